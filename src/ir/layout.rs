//! How a value is laid out across the tp ranks.

use serde::{Deserialize, Serialize};
use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
pub enum Layout {
    /// Every rank holds the whole value.
    Replicated,
    /// Rank r holds its piece along `dim`.
    Split { dim: u32 },
    /// Every rank holds a full-shaped partial sum; the value is the sum over ranks.
    Partial,
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Layout::Replicated => f.write_str("R"),
            Layout::Split { dim } => write!(f, "S({dim})"),
            Layout::Partial => f.write_str("P"),
        }
    }
}
