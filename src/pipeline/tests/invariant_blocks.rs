//! Invariant numerics in compiled plans: the blocks a row-parallel linear keeps at uneven tps, and a tp that would cut them.

use crate::ir::{NumericsMode, Op};

/// TinyLlama (32 heads in 4 kv groups, MLP 5632 = 32 × 176): the power-of-two tps give
/// o_proj blocks of 64 and down_proj blocks of 176; uneven tp 3 falls on them, the even
/// tp 11 (512 columns a rank) would not and is refused naming the tps covered.
#[test]
fn uneven_tps_keep_the_power_of_two_blocks_and_a_cutting_tp_is_refused() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/tinyllama-1.1b.ron");
    let def = crate::frontend::load::load_model(&path).unwrap();
    let options = crate::passes::ShardOptions {
        numerics: NumericsMode::Invariant,
        ..Default::default()
    };
    let compile = |tp| crate::pipeline::compile_with(&def, tp, options);
    let plan = compile(3).unwrap().plan;
    let block = |name: &str| {
        plan.ranks[0]
            .instrs
            .iter()
            .find_map(|i| match &i.op {
                Op::Linear(l) if i.name.ends_with(name) => l.exact.map(|e| e.block),
                _ => None,
            })
            .unwrap()
    };
    assert_eq!((block("o_proj"), block("down_proj")), (64, 176));
    plan.verify().unwrap();
    let refused = compile(11).unwrap_err().to_string();
    assert!(
        refused.contains("tp 11 splits a row-parallel linear off the blocks")
            && refused.contains("covers tp 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12,"),
        "{refused}"
    );
    // The fast order has no blocks to keep.
    crate::pipeline::compile(&def, 11).unwrap();
}
