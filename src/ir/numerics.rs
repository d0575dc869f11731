//! The numerics mode of a plan: how its sums are ordered.

use serde::{Deserialize, Serialize};
use std::fmt;

/// `fast` (the default): each kernel sums in the order that is fastest for its shape, so a
/// value's low bits depend on the batch, the thread count and the tp. `invariant`: every
/// sum follows one order fixed by the model alone (`runtime::exact`), so logits are the same
/// bits at every tp the plan allows and for any batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NumericsMode {
    #[default]
    Fast,
    Invariant,
}

impl NumericsMode {
    pub fn is_fast(&self) -> bool {
        *self == NumericsMode::Fast
    }
}

impl fmt::Display for NumericsMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            NumericsMode::Fast => "fast",
            NumericsMode::Invariant => "invariant",
        })
    }
}

/// Most ranks an invariant plan has: the limbs its collectives add hold sums of this many
/// (`runtime::exact::MAX_RANKS`).
pub const MAX_INVARIANT_RANKS: u64 = 32;

/// How an invariant plan sums a linear whose depth some valid tp splits over ranks:
/// `blocks` blocks of `block` inputs each (the whole depth), added exactly. Every valid
/// tp's split boundary falls between blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ExactBlocks {
    pub block: u64,
    pub blocks: u64,
}
