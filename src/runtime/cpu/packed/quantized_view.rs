//! A quantized weight's panels as the packer left them, for a device that multiplies the
//! codes itself (the CUDA backend's `kernels/quant.cu` reads this layout): the host does the
//! slicing, fusing, padding and act-order sorting once, here, for every backend.

use super::super::isa::CodeKind;
use super::{PackedMatrix, Panels};

/// The arrays of a quantized [`PackedMatrix`] (`n` columns in panels of `NR`, `k` slots).
#[derive(Debug, Clone, Copy)]
pub enum QuantizedPanels<'a> {
    /// FP8 e4m3 or INT8 codes: per panel `[k][NR]` bytes; scales per panel
    /// `[⌈k/kblock⌉][NR]`.
    Bytes {
        kind: CodeKind,
        codes: &'a [u8],
        scales: &'a [f32],
        kblock: usize,
    },
    /// INT4 codes: per panel `k/4` quads of 32 bytes (`isa::int4_slot`); scales and zero
    /// points per panel `[⌈k/kblock⌉][NR]`; `order`, where the steps are stored sorted by
    /// group, the input at each of the `k` slots (`u32::MAX`: padding).
    Int4 {
        codes: &'a [u8],
        scales: &'a [f32],
        zeros: &'a [f32],
        kblock: usize,
        order: Option<&'a [u32]>,
    },
}

impl PackedMatrix {
    /// The codes and scales, where the weight kept its checkpoint's codes (`None`: values).
    pub fn quantized_panels(&self) -> Option<QuantizedPanels<'_>> {
        match &self.panels {
            Panels::Codes(c) => Some(QuantizedPanels::Bytes {
                kind: c.kind,
                codes: &c.codes,
                scales: &c.scales,
                kblock: c.kblock,
            }),
            Panels::Int4(c) => Some(QuantizedPanels::Int4 {
                codes: &c.codes,
                scales: &c.scales,
                zeros: &c.zeros,
                kblock: c.kblock,
                order: c.order.as_ref().map(|o| &o.stored[..]),
            }),
            Panels::Bf16(_) | Panels::F32(_) => None,
        }
    }
}
