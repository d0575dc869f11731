//! The CUDA backend: one rank's program on a GPU. Activations are f32 on the device; linear
//! weights stay resident in bf16 (or f32) and go to cuBLAS with f32 accumulation, or as a
//! quantized checkpoint's codes (`backend/quantized.rs`); every other
//! op is one launch of a kernel from `kernels/`. The executor is the CPU's: this is only the
//! other side of the [`Backend`] seam.
//!
//! Not yet: CUDA graphs for decode.

use super::act::CudaAct;
use super::device::{blocks_of, grid_dim, grid_dim_y, grid_for, GpuRank};
use crate::ir::{ActivationKind, DType, RopeOp, WeightOrder};
use crate::plan::WeightSlice;
use crate::runtime::backend::{
    Activation, Backend, BackendError, BackendResult, BinaryOp, Segment, WeightUse,
};
use crate::runtime::exact::{DepthOrder, LIMBS};
use crate::runtime::sampling::{host_best_k_of_pairs, host_top_k_pairs};
use crate::runtime::shape_rules;
use crate::runtime::tensor::Tensor;
use crate::runtime::unpadded::Unpadded;
use crate::runtime::weights::{load_slice, load_slice_bf16, side_by_side, WeightSource};
use cudarc::cublas::sys as blas;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use std::ffi::c_void;
use std::sync::{Arc, OnceLock};

/// Pushes the arguments and launches kernel `$name` on the rank's stream.
macro_rules! launch {
    ($gpu:expr, $name:literal, $cfg:expr, $($arg:expr),+ $(,)?) => {{
        let f = $gpu.kernel($name)?;
        let mut b = $gpu.stream.launch_builder(f);
        $( b.arg($arg); )+
        // SAFETY: the arguments are pushed in the order and with the types of the kernel's
        // C signature in kernels/, and every size the kernel indexes with was checked
        // against the buffers' lengths by the caller.
        unsafe { b.launch($cfg) }
            .map(|_| ())
            .map_err(|e| $gpu.fail(concat!("kernel ", $name), None, e))
    }};
}

mod quantized;

pub struct CudaBackend {
    gpu: Arc<GpuRank>,
    bf16_linears: bool,
    /// `--numerics invariant`: attention in its one-pass kernel for every call shape.
    invariant: bool,
}

/// Rows and columns of an invariant product's tile (`INV_ROWS`, `INV_COLS` in invariant.cu).
const INVARIANT_ROWS: usize = 8;
const INVARIANT_COLS: usize = 32;
/// Threads of every attention kernel's block (`32 * ATTENTION_WARPS` in attention.cu).
const ATTENTION_THREADS: u32 = 128;
/// Query rows per block of `attention_tiled` (`TILE_ROWS` in attention.cu).
const TILE_ROWS: usize = 16;
/// The fewest positions a chunk of `attention_split` takes, and the most chunks.
const SPLIT_MIN_CHUNK: usize = 64;
const SPLIT_MAX_CHUNKS: usize = 64;

/// A segment's attention heads: query and kv head counts, head size, score scale.
#[derive(Clone, Copy)]
struct Heads {
    q: usize,
    kv: usize,
    dim: usize,
    scale: f32,
}

/// How one segment's attention runs on the GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum AttentionWay {
    /// One block per (row, head) over every position it sees.
    OnePass,
    /// A prompt: blocks of [`TILE_ROWS`] rows sharing keys and values in shared memory.
    Tiled,
    /// A few rows over a long cache: one block per (row, head, chunk of `chunk`
    /// positions), then a merge, so a decode step keeps the GPU busy.
    Split { chunk: usize, chunks: usize },
}

/// Names a way for every segment (`one-pass`, `tiled`, `split`: chunks of at least 4
/// positions; empty or unset: the usual choice), so the GPU checks can run the tiny
/// fixtures through each kernel (scripts/device_check.sh).
const FORCE_ATTENTION: &str = "TPC_CUDA_ATTENTION";

impl AttentionWay {
    /// The way for `new` rows whose last sees `positions` positions.
    fn of(new: usize, positions: usize) -> AttentionWay {
        if new >= TILE_ROWS {
            return AttentionWay::Tiled;
        }
        match AttentionWay::split(SPLIT_MIN_CHUNK, positions) {
            split @ AttentionWay::Split { chunks: 2.., .. } => split,
            _ => AttentionWay::OnePass,
        }
    }

    /// Chunks of at least `min_chunk` positions, at most [`SPLIT_MAX_CHUNKS`] of them.
    fn split(min_chunk: usize, positions: usize) -> AttentionWay {
        let chunk = min_chunk.max(positions.div_ceil(SPLIT_MAX_CHUNKS));
        AttentionWay::Split {
            chunk,
            chunks: positions.div_ceil(chunk),
        }
    }

    /// The way [`FORCE_ATTENTION`] names, if set, else [`AttentionWay::of`].
    fn chosen(new: usize, positions: usize) -> BackendResult<AttentionWay> {
        static FORCED: OnceLock<Option<String>> = OnceLock::new();
        let forced = FORCED.get_or_init(|| {
            std::env::var(FORCE_ATTENTION)
                .ok()
                .filter(|v| !v.is_empty())
        });
        match forced.as_deref() {
            None => Ok(AttentionWay::of(new, positions)),
            Some("one-pass") => Ok(AttentionWay::OnePass),
            Some("tiled") => Ok(AttentionWay::Tiled),
            Some("split") => Ok(AttentionWay::split(4, positions)),
            Some(other) => Err(BackendError::Unsupported(format!(
                "{FORCE_ATTENTION}={other}: the ways are one-pass, tiled and split (or leave it unset)"
            ))),
        }
    }
}

/// A weight on the device, in the layout the checkpoint slice has.
pub struct CudaWeight {
    shape: Vec<usize>,
    data: WeightData,
    /// How a linear op reads it.
    order: WeightOrder,
    /// The padding of an uneven split left out of `data`: a rank with a smaller share
    /// uploads and multiplies only its real columns (`None`: nothing left out).
    unpadded: Option<Unpadded>,
}

enum WeightData {
    F32(CudaSlice<f32>),
    /// bf16 as its bits.
    Bf16(CudaSlice<u16>),
    /// A linear weight's quantized codes and scales (`backend/quantized.rs`).
    Codes(quantized::DeviceCodes),
}

/// One product's part: `n` output columns from the weight's column `w_col` into column
/// `out_col` of output rows `ldc` wide, over x's first `k` inputs.
#[derive(Clone, Copy)]
struct GemmPart {
    k: usize,
    n: usize,
    w_col: usize,
    out_col: usize,
    ldc: usize,
}

impl CudaWeight {
    fn f32(&self, what: &str) -> BackendResult<&CudaSlice<f32>> {
        match &self.data {
            WeightData::F32(d) => Ok(d),
            WeightData::Bf16(_) | WeightData::Codes(_) => Err(BackendError::Unsupported(format!(
                "{what} of a bf16 or quantized weight; the CUDA backend keeps scales and biases in f32"
            ))),
        }
    }
    fn len(&self) -> usize {
        match &self.data {
            WeightData::F32(d) => d.len(),
            WeightData::Bf16(d) => d.len(),
            // The values it stands for.
            WeightData::Codes(_) => self.shape.iter().product(),
        }
    }
}

/// One attention op's pool of KV blocks on the device: block `b` holds the keys of
/// `block_size` token slots at rows `b · block_size ..` of `k` (rows of `k_width`), its
/// values likewise in `v`. Grown by reallocating and copying.
pub struct CudaKv {
    k_width: usize,
    v_width: usize,
    block_size: usize,
    blocks: usize,
    k: Option<CudaSlice<f32>>,
    v: Option<CudaSlice<f32>>,
}

/// Rotary cos/sin tables on the device, `[rows, half]` each.
pub struct CudaRope {
    half: usize,
    rows: usize,
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
}

/// The outputs of `x · Wᵀ` (W's rows in out-in order), checked against `x`'s depth.
fn linear_width(x: &CudaAct, w: &CudaWeight) -> BackendResult<usize> {
    let (m, k) = x.rows_cols();
    let (n, wk) = match (w.order, &w.shape[..]) {
        (WeightOrder::OutIn, [n, k]) => (*n, *k),
        (WeightOrder::InOut, [k, n]) => (*n, *k),
        _ => return Err(shape_err(format!("a linear weight of shape {:?}", w.shape))),
    };
    if wk != k || w.len() != n * k {
        return Err(shape_err(format!(
            "x [{m}, {k}] times a weight of shape {:?} ({:?})",
            w.shape, w.order
        )));
    }
    Ok(n)
}

fn shape_err(what: String) -> BackendError {
    BackendError::Shape(what)
}

fn i64_of(n: usize) -> i64 {
    // Device buffers are far below 2^63 elements: lengths were allocated.
    n as i64
}

fn elements(shape: &[usize]) -> BackendResult<usize> {
    shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| BackendError::OutOfMemory(format!("a tensor of shape {shape:?}")))
}

/// The launches of one part of a weighted rows sum, each with distinct targets (so no two
/// threads add into one value): `at` as i64, a row left out (-1) of every launch but the
/// one for its target's `k`-th occurrence, the `k`-th launch. Rows adding into one target
/// thus add in row order, as on the CPU. Almost always one launch: the rows an expert took
/// are distinct tokens. `seen` holds a zero per output row and is left so; every target
/// is below its length (`shape_rules::weighted_rows` checked them).
fn repeat_rounds(at: &[usize], seen: &mut [u32]) -> Vec<Vec<i64>> {
    let round: Vec<u32> = at
        .iter()
        .map(|&r| {
            let k = seen[r];
            seen[r] = k.saturating_add(1);
            k
        })
        .collect();
    for &r in at {
        seen[r] = 0;
    }
    let rounds = round.iter().copied().max().map_or(0, |k| k as usize + 1);
    (0..rounds)
        .map(|k| {
            at.iter()
                .zip(&round)
                .map(|(&r, &kr)| if kr as usize == k { i64_of(r) } else { -1 })
                .collect()
        })
        .collect()
}

impl CudaBackend {
    pub fn new(gpu: Arc<GpuRank>, bf16_linears: bool) -> CudaBackend {
        CudaBackend {
            gpu,
            bf16_linears,
            invariant: false,
        }
    }

    pub fn gpu(&self) -> &GpuRank {
        &self.gpu
    }

    /// A buffer whose every element the caller's kernel (or cuBLAS, with beta = 0) writes
    /// before anything reads it: no zero fill, one launch fewer per op on the decode path.
    fn output(&self, shape: Vec<usize>) -> BackendResult<CudaAct> {
        let n = elements(&shape)?;
        // SAFETY: device memory; the contents are written before they are read (above).
        let data = unsafe { self.gpu.stream.alloc::<f32>(n.max(1)) }
            .map_err(|e| self.gpu.fail("an activation", n.checked_mul(4), e))?;
        Ok(CudaAct::new(shape, data))
    }

    /// A zero-filled buffer (attention leaves rows outside its segments as zeros).
    fn zeros(&self, shape: Vec<usize>) -> BackendResult<CudaAct> {
        let n = elements(&shape)?;
        let data = self
            .gpu
            .stream
            .alloc_zeros::<f32>(n.max(1))
            .map_err(|e| self.gpu.fail("an activation", n.checked_mul(4), e))?;
        Ok(CudaAct::new(shape, data))
    }

    fn upload_f32(&self, values: &[f32], what: &str) -> BackendResult<CudaSlice<f32>> {
        self.gpu
            .stream
            .clone_htod(values)
            .map_err(|e| self.gpu.fail(what, Some(values.len() * 4), e))
    }

    fn upload_i64(&self, values: &[i64], what: &str) -> BackendResult<CudaSlice<i64>> {
        self.gpu
            .stream
            .clone_htod(values)
            .map_err(|e| self.gpu.fail(what, Some(values.len() * 8), e))
    }

    fn download(&self, x: &CudaSlice<f32>, len: usize) -> BackendResult<Vec<f32>> {
        let mut all = self
            .gpu
            .stream
            .clone_dtoh(x)
            .map_err(|e| self.gpu.fail("copying to the host", None, e))?;
        all.truncate(len);
        Ok(all)
    }

    /// `out [m, n] = x [m, k] · Wᵀ` through cuBLAS (column-major: `outᵀ = W · xᵀ`) into a
    /// new buffer: one part, the whole weight.
    fn gemm(
        &self,
        x: &CudaAct,
        w: &CudaWeight,
        m: usize,
        k: usize,
        n: usize,
    ) -> BackendResult<CudaAct> {
        let mut out_shape = x.shape().to_vec();
        if let Some(last) = out_shape.last_mut() {
            *last = n;
        }
        // A product over no depth is zeros, which cuBLAS need not write.
        let mut out = if k == 0 {
            self.zeros(out_shape)?
        } else {
            self.output(out_shape)?
        };
        let whole = GemmPart {
            k,
            n,
            w_col: 0,
            out_col: 0,
            ldc: n,
        };
        self.gemm_parts(x, w, m, &mut out, &[whole])?;
        Ok(out)
    }

    /// The parts of `x · W` that `parts` name, each into its columns of `out` (`[m, ldc]`);
    /// `out`'s other columns are left as they are.
    fn gemm_parts(
        &self,
        x: &CudaAct,
        w: &CudaWeight,
        m: usize,
        out: &mut CudaAct,
        parts: &[GemmPart],
    ) -> BackendResult<()> {
        let ldx = x.rows_cols().1;
        let i32_of = |d: usize| {
            i32::try_from(d).map_err(|_| {
                BackendError::Unsupported(format!(
                    "a product of [{m}, {ldx}] by a weight of shape {:?}: cuBLAS takes dimensions below 2^31",
                    w.shape
                ))
            })
        };
        let (w_rows, w_cols) = match w.shape[..] {
            [a, b] => (a, b),
            _ => return Err(shape_err(format!("a linear weight of shape {:?}", w.shape))),
        };
        // W stored [n, k] (out, in) is read transposed; [k, n] (in, out) as it is. A part's
        // first weight column is `w_col` rows (out-in) or elements (in-out) in.
        let (trans_w, ld_w, w_step) = match w.order {
            WeightOrder::OutIn => (blas::cublasOperation_t::CUBLAS_OP_T, w_cols, w_cols),
            WeightOrder::InOut => (blas::cublasOperation_t::CUBLAS_OP_N, w_cols, 1),
        };
        let (depth, width) = match w.order {
            WeightOrder::OutIn => (w_cols, w_rows),
            WeightOrder::InOut => (w_rows, w_cols),
        };
        let (mi, ldxi, ld_wi) = (i32_of(m)?, i32_of(ldx)?, i32_of(ld_w)?);
        for p in parts {
            let fits = w.len() == w_rows.saturating_mul(w_cols)
                && p.k <= depth.min(ldx)
                && p.w_col.checked_add(p.n).is_some_and(|e| e <= width)
                && p.out_col.checked_add(p.n).is_some_and(|e| e <= p.ldc)
                && out.data().len() >= m.saturating_mul(p.ldc);
            if !fits {
                return Err(shape_err(format!(
                    "a product part of {} columns from weight column {} into column {} of {} over depth {} (x [{m}, {ldx}], weight {:?})",
                    p.n, p.w_col, p.out_col, p.ldc, p.k, w.shape
                )));
            }
        }
        if m == 0 || parts.iter().all(|p| p.n == 0 || p.k == 0) {
            return Ok(());
        }
        let (alpha, beta) = (1.0f32, 0.0f32);
        let stream = self.gpu.stream.clone();
        self.gpu
            .ctx
            .bind_to_thread()
            .map_err(|e| self.gpu.fail("binding the context", None, e))?;
        // bf16 weights multiply bf16 activations (rounded once, as torch's bf16 does; the
        // rounded copy is kept with the activation for the next product that reads it).
        let rounded: Option<&CudaSlice<u16>> = match &w.data {
            WeightData::F32(_) | WeightData::Codes(_) => None,
            WeightData::Bf16(_) => Some(x.rounded(|data| -> BackendResult<CudaSlice<u16>> {
                let len = m * ldx;
                // SAFETY: device memory, written whole by round_to_bf16 below.
                let mut r = unsafe { stream.alloc::<u16>(len.max(1)) }
                    .map_err(|e| self.gpu.fail("bf16 activations", Some(len * 2), e))?;
                let n64 = i64_of(len);
                launch!(self.gpu, "round_to_bf16", grid_for(len), &mut r, data, &n64)?;
                Ok(r)
            })?),
        };
        // The operands' addresses, element type and the weight's element size; the guards
        // keep cudarc's stream ordering until the calls are enqueued.
        let ((wp, _w), (xp, _x), operands, w_size) =
            match (&w.data, rounded) {
                (WeightData::F32(wd), _) => (
                    wd.device_ptr(&stream),
                    x.data().device_ptr(&stream),
                    blas::cudaDataType::CUDA_R_32F,
                    4u64,
                ),
                (WeightData::Bf16(wd), Some(r)) => (
                    wd.device_ptr(&stream),
                    r.device_ptr(&stream),
                    blas::cudaDataType::CUDA_R_16BF,
                    2u64,
                ),
                (WeightData::Bf16(_), None) => {
                    return Err(BackendError::Device(
                        "bf16 weights without rounded activations (a bug in tpc)".into(),
                    ))
                }
                (WeightData::Codes(_), _) => return Err(BackendError::Device(
                    "a cuBLAS product of quantized codes (a bug in tpc: they are widened first)"
                        .into(),
                )),
            };
        let (out_ptr, _o) = out.data_mut().device_ptr_mut(&stream);
        for p in parts.iter().filter(|p| p.n > 0 && p.k > 0) {
            let (ni, ki, ldci) = (i32_of(p.n)?, i32_of(p.k)?, i32_of(p.ldc)?);
            let w_at = wp + (p.w_col * w_step) as u64 * w_size;
            let out_at = out_ptr + p.out_col as u64 * 4;
            // SAFETY: the part's weight columns, x's first k inputs of each of its m rows
            // (ldx apart) and the part's output columns of out's m rows (ldc apart) lie in
            // their buffers (checked above); the handle runs on this rank's stream.
            let status = unsafe {
                cudarc::cublas::result::gemm_ex(
                    *self.gpu.blas.handle(),
                    trans_w,
                    blas::cublasOperation_t::CUBLAS_OP_N,
                    ni,
                    mi,
                    ki,
                    &alpha as *const f32 as *const c_void,
                    w_at as *const c_void,
                    operands,
                    ld_wi,
                    xp as *const c_void,
                    operands,
                    ldxi,
                    &beta as *const f32 as *const c_void,
                    out_at as *mut c_void,
                    blas::cudaDataType::CUDA_R_32F,
                    ldci,
                    blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            };
            status.map_err(|e| {
                BackendError::Device(format!(
                    "rank {} on GPU {}: cuBLAS GEMM [{m}, {}] x [{}, {}]: {e:?}",
                    self.gpu.rank, self.gpu.ordinal, p.k, p.k, p.n
                ))
            })?;
        }
        drop((_o, _w, _x));
        Ok(())
    }

    /// A padded linear without its padding: each real column run of `u` from the trimmed
    /// weight over x's real inputs, into a zeroed output of the padded width.
    fn linear_unpadded(&self, x: &CudaAct, w: &CudaWeight, u: &Unpadded) -> BackendResult<CudaAct> {
        let (m, k) = x.rows_cols();
        let &[(real_k, _)] = &u.depth_runs[..] else {
            return Err(BackendError::Device(
                "a weight trimmed with inputs padded inside (a bug in tpc: it is not trimmed on GPUs)"
                    .into(),
            ));
        };
        if k != u.depth {
            return Err(shape_err(format!(
                "{k} input features against a weight of {} inputs",
                u.depth
            )));
        }
        let width = u
            .columns
            .iter()
            .try_fold(0usize, |a, &(n, pad)| a.checked_add(n)?.checked_add(pad))
            .ok_or_else(|| shape_err("a weight wider than memory".into()))?;
        let mut shape = x.shape().to_vec();
        if let Some(last) = shape.last_mut() {
            *last = width;
        }
        // cuBLAS writes every real column; padded ones (or all, over no real input) stay
        // zeros.
        let mut out = if real_k == 0 || u.columns.iter().any(|&(_, pad)| pad > 0) {
            self.zeros(shape)?
        } else {
            self.output(shape)?
        };
        let (mut w_col, mut out_col) = (0, 0);
        let mut parts = Vec::with_capacity(u.columns.len());
        for &(n, pad) in &u.columns {
            parts.push(GemmPart {
                k: real_k,
                n,
                w_col,
                out_col,
                ldc: width,
            });
            w_col += n;
            out_col += n + pad;
        }
        self.gemm_parts(x, w, m, &mut out, &parts)?;
        Ok(out)
    }

    /// Runs `argmax_pairs` over `x`: `[rows, 2]` (value, index) on the device.
    /// One segment's attention over its cache (its keys and values already appended): the
    /// way [`AttentionWay::of`] picks, each a kernel of `kernels/attention.cu`.
    #[allow(clippy::too_many_arguments)]
    fn attend_segment(
        &self,
        out: &mut CudaAct,
        q: &CudaAct,
        (kc, vc): (&CudaSlice<f32>, &CudaSlice<f32>),
        (table, block_size): (&CudaSlice<i64>, usize),
        row0: usize,
        new: usize,
        start: usize,
        h: Heads,
    ) -> BackendResult<()> {
        let (row0, start64, bs) = (i64_of(row0), i64_of(start), i64_of(block_size));
        let (qh, kh, hd) = (i64_of(h.q), i64_of(h.kv), i64_of(h.dim));
        let heads_y = grid_dim_y(h.q)?;
        // Every attention kernel: blocks of ATTENTION_THREADS over (x, heads, z).
        let grid = |x: u32, z: u32| LaunchConfig {
            grid_dim: (x, heads_y, z),
            block_dim: (ATTENTION_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let rows = grid_dim(new)?;
        // The one-pass kernel adds every (row, head)'s positions in one order whatever the
        // call's rows: the invariant mode's way for prompts, chunks and decode steps alike.
        let way = if self.invariant {
            AttentionWay::OnePass
        } else {
            AttentionWay::chosen(new, start + new)?
        };
        match way {
            AttentionWay::OnePass => {
                let cfg = grid(rows, 1);
                launch!(
                    self.gpu,
                    "attention",
                    cfg,
                    out.data_mut(),
                    q.data(),
                    kc,
                    vc,
                    table,
                    &bs,
                    &row0,
                    &start64,
                    &qh,
                    &kh,
                    &hd,
                    &h.scale
                )
            }
            AttentionWay::Tiled => {
                let cfg = grid(grid_dim(new.div_ceil(TILE_ROWS))?, 1);
                let rows64 = i64_of(new);
                launch!(
                    self.gpu,
                    "attention_tiled",
                    cfg,
                    out.data_mut(),
                    q.data(),
                    kc,
                    vc,
                    table,
                    &bs,
                    &row0,
                    &rows64,
                    &start64,
                    &qh,
                    &kh,
                    &hd,
                    &h.scale
                )
            }
            AttentionWay::Split { chunk, chunks } => {
                // Partial softmax sums per (row, head, chunk), merged by a second kernel.
                let slots = new * h.q * chunks;
                let mut part_max = self.output(vec![slots])?;
                let mut part_sum = self.output(vec![slots])?;
                let mut part_values = self.output(vec![slots, h.dim])?;
                let cfg = grid(rows, chunks as u32);
                let (chunk64, chunks64) = (i64_of(chunk), i64_of(chunks));
                launch!(
                    self.gpu,
                    "attention_split",
                    cfg,
                    part_max.data_mut(),
                    part_sum.data_mut(),
                    part_values.data_mut(),
                    q.data(),
                    kc,
                    vc,
                    table,
                    &bs,
                    &row0,
                    &start64,
                    &qh,
                    &kh,
                    &hd,
                    &h.scale,
                    &chunk64
                )?;
                let cfg = grid(rows, 1);
                launch!(
                    self.gpu,
                    "attention_merge",
                    cfg,
                    out.data_mut(),
                    part_max.data(),
                    part_sum.data(),
                    part_values.data(),
                    &row0,
                    &qh,
                    &hd,
                    &chunks64
                )
            }
        }
    }

    fn pairs(
        &self,
        x: &CudaAct,
        valid: usize,
        offset: usize,
        mark: bool,
    ) -> BackendResult<CudaAct> {
        let (rows, cols) = x.rows_cols();
        if valid > cols {
            return Err(shape_err(format!("{valid} valid columns of {cols}")));
        }
        let mut out = self.output(vec![rows, 2])?;
        if rows == 0 {
            return Ok(out);
        }
        let (c, v, o, m) = (i64_of(cols), i64_of(valid), i64_of(offset), i32::from(mark));
        launch!(
            self.gpu,
            "argmax_pairs",
            blocks_of(rows, 256)?,
            out.data_mut(),
            x.data(),
            &c,
            &v,
            &o,
            &m
        )?;
        Ok(out)
    }

    fn gather_rows(&self, x: &CudaAct, index: &[i64]) -> BackendResult<CudaAct> {
        let cols = x.rows_cols().1;
        let mut out = self.output(vec![index.len(), cols])?;
        if index.is_empty() || cols == 0 {
            return Ok(out);
        }
        let idx = self.upload_i64(index, "row indices")?;
        let (count, c) = (i64_of(index.len()), i64_of(cols));
        let n = index.len() * cols;
        launch!(
            self.gpu,
            "gather_rows",
            grid_for(n),
            out.data_mut(),
            x.data(),
            &idx,
            &count,
            &c
        )?;
        Ok(out)
    }
}

impl Backend for CudaBackend {
    type Act = CudaAct;
    type Weight = CudaWeight;
    type Kv = CudaKv;
    type RopeTables = CudaRope;

    fn upload(
        &self,
        src: &dyn WeightSource,
        slice: &WeightSlice,
        usage: WeightUse,
    ) -> BackendResult<CudaWeight> {
        let weights = BackendError::Weights;
        let two_d = slice.local_shape.len() == 2;
        if usage.linear.is_some() && !two_d {
            return Err(shape_err(format!(
                "a linear weight of shape {:?}; linear weights are 2-D",
                slice.local_shape
            )));
        }
        // A weight read only by linears leaves out the padding of an uneven split.
        if let (Some(order), false, true) = (usage.linear, usage.other, two_d) {
            return self.upload_linears(src, &[slice], order);
        }
        // Matrices (linear weights, embedding tables) in bf16 compute stay bf16; vectors
        // (norm scales, biases) are f32.
        let bf16 = self.bf16_linears && two_d;
        let (shape, data) = if bf16 {
            let (shape, values) = load_slice_bf16(src, slice).map_err(weights)?;
            let bits: Vec<u16> = values.iter().map(|v| v.to_bits()).collect();
            let d = self
                .gpu
                .stream
                .clone_htod(&bits)
                .map_err(|e| self.gpu.fail("a weight", Some(bits.len() * 2), e))?;
            (shape, WeightData::Bf16(d))
        } else {
            let t = load_slice(src, slice).map_err(weights)?;
            let d = self.upload_f32(&t.data, "a weight")?;
            (t.shape, WeightData::F32(d))
        };
        Ok(CudaWeight {
            shape,
            data,
            order: usage.linear.unwrap_or_default(),
            unpadded: None,
        })
    }

    fn upload_linears(
        &self,
        src: &dyn WeightSource,
        slices: &[&WeightSlice],
        order: WeightOrder,
    ) -> BackendResult<CudaWeight> {
        let weights = |e| BackendError::Weights(e);
        // Without the padding of an uneven split, unless the invariant sums keep its place;
        // inputs padded inside (no model has them) are multiplied as stored.
        let trimmed = (!self.invariant)
            .then(|| Unpadded::trim(slices, order))
            .flatten()
            .filter(|(_, u)| u.depth_runs.len() == 1);
        let (real, unpadded) = match trimmed {
            Some((real, u)) => (real, Some(u)),
            None => {
                if let Some(codes) = self.upload_codes(src, slices, order)? {
                    return Ok(codes);
                }
                (Vec::new(), None)
            }
        };
        let real_refs: Vec<&WeightSlice> = real.iter().collect();
        let slices = if unpadded.is_some() {
            &real_refs[..]
        } else {
            slices
        };
        let names: Vec<&str> = slices.iter().map(|w| &*w.tensor).collect();
        // Joined on the host, in the dtype the weight keeps, then one upload.
        let (shape, data) = if self.bf16_linears {
            let parts = slices
                .iter()
                .map(|w| load_slice_bf16(src, w))
                .collect::<Result<Vec<_>, _>>()
                .map_err(weights)?;
            let (shape, values) = side_by_side(parts, order, &names).map_err(weights)?;
            let bits: Vec<u16> = values.iter().map(|v| v.to_bits()).collect();
            let d = self
                .gpu
                .stream
                .clone_htod(&bits)
                .map_err(|e| self.gpu.fail("a fused weight", Some(bits.len() * 2), e))?;
            (shape, WeightData::Bf16(d))
        } else {
            let parts = slices
                .iter()
                .map(|w| load_slice(src, w).map(|t| (t.shape, t.data)))
                .collect::<Result<Vec<_>, _>>()
                .map_err(weights)?;
            let (shape, values) = side_by_side(parts, order, &names).map_err(weights)?;
            (
                shape,
                WeightData::F32(self.upload_f32(&values, "a fused weight")?),
            )
        };
        Ok(CudaWeight {
            shape,
            data,
            order,
            unpadded,
        })
    }

    fn weight_bytes(&self, w: &CudaWeight) -> usize {
        match &w.data {
            WeightData::F32(d) => d.len() * 4,
            WeightData::Bf16(d) => d.len() * 2,
            WeightData::Codes(c) => c.bytes(),
        }
    }

    fn embedding(&self, ids: &[i64], table: &CudaWeight, offset: usize) -> BackendResult<CudaAct> {
        let [rows, cols] = table.shape[..] else {
            return Err(shape_err(format!(
                "an embedding table of shape {:?}",
                table.shape
            )));
        };
        let mut out = self.output(vec![ids.len(), cols])?;
        if ids.is_empty() {
            return Ok(out);
        }
        let dev_ids = self.upload_i64(ids, "token ids")?;
        let (r, c, o) = (i64_of(rows), i64_of(cols), i64_of(offset));
        let cfg = blocks_of(ids.len(), 256)?;
        match &table.data {
            WeightData::F32(t) => launch!(
                self.gpu,
                "embedding_f32",
                cfg,
                out.data_mut(),
                t,
                &dev_ids,
                &r,
                &c,
                &o
            )?,
            WeightData::Bf16(t) => launch!(
                self.gpu,
                "embedding_bf16",
                cfg,
                out.data_mut(),
                t,
                &dev_ids,
                &r,
                &c,
                &o
            )?,
            WeightData::Codes(_) => {
                return Err(BackendError::Device(
                    "an embedding table kept as quantized codes (a bug in tpc: only linears are)"
                        .into(),
                ))
            }
        }
        Ok(out)
    }

    fn linear(&self, x: &CudaAct, w: &CudaWeight) -> BackendResult<CudaAct> {
        if let WeightData::Codes(c) = &w.data {
            return self.linear_codes(x, w, c);
        }
        if let Some(u) = &w.unpadded {
            return self.linear_unpadded(x, w, u);
        }
        let (m, k) = x.rows_cols();
        let n = linear_width(x, w)?;
        self.gemm(x, w, m, k, n)
    }

    fn linear_invariant(
        &self,
        x: &CudaAct,
        w: &CudaWeight,
        order: DepthOrder,
    ) -> BackendResult<CudaAct> {
        if w.unpadded.is_some() {
            return Err(BackendError::Device(
                "an invariant product of a weight trimmed of its padding (a bug in tpc: the invariant mode keeps the padding)".into(),
            ));
        }
        let (m, k) = x.rows_cols();
        let n = linear_width(x, w)?;
        let width = order.width();
        let mut shape = x.shape().to_vec();
        if let Some(last) = shape.last_mut() {
            *last = n.checked_mul(width).ok_or_else(|| {
                BackendError::OutOfMemory(format!("{n} outputs of {width} values"))
            })?;
        }
        let mut out = self.output(shape)?;
        if m == 0 || n == 0 {
            return Ok(out);
        }
        // invariant.cu's modes: 0 chained, 1 exact value, 2 exact limbs.
        let mode = match order {
            DepthOrder::Chained { .. } => 0i32,
            DepthOrder::Exact { limbs, .. } => 1 + i32::from(limbs),
        };
        let bound = order.bound();
        let cfg = LaunchConfig {
            grid_dim: (
                grid_dim(n.div_ceil(INVARIANT_COLS))?,
                grid_dim_y(m.div_ceil(INVARIANT_ROWS))?,
                1,
            ),
            block_dim: ((INVARIANT_ROWS * INVARIANT_COLS) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let out_in = i32::from(w.order == WeightOrder::OutIn);
        let (m64, k64, n64, block) = (i64_of(m), i64_of(k), i64_of(n), i64_of(order.block()));
        match &w.data {
            WeightData::F32(wd) => launch!(
                self.gpu,
                "linear_invariant_f32",
                cfg,
                out.data_mut(),
                x.data(),
                wd,
                &m64,
                &k64,
                &n64,
                &out_in,
                &block,
                &mode,
                &bound
            )?,
            WeightData::Bf16(wd) => launch!(
                self.gpu,
                "linear_invariant_bf16",
                cfg,
                out.data_mut(),
                x.data(),
                wd,
                &m64,
                &k64,
                &n64,
                &out_in,
                &block,
                &mode,
                &bound
            )?,
            WeightData::Codes(_) => {
                return Err(BackendError::Device(
                    "an invariant product of quantized codes (a bug in tpc: the invariant mode loads values)"
                        .into(),
                ))
            }
        }
        Ok(out)
    }

    fn set_invariant_numerics(&mut self) -> BackendResult<()> {
        self.invariant = true;
        Ok(())
    }

    fn decode_limbs(&self, x: &CudaAct) -> BackendResult<CudaAct> {
        let cols = x.rows_cols().1;
        if !cols.is_multiple_of(LIMBS) {
            return Err(shape_err(format!(
                "rows of {cols} values are not whole values of {LIMBS} limbs"
            )));
        }
        let mut shape = x.shape().to_vec();
        if let Some(last) = shape.last_mut() {
            *last = cols / LIMBS;
        }
        let n = x.elements() / LIMBS;
        let mut out = self.output(shape)?;
        if n > 0 {
            let n64 = i64_of(n);
            launch!(
                self.gpu,
                "decode_limbs",
                grid_for(n),
                out.data_mut(),
                x.data(),
                &n64
            )?;
        }
        Ok(out)
    }

    fn bias_add(&self, x: &mut CudaAct, bias: &CudaWeight) -> BackendResult<()> {
        let b = bias.f32("a bias")?;
        let cols = x.rows_cols().1;
        if b.len() != cols {
            return Err(shape_err(format!(
                "a bias of {} on rows of {cols}",
                b.len()
            )));
        }
        let n = x.elements();
        if n == 0 {
            return Ok(());
        }
        let (n64, c) = (i64_of(n), i64_of(cols));
        launch!(self.gpu, "bias_add", grid_for(n), x.data_mut(), b, &n64, &c)
    }

    fn binary(&self, x: &mut CudaAct, y: &CudaAct, op: BinaryOp) -> BackendResult<()> {
        if x.shape() != y.shape() {
            return Err(shape_err(format!(
                "{:?} and {:?} elementwise",
                x.shape(),
                y.shape()
            )));
        }
        let n = x.elements();
        if n == 0 {
            return Ok(());
        }
        let n64 = i64_of(n);
        match op {
            BinaryOp::Add => launch!(self.gpu, "add", grid_for(n), x.data_mut(), y.data(), &n64),
            BinaryOp::Mul => launch!(self.gpu, "mul", grid_for(n), x.data_mut(), y.data(), &n64),
        }
    }

    fn rms_norm(
        &self,
        x: &CudaAct,
        w: &CudaWeight,
        group: usize,
        eps: f32,
    ) -> BackendResult<CudaAct> {
        let scales = w.f32("RMSNorm")?;
        let group = shape_rules::rms_norm_group(x.rows_cols().1, group, scales.len())?;
        let mut out = self.output(x.shape().to_vec())?;
        let groups = x.elements() / group;
        if groups == 0 {
            return Ok(out);
        }
        let threads = (group.next_multiple_of(32)).clamp(32, 256) as u32;
        let g = i64_of(group);
        launch!(
            self.gpu,
            "rms_norm",
            blocks_of(groups, threads)?,
            out.data_mut(),
            x.data(),
            scales,
            &g,
            &eps
        )?;
        Ok(out)
    }

    fn layer_norm(
        &self,
        x: &CudaAct,
        w: &CudaWeight,
        b: &CudaWeight,
        eps: f32,
    ) -> BackendResult<CudaAct> {
        let (scales, shifts) = (w.f32("LayerNorm")?, b.f32("LayerNorm")?);
        let (rows, cols) = x.rows_cols();
        shape_rules::layer_norm(cols, scales.len(), shifts.len())?;
        let mut out = self.output(x.shape().to_vec())?;
        if rows == 0 || cols == 0 {
            return Ok(out);
        }
        let c = i64_of(cols);
        launch!(
            self.gpu,
            "layer_norm",
            blocks_of(rows, 256)?,
            out.data_mut(),
            x.data(),
            scales,
            shifts,
            &c,
            &eps
        )?;
        Ok(out)
    }

    fn activation(&self, x: &mut CudaAct, kind: ActivationKind) -> BackendResult<()> {
        let n = x.elements();
        if n == 0 {
            return Ok(());
        }
        let (cfg, n64) = (grid_for(n), i64_of(n));
        match kind {
            ActivationKind::Silu => launch!(self.gpu, "silu", cfg, x.data_mut(), &n64),
            ActivationKind::GeluTanh => launch!(self.gpu, "gelu_tanh", cfg, x.data_mut(), &n64),
            ActivationKind::Gelu => launch!(self.gpu, "gelu_erf", cfg, x.data_mut(), &n64),
            ActivationKind::Relu => launch!(self.gpu, "relu", cfg, x.data_mut(), &n64),
        }
    }

    fn rope_tables(&self, op: &RopeOp, positions: &[i64]) -> BackendResult<CudaRope> {
        let t = crate::runtime::rope::tables(op, positions);
        Ok(CudaRope {
            half: t.half,
            rows: positions.len(),
            cos: self.upload_f32(&t.cos, "rotary tables")?,
            sin: self.upload_f32(&t.sin, "rotary tables")?,
        })
    }

    fn rope(&self, x: &mut CudaAct, head_dim: usize, t: &CudaRope) -> BackendResult<()> {
        let (rows, cols) = x.rows_cols();
        let half = t.half;
        if head_dim == 0 || cols % head_dim != 0 || 2 * half > head_dim || t.rows < rows {
            return Err(shape_err(format!(
                "rotary embedding of {half} pairs per head of {head_dim} on {rows} rows of {cols}"
            )));
        }
        let heads = cols / head_dim;
        if rows == 0 || heads == 0 || half == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (grid_dim(rows)?, grid_dim_y(heads)?, 1),
            block_dim: (half.next_multiple_of(32).min(128) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (c, d, h) = (i64_of(cols), i64_of(head_dim), i64_of(half));
        launch!(
            self.gpu,
            "rope",
            cfg,
            x.data_mut(),
            &t.cos,
            &t.sin,
            &c,
            &d,
            &h
        )
    }

    fn new_kv(&self, k_width: usize, v_width: usize, block_size: usize) -> CudaKv {
        CudaKv {
            k_width,
            v_width,
            block_size: block_size.max(1),
            blocks: 0,
            k: None,
            v: None,
        }
    }

    fn grow_kv(&self, kv: &mut CudaKv, blocks: usize) -> BackendResult<()> {
        if blocks <= kv.blocks {
            return Ok(());
        }
        let (old_blocks, bs) = (kv.blocks, kv.block_size);
        let alloc = |width: usize, old: &Option<CudaSlice<f32>>| -> BackendResult<CudaSlice<f32>> {
            let n = blocks
                .checked_mul(bs)
                .and_then(|rows| rows.checked_mul(width))
                .filter(|n| n.checked_mul(4).is_some_and(|b| b <= isize::MAX as usize))
                .ok_or_else(|| {
                    BackendError::OutOfMemory(format!(
                        "a KV pool of {blocks} blocks of {bs} tokens of {width} values"
                    ))
                })?;
            let mut fresh = self
                .gpu
                .stream
                .alloc_zeros::<f32>(n.max(1))
                .map_err(|e| self.gpu.fail("the KV cache", n.checked_mul(4), e))?;
            if let Some(old) = old {
                let used = old_blocks * bs * width;
                if used > 0 {
                    self.gpu
                        .stream
                        .memcpy_dtod(&old.slice(..used), &mut fresh.slice_mut(..used))
                        .map_err(|e| self.gpu.fail("growing the KV cache", None, e))?;
                }
            }
            Ok(fresh)
        };
        let k = alloc(kv.k_width, &kv.k)?;
        let v = alloc(kv.v_width, &kv.v)?;
        kv.k = Some(k);
        kv.v = Some(v);
        kv.blocks = blocks;
        Ok(())
    }

    fn attention(
        &self,
        [q, k, v]: [&CudaAct; 3],
        kv: &mut CudaKv,
        segments: &[Segment<'_>],
        d: usize,
        scale: f32,
    ) -> BackendResult<CudaAct> {
        let (rows, qcols) = q.rows_cols();
        let (kcols, vcols) = (k.rows_cols().1, v.rows_cols().1);
        let (q_heads, kv_heads) =
            shape_rules::attention_heads((rows, qcols), k.rows_cols(), v.rows_cols(), d)?;
        if d > 256 {
            return Err(BackendError::Unsupported(format!(
                "attention heads of {d}; the GPU kernel takes at most 256"
            )));
        }
        if kv.k_width != kcols || kv.v_width != vcols {
            return Err(shape_err(format!(
                "keys of {kcols} and values of {vcols} columns into a KV pool of {} and {}",
                kv.k_width, kv.v_width
            )));
        }
        if segments.is_empty() {
            return Err(shape_err("attention over no segments".into()));
        }
        // Every segment checked and its table uploaded, then every segment's keys and
        // values written, then each attends: a sequence may read blocks another one of the
        // call wrote.
        let bs = kv.block_size;
        let mut tables = Vec::with_capacity(segments.len());
        for s in segments {
            let end = shape_rules::paged_segment(s, rows, bs, kv.blocks)?;
            // The kernels find a position's block with a 32-bit division.
            if end > i32::MAX as usize || bs > i32::MAX as usize {
                return Err(BackendError::Unsupported(format!(
                    "{end} positions in blocks of {bs} tokens; the GPU kernels take fewer \
                     than 2^31"
                )));
            }
            let table: Vec<i64> = s.blocks[..end.div_ceil(bs)]
                .iter()
                .map(|&b| i64::from(b))
                .collect();
            tables.push(self.upload_i64(&table, "a KV block table")?);
        }
        let (kc, vc) = match (&mut kv.k, &mut kv.v) {
            (Some(kc), Some(vc)) => (kc, vc),
            _ => return Err(shape_err("a KV pool of no blocks".into())),
        };
        let bs64 = i64_of(bs);
        for (s, table) in segments.iter().zip(&tables) {
            let (row0, start, new) = (i64_of(s.rows.start), i64_of(s.start), i64_of(s.rows.len()));
            for (cache, src, cols) in [(&mut *kc, k, kcols), (&mut *vc, v, vcols)] {
                let cols64 = i64_of(cols);
                launch!(
                    self.gpu,
                    "kv_write",
                    grid_for(s.rows.len() * cols),
                    cache,
                    src.data(),
                    table,
                    &bs64,
                    &row0,
                    &start,
                    &new,
                    &cols64
                )?;
            }
        }
        let mut out = self.zeros(q.shape().to_vec())?;
        let heads = Heads {
            q: q_heads,
            kv: kv_heads,
            dim: d,
            scale,
        };
        for (s, table) in segments.iter().zip(&tables) {
            self.attend_segment(
                &mut out,
                q,
                (&*kc, &*vc),
                (table, bs),
                s.rows.start,
                s.rows.len(),
                s.start,
                heads,
            )?;
        }
        Ok(out)
    }

    fn unfuse(
        &self,
        x: &CudaAct,
        block: usize,
        offset: usize,
        len: usize,
    ) -> BackendResult<CudaAct> {
        let (rows, n) = x.rows_cols();
        let out_cols = shape_rules::unfuse(n, block, offset, len)?;
        let mut shape = x.shape().to_vec();
        if let Some(last) = shape.last_mut() {
            *last = out_cols;
        }
        let mut out = self.output(shape)?;
        let total = rows * out_cols;
        if total == 0 {
            return Ok(out);
        }
        let (r, c, b, o, l) = (
            i64_of(rows),
            i64_of(n),
            i64_of(block),
            i64_of(offset),
            i64_of(len),
        );
        launch!(
            self.gpu,
            "block_columns",
            grid_for(total),
            out.data_mut(),
            x.data(),
            &r,
            &c,
            &b,
            &o,
            &l
        )?;
        Ok(out)
    }

    fn split_columns(&self, x: CudaAct, widths: &[usize]) -> BackendResult<Vec<CudaAct>> {
        let (rows, n) = x.rows_cols();
        shape_rules::split_columns(n, widths)?;
        let shape_with = |w: usize| {
            let mut shape = x.shape().to_vec();
            if let Some(last) = shape.last_mut() {
                *last = w;
            }
            shape
        };
        // One row (a decode step): the first block is the front of the product already and
        // keeps its memory; the others are copied out, three per launch.
        let keep_first = rows == 1;
        let first_shape = shape_with(widths[0]);
        let copied = usize::from(keep_first);
        let mut outs = Vec::with_capacity(widths.len());
        for &w in &widths[copied..] {
            outs.push(self.output(shape_with(w))?);
        }
        let mut from: usize = widths[..copied].iter().sum();
        for (blocks, widths) in outs.chunks_mut(3).zip(widths[copied..].chunks(3)) {
            let at = |k: usize| from + widths.iter().take(k).sum::<usize>();
            let to = at(3);
            if rows * (to - from) > 0 {
                let (r, c) = (i64_of(rows), i64_of(n));
                let bounds = [from, at(1), at(2), to].map(i64_of);
                let [a, rest @ ..] = blocks else { continue };
                // Outputs past the blocks get no columns: the input stands in for them.
                let (b, c_out) = match rest {
                    [b, c_out] => (Some(b), Some(c_out)),
                    [b] => (Some(b), None),
                    _ => (None, None),
                };
                let f = self.gpu.kernel("split_columns")?;
                let mut launch = self.gpu.stream.launch_builder(f);
                launch.arg(a.data_mut());
                match b {
                    Some(b) => launch.arg(b.data_mut()),
                    None => launch.arg(x.data()),
                };
                match c_out {
                    Some(c_out) => launch.arg(c_out.data_mut()),
                    None => launch.arg(x.data()),
                };
                launch.arg(x.data());
                launch.arg(&r);
                launch.arg(&c);
                for bound in &bounds {
                    launch.arg(bound);
                }
                // SAFETY: the arguments follow split_columns' C signature in select.cu; each
                // output holds rows × its block's width, and x rows × n with to ≤ n.
                unsafe { launch.launch(grid_for(rows * (to - from))) }
                    .map_err(|e| self.gpu.fail("kernel split_columns", None, e))?;
            }
            from = to;
        }
        if keep_first {
            let first = CudaAct::new(first_shape, x.into_data());
            outs.insert(0, first);
        }
        Ok(outs)
    }

    fn column_block(&self, x: &CudaAct, k: usize, parts: usize) -> BackendResult<CudaAct> {
        let n = x.rows_cols().1;
        let width = shape_rules::column_block(n, k, parts)?;
        self.unfuse(x, n, k * width, width)
    }

    fn column_window(
        &self,
        x: &CudaAct,
        offset: usize,
        len: usize,
        width: usize,
    ) -> BackendResult<CudaAct> {
        let (rows, n) = x.rows_cols();
        shape_rules::column_window(n, offset, len, width)?;
        let mut shape = x.shape().to_vec();
        if let Some(last) = shape.last_mut() {
            *last = width;
        }
        let mut out = self.zeros(shape)?;
        if rows * len == 0 {
            return Ok(out);
        }
        // x from column `offset` on, read as one rank-major part of rows of n: its first
        // `len` columns of each row into columns 0..len of out.
        let from = x.data().slice(offset..);
        let (r, c, part, l, col, keep) = (
            i64_of(rows),
            i64_of(n),
            0i64,
            i64_of(len),
            0i64,
            i64_of(width),
        );
        launch!(
            self.gpu,
            "rank_major_part_to_rows",
            grid_for(rows * len),
            out.data_mut(),
            &from,
            &r,
            &c,
            &part,
            &l,
            &col,
            &keep
        )?;
        Ok(out)
    }

    fn rows_to_rank_major(&self, x: &CudaAct, parts: usize) -> BackendResult<CudaAct> {
        let (rows, n) = x.rows_cols();
        let width = shape_rules::to_rank_major(n, parts)?;
        let mut out = self.output(vec![rows * parts, width])?;
        if rows * n == 0 {
            return Ok(out);
        }
        let (r, p, w) = (i64_of(rows), i64_of(parts), i64_of(n / parts));
        launch!(
            self.gpu,
            "rows_to_rank_major",
            grid_for(rows * n),
            out.data_mut(),
            x.data(),
            &r,
            &p,
            &w
        )?;
        Ok(out)
    }

    fn rank_major_to_rows(&self, x: &CudaAct, widths: &[usize]) -> BackendResult<CudaAct> {
        let (all_rows, n) = x.rows_cols();
        let (rows, keep) = shape_rules::from_rank_major(all_rows, n, widths)?;
        let mut out = self.output(vec![rows, keep])?;
        if rows * keep == 0 {
            return Ok(out);
        }
        let (r, w, kp) = (i64_of(rows), i64_of(n), i64_of(keep));
        if shape_rules::is_prefix(widths, n) {
            launch!(
                self.gpu,
                "rank_major_to_rows",
                grid_for(rows * keep),
                out.data_mut(),
                x.data(),
                &r,
                &w,
                &kp
            )?;
            return Ok(out);
        }
        // Unequal parts (shares): one copy of each part's real columns to its place.
        let mut column = 0usize;
        for (part, &width) in widths.iter().enumerate() {
            if rows * width > 0 {
                let (k, wd, c) = (i64_of(part), i64_of(width), i64_of(column));
                launch!(
                    self.gpu,
                    "rank_major_part_to_rows",
                    grid_for(rows * width),
                    out.data_mut(),
                    x.data(),
                    &r,
                    &w,
                    &k,
                    &wd,
                    &c,
                    &kp
                )?;
            }
            column += width;
        }
        Ok(out)
    }

    fn argmax_rows(&self, x: &CudaAct) -> BackendResult<Vec<usize>> {
        let (rows, cols) = x.rows_cols();
        if cols == 0 {
            return Err(shape_err("argmax of rows with no columns".into()));
        }
        let pairs = self.pairs(x, cols, 0, false)?;
        let host = self.download(pairs.data(), rows * 2)?;
        // A row with nothing larger than its first value (all NaN) gives its first column.
        Ok(host
            .chunks_exact(2)
            .map(|p| if p[1] >= 0.0 { p[1] as usize } else { 0 })
            .collect())
    }

    fn argmax_pairs(&self, x: &CudaAct, valid: usize, offset: usize) -> BackendResult<CudaAct> {
        self.pairs(x, valid, offset, true)
    }

    fn best_of_pairs(&self, pairs: &CudaAct, parts: usize) -> BackendResult<CudaAct> {
        let (all, cols) = pairs.rows_cols();
        let rows = shape_rules::pairs(all, cols, parts)?;
        let mut out = self.output(vec![rows, 2])?;
        if rows == 0 {
            return Ok(out);
        }
        let (r, p) = (i64_of(rows), i64_of(parts));
        launch!(
            self.gpu,
            "best_of_pairs",
            grid_for(rows),
            out.data_mut(),
            pairs.data(),
            &r,
            &p
        )?;
        Ok(out)
    }

    fn top_k_pairs(
        &self,
        x: &CudaAct,
        k: usize,
        valid: usize,
        offset: usize,
    ) -> BackendResult<CudaAct> {
        // Sampling with top-k: rare next to greedy decoding, and small; on the host.
        let host = self.to_host_copy(x)?;
        let pairs = host_top_k_pairs(&host, k, valid, offset).map_err(BackendError::Shape)?;
        self.upload_host(&pairs)
    }

    fn best_k_of_pairs(&self, pairs: &CudaAct, parts: usize, k: usize) -> BackendResult<CudaAct> {
        let host = self.to_host_copy(pairs)?;
        let best = host_best_k_of_pairs(&host, parts, k).map_err(BackendError::Shape)?;
        self.upload_host(&best)
    }

    fn first_non_finite_row(&self, x: &CudaAct) -> BackendResult<Option<usize>> {
        let (rows, cols) = x.rows_cols();
        if rows * cols == 0 {
            return Ok(None);
        }
        let mut first = self
            .gpu
            .stream
            .clone_htod(&[u64::MAX])
            .map_err(|e| self.gpu.fail("a flag", Some(8), e))?;
        let (r, c) = (i64_of(rows), i64_of(cols));
        launch!(
            self.gpu,
            "first_non_finite_row",
            grid_for(rows * cols),
            &mut first,
            x.data(),
            &r,
            &c
        )?;
        let host = self
            .gpu
            .stream
            .clone_dtoh(&first)
            .map_err(|e| self.gpu.fail("reading a flag", None, e))?;
        Ok(host
            .first()
            .filter(|&&row| row != u64::MAX)
            .map(|&row| row as usize))
    }

    fn select_rows(&self, x: &CudaAct, rows: &[usize]) -> BackendResult<CudaAct> {
        let all = x.rows_cols().0;
        if let Some(&r) = rows.iter().find(|&&r| r >= all) {
            return Err(shape_err(format!("row {r} of {all}")));
        }
        let index: Vec<i64> = rows.iter().map(|&r| i64_of(r)).collect();
        self.gather_rows(x, &index)
    }

    fn weighted_rows_sum(
        &self,
        rows: usize,
        width: usize,
        parts: &[(&CudaAct, &[usize], &[f32])],
    ) -> BackendResult<CudaAct> {
        shape_rules::weighted_rows(
            rows,
            width,
            parts.iter().map(|(y, at, w)| (y.rows_cols(), *at, *w)),
        )?;
        let mut out = self.zeros(vec![rows, width])?;
        if width == 0 {
            return Ok(out);
        }
        // One count per output row, reused by every part (repeat_rounds leaves it zeroed).
        let mut seen = vec![0u32; rows];
        let w64 = i64_of(width);
        // In the order given, each launch after the previous one on the stream: the CPU's
        // order of additions into every output row.
        for (y, at, weights) in parts {
            if at.is_empty() {
                continue;
            }
            let w = self.upload_f32(weights, "an expert's routing weights")?;
            let count = i64_of(at.len());
            let n = at
                .len()
                .checked_mul(width)
                .ok_or_else(|| BackendError::OutOfMemory(format!("[{}, {width}]", at.len())))?;
            for targets in repeat_rounds(at, &mut seen) {
                let idx = self.upload_i64(&targets, "an expert's target rows")?;
                launch!(
                    self.gpu,
                    "weighted_rows_add",
                    grid_for(n),
                    out.data_mut(),
                    y.data(),
                    &idx,
                    &w,
                    &count,
                    &w64
                )?;
            }
        }
        Ok(out)
    }

    fn row_window(&self, x: &CudaAct, from: usize, count: usize) -> BackendResult<CudaAct> {
        let all = x.rows_cols().0;
        let index: Vec<i64> = (0..count)
            .map(|i| match from.checked_add(i) {
                Some(r) if r < all => i64_of(r),
                _ => -1,
            })
            .collect();
        self.gather_rows(x, &index)
    }

    fn alloc(&self, shape: &[usize], dtype: DType) -> BackendResult<CudaAct> {
        if dtype != DType::F32 {
            return Err(BackendError::Unsupported(format!(
                "{dtype:?} activations; the CUDA backend computes activations in f32"
            )));
        }
        self.output(shape.to_vec())
    }

    fn copy(&self, x: &CudaAct) -> BackendResult<CudaAct> {
        let data = self
            .gpu
            .stream
            .clone_dtod(x.data())
            .map_err(|e| self.gpu.fail("a copy", Some(x.data().len() * 4), e))?;
        Ok(CudaAct::new(x.shape().to_vec(), data))
    }

    fn release(&self, x: CudaAct) {
        drop(x);
    }

    fn to_host(&self, x: CudaAct) -> BackendResult<Tensor> {
        self.to_host_copy(&x)
    }

    fn upload_host(&self, x: &Tensor) -> BackendResult<CudaAct> {
        let data = if x.data.is_empty() {
            self.gpu
                .stream
                .alloc_zeros::<f32>(1)
                .map_err(|e| self.gpu.fail("an activation", Some(4), e))?
        } else {
            self.upload_f32(&x.data, "an activation")?
        };
        Ok(CudaAct::new(x.shape().to_vec(), data))
    }
}

impl CudaBackend {
    fn to_host_copy(&self, x: &CudaAct) -> BackendResult<Tensor> {
        let n = x.elements();
        Ok(Tensor::new(x.shape().to_vec(), self.download(x.data(), n)?))
    }
}

#[cfg(test)]
mod tests {
    use super::{repeat_rounds, AttentionWay};

    #[test]
    fn prompts_tile_decode_steps_split_long_caches_and_short_ones_run_in_one_pass() {
        assert_eq!(AttentionWay::of(16, 16), AttentionWay::Tiled);
        assert_eq!(AttentionWay::of(512, 600), AttentionWay::Tiled);
        assert_eq!(AttentionWay::of(1, 64), AttentionWay::OnePass);
        assert_eq!(AttentionWay::of(15, 40), AttentionWay::OnePass);
        assert_eq!(AttentionWay::of(1, 1), AttentionWay::OnePass);
        assert_eq!(
            AttentionWay::of(1, 65),
            AttentionWay::Split {
                chunk: 64,
                chunks: 2
            }
        );
        assert_eq!(
            AttentionWay::of(1, 512),
            AttentionWay::Split {
                chunk: 64,
                chunks: 8
            }
        );
        // Long contexts keep at most 64 chunks, each longer.
        assert_eq!(
            AttentionWay::of(4, 32768),
            AttentionWay::Split {
                chunk: 512,
                chunks: 64
            }
        );
        assert_eq!(
            AttentionWay::of(1, 4097),
            AttentionWay::Split {
                chunk: 65,
                chunks: 64
            }
        );
    }

    #[test]
    fn a_parts_repeated_targets_go_to_later_launches_in_row_order() {
        let mut seen = vec![0u32; 6];
        // Distinct targets (an expert's tokens): one launch, `at` as it is.
        assert_eq!(repeat_rounds(&[4, 0, 2], &mut seen), vec![vec![4, 0, 2]]);
        // Row 1 repeated twice, row 3 once: each occurrence in the next launch.
        assert_eq!(
            repeat_rounds(&[1, 3, 1, 5, 3, 1], &mut seen),
            vec![
                vec![1, 3, -1, 5, -1, -1],
                vec![-1, -1, 1, -1, 3, -1],
                vec![-1, -1, -1, -1, -1, 1],
            ]
        );
        assert!(repeat_rounds(&[], &mut seen).is_empty());
        assert_eq!(seen, vec![0; 6], "the counts are left zeroed");
    }
}
