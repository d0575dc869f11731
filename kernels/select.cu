// Copies that rearrange an f32 matrix: column blocks, rank-major blocks, chosen rows.
// Grid-stride loops over the output; any grid size.
#include "common.cuh"

// Columns offset .. offset + len of each block of `block` columns, concatenated: out has
// rows * (cols / block) * len values (unfuse; a column block is one block of `cols`).
extern "C" __global__ void block_columns(float* out, const float* x, i64 rows, i64 cols,
                                         i64 block, i64 offset, i64 len) {
    const i64 blocks = cols / block;
    const i64 out_cols = blocks * len;
    FOR_EACH(i, rows * out_cols) {
        const i64 r = i / out_cols;
        const i64 c = i % out_cols;
        out[i] = x[r * cols + (c / len) * block + offset + c % len];
    }
}

// Columns from..to of each row of x [rows, cols] into up to three outputs side by side (a
// fused product's outputs): a takes columns from..at_b, b at_b..at_c, c at_c..to, each as
// its own [rows, width]. An output past the blocks asked for gets no columns and is never
// written (any pointer will do).
extern "C" __global__ void split_columns(float* a, float* b, float* c, const float* x, i64 rows,
                                         i64 cols, i64 from, i64 at_b, i64 at_c, i64 to) {
    const i64 width = to - from;
    FOR_EACH(i, rows * width) {
        const i64 r = i / width;
        const i64 col = from + i % width;
        const float v = x[r * cols + col];
        if (col < at_b) {
            a[r * (at_b - from) + col - from] = v;
        } else if (col < at_c) {
            b[r * (at_c - at_b) + col - at_b] = v;
        } else {
            c[r * (to - at_c) + col - at_c] = v;
        }
    }
}

// [rows, parts * n] -> rank-major [parts][rows][n].
extern "C" __global__ void rows_to_rank_major(float* out, const float* x, i64 rows, i64 parts,
                                              i64 n) {
    FOR_EACH(i, rows * parts * n) {
        const i64 k = i / (rows * n);
        const i64 r = (i / n) % rows;
        const i64 c = i % n;
        out[i] = x[r * parts * n + k * n + c];
    }
}

// Rank-major [parts][rows][n] -> [rows, keep], the first `keep` of the parts * n columns.
extern "C" __global__ void rank_major_to_rows(float* out, const float* x, i64 rows, i64 n,
                                              i64 keep) {
    FOR_EACH(i, rows * keep) {
        const i64 r = i / keep;
        const i64 j = i % keep;
        out[i] = x[((j / n) * rows + r) * n + j % n];
    }
}

// The first `width` columns of rank-major part `part` ([parts][rows][n]) into columns
// [column, column + width) of out [rows, keep]: one rank's real part of a gather whose
// ranks hold unequal parts.
extern "C" __global__ void rank_major_part_to_rows(float* out, const float* x, i64 rows, i64 n,
                                                   i64 part, i64 width, i64 column, i64 keep) {
    FOR_EACH(i, rows * width) {
        const i64 r = i / width;
        const i64 j = i % width;
        out[r * keep + column + j] = x[(part * rows + r) * n + j];
    }
}

// Row i of out is row index[i] of x, or zeros where index[i] < 0 (padding rows).
extern "C" __global__ void gather_rows(float* out, const float* x, const i64* index, i64 count,
                                       i64 cols) {
    FOR_EACH(i, count * cols) {
        const i64 src = index[i / cols];
        out[i] = src >= 0 ? x[src * cols + i % cols] : 0.0f;
    }
}
