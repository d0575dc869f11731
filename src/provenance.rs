//! A saved plan runs only when it is what tpc compiles. Plans record the model and the
//! choices they were compiled from ([`PlanSource`]); loading one for a run compiles that
//! source again (the compiler is deterministic and takes milliseconds) and refuses any
//! difference, naming the first place. `Plan::verify` alone checks that a plan holds
//! together, which an exchange of two ranks' slices or of an attention's k and v inputs
//! survives; this check does not let such an edit through.

use crate::error::{ProvenanceError, Result};
use crate::frontend::ModelDef;
use crate::ir::{AlgorithmChoice, Op};
use crate::passes::ShardOptions;
use crate::plan::diff::{first_difference, first_field_difference, PlanDifference};
use crate::plan::source::PlanSource;
use crate::plan::Plan;
use std::collections::BTreeMap;
use std::path::Path;

/// How a saved plan was found to be the compiler's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Accepted {
    /// Compiled again from the source it records: the same plan.
    Recorded,
    /// A plan without a recorded source (an older tpc's): the same as compiling the
    /// checkpoint's model with these options.
    Inferred(ShardOptions),
}

/// Checks that `plan`, read from `path`, is what tpc compiles for `model`, the model of
/// the checkpoint it is about to run on. `model` is `None` for a checkpoint whose config
/// names an architecture tpc has no preset for: a plan of an explicit graph (which the
/// graph describes) is then checked against its own record only, and the checkpoint's
/// tensors against the plan's shapes when they load.
pub fn check_saved(plan: &Plan, model: Option<&ModelDef>, path: &Path) -> Result<Accepted> {
    let layers = stage_layers(plan);
    let source = match (&plan.source, model) {
        (Some(source), _) => source,
        (None, Some(model)) => return check_unrecorded(plan, model, path, layers.as_deref()),
        (None, None) => {
            return Err(ProvenanceError::Unchecked {
                path: path.to_path_buf(),
            }
            .into())
        }
    };
    // The plan is what its own record compiles to...
    let fresh = compile_source(source, plan.tp, layers.as_deref())?;
    if let Some(difference) = first_difference(plan, &fresh) {
        return Err(ProvenanceError::Edited {
            path: path.to_path_buf(),
            difference,
        }
        .into());
    }
    // ...and the checkpoint's model compiles to the same computation. Definitions may spell
    // the same model differently (a preset's omitted default, an explicit graph), so the
    // plans are compared, and the definitions only to name what differs.
    let model = match (model, &source.model) {
        (Some(model), _) => model,
        (None, ModelDef::Graph(_)) => return Ok(Accepted::Recorded),
        (None, ModelDef::Preset(_)) => {
            return Err(ProvenanceError::Unchecked {
                path: path.to_path_buf(),
            }
            .into())
        }
    };
    // The checkpoint's own definition, as recorded: its plan is the one just compiled.
    if source.model == *model {
        return Ok(Accepted::Recorded);
    }
    let mut same_choices = source.clone();
    same_choices.model = model.clone();
    let ours = compile_source(&same_choices, plan.tp, layers.as_deref());
    let difference = match &ours {
        Ok(ours) => first_difference(&computation(plan), &computation(ours)),
        Err(e) => Some(PlanDifference {
            place: "the checkpoint's model".into(),
            found: "a plan".into(),
            expected: format!("no plan at these options ({e})"),
        }),
    };
    match difference {
        None => Ok(Accepted::Recorded),
        Some(difference) => Err(ProvenanceError::OtherModel {
            path: path.to_path_buf(),
            tp: plan.tp,
            fields: differing_fields(&source.model, model),
            difference,
        }
        .into()),
    }
}

/// A plan without a recorded source (an older tpc's, or written by hand) runs only when it
/// is what the checkpoint's model compiles to with one of the sharding options.
fn check_unrecorded(
    plan: &Plan,
    model: &ModelDef,
    path: &Path,
    layers: Option<&[u64]>,
) -> Result<Accepted> {
    let algorithms = algorithms_of(plan);
    let mut first = None;
    for sequence_parallel in [false, true] {
        for fuse_norm in [false, true] {
            let source = PlanSource {
                model: model.clone(),
                sequence_parallel,
                fuse_norm,
                numerics: plan.numerics,
                forced: BTreeMap::new(),
                algorithms: algorithms.clone(),
                // A plan written before shares existed deals every dimension evenly.
                shares: None,
            };
            // An option the model cannot take is simply not the one.
            let Ok(mut fresh) = compile_source(&source, plan.tp, layers) else {
                continue;
            };
            fresh.source = None;
            match first_difference(plan, &fresh) {
                None => return Ok(Accepted::Inferred(source.options())),
                Some(d) => {
                    first.get_or_insert(d);
                }
            }
        }
    }
    Err(ProvenanceError::Unrecorded {
        path: path.to_path_buf(),
        tp: plan.tp,
        difference: first.unwrap_or_else(|| PlanDifference {
            place: "the plan".into(),
            found: format!("tp={}", plan.tp),
            expected: "no plan: the model does not compile at this tp".into(),
        }),
    }
    .into())
}

/// The plan without what does not change the computation: its source and model name.
fn computation(plan: &Plan) -> Plan {
    Plan {
        model: String::new(),
        source: None,
        ..plan.clone()
    }
}

/// The plan `source` compiles to at `tp`, with `layers` per pipeline stage.
pub fn compile_source(source: &PlanSource, tp: u64, layers: Option<&[u64]>) -> Result<Plan> {
    let mut plan =
        crate::pipeline::compile_full(&source.model, tp, &source.forced, source.options())?.plan;
    if let Some(choice) = &source.algorithms {
        crate::cost::algorithms::apply_algorithms(&mut plan, choice);
        if let Some(s) = &mut plan.source {
            s.algorithms = Some(choice.clone());
        }
    }
    if let Some(layers) = layers {
        crate::pipeline::split_stages(&mut plan, layers.len() as u64, Some(layers))?;
    }
    Ok(plan)
}

/// Each pipeline stage's layer count, when the plan has stages.
fn stage_layers(plan: &Plan) -> Option<Vec<u64>> {
    plan.pipeline
        .as_ref()
        .map(|p| p.stages.iter().map(|s| u64::from(s.layers)).collect())
}

/// The algorithm choice of the plan's first all-reduce, if it has one.
fn algorithms_of(plan: &Plan) -> Option<AlgorithmChoice> {
    plan.ranks.first()?.instrs.iter().find_map(|i| match &i.op {
        Op::AllReduce(a) => a.algorithm.clone(),
        Op::RmsNorm(n) => n.reduce_input.as_ref()?.algorithm.clone(),
        _ => None,
    })
}

/// The fields where the checkpoint's model differs from the recorded one, as
/// "`rope_theta`: 10000 in the plan's model, 500000 in the checkpoint's" (the name left out:
/// it changes nothing computed). At most a few; empty when only the kind of definition
/// differs in form.
fn differing_fields(recorded: &ModelDef, checkpoint: &ModelDef) -> Vec<String> {
    const MOST: usize = 4;
    let fields = |m: &ModelDef| -> serde_json::Value {
        let mut v = match m {
            ModelDef::Preset(p) => serde_json::to_value(p),
            ModelDef::Graph(g) => serde_json::to_value(g),
        }
        .unwrap_or(serde_json::Value::Null);
        if let Some(o) = v.as_object_mut() {
            o.remove("name");
        }
        v
    };
    let (a, b) = (fields(recorded), fields(checkpoint));
    let (Some(a), Some(b)) = (a.as_object(), b.as_object()) else {
        return Vec::new();
    };
    let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
    keys.sort();
    keys.dedup();
    let null = serde_json::Value::Null;
    keys.into_iter()
        .filter_map(|k| {
            let (x, y) = (a.get(k).unwrap_or(&null), b.get(k).unwrap_or(&null));
            first_field_difference(y, x).map(|(inner, found, planned)| {
                let field = if inner.is_empty() {
                    k.clone()
                } else {
                    format!("{k}.{inner}")
                };
                format!("`{field}`: {planned} in the plan's model, {found} in the checkpoint's")
            })
        })
        .take(MOST)
        .collect()
}
