//! The start-up self-check a variant passes before it is used: small products through its
//! prompt GEMM and decode GEMV, for both weight types, against an f64 reference of the same
//! (rounded, where the variant rounds) operands. A wrong result here means a kernel bug or a
//! CPU/OS that misreports a feature: the variant is then not used. The checked choices of
//! [`Kernels`] (`select`, `detect`, `exact`) live here, above both the kernels and the
//! packed weights the check multiplies.

use super::isa::{round_bf16, widen, Isa, KernelError, Kernels};
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

/// Operands of a check: `m × k` activations and `n · k` weight values, in [-1, 1].
pub(crate) fn operands(m: usize, n: usize, k: usize) -> (Tensor, Vec<f32>) {
    let x = (0..m * k)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
        .collect();
    let w = (0..n * k)
        .map(|i| ((i * 53 % 97) as f32 - 48.0) / 97.0)
        .collect();
    (Tensor::new(vec![m, k], x), w)
}

/// `x · wᵀ` in f64, with `x` rounded to bf16 first when `round` (as the bf16-product
/// variants do).
pub(crate) fn reference(x: &Tensor, w: &PackedMatrix, round: bool) -> Vec<f64> {
    let (m, k) = x.rows_cols();
    let xv = |i: usize| {
        let v = x.data[i];
        if round {
            widen(round_bf16(v))
        } else {
            v
        }
    };
    (0..m * w.n)
        .map(|i| {
            let (r, j) = (i / w.n, i % w.n);
            (0..k)
                .map(|p| xv(r * k + p) as f64 * w.get(j, p) as f64)
                .sum()
        })
        .collect()
}

/// `product` against the reference of `kernels`' rounding, on every shape and weight type.
fn compare(
    kernels: Kernels,
    product: impl Fn(&PackedMatrix, &Tensor) -> Tensor,
) -> Result<(), String> {
    for (m, n, k) in SHAPES {
        let (x, w) = operands(m, n, k);
        let w = Tensor::new(vec![n, k], w);
        // FP8 codes too: every code but the NaNs, in blocks of 8 steps whose power-of-two
        // scales keep the values bf16 (so the bf16 products round the activations only).
        let kblock = 8;
        let codes: Vec<u8> = (0..n * k)
            .map(|i| match (i * 53 % 251) as u8 {
                b if b & 0x7f == 0x7f => 0,
                b => b,
            })
            .collect();
        let scales: Vec<f32> = (0..n * k.div_ceil(kblock))
            .map(|i| [0.25, 0.5, 0.0625][i % 3])
            .collect();
        for (bf16, fp8) in [(false, false), (true, false), (false, true), (true, true)] {
            let packed = if fp8 {
                PackedMatrix::from_codes(n, k, &codes, &scales, kblock, bf16)
            } else {
                PackedMatrix::pack(&w, WeightOrder::OutIn, bf16)
            };
            let got = product(&packed, &x);
            // FP8 decode rows keep f32 activations; FP8 prompts take the bf16 products.
            let round = if fp8 {
                bf16 && m > kernels.gemv_max_rows(false)
                    && kernels.gemm_variant(true).bf16_activations()
            } else {
                bf16 && kernels.isa().bf16_activations()
            };
            let reference = reference(&x, &packed, round);
            for (i, (&g, &want)) in got.data.iter().zip(&reference).enumerate() {
                let (r, j) = (i / n, i % n);
                let bound = 1e-5 * (1.0 + want.abs()) * (k as f64).sqrt();
                // A NaN result compares as None: it fails too.
                let err = (g as f64 - want).abs();
                if !matches!(err.partial_cmp(&bound), Some(Less | Equal)) {
                    return Err(format!(
                        "{m}×{n}×{k} product with {} weights: element ({r}, {j}) is {g}, \
                         expected {want}",
                        match (fp8, bf16) {
                            (true, _) => "FP8",
                            (false, true) => "bf16",
                            (false, false) => "f32",
                        }
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
    }
}
