//! Validation of a model definition before any graph is built: every size positive and
//! within tpc's limits (with checked arithmetic, so a hostile file cannot wrap a size or ask
//! for an allocation that aborts), every float attribute finite and in range, and weight
//! structures only on dimensions the weight has. The graph builder and the passes may then
//! assume sane numbers.

use super::spec::{GraphDef, Stmt};
use crate::error::{Result, TpcError};
use crate::ir::{Groups, Op, RopeScaling};

/// Largest length of one tensor dimension (hidden size, vocabulary, …): 16 Mi. The largest
/// published models stay below 2^18 on every dimension.
pub const MAX_DIM: u64 = 1 << 24;
/// Largest element count of one weight: 2^40 (a 2^18-row vocabulary × 2^22 wide).
pub const MAX_WEIGHT_ELEMENTS: u64 = 1 << 40;
/// Largest layer count of a repeat. The deepest published decoders have a few hundred.
pub const MAX_LAYERS: u64 = 4096;
/// Largest parameter count of a whole model: 2^44 (17.6 trillion).
pub const MAX_PARAMS: u64 = 1 << 44;
/// Largest context (`max_position_embeddings`, `sliding_window`).
pub const MAX_POSITIONS: u64 = 1 << 24;

/// Checks a graph definition (explicit, or lowered from a preset) before it is built.
pub fn validate_graph_def(def: &GraphDef) -> Result<()> {
    let err = |place: String, message: String| TpcError::Model {
        model: def.name.clone(),
        place,
        message,
    };
    for (field, value) in [
        ("max_position_embeddings", def.max_position_embeddings),
        ("sliding_window", def.sliding_window),
    ] {
        if let Some(v) = value {
            check_positions(field, v).map_err(|m| err(field.into(), m))?;
        }
    }
    let mut params: u64 = 0;
    for stmt in &def.body {
        match stmt {
            Stmt::Repeat(r) => {
                let place = format!("repeat over `{}`", r.carry);
                if !(1..=MAX_LAYERS).contains(&r.count) {
                    return Err(err(
                        place,
                        format!(
                            "count {} is outside 1..={MAX_LAYERS}; a model has at least one layer and tpc plans at most {MAX_LAYERS}",
                            r.count
                        ),
                    ));
                }
                let mut layer: u64 = 0;
                for inner in &r.body {
                    let n = check_stmt(inner).map_err(|(p, m)| err(p, m))?;
                    layer = layer.saturating_add(n);
                }
                params = params.saturating_add(layer.saturating_mul(r.count));
            }
            other => {
                let n = check_stmt(other).map_err(|(p, m)| err(p, m))?;
                params = params.saturating_add(n);
            }
        }
    }
    if params > MAX_PARAMS {
        return Err(err(
            "the whole model".into(),
            format!(
                "{} parameters is more than tpc plans for ({MAX_PARAMS}); check the sizes",
                if params == u64::MAX {
                    "more than 2^64".to_string()
                } else {
                    params.to_string()
                }
            ),
        ));
    }
    Ok(())
}

/// One statement; returns the parameter count it declares. Errors are (place, message).
fn check_stmt(stmt: &Stmt) -> std::result::Result<u64, (String, String)> {
    match stmt {
        Stmt::Weight(w) => {
            let place = format!("weight `{}`", w.name);
            weight_elements(&w.shape, &w.groups).map_err(|m| (place, m))
        }
        Stmt::Node(n) => {
            let place = format!("node `{}`", n.name);
            match &n.op {
                Op::Param(p) => weight_elements(&p.shape, &p.groups).map_err(|m| (place, m)),
                op => check_op(op).map(|()| 0).map_err(|m| (place, m)),
            }
        }
        Stmt::Repeat(r) => Err((
            format!("repeat over `{}`", r.carry),
            "repeats cannot be nested".into(),
        )),
    }
}

/// The element count of a weight whose dimensions and structures are within limits.
pub fn weight_elements(
    shape: &[u64],
    groups: &std::collections::BTreeMap<u32, Groups>,
) -> std::result::Result<u64, String> {
    if shape.is_empty() || shape.len() > 4 {
        return Err(format!(
            "shape {shape:?} has {} dimensions; a weight has 1 to 4",
            shape.len()
        ));
    }
    let mut elements: u64 = 1;
    for (i, &d) in shape.iter().enumerate() {
        check_dim(&format!("dimension {i}"), d)?;
        elements = elements
            .checked_mul(d)
            .filter(|&e| e <= MAX_WEIGHT_ELEMENTS)
            .ok_or_else(|| {
                format!(
                    "shape {shape:?} has more than {MAX_WEIGHT_ELEMENTS} elements (tpc's limit on one weight)"
                )
            })?;
    }
    for (&dim, g) in groups {
        let Some(&len) = shape.get(dim as usize) else {
            return Err(format!(
                "groups are given for dimension {dim}, but the weight has shape {shape:?} (dimensions 0..{}); key the groups by an existing dimension",
                shape.len()
            ));
        };
        if let Some(covered) = covered_len(g)? {
            if covered != len {
                return Err(format!(
                    "the groups of dimension {dim} cover {covered} elements, the dimension has {len}; make them agree"
                ));
            }
        }
    }
    Ok(elements)
}

/// The length a structure fixes, after checking every count and size is positive and
/// within [`MAX_DIM`] and every Concat part fixes its own length.
fn covered_len(g: &Groups) -> std::result::Result<Option<u64>, String> {
    check_counts(g)?;
    g.checked_len()
        .ok_or_else(|| format!("the groups cover more than {MAX_DIM} elements"))
}

fn check_counts(g: &Groups) -> std::result::Result<(), String> {
    match g {
        Groups::Plain { .. } => Ok(()),
        Groups::Heads { count, size, .. } => {
            check_dim("a group's head count", *count)?;
            check_dim("a group's head size", *size)
        }
        Groups::Concat(parts) => {
            if parts.is_empty() {
                return Err("a Concat structure needs at least one part".into());
            }
            for p in parts {
                if matches!(p, Groups::Plain { .. }) {
                    return Err(
                        "each part of a Concat structure must fix its length (Heads, Interleaved or Concat, not Plain)"
                            .into(),
                    );
                }
                check_counts(p)?;
            }
            Ok(())
        }
        Groups::Interleaved { heads, parts } => {
            check_dim("an interleaved head count", *heads)?;
            if parts.is_empty() {
                return Err("an Interleaved structure needs at least one part".into());
            }
            parts
                .iter()
                .try_for_each(|&p| check_dim("an interleaved part", p))
        }
    }
}

fn check_dim(what: &str, d: u64) -> std::result::Result<(), String> {
    if d == 0 || d > MAX_DIM {
        return Err(format!(
            "{what} is {d}; it must be in 1..={MAX_DIM} (tpc's limit on one dimension)"
        ));
    }
    Ok(())
}

fn check_positions(what: &str, v: u64) -> std::result::Result<(), String> {
    if v == 0 || v > MAX_POSITIONS {
        return Err(format!("{what} is {v}; it must be in 1..={MAX_POSITIONS}"));
    }
    Ok(())
}

/// A float attribute that must be finite and positive (eps, theta, scale factors).
fn check_positive(what: &str, v: f64) -> std::result::Result<(), String> {
    if !(v.is_finite() && v > 0.0) {
        return Err(format!("{what} is {v}; it must be a finite number above 0"));
    }
    Ok(())
}

/// Rope scaling factors: finite, positive, and a smooth band transformers can divide by.
pub fn check_rope_scaling(scaling: &RopeScaling) -> std::result::Result<(), String> {
    match scaling {
        RopeScaling::Linear { factor } => check_positive("rope scaling factor", factor.0),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            check_positive("rope scaling factor", factor.0)?;
            check_positive("rope low_freq_factor", low_freq_factor.0)?;
            check_positive("rope high_freq_factor", high_freq_factor.0)?;
            // transformers divides by (high - low) in the smooth band.
            if high_freq_factor.0 <= low_freq_factor.0 {
                return Err(format!(
                    "rope high_freq_factor {} must be above low_freq_factor {}",
                    high_freq_factor.0, low_freq_factor.0
                ));
            }
            check_positions(
                "rope original_max_position_embeddings",
                *original_max_position_embeddings,
            )
        }
    }
}

/// The attributes of one op: sizes within limits, floats finite and in range. Plans loaded
/// from disk are checked with the same rule.
pub fn check_op(op: &Op) -> std::result::Result<(), String> {
    match op {
        Op::RmsNorm(n) => {
            check_positive("eps", n.eps.0)?;
            if let Some(g) = n.group {
                check_dim("the norm group", g)?;
            }
            match n.reduce_input.as_ref().and_then(|r| r.algorithm.as_ref()) {
                Some(choice) => choice
                    .check()
                    .map_err(|e| format!("the fused all-reduce's algorithm choice: {e}")),
                None => Ok(()),
            }
        }
        Op::LayerNorm(n) => check_positive("eps", n.eps.0),
        Op::Rope(r) => {
            check_dim("head_dim", r.head_dim)?;
            if r.rotary_dim == 0 || r.rotary_dim > r.head_dim || r.rotary_dim % 2 != 0 {
                return Err(format!(
                    "rotary_dim {} must be even and in 2..={} (head_dim)",
                    r.rotary_dim, r.head_dim
                ));
            }
            check_positive("rope theta", r.theta.0)?;
            match &r.scaling {
                Some(scaling) => check_rope_scaling(scaling),
                None => Ok(()),
            }
        }
        Op::Attention(a) => {
            check_dim("head_dim", a.head_dim)?;
            match a.scale {
                Some(s) => check_positive("attention scale", s.0),
                None => Ok(()),
            }
        }
        Op::Unfuse(u) => covered_len(&u.groups).map(|_| ()),
        Op::Param(p) => weight_elements(&p.shape, &p.groups).map(|_| ()),
        Op::AllReduce(a) => match &a.algorithm {
            Some(choice) => choice
                .check()
                .map_err(|e| format!("the all-reduce's algorithm choice: {e}")),
            None => Ok(()),
        },
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frontend::{load::parse_ron, ModelDef};
    use std::path::Path;

    fn tiny_with(from: &str, to: &str) -> ModelDef {
        let text = include_str!("../../models/tiny-llama.ron").replace(from, to);
        parse_ron(Path::new("tiny.ron"), &text).unwrap()
    }

    fn compile_error(def: &ModelDef) -> String {
        crate::frontend::to_graph(def).unwrap_err().to_string()
    }

    #[test]
    fn refuses_bad_numbers_in_presets() {
        for (from, to, expect) in [
            ("norm_eps: 1e-5", "norm_eps: -1.0", "eps is -1"),
            ("norm_eps: 1e-5", "norm_eps: NaN", "eps is NaN"),
            ("norm_eps: 1e-5", "norm_eps: inf", "eps is inf"),
            ("rope_theta: 10000.0", "rope_theta: -5.0", "theta is -5"),
            ("factor: 8.0", "factor: 0.0", "factor is 0"),
            (
                "high_freq_factor: 4.0",
                "high_freq_factor: 1.0",
                "above low_freq",
            ),
            (
                "num_hidden_layers: 2",
                "num_hidden_layers: 10000000",
                "10000000",
            ),
            ("hidden_size: 64", "hidden_size: 1000000000", "1000000000"),
            (
                "intermediate_size: 128",
                "intermediate_size: 4611686018427387904",
                "4611686018427387904",
            ),
            (
                "max_position_embeddings: 256",
                "max_position_embeddings: 0",
                "max_position_embeddings",
            ),
        ] {
            let msg = compile_error(&tiny_with(from, to));
            assert!(msg.contains(expect), "{to}: {msg}");
        }
    }

    #[test]
    fn refuses_groups_on_missing_dimensions_and_bad_counts() {
        let mut groups = std::collections::BTreeMap::new();
        groups.insert(
            2,
            Groups::Heads {
                count: 2,
                size: 2,
                replicable: false,
                kv_groups: None,
            },
        );
        let msg = weight_elements(&[4, 4], &groups).unwrap_err();
        assert!(msg.contains("dimension 2"), "{msg}");
        let mut groups = std::collections::BTreeMap::new();
        groups.insert(
            0,
            Groups::Heads {
                count: 0,
                size: 4,
                replicable: false,
                kv_groups: None,
            },
        );
        let msg = weight_elements(&[4, 4], &groups).unwrap_err();
        assert!(msg.contains("head count is 0"), "{msg}");
        let mut groups = std::collections::BTreeMap::new();
        groups.insert(
            0,
            Groups::Heads {
                count: 1 << 40,
                size: 1 << 40,
                replicable: false,
                kv_groups: None,
            },
        );
        assert!(weight_elements(&[4, 4], &groups).is_err());
        assert!(weight_elements(&[], &Default::default()).is_err());
        assert!(weight_elements(&[0, 4], &Default::default()).is_err());
        let msg = weight_elements(&[1 << 24; 4], &Default::default()).unwrap_err();
        assert!(msg.contains("more than"), "{msg}");
    }

    #[test]
    fn the_shipped_models_pass() {
        for entry in std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/models")).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "ron") {
                let def = crate::frontend::load::load_model(&path).unwrap();
                let graph = match &def {
                    ModelDef::Preset(p) => crate::frontend::preset::lower_preset(p).unwrap(),
                    ModelDef::Graph(g) => g.clone(),
                };
                validate_graph_def(&graph).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            }
        }
    }
}
