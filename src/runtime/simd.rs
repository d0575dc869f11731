//! Runs plain Rust loops compiled for AVX2 + FMA when the CPU has them (chosen at run time),
//! so that they vectorise 8 wide instead of the 4 of the baseline x86-64 target.

/// Calls `f` from a function compiled with AVX2 + FMA enabled when this CPU has both; `f`
/// and what it inlines are then compiled for them too.
#[inline(always)]
pub fn with_avx2<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2,fma")]
        unsafe fn go<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: both features were detected just above.
            return unsafe { go(f) };
        }
    }
    f()
}
