//! How layers are dealt to pipeline stages when no counts are given: contiguous runs with
//! the least largest cost.

/// Splits items (bytes per layer) into `parts` contiguous, non-empty runs with the least
/// largest sum (ties: the earliest boundaries); returns each run's first index.
pub fn balanced_split(bytes: &[f64], parts: usize) -> Vec<usize> {
    let n = bytes.len();
    if parts == 0 || parts > n {
        return Vec::new();
    }
    let mut prefix = vec![0.0; n + 1];
    for (i, b) in bytes.iter().enumerate() {
        prefix[i + 1] = prefix[i] + b;
    }
    // best[k][j]: least largest sum of the first j items in k runs; from[k][j]: where the
    // last of those runs starts.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balanced_split_minimizes_the_largest_stage() {
        assert_eq!(balanced_split(&[1.0, 1.0, 1.0, 1.0], 2), vec![0, 2]);
        assert_eq!(balanced_split(&[3.0, 1.0, 1.0, 1.0], 2), vec![0, 1]);
        assert_eq!(balanced_split(&[1.0, 1.0, 1.0, 3.0], 2), vec![0, 3]);
        assert_eq!(balanced_split(&[1.0, 2.0, 3.0], 3), vec![0, 1, 2]);
        assert!(balanced_split(&[1.0], 2).is_empty());
        assert!(balanced_split(&[1.0], 0).is_empty());
    }
}
