//! Choosing the next token: greedy by default; temperature, top-k and top-p with a seed.

use super::tensor::{pool, Tensor};

/// How to pick tokens. `temperature == 0` means greedy.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    pub temperature: f32,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub seed: u64,
}

/// Sampling settings that would be ignored or meaningless. The messages name the `tpc run`
/// flags, the only place these settings come from user input.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    #[error("--temperature {0} is not a temperature; give 0 (greedy) or a finite number above 0")]
    BadTemperature(f32),
    #[error("--top-k 0 keeps no token; give at least 1 (1 is greedy), or drop --top-k")]
    ZeroTopK,
    #[error("--top-p {0} is outside (0, 1]; give a probability mass such as 0.9, or drop --top-p")]
    TopPOutOfRange(f32),
    #[error("{flags} would be ignored: temperature 0 (the default) means greedy decoding; add --temperature T (T > 0, e.g. 0.8) to sample, or drop {flags}")]
    NeedsTemperature { flags: &'static str },
}

impl Sampling {
    /// Refuses settings that the sampler would silently ignore (top-k/top-p with greedy
    /// decoding) or could not honour (no token kept, a temperature that is not a number).
    pub fn validate(&self) -> Result<(), SamplingError> {
        let t = self.temperature;
        if !t.is_finite() || t < 0.0 {
            return Err(SamplingError::BadTemperature(t));
        }
        if self.top_k == Some(0) {
            return Err(SamplingError::ZeroTopK);
        }
        if let Some(p) = self.top_p {
            // Written so that NaN fails too.
            if !(p > 0.0 && p <= 1.0) {
                return Err(SamplingError::TopPOutOfRange(p));
            }
        }
        if t == 0.0 {
            let flags = match (self.top_k.is_some(), self.top_p.is_some()) {
                (true, true) => Some("--top-k and --top-p"),
                (true, false) => Some("--top-k"),
                (false, true) => Some("--top-p"),
                (false, false) => None,
            };
            if let Some(flags) = flags {
                return Err(SamplingError::NeedsTemperature { flags });
            }
        }
        Ok(())
    }
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            seed: 0,
        }
    }
}

/// SplitMix64: small, seedable, and the same on every rank.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Index of the largest logit; the first one on ties, as `torch.argmax`.
pub fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best
}

/// The sampler's order of candidates: larger logit first (as `f32::total_cmp`), the lower
/// token first among equal logits. A strict total order, so every sort gives one result.
pub fn candidate_order(a: &(f32, usize), b: &(f32, usize)) -> std::cmp::Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// Picks the next token from one row of logits.
pub fn pick(logits: &[f32], s: &Sampling, rng: &mut Rng) -> usize {
    if s.temperature <= 0.0 {
        return argmax(logits);
    }
    let mut order: Vec<(f32, usize)> = logits.iter().copied().zip(0..).collect();
    order.sort_by(candidate_order);
    if let Some(k) = s.top_k.filter(|&k| k > 0) {
        order.truncate(k);
    }
    draw(&order, s, rng).unwrap_or(0)
}

/// Picks the next token from a row's candidates, `(logit, token)` pairs: with `--top-k K`,
/// at least the row's K best logits (vocabulary-parallel sampling exchanges only those).
/// The same token, for the same random state, as [`pick`] on the whole row: `pick` keeps the
/// K best in [`candidate_order`] and draws from them alone, and so does this. `None` when
/// there is no candidate.
pub fn pick_from_candidates(
    candidates: &[(f32, usize)],
    s: &Sampling,
    rng: &mut Rng,
) -> Option<usize> {
    let mut order = candidates.to_vec();
    order.sort_by(candidate_order);
    if s.temperature <= 0.0 {
        // Greedy takes the first maximum, as `argmax` (where -0.0 equals 0.0).
        let first = order.first()?.0;
        return order.iter().filter(|c| c.0 == first).map(|c| c.1).min();
    }
    if let Some(k) = s.top_k.filter(|&k| k > 0) {
        order.truncate(k);
    }
    draw(&order, s, rng)
}

/// Temperature, top-p and the seeded draw over candidates already sorted and cut to the
/// top-k. Draws one number from `rng` whenever there is a candidate.
fn draw(order: &[(f32, usize)], s: &Sampling, rng: &mut Rng) -> Option<usize> {
    let max = order.first()?.0 as f64;
    let mut probs: Vec<f64> = order
        .iter()
        .map(|&(v, _)| ((v as f64 - max) / s.temperature as f64).exp())
        .collect();
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
    if let Some(top_p) = s.top_p.filter(|&p| p < 1.0) {
        // Keep the smallest prefix whose mass reaches top_p (at least one token).
        let mut mass = 0.0;
        let mut keep = 0;
        for p in &probs {
            keep += 1;
            mass += p;
            if mass >= top_p as f64 {
                break;
            }
        }
        probs.truncate(keep);
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
    }
    let mut u = rng.next_f64();
    for (i, p) in probs.iter().enumerate() {
        if u < *p {
            return Some(order[i].1);
        }
        u -= p;
    }
    Some(order[probs.len() - 1].1)
}

/// Each row's `k` best (value, offset + column) pairs among its first `valid` columns, best
/// first, padded with (-inf, -1); a row with a non-finite value gives (NaN, 0). Host code
/// every backend's top-k sampling shares.
pub fn host_top_k_pairs(
    x: &Tensor,
    k: usize,
    valid: usize,
    offset: usize,
) -> Result<Tensor, String> {
    let (rows, cols) = x.rows_cols();
    if valid > cols || k == 0 || k > cols {
        return Err(format!("top {k} of {valid} valid columns of {cols}"));
    }
    let mut out = pool::empty(rows * 2 * k);
    let mut order: Vec<(f32, usize)> = Vec::with_capacity(valid);
    for row in x.data.chunks(cols).take(rows) {
        let row = &row[..valid];
        let start = out.len();
        if row.iter().any(|v| !v.is_finite()) {
            out.extend_from_slice(&[f32::NAN, 0.0]);
        } else {
            order.clear();
            order.extend(row.iter().copied().zip(0..));
            let m = k.min(valid);
            if m > 0 && m < valid {
                order.select_nth_unstable_by(m - 1, candidate_order);
            }
            order[..m].sort_unstable_by(candidate_order);
            for &(v, i) in &order[..m] {
                // Exact: vocabularies are at most 2^24 (the model validation's limit).
                out.extend_from_slice(&[v, (offset + i) as f32]);
            }
        }
        while out.len() < start + 2 * k {
            out.extend_from_slice(&[f32::NEG_INFINITY, -1.0]);
        }
    }
    Ok(Tensor::new(vec![rows, 2 * k], out))
}

/// The `k` best pairs of each row over `parts` blocks of [`host_top_k_pairs`] output (one
/// per rank, stacked), NaN rows kept as NaN.
pub fn host_best_k_of_pairs(pairs: &Tensor, parts: usize, k: usize) -> Result<Tensor, String> {
    let (all, cols) = pairs.rows_cols();
    let per = cols / 2;
    if cols % 2 != 0 || parts == 0 || all % parts != 0 || k == 0 || k > per * parts {
        return Err(format!("best {k} of {all}x{cols} pairs in {parts} parts"));
    }
    let rows = all / parts;
    let mut out = pool::empty(rows * 2 * k);
    let mut union: Vec<(f32, usize)> = Vec::with_capacity(per * parts);
    for r in 0..rows {
        let start = out.len();
        union.clear();
        let mut nan = false;
        for p in 0..parts {
            let at = (p * rows + r) * cols;
            let part = &pairs.data[at..at + cols];
            if part[0].is_nan() {
                nan = true;
                break;
            }
            // Indices are whole numbers below 2^24; -1 marks an empty entry.
            union.extend(
                part.chunks(2)
                    .filter(|e| e[1] >= 0.0)
                    .map(|e| (e[0], e[1] as usize)),
            );
        }
        if nan {
            out.extend_from_slice(&[f32::NAN, 0.0]);
        } else {
            union.sort_unstable_by(candidate_order);
            for &(v, i) in union.iter().take(k) {
                out.extend_from_slice(&[v, i as f32]);
            }
        }
        while out.len() < start + 2 * k {
            out.extend_from_slice(&[f32::NEG_INFINITY, -1.0]);
        }
    }
    Ok(Tensor::new(vec![rows, 2 * k], out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(
            pick(&[1.0, 3.0, 3.0], &Sampling::default(), &mut Rng::new(1)),
            1
        );
    }

    fn with(temperature: f32, top_k: Option<usize>, top_p: Option<f32>) -> Sampling {
        Sampling {
            temperature,
            top_k,
            top_p,
            seed: 0,
        }
    }

    #[test]
    fn validate_accepts_greedy_and_real_sampling() {
        assert_eq!(Sampling::default().validate(), Ok(()));
        assert_eq!(with(0.8, Some(5), Some(0.9)).validate(), Ok(()));
        assert_eq!(with(1.0, Some(1), Some(1.0)).validate(), Ok(()));
        assert_eq!(with(0.5, None, None).validate(), Ok(()));
    }

    #[test]
    fn validate_refuses_top_k_or_top_p_with_greedy_decoding() {
        for (s, flags) in [
            (with(0.0, Some(5), None), "--top-k"),
            (with(0.0, None, Some(0.9)), "--top-p"),
            (with(0.0, Some(5), Some(0.9)), "--top-k and --top-p"),
        ] {
            let e = s.validate().unwrap_err();
            assert_eq!(e, SamplingError::NeedsTemperature { flags });
            let m = e.to_string();
            assert!(
                m.contains("add --temperature T") && m.contains(&format!("or drop {flags}")),
                "{m}"
            );
        }
    }

    #[test]
    fn validate_refuses_values_that_keep_nothing_or_are_not_numbers() {
        assert_eq!(
            with(1.0, Some(0), None).validate(),
            Err(SamplingError::ZeroTopK)
        );
        for p in [0.0, -0.1, 1.01, f32::NAN, f32::INFINITY] {
            let e = with(1.0, None, Some(p)).validate().unwrap_err();
            assert!(matches!(e, SamplingError::TopPOutOfRange(_)), "{p}: {e}");
        }
        for t in [-0.5, f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let e = with(t, None, None).validate().unwrap_err();
            assert!(matches!(e, SamplingError::BadTemperature(_)), "{t}: {e}");
        }
    }

    #[test]
    fn top_k_one_is_greedy_and_seeds_repeat() {
        let logits = [0.1, 2.0, 1.9, -1.0];
        let s = Sampling {
            temperature: 1.0,
            top_k: Some(1),
            top_p: None,
            seed: 3,
        };
        assert_eq!(pick(&logits, &s, &mut Rng::new(3)), 1);
        let s = Sampling {
            temperature: 1.0,
            top_k: None,
            top_p: Some(0.9),
            seed: 3,
        };
        let a: Vec<usize> = {
            let mut r = Rng::new(7);
            (0..20).map(|_| pick(&logits, &s, &mut r)).collect()
        };
        let b: Vec<usize> = {
            let mut r = Rng::new(7);
            (0..20).map(|_| pick(&logits, &s, &mut r)).collect()
        };
        assert_eq!(a, b);
        assert!(
            a.iter().all(|&t| t == 1 || t == 2),
            "top-p 0.9 keeps the two likely tokens: {a:?}"
        );
    }

    /// Logits with many ties (and -0.0 beside 0.0), from a seed.
    fn tied_logits(seed: u64, n: usize) -> Vec<f32> {
        let mut r = Rng::new(seed);
        (0..n)
            .map(|_| match (r.next_f64() * 8.0) as u32 {
                0 => 0.0,
                1 => -0.0,
                2 => 1.5,
                _ => ((r.next_f64() * 12.0).floor() as f32 - 6.0) * 0.5,
            })
            .collect()
    }

    #[test]
    fn candidates_from_slices_pick_what_the_whole_row_picks() {
        for seed in 0..300u64 {
            let logits = tied_logits(seed, 37);
            for (k, top_p) in [
                (1, None),
                (3, None),
                (5, Some(0.7)),
                (36, Some(0.95)),
                (80, None),
            ] {
                let s = Sampling {
                    temperature: 0.3 + (seed % 5) as f32 * 0.4,
                    top_k: Some(k),
                    top_p,
                    seed,
                };
                // Each of 4 slices keeps its own k best; the union holds the global k best.
                let mut union = Vec::new();
                for slice in 0..4 {
                    let start = slice * 10;
                    let mut part: Vec<(f32, usize)> = logits
                        .iter()
                        .copied()
                        .zip(0..)
                        .skip(start)
                        .take(10)
                        .collect();
                    part.sort_by(candidate_order);
                    part.truncate(k);
                    union.extend(part);
                }
                union.reverse();
                let (mut a, mut b) = (Rng::new(seed), Rng::new(seed));
                for _ in 0..4 {
                    assert_eq!(
                        Some(pick(&logits, &s, &mut a)),
                        pick_from_candidates(&union, &s, &mut b),
                        "seed {seed}, k {k}"
                    );
                }
            }
        }
        assert_eq!(
            pick_from_candidates(&[], &with(1.0, Some(2), None), &mut Rng::new(0)),
            None
        );
        // Greedy over candidates is the first maximum, -0.0 equal to 0.0 as in `argmax`.
        let greedy = Sampling::default();
        let c = [(0.0, 4), (-0.0, 2), (-1.0, 0)];
        assert_eq!(pick_from_candidates(&c, &greedy, &mut Rng::new(0)), Some(2));
        assert_eq!(argmax(&[-1.0, 0.0, -0.0, 0.0, 0.0]), 1);
    }
}
