//! How layers are dealt to pipeline stages when no counts are given: contiguous runs with
//! the least largest cost.

/// Splits items (bytes per layer) into `parts` contiguous, non-empty runs with the least
/// largest sum (ties: the earliest boundaries); returns each run's first index.
pub fn balanced_split(bytes: &[f64], parts: usize) -> Vec<usize> {
    if parts == 0 || parts > bytes.len() {
        return Vec::new();
    }
    balanced_splits(bytes, parts).pop().unwrap_or_default()
}

/// [`balanced_split`] for every run count from 1 to `max_parts` (at most the item count),
/// in that order, from one table: what `simulate --search` prices, at the cost of the
/// largest split alone.
///
/// The table: `best[k][j]` is the least largest sum of the first `j` items in `k` runs,
/// `from[k][j]` where the last of those runs starts (the earliest such start). For a given
/// `k` and `j`, over the last run's start `i`, `best[k-1][i]` never falls as `i` grows (the
/// items are not negative) and the last run's sum `prefix[j] − prefix[i]` never rises, so
/// the earliest `i` where the first reaches the second is found by bisection, and the
/// least of the two maxima lies there or just before: O(k·n·log n), not O(k·n²).
pub fn balanced_splits(bytes: &[f64], max_parts: usize) -> Vec<Vec<usize>> {
    let n = bytes.len();
    let parts = max_parts.min(n);
    if parts == 0 {
        return Vec::new();
    }
    let mut prefix = vec![0.0; n + 1];
    for (i, b) in bytes.iter().enumerate() {
        prefix[i + 1] = prefix[i] + b;
    }
    let mut best = vec![vec![f64::INFINITY; n + 1]; parts + 1];
    let mut from = vec![vec![0usize; n + 1]; parts + 1];
    best[0][0] = 0.0;
    for k in 1..=parts {
        let (done, rest) = best.split_at_mut(k);
        let (before, row) = (&done[k - 1], &mut rest[0]);
        for j in k..=n {
            let last_run = |i: usize| prefix[j] - prefix[i];
            // Starts `k-1 .. j` of the last run (the runs before need one item each).
            let (lo, hi) = (k - 1, j);
            let cross = first_where(lo, hi, |i| before[i] >= last_run(i));
            let mut pick: Option<(f64, usize)> = (cross < hi).then(|| (before[cross], cross));
            if cross > lo {
                // Before the crossing the last run is the larger: its least value, at the
                // earliest start that has it.
                let v = last_run(cross - 1);
                if pick.is_none_or(|(p, _)| v <= p) {
                    pick = Some((v, first_where(lo, cross, |i| last_run(i) <= v)));
                }
            }
            if let Some((v, i)) = pick {
                row[j] = v;
                from[k][j] = i;
            }
        }
    }
    (1..=parts)
        .map(|runs| {
            let mut starts = vec![0; runs];
            let mut j = n;
            for k in (1..=runs).rev() {
                starts[k - 1] = from[k][j];
                j = from[k][j];
            }
            starts
        })
        .collect()
}

/// The least `i` in `lo..hi` where `holds(i)`, or `hi`; `holds` must be false then true.
fn first_where(mut lo: usize, mut hi: usize, holds: impl Fn(usize) -> bool) -> usize {
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if holds(mid) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    lo
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::strategy::Strategy;

    #[test]
    fn balanced_split_minimizes_the_largest_stage() {
        assert_eq!(balanced_split(&[1.0, 1.0, 1.0, 1.0], 2), vec![0, 2]);
        assert_eq!(balanced_split(&[3.0, 1.0, 1.0, 1.0], 2), vec![0, 1]);
        assert_eq!(balanced_split(&[1.0, 1.0, 1.0, 3.0], 2), vec![0, 3]);
        assert_eq!(balanced_split(&[1.0, 2.0, 3.0], 3), vec![0, 1, 2]);
        assert!(balanced_split(&[1.0], 2).is_empty());
        assert!(balanced_split(&[1.0], 0).is_empty());
    }

    /// The table as first written, every start tried: the reference the bisection must
    /// match boundary for boundary.
    fn every_start_tried(bytes: &[f64], parts: usize) -> Vec<usize> {
        let n = bytes.len();
        if parts == 0 || parts > n {
            return Vec::new();
        }
        let mut prefix = vec![0.0; n + 1];
        for (i, b) in bytes.iter().enumerate() {
            prefix[i + 1] = prefix[i] + b;
        }
        let mut best = vec![vec![f64::INFINITY; n + 1]; parts + 1];
        let mut from = vec![vec![0usize; n + 1]; parts + 1];
        best[0][0] = 0.0;
        for k in 1..=parts {
            for j in k..=n {
                for i in (k - 1)..j {
                    let v = best[k - 1][i].max(prefix[j] - prefix[i]);
                    if v < best[k][j] {
                        best[k][j] = v;
                        from[k][j] = i;
                    }
                }
            }
        }
        let mut starts = vec![0; parts];
        let mut j = n;
        for k in (1..=parts).rev() {
            starts[k - 1] = from[k][j];
            j = from[k][j];
        }
        starts
    }

    proptest::proptest! {
        /// Bisection picks the same boundaries as trying every start, ties and zero-cost
        /// layers included, for every run count at once.
        #[test]
        fn bisection_matches_trying_every_start(
            bytes in proptest::collection::vec(
                proptest::prop_oneof![
                    proptest::prelude::Just(0.0f64),
                    proptest::prelude::Just(1.0f64),
                    (0u32..4).prop_map(f64::from),
                    0.0f64..1e12,
                ],
                0..40,
            ),
            max_parts in 0usize..45,
        ) {
            let all = balanced_splits(&bytes, max_parts);
            proptest::prop_assert_eq!(all.len(), max_parts.min(bytes.len()));
            for (k, starts) in all.iter().enumerate() {
                proptest::prop_assert_eq!(starts, &every_start_tried(&bytes, k + 1));
            }
            proptest::prop_assert_eq!(
                balanced_split(&bytes, max_parts),
                every_start_tried(&bytes, max_parts)
            );
        }
    }
}
