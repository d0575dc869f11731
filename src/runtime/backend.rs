//! The device seam: everything a rank computes goes through a [`Backend`], which owns the
//! memory (activation buffers, weights in its own layout and dtype, KV caches). The executor
//! (`executor.rs`) only schedules: order, liveness, in-place reuse. The CPU backend
//! (`cpu/`) is one implementation; the CUDA backend (`cuda/`) another, with the same executor.

pub use super::activation::{Activation, HostBuffer, HostData, HostDataRef};
pub use super::backend_error::{BackendError, BackendResult};
use super::collectives::{CollectiveError, Collectives};
use super::exact::DepthOrder;
use super::weights::WeightSource;
use crate::ir::{ActivationKind, CollectiveAlgorithm, DType, RopeOp, WeightOrder};
use crate::plan::WeightSlice;

/// The all-reduce + RMSNorm in two passes: `sum` reduced in place, then normalized
/// ([`Backend::all_reduce_rms_norm`]'s default, and a backend's path where one loop does
/// not pay).
pub fn reduce_then_rms_norm<B: Backend + ?Sized>(
    backend: &B,
    comm: &mut dyn Collectives<B::Act>,
    sum: &mut B::Act,
    w: &B::Weight,
    group: usize,
    eps: f32,
    algorithm: Option<CollectiveAlgorithm>,
) -> Result<(B::Act, Option<CollectiveAlgorithm>), ReduceNormError> {
    let ran = comm
        .all_reduce_sum_planned(sum, algorithm)
        .map_err(ReduceNormError::Collective)?;
    let out = backend
        .rms_norm(sum, w, group, eps)
        .map_err(ReduceNormError::Norm)?;
    Ok((out, ran))
}

/// The norm of a fused reduce + add + norm step ([`Backend::all_reduce_add_rms_norm`]):
/// whether the sum is held as limbs, the residual added to it (if any), and the norm.
pub struct NormStep<'s, B: Backend + ?Sized> {
    pub limbs: bool,
    pub residual: Option<&'s B::Act>,
    pub weight: &'s B::Weight,
    pub group: usize,
    pub eps: f32,
}

/// What a fused reduce + add + norm step makes: the new residual, its norm, and the
/// all-reduce algorithm that ran.
pub struct NormStepOut<A> {
    pub residual: A,
    pub normed: A,
    pub ran: Option<CollectiveAlgorithm>,
}

/// The invariant reduce + add + norm as the unfused ops ([`Backend::all_reduce_add_rms_norm`]'s
/// default): reduce, decode the limbs, add the residual, normalize.
pub fn reduce_add_then_rms_norm<B: Backend + ?Sized>(
    backend: &B,
    comm: &mut dyn Collectives<B::Act>,
    mut sum: B::Act,
    step: NormStep<'_, B>,
    algorithm: Option<CollectiveAlgorithm>,
) -> Result<NormStepOut<B::Act>, ReduceNormError> {
    let ran = match comm.all_reduce_sum_planned(&mut sum, algorithm) {
        Ok(ran) => ran,
        Err(e) => {
            backend.release(sum);
            return Err(ReduceNormError::Collective(e));
        }
    };
    let mut h = if step.limbs {
        let values = backend.decode_limbs(&sum);
        backend.release(sum);
        values.map_err(ReduceNormError::Norm)?
    } else {
        sum
    };
    let normed = match step.residual {
        Some(r) => backend.binary(&mut h, r, BinaryOp::Add),
        None => Ok(()),
    }
    .and_then(|()| backend.rms_norm(&h, step.weight, step.group, step.eps));
    match normed {
        Ok(normed) => Ok(NormStepOut {
            residual: h,
            normed,
            ran,
        }),
        Err(e) => {
            backend.release(h);
            Err(ReduceNormError::Norm(e))
        }
    }
}

/// Why a fused all-reduce + norm failed: its collective (a peer failed, buffers disagree),
/// or the norm.
#[derive(Debug)]
pub enum ReduceNormError {
    Collective(CollectiveError),
    Norm(BackendError),
}

/// How the program reads a weight, so the backend can store it in the layout that use wants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WeightUse {
    /// Read as the weight of a linear op, stored in this order.
    pub linear: Option<WeightOrder>,
    /// Read by anything else (an embedding table, a norm's scale, a bias).
    pub other: bool,
}

/// Elementwise operations of two equal-shape activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BinaryOp {
    Add,
    Mul,
}

/// One sequence's rows in a (possibly ragged) batch: rows `rows` of every activation belong
/// to one sequence, whose first row sits at absolute position `start` and whose keys and
/// values live in the blocks of its table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment<'t> {
    /// The sequence's rows of q, k and v in the call.
    pub rows: std::ops::Range<usize>,
    /// Positions already cached before these rows.
    pub start: usize,
    /// The sequence's block table: position `p` lives in block `blocks[p / block_size]`,
    /// slot `p % block_size`. Covers at least `start + rows.len()` positions. Blocks that
    /// several sequences share (a common prompt prefix) are only read by the later ones.
    pub blocks: &'t [u32],
}

/// A rank's device: kernels plus the memory they work on.
pub trait Backend: Send + Sync {
    type Act: Activation;
    type Weight: Send + Sync;
    /// One attention op's KV cache: a pool of blocks of token slots (keys and values),
    /// shared by every sequence through its block table.
    type Kv: Send;
    /// Rotary cos/sin for the positions of one forward call.
    type RopeTables: Send;

    /// Loads one rank's slice of a weight from `src` into the backend's layout and dtype.
    fn upload(
        &self,
        src: &dyn WeightSource,
        slice: &WeightSlice,
        usage: WeightUse,
    ) -> BackendResult<Self::Weight>;
    /// Loads the weights of linear ops that read the same input as one linear weight: one
    /// rank's `slices`, each stored in `order`, side by side along the output features in
    /// the order given, so that one [`Backend::linear`] computes all their outputs as
    /// column blocks (a fused product, `plan::fuse`).
    fn upload_linears(
        &self,
        src: &dyn WeightSource,
        slices: &[&WeightSlice],
        order: WeightOrder,
    ) -> BackendResult<Self::Weight>;
    /// Bytes the weight occupies on the device.
    fn weight_bytes(&self, w: &Self::Weight) -> usize;

    /// Rows of `table [rows, cols]` for `ids`; ids outside `vocab_offset .. + rows` give zero
    /// rows (vocab-parallel lookup: the all-reduce adds the other ranks' rows).
    fn embedding(
        &self,
        ids: &[i64],
        table: &Self::Weight,
        vocab_offset: usize,
    ) -> BackendResult<Self::Act>;
    /// `x [m, k] · Wᵀ → [m, n]`.
    fn linear(&self, x: &Self::Act, w: &Self::Weight) -> BackendResult<Self::Act>;
    /// `x · Wᵀ` in the invariant order (`--numerics invariant`, `runtime::exact`): the
    /// depth in `order`'s blocks, each one f32 chain, added as it says; a row's bits do not
    /// depend on the other rows or the threads.
    fn linear_invariant(
        &self,
        x: &Self::Act,
        w: &Self::Weight,
        order: DepthOrder,
    ) -> BackendResult<Self::Act>;
    /// Runs everything after in the invariant order (`--numerics invariant`): attention,
    /// norms and elementwise ops whose bits do not depend on the call's rows or threads.
    fn set_invariant_numerics(&mut self) -> BackendResult<()>;
    /// Rows of limbs (`exact::LIMBS` per value: an exact partial sum, reduced) → rows of
    /// values.
    fn decode_limbs(&self, x: &Self::Act) -> BackendResult<Self::Act>;
    /// Adds the bias vector to every row, in place.
    fn bias_add(&self, x: &mut Self::Act, bias: &Self::Weight) -> BackendResult<()>;
    /// `x ⊙= y` elementwise, in place.
    fn binary(&self, x: &mut Self::Act, y: &Self::Act, op: BinaryOp) -> BackendResult<()>;
    /// RMSNorm over each `group` columns (the whole row when `group` = cols).
    fn rms_norm(
        &self,
        x: &Self::Act,
        w: &Self::Weight,
        group: usize,
        eps: f32,
    ) -> BackendResult<Self::Act>;
    /// The fused all-reduce + RMSNorm (`all_reduce_rms_norm`): `sum`, a partial sum, is
    /// reduced in place over `comm`'s ranks, and its RMSNorm over each `group` columns is
    /// returned with the all-reduce algorithm that ran. This default is two passes, the
    /// reduction and then [`Backend::rms_norm`]; a backend may make them one.
    fn all_reduce_rms_norm(
        &self,
        comm: &mut dyn Collectives<Self::Act>,
        sum: &mut Self::Act,
        w: &Self::Weight,
        group: usize,
        eps: f32,
        algorithm: Option<CollectiveAlgorithm>,
    ) -> Result<(Self::Act, Option<CollectiveAlgorithm>), ReduceNormError> {
        reduce_then_rms_norm(self, comm, sum, w, group, eps, algorithm)
    }
    /// The invariant norm fusion (`plan::fuse_norm`): `sum`, a partial sum (as limbs when
    /// `step.limbs`), is reduced over `comm`'s ranks and decoded, `step.residual` added, and
    /// the result normalized; returns the new residual, its norm and the all-reduce
    /// algorithm that ran. The arithmetic must be the unfused ops' (`decode_limbs`, an add,
    /// `rms_norm`) in their order, so that the bits are theirs: this default is those ops;
    /// a backend may make them one loop.
    fn all_reduce_add_rms_norm(
        &self,
        comm: &mut dyn Collectives<Self::Act>,
        sum: Self::Act,
        step: NormStep<'_, Self>,
        algorithm: Option<CollectiveAlgorithm>,
    ) -> Result<NormStepOut<Self::Act>, ReduceNormError> {
        reduce_add_then_rms_norm(self, comm, sum, step, algorithm)
    }
    fn layer_norm(
        &self,
        x: &Self::Act,
        w: &Self::Weight,
        b: &Self::Weight,
        eps: f32,
    ) -> BackendResult<Self::Act>;
    fn activation(&self, x: &mut Self::Act, kind: ActivationKind) -> BackendResult<()>;
    fn rope_tables(&self, op: &RopeOp, positions: &[i64]) -> BackendResult<Self::RopeTables>;
    /// Rotate-half rotary embedding on each `head_dim` block, in place; row `r` uses row `r`
    /// of the tables.
    fn rope(
        &self,
        x: &mut Self::Act,
        head_dim: usize,
        tables: &Self::RopeTables,
    ) -> BackendResult<()>;

    /// An empty pool of blocks of `block_size` tokens (at least 1), keys of `k_width` and
    /// values of `v_width` columns per token.
    fn new_kv(&self, k_width: usize, v_width: usize, block_size: usize) -> Self::Kv;
    /// Grows the pool to at least `blocks` blocks (never shrinks; what the blocks held is
    /// kept). Memory that cannot be had, or a size that overflows, is an error, not an abort.
    fn grow_kv(&self, kv: &mut Self::Kv, blocks: usize) -> BackendResult<()>;
    /// Writes each segment's rows of `k`, `v` at its positions `start..` through its block
    /// table (every segment's before any attends), then computes causal attention of the
    /// segment's rows of `q` over its positions `0..start + rows` read through the table
    /// (GQA: query head `h` reads kv head `h / (q_heads / kv_heads)`). A table too short, a
    /// block outside the pool or widths not the pool's are errors.
    fn attention(
        &self,
        qkv: [&Self::Act; 3],
        kv: &mut Self::Kv,
        segments: &[Segment<'_>],
        head_dim: usize,
        scale: f32,
    ) -> BackendResult<Self::Act>;

    /// Columns `offset .. offset + len` of each block of `block` columns, concatenated.
    fn unfuse(
        &self,
        x: &Self::Act,
        block: usize,
        offset: usize,
        len: usize,
    ) -> BackendResult<Self::Act>;
    /// `x [.., Σ widths]` as its column blocks of `widths`, in order (a fused product's
    /// outputs; `shape_rules::split_columns`). `x` is consumed, so that a backend may keep
    /// its memory for a block instead of copying it.
    fn split_columns(&self, x: Self::Act, widths: &[usize]) -> BackendResult<Vec<Self::Act>>;
    /// Column block `k` of `parts` equal blocks.
    fn column_block(&self, x: &Self::Act, k: usize, parts: usize) -> BackendResult<Self::Act>;
    /// Columns `offset .. offset + len` of `x [.., n]`, then zeros up to `width`
    /// (`shape_rules::column_window`): a rank's uneven piece of a local slice.
    fn column_window(
        &self,
        x: &Self::Act,
        offset: usize,
        len: usize,
        width: usize,
    ) -> BackendResult<Self::Act>;
    /// `[rows, parts·n]` → rank-major `[parts][rows][n]` (what a reduce-scatter takes).
    fn rows_to_rank_major(&self, x: &Self::Act, parts: usize) -> BackendResult<Self::Act>;
    /// Rank-major `[parts][rows][n]` → `[rows, Σ widths]`, keeping the first `widths[k]`
    /// columns of part `k` (padding dropped: a vocabulary's end padding, or each rank's
    /// own where shares deal it unequal parts); `parts = widths.len()`.
    fn rank_major_to_rows(&self, x: &Self::Act, widths: &[usize]) -> BackendResult<Self::Act>;
    /// The index of the largest value of each row (the first on ties, as `torch.argmax`):
    /// greedy sampling without bringing the logits to the host.
    fn argmax_rows(&self, x: &Self::Act) -> BackendResult<Vec<usize>>;
    /// Per row of `x`, its largest value among the first `valid` columns and that column's
    /// index plus `offset` (the first of equal values), as `[rows, 2]` (value, index); a row
    /// with a NaN or an infinity anywhere gets a NaN value. `valid = 0` gives (-inf, -1).
    fn argmax_pairs(&self, x: &Self::Act, valid: usize, offset: usize) -> BackendResult<Self::Act>;
    /// `pairs` is `parts` rank-major `[rows, 2]` blocks from [`Backend::argmax_pairs`]
    /// over consecutive vocabulary slices; per row, the best pair (larger value, lower index
    /// on ties, NaN if any part is NaN), as `[rows, 2]`.
    fn best_of_pairs(&self, pairs: &Self::Act, parts: usize) -> BackendResult<Self::Act>;
    /// Per row of `x`, its `k` best values among the first `valid` columns, each with its
    /// column index plus `offset`, as `[rows, 2k]` (value, index) pairs in the sampler's
    /// order (larger value first by `f32::total_cmp`, lower index first among equal values;
    /// `sampling::candidate_order`): vocabulary-parallel top-k sampling. Entries past the
    /// `valid` columns are (-inf, -1), never chosen. A row with a NaN or an infinity among
    /// its valid columns gets a NaN value first. Needs `1 <= k <= cols`.
    fn top_k_pairs(
        &self,
        x: &Self::Act,
        k: usize,
        valid: usize,
        offset: usize,
    ) -> BackendResult<Self::Act>;
    /// `pairs` is `parts` rank-major `[rows, 2m]` blocks from [`Backend::top_k_pairs`] over
    /// consecutive vocabulary slices; per row, the `k` best pairs of their union in the same
    /// order, as `[rows, 2k]` ((-inf, -1) when the union has fewer; a NaN value first if any
    /// part's row is NaN). Needs `1 <= k <= parts·m`.
    fn best_k_of_pairs(
        &self,
        pairs: &Self::Act,
        parts: usize,
        k: usize,
    ) -> BackendResult<Self::Act>;
    /// The first row of `x` holding a NaN or an infinity, if any.
    fn first_non_finite_row(&self, x: &Self::Act) -> BackendResult<Option<usize>>;
    /// The given rows, in order.
    fn select_rows(&self, x: &Self::Act, rows: &[usize]) -> BackendResult<Self::Act>;
    /// Rows `from..from + count` of `x`, rows past its end being zeros (a rank's block of
    /// tokens for sequence parallelism, a call of fewer tokens than ranks padded).
    fn row_window(&self, x: &Self::Act, from: usize, count: usize) -> BackendResult<Self::Act>;

    /// `[rows, width]`: zeros, plus for each `(y, at, weights)` row `j` of `y` times
    /// `weights[j]` added to row `at[j]` (the experts' outputs of a mixture-of-experts layer,
    /// each weighted by the router, summed in the order given).
    fn weighted_rows_sum(
        &self,
        rows: usize,
        width: usize,
        parts: &[(&Self::Act, &[usize], &[f32])],
    ) -> BackendResult<Self::Act>;

    /// A buffer of this shape and dtype (contents unspecified).
    fn alloc(&self, shape: &[usize], dtype: DType) -> BackendResult<Self::Act>;
    /// A copy.
    fn copy(&self, x: &Self::Act) -> BackendResult<Self::Act>;
    /// Gives a buffer back for reuse.
    fn release(&self, x: Self::Act);
    /// The values on the host, as f32 (logits for sampling and the user).
    fn to_host(&self, x: Self::Act) -> BackendResult<super::tensor::Tensor>;
    /// An f32 activation holding `x` (a small control message between pipeline stages).
    fn upload_host(&self, x: &super::tensor::Tensor) -> BackendResult<Self::Act>;
}
