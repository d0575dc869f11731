//! Weights in the encoding a checkpoint stores them in (f32, bf16, f16, and FP8 e4m3 before
//! its block scales), and their conversions to what the runtime computes with: f32, or bf16
//! bits.

use super::{Result, WeightError};
use safetensors::Dtype;
use std::path::PathBuf;

/// How a stored tensor's elements are encoded (little-endian).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoredDtype {
    F32,
    Bf16,
    F16,
    /// `float8_e4m3fn`: a quantized weight's elements, each to be multiplied by its block's
    /// scale (`fp8`); decoded alone they are the values before the scale.
    F8E4m3,
    /// Signed 8-bit integers: a quantized weight's elements before their scales.
    I8,
}

impl StoredDtype {
    pub(super) fn of(dtype: Dtype) -> Option<StoredDtype> {
        match dtype {
            Dtype::F32 => Some(StoredDtype::F32),
            Dtype::BF16 => Some(StoredDtype::Bf16),
            Dtype::F16 => Some(StoredDtype::F16),
            Dtype::F8_E4M3 => Some(StoredDtype::F8E4m3),
            Dtype::I8 => Some(StoredDtype::I8),
            _ => None,
        }
    }

    /// The byte dtypes' name in messages.
    pub fn quant_word(self) -> &'static str {
        match self {
            StoredDtype::I8 => "INT8",
            _ => "FP8",
        }
    }

    /// The quantization format of the byte dtypes (f32 and 16-bit floats are not
    /// quantized; they report FP8's, which no check compares them with).
    pub fn quant_format(self) -> crate::ir::QuantFormat {
        match self {
            StoredDtype::I8 => crate::ir::QuantFormat::Int8,
            _ => crate::ir::QuantFormat::Fp8E4m3,
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            StoredDtype::F32 => 4,
            StoredDtype::Bf16 | StoredDtype::F16 => 2,
            StoredDtype::F8E4m3 | StoredDtype::I8 => 1,
        }
    }
}

/// A batch of local rows of one rank's 2-D slice of a weight (the slice's `[rows, cols]`,
/// row-major) in the stored encoding, read from the checkpoint into memory tpc owns, padding
/// as zero bytes (zero in every stored dtype). A packer reads its slice a batch at a time
/// into one of these, reused, and converts windows of the rows.
pub struct StoredRows {
    pub(super) dtype: StoredDtype,
    /// `rows · cols` little-endian elements.
    pub(super) bytes: Vec<u8>,
    /// The first local row held, and how many.
    pub(super) first: usize,
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) tensor: String,
    pub(super) path: PathBuf,
    /// Quantized weights are held as their codes (not dequantized): set by a packer that
    /// applies the scales itself.
    pub(super) keep_codes: bool,
}

impl Default for StoredRows {
    fn default() -> Self {
        StoredRows {
            dtype: StoredDtype::F32,
            bytes: Vec::new(),
            first: 0,
            rows: 0,
            cols: 0,
            tensor: String::new(),
            path: PathBuf::new(),
            keep_codes: false,
        }
    }
}

impl StoredRows {
    /// The encoding of the rows held.
    pub fn dtype(&self) -> StoredDtype {
        self.dtype
    }

    /// The local rows held.
    pub fn rows(&self) -> std::ops::Range<usize> {
        self.first..self.first + self.rows
    }

    /// The bytes of local row `r`, columns `[c0, c0 + len)`, or an error naming the tensor
    /// when the row is not held or the columns are not in it.
    fn run(&self, r: usize, c0: usize, len: usize) -> Result<&[u8]> {
        let size = self.dtype.size();
        let inside =
            self.rows().contains(&r) && c0.checked_add(len).is_some_and(|e| e <= self.cols);
        if !inside {
            return Err(WeightError::Tensor {
                path: self.path.clone(),
                tensor: self.tensor.clone(),
                problem: format!(
                    "row {r}, columns {c0}..{} asked for; rows {:?} of {} columns are read",
                    c0.saturating_add(len),
                    self.rows(),
                    self.cols
                ),
            });
        }
        // In range: (r - first) < rows and c0 + len ≤ cols, and rows · cols · size is the
        // buffer's length.
        let at = ((r - self.first) * self.cols + c0) * size;
        Ok(&self.bytes[at..at + len * size])
    }

    /// Rows read from now on hold a quantized weight's codes, not its values.
    pub fn keep_codes(&mut self) {
        self.keep_codes = true;
    }

    /// Local row `r`, columns `[c0, c0 + out.len())`, as quantized codes (the bytes as stored),
    /// or an error when the rows hold values.
    pub fn codes(&self, r: usize, c0: usize, out: &mut [u8]) -> Result<()> {
        if !matches!(self.dtype, StoredDtype::F8E4m3 | StoredDtype::I8) {
            return Err(WeightError::Tensor {
                path: self.path.clone(),
                tensor: self.tensor.clone(),
                problem: format!(
                    "is read as {:?} values where quantized codes were expected; report this as a bug",
                    self.dtype
                ),
            });
        }
        out.copy_from_slice(self.run(r, c0, out.len())?);
        // The products widen e4m3 codes without a table, which has no NaN (`isa/codes.rs`).
        let nan = self.dtype == StoredDtype::F8E4m3;
        match out.iter().position(|b| nan && b & 0x7f == 0x7f) {
            None => Ok(()),
            Some(at) => Err(WeightError::Tensor {
                path: self.path.clone(),
                tensor: self.tensor.clone(),
                problem: format!(
                    "holds the FP8 NaN code {:#04x} (local row {r}, column {}); a weight cannot be NaN, the checkpoint is corrupt",
                    out[at],
                    c0 + at
                ),
            }),
        }
    }

    /// Local row `r`, columns `[c0, c0 + out.len())`, as f32 (bf16 and f16 widen exactly).
    pub fn f32s(&self, r: usize, c0: usize, out: &mut [f32]) -> Result<()> {
        decode_f32(self.dtype, self.run(r, c0, out.len())?, out);
        Ok(())
    }

    /// Local row `r`, columns `[c0, c0 + out.len())`, as bf16 bits (see [`decode_bf16`]).
    pub fn bf16_bits(&self, r: usize, c0: usize, out: &mut [u16]) -> Result<()> {
        decode_bf16(self.dtype, self.run(r, c0, out.len())?, out);
        Ok(())
    }
}

/// Stored elements as f32 (bf16 and f16 widen exactly), as many as both sides hold.
pub(super) fn decode_f32(dtype: StoredDtype, bytes: &[u8], out: &mut [f32]) {
    // Byte arrays (not `chunks_exact`) so that these loops vectorise.
    match dtype {
        StoredDtype::F32 => {
            for (o, b) in out.iter_mut().zip(byte_arrays::<4>(bytes)) {
                *o = f32::from_le_bytes(*b);
            }
        }
        StoredDtype::Bf16 => {
            for (o, b) in out.iter_mut().zip(byte_arrays::<2>(bytes)) {
                *o = f32::from_bits((u16::from_le_bytes(*b) as u32) << 16);
            }
        }
        StoredDtype::F16 => {
            for (o, b) in out.iter_mut().zip(byte_arrays::<2>(bytes)) {
                *o = half::f16::from_le_bytes(*b).to_f32();
            }
        }
        StoredDtype::F8E4m3 => {
            for (o, &b) in out.iter_mut().zip(bytes) {
                *o = super::fp8::e4m3_to_f32(b);
            }
        }
        StoredDtype::I8 => {
            for (o, &b) in out.iter_mut().zip(bytes) {
                *o = b as i8 as f32;
            }
        }
    }
}

/// Stored elements as bf16 bits, equal to `half::bf16::from_f32` of [`decode_f32`]: bf16
/// is copied (a NaN gets its quiet bit, as that round trip gives it), f32 and f16 are
/// rounded to nearest even.
pub(super) fn decode_bf16(dtype: StoredDtype, bytes: &[u8], out: &mut [u16]) {
    match dtype {
        StoredDtype::Bf16 => {
            for (o, b) in out.iter_mut().zip(byte_arrays::<2>(bytes)) {
                let bits = u16::from_le_bytes(*b);
                // Branch-free so that the copy vectorises.
                let nan = ((bits & 0x7FFF) > 0x7F80) as u16;
                *o = bits | (nan << 6);
            }
        }
        StoredDtype::F32 => {
            for (o, b) in out.iter_mut().zip(byte_arrays::<4>(bytes)) {
                *o = half::bf16::from_f32(f32::from_le_bytes(*b)).to_bits();
            }
        }
        StoredDtype::F16 => {
            for (o, b) in out.iter_mut().zip(byte_arrays::<2>(bytes)) {
                let v = half::f16::from_le_bytes(*b).to_f32();
                *o = half::bf16::from_f32(v).to_bits();
            }
        }
        // Exact: every e4m3 value and every 8-bit integer is a bf16 value.
        StoredDtype::F8E4m3 => {
            for (o, &b) in out.iter_mut().zip(bytes) {
                *o = half::bf16::from_f32(super::fp8::e4m3_to_f32(b)).to_bits();
            }
        }
        StoredDtype::I8 => {
            for (o, &b) in out.iter_mut().zip(bytes) {
                *o = half::bf16::from_f32(b as i8 as f32).to_bits();
            }
        }
    }
}

/// `bytes` as whole `N`-byte arrays, the tail dropped (what `slice::as_chunks` does, newer
/// than this crate's minimum Rust).
fn byte_arrays<const N: usize>(bytes: &[u8]) -> &[[u8; N]] {
    // SAFETY: `[u8; N]` has size N and alignment 1, so `len / N` of them lie within `bytes`
    // whatever its address, and any bytes are a valid `[u8; N]`.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast(), bytes.len() / N) }
}
