//! Hugging Face checkpoints: `model.safetensors` or a sharded
//! `model.safetensors.index.json`, memory-mapped. Every tensor a plan needs is checked
//! before any compute; each rank then materialises only its slices, as f32.

use super::tensor::Tensor;
use crate::error::{Result, TpcError};
use crate::plan::{Plan, WeightSlice};
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

fn file_err(path: &Path, problem: impl Into<String>) -> TpcError {
    TpcError::CheckpointFile {
        path: path.to_path_buf(),
        problem: problem.into(),
    }
}

fn open_file(path: &Path) -> Result<File> {
    let f = std::fs::File::open(path).map_err(|io| TpcError::Read {
        path: path.to_path_buf(),
        io,
    })?;
    // SAFETY: the file is opened read-only and tpc never writes it; a checkpoint changed by
    // another process while we run is outside what any loader can defend against.
    let map = unsafe { Mmap::map(&f) }.map_err(|io| TpcError::Read {
        path: path.to_path_buf(),
        io,
    })?;
    let (header, meta) = SafeTensors::read_metadata(&map).map_err(|e| {
        file_err(
            path,
            format!("not a valid safetensors file ({e:?}); re-download or re-save it"),
        )
    })?;
    let data_start = 8 + header;
    let data_len = map.len() - data_start;
    for (name, info) in meta.tensors() {
        if info.data_offsets.1 > data_len {
            return Err(TpcError::CheckpointTensor {
                path: path.to_path_buf(),
                tensor: name,
                problem: format!(
                    "the file is truncated: the tensor ends at byte {} of {data_len} data bytes",
                    info.data_offsets.1
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
                files.push(open_file(&dir.join(name))?);
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
        let (name, f) = self
            .resolve(tensor)
            .ok_or_else(|| TpcError::CheckpointTensor {
                path: self.dir.clone(),
                tensor: tensor.to_string(),
                problem:
                    "missing from the checkpoint; the model definition does not match these weights"
                        .into(),
            })?;
        let file = &self.files[f];
        let info = file
            .meta
            .info(name)
            .ok_or_else(|| TpcError::CheckpointTensor {
                path: file.path.clone(),
                tensor: tensor.to_string(),
                problem: "listed in the index but missing from its file".into(),
            })?;
        Ok((file, info))
    }

    /// Checks every tensor every rank needs: present, the expected shape, a dtype tpc reads.
    pub fn check(&self, plan: &Plan) -> Result<()> {
        let mut seen = std::collections::HashSet::new();
        for w in plan.ranks.iter().flat_map(|r| &r.weights) {
            if !seen.insert(&*w.tensor) {
                continue;
            }
            let (file, info) = self.info(&w.tensor)?;
            let bad = |problem: String| TpcError::CheckpointTensor {
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
            if !matches!(info.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16) {
                return Err(bad(format!(
                    "has dtype {:?}; tpc reads F32, BF16 and F16",
                    info.dtype
                )));
            }
            let n: usize = info.shape.iter().product();
            if info.data_offsets.1 - info.data_offsets.0 != n * info.dtype.size() {
                return Err(bad(
                    "its byte length does not match its shape and dtype; the file is corrupt"
                        .into(),
                ));
            }
        }
        Ok(())
    }
}

impl WeightSource for Checkpoint {
    fn check(&self, plan: &Plan) -> Result<()> {
        Checkpoint::check(self, plan)
    }

    fn read(&self, tensor: &str, from: usize, count: usize, out: &mut Vec<f32>) -> Result<()> {
        let (file, info) = self.info(tensor)?;
        let bytes =
            &file.map[file.data_start + info.data_offsets.0..file.data_start + info.data_offsets.1];
        let size = info.dtype.size();
        let convert = converter(info.dtype);
        let end = (from + count) * size;
        if end > bytes.len() {
            return Err(TpcError::CheckpointTensor {
                path: file.path.clone(),
                tensor: tensor.to_string(),
                problem: format!("read past its end ({end} > {} bytes)", bytes.len()),
            });
        }
        out.extend(bytes[from * size..end].chunks_exact(size).map(convert));
        Ok(())
    }
}

/// Where weights come from: a checkpoint, or seeded random values for `tpc verify`.
pub trait WeightSource: Sync {
    /// Every problem with the tensors `plan` needs, before any compute.
    fn check(&self, plan: &Plan) -> Result<()>;
    /// Appends elements `[from, from + count)` of the flattened tensor, as f32.
    fn read(&self, tensor: &str, from: usize, count: usize, out: &mut Vec<f32>) -> Result<()>;
}

/// One rank's piece of a tensor, as f32, with padding of zeros.
pub fn load_slice(src: &dyn WeightSource, w: &WeightSlice) -> Result<Tensor> {
    let shape: Vec<usize> = w.shape.iter().map(|&d| d as usize).collect();
    let local: Vec<usize> = w.local_shape.iter().map(|&d| d as usize).collect();
    let mut out = Vec::with_capacity(local.iter().product());
    match (w.dim, shape.len()) {
        (None, _) => src.read(&w.tensor, 0, shape.iter().product(), &mut out)?,
        (Some(0), _) => {
            // Row slices are contiguous runs of the stored tensor.
            let row: usize = shape[1..].iter().product();
            for r in &w.ranges {
                src.read(
                    &w.tensor,
                    r.offset as usize * row,
                    r.len as usize * row,
                    &mut out,
                )?;
            }
            out.resize(out.len() + w.padding as usize * row, 0.0);
        }
        (Some(1), 2) => {
            for row in 0..shape[0] {
                for r in &w.ranges {
                    src.read(
                        &w.tensor,
                        row * shape[1] + r.offset as usize,
                        r.len as usize,
                        &mut out,
                    )?;
                }
                out.resize(out.len() + w.padding as usize, 0.0);
            }
        }
        (Some(d), rank) => {
            return Err(TpcError::BadInstruction {
                name: w.tensor.to_string(),
                problem: format!(
                "the plan splits dim {d} of a rank-{rank} tensor, which the loader cannot slice"
            ),
            })
        }
    }
    Ok(Tensor::new(local, out))
}

fn converter(dtype: Dtype) -> fn(&[u8]) -> f32 {
    match dtype {
        Dtype::BF16 => |b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        Dtype::F16 => |b| half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
        _ => |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
    }
}
