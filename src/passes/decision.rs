//! Why each weight got its layout: the rule branch that placed it, the op that asked, and
//! for a row split the chain of split values back to the linears that opened the region.
//! Filled by `assign_layouts`; read by `tpc explain`. Nothing else depends on it.

use crate::frontend::TpWord;
use crate::ir::{Graph, Layout, NodeId, Op};

/// The branch of the placement rule that decided a weight's layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// A `tp_plan` word from the model file forced it.
    Override(TpWord),
    /// An embedding table is split by vocabulary (its looked-up dim).
    Lookup,
    /// A linear reading a feature-split activation is row-split: partial sums, which close
    /// a column→row region.
    ReadsSplit,
    /// A linear reading a whole activation is column-split: it opens a region.
    ReadsWhole,
    /// The weight has no dim of the kind the rule wanted to split, so it stays whole.
    NoSplittableDim,
    /// Not a contraction weight (bias, norm scale): it takes what its op needs for the
    /// activation's split.
    Follows,
    /// tp = 1: nothing is split.
    SingleRank,
    /// A mixture-of-experts layer's weights, split as `--moe` says: whole experts dealt to
    /// the ranks, or every expert's features.
    Experts(crate::ir::ExpertSplit),
}

impl Reason {
    /// A short machine word (`--json`'s `rule`).
    pub fn word(self) -> &'static str {
        match self {
            Reason::Override(_) => "override",
            Reason::Lookup => "embedding_vocab",
            Reason::ReadsSplit => "reads_split_activation",
            Reason::ReadsWhole => "reads_whole_activation",
            Reason::NoSplittableDim => "no_splittable_dim",
            Reason::Follows => "follows_its_op",
            Reason::SingleRank => "tp_1",
            Reason::Experts(crate::ir::ExpertSplit::Expert) => "moe_expert_split",
            Reason::Experts(crate::ir::ExpertSplit::Tensor) => "moe_tensor_split",
        }
    }

    /// The rule as a sentence.
    pub fn sentence(self) -> String {
        match self {
            Reason::Override(w) => format!(
                "override: the model's tp_plan says `{}`",
                w.word()
            ),
            Reason::Lookup => {
                "embedding table: split by vocabulary (the looked-up dim); each rank looks up its own ids, partial sums".into()
            }
            Reason::ReadsSplit => {
                "linear reads a split activation → row split (partial sums; closes a column→row region)".into()
            }
            Reason::ReadsWhole => {
                "linear reads a whole activation → column split (opens a column→row region)".into()
            }
            Reason::NoSplittableDim => "no dim the rule splits → replicated".into(),
            Reason::Follows => {
                "not a contraction weight: takes the layout its op needs for the activation's split".into()
            }
            Reason::SingleRank => "tp = 1: everything is replicated".into(),
            Reason::Experts(crate::ir::ExpertSplit::Expert) => {
                "mixture of experts, --moe expert: whole experts dealt to the ranks, each rank reads its columns of the routing and sums its experts (partial sums)".into()
            }
            Reason::Experts(crate::ir::ExpertSplit::Tensor) => {
                "mixture of experts, --moe tensor: every expert's gate/up split by columns and down by rows (partial sums)".into()
            }
        }
    }
}

/// Why one weight has its layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub reason: Reason,
    /// The op whose rule placed the weight (its first consumer).
    pub consumer: NodeId,
    /// That op's activation input and the split values behind it, nearest first, ending at
    /// the linear (or embedding) whose split made it split. Empty for ops without one.
    pub chain: Vec<NodeId>,
    /// Every linear whose split reaches the activation through split values only (the
    /// region's openers); empty unless the activation is split.
    pub openers: Vec<NodeId>,
}

/// Whether `n` makes a split value out of a placed weight: a column linear or an embedding
/// split by its hidden dim.
fn opens(graph: &Graph, n: NodeId) -> bool {
    matches!(graph.node(n).op, Op::Linear(_) | Op::Embedding(_))
}

fn split_inputs(graph: &Graph, n: NodeId) -> impl Iterator<Item = NodeId> + '_ {
    graph.inputs(n).into_iter().filter(move |&i| {
        !matches!(graph.node(i).op, Op::Param(_))
            && matches!(graph.node(i).layout, Some(Layout::Split { .. }))
    })
}

/// The chain behind the activation `x` that op `consumer` reads (layouts of everything
/// before `consumer` are already set): `x`, then its first split input, and so on to the
/// opener; and every opener reached through split values.
pub fn split_chain(graph: &Graph, x: NodeId) -> (Vec<NodeId>, Vec<NodeId>) {
    let mut chain = vec![x];
    if !matches!(graph.node(x).layout, Some(Layout::Split { .. })) {
        return (chain, vec![]);
    }
    let mut at = x;
    // Bounded by the graph's size: each step goes to an earlier node.
    while !opens(graph, at) && chain.len() <= graph.g.node_count() {
        match split_inputs(graph, at).next() {
            Some(next) => {
                chain.push(next);
                at = next;
            }
            None => break,
        }
    }
    let mut openers = Vec::new();
    let mut seen = vec![x];
    let mut stack = vec![x];
    while let Some(n) = stack.pop() {
        if opens(graph, n) {
            openers.push(n);
            continue;
        }
        for i in split_inputs(graph, n) {
            if !seen.contains(&i) {
                seen.push(i);
                stack.push(i);
            }
        }
    }
    openers.sort_by_key(|&n| graph.node(n).order);
    (chain, openers)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frontend::ModelDef;

    fn tiny(name: &str) -> ModelDef {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("models")
            .join(name);
        crate::frontend::load::load_model(&path).expect("loads")
    }

    fn sharded(def: &ModelDef, tp: u64) -> crate::passes::Sharded {
        let no_overrides = std::collections::BTreeMap::new();
        crate::passes::shard_model(def, tp, &no_overrides, Default::default()).expect("shards")
    }

    /// (reason, consumer name, chain names, opener names) of the weight `tensor`.
    fn why(s: &crate::passes::Sharded, tensor: &str) -> (Reason, String, Vec<String>, Vec<String>) {
        let g = &s.graph;
        let id =
            g.g.node_indices()
                .find(|&n| matches!(&g.node(n).op, Op::Param(p) if &*p.tensor == tensor))
                .expect(tensor);
        let d = &s.ctx.decisions[&id];
        let names = |v: &[NodeId]| v.iter().map(|&n| g.node(n).name.to_string()).collect();
        (
            d.reason,
            g.node(d.consumer).name.to_string(),
            names(&d.chain),
            names(&d.openers),
        )
    }

    #[test]
    fn every_weight_of_a_llama_gets_the_branch_that_placed_it() {
        let s = &sharded(&tiny("tiny-llama.ron"), 2);
        let l = "model.layers.1";
        let (r, by, chain, _) = why(s, &format!("{l}.self_attn.q_proj.weight"));
        assert_eq!(
            (r, by.as_str()),
            (Reason::ReadsWhole, "model.layers.1.self_attn.q_proj")
        );
        assert_eq!(chain, vec![format!("{l}.input_layernorm")]);
        let (r, by, chain, openers) = why(s, &format!("{l}.self_attn.o_proj.weight"));
        assert_eq!(
            (r, by.as_str()),
            (Reason::ReadsSplit, "model.layers.1.self_attn.o_proj")
        );
        assert_eq!(chain.first(), Some(&format!("{l}.self_attn.attn")));
        assert_eq!(chain.last(), Some(&format!("{l}.self_attn.q_proj")));
        let qkv: Vec<String> = ["q", "k", "v"]
            .iter()
            .map(|p| format!("{l}.self_attn.{p}_proj"))
            .collect();
        assert_eq!(openers, qkv);
        let (r, _, chain, openers) = why(s, &format!("{l}.mlp.down_proj.weight"));
        assert_eq!(r, Reason::ReadsSplit);
        assert_eq!(chain.last(), Some(&format!("{l}.mlp.gate_proj")));
        assert_eq!(
            openers,
            vec![format!("{l}.mlp.gate_proj"), format!("{l}.mlp.up_proj")]
        );
        assert_eq!(why(s, "model.embed_tokens.weight").0, Reason::Lookup);
        assert_eq!(why(s, "lm_head.weight").0, Reason::ReadsWhole);
        assert_eq!(why(s, "model.norm.weight").0, Reason::Follows);
        // Every weight has a decision.
        let params = s
            .graph
            .g
            .node_indices()
            .filter(|&n| matches!(s.graph.node(n).op, Op::Param(_)));
        assert_eq!(params.count(), s.ctx.decisions.len());
    }

    #[test]
    fn a_tied_head_is_decided_by_the_embedding_and_tp_1_by_nothing() {
        let s = sharded(&tiny("tiny-gpt2.ron"), 2);
        let (r, by, ..) = why(&s, "transformer.wte.weight");
        assert_eq!((r, by.as_str()), (Reason::Lookup, "transformer.wte"));
        let s = sharded(&tiny("tiny-gpt2.ron"), 1);
        assert!(s
            .ctx
            .decisions
            .values()
            .all(|d| d.reason == Reason::SingleRank));
    }

    #[test]
    fn an_override_is_recorded_as_the_reason() {
        let mut def = tiny("tiny-llama.ron");
        let ModelDef::Preset(p) = &mut def else {
            panic!("a preset")
        };
        p.tp_plan
            .insert("layers.*.mlp.down_proj".into(), TpWord::Colwise);
        let s = sharded(&def, 2);
        let (r, ..) = why(&s, "model.layers.0.mlp.down_proj.weight");
        assert_eq!(r, Reason::Override(TpWord::Colwise));
        let (r, ..) = why(&s, "model.layers.0.mlp.up_proj.weight");
        assert_eq!(r, Reason::ReadsWhole);
    }
}
