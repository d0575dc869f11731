//! The backend contract: what every [`Backend`] must compute, written once, generic over the
//! backend, each clause against an f64 or an exact reference built here on the host.
//! [`backend_contract!`] makes one `#[test]` per clause for a backend: the `runtime` target
//! runs them on the CPU backend, the `cuda` target on the CUDA backend (on a GPU, or on the
//! emulated GPUs of `tests/emulator` in a child process).
//!
//! Shapes are small but cover what the backends treat specially: widths that are not a
//! multiple of a SIMD width, grouped heads, ragged batches, and on the CUDA backend each of
//! its attention kernels (a prompt of 16 rows or more is tiled; a decode step over more
//! than 64 positions is split).

use std::f64::consts::{PI, SQRT_2};
use tpc::ir::{ActivationKind, DType, RopeOp, RopeScaling, WeightOrder, F64};
use tpc::plan::{Plan, WeightSlice};
use tpc::runtime::backend::{Activation, Backend, BinaryOp, Segment, WeightUse};
use tpc::runtime::exact::{DepthOrder, LIMBS};
use tpc::runtime::tensor::Tensor;
use tpc::runtime::weights::WeightSource;

/// One `#[test]` per clause of the contract for the backends `$make(bf16)` builds
/// (`bf16`: linear weights and embedding tables kept in bf16). `$make` returns `None`
/// where that backend cannot run here, having said why; the test then passes as a skip.
macro_rules! backend_contract {
    ($make:path) => {
        #[test]
        fn buffers_round_trip_bit_for_bit() {
            if let Some(b) = $make(false) {
                $crate::contract::buffers_round_trip_bit_for_bit(&b);
            }
        }
        #[test]
        fn linear_matches_an_f64_product() {
            if let Some(b) = $make(false) {
                $crate::contract::linear_matches_an_f64_product(&b, false);
            }
        }
        #[test]
        fn linear_with_bf16_weights_matches_an_f64_product_of_the_rounded_weights() {
            if let Some(b) = $make(true) {
                $crate::contract::linear_matches_an_f64_product(&b, true);
            }
        }
        #[test]
        fn weights_are_rounded_to_bf16_nearest_even_only_in_bf16() {
            if let (Some(f32s), Some(bf16s)) = ($make(false), $make(true)) {
                $crate::contract::weights_round_to_bf16_only_in_bf16(&f32s, false);
                $crate::contract::weights_round_to_bf16_only_in_bf16(&bf16s, true);
            }
        }
        #[test]
        fn embedding_reads_this_ranks_rows_and_zeros_the_others() {
            if let (Some(f32s), Some(bf16s)) = ($make(false), $make(true)) {
                $crate::contract::embedding_reads_this_ranks_rows(&f32s, false);
                $crate::contract::embedding_reads_this_ranks_rows(&bf16s, true);
            }
        }
        #[test]
        fn norms_match_an_f64_reference_with_f32_scales() {
            if let (Some(f32s), Some(bf16s)) = ($make(false), $make(true)) {
                $crate::contract::norms_match_an_f64_reference(&f32s);
                $crate::contract::norms_match_an_f64_reference(&bf16s);
            }
        }
        #[test]
        fn elementwise_ops_are_exact() {
            if let Some(b) = $make(false) {
                $crate::contract::elementwise_ops_are_exact(&b);
            }
        }
        #[test]
        fn activations_match_an_f64_reference() {
            if let Some(b) = $make(false) {
                $crate::contract::activations_match_an_f64_reference(&b);
            }
        }
        #[test]
        fn rope_rotates_like_an_f64_reference() {
            if let Some(b) = $make(false) {
                $crate::contract::rope_rotates_like_an_f64_reference(&b);
            }
        }
        #[test]
        fn attention_over_the_caches_matches_an_f64_reference() {
            if let Some(b) = $make(false) {
                $crate::contract::attention_matches_an_f64_reference(&b);
            }
        }
        #[test]
        fn layout_ops_move_values_exactly() {
            if let Some(b) = $make(false) {
                $crate::contract::layout_ops_move_values_exactly(&b);
            }
        }
        #[test]
        fn invariant_products_give_a_row_its_bits_in_any_batch_and_exact_sums_through_limbs() {
            if let (Some(f32s), Some(bf16s)) = ($make(false), $make(true)) {
                $crate::contract::invariant_products_keep_a_rows_bits(&f32s, false);
                $crate::contract::invariant_products_keep_a_rows_bits(&bf16s, true);
            }
        }
        #[test]
        fn invariant_attention_gives_a_row_its_bits_in_any_call() {
            if let Some(b) = $make(false) {
                $crate::contract::invariant_attention_keeps_a_rows_bits(b);
            }
        }
        #[test]
        fn argmax_and_top_k_follow_the_samplers_order() {
            if let Some(b) = $make(false) {
                $crate::contract::argmax_and_top_k_follow_the_samplers_order(&b);
            }
        }
        #[test]
        fn weighted_rows_sum_adds_the_parts_in_order() {
            if let Some(b) = $make(false) {
                $crate::contract::weighted_rows_sum_adds_the_parts_in_order(&b);
            }
        }
    };
}
pub(crate) use backend_contract;

/// Reproducible values in [-1, 1) (xorshift).
struct Values(u64);

impl Values {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 23) as f32) - 1.0
    }
    fn take(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next()).collect()
    }
}

/// A weight source holding one tensor's values, whatever its name.
struct Source<'a>(&'a [f32]);

impl WeightSource for Source<'_> {
    fn check(&self, _: &Plan) -> tpc::runtime::weights::WeightResult<()> {
        Ok(())
    }
    fn read(
        &self,
        _: &str,
        from: usize,
        count: usize,
        out: &mut Vec<f32>,
    ) -> tpc::runtime::weights::WeightResult<()> {
        out.extend_from_slice(&self.0[from..from + count]);
        Ok(())
    }
}

/// `values` of `shape` uploaded whole: for a linear op in `order`, or else as a table or
/// vector.
fn weight<B: Backend>(
    b: &B,
    shape: &[usize],
    values: &[f32],
    order: Option<WeightOrder>,
) -> B::Weight {
    assert_eq!(shape.iter().product::<usize>(), values.len());
    let dims: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
    let slice = WeightSlice {
        tensor: "w".into(),
        shape: dims.clone(),
        dtype: DType::F32,
        dim: None,
        ranges: vec![],
        padding: 0,
        local_shape: dims,
        quant: None,
    };
    let usage = WeightUse {
        linear: order,
        other: order.is_none(),
    };
    b.upload(&Source(values), &slice, usage)
        .unwrap_or_else(|e| panic!("uploading a weight of shape {shape:?}: {e}"))
}

fn act<B: Backend>(b: &B, shape: &[usize], data: Vec<f32>) -> B::Act {
    b.upload_host(&Tensor::new(shape.to_vec(), data))
        .unwrap_or_else(|e| panic!("uploading an activation of shape {shape:?}: {e}"))
}

/// The values of `x` on the host, `x` kept.
fn read<B: Backend>(b: &B, x: &B::Act) -> Tensor {
    b.to_host(b.copy(x).unwrap()).unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Bit-for-bit equality, naming the first difference.
fn assert_same(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!("{what}: at {i}: got {} want {}", got[i], want[i]);
    }
}

/// `|got - want| <= tol * scale[i]` everywhere (a non-finite `got` never is).
fn assert_within(what: &str, got: &[f32], want: &[f64], scale: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let e = (g as f64 - w).abs();
        assert!(
            e <= tol * scale[i],
            "{what}: at {i}: got {g} want {w} (error {e:.3e} > {:.3e})",
            tol * scale[i]
        );
    }
}

/// `|got - want| <= tol * max(1, |want|)` everywhere.
fn assert_close(what: &str, got: &[f32], want: &[f64], tol: f64) {
    let scale: Vec<f64> = want.iter().map(|w| w.abs().max(1.0)).collect();
    assert_within(what, got, want, &scale, tol);
}

fn bf16(v: f32) -> f32 {
    half::bf16::from_f32(v).to_f32()
}

/// Activations go to the device and back unchanged (NaN, infinities and -0 included), a copy
/// is independent of its original, `alloc` makes the shape asked for, and row selections
/// copy rows (past the end: zeros).
pub fn buffers_round_trip_bit_for_bit<B: Backend>(b: &B) {
    let mut data = Values(1).take(15);
    data[1] = f32::NAN;
    data[4] = f32::NEG_INFINITY;
    data[7] = -0.0;
    data[9] = f32::from_bits(1); // the smallest subnormal
    let x = act(b, &[3, 5], data.clone());
    assert_eq!(x.shape(), &[3, 5]);
    assert_eq!(x.rows_cols(), (3, 5));
    assert_eq!(x.dtype(), DType::F32);
    let back = read(b, &x);
    assert_eq!(back.shape, vec![3, 5]);
    assert_eq!(bits(&back.data), bits(&data), "round trip");

    let mut original = b.copy(&x).unwrap();
    let copy = b.copy(&original).unwrap();
    b.binary(&mut original, &x, BinaryOp::Add).unwrap();
    assert_same(
        "a copy after its original changed",
        &read(b, &copy).data,
        &data,
    );

    let fresh = b.alloc(&[2, 7], DType::F32).unwrap();
    assert_eq!((fresh.shape(), fresh.dtype()), (&[2, 7][..], DType::F32));
    b.release(fresh);

    let picked = b.select_rows(&x, &[2, 0, 2]).unwrap();
    let want: Vec<f32> = [2, 0, 2]
        .iter()
        .flat_map(|&r| data[r * 5..(r + 1) * 5].to_vec())
        .collect();
    assert_eq!(picked.shape(), &[3, 5]);
    assert_eq!(bits(&read(b, &picked).data), bits(&want), "select_rows");

    let window = b.row_window(&x, 1, 4).unwrap();
    let mut want = data[5..15].to_vec();
    want.extend([0.0; 10]);
    assert_eq!(window.shape(), &[4, 5]);
    assert_eq!(bits(&read(b, &window).data), bits(&want), "row_window");
}

/// `x [m, k] · Wᵀ` in both weight orders against an f64 product, within f32 accumulation
/// error. With bf16 weights the product is of the bf16-rounded weights, and of the
/// activations either as they are or rounded to bf16 too (as the GPU's and AMX's bf16
/// products do): one of the two for the whole product.
pub fn linear_matches_an_f64_product<B: Backend>(b: &B, bf16_weights: bool) {
    let mut values = Values(2);
    for (m, k, n) in [(1, 40, 24), (7, 37, 19), (17, 64, 33)] {
        let x = values.take(m * k);
        let w = values.take(n * k); // w[j][p]: output j, input p
        let round = |v: f32| if bf16_weights { bf16(v) } else { v };
        // The reference products with x as it is and with x rounded, and the scale of the
        // f32 error (the sum of the terms' magnitudes).
        let mut want = [vec![0f64; m * n], vec![0f64; m * n]];
        let mut scale = vec![1e-3f64; m * n];
        for r in 0..m {
            for j in 0..n {
                for p in 0..k {
                    let (xv, wv) = (x[r * k + p], round(w[j * k + p]) as f64);
                    want[0][r * n + j] += xv as f64 * wv;
                    want[1][r * n + j] += round(xv) as f64 * wv;
                    scale[r * n + j] += (xv as f64 * wv).abs();
                }
            }
        }
        let xa = act(b, &[m, k], x.clone());
        let transposed: Vec<f32> = (0..k)
            .flat_map(|p| (0..n).map(move |j| (p, j)))
            .map(|(p, j)| w[j * k + p])
            .collect();
        for (order, shape, data) in [
            (WeightOrder::OutIn, [n, k], &w),
            (WeightOrder::InOut, [k, n], &transposed),
        ] {
            let wt = weight(b, &shape, data, Some(order));
            let y = b.linear(&xa, &wt).unwrap();
            assert_eq!(y.shape(), &[m, n]);
            let got = read(b, &y).data;
            let what = format!("[{m}, {k}] x {order:?} {shape:?}, bf16 weights {bf16_weights}");
            // Checked against the nearer of the two (the only one in f32 compute).
            let worst = |want: &[f64]| {
                (0..got.len())
                    .map(|i| (got[i] as f64 - want[i]).abs() / scale[i])
                    .fold(0f64, f64::max)
            };
            let rounded_x = bf16_weights && worst(&want[1]) < worst(&want[0]);
            assert_within(&what, &got, &want[rounded_x as usize], &scale, 1e-5);
        }
    }
}

/// A weight's values come back exactly through a product with one-hot rows: bf16 rounded to
/// nearest, ties to even, in bf16 compute; untouched in f32.
pub fn weights_round_to_bf16_only_in_bf16<B: Backend>(b: &B, bf16_weights: bool) {
    let (n, k) = (3, 4);
    // Normal values only: a subnormal may be flushed to zero by a device's products.
    let w: Vec<f32> = [
        0x3f80_8000u32, // 1 + 2^-8, a tie: down to 1.0 (even)
        0x3f81_8000,    // a tie: up to 0x3f82 (even)
        0xbf80_8000,    // a negative tie
        0x3f80_8001,    // just past a tie: up
        0x3f80_7fff,    // just below one: down
        0x4049_0fdb,    // pi
        0x3eaa_aaab,    // 1/3
        0x7e80_8000,    // a tie far from one
        0x0100_8000,    // a tie near the smallest normal
        0xc2f6_e979,    // -123.456
        0x3380_0000,    // 2^-24
        0x3f7f_ffff,    // just below 1: up to 1.0
    ]
    .iter()
    .map(|&u| f32::from_bits(u))
    .collect();
    let one_hot: Vec<f32> = (0..k * k)
        .map(|i| if i / k == i % k { 1.0 } else { 0.0 })
        .collect();
    let x = act(b, &[k, k], one_hot);
    let want: Vec<f32> = (0..k)
        .flat_map(|p| (0..n).map(move |j| (p, j)))
        .map(|(p, j)| w[j * k + p])
        .map(|v| if bf16_weights { bf16(v) } else { v })
        .collect();
    let wt = weight(b, &[n, k], &w, Some(WeightOrder::OutIn));
    let y = b.linear(&x, &wt).unwrap();
    assert_same(
        &format!("one-hot rows times a weight (bf16 weights {bf16_weights})"),
        &read(b, &y).data,
        &want,
    );
}

/// Rows `ids - offset` of the table, zero rows for ids outside it; in bf16 compute the
/// table's values are bf16-rounded, in f32 exact.
pub fn embedding_reads_this_ranks_rows<B: Backend>(b: &B, bf16_tables: bool) {
    let (rows, cols, offset) = (4usize, 3usize, 10usize);
    let table: Vec<f32> = (0..rows * cols).map(|i| i as f32 + 1.0 / 3.0).collect();
    let t = weight(b, &[rows, cols], &table, None);
    let ids = [9i64, 10, 13, 14, -1, 11, 10];
    let y = b.embedding(&ids, &t, offset).unwrap();
    assert_eq!(y.shape(), &[ids.len(), cols]);
    let mut want = Vec::new();
    for &id in &ids {
        let row = usize::try_from(id - offset as i64)
            .ok()
            .filter(|&r| r < rows);
        for c in 0..cols {
            let v = row.map_or(0.0, |r| table[r * cols + c]);
            want.push(if bf16_tables { bf16(v) } else { v });
        }
    }
    assert_same(
        &format!("embedding (bf16 tables {bf16_tables})"),
        &read(b, &y).data,
        &want,
    );
    let none = b.embedding(&[], &t, offset).unwrap();
    assert_eq!(none.shape(), &[0, cols]);
}

/// RMSNorm over whole rows and over each head's columns, and LayerNorm, against f64; the
/// scales and shifts are vectors, kept f32 in every compute dtype (bf16 would be off by
/// about 2^-9 of each value).
pub fn norms_match_an_f64_reference<B: Backend>(b: &B) {
    let mut values = Values(3);
    let (rows, cols, eps) = (5, 24, 1e-5f32);
    // Rows far from zero mean: LayerNorm's variance must come from centred values.
    let x: Vec<f32> = values.take(rows * cols).iter().map(|v| 3.0 + v).collect();
    let xa = act(b, &[rows, cols], x.clone());
    for group in [cols, 8] {
        let scales: Vec<f32> = (0..group).map(|i| 1.0 + i as f32 / 3.0).collect();
        let w = weight(b, &[group], &scales, None);
        let y = b.rms_norm(&xa, &w, group, eps).unwrap();
        let want: Vec<f64> = x
            .chunks(group)
            .flat_map(|g| {
                let ms = g.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / group as f64;
                let inv = 1.0 / (ms + eps as f64).sqrt();
                g.iter()
                    .zip(&scales)
                    .map(move |(&v, &s)| v as f64 * inv * s as f64)
                    .collect::<Vec<_>>()
            })
            .collect();
        assert_close(
            &format!("rms_norm, group {group}"),
            &read(b, &y).data,
            &want,
            1e-5,
        );
    }
    let scales: Vec<f32> = (0..cols).map(|i| 0.5 + i as f32 / 7.0).collect();
    let shifts: Vec<f32> = (0..cols).map(|i| i as f32 / 3.0 - 2.0).collect();
    let (w, s) = (
        weight(b, &[cols], &scales, None),
        weight(b, &[cols], &shifts, None),
    );
    let y = b.layer_norm(&xa, &w, &s, eps).unwrap();
    let want: Vec<f64> = x
        .chunks(cols)
        .flat_map(|row| {
            let mean = row.iter().map(|&v| v as f64).sum::<f64>() / cols as f64;
            let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / cols as f64;
            let inv = 1.0 / (var + eps as f64).sqrt();
            (0..cols)
                .map(|i| (row[i] as f64 - mean) * inv * scales[i] as f64 + shifts[i] as f64)
                .collect::<Vec<_>>()
        })
        .collect();
    assert_close("layer_norm", &read(b, &y).data, &want, 1e-5);
}

/// Sums and products in place, and bias rows, bit for bit as f32 arithmetic gives them.
pub fn elementwise_ops_are_exact<B: Backend>(b: &B) {
    let mut values = Values(4);
    let (rows, cols) = (6, 13);
    let x = values.take(rows * cols);
    let y: Vec<f32> = values.take(rows * cols).iter().map(|v| v * 3.7).collect();
    let ya = act(b, &[rows, cols], y.clone());
    for (op, f) in [
        (BinaryOp::Add, (|p, q| p + q) as fn(f32, f32) -> f32),
        (BinaryOp::Mul, |p, q| p * q),
    ] {
        let mut xa = act(b, &[rows, cols], x.clone());
        b.binary(&mut xa, &ya, op).unwrap();
        let want: Vec<f32> = x.iter().zip(&y).map(|(&p, &q)| f(p, q)).collect();
        assert_same(&format!("{op:?}"), &read(b, &xa).data, &want);
    }
    let bias = values.take(cols);
    let mut xa = act(b, &[rows, cols], x.clone());
    b.bias_add(&mut xa, &weight(b, &[cols], &bias, None))
        .unwrap();
    let want: Vec<f32> = x
        .iter()
        .enumerate()
        .map(|(i, v)| v + bias[i % cols])
        .collect();
    assert_same("bias_add", &read(b, &xa).data, &want);
}

/// An activation's f64 definition.
type Reference = fn(f64) -> f64;

/// SiLU, exact GeLU, tanh GeLU and ReLU in place against their f64 definitions.
pub fn activations_match_an_f64_reference<B: Backend>(b: &B) {
    let x: Vec<f32> = (0..161)
        .map(|i| (i as f32 - 80.0) * 0.1)
        .chain([-30.0, 30.0, 0.0, -0.0, 1e-4, -1e-4])
        .collect();
    let gelu_tanh = |v: f64| {
        let c = (2.0 / PI).sqrt();
        0.5 * v * (1.0 + (c * (v + 0.044715 * v * v * v)).tanh())
    };
    let cases: [(ActivationKind, Reference); 4] = [
        (ActivationKind::Silu, |v| v / (1.0 + (-v).exp())),
        (ActivationKind::Gelu, |v| {
            0.5 * v * (1.0 + libm::erf(v / SQRT_2))
        }),
        (ActivationKind::GeluTanh, gelu_tanh),
        (ActivationKind::Relu, |v| v.max(0.0)),
    ];
    for (kind, f) in cases {
        let mut xa = act(b, &[1, x.len()], x.clone());
        b.activation(&mut xa, kind).unwrap();
        let want: Vec<f64> = x.iter().map(|&v| f(v as f64)).collect();
        assert_close(&format!("{kind:?}"), &read(b, &xa).data, &want, 1e-5);
    }
}

/// Rotate-half rotary embedding of each head's first `rotary_dim` columns by the angle
/// `position · θ^(-2i / rotary_dim)` (divided by the linear scaling's factor), the other
/// columns untouched.
pub fn rope_rotates_like_an_f64_reference<B: Backend>(b: &B) {
    let mut values = Values(5);
    let positions = [0i64, 1, 7, 300, 4095];
    let (rows, heads, head_dim) = (positions.len(), 3, 8);
    let cols = heads * head_dim;
    let x = values.take(rows * cols);
    for (rotary_dim, factor) in [(8u64, None), (4, None), (8, Some(4.0))] {
        let op = RopeOp {
            head_dim: head_dim as u64,
            rotary_dim,
            theta: F64(10000.0),
            scaling: factor.map(|f| RopeScaling::Linear { factor: F64(f) }),
        };
        let tables = b.rope_tables(&op, &positions).unwrap();
        let mut xa = act(b, &[rows, cols], x.clone());
        b.rope(&mut xa, head_dim, &tables).unwrap();
        let half = rotary_dim as usize / 2;
        let mut want: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        for (r, &p) in positions.iter().enumerate() {
            for h in 0..heads {
                let at = r * cols + h * head_dim;
                for i in 0..half {
                    let freq = 10000f64.powf(-((2 * i) as f64) / rotary_dim as f64)
                        / factor.unwrap_or(1.0);
                    let (sin, cos) = (p as f64 * freq).sin_cos();
                    let (a, c) = (x[at + i] as f64, x[at + i + half] as f64);
                    want[at + i] = a * cos - c * sin;
                    want[at + i + half] = c * cos + a * sin;
                }
            }
        }
        let what = format!("rope, rotary dim {rotary_dim} of {head_dim}, scaling {factor:?}");
        assert_close(&what, &read(b, &xa).data, &want, 1e-5);
    }
}

/// Keys and values one sequence has cached, and its causal attention.
#[derive(Default)]
struct History {
    k: Vec<f32>,
    v: Vec<f32>,
}

/// Causal attention of `q`'s rows (the last of the history's positions) over the history:
/// query head `h` reads kv head `h / (q_heads / kv_heads)`.
fn attention_reference(
    q: &[f32],
    history: &History,
    heads: (usize, usize),
    d: usize,
    scale: f32,
) -> Vec<f64> {
    let (q_heads, kv_heads) = heads;
    let (qc, kc) = (q_heads * d, kv_heads * d);
    let rows = q.len() / qc;
    let total = history.k.len() / kc;
    let mut out = vec![0f64; q.len()];
    for r in 0..rows {
        let seen = total - rows + r + 1;
        for h in 0..q_heads {
            let kh = h / (q_heads / kv_heads);
            let scores: Vec<f64> = (0..seen)
                .map(|p| {
                    (0..d)
                        .map(|i| {
                            q[r * qc + h * d + i] as f64 * history.k[p * kc + kh * d + i] as f64
                        })
                        .sum::<f64>()
                        * scale as f64
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = weights.iter().sum();
            for i in 0..d {
                out[r * qc + h * d + i] = (0..seen)
                    .map(|p| weights[p] * history.v[p * kc + kh * d + i] as f64)
                    .sum::<f64>()
                    / sum;
            }
        }
    }
    out
}

/// Attention over a paged KV pool (blocks of 4 tokens) through a ragged prefill of two
/// sequences, decode steps given in the other sequence order, a long chunk and a decode
/// step over more than 64 positions, a sequence restarted on other blocks next to a third
/// that shares the first sequence's first two blocks (a cached prompt prefix, only read),
/// and the first sequence decoding on over its shared blocks. Sequence 0's blocks are in
/// order, the others' scattered. Every row against an f64 reference over its own
/// sequence only.
pub fn attention_matches_an_f64_reference<B: Backend>(b: &B) {
    let mut values = Values(6);
    let (q_heads, kv_heads, d) = (4, 2, 8);
    let (qc, kc) = (q_heads * d, kv_heads * d);
    let scale = 0.3f32;
    let mut pool = b.new_kv(kc, kc, 4);
    b.grow_kv(&mut pool, 30).unwrap();
    b.grow_kv(&mut pool, 41).unwrap();
    b.grow_kv(&mut pool, 10).unwrap();
    let mut tables: [Vec<u32>; 3] = [(0..20).collect(), vec![33, 21, 38, 20], vec![0, 1, 40]];
    let mut history = [History::default(), History::default(), History::default()];
    // Each step: (sequence, new rows), in row order.
    let steps: [&[(usize, usize)]; 6] = [
        &[(0, 20), (1, 3)], // a ragged prefill; sequence 0's prompt is tiled on a GPU
        &[(1, 1), (0, 1)],  // one decode step each, in the other order
        &[(0, 50)],         // one sequence alone: 71 positions cached after it
        &[(0, 1)],          // a decode step over 72 positions (split on a GPU)
        &[(1, 2), (2, 3)],  // 1 anew on other blocks; 2 after 0's first 8 positions
        &[(0, 1), (2, 1)],  // both readers of the shared blocks decode on
    ];
    for (n, step) in steps.iter().enumerate() {
        if n == 4 {
            tables[1] = vec![24, 39];
            history[1] = History::default();
            history[2] = History {
                k: history[0].k[..8 * kc].to_vec(),
                v: history[0].v[..8 * kc].to_vec(),
            };
        }
        let rows: usize = step.iter().map(|s| s.1).sum();
        let (q, k, v) = (
            values.take(rows * qc),
            values.take(rows * kc),
            values.take(rows * kc),
        );
        let mut segments = Vec::new();
        let mut seqs = Vec::new();
        let mut row = 0;
        for &(seq, new) in step.iter() {
            segments.push(Segment {
                rows: row..row + new,
                start: history[seq].k.len() / kc,
                blocks: &tables[seq],
            });
            seqs.push(seq);
            row += new;
        }
        let out = b
            .attention(
                [
                    &act(b, &[rows, qc], q.clone()),
                    &act(b, &[rows, kc], k.clone()),
                    &act(b, &[rows, kc], v.clone()),
                ],
                &mut pool,
                &segments,
                d,
                scale,
            )
            .unwrap_or_else(|e| panic!("step {n}: {e}"));
        assert_eq!(out.shape(), &[rows, qc]);
        let got = read(b, &out).data;
        for (s, &seq) in segments.iter().zip(&seqs) {
            let h = &mut history[seq];
            h.k.extend_from_slice(&k[s.rows.start * kc..s.rows.end * kc]);
            h.v.extend_from_slice(&v[s.rows.start * kc..s.rows.end * kc]);
            let want = attention_reference(
                &q[s.rows.start * qc..s.rows.end * qc],
                h,
                (q_heads, kv_heads),
                d,
                scale,
            );
            let what = format!(
                "step {n}: sequence {seq} rows {:?} from position {}",
                s.rows, s.start
            );
            assert_close(&what, &got[s.rows.start * qc..s.rows.end * qc], &want, 1e-5);
        }
    }
    // What no pool can hold is an error, on every backend: a table too short for the
    // positions, a block past the pool, and a pool too large to count.
    let mut one = |cols: usize| act(b, &[1, cols], values.take(cols));
    let (q, k, v) = (one(qc), one(kc), one(kc));
    for (blocks, start, what) in [
        (&[0u32][..], 4, "a table of 1 block of 4 for position 4"),
        (&[41u32][..], 0, "block 41 of 41"),
        (&[u32::MAX][..], 0, "block u32::MAX"),
    ] {
        let segment = Segment {
            rows: 0..1,
            start,
            blocks,
        };
        assert!(
            b.attention([&q, &k, &v], &mut pool, &[segment], d, scale)
                .is_err(),
            "{what}: accepted"
        );
    }
    assert!(b.grow_kv(&mut pool, usize::MAX / 2).is_err());
}

/// The column and row layouts the collectives need, exactly.
pub fn layout_ops_move_values_exactly<B: Backend>(b: &B) {
    let (rows, cols) = (3, 12);
    let data: Vec<f32> = (0..rows * cols).map(|i| i as f32 + 0.25).collect();
    let x = act(b, &[rows, cols], data.clone());
    let at = |r: usize, c: usize| data[r * cols + c];

    // Columns 2..5 of each block of 6.
    let y = b.unfuse(&x, 6, 2, 3).unwrap();
    let want: Vec<f32> = (0..rows)
        .flat_map(|r| [2, 3, 4, 8, 9, 10].map(|c| at(r, c)))
        .collect();
    assert_eq!(y.shape(), &[rows, 6]);
    assert_same("unfuse", &read(b, &y).data, &want);

    let y = b.column_block(&x, 1, 3).unwrap();
    let want: Vec<f32> = (0..rows)
        .flat_map(|r| (4..8).map(move |c| at(r, c)))
        .collect();
    assert_eq!(y.shape(), &[rows, 4]);
    assert_same("column_block", &read(b, &y).data, &want);

    // An uneven piece: columns 5..9, then zeros up to 6; a rank with no columns; too far.
    let y = b.column_window(&x, 5, 4, 6).unwrap();
    let want: Vec<f32> = (0..rows)
        .flat_map(|r| (5..11).map(move |c| if c < 9 { at(r, c) } else { 0.0 }))
        .collect();
    assert_eq!(y.shape(), &[rows, 6]);
    assert_same("column_window", &read(b, &y).data, &want);
    let y = b.column_window(&x, 12, 0, 2).unwrap();
    assert_same("column_window (none)", &read(b, &y).data, &[0.0; 6]);
    assert!(b.column_window(&x, 10, 3, 4).is_err());
    assert!(b.column_window(&x, 0, 5, 4).is_err());

    // [rows, 3·4] → rank-major [3][rows][4], and back keeping the first 10 columns.
    let y = b.rows_to_rank_major(&x, 3).unwrap();
    let want: Vec<f32> = (0..3)
        .flat_map(|k| (0..rows).flat_map(move |r| (0..4).map(move |c| at(r, k * 4 + c))))
        .collect();
    assert_eq!(y.shape(), &[3 * rows, 4]);
    assert_same("rows_to_rank_major", &read(b, &y).data, &want);
    let back = b.rank_major_to_rows(&y, &[4, 4, 2]).unwrap();
    let want: Vec<f32> = (0..rows)
        .flat_map(|r| (0..10).map(move |c| at(r, c)))
        .collect();
    assert_eq!(back.shape(), &[rows, 10]);
    assert_same("rank_major_to_rows", &read(b, &back).data, &want);
    // Unequal parts (shares): the first 1, 4 and 3 columns of the three parts.
    let back = b.rank_major_to_rows(&y, &[1, 4, 3]).unwrap();
    let want: Vec<f32> = (0..rows)
        .flat_map(|r| [0, 4, 5, 6, 7, 8, 9, 10].map(|c| at(r, c)))
        .collect();
    assert_eq!(back.shape(), &[rows, 8]);
    assert_same(
        "rank_major_to_rows, unequal parts",
        &read(b, &back).data,
        &want,
    );
}

/// The experts' weighted sum of a mixture-of-experts layer, bit for bit as the host adds it:
/// zeros, then each part's rows times their weights into their target rows, the parts in
/// the order given and a part's rows in row order — rows chosen by several parts, a row
/// that one part adds into twice, an empty part. Wrong shapes and targets are errors.
pub fn weighted_rows_sum_adds_the_parts_in_order<B: Backend>(b: &B) {
    let mut values = Values(61);
    let (rows, width) = (7usize, 13usize);
    // Rows 2 and 3: a small value and a large one and its negation, so that the sum is the
    // small value rounded to the large one's step, and in another order exact; row 3 gets
    // the negation and the small value from one part (the large one's repeat comes first).
    let parts: [(&[usize], f32); 4] = [
        (&[0, 2, 5], 1e-3),
        (&[], 1.0),
        (&[5, 2, 3, 1], 3e4),
        (&[3, 2, 3], 1e-3),
    ];
    let mut ys: Vec<Vec<f32>> = parts
        .iter()
        .map(|(at, scale)| {
            let y = values.take(at.len() * width);
            y.iter().map(|v| v * scale).collect()
        })
        .collect();
    let mut weights: Vec<Vec<f32>> = parts.iter().map(|(at, _)| values.take(at.len())).collect();
    // Part 3's rows 0 and 1 cancel part 2's rows 2 and 1 (targets 3 and 2).
    for (mine, theirs) in [(0, 2), (1, 1)] {
        let large: Vec<f32> = ys[2][theirs * width..(theirs + 1) * width]
            .iter()
            .map(|v| -v)
            .collect();
        ys[3][mine * width..(mine + 1) * width].copy_from_slice(&large);
        weights[3][mine] = weights[2][theirs];
    }
    // The host's sum, the parts in `order`, each part's rows in row order or reversed.
    let sum = |order: &mut dyn Iterator<Item = usize>, reversed_rows: bool| {
        let mut out = vec![0f32; rows * width];
        for k in order {
            let mut js: Vec<usize> = (0..parts[k].0.len()).collect();
            if reversed_rows {
                js.reverse();
            }
            for j in js {
                let r = parts[k].0[j];
                for c in 0..width {
                    out[r * width + c] += weights[k][j] * ys[k][j * width + c];
                }
            }
        }
        out
    };
    let want = sum(&mut (0..parts.len()), false);
    for (what, other) in [
        ("the parts", sum(&mut (0..parts.len()).rev(), false)),
        ("a part's rows", sum(&mut (0..parts.len()), true)),
    ] {
        assert_ne!(
            bits(&want),
            bits(&other),
            "data whose sum is the same in any order of {what}"
        );
    }
    let acts: Vec<B::Act> = parts
        .iter()
        .zip(&ys)
        .map(|((at, _), y)| act(b, &[at.len(), width], y.clone()))
        .collect();
    let args: Vec<(&B::Act, &[usize], &[f32])> = acts
        .iter()
        .zip(&parts)
        .zip(&weights)
        .map(|((y, (at, _)), w)| (y, *at, w.as_slice()))
        .collect();
    let got = b.weighted_rows_sum(rows, width, &args).unwrap();
    assert_eq!(got.shape(), &[rows, width]);
    assert_same("weighted_rows_sum", &read(b, &got).data, &want);

    // No parts: zeros; no rows: an empty result.
    let none = b.weighted_rows_sum(rows, width, &[]).unwrap();
    assert_same("no parts", &read(b, &none).data, &vec![0.0; rows * width]);
    let empty = b.weighted_rows_sum(0, width, &args[1..2]).unwrap();
    assert_eq!(empty.shape(), &[0, width]);
    // A target past the rows, a weight missing, rows of another width: errors.
    let (y, at, w) = args[0];
    assert!(b.weighted_rows_sum(5, width, &[(y, at, w)]).is_err());
    assert!(b
        .weighted_rows_sum(rows, width, &[(y, at, &w[..2])])
        .is_err());
    assert!(b.weighted_rows_sum(rows, width + 1, &[(y, at, w)]).is_err());
}

/// The sampler's order over (value, index): larger value first, lower index among equals.
fn sampler_order(row: &[f32], valid: usize, offset: usize) -> Vec<(f32, f32)> {
    let mut order: Vec<(f32, usize)> = row[..valid].iter().copied().zip(0..).collect();
    order.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    order
        .into_iter()
        .map(|(v, i)| (v, (i + offset) as f32))
        .collect()
}

/// Greedy and top-k candidates per row, per vocabulary slice and merged across slices, as
/// the sampler orders them; non-finite rows marked with NaN.
pub fn argmax_and_top_k_follow_the_samplers_order<B: Backend>(b: &B) {
    let cols = 7;
    // Ties within rows (the first index wins), negative rows (padding zeros must not win).
    let data = vec![
        1.0,
        5.0,
        2.0,
        5.0,
        -1.0,
        0.5,
        5.0, //
        -3.0,
        -1.0,
        -2.0,
        -1.0,
        -5.0,
        -9.0,
        -4.0, //
        0.0,
        0.0,
        0.0,
        0.0,
        0.0,
        0.0,
        0.0, //
        2.0,
        1.0,
        f32::NAN,
        3.0,
        0.0,
        1.0,
        2.0,
    ];
    let rows = data.len() / cols;
    let x = act(b, &[rows, cols], data.clone());
    let finite_rows = &data[..3 * cols];
    let fx = act(b, &[3, cols], finite_rows.to_vec());
    assert_eq!(b.argmax_rows(&fx).unwrap(), vec![1, 1, 0]);
    assert_eq!(b.first_non_finite_row(&fx).unwrap(), None);
    assert_eq!(b.first_non_finite_row(&x).unwrap(), Some(3));

    // Pairs over the first 5 columns, indices offset by 100; the NaN row is marked.
    let pairs = read(b, &b.argmax_pairs(&x, 5, 100).unwrap());
    assert_eq!(pairs.shape, vec![rows, 2]);
    for r in 0..3 {
        let best = sampler_order(&data[r * cols..(r + 1) * cols], 5, 100)[0];
        assert_same(
            &format!("argmax_pairs row {r}"),
            &pairs.data[2 * r..2 * r + 2],
            &[best.0, best.1],
        );
    }
    assert!(
        pairs.data[6].is_nan(),
        "argmax_pairs of a row with a NaN: {:?}",
        pairs.data
    );
    let empty = read(b, &b.argmax_pairs(&fx, 0, 3).unwrap());
    assert_same(
        "argmax_pairs of no column",
        &empty.data,
        &[f32::NEG_INFINITY, -1.0].repeat(3),
    );

    // Two slices of a vocabulary of 6 (3 + 3 columns), merged.
    let slices = [(0usize, 3usize), (3, 3)];
    let vocab: Vec<Vec<f32>> = (0..3)
        .map(|r| finite_rows[r * cols..r * cols + 6].to_vec())
        .collect();
    let slice_act = |s: usize, w: usize| {
        let d: Vec<f32> = vocab
            .iter()
            .flat_map(|row| row[s..s + w].to_vec())
            .collect();
        act(b, &[3, w], d)
    };
    let mut gathered = Vec::new();
    for &(s, w) in &slices {
        gathered.extend(read(b, &b.argmax_pairs(&slice_act(s, w), w, s).unwrap()).data);
    }
    let best = read(b, &b.best_of_pairs(&act(b, &[6, 2], gathered), 2).unwrap());
    for (r, row) in vocab.iter().enumerate() {
        let want = sampler_order(row, 6, 0)[0];
        assert_same(
            &format!("best_of_pairs row {r}"),
            &best.data[2 * r..2 * r + 2],
            &[want.0, want.1],
        );
    }

    // Top 4 of each slice, then the best 5 of their union; every row against the whole row.
    let k = 4;
    let mut gathered = Vec::new();
    for &(s, w) in &slices {
        let p = read(b, &b.top_k_pairs(&slice_act(s, w), k.min(w), w, s).unwrap());
        assert_eq!(p.shape, vec![3, 2 * k.min(w)]);
        gathered.extend(p.data);
    }
    let merged = read(
        b,
        &b.best_k_of_pairs(&act(b, &[6, 6], gathered), 2, 5).unwrap(),
    );
    assert_eq!(merged.shape, vec![3, 10]);
    for (r, row) in vocab.iter().enumerate() {
        let want: Vec<f32> = sampler_order(row, 6, 0)[..5]
            .iter()
            .flat_map(|&(v, i)| [v, i])
            .collect();
        assert_same(
            &format!("best_k_of_pairs row {r}"),
            &merged.data[10 * r..10 * r + 10],
            &want,
        );
    }
    // More entries than valid columns: the rest are (-inf, -1); a NaN row is marked.
    let p = read(b, &b.top_k_pairs(&x, 6, 4, 0).unwrap());
    let mut want: Vec<f32> = sampler_order(&data[..cols], 4, 0)
        .iter()
        .flat_map(|&(v, i)| [v, i])
        .collect();
    want.extend([f32::NEG_INFINITY, -1.0].repeat(2));
    assert_same("top_k_pairs past the valid columns", &p.data[..12], &want);
    assert!(
        p.data[3 * 12].is_nan(),
        "top_k_pairs of a row with a NaN: {:?}",
        &p.data[36..]
    );
}

/// `linear_invariant` (`--numerics invariant`): a row's bits are the same alone and in
/// batches of 3, 9 and 21 rows (a GEMV and tiles on either backend), in both weight orders,
/// blocks chained in f32 or added exactly, and close to an f64 product; and the exact order
/// gives the same bits when the depth is cut into parts (as ranks hold it) whose limbs are
/// added in f32 in any order and then decoded.
pub fn invariant_products_keep_a_rows_bits<B: Backend>(b: &B, bf16_weights: bool) {
    let mut values = Values(9);
    // 5 blocks of 20, so that parts of the depth fall on block boundaries.
    let (rows, k, n, block, blocks) = (21, 100, 19, 20, 5);
    let x = values.take(rows * k);
    let w = values.take(n * k); // w[j][p]: output j, input p
    let round = |v: f32| if bf16_weights { bf16(v) } else { v };
    let mut want = vec![0f64; rows * n];
    let mut scale = vec![1e-3f64; rows * n];
    for r in 0..rows {
        for j in 0..n {
            for p in 0..k {
                let t = x[r * k + p] as f64 * round(w[j * k + p]) as f64;
                want[r * n + j] += t;
                scale[r * n + j] += t.abs();
            }
        }
    }
    let rows_of = |from: usize, to: usize, cols: (usize, usize)| -> Vec<f32> {
        (from..to)
            .flat_map(|r| x[r * k + cols.0..r * k + cols.1].to_vec())
            .collect()
    };
    // W's depth steps a .. b as a weight of the given order.
    let w = &w;
    let part = |order: WeightOrder, (a, z): (usize, usize)| -> (Vec<usize>, Vec<f32>) {
        match order {
            WeightOrder::OutIn => (
                vec![n, z - a],
                (0..n)
                    .flat_map(|j| w[j * k + a..j * k + z].to_vec())
                    .collect(),
            ),
            WeightOrder::InOut => (
                vec![z - a, n],
                (a..z)
                    .flat_map(|p| (0..n).map(move |j| w[j * k + p]))
                    .collect(),
            ),
        }
    };
    let exact = |limbs| DepthOrder::Exact {
        block,
        blocks_total: blocks,
        limbs,
    };
    for order in [WeightOrder::OutIn, WeightOrder::InOut] {
        let (shape, data) = part(order, (0, k));
        let wt = weight(b, &shape, &data, Some(order));
        let what = format!("{order:?}, bf16 weights {bf16_weights}");
        let mut whole = Vec::new();
        for depth in [DepthOrder::Chained { block }, exact(false)] {
            let product = |from: usize, to: usize| {
                let xa = act(b, &[to - from, k], rows_of(from, to, (0, k)));
                read(b, &b.linear_invariant(&xa, &wt, depth).unwrap()).data
            };
            let all = product(0, rows);
            assert_within(&format!("{what} {depth:?}"), &all, &want, &scale, 1e-5);
            for batch in [1, 3, 9] {
                for from in (0..rows).step_by(batch) {
                    let to = (from + batch).min(rows);
                    assert_same(
                        &format!("{what} {depth:?}: rows {from}..{to} against all {rows}"),
                        &product(from, to),
                        &all[from * n..to * n],
                    );
                }
            }
            whole = all;
        }
        // The depth in parts, each part's sum as limbs; the parts' limbs added in f32 in
        // both orders, decoded by the backend: the exact whole's bits.
        for cuts in [&[0, 40, 100][..], &[0, 20, 60, 80, 100]] {
            let parts: Vec<Vec<f32>> = cuts
                .windows(2)
                .map(|c| {
                    let (shape, data) = part(order, (c[0], c[1]));
                    let wp = weight(b, &shape, &data, Some(order));
                    let xa = act(b, &[rows, c[1] - c[0]], rows_of(0, rows, (c[0], c[1])));
                    let y = b.linear_invariant(&xa, &wp, exact(true)).unwrap();
                    assert_eq!(y.shape(), &[rows, n * LIMBS]);
                    read(b, &y).data
                })
                .collect();
            let add = |sum: Vec<f32>, p: &Vec<f32>| -> Vec<f32> {
                sum.iter().zip(p).map(|(a, b)| a + b).collect()
            };
            let zeros = vec![0f32; rows * n * LIMBS];
            let forward = parts.iter().fold(zeros.clone(), add);
            let backward = parts.iter().rev().fold(zeros, add);
            assert_same(
                &format!("{what}: limbs added in two orders"),
                &forward,
                &backward,
            );
            let summed = act(b, &[rows, n * LIMBS], forward);
            let decoded = b.decode_limbs(&summed).unwrap();
            assert_eq!(decoded.shape(), &[rows, n]);
            assert_same(
                &format!("{what}: the depth cut at {cuts:?}, through limbs"),
                &read(b, &decoded).data,
                &whole,
            );
        }
    }
}

/// Attention after `set_invariant_numerics`: each row of an 80-token sequence gets the same
/// bits prefilled whole, in chunks beside another sequence, and one decode step at a time
/// (on a GPU: the tiled, split and one-pass calls of the fast mode), close to an f64
/// reference.
pub fn invariant_attention_keeps_a_rows_bits<B: Backend>(mut b: B) {
    b.set_invariant_numerics().unwrap();
    let b = &b;
    let mut values = Values(10);
    let (q_heads, kv_heads, d) = (4, 2, 8);
    let (qc, kc) = (q_heads * d, kv_heads * d);
    let scale = 0.3f32;
    let len = 80;
    let (q, k, v) = (
        values.take(len * qc),
        values.take(len * kc),
        values.take(len * kc),
    );
    let other_rows = 40;
    let (oq, ok, ov) = (
        values.take(other_rows * qc),
        values.take(other_rows * kc),
        values.take(other_rows * kc),
    );
    // Each way: the calls, each (rows of the sequence, rows of the other one beside it).
    let ways: [(&str, Vec<(usize, usize)>); 3] = [
        ("whole", vec![(len, 0)]),
        (
            "chunks beside another sequence",
            vec![(23, 5), (1, 1), (40, 30), (16, 4)],
        ),
        ("one row a call", vec![(1, 0); len]),
    ];
    let mut first: Option<Vec<f32>> = None;
    for (way, calls) in ways {
        let mut pool = b.new_kv(kc, kc, 4);
        b.grow_kv(&mut pool, 40).unwrap();
        let ours: Vec<u32> = (0..20).rev().collect();
        let theirs: Vec<u32> = (20..40).collect();
        let (mut done, mut other_done) = (0, 0);
        let mut got = Vec::new();
        for (mine, beside) in calls {
            let take = |v: &[f32], cols: usize, from: usize, count: usize| {
                v[from * cols..(from + count) * cols].to_vec()
            };
            // The other sequence's rows first, then ours.
            let cat = |ov: &[f32], v: &[f32], cols: usize| {
                let mut all = take(ov, cols, other_done, beside);
                all.extend(take(v, cols, done, mine));
                act(b, &[beside + mine, cols], all)
            };
            let (qa, ka, va) = (cat(&oq, &q, qc), cat(&ok, &k, kc), cat(&ov, &v, kc));
            let segments = [
                Segment {
                    rows: 0..beside,
                    start: other_done,
                    blocks: &theirs,
                },
                Segment {
                    rows: beside..beside + mine,
                    start: done,
                    blocks: &ours,
                },
            ];
            let segments = if beside == 0 {
                &segments[1..]
            } else {
                &segments[..]
            };
            let out = b
                .attention([&qa, &ka, &va], &mut pool, segments, d, scale)
                .unwrap_or_else(|e| panic!("{way}: {e}"));
            got.extend_from_slice(&read(b, &out).data[beside * qc..]);
            done += mine;
            other_done += beside;
        }
        match &first {
            None => {
                let history = History {
                    k: k.clone(),
                    v: v.clone(),
                };
                let want = attention_reference(&q, &history, (q_heads, kv_heads), d, scale);
                assert_close(way, &got, &want, 1e-5);
                first = Some(got);
            }
            Some(want) => assert_same(&format!("{way} against whole"), &got, want),
        }
    }
}
