//! Tensor facts: element type and shape with symbolic batch and sequence dims.

use serde::{Deserialize, Serialize};
use smallvec::SmallVec;
use std::fmt;
use std::sync::Arc;

/// A shared, immutable name (node or checkpoint tensor): cloning it for every rank's
/// program costs a reference count, not an allocation.
pub type Name = Arc<str>;

/// Element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
pub enum DType {
    F32,
    F16,
    Bf16,
    I64,
}

impl DType {
    pub fn size_bytes(self) -> u64 {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::Bf16 => 2,
            DType::I64 => 8,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::I64 => "i64",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One dimension: symbolic batch / sequence length, or a fixed size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Dim {
    Batch,
    Seq,
    Fixed(u64),
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dim::Batch => f.write_str("B"),
            Dim::Seq => f.write_str("S"),
            Dim::Fixed(n) => write!(f, "{n}"),
        }
    }
}

/// A shape; the last dim is the feature dim for activations.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub struct Shape(pub SmallVec<[Dim; 4]>);

impl Shape {
    pub fn fixed(dims: &[u64]) -> Shape {
        Shape(dims.iter().map(|&d| Dim::Fixed(d)).collect())
    }

    /// `[B, S, features...]`
    pub fn tokens(features: &[u64]) -> Shape {
        let mut dims: SmallVec<[Dim; 4]> = SmallVec::from_slice(&[Dim::Batch, Dim::Seq]);
        dims.extend(features.iter().map(|&d| Dim::Fixed(d)));
        Shape(dims)
    }

    /// `[B, S]`: token ids and positions.
    pub fn ids() -> Shape {
        Shape(SmallVec::from_slice(&[Dim::Batch, Dim::Seq]))
    }

    pub fn rank(&self) -> usize {
        self.0.len()
    }

    /// Whether dim `i` indexes tokens within a sequence: a split or collective there moves
    /// tokens (sequence parallelism), rows of a call rather than features.
    pub fn is_sequence(&self, i: u32) -> bool {
        self.0.get(i as usize) == Some(&Dim::Seq)
    }

    pub fn last(&self) -> Option<Dim> {
        self.0.last().copied()
    }

    /// The fixed size of dim `i`, if it is fixed.
    pub fn fixed_at(&self, i: usize) -> Option<u64> {
        match self.0.get(i) {
            Some(Dim::Fixed(n)) => Some(*n),
            _ => None,
        }
    }

    /// Product of the fixed dims: elements per token for activations, total for weights.
    pub fn fixed_elements(&self) -> u64 {
        self.0
            .iter()
            .map(|d| match d {
                Dim::Fixed(n) => *n,
                _ => 1,
            })
            .fold(1u64, u64::saturating_mul)
    }

    pub fn with_last(&self, n: u64) -> Shape {
        let mut s = self.clone();
        if let Some(l) = s.0.last_mut() {
            *l = Dim::Fixed(n);
        }
        s
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

/// What is known about a value: its element type and shape.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorFact {
    pub dtype: DType,
    pub shape: Shape,
}

impl fmt::Display for TensorFact {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.dtype, self.shape)
    }
}
