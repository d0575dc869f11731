//! Communication and memory against theory for the shipped presets.

use std::path::Path;
use tpc::frontend::load::load_model;
use tpc::frontend::{Family, ModelDef};
use tpc::pipeline::compile;
use tpc::plan::report::summarize;
use tpc::plan::Plan;

fn plan_for(model: &str, tp: u64) -> Plan {
    let def = load_model(Path::new(model)).unwrap();
    compile(&def, tp).unwrap().plan
}

fn count(plan: &Plan, kind: &str, in_layer: bool) -> usize {
    plan.collectives
        .iter()
        .filter(|c| c.kind == kind && c.layer.is_some() == in_layer)
        .count()
}

#[test]
fn llama3_70b_at_tp8_reduces_twice_per_layer() {
    let plan = plan_for("models/llama3-70b.ron", 8);
    let layer_ars: Vec<_> = plan
        .collectives
        .iter()
        .filter(|c| c.kind == "all_reduce" && c.layer.is_some())
        .collect();
    assert_eq!(layer_ars.len(), 160);
    for c in &layer_ars {
        assert_eq!(c.elements_per_token, 8192, "{}", c.name);
        assert_eq!(c.bytes_per_token, 16384, "{}", c.name);
        // Ring all-reduce: each rank sends 2(N-1)/N of the message.
        assert_eq!(c.ring_wire_bytes_per_token, 16384 * 2 * 7 / 8);
    }
    for layer in 0..80 {
        let n = layer_ars.iter().filter(|c| c.layer == Some(layer)).count();
        assert_eq!(n, 2, "layer {layer}");
    }
    assert_eq!(count(&plan, "all_reduce", false), 1, "embedding all-reduce");
    assert_eq!(count(&plan, "all_gather", false), 1, "logits all-gather");
    assert_eq!(count(&plan, "all_gather", true), 0);
    assert_eq!(
        count(&plan, "reduce_scatter", true) + count(&plan, "reduce_scatter", false),
        0
    );
    let gather = plan
        .collectives
        .iter()
        .find(|c| c.kind == "all_gather")
        .unwrap();
    assert_eq!(gather.elements_per_token, 128256);
    assert_eq!(plan.collectives.len(), 162);
}

#[test]
fn pythia_parallel_residual_reduces_once_per_layer() {
    for tp in [2, 4, 8, 16] {
        let plan = plan_for("models/pythia-1.4b.ron", tp);
        for layer in 0..24 {
            let n = plan
                .collectives
                .iter()
                .filter(|c| c.layer == Some(layer))
                .count();
            assert_eq!(n, 1, "tp={tp} layer {layer}");
        }
        assert_eq!(count(&plan, "all_reduce", true), 24);
        assert_eq!(plan.collectives.len(), 26, "tp={tp}");
    }
}

#[test]
fn sequential_residual_families_reduce_twice_per_layer() {
    for (model, layers) in [
        ("models/llama3-8b.ron", 32),
        ("models/mistral-7b.ron", 32),
        ("models/qwen2-7b.ron", 28),
        ("models/qwen3-32b.ron", 64),
        ("models/gpt2.ron", 12),
    ] {
        let plan = plan_for(model, 2);
        assert_eq!(count(&plan, "all_reduce", true), 2 * layers, "{model}");
        assert_eq!(count(&plan, "all_reduce", false), 1, "{model}");
        assert_eq!(count(&plan, "all_gather", false), 1, "{model}");
        assert_eq!(plan.collectives.len(), 2 * layers + 2, "{model}");
    }
}

#[test]
fn tp1_has_no_collectives() {
    let plan = plan_for("models/llama3-8b.ron", 1);
    assert!(plan.collectives.is_empty());
    assert_eq!(plan.ranks.len(), 1);
}

/// Bytes every rank holds, from the preset's hyper-parameters alone (not from the plan):
/// replicated tensors once per rank, split tensors divided (padded vocab rows included),
/// kv heads replicated when tp exceeds them, biases of row-split linears on rank 0 only.
fn expected_total_bytes(def: &ModelDef, tp: u64) -> u64 {
    let ModelDef::Preset(c) = def else {
        panic!("preset expected")
    };
    let h = c.hidden_size;
    let heads = c.num_attention_heads;
    let kv = c.num_key_value_heads.unwrap_or(heads);
    let hd = c.head_dim.unwrap_or(h / heads);
    let ffn = c.intermediate_size;
    let vocab_padded = c.vocab_size.div_ceil(tp) * tp;
    // Heads held over all ranks, padding included: tp pieces of the largest share.
    let even = heads % tp == 0 && (kv % tp == 0 || tp.is_multiple_of(kv));
    let q_total = if even {
        heads
    } else if tp < kv {
        tp * kv.div_ceil(tp) * (heads / kv)
    } else {
        tp * (heads / kv).div_ceil(tp / kv)
    };
    let kv_total = if kv % tp == 0 {
        kv
    } else if tp < kv {
        tp * kv.div_ceil(tp)
    } else {
        tp
    };
    // MLP columns held over all ranks: blocks of gcd(ffn, 64) dealt unevenly.
    let atom = if ffn % 32 == 0 && ffn / 32 >= 64 {
        ffn / 32
    } else {
        [64, 32, 16, 8, 4, 2]
            .into_iter()
            .find(|b| ffn % b == 0)
            .unwrap_or(1)
    };
    let ffn = if ffn % tp == 0 {
        ffn
    } else {
        tp * (ffn / atom).div_ceil(tp) * atom
    };
    let size = c.dtype.size_bytes();
    let family = c.family;
    let (per_layer, other) = match family {
        Family::Llama | Family::Qwen2 | Family::Qwen3 => {
            let norms = 2 * h * tp;
            let attn = h * q_total * hd * 2 + 2 * h * kv_total * hd;
            let bias = if family == Family::Qwen2 {
                q_total * hd + 2 * kv_total * hd
            } else {
                0
            };
            let qk_norm = if family == Family::Qwen3 {
                2 * hd * tp
            } else {
                0
            };
            let mlp = 3 * h * ffn;
            let tie = c.tie_word_embeddings.unwrap_or(false);
            let head = if tie { 0 } else { vocab_padded * h };
            (
                norms + attn + bias + qk_norm + mlp,
                vocab_padded * h + head + h * tp,
            )
        }
        Family::Gpt2 => {
            let positions = c.max_position_embeddings.unwrap().div_ceil(tp) * tp;
            let norms = 4 * h * tp;
            // c_attn (+bias) split (each of q, k, v padded to the largest share of heads);
            // c_proj split by rows, its bias added (and held) on rank 0 only, because it is
            // added to partial sums; the same for the MLP.
            let aw = q_total * hd;
            let attn = 3 * h * aw + 3 * aw + aw * h + h;
            let mlp = h * ffn + ffn + ffn * h + h;
            (
                norms + attn + mlp,
                vocab_padded * h + positions * h + 2 * h * tp,
            )
        }
        Family::GptNeox => {
            let norms = 4 * h * tp;
            let aw = q_total * hd;
            let attn = 3 * h * aw + 3 * aw + aw * h + h;
            let mlp = h * ffn + ffn + ffn * h + h;
            (norms + attn + mlp, 2 * vocab_padded * h + 2 * h * tp)
        }
        Family::Mixtral | Family::Qwen3Moe | Family::Qwen2Moe | Family::Olmoe => {
            unreachable!(
                "the presets listed below are dense; mixture-of-experts ones have their own tests"
            )
        }
    };
    (per_layer * c.num_hidden_layers + other) * size
}

#[test]
fn param_bytes_per_rank_sum_to_the_model_for_every_preset_and_valid_tp() {
    let presets = [
        "models/llama3-8b.ron",
        "models/llama3-70b.ron",
        "models/llama3.1-405b.ron",
        "models/mistral-7b.ron",
        "models/qwen2-7b.ron",
        "models/qwen3-32b.ron",
        "models/gpt2.ron",
        "models/pythia-1.4b.ron",
        "models/tiny-llama.ron",
        "models/tiny-qwen2.ron",
        "models/tiny-qwen3.ron",
        "models/tiny-gpt2.ron",
        "models/tiny-neox.ron",
    ];
    for model in presets {
        let def = load_model(Path::new(model)).unwrap();
        let mut valid = 0;
        for tp in 1..=16u64 {
            let Ok(compiled) = compile(&def, tp) else {
                continue;
            };
            valid += 1;
            let s = summarize(&compiled.plan);
            assert_eq!(s.param_bytes_per_rank.len() as u64, tp);
            let total: u64 = s.param_bytes_per_rank.iter().sum();
            assert_eq!(total, expected_total_bytes(&def, tp), "{model} tp={tp}");
            if tp == 1 {
                assert_eq!(total, s.model_param_bytes, "{model}");
            }
        }
        assert!(
            valid >= 3,
            "{model} has only {valid} valid tp values up to 16"
        );
    }
}

#[test]
fn published_parameter_counts() {
    // Parameter counts of the unsplit models, as published (rounded).
    for (model, billions) in [
        ("models/llama3-8b.ron", 8.03),
        ("models/llama3-70b.ron", 70.55),
        ("models/llama3.1-405b.ron", 405.85),
        ("models/mistral-7b.ron", 7.24),
        ("models/qwen2-7b.ron", 7.62),
        ("models/qwen3-32b.ron", 32.76),
        ("models/pythia-1.4b.ron", 1.41),
    ] {
        let s = summarize(&plan_for(model, 1));
        let got = s.model_param_count as f64 / 1e9;
        assert!(
            (got - billions).abs() < 0.01 * billions,
            "{model}: {got:.3}B vs {billions}B"
        );
    }
    // GPT-2 small: 124.4M with the tied head counted once.
    let s = summarize(&plan_for("models/gpt2.ron", 1));
    assert_eq!(s.model_param_count, 124_439_808);
}

#[test]
fn kv_cache_per_rank_follows_kv_heads() {
    // Llama 3 70B: 80 layers × (k + v) × 8 kv heads × 128 × 2 bytes, split over ranks.
    let full = 80 * 2 * 8 * 128 * 2;
    for tp in [1u64, 2, 4, 8] {
        let s = summarize(&plan_for("models/llama3-70b.ron", tp));
        for &b in &s.kv_cache_bytes_per_token_per_rank {
            assert_eq!(b, full / tp, "tp={tp}");
        }
    }
    // tp=16 > 8 kv heads: each rank keeps one (replicated) kv head.
    let s = summarize(&plan_for("models/llama3-70b.ron", 16));
    assert!(s
        .kv_cache_bytes_per_token_per_rank
        .iter()
        .all(|&b| b == full / 8));
    assert!(s.notes.iter().any(|n| n.contains("replicated on 2 ranks")));
}
