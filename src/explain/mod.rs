//! `tpc explain`: for each weight (a repeated weight once, its layers grouped) the layout it
//! got, the rule and the chain of ops that decided it (or the override that forced it), the
//! collectives it causes with bytes per token, and what the other split would cost — found
//! by compiling again with that one weight forced the other way.

mod caused;
mod render;

use crate::error::{Result, TpcError};
use crate::frontend::{ModelDef, TpWord};
use crate::ir::op_dims::{dims, Role};
use crate::ir::{Graph, Groups, Layout, NodeId, Op};
use crate::passes::ShardOptions;
use crate::passes::{Decision, Reason};
use crate::pipeline::compile_full;
use crate::plan::report::{summarize, Summary};
use crate::plan::Plan;
pub use render::render_text;
use serde::Serialize;
use std::collections::BTreeMap;

/// Everything `tpc explain` says about one model at one tp.
#[derive(Debug, Clone, Serialize)]
pub struct Explanation {
    pub model: String,
    pub tp: u64,
    /// The `--tp-shares` the plan was dealt by, if any.
    pub shares: Option<String>,
    /// The element type collective bytes count.
    pub dtype: String,
    pub weights: Vec<WeightExplain>,
}

/// One weight, or one weight repeated in several layers with the same story.
#[derive(Debug, Clone, Serialize)]
pub struct WeightExplain {
    /// The checkpoint name; a repeated weight as `model.layers.{0..31}.mlp.up_proj.weight`.
    pub tensor: String,
    /// Every checkpoint tensor this entry stands for.
    pub tensors: Vec<String>,
    pub shape: Vec<u64>,
    /// `column` (output features), `row` (input features), `vocab` (an embedding's
    /// looked-up rows), `split` (a weight that follows its op) or `replicated`.
    pub layout: String,
    pub dim: Option<u32>,
    /// Whether the split dim is a (padded) vocabulary.
    pub vocab_dim: bool,
    /// Bytes of one tensor on the fullest rank.
    pub bytes_per_rank: u64,
    /// Where the split is uneven (a tp that the atoms do not divide, or `--tp-shares`):
    /// each rank's real length of the split dim, in rank order; every piece is padded to
    /// the largest. Empty for an even split.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub pieces: Vec<u64>,
    /// How a quantized checkpoint stores the weight (its format and scale blocks, which the
    /// split keeps whole); absent for a weight stored as is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stored: Option<String>,
    /// The rule branch as a word (`reads_whole_activation`, `reads_split_activation`,
    /// `embedding_vocab`, `override`, `follows_its_op`, `no_splittable_dim`, `tp_1`).
    pub rule: String,
    /// The rule as a sentence.
    pub why: String,
    /// The op whose rule placed the weight (its first consumer), for the first tensor.
    pub decided_by: Link,
    /// The activation that op reads, then the split values behind it back to the linear
    /// whose split made it split (first tensor; empty for a weight that follows its op).
    pub chain: Vec<Link>,
    /// Weights of every linear whose split reaches that activation (the region's openers).
    pub opened_by: Vec<String>,
    /// The `tp_plan` word that forced the layout, if one did.
    #[serde(rename = "override")]
    pub override_word: Option<String>,
    /// Other ops reading the same tensor (a tied LM head), which take its layout as given.
    pub also_read_by: Vec<Link>,
    pub collectives: Vec<Caused>,
    pub alternative: Alternative,
}

/// A node named in an explanation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Link {
    pub name: String,
    pub op: String,
    pub layout: String,
}

/// A collective a weight's split causes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Caused {
    pub kind: String,
    /// The collective's value (for the first tensor of a group).
    pub value: String,
    /// The collective's value for every tensor of the group.
    pub values: Vec<String>,
    pub bytes_per_token: u64,
    /// How many of them the entry causes: one per tensor of the group.
    pub count: u64,
    /// Other weights whose partial sums the same collective reduces.
    pub shared_with: Vec<String>,
}

/// What forcing the other split on the entry's first tensor does to the whole model.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Alternative {
    Feasible {
        word: String,
        forced: String,
        layout: String,
        dim: Option<u32>,
        /// Change of the plan's total collective bytes per token.
        collective_bytes_per_token_delta: i64,
        /// Change in collective counts by kind (kinds that change only).
        collectives_delta: BTreeMap<String, i64>,
        /// Change of the fullest rank's parameter bytes.
        param_bytes_per_rank_delta: i64,
    },
    Infeasible {
        word: String,
        forced: String,
        reason: String,
    },
    /// No other split to try (tp = 1, a weight that follows its op).
    None { reason: String },
}

/// Each rank's real length of `tensor`'s split dim, where some rank's piece is padded;
/// empty where the split is even or the weight is replicated.
fn uneven_pieces(plan: &Plan, tensor: &str) -> Vec<u64> {
    let slices: Vec<_> = plan
        .ranks
        .iter()
        .filter_map(|r| r.weights.iter().find(|w| &*w.tensor == tensor))
        .collect();
    if slices.len() != plan.ranks.len() || slices.iter().all(|w| w.pad_len() == 0) {
        return Vec::new();
    }
    slices.iter().map(|w| w.real_len()).collect()
}

/// Explains every weight of `def` at `tp`, compiled with `options` (its `--tp-shares`),
/// whose checkpoint name `pattern` matches (see [`name_matches`]).
pub fn explain(
    def: &ModelDef,
    tp: u64,
    options: ShardOptions,
    pattern: Option<&str>,
) -> Result<Explanation> {
    let base = compile_full(def, tp, &BTreeMap::new(), options)?;
    let summary = summarize(&base.plan);
    let graph = &base.sharded.graph;
    let decisions = &base.sharded.ctx.decisions;
    let mut params: Vec<NodeId> = decisions.keys().copied().collect();
    params.sort_by_key(|&p| graph.node(p).order);
    let chosen: Vec<NodeId> = params
        .iter()
        .copied()
        .filter(|&p| pattern.is_none_or(|pat| name_matches(pat, tensor_of(graph, p))))
        .collect();
    if let (Some(pattern), true) = (pattern, chosen.is_empty()) {
        return Err(TpcError::NoWeightMatches {
            model: base.plan.model.clone(),
            pattern: pattern.to_string(),
            examples: examples(graph, &params),
        });
    }
    let causes = caused::by_weight(graph, &params, &base.plan);
    let bytes = bytes_per_rank(&base.plan);
    let mut groups: Vec<(Key, Vec<NodeId>)> = Vec::new();
    for &p in &chosen {
        let key = key_of(graph, &base.sharded.ctx.overrides, decisions, &causes, p);
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, members)) => members.push(p),
            None => groups.push((key, vec![p])),
        }
    }
    let weights = groups
        .into_iter()
        .map(|(key, members)| {
            let first = members[0];
            let decision = &decisions[&first];
            let tensor = tensor_of(graph, first);
            let layers: Vec<u32> = members.iter().filter_map(|&m| graph.node(m).layer).collect();
            let shown = match (&key.template, members.len()) {
                (Some(t), n) if n > 1 => t.replace("{}", &format!("{{{}}}", spans(&layers))),
                _ => tensor.to_string(),
            };
            let none = Vec::new();
            let of = |m: NodeId| causes.get(&m).unwrap_or(&none);
            let collectives = of(first)
                .iter()
                .enumerate()
                .map(|(i, c)| Caused {
                    count: members.len() as u64,
                    // Same kinds and sizes in every member (part of the group key).
                    values: members
                        .iter()
                        .filter_map(|&m| of(m).get(i).map(|c| c.value.clone()))
                        .collect(),
                    ..c.clone()
                })
                .collect();
            let followed = matches!(decision.reason, Reason::Follows | Reason::SingleRank);
            let (chain, openers) = if followed {
                (&[][..], &[][..])
            } else {
                (&decision.chain[..], &decision.openers[..])
            };
            WeightExplain {
                tensor: shown,
                tensors: members
                    .iter()
                    .map(|&m| tensor_of(graph, m).to_string())
                    .collect(),
                shape: param_shape(graph, first),
                layout: key.layout.to_string(),
                dim: key.dim,
                vocab_dim: key.vocab,
                bytes_per_rank: bytes.get(tensor).copied().unwrap_or(0),
                pieces: uneven_pieces(&base.plan, tensor),
                stored: match &graph.node(first).op {
                    Op::Param(p) => p.quant.map(|q| q.describe()),
                    _ => None,
                },
                rule: decision.reason.word().to_string(),
                why: match (decision.reason, key.layout, key.vocab) {
                    (Reason::ReadsWhole, "column", true) => "linear reads a whole activation → column split; its columns are the vocabulary, so each rank makes its slice of the logits".to_string(),
                    (why, ..) => why.sentence(),
                },
                decided_by: link(graph, decision.consumer),
                chain: chain.iter().map(|&n| link(graph, n)).collect(),
                opened_by: openers
                    .iter()
                    .map(|&n| weight_name(graph, n))
                    .collect(),
                override_word: key.word.map(|w| w.word().to_string()),
                also_read_by: graph
                    .users(first)
                    .into_iter()
                    .map(|(u, _)| u)
                    .filter(|&u| u != decision.consumer && !graph.node(u).op.is_collective())
                    .map(|u| link(graph, u))
                    .collect(),
                collectives,
                alternative: alternative(
                    (def, tp, &options),
                    &summary,
                    graph,
                    first,
                    decision,
                    key.layout,
                ),
            }
        })
        .collect();
    Ok(Explanation {
        model: base.plan.model.clone(),
        tp,
        shares: options.shares.map(|s| s.to_string()),
        dtype: base.plan.dtype.to_string(),
        weights,
    })
}

/// Whether `pattern` picks the checkpoint tensor `name`: with `*` a glob over the whole
/// name (`*` matches any characters, dots included), otherwise a substring.
pub fn name_matches(pattern: &str, name: &str) -> bool {
    if !pattern.contains('*') {
        return name.contains(pattern);
    }
    let parts: Vec<&str> = pattern.split('*').collect();
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    let fits = name.len() >= first.len() + last.len();
    if !fits || !name.starts_with(first) || !name.ends_with(last) {
        return false;
    }
    let mut rest = &name[first.len()..name.len() - last.len()];
    for part in &parts[1..parts.len() - 1] {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    true
}

/// What entries of one group share.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Key {
    /// The name with its layer index as `{}`.
    template: Option<String>,
    shape: Vec<u64>,
    layout: &'static str,
    dim: Option<u32>,
    vocab: bool,
    reason: Reason,
    word: Option<TpWord>,
    caused: Vec<(String, u64)>,
}

fn key_of(
    graph: &Graph,
    overrides: &rustc_hash::FxHashMap<NodeId, TpWord>,
    decisions: &rustc_hash::FxHashMap<NodeId, Decision>,
    causes: &BTreeMap<NodeId, Vec<Caused>>,
    p: NodeId,
) -> Key {
    let decision = &decisions[&p];
    let (layout, dim, vocab) = kind_of(graph, p, decision);
    Key {
        template: template(tensor_of(graph, p), graph.node(p).layer),
        shape: param_shape(graph, p),
        layout,
        dim,
        vocab,
        reason: decision.reason,
        word: overrides.get(&p).copied(),
        caused: causes
            .get(&p)
            .map(|c| {
                c.iter()
                    .map(|c| (c.kind.clone(), c.bytes_per_token))
                    .collect()
            })
            .unwrap_or_default(),
    }
}

fn tensor_of(graph: &Graph, p: NodeId) -> &str {
    match &graph.node(p).op {
        Op::Param(op) => &op.tensor,
        _ => &graph.node(p).name,
    }
}

fn param_shape(graph: &Graph, p: NodeId) -> Vec<u64> {
    match &graph.node(p).op {
        Op::Param(op) => op.shape.clone(),
        _ => vec![],
    }
}

fn link(graph: &Graph, n: NodeId) -> Link {
    let node = graph.node(n);
    Link {
        name: node.name.to_string(),
        op: node.op.kind().to_string(),
        layout: graph.layout(n).to_string(),
    }
}

/// The weight a linear or embedding reads, by checkpoint name.
fn weight_name(graph: &Graph, op: NodeId) -> String {
    graph
        .inputs(op)
        .get(1)
        .map(|&w| tensor_of(graph, w).to_string())
        .unwrap_or_else(|| graph.node(op).name.to_string())
}

/// Which kind of split a weight has, judged by the dims of the op that placed it.
fn kind_of(graph: &Graph, p: NodeId, decision: &Decision) -> (&'static str, Option<u32>, bool) {
    let Layout::Split { dim } = graph.layout(p) else {
        return ("replicated", None, false);
    };
    let vocab = match &graph.node(p).op {
        Op::Param(op) => op.groups_of(dim) == (Groups::Plain { padded: true }),
        _ => false,
    };
    if decision.reason == Reason::Follows {
        return ("split", Some(dim), vocab);
    }
    let c = decision.consumer;
    let inputs = graph.inputs(c);
    let ranks: Vec<usize> = inputs
        .iter()
        .map(|&i| graph.node(i).fact.shape.rank())
        .collect();
    let d = dims(&graph.node(c).op);
    let kind = inputs
        .iter()
        .position(|&i| i == p)
        .and_then(|slot| {
            [
                (Role::Kept, "column"),
                (Role::Contracted, "row"),
                (Role::Lookup, "vocab"),
            ]
            .into_iter()
            .find(|&(role, _)| d.input_dim_with(slot, role, &ranks) == Some(dim))
            .map(|(_, kind)| kind)
        })
        .unwrap_or("split");
    (kind, Some(dim), vocab)
}

/// `name` with the dotted segment that is its layer index replaced by `{}`.
fn template(name: &str, layer: Option<u32>) -> Option<String> {
    let layer = layer?.to_string();
    let segs: Vec<&str> = name.split('.').collect();
    let at = segs.iter().position(|s| *s == layer)?;
    let mut out: Vec<&str> = segs.clone();
    out[at] = "{}";
    Some(out.join("."))
}

/// Sorted layer numbers as inclusive runs: `0..31`, `0..3,5`.
fn spans(layers: &[u32]) -> String {
    let mut v = layers.to_vec();
    v.sort_unstable();
    v.dedup();
    let mut runs: Vec<String> = Vec::new();
    let mut i = 0;
    while i < v.len() {
        let mut j = i;
        while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
            j += 1;
        }
        runs.push(if j == i {
            v[i].to_string()
        } else {
            format!("{}..{}", v[i], v[j])
        });
        i = j + 1;
    }
    runs.join(",")
}

/// A few names a pattern could have matched: distinct shapes of name, layers folded.
fn examples(graph: &Graph, params: &[NodeId]) -> Vec<String> {
    let mut seen: Vec<String> = Vec::new();
    for &p in params {
        let name = tensor_of(graph, p);
        let shown = template(name, graph.node(p).layer)
            .map(|t| t.replace("{}", "0"))
            .unwrap_or_else(|| name.to_string());
        if !seen.contains(&shown) {
            seen.push(shown);
        }
    }
    seen.truncate(6);
    seen
}

/// Each checkpoint tensor's bytes on the fullest rank.
fn bytes_per_rank(plan: &crate::plan::Plan) -> BTreeMap<String, u64> {
    let mut out: BTreeMap<String, u64> = BTreeMap::new();
    for rank in &plan.ranks {
        for w in &rank.weights {
            let b = out.entry(w.tensor.to_string()).or_default();
            *b = (*b).max(w.local_bytes());
        }
    }
    out
}

fn delta(new: u64, old: u64) -> i64 {
    (i128::from(new) - i128::from(old)).clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64
}

/// Forces the other split on weight `p` alone and compares the whole plan with `base`.
fn alternative(
    (def, tp, options): (&ModelDef, u64, &ShardOptions),
    base: &Summary,
    graph: &Graph,
    p: NodeId,
    decision: &Decision,
    layout: &str,
) -> Alternative {
    let word = match (decision.reason, layout) {
        (Reason::SingleRank, _) => {
            return Alternative::None {
                reason: "tp = 1: there is nothing to split".into(),
            }
        }
        (Reason::Follows, _) => {
            return Alternative::None {
                reason: format!(
                    "it follows `{}`; force that op's weight instead",
                    graph.node(decision.consumer).name
                ),
            }
        }
        (_, "column") => TpWord::Rowwise,
        (_, "row" | "vocab" | "replicated") => TpWord::Colwise,
        _ => {
            return Alternative::None {
                reason: "no tp_plan word names another split of this weight".into(),
            }
        }
    };
    let forced = tensor_of(graph, p).to_string();
    let plan = BTreeMap::from([(forced.clone(), word)]);
    match compile_full(def, tp, &plan, *options) {
        Err(e) => Alternative::Infeasible {
            word: word.word().into(),
            forced,
            reason: e.to_string(),
        },
        Ok(alt) => {
            let s = summarize(&alt.plan);
            let g = &alt.sharded.graph;
            let found = alt
                .sharded
                .ctx
                .decisions
                .iter()
                .find(|(&n, _)| tensor_of(g, n) == forced);
            let (layout, dim, _) =
                found.map_or(("replicated", None, false), |(&n, d)| kind_of(g, n, d));
            let counts = |s: &Summary| {
                let mut m: BTreeMap<String, i64> = BTreeMap::new();
                for c in &s.collectives {
                    *m.entry(c.kind.clone()).or_default() += 1;
                }
                m
            };
            let (old, new) = (counts(base), counts(&s));
            let mut collectives_delta = BTreeMap::new();
            for kind in old.keys().chain(new.keys()) {
                let d = new.get(kind).unwrap_or(&0) - old.get(kind).unwrap_or(&0);
                if d != 0 {
                    collectives_delta.insert(kind.clone(), d);
                }
            }
            let fullest = |s: &Summary| s.param_bytes_per_rank.iter().copied().max().unwrap_or(0);
            Alternative::Feasible {
                word: word.word().into(),
                forced,
                layout: layout.into(),
                dim,
                collective_bytes_per_token_delta: delta(
                    s.bytes_per_token_total,
                    base.bytes_per_token_total,
                ),
                collectives_delta,
                param_bytes_per_rank_delta: delta(fullest(&s), fullest(base)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_are_substrings_or_globs() {
        let n = "model.layers.3.mlp.up_proj.weight";
        assert!(name_matches("up_proj", n));
        assert!(!name_matches("down_proj", n));
        assert!(name_matches("*.mlp.*", n));
        assert!(name_matches("model.*.weight", n));
        assert!(!name_matches("*.mlp", n));
        assert!(!name_matches("lm_head*", n));
        assert!(name_matches("*", n));
        assert!(!name_matches("model.*s.3.*s.3.*", n));
    }

    #[test]
    fn layers_fold_into_runs() {
        assert_eq!(spans(&[3, 0, 1, 2]), "0..3");
        assert_eq!(spans(&[0, 1, 2, 5, 7, 8]), "0..2,5,7..8");
        assert_eq!(
            template("model.layers.12.mlp.up_proj.weight", Some(12)).as_deref(),
            Some("model.layers.{}.mlp.up_proj.weight")
        );
        assert_eq!(template("lm_head.weight", None), None);
    }
}
