//! Feasibility, decided before any weight is read: every split weight must divide among
//! the ranks by whole heads (kv heads may be replicated), vocabularies are padded. An
//! impossible tp is one error that names each constraint and lists the tp values that work.

use super::ShardCtx;
use crate::error::{Result, TpcError};
use crate::ir::{Deal, Graph, Groups, Layout, Op, Quantized};
use std::collections::BTreeSet;

/// Largest tp tpc plans for (checked before the graph is built); also the range the
/// infeasibility message searches for valid values.
pub const MAX_TP: u64 = 1024;

/// One split dimension of a weight: its structure, its length, and how the checkpoint
/// stores the weight when it is quantized.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SplitDim {
    pub groups: Groups,
    pub len: u64,
    dim: u32,
    /// The weight's dims.
    ndim: usize,
    quant: Option<Quantized>,
    /// The plan's quantization blocks (`ir::quant::graph_split_block`).
    block: u64,
}

impl SplitDim {
    /// Why the dim cannot be dealt so: its structure does not share, or some rank's piece
    /// would cut the blocks that share one quantization scale.
    pub fn problem(&self, deal: Deal) -> Option<String> {
        if let Err(p) = self.groups.check_dealt(self.len, deal) {
            return Some(p.describe(deal.tp));
        }
        let q = self.quant?;
        (0..deal.tp).find_map(|rank| {
            let piece = self.groups.slice_dealt(self.len, deal, rank).ok()?;
            q.cut_by(self.dim, self.ndim, self.len, &piece.ranges).map(|why| {
                format!(
                    "at tp={} rank {rank}'s piece, {why}; a split must keep every block on one rank",
                    deal.tp
                )
            })
        })
    }

    /// Whether the dim splits evenly `tp` ways, blocks whole.
    pub fn fits(&self, tp: u64) -> bool {
        self.problem(Deal::even(tp).in_blocks(self.block)).is_none()
    }
}

/// Every distinct split dimension of `graph`'s weights; `block` is the plan's quantization
/// blocks (`ShardCtx::block`).
pub(crate) fn split_dims(graph: &Graph, block: u64) -> Vec<(String, SplitDim)> {
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for n in graph.g.node_weights() {
        let (Op::Param(p), Some(Layout::Split { dim })) = (&n.op, n.layout) else {
            continue;
        };
        let Some(&len) = p.shape.get(dim as usize) else {
            continue;
        };
        let groups = p.groups_of(dim);
        let pattern = tensor_pattern(&p.tensor);
        if seen.insert((pattern.clone(), format!("{groups:?}{:?}", p.quant), len)) {
            out.push((
                pattern,
                SplitDim {
                    groups,
                    len,
                    dim,
                    ndim: p.shape.len(),
                    quant: p.quant,
                    block,
                },
            ));
        }
    }
    out
}

/// `model.layers.3.mlp.up_proj.weight` → `model.layers.*.mlp.up_proj.weight`
pub fn tensor_pattern(tensor: &str) -> String {
    tensor
        .split('.')
        .map(|s| {
            if s.chars().all(|c| c.is_ascii_digit()) {
                "*"
            } else {
                s
            }
        })
        .collect::<Vec<_>>()
        .join(".")
}

pub fn check_feasibility(graph: &mut Graph, ctx: &mut ShardCtx) -> Result<()> {
    let dims = split_dims(graph, ctx.block);
    let tp = ctx.tp;
    // One reason per distinct constraint, with every weight it concerns.
    let mut reasons: Vec<(String, Vec<String>)> = Vec::new();
    let mut uneven: Vec<(String, Vec<String>)> = Vec::new();
    let say = |list: &mut Vec<(String, Vec<String>)>, text: String, pattern: &str| match list
        .iter_mut()
        .find(|(t, _)| *t == text)
    {
        Some((_, names)) => names.push(format!("`{pattern}`")),
        None => list.push((text, vec![format!("`{pattern}`")])),
    };
    for (pattern, d) in &dims {
        if let Some(problem) = d.problem(ctx.deal()) {
            say(&mut reasons, problem, pattern);
        } else if let Some(text) = uneven_note(&d.groups, d.len, ctx.deal()) {
            say(&mut uneven, text, pattern);
        }
        notes_for(&d.groups, d.len, ctx.deal(), &mut ctx.notes);
    }
    // Said at any tp (tp 1 splits nothing): the report's bytes are the stored ones.
    let quantized = graph.g.node_weights().find_map(|n| match &n.op {
        Op::Param(p) => p.quant,
        _ => None,
    });
    if let Some(q) = quantized {
        ctx.notes.push(format!(
            "quantized checkpoint ({}): each rank reads the scales of its pieces",
            q.describe()
        ));
    }
    if let Some(shares) = ctx.shares {
        ctx.notes.push(format!(
            "--tp-shares {shares}: every split dimension dealt by the shares in whole atoms (heads by their key/value groups, MLP columns and vocabulary rows in blocks)"
        ));
    }
    ctx.notes.extend(
        uneven
            .into_iter()
            .map(|(text, names)| format!("{text} ({})", names.join(", "))),
    );
    let reasons: Vec<String> = reasons
        .into_iter()
        .map(|(text, names)| format!("{text} ({})", names.join(", ")))
        .collect();
    if reasons.is_empty() {
        return Ok(());
    }
    let valid = valid_tps(&dims, |_| true);
    Err(TpcError::Infeasible {
        model: graph.name.clone(),
        tp,
        reasons,
        valid,
    })
}

/// The tps every split dim allows and `also` accepts.
fn valid_tps(dims: &[(String, SplitDim)], also: impl Fn(u64) -> bool) -> Vec<u64> {
    (1..=MAX_TP)
        .filter(|&t| also(t) && dims.iter().all(|(_, d)| d.fits(t)))
        .collect()
}

/// What an uneven split gives each rank (an evenly dealt vocabulary has its own note); a
/// fused dimension (`[q | k | v]`) by its first part, each part being dealt on its own and
/// padded inside the piece, which every backend computes.
fn uneven_note(groups: &Groups, len: u64, deal: Deal) -> Option<String> {
    let vocabulary = matches!(groups, Groups::Plain { padded: true });
    if vocabulary && deal.shares.is_none() {
        return None;
    }
    let (dealt, len, parts) = match groups {
        Groups::Concat(parts) => {
            let first = parts.first()?;
            (first, first.covered_len()?, Some(parts.len()))
        }
        _ => (groups, len, None),
    };
    let shares = dealt.uneven_shares(len, deal)?;
    let by = match deal.shares {
        Some(s) => format!(" by shares {s}"),
        None => String::new(),
    };
    let (unit, size) = match dealt {
        g if g.is_experts() => ("experts", 1),
        Groups::Heads { size, .. } if *size > 1 || parts.is_some() => ("heads", (*size).max(1)),
        _ if vocabulary => ("vocabulary rows", 1),
        _ => ("columns", 1),
    };
    let list: Vec<String> = shares.iter().map(|s| (s / size).to_string()).collect();
    let (tp, count, list) = (deal.tp, len / size, list.join("/"));
    Some(match parts {
        Some(n) => format!(
            "uneven split at tp={tp}{by}: a fused dimension of {n} parts, {count} heads of each dealt {list} (each part padded with zeros inside the piece to the largest; linears skip the padding on CPUs and GPUs)"
        ),
        None => {
            let largest = shares.iter().max().copied().unwrap_or(0) / size;
            format!(
                "uneven split at tp={tp}{by}: {count} {unit} dealt {list} (each piece padded with zeros to {largest}, the largest; linears skip the padding on CPUs and GPUs)"
            )
        }
    })
}

fn notes_for(groups: &Groups, len: u64, deal: Deal, notes: &mut Vec<String>) {
    let tp = deal.tp;
    let mut add = |s: String| {
        if !notes.contains(&s) {
            notes.push(s)
        }
    };
    match groups {
        // Dealt by shares, the vocabulary has its uneven note instead.
        Groups::Plain { padded: true } if !len.is_multiple_of(tp) && deal.shares.is_none() => {
            let padded = len.div_ceil(tp) * tp;
            add(format!(
                "vocabulary of {len} rows padded to {padded} for tp={tp} ({} padding rows at the end); padded rows are masked and padded logits are dropped",
                padded - len
            ));
        }
        Groups::Heads {
            count,
            replicable: true,
            ..
        } if tp > *count && tp.is_multiple_of(*count) => {
            add(format!(
                "{count} key/value heads for tp={tp}: each kv head is replicated on {} ranks",
                tp / count
            ));
        }
        Groups::Heads {
            count,
            replicable: true,
            kv_groups: Some(_),
            ..
        } if tp > *count => {
            add(format!(
                "{count} key/value heads for tp={tp}: each kv head is replicated on {} or {} ranks (its query heads shared among them)",
                tp / count,
                tp / count + 1
            ));
        }
        Groups::Concat(parts) => {
            for p in parts {
                notes_for(p, p.covered_len().unwrap_or(0), deal, &mut *notes);
            }
        }
        _ => {}
    }
}

/// Refuses an all-gather of heads that are replicated on several ranks. (Gathers, local
/// slices and reduce-scatters of unequal pieces are partitioned with per-rank counts: those
/// of the weight that deals or reads the dim, or a plain deal of it, `plan::partition`.)
pub fn check_gathers_join_disjoint_pieces(graph: &mut Graph, ctx: &mut ShardCtx) -> Result<()> {
    for id in graph.g.node_indices() {
        let node = graph.node(id);
        let Op::AllGather(g) = &node.op else {
            continue;
        };
        if !node.fact.shape.is_sequence(g.dim) {
            check_gathered_heads_disjoint(graph, id, g.dim, ctx)?;
        }
    }
    Ok(())
}

/// An all-gather joins the ranks' pieces, so no entry may be on two ranks. Heads replicated
/// because tp exceeds their count (kv heads) are: gathering them back whole (OLMoE's q and
/// k, whose norms span every head) is refused, naming the tp values that work.
fn check_gathered_heads_disjoint(
    graph: &Graph,
    id: crate::ir::NodeId,
    dim: u32,
    ctx: &ShardCtx,
) -> Result<()> {
    let weight = graph
        .inputs(id)
        .first()
        .and_then(|&p| crate::ir::dealing::dealing_weight(graph, p, dim))
        .map(|w| graph.node(w));
    let Some((Op::Param(p), Some(Layout::Split { dim: wdim }))) = weight.map(|w| (&w.op, w.layout))
    else {
        return Ok(());
    };
    let len = p.shape.get(wdim as usize).copied().unwrap_or(0);
    let groups = p.groups_of(wdim);
    // Replicated heads: the ranks' pieces hold more entries than the dim has. (A deal that
    // fails is another check's refusal.)
    let disjoint = |deal: Deal| {
        let mut total = 0u64;
        for rank in 0..deal.tp {
            match groups.slice_dealt(len, deal, rank) {
                Ok(piece) => total = total.saturating_add(piece.real_len()),
                Err(_) => return true,
            }
        }
        total <= len
    };
    if disjoint(Deal::by(ctx.tp, ctx.shares)) {
        return Ok(());
    }
    let dims = split_dims(graph, ctx.block);
    Err(TpcError::Infeasible {
        model: graph.name.clone(),
        tp: ctx.tp,
        reasons: vec![format!(
            "`{}` gathers `{}`'s split dim whole (a norm over every head), and at tp={} some of its heads are replicated on several ranks (more ranks than heads), which a gather cannot join back; use a tp at most their count",
            graph.node(id).name,
            p.tensor,
            ctx.tp
        )],
        valid: valid_tps(&dims, |t| disjoint(Deal::by(t, None))),
    })
}
