//! The first place where two plans differ, named as a user reads a plan: the rank, the
//! instruction or weight, then the field inside it, with both values.

use super::Plan;
pub use crate::error::provenance::PlanDifference;
use serde_json::Value;

/// The first difference of `found` from `expected`, in plan order; `None` when equal.
pub fn first_difference(found: &Plan, expected: &Plan) -> Option<PlanDifference> {
    // Both serialize: a plan is plain data (a failure would be a serde bug, reported as a
    // difference at the top rather than hidden).
    let (a, b) = match (serde_json::to_value(found), serde_json::to_value(expected)) {
        (Ok(a), Ok(b)) => (a, b),
        _ => {
            return (found != expected).then(|| PlanDifference {
                place: "the plan".into(),
                found: "a plan that cannot be written out".into(),
                expected: "the compiled plan".into(),
            })
        }
    };
    let mut path = Vec::new();
    let (x, y) = first_in(Some(&a), Some(&b), &mut path)?;
    Some(PlanDifference {
        place: describe(&path, &a),
        found: show(x),
        expected: show(y),
    })
}

/// The first field where two JSON values differ: its dotted path (`rope_scaling.factor`)
/// and both values, as [`first_difference`] shows them.
pub fn first_field_difference(found: &Value, expected: &Value) -> Option<(String, String, String)> {
    let mut path = Vec::new();
    let (x, y) = first_in(Some(found), Some(expected), &mut path)?;
    Some((field_path(&path), show(x), show(y)))
}

/// One step into a JSON value.
#[derive(Debug, Clone)]
enum Step {
    Key(String),
    Index(usize),
}

fn first_in<'a>(
    a: Option<&'a Value>,
    b: Option<&'a Value>,
    path: &mut Vec<Step>,
) -> Option<(Option<&'a Value>, Option<&'a Value>)> {
    match (a, b) {
        (Some(Value::Object(x)), Some(Value::Object(y))) => {
            // Keys in the order the plan writes them, then any only the other has.
            let keys = x.keys().chain(y.keys().filter(|k| !x.contains_key(*k)));
            for k in keys {
                path.push(Step::Key(k.clone()));
                if let Some(d) = first_in(x.get(k), y.get(k), path) {
                    return Some(d);
                }
                path.pop();
            }
            None
        }
        (Some(Value::Array(x)), Some(Value::Array(y))) => {
            for i in 0..x.len().max(y.len()) {
                path.push(Step::Index(i));
                if let Some(d) = first_in(x.get(i), y.get(i), path) {
                    return Some(d);
                }
                path.pop();
            }
            None
        }
        // Scalars, or values of different kinds: a missing key or element differs too.
        (x, y) if x == y => None,
        (x, y) => Some((x, y)),
    }
}

/// The path as a reader names it: ranks, instructions and weights by what they are.
fn describe(path: &[Step], plan: &Value) -> String {
    let mut parts = Vec::new();
    let mut rest = path;
    if let [Step::Key(k), Step::Index(r), tail @ ..] = path {
        if k == "ranks" {
            parts.push(format!("rank {r}"));
            rest = tail;
            let program = &plan["ranks"][*r];
            if let [Step::Key(k), Step::Index(j), tail @ ..] = rest {
                let item = &program[k.as_str()][*j];
                match k.as_str() {
                    "instrs" => {
                        parts.push(format!(
                            "instruction %{} `{}`",
                            item["id"],
                            item["name"].as_str().unwrap_or("?")
                        ));
                        rest = tail;
                    }
                    "weights" => {
                        parts.push(format!(
                            "weight `{}`",
                            item["tensor"].as_str().unwrap_or("?")
                        ));
                        rest = tail;
                    }
                    _ => {}
                }
            }
        }
    }
    if !rest.is_empty() {
        parts.push(format!("field `{}`", field_path(rest)));
    }
    if parts.is_empty() {
        "the plan".into()
    } else {
        parts.join(", ")
    }
}

/// `a.b[2].c`.
fn field_path(path: &[Step]) -> String {
    let mut field = String::new();
    for s in path {
        match s {
            Step::Key(k) if field.is_empty() => field.push_str(k),
            Step::Key(k) => {
                field.push('.');
                field.push_str(k)
            }
            Step::Index(i) => field.push_str(&format!("[{i}]")),
        }
    }
    field
}

/// A value shown in a message: compact JSON, long ones shortened.
fn show(v: Option<&Value>) -> String {
    const LONGEST: usize = 160;
    match v {
        None => "nothing (the field is absent)".into(),
        Some(v) => {
            let text = v.to_string();
            if text.chars().count() > LONGEST {
                let cut: String = text.chars().take(LONGEST).collect();
                format!("{cut}…")
            } else {
                text
            }
        }
    }
}
