//! Sequence parallelism where a whole activation enters the token-split residual stream.

use tpc::passes::ShardOptions;

/// With GPT-2's position table replicated (an override), its lookup is whole on every rank
/// and is cut to the rank's tokens where it meets the reduce-scattered token embeddings:
/// the tp 2 plan still gives tp 1's logits and tokens on seeded weights.
#[test]
fn a_replicated_position_table_under_sequence_parallelism_reproduces_tp_1() {
    let text = include_str!("../../models/tiny-gpt2.ron").replace(
        "dtype: F32,",
        "dtype: F32, tp_plan: {\"transformer.wpe.weight\": replicate},",
    );
    let def = tpc::frontend::load::parse_ron(std::path::Path::new("gpt2.ron"), &text).unwrap();
    let options = ShardOptions {
        sequence_parallel: true,
        ..Default::default()
    };
    let split = tpc::pipeline::compile_with(&def, 2, options).unwrap().plan;
    let one = tpc::pipeline::compile(&def, 1).unwrap().plan;
    let report = tpc::runtime::verify::verify_plans(
        &one,
        &split,
        None,
        3,
        9,
        &tpc::runtime::generate::Device::cpu(),
    )
    .unwrap();
    assert!(report.rel_error <= report.tolerance, "{report:?}");
    assert!(
        report.passed && report.tokens_tp1 == report.tokens_tpn,
        "{report:?}"
    );
}
