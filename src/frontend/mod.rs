//! Frontend: model files (RON presets, explicit graphs, HF configs) → IR graph.

pub mod build;
pub mod hf_config;
pub mod load;
pub mod preset;
pub mod spec;

use crate::error::Result;
use crate::ir::Graph;
pub use spec::*;

/// Lowers any model definition to the IR.
pub fn to_graph(def: &ModelDef) -> Result<Graph> {
    match def {
        ModelDef::Preset(p) => build::build_graph(&preset::lower_preset(p)?),
        ModelDef::Graph(g) => build::build_graph(g),
    }
}
