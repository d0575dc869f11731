//! The α-β cost model of a plan on a hardware profile: per phase (a prefill of the whole
//! batch, one decode step), time split into compute, memory and communication, plus memory
//! per rank. Compute and memory overlap (a phase takes the larger), communication does not
//! (tensor-parallel collectives sit between dependent ops), nor does a profile's fixed cost
//! per op. On a shared host (`HwProfile::shared`) each rank gets its share of the host's
//! compute and bandwidth.

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

/// The number types a runtime computes a plan with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Numerics {
    /// Type the weights are held and read in.
    pub weights: DType,
    /// Type of the activations, the KV cache and the collectives' messages.
    pub activations: DType,
}

impl Numerics {
    /// The plan's own dtype throughout (what a GPU runtime does).
    pub fn of_plan(plan: &Plan) -> Numerics {
        Numerics {
            weights: plan.dtype,
            activations: plan.dtype,
        }
    }

    /// tpc's CPU runtime (`tpc run` / `tpc bench`): weights in bf16 or f32 as its `--dtype`
    /// chose; activations, the KV cache and collectives in f32 always.
    pub fn cpu_runtime(bf16_weights: bool) -> Numerics {
        Numerics {
            weights: if bf16_weights {
                DType::Bf16
            } else {
                DType::F32
            },
            activations: DType::F32,
        }
    }
}

/// Time of one phase, seconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PhaseTime {
    pub time_s: f64,
    pub compute_s: f64,
    pub memory_s: f64,
    pub comm_s: f64,
    /// The profile's fixed cost per op times the ops the rank runs.
    pub overhead_s: f64,
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
    /// Types of the weights and of the activations (KV cache, collectives) priced.
    pub weight_dtype: DType,
    pub activation_dtype: DType,
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
    /// Compute ops in its program (each pays the profile's fixed cost once per pass).
    ops: f64,
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
            if is_compute_op(&i.op) {
                w.ops += 1.0;
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

/// Ops that run a kernel on the rank's threads (not inputs, weights, views, outputs, or
/// collectives, which are priced by their α).
fn is_compute_op(op: &Op) -> bool {
    matches!(
        op,
        Op::Embedding(_)
            | Op::Linear(_)
            | Op::BiasAdd(_)
            | Op::Add(_)
            | Op::Mul(_)
            | Op::Activation(_)
            | Op::RmsNorm(_)
            | Op::LayerNorm(_)
            | Op::Rope(_)
            | Op::Attention(_)
    )
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

fn comm_s(plan: &Plan, hw: &HwProfile, tokens: f64, scale: f64) -> f64 {
    // An all-reduce runs the algorithm its plan recorded, else the cheapest.
    let recorded: std::collections::HashMap<u32, &crate::ir::AlgorithmChoice> = plan
        .ranks
        .first()
        .into_iter()
        .flat_map(|r| &r.instrs)
        .filter_map(|i| match &i.op {
            Op::AllReduce(a) => a.algorithm.as_ref().map(|c| (i.id, c)),
            Op::RmsNorm(n) => n
                .reduce_input
                .as_ref()
                .and_then(|a| a.algorithm.as_ref())
                .map(|c| (i.id, c)),
            _ => None,
        })
        .collect();
    plan.collectives
        .iter()
        .map(|c| {
            let bytes = c.bytes_per_token as f64 * tokens * scale;
            match c.kind.as_str() {
                "all_gather" => all_gather_s(&hw.link, plan.tp, bytes),
                "reduce_scatter" => all_gather_s(&hw.link, plan.tp, bytes),
                _ => match recorded.get(&c.id).and_then(|r| r.for_bytes(bytes as u64)) {
                    Some(a) => all_reduce_time(&hw.link, a, plan.tp, bytes),
                    None => all_reduce_s(&hw.link, plan.tp, bytes),
                },
            }
        })
        // From +0 (a sum of no f64 is -0, which prints as "-0.000 ms").
        .fold(0.0, |a, b| a + b)
}

fn phase(compute_s: f64, memory_s: f64, comm_s: f64, overhead_s: f64) -> PhaseTime {
    PhaseTime {
        time_s: compute_s.max(memory_s) + overhead_s + comm_s,
        compute_s,
        memory_s,
        comm_s,
        overhead_s,
    }
}

/// The estimate for `plan` running `work` on `hw`, in the plan's dtype throughout.
pub fn simulate(plan: &Plan, hw: &HwProfile, work: Workload) -> Estimate {
    simulate_as(plan, hw, work, Numerics::of_plan(plan))
}

/// The estimate for `plan` running `work` on `hw` with the number types `num`: weight bytes
/// scale from the plan's dtype to `num.weights`, KV and collective bytes to
/// `num.activations`; products run at the f32 peak when either operand is f32 on a device
/// without mixed products, i.e. at the bf16 peak only for bf16 weights.
pub fn simulate_as(plan: &Plan, hw: &HwProfile, work: Workload, num: Numerics) -> Estimate {
    let mut w = rank_work(plan);
    let plan_size = plan.dtype.size_bytes() as f64;
    let weight_scale = num.weights.size_bytes() as f64 / plan_size;
    let act_scale = num.activations.size_bytes() as f64 / plan_size;
    w.weight_bytes *= weight_scale;
    w.weight_read_bytes *= weight_scale;
    w.kv_bytes_per_token *= act_scale;
    let (peak, bandwidth) = hw.per_rank(plan.tp, num.weights == DType::F32);
    // Attention at its own measured rate where the profile has one (a rank's share of it
    // on a shared host), else at the GEMM peak.
    let attention_rate = match (hw.attention_flops, &hw.shared) {
        (Some(a), Some(h)) => a * h.compute_share(plan.tp),
        (Some(a), None) => a,
        (None, _) => peak,
    };
    let overhead = w.ops * hw.op_overhead_s;
    let (b, s, g) = (work.batch as f64, work.prompt as f64, work.gen as f64);

    // Prefill: every prompt token through every linear; causal attention over s(s+1)/2
    // pairs per sequence; weights read once, the prompt's keys and values written.
    let prefill_linear = w.linear_flops_per_token * b * s;
    let prefill_attention = w.attention_flops_per_pair * b * s * (s + 1.0) / 2.0;
    let prefill_bytes = w.weight_read_bytes + w.kv_bytes_per_token * b * s;
    let prefill = phase(
        prefill_linear / peak + prefill_attention / attention_rate,
        prefill_bytes / bandwidth,
        comm_s(plan, hw, b * s, act_scale),
        overhead,
    );

    // A decode step at the middle of generation: one token per sequence, attending to
    // about s + g/2 cached positions; all weights and that cache are read.
    let context = s + g / 2.0;
    let decode_linear = w.linear_flops_per_token * b;
    let decode_attention = w.attention_flops_per_pair * b * context;
    let decode_bytes = w.weight_read_bytes + w.kv_bytes_per_token * b * context;
    let decode_step = phase(
        decode_linear / peak + decode_attention / attention_rate,
        decode_bytes / bandwidth,
        comm_s(plan, hw, b, act_scale),
        overhead,
    );

    let kv_bytes = w.kv_bytes_per_token * b * (s + g);
    let memory = w.weight_bytes + kv_bytes;
    // Ranks on a shared host split its memory.
    let capacity = match hw.shared {
        Some(_) => hw.memory_bytes / plan.tp.max(1) as f64,
        None => hw.memory_bytes,
    };
    Estimate {
        model: plan.model.clone(),
        tp: plan.tp,
        hw: hw.name.clone(),
        weight_dtype: num.weights,
        activation_dtype: num.activations,
        prefill,
        decode_step,
        memory_per_rank_bytes: memory as u64,
        weight_bytes_per_rank: w.weight_bytes as u64,
        kv_bytes_per_rank: kv_bytes as u64,
        device_memory_bytes: capacity as u64,
        fits: memory <= capacity,
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
            op_overhead_s: 0.0,
            attention_flops: None,
            shared: None,
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

    fn tinyllama(tp: u64) -> Plan {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/models/tinyllama-1.1b.ron");
        let def = crate::frontend::load::load_model(std::path::Path::new(path)).unwrap();
        crate::pipeline::compile(&def, tp).unwrap().plan
    }

    #[test]
    fn ranks_on_a_two_core_host_get_half_its_compute_and_bandwidth() {
        let mut hw = flat_hw();
        hw.compute_efficiency = 1.0;
        hw.memory_efficiency = 1.0;
        hw.peak_flops_bf16 = 8e11;
        hw.memory_bandwidth = 2e10;
        hw.memory_bytes = 16e9;
        hw.op_overhead_s = 2e-6;
        hw.shared = Some(crate::cost::profile::SharedHost { cores: 2 });
        let work = Workload {
            batch: 1,
            prompt: 128,
            gen: 0,
        };
        let num = Numerics::cpu_runtime(true);
        let one = simulate_as(&tinyllama(1), &hw, work, num);
        let two = simulate_as(&tinyllama(2), &hw, work, num);
        // TinyLlama read whole per pass: 22 layers of q, k, v, o (2048², 256×2048 twice,
        // 2048²), gate, up, down (3 × 5632×2048) and two norms, the final norm and the
        // LM head (32000×2048); bf16. Keys and values: 22 layers × 2 × 256, f32.
        let layer = 2 * 2048 * 2048 + 2 * 256 * 2048 + 3 * 5632 * 2048;
        let read1 = 2.0 * (22 * (layer + 2 * 2048) + 2048 + 32000 * 2048) as f64;
        let kv1 = (22 * 2 * 256 * 4) as f64;
        let expect = (read1 + kv1 * 128.0) / 2e10;
        assert!(
            (one.decode_step.memory_s / expect - 1.0).abs() < 1e-12,
            "{one:?}"
        );
        // tp 2: linears and the head split in half, norms replicated, 2 of 4 kv heads; one
        // core and half the bandwidth each.
        let read2 = 2.0 * (22 * (layer / 2 + 2 * 2048) + 2048 + 16000 * 2048) as f64;
        let expect = (read2 + kv1 / 2.0 * 128.0) / 1e10;
        assert!(
            (two.decode_step.memory_s / expect - 1.0).abs() < 1e-12,
            "{two:?}"
        );
        // Prefill: half the FLOPs at half the rate take as long as tp 1's.
        let flops1 = 2.0 * (22 * layer + 32000 * 2048) as f64 * 128.0
            + 4.0 * (22 * 2048) as f64 * 128.0 * 129.0 / 2.0;
        assert!((one.prefill.compute_s / (flops1 / 8e11) - 1.0).abs() < 1e-12);
        assert!((two.prefill.compute_s / (flops1 / 2.0 / 4e11) - 1.0).abs() < 1e-12);
        // 355 ops per pass (7 linears, 2 norms, 2 ropes, 2 adds, attention, activation,
        // mul per layer; embedding, final norm, head), 2 µs each.
        assert!(
            (one.decode_step.overhead_s - 355.0 * 2e-6).abs() < 1e-12,
            "{one:?}"
        );
        assert_eq!(one.decode_step.comm_s, 0.0);
        // Collectives carry f32: 45 all-reduces of 2048 f32 and the logits gather.
        assert!(two.decode_step.comm_s >= 45.0 * hw.link.one_shot.alpha_s);
        let t = &two.decode_step;
        assert_eq!(
            t.time_s,
            t.compute_s.max(t.memory_s) + t.overhead_s + t.comm_s
        );
        // With an attention rate of its own, attention's FLOPs are priced at it.
        hw.attention_flops = Some(1e10);
        let slow = simulate_as(&tinyllama(2), &hw, work, num);
        let attention = 4.0 * (22 * 1024) as f64 * 128.0 * 129.0 / 2.0;
        let linear = (22 * layer / 2 + 16000 * 2048) as f64 * 2.0 * 128.0;
        let expect = linear / 4e11 + attention / 5e9;
        assert!(
            (slow.prefill.compute_s / expect - 1.0).abs() < 1e-12,
            "{slow:?}"
        );
        // The host's 16 GB are shared by the ranks.
        assert_eq!(two.device_memory_bytes, 8_000_000_000);
        assert_eq!(two.weight_dtype, DType::Bf16);
        assert_eq!(two.activation_dtype, DType::F32);
    }

    #[test]
    fn f32_weights_double_the_bytes_and_use_the_f32_peak() {
        let hw = flat_hw();
        let work = Workload {
            batch: 1,
            prompt: 16,
            gen: 0,
        };
        let plan = tinyllama(1);
        let bf = simulate_as(&plan, &hw, work, Numerics::cpu_runtime(true));
        let f = simulate_as(&plan, &hw, work, Numerics::cpu_runtime(false));
        assert_eq!(f.weight_bytes_per_rank, 2 * bf.weight_bytes_per_rank);
        assert!((f.prefill.compute_s / bf.prefill.compute_s - 10.0).abs() < 1e-9);
        assert_eq!(simulate(&plan, &hw, work).weight_dtype, DType::Bf16);
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
