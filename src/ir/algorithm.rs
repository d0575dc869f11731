//! How an all-reduce runs, chosen per site by the cost model for a hardware profile and
//! recorded on the op, so that the runtime follows the plan instead of a built-in threshold.

use serde::{Deserialize, Serialize};
use std::fmt;

/// The all-reduce algorithms the cost model prices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CollectiveAlgorithm {
    /// Every rank reads every peer's whole buffer after one synchronisation: one latency,
    /// `(p − 1) × bytes` read per rank. Wins for small messages.
    OneShot,
    /// Reduce-scatter then all-gather, each as one step that reads every peer's chunk: two
    /// latencies, `2(p − 1)/p × bytes` per rank.
    TwoShot,
    /// Ring reduce-scatter then ring all-gather: `2(p − 1)` steps, `2(p − 1)/p × bytes`.
    Ring,
}

impl CollectiveAlgorithm {
    pub const ALL: [CollectiveAlgorithm; 3] = [
        CollectiveAlgorithm::OneShot,
        CollectiveAlgorithm::TwoShot,
        CollectiveAlgorithm::Ring,
    ];

    pub fn name(self) -> &'static str {
        match self {
            CollectiveAlgorithm::OneShot => "one_shot",
            CollectiveAlgorithm::TwoShot => "two_shot",
            CollectiveAlgorithm::Ring => "ring",
        }
    }
}

impl fmt::Display for CollectiveAlgorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Messages of more bytes than the previous entry's bound and at most `up_to_bytes` use
/// `algorithm`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SizeRange {
    pub up_to_bytes: u64,
    pub algorithm: CollectiveAlgorithm,
}

/// One site's choice: the algorithm by message size (a message's size depends on the
/// tokens of a call, so a prefill and a decode step may differ), and the profile it was
/// made for.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct AlgorithmChoice {
    pub profile: String,
    /// Ascending bounds; the last is `u64::MAX`.
    pub by_size: Vec<SizeRange>,
}

impl AlgorithmChoice {
    /// The algorithm for a message of `bytes`; `None` only for a table that
    /// [`AlgorithmChoice::check`] refuses.
    pub fn for_bytes(&self, bytes: u64) -> Option<CollectiveAlgorithm> {
        self.by_size
            .iter()
            .find(|r| bytes <= r.up_to_bytes)
            .map(|r| r.algorithm)
    }

    /// A table covers every size: non-empty, strictly ascending, ending at `u64::MAX`.
    pub fn check(&self) -> Result<(), String> {
        let Some(last) = self.by_size.last() else {
            return Err("its size table is empty; it needs at least one entry".into());
        };
        if last.up_to_bytes != u64::MAX {
            return Err(format!(
                "its size table ends at {} bytes; the last entry must be {} (every size)",
                last.up_to_bytes,
                u64::MAX
            ));
        }
        if let Some(w) = self
            .by_size
            .windows(2)
            .find(|w| w[0].up_to_bytes >= w[1].up_to_bytes)
        {
            return Err(format!(
                "its size table goes from {} to {} bytes; bounds must rise strictly",
                w[0].up_to_bytes, w[1].up_to_bytes
            ));
        }
        Ok(())
    }

    /// `one_shot ≤ 2 KiB, ring above`.
    pub fn describe(&self) -> String {
        let parts: Vec<String> = self
            .by_size
            .iter()
            .enumerate()
            .map(|(k, r)| match (k, r.up_to_bytes) {
                (0, u64::MAX) => format!("{} always", r.algorithm),
                (_, u64::MAX) => format!("{} above", r.algorithm),
                (_, bytes) => format!("{} ≤ {bytes} B", r.algorithm),
            })
            .collect();
        parts.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use CollectiveAlgorithm::*;

    fn table(entries: &[(u64, CollectiveAlgorithm)]) -> AlgorithmChoice {
        AlgorithmChoice {
            profile: "test".into(),
            by_size: entries
                .iter()
                .map(|&(up_to_bytes, algorithm)| SizeRange {
                    up_to_bytes,
                    algorithm,
                })
                .collect(),
        }
    }

    #[test]
    fn sizes_pick_their_range() {
        let t = table(&[(2048, OneShot), (1 << 20, TwoShot), (u64::MAX, Ring)]);
        assert!(t.check().is_ok());
        assert_eq!(t.for_bytes(0), Some(OneShot));
        assert_eq!(t.for_bytes(2048), Some(OneShot));
        assert_eq!(t.for_bytes(2049), Some(TwoShot));
        assert_eq!(t.for_bytes(1 << 20), Some(TwoShot));
        assert_eq!(t.for_bytes(u64::MAX), Some(Ring));
        assert_eq!(
            t.describe(),
            "one_shot ≤ 2048 B, two_shot ≤ 1048576 B, ring above"
        );
    }

    #[test]
    fn broken_tables_are_refused() {
        assert!(table(&[]).check().unwrap_err().contains("empty"));
        assert!(table(&[(10, Ring)])
            .check()
            .unwrap_err()
            .contains("ends at 10"));
        let e = table(&[(10, Ring), (10, OneShot), (u64::MAX, Ring)])
            .check()
            .unwrap_err();
        assert!(e.contains("rise strictly"), "{e}");
        assert_eq!(table(&[(u64::MAX, Ring)]).describe(), "ring always");
    }
}
