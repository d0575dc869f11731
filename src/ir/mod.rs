//! The dataflow IR: ops, tensor facts, layouts, the graph and its verifier.

pub mod algorithm;
pub mod dealing;
pub mod graph;
pub mod groups;
pub mod layout;
pub mod numerics;
pub mod op;
pub mod op_dims;
pub mod quant;
pub mod saturating;
pub mod shape;
pub mod shares;
pub mod tensor;
pub mod verify;

pub use algorithm::{AlgorithmChoice, CollectiveAlgorithm, SizeRange};
pub use graph::{Edge, Graph, Node, NodeId, ORDER_STEP};
pub use groups::{Deal, DimSlice, Groups, SliceRange, SplitProblem};
pub use layout::Layout;
pub use numerics::{ExactBlocks, NumericsMode};
pub use op::*;
pub use quant::{QuantFormat, Quantization, Quantized};
pub use shares::{token_blocks, TpShares};
pub use tensor::{DType, Dim, Name, Shape, TensorFact};
