//! The CPU kernel set: packed linears (`packed.rs`) and attention (`attention/`) on the
//! rank's team, norms and activations as f32 loops (f64 where accumulated error would
//! matter), and the `gemm` crate for a linear weight that was not packed.

use super::attention::KvView;
use super::fastmath;
use super::isa::Kernels;
use super::packed::PackedMatrix;
use super::team::Team;
use crate::ir::{ActivationKind, CollectiveAlgorithm, DType, RopeOp, WeightOrder};
use crate::plan::WeightSlice;
use crate::runtime::backend::{
    reduce_add_then_rms_norm, reduce_then_rms_norm, Activation, Backend, BackendError,
    BackendResult, BinaryOp, HostBuffer, HostData, HostDataRef, NormStep, NormStepOut,
    ReduceNormError, Segment, WeightUse,
};
use crate::runtime::collectives::Collectives;
use crate::runtime::exact::{decode_limb_rows, DepthOrder, LIMBS};
use crate::runtime::rope::{self, RopeTables};
use crate::runtime::sampling::{host_best_k_of_pairs, host_top_k_pairs};
use crate::runtime::shape_rules;
use crate::runtime::simd::{widest_simd_fn, with_avx2};
use crate::runtime::tensor::{pool, Tensor};
use crate::runtime::unpadded::Unpadded;
use crate::runtime::weights::{load_slice, load_slice_bf16, WeightSource};

/// Elementwise work at least this long (elements) is split over the team: a prompt's
/// activations are, a decode step's are not (waking a helper would cost more than it saves).
const PARALLEL_MIN: usize = 1 << 15;

/// CPU kernels; `threads` is the intra-op parallelism (≈ cores / tp), served by the rank's
/// own team of compute threads.
#[derive(Debug)]
pub struct CpuBackend {
    pub threads: usize,
    pub team: Team,
    /// Linear weights kept as bf16 panels (half the bytes; f32 accumulation).
    pub bf16_linears: bool,
    /// The linear kernels' instruction-set variant.
    pub kernels: Kernels,
    /// Attention in the one order every call shape shares (`--numerics invariant`).
    pub invariant: bool,
}

impl CpuBackend {
    pub fn new(threads: usize) -> CpuBackend {
        CpuBackend::pinned(threads, &[])
    }

    /// With member `m` of the team pinned to `cores[m]` (member 0 is the caller's thread,
    /// which pins itself).
    pub fn pinned(threads: usize, cores: &[Option<usize>]) -> CpuBackend {
        Self::try_pinned(threads, cores).expect("spawning a compute thread")
    }

    /// As [`CpuBackend::pinned`]; compute threads the system refuses to start are an error.
    pub fn try_pinned(threads: usize, cores: &[Option<usize>]) -> std::io::Result<CpuBackend> {
        Ok(CpuBackend {
            threads: threads.max(1),
            team: Team::try_pinned(threads, cores)?,
            bf16_linears: false,
            invariant: false,
            // Miri reports no SIMD features, so detection can only pick the portable
            // kernels, after a self-check that takes it minutes: skip to the answer.
            kernels: if cfg!(miri) {
                Kernels::portable()
            } else {
                Kernels::detect()
            },
        })
    }

    /// The same backend running its linears with `kernels`.
    pub fn with_kernels(mut self, kernels: Kernels) -> CpuBackend {
        self.kernels = kernels;
        self
    }

    /// The same backend with attention in the invariant order (`--numerics invariant`):
    /// each (query row, head) over its keys in position order, whatever the call's rows.
    pub fn with_invariant_numerics(mut self, invariant: bool) -> CpuBackend {
        self.invariant = invariant;
        self
    }

    /// The same backend storing linear weights as bf16 (`true`) or f32.
    pub fn with_bf16_linears(mut self, bf16: bool) -> CpuBackend {
        self.bf16_linears = bf16;
        self
    }
}

/// `dst[m, n] (row stride dst_rs) = lhs[m, k] · rhs[k, n]`, `lhs` row-major, `rhs` given
/// with its row and column strides (`rhs[p, j]` at `p·rhs_rs + j·rhs_cs`: `(k, 1)` for a
/// `[k, n]` weight, `(1, k)` for an `[n, k]` one); through the `gemm` crate with `threads`
/// threads. Only the `m × n` values of `dst` are written (each row's `dst_rs - n` values after
/// it are left alone); `k = 0` writes zeros.
///
/// # Panics
/// On operands the product would reach past — the `gemm` crate indexes raw pointers, so these
/// are checked here in full, without overflow, whatever the sizes: `dst_rs < n` (rows would
/// overlap, written concurrently), `dst` shorter than `(m - 1)·dst_rs + n`, `lhs` shorter
/// than `m·k`, `rhs` shorter than `(k - 1)·rhs_rs + (n - 1)·rhs_cs + 1`, or a stride or an
/// extent that does not fit in `isize`.
pub fn gemm_f32(
    (m, n, k): (usize, usize, usize),
    dst: &mut [f32],
    dst_rs: usize,
    lhs: &[f32],
    (rhs, rhs_rs, rhs_cs): (&[f32], usize, usize),
    threads: usize,
) {
    /// Elements `0 ..= (rows - 1)·rs + (cols - 1)·cs` of a strided matrix (`rows, cols ≥ 1`):
    /// how many it spans, or `None` past `usize`.
    fn extent(rows: usize, rs: usize, cols: usize, cs: usize) -> Option<usize> {
        (rows - 1)
            .checked_mul(rs)?
            .checked_add((cols - 1).checked_mul(cs)?)?
            .checked_add(1)
    }
    let stride = |s: usize, what: &str| {
        isize::try_from(s).unwrap_or_else(|_| panic!("gemm {what} stride {s} overflows isize"))
    };
    assert!(
        dst_rs >= n,
        "gemm destination row stride {dst_rs} < {n} columns (rows would overlap)"
    );
    let strides = (
        stride(dst_rs, "destination row"),
        stride(rhs_rs, "rhs row"),
        stride(rhs_cs, "rhs column"),
    );
    if m == 0 || n == 0 {
        return;
    }
    let dst_needs = extent(m, dst_rs, n, 1);
    assert!(
        dst_needs.is_some_and(|need| dst.len() >= need),
        "gemm destination of {} values too small for {m} rows of {n}, {dst_rs} apart",
        dst.len()
    );
    if k == 0 {
        for row in dst.chunks_mut(dst_rs).take(m) {
            row[..n].fill(0.0);
        }
        return;
    }
    assert!(
        m.checked_mul(k).is_some_and(|need| lhs.len() >= need),
        "gemm lhs of {} values too small for {m} × {k}",
        lhs.len()
    );
    assert!(
        extent(k, rhs_rs, n, rhs_cs).is_some_and(|need| rhs.len() >= need),
        "gemm rhs of {} values too small for {k} × {n} with strides ({rhs_rs}, {rhs_cs})",
        rhs.len()
    );
    let parallelism = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    let (dst_rs, rhs_rs, rhs_cs) = strides;
    // SAFETY: the asserts above keep every access inside the three slices: the m × n
    // destination values (rows dst_rs ≥ n apart, so distinct, each written once), lhs
    // [i·k + p] < m·k, rhs [p·rhs_rs + j·rhs_cs] below its extent; every stride is a
    // non-negative isize and every offset at most a slice's length, so no pointer arithmetic
    // overflows. `dst` is a unique borrow, so it aliases neither input; read_dst is false,
    // so it is only written.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs,
            false,
            lhs.as_ptr(),
            1,
            k as isize,
            rhs.as_ptr(),
            rhs_cs,
            rhs_rs,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            parallelism,
        );
    }
}

impl CpuBackend {
    /// Causal attention of `q` over the cache: on AMX tiles for a prompt in bf16 compute
    /// (bf16 linears whose activations are rounded to bf16, on a host with AMX), else in f32.
    fn causal_attention(
        &self,
        q: &Tensor,
        kv: &KvView,
        d: usize,
        kv_heads: usize,
        scale: f32,
    ) -> Tensor {
        if self.invariant {
            return super::attention::invariant_attention(&self.team, q, kv, d, kv_heads, scale);
        }
        #[cfg(target_arch = "x86_64")]
        if self.bf16_linears
            && self.kernels.gemm_variant(true) == super::isa::Isa::Amx
            && q.rows_cols().0 > super::attention::DIRECT_MAX_ROWS
        {
            // SAFETY: `Kernels` holds `Isa::Amx` only where the host supports it.
            return unsafe {
                super::attention::amx::causal_attention_amx(&self.team, q, kv, d, kv_heads, scale)
            };
        }
        super::attention::causal_attention(&self.team, q, kv, d, kv_heads, scale)
    }

    /// Packs one linear's slices (several: a fused product), leaving out the padding of an
    /// uneven split unless the sums must keep their invariant blocks (whose order counts
    /// the padding's place).
    fn pack(
        &self,
        src: &dyn WeightSource,
        slices: &[&WeightSlice],
        order: WeightOrder,
    ) -> crate::runtime::weights::WeightResult<(PackedMatrix, Option<Unpadded>)> {
        let trimmed = (!self.invariant)
            .then(|| Unpadded::trim(slices, order))
            .flatten();
        // The invariant order's depth blocks are the stored steps in their own order.
        let pack = if self.invariant {
            PackedMatrix::pack_slices_in_step_order
        } else {
            PackedMatrix::pack_slices
        };
        Ok(match trimmed {
            Some((real, unpadded)) => {
                let refs: Vec<&WeightSlice> = real.iter().collect();
                let packed = pack(src, &refs, order, self.bf16_linears)?;
                (packed, Some(unpadded))
            }
            None => (pack(src, slices, order, self.bf16_linears)?, None),
        })
    }

    /// `x[i] = f(x[i])`, split over the team for long tensors; `f` is inlined into an
    /// AVX2 loop where the CPU has it (so SiLU's `exp` vectorises).
    fn map_in_place(&self, x: &mut Tensor, f: impl Fn(f32) -> f32 + Sync) {
        self.team
            .for_each_part(&mut x.data, 1, PARALLEL_MIN, &|part, _| {
                with_avx2(|| part.iter_mut().for_each(|v| *v = f(*v)))
            });
    }
}

/// A weight on the CPU: packed panels for linear use, a plain f32 tensor for anything else.
#[derive(Debug)]
pub struct CpuWeight {
    packed: Option<PackedMatrix>,
    dense: Option<Tensor>,
    /// An embedding table kept in bf16 (bf16 compute): `[rows, cols]`, widened row by row
    /// on lookup.
    table_bf16: Option<(usize, Vec<half::bf16>)>,
    /// The padding of an uneven split that the packed weight leaves out.
    unpadded: Option<Unpadded>,
}

impl CpuWeight {
    fn dense(&self) -> BackendResult<&Tensor> {
        self.dense.as_ref().ok_or_else(|| {
            BackendError::Unsupported(
                "a weight stored for linear or table use is read as a vector".into(),
            )
        })
    }
}

/// One attention op's pool of KV blocks: block `b` holds the keys of `block_size` token
/// slots at rows `b · block_size ..` of `k` (rows of `k_width`), its values likewise in `v`.
#[derive(Debug, Default)]
pub struct CpuKv {
    k: Vec<f32>,
    v: Vec<f32>,
    k_width: usize,
    v_width: usize,
    block_size: usize,
    blocks: usize,
}

impl CpuKv {
    /// Writes rows `rows` of `k` and `v` at positions `start..` of the sequence whose table
    /// is `table` (checked by `shape_rules::paged_segment`), a block at a time.
    fn write(
        &mut self,
        k: &Tensor,
        v: &Tensor,
        rows: std::ops::Range<usize>,
        start: usize,
        table: &[u32],
    ) {
        let (kw, vw, bs) = (self.k_width, self.v_width, self.block_size);
        let (mut r, mut p) = (rows.start, start);
        while r < rows.end {
            let len = (bs - p % bs).min(rows.end - r);
            let at = table[p / bs] as usize * bs + p % bs;
            self.k[at * kw..(at + len) * kw].copy_from_slice(&k.data[r * kw..(r + len) * kw]);
            self.v[at * vw..(at + len) * vw].copy_from_slice(&v.data[r * vw..(r + len) * vw]);
            r += len;
            p += len;
        }
    }
}

/// `w`'s packed panels, checked against `x`'s features (what every linear reads).
fn packed_for<'w>(x: &Tensor, w: &'w CpuWeight) -> BackendResult<&'w PackedMatrix> {
    let w = w.packed.as_ref().ok_or_else(|| {
        BackendError::Unsupported("the weight was not uploaded for linear use".into())
    })?;
    if x.cols() != w.inputs() {
        return Err(shape_err(format!(
            "{} input features against a weight of {} inputs",
            x.cols(),
            w.inputs()
        )));
    }
    Ok(w)
}

fn shape_err(what: String) -> BackendError {
    BackendError::Shape(what)
}

widest_simd_fn!(fn silu_in_place(x: &mut [f32]) => silu_all);

/// SiLU of every value, compiled per instruction set by [`silu_in_place`] (measured on a
/// 512 × 5632 prompt activation, one thread: AVX-512 1.5 ms, AVX2 2.0 ms).
#[inline(always)]
fn silu_all(x: &mut [f32]) {
    x.iter_mut().for_each(|v| *v = fastmath::silu(*v));
}

/// RMSNorm of each group of `w.len()` values of `x` into `out` (as long as `x`):
/// `out ← w ⊙ x / rms(x)`, the mean square summed in `f64`.
fn rms_norm_rows(x: &[f32], out: &mut [f32], w: &[f32], eps: f32) {
    let group = w.len().max(1);
    with_avx2(|| {
        for (row, o) in x.chunks(group).zip(out.chunks_mut(group)) {
            let inv = inverse_rms(row, eps);
            for ((o, &v), &g) in o.iter_mut().zip(row).zip(w) {
                *o = g * (v * inv);
            }
        }
    })
}

/// `1 / sqrt(mean(x²) + eps)`, the mean in f64.
#[inline(always)]
fn inverse_rms(x: &[f32], eps: f32) -> f32 {
    let ms = sum_of_squares(x) / x.len().max(1) as f64;
    (1.0 / (ms + eps as f64).sqrt()) as f32
}

/// `Σ x²` in f64 over eight running sums, so that it vectorises (one running sum is a
/// chain of dependent f64 additions: 1.2 ms per 512 × 2048 norm, measured).
#[inline(always)]
fn sum_of_squares(x: &[f32]) -> f64 {
    let mut acc = [0f64; 8];
    let chunks = x.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for l in 0..8 {
            acc[l] += (c[l] as f64) * (c[l] as f64);
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for &v in rest {
        s += (v as f64) * (v as f64);
    }
    s
}

impl Activation for Tensor {
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn dtype(&self) -> DType {
        DType::F32
    }
}

impl HostBuffer for Tensor {
    fn host_data(&mut self) -> HostData<'_> {
        HostData::F32(&mut self.data)
    }
    fn host_data_ref(&self) -> HostDataRef<'_> {
        HostDataRef::F32(&self.data)
    }
}

impl Backend for CpuBackend {
    type Act = Tensor;
    type Weight = CpuWeight;
    type Kv = CpuKv;
    type RopeTables = RopeTables;

    fn upload(
        &self,
        src: &dyn WeightSource,
        slice: &WeightSlice,
        usage: WeightUse,
    ) -> BackendResult<CpuWeight> {
        let weights = BackendError::Weights;
        // Linear weights go from the checkpoint straight into packed panels, in the compute
        // dtype (no f32 copy of a bf16 weight); only other uses get a plain f32 tensor.
        let mut unpadded = None;
        let packed = match usage.linear {
            Some(order) if slice.local_shape.len() == 2 => {
                let (packed, skipped) = self.pack(src, &[slice], order).map_err(weights)?;
                unpadded = skipped;
                Some(packed)
            }
            Some(_) => {
                return Err(shape_err(format!(
                    "a linear weight of shape {:?}; linear weights are 2-D",
                    slice.local_shape
                )))
            }
            None => None,
        };
        // In bf16 compute a 2-D table (an embedding) stays bf16: half the bytes.
        let table = usage.other && self.bf16_linears && slice.local_shape.len() == 2;
        let table_bf16 = if table {
            let (shape, data) = load_slice_bf16(src, slice).map_err(weights)?;
            Some((shape[1], data))
        } else {
            None
        };
        let dense = if (usage.other || packed.is_none()) && !table {
            Some(load_slice(src, slice).map_err(weights)?)
        } else {
            None
        };
        Ok(CpuWeight {
            packed,
            dense,
            table_bf16,
            unpadded,
        })
    }

    fn upload_linears(
        &self,
        src: &dyn WeightSource,
        slices: &[&WeightSlice],
        order: WeightOrder,
    ) -> BackendResult<CpuWeight> {
        let (packed, unpadded) = self
            .pack(src, slices, order)
            .map_err(BackendError::Weights)?;
        Ok(CpuWeight {
            packed: Some(packed),
            dense: None,
            table_bf16: None,
            unpadded,
        })
    }

    fn weight_bytes(&self, w: &CpuWeight) -> usize {
        w.packed.as_ref().map_or(0, PackedMatrix::bytes)
            + w.dense.as_ref().map_or(0, |t| t.data.len() * 4)
            + w.table_bf16.as_ref().map_or(0, |(_, d)| d.len() * 2)
    }

    fn embedding(&self, ids: &[i64], table: &CpuWeight, offset: usize) -> BackendResult<Tensor> {
        // The table's values and row length, in whichever form it is kept.
        let (data, cols) = match (&table.table_bf16, &table.dense) {
            (Some((cols, data)), _) => (HostDataRef::Bf16(data), *cols),
            (None, Some(t)) => (HostDataRef::F32(&t.data), t.cols()),
            (None, None) => {
                return Err(BackendError::Unsupported(
                    "a linear-only weight is read as an embedding table".into(),
                ))
            }
        };
        let len = match data {
            HostDataRef::F32(d) => d.len(),
            HostDataRef::Bf16(d) => d.len(),
        };
        let rows = len.checked_div(cols).unwrap_or(0);
        let mut out = Tensor::zeros(vec![ids.len(), cols]);
        for (r, &id) in ids.iter().enumerate() {
            // Ids outside this rank's rows contribute zeros; the all-reduce adds the rest.
            let Some(local) = usize::try_from(id)
                .ok()
                .and_then(|id| id.checked_sub(offset))
                .filter(|&l| l < rows)
            else {
                continue;
            };
            let dst = &mut out.data[r * cols..(r + 1) * cols];
            let row = local * cols..(local + 1) * cols;
            match data {
                HostDataRef::F32(d) => dst.copy_from_slice(&d[row]),
                HostDataRef::Bf16(d) => dst
                    .iter_mut()
                    .zip(&d[row])
                    .for_each(|(o, v)| *o = v.to_f32()),
            }
        }
        Ok(out)
    }

    fn linear(&self, x: &Tensor, w: &CpuWeight) -> BackendResult<Tensor> {
        let Some(u) = &w.unpadded else {
            return Ok(packed_for(x, w)?.matmul_with(self.kernels, x, &self.team));
        };
        if x.cols() != u.depth {
            return Err(shape_err(format!(
                "{} input features against a weight of {} inputs",
                x.cols(),
                u.depth
            )));
        }
        let real = u.real_inputs(x);
        let y = packed_for(&real, w)?.matmul_with(self.kernels, &real, &self.team);
        Ok(u.widen(y))
    }

    fn linear_invariant(
        &self,
        x: &Tensor,
        w: &CpuWeight,
        order: DepthOrder,
    ) -> BackendResult<Tensor> {
        Ok(packed_for(x, w)?.matmul_invariant(self.kernels, x, &self.team, order))
    }

    fn set_invariant_numerics(&mut self) -> BackendResult<()> {
        self.invariant = true;
        Ok(())
    }

    fn decode_limbs(&self, x: &Tensor) -> BackendResult<Tensor> {
        let (rows, cols) = x.rows_cols();
        if !cols.is_multiple_of(LIMBS) {
            return Err(shape_err(format!(
                "rows of {cols} values are not whole values of {LIMBS} limbs"
            )));
        }
        let mut shape = x.shape.clone();
        *shape.last_mut().expect("rows_cols gave a last dim") = cols / LIMBS;
        let mut out = Tensor::new(shape, pool::take(rows * cols / LIMBS));
        decode_limb_rows(&x.data, &mut out.data);
        Ok(out)
    }

    fn bias_add(&self, x: &mut Tensor, bias: &CpuWeight) -> BackendResult<()> {
        let bias = &bias.dense()?.data;
        if bias.is_empty() || x.cols() != bias.len() {
            return Err(shape_err(format!(
                "a bias of {} values on rows of {}",
                bias.len(),
                x.cols()
            )));
        }
        for row in x.data.chunks_mut(bias.len()) {
            row.iter_mut().zip(bias).for_each(|(o, b)| *o += b);
        }
        Ok(())
    }

    fn binary(&self, x: &mut Tensor, y: &Tensor, op: BinaryOp) -> BackendResult<()> {
        if x.data.len() != y.data.len() {
            return Err(shape_err(format!(
                "operands of {} and {} elements",
                x.data.len(),
                y.data.len()
            )));
        }
        self.team
            .for_each_part(&mut x.data, 1, PARALLEL_MIN, &|part, offset| {
                let y = &y.data[offset..offset + part.len()];
                with_avx2(|| match op {
                    BinaryOp::Add => part.iter_mut().zip(y).for_each(|(o, v)| *o += v),
                    BinaryOp::Mul => part.iter_mut().zip(y).for_each(|(o, v)| *o *= v),
                })
            });
        Ok(())
    }

    fn rms_norm(&self, x: &Tensor, w: &CpuWeight, group: usize, eps: f32) -> BackendResult<Tensor> {
        let w = &w.dense()?.data;
        let group = shape_rules::rms_norm_group(x.cols(), group, w.len())?;
        // Read from `x` and written whole: no copy of `x` first.
        let mut out = Tensor::new(x.shape.clone(), pool::take(x.data.len()));
        self.team
            .for_each_part(&mut out.data, group, PARALLEL_MIN, &|part, offset| {
                rms_norm_rows(&x.data[offset..offset + part.len()], part, w, eps)
            });
        Ok(out)
    }

    /// One loop over the rows where the communicator can (the in-process one-shot): each
    /// row is summed over the ranks and normalized while it is in cache. The bits are the
    /// two-pass path's (the same sum order, the same norm). A sum large enough for the team
    /// to share the norm (a prefill's, on a rank of several threads) takes the two passes,
    /// so that the norm stays parallel.
    fn all_reduce_rms_norm(
        &self,
        comm: &mut dyn Collectives<Tensor>,
        sum: &mut Tensor,
        w: &CpuWeight,
        group: usize,
        eps: f32,
        algorithm: Option<CollectiveAlgorithm>,
    ) -> Result<(Tensor, Option<CollectiveAlgorithm>), ReduceNormError> {
        let scales = &w.dense().map_err(ReduceNormError::Norm)?.data;
        let cols = sum.cols();
        let group = shape_rules::rms_norm_group(cols, group, scales.len())
            .map_err(ReduceNormError::Norm)?;
        if cols == 0 {
            return Err(ReduceNormError::Norm(shape_err(
                "RMSNorm of rows with no columns".into(),
            )));
        }
        let fused = if self.team.size() > 1 && sum.data.len() >= PARALLEL_MIN {
            None
        } else {
            let mut out = Tensor::zeros(sum.shape.clone());
            comm.all_reduce_sum_rows(sum, cols, algorithm, &mut |r, row| {
                rms_norm_rows(row, &mut out.data[r * cols..(r + 1) * cols], scales, eps);
            })
            .map(|ran| ran.map(|ran| (out, ran)))
        };
        match fused {
            Some(done) => done.map_err(ReduceNormError::Collective),
            None => reduce_then_rms_norm(self, comm, sum, w, group, eps, algorithm),
        }
    }

    /// One loop over the rows where the communicator can (as [`Self::all_reduce_rms_norm`]):
    /// each row is summed over the ranks, decoded, given its residual and normalized while
    /// it is in cache — the unfused ops' arithmetic, so their bits. A sum the team would
    /// share takes the unfused ops, which stay parallel.
    fn all_reduce_add_rms_norm(
        &self,
        comm: &mut dyn Collectives<Tensor>,
        mut sum: Tensor,
        step: NormStep<'_, Self>,
        algorithm: Option<CollectiveAlgorithm>,
    ) -> Result<NormStepOut<Tensor>, ReduceNormError> {
        if self.team.size() > 1 && sum.data.len() >= PARALLEL_MIN {
            return reduce_add_then_rms_norm(self, comm, sum, step, algorithm);
        }
        let norm = |e| ReduceNormError::Norm(e);
        let scales = &step.weight.dense().map_err(norm)?.data;
        let (rows, width) = sum.rows_cols();
        let per_value = if step.limbs { LIMBS } else { 1 };
        if width == 0 || !width.is_multiple_of(per_value) {
            return Err(norm(shape_err(format!(
                "RMSNorm of rows of {width} values held as {per_value} limb(s) each"
            ))));
        }
        let cols = width / per_value;
        shape_rules::rms_norm_group(cols, step.group, scales.len()).map_err(norm)?;
        if let Some(r) = step.residual.filter(|r| r.data.len() != rows * cols) {
            return Err(norm(shape_err(format!(
                "a residual of {} values added to {rows} rows of {cols}",
                r.data.len()
            ))));
        }
        let mut shape = sum.shape.clone();
        *shape.last_mut().expect("rows_cols gave a last dim") = cols;
        let mut h = Tensor::new(shape.clone(), pool::take(rows * cols));
        let mut y = Tensor::new(shape, pool::take(rows * cols));
        let (limbs, residual, eps) = (step.limbs, step.residual, step.eps);
        let done = comm.all_reduce_sum_rows(&mut sum, width, algorithm, &mut |r, row| {
            let at = r * cols..(r + 1) * cols;
            let h_row = &mut h.data[at.clone()];
            if limbs {
                decode_limb_rows(row, h_row);
            } else {
                h_row.copy_from_slice(row);
            }
            if let Some(residual) = residual {
                let add = &residual.data[at.clone()];
                with_avx2(|| h_row.iter_mut().zip(add).for_each(|(o, v)| *o += v));
            }
            rms_norm_rows(h_row, &mut y.data[at], scales, eps);
        });
        match done {
            Some(Ok(ran)) => {
                sum.release();
                Ok(NormStepOut {
                    residual: h,
                    normed: y,
                    ran,
                })
            }
            Some(Err(e)) => Err(ReduceNormError::Collective(e)),
            // Not a host communicator: the unfused ops.
            None => {
                h.release();
                y.release();
                reduce_add_then_rms_norm(self, comm, sum, step, algorithm)
            }
        }
    }

    fn layer_norm(
        &self,
        x: &Tensor,
        w: &CpuWeight,
        b: &CpuWeight,
        eps: f32,
    ) -> BackendResult<Tensor> {
        let (w, b) = (&w.dense()?.data, &b.dense()?.data);
        let cols = x.cols();
        shape_rules::layer_norm(cols, w.len(), b.len())?;
        let mut out = x.pooled_copy();
        for (row, o) in x.data.chunks(cols).zip(out.data.chunks_mut(cols)) {
            let mean = row.iter().map(|&v| v as f64).sum::<f64>() / cols as f64;
            let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / cols as f64;
            let inv = 1.0 / (var + eps as f64).sqrt();
            for (i, o) in o.iter_mut().enumerate() {
                *o = ((row[i] as f64 - mean) * inv) as f32 * w[i] + b[i];
            }
        }
        Ok(out)
    }

    fn activation(&self, x: &mut Tensor, kind: ActivationKind) -> BackendResult<()> {
        match kind {
            ActivationKind::Silu => {
                self.team
                    .for_each_part(&mut x.data, 1, PARALLEL_MIN, &|part, _| silu_in_place(part))
            }
            ActivationKind::Relu => self.map_in_place(x, |v| v.max(0.0)),
            ActivationKind::Gelu => self.map_in_place(x, |v| {
                let v = v as f64;
                (0.5 * v * (1.0 + libm::erf(v / std::f64::consts::SQRT_2))) as f32
            }),
            ActivationKind::GeluTanh => self.map_in_place(x, |v| {
                let v = v as f64;
                let c = (2.0 / std::f64::consts::PI).sqrt();
                (0.5 * v * (1.0 + (c * (v + 0.044715 * v * v * v)).tanh())) as f32
            }),
        }
        Ok(())
    }

    fn rope_tables(&self, op: &RopeOp, positions: &[i64]) -> BackendResult<RopeTables> {
        Ok(rope::tables(op, positions))
    }

    fn rope(&self, x: &mut Tensor, head_dim: usize, t: &RopeTables) -> BackendResult<()> {
        let (rows, cols) = x.rows_cols();
        let half = t.half;
        if head_dim == 0 || cols % head_dim != 0 || 2 * half > head_dim || t.cos.len() < rows * half
        {
            return Err(shape_err(format!(
                "rotary embedding of {half} pairs per head of {head_dim} on {rows} rows of {cols}"
            )));
        }
        for r in 0..rows {
            let cos = &t.cos[r * half..(r + 1) * half];
            let sin = &t.sin[r * half..(r + 1) * half];
            let row = &mut x.data[r * cols..(r + 1) * cols];
            for head in row.chunks_mut(head_dim) {
                for i in 0..half {
                    let (a, b) = (head[i], head[i + half]);
                    head[i] = a * cos[i] - b * sin[i];
                    head[i + half] = b * cos[i] + a * sin[i];
                }
            }
        }
        Ok(())
    }

    fn new_kv(&self, k_width: usize, v_width: usize, block_size: usize) -> CpuKv {
        CpuKv {
            k_width,
            v_width,
            block_size: block_size.max(1),
            ..Default::default()
        }
    }

    fn grow_kv(&self, kv: &mut CpuKv, blocks: usize) -> BackendResult<()> {
        if blocks <= kv.blocks {
            return Ok(());
        }
        let values = |width: usize| {
            blocks
                .checked_mul(kv.block_size)
                .and_then(|n| n.checked_mul(width))
                .filter(|&n| n.checked_mul(4).is_some_and(|b| b <= isize::MAX as usize))
                .ok_or_else(|| {
                    BackendError::OutOfMemory(format!(
                        "a KV pool of {blocks} blocks of {} tokens of {width} values overflows",
                        kv.block_size
                    ))
                })
        };
        let (kl, vl) = (values(kv.k_width)?, values(kv.v_width)?);
        let no_memory = |what: &str| {
            BackendError::OutOfMemory(format!(
                "no memory for the {what} of a KV pool of {blocks} blocks of {} tokens; give the \
                 KV cache less memory or the run fewer tokens",
                kv.block_size
            ))
        };
        kv.k.try_reserve_exact(kl - kv.k.len())
            .map_err(|_| no_memory("keys"))?;
        kv.v.try_reserve_exact(vl - kv.v.len())
            .map_err(|_| no_memory("values"))?;
        kv.k.resize(kl, 0.0);
        kv.v.resize(vl, 0.0);
        kv.blocks = blocks;
        Ok(())
    }

    fn attention(
        &self,
        [q, k, v]: [&Tensor; 3],
        kv: &mut CpuKv,
        segments: &[Segment<'_>],
        d: usize,
        scale: f32,
    ) -> BackendResult<Tensor> {
        let (rows, qcols) = q.rows_cols();
        let (kcols, vcols) = (k.cols(), v.cols());
        let (_, kv_heads) =
            shape_rules::attention_heads((rows, qcols), k.rows_cols(), v.rows_cols(), d)?;
        if kv.k_width != kcols || kv.v_width != vcols {
            return Err(shape_err(format!(
                "keys of {kcols} and values of {vcols} columns into a KV pool of {} and {}",
                kv.k_width, kv.v_width
            )));
        }
        if segments.is_empty() {
            return Err(shape_err("attention over no segments".into()));
        }
        // Every segment checked, then every segment's keys and values written, then each
        // attends: a sequence may read blocks another one of the call wrote.
        for s in segments {
            shape_rules::paged_segment(s, rows, kv.block_size, kv.blocks)?;
        }
        for s in segments {
            kv.write(k, v, s.rows.clone(), s.start, s.blocks);
        }
        let single = matches!(segments, [s] if s.rows == (0..rows));
        let mut out = if single {
            None
        } else {
            Some(Tensor::zeros(q.shape.clone()))
        };
        let mut result = Ok(());
        for s in segments {
            let end = s.start + s.rows.len();
            let cache = match KvView::new(&kv.k, &kv.v, kcols, kv.block_size, s.blocks, end) {
                Ok(c) => c,
                Err(why) => {
                    result = Err(shape_err(why));
                    break;
                }
            };
            match &mut out {
                None => {
                    return Ok(self.causal_attention(q, &cache, d, kv_heads, scale));
                }
                Some(out) => {
                    let mut rows_of_q = pool::empty(s.rows.len() * qcols);
                    rows_of_q.extend_from_slice(&q.data[s.rows.start * qcols..s.rows.end * qcols]);
                    let part = Tensor::new(vec![s.rows.len(), qcols], rows_of_q);
                    let y = self.causal_attention(&part, &cache, d, kv_heads, scale);
                    out.data[s.rows.start * qcols..s.rows.end * qcols].copy_from_slice(&y.data);
                    y.release();
                    part.release();
                }
            }
        }
        result?;
        out.ok_or_else(|| shape_err("attention over no segments".into()))
    }

    fn unfuse(&self, x: &Tensor, block: usize, offset: usize, len: usize) -> BackendResult<Tensor> {
        let n = x.cols();
        shape_rules::unfuse(n, block, offset, len)?;
        let mut out = pool::empty(x.data.len() / block * len);
        for chunk in x.data.chunks(block) {
            out.extend_from_slice(&chunk[offset..offset + len]);
        }
        Ok(x.with_cols(n / block * len, out))
    }

    fn split_columns(&self, mut x: Tensor, widths: &[usize]) -> BackendResult<Vec<Tensor>> {
        let (rows, n) = x.rows_cols();
        if let Err(e) = shape_rules::split_columns(n, widths) {
            x.release();
            return Err(e);
        }
        // The blocks after the first are copied out; the first then moves to the front of
        // each row in place and keeps the product's memory (one row, a decode step: it
        // is there already).
        let mut parts = Vec::with_capacity(widths.len());
        parts.push(Tensor::default());
        let mut offset = widths[0];
        for &w in &widths[1..] {
            let mut out = pool::empty(rows * w);
            // (No columns at all: no rows to read either.)
            for row in x.data.chunks_exact(n.max(1)) {
                out.extend_from_slice(&row[offset..offset + w]);
            }
            parts.push(x.with_cols(w, out));
            offset += w;
        }
        let first = widths[0];
        for r in 1..rows {
            x.data.copy_within(r * n..r * n + first, r * first);
        }
        x.data.truncate(rows * first);
        if let Some(last) = x.shape.last_mut() {
            *last = first;
        }
        parts[0] = x;
        Ok(parts)
    }

    fn column_block(&self, x: &Tensor, k: usize, parts: usize) -> BackendResult<Tensor> {
        let n = x.cols();
        shape_rules::column_block(n, k, parts)?;
        let mut out = pool::empty(x.data.len() / parts);
        x.push_column_block(k, parts, &mut out);
        Ok(x.with_cols(n / parts, out))
    }

    fn column_window(
        &self,
        x: &Tensor,
        offset: usize,
        len: usize,
        width: usize,
    ) -> BackendResult<Tensor> {
        let (rows, n) = x.rows_cols();
        shape_rules::column_window(n, offset, len, width)?;
        let mut out = pool::empty(rows * width);
        for row in x.data.chunks_exact(n.max(1)).take(rows) {
            out.extend_from_slice(&row[offset..offset + len]);
            out.resize(out.len() + width - len, 0.0);
        }
        out.resize(rows * width, 0.0);
        Ok(x.with_cols(width, out))
    }

    fn rows_to_rank_major(&self, x: &Tensor, parts: usize) -> BackendResult<Tensor> {
        let n = x.cols();
        shape_rules::to_rank_major(n, parts)?;
        let mut out = pool::empty(x.data.len());
        for k in 0..parts {
            x.push_column_block(k, parts, &mut out);
        }
        Ok(Tensor::new(vec![x.rows_cols().0 * parts, n / parts], out))
    }

    fn rank_major_to_rows(&self, x: &Tensor, widths: &[usize]) -> BackendResult<Tensor> {
        let (all_rows, n) = x.rows_cols();
        let (rows, keep) = shape_rules::from_rank_major(all_rows, n, widths)?;
        let mut out = pool::empty(rows * keep);
        for r in 0..rows {
            for (k, &width) in widths.iter().enumerate() {
                let start = (k * rows + r) * n;
                out.extend_from_slice(&x.data[start..start + width]);
            }
        }
        Ok(Tensor::new(vec![rows, keep], out))
    }

    fn argmax_rows(&self, x: &Tensor) -> BackendResult<Vec<usize>> {
        let cols = x.cols();
        if cols == 0 {
            return Err(shape_err("argmax of rows with no columns".into()));
        }
        Ok(x.data
            .chunks(cols)
            .map(crate::runtime::sampling::argmax)
            .collect())
    }

    fn argmax_pairs(&self, x: &Tensor, valid: usize, offset: usize) -> BackendResult<Tensor> {
        let (rows, cols) = x.rows_cols();
        if valid > cols {
            return Err(shape_err(format!("{valid} valid columns of {cols}")));
        }
        let mut out = pool::empty(rows * 2);
        for row in x.data.chunks(cols.max(1)).take(rows) {
            let (value, index) = if row.iter().any(|v| !v.is_finite()) {
                (f32::NAN, 0.0)
            } else if valid == 0 {
                (f32::NEG_INFINITY, -1.0)
            } else {
                let i = crate::runtime::sampling::argmax(&row[..valid]);
                // Exact: vocabularies are at most 2^24 (the model validation's limit).
                (row[i], (offset + i) as f32)
            };
            out.extend_from_slice(&[value, index]);
        }
        Ok(Tensor::new(vec![rows, 2], out))
    }

    fn best_of_pairs(&self, pairs: &Tensor, parts: usize) -> BackendResult<Tensor> {
        let (all, cols) = pairs.rows_cols();
        let rows = shape_rules::pairs(all, cols, parts)?;
        let mut out = pool::empty(rows * 2);
        for r in 0..rows {
            // Parts hold increasing vocabulary ranges: keep the first of equal values.
            let mut best = [f32::NEG_INFINITY, -1.0];
            for p in 0..parts {
                let at = (p * rows + r) * 2;
                let (v, i) = (pairs.data[at], pairs.data[at + 1]);
                if v.is_nan() {
                    best = [f32::NAN, 0.0];
                    break;
                }
                if i >= 0.0 && (best[1] < 0.0 || v > best[0]) {
                    best = [v, i];
                }
            }
            out.extend_from_slice(&best);
        }
        Ok(Tensor::new(vec![rows, 2], out))
    }

    fn top_k_pairs(
        &self,
        x: &Tensor,
        k: usize,
        valid: usize,
        offset: usize,
    ) -> BackendResult<Tensor> {
        host_top_k_pairs(x, k, valid, offset).map_err(shape_err)
    }

    fn best_k_of_pairs(&self, pairs: &Tensor, parts: usize, k: usize) -> BackendResult<Tensor> {
        host_best_k_of_pairs(pairs, parts, k).map_err(shape_err)
    }

    fn first_non_finite_row(&self, x: &Tensor) -> BackendResult<Option<usize>> {
        Ok(x.first_non_finite_row())
    }

    fn select_rows(&self, x: &Tensor, rows: &[usize]) -> BackendResult<Tensor> {
        let (all, cols) = x.rows_cols();
        let mut out = pool::empty(rows.len() * cols);
        for &r in rows {
            if r >= all {
                return Err(shape_err(format!("row {r} of {all}")));
            }
            out.extend_from_slice(&x.data[r * cols..(r + 1) * cols]);
        }
        Ok(Tensor::new(vec![rows.len(), cols], out))
    }

    fn row_window(&self, x: &Tensor, from: usize, count: usize) -> BackendResult<Tensor> {
        let (all, cols) = x.rows_cols();
        let len = count
            .checked_mul(cols)
            .ok_or_else(|| BackendError::OutOfMemory(format!("{count} rows of {cols}")))?;
        let mut out = pool::empty(len);
        let real = all.saturating_sub(from).min(count);
        if real > 0 {
            out.extend_from_slice(&x.data[from * cols..(from + real) * cols]);
        }
        out.resize(len, 0.0);
        Ok(Tensor::new(vec![count, cols], out))
    }

    fn weighted_rows_sum(
        &self,
        rows: usize,
        width: usize,
        parts: &[(&Tensor, &[usize], &[f32])],
    ) -> BackendResult<Tensor> {
        shape_rules::weighted_rows(
            rows,
            width,
            parts.iter().map(|(y, at, w)| (y.rows_cols(), *at, *w)),
        )?;
        let mut out = Tensor::zeros(vec![rows, width]);
        for (y, at, weights) in parts {
            for ((src, &r), &w) in y.data.chunks_exact(width.max(1)).zip(*at).zip(*weights) {
                let dst = &mut out.data[r * width..(r + 1) * width];
                dst.iter_mut().zip(src).for_each(|(o, v)| *o += w * v);
            }
        }
        Ok(out)
    }

    fn alloc(&self, shape: &[usize], dtype: DType) -> BackendResult<Tensor> {
        if dtype != DType::F32 {
            return Err(BackendError::Unsupported(format!(
                "{dtype:?} activations; the CPU backend computes activations in f32"
            )));
        }
        let n = shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| BackendError::OutOfMemory(format!("a tensor of shape {shape:?}")))?;
        Ok(Tensor {
            shape: shape.to_vec(),
            data: pool::take(n),
        })
    }

    fn copy(&self, x: &Tensor) -> BackendResult<Tensor> {
        Ok(x.pooled_copy())
    }

    fn release(&self, x: Tensor) {
        x.release();
    }

    fn to_host(&self, x: Tensor) -> BackendResult<Tensor> {
        Ok(x)
    }

    fn upload_host(&self, x: &Tensor) -> BackendResult<Tensor> {
        Ok(x.pooled_copy())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::WeightOrder;
    use crate::runtime::sampling::candidate_order;

    fn naive(x: &Tensor, w: &Tensor, order: WeightOrder) -> Vec<f32> {
        let (m, k) = x.rows_cols();
        let n = match order {
            WeightOrder::OutIn => w.shape[0],
            WeightOrder::InOut => w.shape[1],
        };
        let mut out = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k)
                    .map(|kk| {
                        let wv = match order {
                            WeightOrder::OutIn => w.data[j * k + kk],
                            WeightOrder::InOut => w.data[kk * n + j],
                        };
                        x.data[i * k + kk] * wv
                    })
                    .sum();
            }
        }
        out
    }

    fn dense(t: Tensor) -> CpuWeight {
        CpuWeight {
            packed: None,
            unpadded: None,
            dense: Some(t),
            table_bf16: None,
        }
    }

    #[test]
    fn gemm_and_packed_linear_match_a_naive_product_in_both_weight_orders() {
        let x = Tensor::new(
            vec![3, 5],
            (0..15).map(|i| (i as f32 * 0.37).sin()).collect(),
        );
        let w = Tensor::new(
            vec![4, 5],
            (0..20).map(|i| (i as f32 * 0.11).cos()).collect(),
        );
        let w2 = Tensor::new(vec![5, 4], w.data.clone());
        for threads in [1, 2] {
            let cpu = CpuBackend::new(threads);
            for (w, order, rs, cs) in [
                (&w, WeightOrder::OutIn, 1, 5),
                (&w2, WeightOrder::InOut, 4, 1),
            ] {
                let want = naive(&x, w, order);
                let mut y = vec![0f32; 12];
                gemm_f32((3, 4, 5), &mut y, 4, &x.data, (&w.data, rs, cs), threads);
                let weight = CpuWeight {
                    packed: Some(PackedMatrix::pack(w, order, false)),
                    unpadded: None,
                    dense: None,
                    table_bf16: None,
                };
                let packed = cpu.linear(&x, &weight).unwrap();
                assert_eq!(packed.shape, vec![3, 4]);
                for ((a, p), b) in y.iter().zip(&packed.data).zip(&want) {
                    assert!((a - b).abs() < 1e-5 && (p - b).abs() < 1e-5, "{order:?}");
                }
            }
            // A weight uploaded for other uses only cannot be multiplied by.
            assert!(cpu.linear(&x, &dense(w.clone())).is_err());
        }
    }

    /// The panic message of `gemm_f32` on these operands, or `None` when it ran.
    fn gemm_refusal(
        mnk: (usize, usize, usize),
        (dst_len, dst_rs): (usize, usize),
        lhs_len: usize,
        (rhs_len, rs, cs): (usize, usize, usize),
    ) -> Option<String> {
        let mut dst = vec![0f32; dst_len];
        let (lhs, rhs) = (vec![1f32; lhs_len], vec![1f32; rhs_len]);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            gemm_f32(mnk, &mut dst, dst_rs, &lhs, (&rhs, rs, cs), 1)
        }));
        r.err().map(|e| match e.downcast::<String>() {
            Ok(s) => *s,
            Err(e) => e.downcast_ref::<&str>().copied().unwrap_or("?").to_string(),
        })
    }

    #[test]
    fn gemm_refuses_overlapping_rows_short_operands_and_overflowing_sizes() {
        let refused = |mnk, dst, lhs, rhs, why: &str| {
            let msg = gemm_refusal(mnk, dst, lhs, rhs).expect(why);
            assert!(msg.starts_with("gemm "), "{why}: {msg}");
        };
        // Rows 1 apart for 2 columns overlap (they were written by two threads at once).
        refused((2, 2, 1), (4, 1), 2, (2, 2, 1), "dst_rs < n");
        refused(
            (1, 2, 1),
            (4, 0),
            1,
            (2, 2, 1),
            "dst_rs < n for one row too",
        );
        // A stride that was negative (isize) is now a huge usize: its extent overflows.
        let minus_one = usize::MAX;
        refused(
            (2, 2, 2),
            (4, 2),
            4,
            (4, minus_one, 1),
            "a negative rhs row stride",
        );
        refused(
            (2, 2, 2),
            (4, 2),
            4,
            (4, 2, minus_one),
            "a negative rhs column stride",
        );
        refused(
            (2, 2, 2),
            (4, minus_one),
            4,
            (4, 2, 1),
            "a negative dst stride",
        );
        // (m - 1)·dst_rs + n and m·k past usize (they wrapped, passing the old checks).
        let half = usize::MAX / 2 + 1;
        refused(
            (3, 1, 1),
            (4, half),
            3,
            (1, 1, 1),
            "(m - 1)·dst_rs overflowing",
        );
        refused((2, 1, half), (2, 1), 4, (4, 0, 0), "m·k overflowing");
        refused(
            (1, 2, 3),
            (2, 2),
            3,
            (4, half, half),
            "the rhs extent overflowing",
        );
        // Strides that fit in usize but not in the crate's isize.
        refused(
            (1, 1, 1),
            (1, 1),
            1,
            (1, half, 0),
            "an rhs stride past isize",
        );
        // Short operands.
        refused((2, 2, 2), (3, 2), 4, (4, 2, 1), "a short dst");
        refused((2, 2, 2), (4, 2), 3, (4, 2, 1), "a short lhs");
        refused((2, 2, 2), (4, 2), 4, (3, 2, 1), "a short rhs");
        // Exactly long enough, gaps between dst rows, zero (broadcast) strides: accepted.
        assert_eq!(gemm_refusal((2, 2, 2), (5, 3), 4, (4, 2, 1)), None);
        assert_eq!(gemm_refusal((2, 2, 2), (4, 2), 4, (1, 0, 0)), None);
        // Empty products touch nothing (a stride still has to be sane).
        assert_eq!(gemm_refusal((0, 2, 2), (0, 2), 0, (0, 2, 1)), None);
        assert_eq!(gemm_refusal((2, 0, 2), (0, 0), 0, (0, 2, 1)), None);
    }

    #[test]
    fn gemm_over_an_empty_sum_writes_zeros_and_leaves_row_gaps() {
        let mut dst = vec![5f32; 5];
        gemm_f32((2, 2, 0), &mut dst, 3, &[], (&[], 0, 0), 1);
        assert_eq!(dst, vec![0.0, 0.0, 5.0, 0.0, 0.0]);
    }

    fn seg(rows: std::ops::Range<usize>, start: usize, blocks: &[u32]) -> Segment<'_> {
        Segment {
            rows,
            start,
            blocks,
        }
    }

    #[test]
    fn attention_over_one_key_returns_its_value() {
        let cpu = CpuBackend::new(1);
        let q = Tensor::new(vec![1, 4], vec![1.0, 2.0, 3.0, 4.0]);
        let k = Tensor::new(vec![1, 2], vec![0.5, 0.5]);
        let v = Tensor::new(vec![1, 2], vec![7.0, 8.0]);
        let mut pool = cpu.new_kv(2, 2, 2);
        cpu.grow_kv(&mut pool, 2).unwrap();
        let out = cpu
            .attention([&q, &k, &v], &mut pool, &[seg(0..1, 0, &[1])], 2, 1.0)
            .unwrap();
        assert_eq!(out.data, vec![7.0, 8.0, 7.0, 8.0]);
    }

    /// A table too short for the positions, a block outside the pool, rows outside the
    /// call, keys of another width and no segment at all are errors (not panics), and
    /// the pool grows only by whole checked sizes.
    #[test]
    fn attention_refuses_what_its_pool_and_tables_cannot_hold() {
        let cpu = CpuBackend::new(1);
        let q = Tensor::new(vec![1, 4], vec![1.0, 2.0, 3.0, 4.0]);
        let k = Tensor::new(vec![1, 2], vec![0.5, 0.5]);
        let v = Tensor::new(vec![1, 2], vec![7.0, 8.0]);
        let mut pool = cpu.new_kv(2, 2, 2);
        cpu.grow_kv(&mut pool, 3).unwrap();
        let mut refused = |segments: &[Segment<'_>], k: &Tensor, what: &str| {
            let e = cpu.attention([&q, k, &v], &mut pool, segments, 2, 1.0);
            assert!(e.is_err(), "{what}: accepted");
        };
        refused(
            &[seg(0..1, 2, &[0])],
            &k,
            "a table of 1 block for position 2",
        );
        refused(&[seg(0..1, 0, &[3])], &k, "block 3 of 3");
        refused(&[seg(0..1, 0, &[u32::MAX])], &k, "block u32::MAX");
        refused(&[seg(0..2, 0, &[0])], &k, "rows past the call");
        refused(&[seg(0..1, usize::MAX, &[0])], &k, "a start that overflows");
        refused(&[], &k, "no segment");
        let wide = Tensor::new(vec![1, 4], vec![0.5; 4]);
        refused(
            &[seg(0..1, 0, &[0])],
            &wide,
            "keys of 4 columns into a pool of 2",
        );
        assert!(cpu.grow_kv(&mut pool, usize::MAX / 2).is_err());
        // The pool is unchanged by what it refused.
        assert_eq!(pool.blocks, 3);
        assert_eq!(pool.k.len(), 3 * 2 * 2);
    }

    fn rows_of(n: usize, cols: usize, salt: usize) -> Tensor {
        Tensor::new(
            vec![n, cols],
            (0..n * cols)
                .map(|i| (((i * 7 + salt * 13) % 11) as f32 - 5.0) / 3.0)
                .collect(),
        )
    }

    #[test]
    #[cfg_attr(
        miri,
        ignore = "minutes under Miri; attention's unsafe paths have their own test"
    )]
    fn a_ragged_batch_attends_each_sequence_to_its_own_blocks_only() {
        let cpu = CpuBackend::new(2);
        let (d, hq, hk) = (4, 2, 1);
        // Sequence 0: 3 prompt rows; sequence 1: 5 prompt rows; blocks of 3 out of order.
        let (q, k, v) = (
            rows_of(8, hq * d, 1),
            rows_of(8, hk * d, 2),
            rows_of(8, hk * d, 3),
        );
        let mut pool = cpu.new_kv(hk * d, hk * d, 3);
        cpu.grow_kv(&mut pool, 6).unwrap();
        let tables: [&[u32]; 2] = [&[4], &[5, 0]];
        let both = cpu
            .attention(
                [&q, &k, &v],
                &mut pool,
                &[seg(0..3, 0, tables[0]), seg(3..8, 0, tables[1])],
                d,
                0.5,
            )
            .unwrap();
        for (range, seq) in [(0..3, 0), (3..8, 1)] {
            let part = |t: &Tensor| cpu.select_rows(t, &range.clone().collect::<Vec<_>>());
            let (q1, k1, v1) = (part(&q).unwrap(), part(&k).unwrap(), part(&v).unwrap());
            let mut alone = cpu.new_kv(hk * d, hk * d, 16);
            cpu.grow_kv(&mut alone, 1).unwrap();
            let n = range.len();
            let y = cpu
                .attention([&q1, &k1, &v1], &mut alone, &[seg(0..n, 0, &[0])], d, 0.5)
                .unwrap();
            let cols = hq * d;
            assert_eq!(
                &both.data[range.start * cols..range.end * cols],
                &y.data[..],
                "sequence {seq}"
            );
            // Its keys sit in its blocks, position by position.
            for (i, r) in range.enumerate() {
                let at = tables[seq][i / 3] as usize * 3 + i % 3;
                assert_eq!(pool.k[at * 4..at * 4 + 4], k.data[r * 4..r * 4 + 4]);
            }
        }
    }

    /// Prefix caching: sequence b's table names sequence a's first (full) block and then a
    /// block of its own; b, starting after the shared block, writes only its own block and
    /// attends over a's cached prefix; a then decodes on, its shared block intact.
    #[test]
    #[cfg_attr(
        miri,
        ignore = "minutes under Miri; attention's unsafe paths have their own test"
    )]
    fn a_sequence_reads_a_shared_prefix_block_and_leaves_it_unwritten() {
        let cpu = CpuBackend::new(2);
        let (d, hq, hk, bs) = (8, 4, 2, 3);
        let (qc, kc) = (hq * d, hk * d);
        let (qa, ka, va) = (rows_of(6, qc, 1), rows_of(6, kc, 2), rows_of(6, kc, 3));
        let (qb, kb, vb) = (rows_of(2, qc, 4), rows_of(2, kc, 5), rows_of(2, kc, 6));
        let take = |t: &Tensor, r: std::ops::Range<usize>| {
            cpu.select_rows(t, &r.collect::<Vec<_>>()).unwrap()
        };
        let mut pool = cpu.new_kv(kc, kc, bs);
        cpu.grow_kv(&mut pool, 5).unwrap();
        let (table_a, table_b): (&[u32], &[u32]) = (&[3, 1], &[3, 4]);
        // a's first 5 tokens, then b's 2 after a's first block.
        let first = [take(&qa, 0..5), take(&ka, 0..5), take(&va, 0..5)];
        cpu.attention(
            [&first[0], &first[1], &first[2]],
            &mut pool,
            &[seg(0..5, 0, table_a)],
            d,
            0.5,
        )
        .unwrap();
        let got_b = cpu
            .attention(
                [&qb, &kb, &vb],
                &mut pool,
                &[seg(0..2, bs, table_b)],
                d,
                0.5,
            )
            .unwrap();
        let last = [take(&qa, 5..6), take(&ka, 5..6), take(&va, 5..6)];
        let got_a = cpu
            .attention(
                [&last[0], &last[1], &last[2]],
                &mut pool,
                &[seg(0..1, 5, table_a)],
                d,
                0.5,
            )
            .unwrap();
        // References: each sequence's whole history in a fresh pool of its own.
        let alone = |q: Tensor, k: Tensor, v: Tensor, rows: std::ops::Range<usize>| {
            let mut fresh = cpu.new_kv(kc, kc, 16);
            cpu.grow_kv(&mut fresh, 1).unwrap();
            let n = q.rows_cols().0;
            let y = cpu
                .attention([&q, &k, &v], &mut fresh, &[seg(0..n, 0, &[0])], d, 0.5)
                .unwrap();
            take(&y, rows)
        };
        let cat = |a: &Tensor, b: &Tensor| {
            let mut data = a.data[..bs * a.cols()].to_vec();
            data.extend_from_slice(&b.data);
            Tensor::new(vec![bs + b.rows_cols().0, a.cols()], data)
        };
        let want_b = alone(cat(&qa, &qb), cat(&ka, &kb), cat(&va, &vb), bs..bs + 2);
        let want_a = alone(qa.clone(), ka.clone(), va.clone(), 5..6);
        for (what, got, want) in [("b", &got_b, &want_b), ("a", &got_a, &want_a)] {
            for (x, y) in got.data.iter().zip(&want.data) {
                assert!((x - y).abs() < 1e-5 * (1.0 + y.abs()), "{what}: {x} vs {y}");
            }
        }
    }

    #[test]
    fn group_rms_norm_normalizes_each_head() {
        let cpu = CpuBackend::new(1);
        let x = Tensor::new(vec![1, 4], vec![3.0, 4.0, 1.0, 1.0]);
        let w = dense(Tensor::new(vec![2], vec![1.0, 1.0]));
        let y = cpu.rms_norm(&x, &w, 2, 0.0).unwrap();
        let expect = [3.0 / 12.5f32.sqrt(), 4.0 / 12.5f32.sqrt(), 1.0, 1.0];
        for (a, b) in y.data.iter().zip(expect) {
            assert!((a - b).abs() < 1e-6);
        }
    }

    /// The fused all-reduce + RMSNorm gives the bits of the all-reduce followed by the norm,
    /// for one-shot (one loop over the rows), the ring and the communicator's own choice, and
    /// for a sum large enough to keep the two passes, and leaves the reduced sum in its
    /// input.
    #[test]
    #[cfg_attr(
        miri,
        ignore = "rank threads spin in the communicator's waits: slow under Miri"
    )]
    fn fused_all_reduce_rms_norm_equals_the_two_passes() {
        use crate::runtime::comm::local_group;
        let choices = [
            None,
            Some(CollectiveAlgorithm::OneShot),
            Some(CollectiveAlgorithm::Ring),
        ];
        for n in [1, 2, 3] {
            let handles: Vec<_> = local_group(n)
                .into_iter()
                .enumerate()
                .map(|(rank, mut comm)| {
                    std::thread::spawn(move || {
                        // Two threads: the largest sum takes the two-pass path.
                        let cpu = CpuBackend::new(2);
                        let mut out = Vec::new();
                        let shapes = [(1, 64, 64), (3, 24, 8), (5, 40, 40), (16, 2048, 2048)];
                        for (rows, cols, group) in shapes {
                            let x: Vec<f32> = (0..rows * cols)
                                .map(|i| ((i * 7 + rank * 13) % 23) as f32 / 7.0 - 1.5)
                                .collect();
                            let w = dense(Tensor::new(
                                vec![group],
                                (0..group).map(|g| 0.5 + g as f32 / 16.0).collect(),
                            ));
                            for choice in choices {
                                let mut fused_in = Tensor::new(vec![rows, cols], x.clone());
                                let (fused, ran) = cpu
                                    .all_reduce_rms_norm(
                                        &mut comm,
                                        &mut fused_in,
                                        &w,
                                        group,
                                        1e-5,
                                        choice,
                                    )
                                    .unwrap();
                                let mut sum = Tensor::new(vec![rows, cols], x.clone());
                                Collectives::all_reduce_sum_planned(&mut comm, &mut sum, choice)
                                    .unwrap();
                                let two_pass = cpu.rms_norm(&sum, &w, group, 1e-5).unwrap();
                                out.push((fused, fused_in, two_pass, sum, ran, choice));
                            }
                        }
                        out
                    })
                })
                .collect();
            for h in handles {
                for (fused, fused_in, two_pass, sum, ran, choice) in h.join().unwrap() {
                    let bits = |t: &Tensor| t.data.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&fused), bits(&two_pass), "n {n} {choice:?}");
                    assert_eq!(bits(&fused_in), bits(&sum), "n {n} {choice:?}");
                    assert_eq!(fused.shape, two_pass.shape);
                    if choice.is_some() && n > 1 {
                        assert_eq!(ran, choice);
                    }
                }
            }
        }
    }

    #[test]
    fn rank_major_round_trip_and_unpadding() {
        let cpu = CpuBackend::new(1);
        // Two rows of 6 columns split 3 ways.
        let x = Tensor::new(vec![2, 6], (0..12).map(|i| i as f32).collect());
        let rm = cpu.rows_to_rank_major(&x, 3).unwrap();
        assert_eq!(
            rm.data,
            vec![0., 1., 6., 7., 2., 3., 8., 9., 4., 5., 10., 11.]
        );
        let back = cpu.rank_major_to_rows(&rm, &[2, 2, 1]).unwrap();
        assert_eq!(back.shape, vec![2, 5]);
        assert_eq!(back.data, vec![0., 1., 2., 3., 4., 6., 7., 8., 9., 10.]);
        // Unequal parts (shares): each part's own padding dropped.
        let back = cpu.rank_major_to_rows(&rm, &[1, 2, 0]).unwrap();
        assert_eq!(back.data, vec![0., 2., 3., 6., 8., 9.]);
        assert!(cpu.rank_major_to_rows(&rm, &[1; 5]).is_err());
        assert!(cpu.rank_major_to_rows(&rm, &[3, 0, 0]).is_err());
        let block = cpu.column_block(&x, 1, 3).unwrap();
        assert_eq!(block.data, vec![2., 3., 8., 9.]);
        let part = cpu.unfuse(&x, 3, 1, 2).unwrap();
        assert_eq!(part.data, vec![1., 2., 4., 5., 7., 8., 10., 11.]);
        assert!(cpu.unfuse(&x, 4, 1, 2).is_err());
    }

    #[test]
    fn split_columns_gives_each_block_and_keeps_the_products_memory_for_the_first() {
        let cpu = CpuBackend::new(1);
        for rows in [0usize, 1, 3] {
            let x = Tensor::new(vec![rows, 7], (0..rows * 7).map(|i| i as f32).collect());
            let want = |from: usize, w: usize| -> Vec<f32> {
                (0..rows)
                    .flat_map(|r| (from..from + w).map(move |c| (r * 7 + c) as f32))
                    .collect()
            };
            let memory = x.data.as_ptr();
            let parts = cpu.split_columns(x, &[4, 1, 2]).unwrap();
            let shapes: Vec<Vec<usize>> = parts.iter().map(|p| p.shape.clone()).collect();
            assert_eq!(shapes, vec![vec![rows, 4], vec![rows, 1], vec![rows, 2]]);
            assert_eq!(parts[0].data, want(0, 4), "rows={rows}");
            assert_eq!(parts[1].data, want(4, 1), "rows={rows}");
            assert_eq!(parts[2].data, want(5, 2), "rows={rows}");
            // The first block is the product's buffer, compacted in place: no copy.
            if rows > 0 {
                assert_eq!(parts[0].data.as_ptr(), memory);
            }
        }
        let x = Tensor::new(vec![2, 3], vec![0.0; 6]);
        assert!(cpu.split_columns(x.clone(), &[1, 1]).is_err());
        assert!(cpu.split_columns(x, &[]).is_err());
    }

    /// A 4×3 table whose element `i` is `i + 1/3` (not representable in bf16).
    struct Table;

    impl WeightSource for Table {
        fn check(&self, _: &crate::plan::Plan) -> crate::runtime::weights::WeightResult<()> {
            Ok(())
        }
        fn read(
            &self,
            _: &str,
            from: usize,
            count: usize,
            out: &mut Vec<f32>,
        ) -> crate::runtime::weights::WeightResult<()> {
            out.extend((from..from + count).map(|i| i as f32 + 1.0 / 3.0));
            Ok(())
        }
    }

    #[test]
    fn padding_inside_a_piece_is_neither_packed_nor_multiplied() {
        use crate::ir::SliceRange;
        // A fused [q | k]-like piece of a 64×8 weight: rows 0..16 and 32..48, each followed
        // by 8 zero rows (the parts dealt unevenly), 48 rows in all.
        let range = |offset, len| SliceRange {
            offset,
            len,
            pad: 8,
        };
        let slice = WeightSlice {
            tensor: "w".into(),
            shape: vec![64, 8],
            dtype: DType::F32,
            dim: Some(0),
            ranges: vec![range(0, 16), range(32, 16)],
            padding: 0,
            local_shape: vec![48, 8],
            quant: None,
        };
        let usage = WeightUse {
            linear: Some(WeightOrder::OutIn),
            other: false,
        };
        let cpu = CpuBackend::new(1);
        let w = cpu.upload(&Table, &slice, usage).unwrap();
        // Only the 32 real rows are packed (f32 panels of 16 columns: no rounding here).
        assert_eq!(cpu.weight_bytes(&w), 32 * 8 * 4);
        let x = Tensor::new(
            vec![2, 8],
            (0..16).map(|i| (i as f32 * 0.3).sin()).collect(),
        );
        let y = cpu.linear(&x, &w).unwrap();
        assert_eq!(y.shape, vec![2, 48]);
        let weight_row = |r: usize| (0..8).map(move |c| (r * 8 + c) as f32 + 1.0 / 3.0);
        for (i, row) in y.data.chunks(48).enumerate() {
            for (j, &v) in row.iter().enumerate() {
                let source = match j {
                    0..16 => Some(j),
                    24..40 => Some(32 + j - 24),
                    _ => None,
                };
                let want: f32 = source.map_or(0.0, |r| {
                    weight_row(r)
                        .zip(&x.data[i * 8..i * 8 + 8])
                        .map(|(a, b)| a * b)
                        .sum()
                });
                assert!(
                    (v - want).abs() <= 1e-4 * want.abs().max(1.0),
                    "{i},{j}: {v} vs {want}"
                );
            }
        }
    }

    #[test]
    fn a_vocab_split_table_looks_up_the_same_rows_in_f32_and_bf16() {
        use crate::ir::SliceRange;
        // Rows 1..3 of 4 plus one padding row, as a vocab-parallel rank holds them.
        let slice = WeightSlice {
            tensor: "embed".into(),
            shape: vec![4, 3],
            dtype: DType::F32,
            dim: Some(0),
            ranges: vec![SliceRange {
                offset: 1,
                len: 2,
                pad: 0,
            }],
            padding: 1,
            local_shape: vec![3, 3],
            quant: None,
        };
        let usage = WeightUse {
            linear: None,
            other: true,
        };
        let ids = [0, 1, 2, 3, 4, -1];
        let mut outs = Vec::new();
        for bf16 in [false, true] {
            let cpu = CpuBackend::new(1).with_bf16_linears(bf16);
            let w = cpu.upload(&Table, &slice, usage).unwrap();
            assert_eq!(cpu.weight_bytes(&w), if bf16 { 18 } else { 36 });
            outs.push(cpu.embedding(&ids, &w, 1).unwrap());
        }
        let want: Vec<f32> = [None, Some(1), Some(2), None, None, None]
            .iter()
            .flat_map(|row| {
                (0..3).map(move |c| row.map_or(0.0, |r| (r * 3 + c) as f32 + 1.0 / 3.0))
            })
            .collect();
        assert_eq!(outs[0].data, want);
        for (b, w) in outs[1].data.iter().zip(&want) {
            assert_eq!(*b, half::bf16::from_f32(*w).to_f32());
        }
    }

    #[test]
    fn vocab_parallel_argmax_matches_the_gathered_argmax() {
        let cpu = CpuBackend::new(1);
        // Two ranks of 3 columns over a vocabulary of 5: rank 1's last column is padding
        // (zero), which must not win over negative logits.
        let full = [
            [-3.0f32, -1.0, -2.0, -1.0, -5.0],
            [-4.0, -4.0, -4.0, -2.0, -9.0],
        ];
        let mut parts = Vec::new();
        for rank in 0..2 {
            let mut data = Vec::new();
            for row in &full {
                for c in 0..3 {
                    data.push(row.get(rank * 3 + c).copied().unwrap_or(0.0));
                }
            }
            let slice = Tensor::new(vec![2, 3], data);
            let valid = 5usize.saturating_sub(rank * 3).min(3);
            parts.push(cpu.argmax_pairs(&slice, valid, rank * 3).unwrap());
        }
        let gathered: Vec<f32> = parts.iter().flat_map(|p| p.data.clone()).collect();
        let best = cpu
            .best_of_pairs(&Tensor::new(vec![4, 2], gathered), 2)
            .unwrap();
        // Row 0: -1 at 1 and 3, the lower index wins (as HF's argmax); row 1: -2 at 3.
        assert_eq!(best.data, vec![-1.0, 1.0, -2.0, 3.0]);
        let whole = Tensor::new(vec![2, 5], full.concat());
        assert_eq!(cpu.argmax_rows(&whole).unwrap(), vec![1, 3]);
        // A NaN anywhere marks the row; a rank with no valid column never wins.
        let nan = Tensor::new(vec![1, 3], vec![0.0, f32::NAN, 1.0]);
        assert!(cpu.argmax_pairs(&nan, 3, 0).unwrap().data[0].is_nan());
        let empty = cpu
            .argmax_pairs(&Tensor::new(vec![1, 3], vec![9.0; 3]), 0, 6)
            .unwrap();
        assert_eq!(empty.data, vec![f32::NEG_INFINITY, -1.0]);
        let pairs = Tensor::new(vec![2, 2], vec![-7.0, 2.0, f32::NEG_INFINITY, -1.0]);
        assert_eq!(cpu.best_of_pairs(&pairs, 2).unwrap().data, vec![-7.0, 2.0]);
        assert!(cpu.argmax_pairs(&nan, 4, 0).is_err());
        assert!(cpu.best_of_pairs(&nan, 2).is_err());
    }

    /// Every rank's top-k pairs of its padded slice, gathered rank-major and merged.
    fn merged_top_k(cpu: &CpuBackend, full: &[Vec<f32>], tp: usize, k: usize) -> Tensor {
        let vocab = full[0].len();
        let n = vocab.div_ceil(tp);
        let mut gathered = Vec::new();
        let mut width = 0;
        for rank in 0..tp {
            let mut data = Vec::new();
            for row in full {
                // Padding columns are zeros, which must not beat negative logits.
                data.extend((0..n).map(|c| row.get(rank * n + c).copied().unwrap_or(0.0)));
            }
            let slice = Tensor::new(vec![full.len(), n], data);
            let valid = vocab.saturating_sub(rank * n).min(n);
            let pairs = cpu.top_k_pairs(&slice, k.min(n), valid, rank * n).unwrap();
            width = pairs.cols();
            gathered.extend_from_slice(&pairs.data);
        }
        let pairs = Tensor::new(vec![full.len() * tp, width], gathered);
        cpu.best_k_of_pairs(&pairs, tp, k.min(vocab)).unwrap()
    }

    #[test]
    #[cfg_attr(
        miri,
        ignore = "safe code, and too slow under Miri; top_k_pairs_mark_missing_entries_and_non_finite_rows covers the ops there"
    )]
    fn vocab_parallel_top_k_matches_the_whole_row_and_samples_the_same_tokens() {
        use crate::runtime::sampling::{pick, pick_from_candidates, Rng, Sampling};
        let cpu = CpuBackend::new(1);
        let vocab = 23;
        for seed in 0..60u64 {
            // Negative logits in half steps: many ties, within and across ranks; -0.0 too.
            let mut r = Rng::new(seed);
            let full: Vec<Vec<f32>> = (0..3)
                .map(|_| {
                    (0..vocab)
                        .map(|_| match (r.next_f64() * 10.0) as u32 {
                            0 => -0.0,
                            _ => -((r.next_f64() * 8.0).floor() as f32) * 0.5 - 0.5,
                        })
                        .collect()
                })
                .collect();
            for tp in [1, 2, 3, 4] {
                for k in [1, 2, 5, 7, 11, 23, 40] {
                    let best = merged_top_k(&cpu, &full, tp, k);
                    let kk = k.min(vocab);
                    assert_eq!(best.shape, vec![3, 2 * kk]);
                    for (row, got) in full.iter().zip(best.data.chunks(2 * kk)) {
                        let mut want: Vec<(f32, usize)> = row.iter().copied().zip(0..).collect();
                        want.sort_by(candidate_order);
                        want.truncate(kk);
                        let got: Vec<(f32, usize)> =
                            got.chunks(2).map(|e| (e[0], e[1] as usize)).collect();
                        let bits = |c: &[(f32, usize)]| -> Vec<(u32, usize)> {
                            c.iter().map(|&(v, i)| (v.to_bits(), i)).collect()
                        };
                        assert_eq!(bits(&got), bits(&want), "seed {seed} tp {tp} k {k}");
                        for (t, p) in [(0.7, None), (1.3, Some(0.8))] {
                            let s = Sampling {
                                temperature: t,
                                top_k: Some(k),
                                top_p: p,
                                seed,
                            };
                            let (mut a, mut b) = (Rng::new(seed), Rng::new(seed));
                            for _ in 0..3 {
                                assert_eq!(
                                    Some(pick(row, &s, &mut a)),
                                    pick_from_candidates(&got, &s, &mut b)
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn top_k_pairs_mark_missing_entries_and_non_finite_rows() {
        let cpu = CpuBackend::new(1);
        let x = Tensor::new(
            vec![2, 4],
            vec![1.0, 3.0, 3.0, 9.0, 0.5, f32::NAN, 2.0, 0.0],
        );
        // Three valid columns, k 4: the last entry is empty; ties keep the lower index.
        let p = cpu.top_k_pairs(&x, 4, 3, 10).unwrap();
        let ninf = f32::NEG_INFINITY;
        assert_eq!(&p.data[..8], &[3.0, 11.0, 3.0, 12.0, 1.0, 10.0, ninf, -1.0]);
        // A NaN among the valid columns marks the row; one in padding does not.
        assert!(p.data[8].is_nan());
        let p = cpu.top_k_pairs(&x, 1, 1, 0).unwrap();
        assert_eq!(p.data, vec![1.0, 0.0, 0.5, 0.0]);
        let inf = Tensor::new(vec![1, 2], vec![f32::INFINITY, 1.0]);
        assert!(cpu.top_k_pairs(&inf, 1, 2, 0).unwrap().data[0].is_nan());
        // No valid column: only empty entries, which never win a merge.
        let empty = cpu.top_k_pairs(&x, 2, 0, 4).unwrap();
        assert_eq!(empty.data, [ninf, -1.0].repeat(4));
        let other = cpu.top_k_pairs(&x, 2, 4, 0).unwrap();
        let both = Tensor::new(vec![4, 4], [empty.data.clone(), other.data].concat());
        let merged = cpu.best_k_of_pairs(&both, 2, 3).unwrap();
        assert_eq!(&merged.data[..6], &[9.0, 3.0, 3.0, 1.0, ninf, -1.0]);
        assert!(merged.data[6].is_nan());
        // Fewer real entries than k: the rest stay empty.
        let one = Tensor::new(vec![1, 4], vec![2.0, 5.0, ninf, -1.0]);
        let merged = cpu.best_k_of_pairs(&one, 1, 2).unwrap();
        assert_eq!(merged.data, vec![2.0, 5.0, ninf, -1.0]);
        // Equal values on two ranks: the lower index first, whatever the rank order.
        let tied = Tensor::new(vec![2, 2], vec![4.0, 7.0, 4.0, 2.0]);
        assert_eq!(
            cpu.best_k_of_pairs(&tied, 2, 2).unwrap().data,
            vec![4.0, 2.0, 4.0, 7.0]
        );
        // Shapes that ask for nothing or too much are errors, not allocations.
        assert!(cpu.top_k_pairs(&x, 0, 4, 0).is_err());
        assert!(cpu.top_k_pairs(&x, 5, 4, 0).is_err());
        assert!(cpu.top_k_pairs(&x, usize::MAX, 4, 0).is_err());
        assert!(cpu.top_k_pairs(&x, 2, 5, 0).is_err());
        assert!(cpu.best_k_of_pairs(&both, 2, 5).is_err());
        assert!(cpu.best_k_of_pairs(&both, 3, 1).is_err());
        assert!(cpu.best_k_of_pairs(&one, 1, 0).is_err());
        assert!(cpu
            .best_k_of_pairs(&Tensor::new(vec![1, 3], vec![1.0; 3]), 1, 1)
            .is_err());
    }

    #[test]
    fn argmax_rows_picks_the_first_largest_of_each_row() {
        let cpu = CpuBackend::new(1);
        let x = Tensor::new(
            vec![3, 3],
            vec![1., 5., 5., -1., -2., -3., 0., f32::NAN, 2.],
        );
        assert_eq!(cpu.argmax_rows(&x).unwrap(), vec![1, 0, 2]);
        assert!(cpu.argmax_rows(&Tensor::new(vec![1, 0], vec![])).is_err());
    }
}
