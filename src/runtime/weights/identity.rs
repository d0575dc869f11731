//! What tells one checkpoint's weight files from another's without reading their data, for
//! the MPI ranks' agreement ([`crate::runtime::agreement`]): each file's safetensors header
//! (tensor names, types, shapes, offsets, metadata), its length, and the first and last
//! bytes of every tensor. Two fine-tunes of one model have equal headers and lengths, but
//! their values differ almost everywhere, so the samples tell them apart; a copy changed
//! only inside a tensor is not seen (the data is not read in full, which on a large
//! checkpoint would take minutes).

use super::{Checkpoint, Result};
use crate::runtime::agreement::Digest;

/// Bytes sampled at each end of every tensor's data.
const SAMPLE: u64 = 64;

impl Checkpoint {
    /// Each weight file's path in the checkpoint folder (as the index names it) with the
    /// digest of its identity, in the order the checkpoint opened them. Reads the files it
    /// opened, through `pread`, so a file that shrank since it was opened is an error, not a
    /// fault.
    pub fn file_identities(&self) -> Result<Vec<(String, u64)>> {
        let mut out = Vec::with_capacity(self.files.len());
        for f in &self.files {
            let name = f
                .path
                .strip_prefix(&self.dir)
                .unwrap_or(&f.path)
                .to_string_lossy()
                .into_owned();
            let read = |from: u64, len: u64| -> Result<Vec<u8>> {
                let mut buf = vec![0u8; len as usize];
                f.read_exact_at(from, &mut buf)?;
                Ok(buf)
            };
            let data_start = f.data_start;
            let mut d = Digest::default();
            d.u64(f.size).part(&read(0, data_start)?);
            let mut spans: Vec<(usize, usize)> = f
                .meta
                .tensors()
                .values()
                .map(|info| info.data_offsets)
                .collect();
            spans.sort_unstable();
            for (start, end) in spans {
                let (start, end) = (data_start + start as u64, data_start + end as u64);
                let head = SAMPLE.min(end - start);
                d.part(&read(start, head)?);
                d.part(&read(end - head, head)?);
            }
            out.push((name, d.finish()));
        }
        Ok(out)
    }
}
