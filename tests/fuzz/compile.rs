//! What every parsed model goes through: lowering (with the `tpc lower` round trip),
//! compiling for several tp, and every renderer of the plan. A compiled plan that fails
//! `Plan::verify` is a broken invariant, not an expected error.

use super::harness::Outcome;
use tpc::frontend::load::{parse_ron, ron_options};
use tpc::frontend::preset::lower_preset;
use tpc::frontend::ModelDef;
use tpc::pipeline::compile;
use tpc::plan::dot::{render, DotOptions};
use tpc::plan::report::{render_table, summarize};
use tpc::plan::text::render_plan;
use tpc::plan::Plan;

/// tp values tried on each model: the common ones, one that divides little, and one far
/// beyond any limit.
const TPS: [u64; 5] = [1, 2, 3, 8, u64::MAX];

pub fn exercise(def: &ModelDef) -> Outcome {
    if let ModelDef::Preset(p) = def {
        if let Ok(graph) = lower_preset(p) {
            if let Some(broken) = lowered_round_trip(ModelDef::Graph(graph)) {
                return Outcome::Failed(broken);
            }
        }
    }
    let mut accepted = false;
    for tp in TPS {
        let Ok(compiled) = compile(def, tp) else {
            continue;
        };
        if let Err(e) = compiled.plan.verify() {
            return Outcome::Failed(format!(
                "broken: the plan compiled at tp={tp} fails Plan::verify: {e}"
            ));
        }
        // Rendering is the slow part for large models: once per input is enough.
        if !accepted {
            render_all(&compiled.plan);
        }
        accepted = true;
    }
    if accepted {
        Outcome::Accepted
    } else {
        Outcome::Rejected
    }
}

/// `tpc lower`'s text of a graph must parse back to the same definition.
fn lowered_round_trip(def: ModelDef) -> Option<String> {
    let cfg = ron::ser::PrettyConfig::new()
        .extensions(
            ron::extensions::Extensions::IMPLICIT_SOME
                | ron::extensions::Extensions::UNWRAP_VARIANT_NEWTYPES,
        )
        .depth_limit(4);
    let text = match ron_options().to_string_pretty(&def, cfg) {
        Ok(t) => t,
        Err(e) => return Some(format!("broken: the lowered graph does not serialize: {e}")),
    };
    match parse_ron::<ModelDef>(std::path::Path::new("lowered.ron"), &text) {
        Ok(_) => None,
        Err(e) => Some(format!(
            "broken: the lowered graph's RON does not parse back: {e}"
        )),
    }
}

/// Everything `tpc compile` and `tpc dot` print for a plan.
pub fn render_all(plan: &Plan) {
    let summary = summarize(plan);
    let _ = render_table(&summary);
    let _ = serde_json::to_string(&summary);
    let _ = render_plan(plan);
    let _ = render(plan, &DotOptions::default());
    let _ = render(
        plan,
        &DotOptions {
            all_ranks: true,
            layers: Some((0, 1)),
        },
    );
}
