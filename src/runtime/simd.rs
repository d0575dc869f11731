//! Runs plain Rust loops compiled for AVX2 + FMA when the CPU has them (chosen at run time),
//! so that they vectorise 8 wide instead of the 4 of the baseline x86-64 target. Host code of
//! two parts uses it: the CPU backend and the host communicators' sums (`comm/reduce.rs`).

/// Calls `f` from a function compiled with AVX2 + FMA enabled when this CPU has both; `f`
/// and what it inlines are then compiled for them too — if LLVM inlines `f`, which it does
/// for small closures only: large loops belong in [`widest_simd_fn`].
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

/// Defines `$vis fn $name(args)` that runs `$body(args)` — an `#[inline(always)]` function —
/// compiled for AVX-512F, else AVX2 + FMA, else the baseline, as the host allows. Unlike
/// [`with_avx2`], whose closure gets the features only if LLVM inlines it (a large closure is
/// not inlined and runs as baseline SSE2: `mulps` on xmm registers, seen in both attention
/// loops), the body is inlined into each wrapper by its `#[inline(always)]`. Loops compute
/// the same sums in the same order whichever runs.
macro_rules! widest_simd_fn {
    ($vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) => $body:path) => {
        $vis fn $name($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma")]
                unsafe fn wide($($arg: $ty),*) {
                    $body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn narrow($($arg: $ty),*) {
                    $body($($arg),*)
                }
                let avx2_fma = std::is_x86_feature_detected!("avx2")
                    && std::is_x86_feature_detected!("fma");
                if avx2_fma && std::is_x86_feature_detected!("avx512f") {
                    // SAFETY: AVX-512F (and with it AVX2 and FMA) was detected.
                    return unsafe { wide($($arg),*) };
                }
                if avx2_fma {
                    // SAFETY: AVX2 and FMA were detected.
                    return unsafe { narrow($($arg),*) };
                }
            }
            $body($($arg),*)
        }
    };
}
pub(crate) use widest_simd_fn;
