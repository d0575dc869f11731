//! Linear weights kept on the GPU as their checkpoint's quantized codes (FP8 e4m3, INT8,
//! GPTQ / AWQ INT4) with their scales, in the CPU backend's panel layout: the host packer
//! (`PackedMatrix`) slices, fuses, pads and sorts them once, and `kernels/quant.cu`
//! multiplies them. A decode step (at most [`GEMV_ROWS`] rows) reads the codes in place —
//! a half (FP8, INT8) or a quarter (INT4) of bf16's bytes; a prompt widens the weight to
//! bf16 (or f32) rows in a scratch buffer for cuBLAS, as the CPU backend widens panels.
//!
//! Not kept as codes (loaded as values, as before): weights under `--numerics invariant`, a
//! linear trimmed of an uneven split's padding, and any slice the packer dequantizes (a
//! split inside a block or group, act order it cannot sort).

use super::{i64_of, linear_width, CudaBackend, CudaWeight, GemmPart, WeightData};
use crate::ir::WeightOrder;
use crate::plan::WeightSlice;
use crate::runtime::backend::{Activation, BackendError, BackendResult};
use crate::runtime::cpu::isa::{CodeKind, NR};
use crate::runtime::cpu::packed::{PackedMatrix, QuantizedPanels};
use crate::runtime::cuda::act::CudaAct;
use crate::runtime::cuda::device::{grid_dim, grid_for};
use crate::runtime::weights::WeightSource;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

/// Columns of a panel (`PANEL` in quant.cu): the packer's.
const PANEL: usize = 16;
const _: () = assert!(NR == PANEL, "quant.cu reads the packer's 16-column panels");
/// The most rows a GEMV takes (`GEMV_ROWS` in quant.cu); more go to cuBLAS.
pub(super) const GEMV_ROWS: usize = 8;
/// Threads of a GEMV block (`32 * GEMV_WARPS` in quant.cu).
const GEMV_THREADS: u32 = 256;

/// A quantized linear weight on the device.
pub(super) struct DeviceCodes {
    format: CodeFormat,
    /// Per panel: `[slots][16]` bytes, or INT4's `slots / 4` quads of 32 bytes.
    codes: CudaSlice<u8>,
    /// Per panel `[⌈slots/kblock⌉][16]`.
    scales: CudaSlice<f32>,
    /// INT4 act order: the input at each slot (`u32::MAX`: padding).
    order: Option<CudaSlice<u32>>,
    /// Steps the panels hold (the inputs, or act order's slots).
    slots: usize,
    kblock: usize,
}

/// How the codes are stored, and what that adds to the scales.
enum CodeFormat {
    /// A byte a code: FP8 e4m3 (`e4m3`) or INT8.
    Bytes { e4m3: bool },
    /// Four bits a code, with a zero point per column per group, laid out as the scales.
    Int4 { zeros: CudaSlice<f32> },
}

impl DeviceCodes {
    pub(super) fn bytes(&self) -> usize {
        let zeros = match &self.format {
            CodeFormat::Int4 { zeros } => zeros.len(),
            CodeFormat::Bytes { .. } => 0,
        };
        self.codes.len()
            + 4 * (self.scales.len() + zeros + self.order.as_ref().map_or(0, |o| o.len()))
    }
}

impl CudaBackend {
    /// The linear `slices` (outputs side by side) as codes, where each is stored quantized
    /// and the packer keeps their codes; `Ok(None)` where they are loaded as values instead.
    pub(super) fn upload_codes(
        &self,
        src: &dyn WeightSource,
        slices: &[&WeightSlice],
        order: WeightOrder,
    ) -> BackendResult<Option<CudaWeight>> {
        let weights = BackendError::Weights;
        if order != WeightOrder::OutIn || self.invariant {
            return Ok(None);
        }
        for w in slices {
            let stored = src.quant_scales(&w.tensor).map_err(weights)?.is_some()
                || src.int4_weight(&w.tensor).map_err(weights)?.is_some();
            if !stored {
                return Ok(None);
            }
        }
        let packed =
            PackedMatrix::pack_slices(src, slices, order, self.bf16_linears).map_err(weights)?;
        let Some(view) = packed.quantized_panels() else {
            return Ok(None);
        };
        let up_u8 = |v: &[u8]| {
            self.gpu
                .stream
                .clone_htod(v)
                .map_err(|e| self.gpu.fail("quantized codes", Some(v.len()), e))
        };
        let up_u32 = |v: &[u32]| {
            self.gpu
                .stream
                .clone_htod(v)
                .map_err(|e| self.gpu.fail("an act order", Some(v.len() * 4), e))
        };
        let codes = match view {
            QuantizedPanels::Bytes {
                kind,
                codes,
                scales,
                kblock,
            } => DeviceCodes {
                format: CodeFormat::Bytes {
                    e4m3: kind == CodeKind::E4m3,
                },
                codes: up_u8(codes)?,
                scales: self.upload_f32(scales, "quantized scales")?,
                order: None,
                slots: packed.k,
                kblock,
            },
            QuantizedPanels::Int4 {
                codes,
                scales,
                zeros,
                kblock,
                order,
            } => DeviceCodes {
                format: CodeFormat::Int4 {
                    zeros: self.upload_f32(zeros, "INT4 zero points")?,
                },
                codes: up_u8(codes)?,
                scales: self.upload_f32(scales, "INT4 scales")?,
                order: order.map(up_u32).transpose()?,
                slots: packed.k,
                kblock,
            },
        };
        Ok(Some(CudaWeight {
            shape: vec![packed.n, packed.inputs()],
            data: WeightData::Codes(codes),
            order,
            unpadded: None,
        }))
    }

    /// `x · Wᵀ` for a weight kept as codes: the GEMV of quant.cu for a decode step, else
    /// the weight widened to rows for cuBLAS.
    pub(super) fn linear_codes(
        &self,
        x: &CudaAct,
        w: &CudaWeight,
        c: &DeviceCodes,
    ) -> BackendResult<CudaAct> {
        let (m, _) = x.rows_cols();
        let n = linear_width(x, w)?;
        let mut shape = x.shape().to_vec();
        if let Some(last) = shape.last_mut() {
            *last = n;
        }
        if m == 0 || n == 0 || c.slots == 0 {
            return self.zeros(shape);
        }
        // Act order: the activations in the stored order of the steps.
        let permuted = match &c.order {
            Some(order) => Some(self.permute_steps(x, order, c.slots)?),
            None => None,
        };
        let xs = permuted.as_ref().unwrap_or(x);
        let (slots, kblock) = (i64_of(c.slots), i64_of(c.kblock));
        let (rows, n64) = (i64_of(m), i64_of(n));
        if m <= GEMV_ROWS {
            let mut out = self.output(shape)?;
            let cfg = LaunchConfig {
                grid_dim: (grid_dim(n.div_ceil(PANEL))?, 1, 1),
                block_dim: (GEMV_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            match &c.format {
                CodeFormat::Int4 { zeros } => launch!(
                    self.gpu,
                    "gemv_int4",
                    cfg,
                    out.data_mut(),
                    xs.data(),
                    &c.codes,
                    &c.scales,
                    zeros,
                    &rows,
                    &n64,
                    &slots,
                    &kblock
                )?,
                &CodeFormat::Bytes { e4m3 } => {
                    let e4m3 = i32::from(e4m3);
                    launch!(
                        self.gpu,
                        "gemv_codes",
                        cfg,
                        out.data_mut(),
                        xs.data(),
                        &c.codes,
                        &c.scales,
                        &rows,
                        &n64,
                        &slots,
                        &kblock,
                        &e4m3
                    )?
                }
            }
            return Ok(out);
        }
        let rows_of = self.widen(c, n)?;
        let widened = CudaWeight {
            shape: vec![n, c.slots],
            data: rows_of,
            order: WeightOrder::OutIn,
            unpadded: None,
        };
        let mut out = self.output(shape)?;
        let whole = GemmPart {
            k: c.slots,
            n,
            w_col: 0,
            out_col: 0,
            ldc: n,
        };
        self.gemm_parts(xs, &widened, m, &mut out, &[whole])?;
        Ok(out)
    }

    /// The weight's values as `[n][slots]` rows, in the run's dtype.
    fn widen(&self, c: &DeviceCodes, n: usize) -> BackendResult<WeightData> {
        let len = n
            .checked_mul(c.slots)
            .ok_or_else(|| BackendError::OutOfMemory(format!("a {n}×{} weight", c.slots)))?;
        let stream = &self.gpu.stream;
        if self.bf16_linears {
            // SAFETY: device memory, every value written by the widening kernel.
            let mut out = unsafe { stream.alloc::<u16>(len) }
                .map_err(|e| self.gpu.fail("a widened weight", Some(len * 2), e))?;
            self.widen_into(c, n, &mut out, "bf16")?;
            Ok(WeightData::Bf16(out))
        } else {
            // SAFETY: as above.
            let mut out = unsafe { stream.alloc::<f32>(len) }
                .map_err(|e| self.gpu.fail("a widened weight", Some(len * 4), e))?;
            self.widen_into(c, n, &mut out, "f32")?;
            Ok(WeightData::F32(out))
        }
    }

    /// Launches `codes_to_<dtype>` or `int4_to_<dtype>` (quant.cu) into `out`, `n · slots`
    /// values of `dtype`.
    fn widen_into<T>(
        &self,
        c: &DeviceCodes,
        n: usize,
        out: &mut CudaSlice<T>,
        dtype: &str,
    ) -> BackendResult<()>
    where
        T: cudarc::driver::DeviceRepr,
    {
        let (n64, slots, kblock) = (i64_of(n), i64_of(c.slots), i64_of(c.kblock));
        let e4m3 = i32::from(matches!(c.format, CodeFormat::Bytes { e4m3: true }));
        let name = match c.format {
            CodeFormat::Int4 { .. } => format!("int4_to_{dtype}"),
            CodeFormat::Bytes { .. } => format!("codes_to_{dtype}"),
        };
        let f = self.gpu.kernel(&name)?;
        let mut b = self.gpu.stream.launch_builder(f);
        b.arg(out).arg(&c.codes).arg(&c.scales);
        match &c.format {
            CodeFormat::Int4 { zeros } => b.arg(zeros).arg(&n64).arg(&slots).arg(&kblock),
            CodeFormat::Bytes { .. } => b.arg(&n64).arg(&slots).arg(&kblock).arg(&e4m3),
        };
        // SAFETY: the arguments are pushed in the order and with the types of the kernel's
        // C signature in quant.cu; `out` holds n · slots values, and the panels hold the
        // codes and scales of n columns over `slots` steps (packed so).
        unsafe { b.launch(grid_for(n * c.slots)) }
            .map(|_| ())
            .map_err(|e| self.gpu.fail(&format!("kernel {name}"), None, e))
    }

    /// `x`'s columns in act order's slots (zeros at padding slots).
    fn permute_steps(
        &self,
        x: &CudaAct,
        order: &CudaSlice<u32>,
        slots: usize,
    ) -> BackendResult<CudaAct> {
        let (m, inputs) = x.rows_cols();
        let len = m
            .checked_mul(slots)
            .ok_or_else(|| BackendError::OutOfMemory(format!("{m} rows of {slots} slots")))?;
        let mut out = self.output(vec![m, slots])?;
        let (m64, inputs64, slots64) = (i64_of(m), i64_of(inputs), i64_of(slots));
        launch!(
            self.gpu,
            "permute_steps",
            grid_for(len),
            out.data_mut(),
            x.data(),
            order,
            &m64,
            &inputs64,
            &slots64
        )?;
        Ok(out)
    }
}
