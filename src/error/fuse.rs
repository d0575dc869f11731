//! Why a plan's fused product (`plan/fuse.rs`) cannot run as one product.

use crate::ir::{Layout, WeightOrder};

/// Why a recorded fused product cannot run as one product; each says what would be right.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FuseProblem {
    #[error("names {count} linear(s); a fused product joins at least two")]
    TooFew { count: usize },
    #[error("lists {listed} column counts for {linears} linears; it needs one per linear")]
    ColumnCount { listed: usize, linears: usize },
    #[error("%{id} is not a linear instruction of this rank; a fused product joins linear ops")]
    NotLinear { id: u32 },
    #[error(
        "%{id} is in more than one fused product (or twice in one); a linear runs in at most one"
    )]
    Repeated { id: u32 },
    #[error("%{id} comes before the linear listed ahead of it; list the linears in program order")]
    Order { id: u32 },
    #[error("%{id} reads %{input} but the first linear reads %{first}; a fused product's linears read the same input")]
    Input { id: u32, input: u32, first: u32 },
    #[error("%{id} reads its weight stored {order:?} but the first linear {first:?}; the weights must be stored the same way")]
    WeightOrder {
        id: u32,
        order: WeightOrder,
        first: WeightOrder,
    },
    #[error("%{id}'s output is laid out {layout} but the first linear's is {first}; a fused product's outputs share one layout")]
    Layout {
        id: u32,
        layout: Layout,
        first: Layout,
    },
    #[error("%{id}'s weight %{weight} is not a param that only it reads; each weight of a fused product is loaded into it and read by nothing else")]
    Weight { id: u32, weight: u32 },
    #[error("%{id} computes the model output (the LM head, which runs on the sampled rows alone); leave it out of fused products")]
    Head { id: u32 },
    #[error("lists {listed} columns for %{id}, whose output has {}; they must be equal", actual.map_or_else(|| "no fixed number of".to_string(), |a| a.to_string()))]
    Columns {
        id: u32,
        listed: u64,
        actual: Option<u64>,
    },
}
