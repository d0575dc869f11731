//! Partition: the sharded global graph → one program per rank with local shapes and
//! local attributes, plus the weight-slice manifest and the list of collectives.

use super::*;
use crate::error::{Result, TpcError};
use crate::ir::op_dims::dims;
use crate::ir::shape::infer;
use crate::ir::{
    AllGatherOp, Deal, Dim, DimSlice, Graph, Groups, LocalSliceOp, NodeId, Op, ParamOp,
    ReduceScatterOp, Shape,
};
use crate::passes::Sharded;
use smallvec::SmallVec;
use std::collections::HashMap;

fn bug(pass: &'static str, node: &str, message: String) -> TpcError {
    TpcError::Verify {
        pass,
        problems: vec![crate::ir::verify::Problem {
            node: node.to_string(),
            message,
        }],
    }
}

/// Whether `node` only runs on rank 0: adding a replicated term to partial sums must
/// happen once, so other ranks pass their partial sum through (the op's dims say which
/// ops add a term, and which input is passed through).
fn rank0_only(graph: &Graph, id: NodeId) -> Option<usize> {
    let node = graph.node(id);
    let output = node.layout?;
    let inputs: Vec<Layout> = graph.inputs(id).iter().map(|&i| graph.layout(i)).collect();
    dims(&node.op).rank0_only(&inputs, output)
}

fn weight_slice(
    p: &ParamOp,
    layout: Layout,
    deal: Deal,
    rank: u64,
    dtype: DType,
) -> std::result::Result<WeightSlice, String> {
    let (dim, piece) = match layout {
        Layout::Split { dim } => {
            let len = *p
                .shape
                .get(dim as usize)
                .ok_or("split dim outside the weight")?;
            let s: DimSlice = p
                .groups_of(dim)
                .slice_dealt(len, deal, rank)
                .map_err(|e| e.describe(deal.tp))?;
            (Some(dim), Some(s))
        }
        _ => (None, None),
    };
    let mut local_shape = p.shape.clone();
    if let (Some(d), Some(s)) = (dim, &piece) {
        local_shape[d as usize] = s.local_len();
    }
    Ok(WeightSlice {
        tensor: p.tensor.clone(),
        shape: p.shape.clone(),
        dtype: p.dtype.unwrap_or(dtype),
        dim,
        ranges: piece.as_ref().map(|s| s.ranges.clone()).unwrap_or_default(),
        padding: piece.map(|s| s.padding).unwrap_or(0),
        local_shape,
        quant: p.quant,
    })
}

fn resize(shape: &Shape, dim: u32, f: impl Fn(u64) -> Option<u64>) -> Option<Shape> {
    let mut s = shape.clone();
    match s.0.get_mut(dim as usize) {
        Some(Dim::Fixed(n)) => *n = f(*n)?,
        // The sequence (sequence parallelism) stays symbolic: a rank's block of a call's
        // tokens is decided at run time.
        Some(Dim::Seq) => {}
        _ => return None,
    }
    Some(s)
}

/// Builds the plan for a sharded graph.
pub fn partition(sharded: &Sharded) -> Result<Plan> {
    let graph = &sharded.graph;
    let tp = sharded.ctx.tp;
    let order = graph
        .topo_order()
        .map_err(|_| bug("partition", &graph.name, "the graph has a cycle".into()))?;
    let mut id_of = vec![
        u32::MAX;
        graph
            .g
            .node_indices()
            .map(|n| n.index() + 1)
            .max()
            .unwrap_or(0)
    ];
    for (i, &n) in order.iter().enumerate() {
        id_of[n.index()] = i as u32;
    }
    let deal = sharded.ctx.deal();
    let cut: Vec<Cut> = order
        .iter()
        .map(|&n| cut_pieces(graph, n, deal))
        .collect::<Result<_>>()?;
    // Shared by all ranks: inputs as value ids, and which ops only rank 0 runs.
    let walk = Walk {
        inputs: order
            .iter()
            .map(|&n| graph.inputs(n).iter().map(|i| id_of[i.index()]).collect())
            .collect(),
        rank0_keep: order.iter().map(|&n| rank0_only(graph, n)).collect(),
        gather_pieces: order
            .iter()
            .map(|&n| gather_pieces(graph, n, deal, &|c| cut[id_of[c.index()] as usize].clone()))
            .collect::<Result<_>>()?,
        cut_pieces: cut,
        order,
    };
    let mut ranks = Vec::with_capacity(tp as usize);
    for rank in 0..tp {
        ranks.push(rank_program(graph, &walk, sharded.ctx.deal(), rank)?);
    }
    let order = walk.order;
    let collectives = collectives(graph, &order, &ranks[0], tp);
    let name = |n: &NodeId| graph.node(*n).name.to_string();
    let regions = sharded
        .ctx
        .regions
        .iter()
        .map(|r| RegionInfo {
            layer: r.layer,
            columns: r.columns.iter().map(name).collect(),
            rows: r.rows.iter().map(name).collect(),
            members: r.members.iter().map(name).collect(),
        })
        .collect();
    Ok(Plan {
        version: PLAN_VERSION,
        model: graph.name.clone(),
        tp,
        dtype: graph.dtype,
        notes: sharded.ctx.notes.clone(),
        collectives,
        regions,
        ranks,
        max_positions: None,
        attention_window: None,
        pipeline: None,
        numerics: sharded.ctx.numerics,
        source: None,
    })
}

/// The graph in program order, prepared once for all ranks.
struct Walk {
    order: Vec<NodeId>,
    inputs: Vec<Vec<u32>>,
    rank0_keep: Vec<Option<usize>>,
    /// Each all-gather's per-rank counts (`AllGatherOp::pieces`); empty for other ops.
    gather_pieces: Vec<Vec<u64>>,
    /// Each uneven local slice's or reduce-scatter's per-rank pieces.
    cut_pieces: Vec<Cut>,
}

/// The per-rank pieces of an uneven local slice or reduce-scatter (`LocalSliceOp::pieces`
/// and `::starts`, the same of `ReduceScatterOp`); both empty where even.
#[derive(Debug, Clone, Default)]
struct Cut {
    pieces: Vec<u64>,
    starts: Vec<u64>,
}

/// The per-rank real counts of an all-gather's dim where the ranks hold unequal real
/// parts: under unequal shares, each rank's piece of the weight of the linear that deals
/// the gathered dim (the LM head's vocabulary for the logits; gate/up's columns for an MLP
/// product an override reads whole), which must be one run of the dim, the ranks' runs in
/// rank order; the pieces of the reduce-scatter or local slice that split it (`cut`, by
/// node); else, where nothing deals the dim (a `tp_plan` override that splits the
/// embeddings' hidden columns), a plain deal of it. Empty where the pieces are whole but
/// the last ones' end padding (which `unpad_to` drops) and for other ops. Sequence gathers
/// keep their run-time token blocks.
fn gather_pieces(
    graph: &Graph,
    id: NodeId,
    deal: Deal,
    cut: &dyn Fn(NodeId) -> Cut,
) -> Result<Vec<u64>> {
    let node = graph.node(id);
    let Op::AllGather(g) = &node.op else {
        return Ok(Vec::new());
    };
    if node.fact.shape.is_sequence(g.dim) {
        return Ok(Vec::new());
    }
    // Under shares a refusal names them; without, every gather tpc makes has its counts,
    // so one that has none is tpc's own error.
    let refuse = |problem: String| match deal.shares {
        Some(shares) => TpcError::SharesUnsupported {
            model: graph.name.clone(),
            shares: shares.to_string(),
            problem: format!("`{}` {problem}", node.name),
        },
        None => bug("partition", &node.name, problem),
    };
    let dealer = graph
        .inputs(id)
        .first()
        .and_then(|&p| crate::ir::dealing::dealing_op(graph, p, g.dim));
    match dealer.map(|d| (d, &graph.node(d).op)) {
        Some((linear, Op::Linear(_))) => {
            let weight = graph.inputs(linear).get(1).map(|&w| graph.node(w));
            let Some((Op::Param(p), Some(Layout::Split { dim }))) =
                weight.map(|w| (&w.op, w.layout))
            else {
                return Err(refuse(
                    "gathers a dim whose linear's weight is not split, so its pieces' counts are unknown".into(),
                ));
            };
            let len = p.shape.get(dim as usize).copied().unwrap_or(0);
            // A part of a fused q|k|v product (GPT-2, NeoX) is dealt as its part of the
            // weight's dim.
            let input = graph.inputs(id).first().copied();
            let part = input
                .and_then(|x| crate::ir::dealing::unfuse_on_trail(graph, x, g.dim))
                .and_then(|u| match &graph.node(u).op {
                    Op::Unfuse(u) => Some(u),
                    _ => None,
                });
            let pieces = match part {
                Some(u) => part_counts(&u.groups, u.part, deal, &p.tensor, &refuse),
                None => run_counts(&p.groups_of(dim), len, &p.tensor, deal, "gathers", &refuse),
            };
            match (pieces, deal.shares) {
                (pieces, Some(_)) => pieces,
                // Unequal pieces of an uneven tp too (query heads dealt by kv group:
                // 16/16/32 at tp 3, not the 32/32/0 of whole padded pieces); none where
                // they are whole but the last ones' end padding (a padded vocabulary).
                (Ok(pieces), None) => Ok(match end_padded(&pieces) {
                    true => Vec::new(),
                    false => pieces,
                }),
                (Err(e), None) => Err(e),
            }
        }
        Some((cutter, _)) => match cut(cutter) {
            Cut { pieces, starts } if starts.is_empty() => Ok(pieces),
            _ => Err(refuse(format!(
                "gathers the pieces `{}` cut, which overlap (heads replicated on several ranks), so they cannot be joined; use a tp at most the heads' count",
                graph.node(cutter).name
            ))),
        },
        None => Ok(plain_cut(graph, id, g.dim, deal, &refuse)?.pieces),
    }
}

/// Each rank's real count of part `part` of a fused dim structured by `groups`: a
/// `Concat`'s part dealt on its own; an `Interleaved` one's share of each rank's whole heads.
fn part_counts(
    groups: &Groups,
    part: u32,
    deal: Deal,
    what_of: &str,
    refuse: &dyn Fn(String) -> TpcError,
) -> Result<Vec<u64>> {
    let unknown = || {
        refuse(format!(
            "gathers part {part} of `{what_of}`, which it does not have"
        ))
    };
    match groups {
        Groups::Concat(parts) => {
            let g = parts.get(part as usize).ok_or_else(unknown)?;
            let len = g.covered_len().ok_or_else(unknown)?;
            run_counts(g, len, what_of, deal, "gathers", refuse)
        }
        Groups::Interleaved { heads, parts } => {
            let size = parts.get(part as usize).copied().ok_or_else(unknown)?;
            let per_head: u64 = parts.iter().sum();
            let len = heads.checked_mul(per_head).ok_or_else(unknown)?;
            let whole = run_counts(groups, len, what_of, deal, "gathers", refuse)?;
            Ok(whole.iter().map(|&c| c / per_head.max(1) * size).collect())
        }
        _ => Err(unknown()),
    }
}

/// The pieces of a plain deal of dim `dim` of value `id` (every entry its own atom, as a
/// weight's plain dims are dealt).
fn plain_cut(
    graph: &Graph,
    id: NodeId,
    dim: u32,
    deal: Deal,
    refuse: &dyn Fn(String) -> TpcError,
) -> Result<Cut> {
    let node = graph.node(id);
    let Some(len) = node.fact.shape.fixed_at(dim as usize) else {
        return Ok(Cut::default());
    };
    cut_by(&Groups::default(), len, &node.name, deal, refuse)
}

/// Whether `pieces` are whole pieces of the largest's size but for the last ones' end
/// padding (what an all-gather without counts joins, `AllGatherOp::real_counts`).
fn end_padded(pieces: &[u64]) -> bool {
    let local = pieces.iter().copied().max().unwrap_or(0);
    let mut left: u64 = pieces.iter().sum();
    pieces.iter().all(|&p| {
        let whole = local.min(left);
        left -= whole;
        p == whole
    })
}

fn uneven_or_empty(pieces: Vec<u64>) -> Vec<u64> {
    match pieces.windows(2).all(|w| w[0] == w[1]) {
        true => Vec::new(),
        false => pieces,
    }
}

/// Each rank's piece of a `len`-long dim of `what_of` structured by `groups`, which must
/// be one run per rank (`what` it does names the op in `refuse`'s message otherwise): its
/// real length and where it starts, for every rank.
fn runs(
    groups: &Groups,
    len: u64,
    what_of: &str,
    deal: Deal,
    what: &str,
    refuse: &dyn Fn(String) -> TpcError,
) -> Result<Cut> {
    let mut cut = Cut::default();
    for rank in 0..deal.tp {
        let piece = groups
            .slice_dealt(len, deal, rank)
            .map_err(|e| refuse(e.describe(deal.tp)))?;
        if piece.ranges.len() > 1 || piece.padded_inside() {
            return Err(refuse(format!(
                "{what} pieces of `{what_of}` that are not one run each"
            )));
        }
        cut.starts
            .push(piece.ranges.first().map_or(0, |r| r.offset));
        cut.pieces.push(piece.real_len());
    }
    Ok(cut)
}

/// Whether each rank's run starts where the earlier ranks' end (empty runs anywhere).
fn in_rank_order(cut: &Cut) -> bool {
    let mut next = 0u64;
    cut.pieces.iter().zip(&cut.starts).all(|(&p, &s)| {
        let at = next;
        next = next.saturating_add(p);
        p == 0 || s == at
    })
}

/// [`runs`] as a cut: where the runs follow each other in rank order, their counts, else
/// (heads replicated on several ranks) their starts too. Empty where the pieces are even.
fn cut_by(
    groups: &Groups,
    len: u64,
    what_of: &str,
    deal: Deal,
    refuse: &dyn Fn(String) -> TpcError,
) -> Result<Cut> {
    let mut cut = runs(groups, len, what_of, deal, "cuts", refuse)?;
    if in_rank_order(&cut) {
        cut.starts.clear();
        cut.pieces = uneven_or_empty(cut.pieces);
    }
    Ok(cut)
}

/// [`runs`]' real lengths, which must follow each other in rank order (so that the real
/// parts in rank order rebuild the dim); `refuse` names the op (`what` it does) otherwise.
fn run_counts(
    groups: &Groups,
    len: u64,
    what_of: &str,
    deal: Deal,
    what: &str,
    refuse: &dyn Fn(String) -> TpcError,
) -> Result<Vec<u64>> {
    let cut = runs(groups, len, what_of, deal, what, refuse)?;
    if !in_rank_order(&cut) {
        return Err(refuse(format!(
            "{what} pieces of `{what_of}` that are not in rank order"
        )));
    }
    Ok(cut.pieces)
}

/// The per-rank counts of a local slice or a non-sequence reduce-scatter whose pieces are
/// uneven (a dim that tp does not divide evenly, or dealt by `--tp-shares`): the real
/// lengths of the dim of the weight whose structure fixes them (`dealing::cutting_weight`:
/// the linear that dealt or made the value, or a split weight reading it), or, where none
/// does (the embeddings' hidden columns), of a plain deal of the dim. Empty where the
/// pieces are even (or the dim is the sequence's, cut at run time) and for other ops.
fn cut_pieces(graph: &Graph, id: NodeId, deal: Deal) -> Result<Cut> {
    let node = graph.node(id);
    let dim = match &node.op {
        Op::LocalSlice(s) => s.dim,
        Op::ReduceScatter(r) => r.dim,
        _ => return Ok(Cut::default()),
    };
    if node.fact.shape.is_sequence(dim) {
        return Ok(Cut::default());
    }
    let refuse = |problem: String| {
        bug(
            "partition",
            &node.name,
            format!("its pieces cannot follow the weight that fixes them: {problem}"),
        )
    };
    let weight =
        crate::ir::dealing::cutting_weight(graph, id).and_then(|(w, at)| match &graph.node(w).op {
            Op::Param(p) => Some((p, at)),
            _ => None,
        });
    let Some((p, at)) = weight else {
        return plain_cut(graph, id, dim, deal, &refuse);
    };
    let len = p.shape.get(at as usize).copied().unwrap_or(0);
    cut_by(&p.groups_of(at), len, &p.tensor, deal, &refuse)
}

fn rank_program(graph: &Graph, walk: &Walk, deal: Deal, rank: u64) -> Result<RankProgram> {
    let tp = deal.tp;
    let order = &walk.order;
    // `holder[id]` is the value id that holds value `id` on this rank (itself unless aliased).
    let mut holder: Vec<u32> = (0..order.len() as u32).collect();
    // Where each value's instruction sits in `instrs` (its local fact lives there).
    let mut at: Vec<u32> = vec![u32::MAX; order.len()];
    // Index into `weights` of each param value.
    let mut slice_of: Vec<Option<usize>> = vec![None; order.len()];
    let mut weights: Vec<WeightSlice> = Vec::new();
    let mut instrs: Vec<Instr> = Vec::with_capacity(order.len());
    for (pos, &n) in order.iter().enumerate() {
        let node = graph.node(n);
        let id = pos as u32;
        let inputs: SmallVec<[u32; 4]> = walk.inputs[pos]
            .iter()
            .map(|&i| holder[i as usize])
            .collect();
        if let (true, Some(keep)) = (rank != 0, walk.rank0_keep[pos]) {
            holder[id as usize] = inputs[keep];
            continue;
        }
        let local_in: Vec<&TensorFact> = inputs
            .iter()
            .map(|&i| &instrs[at[i as usize] as usize].fact)
            .collect();
        let layout = node.layout.unwrap_or(Layout::Replicated);
        let bad = |m: String| bug("partition", &node.name, m);
        let mut op = match &node.op {
            // The rank's weight: its local shape, without the split structure.
            Op::Param(p) => {
                let s = weight_slice(p, layout, deal, rank, graph.dtype).map_err(bad)?;
                slice_of[pos] = Some(weights.len());
                let op = Op::Param(ParamOp {
                    tensor: p.tensor.clone(),
                    shape: s.local_shape.clone(),
                    dtype: p.dtype,
                    groups: Default::default(),
                    quant: p.quant,
                });
                weights.push(s);
                op
            }
            other => other.clone(),
        };
        let fact = match &mut op {
            Op::Param(p) => TensorFact {
                dtype: weights.last().map_or(graph.dtype, |w| w.dtype),
                shape: Shape::fixed(&p.shape),
            },
            Op::Embedding(e) => {
                let table = walk.inputs[pos][1] as usize;
                if let Some(s) = slice_of[table]
                    .map(|w| &weights[w])
                    .filter(|s| s.dim == Some(0))
                {
                    let start = s.ranges.first().map(|r| r.offset).unwrap_or(0);
                    let len = s.ranges.iter().map(|r| r.len).sum();
                    e.vocab_range = Some((start, len));
                }
                infer(&op, &local_in, graph.dtype).map_err(bad)?
            }
            Op::Unfuse(u) => {
                if matches!(layout, Layout::Split { .. }) {
                    let total = u.groups.covered_len().unwrap_or(0);
                    u.groups = u.groups.localize(total, deal);
                }
                infer(&op, &local_in, graph.dtype).map_err(bad)?
            }
            Op::AllGather(g) => {
                let gathered = resize(&local_in[0].shape, g.dim, |n| Some(n * tp))
                    .ok_or_else(|| bad("all-gather over a symbolic dim".into()))?;
                let whole = node.fact.shape.fixed_at(g.dim as usize);
                if gathered.fixed_at(g.dim as usize) != whole {
                    g.unpad_to = whole;
                }
                g.pieces = walk.gather_pieces[pos].clone();
                let shape = match g.unpad_to {
                    Some(w) => resize(&gathered, g.dim, |_| Some(w)).unwrap_or(gathered),
                    None => gathered,
                };
                TensorFact {
                    dtype: local_in[0].dtype,
                    shape,
                }
            }
            Op::ReduceScatter(_) | Op::LocalSlice(_) if !walk.cut_pieces[pos].pieces.is_empty() => {
                let cut = &walk.cut_pieces[pos];
                op.set_cut(cut.pieces.clone(), cut.starts.clone());
                let dim = op.cut().map_or(0, |c| c.dim);
                let local = cut.pieces.iter().copied().max().unwrap_or(0);
                let shape = resize(&local_in[0].shape, dim, |_| Some(local))
                    .ok_or_else(|| bad("an uneven cut of a symbolic dim".into()))?;
                TensorFact {
                    dtype: local_in[0].dtype,
                    shape,
                }
            }
            Op::ReduceScatter(ReduceScatterOp { dim, .. })
            | Op::LocalSlice(LocalSliceOp { dim, .. }) => {
                let dim = *dim;
                let shape = resize(&local_in[0].shape, dim, |n| (n % tp == 0).then_some(n / tp))
                    .ok_or_else(|| {
                        bad(format!(
                            "dim {dim} of {} does not divide by tp={tp}",
                            local_in[0].shape
                        ))
                    })?;
                TensorFact {
                    dtype: local_in[0].dtype,
                    shape,
                }
            }
            _ => infer(&op, &local_in, graph.dtype).map_err(bad)?,
        };
        at[pos] = instrs.len() as u32;
        instrs.push(Instr {
            id,
            name: node.name.clone(),
            op,
            inputs,
            fact,
            layout,
            layer: node.layer,
        });
    }
    drop_dead(&mut instrs, &mut weights);
    let split_by_tokens = instrs.iter().any(Instr::is_split_by_tokens);
    let mut program = RankProgram {
        rank,
        weights,
        instrs,
        fused: Vec::new(),
        sequence_shares: deal.shares.filter(|s| split_by_tokens && !s.is_even()),
    };
    program.fused = super::fuse::find(&program);
    Ok(program)
}

/// Removes what no output depends on on this rank (e.g. the bias another rank adds), so a
/// rank never loads a weight it does not use.
fn drop_dead(instrs: &mut Vec<Instr>, weights: &mut Vec<WeightSlice>) {
    let mut live = vec![false; instrs.iter().map(|i| i.id as usize + 1).max().unwrap_or(0)];
    for i in instrs.iter().rev() {
        // Every rank issues every collective, with its own piece, even where its result
        // is not used on this rank (a replicated NeoX `dense` whose output only rank 0
        // adds to the layer's partial sum still gathers each rank's heads).
        if matches!(i.op, Op::Output(_)) || i.op.is_collective() || live[i.id as usize] {
            live[i.id as usize] = true;
            for &a in &i.inputs {
                live[a as usize] = true;
            }
        }
    }
    if instrs.iter().all(|i| live[i.id as usize]) {
        return;
    }
    let dead: std::collections::HashSet<&str> = instrs
        .iter()
        .filter(|i| !live[i.id as usize])
        .filter_map(|i| match &i.op {
            Op::Param(p) => Some(&*p.tensor),
            _ => None,
        })
        .collect();
    if !dead.is_empty() {
        weights.retain(|w| !dead.contains(&*w.tensor));
    }
    instrs.retain(|i| live[i.id as usize]);
}

fn collectives(graph: &Graph, order: &[NodeId], rank0: &RankProgram, tp: u64) -> Vec<Collective> {
    let local: HashMap<u32, &Instr> = rank0.instrs.iter().map(|i| (i.id, i)).collect();
    let mut out = Vec::new();
    for (id, &n) in order.iter().enumerate() {
        let node = graph.node(n);
        if !node.op.is_collective() {
            continue;
        }
        let Some(instr) = local.get(&(id as u32)) else {
            continue;
        };
        let input_elems = instr
            .inputs
            .first()
            .and_then(|i| local.get(i))
            .map(|i| i.fact.shape.fixed_elements())
            .unwrap_or(0);
        let elements = match node.op {
            // Over the sequence each token's row moves whole.
            Op::AllGather(AllGatherOp { dim, .. }) if instr.fact.shape.is_sequence(dim) => {
                input_elems
            }
            // The gathered value, padding included.
            Op::AllGather(_) => input_elems * tp,
            _ => input_elems,
        };
        let wire_factor = Collective::ring_passes(&instr.op) * (tp - 1) as f64 / tp as f64;
        let bytes = elements * instr.fact.dtype.size_bytes();
        out.push(Collective {
            id: id as u32,
            name: node.name.to_string(),
            kind: node.op.kind().to_string(),
            layer: node.layer,
            elements_per_token: elements,
            bytes_per_token: bytes,
            ring_wire_bytes_per_token: (bytes as f64 * wire_factor).round() as u64,
        });
    }
    out
}
