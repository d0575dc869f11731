//! How the indices of one weight dimension group into units that must stay on one rank
//! (attention heads, fused q|k|v parts, vocab rows), and how such a dimension is sliced
//! for one rank.

use serde::{Deserialize, Serialize};

/// The structure of a splittable dimension.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Groups {
    /// Every index is its own unit; ranks get contiguous blocks. With `padded`, a size that
    /// tp does not divide is padded up (vocab); the padding is masked, never visible.
    Plain { padded: bool },
    /// `count` contiguous heads of `size` each. `replicable` heads (kv heads) may be
    /// replicated when tp is a multiple of `count`.
    Heads {
        count: u64,
        size: u64,
        #[serde(default)]
        replicable: bool,
    },
    /// A fused dimension that concatenates parts, each split on its own (`[q | k | v]`).
    Concat(Vec<Groups>),
    /// A fused dimension interleaved per head: for each of `heads`, `parts` sizes in order
    /// (GPT-NeoX `query_key_value` stores `[heads, 3, head_dim]`).
    Interleaved { heads: u64, parts: Vec<u64> },
}

impl Default for Groups {
    fn default() -> Self {
        Groups::Plain { padded: false }
    }
}

/// Why a dimension cannot be split `tp` ways.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SplitProblem {
    /// `what` (e.g. "32 attention heads") is not divisible by tp.
    NotDivisible { count: u64, unit: &'static str },
    /// Replicable heads: tp neither divides nor is a multiple of the count.
    NotShareable { count: u64 },
    /// The structure says a length other than the tensor's.
    LengthMismatch { structure: u64, tensor: u64 },
}

impl SplitProblem {
    pub fn describe(&self, tp: u64) -> String {
        match self {
            SplitProblem::NotDivisible { count, unit } => {
                format!("{count} {unit} are not divisible by tp={tp}")
            }
            SplitProblem::NotShareable { count } => format!(
                "{count} key/value heads cannot be shared by tp={tp}: tp must divide {count} \
                 or be a multiple of it (then each kv head is replicated on tp/{count} ranks)"
            ),
            SplitProblem::LengthMismatch { structure, tensor } => format!(
                "the declared head structure covers {structure} elements but the dimension has {tensor}"
            ),
        }
    }
}

/// One rank's piece of a dimension: ranges of the checkpoint dimension, in order, plus
/// zero padding appended at the end.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DimSlice {
    pub ranges: Vec<SliceRange>,
    pub padding: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SliceRange {
    pub offset: u64,
    pub len: u64,
}

impl DimSlice {
    /// Local length including padding.
    pub fn local_len(&self) -> u64 {
        super::saturating::sum(self.ranges.iter().map(|r| r.len)).saturating_add(self.padding)
    }
}

impl Groups {
    /// The length this structure covers, when it fixes one.
    pub fn covered_len(&self) -> Option<u64> {
        match self {
            Groups::Plain { .. } => None,
            Groups::Heads { count, size, .. } => Some(count.saturating_mul(*size)),
            Groups::Concat(parts) => parts
                .iter()
                .map(Groups::covered_len)
                .try_fold(0u64, |total, len| Some(total.saturating_add(len?))),
            Groups::Interleaved { heads, parts } => {
                Some(heads.saturating_mul(super::saturating::sum(parts.iter().copied())))
            }
        }
    }

    /// [`Groups::covered_len`] with checked arithmetic: `None` when it overflows, else the
    /// length it fixes (if any). Every part of a Concat is checked, sized or not, since
    /// inference may read any of them.
    pub fn checked_len(&self) -> Option<Option<u64>> {
        match self {
            Groups::Plain { .. } => Some(None),
            Groups::Heads { count, size, .. } => count.checked_mul(*size).map(Some),
            Groups::Concat(parts) => {
                let mut sum = 0u64;
                let mut sized = true;
                for part in parts {
                    match part.checked_len()? {
                        Some(n) => sum = sum.checked_add(n)?,
                        None => sized = false,
                    }
                }
                Some(sized.then_some(sum))
            }
            Groups::Interleaved { heads, parts } => {
                let per_head = parts.iter().try_fold(0u64, |t, &p| t.checked_add(p))?;
                heads.checked_mul(per_head).map(Some)
            }
        }
    }

    /// Whether a dimension of `total` elements with this structure splits `tp` ways.
    pub fn check(&self, total: u64, tp: u64) -> Result<(), SplitProblem> {
        self.slice(total, tp, 0).map(|_| ())
    }

    /// The piece of a `total`-long dimension that `rank` of `tp` holds.
    pub fn slice(&self, total: u64, tp: u64, rank: u64) -> Result<DimSlice, SplitProblem> {
        if let Some(len) = self.covered_len() {
            if len != total {
                return Err(SplitProblem::LengthMismatch {
                    structure: len,
                    tensor: total,
                });
            }
        }
        let mut ranges = Vec::new();
        let padding = self.slice_into(0, total, tp, rank, &mut ranges)?;
        Ok(DimSlice { ranges, padding })
    }

    fn slice_into(
        &self,
        base: u64,
        total: u64,
        tp: u64,
        rank: u64,
        out: &mut Vec<SliceRange>,
    ) -> Result<u64, SplitProblem> {
        match self {
            Groups::Plain { padded: false } => {
                if !total.is_multiple_of(tp) {
                    return Err(SplitProblem::NotDivisible {
                        count: total,
                        unit: "elements",
                    });
                }
                let n = total / tp;
                push_range(out, base + rank * n, n);
                Ok(0)
            }
            Groups::Plain { padded: true } => {
                let chunk = total.div_ceil(tp);
                let start = (rank * chunk).min(total);
                let len = chunk.min(total - start);
                push_range(out, base + start, len);
                Ok(chunk - len)
            }
            Groups::Heads {
                count,
                size,
                replicable,
            } => {
                if count % tp == 0 {
                    let per = count / tp;
                    push_range(out, base + rank * per * size, per * size);
                } else if *replicable && tp.is_multiple_of(*count) {
                    let head = rank / (tp / count);
                    push_range(out, base + head * size, *size);
                } else if *replicable {
                    return Err(SplitProblem::NotShareable { count: *count });
                } else {
                    return Err(SplitProblem::NotDivisible {
                        count: *count,
                        // Size-1 groups are plain features that a fused dim counts exactly.
                        unit: if *size == 1 {
                            "features"
                        } else {
                            "attention heads"
                        },
                    });
                }
                Ok(0)
            }
            Groups::Concat(parts) => {
                let mut offset = base;
                for part in parts {
                    let len = part.covered_len().unwrap_or(0);
                    part.slice_into(offset, len, tp, rank, out)?;
                    offset += len;
                }
                Ok(0)
            }
            Groups::Interleaved { heads, parts } => {
                let per_head: u64 = parts.iter().sum();
                if heads % tp != 0 {
                    return Err(SplitProblem::NotDivisible {
                        count: *heads,
                        unit: "attention heads",
                    });
                }
                let per = heads / tp;
                push_range(out, base + rank * per * per_head, per * per_head);
                Ok(0)
            }
        }
    }

    /// The structure of one rank's piece (for ops that unfuse a split fused value).
    pub fn localize(&self, tp: u64) -> Groups {
        match self {
            Groups::Plain { padded } => Groups::Plain { padded: *padded },
            Groups::Heads {
                count,
                size,
                replicable,
            } => Groups::Heads {
                count: if count % tp == 0 { count / tp } else { 1 },
                size: *size,
                replicable: *replicable,
            },
            Groups::Concat(parts) => Groups::Concat(parts.iter().map(|p| p.localize(tp)).collect()),
            Groups::Interleaved { heads, parts } => Groups::Interleaved {
                heads: (heads / tp).max(1),
                parts: parts.clone(),
            },
        }
    }
}

fn push_range(out: &mut Vec<SliceRange>, offset: u64, len: u64) {
    // Adjacent ranges merge so a plain split is always one range.
    if let Some(last) = out.last_mut() {
        if last.offset + last.len == offset {
            last.len += len;
            return;
        }
    }
    out.push(SliceRange { offset, len });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranges(s: &DimSlice) -> Vec<(u64, u64)> {
        s.ranges.iter().map(|r| (r.offset, r.len)).collect()
    }

    #[test]
    fn plain_split_is_contiguous() {
        let g = Groups::default();
        assert_eq!(ranges(&g.slice(8, 4, 2).unwrap()), vec![(4, 2)]);
        assert!(g.slice(10, 4, 0).is_err());
    }

    #[test]
    fn padded_vocab_masks_the_tail() {
        let g = Groups::Plain { padded: true };
        // 10 rows on 4 ranks: chunks of 3, the last rank holds 1 real row and 2 padding.
        let last = g.slice(10, 4, 3).unwrap();
        assert_eq!(ranges(&last), vec![(9, 1)]);
        assert_eq!(last.padding, 2);
        assert_eq!(last.local_len(), 3);
        let total: u64 = (0..4)
            .map(|r| g.slice(10, 4, r).unwrap().ranges[0].len)
            .sum();
        assert_eq!(total, 10);
    }

    #[test]
    fn kv_heads_replicate_when_tp_is_a_multiple() {
        let g = Groups::Heads {
            count: 2,
            size: 4,
            replicable: true,
        };
        let heads: Vec<_> = (0..4).map(|r| ranges(&g.slice(8, 4, r).unwrap())).collect();
        assert_eq!(
            heads,
            vec![vec![(0, 4)], vec![(0, 4)], vec![(4, 4)], vec![(4, 4)]]
        );
        assert_eq!(
            g.slice(8, 3, 0).unwrap_err(),
            SplitProblem::NotShareable { count: 2 }
        );
    }

    #[test]
    fn fused_qkv_takes_each_part() {
        // q: 4 heads of 2, k and v: 2 heads of 2 → 16 rows; rank 1 of 2.
        let kv = Groups::Heads {
            count: 2,
            size: 2,
            replicable: true,
        };
        let g = Groups::Concat(vec![
            Groups::Heads {
                count: 4,
                size: 2,
                replicable: false,
            },
            kv.clone(),
            kv,
        ]);
        let s = g.slice(16, 2, 1).unwrap();
        assert_eq!(ranges(&s), vec![(4, 4), (10, 2), (14, 2)]);
    }

    #[test]
    fn interleaved_qkv_takes_whole_heads() {
        let g = Groups::Interleaved {
            heads: 4,
            parts: vec![2, 2, 2],
        };
        assert_eq!(ranges(&g.slice(24, 2, 1).unwrap()), vec![(12, 12)]);
        assert!(g.slice(24, 3, 0).is_err());
    }

    #[test]
    fn wrong_structure_length_is_reported() {
        let g = Groups::Heads {
            count: 4,
            size: 2,
            replicable: false,
        };
        assert!(matches!(
            g.slice(10, 2, 0),
            Err(SplitProblem::LengthMismatch { .. })
        ));
    }
}
