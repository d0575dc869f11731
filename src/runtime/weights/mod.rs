//! Hugging Face checkpoints: `model.safetensors` or a sharded
//! `model.safetensors.index.json`, memory-mapped. Every tensor a plan needs is checked
//! before any compute; each rank then reads only its slices, converting straight from the
//! map (see [`StoredTensor`]) and letting each tensor's pages go once it is read.

mod error;
mod identity;

pub use error::WeightError;

use super::tensor::Tensor;

/// What reading weights returns.
pub type WeightResult<T> = std::result::Result<T, WeightError>;
type Result<T> = WeightResult<T>;
use crate::plan::{Plan, WeightSlice};
use half::slice::HalfFloatSliceExt;
use memmap2::Mmap;
use safetensors::tensor::{Metadata, SafeTensors, TensorInfo};
use safetensors::Dtype;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

struct File {
    path: PathBuf,
    map: Mmap,
    /// Where tensor data starts (after the 8-byte length and the JSON header).
    data_start: usize,
    meta: Metadata,
}

/// An opened checkpoint directory.
pub struct Checkpoint {
    dir: PathBuf,
    files: Vec<File>,
    /// Tensor name → file index.
    index: HashMap<String, usize>,
}

fn file_err(path: &Path, problem: impl Into<String>) -> WeightError {
    WeightError::File {
        path: path.to_path_buf(),
        problem: problem.into(),
    }
}

fn open_file(path: &Path) -> Result<File> {
    if path.is_dir() {
        return Err(file_err(
            path,
            "is a folder, not a safetensors file; the checkpoint's weights must be files",
        ));
    }
    let f = std::fs::File::open(path).map_err(|io| crate::error::TpcError::Read {
        path: path.to_path_buf(),
        io,
    })?;
    // SAFETY: the file is opened read-only and tpc never writes it; a checkpoint changed by
    // another process while we run is outside what any loader can defend against.
    let map = unsafe { Mmap::map(&f) }.map_err(|io| crate::error::TpcError::Read {
        path: path.to_path_buf(),
        io,
    })?;
    let (header, meta) =
        SafeTensors::read_metadata(&map).map_err(|e| file_err(path, header_problem(&map, &e)))?;
    // read_metadata checks that the header fits and that the offsets tile the data exactly;
    // the checks here are kept anyway so that nothing below relies on that.
    let data_start = 8usize.saturating_add(header);
    let data_len = map.len().checked_sub(data_start).ok_or_else(|| {
        file_err(
            path,
            "the header is longer than the file; re-download or re-save it",
        )
    })?;
    for (name, info) in meta.tensors() {
        let (start, end) = info.data_offsets;
        if start > end || end > data_len {
            return Err(WeightError::Tensor {
                path: path.to_path_buf(),
                tensor: name,
                problem: format!(
                    "the file is truncated or corrupt: the tensor spans bytes {start}..{end} of {data_len} data bytes"
                ),
            });
        }
    }
    Ok(File {
        path: path.to_path_buf(),
        map,
        data_start,
        meta,
    })
}

/// tpc's own words for why a safetensors header does not read.
fn header_problem(bytes: &[u8], e: &safetensors::SafeTensorError) -> String {
    use safetensors::SafeTensorError as E;
    let size = bytes.len();
    let declared = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])));
    let why = match (e, declared) {
        (E::HeaderTooSmall, _) => {
            format!("the file has {size} bytes, fewer than the 8-byte header length; it is truncated")
        }
        (E::MetadataIncompleteBuffer | E::InvalidHeaderLength, Some(n)) if n.saturating_add(8) > size as u64 => {
            format!("its header length says {n} bytes follow, the file has {size} in all; it is truncated")
        }
        (E::MetadataIncompleteBuffer, _) => format!(
            "the tensors' data does not fill the file exactly ({size} bytes); it is truncated or has bytes appended"
        ),
        (E::HeaderTooLarge | E::InvalidHeaderLength, _) => {
            "the header length is impossible; the file is corrupt or not safetensors".into()
        }
        (E::InvalidHeader | E::InvalidHeaderStart | E::InvalidHeaderDeserialization | E::JsonError(_), _) => {
            "the header is not the JSON safetensors expects; the file is corrupt or not safetensors".into()
        }
        (E::TensorInvalidInfo | E::InvalidOffset(_) | E::ValidationOverflow, _) => {
            "a tensor's shape, type and byte offsets disagree; the file is corrupt".into()
        }
        (other, _) => format!("its header does not read ({other:?})"),
    };
    format!("not a valid safetensors file: {why}; re-download or re-save it")
}

/// Resolves an index's file name inside the checkpoint folder; names that would leave it
/// (absolute paths, `..`) are refused, so a downloaded index cannot make tpc read elsewhere.
fn shard_path(dir: &Path, index_path: &Path, name: &str) -> Result<std::path::PathBuf> {
    let relative = Path::new(name);
    let stays_inside = !name.is_empty()
        && relative
            .components()
            .all(|c| matches!(c, std::path::Component::Normal(_)));
    if !stays_inside {
        return Err(file_err(
            index_path,
            format!("`weight_map` names the file `{name}`, which is not inside the model folder; an index may name only files beside it"),
        ));
    }
    Ok(dir.join(relative))
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
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            files,
            index,
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
        let short = tensor.strip_prefix("transformer.")?;
        self.index
            .get_key_value(short)
            .map(|(k, &f)| (k.as_str(), f))
    }

    fn info(&self, tensor: &str) -> Result<(&File, &TensorInfo)> {
        let (name, f) = self.resolve(tensor).ok_or_else(|| WeightError::Tensor {
            path: self.dir.clone(),
            tensor: tensor.to_string(),
            problem:
                "missing from the checkpoint; the model definition does not match these weights"
                    .into(),
        })?;
        let file = &self.files[f];
        let info = file.meta.info(name).ok_or_else(|| WeightError::Tensor {
            path: file.path.clone(),
            tensor: tensor.to_string(),
            problem: "listed in the index but missing from its file".into(),
        })?;
        Ok((file, info))
    }

    /// The tensor's bytes in the map, checked against its shape and dtype with checked
    /// arithmetic: a corrupt header gives an error, never a panic or a read out of the map.
    fn bytes<'a>(
        &self,
        file: &'a File,
        tensor: &str,
        info: &TensorInfo,
        dtype: StoredDtype,
    ) -> Result<&'a [u8]> {
        let bad = |problem: String| WeightError::Tensor {
            path: file.path.clone(),
            tensor: tensor.to_string(),
            problem,
        };
        let (start, end) = info.data_offsets;
        let range = file
            .data_start
            .checked_add(start)
            .zip(file.data_start.checked_add(end))
            .filter(|(a, b)| a <= b && *b <= file.map.len())
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
        Ok(&file.map[range.0..range.1])
    }

    /// Checks every tensor every rank needs: present, the expected shape, a dtype tpc reads.
    pub fn check(&self, plan: &Plan) -> Result<()> {
        let mut seen = std::collections::HashSet::new();
        for w in plan.ranks.iter().flat_map(|r| &r.weights) {
            if !seen.insert(&*w.tensor) {
                continue;
            }
            let (file, info) = self.info(&w.tensor)?;
            let bad = |problem: String| WeightError::Tensor {
                path: file.path.clone(),
                tensor: w.tensor.to_string(),
                problem,
            };
            let expected: Vec<usize> = w.shape.iter().map(|&d| d as usize).collect();
            if info.shape != expected {
                return Err(bad(format!(
                    "has shape {:?}, the model expects {expected:?}",
                    info.shape
                )));
            }
            let dtype = StoredDtype::of(info.dtype).ok_or_else(|| {
                bad(format!(
                    "has dtype {:?}; tpc reads F32, BF16 and F16",
                    info.dtype
                ))
            })?;
            self.bytes(file, w.tensor.as_ref(), info, dtype)?;
        }
        Ok(())
    }
}

impl WeightSource for Checkpoint {
    fn check(&self, plan: &Plan) -> Result<()> {
        Checkpoint::check(self, plan)
    }

    fn read(&self, tensor: &str, from: usize, count: usize, out: &mut Vec<f32>) -> Result<()> {
        let stored = self.stored_tensor(tensor)?;
        stored.run(from, count)?;
        append(out, count, |dst| stored.f32s(from, dst))
    }

    fn stored(&self, tensor: &str) -> Result<Option<StoredTensor<'_>>> {
        self.stored_tensor(tensor).map(Some)
    }

    fn release(&self, tensor: &str) {
        let Ok((file, info)) = self.info(tensor) else {
            return;
        };
        let (start, end) = info.data_offsets;
        if let Some(offset) = file.data_start.checked_add(start) {
            // SAFETY: the map is read-only and shared (MAP_SHARED of a file tpc never
            // writes): MADV_DONTNEED only unmaps its pages from this process, and a later
            // read of any borrowed slice faults the same bytes back in from the page cache.
            // Best effort: an error only means the pages stay resident.
            let _ = unsafe {
                file.map.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    offset,
                    end.saturating_sub(start),
                )
            };
        }
    }
}

impl Checkpoint {
    fn stored_tensor(&self, tensor: &str) -> Result<StoredTensor<'_>> {
        let (file, info) = self.info(tensor)?;
        let dtype = StoredDtype::of(info.dtype).ok_or_else(|| WeightError::Tensor {
            path: file.path.clone(),
            tensor: tensor.to_string(),
            problem: format!("has dtype {:?}; tpc reads F32, BF16 and F16", info.dtype),
        })?;
        Ok(StoredTensor {
            dtype,
            bytes: self.bytes(file, tensor, info, dtype)?,
            tensor: tensor.to_string(),
            path: &file.path,
        })
    }
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
    /// The tensor's stored encoding and bytes when the source holds them in memory (a
    /// checkpoint's map, borrowed: no copy); `None` for a source that computes its values.
    fn stored(&self, _tensor: &str) -> Result<Option<StoredTensor<'_>>> {
        Ok(None)
    }
    /// Appends elements `[from, from + count)` as bf16, equal to `half::bf16::from_f32` of
    /// what [`WeightSource::read`] gives: straight from the stored bytes where there are
    /// some (bf16 is copied), otherwise through `read` a bounded chunk at a time.
    fn read_bf16(
        &self,
        tensor: &str,
        from: usize,
        count: usize,
        out: &mut Vec<half::bf16>,
    ) -> Result<()> {
        if let Some(stored) = self.stored(tensor)? {
            // Checked first: `count` sizes the allocation.
            stored.run(from, count)?;
            return append(out, count, |dst| {
                stored.bf16_bits(from, dst.reinterpret_cast_mut())
            });
        }
        const CHUNK: usize = 1 << 14;
        let mut buf = Vec::with_capacity(CHUNK.min(count));
        let mut done = 0;
        while done < count {
            let n = CHUNK.min(count - done);
            buf.clear();
            self.read(tensor, from.saturating_add(done), n, &mut buf)?;
            out.extend(buf.iter().map(|&v| half::bf16::from_f32(v)));
            done += n;
        }
        Ok(())
    }
    /// Done with `tensor` for now: a memory-mapped source lets its pages leave this
    /// process's resident memory (the page cache keeps them; a later read maps them back).
    fn release(&self, _tensor: &str) {}
}

/// How a stored tensor's elements are encoded (little-endian).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoredDtype {
    F32,
    Bf16,
    F16,
}

impl StoredDtype {
    fn of(dtype: Dtype) -> Option<StoredDtype> {
        match dtype {
            Dtype::F32 => Some(StoredDtype::F32),
            Dtype::BF16 => Some(StoredDtype::Bf16),
            Dtype::F16 => Some(StoredDtype::F16),
            _ => None,
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            StoredDtype::F32 => 4,
            StoredDtype::Bf16 | StoredDtype::F16 => 2,
        }
    }
}

/// A stored tensor's bytes, borrowed from the source, with conversions that read a run of
/// elements straight into the caller's buffer.
pub struct StoredTensor<'a> {
    pub dtype: StoredDtype,
    /// Little-endian elements, `len() · dtype.size()` bytes.
    pub bytes: &'a [u8],
    tensor: String,
    path: &'a Path,
}

impl StoredTensor<'_> {
    /// Elements stored.
    pub fn len(&self) -> usize {
        self.bytes.len() / self.dtype.size()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes of elements `[from, from + count)`, or an error naming the tensor.
    fn run(&self, from: usize, count: usize) -> Result<&[u8]> {
        let size = self.dtype.size();
        let range = from
            .checked_add(count)
            .filter(|&end| end <= self.len())
            .map(|end| from * size..end * size);
        range
            .map(|r| &self.bytes[r])
            .ok_or_else(|| WeightError::Tensor {
                path: self.path.to_path_buf(),
                tensor: self.tensor.clone(),
                problem: format!(
                    "elements {from}..{} asked for, it has {}; the plan does not match these weights",
                    from.saturating_add(count),
                    self.len()
                ),
            })
    }

    /// Elements `[from, from + out.len())` as f32 (bf16 and f16 widen exactly).
    pub fn f32s(&self, from: usize, out: &mut [f32]) -> Result<()> {
        let bytes = self.run(from, out.len())?;
        // Byte arrays (not `chunks_exact`) so that these loops vectorise.
        match self.dtype {
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
        }
        Ok(())
    }

    /// Elements `[from, from + out.len())` as bf16 bits, equal to `half::bf16::from_f32` of
    /// [`StoredTensor::f32s`]: bf16 is copied (a NaN gets its quiet bit, as that round trip
    /// gives it), f32 and f16 are rounded to nearest even.
    pub fn bf16_bits(&self, from: usize, out: &mut [u16]) -> Result<()> {
        let bytes = self.run(from, out.len())?;
        match self.dtype {
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
        }
        Ok(())
    }
}

/// `bytes` as whole `N`-byte arrays, the tail dropped (what `slice::as_chunks` does, newer
/// than this crate's minimum Rust).
fn byte_arrays<const N: usize>(bytes: &[u8]) -> &[[u8; N]] {
    // SAFETY: `[u8; N]` has size N and alignment 1, so `len / N` of them lie within `bytes`
    // whatever its address, and any bytes are a valid `[u8; N]`.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast(), bytes.len() / N) }
}

/// One rank's piece of a tensor, as f32, with padding of zeros; the tensor's pages are
/// released afterwards (see [`WeightSource::release`]).
pub fn load_slice(src: &dyn WeightSource, w: &WeightSlice) -> Result<Tensor> {
    let (local, data) = load_slice_as(src, w, |t, from, count, out: &mut Vec<f32>| {
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
    load_slice_as(src, w, |t, from, count, out: &mut Vec<half::bf16>| {
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
    src: &dyn WeightSource,
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
    src.release(&w.tensor);
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
                let mut end = 0;
                for &(l, s, n) in ranges {
                    end = l + n;
                    let (a, b) = (l.max(c0), end.min(c1));
                    if a < b {
                        let from = r * self.stored_cols + s + (a - l);
                        f(a - c0, Piece::Stored { from, len: b - a })?;
                    }
                }
                let a = end.max(c0);
                if a < c1 {
                    f(a - c0, Piece::Zeros { len: c1 - a })?;
                }
                Ok(())
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
        if let Ok(ckpt) = Checkpoint::open(&dir) {
            for name in ["a", "b", "missing"] {
                let _ = ckpt.stored(name);
                for &(from, count) in reads {
                    let mut f = Vec::new();
                    if ckpt.read(name, from, count, &mut f).is_err() {
                        assert!(f.is_empty(), "a failed read leaves the output as it was");
                    }
                    let mut b = Vec::new();
                    let _ = ckpt.read_bf16(name, from, count, &mut b);
                }
                ckpt.release(name);
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
        let stored = ckpt.stored("a").unwrap().unwrap();
        assert_eq!((stored.dtype, stored.len()), (StoredDtype::Bf16, 4));
        // One past the end, and an overflowing range: errors that name the tensor.
        let e = ckpt.read("a", 2, 3, &mut f).unwrap_err().to_string();
        assert!(e.contains("`a`") && e.contains("2..5"), "{e}");
        assert!(ckpt.read_bf16("a", usize::MAX, 2, &mut b).is_err());
        assert_eq!((f.len(), b.len()), (6, 1));
        drop(ckpt);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
