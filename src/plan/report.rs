//! The summary of a plan: memory per rank, communication per token, KV cache per rank.

use super::Plan;
use crate::ir::saturating::{product, sum};
use crate::ir::Op;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Machine-readable summary (`tpc compile --json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub model: String,
    pub tp: u64,
    pub dtype: String,
    pub param_count_per_rank: Vec<u64>,
    pub param_bytes_per_rank: Vec<u64>,
    /// Parameters per rank without the zero padding of an uneven split (each rank's share;
    /// what the CPU backend holds and multiplies); absent when no rank has padding.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub real_param_count_per_rank: Vec<u64>,
    /// Parameters of the unsplit model (each checkpoint tensor once).
    pub model_param_count: u64,
    pub model_param_bytes: u64,
    pub kv_cache_bytes_per_token_per_rank: Vec<u64>,
    pub collectives: Vec<CollectiveSummary>,
    /// The element type the byte figures count (the plan's dtype).
    pub collective_dtype: String,
    /// Collective counts by kind in one layer: one number when every layer has the same
    /// count, the range when layers differ (overrides, mixed layer kinds).
    pub collectives_per_layer: BTreeMap<String, LayerCount>,
    /// Collective counts by kind outside every layer (embedding, LM head).
    pub collectives_outside_layers: BTreeMap<String, u64>,
    pub collective_count: u64,
    pub bytes_per_token_total: u64,
    pub ring_wire_bytes_per_token_total: u64,
    pub column_row_pairs: u64,
    /// Per rank, its fused products (linears that read one input run as one product:
    /// q|k|v, gate|up) and the linears they run.
    #[serde(default)]
    pub fused_products_per_rank: Vec<u64>,
    #[serde(default)]
    pub fused_linears_per_rank: Vec<u64>,
    pub notes: Vec<String>,
    /// When the output is gathered vocab-split logits: what greedy decoding exchanges
    /// instead (one f32 (value, index) pair per rank), per token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub greedy_exchange: Option<GreedyExchange>,
    /// When the output is gathered vocab-split logits: what sampling with `--top-k K`
    /// exchanges instead (K f32 (value, index) pairs per rank), per token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k_exchange: Option<TopKExchange>,
    /// Pipeline stages (`--pp`), when the plan has more than one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stages: Vec<StageSummary>,
}

/// One pipeline stage: its layers and, per tp rank, what its stage program holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageSummary {
    pub stage: u64,
    pub first_layer: u32,
    pub layers: u32,
    /// Its global ranks (stage · tp + tp rank).
    pub ranks: Vec<u64>,
    pub param_count_per_rank: Vec<u64>,
    pub param_bytes_per_rank: Vec<u64>,
    pub kv_cache_bytes_per_token_per_rank: Vec<u64>,
    /// Collectives inside the stage's tensor-parallel group.
    pub collective_count: u64,
    /// What each rank sends to its peer on the next stage (0 on the last stage).
    pub send_bytes_per_token_per_rank: u64,
    /// The values sent, by name.
    pub sends: Vec<String>,
}

fn param_count(program: &super::RankProgram) -> u64 {
    sum(program.weights.iter().map(|w| w.local_elements()))
}

fn param_bytes(program: &super::RankProgram) -> u64 {
    sum(program.weights.iter().map(|w| w.local_bytes()))
}

/// Key and value bytes one token adds to the program's KV caches.
fn kv_bytes_per_token(program: &super::RankProgram) -> u64 {
    let facts: BTreeMap<u32, _> = program.instrs.iter().map(|i| (i.id, &i.fact)).collect();
    let bytes = |id: &u32| {
        facts.get(id).map_or(0, |f: &&crate::ir::TensorFact| {
            f.shape
                .fixed_elements()
                .saturating_mul(f.dtype.size_bytes())
        })
    };
    sum(program
        .instrs
        .iter()
        .filter(|i| matches!(i.op, Op::Attention(_)))
        .map(|i| {
            let (k, v) = (i.inputs.get(1), i.inputs.get(2));
            k.map_or(0, bytes).saturating_add(v.map_or(0, bytes))
        }))
}

/// Per stage of a pipelined plan, its figures; empty without a pipeline (or when the
/// stage programs cannot be derived: `Plan::verify` reports that).
fn stage_summaries(plan: &Plan) -> Vec<StageSummary> {
    let Some(pipeline) = &plan.pipeline else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for (s, span) in pipeline.stages.iter().enumerate() {
        let programs: Result<Vec<_>, _> = (0..plan.ranks.len())
            .map(|r| super::stages::stage_program(plan, r, s))
            .collect();
        let Ok(programs) = programs else {
            return Vec::new();
        };
        let first = programs.first();
        out.push(StageSummary {
            stage: s as u64,
            first_layer: span.first_layer,
            layers: span.layers,
            ranks: programs.iter().map(|p| p.program.rank).collect(),
            param_count_per_rank: programs.iter().map(|p| param_count(&p.program)).collect(),
            param_bytes_per_rank: programs.iter().map(|p| param_bytes(&p.program)).collect(),
            kv_cache_bytes_per_token_per_rank: programs
                .iter()
                .map(|p| kv_bytes_per_token(&p.program))
                .collect(),
            collective_count: first.map_or(0, |p| {
                p.program
                    .instrs
                    .iter()
                    .filter(|i| i.op.is_collective())
                    .count() as u64
            }),
            send_bytes_per_token_per_rank: first
                .map_or(0, |p| sum(p.send.iter().map(|b| b.bytes_per_token()))),
            sends: first.map_or(Vec::new(), |p| {
                p.send.iter().map(|b| b.name.to_string()).collect()
            }),
        });
    }
    out
}

/// Bytes per token of the logits gather and of the pairs greedy decoding sends instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GreedyExchange {
    pub logits_gather_bytes_per_token: u64,
    pub pair_bytes_per_token: u64,
}

/// Bytes per token of the logits gather and of the candidates top-k sampling sends instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopKExchange {
    pub logits_gather_bytes_per_token: u64,
    /// 8·tp: per candidate, one f32 (value, index) pair from every rank.
    pub pair_bytes_per_token_per_k: u64,
    /// The largest K whose pairs are fewer than a rank's slice of logits; a larger K gathers
    /// the logits (the same tokens).
    pub max_k: u64,
}

/// The output's logits gather and the width of each rank's slice, when the output is one.
fn top_k_exchange(plan: &Plan) -> Option<TopKExchange> {
    let program = plan.ranks.first()?;
    let id = program.output_gather()?;
    let gather = plan.collectives.iter().find(|c| c.id == id)?;
    let instr = program.instrs.iter().find(|i| i.id == id)?;
    let input = program
        .instrs
        .iter()
        .find(|i| Some(&i.id) == instr.inputs.first())?;
    let shape = &input.fact.shape;
    let slice = shape.fixed_at(shape.rank().checked_sub(1)?)?;
    Some(TopKExchange {
        logits_gather_bytes_per_token: gather.bytes_per_token,
        pair_bytes_per_token_per_k: plan.tp.saturating_mul(8),
        // The executor exchanges pairs while 2K < the slice width.
        max_k: slice.saturating_sub(1) / 2,
    })
}

/// The output's logits gather, when the output is one (see the executor's argmax path).
fn greedy_exchange(plan: &Plan) -> Option<GreedyExchange> {
    let id = plan.ranks.first()?.output_gather()?;
    let gather = plan.collectives.iter().find(|c| c.id == id)?;
    Some(GreedyExchange {
        logits_gather_bytes_per_token: gather.bytes_per_token,
        pair_bytes_per_token: plan.tp.saturating_mul(8),
    })
}

/// How many collectives of one kind a layer has. Serialized as a plain number when all layers
/// agree, so uniform models keep the simple `"all_reduce": 2` form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum LayerCount {
    Same(u64),
    Differ { min: u64, max: u64 },
}

impl LayerCount {
    fn of(counts: impl Iterator<Item = u64>) -> LayerCount {
        let (min, max) = counts.fold((u64::MAX, 0), |(lo, hi), c| (lo.min(c), hi.max(c)));
        if min >= max {
            LayerCount::Same(max)
        } else {
            LayerCount::Differ { min, max }
        }
    }
}

impl std::fmt::Display for LayerCount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LayerCount::Same(n) => write!(f, "{n}"),
            LayerCount::Differ { min, max } => write!(f, "{min}–{max}"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CollectiveSummary {
    pub kind: String,
    pub layer: Option<u32>,
    pub value: String,
    pub elements_per_token: u64,
    pub bytes_per_token: u64,
    pub ring_wire_bytes_per_token: u64,
    /// An all-reduce's algorithm by message size, when compiled for a hardware profile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub algorithm: Option<crate::ir::AlgorithmChoice>,
}

/// The algorithm choice rank 0's program records for each collective, by id (the first
/// instruction of that id). One pass: a search per collective made summarizing a deep
/// model's plan quadratic (seconds for thousands of layers).
fn recorded_algorithms(
    plan: &Plan,
) -> std::collections::HashMap<u32, Option<crate::ir::AlgorithmChoice>> {
    let mut found = std::collections::HashMap::new();
    for i in plan.ranks.first().into_iter().flat_map(|r| &r.instrs) {
        if let std::collections::hash_map::Entry::Vacant(slot) = found.entry(i.id) {
            let algorithm = match &i.op {
                crate::ir::Op::AllReduce(a) => a.algorithm.clone(),
                crate::ir::Op::RmsNorm(n) => {
                    n.reduce_input.as_ref().and_then(|a| a.algorithm.clone())
                }
                _ => None,
            };
            slot.insert(algorithm);
        }
    }
    found
}

pub fn summarize(plan: &Plan) -> Summary {
    let param_count_per_rank: Vec<u64> = plan.ranks.iter().map(param_count).collect();
    let real: Vec<u64> = plan
        .ranks
        .iter()
        .map(|r| sum(r.weights.iter().map(|w| w.real_elements())))
        .collect();
    let real_param_count_per_rank = if real == param_count_per_rank {
        Vec::new()
    } else {
        real
    };
    let param_bytes_per_rank = plan.ranks.iter().map(param_bytes).collect();
    let (model_param_count, model_param_bytes) = plan.ranks.first().map_or((0, 0), |r| {
        r.weights.iter().fold((0u64, 0u64), |(c, b), w| {
            let n = product(w.shape.iter().copied());
            (c.saturating_add(n), b.saturating_add(w.whole_bytes()))
        })
    });
    let kv_cache_bytes_per_token_per_rank = plan.ranks.iter().map(kv_bytes_per_token).collect();
    let (per_layer, outside) = count_collectives(plan);
    let algorithms = recorded_algorithms(plan);
    Summary {
        model: plan.model.clone(),
        tp: plan.tp,
        dtype: plan.dtype.to_string(),
        param_count_per_rank,
        param_bytes_per_rank,
        real_param_count_per_rank,
        model_param_count,
        model_param_bytes,
        kv_cache_bytes_per_token_per_rank,
        collective_dtype: plan.dtype.to_string(),
        collectives: plan
            .collectives
            .iter()
            .map(|c| CollectiveSummary {
                kind: c.kind.clone(),
                layer: c.layer,
                value: c.name.clone(),
                elements_per_token: c.elements_per_token,
                bytes_per_token: c.bytes_per_token,
                ring_wire_bytes_per_token: c.ring_wire_bytes_per_token,
                algorithm: algorithms.get(&c.id).cloned().flatten(),
            })
            .collect(),
        collectives_per_layer: per_layer,
        collectives_outside_layers: outside,
        collective_count: plan.collectives.len() as u64,
        bytes_per_token_total: sum(plan.collectives.iter().map(|c| c.bytes_per_token)),
        ring_wire_bytes_per_token_total: sum(plan
            .collectives
            .iter()
            .map(|c| c.ring_wire_bytes_per_token)),
        column_row_pairs: plan.regions.len() as u64,
        fused_products_per_rank: plan.ranks.iter().map(|r| r.fused.len() as u64).collect(),
        fused_linears_per_rank: plan
            .ranks
            .iter()
            .map(|r| sum(r.fused.iter().map(|g| g.linears.len() as u64)))
            .collect(),
        notes: plan.notes.clone(),
        greedy_exchange: greedy_exchange(plan),
        top_k_exchange: top_k_exchange(plan),
        stages: stage_summaries(plan),
    }
}

/// Collective counts by kind per layer (from each layer's own collectives: a layer without
/// one of a kind counts 0) and outside layers.
fn count_collectives(plan: &Plan) -> (BTreeMap<String, LayerCount>, BTreeMap<String, u64>) {
    // Every layer of the program, also those without any collective.
    let mut by_layer: BTreeMap<u32, BTreeMap<&str, u64>> = plan
        .ranks
        .first()
        .map(|r| r.instrs.iter().filter_map(|i| i.layer))
        .into_iter()
        .flatten()
        .map(|l| (l, BTreeMap::new()))
        .collect();
    let mut outside: BTreeMap<String, u64> = BTreeMap::new();
    for c in &plan.collectives {
        match c.layer {
            Some(l) => *by_layer.entry(l).or_default().entry(&c.kind).or_default() += 1,
            None => *outside.entry(c.kind.clone()).or_default() += 1,
        }
    }
    let kinds: std::collections::BTreeSet<&str> =
        by_layer.values().flat_map(|m| m.keys().copied()).collect();
    let per_layer = kinds
        .into_iter()
        .map(|k| {
            let counts = by_layer.values().map(|m| m.get(k).copied().unwrap_or(0));
            (k.to_string(), LayerCount::of(counts))
        })
        .collect();
    (per_layer, outside)
}

/// Bytes in binary units with one decimal.
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

fn human_count(n: u64) -> String {
    match n {
        0..=9_999 => n.to_string(),
        10_000..=9_999_999 => format!("{:.2}M", n as f64 / 1e6),
        _ if n < 10_000_000_000 => format!("{:.3}B", n as f64 / 1e9),
        _ => format!("{:.1}B", n as f64 / 1e9),
    }
}

/// The human-readable table printed by `tpc compile`.
pub fn render_table(s: &Summary) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(out, "model {}  tp={}  dtype={}", s.model, s.tp, s.dtype);
    let _ = writeln!(
        out,
        "model parameters: {} ({})",
        human_count(s.model_param_count),
        human_bytes(s.model_param_bytes)
    );
    let shares = !s.real_param_count_per_rank.is_empty();
    let _ = write!(
        out,
        "\n{:>5}  {:>12}  {:>12}  {:>16}",
        "rank", "params", "bytes", "kv bytes/token"
    );
    let _ = writeln!(
        out,
        "{}",
        if shares { "   real params (share)" } else { "" }
    );
    let real_total = sum(s.real_param_count_per_rank.iter().copied()).max(1);
    for r in 0..s.tp as usize {
        let _ = write!(
            out,
            "{:>5}  {:>12}  {:>12}  {:>16}",
            r,
            human_count(s.param_count_per_rank[r]),
            human_bytes(s.param_bytes_per_rank[r]),
            s.kv_cache_bytes_per_token_per_rank[r]
        );
        let real = s.real_param_count_per_rank.get(r).copied();
        let _ = match real.filter(|_| shares) {
            Some(n) => writeln!(
                out,
                "  {:>12} ({:>4.1} %)",
                human_count(n),
                n as f64 * 100.0 / real_total as f64
            ),
            None => writeln!(out),
        };
    }
    if shares {
        let _ = writeln!(
            out,
            "(an uneven split: params count every piece padded to the largest; real params leave the padding out, as the CPU backend does)"
        );
    }
    let _ = writeln!(
        out,
        "\ncollectives (batch 1, per token; bytes of {} messages, the plan's dtype — `tpc run --json` reports what a run moved):",
        s.collective_dtype
    );
    let _ = writeln!(
        out,
        "{:<16} {:>10} {:>8} {:>16} {:>16}",
        "kind", "where", "count", "bytes each", "ring wire each"
    );
    // Group identical collectives (same kind, inside/outside layers, same size).
    let mut groups: BTreeMap<(String, bool, u64, u64), u64> = BTreeMap::new();
    for c in &s.collectives {
        *groups
            .entry((
                c.kind.clone(),
                c.layer.is_some(),
                c.bytes_per_token,
                c.ring_wire_bytes_per_token,
            ))
            .or_default() += 1;
    }
    for ((kind, in_layer, bytes, wire), count) in &groups {
        let place = if *in_layer { "layers" } else { "outside" };
        let _ = writeln!(
            out,
            "{kind:<16} {place:>10} {count:>8} {bytes:>16} {wire:>16}"
        );
    }
    let mut choices: Vec<&crate::ir::AlgorithmChoice> = s
        .collectives
        .iter()
        .filter_map(|c| c.algorithm.as_ref())
        .collect();
    choices.dedup();
    for c in choices {
        let _ = writeln!(
            out,
            "all-reduce algorithm by message size (profile {}): {}",
            c.profile,
            c.describe()
        );
    }
    let per_layer: Vec<String> = s
        .collectives_per_layer
        .iter()
        .map(|(k, v)| format!("{v} {k}"))
        .collect();
    let differ = s
        .collectives_per_layer
        .values()
        .any(|c| matches!(c, LayerCount::Differ { .. }));
    let _ = writeln!(
        out,
        "per layer{}: {}; total: {} collectives, {} per token ({} on the wire per rank, ring)",
        if differ { " (layers differ)" } else { "" },
        if per_layer.is_empty() {
            "none".to_string()
        } else {
            per_layer.join(", ")
        },
        s.collective_count,
        human_bytes(s.bytes_per_token_total),
        human_bytes(s.ring_wire_bytes_per_token_total)
    );
    let _ = writeln!(
        out,
        "column→row pairs (no communication inside): {}",
        s.column_row_pairs
    );
    render_fused(&mut out, s);
    if let Some(g) = s.greedy_exchange {
        let _ = writeln!(
            out,
            "greedy decode: ranks exchange (value, index) pairs, {} per token instead of the {} logits gather",
            human_bytes(g.pair_bytes_per_token),
            human_bytes(g.logits_gather_bytes_per_token)
        );
    }
    if let Some(t) = s.top_k_exchange.filter(|t| t.max_k > 0) {
        let _ = writeln!(
            out,
            "sampling with --top-k K: ranks exchange K pairs each, 8·K·tp = {}·K per token instead of the {} logits gather (K up to {}; a larger K gathers)",
            human_bytes(t.pair_bytes_per_token_per_k),
            human_bytes(t.logits_gather_bytes_per_token),
            t.max_k
        );
    }
    render_stages(&mut out, s);
    for n in &s.notes {
        let _ = writeln!(out, "note: {n}");
    }
    out
}

/// How many linears run as fused products, per rank (one figure when every rank has it).
fn render_fused(out: &mut String, s: &Summary) {
    use std::fmt::Write;
    let pairs: Vec<(u64, u64)> = s
        .fused_products_per_rank
        .iter()
        .copied()
        .zip(s.fused_linears_per_rank.iter().copied())
        .collect();
    let Some(&first) = pairs.first() else { return };
    if first.0 == 0 && pairs.iter().all(|&p| p == first) {
        return;
    }
    let counts = if pairs.iter().all(|&p| p == first) {
        format!(
            "{} products running {} linears on each rank",
            first.0, first.1
        )
    } else {
        let each: Vec<String> = pairs
            .iter()
            .enumerate()
            .map(|(r, (p, l))| format!("rank {r}: {p} running {l}"))
            .collect();
        each.join(", ")
    };
    let _ = writeln!(
        out,
        "fused products (linears that read one input run as one product): {counts}"
    );
}

/// The pipeline stages' table: layers, per-rank memory and what crosses to the next stage.
fn render_stages(out: &mut String, s: &Summary) {
    use std::fmt::Write;
    if s.stages.is_empty() {
        return;
    }
    let _ = writeln!(
        out,
        "\npipeline: {} stages of {} rank(s) (global rank = stage·tp + tp rank); per rank, the fullest of the stage's tp ranks:",
        s.stages.len(),
        s.tp
    );
    let _ = writeln!(
        out,
        "{:>5}  {:>9}  {:>10}  {:>12}  {:>12}  {:>14}  {:>11}  {:>16}",
        "stage",
        "layers",
        "ranks",
        "params",
        "bytes",
        "kv bytes/token",
        "collectives",
        "send bytes/token"
    );
    let max = |v: &[u64]| v.iter().copied().max().unwrap_or(0);
    for st in &s.stages {
        let ranks = match (st.ranks.first(), st.ranks.last()) {
            (Some(a), Some(b)) if a != b => format!("{a}–{b}"),
            (Some(a), _) => a.to_string(),
            _ => String::new(),
        };
        let layers = format!(
            "{}–{}",
            st.first_layer,
            u64::from(st.first_layer) + u64::from(st.layers).saturating_sub(1)
        );
        let _ = writeln!(
            out,
            "{:>5}  {:>9}  {:>10}  {:>12}  {:>12}  {:>14}  {:>11}  {:>16}",
            st.stage,
            layers,
            ranks,
            human_count(max(&st.param_count_per_rank)),
            human_bytes(max(&st.param_bytes_per_rank)),
            max(&st.kv_cache_bytes_per_token_per_rank),
            st.collective_count,
            st.send_bytes_per_token_per_rank
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(model: &str, tp: u64) -> Plan {
        let def = crate::frontend::load::load_model(std::path::Path::new(model)).unwrap();
        crate::plan::build::compile(&def, tp).unwrap().plan
    }

    #[test]
    fn the_summary_counts_fused_products_per_rank() {
        let s = summarize(&plan("models/tiny-llama.ron", 2));
        // Two layers of q|k|v and gate|up.
        assert_eq!(s.fused_products_per_rank, vec![4, 4]);
        assert_eq!(s.fused_linears_per_rank, vec![10, 10]);
        let table = render_table(&s);
        assert!(
            table.contains("run as one product): 4 products running 10 linears on each rank"),
            "{table}"
        );
        // GPT-2's c_attn is one linear already: nothing to say.
        let s = summarize(&plan("models/tiny-gpt2.ron", 2));
        assert_eq!(s.fused_products_per_rank, vec![0, 0]);
        assert!(!render_table(&s).contains("fused products"));
        // A summary written before the fields existed still reads.
        let mut json = serde_json::to_value(&s).unwrap();
        json.as_object_mut()
            .unwrap()
            .remove("fused_products_per_rank");
        json.as_object_mut()
            .unwrap()
            .remove("fused_linears_per_rank");
        let back: Summary = serde_json::from_value(json).unwrap();
        assert!(back.fused_products_per_rank.is_empty());
    }
}
