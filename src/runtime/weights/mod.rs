//! Hugging Face checkpoints: `model.safetensors` or a sharded
//! `model.safetensors.index.json`. Every tensor a plan needs is checked before any compute;
//! each rank then reads only its slices, with `pread` (see [`file`] for why not a memory
//! map), converting to what it computes with.

mod error;
mod file;
mod fp8;
mod identity;
mod int4;
mod stored;

pub use error::WeightError;
pub use fp8::{e4m3_to_f32, BlockScales};
#[cfg(test)]
pub(crate) use int4::tests::write_int4_checkpoint;
pub use int4::Int4Weight;
pub use stored::{StoredDtype, StoredRows};

use super::tensor::Tensor;

/// What reading weights returns.
pub type WeightResult<T> = std::result::Result<T, WeightError>;
type Result<T> = WeightResult<T>;
use crate::plan::{Plan, WeightSlice};
use file::ShardFile;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;
use safetensors::tensor::TensorInfo;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use stored::{decode_bf16, decode_f32};

/// An opened checkpoint directory.
pub struct Checkpoint {
    dir: PathBuf,
    files: Vec<ShardFile>,
    /// Tensor name → file index.
    index: HashMap<String, usize>,
    /// A quantized checkpoint's format, scale blocks and scale names (its `config.json`'s
    /// `quantization_config`).
    quant: Option<crate::ir::Quantization>,
    /// Each quantized weight's scales, read once.
    scales: Mutex<HashMap<String, Arc<BlockScales>>>,
    /// Each INT4 weight's layout, scales, zeros and groups, read once.
    int4: Mutex<HashMap<String, Arc<int4::Int4Weight>>>,
    /// INT4 weights' bands read last.
    bands: int4::BandCache,
    /// compressed-tensors' 8-bit `pack-quantized` (W8A16) weights: `<m>.weight` → the file
    /// of `<m>.weight_packed` and those int32 words read as I8 `[out, 4 · words]` (a word's
    /// byte `k` is input `4p + k`), each byte the value plus 128 (flipped back as read).
    biased_bytes: HashMap<String, (usize, TensorInfo)>,
}

/// The W8A16 weights among `index`'s tensors (see `Checkpoint::biased_bytes`): every 2-D
/// I32 `<m>.weight_packed` of an INT8 checkpoint whose `<m>.weight` is not stored.
fn biased_bytes_of(
    files: &[ShardFile],
    index: &HashMap<String, usize>,
    quant: Option<&crate::ir::Quantization>,
) -> HashMap<String, (usize, TensorInfo)> {
    let mut out = HashMap::new();
    if quant.is_none_or(|q| q.format != crate::ir::QuantFormat::Int8) {
        return out;
    }
    for (name, &f) in index {
        let Some(stem) = name.strip_suffix(".weight_packed") else {
            continue;
        };
        let weight = format!("{stem}.weight");
        let Some(info) = files.get(f).and_then(|file| file.meta.info(name)) else {
            continue;
        };
        if let (safetensors::Dtype::I32, &[rows, words]) = (info.dtype, &info.shape[..]) {
            if index.contains_key(&weight) {
                continue;
            }
            let bytes = TensorInfo {
                dtype: safetensors::Dtype::I8,
                shape: vec![rows, words.saturating_mul(4)],
                data_offsets: info.data_offsets,
            };
            out.insert(weight, (f, bytes));
        }
    }
    out
}

fn file_err(path: &Path, problem: impl Into<String>) -> WeightError {
    WeightError::File {
        path: path.to_path_buf(),
        problem: problem.into(),
    }
}

fn open_file(path: &Path) -> Result<ShardFile> {
    let file = ShardFile::open(path)?;
    // The header check saw the offsets tile the data exactly; this is kept anyway so that
    // nothing below relies on that.
    let data_len = file.size.saturating_sub(file.data_start);
    for (name, info) in file.meta.tensors() {
        let (start, end) = info.data_offsets;
        if start > end || end as u64 > data_len {
            return Err(WeightError::Tensor {
                path: path.to_path_buf(),
                tensor: name,
                problem: format!(
                    "the file is truncated or corrupt: the tensor spans bytes {start}..{end} of {data_len} data bytes"
                ),
            });
        }
    }
    Ok(file)
}

/// A quantized checkpoint's quantization, from the `quantization_config` of the
/// `config.json` beside its weights (as the model's frontend reads it); `None` without one.
/// A config that does not parse is the model loader's to report.
fn quantization_of(dir: &Path) -> Result<Option<crate::ir::Quantization>> {
    let path = dir.join("config.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(None);
    };
    let Ok(json) = serde_json::from_str::<serde_json::Value>(&text) else {
        return Ok(None);
    };
    Ok(crate::frontend::hf_config::quantization_in(&path, &json)?)
}

/// Elements per scale along each dim of a 2-D weight of `shape` quantized in `block`s (a
/// block of 0 is the whole dim: a scale per output channel).
fn elements_per_scale(block: [u64; 2], shape: [usize; 2]) -> [usize; 2] {
    [0, 1].map(|d| match block[d] as usize {
        0 => shape[d].max(1),
        b => b,
    })
}

/// Resolves an index's file name inside the checkpoint folder. Names that would leave it
/// are refused, so a downloaded index cannot make tpc read elsewhere: absolute paths, `..`,
/// and subfolders that are links to outside the folder (the folder each file is in must be
/// the model folder or under it, after resolving links). The file itself may be a link, as
/// the Hugging Face cache makes every file a link into its blob store.
fn shard_path(dir: &Path, index_path: &Path, name: &str) -> Result<PathBuf> {
    let relative = Path::new(name);
    let outside = || {
        file_err(
            index_path,
            format!("`weight_map` names the file `{name}`, which is not inside the model folder; an index may name only files beside it"),
        )
    };
    let stays_inside = !name.is_empty()
        && relative
            .components()
            .all(|c| matches!(c, std::path::Component::Normal(_)));
    if !stays_inside {
        return Err(outside());
    }
    let path = dir.join(relative);
    let folder = path.parent().unwrap_or(dir);
    let canonical = |p: &Path| {
        p.canonicalize().map_err(|io| crate::error::TpcError::Read {
            path: p.to_path_buf(),
            io,
        })
    };
    if !canonical(folder)?.starts_with(canonical(dir)?) {
        return Err(outside());
    }
    Ok(path)
}

impl Checkpoint {
    /// Opens `dir/model.safetensors`, or every file named by `dir/model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let single = dir.join("model.safetensors");
        let index_path = dir.join("model.safetensors.index.json");
        let mut files = Vec::new();
        let mut index = HashMap::new();
        if index_path.exists() {
            let text = crate::fsio::read_text(&index_path)?;
            let json: serde_json::Value = crate::frontend::load::parse_json(&index_path, &text)?;
            let map = json
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| file_err(&index_path, "has no `weight_map` object"))?;
            let mut names: Vec<&str> = map.values().filter_map(|v| v.as_str()).collect();
            names.sort_unstable();
            names.dedup();
            let mut file_of = HashMap::new();
            for name in names {
                file_of.insert(name.to_string(), files.len());
                files.push(open_file(&shard_path(dir, &index_path, name)?)?);
            }
            for (tensor, file) in map {
                let file = file.as_str().ok_or_else(|| {
                    file_err(&index_path, format!("`{tensor}` maps to a non-string"))
                })?;
                index.insert(tensor.clone(), file_of[file]);
            }
        } else if single.exists() {
            files.push(open_file(&single)?);
            for name in files[0].meta.tensors().into_keys() {
                index.insert(name, 0);
            }
        } else {
            return Err(file_err(
                dir,
                "has neither model.safetensors nor model.safetensors.index.json; give a directory saved by `save_pretrained` with safe_serialization",
            ));
        }
        let quant = quantization_of(dir)?;
        let biased_bytes = biased_bytes_of(&files, &index, quant.as_ref());
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            files,
            index,
            quant,
            scales: Mutex::default(),
            int4: Mutex::default(),
            bands: int4::BandCache::default(),
            biased_bytes,
        })
    }

    /// The checkpoint in `dir` if it has one (`None` when `dir` is not a directory or holds
    /// no safetensors weights); a checkpoint that is there but broken is an error.
    pub fn find(dir: &Path) -> Result<Option<Checkpoint>> {
        let has_weights = dir.is_dir()
            && (dir.join("model.safetensors").exists()
                || dir.join("model.safetensors.index.json").exists());
        if has_weights {
            Checkpoint::open(dir).map(Some)
        } else {
            Ok(None)
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The stored name for a tensor the plan names: exact, or without GPT-2's
    /// `transformer.` prefix (the published GPT-2 checkpoints omit it).
    fn resolve(&self, tensor: &str) -> Option<(&str, usize)> {
        if let Some((k, &f)) = self.index.get_key_value(tensor) {
            return Some((k.as_str(), f));
        }
        if let Some((k, (f, _))) = self.biased_bytes.get_key_value(tensor) {
            return Some((k.as_str(), *f));
        }
        let short = tensor.strip_prefix("transformer.")?;
        self.index
            .get_key_value(short)
            .map(|(k, &f)| (k.as_str(), f))
    }

    /// A tensor the checkpoint stores in a quantized layout in place of `tensor` (GPTQ's and
    /// AWQ's `qweight`, compressed-tensors' `weight_packed`, FP8's `weight_scale_inv`).
    fn quantized_sibling(&self, tensor: &str) -> Option<String> {
        let stem = tensor.strip_suffix(".weight").unwrap_or(tensor);
        [
            format!("{stem}.qweight"),
            format!("{stem}.weight_packed"),
            format!("{stem}.weight_scale"),
            format!("{tensor}_scale_inv"),
        ]
        .into_iter()
        .find(|name| self.resolve(name).is_some())
    }

    /// The INT4 weight `tensor` (`<module>.weight`) of a GPTQ, AWQ or compressed-tensors
    /// checkpoint, stored as `<module>.qweight` (`weight_packed`) and its companions; `None`
    /// for a tensor stored as itself (an
    /// unquantized one, or any in a checkpoint of another format). Its small tensors are
    /// read and checked once.
    fn int4(&self, tensor: &str) -> Result<Option<Arc<int4::Int4Weight>>> {
        let Some(q) = self.quant.as_ref().filter(|q| q.format.is_int4()) else {
            return Ok(None);
        };
        let Some(stem) = tensor.strip_suffix(".weight") else {
            return Ok(None);
        };
        if self.resolve(tensor).is_some() {
            return Ok(None);
        }
        let names = int4::part_names(q.format);
        let qweight = format!("{stem}.{}", names[0]);
        let Some((_, file_index)) = self.resolve(&qweight) else {
            return Ok(None);
        };
        if let Some(w) = self.int4.lock().ok().and_then(|m| m.get(tensor).cloned()) {
            return Ok(Some(w));
        }
        let part = |suffix: &str| {
            let name = format!("{stem}.{suffix}");
            let (file, info) = self.info(&name).ok()?;
            Some(int4::Part { file, info, name })
        };
        let w = Arc::new(int4::Int4Weight::open(
            tensor,
            q.format,
            q.block[1],
            q.act_order,
            [
                part(names[0]),
                part(names[1]),
                part(names[2]),
                part(names[3]),
                part("weight_shape")
                    .filter(|_| matches!(q.format, crate::ir::QuantFormat::Int4Packed { .. })),
            ],
            file_index,
            |name| self.tensor(name)?.values(),
        )?);
        if let Ok(mut m) = self.int4.lock() {
            m.insert(tensor.to_string(), w.clone());
        }
        Ok(Some(w))
    }

    fn info(&self, tensor: &str) -> Result<(&ShardFile, &TensorInfo)> {
        let (name, f) = self.resolve(tensor).ok_or_else(|| WeightError::Tensor {
            path: self.dir.clone(),
            tensor: tensor.to_string(),
            problem: match self.quantized_sibling(tensor) {
                Some(q) => format!(
                    "missing from the checkpoint, which holds `{q}` instead: it is quantized, in a layout {}; use the config.json that came with these weights, or the model's unquantized release",
                    match &self.quant {
                        None => "its config.json does not state (no `quantization_config`)".to_string(),
                        Some(c) => format!("other than the {} its config.json states", c.format.name()),
                    }
                ),
                None => "missing from the checkpoint; the model definition does not match these weights"
                    .into(),
            },
        })?;
        let file = &self.files[f];
        if let Some((_, info)) = self.biased_bytes.get(name) {
            return Ok((file, info));
        }
        let info = file.meta.info(name).ok_or_else(|| WeightError::Tensor {
            path: file.path.clone(),
            tensor: tensor.to_string(),
            problem: "listed in the index but missing from its file".into(),
        })?;
        Ok((file, info))
    }

    /// A tensor tpc can read: its file, how it is stored, where its data starts in the file
    /// and how many elements it has, checked against its shape and dtype and the file's
    /// length with checked arithmetic: a corrupt header gives an error, never a panic or a
    /// read outside the file.
    fn tensor<'a>(&'a self, tensor: &'a str) -> Result<TensorSpan<'a>> {
        let (file, info) = self.info(tensor)?;
        let bad = |problem: String| WeightError::Tensor {
            path: file.path.clone(),
            tensor: tensor.to_string(),
            problem,
        };
        let dtype = StoredDtype::of(info.dtype).ok_or_else(|| {
            let name = format!("{:?}", info.dtype);
            // 8-bit floats and small integers hold quantized weights.
            let quantized = name.starts_with("F8")
                || name.starts_with("F4")
                || matches!(name.as_str(), "I8" | "U8" | "I32" | "U32" | "I4" | "U4");
            bad(format!(
                "has dtype {name}; tpc reads F32, BF16 and F16, and F8_E4M3 or I8 with scales{}",
                if quantized {
                    " (this looks like a quantized checkpoint in a format tpc does not read; use the model's unquantized release or dequantize this one first)"
                } else {
                    ""
                }
            ))
        })?;
        let scales = match (dtype, &self.quant) {
            (StoredDtype::F8E4m3 | StoredDtype::I8, Some(q)) if q.format == dtype.quant_format() => {
                Some(self.block_scales(tensor, &info.shape, dtype, q)?)
            }
            (StoredDtype::F8E4m3 | StoredDtype::I8, q) => {
                return Err(bad(format!(
                    "is stored as {:?}, but the checkpoint's config.json {}, so its scales are unknown; use the config.json that came with these weights",
                    info.dtype,
                    match q {
                        None => format!("has no {} `quantization_config`", dtype.quant_word()),
                        Some(q) => format!("says its weights are {}", q.format.name()),
                    }
                )))
            }
            _ => None,
        };
        let (start, end) = info.data_offsets;
        let at = |o: usize| file.data_start.checked_add(o as u64);
        let offset = at(start)
            .zip(at(end))
            .filter(|(a, b)| a <= b && *b <= file.size)
            .map(|(a, _)| a)
            .ok_or_else(|| {
                bad(format!(
                    "its data offsets {start}..{end} lie outside the file; the file is corrupt"
                ))
            })?;
        let want = info
            .shape
            .iter()
            .try_fold(dtype.size(), |n, &d| n.checked_mul(d));
        if want != Some(end - start) {
            return Err(bad(format!(
                "its byte length {} does not match its shape {:?} and dtype {:?}; the file is corrupt",
                end - start,
                info.shape,
                info.dtype
            )));
        }
        Ok(TensorSpan {
            file,
            name: tensor,
            dtype,
            offset,
            len: (end - start) / dtype.size(),
            scales,
            biased: self
                .resolve(tensor)
                .is_some_and(|(k, _)| self.biased_bytes.contains_key(k)),
        })
    }

    /// The scales of the quantized weight `tensor` stored `shape` as `dtype` in `q`'s
    /// blocks, from its scale tensor (checked: 2-D, one scale per block, a dtype tpc reads,
    /// finite), read once.
    fn block_scales(
        &self,
        tensor: &str,
        shape: &[usize],
        dtype: StoredDtype,
        q: &crate::ir::Quantization,
    ) -> Result<Arc<BlockScales>> {
        if let Some(s) = self.scales.lock().ok().and_then(|m| m.get(tensor).cloned()) {
            return Ok(s);
        }
        let name = format!("{tensor}{}", q.scales.suffix());
        let (file, info) = self.info(&name).map_err(|_| WeightError::Tensor {
            path: self.dir.clone(),
            tensor: tensor.to_string(),
            problem: format!(
                "is stored as {dtype:?} but its scales `{name}` are missing from the checkpoint; the checkpoint is incomplete"
            ),
        })?;
        let &[rows, cols] = shape else {
            return Err(WeightError::Tensor {
                path: file.path.clone(),
                tensor: tensor.to_string(),
                problem: format!("is stored as {dtype:?} with shape {shape:?}; tpc reads quantized 2-D weights only"),
            });
        };
        let block = elements_per_scale(q.block, [rows, cols]);
        let want = [rows.div_ceil(block[0]), cols.div_ceil(block[1])];
        if info.shape != want {
            return Err(WeightError::Tensor {
                path: file.path.clone(),
                tensor: name,
                problem: format!(
                    "has shape {:?}; a {rows} × {cols} weight with a scale per {} has {want:?} scales; the checkpoint and its config.json do not match",
                    info.shape,
                    crate::ir::quant::describe_block(q.block)
                ),
            });
        }
        // Checked before reading it as a tensor, so that scales of scales never recurse.
        if !matches!(
            StoredDtype::of(info.dtype),
            Some(StoredDtype::F32 | StoredDtype::Bf16 | StoredDtype::F16)
        ) {
            return Err(WeightError::Tensor {
                path: file.path.clone(),
                tensor: name,
                problem: format!(
                    "has dtype {:?}; {} scales are F32, BF16 or F16",
                    info.dtype,
                    dtype.quant_word()
                ),
            });
        }
        let span = self.tensor(&name)?;
        let values = span.values()?;
        if let Some(bad) = values.iter().position(|v| !v.is_finite()) {
            return Err(span.err(format!(
                "scale {bad} is {}; a corrupt checkpoint (every scale of a quantized weight is a finite number)",
                values[bad]
            )));
        }
        let scales = Arc::new(BlockScales {
            format: dtype.quant_format(),
            block,
            cols,
            per_row: want[1],
            values,
        });
        if let Ok(mut m) = self.scales.lock() {
            m.insert(tensor.to_string(), scales.clone());
        }
        Ok(scales)
    }

    /// Checks every tensor every rank needs: present, the expected shape, a dtype tpc reads.
    pub fn check(&self, plan: &Plan) -> Result<()> {
        let mut seen = std::collections::HashSet::new();
        for w in plan.ranks.iter().flat_map(|r| &r.weights) {
            if !seen.insert(&*w.tensor) {
                continue;
            }
            // A stack of experts is checked as the experts' own tensors.
            let tensors = crate::plan::experts::expert_tensors(&w.tensor, &w.shape)
                .unwrap_or_else(|| vec![(w.tensor.to_string(), w.shape.clone())]);
            for (tensor, shape) in tensors {
                self.check_packed_shape(&tensor, &shape)?;
                if let Some(int4) = self.int4(&tensor)? {
                    self.check_int4(&int4, &tensor, &shape, w.quant)?;
                    continue;
                }
                let (file, info) = self.info(&tensor)?;
                let expected: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
                if info.shape != expected {
                    return Err(WeightError::Tensor {
                        path: file.path.clone(),
                        tensor,
                        problem: format!(
                            "has shape {:?}, the model expects {expected:?}",
                            info.shape
                        ),
                    });
                }
                let span = self.tensor(&tensor)?;
                // A plan compiled for other blocks split this weight for them.
                if let (Some(q), Some(s)) = (&w.quant, &span.scales) {
                    let rows = info.shape.first().copied().unwrap_or(0);
                    let planned = elements_per_scale(q.block, [rows, s.cols]);
                    if planned != s.block || q.format != span.dtype.quant_format() {
                        return Err(span.err(format!(
                            "is stored as {} in blocks of {} × {}, the plan was compiled for blocks of {} × {} ({}); compile the plan from this checkpoint's config.json",
                            span.dtype.quant_format().name(),
                            s.block[0],
                            s.block[1],
                            planned[0],
                            planned[1],
                            q.format.name()
                        )));
                    }
                }
            }
        }
        Ok(())
    }
}

impl Checkpoint {
    /// The packed codes (`qweight`, `weight_packed`) of an INT4 weight `tensor` against the
    /// shape the plan gives the weight,
    /// before its other tensors are read (a packed tensor of the wrong length is named as
    /// such, not by the companion it then disagrees with).
    fn check_packed_shape(&self, tensor: &str, shape: &[u64]) -> Result<()> {
        let (Some(q), Some(stem)) = (
            self.quant.as_ref().filter(|q| q.format.is_int4()),
            tensor.strip_suffix(".weight"),
        ) else {
            return Ok(());
        };
        let qweight = format!("{stem}.{}", int4::part_names(q.format)[0]);
        if self.resolve(tensor).is_some() || self.resolve(&qweight).is_none() {
            return Ok(());
        }
        let (file, info) = self.info(&qweight)?;
        let dims: Option<[usize; 2]> = match shape {
            [out, inp] => usize::try_from(*out)
                .ok()
                .zip(usize::try_from(*inp).ok())
                .map(|(o, i)| [o, i]),
            _ => None,
        };
        let want = dims.and_then(|d| int4::packed_shape(q.format, d));
        if want.is_none_or(|w| info.shape[..] != w[..]) {
            return Err(WeightError::Tensor {
                path: file.path.clone(),
                tensor: qweight,
                problem: format!(
                    "has shape {:?}; the model's {shape:?} weight packed as {} has {}; the checkpoint and the model do not match",
                    info.shape,
                    q.format.name(),
                    want.map_or("no such packing (a dim is not a multiple of 8)".to_string(), |w| format!("{w:?}"))
                ),
            });
        }
        Ok(())
    }

    /// An INT4 weight against the plan: its `[out, in]` and the format the plan was
    /// compiled for.
    fn check_int4(
        &self,
        w: &int4::Int4Weight,
        tensor: &str,
        shape: &[u64],
        planned: Option<crate::ir::Quantized>,
    ) -> Result<()> {
        let err = |problem: String| WeightError::Tensor {
            path: self.dir.clone(),
            tensor: tensor.to_string(),
            problem,
        };
        let stored = w.shape().map(|d| d as u64);
        if shape != stored {
            return Err(err(format!(
                "is a {} weight of shape {stored:?} (from its packed codes), the model expects {shape:?}",
                w.format().name()
            )));
        }
        match planned {
            Some(q) if q.format == w.format() => Ok(()),
            other => Err(err(format!(
                "is stored as {}, the plan was compiled for {}; compile the plan from this checkpoint's config.json",
                w.format().name(),
                other.map_or("an unquantized weight".to_string(), |q| q.format.name().to_string())
            ))),
        }
    }
}

/// Where a checked tensor's elements lie in its file.
struct TensorSpan<'a> {
    file: &'a ShardFile,
    name: &'a str,
    dtype: StoredDtype,
    /// The file offset of element 0.
    offset: u64,
    /// Elements stored.
    len: usize,
    /// An FP8 weight's block scales: its elements are their e4m3 values times these.
    scales: Option<Arc<BlockScales>>,
    /// Bytes stored as the value plus 128 (W8A16's `weight_packed`): flipped as read.
    biased: bool,
}

/// Stored bytes of the value plus 128 → the value's i8 bits.
fn unbias(bytes: &mut [u8]) {
    for b in bytes {
        *b ^= 0x80;
    }
}

/// Bytes read from a file per `pread` when a read is split, so that reads of large tensors
/// run on several threads and a conversion's scratch stays small.
const READ_CHUNK: usize = 1 << 20;

impl TensorSpan<'_> {
    fn err(&self, problem: String) -> WeightError {
        WeightError::Tensor {
            path: self.file.path.clone(),
            tensor: self.name.to_string(),
            problem,
        }
    }

    /// Every element as f32 (a small tensor read whole: scales).
    fn values(&self) -> Result<Vec<f32>> {
        let mut values = Vec::new();
        self.bytes_of(0, self.len)?;
        append(&mut values, self.len, |dst| {
            self.read_into(0, dst, decode_f32)
        })?;
        Ok(values)
    }

    /// The file offset and byte length of elements `[from, from + count)`, or an error
    /// naming the tensor when they are not all in it.
    fn bytes_of(&self, from: usize, count: usize) -> Result<(u64, usize)> {
        let size = self.dtype.size();
        from.checked_add(count)
            .filter(|&end| end <= self.len)
            // In range: the tensor's bytes fit in the file, so in u64 and in usize.
            .map(|_| (self.offset + (from * size) as u64, count * size))
            .ok_or_else(|| {
                self.err(format!(
                    "elements {from}..{} asked for, it has {}; the plan does not match these weights",
                    from.saturating_add(count),
                    self.len
                ))
            })
    }

    /// Elements `[from, from + out.len())` converted by `decode`, read a chunk at a time.
    fn read_into<T>(
        &self,
        from: usize,
        out: &mut [T],
        decode: impl Fn(StoredDtype, &[u8], &mut [T]),
    ) -> Result<()> {
        let (offset, bytes) = self.bytes_of(from, out.len())?;
        let size = self.dtype.size();
        let per_chunk = READ_CHUNK / size;
        let mut scratch = vec![0u8; bytes.min(per_chunk * size)];
        for (i, dst) in out.chunks_mut(per_chunk).enumerate() {
            let buf = &mut scratch[..dst.len() * size];
            self.file
                .read_exact_at(offset + (i * per_chunk * size) as u64, buf)?;
            if self.biased {
                unbias(buf);
            }
            decode(self.dtype, buf, dst);
        }
        Ok(())
    }

    /// Local rows `rows` of the 2-D slice `layout` of this tensor into `into`, in its stored
    /// encoding, padding as zero bytes: each run of stored elements is read straight into
    /// its place, consecutive runs joined, the reads spread over threads.
    fn read_rows(
        &self,
        layout: &SliceLayout,
        rows: std::ops::Range<usize>,
        into: &mut StoredRows,
    ) -> Result<()> {
        if rows.start > rows.end || rows.end > layout.rows {
            return Err(self.err(format!(
                "rows {rows:?} asked for, the slice has {}",
                layout.rows
            )));
        }
        let size = self.dtype.size();
        let cols = layout.cols;
        let bytes = rows
            .len()
            .checked_mul(cols)
            .and_then(|n| n.checked_mul(size))
            .ok_or_else(|| {
                self.err(format!(
                    "{} rows of {cols} overflow the address space",
                    rows.len()
                ))
            })?;
        // Only grows the buffer's zeroed part; padding is zeroed below, the rest is read.
        into.bytes.resize(bytes, 0);
        // (file offset, offset in the batch, bytes), in increasing batch offsets.
        let mut runs: Vec<(u64, usize, usize)> = Vec::new();
        // An FP8 weight's stored pieces (first element, element in the batch, count), for
        // their scales.
        let mut scaled: Vec<(usize, usize, usize)> = Vec::new();
        for r in rows.clone() {
            let buffer = &mut into.bytes;
            layout.pieces(r, 0, cols, |at, piece| {
                // In range: r - start < rows.len(), at + len ≤ cols.
                let here = ((r - rows.start) * cols + at) * size;
                match piece {
                    Piece::Zeros { len } => buffer[here..here + len * size].fill(0),
                    Piece::Stored { from, len } => {
                        if self.scales.is_some() {
                            scaled.push((from, here / size, len));
                        }
                        let (file_at, n) = self.bytes_of(from, len)?;
                        match runs.last_mut() {
                            Some(last)
                                if last.0 + last.2 as u64 == file_at && last.1 + last.2 == here =>
                            {
                                last.2 += n
                            }
                            _ => runs.push((file_at, here, n)),
                        }
                    }
                }
                Ok(())
            })?;
        }
        // The runs' places in the buffer, carved apart so that each read has its own.
        let mut reads: Vec<(u64, &mut [u8])> = Vec::with_capacity(runs.len());
        let mut rest: &mut [u8] = &mut into.bytes;
        let mut done = 0;
        for (file_at, here, n) in runs {
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(here - done);
            let (dst, tail) = tail.split_at_mut(n);
            rest = tail;
            done = here + n;
            for (i, chunk) in dst.chunks_mut(READ_CHUNK).enumerate() {
                reads.push((file_at + (i * READ_CHUNK) as u64, chunk));
            }
        }
        reads.into_par_iter().try_for_each(|(at, dst)| {
            self.file.read_exact_at(at, dst)?;
            if self.biased {
                unbias(dst);
            }
            Ok::<_, WeightError>(())
        })?;
        into.dtype = self.dtype;
        if let (Some(scales), false) = (&self.scales, into.keep_codes) {
            into.bytes = dequantize_rows(self.dtype, &into.bytes, cols, &scaled, scales);
            into.dtype = StoredDtype::F32;
        }
        into.first = rows.start;
        into.rows = rows.len();
        into.cols = cols;
        if into.tensor != self.name {
            into.tensor = self.name.to_string();
            into.path = self.file.path.clone();
        }
        Ok(())
    }
}

impl WeightSource for Checkpoint {
    fn check(&self, plan: &Plan) -> Result<()> {
        Checkpoint::check(self, plan)
    }

    fn read(&self, tensor: &str, from: usize, count: usize, out: &mut Vec<f32>) -> Result<()> {
        if let Some(w) = self.int4(tensor)? {
            // Checked first: `count` sizes the allocation.
            w.check_range(from, count)?;
            return append(out, count, |dst| {
                w.read(&self.files[w.file()], &self.bands, from, dst)
            });
        }
        let t = self.tensor(tensor)?;
        // Checked first: `count` sizes the allocation.
        t.bytes_of(from, count)?;
        append(out, count, |dst| {
            t.read_into(from, dst, decode_f32)?;
            if let Some(scales) = &t.scales {
                scales.apply(from, dst);
            }
            Ok(())
        })
    }

    fn read_bf16(
        &self,
        tensor: &str,
        from: usize,
        count: usize,
        out: &mut Vec<half::bf16>,
    ) -> Result<()> {
        if self.int4(tensor)?.is_some() {
            return bf16_through_f32(self, tensor, from, count, out);
        }
        let t = self.tensor(tensor)?;
        t.bytes_of(from, count)?;
        if t.scales.is_some() {
            // Scaled in f32, then rounded.
            return bf16_through_f32(self, tensor, from, count, out);
        }
        append(out, count, |dst| {
            t.read_into(from, dst.reinterpret_cast_mut(), decode_bf16)
        })
    }

    fn read_stored_rows(
        &self,
        w: &WeightSlice,
        rows: std::ops::Range<usize>,
        into: &mut StoredRows,
    ) -> Result<bool> {
        // Dequantized a band at a time through `read`.
        if self.int4(&w.tensor)?.is_some() {
            return Ok(false);
        }
        let layout = SliceLayout::new(w)?;
        let t = self.tensor(&w.tensor)?;
        // The layout's ranges were checked against `w.shape`; that is the stored shape.
        let (_, info) = self.info(&w.tensor)?;
        if !info
            .shape
            .iter()
            .map(|&d| d as u64)
            .eq(w.shape.iter().copied())
        {
            return Err(t.err(format!(
                "has shape {:?}, the plan's slice expects {:?}",
                info.shape, w.shape
            )));
        }
        t.read_rows(&layout, rows, into)?;
        Ok(true)
    }

    fn quant_scales(&self, tensor: &str) -> Result<Option<Arc<BlockScales>>> {
        if self.int4(tensor)?.is_some() {
            return Ok(None);
        }
        Ok(self.tensor(tensor)?.scales)
    }

    fn int4_weight(&self, tensor: &str) -> Result<Option<Arc<Int4Weight>>> {
        self.int4(tensor)
    }

    fn read_int4_codes(&self, tensor: &str, from: usize, out: &mut [u8]) -> Result<()> {
        match self.int4(tensor)? {
            Some(w) => w.read_codes(&self.files[w.file()], &self.bands, from, out),
            None => Err(self
                .tensor(tensor)?
                .err("is not stored as INT4 codes; report this as a bug".into())),
        }
    }
}

/// A batch of quantized rows (`cols` codes of `dtype` each) as the weight's values in
/// little-endian f32 bytes: each stored piece `(first element, element in the batch, count)`
/// decoded and scaled, padding zero; a row per task.
fn dequantize_rows(
    dtype: StoredDtype,
    fp8: &[u8],
    cols: usize,
    pieces: &[(usize, usize, usize)],
    scales: &BlockScales,
) -> Vec<u8> {
    let mut out = vec![0u8; fp8.len() * 4];
    if cols == 0 {
        return out;
    }
    out.par_chunks_mut(cols * 4)
        .enumerate()
        .for_each(|(row, dst)| {
            let start = row * cols;
            // Pieces are in batch order and never cross a row.
            let first = pieces.partition_point(|p| p.1 < start);
            let mut values = vec![0f32; cols];
            for &(from, here, len) in pieces[first..].iter().take_while(|p| p.1 < start + cols) {
                let at = here - start;
                let v = &mut values[at..at + len];
                decode_f32(dtype, &fp8[here..here + len], v);
                scales.apply(from, v);
            }
            for (d, v) in dst.chunks_exact_mut(4).zip(&values) {
                d.copy_from_slice(&v.to_le_bytes());
            }
        });
    out
}

/// Grows `out` by `count` elements (a count already checked against the tensor) filled by
/// `fill`; on error `out` is left as it was.
fn append<T: Copy + Default>(
    out: &mut Vec<T>,
    count: usize,
    fill: impl FnOnce(&mut [T]) -> Result<()>,
) -> Result<()> {
    let old = out.len();
    out.resize(old.saturating_add(count), T::default());
    let done = fill(&mut out[old..]);
    if done.is_err() {
        out.truncate(old);
    }
    done
}

/// Where weights come from: a checkpoint, or seeded random values for `tpc verify`.
pub trait WeightSource: Sync {
    /// Every problem with the tensors `plan` needs, before any compute.
    fn check(&self, plan: &Plan) -> Result<()>;
    /// Appends elements `[from, from + count)` of the flattened tensor, as f32.
    fn read(&self, tensor: &str, from: usize, count: usize, out: &mut Vec<f32>) -> Result<()>;
    /// Reads local rows `rows` of the 2-D slice `w` into `into` in the encoding the source
    /// stores them in (padding zero), for a packer to convert straight to what it computes
    /// with, and says true; a source that computes its values reads nothing and says false.
    fn read_stored_rows(
        &self,
        _w: &WeightSlice,
        _rows: std::ops::Range<usize>,
        _into: &mut StoredRows,
    ) -> Result<bool> {
        Ok(false)
    }
    /// The scales of a weight the source stores quantized (FP8 codes), `None` for one it
    /// stores as values: for a packer that keeps the codes ([`StoredRows::keep_codes`]) and
    /// multiplies by the scales as it computes.
    fn quant_scales(&self, _tensor: &str) -> Result<Option<Arc<BlockScales>>> {
        Ok(None)
    }
    /// The INT4 weight `tensor` (GPTQ, AWQ: its groups, zeros and scales, read and checked)
    /// when the source stores it so, `None` otherwise: for a packer that keeps the codes
    /// ([`WeightSource::read_int4_codes`]).
    fn int4_weight(&self, _tensor: &str) -> Result<Option<Arc<Int4Weight>>> {
        Ok(None)
    }
    /// Codes `[from, from + out.len())` of the flat `[out, in]` INT4 weight `tensor`, one a
    /// byte; only for a tensor [`WeightSource::int4_weight`] gives.
    fn read_int4_codes(&self, tensor: &str, _from: usize, _out: &mut [u8]) -> Result<()> {
        Err(WeightError::Slice {
            name: tensor.to_string(),
            problem: "this source stores no INT4 codes; report this as a bug".into(),
        })
    }
    /// Appends elements `[from, from + count)` as bf16, equal to `half::bf16::from_f32` of
    /// what [`WeightSource::read`] gives, through `read` a bounded chunk at a time.
    fn read_bf16(
        &self,
        tensor: &str,
        from: usize,
        count: usize,
        out: &mut Vec<half::bf16>,
    ) -> Result<()> {
        bf16_through_f32(self, tensor, from, count, out)
    }
}

/// [`WeightSource::read_bf16`] through [`WeightSource::read`], a bounded chunk at a time,
/// each value rounded by `half::bf16::from_f32`.
fn bf16_through_f32<S: WeightSource + ?Sized>(
    src: &S,
    tensor: &str,
    from: usize,
    count: usize,
    out: &mut Vec<half::bf16>,
) -> Result<()> {
    const CHUNK: usize = 1 << 14;
    let mut buf = Vec::with_capacity(CHUNK.min(count));
    let mut done = 0;
    while done < count {
        let n = CHUNK.min(count - done);
        buf.clear();
        src.read(tensor, from.saturating_add(done), n, &mut buf)?;
        out.extend(buf.iter().map(|&v| half::bf16::from_f32(v)));
        done += n;
    }
    Ok(())
}

/// One rank's piece of a tensor, as f32, with padding of zeros.
pub fn load_slice(src: &dyn WeightSource, w: &WeightSlice) -> Result<Tensor> {
    let (local, data) = load_slice_as(w, |t, from, count, out: &mut Vec<f32>| {
        src.read(t, from, count, out)
    })?;
    Ok(Tensor::new(local, data))
}

/// One rank's piece of a tensor as bf16 (bits copied from a bf16 checkpoint, others
/// rounded), with its local shape: for tables kept in bf16.
pub fn load_slice_bf16(
    src: &dyn WeightSource,
    w: &WeightSlice,
) -> Result<(Vec<usize>, Vec<half::bf16>)> {
    load_slice_as(w, |t, from, count, out: &mut Vec<half::bf16>| {
        src.read_bf16(t, from, count, out)
    })
}

/// Several rank slices of linear weights (local shape and values, as [`load_slice`] or
/// [`load_slice_bf16`] give them) as one weight, their output features side by side in
/// order: `[n_i, k]` rows one after another for `OutIn`, each row of `[k, n_i]` joined for
/// `InOut`. `names` are the tensors', for the error when the depths differ.
pub fn side_by_side<T: Copy>(
    parts: Vec<(Vec<usize>, Vec<T>)>,
    order: crate::ir::WeightOrder,
    names: &[&str],
) -> Result<(Vec<usize>, Vec<T>)> {
    use crate::ir::WeightOrder;
    let name = |i: usize| {
        names
            .get(i)
            .copied()
            .unwrap_or("a fused weight")
            .to_string()
    };
    // Each part's (outputs, depth).
    let mut dims = Vec::with_capacity(parts.len());
    for (i, (shape, values)) in parts.iter().enumerate() {
        let (&[r, c], true) = (
            &shape[..],
            shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)) == Some(values.len()),
        ) else {
            return Err(WeightError::Slice {
                name: name(i),
                problem: format!(
                    "a linear weight must be 2-D here with one value per element; its local shape is {shape:?} with {} values",
                    values.len()
                ),
            });
        };
        dims.push(match order {
            WeightOrder::OutIn => (r, c),
            WeightOrder::InOut => (c, r),
        });
    }
    let k = dims.first().map_or(0, |d| d.1);
    if let Some(i) = dims.iter().position(|d| d.1 != k) {
        return Err(WeightError::Slice {
            name: name(i),
            problem: format!(
                "it takes {} inputs but `{}` beside it in one product takes {k}",
                dims[i].1,
                name(0)
            ),
        });
    }
    let n: usize = dims.iter().map(|d| d.0).sum();
    let mut out = Vec::with_capacity(n.saturating_mul(k));
    match order {
        WeightOrder::OutIn => parts.iter().for_each(|(_, v)| out.extend_from_slice(v)),
        WeightOrder::InOut => {
            for p in 0..k {
                for ((_, v), &(cols, _)) in parts.iter().zip(&dims) {
                    out.extend_from_slice(&v[p * cols..(p + 1) * cols]);
                }
            }
        }
    }
    let shape = match order {
        WeightOrder::OutIn => vec![n, k],
        WeightOrder::InOut => vec![k, n],
    };
    Ok((shape, out))
}

/// The slicing of [`load_slice`] for any element type, reading runs with `read`.
fn load_slice_as<T: Copy + Default>(
    w: &WeightSlice,
    read: impl Fn(&str, usize, usize, &mut Vec<T>) -> Result<()>,
) -> Result<(Vec<usize>, Vec<T>)> {
    let shape = dims(w, &w.shape)?;
    let local = dims(w, &w.local_shape)?;
    let local_n = checked_product(w, &local)?;
    let mut out = Vec::with_capacity(local_n);
    let too_big = || slice_err(w, "its ranges overflow the address space".into());
    match (w.dim, shape.len()) {
        (None, _) => read(&w.tensor, 0, checked_product(w, &shape)?, &mut out)?,
        (Some(0), _) => {
            // Row slices are contiguous runs of the stored tensor.
            let row = checked_product(w, &shape[1..])?;
            for r in &w.ranges {
                let (offset, len) = (to_usize(w, r.offset)?, to_usize(w, r.len)?);
                let from = offset.checked_mul(row).ok_or_else(too_big)?;
                let count = len.checked_mul(row).ok_or_else(too_big)?;
                read(&w.tensor, from, count, &mut out)?;
                let pad = to_usize(w, r.pad)?.checked_mul(row).ok_or_else(too_big)?;
                out.resize(out.len().saturating_add(pad), T::default());
            }
            let pad = to_usize(w, w.padding)?
                .checked_mul(row)
                .ok_or_else(too_big)?;
            out.resize(out.len().saturating_add(pad), T::default());
        }
        (Some(1), 2) => {
            for row in 0..shape[0] {
                for r in &w.ranges {
                    let from = row
                        .checked_mul(shape[1])
                        .and_then(|a| a.checked_add(to_usize(w, r.offset).ok()?))
                        .ok_or_else(too_big)?;
                    read(&w.tensor, from, to_usize(w, r.len)?, &mut out)?;
                    out.resize(out.len().saturating_add(to_usize(w, r.pad)?), T::default());
                }
                out.resize(
                    out.len().saturating_add(to_usize(w, w.padding)?),
                    T::default(),
                );
            }
        }
        (Some(d), rank) => {
            return Err(WeightError::Slice {
                name: w.tensor.to_string(),
                problem: format!(
                "the plan splits dim {d} of a rank-{rank} tensor, which the loader cannot slice"
            ),
            })
        }
    }
    if out.len() != local_n {
        return Err(slice_err(
            w,
            format!(
                "its ranges give {} elements, its local shape {:?} holds {local_n}",
                out.len(),
                w.local_shape
            ),
        ));
    }
    Ok((local, out))
}

fn slice_err(w: &WeightSlice, problem: String) -> WeightError {
    WeightError::Slice {
        name: w.tensor.to_string(),
        problem,
    }
}

fn to_usize(w: &WeightSlice, v: u64) -> Result<usize> {
    usize::try_from(v).map_err(|_| slice_err(w, format!("{v} does not fit this machine's usize")))
}

fn dims(w: &WeightSlice, shape: &[u64]) -> Result<Vec<usize>> {
    shape.iter().map(|&d| to_usize(w, d)).collect()
}

fn checked_product(w: &WeightSlice, shape: &[usize]) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| slice_err(w, format!("shape {shape:?} overflows the address space")))
}

/// Where each element of a 2-D slice `[rows, cols]` comes from: a run of the stored tensor
/// or zero padding. What [`load_slice`] materialises, described instead, so that a packer
/// can read any window of any local row straight from the source.
pub(crate) struct SliceLayout {
    pub rows: usize,
    pub cols: usize,
    /// Row length of the stored tensor.
    stored_cols: usize,
    map: RowMap,
}

/// One range of a split dim: (local first index, stored first index, length).
type Span = (usize, usize, usize);

enum RowMap {
    /// Local row `r` is stored row `r`.
    Whole,
    /// A span of rows per range; rows past them are zeros.
    Rows(Vec<Span>),
    /// A span of columns per range, in every row; columns past them are zeros.
    Cols(Vec<Span>),
}

/// A run of a local row: `len` elements from stored flat index `from`, or `len` zeros.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Piece {
    Stored { from: usize, len: usize },
    Zeros { len: usize },
}

impl SliceLayout {
    /// The layout of a slice whose local shape is 2-D; an error for any other, or for
    /// ranges outside the stored tensor or not adding up to the local shape.
    pub fn new(w: &WeightSlice) -> Result<SliceLayout> {
        let shape = dims(w, &w.shape)?;
        let local = dims(w, &w.local_shape)?;
        let [rows, cols] = local[..] else {
            return Err(slice_err(
                w,
                format!("a linear weight must be 2-D here, its local shape is {local:?}"),
            ));
        };
        let &[stored_rows, stored_cols] = &shape[..] else {
            return Err(slice_err(
                w,
                format!("a linear weight must be stored 2-D, its shape is {shape:?}"),
            ));
        };
        // (local start, stored start, len) per range, checked against the split dim's
        // length; then the local length the ranges and padding give.
        let ranges = |dim_len: usize| -> Result<(Vec<Span>, usize)> {
            let mut out = Vec::with_capacity(w.ranges.len());
            let mut at = 0usize;
            for r in &w.ranges {
                let (offset, len) = (to_usize(w, r.offset)?, to_usize(w, r.len)?);
                if offset.checked_add(len).is_none_or(|end| end > dim_len) {
                    return Err(slice_err(
                        w,
                        format!("range {offset}+{len} lies outside its dim of {dim_len}"),
                    ));
                }
                out.push((at, offset, len));
                at = at
                    .checked_add(len)
                    .and_then(|a| a.checked_add(to_usize(w, r.pad).ok()?))
                    .ok_or_else(|| slice_err(w, "its ranges overflow the address space".into()))?;
            }
            let total = at
                .checked_add(to_usize(w, w.padding)?)
                .ok_or_else(|| slice_err(w, "its padding overflows the address space".into()))?;
            Ok((out, total))
        };
        let (map, want) = match w.dim {
            None => (RowMap::Whole, [stored_rows, stored_cols]),
            Some(0) => {
                let (r, total) = ranges(stored_rows)?;
                (RowMap::Rows(r), [total, stored_cols])
            }
            Some(1) => {
                let (c, total) = ranges(stored_cols)?;
                (RowMap::Cols(c), [stored_rows, total])
            }
            Some(d) => {
                return Err(slice_err(
                    w,
                    format!("the plan splits dim {d} of a 2-D tensor"),
                ))
            }
        };
        if want != [rows, cols] {
            return Err(slice_err(
                w,
                format!("its ranges give shape {want:?}, its local shape is {local:?}"),
            ));
        }
        Ok(SliceLayout {
            rows,
            cols,
            stored_cols,
            map,
        })
    }

    /// Calls `f(offset in the window, piece)` for the pieces of local row `r`, columns
    /// `[c0, c0 + len)`, in order. `r < rows` and `c0 + len ≤ cols` (the caller's loops).
    pub fn pieces(
        &self,
        r: usize,
        c0: usize,
        len: usize,
        mut f: impl FnMut(usize, Piece) -> Result<()>,
    ) -> Result<()> {
        // In range by construction: r < rows ≤ stored rows and c0 + len ≤ cols, and every
        // range was checked against the stored shape, whose element count fits a usize.
        let c1 = c0 + len;
        match &self.map {
            RowMap::Whole => f(
                0,
                Piece::Stored {
                    from: r * self.stored_cols + c0,
                    len,
                },
            ),
            RowMap::Rows(ranges) => {
                let hit = ranges
                    .iter()
                    .find(|&&(l, _, n)| r >= l && r < l + n)
                    .map(|&(l, s, _)| s + (r - l));
                match hit {
                    Some(row) => f(
                        0,
                        Piece::Stored {
                            from: row * self.stored_cols + c0,
                            len,
                        },
                    ),
                    None => f(0, Piece::Zeros { len }),
                }
            }
            RowMap::Cols(ranges) => {
                // Columns between ranges (a fused part's padding) and after them are zeros.
                let zeros = |f: &mut dyn FnMut(usize, Piece) -> Result<()>, from, to| {
                    let (a, b) = (usize::max(from, c0), usize::min(to, c1));
                    if a < b {
                        return f(a - c0, Piece::Zeros { len: b - a });
                    }
                    Ok(())
                };
                let mut end = 0;
                for &(l, s, n) in ranges {
                    zeros(&mut f, end, l)?;
                    end = l + n;
                    let (a, b) = (l.max(c0), end.min(c1));
                    if a < b {
                        let from = r * self.stored_cols + s + (a - l);
                        f(a - c0, Piece::Stored { from, len: b - a })?;
                    }
                }
                zeros(&mut f, end, c1)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn side_by_side_joins_output_features_in_either_order() {
        use crate::ir::WeightOrder;
        // [2, 3] and [1, 3] stored [out, in]: rows one after another.
        let a = (vec![2, 3], vec![1, 2, 3, 4, 5, 6]);
        let b = (vec![1, 3], vec![7, 8, 9]);
        let (shape, v) = side_by_side(vec![a, b], WeightOrder::OutIn, &["a", "b"]).unwrap();
        assert_eq!((shape, v), (vec![3, 3], (1..=9).collect::<Vec<_>>()));
        // The same stored [in, out]: each input's row joined.
        let a = (vec![3, 2], vec![1, 4, 2, 5, 3, 6]);
        let b = (vec![3, 1], vec![7, 8, 9]);
        let (shape, v) = side_by_side(vec![a, b], WeightOrder::InOut, &["a", "b"]).unwrap();
        assert_eq!((shape, v), (vec![3, 3], vec![1, 4, 7, 2, 5, 8, 3, 6, 9]));
        // Depths that differ, a weight that is not 2-D, values that do not fill the shape.
        let e = side_by_side(
            vec![(vec![2, 3], vec![0; 6]), (vec![2, 2], vec![0; 4])],
            WeightOrder::OutIn,
            &["a", "b"],
        )
        .unwrap_err();
        assert!(e.to_string().contains("takes 2 inputs but `a`"), "{e}");
        assert!(side_by_side(vec![(vec![6], vec![0; 6])], WeightOrder::OutIn, &["a"]).is_err());
        assert!(side_by_side(vec![(vec![2, 3], vec![0; 5])], WeightOrder::InOut, &["a"]).is_err());
    }

    fn temp_dir() -> PathBuf {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "tpc-weights-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_quantized_checkpoint_is_named_so() {
        let dir = temp_dir();
        let header = r#"{"l.qweight":{"dtype":"I32","shape":[2,2],"data_offsets":[0,16]},"f":{"dtype":"F8_E4M3","shape":[2,2],"data_offsets":[16,20]},"p":{"dtype":"F32","shape":[1],"data_offsets":[20,24]}}"#;
        std::fs::write(dir.join("model.safetensors"), raw_file(header, 24)).unwrap();
        let ckpt = Checkpoint::open(&dir).unwrap();
        // GPTQ's packed weight in place of the plain one.
        let e = ckpt.tensor("l.weight").err().unwrap().to_string();
        assert!(
            e.contains("holds `l.qweight` instead: it is quantized"),
            "{e}"
        );
        // An 8-bit float weight without the config that gives its scale blocks.
        let e = ckpt.tensor("f").err().unwrap().to_string();
        assert!(
            e.contains("F8_E4M3") && e.contains("no FP8 `quantization_config`"),
            "{e}"
        );
        // An integer weight.
        let e = ckpt.tensor("l.qweight").err().unwrap().to_string();
        assert!(
            e.contains("I32") && e.contains("quantized checkpoint"),
            "{e}"
        );
        // A missing tensor with no quantized sibling says nothing of quantization.
        let e = ckpt.tensor("m.weight").err().unwrap().to_string();
        assert!(
            e.contains("does not match") && !e.contains("quantiz"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A 5 × 6 FP8 weight `w` in blocks of 2 × 4 (3 × 2 scales, the last row and column
    /// of blocks partial) beside a config that says so; its bytes and scales.
    fn fp8_checkpoint(scale_shape: [usize; 2]) -> (PathBuf, Vec<u8>, Vec<f32>) {
        let dir = temp_dir();
        let config =
            r#"{"quantization_config": {"quant_method": "fp8", "weight_block_size": [2, 4]}}"#;
        std::fs::write(dir.join("config.json"), config).unwrap();
        // Every byte but the NaNs, in some order.
        let bytes: Vec<u8> = (0..30u8).map(|i| i.wrapping_mul(37) % 0x7f).collect();
        let scales: Vec<f32> = (0..scale_shape[0] * scale_shape[1])
            .map(|i| 0.5 + i as f32)
            .collect();
        let scale_bytes: Vec<u8> = scales.iter().flat_map(|v| v.to_le_bytes()).collect();
        let tensors = [
            ("w", safetensors::Dtype::F8_E4M3, vec![5, 6], &bytes),
            (
                "w_scale_inv",
                safetensors::Dtype::F32,
                scale_shape.to_vec(),
                &scale_bytes,
            ),
        ];
        let views: Vec<_> = tensors
            .iter()
            .map(|(n, d, s, b)| {
                (
                    n.to_string(),
                    safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, &None, &dir.join("model.safetensors")).unwrap();
        (dir, bytes, scales)
    }

    #[test]
    fn fp8_weights_read_as_their_values_times_their_block_scales() {
        let (dir, bytes, scales) = fp8_checkpoint([3, 2]);
        let ckpt = Checkpoint::open(&dir).unwrap();
        let want: Vec<f32> = (0..30)
            .map(|i| fp8::e4m3_to_f32(bytes[i]) * scales[(i / 6 / 2) * 2 + (i % 6) / 4])
            .collect();
        let mut all = Vec::new();
        ckpt.read("w", 0, 30, &mut all).unwrap();
        assert_eq!(all, want);
        // From inside a row, across rows.
        let mut part = Vec::new();
        ckpt.read("w", 9, 11, &mut part).unwrap();
        assert_eq!(part, want[9..20]);
        let mut b = Vec::new();
        ckpt.read_bf16("w", 0, 30, &mut b).unwrap();
        assert!(b
            .iter()
            .zip(&want)
            .all(|(b, &w)| *b == half::bf16::from_f32(w)));
        // A rank's pieces, as the packers read them: rows 2..4 (a column split of the
        // outputs) and columns 4..6 then 2 zeros (a row split of the inputs, padded).
        let range = |offset, len| crate::ir::SliceRange {
            offset,
            len,
            pad: 0,
        };
        for (dim, r, padding, local) in [(0, range(2, 2), 0, [2, 6]), (1, range(4, 2), 2, [5, 4])] {
            let w = WeightSlice {
                dim: Some(dim),
                ranges: vec![r],
                padding,
                local_shape: local.to_vec(),
                ..whole("w", [5, 6])
            };
            let mut rows = StoredRows::default();
            assert!(ckpt
                .read_stored_rows(&w, 0..local[0] as usize, &mut rows)
                .unwrap());
            assert_eq!(rows.dtype(), StoredDtype::F32);
            let expect = load_slice(&ckpt, &w).unwrap();
            for i in 0..local[0] as usize {
                let mut got = vec![0f32; local[1] as usize];
                rows.f32s(i, 0, &mut got).unwrap();
                let at = i * local[1] as usize;
                assert_eq!(got, expect.data[at..at + got.len()], "dim {dim} row {i}");
                for (c, v) in got.iter().enumerate() {
                    let (row, col) = if dim == 0 { (2 + i, c) } else { (i, 4 + c) };
                    let stored = if col < 6 { want[row * 6 + col] } else { 0.0 };
                    assert_eq!(*v, stored, "dim {dim} ({i}, {c})");
                }
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Why reading the first element of `w` in the checkpoint in `dir` fails.
    fn read_error(dir: &Path) -> String {
        let ckpt = Checkpoint::open(dir).unwrap();
        let e = ckpt.read("w", 0, 1, &mut Vec::new()).unwrap_err();
        e.to_string()
    }

    #[test]
    fn fp8_scales_that_do_not_fit_their_blocks_are_refused_before_reading() {
        let (dir, _, _) = fp8_checkpoint([2, 2]);
        let e = read_error(&dir);
        assert!(
            e.contains("w_scale_inv")
                && e.contains("has shape [2, 2]")
                && e.contains("[3, 2] scales"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&dir);
        // Scales missing: the weight alone is not readable.
        let dir = temp_dir();
        let config =
            r#"{"quantization_config": {"quant_method": "fp8", "weight_block_size": [2, 4]}}"#;
        std::fs::write(dir.join("config.json"), config).unwrap();
        let header = r#"{"w":{"dtype":"F8_E4M3","shape":[2,2],"data_offsets":[0,4]}}"#;
        std::fs::write(dir.join("model.safetensors"), raw_file(header, 4)).unwrap();
        let e = read_error(&dir);
        assert!(e.contains("its scales `w_scale_inv` are missing"), "{e}");
        // Scales stored as FP8 themselves, and a scale that is not finite.
        let header = r#"{"w":{"dtype":"F8_E4M3","shape":[2,2],"data_offsets":[0,4]},"w_scale_inv":{"dtype":"F8_E4M3","shape":[1,1],"data_offsets":[4,5]}}"#;
        std::fs::write(dir.join("model.safetensors"), raw_file(header, 5)).unwrap();
        let e = read_error(&dir);
        assert!(e.contains("FP8 scales are F32, BF16 or F16"), "{e}");
        let header = r#"{"w":{"dtype":"F8_E4M3","shape":[2,2],"data_offsets":[0,4]},"w_scale_inv":{"dtype":"F32","shape":[1,1],"data_offsets":[4,8]}}"#;
        let mut file = raw_file(header, 4);
        file.extend_from_slice(&f32::INFINITY.to_le_bytes());
        std::fs::write(dir.join("model.safetensors"), file).unwrap();
        let e = read_error(&dir);
        assert!(e.contains("scale 0 is inf"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A safetensors file from a raw header and data, as a corrupt writer might make it.
    fn raw_file(header: &str, data_len: usize) -> Vec<u8> {
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend((0..data_len).map(|i| i as u8));
        bytes
    }

    /// Every read a loader makes, with `from`/`count` anywhere up to usize::MAX: each must
    /// give a value or an error, never panic.
    fn exercise(bytes: &[u8], reads: &[(usize, usize)]) {
        let dir = temp_dir();
        std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
        // The header read with pread accepts exactly what safetensors accepts in memory.
        let ours = ShardFile::open(&dir.join("model.safetensors"));
        let theirs = safetensors::SafeTensors::read_metadata(bytes);
        assert_eq!(ours.is_ok(), theirs.is_ok(), "{:?}", ours.err());
        if let (Ok(ours), Ok((n, meta))) = (ours, theirs) {
            assert_eq!(ours.data_start, 8 + n as u64);
            let listed = |m: &safetensors::tensor::Metadata| {
                let mut v: Vec<String> = m
                    .tensors()
                    .iter()
                    .map(|(name, info)| format!("{name} {info:?}"))
                    .collect();
                v.sort();
                v
            };
            assert_eq!(listed(&ours.meta), listed(&meta));
        }
        if let Ok(ckpt) = Checkpoint::open(&dir) {
            for name in ["a", "b", "missing"] {
                for &(from, count) in reads {
                    // The tensor whole and a range of rows, as a plan would slice it (with
                    // the shape its header gives), and the same with a shape it does not.
                    let shape = ckpt.info(name).map_or(vec![2, 2], |(_, i)| {
                        i.shape.iter().map(|&d| d as u64).collect()
                    });
                    if let [rows, cols] = shape[..] {
                        let range = (from as u64 % (rows + 1), count as u64 % (rows + 1));
                        for (dim, ranges, local_rows) in
                            [(None, vec![], rows), (Some(0), vec![range], range.1)]
                        {
                            for shape in [vec![rows, cols], vec![cols, rows]] {
                                let edge = local_rows as usize + 2;
                                let batch = from % edge..count % edge;
                                let slice = WeightSlice {
                                    tensor: name.into(),
                                    shape,
                                    dtype: crate::ir::DType::F32,
                                    dim,
                                    ranges: ranges
                                        .iter()
                                        .map(|&(offset, len)| crate::ir::SliceRange {
                                            offset,
                                            len,
                                            pad: 0,
                                        })
                                        .collect(),
                                    padding: 0,
                                    local_shape: vec![local_rows, cols],
                                    quant: None,
                                };
                                let mut into = StoredRows::default();
                                let _ = ckpt.read_stored_rows(&slice, batch, &mut into);
                            }
                        }
                    }
                    let mut f = Vec::new();
                    if ckpt.read(name, from, count, &mut f).is_err() {
                        assert!(f.is_empty(), "a failed read leaves the output as it was");
                    }
                    let mut b = Vec::new();
                    let _ = ckpt.read_bf16(name, from, count, &mut b);
                }
            }
        }
        std::fs::remove_dir_all(dir).unwrap();
    }

    fn interesting() -> impl Strategy<Value = usize> {
        prop_oneof![
            0usize..64,
            Just(usize::MAX),
            Just(usize::MAX / 2),
            Just(usize::MAX / 4 + 1),
            any::<usize>(),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Headers with arbitrary shapes and offsets (overflowing, reversed, past the end)
        /// and files cut short or too long.
        #[test]
        fn corrupt_headers_never_panic(
            shape in prop::collection::vec(interesting(), 0..3),
            start in interesting(),
            end in interesting(),
            dtype in prop::sample::select(vec!["BF16", "F32", "F16", "I64", "BOOL"]),
            data_len in 0usize..64,
            reads in prop::collection::vec((interesting(), interesting()), 1..6),
        ) {
            let header = format!(
                r#"{{"a":{{"dtype":"{dtype}","shape":{shape:?},"data_offsets":[{start},{end}]}}}}"#
            );
            exercise(&raw_file(&header, data_len), &reads);
        }

        /// A valid file with bytes overwritten anywhere (header included) or cut short.
        #[test]
        fn damaged_files_never_panic(
            edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
            cut in prop::option::of(any::<prop::sample::Index>()),
            reads in prop::collection::vec((interesting(), interesting()), 1..6),
        ) {
            let header = r#"{"a":{"dtype":"BF16","shape":[3,4],"data_offsets":[0,24]},"b":{"dtype":"F32","shape":[5],"data_offsets":[24,44]}}"#;
            let mut bytes = raw_file(header, 44);
            for (at, v) in edits {
                let i = at.index(bytes.len());
                bytes[i] = v;
            }
            if let Some(c) = cut {
                bytes.truncate(c.index(bytes.len()));
            }
            exercise(&bytes, &reads);
        }
    }

    /// 0, 1, 2, … as a tensor's values.
    struct Counting;

    impl WeightSource for Counting {
        fn check(&self, _: &crate::plan::Plan) -> Result<()> {
            Ok(())
        }
        fn read(&self, _: &str, from: usize, count: usize, out: &mut Vec<f32>) -> Result<()> {
            out.extend((from..from + count).map(|v| v as f32));
            Ok(())
        }
    }

    #[test]
    fn zeros_follow_each_range_then_the_piece() {
        // A [2, 6] tensor (values 0..12): columns 0..2 then 2 zeros, columns 4..6 then 1,
        // then 1 zero at the end (a fused dim's parts padded inside the piece).
        let range = |offset, len, pad| crate::ir::SliceRange { offset, len, pad };
        let cols = WeightSlice {
            tensor: "w".into(),
            shape: vec![2, 6],
            dtype: crate::ir::DType::F32,
            dim: Some(1),
            ranges: vec![range(0, 2, 2), range(4, 2, 1)],
            padding: 1,
            local_shape: vec![2, 8],
            quant: None,
        };
        let t = load_slice(&Counting, &cols).unwrap();
        let want = [
            0., 1., 0., 0., 4., 5., 0., 0., 6., 7., 0., 0., 10., 11., 0., 0.,
        ];
        assert_eq!(t.data, want);
        // The row-by-row layout the packing reads gives the same zeros in the same places.
        let layout = SliceLayout::new(&cols).unwrap();
        for r in 0..2 {
            let mut row = vec![f32::NAN; 8];
            layout
                .pieces(r, 0, 8, |at, piece| {
                    match piece {
                        Piece::Zeros { len } => row[at..at + len].fill(0.0),
                        Piece::Stored { from, len } => {
                            for (k, v) in row[at..at + len].iter_mut().enumerate() {
                                *v = (from + k) as f32;
                            }
                        }
                    }
                    Ok(())
                })
                .unwrap();
            assert_eq!(row, want[r * 8..(r + 1) * 8]);
        }
        // Rows: row 1 then a zero row, row 0.
        let rows = WeightSlice {
            dim: Some(0),
            ranges: vec![range(1, 1, 1), range(0, 1, 0)],
            padding: 0,
            local_shape: vec![3, 6],
            ..cols
        };
        let t = load_slice(&Counting, &rows).unwrap();
        let want: Vec<f32> = (6..12)
            .chain([0; 6])
            .chain(0..6)
            .map(|v| v as f32)
            .collect();
        assert_eq!(t.data, want);
    }

    #[test]
    fn reads_convert_and_check_their_range() {
        let header = r#"{"a":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]},"b":{"dtype":"F16","shape":[2],"data_offsets":[8,12]}}"#;
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        for v in [1.0f32, -2.5, 0.15625, 3.0] {
            bytes.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes());
        }
        for v in [0.5f32, -1.0] {
            bytes.extend_from_slice(&half::f16::from_f32(v).to_le_bytes());
        }
        let dir = temp_dir();
        std::fs::write(dir.join("model.safetensors"), &bytes).unwrap();
        let ckpt = Checkpoint::open(&dir).unwrap();
        let mut f = vec![9.0];
        ckpt.read("a", 1, 3, &mut f).unwrap();
        assert_eq!(f, [9.0, -2.5, 0.15625, 3.0]);
        ckpt.read("b", 0, 2, &mut f).unwrap();
        assert_eq!(&f[4..], [0.5, -1.0]);
        let mut b = Vec::new();
        ckpt.read_bf16("b", 1, 1, &mut b).unwrap();
        assert_eq!(b, [half::bf16::from_f32(-1.0)]);
        let mut rows = StoredRows::default();
        assert!(ckpt
            .read_stored_rows(&whole("a", [2, 2]), 1..2, &mut rows)
            .unwrap());
        assert_eq!((rows.dtype(), rows.rows()), (StoredDtype::Bf16, 1..2));
        let mut bits = [0u16; 2];
        rows.bf16_bits(1, 0, &mut bits).unwrap();
        assert_eq!(
            bits.map(|b| half::bf16::from_bits(b).to_f32()),
            [0.15625, 3.0]
        );
        let mut wide = [0f32; 1];
        rows.f32s(1, 1, &mut wide).unwrap();
        assert_eq!(wide, [3.0]);
        // A row not read, columns past the row, rows past the slice: errors.
        assert!(rows.f32s(0, 0, &mut wide).is_err());
        assert!(rows.bf16_bits(1, 1, &mut bits).is_err());
        assert!(ckpt
            .read_stored_rows(&whole("a", [2, 2]), 1..3, &mut rows)
            .is_err());
        // One past the end, and an overflowing range: errors that name the tensor.
        let e = ckpt.read("a", 2, 3, &mut f).unwrap_err().to_string();
        assert!(e.contains("`a`") && e.contains("2..5"), "{e}");
        assert!(ckpt.read_bf16("a", usize::MAX, 2, &mut b).is_err());
        assert_eq!((f.len(), b.len()), (6, 1));
        drop(ckpt);
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// The whole 2-D tensor `name` as a plan's slice.
    fn whole(name: &str, shape: [u64; 2]) -> WeightSlice {
        WeightSlice {
            tensor: name.into(),
            shape: shape.to_vec(),
            dtype: crate::ir::DType::F32,
            dim: None,
            ranges: vec![],
            padding: 0,
            local_shape: shape.to_vec(),
            quant: None,
        }
    }

    /// A weight file cut short by another process after tpc opened it: every read of the
    /// bytes that are gone is an error naming the file (through a memory map it was SIGBUS,
    /// which kills this test binary), and the bytes still there read as before.
    #[test]
    fn a_file_cut_short_after_opening_is_an_error_not_a_fault() {
        // Two pages of f32 data, so that the cut leaves whole pages behind it.
        let header = r#"{"w":{"dtype":"F32","shape":[16,128],"data_offsets":[0,8192]},"t":{"dtype":"BF16","shape":[4],"data_offsets":[8192,8200]}}"#;
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        let data_start = bytes.len();
        for i in 0..2048 {
            bytes.extend_from_slice(&(i as f32).to_le_bytes());
        }
        bytes.extend_from_slice(&[0; 8]);
        let dir = temp_dir();
        let path = dir.join("model.safetensors");
        std::fs::write(&path, &bytes).unwrap();
        let ckpt = Checkpoint::open(&dir).unwrap();
        // Keep the header and the first row of `w` (128 f32s).
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len((data_start + 512) as u64)
            .unwrap();
        let changed = |e: WeightError| {
            let e = e.to_string();
            assert!(
                e.contains(&format!(
                    "the checkpoint `{}` changed while it was being read",
                    path.display()
                )),
                "{e}"
            );
        };
        let mut f = vec![];
        ckpt.read("w", 0, 128, &mut f).unwrap();
        assert_eq!(f[127], 127.0);
        changed(ckpt.read("w", 0, 129, &mut f).unwrap_err());
        assert_eq!(f.len(), 128, "a failed read leaves the output as it was");
        let mut b = vec![];
        changed(ckpt.read_bf16("t", 0, 4, &mut b).unwrap_err());
        let slice = whole("w", [16, 128]);
        let mut rows = StoredRows::default();
        ckpt.read_stored_rows(&slice, 0..1, &mut rows).unwrap();
        changed(ckpt.read_stored_rows(&slice, 0..2, &mut rows).unwrap_err());
        changed(load_slice(&ckpt, &slice).unwrap_err());
        changed(load_slice_bf16(&ckpt, &slice).unwrap_err());
        changed(ckpt.file_identities().unwrap_err());
        drop(ckpt);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
