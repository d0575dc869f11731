//! The kernel set the executor calls. One CPU implementation today; a faster CPU kernel
//! set and a CUDA backend slot in behind the same trait.

use super::packed::PackedMatrix;
use super::tensor::Tensor;
use crate::ir::{ActivationKind, WeightOrder};

/// Rotary tables for a run of positions: `cos`/`sin` of `[positions, rotary_dim / 2]`.
pub struct RopeTables {
    pub half: usize,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

/// Elementwise operations of two equal-length tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BinaryOp {
    Add,
    Mul,
}

pub trait Backend: Send + Sync {
    /// `x [m, k] · W` where `W` is `[n, k]` (`OutIn`) or `[k, n]` (`InOut`) → `[m, n]`.
    fn linear(&self, x: &Tensor, w: &Tensor, order: WeightOrder) -> Tensor;
    /// `x [m, k] · Wᵀ` for a weight packed at load time → `[m, n]`.
    fn packed_linear(&self, x: &Tensor, w: &PackedMatrix) -> Tensor;
    /// RMSNorm over each `group` columns (the whole row when `group` = cols).
    fn rms_norm(&self, x: &Tensor, w: &[f32], group: usize, eps: f32) -> Tensor;
    /// `x ⊙= y` elementwise (same length), in place.
    fn binary(&self, x: &mut Tensor, y: &Tensor, op: BinaryOp);
    fn layer_norm(&self, x: &Tensor, w: &[f32], b: &[f32], eps: f32) -> Tensor;
    fn activation(&self, x: &mut Tensor, kind: ActivationKind);
    /// Rotate-half rotary embedding on the first `2·half` of each `head_dim` block, in place.
    fn rope(&self, x: &mut Tensor, head_dim: usize, tables: &RopeTables);
    /// Causal attention of `q [t, hq·d]` over the cache `k, v [n, hk·d]`, where query row
    /// `i` sits at absolute position `n - t + i`.
    fn attention(
        &self,
        q: &Tensor,
        k: &[f32],
        v: &[f32],
        head_dim: usize,
        kv_heads: usize,
        scale: f32,
    ) -> Tensor;
}
