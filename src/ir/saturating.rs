//! Size arithmetic that cannot wrap: a product or sum past `u64::MAX` stays at `u64::MAX`,
//! which every later limit check refuses. Used where sizes come from files (models, plans).

/// The product of `factors`, or `u64::MAX` when it does not fit.
pub fn product(factors: impl IntoIterator<Item = u64>) -> u64 {
    factors.into_iter().fold(1u64, u64::saturating_mul)
}

/// The sum of `terms`, or `u64::MAX` when it does not fit.
pub fn sum(terms: impl IntoIterator<Item = u64>) -> u64 {
    terms.into_iter().fold(0u64, u64::saturating_add)
}

/// The greatest common divisor (`gcd(0, b) = b`).
pub fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The least common multiple of `a` and `b` (0 where either is), or `u64::MAX` when it
/// does not fit.
pub fn lcm(a: u64, b: u64) -> u64 {
    match gcd(a, b) {
        0 => 0,
        g => (a / g).saturating_mul(b),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn divisors_and_multiples() {
        assert_eq!(super::gcd(800, 128), 32);
        assert_eq!(super::gcd(0, 7), 7);
        assert_eq!(super::lcm(800, 128), 3200);
        assert_eq!(super::lcm(1, 128), 128);
        assert_eq!(super::lcm(0, 5), 0);
        assert_eq!(super::lcm(1 << 40, (1 << 40) - 1), u64::MAX);
    }

    #[test]
    fn saturates_instead_of_wrapping() {
        assert_eq!(super::product([1 << 32, 1 << 32]), u64::MAX);
        assert_eq!(super::product([3, 5]), 15);
        assert_eq!(super::product([0, u64::MAX]), 0);
        assert_eq!(super::sum([u64::MAX, 1]), u64::MAX);
        assert_eq!(super::sum([2, 3]), 5);
    }
}
