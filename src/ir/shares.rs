//! Per-rank shares of every split dimension (`--tp-shares 3,1,1,1`): how much of each
//! dimension a rank on a faster device takes, and how whole atoms are apportioned to them.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// The most ranks `--tp-shares` can name (a fixed array keeps the options `Copy`).
pub const MAX_SHARED_RANKS: usize = 64;
/// The largest single share: shares are ratios, and small integers say every useful one.
pub const MAX_SHARE: u16 = 1000;

/// Each rank's share, in rank order: rank `r` gets `parts[r] / sum` of every split
/// dimension, rounded to the dimension's atoms.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TpShares {
    len: u8,
    parts: [u16; MAX_SHARED_RANKS],
}

impl TpShares {
    /// Shares from a list; refused (with the reason) when empty, longer than
    /// [`MAX_SHARED_RANKS`], or holding a share outside `1..=MAX_SHARE`.
    pub fn new(parts: &[u64]) -> Result<TpShares, String> {
        if parts.is_empty() {
            return Err("no shares given; give one per rank, e.g. 2,1".into());
        }
        if parts.len() > MAX_SHARED_RANKS {
            return Err(format!(
                "{} shares given; --tp-shares takes at most {MAX_SHARED_RANKS} ranks",
                parts.len()
            ));
        }
        let mut out = TpShares {
            len: parts.len() as u8,
            parts: [0; MAX_SHARED_RANKS],
        };
        for (slot, &p) in out.parts.iter_mut().zip(parts) {
            if p == 0 || p > u64::from(MAX_SHARE) {
                return Err(format!(
                    "share {p} is outside 1..={MAX_SHARE}: every rank needs a positive share \
                     (a rank that should hold nothing belongs outside the tp group)"
                ));
            }
            *slot = p as u16;
        }
        Ok(out)
    }

    /// The shares, one per rank.
    pub fn parts(&self) -> &[u16] {
        &self.parts[..usize::from(self.len)]
    }

    /// How many ranks the shares are for.
    pub fn tp(&self) -> u64 {
        u64::from(self.len)
    }

    /// Whether every rank has the same share (the plain split).
    pub fn is_even(&self) -> bool {
        self.parts().windows(2).all(|w| w[0] == w[1])
    }

    /// `items` whole atoms apportioned by the shares: each rank gets the floor of its exact
    /// part, and what is left goes one each to the largest remainders (the lower rank first
    /// on ties). The counts add up to `items`.
    pub fn apportion(&self, items: u64) -> Vec<u64> {
        let total: u128 = self.parts().iter().map(|&p| u128::from(p)).sum();
        let exact: Vec<(u64, u128)> = self
            .parts()
            .iter()
            .map(|&p| {
                let scaled = u128::from(items) * u128::from(p);
                ((scaled / total) as u64, scaled % total)
            })
            .collect();
        let mut counts: Vec<u64> = exact.iter().map(|e| e.0).collect();
        let left = items - counts.iter().sum::<u64>();
        let mut by_remainder: Vec<usize> = (0..counts.len()).collect();
        by_remainder.sort_by(|&a, &b| exact[b].1.cmp(&exact[a].1).then(a.cmp(&b)));
        for &r in by_remainder.iter().take(left as usize) {
            counts[r] += 1;
        }
        counts
    }
}

/// How a call's `tokens` rows are dealt to `tp` ranks under sequence parallelism, rank
/// after rank: every rank at least one row (zero rows pad a call of fewer tokens than
/// ranks), the rest by `shares` (`None`: as evenly as they go, the first ranks one more).
pub fn token_blocks(tokens: u64, tp: u64, shares: Option<&TpShares>) -> Vec<u64> {
    let tp = tp.max(1);
    let spare = tokens.saturating_sub(tp);
    let dealt = match shares.filter(|s| s.tp() == tp) {
        Some(s) => s.apportion(spare),
        None => (0..tp)
            .map(|r| spare / tp + u64::from(r < spare % tp))
            .collect(),
    };
    dealt.into_iter().map(|d| d + 1).collect()
}

impl fmt::Display for TpShares {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let list: Vec<String> = self.parts().iter().map(u16::to_string).collect();
        f.write_str(&list.join(","))
    }
}

impl fmt::Debug for TpShares {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TpShares({self})")
    }
}

impl std::str::FromStr for TpShares {
    type Err = String;

    fn from_str(s: &str) -> Result<TpShares, String> {
        let parts = s
            .split(',')
            .map(|p| {
                p.trim().parse::<u64>().map_err(|_| {
                    format!("`{p}` in `{s}` is not a whole number; give shares like 3,1,1,1")
                })
            })
            .collect::<Result<Vec<u64>, String>>()?;
        TpShares::new(&parts)
    }
}

impl Serialize for TpShares {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.parts().serialize(s)
    }
}

impl<'de> Deserialize<'de> for TpShares {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<TpShares, D::Error> {
        let parts = Vec::<u64>::deserialize(d)?;
        TpShares::new(&parts).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shares(s: &str) -> TpShares {
        s.parse().unwrap()
    }

    #[test]
    fn tokens_are_dealt_by_shares_with_a_row_for_every_rank() {
        // Evenly: the first ranks take one more, as a ceiling block would for 5 over 2.
        assert_eq!(token_blocks(5, 2, None), [3, 2]);
        assert_eq!(token_blocks(4, 3, None), [2, 1, 1]);
        // Fewer tokens than ranks: padded to a row each (a decode step of one sequence).
        assert_eq!(token_blocks(1, 4, None), [1, 1, 1, 1]);
        assert_eq!(token_blocks(0, 2, Some(&shares("3,1"))), [1, 1]);
        // By shares: 8 spare rows at 3:1, one row each first.
        assert_eq!(token_blocks(10, 2, Some(&shares("3,1"))), [7, 3]);
        assert_eq!(
            token_blocks(100, 4, Some(&shares("3,1,1,1"))),
            [49, 17, 17, 17]
        );
        for t in 0..40 {
            for s in ["1,1", "2,1", "3,1,1,1", "1,5,2"] {
                let s = shares(s);
                let blocks = token_blocks(t, s.tp(), Some(&s));
                assert_eq!(blocks.iter().sum::<u64>(), t.max(s.tp()), "{t} {s}");
                assert!(blocks.iter().all(|&b| b >= 1), "{t} {s} {blocks:?}");
            }
        }
        // Shares for another tp are ignored.
        assert_eq!(token_blocks(5, 2, Some(&shares("1,1,1"))), [3, 2]);
    }

    #[test]
    fn apportion_by_largest_remainder() {
        // 32 atoms at 2:1 → 21.33 / 10.67: the larger remainder (rank 1) takes the spare.
        assert_eq!(shares("2,1").apportion(32), vec![21, 11]);
        // 32 at 3:1:1:1 → 16, 5.33 ×3: one spare to the lowest rank among equal remainders.
        assert_eq!(shares("3,1,1,1").apportion(32), vec![16, 6, 5, 5]);
        assert_eq!(shares("1,1,1").apportion(8), vec![3, 3, 2]);
        assert_eq!(shares("1,3").apportion(4), vec![1, 3]);
        for s in ["5,3,2", "1,1", "7,1,1,1,1,1,1,1", "1000,1"] {
            let t = shares(s);
            for items in [0, 1, 7, 64, 5632, u64::MAX / 1000] {
                assert_eq!(t.apportion(items).iter().sum::<u64>(), items, "{s} {items}");
            }
        }
    }

    #[test]
    fn malformed_shares_are_refused_with_the_reason() {
        assert!(""
            .parse::<TpShares>()
            .unwrap_err()
            .contains("not a whole number"));
        assert!("2,0"
            .parse::<TpShares>()
            .unwrap_err()
            .contains("positive share"));
        assert!("2,x".parse::<TpShares>().unwrap_err().contains("`x`"));
        assert!("1001".parse::<TpShares>().unwrap_err().contains("1..=1000"));
        let many = vec!["1"; MAX_SHARED_RANKS + 1].join(",");
        assert!(many.parse::<TpShares>().unwrap_err().contains("at most 64"));
        assert_eq!(shares("3, 1,1,1").to_string(), "3,1,1,1");
        assert!(shares("2,2").is_even() && !shares("2,1").is_even());
    }

    #[test]
    fn shares_round_trip_as_a_list() {
        let s = shares("3,1,1,1");
        let text = ron::to_string(&s).unwrap();
        assert_eq!(text, "[3,1,1,1]");
        assert_eq!(ron::from_str::<TpShares>(&text).unwrap(), s);
        assert!(ron::from_str::<TpShares>("[0]").is_err());
    }
}
