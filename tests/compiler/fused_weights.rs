//! Fused weights split per rank with the right interleaving: a gate|up weight fused by
//! concatenation (Phi-3 style), GPT-2's [in, out] c_attn, GPT-NeoX's per-head qkv.

use std::path::Path;
use tpc::frontend::load::{load_model, parse_ron};
use tpc::frontend::ModelDef;
use tpc::pipeline::compile;
use tpc::plan::{Plan, WeightSlice};

fn slice<'a>(plan: &'a Plan, rank: usize, tensor: &str) -> &'a WeightSlice {
    plan.ranks[rank]
        .weights
        .iter()
        .find(|w| &*w.tensor == tensor)
        .unwrap_or_else(|| panic!("{tensor} on rank {rank}"))
}

fn ranges(w: &WeightSlice) -> Vec<(u64, u64)> {
    w.ranges
        .iter()
        .map(|r| (r.offset, r.offset + r.len))
        .collect()
}

const FUSED_MLP: &str = r#"Graph(name: "fused-mlp", dtype: F32, body: [
    Node(name: "ids", op: Input(kind: TokenIds)),
    Weight(name: "embed.weight", shape: [32, 16], groups: {0: Plain(padded: true)}),
    Node(name: "embed", op: Embedding(), inputs: ["ids", "embed.weight"]),
    Weight(name: "mlp.gate_up_proj.weight", shape: [48, 16],
           groups: {0: Concat([Heads(count: 24, size: 1), Heads(count: 24, size: 1)])}),
    Node(name: "mlp.gate_up_proj", op: Linear(), inputs: ["embed", "mlp.gate_up_proj.weight"]),
    Node(name: "mlp.gate", op: Unfuse(groups: Concat([Heads(count: 24, size: 1), Heads(count: 24, size: 1)]), part: 0), inputs: ["mlp.gate_up_proj"]),
    Node(name: "mlp.up", op: Unfuse(groups: Concat([Heads(count: 24, size: 1), Heads(count: 24, size: 1)]), part: 1), inputs: ["mlp.gate_up_proj"]),
    Node(name: "mlp.act", op: Activation(kind: Silu), inputs: ["mlp.gate"]),
    Node(name: "mlp.mul", op: Mul(), inputs: ["mlp.act", "mlp.up"]),
    Weight(name: "mlp.down_proj.weight", shape: [16, 24]),
    Node(name: "mlp.down_proj", op: Linear(), inputs: ["mlp.mul", "mlp.down_proj.weight"]),
    Node(name: "residual", op: Add(), inputs: ["embed", "mlp.down_proj"]),
    Node(name: "logits", op: Output(name: "logits"), inputs: ["residual"]),
])"#;

#[test]
fn concatenated_gate_up_takes_each_half_per_rank() {
    let def: ModelDef = parse_ron(Path::new("fused-mlp.ron"), FUSED_MLP).unwrap();
    let plan = compile(&def, 4).unwrap().plan;
    for r in 0..4u64 {
        let w = slice(&plan, r as usize, "mlp.gate_up_proj.weight");
        assert_eq!(w.dim, Some(0));
        assert_eq!(
            ranges(w),
            vec![(6 * r, 6 * r + 6), (24 + 6 * r, 24 + 6 * r + 6)]
        );
        assert_eq!(w.local_shape, vec![12, 16]);
        let down = slice(&plan, r as usize, "mlp.down_proj.weight");
        assert_eq!(
            (down.dim, ranges(down)),
            (Some(1), vec![(6 * r, 6 * r + 6)])
        );
    }
    // One all-reduce for the embedding and one after the row-split down projection.
    let kinds: Vec<&str> = plan.collectives.iter().map(|c| c.kind.as_str()).collect();
    assert_eq!(kinds, vec!["all_reduce", "all_reduce"]);
    assert_eq!(plan.regions.len(), 1);
    assert_eq!(plan.regions[0].columns, vec!["mlp.gate_up_proj"]);
    assert_eq!(plan.regions[0].rows, vec!["mlp.down_proj"]);
    // 24 is not divisible by 5: the error names the fused parts.
    let e = compile(&def, 5).unwrap_err().to_string();
    assert!(e.contains("24 features are not divisible by tp=5"), "{e}");
}

#[test]
fn gpt2_c_attn_is_split_on_its_output_columns_per_part() {
    let plan = compile(&load_model(Path::new("models/gpt2.ron")).unwrap(), 4)
        .unwrap()
        .plan;
    // 12 heads of 64 → 3 heads (192 columns) of each of q, k, v per rank, in [in, out] layout.
    for r in 0..4u64 {
        let w = slice(&plan, r as usize, "transformer.h.0.attn.c_attn.weight");
        assert_eq!(w.dim, Some(1));
        let q = 192 * r;
        assert_eq!(
            ranges(w),
            vec![
                (q, q + 192),
                (768 + q, 768 + q + 192),
                (1536 + q, 1536 + q + 192)
            ]
        );
        assert_eq!(w.local_shape, vec![768, 576]);
        let proj = slice(&plan, r as usize, "transformer.h.0.attn.c_proj.weight");
        assert_eq!((proj.dim, ranges(proj)), (Some(0), vec![(q, q + 192)]));
    }
}

#[test]
fn neox_qkv_keeps_whole_interleaved_heads() {
    let plan = compile(&load_model(Path::new("models/pythia-1.4b.ron")).unwrap(), 4)
        .unwrap()
        .plan;
    // 16 heads × (q, k, v) × 128 rows, interleaved per head: 4 whole heads per rank.
    for r in 0..4u64 {
        let w = slice(
            &plan,
            r as usize,
            "gpt_neox.layers.5.attention.query_key_value.weight",
        );
        assert_eq!(
            (w.dim, ranges(w)),
            (Some(0), vec![(1536 * r, 1536 * (r + 1))])
        );
        let b = slice(
            &plan,
            r as usize,
            "gpt_neox.layers.5.attention.query_key_value.bias",
        );
        assert_eq!(ranges(b), ranges(w));
    }
    // Rank 0 adds the row-split biases (to partial sums, once); other ranks never load them.
    assert!(plan.ranks[0]
        .weights
        .iter()
        .any(|w| &*w.tensor == "gpt_neox.layers.5.attention.dense.bias"));
    assert!(plan.ranks[1]
        .weights
        .iter()
        .all(|w| &*w.tensor != "gpt_neox.layers.5.attention.dense.bias"));
}
