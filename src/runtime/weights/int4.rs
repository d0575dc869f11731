//! INT4 weights as GPTQ, AWQ and compressed-tensors store them. A linear weight `W [out,
//! in]` is not a tensor of the checkpoint: `<module>.qweight` holds its 4-bit codes packed
//! eight to an int32, `<module>.qzeros` a zero point and `<module>.scales` an f16 scale per
//! output per group of inputs, and GPTQ's `<module>.g_idx` each input's group (in
//! compressed-tensors: `weight_packed`, `weight_zero_point`, `weight_scale`,
//! `weight_g_idx`); an element's value is
//! `(code − zero) × scale` of its input's group, which is how the formats' own reference
//! kernels dequantize (here exactly, in f32).
//!
//! - GPTQ (`gptq` checkpoint format): `qweight [in/8, out]`, input `8p + k` of word `p` in
//!   bits `4k..4k+4`; `qzeros [groups, out/8]`, output `8j + k` in bits `4k..`, each zero
//!   stored one less; `g_idx [in]`, which with `desc_act` scatters a group's inputs.
//! - AWQ (GEMM packing): `qweight [in, out/8]` and `qzeros [groups, out/8]`, word `j`'s
//!   bits `4k..` holding output `8j + ORDER[k]` with ORDER = 0 2 4 6 1 3 5 7; zeros as
//!   stored; input `i` in group `i / group`.
//! - compressed-tensors (`pack-quantized`): `weight_packed [out, in/8]`, input `8p + k` of
//!   word `p` of its output's row in bits `4k..`, each code the signed value plus 8;
//!   `weight_scale [out, groups]` (the model's float type); `weight_zero_point [out/8,
//!   groups]`, output `8j + k` in bits `4k..`, plus 8 as the codes (absent where symmetric:
//!   every zero is 8); `weight_g_idx [in]` in group act order (−1 entries: consecutive
//!   groups); `weight_shape` `[out, in]`.
//!
//! Scales, zeros and groups are small (one per group, not per element) and are read and
//! checked whole when the weight is first asked for, before any compute. The codes are
//! read a band of output rows at a time (each band's words are `pread` row by row of the
//! packed tensor) and unpacked a byte a code; the last few bands stay cached, so that a
//! rank reading its columns of every row in turn reads each band once. A reader gets the
//! values (dequantized in f32 as it copies) or the codes themselves (the CPU packer keeps
//! them, `runtime/cpu/packed/int4.rs`).

use super::file::ShardFile;
use super::{Result, WeightError};
use crate::ir::QuantFormat;
use rayon::prelude::*;
use safetensors::tensor::TensorInfo;
use safetensors::Dtype;
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// AWQ's order of outputs within a packed word: bits `4k..` hold output `ORDER[k]`.
const AWQ_ORDER: [usize; 8] = [0, 2, 4, 6, 1, 3, 5, 7];

/// Which field of an AWQ word holds output `o % 8`: AWQ_ORDER's inverse.
const AWQ_FIELD: [usize; 8] = invert(AWQ_ORDER);

const fn invert(order: [usize; 8]) -> [usize; 8] {
    let mut field = [0; 8];
    let mut k = 0;
    while k < 8 {
        field[order[k]] = k;
        k += 1;
    }
    field
}

/// Codes a band holds at most (4 MiB), so that a cached band is small;
/// a few in unit tests, so that their small weights span several bands.
const BAND_ELEMENTS: usize = if cfg!(test) { 256 } else { 1 << 22 };

/// Bands kept after they are read.
const CACHED_BANDS: usize = 6;

/// The shape of `qweight` for a weight of `[out, in]` (`None` where the packing cannot
/// hold it: a dim not a multiple of the eight elements a word holds).
pub(super) fn packed_shape(format: QuantFormat, [out, inp]: [usize; 2]) -> Option<[usize; 2]> {
    match format {
        QuantFormat::Int4Gptq if inp % 8 == 0 => Some([inp / 8, out]),
        QuantFormat::Int4Awq if out % 8 == 0 => Some([inp, out / 8]),
        QuantFormat::Int4Packed { .. } if inp % 8 == 0 => Some([out, inp / 8]),
        _ => None,
    }
}

/// The names (after `<module>.`) of an INT4 weight's packed codes, zeros, scales and
/// groups in `format`, in that order.
pub(super) fn part_names(format: QuantFormat) -> [&'static str; 4] {
    match format {
        QuantFormat::Int4Packed { .. } => [
            "weight_packed",
            "weight_zero_point",
            "weight_scale",
            "weight_g_idx",
        ],
        _ => ["qweight", "qzeros", "scales", "g_idx"],
    }
}

/// One stored tensor of an INT4 weight, located in its file and checked against the shape
/// and dtype the format gives it.
pub(super) struct Part<'a> {
    pub file: &'a ShardFile,
    pub info: &'a TensorInfo,
    pub name: String,
}

/// An INT4 weight's layout and its small tensors, read and checked.
pub struct Int4Weight {
    /// The weight's name as the plan gives it (`<module>.weight`).
    tensor: String,
    format: QuantFormat,
    out: usize,
    inp: usize,
    path: PathBuf,
    /// The file holding `qweight`, and where its data starts.
    file: usize,
    offset: u64,
    /// `[groups][out]`.
    scales: Vec<f32>,
    /// `[groups][out]`: the zero points, as the dequantization subtracts them.
    zeros: Vec<u8>,
    /// Each input's group.
    group_of: Vec<u32>,
    /// Output rows per band (a multiple of 8).
    band_rows: usize,
}

/// The int32 words of a tensor's bytes.
fn words(bytes: &[u8]) -> impl Iterator<Item = u32> + '_ {
    bytes
        .chunks_exact(4)
        .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
}

/// The 4-bit field `k` of `word`.
fn nibble(word: u32, k: usize) -> u8 {
    ((word >> (4 * k)) & 0xf) as u8
}

/// Where in a packed word (which of its eight fields) output `o % 8` lies.
fn field_of(format: QuantFormat, o: usize) -> usize {
    match format {
        QuantFormat::Int4Awq => AWQ_FIELD[o % 8],
        _ => o % 8,
    }
}

impl Int4Weight {
    /// Reads and checks the small tensors of the INT4 weight `tensor`, whose packed codes,
    /// zeros, scales and groups ([`part_names`]) and compressed-tensors' `weight_shape` are
    /// `parts` (`None` where missing), quantized in `format` with `group` inputs a group (0:
    /// one group across them). `read_floats` reads a float tensor (the scales) whole as f32.
    pub(super) fn open(
        tensor: &str,
        format: QuantFormat,
        group: u64,
        act_order: bool,
        parts: [Option<Part<'_>>; 5],
        file_index: usize,
        read_floats: impl Fn(&str) -> Result<Vec<f32>>,
    ) -> Result<Int4Weight> {
        let [qweight, qzeros, scales, g_idx, shape_part] = parts;
        let stem = tensor.strip_suffix(".weight").unwrap_or(tensor);
        let missing = |what: &str| {
            WeightError::Tensor {
            path: PathBuf::new(),
            tensor: tensor.to_string(),
            problem: format!(
                "is stored as {} but `{stem}.{what}` is missing from the checkpoint; the checkpoint is incomplete",
                format.name()
            ),
        }
        };
        let names = part_names(format);
        let qweight = qweight.ok_or_else(|| missing(names[0]))?;
        let bad = |part: &Part, problem: String| WeightError::Tensor {
            path: part.file.path.clone(),
            tensor: part.name.clone(),
            problem,
        };
        let two_d = |part: &Part, dtype: &[Dtype]| -> Result<[usize; 2]> {
            if !dtype.contains(&part.info.dtype) {
                return Err(bad(
                    part,
                    format!(
                        "has dtype {:?}; {} stores it as {}",
                        part.info.dtype,
                        format.name(),
                        dtype
                            .iter()
                            .map(|d| format!("{d:?}"))
                            .collect::<Vec<_>>()
                            .join(" or ")
                    ),
                ));
            }
            match part.info.shape[..] {
                [a, b] => Ok([a, b]),
                _ => Err(bad(
                    part,
                    format!("has shape {:?}; it must be 2-D", part.info.shape),
                )),
            }
        };
        let packed = two_d(&qweight, &[Dtype::I32, Dtype::U32])?;
        // The weight's [out, in] from its packed shape.
        let [out, inp] = match format {
            QuantFormat::Int4Gptq => [Some(packed[1]), packed[0].checked_mul(8)],
            QuantFormat::Int4Packed { .. } => [Some(packed[0]), packed[1].checked_mul(8)],
            _ => [packed[1].checked_mul(8), Some(packed[0])],
        }
        .map(|d| d.unwrap_or(usize::MAX));
        if out == 0 || inp == 0 || out % 8 != 0 || out == usize::MAX || inp == usize::MAX {
            return Err(bad(
                &qweight,
                format!(
                    "has shape {packed:?}: a {} weight of {out} outputs and {inp} inputs, which must be positive and the outputs a multiple of 8; the checkpoint is corrupt",
                    format.name()
                ),
            ));
        }
        let groups = if group == 0 {
            1
        } else {
            inp.div_ceil(usize::try_from(group).unwrap_or(usize::MAX))
        };
        let want = |part: &Part, got: [usize; 2], want: [usize; 2], what: &str| {
            if got == want {
                Ok(())
            } else {
                Err(bad(
                    part,
                    format!(
                        "has shape {got:?}; a {out} × {inp} {} weight in {groups} group(s) of inputs has {what} {want:?}; the checkpoint and its config.json do not match",
                        format.name()
                    ),
                ))
            }
        };
        // compressed-tensors stores scales and zeros with the outputs first.
        let by_output = matches!(format, QuantFormat::Int4Packed { .. });
        let qzeros = if format.stores_zeros() {
            let qzeros = qzeros.ok_or_else(|| missing(names[1]))?;
            let shape = if by_output {
                [out / 8, groups]
            } else {
                [groups, out / 8]
            };
            want(
                &qzeros,
                two_d(&qzeros, &[Dtype::I32, Dtype::U32])?,
                shape,
                "zeros",
            )?;
            Some(qzeros)
        } else {
            None
        };
        let scales_part = scales.ok_or_else(|| missing(names[2]))?;
        want(
            &scales_part,
            two_d(&scales_part, &[Dtype::F16, Dtype::BF16, Dtype::F32])?,
            if by_output {
                [out, groups]
            } else {
                [groups, out]
            },
            "scales",
        )?;
        let raw = |part: &Part| -> Result<Vec<u8>> {
            let (start, end) = part.info.data_offsets;
            let mut buf = vec![0u8; end.saturating_sub(start)];
            part.file
                .read_exact_at(part.file.data_start.saturating_add(start as u64), &mut buf)?;
            Ok(buf)
        };
        if let Some(part) = shape_part {
            let ok =
                matches!(part.info.dtype, Dtype::I32 | Dtype::I64) && part.info.shape[..] == [2];
            let dims: Vec<i64> = if ok {
                let bytes = raw(&part)?;
                match part.info.dtype {
                    Dtype::I64 => bytes
                        .chunks_exact(8)
                        .map(|b| i64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
                        .collect(),
                    _ => words(&bytes).map(|w| i64::from(w as i32)).collect(),
                }
            } else {
                Vec::new()
            };
            if dims != [out as i64, inp as i64] {
                return Err(bad(
                    &part,
                    format!(
                        "is {dims:?} ({:?} {:?}); the packed codes hold a {out} × {inp} weight, whose weight_shape is I32 or I64 [2] = [{out}, {inp}] (tpc reads inputs in whole words of 8); the checkpoint is corrupt",
                        part.info.dtype, part.info.shape
                    ),
                ));
            }
        }
        let mut scales = read_floats(&scales_part.name)?;
        if by_output {
            // [out][groups] → [groups][out], as the other packings store them.
            scales = (0..groups * out)
                .map(|at| scales[(at % out) * groups + at / out])
                .collect();
        }
        if let Some(bad_at) = scales.iter().position(|v| !v.is_finite()) {
            return Err(bad(
                &scales_part,
                format!(
                    "scale {bad_at} is {}; a corrupt checkpoint (every scale of a quantized weight is a finite number)",
                    scales[bad_at]
                ),
            ));
        }
        // One zero per (group, output), as the dequantization subtracts it; a symmetric
        // scheme's codes are the signed value plus 8.
        let mut zeros = vec![8u8; groups.saturating_mul(out)];
        if let Some(qzeros) = &qzeros {
            let zero_words: Vec<u32> = words(&raw(qzeros)?).collect();
            let plus = u8::from(format == QuantFormat::Int4Gptq);
            for (g, row) in zeros.chunks_mut(out.max(1)).enumerate() {
                for (o, z) in row.iter_mut().enumerate() {
                    let word = if by_output {
                        zero_words[(o / 8) * groups + g]
                    } else {
                        zero_words[g * (out / 8) + o / 8]
                    };
                    *z = nibble(word, field_of(format, o)) + plus;
                }
            }
        }
        let scattered = matches!(
            format,
            QuantFormat::Int4Gptq | QuantFormat::Int4Packed { .. }
        );
        let group_of: Vec<u32> = match (scattered, g_idx) {
            (true, Some(part)) => {
                let shape = &part.info.shape;
                if !matches!(part.info.dtype, Dtype::I32 | Dtype::I64) || shape[..] != [inp] {
                    return Err(bad(
                        &part,
                        format!(
                            "has dtype {:?} and shape {shape:?}; a weight of {inp} inputs has g_idx I32 [{inp}]",
                            part.info.dtype
                        ),
                    ));
                }
                let bytes = raw(&part)?;
                let ids: Vec<i64> = match part.info.dtype {
                    Dtype::I64 => bytes
                        .chunks_exact(8)
                        .map(|b| i64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
                        .collect(),
                    _ => words(&bytes).map(|w| w as i32 as i64).collect(),
                };
                let mut out_ids = Vec::with_capacity(ids.len());
                // compressed-tensors leaves g_idx at −1 where the groups are in column order.
                let column_order = by_output && ids.contains(&-1);
                for (i, &g) in ids.iter().enumerate() {
                    if column_order {
                        out_ids.push((i as u64).checked_div(group).unwrap_or(0) as u32);
                        continue;
                    }
                    match u32::try_from(g).ok().filter(|&g| (g as usize) < groups) {
                        Some(g) => out_ids.push(g),
                        None => {
                            return Err(bad(
                                &part,
                                format!(
                                    "input {i} is in group {g}; the weight has {groups} group(s): a corrupt checkpoint"
                                ),
                            ))
                        }
                    }
                }
                out_ids
            }
            (true, None) if act_order => return Err(missing(names[3])),
            // Consecutive groups (one across the inputs for a group of 0); fewer groups than
            // inputs, so u32 holds them.
            _ => (0..inp)
                .map(|i| (i as u64).checked_div(group).unwrap_or(0) as u32)
                .collect(),
        };
        let band_rows = (BAND_ELEMENTS / inp.max(1)).clamp(8, out.max(8)) / 8 * 8;
        Ok(Int4Weight {
            tensor: tensor.to_string(),
            format,
            out,
            inp,
            path: qweight.file.path.clone(),
            file: file_index,
            offset: qweight
                .file
                .data_start
                .saturating_add(qweight.info.data_offsets.0 as u64),
            scales,
            zeros,
            group_of,
            band_rows,
        })
    }

    /// The weight's `[out, in]`.
    pub fn shape(&self) -> [usize; 2] {
        [self.out, self.inp]
    }

    pub fn format(&self) -> QuantFormat {
        self.format
    }

    fn err(&self, problem: String) -> WeightError {
        WeightError::Tensor {
            path: self.path.clone(),
            tensor: self.tensor.clone(),
            problem,
        }
    }

    /// The codes of output rows `[o0, o1)` (`o0` a multiple of 8, `o1` of 8 or `out`),
    /// `[o1 − o0][in]`, one a byte.
    fn band_codes(&self, file: &ShardFile, o0: usize, o1: usize) -> Result<Vec<u8>> {
        let rows = o1 - o0;
        let (packed_rows, words_per_row, first_word, row_words) = match self.format {
            QuantFormat::Int4Gptq => (self.inp / 8, rows, o0, self.out),
            // Each output's row of words in turn: one run of them.
            QuantFormat::Int4Packed { .. } => (rows, self.inp / 8, o0 * self.inp / 8, self.inp / 8),
            _ => (self.inp, rows.div_ceil(8), o0 / 8, self.out / 8),
        };
        // The band's words, packed row after packed row.
        let mut buf = vec![0u8; packed_rows * words_per_row * 4];
        buf.par_chunks_mut((words_per_row * 4).max(1))
            .enumerate()
            .try_for_each(|(p, dst)| {
                let at = (p * row_words + first_word) as u64 * 4;
                file.read_exact_at(self.offset + at, dst)
            })?;
        let words: Vec<u32> = words(&buf).collect();
        let mut codes = vec![0u8; rows * self.inp];
        codes
            .par_chunks_mut(self.inp.max(1))
            .enumerate()
            .for_each(|(r, row)| {
                let o = o0 + r;
                for (i, c) in row.iter_mut().enumerate() {
                    *c = match self.format {
                        QuantFormat::Int4Gptq => nibble(words[(i / 8) * words_per_row + r], i % 8),
                        QuantFormat::Int4Packed { .. } => {
                            nibble(words[r * words_per_row + i / 8], i % 8)
                        }
                        _ => nibble(
                            words[i * words_per_row + (o / 8 - first_word)],
                            field_of(self.format, o),
                        ),
                    };
                }
            });
        Ok(codes)
    }

    /// Whether elements `[from, from + count)` are all in the weight.
    pub(super) fn check_range(&self, from: usize, count: usize) -> Result<()> {
        let total = self.out * self.inp;
        if from.checked_add(count).is_none_or(|end| end > total) {
            return Err(self.err(format!(
                "elements {from}..{} asked for, it has {total}; the plan does not match these weights",
                from.saturating_add(count)
            )));
        }
        Ok(())
    }

    /// Calls `f(element, codes)` for the runs of elements `[from, from + count)` of the flat
    /// `[out, in]` weight's codes, a band at a time through `cache`.
    fn bands(
        &self,
        file: &ShardFile,
        cache: &BandCache,
        from: usize,
        count: usize,
        mut f: impl FnMut(usize, &[u8]),
    ) -> Result<()> {
        self.check_range(from, count)?;
        let band_len = self.band_rows * self.inp;
        let mut done = 0;
        while done < count {
            let at = from + done;
            let band = at / band_len;
            let codes = cache.get(&self.tensor, band, || {
                let o0 = band * self.band_rows;
                self.band_codes(file, o0, (o0 + self.band_rows).min(self.out))
            })?;
            let start = at - band * band_len;
            let n = (codes.len() - start).min(count - done);
            f(at, &codes[start..start + n]);
            done += n;
        }
        Ok(())
    }

    /// Elements `[from, from + out.len())` of the flat `[out, in]` weight, dequantized,
    /// through `cache`.
    pub(super) fn read(
        &self,
        file: &ShardFile,
        cache: &BandCache,
        from: usize,
        out: &mut [f32],
    ) -> Result<()> {
        let count = out.len();
        let mut dst = out.iter_mut();
        self.bands(file, cache, from, count, |at, codes| {
            for ((e, &code), v) in (at..).zip(codes).zip(&mut dst) {
                let (o, i) = (e / self.inp, e % self.inp);
                *v = self.value(code, self.group_of[i] as usize, o);
            }
        })
    }

    /// Codes `[from, from + out.len())` of the flat `[out, in]` weight, one a byte, through
    /// `cache`.
    pub(super) fn read_codes(
        &self,
        file: &ShardFile,
        cache: &BandCache,
        from: usize,
        out: &mut [u8],
    ) -> Result<()> {
        let mut done = 0;
        self.bands(file, cache, from, out.len(), |_, codes| {
            out[done..done + codes.len()].copy_from_slice(codes);
            done += codes.len();
        })
    }

    /// The value of `code` at output `o` in group `g`: `(code − zero) × scale`.
    #[inline]
    pub fn value(&self, code: u8, g: usize, o: usize) -> f32 {
        let at = g * self.out + o;
        (f32::from(code) - f32::from(self.zeros[at])) * self.scales[at]
    }

    /// The scale and the zero point of output `o` in group `g`.
    pub fn scale_zero(&self, g: usize, o: usize) -> (f32, u8) {
        let at = g * self.out + o;
        (self.scales[at], self.zeros[at])
    }

    /// Each input's group.
    pub fn group_of(&self) -> &[u32] {
        &self.group_of
    }

    /// The file index of `qweight`.
    pub(super) fn file(&self) -> usize {
        self.file
    }
}

/// A band's codes, with the weight and the band they are.
type Band = (String, usize, Arc<Vec<u8>>);

/// The bands of INT4 weights read last, newest last.
#[derive(Default)]
pub(super) struct BandCache {
    bands: Mutex<VecDeque<Band>>,
}

impl BandCache {
    /// Band `band` of `tensor`, from the cache or made by `decode` (outside the lock, so
    /// that ranks decode their bands in parallel).
    fn get(
        &self,
        tensor: &str,
        band: usize,
        decode: impl FnOnce() -> Result<Vec<u8>>,
    ) -> Result<Arc<Vec<u8>>> {
        if let Ok(bands) = self.bands.lock() {
            if let Some((_, _, v)) = bands.iter().find(|(t, b, _)| t == tensor && *b == band) {
                return Ok(v.clone());
            }
        }
        let values = Arc::new(decode()?);
        if let Ok(mut bands) = self.bands.lock() {
            if bands.len() == CACHED_BANDS {
                bands.pop_front();
            }
            bands.push_back((tensor.to_string(), band, values.clone()));
        }
        Ok(values)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::super::{Checkpoint, WeightSource};
    use super::*;
    use std::path::Path;

    /// A small xorshift stream, so the weights below are arbitrary but fixed.
    struct Stream(u64);
    impl Stream {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    /// An INT4 weight `w [out, inp]` quantized in `group`s of inputs: its codes, zeros and
    /// scales as the dequantization uses them, and each input's group.
    struct Made {
        codes: Vec<u8>,
        zeros: Vec<u8>,
        scales: Vec<f32>,
        group_of: Vec<usize>,
        /// Made in act order (compressed-tensors then stores `weight_g_idx`).
        scattered: bool,
        out: usize,
        inp: usize,
    }

    impl Made {
        fn new(out: usize, inp: usize, group: usize, scatter: bool, seed: u64) -> Made {
            let mut r = Stream(seed);
            let groups = inp / group;
            let mut group_of: Vec<usize> = (0..inp).map(|i| i / group).collect();
            if scatter {
                // Act order: the groups of a shuffled order of the inputs.
                for i in (1..inp).rev() {
                    group_of.swap(i, r.next() as usize % (i + 1));
                }
            }
            Made {
                codes: (0..out * inp).map(|_| (r.next() % 16) as u8).collect(),
                zeros: (0..groups * out)
                    .map(|_| 1 + (r.next() % 15) as u8)
                    .collect(),
                // Powers of two and odd f16 values, exact in f16.
                scales: (0..groups * out)
                    .map(|_| (1 + r.next() % 2000) as f32 / 4096.0)
                    .map(|v| half::f16::from_f32(v).to_f32())
                    .collect(),
                group_of,
                scattered: scatter,
                out,
                inp,
            }
        }

        fn value(&self, o: usize, i: usize) -> f32 {
            let at = self.group_of[i] * self.out + o;
            (self.codes[o * self.inp + i] as f32 - self.zeros[at] as f32) * self.scales[at]
        }

        fn values(&self) -> Vec<f32> {
            (0..self.out * self.inp)
                .map(|e| self.value(e / self.inp, e % self.inp))
                .collect()
        }

        /// The tensors of module `m` as `format` packs them.
        fn tensors(
            &self,
            m: &str,
            format: QuantFormat,
        ) -> Vec<(String, Dtype, Vec<usize>, Vec<u8>)> {
            let (out, inp) = (self.out, self.inp);
            let groups = self.zeros.len() / out;
            let le = |w: Vec<u32>| w.iter().flat_map(|w| w.to_le_bytes()).collect::<Vec<u8>>();
            // A word's field k holds element `at(k)`.
            let pack = |at: &dyn Fn(usize) -> u8| {
                (0..8).fold(0u32, |w, k| w | ((at(k) as u32) << (4 * k)))
            };
            let order = |k: usize| match format {
                QuantFormat::Int4Awq => AWQ_ORDER[k],
                _ => k,
            };
            let f16s = |v: &[f32]| -> Vec<u8> {
                v.iter()
                    .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                    .collect()
            };
            if let QuantFormat::Int4Packed { zero_points } = format {
                // compressed-tensors: rows of outputs, scales and zeros outputs first.
                let packed: Vec<u32> = (0..out * inp / 8)
                    .map(|w| {
                        let (o, p) = (w / (inp / 8), w % (inp / 8));
                        pack(&|k| self.codes[o * inp + 8 * p + k])
                    })
                    .collect();
                let by_output: Vec<f32> = (0..out * groups)
                    .map(|at| self.scales[(at % groups) * out + at / groups])
                    .collect();
                let shape: Vec<u8> = [out as i64, inp as i64]
                    .iter()
                    .flat_map(|d| d.to_le_bytes())
                    .collect();
                let mut t = vec![
                    (
                        format!("{m}.weight_packed"),
                        Dtype::I32,
                        vec![out, inp / 8],
                        le(packed),
                    ),
                    (
                        format!("{m}.weight_scale"),
                        Dtype::F16,
                        vec![out, groups],
                        f16s(&by_output),
                    ),
                    (format!("{m}.weight_shape"), Dtype::I64, vec![2], shape),
                ];
                if zero_points {
                    let zp: Vec<u32> = (0..out / 8 * groups)
                        .map(|w| {
                            let (j, g) = (w / groups, w % groups);
                            pack(&|k| self.zeros[g * out + 8 * j + k])
                        })
                        .collect();
                    t.push((
                        format!("{m}.weight_zero_point"),
                        Dtype::I32,
                        vec![out / 8, groups],
                        le(zp),
                    ));
                }
                if self.scattered {
                    let g: Vec<u32> = self.group_of.iter().map(|&g| g as u32).collect();
                    t.push((format!("{m}.weight_g_idx"), Dtype::I32, vec![inp], le(g)));
                }
                return t;
            }
            let minus = u8::from(format == QuantFormat::Int4Gptq);
            let qzeros: Vec<u32> = (0..groups * out / 8)
                .map(|w| {
                    let (g, j) = (w / (out / 8), w % (out / 8));
                    pack(&|k| self.zeros[g * out + 8 * j + order(k)] - minus)
                })
                .collect();
            let (qweight, shape): (Vec<u32>, Vec<usize>) = match format {
                QuantFormat::Int4Gptq => (
                    (0..inp / 8 * out)
                        .map(|w| {
                            let (p, o) = (w / out, w % out);
                            pack(&|k| self.codes[o * inp + 8 * p + k])
                        })
                        .collect(),
                    vec![inp / 8, out],
                ),
                _ => (
                    (0..inp * out / 8)
                        .map(|w| {
                            let (i, j) = (w / (out / 8), w % (out / 8));
                            pack(&|k| self.codes[(8 * j + order(k)) * inp + i])
                        })
                        .collect(),
                    vec![inp, out / 8],
                ),
            };
            let scales = f16s(&self.scales);
            let mut t = vec![
                (format!("{m}.qweight"), Dtype::I32, shape, le(qweight)),
                (
                    format!("{m}.qzeros"),
                    Dtype::I32,
                    vec![groups, out / 8],
                    le(qzeros),
                ),
                (format!("{m}.scales"), Dtype::F16, vec![groups, out], scales),
            ];
            if format == QuantFormat::Int4Gptq {
                let g: Vec<u32> = self.group_of.iter().map(|&g| g as u32).collect();
                t.push((format!("{m}.g_idx"), Dtype::I32, vec![inp], le(g)));
            }
            t
        }
    }

    fn write(dir: &Path, config: &str, tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)]) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("config.json"), config).unwrap();
        let views: Vec<_> = tensors
            .iter()
            .map(|(n, d, s, b)| {
                (
                    n.clone(),
                    safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, &None, &dir.join("model.safetensors")).unwrap();
    }

    fn temp(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("tpc-int4-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    /// Writes into `dir` a checkpoint holding one INT4 weight `w.weight [out, inp]` (random
    /// codes, zeros and scales) in `format`, in groups of `group` inputs (scattered in act
    /// order), with its config.json; gives the weight's values, row-major.
    pub(crate) fn write_int4_checkpoint(
        dir: &Path,
        format: QuantFormat,
        act_order: bool,
        [out, inp]: [usize; 2],
        group: usize,
        seed: u64,
    ) -> Vec<f32> {
        let mut made = Made::new(out, inp, group, act_order, seed);
        if !format.stores_zeros() {
            made.zeros.fill(8);
        }
        let config = match format {
            QuantFormat::Int4Awq => format!(
                r#"{{"quantization_config": {{"quant_method": "awq", "bits": 4, "group_size": {group}, "zero_point": true, "version": "gemm"}}}}"#
            ),
            QuantFormat::Int4Packed { zero_points } => {
                packed_config(!zero_points, if act_order { r#""group""# } else { "null" })
                    .replace("\"group_size\": 32", &format!("\"group_size\": {group}"))
            }
            _ => format!(
                r#"{{"quantization_config": {{"quant_method": "gptq", "bits": 4, "group_size": {group}, "desc_act": {act_order}}}}}"#
            ),
        };
        write(dir, &config, &made.tensors("w", format));
        made.values()
    }

    const GPTQ: &str = r#"{"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": false}}"#;
    const GPTQ_ACT: &str = r#"{"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": true}}"#;
    const AWQ: &str = r#"{"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": true, "version": "gemm"}}"#;

    /// A compressed-tensors W4A16 config: groups of 32, `symmetric` and `actorder` as given.
    fn packed_config(symmetric: bool, actorder: &str) -> String {
        format!(
            r#"{{"quantization_config": {{"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {{"group_0": {{"targets": ["Linear"], "input_activations": null, "weights": {{"type": "int", "num_bits": 4, "strategy": "group", "group_size": 32, "symmetric": {symmetric}, "dynamic": false, "actorder": {actorder}}}}}}}}}}}"#
        )
    }

    #[test]
    fn int4_weights_read_as_code_minus_zero_times_scale_in_every_packing() {
        let sym = QuantFormat::Int4Packed { zero_points: false };
        let asym = QuantFormat::Int4Packed { zero_points: true };
        for (name, format, config, scatter) in [
            ("gptq", QuantFormat::Int4Gptq, GPTQ.to_string(), false),
            (
                "gptq-act",
                QuantFormat::Int4Gptq,
                GPTQ_ACT.to_string(),
                true,
            ),
            ("awq", QuantFormat::Int4Awq, AWQ.to_string(), false),
            ("packed", sym, packed_config(true, "null"), false),
            (
                "packed-asym-act",
                asym,
                packed_config(false, r#""group""#),
                true,
            ),
            (
                "packed-weight-order",
                asym,
                packed_config(false, r#""weight""#),
                false,
            ),
        ] {
            // 24 outputs × 64 inputs: two groups, and bands of 256 / 64 = 4 → 8 rows.
            let mut made = Made::new(24, 64, 32, scatter, 7);
            if !format.stores_zeros() {
                made.zeros.fill(8);
            }
            let config = config.as_str();
            let dir = temp(name);
            write(&dir, config, &made.tensors("l", format));
            let ckpt = Checkpoint::open(&dir).unwrap();
            let want = made.values();
            let mut all = Vec::new();
            ckpt.read("l.weight", 0, want.len(), &mut all).unwrap();
            assert_eq!(all, want, "{name}");
            // From inside a row, across bands; and one row's inputs 40..50 (a row split).
            let mut part = Vec::new();
            ckpt.read("l.weight", 500, 700, &mut part).unwrap();
            assert_eq!(part, want[500..1200], "{name}");
            part.clear();
            ckpt.read("l.weight", 17 * 64 + 40, 10, &mut part).unwrap();
            assert_eq!(part, want[17 * 64 + 40..17 * 64 + 50], "{name}");
            let mut b = Vec::new();
            ckpt.read_bf16("l.weight", 0, want.len(), &mut b).unwrap();
            assert!(b
                .iter()
                .zip(&want)
                .all(|(b, &w)| *b == half::bf16::from_f32(w)));
            // Past the end: an error naming the weight, before anything is allocated.
            let e = ckpt
                .read("l.weight", 1000, 1 << 40, &mut part)
                .unwrap_err()
                .to_string();
            assert!(e.contains("l.weight") && e.contains("asked for"), "{e}");
            assert!(ckpt.quant_scales("l.weight").unwrap().is_none());
            let _ = std::fs::remove_dir_all(&dir);
        }
    }

    /// The refusal reading `l.weight` of a copy of a GPTQ weight's tensors edited by `edit`.
    fn refusal(
        name: &str,
        config: &str,
        edit: impl Fn(&mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>),
    ) -> String {
        let made = Made::new(16, 64, 32, false, 3);
        let mut t = made.tensors("l", QuantFormat::Int4Gptq);
        edit(&mut t);
        let dir = temp(name);
        write(&dir, config, &t);
        let ckpt = Checkpoint::open(&dir).unwrap();
        let e = ckpt
            .read("l.weight", 0, 8, &mut Vec::new())
            .unwrap_err()
            .to_string();
        let _ = std::fs::remove_dir_all(&dir);
        e
    }

    #[test]
    fn int4_tensors_that_do_not_fit_are_refused_before_any_code_is_read() {
        // Zeros for three groups of a weight with two.
        let e = refusal("zeros", GPTQ, |t| {
            t[1].2 = vec![3, 2];
            t[1].3.extend([0u8; 8]);
        });
        assert!(e.contains("l.qzeros") && e.contains("zeros [2, 2]"), "{e}");
        // Scales stored as I32.
        let e = refusal("scales", GPTQ, |t| {
            t[2].1 = Dtype::I32;
            t[2].2 = vec![2, 8];
        });
        assert!(
            e.contains("l.scales") && e.contains("F16 or BF16 or F32"),
            "{e}"
        );
        // A group past the last.
        let e = refusal("g_idx", GPTQ, |t| t[3].3[0] = 9);
        assert!(
            e.contains("input 0 is in group 9") && e.contains("2 group(s)"),
            "{e}"
        );
        // A missing g_idx is read as consecutive groups, unless the inputs are in act order.
        let e = refusal("act", GPTQ_ACT, |t| {
            t.pop();
        });
        assert!(e.contains("`l.g_idx` is missing"), "{e}");
        let e = refusal("scales-missing", GPTQ, |t| {
            t.remove(2);
        });
        assert!(e.contains("`l.scales` is missing"), "{e}");
        // A non-finite scale.
        let e = refusal("nan", GPTQ, |t| {
            t[2].3[0..2].copy_from_slice(&half::f16::NAN.to_le_bytes());
        });
        assert!(e.contains("scale 0 is NaN"), "{e}");
        // A group size the zeros do not fit.
        let e = refusal("group", &GPTQ.replace("32", "16"), |_| {});
        assert!(
            e.contains("4 group(s)") && e.contains("do not match"),
            "{e}"
        );
    }
}
