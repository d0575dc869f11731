//! The kernels of `kernels/` that `kernels.rs` beside this file leaves out, run on the CPU
//! (`tests/emulator`) with the launch shapes of the CUDA backend
//! (`src/runtime/cuda/backend.rs`), against plain Rust references: layer norm, rotary
//! embedding, embedding lookup, the elementwise ops, the copies of select.cu, greedy
//! sampling (argmax.cu), the experts' weighted sum (moe.cu) and the one-shot all-reduce
//! sum. Kernels that only move or select values, or do one f32 operation per value, must
//! match bit for bit; the others an f64 reference within a tolerance. Grid-stride kernels
//! also run on a deliberately small grid, so that their loops take several rounds.

use crate::emulator;

use emulator::{assert_close, dims, kernel_file, Arg, Buffers, Dims, Values};

/// A launch's grid and block.
type Shape = (Dims, Dims);

/// Runs `kernel` of `file` (twice, as the emulator does), failing with the emulator's reason.
fn launch(file: &str, kernel: &str, (grid, block): Shape, args: &[Arg], bufs: &mut Buffers) {
    kernel_file(file)
        .launch(kernel, grid, block, args, bufs)
        .unwrap_or_else(|e| panic!("{file}: {e}"));
}

/// The backend's launch over `n` values (`grid_for`: 256 threads, 1 to 4096 blocks), then a
/// small grid whose threads each take several values.
fn stride_shapes(n: usize) -> [Shape; 2] {
    [
        (dims(n.div_ceil(256).clamp(1, 4096) as u32, 1), dims(256, 1)),
        (dims(2, 1), dims(64, 1)),
    ]
}

fn label(kernel: &str, (grid, block): Shape) -> String {
    format!("{kernel} on {} blocks of {}", grid.x, block.x)
}

/// Bit-for-bit equality (NaNs and signed zeros included), naming the first difference.
fn assert_same(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!(
            "{what}: at {i}: got {} ({:#010x}) want {} ({:#010x})",
            got[i],
            got[i].to_bits(),
            want[i],
            want[i].to_bits()
        );
    }
}

/// What an output holds before a launch: a NaN no kernel computes, so a value the kernel
/// skipped shows.
const UNWRITTEN: f32 = f32::from_bits(0x7fc0_dead);

#[test]
fn layer_norm_matches_an_f64_reference() {
    let mut values = Values(7);
    let eps = 1e-5f32;
    // (rows, cols): one column per thread and fewer, strides of several rounds, and rows
    // far from zero mean (the variance must come from centred values).
    for (rows, cols, shift) in [(4usize, 77usize, 0.0f32), (3, 1000, 0.0), (2, 2048, 50.0)] {
        let x: Vec<f32> = values.take(rows * cols).iter().map(|v| v + shift).collect();
        let (w, b) = (values.take(cols), values.take(cols));
        let (w, b) = (&w, &b);
        let want: Vec<f64> = x
            .chunks(cols)
            .flat_map(|row| {
                let mean = row.iter().map(|&v| v as f64).sum::<f64>() / cols as f64;
                let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / cols as f64;
                let inv = 1.0 / (var + eps as f64).sqrt();
                (0..cols).map(move |c| (row[c] as f64 - mean) * inv * w[c] as f64 + b[c] as f64)
            })
            .collect();
        let mut bufs = Buffers::default();
        let out = bufs.f32(&vec![UNWRITTEN; x.len()]);
        let (xb, wb, bb) = (bufs.f32(&x), bufs.f32(w), bufs.f32(b));
        launch(
            "norm.cu",
            "layer_norm",
            (dims(rows as u32, 1), dims(256, 1)),
            &[
                Arg::Buf(out),
                Arg::Buf(xb),
                Arg::Buf(wb),
                Arg::Buf(bb),
                Arg::I64(cols as i64),
                Arg::F32(eps),
            ],
            &mut bufs,
        );
        let what = format!("layer_norm {rows}x{cols} shifted by {shift}");
        assert_close(&what, &bufs.read_f32(out), &want, 2e-5);
    }
}

#[test]
fn rope_rotates_the_first_pairs_of_each_head() {
    let mut values = Values(11);
    // (rows, heads, head_dim, half): full rotary on one warp, partial rotary (half below
    // head_dim / 2, not a multiple of 32), and half above 128 so each thread takes two pairs.
    for (rows, heads, head_dim, half) in [
        (3usize, 4usize, 64usize, 32usize),
        (2, 3, 96, 40),
        (2, 2, 320, 160),
    ] {
        let cols = heads * head_dim;
        let x = values.take(rows * cols);
        let angle: Vec<f32> = values.take(rows * half).iter().map(|a| a * 40.0).collect();
        let cos: Vec<f32> = angle.iter().map(|a| a.cos()).collect();
        let sin: Vec<f32> = angle.iter().map(|a| a.sin()).collect();
        let mut want: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        for r in 0..rows {
            for h in 0..heads {
                let head = r * cols + h * head_dim;
                for i in 0..half {
                    let (a, b) = (x[head + i] as f64, x[head + i + half] as f64);
                    let (c, s) = (cos[r * half + i] as f64, sin[r * half + i] as f64);
                    want[head + i] = a * c - b * s;
                    want[head + i + half] = b * c + a * s;
                }
            }
        }
        let mut bufs = Buffers::default();
        let (xb, cb, sb) = (bufs.f32(&x), bufs.f32(&cos), bufs.f32(&sin));
        let threads = half.next_multiple_of(32).min(128) as u32;
        launch(
            "rope.cu",
            "rope",
            (dims(rows as u32, heads as u32), dims(threads, 1)),
            &[
                Arg::Buf(xb),
                Arg::Buf(cb),
                Arg::Buf(sb),
                Arg::I64(cols as i64),
                Arg::I64(head_dim as i64),
                Arg::I64(half as i64),
            ],
            &mut bufs,
        );
        let got = bufs.read_f32(xb);
        let what = format!("rope heads {heads} of {head_dim}, half {half}");
        assert_close(&what, &got, &want, 1e-6);
        // Past the rotated pairs (partial rotary) each head is left bit for bit.
        for (i, (g, v)) in got.iter().zip(&x).enumerate() {
            if i % head_dim >= 2 * half {
                assert_eq!(g.to_bits(), v.to_bits(), "{what}: the tail at {i} changed");
            }
        }
    }
}

/// This rank's slice of an embedding table, `rows` of the vocabulary from `offset`.
const EMBED_ROWS: usize = 6;
const EMBED_OFFSET: i64 = 12;
/// Ids of this rank's slice (both ends) and of others' (just outside it, negative, far).
const EMBED_IDS: &[i64] = &[12, 17, 11, 18, -1, 14, 0, 17, 1000, 13];

/// Runs an embedding kernel over `table` (bit patterns of its elements) with the backend's
/// launch; asserts each output row is its table row, widened by `widen`, or zeros.
fn check_embedding(
    kernel: &str,
    cols: usize,
    table: Arg,
    bufs: &mut Buffers,
    widen: &dyn Fn(usize) -> u32,
) {
    let ids = bufs.i64(EMBED_IDS);
    let out = bufs.f32(&vec![UNWRITTEN; EMBED_IDS.len() * cols]);
    launch(
        "embedding.cu",
        kernel,
        (dims(EMBED_IDS.len() as u32, 1), dims(256, 1)),
        &[
            Arg::Buf(out),
            table,
            Arg::Buf(ids),
            Arg::I64(EMBED_ROWS as i64),
            Arg::I64(cols as i64),
            Arg::I64(EMBED_OFFSET),
        ],
        bufs,
    );
    let want: Vec<f32> = EMBED_IDS
        .iter()
        .flat_map(|&id| {
            let local = (EMBED_OFFSET..EMBED_OFFSET + EMBED_ROWS as i64).contains(&id);
            let row = (id - EMBED_OFFSET) as usize;
            (0..cols).map(move |c| {
                if local {
                    f32::from_bits(widen(row * cols + c))
                } else {
                    0.0
                }
            })
        })
        .collect();
    assert_same(
        &format!("{kernel} of {cols} columns"),
        &bufs.read_f32(out),
        &want,
    );
}

#[test]
fn embeddings_copy_this_ranks_rows_and_zero_the_others() {
    let mut values = Values(13);
    // Fewer columns than threads, and more (each thread takes two).
    for cols in [5usize, 300] {
        let n = EMBED_ROWS * cols;
        let table = values.take(n);
        let mut bufs = Buffers::default();
        let t = bufs.f32(&table);
        check_embedding("embedding_f32", cols, Arg::Buf(t), &mut bufs, &|i| {
            table[i].to_bits()
        });

        // Any bit pattern, NaNs and infinities included: the kernel only widens it.
        let bits: Vec<u16> = (0..n).map(|_| values.bits() as u16).collect();
        let mut bufs = Buffers::default();
        let t = bufs.bf16(&bits);
        check_embedding("embedding_bf16", cols, Arg::Buf(t), &mut bufs, &|i| {
            (bits[i] as u32) << 16
        });
    }
}

/// Runs an in-place elementwise kernel of elementwise.cu on `x` (arguments: x, then `y` if
/// any, then n, then `more`) with each of `stride_shapes`; the result of each, labelled.
fn elementwise(
    kernel: &str,
    x: &[f32],
    y: Option<&[f32]>,
    more: &[Arg],
) -> Vec<(String, Vec<f32>)> {
    stride_shapes(x.len())
        .into_iter()
        .map(|shape| {
            let mut bufs = Buffers::default();
            let xb = bufs.f32(x);
            let mut args = vec![Arg::Buf(xb)];
            args.extend(y.map(|y| Arg::Buf(bufs.f32(y))));
            args.push(Arg::I64(x.len() as i64));
            args.extend_from_slice(more);
            launch("elementwise.cu", kernel, shape, &args, &mut bufs);
            (label(kernel, shape), bufs.read_f32(xb))
        })
        .collect()
}

/// Elementwise sizes: several blocks, the last one partial.
const ROWS: usize = 13;
const COLS: usize = 77;

#[test]
fn binary_elementwise_ops_match_f32_bit_for_bit() {
    let mut values = Values(17);
    let n = ROWS * COLS;
    let (x, y) = (values.take(n), values.take(n));
    let bias = values.take(COLS);
    let checks = [
        (
            "bias_add",
            &bias,
            vec![Arg::I64(COLS as i64)],
            (0..n).map(|i| x[i] + bias[i % COLS]).collect::<Vec<f32>>(),
        ),
        ("add", &y, vec![], (0..n).map(|i| x[i] + y[i]).collect()),
        ("mul", &y, vec![], (0..n).map(|i| x[i] * y[i]).collect()),
    ];
    for (kernel, other, more, want) in checks {
        for (what, got) in elementwise(kernel, &x, Some(other), &more) {
            assert_same(&what, &got, &want);
        }
    }
}

#[test]
fn activations_match_an_f64_reference() {
    let mut values = Values(19);
    // Mostly where the curves bend, plus saturated tails and zero.
    let mut x: Vec<f32> = values.take(ROWS * COLS).iter().map(|v| v * 8.0).collect();
    x.extend([0.0, -0.0, 30.0, -30.0, 100.0, -100.0]);
    let sqrt_2_over_pi = (2.0 / std::f64::consts::PI).sqrt();
    let references: [(&str, &dyn Fn(f64) -> f64); 3] = [
        ("silu", &|v| v / (1.0 + (-v).exp())),
        ("gelu_tanh", &|v| {
            0.5 * v * (1.0 + (sqrt_2_over_pi * (v + 0.044715 * v * v * v)).tanh())
        }),
        ("gelu_erf", &|v| {
            0.5 * v * (1.0 + libm::erf(v / 2f64.sqrt()))
        }),
    ];
    for (kernel, f) in references {
        let want: Vec<f64> = x.iter().map(|&v| f(v as f64)).collect();
        for (what, got) in elementwise(kernel, &x, None, &[]) {
            assert_close(&what, &got, &want, 1e-6);
        }
    }
    let want: Vec<f32> = x.iter().map(|&v| if v > 0.0 { v } else { 0.0 }).collect();
    for (what, got) in elementwise("relu", &x, None, &[]) {
        // Compared as values: either zero's sign will do.
        if let Some(i) = got.iter().zip(&want).position(|(g, w)| g != w) {
            panic!("{what}: at {i}: relu({}) gave {}", x[i], got[i]);
        }
    }
}

#[test]
fn round_to_bf16_rounds_to_nearest_even() {
    let mut values = Values(23);
    let special: [u32; 16] = [
        0x7fc0_0000, // quiet NaN
        0xffc1_2345, // negative NaN with a payload
        0x7f80_0001, // signalling NaN, its payload only in bits the rounding drops
        0x7f80_0000, // +inf
        0xff80_0000, // -inf
        0x7f7f_ffff, // the largest f32: rounds up to +inf
        0xff7f_8000, // a tie at the largest bf16, odd: rounds away to -inf
        0x3f80_8000, // a tie above an even bf16: down to it
        0x3f81_8000, // a tie above an odd bf16: up to the even one
        0x3f80_8001, // just above a tie: up
        0x3f81_7fff, // just below a tie: down
        0x0000_0000,
        0x8000_0000,
        0x0000_0001, // the smallest subnormal: rounds to zero
        0x007f_ffff, // the largest subnormal: rounds up to the smallest normal
        0x807f_8000, // a subnormal tie
    ];
    // An odd count: the output's last word is half padding, which must stay as it was.
    let bits: Vec<u32> = special
        .into_iter()
        .chain((0..1001).map(|_| values.bits() as u32))
        .collect();
    let x: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
    let n = x.len();
    assert_eq!(n % 2, 1);
    let mut want: Vec<u16> = x
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_bits())
        .collect();
    want.push(0);
    for shape in stride_shapes(n) {
        let mut bufs = Buffers::default();
        let out = bufs.bf16(&vec![0u16; n]);
        let xb = bufs.f32(&x);
        let args = [Arg::Buf(out), Arg::Buf(xb), Arg::I64(n as i64)];
        launch("elementwise.cu", "round_to_bf16", shape, &args, &mut bufs);
        let got = bufs.read_u16(out);
        if let Some(i) = got.iter().zip(&want).position(|(g, w)| g != w) {
            panic!(
                "{}: at {i} ({:#010x}): got {:#06x} want {:#06x}",
                label("round_to_bf16", shape),
                bits.get(i).copied().unwrap_or(0),
                got[i],
                want[i]
            );
        }
    }
}

/// Runs a copy kernel of select.cu, (out, x, then `index` if any, then `ints`), into an
/// output of `want.len()` values with each of `stride_shapes`; it must equal `want`.
fn check_copy(kernel: &str, x: &[f32], index: Option<&[i64]>, ints: &[i64], want: &[f32]) {
    for shape in stride_shapes(want.len()) {
        let mut bufs = Buffers::default();
        let out = bufs.f32(&vec![UNWRITTEN; want.len()]);
        let mut args = vec![Arg::Buf(out), Arg::Buf(bufs.f32(x))];
        args.extend(index.map(|i| Arg::Buf(bufs.i64(i))));
        args.extend(ints.iter().map(|&v| Arg::I64(v)));
        launch("select.cu", kernel, shape, &args, &mut bufs);
        assert_same(
            &format!("{} {ints:?}", label(kernel, shape)),
            &bufs.read_f32(out),
            want,
        );
    }
}

#[test]
fn block_columns_takes_each_blocks_slice() {
    let mut values = Values(29);
    // (rows, cols, block, offset, len): a slice of each of 3 fused blocks (unfuse), one
    // rank's column block (one block of all the columns), and the whole matrix.
    for (rows, cols, block, offset, len) in [
        (5usize, 120usize, 40usize, 8usize, 20usize),
        (6, 96, 96, 32, 32),
        (3, 50, 10, 0, 10),
    ] {
        let x = values.take(rows * cols);
        let want: Vec<f32> = (0..rows)
            .flat_map(|r| (0..cols / block).map(move |b| r * cols + b * block + offset))
            .flat_map(|start| x[start..start + len].to_vec())
            .collect();
        let ints = [rows, cols, block, offset, len].map(|v| v as i64);
        check_copy("block_columns", &x, None, &ints, &want);
    }
}

#[test]
fn split_columns_gives_each_output_its_block() {
    let mut values = Values(31);
    // (rows, cols, from, at_b, at_c, to): q|k|v from the first column, k|v after a first
    // block kept in place (a decode step), gate|up's up alone, and blocks of one column.
    for (rows, cols, from, at_b, at_c, to) in [
        (5usize, 48usize, 0usize, 32usize, 40usize, 48usize),
        (1, 48, 32, 40, 48, 48),
        (1, 64, 32, 64, 64, 64),
        (3, 3, 0, 1, 2, 3),
    ] {
        let x = values.take(rows * cols);
        let block = |a: usize, b: usize| -> Vec<f32> {
            (0..rows)
                .flat_map(|r| x[r * cols + a..r * cols + b].to_vec())
                .collect()
        };
        let want = [block(from, at_b), block(at_b, at_c), block(at_c, to)];
        for shape in stride_shapes(rows * (to - from)) {
            let mut bufs = Buffers::default();
            // Outputs without columns get the input, as the backend passes it.
            let input = bufs.f32(&x);
            let outs: Vec<_> = want
                .iter()
                .map(|w| {
                    if w.is_empty() {
                        input
                    } else {
                        bufs.f32(&vec![UNWRITTEN; w.len()])
                    }
                })
                .collect();
            let mut args: Vec<Arg> = outs.iter().map(|&o| Arg::Buf(o)).collect();
            args.push(Arg::Buf(input));
            args.extend([rows, cols, from, at_b, at_c, to].map(|v| Arg::I64(v as i64)));
            launch("select.cu", "split_columns", shape, &args, &mut bufs);
            let what = format!(
                "{} {rows}x{cols} {from}..{at_b}..{at_c}..{to}",
                label("split_columns", shape)
            );
            for (k, (o, w)) in outs.iter().zip(&want).enumerate() {
                if !w.is_empty() {
                    assert_same(&format!("{what}: output {k}"), &bufs.read_f32(*o), w);
                }
            }
            assert_same(&format!("{what}: input"), &bufs.read_f32(input), &x);
        }
    }
}

#[test]
fn rank_major_layouts_round_trip() {
    let mut values = Values(31);
    let (rows, parts, n) = (7usize, 3usize, 50usize);
    let x = values.take(rows * parts * n);
    // [rows, parts * n] -> [parts][rows][n]
    let major: Vec<f32> = (0..parts)
        .flat_map(|k| (0..rows).map(move |r| r * parts * n + k * n))
        .flat_map(|start| x[start..start + n].to_vec())
        .collect();
    let ints = [rows, parts, n].map(|v| v as i64);
    check_copy("rows_to_rank_major", &x, None, &ints, &major);
    // Back, all the columns or only the first `keep` (not a whole number of parts).
    for keep in [parts * n, 2 * n + 13] {
        let want: Vec<f32> = (0..rows)
            .flat_map(|r| x[r * parts * n..r * parts * n + keep].to_vec())
            .collect();
        let ints = [rows, n, keep].map(|v| v as i64);
        check_copy("rank_major_to_rows", &major, None, &ints, &want);
    }
}

#[test]
fn rank_major_part_lands_in_its_columns_only() {
    let mut values = Values(41);
    // Unequal real widths of parts of 9 columns (shares): one part's real columns, joined
    // at their column offset; the other columns are the other launches'.
    let (rows, n, widths) = (5usize, 9usize, [9usize, 4, 0, 6]);
    let keep: usize = widths.iter().sum();
    let major = values.take(widths.len() * rows * n);
    let mut column = 0;
    for (part, &width) in widths.iter().enumerate() {
        if width == 0 {
            continue;
        }
        let mut want = vec![UNWRITTEN; rows * keep];
        for r in 0..rows {
            let from = (part * rows + r) * n;
            want[r * keep + column..r * keep + column + width]
                .copy_from_slice(&major[from..from + width]);
        }
        let ints = [rows, n, part, width, column, keep].map(|v| v as i64);
        check_copy("rank_major_part_to_rows", &major, None, &ints, &want);
        column += width;
    }
}

#[test]
fn gather_rows_pads_with_zero_rows() {
    let mut values = Values(37);
    let (rows, cols) = (6usize, 70usize);
    let x = values.take(rows * cols);
    // Repeats, out of order, and -1 padding, first and last too.
    let index: [i64; 9] = [-1, 3, 0, 5, 5, -1, 2, 4, -1];
    let want: Vec<f32> = index
        .iter()
        .flat_map(|&i| match usize::try_from(i) {
            Ok(r) => x[r * cols..(r + 1) * cols].to_vec(),
            Err(_) => vec![0.0; cols],
        })
        .collect();
    let ints = [index.len(), cols].map(|v| v as i64);
    check_copy("gather_rows", &x, Some(&index), &ints, &want);
}

/// The experts' weighted sum (moe.cu) as the backend launches it, one launch per part into
/// one zeroed output, against the CPU backend's loop, bit for bit: rows chosen by two and
/// three parts, an empty part (a launch over no rows writes nothing), a row left to another
/// launch (-1), and a sum that another order of the parts would round differently.
#[test]
fn weighted_rows_add_adds_each_part_in_order() {
    let mut values = Values(59);
    let (rows, cols) = (7usize, 45usize);
    // Row 2: a small value, then a large one and its negation (parts 2 and 3), so that the
    // sum is the small value rounded to the large one's step, and in another order exact.
    let parts: [(&[i64], f32); 4] = [
        (&[0, 2, 5], 1e-3),
        (&[], 1.0),
        (&[5, 2, 6, 1], 3e4),
        (&[-1, 2, 3], 1.0),
    ];
    let mut ys: Vec<Vec<f32>> = parts
        .iter()
        .map(|(at, scale)| {
            values
                .take(at.len() * cols)
                .iter()
                .map(|v| v * scale)
                .collect()
        })
        .collect();
    let mut ws: Vec<Vec<f32>> = parts.iter().map(|(at, _)| values.take(at.len())).collect();
    let large: Vec<f32> = ys[2][cols..2 * cols].iter().map(|v| -v).collect();
    ys[3][cols..2 * cols].copy_from_slice(&large);
    ws[3][1] = ws[2][1];
    let sum = |order: &mut dyn Iterator<Item = usize>| {
        let mut out = vec![0f32; rows * cols];
        for k in order {
            for (j, &r) in parts[k].0.iter().enumerate() {
                let Ok(r) = usize::try_from(r) else { continue };
                for c in 0..cols {
                    out[r * cols + c] += ws[k][j] * ys[k][j * cols + c];
                }
            }
        }
        out
    };
    let want = sum(&mut (0..parts.len()));
    let reversed = sum(&mut (0..parts.len()).rev());
    assert_ne!(want, reversed, "data whose sum is the same in any order");
    for s in 0..2 {
        let mut bufs = Buffers::default();
        let out = bufs.f32(&vec![0.0; rows * cols]);
        let mut what = String::new();
        for (((at, _), y), w) in parts.iter().zip(&ys).zip(&ws) {
            let shape = stride_shapes(at.len() * cols)[s];
            let args = [
                Arg::Buf(out),
                Arg::Buf(bufs.f32(y)),
                Arg::Buf(bufs.i64(at)),
                Arg::Buf(bufs.f32(w)),
                Arg::I64(at.len() as i64),
                Arg::I64(cols as i64),
            ];
            launch("moe.cu", "weighted_rows_add", shape, &args, &mut bufs);
            what.push_str(&format!("{}; ", label("weighted_rows_add", shape)));
        }
        assert_same(&what, &bufs.read_f32(out), &want);
    }
}

/// argmax_pairs' contract for one row: (NaN, 0) when marking and any column is not finite;
/// else the largest of the first `valid` columns, the first of equal ones, its index plus
/// `offset`; (-inf, -1) with no valid column.
fn argmax_reference(row: &[f32], valid: usize, offset: usize, mark: bool) -> [f32; 2] {
    if mark && row.iter().any(|v| !v.is_finite()) {
        return [f32::NAN, 0.0];
    }
    let mut best: Option<(f32, usize)> = None;
    for (i, &v) in row[..valid].iter().enumerate() {
        if best.is_none_or(|(b, _)| v > b) {
            best = Some((v, i));
        }
    }
    best.map_or([f32::NEG_INFINITY, -1.0], |(v, i)| [v, (i + offset) as f32])
}

/// Rows of `cols` values for argmax_pairs, each a case of its contract (the valid columns
/// are the first 650 or fewer).
fn argmax_rows(cols: usize, values: &mut Values) -> Vec<Vec<f32>> {
    let with = |at: &[(usize, f32)], values: &mut Values| {
        let mut row = values.take(cols);
        for &(c, v) in at {
            row[c] = v;
        }
        row
    };
    vec![
        values.take(cols),
        // Ties: the lowest index sits in a later thread (250) and warp than another (260).
        with(&[(260, 2.0), (600, 2.0), (250, 2.0)], values),
        // Ties in one thread's successive columns (5, 261, 517) and another's (37).
        with(&[(517, 2.0), (37, 2.0), (261, 2.0), (5, 2.0)], values),
        vec![0.5; cols],
        // The largest value past the valid columns.
        with(&[(680, 5.0)], values),
        // Not finite, past the valid columns only (with all columns valid and no marking,
        // the NaN is simply never larger).
        with(&[(690, f32::NAN)], values),
        with(&[(660, f32::INFINITY), (670, f32::NEG_INFINITY)], values),
        // +inf is the largest value when not marking.
        with(&[(100, f32::INFINITY)], values),
        // Nothing but -inf: a real index still beats none.
        vec![f32::NEG_INFINITY; cols],
    ]
}

#[test]
fn argmax_pairs_picks_the_first_largest_value() {
    let mut values = Values(41);
    let (cols, offset) = (700usize, 1000usize);
    let rows = argmax_rows(cols, &mut values);
    let x: Vec<f32> = rows.concat();
    for valid in [cols, 650, 0] {
        for mark in [false, true] {
            let want: Vec<f32> = rows
                .iter()
                .flat_map(|row| argmax_reference(row, valid, offset, mark))
                .collect();
            // The backend's 256 threads, and fewer: 2 warps, each thread taking 11 columns.
            for threads in [256, 64] {
                let mut bufs = Buffers::default();
                let out = bufs.f32(&vec![UNWRITTEN; rows.len() * 2]);
                let xb = bufs.f32(&x);
                let shape = (dims(rows.len() as u32, 1), dims(threads, 1));
                let args = [
                    Arg::Buf(out),
                    Arg::Buf(xb),
                    Arg::I64(cols as i64),
                    Arg::I64(valid as i64),
                    Arg::I64(offset as i64),
                    Arg::I32(mark as i32),
                ];
                launch("argmax.cu", "argmax_pairs", shape, &args, &mut bufs);
                let what = format!("argmax_pairs valid {valid} mark {mark} threads {threads}");
                assert_same(&what, &bufs.read_f32(out), &want);
            }
        }
    }
}

#[test]
fn best_of_pairs_keeps_the_first_best_part() {
    let mut values = Values(43);
    let (parts, rows) = (3usize, 300usize);
    let none = [f32::NEG_INFINITY, -1.0];
    // Rank-major [parts][rows][2]: part p's row r holds (value, index) from vocabulary slice
    // p (indices p * 100 ..), or none; few distinct values, so ties across parts are common.
    let mut pairs = vec![0.0f32; parts * rows * 2];
    for p in 0..parts {
        for r in 0..rows {
            let pair = match values.below(8) {
                0 => none,
                1 if values.below(8) == 0 => [f32::NAN, 0.0],
                2 => [f32::NEG_INFINITY, (p * 100 + values.below(100)) as f32],
                k => [k as f32 / 2.0, (p * 100 + values.below(100)) as f32],
            };
            pairs[(p * rows + r) * 2..][..2].copy_from_slice(&pair);
        }
    }
    // Rows where every part has none.
    for p in 0..parts {
        pairs[(p * rows + 7) * 2..][..2].copy_from_slice(&none);
    }
    let want: Vec<f32> = (0..rows)
        .flat_map(|r| {
            let part = |p: usize| [pairs[(p * rows + r) * 2], pairs[(p * rows + r) * 2 + 1]];
            if (0..parts).any(|p| part(p)[0].is_nan()) {
                return [f32::NAN, 0.0];
            }
            // The largest value among real indices; on ties the first part's (the lowest).
            (0..parts)
                .map(part)
                .filter(|q| q[1] >= 0.0)
                .fold(none, |best, q| {
                    if best[1] < 0.0 || q[0] > best[0] {
                        q
                    } else {
                        best
                    }
                })
        })
        .collect();
    assert!(want.chunks(2).any(|q| q[0].is_nan()), "no NaN row to test");
    for shape in stride_shapes(rows) {
        let mut bufs = Buffers::default();
        let out = bufs.f32(&vec![UNWRITTEN; rows * 2]);
        let pb = bufs.f32(&pairs);
        let args = [
            Arg::Buf(out),
            Arg::Buf(pb),
            Arg::I64(rows as i64),
            Arg::I64(parts as i64),
        ];
        launch("argmax.cu", "best_of_pairs", shape, &args, &mut bufs);
        assert_same(&label("best_of_pairs", shape), &bufs.read_f32(out), &want);
    }
}

/// (row, column, value) entries of a matrix.
type Entries = &'static [(usize, usize, f32)];

#[test]
fn first_non_finite_row_finds_the_lowest() {
    let mut values = Values(47);
    let (rows, cols) = (40usize, 37usize);
    let x = values.take(rows * cols);
    // The non-finite entries, and the row expected.
    let cases: [(Entries, u64); 4] = [
        (&[], u64::MAX),
        (
            &[
                (30, 3, f32::INFINITY),
                (12, 36, f32::NAN),
                (25, 0, f32::NEG_INFINITY),
            ],
            12,
        ),
        (&[(39, 36, f32::NAN)], 39),
        (
            &[(17, 5, f32::INFINITY), (0, 0, f32::NAN), (1, 1, f32::NAN)],
            0,
        ),
    ];
    for (bad, want) in cases {
        let mut x = x.clone();
        for &(r, c, v) in bad {
            x[r * cols + c] = v;
        }
        for shape in stride_shapes(rows * cols) {
            let mut bufs = Buffers::default();
            let first = bufs.u64(&[u64::MAX]);
            let xb = bufs.f32(&x);
            let args = [
                Arg::Buf(first),
                Arg::Buf(xb),
                Arg::I64(rows as i64),
                Arg::I64(cols as i64),
            ];
            launch("argmax.cu", "first_non_finite_row", shape, &args, &mut bufs);
            let what = format!("{} with {bad:?}", label("first_non_finite_row", shape));
            assert_eq!(bufs.read_u64(first), [want], "{what}");
        }
    }
}

/// Elementwise f32 sums, taking the parts in the given order.
fn f32_sum<'a>(mut parts: impl Iterator<Item = &'a Vec<f32>>) -> Vec<f32> {
    let first = parts.next().expect("a part").clone();
    parts.fold(first, |acc, p| {
        acc.iter().zip(p).map(|(a, b)| a + b).collect()
    })
}

#[test]
fn sum_ranks_adds_in_rank_order() {
    let mut values = Values(53);
    let n = 1000usize;
    // Magnitudes far apart, so that f32 sums in another order round differently.
    let scales = [1.0f32, 3e4, 1e-3, -3e4, 7.0, 1e-4, -2.0, 5e3];
    let inputs: Vec<Vec<f32>> = scales
        .iter()
        .map(|&s| values.take(n).iter().map(|v| v * s).collect())
        .collect();
    for ranks in 1..=8 {
        let want = f32_sum(inputs[..ranks].iter());
        if ranks > 2 {
            let reversed = f32_sum(inputs[..ranks].iter().rev());
            assert_ne!(want, reversed, "data whose sum is the same in any order");
        }
        for shape in stride_shapes(n) {
            let mut bufs = Buffers::default();
            let out = bufs.f32(&vec![UNWRITTEN; n]);
            let mut args = vec![Arg::Buf(out)];
            // Unused ranks' pointers are null, as the backend passes them.
            args.extend((0..8).map(|r| {
                if r < ranks {
                    Arg::Buf(bufs.f32(&inputs[r]))
                } else {
                    Arg::Null
                }
            }));
            args.extend([Arg::I32(ranks as i32), Arg::I64(n as i64)]);
            launch("allreduce.cu", "sum_ranks", shape, &args, &mut bufs);
            let what = format!("{} of {ranks} ranks", label("sum_ranks", shape));
            assert_same(&what, &bufs.read_f32(out), &want);
        }
    }
}
