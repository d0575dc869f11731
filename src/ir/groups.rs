//! How the indices of one weight dimension group into units that must stay on one rank
//! (attention heads, fused q|k|v parts, vocab rows), and how such a dimension is sliced
//! for one rank.

use super::shares::TpShares;
use serde::{Deserialize, Serialize};

/// The structure of a splittable dimension.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Groups {
    /// Every index is its own unit; ranks get contiguous blocks. With `padded`, a size that
    /// tp does not divide is padded up (vocab); the padding is masked, never visible.
    /// Dealt by shares, either kind is dealt in atoms (see `plain_atom`).
    Plain { padded: bool },
    /// `count` contiguous heads of `size` each. `replicable` heads (kv heads) may be
    /// replicated when tp is a multiple of `count`.
    Heads {
        count: u64,
        size: u64,
        #[serde(default)]
        replicable: bool,
        /// The key/value groups the heads fall into, in order (query heads: the kv heads;
        /// kv heads: their own count). Declared, a tp that neither divides the groups nor is
        /// a multiple of them deals whole groups unevenly (each rank's piece padded to the
        /// largest), so that query and kv heads stay together; absent, only even splits.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        kv_groups: Option<u64>,
    },
    /// A fused dimension that concatenates parts, each split on its own (`[q | k | v]`).
    Concat(Vec<Groups>),
    /// A fused dimension interleaved per head: for each of `heads`, `parts` sizes in order
    /// (GPT-NeoX `query_key_value` stores `[heads, 3, head_dim]`).
    Interleaved { heads: u64, parts: Vec<u64> },
}

impl Groups {
    /// The experts dim of a mixture-of-experts weight stack (`frontend::preset`'s
    /// `experts_block`): one-entry atoms, each its own group, dealt whole. No attention
    /// structure has one-element heads (RoPE needs an even head size).
    pub fn is_experts(&self) -> bool {
        matches!(self, Groups::Heads { count, size: 1, replicable: false, kv_groups: Some(g) } if g == count)
    }
}

impl Default for Groups {
    fn default() -> Self {
        Groups::Plain { padded: false }
    }
}

/// Why a dimension cannot be split `tp` ways.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SplitProblem {
    /// More ranks than heads (or experts, `unit`): some rank would hold none.
    MoreRanksThanHeads { count: u64, unit: &'static str },
    /// `what` (e.g. "32 attention heads") is not divisible by tp.
    NotDivisible { count: u64, unit: &'static str },
    /// Replicable heads: tp neither divides nor is a multiple of the count.
    NotShareable { count: u64 },
    /// The structure says a length other than the tensor's.
    LengthMismatch { structure: u64, tensor: u64 },
    /// Per-rank shares of heads whose key/value groups the model does not declare: the
    /// query and kv heads could not be dealt so that each rank keeps its queries' kv heads.
    SharesNeedGroups,
}

impl SplitProblem {
    pub fn describe(&self, tp: u64) -> String {
        match self {
            SplitProblem::MoreRanksThanHeads { count, unit } => format!(
                "{count} {unit} cannot be shared by tp={tp}: every rank needs at least one"
            ),
            // Heads that declare their key/value groups deal whole groups unevenly, so
            // these two are said only of heads that do not: say how to declare them.
            SplitProblem::NotDivisible { count, unit } if *unit == "attention heads" => format!(
                "{count} {unit} are not divisible by tp={tp} (declared with their key/value \
                 groups, `kv_groups` as a preset's are, heads are dealt unevenly by whole groups)"
            ),
            SplitProblem::NotDivisible { count, unit } => {
                format!("{count} {unit} are not divisible by tp={tp}")
            }
            SplitProblem::NotShareable { count } => format!(
                "{count} key/value heads cannot be shared by tp={tp}: tp must divide {count} \
                 or be a multiple of it (then each kv head is replicated on tp/{count} ranks), \
                 or the heads declare their key/value groups (`kv_groups`)"
            ),
            SplitProblem::LengthMismatch { structure, tensor } => format!(
                "the declared head structure covers {structure} elements but the dimension has {tensor}"
            ),
            SplitProblem::SharesNeedGroups => format!(
                "attention heads without declared key/value groups split only evenly, not by --tp-shares (tp={tp}); declare the groups (a preset does) or drop the shares"
            ),
        }
    }
}

/// One rank's piece of a dimension: ranges of the checkpoint dimension, in order, each
/// followed by its own zero padding (a fused dimension's part padded to the largest piece
/// of that part), plus zero padding appended at the end.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DimSlice {
    pub ranges: Vec<SliceRange>,
    pub padding: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub struct SliceRange {
    pub offset: u64,
    pub len: u64,
    /// Zeros that follow this range in the local piece (inside a fused dimension whose
    /// parts are dealt unevenly); the piece's end padding is `DimSlice::padding`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub pad: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// How a dimension is dealt: over `tp` ranks evenly, or by per-rank `shares`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deal {
    pub tp: u64,
    /// Unequal shares, one per rank (`--tp-shares`); `None` for the even split.
    pub shares: Option<TpShares>,
    /// Elements a plain dimension's pieces are made of where its length allows (the
    /// quantization blocks of the plan's weights, [`graph_split_block`]); 1: none.
    ///
    /// [`graph_split_block`]: super::quant::graph_split_block
    pub block: u64,
}

impl Deal {
    /// The even split over `tp` ranks.
    pub fn even(tp: u64) -> Deal {
        Deal {
            tp,
            shares: None,
            block: 1,
        }
    }

    /// A split over `tp` ranks by `shares` when they are given and unequal (equal shares
    /// are the even split). The caller has checked that there is one share per rank.
    pub fn by(tp: u64, shares: Option<TpShares>) -> Deal {
        Deal {
            tp,
            shares: shares.filter(|s| !s.is_even()),
            block: 1,
        }
    }

    /// This deal with plain dimensions made of `block`-element pieces where they divide.
    pub fn in_blocks(self, block: u64) -> Deal {
        Deal {
            block: block.max(1),
            ..self
        }
    }

    /// How many of `items` atoms each rank holds, when dealt by shares.
    fn counts(&self, items: u64) -> Option<Vec<u64>> {
        self.shares.map(|s| s.apportion(items))
    }
}

impl DimSlice {
    /// Local length including padding.
    pub fn local_len(&self) -> u64 {
        super::saturating::sum(self.ranges.iter().map(|r| r.len.saturating_add(r.pad)))
            .saturating_add(self.padding)
    }

    /// Local length without padding: the checkpoint elements the piece holds.
    pub fn real_len(&self) -> u64 {
        super::saturating::sum(self.ranges.iter().map(|r| r.len))
    }

    /// Whether some padding lies inside the piece (not only at its end).
    pub fn padded_inside(&self) -> bool {
        self.ranges.iter().any(|r| r.pad > 0)
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
        self.check_dealt(total, Deal::even(tp))
    }

    /// Whether a dimension of `total` elements with this structure can be dealt so.
    pub fn check_dealt(&self, total: u64, deal: Deal) -> Result<(), SplitProblem> {
        self.slice_dealt(total, deal, 0).map(|_| ())
    }

    /// The piece of a `total`-long dimension that `rank` of `tp` holds.
    pub fn slice(&self, total: u64, tp: u64, rank: u64) -> Result<DimSlice, SplitProblem> {
        self.slice_dealt(total, Deal::even(tp), rank)
    }

    /// The piece of a `total`-long dimension that `rank` holds when it is dealt so.
    pub fn slice_dealt(&self, total: u64, deal: Deal, rank: u64) -> Result<DimSlice, SplitProblem> {
        if let Some(len) = self.covered_len() {
            if len != total {
                return Err(SplitProblem::LengthMismatch {
                    structure: len,
                    tensor: total,
                });
            }
        }
        let mut ranges = Vec::new();
        let padding = self.slice_into(0, total, deal, rank, &mut ranges)?;
        Ok(DimSlice { ranges, padding })
    }

    fn slice_into(
        &self,
        base: u64,
        total: u64,
        deal: Deal,
        rank: u64,
        out: &mut Vec<SliceRange>,
    ) -> Result<u64, SplitProblem> {
        let tp = deal.tp;
        match self {
            // Vocabulary rows too: the logits' all-gather joins pieces by their counts.
            Groups::Plain { .. } if deal.shares.is_some() => {
                let atom = plain_atom(total, deal.block);
                let counts = deal.counts(total / atom).unwrap_or_default();
                Ok(deal_counts(out, base, &counts, atom, rank))
            }
            Groups::Plain { padded: false } => {
                // An even piece that would cut the plan's quantization blocks is dealt
                // in blocks instead.
                let blocked = deal.block > 1 && total.is_multiple_of(deal.block);
                if total.is_multiple_of(tp) && (!blocked || (total / tp).is_multiple_of(deal.block))
                {
                    let n = total / tp;
                    push_range(out, base + rank * n, n);
                    return Ok(0);
                }
                // Atoms dealt as evenly as they allow, every piece padded to the largest.
                let atom = plain_atom(total, deal.block);
                Ok(deal_evenly(out, base, total / atom, atom, tp, rank))
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
                kv_groups: Some(groups),
            } if deal.shares.is_some()
                || count % tp != 0
                || !groups.is_multiple_of(tp) && !tp.is_multiple_of(*groups) =>
            {
                let heads = HeadGroups {
                    count: *count,
                    size: *size,
                    replicable: *replicable,
                    groups: *groups,
                };
                uneven_heads(out, base, heads, deal, rank)
            }
            Groups::Heads { .. } if deal.shares.is_some() => Err(SplitProblem::SharesNeedGroups),
            Groups::Heads {
                count,
                size,
                replicable,
                ..
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
            // Each part dealt on its own; a part dealt unevenly is padded to its largest
            // piece right after the rank's real share of it, so that every rank's piece has
            // the same parts at the same local offsets.
            Groups::Concat(parts) => {
                let mut offset = base;
                let mut padding = 0;
                for part in parts {
                    let len = part.covered_len().unwrap_or(0);
                    pad_after(out, offset, padding);
                    padding = part.slice_into(offset, len, deal, rank, out)?;
                    offset += len;
                }
                Ok(padding)
            }
            // Whole heads of all parts, dealt as heads of their own key/value group are.
            Groups::Interleaved { heads, parts } => {
                let per_head: u64 = parts.iter().sum();
                if heads % tp == 0 && deal.shares.is_none() {
                    let per = heads / tp;
                    push_range(out, base + rank * per * per_head, per * per_head);
                    return Ok(0);
                }
                let heads = HeadGroups {
                    count: *heads,
                    size: per_head,
                    replicable: false,
                    groups: *heads,
                };
                uneven_heads(out, base, heads, deal, rank)
            }
        }
    }

    /// Each rank's real length of a `total`-long dimension split `tp` ways, when the split
    /// is uneven (some rank's piece is padded); `None` when it is even or impossible.
    pub fn uneven_shares(&self, total: u64, deal: Deal) -> Option<Vec<u64>> {
        let pieces: Vec<DimSlice> = (0..deal.tp)
            .map(|r| self.slice_dealt(total, deal, r))
            .collect::<Result<_, _>>()
            .ok()?;
        pieces
            .iter()
            .any(|p| p.padding > 0 || p.padded_inside())
            .then(|| pieces.iter().map(DimSlice::real_len).collect())
    }

    /// The structure of one rank's piece of a `total`-long dimension dealt so (for ops that
    /// unfuse a split fused value): every rank's piece has the same parts of the same local
    /// lengths, padding included, so the structure is one for all ranks.
    pub fn localize(&self, total: u64, deal: Deal) -> Groups {
        let local = |g: &Groups, len: u64| {
            g.slice_dealt(len, deal, 0)
                .map(|s| s.local_len())
                .unwrap_or(len)
        };
        match self {
            Groups::Plain { padded } => Groups::Plain { padded: *padded },
            Groups::Heads {
                size,
                replicable,
                kv_groups,
                ..
            } => Groups::Heads {
                count: local(self, total) / (*size).max(1),
                size: *size,
                replicable: *replicable,
                kv_groups: kv_groups.map(|g| match g % deal.tp {
                    0 => g / deal.tp,
                    _ => 1,
                }),
            },
            Groups::Concat(parts) => Groups::Concat(
                parts
                    .iter()
                    .map(|p| p.localize(p.covered_len().unwrap_or(0), deal))
                    .collect(),
            ),
            Groups::Interleaved { parts, .. } => Groups::Interleaved {
                heads: local(self, total) / parts.iter().sum::<u64>().max(1),
                parts: parts.clone(),
            },
        }
    }
}

/// The atom of an uneven plain split (MLP columns and such): a 32nd of the length where that
/// is a whole run of at least 64 — the piece of an even tp of 32, so that the boundaries of
/// the power-of-two tps and of every uneven one fall on atoms and the exact sums of
/// `--numerics invariant` keep the blocks the even tps give them — else the largest power of
/// two up to 64 that divides the length. Where the plan's weights are quantized in
/// `block`-element blocks that the length holds whole and that atom would cut, the block
/// itself: the finest piece a split may take (FP8's 128 of Qwen3-32B's 25600 MLP columns,
/// whose 32nd, 800, would cut them).
fn plain_atom(total: u64, block: u64) -> u64 {
    let atom = if total.is_multiple_of(32) && total / 32 >= 64 {
        total / 32
    } else {
        (0..=6)
            .rev()
            .map(|k| 1u64 << k)
            .find(|&b| total.is_multiple_of(b))
            .unwrap_or(1)
    };
    if block > 1 && total.is_multiple_of(block) && !atom.is_multiple_of(block) {
        block
    } else {
        atom
    }
}

/// Deals atoms of `atom` elements, `counts[r]` to rank `r` in rank order, and pushes
/// `rank`'s; returns its padding up to the largest piece.
fn deal_counts(out: &mut Vec<SliceRange>, base: u64, counts: &[u64], atom: u64, rank: u64) -> u64 {
    let r = rank as usize;
    let start: u64 = counts[..r.min(counts.len())].iter().sum();
    let held = counts.get(r).copied().unwrap_or(0);
    if held > 0 {
        push_range(out, base + start * atom, held * atom);
    }
    let largest = counts.iter().copied().max().unwrap_or(0);
    (largest - held) * atom
}

/// Deals `atoms` atoms of `atom` elements over `tp` ranks, `ceil(atoms / tp)` to each until
/// they run out (the last ranks take fewer, perhaps none), and pushes `rank`'s; returns its
/// padding up to the largest piece. All padding lies after every rank's real atoms in the
/// dimension's order, so a gather of the pieces drops it from the end.
fn deal_evenly(
    out: &mut Vec<SliceRange>,
    base: u64,
    atoms: u64,
    atom: u64,
    tp: u64,
    rank: u64,
) -> u64 {
    let per = atoms.div_ceil(tp);
    let counts: Vec<u64> = (0..tp)
        .map(|r| per.min(atoms.saturating_sub(r * per)))
        .collect();
    deal_counts(out, base, &counts, atom, rank)
}

/// A head dimension whose heads fall into key/value groups.
#[derive(Debug, Clone, Copy)]
struct HeadGroups {
    count: u64,
    size: u64,
    replicable: bool,
    groups: u64,
}

impl HeadGroups {
    /// The experts of a mixture-of-experts stack: one-entry atoms, each its own group.
    fn are_experts(&self) -> bool {
        self.size == 1 && self.groups == self.count && !self.replicable
    }
}

/// Heads dealt by key/value group when tp does not split them evenly, or by shares. Fewer
/// ranks than groups: whole groups, as evenly as they allow or by the shares (query and kv
/// heads alike, so each rank's query heads use its kv heads). As many or more: each rank
/// serves one group (rank `r` group `r·groups/tp`), holds its kv head (replicated) and
/// shares its query heads with the group's other ranks, as evenly as they allow or by their
/// shares. Every piece is padded to the largest.
fn uneven_heads(
    out: &mut Vec<SliceRange>,
    base: u64,
    heads: HeadGroups,
    deal: Deal,
    rank: u64,
) -> Result<u64, SplitProblem> {
    let HeadGroups {
        count,
        size,
        replicable,
        groups,
    } = heads;
    let tp = deal.tp;
    if groups == 0 || !count.is_multiple_of(groups) {
        return Err(SplitProblem::NotDivisible {
            count,
            unit: "attention heads (by their key/value groups)",
        });
    }
    if !replicable && count < tp {
        let unit = if heads.are_experts() {
            "experts"
        } else {
            "attention heads"
        };
        return Err(SplitProblem::MoreRanksThanHeads { count, unit });
    }
    let per_group = count / groups;
    if tp < groups {
        return Ok(match deal.counts(groups) {
            Some(counts) => deal_counts(out, base, &counts, per_group * size, rank),
            None => deal_evenly(out, base, groups, per_group * size, tp, rank),
        });
    }
    let first = |g: u64| (g * tp).div_ceil(groups);
    // The query heads of group `g` held by each of its ranks.
    let held_in = |g: u64| -> Vec<u64> {
        let ranks = first(g + 1) - first(g);
        match deal.shares {
            Some(s) => {
                let of_group = &s.parts()[first(g) as usize..first(g + 1) as usize];
                TpShares::new(&of_group.iter().map(|&p| u64::from(p)).collect::<Vec<_>>())
                    .map(|t| t.apportion(per_group))
                    .unwrap_or_default()
            }
            None => {
                let share = per_group.div_ceil(ranks);
                (0..ranks)
                    .map(|j| share.min(per_group.saturating_sub(j * share)))
                    .collect()
            }
        }
    };
    let group = rank * groups / tp;
    let base = base + group * per_group * size;
    if replicable {
        push_range(out, base, per_group * size);
        return Ok(0);
    }
    let mine = held_in(group);
    let j = (rank - first(group)) as usize;
    let held = mine.get(j).copied().unwrap_or(0);
    let start: u64 = mine[..j.min(mine.len())].iter().sum();
    if held > 0 {
        push_range(out, base + start * size, held * size);
    }
    let largest = (0..groups).flat_map(held_in).max().unwrap_or(held);
    Ok((largest - held) * size)
}

fn push_range(out: &mut Vec<SliceRange>, offset: u64, len: u64) {
    // Adjacent ranges merge so a plain split is always one range.
    if let Some(last) = out.last_mut() {
        if last.offset + last.len == offset && last.pad == 0 {
            last.len += len;
            return;
        }
    }
    out.push(SliceRange {
        offset,
        len,
        pad: 0,
    });
}

/// Puts `padding` zeros after the ranges pushed so far: after the last one, or, where the
/// rank holds nothing yet, after an empty range at `offset`.
fn pad_after(out: &mut Vec<SliceRange>, offset: u64, padding: u64) {
    if padding == 0 {
        return;
    }
    match out.last_mut() {
        Some(last) => last.pad += padding,
        None => out.push(SliceRange {
            offset,
            len: 0,
            pad: padding,
        }),
    }
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
        // 10 = 5 atoms of 2 at tp 4: 2, 2, 1 and 0 atoms, each piece padded to 4.
        assert_eq!(
            dealt(&g, 10, 4),
            vec![
                (vec![(0, 4)], 0),
                (vec![(4, 4)], 0),
                (vec![(8, 2)], 2),
                (vec![], 4)
            ]
        );
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
            kv_groups: None,
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
            kv_groups: None,
        };
        let g = Groups::Concat(vec![
            Groups::Heads {
                count: 4,
                size: 2,
                replicable: false,
                kv_groups: None,
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
        // Unevenly: whole heads, 2/2/0, padded at the end; never more ranks than heads.
        assert_eq!(dealt(&g, 24, 3)[2], (vec![], 12));
        assert!(g.slice(24, 5, 0).is_err());
    }

    /// Each rank's (ranges, padding) of `g` over `total` at `tp`.
    fn dealt(g: &Groups, total: u64, tp: u64) -> Vec<(Vec<(u64, u64)>, u64)> {
        (0..tp)
            .map(|r| {
                let s = g.slice(total, tp, r).unwrap();
                (ranges(&s), s.padding)
            })
            .collect()
    }

    #[test]
    fn plain_dims_deal_atoms_unevenly_padding_to_the_largest() {
        let g = Groups::default();
        // 5632 (TinyLlama's MLP) = 32 atoms of 176 at tp 3: 11, 11, 10.
        assert_eq!(
            dealt(&g, 5632, 3),
            vec![
                (vec![(0, 1936)], 0),
                (vec![(1936, 1936)], 0),
                (vec![(3872, 1760)], 176)
            ]
        );
        // 96 = 3 atoms of 32 at tp 5: the last two ranks hold only padding.
        let five = dealt(&g, 96, 5);
        assert_eq!(five[2], (vec![(64, 32)], 0));
        assert_eq!(five[4], (vec![], 32));
        // 100 = 25 atoms of 4 at tp 3: 9, 9, 7.
        assert_eq!(dealt(&g, 100, 3)[2], (vec![(72, 28)], 8));
        // Even splits are unchanged.
        assert_eq!(dealt(&g, 96, 2)[1], (vec![(48, 48)], 0));
    }

    /// The real lengths each rank holds of a plain `total` dealt so.
    fn real_lens(total: u64, deal: Deal) -> Vec<u64> {
        (0..deal.tp)
            .map(|r| {
                Groups::default()
                    .slice_dealt(total, deal, r)
                    .unwrap()
                    .real_len()
            })
            .collect()
    }

    #[test]
    fn quantization_blocks_make_the_atoms_where_the_plain_ones_would_cut_them() {
        // Qwen3-32B's 25600 MLP columns in FP8 blocks of 128: a 32nd (800) would cut them,
        // so 200 blocks are dealt, 67/67/66 at tp 3; by shares 3,1 150/50.
        let fp8 = |deal: Deal| deal.in_blocks(128);
        assert_eq!(real_lens(25600, fp8(Deal::even(3))), [8576, 8576, 8448]);
        let shares = "3,1".parse().ok();
        assert_eq!(real_lens(25600, fp8(Deal::by(2, shares))), [19200, 6400]);
        // An even piece that cuts them (1280 / 4 = 320, 2.5 blocks) is dealt in blocks.
        assert_eq!(real_lens(1280, fp8(Deal::even(4))), [384, 384, 384, 128]);
        // Even pieces of whole blocks, and plain atoms that are whole blocks, are unchanged.
        assert_eq!(real_lens(25600, fp8(Deal::even(8))), [3200; 8]);
        assert_eq!(
            real_lens(5632, Deal::even(3).in_blocks(16)),
            real_lens(5632, Deal::even(3))
        );
        // A length the blocks do not divide keeps its plain atoms (its weights' own
        // check then says which blocks a piece would cut).
        assert_eq!(
            real_lens(100, Deal::even(3).in_blocks(128)),
            real_lens(100, Deal::even(3))
        );
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]
        /// Any plain length dealt over any tp, evenly or by shares, in blocks of any size:
        /// the ranks' real pieces are one run each, in rank order, covering the length
        /// exactly once; where the blocks divide the length every boundary is on a block.
        #[test]
        fn plain_pieces_cover_the_length_once_on_block_boundaries(
            blocks in 1u64..400,
            block in proptest::sample::select(vec![1u64, 8, 16, 32, 64, 128]),
            cut in 0u64..3,
            tp in 1u64..=12,
            shares in proptest::collection::vec(1u64..=5, 12),
            by_shares in proptest::bool::ANY,
        ) {
            // A length the blocks divide, or one a few elements short of it.
            let total = (blocks * block).saturating_sub(cut).max(1);
            let list = shares[..tp as usize]
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(",");
            let deal = if by_shares {
                Deal::by(tp, list.parse().ok())
            } else {
                Deal::even(tp)
            }
            .in_blocks(block);
            let mut next = 0;
            for rank in 0..tp {
                let piece = Groups::default().slice_dealt(total, deal, rank).unwrap();
                proptest::prop_assert!(piece.ranges.len() <= 1, "{piece:?}");
                for r in &piece.ranges {
                    proptest::prop_assert_eq!(r.offset, next);
                    next += r.len;
                    if total.is_multiple_of(block) {
                        proptest::prop_assert!(
                            r.offset.is_multiple_of(block) && next.is_multiple_of(block),
                            "total {total} block {block} tp {tp} {deal:?}: {r:?}"
                        );
                    }
                }
            }
            proptest::prop_assert_eq!(next, total);
        }
    }

    #[test]
    fn heads_with_kv_groups_deal_whole_groups_so_queries_keep_their_kv_heads() {
        let q = |count, groups| Groups::Heads {
            count,
            size: 1,
            replicable: false,
            kv_groups: Some(groups),
        };
        let kv = |count| Groups::Heads {
            count,
            size: 1,
            replicable: true,
            kv_groups: Some(count),
        };
        // Llama-3-8B at tp 3: kv groups 3/3/2, query heads 12/12/8 (padded to 12).
        assert_eq!(
            dealt(&kv(8), 8, 3),
            vec![(vec![(0, 3)], 0), (vec![(3, 3)], 0), (vec![(6, 2)], 1)]
        );
        assert_eq!(
            dealt(&q(32, 8), 32, 3),
            vec![(vec![(0, 12)], 0), (vec![(12, 12)], 0), (vec![(24, 8)], 4)]
        );
        // Qwen2-7B at tp 8: 28 query heads in 4 groups of 7; two ranks per group, 4 and 3
        // query heads, each holding the group's kv head.
        let q8 = dealt(&q(28, 4), 28, 8);
        assert_eq!(&q8[..2], &[(vec![(0, 4)], 0), (vec![(4, 3)], 1)]);
        assert_eq!(q8[7], (vec![(25, 3)], 1));
        assert_eq!(dealt(&kv(4), 4, 8)[7], (vec![(3, 1)], 0));
        // 8 query heads in 2 groups at tp 3: ranks 0 and 1 share group 0, rank 2 has group 1.
        assert_eq!(
            dealt(&q(8, 2), 8, 3),
            vec![(vec![(0, 2)], 2), (vec![(2, 2)], 2), (vec![(4, 4)], 0)]
        );
        assert_eq!(
            dealt(&kv(2), 2, 3),
            vec![(vec![(0, 1)], 0), (vec![(0, 1)], 0), (vec![(1, 1)], 0)]
        );
        // More ranks than query heads, and even splits as before.
        assert_eq!(
            q(8, 2).check(8, 9),
            Err(SplitProblem::MoreRanksThanHeads {
                count: 8,
                unit: "attention heads"
            })
        );
        assert_eq!(dealt(&q(8, 2), 8, 4)[1], (vec![(2, 2)], 0));
        // Without kv groups, heads split only evenly.
        let plain_heads = Groups::Heads {
            count: 8,
            size: 1,
            replicable: false,
            kv_groups: None,
        };
        assert!(plain_heads.check(8, 3).is_err());
    }

    /// Each rank's (ranges, padding) of `g` over `total` dealt by `shares`.
    fn shared(g: &Groups, total: u64, shares: &str) -> Vec<(Vec<(u64, u64)>, u64)> {
        let shares: TpShares = shares.parse().unwrap();
        let deal = Deal::by(shares.tp(), Some(shares));
        (0..shares.tp())
            .map(|r| {
                let s = g.slice_dealt(total, deal, r).unwrap();
                (ranges(&s), s.padding)
            })
            .collect()
    }

    #[test]
    fn shares_deal_atoms_and_groups_in_proportion() {
        // TinyLlama's MLP, 32 atoms of 176, at 2:1 → 21 and 11 atoms.
        assert_eq!(
            shared(&Groups::default(), 5632, "2,1"),
            vec![(vec![(0, 3696)], 0), (vec![(3696, 1936)], 1760)]
        );
        // Equal shares are the even split.
        assert_eq!(
            shared(&Groups::default(), 5632, "3,3"),
            dealt(&Groups::default(), 5632, 2)
        );
        let q = Groups::Heads {
            count: 32,
            size: 2,
            replicable: false,
            kv_groups: Some(8),
        };
        let kv = Groups::Heads {
            count: 8,
            size: 2,
            replicable: true,
            kv_groups: Some(8),
        };
        // 8 kv groups at 3:1:1:1 → 4, 2, 1, 1 groups (4 query heads each): queries and kv
        // heads go together, every piece padded to rank 0's.
        assert_eq!(
            shared(&kv, 16, "3,1,1,1"),
            vec![
                (vec![(0, 8)], 0),
                (vec![(8, 4)], 4),
                (vec![(12, 2)], 6),
                (vec![(14, 2)], 6)
            ]
        );
        assert_eq!(
            shared(&q, 64, "3,1,1,1"),
            vec![
                (vec![(0, 32)], 0),
                (vec![(32, 16)], 16),
                (vec![(48, 8)], 24),
                (vec![(56, 8)], 24)
            ]
        );
        // More ranks than groups (2 groups, 4 ranks): each group's query heads go to its two
        // ranks by their shares, the kv head replicated on both.
        let q2 = Groups::Heads {
            count: 8,
            size: 1,
            replicable: false,
            kv_groups: Some(2),
        };
        assert_eq!(
            shared(&q2, 8, "3,1,1,1"),
            vec![
                (vec![(0, 3)], 0),
                (vec![(3, 1)], 2),
                (vec![(4, 2)], 1),
                (vec![(6, 2)], 1)
            ]
        );
        // Heads without declared groups are not dealt by shares.
        let bare = Groups::Heads {
            count: 8,
            size: 1,
            replicable: false,
            kv_groups: None,
        };
        let deal = Deal::by(2, Some("2,1".parse().unwrap()));
        assert_eq!(
            bare.check_dealt(8, deal),
            Err(SplitProblem::SharesNeedGroups)
        );
        // A fused dimension deals each part by the shares, each padded after its piece.
        let fused = Groups::Concat(vec![q2.clone(), q2]);
        let deal4 = Deal::by(4, Some("3,1,1,1".parse().unwrap()));
        let pieces: Vec<DimSlice> = (0..4)
            .map(|r| fused.slice_dealt(16, deal4, r).unwrap())
            .collect();
        let range = |offset, len, pad| SliceRange { offset, len, pad };
        assert_eq!(pieces[0].ranges, vec![range(0, 3, 0), range(8, 3, 0)]);
        assert_eq!(pieces[1].ranges, vec![range(3, 1, 2), range(11, 1, 0)]);
        assert_eq!((pieces[1].padding, pieces[1].local_len()), (2, 6));
        assert!(pieces.iter().all(|p| p.local_len() == 6));
        // The vocabulary too, in atoms (of 2 rows here), each piece padded to the largest.
        assert_eq!(
            shared(&Groups::Plain { padded: true }, 10, "3,1"),
            vec![(vec![(0, 8)], 0), (vec![(8, 2)], 6)]
        );
    }

    #[test]
    fn a_fused_dimension_pads_each_part_after_its_piece() {
        let parts = Groups::Concat(vec![
            Groups::Heads {
                count: 4,
                size: 1,
                replicable: false,
                kv_groups: Some(4),
            },
            Groups::Heads {
                count: 4,
                size: 1,
                replicable: true,
                kv_groups: Some(4),
            },
        ]);
        // 4 heads over 3 ranks: 2, 2 and none of each part; every piece [q, q | k, k].
        let range = |offset, len, pad| SliceRange { offset, len, pad };
        let piece = |r| parts.slice(8, 3, r).unwrap();
        assert_eq!(piece(0).ranges, vec![range(0, 2, 0), range(4, 2, 0)]);
        assert_eq!(piece(1).ranges, vec![range(2, 2, 0), range(6, 2, 0)]);
        assert_eq!(piece(2).ranges, vec![range(4, 0, 2)]);
        assert_eq!(piece(2).padding, 2);
        assert!((0..3).all(|r| piece(r).local_len() == 4));
        // Evenly over 2 ranks, no padding; never more ranks than heads.
        assert_eq!(
            parts.slice(8, 2, 1).unwrap().ranges,
            vec![range(2, 2, 0), range(6, 2, 0)]
        );
        assert!(parts.check(8, 5).is_err());
        // An interleaved dimension ([heads, q|k|v]) deals whole heads, padding at the end.
        let neox = Groups::Interleaved {
            heads: 8,
            parts: vec![2, 2, 2],
        };
        assert_eq!(neox.slice(48, 3, 2).unwrap().ranges, vec![range(36, 12, 0)]);
        assert_eq!(neox.slice(48, 3, 2).unwrap().padding, 6);
    }

    #[test]
    fn wrong_structure_length_is_reported() {
        let g = Groups::Heads {
            count: 4,
            size: 2,
            replicable: false,
            kv_groups: None,
        };
        assert!(matches!(
            g.slice(10, 2, 0),
            Err(SplitProblem::LengthMismatch { .. })
        ));
    }
}
