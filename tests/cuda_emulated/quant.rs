//! The quantized-weight kernels of `kernels/quant.cu` on the CPU (`tests/emulator`), with
//! the CUDA backend's launch shapes, against f64 products of the weights they encode: the
//! decode GEMVs over FP8 / INT8 and INT4 panels, the widening of panels to bf16 or f32 rows
//! for cuBLAS, the act-order permutation of activations, and what cuBLASLt's FP8 products
//! take: activations quantized to e4m3 per row in blocks of 128, and codes as plain rows.
//! The panels are built here from the layout `quant.cu` states, which is the CPU backend's
//! (`src/runtime/cpu/packed/`).

use crate::emulator;

use emulator::{dims, kernel_file, Arg, Buffers, Values};
use tpc::runtime::weights::e4m3_to_f32;

const PANEL: usize = 16;
/// Threads of a GEMV block (`32 * GEMV_WARPS` in quant.cu) and its most rows.
const GEMV_THREADS: u32 = 256;
const GEMV_ROWS: usize = 8;

fn launch(kernel: &str, grid: u32, block: u32, args: &[Arg], bufs: &mut Buffers) {
    kernel_file("quant.cu")
        .launch(kernel, dims(grid, 1), dims(block, 1), args, bufs)
        .unwrap_or_else(|e| panic!("quant.cu: {kernel} on {grid} blocks of {block}: {e}"));
}

/// A weight `[n][k]` as quantized codes with their panels: `values[j * k + p]` is what the
/// panels encode.
struct Quantized {
    n: usize,
    k: usize,
    kblock: usize,
    codes: Vec<u8>,
    scales: Vec<f32>,
    zeros: Vec<f32>,
    values: Vec<f64>,
}

fn grid_len(k: usize, kblock: usize) -> usize {
    k.div_ceil(kblock) * PANEL
}

/// FP8 (`e4m3`) or INT8 codes, random (no NaN code), with random positive scales.
fn byte_codes(n: usize, k: usize, kblock: usize, e4m3: bool, v: &mut Values) -> Quantized {
    let panels = n.div_ceil(PANEL);
    let mut codes = vec![0u8; panels * k * PANEL];
    let scales: Vec<f32> = (0..panels * grid_len(k, kblock))
        .map(|_| 0.01 + v.next().abs())
        .collect();
    let mut values = vec![0f64; n * k];
    for j in 0..n {
        let (q, jj) = (j / PANEL, j % PANEL);
        for p in 0..k {
            let b = loop {
                let b = v.below(256) as u8;
                if !(e4m3 && b & 0x7f == 0x7f) {
                    break b;
                }
            };
            codes[(q * k + p) * PANEL + jj] = b;
            let code = if e4m3 {
                e4m3_to_f32(b) as f64
            } else {
                b as i8 as f64
            };
            let s = scales[q * grid_len(k, kblock) + p / kblock * PANEL + jj] as f64;
            values[j * k + p] = code * s;
        }
    }
    Quantized {
        n,
        k,
        kblock,
        codes,
        scales,
        zeros: Vec::new(),
        values,
    }
}

/// INT4 codes (k and kblock multiples of 4) with random scales and zero points.
fn int4_codes(n: usize, k: usize, kblock: usize, v: &mut Values) -> Quantized {
    let panels = n.div_ceil(PANEL);
    let mut codes = vec![0u8; panels * k / 2 * PANEL];
    let grid = panels * grid_len(k, kblock);
    let scales: Vec<f32> = (0..grid).map(|_| 0.01 + v.next().abs()).collect();
    let zeros: Vec<f32> = (0..grid).map(|_| v.below(16) as f32).collect();
    let mut values = vec![0f64; n * k];
    for j in 0..n {
        let (q, jj) = (j / PANEL, j % PANEL);
        for p in 0..k {
            let code = v.below(16) as u8;
            let at = q * k / 2 * PANEL + p / 4 * 32 + (jj % 8) * 4 + p % 4;
            codes[at] |= code << (4 * (jj / 8));
            let g = q * grid_len(k, kblock) + p / kblock * PANEL + jj;
            values[j * k + p] = (code as f64 - zeros[g] as f64) * scales[g] as f64;
        }
    }
    Quantized {
        n,
        k,
        kblock,
        codes,
        scales,
        zeros,
        values,
    }
}

/// `x [rows][k] · Wᵀ` in f64, and each output's sum of |terms| (what its rounding error
/// scales with).
fn product(w: &Quantized, x: &[f32], rows: usize) -> (Vec<f64>, Vec<f64>) {
    let mut out = vec![0f64; rows * w.n];
    let mut size = vec![0f64; rows * w.n];
    for r in 0..rows {
        for j in 0..w.n {
            for p in 0..w.k {
                let t = x[r * w.k + p] as f64 * w.values[j * w.k + p];
                out[r * w.n + j] += t;
                size[r * w.n + j] += t.abs();
            }
        }
    }
    (out, size)
}

/// Each output within f32 rounding of its terms' sum: `|got - want| <= 2⁻²² √k Σ|terms|`
/// (f32 sums of `k` rounded products, in another order than the reference's).
fn assert_product(what: &str, got: &[f32], (want, size): &(Vec<f64>, Vec<f64>), k: usize) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = (k as f64).sqrt().max(2.0) / (1u64 << 22) as f64;
    for (i, ((&g, &w), &s)) in got.iter().zip(want).zip(size).enumerate() {
        let e = (g as f64 - w).abs();
        assert!(
            e <= scale * s,
            "{what}: error {e:.3e} > {:.3e} at {i}: got {g} want {w}",
            scale * s
        );
    }
}

/// Runs the GEMV for `rows` rows of `w` (`int4`: gemv_int4, else gemv_codes with `e4m3`).
fn gemv(w: &Quantized, x: &[f32], rows: usize, int4: bool, e4m3: bool) -> Vec<f32> {
    let mut bufs = Buffers::default();
    let out = bufs.f32(&vec![f32::NAN; rows * w.n]);
    let xs = bufs.f32(x);
    let codes = bufs.bytes(&w.codes);
    let scales = bufs.f32(&w.scales);
    let (n, k, kblock) = (w.n as i64, w.k as i64, w.kblock as i64);
    let panels = w.n.div_ceil(PANEL) as u32;
    if int4 {
        let zeros = bufs.f32(&w.zeros);
        let args = [
            Arg::Buf(out),
            Arg::Buf(xs),
            Arg::Buf(codes),
            Arg::Buf(scales),
            Arg::Buf(zeros),
            Arg::I64(rows as i64),
            Arg::I64(n),
            Arg::I64(k),
            Arg::I64(kblock),
        ];
        launch("gemv_int4", panels, GEMV_THREADS, &args, &mut bufs);
    } else {
        let args = [
            Arg::Buf(out),
            Arg::Buf(xs),
            Arg::Buf(codes),
            Arg::Buf(scales),
            Arg::I64(rows as i64),
            Arg::I64(n),
            Arg::I64(k),
            Arg::I64(kblock),
            Arg::I32(e4m3 as i32),
        ];
        launch("gemv_codes", panels, GEMV_THREADS, &args, &mut bufs);
    }
    bufs.read_f32(out)
}

#[test]
fn gemv_over_byte_codes_matches_an_f64_product() {
    let mut v = Values(71);
    // (n, k, kblock): a partial last panel, a depth that is no multiple of the warp's 8
    // steps, a short last scale block, per-channel scales (kblock = k), steps fewer than
    // the block's lanes.
    for &(n, k, kblock) in &[
        (16, 64, 64),
        (37, 100, 32),
        (40, 300, 128),
        (3, 5, 5),
        (64, 1030, 1030),
    ] {
        for e4m3 in [true, false] {
            let w = byte_codes(n, k, kblock, e4m3, &mut v);
            for rows in [1, 3, GEMV_ROWS] {
                let x = v.take(rows * k);
                let got = gemv(&w, &x, rows, false, e4m3);
                let what =
                    format!("gemv_codes n={n} k={k} kblock={kblock} e4m3={e4m3} rows={rows}");
                assert_product(&what, &got, &product(&w, &x, rows), k);
            }
        }
    }
}

#[test]
fn gemv_over_int4_codes_matches_an_f64_product() {
    let mut v = Values(73);
    for &(n, k, kblock) in &[(16, 64, 32), (37, 100, 20), (40, 1032, 128), (8, 4, 4)] {
        let w = int4_codes(n, k, kblock, &mut v);
        for rows in [1, 2, GEMV_ROWS] {
            let x = v.take(rows * k);
            let got = gemv(&w, &x, rows, true, false);
            let what = format!("gemv_int4 n={n} k={k} kblock={kblock} rows={rows}");
            assert_product(&what, &got, &product(&w, &x, rows), k);
        }
    }
}

/// bf16 bits of `v`, rounded to nearest even.
fn bf16_bits(v: f32) -> u16 {
    let b = v.to_bits();
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

#[test]
fn panels_widen_to_their_values_in_f32_and_bf16() {
    let mut v = Values(79);
    let cases = [
        ("codes", byte_codes(37, 100, 32, true, &mut v), 1),
        ("codes", byte_codes(20, 9, 9, false, &mut v), 0),
        ("int4", int4_codes(37, 100, 20, &mut v), 0),
    ];
    for (kind, w, e4m3) in &cases {
        let (n, k, kblock) = (w.n as i64, w.k as i64, w.kblock as i64);
        let len = w.n * w.k;
        // Each value is one f32 product (code times scale, or code minus zero times scale):
        // the f32 results must equal the f64 values rounded to f32 once.
        let want: Vec<f32> = w.values.iter().map(|&x| x as f32).collect();
        for (grid, block) in [(len.div_ceil(256).clamp(1, 4096) as u32, 256), (2, 64)] {
            for bf16 in [false, true] {
                let mut bufs = Buffers::default();
                let out = if bf16 {
                    bufs.bf16(&vec![0xffff; len])
                } else {
                    bufs.f32(&vec![f32::NAN; len])
                };
                let codes = bufs.bytes(&w.codes);
                let scales = bufs.f32(&w.scales);
                let mut args = vec![Arg::Buf(out), Arg::Buf(codes), Arg::Buf(scales)];
                if *kind == "int4" {
                    args.push(Arg::Buf(bufs.f32(&w.zeros)));
                }
                args.extend([Arg::I64(n), Arg::I64(k), Arg::I64(kblock)]);
                if *kind == "codes" {
                    args.push(Arg::I32(*e4m3));
                }
                let name = format!("{kind}_to_{}", if bf16 { "bf16" } else { "f32" });
                launch(&name, grid, block, &args, &mut bufs);
                if bf16 {
                    let got = &bufs.read_u16(out)[..len];
                    let expect: Vec<u16> = want.iter().map(|&x| bf16_bits(x)).collect();
                    assert_eq!(got, &expect[..], "{name} n={n} k={k}");
                } else {
                    let got = bufs.read_f32(out);
                    let same = got
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{name} n={n} k={k}: {got:?} against {want:?}");
                }
            }
        }
    }
}

#[test]
fn act_order_permutes_steps_and_zeros_padding_slots() {
    let mut v = Values(83);
    let (rows, inputs) = (3usize, 10usize);
    let order: Vec<u32> = vec![4, 0, 9, u32::MAX, 2, 1, 3, 5, u32::MAX, 6, 7, 8];
    let x = v.take(rows * inputs);
    let want: Vec<f32> = (0..rows)
        .flat_map(|r| {
            let x = &x;
            order.iter().map(move |&s| {
                if s == u32::MAX {
                    0.0
                } else {
                    x[r * inputs + s as usize]
                }
            })
        })
        .collect();
    for (grid, block) in [(1, 256), (2, 32)] {
        let mut bufs = Buffers::default();
        let out = bufs.f32(&vec![f32::NAN; rows * order.len()]);
        let args = [
            Arg::Buf(out),
            Arg::Buf(bufs.f32(&x)),
            Arg::Buf(bufs.u32(&order)),
            Arg::I64(rows as i64),
            Arg::I64(inputs as i64),
            Arg::I64(order.len() as i64),
        ];
        launch("permute_steps", grid, block, &args, &mut bufs);
        assert_eq!(bufs.read_f32(out), want);
    }
}

/// The e4m3 code nearest to `y` by value, ties to the even code, saturated to ±448, with
/// `y`'s sign (-0 and values that round to zero included): a search over the magnitudes of
/// every finite code, apart from the kernel's bit arithmetic.
fn nearest_e4m3(y: f32) -> u8 {
    let a = y.abs().min(448.0) as f64;
    let mut best = 0u8;
    for c in 1..0x7fu8 {
        let (d, b) = (
            (e4m3_to_f32(c) as f64 - a).abs(),
            (e4m3_to_f32(best) as f64 - a).abs(),
        );
        if d < b || (d == b && c & 1 == 0) {
            best = c;
        }
    }
    best | if y.is_sign_negative() { 0x80 } else { 0 }
}

#[test]
fn activations_quantize_to_the_nearest_e4m3_code_per_block_of_128() {
    let mut v = Values(89);
    // Row 0's first block has 448 at its top, so its scale is 1 and these land as they are:
    // ties between codes (even mantissa wins), subnormals and the step into the normals,
    // and the largest values.
    let exact: [f32; 16] = [
        448.0,
        1.0625,
        1.1875,
        -1.1875,
        0.0009765625,   // 2^-10: halfway from 0 to 2^-9
        0.0029296875,   // 3 * 2^-10: halfway from 2^-9 to 2^-8
        0.0146484375,   // 15 * 2^-10: halfway from 7 * 2^-9 to 2^-6
        0.015625,       // 2^-6
        -31.0 / 2048.0, // between the largest subnormal and 2^-6
        432.0,          // halfway from 416 to 448
        440.0,
        -447.0,
        0.0,
        -0.0,
        3.0e-5,
        240.0,
    ];
    for &(rows, rows_pad, k) in &[(3usize, 4usize, 300usize), (1, 4, 128), (5, 8, 256)] {
        let blocks = k.div_ceil(128);
        let mut x = Vec::with_capacity(rows * k);
        for r in 0..rows {
            for p in 0..k {
                // Magnitudes over many binades; row 1's second block all zeros.
                let value = if r == 1 && p / 128 == 1 {
                    0.0
                } else {
                    v.next() * 2f32.powi(v.below(24) as i32 - 12)
                };
                x.push(value);
            }
        }
        if k >= 128 {
            x[..exact.len()].copy_from_slice(&exact);
            x[exact.len()..128]
                .iter_mut()
                .for_each(|e| *e = e.clamp(-1.0, 1.0));
        }
        let mut want_codes = vec![0u8; rows_pad * k];
        let mut want_scales = vec![1f32; blocks * rows_pad];
        for r in 0..rows {
            for b in 0..blocks {
                let block = &x[r * k + b * 128..r * k + (b * 128 + 128).min(k)];
                let amax = block.iter().fold(0f32, |m, e| m.max(e.abs()));
                let scale = if amax > 0.0 { amax / 448.0 } else { 1.0 };
                want_scales[b * rows_pad + r] = scale;
                for (i, &e) in block.iter().enumerate() {
                    want_codes[r * k + b * 128 + i] = nearest_e4m3(e / scale);
                }
            }
        }
        if k >= 128 {
            assert_eq!(want_scales[0], 1.0, "the exact block's scale");
        }
        let warps = rows_pad * blocks;
        for (grid, block) in [((warps * 32).div_ceil(128) as u32, 128), (warps as u32, 32)] {
            let mut bufs = Buffers::default();
            let codes = bufs.bytes(&vec![0xaa; rows_pad * k]);
            let scales = bufs.f32(&vec![f32::NAN; blocks * rows_pad]);
            let args = [
                Arg::Buf(codes),
                Arg::Buf(scales),
                Arg::Buf(bufs.f32(&x)),
                Arg::I64(rows as i64),
                Arg::I64(rows_pad as i64),
                Arg::I64(k as i64),
            ];
            launch("quantize_rows_e4m3", grid, block, &args, &mut bufs);
            let what = format!("quantize_rows_e4m3 rows={rows}/{rows_pad} k={k} grid={grid}");
            let got = bufs.read_bytes(codes);
            for (i, (&g, &w)) in got.iter().zip(&want_codes).enumerate() {
                let (r, p) = (i / k, i % k);
                let input = if r < rows { x[i] } else { 0.0 };
                assert_eq!(
                    g, w,
                    "{what}: row {r} input {p} ({input:e}): code {g:#04x}, not {w:#04x}"
                );
            }
            let got = bufs.read_f32(scales);
            let same = got
                .iter()
                .zip(&want_scales)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{what}: scales {got:?} against {want_scales:?}");
        }
    }
}

#[test]
fn byte_panels_unpack_to_plain_rows() {
    let mut v = Values(97);
    for (n, k) in [(37usize, 100usize), (16, 128), (5, 3)] {
        let w = byte_codes(n, k, 32, true, &mut v);
        let want: Vec<u8> = (0..n * k)
            .map(|i| w.codes[(i / k / PANEL * k + i % k) * PANEL + i / k % PANEL])
            .collect();
        for (grid, block) in [((n * k).div_ceil(256) as u32, 256), (1, 32)] {
            let mut bufs = Buffers::default();
            let out = bufs.bytes(&vec![0xaa; n * k]);
            let args = [
                Arg::Buf(out),
                Arg::Buf(bufs.bytes(&w.codes)),
                Arg::I64(n as i64),
                Arg::I64(k as i64),
            ];
            launch("codes_to_rows", grid, block, &args, &mut bufs);
            assert_eq!(
                &bufs.read_bytes(out)[..n * k],
                &want[..],
                "codes_to_rows n={n} k={k}"
            );
        }
    }
}
