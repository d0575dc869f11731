//! Rank groups as vLLM lays them out: global ranks on a `[ExternalDP, DP, PP, TP]` grid (TP
//! innermost), and the TP, PP, DP and EP groups cut from it (seed §3.2, `compute_groups`).
//! One function, so the `tpc ranks` table and the runtime's communicators agree.

use serde::Serialize;
use thiserror::Error;

/// The most ranks a layout may have (beyond this the group lists alone are gigabytes).
pub const MAX_WORLD: u64 = 1 << 16;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RankGroupsError {
    #[error("--{what} must be at least 1, got 0")]
    Zero { what: &'static str },
    #[error("a world of {world} ranks is more than tpc lays out ({MAX_WORLD}); use fewer ranks")]
    TooLarge { world: u64 },
    #[error("--{what} {value} is more than the world of {world} ranks; a group cannot have more ranks than the world")]
    GroupTooLarge {
        what: &'static str,
        value: u64,
        world: u64,
    },
    #[error("tp × pp × dp = {tp} × {pp} × {dp} = {per_replica} ranks is more than the world of {world} ranks; give a world of at least {per_replica} ranks, or smaller groups")]
    MoreThanWorld {
        world: u64,
        tp: u64,
        pp: u64,
        dp: u64,
        per_replica: u64,
    },
    #[error("a world of {world} ranks cannot be split into groups of tp × pp × dp = {tp} × {pp} × {dp} = {per_replica} ranks; the world size must be a multiple of it (e.g. {suggest})")]
    NotDivisible {
        world: u64,
        tp: u64,
        pp: u64,
        dp: u64,
        per_replica: u64,
        suggest: u64,
    },
}

/// Where one global rank sits on the grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RankCoords {
    pub rank: usize,
    pub ext_dp: usize,
    pub dp: usize,
    pub pp: usize,
    pub tp: usize,
}

/// Every group of a layout; each list of groups covers every rank exactly once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RankGroups {
    pub world: usize,
    pub ext_dp: usize,
    pub dp: usize,
    pub pp: usize,
    pub tp: usize,
    /// Consecutive ranks: one group per (external dp, dp, stage).
    pub tp_groups: Vec<Vec<usize>>,
    /// The same TP rank across stages: one group per (external dp, dp, tp rank).
    pub pp_groups: Vec<Vec<usize>>,
    /// The same (stage, TP rank) across data-parallel replicas: one group per (external dp,
    /// tp rank, stage), in that order (vLLM's `transpose(1, 3)`).
    pub dp_groups: Vec<Vec<usize>>,
    /// DP × TP within a stage: one group per (external dp, stage).
    pub ep_groups: Vec<Vec<usize>>,
    pub ranks: Vec<RankCoords>,
}

/// The layout of `world` ranks for `tp`, `pp` and `dp`; ExternalDP = world / (tp·pp·dp).
pub fn rank_groups(world: u64, tp: u64, pp: u64, dp: u64) -> Result<RankGroups, RankGroupsError> {
    for (what, v) in [("world", world), ("tp", tp), ("pp", pp), ("dp", dp)] {
        if v == 0 {
            return Err(RankGroupsError::Zero { what });
        }
    }
    if world > MAX_WORLD {
        return Err(RankGroupsError::TooLarge { world });
    }
    // Each group size at most the world (≤ MAX_WORLD = 2^16), so their product, at most
    // 2^48, is exact: never a saturated or wrapped figure in a message.
    for (what, value) in [("tp", tp), ("pp", pp), ("dp", dp)] {
        if value > world {
            return Err(RankGroupsError::GroupTooLarge { what, value, world });
        }
    }
    let per_replica = tp * pp * dp;
    if per_replica > world {
        return Err(RankGroupsError::MoreThanWorld {
            world,
            tp,
            pp,
            dp,
            per_replica,
        });
    }
    if !world.is_multiple_of(per_replica) {
        return Err(RankGroupsError::NotDivisible {
            world,
            tp,
            pp,
            dp,
            per_replica,
            suggest: per_replica * world.div_ceil(per_replica),
        });
    };
    // Every size is at most world ≤ MAX_WORLD from here on.
    let (world, tp, pp, dp) = (world as usize, tp as usize, pp as usize, dp as usize);
    let ext = world / per_replica as usize;
    let rank = |e: usize, d: usize, p: usize, t: usize| ((e * dp + d) * pp + p) * tp + t;
    let mut g = RankGroups {
        world,
        ext_dp: ext,
        dp,
        pp,
        tp,
        tp_groups: Vec::new(),
        pp_groups: Vec::new(),
        dp_groups: Vec::new(),
        ep_groups: Vec::new(),
        ranks: Vec::with_capacity(world),
    };
    for e in 0..ext {
        for d in 0..dp {
            for p in 0..pp {
                g.tp_groups
                    .push((0..tp).map(|t| rank(e, d, p, t)).collect());
                for t in 0..tp {
                    g.ranks.push(RankCoords {
                        rank: rank(e, d, p, t),
                        ext_dp: e,
                        dp: d,
                        pp: p,
                        tp: t,
                    });
                }
            }
            for t in 0..tp {
                g.pp_groups
                    .push((0..pp).map(|p| rank(e, d, p, t)).collect());
            }
        }
        for t in 0..tp {
            for p in 0..pp {
                g.dp_groups
                    .push((0..dp).map(|d| rank(e, d, p, t)).collect());
            }
        }
        for p in 0..pp {
            g.ep_groups.push(
                (0..dp)
                    .flat_map(|d| (0..tp).map(move |t| rank(e, d, p, t)))
                    .collect(),
            );
        }
    }
    Ok(g)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_seed_example_sixteen_ranks_tp4_dp4() {
        let g = rank_groups(16, 4, 1, 4).unwrap();
        let v = |x: &[&[usize]]| x.iter().map(|r| r.to_vec()).collect::<Vec<_>>();
        assert_eq!(
            g.tp_groups,
            v(&[
                &[0, 1, 2, 3],
                &[4, 5, 6, 7],
                &[8, 9, 10, 11],
                &[12, 13, 14, 15]
            ])
        );
        assert_eq!(g.pp_groups, (0..16).map(|r| vec![r]).collect::<Vec<_>>());
        assert_eq!(
            g.dp_groups,
            v(&[
                &[0, 4, 8, 12],
                &[1, 5, 9, 13],
                &[2, 6, 10, 14],
                &[3, 7, 11, 15]
            ])
        );
        assert_eq!(g.ep_groups, vec![(0..16).collect::<Vec<_>>()]);
        assert_eq!(g.ext_dp, 1);
    }

    #[test]
    fn eight_ranks_tp2_pp4_pair_neighbours_and_stride_stages() {
        // vLLM's 8-GPU example (tp 2, pp 4): TP pairs, PP groups of the same TP rank across stages.
        let g = rank_groups(8, 2, 4, 1).unwrap();
        assert_eq!(g.tp_groups[0], vec![0, 1]);
        assert_eq!(g.pp_groups, vec![vec![0, 2, 4, 6], vec![1, 3, 5, 7]]);
        assert_eq!(
            g.ep_groups,
            vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]
        );
    }

    /// What torch's reshape/transpose in `compute_groups` gives, written as index arithmetic
    /// over the row-major [E, D, P, T] grid with the permuted axis order.
    fn reference(world: usize, tp: usize, pp: usize, dp: usize) -> [Vec<Vec<usize>>; 4] {
        let e = world / (tp * pp * dp);
        let dims = [e, dp, pp, tp];
        let at = |i: [usize; 4]| ((i[0] * dp + i[1]) * pp + i[2]) * tp + i[3];
        // Flatten the grid with its axes in `order`, then cut rows of `len`.
        let cut = |order: [usize; 4], len: usize| -> Vec<Vec<usize>> {
            let mut flat = Vec::new();
            let n = order.map(|a| dims[a]);
            for a in 0..n[0] {
                for b in 0..n[1] {
                    for c in 0..n[2] {
                        for d in 0..n[3] {
                            let mut i = [0; 4];
                            for (k, v) in [a, b, c, d].into_iter().enumerate() {
                                i[order[k]] = v;
                            }
                            flat.push(at(i));
                        }
                    }
                }
            }
            flat.chunks(len).map(<[usize]>::to_vec).collect()
        };
        [
            cut([0, 1, 2, 3], tp),
            cut([0, 1, 3, 2], pp),
            cut([0, 3, 2, 1], dp),
            cut([0, 2, 1, 3], dp * tp),
        ]
    }

    #[test]
    fn every_layout_matches_the_reference_and_covers_each_rank_once() {
        for world in [1, 2, 4, 6, 8, 12, 16, 24, 32] {
            for tp in 1..=world {
                for pp in 1..=world {
                    for dp in 1..=world {
                        let Ok(g) = rank_groups(world as u64, tp as u64, pp as u64, dp as u64)
                        else {
                            assert!(world % (tp * pp * dp) != 0);
                            continue;
                        };
                        let [t, p, d, e] = reference(world, tp, pp, dp);
                        assert_eq!(
                            (&g.tp_groups, &g.pp_groups, &g.dp_groups, &g.ep_groups),
                            (&t, &p, &d, &e),
                            "world={world} tp={tp} pp={pp} dp={dp}"
                        );
                        for groups in [&g.tp_groups, &g.pp_groups, &g.dp_groups, &g.ep_groups] {
                            let mut all: Vec<usize> = groups.iter().flatten().copied().collect();
                            all.sort_unstable();
                            assert_eq!(all, (0..world).collect::<Vec<_>>());
                        }
                        for (i, c) in g.ranks.iter().enumerate() {
                            assert_eq!(c.rank, i);
                            assert!(g.tp_groups[(c.ext_dp * dp + c.dp) * pp + c.pp].contains(&i));
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn impossible_layouts_are_errors() {
        assert!(matches!(
            rank_groups(12, 8, 1, 1),
            Err(RankGroupsError::NotDivisible { suggest: 16, .. })
        ));
        assert!(matches!(
            rank_groups(8, 0, 1, 1),
            Err(RankGroupsError::Zero { what: "tp" })
        ));
        assert!(matches!(
            rank_groups(1 << 20, 1, 1, 1),
            Err(RankGroupsError::TooLarge { .. })
        ));
        assert!(rank_groups(8, u64::MAX, u64::MAX, 2).is_err());
    }

    /// Sizes whose product overflows (or passes the world) are refused by what is wrong
    /// with them; no message shows a saturated 18446744073709551615 as a product.
    #[test]
    fn groups_larger_than_the_world_are_refused_plainly() {
        let e = rank_groups(2, u64::MAX, 3, 1).unwrap_err();
        assert_eq!(
            e,
            RankGroupsError::GroupTooLarge {
                what: "tp",
                value: u64::MAX,
                world: 2
            }
        );
        let e = rank_groups(4, 2, 1 << 40, 1 << 40).unwrap_err();
        assert!(matches!(
            e,
            RankGroupsError::GroupTooLarge { what: "pp", .. }
        ));
        let e = rank_groups(8, 4, 4, 1).unwrap_err();
        assert_eq!(
            e.to_string(),
            "tp × pp × dp = 4 × 4 × 1 = 16 ranks is more than the world of 8 ranks; give a world of at least 16 ranks, or smaller groups"
        );
        // The largest sizes that pass the checks multiply exactly.
        let e = rank_groups(1 << 16, 1 << 16, 1 << 16, 1 << 16).unwrap_err();
        assert!(e.to_string().contains(&(1u64 << 48).to_string()), "{e}");
    }
}
