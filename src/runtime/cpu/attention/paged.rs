//! One sequence's cached keys and values read in place from a paged pool through its block
//! table: position `p` lives in row `blocks[p / block_size] · block_size + p % block_size`
//! of the pool. The kernels walk the positions as [`Run`]s (positions that lie in
//! consecutive pool rows: one block, or several whose ids follow each other), so they divide
//! once per block, never per key, and read each key where it lies (no gathered copy of the
//! sequence's cache, which would double a decode step's memory traffic).

use std::ops::Range;

/// Positions `pos .. pos + len` of a sequence, at pool rows `row .. row + len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Run {
    pub pos: usize,
    pub row: usize,
    pub len: usize,
}

/// A sequence's first `n` cached keys and values (rows of `kcols` values each in `k` and
/// `v`), checked: every run lies inside the pool, so the kernels may read any position
/// below `n` without bounds checks.
pub struct KvView<'a> {
    k: &'a [f32],
    v: &'a [f32],
    kcols: usize,
    n: usize,
    /// The positions `0..n` in order, consecutive blocks merged.
    runs: Vec<Run>,
}

impl<'a> KvView<'a> {
    /// Positions `0..n` of a sequence whose table is `blocks` in a pool of rows of `kcols`
    /// keys (`k`) and values (`v`) in blocks of `block_size` rows. Refuses (with the reason)
    /// a table too short for `n`, a block outside the pool, or a pool that is not whole
    /// blocks of rows.
    pub fn new(
        k: &'a [f32],
        v: &'a [f32],
        kcols: usize,
        block_size: usize,
        blocks: &[u32],
        n: usize,
    ) -> Result<KvView<'a>, String> {
        if kcols == 0 || block_size == 0 {
            return Err(format!(
                "a KV pool of rows of {kcols} values in blocks of {block_size} rows"
            ));
        }
        let block_len = block_size
            .checked_mul(kcols)
            .ok_or_else(|| format!("KV blocks of {block_size} rows of {kcols} values"))?;
        if k.len() != v.len() || !k.len().is_multiple_of(block_len) {
            return Err(format!(
                "a KV pool of {} keys and {} values is not whole blocks of {block_size} rows of {kcols}",
                k.len(),
                v.len()
            ));
        }
        let pool_blocks = k.len() / block_len;
        let used = n.div_ceil(block_size);
        if blocks.len() < used {
            return Err(format!(
                "a block table of {} blocks of {block_size} for {n} positions",
                blocks.len()
            ));
        }
        let mut runs: Vec<Run> = Vec::new();
        for (i, &b) in blocks[..used].iter().enumerate() {
            let b = b as usize;
            if b >= pool_blocks {
                return Err(format!("block {b} of a pool of {pool_blocks} blocks"));
            }
            let pos = i * block_size;
            let len = block_size.min(n - pos);
            let row = b * block_size;
            match runs.last_mut() {
                Some(last) if last.row + last.len == row => last.len += len,
                _ => runs.push(Run { pos, row, len }),
            }
        }
        Ok(KvView {
            k,
            v,
            kcols,
            n,
            runs,
        })
    }

    /// `k`, `v` `[n, kcols]` as one run (an unpaged cache). Refuses what is not whole rows.
    pub fn contiguous(k: &'a [f32], v: &'a [f32], kcols: usize) -> Result<KvView<'a>, String> {
        if kcols == 0 || !k.len().is_multiple_of(kcols) {
            return Err(format!(
                "{} cached keys are not whole rows of {kcols}",
                k.len()
            ));
        }
        let n = k.len() / kcols;
        KvView::new(k, v, kcols, n.max(1), &[0], n)
    }

    /// Cached positions.
    pub fn len(&self) -> usize {
        self.n
    }

    /// No cached position.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// Values per key (and per value) row.
    pub fn kcols(&self) -> usize {
        self.kcols
    }

    /// The runs that cover `range` (within `0..n`), cut to it.
    pub(crate) fn runs(&self, range: Range<usize>) -> impl Iterator<Item = Run> + '_ {
        let first = self.runs.partition_point(|r| r.pos + r.len <= range.start);
        self.runs[first..]
            .iter()
            .take_while(move |r| r.pos < range.end && range.start < range.end)
            .map(move |r| {
                let lo = r.pos.max(range.start);
                let hi = (r.pos + r.len).min(range.end);
                Run {
                    pos: lo,
                    row: r.row + (lo - r.pos),
                    len: hi - lo,
                }
            })
    }

    /// The pool row of position `p` if positions `p .. p + len` lie in consecutive rows.
    pub(crate) fn rows_at(&self, p: usize, len: usize) -> Option<usize> {
        let i = self.runs.partition_point(|r| r.pos + r.len <= p);
        let r = self.runs.get(i)?;
        (r.pos <= p && p + len <= r.pos + r.len).then(|| r.row + (p - r.pos))
    }

    /// Keys of `len` consecutive pool rows from `row` (as a run gives them).
    pub(crate) fn key_rows(&self, row: usize, len: usize) -> &'a [f32] {
        &self.k[row * self.kcols..(row + len) * self.kcols]
    }

    /// Values of `len` consecutive pool rows from `row`.
    pub(crate) fn value_rows(&self, row: usize, len: usize) -> &'a [f32] {
        &self.v[row * self.kcols..(row + len) * self.kcols]
    }

    /// The pool's keys and values (for the unchecked kernels: a run's rows lie inside).
    pub(crate) fn pool(&self) -> (&'a [f32], &'a [f32]) {
        (self.k, self.v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_merge_consecutive_blocks_and_cut_to_a_range() {
        let pool = vec![0f32; 10 * 3 * 2];
        // Blocks of 3 rows of 2: table [5, 6, 2, 9], 11 positions (the last block partly).
        let view = KvView::new(&pool, &pool, 2, 3, &[5, 6, 2, 9, 1], 11).unwrap();
        let all: Vec<Run> = view.runs(0..11).collect();
        assert_eq!(
            all,
            vec![
                Run {
                    pos: 0,
                    row: 15,
                    len: 6
                },
                Run {
                    pos: 6,
                    row: 6,
                    len: 3
                },
                Run {
                    pos: 9,
                    row: 27,
                    len: 2
                },
            ]
        );
        let cut: Vec<Run> = view.runs(4..10).collect();
        assert_eq!(
            cut,
            vec![
                Run {
                    pos: 4,
                    row: 19,
                    len: 2
                },
                Run {
                    pos: 6,
                    row: 6,
                    len: 3
                },
                Run {
                    pos: 9,
                    row: 27,
                    len: 1
                },
            ]
        );
        assert_eq!(view.rows_at(1, 5), Some(16));
        assert_eq!(view.rows_at(5, 2), None);
        assert_eq!(view.rows_at(9, 2), Some(27));
        assert_eq!(view.rows_at(10, 2), None);
    }

    #[test]
    fn a_short_table_or_a_block_outside_the_pool_is_refused() {
        let pool = vec![0f32; 4 * 2 * 2];
        assert!(KvView::new(&pool, &pool, 2, 2, &[0, 1], 5).is_err());
        assert!(KvView::new(&pool, &pool, 2, 2, &[0, 4, 1], 5).is_err());
        assert!(KvView::new(&pool, &pool[1..], 2, 2, &[0], 1).is_err());
        assert!(KvView::new(&pool, &pool, 2, 0, &[0], 1).is_err());
        // Blocks past the positions used are not looked at.
        assert!(KvView::new(&pool, &pool, 2, 2, &[3, 1, 99], 4).is_ok());
        assert!(KvView::contiguous(&pool[..3], &pool[..3], 2).is_err());
        assert_eq!(KvView::contiguous(&[], &[], 2).unwrap().len(), 0);
    }
}
