//! Sequence parallelism (Megatron-SP): the residual stream between tensor-parallel blocks
//! is split by tokens instead of held whole on every rank. An all-reduce whose result only
//! flows through token-wise ops (residual adds, norms) becomes a reduce-scatter over the
//! sequence; those ops run on the rank's block of tokens; an all-gather over the sequence
//! brings the whole value back where something needs every token (a column-parallel
//! linear, attention, the LM head). The bytes moved stay those of the all-reduce (a ring
//! all-reduce is a reduce-scatter plus an all-gather); the token-wise work and the
//! residual stream's memory are divided by tp.
//!
//! A split along the sequence dim means, at run time, a contiguous block of the call's
//! token rows (every sequence's tokens, flattened), rank after rank, as
//! [`crate::ir::token_blocks`] deals them: every rank at least one row (zero rows pad a
//! call of fewer tokens than ranks), the rest evenly or by the uneven `--tp-shares` the
//! rank programs record.

use super::ShardCtx;
use crate::error::Result;
use crate::ir::{AllGatherOp, Dim, Graph, Layout, LocalSliceOp, Node, NodeId, Op, ReduceScatterOp};
use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};

/// Inserted nodes sit after their producer, past the collectives insertion put there.
const AFTER_PRODUCER: u64 = 1 << 12;

/// The dim of `node`'s value that indexes tokens within a sequence, when it has one.
fn sequence_dim(graph: &Graph, id: NodeId) -> Option<u32> {
    graph
        .node(id)
        .fact
        .shape
        .0
        .iter()
        .position(|d| *d == Dim::Seq)
        .map(|d| d as u32)
}

/// Ops whose output row for a token depends only on the input rows of that token (and on
/// whole weights): they run unchanged on a block of tokens.
fn token_wise(op: &Op) -> bool {
    matches!(
        op,
        Op::Add(_)
            | Op::Mul(_)
            | Op::RmsNorm(_)
            | Op::LayerNorm(_)
            | Op::BiasAdd(_)
            | Op::Activation(_)
    )
}

/// Rewrites the sharded graph for sequence parallelism when `ctx.sequence_parallel` is set
/// (and tp > 1); otherwise leaves it alone.
pub fn split_sequence(graph: &mut Graph, ctx: &mut ShardCtx) -> Result<()> {
    if !ctx.sequence_parallel || ctx.tp == 1 {
        return Ok(());
    }
    hoist_residual_adds(graph);
    let order = graph.topo_order().map_err(|_| ctx.cycle_error())?;
    let split = token_split_values(graph, &order);
    if split.is_empty() {
        ctx.notes.push(
            "sequence parallelism asked for, but no all-reduce feeds token-wise ops; the plan is unchanged"
                .into(),
        );
        return Ok(());
    }
    let mut gathered: HashMap<NodeId, NodeId> = HashMap::default();
    let mut sliced: HashMap<NodeId, NodeId> = HashMap::default();
    for &id in &order {
        if split.contains(&id) {
            // Whole activations entering a token-split op are cut to the rank's tokens
            // (no communication); weights stay whole.
            let reduces = matches!(graph.node(id).op, Op::AllReduce(_));
            for (slot, input) in graph.inputs(id).into_iter().enumerate() {
                if reduces || split.contains(&input) || matches!(graph.node(input).op, Op::Param(_))
                {
                    continue;
                }
                let Some(dim) = sequence_dim(graph, input) else {
                    continue;
                };
                let cut = *sliced.entry(input).or_insert_with(|| {
                    let src = graph.node(input).clone();
                    let node = Node {
                        name: format!("{}.sequence_slice", src.name).into(),
                        op: Op::LocalSlice(LocalSliceOp::even(dim)),
                        layout: Some(Layout::Split { dim }),
                        order: src.order + AFTER_PRODUCER,
                        ..src
                    };
                    graph.add(node, &[input])
                });
                graph.rewire(id, slot as u32, cut);
            }
            let Some(dim) = sequence_dim(graph, id) else {
                continue;
            };
            if let Op::AllReduce(_) = graph.node(id).op {
                let name = &graph.node(id).name;
                let base = name.strip_suffix(".all_reduce").unwrap_or(name);
                // A `tp_plan` override may have made a reduce-scatter of the same value's
                // hidden dim already (a rowwise up_proj): names stay unique.
                let mut name = format!("{base}.reduce_scatter");
                if graph.find(&name).is_some() {
                    name = format!("{base}.sequence_reduce_scatter");
                }
                let node = graph.node_mut(id);
                node.op = Op::ReduceScatter(ReduceScatterOp::even(dim));
                node.name = name.into();
            }
            graph.node_mut(id).layout = Some(Layout::Split { dim });
            continue;
        }
        // Anything else that reads a token-split value needs every token back.
        for (slot, input) in graph.inputs(id).into_iter().enumerate() {
            if !split.contains(&input) {
                continue;
            }
            let Some(dim) = sequence_dim(graph, input) else {
                continue;
            };
            let whole = *gathered.entry(input).or_insert_with(|| {
                let src = graph.node(input).clone();
                let node = Node {
                    name: format!("{}.sequence_gather", src.name).into(),
                    op: Op::AllGather(AllGatherOp {
                        dim,
                        unpad_to: None,
                        pieces: Vec::new(),
                    }),
                    layout: Some(Layout::Replicated),
                    order: src.order + AFTER_PRODUCER,
                    ..src
                };
                graph.add(node, &[input])
            });
            graph.rewire(id, slot as u32, whole);
        }
    }
    ctx.notes.push(format!(
        "sequence parallel: {} all-reduces became reduce-scatters over the sequence; {} token-wise ops run on 1/{} of the tokens",
        split.iter().filter(|&&n| matches!(graph.node(n).op, Op::ReduceScatter(_))).count(),
        split.iter().filter(|&&n| !matches!(graph.node(n).op, Op::ReduceScatter(_))).count(),
        ctx.tp
    ));
    Ok(())
}

/// The sharding pass adds a residual to the partial sums it joins (on rank 0 only) and
/// all-reduces the total: `all_reduce(h + x)`. Sequence parallelism needs the add after
/// the reduction, `h + all_reduce(x)` (the same value), so that `h` can stay split by
/// tokens and the add run on the rank's tokens.
fn hoist_residual_adds(graph: &mut Graph) {
    let reduces: Vec<NodeId> = graph
        .g
        .node_indices()
        .filter(|&n| matches!(graph.node(n).op, Op::AllReduce(_)))
        .collect();
    for reduce in reduces {
        loop {
            let add = graph.inputs(reduce)[0];
            if !matches!(graph.node(add).op, Op::Add(_))
                || graph.layout(add) != Layout::Partial
                || graph.users(add) != [(reduce, 0)]
            {
                break;
            }
            let inputs = graph.inputs(add);
            let layouts: Vec<Layout> = inputs.iter().map(|&i| graph.layout(i)).collect();
            let Some(partial_slot) = (0..2)
                .find(|&s| layouts[s] == Layout::Partial && layouts[1 - s] == Layout::Replicated)
            else {
                break;
            };
            let partial = inputs[partial_slot];
            let users = graph.users(reduce);
            graph.rewire(reduce, 0, partial);
            graph.rewire(add, partial_slot as u32, reduce);
            for (user, slot) in users {
                graph.rewire(user, slot, add);
            }
            graph.node_mut(add).layout = Some(Layout::Replicated);
            // The reduction now comes first.
            let (a, r) = (graph.node(add).order, graph.node(reduce).order);
            graph.node_mut(add).order = r;
            graph.node_mut(reduce).order = a;
            // Its value is the partial operand's now (the same shape: the add was
            // elementwise).
            graph.node_mut(reduce).fact = graph.node(partial).fact.clone();
        }
    }
}

/// The values to hold split by tokens: all-reduce results, and token-wise ops over whole
/// values of which at least one is such a value — but only all-reduces that some
/// token-wise op reads (an all-reduce read only by a linear stays an all-reduce).
fn token_split_values(graph: &Graph, order: &[NodeId]) -> HashSet<NodeId> {
    let whole_with_tokens = |id: NodeId| {
        graph.node(id).layout == Some(Layout::Replicated) && sequence_dim(graph, id).is_some()
    };
    let mut split: HashSet<NodeId> = HashSet::default();
    for &id in order {
        let node = graph.node(id);
        if !whole_with_tokens(id) {
            continue;
        }
        let joins = match &node.op {
            Op::AllReduce(_) => true,
            op if token_wise(op) => {
                let inputs = graph.inputs(id);
                inputs.iter().any(|i| split.contains(i))
                    && inputs.iter().all(|&i| {
                        split.contains(&i)
                            || whole_with_tokens(i)
                            || (matches!(graph.node(i).op, Op::Param(_))
                                && graph.layout(i) == Layout::Replicated)
                    })
            }
            _ => false,
        };
        if joins {
            split.insert(id);
        }
    }
    let read_by_token_wise: HashSet<NodeId> = split
        .iter()
        .filter(|&&n| !matches!(graph.node(n).op, Op::AllReduce(_)))
        .flat_map(|&n| graph.inputs(n))
        .collect();
    split.retain(|n| {
        !matches!(graph.node(*n).op, Op::AllReduce(_)) || read_by_token_wise.contains(n)
    });
    split
}

#[cfg(test)]
mod tests {
    use crate::frontend::load::load_model;
    use crate::frontend::ModelDef;
    use crate::ir::{Layout, Op};
    use crate::passes::{ShardOptions, Sharded};

    fn shard(def: &ModelDef, tp: u64, sequence_parallel: bool) -> Sharded {
        let options = ShardOptions {
            sequence_parallel,
            ..Default::default()
        };
        crate::passes::shard_model(def, tp, &Default::default(), options).unwrap()
    }

    fn sharded(model: &str, tp: u64, sequence_parallel: bool) -> Sharded {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(model);
        shard(&load_model(&path).unwrap(), tp, sequence_parallel)
    }

    #[test]
    fn a_decoder_layer_reduces_scatters_twice_and_gathers_before_each_block() {
        let s = sharded("models/tiny-llama.ron", 2, true);
        let g = &s.graph;
        let kinds_in_layer = |layer: u32, kind: &str| {
            g.g.node_weights()
                .filter(|n| n.layer == Some(layer) && n.op.kind() == kind)
                .count()
        };
        for layer in 0..2 {
            assert_eq!(kinds_in_layer(layer, "reduce_scatter"), 2);
            assert_eq!(kinds_in_layer(layer, "all_gather"), 2);
            assert_eq!(kinds_in_layer(layer, "all_reduce"), 0);
        }
        // The residual add now follows the reduction and, like the norms, runs on the
        // rank's tokens: S(1) on [B, S, H].
        let node = |name: &str| g.node(g.find(name).unwrap());
        for name in [
            "model.layers.0.attn_residual",
            "model.layers.0.mlp_residual",
            "model.layers.1.input_layernorm",
            "model.norm",
        ] {
            assert_eq!(node(name).layout, Some(Layout::Split { dim: 1 }), "{name}");
        }
        let add = g.find("model.layers.0.attn_residual").unwrap();
        let reduced = g
            .inputs(add)
            .into_iter()
            .find(|&i| matches!(g.node(i).op, Op::ReduceScatter(_)));
        assert!(
            reduced.is_some(),
            "the residual add reads the reduce-scatter"
        );
        // The column-parallel q projection reads a gathered (whole) value.
        let q = g.find("model.layers.0.self_attn.q_proj").unwrap();
        let x = g.inputs(q)[0];
        assert!(matches!(g.node(x).op, Op::AllGather(ref a) if a.dim == 1));
        assert_eq!(g.node(x).layout, Some(Layout::Replicated));
        assert!(s.ctx.notes.iter().any(|n| n.contains("sequence parallel")));
    }

    #[test]
    fn without_the_option_or_at_tp_1_nothing_changes() {
        for (tp, sp) in [(2, false), (1, true)] {
            let s = sharded("models/tiny-llama.ron", tp, sp);
            assert!(s
                .graph
                .g
                .node_weights()
                .all(|n| !matches!(n.op, Op::ReduceScatter(_) | Op::LocalSlice(_))));
        }
    }

    #[test]
    fn gpt2_reduces_its_two_embeddings_once() {
        // Token and position tables are both vocab-split: their partial sums add up before
        // one reduce-scatter.
        let s = sharded("models/tiny-gpt2.ron", 2, true);
        let outside: Vec<&str> = s
            .graph
            .g
            .node_weights()
            .filter(|n| n.layer.is_none() && n.op.kind() == "reduce_scatter")
            .map(|n| &*n.name)
            .collect();
        assert_eq!(outside.len(), 1, "{outside:?}");
    }

    #[test]
    fn a_whole_activation_entering_the_split_stream_is_sliced_locally() {
        // With the position table replicated, its lookup is whole on every rank; added to
        // the reduce-scattered token embeddings, it is cut to the rank's tokens locally (that
        // the plan still equals tp = 1 is checked in tests/compiler/sequence_parallel.rs).
        let text = include_str!("../../models/tiny-gpt2.ron").replace(
            "dtype: F32,",
            "dtype: F32, tp_plan: {\"transformer.wpe.weight\": replicate},",
        );
        let def =
            crate::frontend::load::parse_ron(std::path::Path::new("gpt2.ron"), &text).unwrap();
        let slices = shard(&def, 2, true)
            .graph
            .g
            .node_weights()
            .filter(|n| matches!(n.op, Op::LocalSlice(ref l) if l.dim == 1))
            .count();
        assert_eq!(slices, 1);
    }
}
