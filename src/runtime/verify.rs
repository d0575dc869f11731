//! `tpc verify`: the same inputs through tp=1 and tp=N, compared.

use super::cpu::CpuOptions;
use super::error::Result;
use super::generate::{plan_vocab, Device, RunOptions};
use super::random::RandomWeights;
use super::run::run;
use super::sampling::Rng;
use super::weights::WeightSource;
use crate::plan::Plan;
use serde::Serialize;

/// The tolerance on the relative error ‖a − b‖ / ‖b‖ of the prompt logits (f32 compute).
pub const VERIFY_TOLERANCE: f64 = 1e-4;

/// Tokens each side generates after the prompt (their greedy choices are compared too).
pub const VERIFY_NEW_TOKENS: usize = 4;

#[derive(Debug, Clone, Serialize)]
pub struct VerifyReport {
    pub tp: u64,
    /// The linear kernels both sides ran (ones that keep activations f32).
    pub isa: String,
    pub prompt: Vec<i64>,
    pub max_abs_error: f64,
    /// ‖a − b‖ / ‖b‖ over all prompt logits.
    pub rel_error: f64,
    /// Largest |a − b| / (|b| + 1e-6·max|b|), elementwise.
    pub max_elementwise_rel_error: f64,
    pub tolerance: f64,
    pub tokens_tp1: Vec<i64>,
    pub tokens_tpn: Vec<i64>,
    /// Whether every prompt logit is the same bits on both sides.
    pub bitwise_equal: bool,
    /// `--numerics invariant`: the sides must be the same bits, not merely close.
    pub invariant: bool,
    /// The first prompt logit whose bits differ (row, column, tp=1's value, tp=N's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_difference: Option<(usize, usize, f32, f32)>,
    pub passed: bool,
}

/// Compares the tp=1 plan `one` with `many` (any tp, stages or not) on a seeded prompt of
/// `prompt_len` tokens, both on `device`, with the given weights or seeded random ones. The
/// caller compiles (or loads) both plans: the runtime takes plans only.
pub fn verify_plans(
    one: &Plan,
    many: &Plan,
    weights: Option<&dyn WeightSource>,
    seed: u64,
    prompt_len: usize,
    device: &Device,
) -> Result<VerifyReport> {
    let tp = many.tp;
    let random;
    let weights: &dyn WeightSource = match weights {
        Some(w) => w,
        None => {
            random = RandomWeights::new(one, seed);
            &random
        }
    };
    let vocab = plan_vocab(one)?;
    let mut rng = Rng::new(seed ^ 0x5EED);
    let prompt: Vec<i64> = (0..prompt_len.max(1))
        .map(|_| (rng.next_f64() * vocab as f64) as i64)
        .collect();
    // The sharding is what is checked: kernels that keep activations f32 (see
    // `Kernels::exact`), so that only the order of f32 sums differs between the sides.
    let device = match device {
        Device::Cpu(cpu) => Device::Cpu(CpuOptions {
            isa: Some(crate::runtime::cpu::isa::Kernels::exact().isa()),
            ..cpu.clone()
        }),
        other => other.clone(),
    };
    let opts = RunOptions {
        device,
        max_new_tokens: VERIFY_NEW_TOKENS,
        ..Default::default()
    };
    // tp=1 first: a request the model cannot run (its window, its positions) is refused by
    // the plan compiled from the model before anything is loaded.
    let b = run(one, weights, &prompt, &opts)?;
    let a = run(many, weights, &prompt, &opts)?;
    let (x, y) = (&a.prompt_logits.data, &b.prompt_logits.data);
    let max_b = y.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
    let mut max_abs = 0f64;
    let mut max_rel = 0f64;
    let (mut diff2, mut norm2) = (0f64, 0f64);
    for (&p, &q) in x.iter().zip(y) {
        let d = (p as f64 - q as f64).abs();
        max_abs = max_abs.max(d);
        max_rel = max_rel.max(d / (q.abs() as f64 + 1e-6 * max_b));
        diff2 += d * d;
        norm2 += (q as f64) * (q as f64);
    }
    let rel = (diff2 / norm2.max(f64::MIN_POSITIVE)).sqrt();
    let vocab_cols = a.prompt_logits.data.len() / prompt.len().max(1);
    let first_difference = x
        .iter()
        .zip(y)
        .position(|(p, q)| p.to_bits() != q.to_bits())
        .map(|i| (i / vocab_cols.max(1), i % vocab_cols.max(1), y[i], x[i]));
    let bitwise_equal = first_difference.is_none() && x.len() == y.len();
    let invariant = many.numerics == crate::ir::NumericsMode::Invariant;
    Ok(VerifyReport {
        tp,
        isa: match &opts.device {
            Device::Cpu(cpu) => cpu.isa.map_or_else(String::new, |i| i.name().to_string()),
            Device::Cuda(_) => "cuda".to_string(),
        },
        prompt,
        max_abs_error: max_abs,
        rel_error: rel,
        max_elementwise_rel_error: max_rel,
        tolerance: VERIFY_TOLERANCE,
        passed: rel <= VERIFY_TOLERANCE
            && a.generated == b.generated
            && (bitwise_equal || !invariant),
        bitwise_equal,
        invariant,
        first_difference,
        tokens_tp1: b.generated,
        tokens_tpn: a.generated,
    })
}
