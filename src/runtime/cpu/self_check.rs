//! The start-up self-check a variant passes before it is used: small products through its
//! prompt GEMM and decode GEMV, for every weight type (f32, bf16, FP8, INT8 and INT4
//! codes), against an f64 reference of the same
//! (rounded, where the variant rounds) operands. A wrong result here means a kernel bug or a
//! CPU/OS that misreports a feature: the variant is then not used. The checked choices of
//! [`Kernels`] (`select`, `detect`, `exact`) live here, above both the kernels and the
//! packed weights the check multiplies.

use super::check_operands::{operands, reference};
use super::isa::{CodeKind, Isa, KernelError, Kernels};
use crate::ir::WeightOrder;
use crate::runtime::cpu::packed::PackedMatrix;
use crate::runtime::cpu::team::Team;
use crate::runtime::tensor::Tensor;
use std::cmp::Ordering::{Equal, Less};
use std::sync::OnceLock;

impl Kernels {
    /// The best variant this host supports whose self-check passed (chosen once).
    pub fn detect() -> Kernels {
        static BEST: OnceLock<Kernels> = OnceLock::new();
        *BEST.get_or_init(|| Kernels::best_where(|_| true))
    }

    /// The best variant whose self-check passes among those that keep a product's
    /// activations f32 (not `avx512bf16` or `amx`): results then differ between tp values
    /// only by the order of f32 sums, which is what `tpc verify` and the f32 parity tests
    /// hold to 1e-4. (Rounding activations to bf16 makes a tiny difference upstream flip a
    /// rounding downstream: 7.8e-3 between tp=1 and tp=2 on a TinyLlama-size bf16 model.)
    pub fn exact() -> Kernels {
        static EXACT: OnceLock<Kernels> = OnceLock::new();
        *EXACT.get_or_init(|| Kernels::best_where(|isa| !isa.bf16_activations()))
    }

    /// The most preferred variant `keep` accepts whose self-check passes (portable at worst).
    fn best_where(keep: impl Fn(Isa) -> bool) -> Kernels {
        Isa::ALL
            .into_iter()
            .rev()
            .filter(|&isa| keep(isa))
            .find_map(|isa| Kernels::select(Some(isa)).ok())
            .unwrap_or(Kernels::PORTABLE)
    }

    /// `isa` (after its self-check), or the best when `None`.
    pub fn select(isa: Option<Isa>) -> Result<Kernels, KernelError> {
        let Some(isa) = isa else {
            return Ok(Kernels::detect());
        };
        let kernels = Kernels::unchecked(isa)?;
        passed(kernels).map_err(|detail| KernelError::SelfCheckFailed { isa, detail })?;
        Ok(kernels)
    }
}

/// Shapes across the GEMV limit and every tile edge: 37 rows (12-, 16- and 32-row tiles all
/// partial), 40 columns (a partial panel), 70 steps (a partial 32-step block, odd pairs).
const SHAPES: [(usize, usize, usize); 3] = [(37, 40, 70), (3, 40, 71), (1, 16, 64)];

pub fn passed(kernels: Kernels) -> Result<(), String> {
    let team = Team::new(1);
    compare(kernels, |w, x| w.matmul_with(kernels, x, &team))
}

/// The weights a check multiplies: values packed f32 or bf16, or a checkpoint's codes.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Weights {
    Values,
    Fp8,
    Int8,
    Int4,
}

impl Weights {
    const ALL: [Weights; 4] = [Weights::Values, Weights::Fp8, Weights::Int8, Weights::Int4];

    /// A `n × k` weight (`k` a multiple of 4 for INT4). Codes come in blocks of 8 steps whose
    /// power-of-two scales (and integer zero points) keep the values bf16, so that the bf16
    /// products round the activations only.
    fn pack(self, w: &[f32], n: usize, k: usize, bf16: bool) -> PackedMatrix {
        let kblock = 8;
        let blocks = n * k.div_ceil(kblock);
        let scales: Vec<f32> = (0..blocks).map(|i| [0.25, 0.5, 0.0625][i % 3]).collect();
        let code = |i: usize| (i * 53 % 251) as u8;
        match self {
            Weights::Values => PackedMatrix::pack(
                &Tensor::new(vec![n, k], w.to_vec()),
                WeightOrder::OutIn,
                bf16,
            ),
            // Every FP8 code but the NaNs.
            Weights::Fp8 => {
                let codes: Vec<u8> = (0..n * k)
                    .map(|i| match code(i) {
                        b if b & 0x7f == 0x7f => 0,
                        b => b,
                    })
                    .collect();
                PackedMatrix::from_codes(CodeKind::E4m3, n, k, &codes, &scales, kblock, bf16)
            }
            Weights::Int8 => {
                let codes: Vec<u8> = (0..n * k).map(code).collect();
                PackedMatrix::from_codes(CodeKind::Int8, n, k, &codes, &scales, kblock, bf16)
            }
            Weights::Int4 => {
                let codes: Vec<u8> = (0..n * k).map(|i| code(i) & 0xf).collect();
                let zeros: Vec<f32> = (0..blocks).map(|i| (i * 7 % 16) as f32).collect();
                PackedMatrix::from_int4(n, k, &codes, &scales, &zeros, kblock, bf16)
            }
        }
    }

    fn name(self, bf16: bool) -> &'static str {
        match (self, bf16) {
            (Weights::Fp8, _) => "FP8",
            (Weights::Int8, _) => "INT8",
            (Weights::Int4, _) => "INT4",
            (Weights::Values, true) => "bf16",
            (Weights::Values, false) => "f32",
        }
    }
}

/// `product` against the reference of `kernels`' rounding, on every shape and weight type.
fn compare(
    kernels: Kernels,
    product: impl Fn(&PackedMatrix, &Tensor) -> Tensor,
) -> Result<(), String> {
    for (m, n, k) in SHAPES {
        for (weights, bf16) in Weights::ALL
            .into_iter()
            .flat_map(|w| [(w, false), (w, true)])
        {
            // INT4 panels need a depth that is a multiple of 4.
            let k = if weights == Weights::Int4 {
                k - k % 4
            } else {
                k
            };
            let (x, w) = operands(m, n, k);
            let packed = weights.pack(&w, n, k, bf16);
            let got = product(&packed, &x);
            let gemv = m <= kernels.gemv_max_rows(packed.is_bf16());
            // Code decode rows keep f32 activations (INT4's in a bf16 run, and INT8's on the
            // AVX2 GEMV of a bf16 run: i16 ones, taken as the reference's too); code prompts
            // of a bf16 run take the bf16 products.
            let round = if weights == Weights::Values {
                bf16 && kernels.isa().bf16_activations()
            } else {
                bf16 && !gemv && kernels.gemm_variant(true).bf16_activations()
            };
            let x = match packed.decode_rows(&x, kernels) {
                Some(q) if gemv => q,
                _ => x,
            };
            let reference = reference(&x, packed.n, |j, p| packed.get(j, p), round);
            for (i, (&g, &want)) in got.data.iter().zip(&reference).enumerate() {
                let (r, j) = (i / n, i % n);
                let bound = 1e-5 * (1.0 + want.abs()) * (k as f64).sqrt();
                // A NaN result compares as None: it fails too.
                let err = (g as f64 - want).abs();
                if !matches!(err.partial_cmp(&bound), Some(Less | Equal)) {
                    return Err(format!(
                        "{m}×{n}×{k} product with {} weights: element ({r}, {j}) is {g}, \
                         expected {want}",
                        weights.name(bf16)
                    ));
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::cpu::isa::Isa;

    #[test]
    fn every_host_variant_passes_and_a_wrong_product_fails() {
        for isa in Isa::ALL {
            match Kernels::unchecked(isa) {
                Ok(k) => assert_eq!(passed(k), Ok(()), "{isa}"),
                Err(e) => eprintln!("NOT RUN on this host: {isa}: {e}"),
            }
        }
        let k = Kernels::portable();
        let team = Team::new(1);
        // One element off by less than a bf16 ulp of the result (~5), and a NaN: both fail.
        let nudged = compare(k, |w, x| {
            let mut y = w.matmul_with(k, x, &team);
            y.data[5] += 1e-2;
            y
        });
        assert!(nudged.unwrap_err().contains("element (0, 5)"));
        let nan = compare(k, |w, x| {
            let mut y = w.matmul_with(k, x, &team);
            let last = y.data.len() - 1;
            y.data[last] = f32::NAN;
            y
        });
        assert!(nan.unwrap_err().contains("is NaN"));
        // The INT4 decode rows are checked too: a product off on them alone fails, naming them.
        let int4 = compare(k, |w, x| {
            let mut y = w.matmul_with(k, x, &team);
            if w.is_int4() && x.rows_cols().0 == 1 {
                y.data[3] += 1e-2;
            }
            y
        });
        assert!(int4
            .unwrap_err()
            .contains("1×16×64 product with INT4 weights: element (0, 3)"));
    }
}
