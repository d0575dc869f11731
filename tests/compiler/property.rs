//! Property tests: random small presets of every family, compiled for every tp from 1 to 16.
//!
//! What a correct plan must look like is derived here from the preset's dimensions alone
//! (Megatron-style sharding as the README and the architecture notes describe it), never
//! from the plan under test: which tensors exist, their shapes, which dim each is split on,
//! which tp values are feasible, the parameter count and the collectives per layer.

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use std::collections::{BTreeMap, BTreeSet};
use tpc::frontend::load::ron_options;
use tpc::frontend::{Family, FamilyConfig, ModelDef, TpWord};
use tpc::ir::verify::verify;
use tpc::ir::{DType, Layout};
use tpc::passes::partial_check::linear_in;
use tpc::pipeline::{compile, Compiled};
use tpc::plan::report::summarize;
use tpc::plan::text::render_plan;
use tpc::plan::WeightSlice;
use tpc::TpcError;

/// Every model is compiled for each tp in `1..=MAX_TP`.
const MAX_TP: u64 = 16;
/// The compiler lists valid tp values up to this bound in its infeasibility error.
const MAX_LISTED_TP: u64 = 1024;

// ---------------------------------------------------------------------------------------
// Generators
// ---------------------------------------------------------------------------------------

fn blank(family: Family) -> FamilyConfig {
    FamilyConfig {
        family,
        name: None,
        hidden_size: 0,
        intermediate_size: 0,
        num_hidden_layers: 0,
        num_attention_heads: 0,
        num_key_value_heads: None,
        head_dim: None,
        vocab_size: 0,
        max_position_embeddings: None,
        norm_eps: None,
        rope_theta: None,
        rope_scaling: None,
        rotary_pct: None,
        attention_bias: None,
        tie_word_embeddings: None,
        use_parallel_residual: None,
        hidden_act: None,
        sliding_window: None,
        dtype: DType::Bf16,
        tp_plan: BTreeMap::new(),
        moe: None,
        quantization: None,
    }
}

/// Layers, intermediate size, vocabulary and dtype, shared by every family. Sizes are
/// either free (few tp values divide them) or multiples of 16 (every tp up to 16 does).
fn common() -> impl Strategy<Value = (u64, u64, u64, DType)> {
    (
        1u64..=3,
        prop_oneof![1u64..=96, (1u64..=6).prop_map(|k| 16 * k)],
        prop_oneof![1u64..=300, (1u64..=16).prop_map(|k| 16 * k)],
        prop_oneof![Just(DType::Bf16), Just(DType::F16), Just(DType::F32)],
    )
}

fn apply_common(c: &mut FamilyConfig, (layers, ffn, vocab, dtype): (u64, u64, u64, DType)) {
    c.num_hidden_layers = layers;
    c.intermediate_size = ffn;
    c.vocab_size = vocab;
    c.dtype = dtype;
}

/// Llama, Qwen2 and Qwen3: grouped kv heads. Qwen3 always states head_dim; any of them may
/// have a head_dim other than hidden / heads (Qwen3, Mistral-Nemo style), stated explicitly.
fn llama_like() -> impl Strategy<Value = FamilyConfig> {
    (
        prop_oneof![
            Just(Family::Llama),
            Just(Family::Qwen2),
            Just(Family::Qwen3)
        ],
        common(),
        1u64..=4,      // kv heads
        1u64..=4,      // query heads per kv head
        any::<bool>(), // leave num_key_value_heads unset when it equals the head count
        1u64..=8,      // head_dim / 2
        any::<bool>(), // hidden = heads * head_dim
        2u64..=64,     // otherwise this hidden size, with an explicit head_dim
        any::<Option<bool>>(),
        any::<Option<bool>>(),
    )
        .prop_map(
            |(family, com, kv, group, omit_kv, half, hidden_is_heads, free_hidden, tie, bias)| {
                let mut c = blank(family);
                apply_common(&mut c, com);
                let heads = kv * group;
                let hd = 2 * half;
                c.num_attention_heads = heads;
                c.num_key_value_heads = if omit_kv && group == 1 {
                    None
                } else {
                    Some(kv)
                };
                if hidden_is_heads {
                    c.hidden_size = heads * hd;
                    c.head_dim = (family == Family::Qwen3).then_some(hd);
                } else {
                    c.hidden_size = free_hidden;
                    c.head_dim = Some(hd);
                }
                c.tie_word_embeddings = tie;
                c.attention_bias = bias;
                c
            },
        )
}

/// GPT-2: head_dim = hidden / heads (odd allowed, no rotary), learned positions, tied head.
fn gpt2() -> impl Strategy<Value = FamilyConfig> {
    (
        common(),
        1u64..=8,
        1u64..=12,
        proptest::option::of(1u64..=64),
        prop_oneof![Just(None), Just(Some(true))],
    )
        .prop_map(|(com, heads, hd, positions, tie)| {
            let mut c = blank(Family::Gpt2);
            apply_common(&mut c, com);
            c.num_attention_heads = heads;
            c.hidden_size = heads * hd;
            c.max_position_embeddings = positions;
            c.tie_word_embeddings = tie;
            c
        })
}

/// GPT-NeoX: per-head fused qkv, partial rotary (an even number of rotary dims), parallel or
/// sequential residual.
fn neox() -> impl Strategy<Value = FamilyConfig> {
    (
        common(),
        1u64..=8,
        1u64..=8,
        proptest::option::of(1u64..=8),
        any::<Option<bool>>(),
        any::<Option<bool>>(),
        any::<Option<bool>>(),
    )
        .prop_map(|(com, heads, half, rot_half, tie, bias, parallel)| {
            let mut c = blank(Family::GptNeox);
            apply_common(&mut c, com);
            let hd = 2 * half;
            c.num_attention_heads = heads;
            c.hidden_size = heads * hd;
            // Unset only where any plausible default (all of each head, or HF's quarter)
            // rotates an even number of dims; otherwise an exact even fraction.
            c.rotary_pct = match rot_half {
                None if hd % 8 == 0 => None,
                r => Some((2 * r.unwrap_or(half).min(half)) as f64 / hd as f64),
            };
            c.tie_word_embeddings = tie;
            c.attention_bias = bias;
            c.use_parallel_residual = parallel;
            c
        })
}

/// Every family about equally often.
fn any_model() -> impl Strategy<Value = FamilyConfig> {
    prop_oneof![3 => llama_like(), 1 => gpt2(), 1 => neox()]
}

fn ron_of(c: &FamilyConfig) -> String {
    let cfg = ron::ser::PrettyConfig::new()
        .extensions(ron::extensions::Extensions::IMPLICIT_SOME)
        .struct_names(false);
    ron_options()
        .to_string_pretty(&ModelDef::Preset(c.clone()), cfg)
        .unwrap_or_else(|e| format!("{c:?} (RON failed: {e})"))
}

// ---------------------------------------------------------------------------------------
// What the plan should be, from the preset's dimensions alone
// ---------------------------------------------------------------------------------------

/// Hyper-parameters with the families' documented defaults applied.
struct Dims {
    family: Family,
    h: u64,
    ffn: u64,
    layers: u64,
    heads: u64,
    kv: u64,
    hd: u64,
    vocab: u64,
    /// GPT-2 learned positions (default 1024).
    positions: u64,
    tie: bool,
    bias: bool,
    parallel: bool,
    dtype_bytes: u64,
}

fn dims(c: &FamilyConfig) -> Dims {
    let family = c.family;
    let default_bias = matches!(family, Family::Qwen2 | Family::Gpt2 | Family::GptNeox);
    Dims {
        family,
        h: c.hidden_size,
        ffn: c.intermediate_size,
        layers: c.num_hidden_layers,
        heads: c.num_attention_heads,
        kv: c.num_key_value_heads.unwrap_or(c.num_attention_heads),
        hd: c.head_dim.unwrap_or(c.hidden_size / c.num_attention_heads),
        vocab: c.vocab_size,
        positions: c.max_position_embeddings.unwrap_or(1024),
        // GPT-2 always ties its head to wte.
        tie: family == Family::Gpt2 || c.tie_word_embeddings.unwrap_or(false),
        // GPT-2 always has biases (it has no attention_bias option).
        bias: family == Family::Gpt2 || c.attention_bias.unwrap_or(default_bias),
        parallel: family == Family::GptNeox && c.use_parallel_residual.unwrap_or(true),
        dtype_bytes: match c.dtype {
            DType::F32 => 4,
            DType::F16 | DType::Bf16 => 2,
            DType::I64 => 8,
        },
    }
}

/// How a checkpoint tensor is split for tp > 1.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Split {
    /// Every rank holds all of it (norms, ...).
    Whole,
    /// A whole bias added to a row split's partial sums: it must be added once, so only
    /// rank 0 holds it (other ranks drop what they do not use).
    Rank0,
    /// Vocabulary rows: contiguous blocks of ceil(len / tp), the tail padded with zeros.
    Padded { dim: u32 },
    /// Whole units of `unit` elements of `heads` heads (a fused q|k|v weight and its output
    /// projection): tp equal pieces when tp divides the heads, else ceil(heads / tp) heads'
    /// worth per rank (each part of a fused dim padded to that inside the piece).
    Exact { dim: u32, unit: u64, heads: u64 },
    /// A plain dim (MLP columns): tp equal pieces when tp divides it, else atoms (a 32nd of
    /// it, or a power of two up to 64) dealt ceil(atoms / tp) to each rank in order, every
    /// piece padded to that.
    Blocks { dim: u32 },
    /// `count` query heads of `unit` in `groups` kv groups: tp equal pieces when tp divides
    /// the heads and divides or is a multiple of the groups; else fewer ranks than groups
    /// take ceil(groups / tp) whole groups each, and more ranks share a group's heads
    /// (rank r serves group r·groups/tp), each piece padded to the largest.
    Heads {
        dim: u32,
        count: u64,
        groups: u64,
        unit: u64,
    },
    /// `count` kv heads of `unit`: split when tp divides `count`, dealt ceil(count / tp) per
    /// rank when tp is below it, else rank r holds head r·count/tp (replicated).
    Kv { dim: u32, count: u64, unit: u64 },
}

impl Split {
    fn dim(self) -> Option<u32> {
        match self {
            Split::Whole | Split::Rank0 => None,
            Split::Padded { dim }
            | Split::Exact { dim, .. }
            | Split::Blocks { dim }
            | Split::Heads { dim, .. }
            | Split::Kv { dim, .. } => Some(dim),
        }
    }

    /// Length of the split dim each rank holds, padding included.
    fn local_len(self, len: u64, tp: u64) -> u64 {
        match self {
            Split::Whole | Split::Rank0 => len,
            Split::Padded { .. } => len.div_ceil(tp),
            Split::Exact { heads, .. } if heads % tp == 0 => len / tp,
            Split::Exact { heads, .. } => len / heads * heads.div_ceil(tp),
            Split::Blocks { .. } if len.is_multiple_of(tp) => len / tp,
            Split::Blocks { .. } => {
                // A 32nd of len where that is a run of 64 or more, else the largest power of
                // two up to 64 that divides len.
                let atom = if len.is_multiple_of(32) && len / 32 >= 64 {
                    len / 32
                } else {
                    [64, 32, 16, 8, 4, 2]
                        .into_iter()
                        .find(|&b| len.is_multiple_of(b))
                        .unwrap_or(1)
                };
                (len / atom).div_ceil(tp) * atom
            }
            Split::Heads {
                count,
                groups,
                unit,
                ..
            } => {
                if count % tp == 0 && (groups % tp == 0 || tp.is_multiple_of(groups)) {
                    len / tp
                } else if tp < groups {
                    groups.div_ceil(tp) * (count / groups) * unit
                } else {
                    (count / groups).div_ceil(tp / groups) * unit
                }
            }
            Split::Kv { count, .. } if count % tp == 0 => len / tp,
            Split::Kv { count, unit, .. } if tp < count => count.div_ceil(tp) * unit,
            Split::Kv { unit, .. } => unit,
        }
    }

    /// How many ranks hold index `i` of the split dim.
    fn copies(self, i: u64, tp: u64) -> u64 {
        match self {
            Split::Kv { count, unit, .. } if count % tp != 0 && tp > count => {
                let head = i / unit;
                (0..tp).filter(|r| r * count / tp == head).count() as u64
            }
            _ => 1,
        }
    }

    fn held_by(self, rank: u64, tp: u64) -> bool {
        tp == 1 || rank == 0 || self != Split::Rank0
    }

    fn unit(self) -> u64 {
        match self {
            Split::Exact { unit, .. } | Split::Kv { unit, .. } | Split::Heads { unit, .. } => unit,
            _ => 1,
        }
    }
}

struct Tensor {
    shape: Vec<u64>,
    split: Split,
}

/// Every checkpoint tensor of the model with its HF name, shape and split.
fn expected_tensors(d: &Dims) -> BTreeMap<String, Tensor> {
    let mut out = BTreeMap::new();
    let mut t = |name: String, shape: &[u64], split: Split| {
        let old = out.insert(
            name.clone(),
            Tensor {
                shape: shape.to_vec(),
                split,
            },
        );
        assert!(old.is_none(), "test bug: {name} twice");
    };
    let (h, ffn, hd, n, kv, v) = (d.h, d.ffn, d.hd, d.heads, d.kv, d.vocab);
    let whole = Split::Whole;
    let once = Split::Rank0;
    let vocab_rows = Split::Padded { dim: 0 };
    let exact = |dim: u32, unit: u64| Split::Exact {
        dim,
        unit,
        heads: n,
    };
    let blocks = |dim: u32| Split::Blocks { dim };
    let q_heads = |dim: u32| Split::Heads {
        dim,
        count: n,
        groups: kv,
        unit: hd,
    };
    let kv_heads = Split::Kv {
        dim: 0,
        count: kv,
        unit: hd,
    };
    match d.family {
        Family::Llama | Family::Qwen2 | Family::Qwen3 => {
            t("model.embed_tokens.weight".into(), &[v, h], vocab_rows);
            for i in 0..d.layers {
                let p = format!("model.layers.{i}");
                t(format!("{p}.input_layernorm.weight"), &[h], whole);
                let a = format!("{p}.self_attn");
                t(format!("{a}.q_proj.weight"), &[n * hd, h], q_heads(0));
                t(format!("{a}.k_proj.weight"), &[kv * hd, h], kv_heads);
                t(format!("{a}.v_proj.weight"), &[kv * hd, h], kv_heads);
                if d.bias {
                    t(format!("{a}.q_proj.bias"), &[n * hd], q_heads(0));
                    t(format!("{a}.k_proj.bias"), &[kv * hd], kv_heads);
                    t(format!("{a}.v_proj.bias"), &[kv * hd], kv_heads);
                }
                if d.family == Family::Qwen3 {
                    t(format!("{a}.q_norm.weight"), &[hd], whole);
                    t(format!("{a}.k_norm.weight"), &[hd], whole);
                }
                t(format!("{a}.o_proj.weight"), &[h, n * hd], q_heads(1));
                // Qwen2 has biases on q, k, v only.
                if d.bias && d.family != Family::Qwen2 {
                    t(format!("{a}.o_proj.bias"), &[h], once);
                }
                t(format!("{p}.post_attention_layernorm.weight"), &[h], whole);
                t(format!("{p}.mlp.gate_proj.weight"), &[ffn, h], blocks(0));
                t(format!("{p}.mlp.up_proj.weight"), &[ffn, h], blocks(0));
                t(format!("{p}.mlp.down_proj.weight"), &[h, ffn], blocks(1));
            }
            t("model.norm.weight".into(), &[h], whole);
            if !d.tie {
                t("lm_head.weight".into(), &[v, h], vocab_rows);
            }
        }
        Family::Mixtral | Family::Qwen3Moe | Family::Qwen2Moe | Family::Olmoe => {
            unreachable!("{NOT_GENERATED}")
        }
        Family::Gpt2 => {
            // Conv1D weights are stored [in, out].
            t("transformer.wte.weight".into(), &[v, h], vocab_rows);
            t(
                "transformer.wpe.weight".into(),
                &[d.positions, h],
                vocab_rows,
            );
            for i in 0..d.layers {
                let p = format!("transformer.h.{i}");
                for ln in ["ln_1", "ln_2"] {
                    t(format!("{p}.{ln}.weight"), &[h], whole);
                    t(format!("{p}.{ln}.bias"), &[h], whole);
                }
                t(format!("{p}.attn.c_attn.weight"), &[h, 3 * h], exact(1, hd));
                t(format!("{p}.attn.c_attn.bias"), &[3 * h], exact(0, hd));
                t(format!("{p}.attn.c_proj.weight"), &[h, h], exact(0, hd));
                t(format!("{p}.attn.c_proj.bias"), &[h], once);
                t(format!("{p}.mlp.c_fc.weight"), &[h, ffn], blocks(1));
                t(format!("{p}.mlp.c_fc.bias"), &[ffn], blocks(0));
                t(format!("{p}.mlp.c_proj.weight"), &[ffn, h], blocks(0));
                t(format!("{p}.mlp.c_proj.bias"), &[h], once);
            }
            t("transformer.ln_f.weight".into(), &[h], whole);
            t("transformer.ln_f.bias".into(), &[h], whole);
        }
        Family::GptNeox => {
            t("gpt_neox.embed_in.weight".into(), &[v, h], vocab_rows);
            for i in 0..d.layers {
                let p = format!("gpt_neox.layers.{i}");
                for ln in ["input_layernorm", "post_attention_layernorm"] {
                    t(format!("{p}.{ln}.weight"), &[h], whole);
                    t(format!("{p}.{ln}.bias"), &[h], whole);
                }
                // [heads, 3, head_dim]: whole heads of 3 * head_dim rows.
                let qkv = format!("{p}.attention.query_key_value");
                t(format!("{qkv}.weight"), &[3 * h, h], exact(0, 3 * hd));
                t(format!("{p}.attention.dense.weight"), &[h, h], exact(1, hd));
                t(
                    format!("{p}.mlp.dense_h_to_4h.weight"),
                    &[ffn, h],
                    blocks(0),
                );
                t(
                    format!("{p}.mlp.dense_4h_to_h.weight"),
                    &[h, ffn],
                    blocks(1),
                );
                if d.bias {
                    t(format!("{qkv}.bias"), &[3 * h], exact(0, 3 * hd));
                    t(format!("{p}.attention.dense.bias"), &[h], once);
                    t(format!("{p}.mlp.dense_h_to_4h.bias"), &[ffn], blocks(0));
                    t(format!("{p}.mlp.dense_4h_to_h.bias"), &[h], once);
                }
            }
            t("gpt_neox.final_layer_norm.weight".into(), &[h], whole);
            t("gpt_neox.final_layer_norm.bias".into(), &[h], whole);
            if !d.tie {
                t("embed_out.weight".into(), &[v, h], vocab_rows);
            }
        }
    }
    out
}

/// The parameter count of the unsplit model, written out per family.
fn hand_param_count(d: &Dims) -> u64 {
    let (h, ffn, hd, n, kv, v, l) = (d.h, d.ffn, d.hd, d.heads, d.kv, d.vocab, d.layers);
    let b = u64::from(d.bias);
    let head = if d.tie { 0 } else { v * h };
    match d.family {
        Family::Llama | Family::Qwen2 | Family::Qwen3 => {
            let attn = h * n * hd + 2 * h * kv * hd + n * hd * h;
            let attn_bias = b * (n * hd + 2 * kv * hd);
            let o_bias = if d.family == Family::Qwen2 { 0 } else { b * h };
            let qk_norm = if d.family == Family::Qwen3 { 2 * hd } else { 0 };
            let mlp = 3 * h * ffn;
            v * h + l * (2 * h + attn + attn_bias + o_bias + qk_norm + mlp) + h + head
        }
        Family::Gpt2 => {
            let layer = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * ffn + ffn) + (ffn * h + h);
            v * h + d.positions * h + l * layer + 2 * h
        }
        Family::GptNeox => {
            let weights = 4 * h + 3 * h * h + h * h + 2 * h * ffn;
            let biases = b * (3 * h + h + ffn + h);
            v * h + l * (weights + biases) + 2 * h + head
        }
        Family::Mixtral | Family::Qwen3Moe | Family::Qwen2Moe | Family::Olmoe => {
            unreachable!("{NOT_GENERATED}")
        }
    }
}

/// The generators draw dense families only; mixture-of-experts presets have their own tests.
const NOT_GENERATED: &str = "mixture-of-experts families are not generated here";

/// Any tp up to the query heads: separate q, k and v weights dealt by kv group, a fused
/// q|k|v weight (GPT-2, NeoX, whose heads are each their own group) by whole heads of every
/// part. The MLP is dealt in blocks whatever the tp.
fn feasible(d: &Dims, tp: u64) -> bool {
    tp <= d.heads
}

/// Parameter bytes each rank holds.
fn expected_bytes_per_rank(d: &Dims, tensors: &BTreeMap<String, Tensor>, tp: u64) -> Vec<u64> {
    (0..tp)
        .map(|rank| {
            tensors
                .values()
                .filter(|t| t.split.held_by(rank, tp))
                .map(|t| {
                    let elems: u64 = t.shape.iter().product();
                    let local = match t.split.dim() {
                        Some(dim) if tp > 1 => {
                            let len = t.shape[dim as usize];
                            elems / len * t.split.local_len(len, tp)
                        }
                        _ => elems,
                    };
                    local * d.dtype_bytes
                })
                .sum()
        })
        .collect()
}

// ---------------------------------------------------------------------------------------
// Checks
// ---------------------------------------------------------------------------------------

type Check = Result<(), String>;

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(format!($($fmt)+));
        }
    };
}

fn check_graph(compiled: &Compiled) -> Check {
    let graph = &compiled.sharded.graph;
    verify(graph).map_err(|problems| {
        let lines: Vec<String> = problems.iter().map(|p| p.to_string()).collect();
        format!("sharded graph fails verify:\n  {}", lines.join("\n  "))
    })?;
    for id in graph.g.node_indices() {
        let inputs = graph.inputs(id);
        let layouts: Vec<Layout> = inputs.iter().map(|&i| graph.layout(i)).collect();
        for (slot, l) in layouts.iter().enumerate() {
            let node = graph.node(id);
            ensure!(
                *l != Layout::Partial || linear_in(&node.op, slot as u32, &layouts),
                "partial sum `{}` reaches `{}` ({}) input {slot}, which is not linear in it \
                 (input layouts {layouts:?})",
                graph.node(inputs[slot]).name,
                node.name,
                node.op.kind()
            );
        }
    }
    Ok(())
}

/// One checkpoint tensor across all ranks.
fn check_tensor(name: &str, t: &Tensor, slices: &[&WeightSlice], tp: u64, dtype: DType) -> Check {
    let split = if tp == 1 { Split::Whole } else { t.split };
    for (rank, w) in slices.iter().enumerate() {
        ensure!(
            w.shape == t.shape,
            "`{name}` rank {rank}: shape {:?}, the checkpoint has {:?}",
            w.shape,
            t.shape
        );
        ensure!(w.dtype == dtype, "`{name}` rank {rank}: dtype {}", w.dtype);
        ensure!(
            w.dim == split.dim(),
            "`{name}` rank {rank}: split on {:?}, expected {split:?}",
            w.dim
        );
        let Some(dim) = w.dim else {
            ensure!(
                w.ranges.is_empty() && w.padding == 0 && w.local_shape == w.shape,
                "`{name}` rank {rank}: whole tensor with ranges {:?}, padding {}, local shape {:?}",
                w.ranges,
                w.padding,
                w.local_shape
            );
            continue;
        };
        let len = t.shape[dim as usize];
        for r in &w.ranges {
            ensure!(
                r.offset + r.len <= len,
                "`{name}` rank {rank}: range {}..{} outside dim {dim} of length {len}",
                r.offset,
                r.offset + r.len
            );
            ensure!(
                r.offset % split.unit() == 0 && r.len % split.unit() == 0,
                "`{name}` rank {rank}: range {}+{} cuts a unit of {}",
                r.offset,
                r.len,
                split.unit()
            );
        }
        let real: u64 = w.ranges.iter().map(|r| r.len).sum();
        let mut local = t.shape.clone();
        local[dim as usize] = real + w.ranges.iter().map(|r| r.pad).sum::<u64>() + w.padding;
        ensure!(
            w.local_shape == local,
            "`{name}` rank {rank}: local shape {:?} but ranges {:?} + padding {} give {local:?}",
            w.local_shape,
            w.ranges,
            w.padding
        );
        let want = split.local_len(len, tp);
        let pads: u64 = w.ranges.iter().map(|r| r.pad).sum();
        ensure!(
            real + pads + w.padding == want,
            "`{name}` rank {rank}: holds {} of dim {dim} (len {len}), expected {want} ({split:?})",
            real + pads + w.padding
        );
        ensure!(
            pads == 0 || name.contains(".attn.c_attn."),
            "`{name}` rank {rank}: padding inside the piece ({:?}) of a dim that is not GPT-2's fused q|k|v",
            w.ranges
        );
        ensure!(
            local.iter().product::<u64>() == w.local_elements(),
            "`{name}` rank {rank}: local_elements disagrees with local_shape"
        );
    }
    let Some(dim) = split.dim() else {
        return Ok(());
    };
    let len = t.shape[dim as usize];
    let mut covered = vec![0u64; len as usize];
    for w in slices {
        for r in &w.ranges {
            for c in &mut covered[r.offset as usize..(r.offset + r.len) as usize] {
                *c += 1;
            }
        }
    }
    let held = |i: usize| split.copies(i as u64, tp);
    if let Some(i) = (0..covered.len()).find(|&i| covered[i] != held(i)) {
        return Err(format!(
            "`{name}`: index {i} of dim {dim} is held by {} ranks, expected {} ({split:?})",
            covered[i],
            held(i)
        ));
    }
    if let Split::Padded { .. } = split {
        // Concatenating every rank's piece in rank order (as the logits all-gather does)
        // must give the rows in order, padding only after the last real row.
        let mut order: Vec<Option<u64>> = Vec::new();
        for w in slices {
            for r in &w.ranges {
                order.extend((r.offset..r.offset + r.len).map(Some));
            }
            order.extend(std::iter::repeat_n(None, w.padding as usize));
        }
        let want: Vec<Option<u64>> = (0..len).map(Some).collect();
        ensure!(
            order[..len as usize] == want[..] && order[len as usize..].iter().all(Option::is_none),
            "`{name}`: rank pieces in rank order are not rows 0..{len} then padding: {:?}",
            slices
                .iter()
                .map(|w| (&w.ranges, w.padding))
                .collect::<Vec<_>>()
        );
    }
    Ok(())
}

fn check_weights(c: &FamilyConfig, d: &Dims, compiled: &Compiled, tp: u64) -> Check {
    let plan = &compiled.plan;
    ensure!(plan.tp == tp, "plan.tp = {}", plan.tp);
    ensure!(
        plan.ranks.len() as u64 == tp,
        "{} rank programs",
        plan.ranks.len()
    );
    let tensors = expected_tensors(d);
    let mut by_name: BTreeMap<&str, Vec<&WeightSlice>> = BTreeMap::new();
    for (i, r) in plan.ranks.iter().enumerate() {
        ensure!(r.rank == i as u64, "rank program {i} says rank {}", r.rank);
        let names: Vec<&str> = r.weights.iter().map(|w| &*w.tensor).collect();
        let unique: BTreeSet<&str> = names.iter().copied().collect();
        ensure!(unique.len() == names.len(), "rank {i} loads a tensor twice");
        let want: BTreeSet<&str> = tensors
            .iter()
            .filter(|(_, t)| t.split.held_by(i as u64, tp))
            .map(|(n, _)| n.as_str())
            .collect();
        ensure!(
            unique == want,
            "rank {i} loads {:?} it should not, and lacks {:?}",
            unique.difference(&want).collect::<Vec<_>>(),
            want.difference(&unique).collect::<Vec<_>>()
        );
        for w in &r.weights {
            by_name.entry(&w.tensor).or_default().push(w);
        }
    }
    for (name, t) in &tensors {
        check_tensor(name, t, &by_name[name.as_str()], tp, c.dtype)?;
        let shapes: BTreeSet<&Vec<u64>> = by_name[name.as_str()]
            .iter()
            .map(|w| &w.local_shape)
            .collect();
        ensure!(
            shapes.len() == 1,
            "`{name}`: ranks hold different local shapes {shapes:?}"
        );
    }

    let s = summarize(plan);
    let hand = hand_param_count(d);
    let total: u64 = tensors
        .values()
        .map(|t| t.shape.iter().product::<u64>())
        .sum();
    ensure!(
        total == hand,
        "test bug: tensor table has {total} parameters, closed form {hand}"
    );
    ensure!(
        s.model_param_count == hand && s.model_param_bytes == hand * d.dtype_bytes,
        "model parameters {} ({} B), expected {hand} ({} B)",
        s.model_param_count,
        s.model_param_bytes,
        hand * d.dtype_bytes
    );
    let sum: u64 = s.param_bytes_per_rank.iter().sum();
    let want = expected_bytes_per_rank(d, &tensors, tp);
    ensure!(
        sum == want.iter().sum::<u64>(),
        "param bytes over all ranks {sum} ({:?}), expected {} ({want:?})",
        s.param_bytes_per_rank,
        want.iter().sum::<u64>()
    );
    ensure!(
        s.param_bytes_per_rank == want,
        "param bytes per rank {:?}, expected {want:?}",
        s.param_bytes_per_rank
    );
    if tp == 1 {
        ensure!(
            s.param_bytes_per_rank == vec![hand * d.dtype_bytes],
            "tp=1 rank holds {:?} bytes, the whole model is {} bytes",
            s.param_bytes_per_rank,
            hand * d.dtype_bytes
        );
    }
    Ok(())
}

fn check_collectives(d: &Dims, compiled: &Compiled, tp: u64) -> Check {
    let plan = &compiled.plan;
    let graph = &compiled.sharded.graph;
    let in_graph = graph
        .g
        .node_weights()
        .filter(|n| n.op.is_collective())
        .count();
    ensure!(
        in_graph == plan.collectives.len(),
        "{in_graph} collectives in the graph, {} in the plan",
        plan.collectives.len()
    );
    let list = || {
        plan.collectives
            .iter()
            .map(|c| format!("{} {:?} {}", c.kind, c.layer, c.name))
            .collect::<Vec<_>>()
    };
    if tp == 1 {
        ensure!(
            plan.collectives.is_empty(),
            "tp=1 has collectives {:?}",
            list()
        );
        return Ok(());
    }
    let per_layer = if d.parallel { 1 } else { 2 };
    for layer in 0..d.layers as u32 {
        let here: Vec<_> = plan
            .collectives
            .iter()
            .filter(|c| c.layer == Some(layer))
            .collect();
        let ars = here.iter().filter(|c| c.kind == "all_reduce").count();
        ensure!(
            ars == per_layer && here.len() == per_layer,
            "layer {layer}: expected {per_layer} all_reduce and nothing else, got {:?}",
            list()
        );
    }
    ensure!(
        plan.collectives
            .iter()
            .all(|c| c.layer.is_none_or(|l| u64::from(l) < d.layers)),
        "collective in a layer that does not exist: {:?}",
        list()
    );
    let outside = |kind: &str| {
        plan.collectives
            .iter()
            .filter(|c| c.layer.is_none() && c.kind == kind)
            .count()
    };
    let outside_all = plan
        .collectives
        .iter()
        .filter(|c| c.layer.is_none())
        .count();
    ensure!(
        outside("all_reduce") == 1 && outside("all_gather") == 1 && outside_all == 2,
        "outside layers expected 1 embedding all_reduce and 1 logits all_gather, got {:?}",
        list()
    );
    for c in &plan.collectives {
        let want = match c.kind.as_str() {
            "all_reduce" => d.h,
            _ => d.vocab.div_ceil(tp) * tp,
        };
        ensure!(
            c.elements_per_token == want && c.bytes_per_token == want * d.dtype_bytes,
            "{} `{}`: {} elements ({} B) per token, expected {want}",
            c.kind,
            c.name,
            c.elements_per_token,
            c.bytes_per_token
        );
    }
    Ok(())
}

fn check_compiled(c: &FamilyConfig, d: &Dims, compiled: &Compiled, tp: u64) -> Check {
    check_graph(compiled)?;
    check_weights(c, d, compiled, tp)?;
    check_collectives(d, compiled, tp)
}

/// Compiles for every tp in 1..=16 and checks each outcome.
fn check_model(c: &FamilyConfig) -> Check {
    let def = ModelDef::Preset(c.clone());
    let d = dims(c);
    let mut compiled_ok = BTreeSet::new();
    let mut refused = Vec::new();
    for tp in 1..=MAX_TP {
        match compile(&def, tp) {
            Ok(compiled) => {
                check_compiled(c, &d, &compiled, tp).map_err(|e| format!("tp={tp}: {e}"))?;
                compiled_ok.insert(tp);
            }
            Err(TpcError::Infeasible {
                tp: said, valid, ..
            }) => {
                ensure!(said == tp, "tp={tp}: the error speaks of tp={said}");
                refused.push((tp, valid));
            }
            Err(e) => return Err(format!("tp={tp}: error other than Infeasible: {e}")),
        }
    }
    let want: BTreeSet<u64> = (1..=MAX_TP).filter(|&t| feasible(&d, t)).collect();
    ensure!(
        compiled_ok == want,
        "compiled for tp {compiled_ok:?}, expected exactly {want:?}"
    );
    let listed: Vec<u64> = (1..=MAX_LISTED_TP).filter(|&t| feasible(&d, t)).collect();
    for (tp, valid) in refused {
        let small: BTreeSet<u64> = valid.iter().copied().filter(|&t| t <= MAX_TP).collect();
        ensure!(
            small == compiled_ok,
            "tp={tp}: the error lists valid tp {small:?} up to {MAX_TP}, but {compiled_ok:?} compile"
        );
        ensure!(
            valid == listed,
            "tp={tp}: the error lists valid tp {valid:?}, expected {listed:?}"
        );
    }
    Ok(())
}

fn check_deterministic(c: &FamilyConfig) -> Check {
    let def = ModelDef::Preset(c.clone());
    let d = dims(c);
    for tp in (1..=MAX_TP).filter(|&t| feasible(&d, t)) {
        let once = compile(&def, tp).map_err(|e| format!("tp={tp}: {e}"))?;
        let twice = compile(&def, tp).map_err(|e| format!("tp={tp}: {e}"))?;
        ensure!(
            once.plan == twice.plan,
            "tp={tp}: two compiles give different plans"
        );
        let (a, b) = (render_plan(&once.plan), render_plan(&twice.plan));
        if a != b {
            let line = a.lines().zip(b.lines()).position(|(x, y)| x != y);
            return Err(format!(
                "tp={tp}: two compiles render different plan text (first difference at line {line:?})"
            ));
        }
    }
    Ok(())
}

fn report(c: &FamilyConfig, result: Check) -> Result<(), TestCaseError> {
    result.map_err(|e| TestCaseError::fail(format!("{e}\nmodel:\n{}", ron_of(c))))
}

/// `cases` unless `PROPTEST_CASES` asks for another count (for longer local runs).
fn config(cases: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(cases);
    ProptestConfig {
        cases,
        // No regression files next to the tests; a failure prints the shrunk model's RON.
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config(128))]

    /// Every tp in 1..=16 either compiles into a correct plan or is refused as infeasible
    /// with exactly the right list of valid tp values.
    #[test]
    fn every_tp_compiles_correctly_or_is_refused_exactly(c in any_model()) {
        report(&c, check_model(&c))?;
    }
}

proptest! {
    #![proptest_config(config(64))]

    /// Compiling the same model twice gives equal plans and equal plan text.
    #[test]
    fn compiling_twice_gives_the_same_plan(c in any_model()) {
        report(&c, check_deterministic(&c))?;
    }
}

/// The generators reach every family and both residual styles; a sanity check on the
/// test itself.
#[test]
fn generators_cover_every_family() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let mut seen = BTreeSet::new();
    for _ in 0..500 {
        let c = any_model().new_tree(&mut runner).unwrap().current();
        let d = dims(&c);
        seen.insert(format!("{:?} parallel={}", c.family, d.parallel));
        let mut c2 = c.clone();
        c2.name = Some("roundtrip".into());
        // Generated models are valid presets and survive RON.
        let text = ron_of(&c2);
        let back: ModelDef = ron_options().from_str(&text).unwrap();
        assert_eq!(back, ModelDef::Preset(c2));
    }
    for want in [
        "Llama parallel=false",
        "Qwen2 parallel=false",
        "Qwen3 parallel=false",
        "Gpt2 parallel=false",
        "GptNeox parallel=true",
        "GptNeox parallel=false",
    ] {
        assert!(seen.contains(want), "never generated {want}: {seen:?}");
    }
}

/// One random `--tp-shares` list: 2 to 6 ranks, shares 1 to 5.
fn any_shares() -> impl Strategy<Value = Vec<u64>> {
    proptest::collection::vec(1u64..=5, 2..=6)
}

/// `--tp-shares` on a random model: the plan verifies, every rank's piece of a split weight
/// has one shape, the pieces cover the weight exactly once (kv heads replicated where tp
/// exceeds them: at least once), and where the ranks are no more than the kv groups a larger
/// share never holds less of a dimension dealt by shares; or the compile is refused with a
/// reason that names the shares or the split.
fn check_shares(c: &FamilyConfig, shares: &[u64]) -> Check {
    let def = ModelDef::Preset(c.clone());
    let d = dims(c);
    let tp = shares.len() as u64;
    let list: Vec<String> = shares.iter().map(u64::to_string).collect();
    let options = tpc::passes::ShardOptions {
        shares: Some(list.join(",").parse().map_err(|e: String| e)?),
        ..Default::default()
    };
    let plan = match tpc::pipeline::compile_with(&def, tp, options) {
        Ok(c) => c.plan,
        Err(e) => {
            let text = e.to_string();
            ensure!(
                text.contains("--tp-shares") || text.contains("cannot be split"),
                "shares {list:?}: unclear refusal: {text}"
            );
            return Ok(());
        }
    };
    plan.verify()
        .map_err(|e| format!("shares {list:?}: the plan does not verify: {e}"))?;
    let expected = expected_tensors(&d);
    for w in &plan.ranks[0].weights {
        let Some(dim) = w.dim else { continue };
        let len = w.shape[dim as usize];
        let pieces: Vec<&WeightSlice> = plan
            .ranks
            .iter()
            .filter_map(|r| r.weights.iter().find(|x| x.tensor == w.tensor))
            .collect();
        ensure!(
            pieces.len() == plan.ranks.len(),
            "shares {list:?}: {} missing on a rank",
            w.tensor
        );
        ensure!(
            pieces.iter().all(|p| p.local_shape == w.local_shape),
            "shares {list:?}: {}: local shapes differ",
            w.tensor
        );
        let mut covered = vec![0u32; len as usize];
        for p in &pieces {
            for r in &p.ranges {
                for c in &mut covered[r.offset as usize..(r.offset + r.len) as usize] {
                    *c += 1;
                }
            }
        }
        let replicated_kv = matches!(
            expected.get(&*w.tensor).map(|t| t.split),
            Some(Split::Kv { count, .. }) if tp > count
        );
        let once = covered.iter().all(|&n| n == 1);
        let at_least = covered.iter().all(|&n| n >= 1);
        ensure!(
            once || (replicated_kv && at_least),
            "shares {list:?}: {} is not covered exactly once",
            w.tensor
        );
        let by_shares = !matches!(
            expected.get(&*w.tensor).map(|t| t.split),
            Some(Split::Padded { .. })
        );
        if once && by_shares && tp <= d.kv {
            let real = |p: &WeightSlice| p.ranges.iter().map(|r| r.len).sum::<u64>();
            for a in 0..shares.len() {
                for b in 0..shares.len() {
                    ensure!(
                        shares[a] <= shares[b] || real(pieces[a]) >= real(pieces[b]),
                        "shares {list:?}: {}: rank {a} holds less than rank {b}",
                        w.tensor
                    );
                }
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(config(96))]

    /// Random models and random `--tp-shares`: a verified plan that covers every weight
    /// once with larger pieces for larger shares, or a clear refusal.
    #[test]
    fn shares_give_a_covering_plan_or_a_clear_refusal(c in any_model(), shares in any_shares()) {
        report(&c, check_shares(&c, &shares))?;
    }
}

/// A random model of a family with separate or fused q|k|v weights, and one `tp_plan`
/// override of its weights: a pattern and its word.
fn any_model_with_override() -> impl Strategy<Value = (FamilyConfig, (&'static str, TpWord))> {
    let word = || prop::sample::select(vec![TpWord::Colwise, TpWord::Rowwise, TpWord::Replicate]);
    let llama = [
        "model.embed_tokens",
        "model.layers.*.self_attn.q_proj",
        "model.layers.*.self_attn.k_proj",
        "model.layers.*.self_attn.v_proj",
        "model.layers.*.self_attn.o_proj",
        "model.layers.*.mlp.gate_proj",
        "model.layers.*.mlp.up_proj",
        "model.layers.*.mlp.down_proj",
    ];
    let gpt2_patterns = [
        "transformer.wte",
        "transformer.h.*.attn.c_attn",
        "transformer.h.*.attn.c_proj",
        "transformer.h.*.mlp.c_fc",
        "transformer.h.*.mlp.c_proj",
    ];
    let neox_patterns = [
        "gpt_neox.embed_in",
        "gpt_neox.layers.*.attention.query_key_value",
        "gpt_neox.layers.*.attention.dense",
        "gpt_neox.layers.*.mlp.dense_h_to_4h",
        "gpt_neox.layers.*.mlp.dense_4h_to_h",
    ];
    prop_oneof![
        (llama_like(), (prop::sample::select(llama.to_vec()), word())),
        (
            gpt2(),
            (prop::sample::select(gpt2_patterns.to_vec()), word())
        ),
        (
            neox(),
            (prop::sample::select(neox_patterns.to_vec()), word())
        ),
    ]
}

/// A random `tp_plan` override at a random tp (1 to 8) or random shares, with or without
/// sequence parallelism: a plan that
/// verifies and gives tp 1's logits and tokens on seeded weights, or a refusal that is not
/// tpc's own error (a pass leaving a broken graph).
/// Overrides that split what no linear deals (the hidden state) or cut replicated kv heads
/// once failed in partitioning at uneven tps.
fn check_override(
    c: &FamilyConfig,
    (pattern, word): (&str, TpWord),
    tp: u64,
    shares: Option<&[u64]>,
    sequence_parallel: bool,
) -> Check {
    let mut c = c.clone();
    c.tp_plan.insert(pattern.into(), word);
    // Room for the check's 5 prompt tokens and 4 new ones (GPT-2's learned positions).
    c.max_position_embeddings = c.max_position_embeddings.map(|p| p.max(16));
    let def = ModelDef::Preset(c);
    let (tp, shares_option) = match shares {
        Some(s) => {
            let list: Vec<String> = s.iter().map(u64::to_string).collect();
            (
                s.len() as u64,
                Some(list.join(",").parse().map_err(|e: String| e)?),
            )
        }
        None => (tp, None),
    };
    let options = tpc::passes::ShardOptions {
        shares: shares_option,
        sequence_parallel,
        ..Default::default()
    };
    let at = format!(
        "{pattern}: {} at tp {tp} shares {shares:?} sequence parallel {sequence_parallel}",
        word.word()
    );
    let plan = match tpc::pipeline::compile_with(&def, tp, options) {
        Ok(compiled) => compiled.plan,
        Err(e @ TpcError::Verify { .. }) => return Err(format!("{at}: {e}")),
        Err(_) => return Ok(()),
    };
    plan.verify()
        .map_err(|e| format!("{at}: the plan does not verify: {e}"))?;
    // And it computes the model: tp 1's logits and tokens on seeded weights.
    let one = tpc::pipeline::compile(&def, 1).map_err(|e| format!("{at}: tp 1: {e}"))?;
    let device = tpc::runtime::generate::Device::cpu();
    let report = tpc::runtime::verify::verify_plans(&one.plan, &plan, None, 1, 5, &device)
        .map_err(|e| format!("{at}: the run failed: {e}"))?;
    ensure!(report.passed, "{at}: does not reproduce tp 1: {report:?}");
    Ok(())
}

proptest! {
    #![proptest_config(config(96))]

    /// Random models with a random override, at a random tp or random shares.
    #[test]
    fn overrides_give_a_verified_plan_or_a_clear_refusal(
        (c, over) in any_model_with_override(),
        tp in 1u64..=8,
        shares in proptest::option::of(any_shares()),
        sequence_parallel in any::<bool>(),
    ) {
        report(&c, check_override(&c, over, tp, shares.as_deref(), sequence_parallel))?;
    }
}
