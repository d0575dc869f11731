//! Explicit graph definition → IR graph, with shape inference at every node.

use super::spec::{GraphDef, RepeatDef, Stmt};
use crate::error::{Result, TpcError};
use crate::ir::shape::infer;
use crate::ir::*;
use rustc_hash::FxHashMap as HashMap;

struct Builder<'a> {
    def: &'a GraphDef,
    graph: Graph,
    env: HashMap<String, NodeId>,
    next_order: u64,
}

/// Builds the IR for a graph definition; every name must be bound before use.
pub fn build_graph(def: &GraphDef) -> Result<Graph> {
    let mut b = Builder {
        def,
        graph: Graph::new(def.name.clone(), def.dtype),
        env: HashMap::default(),
        next_order: 0,
    };
    for stmt in &def.body {
        match stmt {
            Stmt::Repeat(r) => b.repeat(r)?,
            other => b.stmt(other, None)?,
        }
    }
    if !b
        .graph
        .g
        .node_weights()
        .any(|n| matches!(n.op, Op::Output(_)))
    {
        return Err(b.err(
            "the graph",
            "it has no Output node; add one for the logits".into(),
        ));
    }
    if let Some(q) = &def.quantization {
        mark_quantized(&mut b.graph, q).map_err(|m| b.err("the quantization", m))?;
    }
    Ok(b.graph)
}

/// Marks the weights a quantized checkpoint stores quantized: every linear's 2-D weight and
/// every expert's, but the output head's (its rows are the vocabulary, which HF never
/// quantizes), a router's (transformers' routers are not linear modules) and those `q`
/// leaves unconverted.
fn mark_quantized(graph: &mut Graph, q: &Quantization) -> std::result::Result<(), String> {
    let most = super::validate::MAX_DIM;
    // 0 along the inputs: one scale across them (a scale per output channel).
    if q.block[0] == 0 || q.block.iter().any(|&b| b > most) {
        return Err(format!(
            "block {:?} must be two sizes from 1 to {most} (elements per scale along a weight's outputs and inputs; 0 inputs for a scale per output channel)",
            q.block
        ));
    }
    let ids: Vec<NodeId> = graph.g.node_indices().collect();
    for id in ids {
        let inputs = graph.inputs(id);
        let (weights, order) = match &graph.node(id).op {
            Op::Linear(l) => {
                let routes = graph
                    .users(id)
                    .iter()
                    .any(|&(u, _)| matches!(graph.node(u).op, Op::Route(_)));
                if routes {
                    continue;
                }
                (inputs.get(1..2).unwrap_or(&[]), l.weight_order)
            }
            // The gate, up and down stacks, each expert stored `[out, in]`.
            Op::Experts(_) => (inputs.get(2..).unwrap_or(&[]), WeightOrder::OutIn),
            _ => continue,
        };
        for &w in weights {
            let Op::Param(p) = &mut graph.node_mut(w).op else {
                continue;
            };
            let vocabulary = matches!(
                p.groups.get(&order.out_dim()),
                Some(Groups::Plain { padded: true })
            );
            if p.shape.len() >= 2 && !vocabulary && q.covers(&p.tensor) {
                // GPTQ's and AWQ's packings are defined on `[out, in]` (nn.Linear) weights.
                if q.format.is_int4() && order != WeightOrder::OutIn {
                    return Err(format!(
                        "`{}` is stored [in, out] (a Conv1D); {} checkpoints are read for [out, in] linear weights only",
                        p.tensor,
                        q.format.name()
                    ));
                }
                p.quant = Some(q.for_weight(order.out_dim()));
            }
        }
    }
    Ok(())
}

/// `s` with every `{i}` replaced by the layer index.
fn subst(s: &str, layer: Option<u32>) -> String {
    use std::fmt::Write;
    let Some(i) = layer else { return s.to_string() };
    let mut out = String::with_capacity(s.len() + 4);
    let mut rest = s;
    while let Some(pos) = rest.find("{i}") {
        out.push_str(&rest[..pos]);
        let _ = write!(out, "{i}");
        rest = &rest[pos + 3..];
    }
    out.push_str(rest);
    out
}

/// Refuses what only tpc's passes may choose: a model file describes the single-device
/// model, and the partitioner decides collectives, slices and each rank's vocabulary rows.
/// Trusting such input would let a model file contradict the plan tpc derives.
fn partitioner_only(op: &Op) -> std::result::Result<(), String> {
    match op {
        Op::AllReduce(_) | Op::AllGather(_) | Op::ReduceScatter(_) | Op::LocalSlice(_) => {
            Err(format!(
                "`{}` is inserted by tpc's sharding passes, never written in a model (the partitioner chooses where collectives and slices go, and an all_gather's `unpad_to`); remove this node and use its input instead",
                op.kind()
            ))
        }
        Op::RmsNorm(n) if n.reduce_input.is_some() || n.with_reduce => Err(format!(
            "`{}` of an rms_norm is set by tpc's norm-fusion pass, never written in a model; remove it",
            if n.with_reduce { "with_reduce" } else { "reduce_input" }
        )),
        Op::Embedding(e) if e.vocab_range.is_some() => Err(
            "`vocab_range` of an embedding is chosen by the partitioner for each rank; remove it and write `Embedding()` with the whole table"
                .into(),
        ),
        _ => Ok(()),
    }
}

impl Builder<'_> {
    fn err(&self, place: &str, message: String) -> TpcError {
        TpcError::Model {
            model: self.def.name.clone(),
            place: place.to_string(),
            message,
        }
    }

    fn repeat(&mut self, r: &RepeatDef) -> Result<()> {
        let place = format!("repeat over `{}`", r.carry);
        let mut carried = *self.env.get(&r.init).ok_or_else(|| {
            self.err(
                &place,
                format!("init `{}` is not defined before the repeat", r.init),
            )
        })?;
        let end = r
            .start
            .checked_add(r.count)
            .filter(|&e| e <= u32::MAX as u64);
        let Some(end) = end else {
            return Err(self.err(
                &place,
                format!("layers {}..+{} is too many", r.start, r.count),
            ));
        };
        for i in r.start as u32..end as u32 {
            self.env.insert(r.carry.clone(), carried);
            for stmt in &r.body {
                if let Stmt::Repeat(_) = stmt {
                    return Err(self.err(&place, "repeats cannot be nested".into()));
                }
                self.stmt(stmt, Some(i))?;
            }
            let result = subst(&r.result, Some(i));
            carried = *self.env.get(&result).ok_or_else(|| {
                self.err(
                    &place,
                    format!("result `{result}` is not defined by the body"),
                )
            })?;
        }
        self.env.insert(r.carry.clone(), carried);
        Ok(())
    }

    fn stmt(&mut self, stmt: &Stmt, layer: Option<u32>) -> Result<()> {
        let (name, op, inputs) = match stmt {
            Stmt::Weight(w) => {
                let name = subst(&w.name, layer);
                let op = Op::Param(ParamOp {
                    tensor: name.as_str().into(),
                    shape: w.shape.clone(),
                    dtype: w.dtype,
                    groups: w.groups.clone(),
                    quant: None,
                });
                (name, op, Vec::new())
            }
            Stmt::Node(n) => {
                let mut op = n.op.clone();
                if let Op::Param(p) = &mut op {
                    p.tensor = subst(&p.tensor, layer).into();
                }
                partitioner_only(&op)
                    .map_err(|m| self.err(&format!("node `{}`", subst(&n.name, layer)), m))?;
                let inputs = n.inputs.iter().map(|s| subst(s, layer)).collect();
                (subst(&n.name, layer), op, inputs)
            }
            Stmt::Repeat(_) => unreachable!("repeats are handled by the caller"),
        };
        let place = format!("node `{name}`");
        if self.env.contains_key(&name) {
            return Err(self.err(
                &place,
                "this name is already bound; every name is defined once".into(),
            ));
        }
        let ids = inputs
            .iter()
            .map(|i| {
                self.env.get(i).copied().ok_or_else(|| {
                    self.err(
                        &place,
                        format!("input `{i}` is not defined before this node"),
                    )
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let facts: Vec<_> = ids.iter().map(|&i| &self.graph.node(i).fact).collect();
        let fact = infer(&op, &facts, self.def.dtype).map_err(|m| self.err(&place, m))?;
        self.next_order += ORDER_STEP;
        let id = self.graph.add(
            Node {
                name: name.as_str().into(),
                op,
                fact,
                layer,
                order: self.next_order,
                layout: None,
            },
            &ids,
        );
        self.env.insert(name, id);
        Ok(())
    }
}
