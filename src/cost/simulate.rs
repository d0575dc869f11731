//! The α-β cost model of a plan on a hardware profile: per phase (a prefill of the whole
//! batch, one decode step), time split into compute, memory and communication, plus memory
//! per rank. Compute and memory overlap (a phase takes the larger), communication does not
//! (tensor-parallel collectives sit between dependent ops).

use super::algorithms::all_reduce_time;
use super::profile::HwProfile;
use crate::ir::{DType, Op};
use crate::plan::Plan;
use serde::Serialize;

/// What is run: `batch` sequences of `prompt` tokens, each generating `gen` more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Workload {
    pub batch: u64,
    pub prompt: u64,
    pub gen: u64,
}

/// Time of one phase, seconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PhaseTime {
    pub time_s: f64,
    pub compute_s: f64,
    pub memory_s: f64,
    pub comm_s: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TokensPerS {
    pub prefill: f64,
    pub decode: f64,
}

/// The model's estimate for one plan, workload and profile.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Estimate {
    pub model: String,
    pub tp: u64,
    pub hw: String,
    pub prefill: PhaseTime,
    pub decode_step: PhaseTime,
    /// Weights plus the KV cache at the end of generation, on the fullest rank.
    pub memory_per_rank_bytes: u64,
    pub weight_bytes_per_rank: u64,
    pub kv_bytes_per_rank: u64,
    pub device_memory_bytes: u64,
    pub fits: bool,
    pub tokens_per_s: TokensPerS,
}

/// Per-token work of the fullest rank, read off its program.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct RankWork {
    /// FLOPs of its linears per token (2 per weight element).
    linear_flops_per_token: f64,
    /// FLOPs per (query, key) pair summed over its attention ops (4 per head and dim:
    /// scores and weighted values).
    attention_flops_per_pair: f64,
    weight_bytes: f64,
    /// Bytes of the weights a forward pass reads whole (all but embedding tables, which are
    /// read by row; a table tied to the LM head is read whole).
    weight_read_bytes: f64,
    kv_bytes_per_token: f64,
}

fn rank_work(plan: &Plan) -> RankWork {
    // Weight and KV bytes per rank are the compile report's own figures.
    let summary = crate::plan::report::summarize(plan);
    let mut fullest = RankWork::default();
    for (rank, r) in plan.ranks.iter().enumerate() {
        let facts: std::collections::HashMap<u32, _> =
            r.instrs.iter().map(|i| (i.id, &i.fact)).collect();
        let elements = |id: Option<&u32>| {
            id.and_then(|id| facts.get(id))
                .map_or(0.0, |f| f.shape.fixed_elements() as f64)
        };
        let mut w = RankWork::default();
        let mut read_whole = std::collections::HashSet::new();
        for i in &r.instrs {
            for (slot, id) in i.inputs.iter().enumerate() {
                if !(matches!(i.op, Op::Embedding(_)) && slot == 1) {
                    read_whole.insert(*id);
                }
            }
        }
        let slice_bytes: std::collections::HashMap<&str, f64> = r
            .weights
            .iter()
            .map(|s| (&*s.tensor, s.local_bytes() as f64))
            .collect();
        for i in &r.instrs {
            if let Op::Param(p) = &i.op {
                if read_whole.contains(&i.id) {
                    w.weight_read_bytes += slice_bytes.get(&*p.tensor).copied().unwrap_or(0.0);
                }
            }
            match &i.op {
                Op::Linear(_) => w.linear_flops_per_token += 2.0 * elements(i.inputs.get(1)),
                Op::Attention(_) => w.attention_flops_per_pair += 4.0 * elements(i.inputs.first()),
                _ => {}
            }
        }
        w.weight_bytes = summary.param_bytes_per_rank[rank] as f64;
        w.kv_bytes_per_token = summary.kv_cache_bytes_per_token_per_rank[rank] as f64;
        if w.weight_bytes + w.kv_bytes_per_token > fullest.weight_bytes + fullest.kv_bytes_per_token
        {
            fullest = w;
        }
    }
    fullest
}

/// Time of one all-reduce of `bytes` over `p` ranks with the cheapest algorithm.
pub fn all_reduce_s(link: &super::profile::LinkCosts, p: u64, bytes: f64) -> f64 {
    super::algorithms::cheapest_all_reduce(link, p, bytes).1
}

/// Time of one all-gather whose result is `bytes` over `p` ranks (ring).
fn all_gather_s(link: &super::profile::LinkCosts, p: u64, bytes: f64) -> f64 {
    if p <= 1 {
        return 0.0;
    }
    let p = p as f64;
    link.ring.alpha_s * (p - 1.0) + (p - 1.0) / p * bytes / link.ring.beta_bytes_per_s
}

fn comm_s(plan: &Plan, hw: &HwProfile, tokens: f64) -> f64 {
    // An all-reduce runs the algorithm its plan recorded, else the cheapest.
    let recorded: std::collections::HashMap<u32, &crate::ir::AlgorithmChoice> = plan
        .ranks
        .first()
        .into_iter()
        .flat_map(|r| &r.instrs)
        .filter_map(|i| match &i.op {
            Op::AllReduce(a) => a.algorithm.as_ref().map(|c| (i.id, c)),
            _ => None,
        })
        .collect();
    plan.collectives
        .iter()
        .map(|c| {
            let bytes = c.bytes_per_token as f64 * tokens;
            match c.kind.as_str() {
                "all_gather" => all_gather_s(&hw.link, plan.tp, bytes),
                "reduce_scatter" => all_gather_s(&hw.link, plan.tp, bytes),
                _ => match recorded.get(&c.id).and_then(|r| r.for_bytes(bytes as u64)) {
                    Some(a) => all_reduce_time(&hw.link, a, plan.tp, bytes),
                    None => all_reduce_s(&hw.link, plan.tp, bytes),
                },
            }
        })
        .sum()
}

fn phase(compute_s: f64, memory_s: f64, comm_s: f64) -> PhaseTime {
    PhaseTime {
        time_s: compute_s.max(memory_s) + comm_s,
        compute_s,
        memory_s,
        comm_s,
    }
}

/// The estimate for `plan` running `work` on `hw`.
pub fn simulate(plan: &Plan, hw: &HwProfile, work: Workload) -> Estimate {
    let w = rank_work(plan);
    let peak = match plan.dtype {
        DType::F32 => hw.peak_flops_f32,
        _ => hw.peak_flops_bf16,
    } * hw.compute_efficiency;
    let bandwidth = hw.memory_bandwidth * hw.memory_efficiency;
    let (b, s, g) = (work.batch as f64, work.prompt as f64, work.gen as f64);

    // Prefill: every prompt token through every linear; causal attention over s(s+1)/2
    // pairs per sequence; weights read once, the prompt's keys and values written.
    let prefill_flops =
        w.linear_flops_per_token * b * s + w.attention_flops_per_pair * b * s * (s + 1.0) / 2.0;
    let prefill_bytes = w.weight_read_bytes + w.kv_bytes_per_token * b * s;
    let prefill = phase(
        prefill_flops / peak,
        prefill_bytes / bandwidth,
        comm_s(plan, hw, b * s),
    );

    // A decode step at the middle of generation: one token per sequence, attending to
    // about s + g/2 cached positions; all weights and that cache are read.
    let context = s + g / 2.0;
    let decode_flops = w.linear_flops_per_token * b + w.attention_flops_per_pair * b * context;
    let decode_bytes = w.weight_read_bytes + w.kv_bytes_per_token * b * context;
    let decode_step = phase(
        decode_flops / peak,
        decode_bytes / bandwidth,
        comm_s(plan, hw, b),
    );

    let kv_bytes = w.kv_bytes_per_token * b * (s + g);
    let memory = w.weight_bytes + kv_bytes;
    Estimate {
        model: plan.model.clone(),
        tp: plan.tp,
        hw: hw.name.clone(),
        prefill,
        decode_step,
        memory_per_rank_bytes: memory as u64,
        weight_bytes_per_rank: w.weight_bytes as u64,
        kv_bytes_per_rank: kv_bytes as u64,
        device_memory_bytes: hw.memory_bytes as u64,
        fits: memory <= hw.memory_bytes,
        tokens_per_s: TokensPerS {
            prefill: b * s / prefill.time_s,
            decode: b / decode_step.time_s,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::profile::{AlphaBeta, LinkCosts};

    fn flat_hw() -> HwProfile {
        let ab = AlphaBeta {
            alpha_s: 1e-5,
            beta_bytes_per_s: 1e11,
        };
        HwProfile {
            name: "test".into(),
            sources: vec![],
            devices: 8,
            memory_bytes: 80e9,
            peak_flops_bf16: 1e15,
            peak_flops_f32: 1e14,
            memory_bandwidth: 2e12,
            compute_efficiency: 0.5,
            memory_efficiency: 0.5,
            link: LinkCosts {
                ring: ab,
                one_shot: ab,
                two_shot: ab,
                send_recv: ab,
            },
        }
    }

    fn plan(tp: u64) -> Plan {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/models/llama3-8b.ron");
        let def = crate::frontend::load::load_model(std::path::Path::new(path)).unwrap();
        crate::pipeline::compile(&def, tp).unwrap().plan
    }

    #[test]
    fn llama3_8b_decode_is_memory_bound_and_matches_hand_arithmetic() {
        let hw = flat_hw();
        let work = Workload {
            batch: 1,
            prompt: 128,
            gen: 0,
        };
        let e = simulate(&plan(1), &hw, work);
        // 8.03 B parameters in bf16 held.
        let weights = 8.03e9 * 2.0;
        assert!((e.weight_bytes_per_rank as f64 / weights - 1.0).abs() < 0.01);
        // Decode at batch 1: memory time = weights read / (2e12 · 0.5), no communication;
        // the embedding table (128256 × 4096, untied) is read by row, not whole.
        assert_eq!(e.decode_step.comm_s, 0.0);
        let expect = (weights - 128256.0 * 4096.0 * 2.0) / 1e12;
        assert!(
            (e.decode_step.memory_s / expect - 1.0).abs() < 0.02,
            "{e:?}"
        );
        assert_eq!(e.decode_step.time_s, e.decode_step.memory_s);
        // Prefill of 128 tokens: compute about 2 · 7.5e9 (non-embedding) · 128 / 5e14.
        let linear_params = 8.03e9 - 128256.0 * 4096.0;
        let expect = 2.0 * linear_params * 128.0 / 5e14;
        assert!((e.prefill.compute_s / expect - 1.0).abs() < 0.05, "{e:?}");
        assert!(e.fits);
    }

    #[test]
    fn tensor_parallelism_splits_weights_and_adds_communication() {
        let hw = flat_hw();
        let work = Workload {
            batch: 1,
            prompt: 128,
            gen: 128,
        };
        let one = simulate(&plan(1), &hw, work);
        let eight = simulate(&plan(8), &hw, work);
        let ratio = one.weight_bytes_per_rank as f64 / eight.weight_bytes_per_rank as f64;
        assert!(ratio > 7.0 && ratio <= 8.0, "{ratio}");
        assert!(eight.decode_step.comm_s > 0.0);
        // 65 all-reduces of 8 KiB and one logits gather per decode step: each at least α.
        assert!(eight.decode_step.comm_s >= 65.0 * hw.link.ring.alpha_s);
        assert!(eight.decode_step.memory_s < one.decode_step.memory_s / 7.0);
    }

    #[test]
    fn a_plan_that_does_not_fit_says_so() {
        let mut hw = flat_hw();
        hw.memory_bytes = 1e9;
        let e = simulate(
            &plan(1),
            &hw,
            Workload {
                batch: 1,
                prompt: 16,
                gen: 16,
            },
        );
        assert!(!e.fits);
    }
}
