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

#[cfg(test)]
mod tests {
    #[test]
    fn saturates_instead_of_wrapping() {
        assert_eq!(super::product([1 << 32, 1 << 32]), u64::MAX);
        assert_eq!(super::product([3, 5]), 15);
        assert_eq!(super::product([0, u64::MAX]), 0);
        assert_eq!(super::sum([u64::MAX, 1]), u64::MAX);
        assert_eq!(super::sum([2, 3]), 5);
    }
}
