//! Frontend: model files (RON presets, explicit graphs, HF configs) → IR graph; and the
//! text side of an HF model folder (its tokenizer, the ids that end generation).

pub mod build;
pub mod head_sizes;
pub mod hf_config;
pub mod load;
pub mod preset;
pub mod spec;
pub mod stop_ids;
pub mod text;
pub mod validate;

use crate::error::Result;
use crate::ir::Graph;
pub use spec::*;

/// Lowers any model definition to the IR.
pub fn to_graph(def: &ModelDef) -> Result<Graph> {
    let lowered;
    let graph_def = match def {
        ModelDef::Preset(p) => {
            lowered = preset::lower_preset(p)?;
            &lowered
        }
        ModelDef::Graph(g) => g,
    };
    validate::validate_graph_def(graph_def)?;
    let graph = build::build_graph(graph_def)?;
    head_sizes::check_head_sizes(&graph)?;
    Ok(graph)
}
