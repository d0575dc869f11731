//! The host's arithmetic peak per kernel variant, measured with a loop of independent
//! multiply-adds in registers (no memory traffic), so `tpc bench-gemm` can show how far each
//! kernel is from what its instructions can do on this machine.

use super::Isa;
use std::time::Instant;

/// Multiply-add instructions per thread per measurement call.
const ITERS: u64 = 1 << 22;

/// Peak FLOP/s of `isa`'s product instruction over `threads` threads (each running the loop
/// at once; the best of calls over about `seconds`), or `None` for `portable` (no single
/// instruction) or a variant this host does not run.
pub fn peak_flops(isa: Isa, threads: usize, seconds: f64) -> Option<f64> {
    isa.host_support().ok()?;
    let one: fn() -> f64 = match isa {
        Isa::Portable => return None,
        #[cfg(target_arch = "x86_64")]
        // SAFETY (all four): the variant's instructions were checked against the host.
        Isa::Avx2 => || unsafe { x86::fma_avx2() },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => || unsafe { x86::fma_avx512() },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Bf16 => || unsafe { x86::dpbf16() },
        #[cfg(target_arch = "x86_64")]
        Isa::Amx => || unsafe { x86::amx() },
        #[cfg(not(target_arch = "x86_64"))]
        _ => return None,
    };
    let start = Instant::now();
    let mut best: f64 = 0.0;
    while best == 0.0 || start.elapsed().as_secs_f64() < seconds {
        let t = Instant::now();
        let flops: f64 = std::thread::scope(|s| {
            let workers: Vec<_> = (0..threads.max(1)).map(|_| s.spawn(one)).collect();
            workers.into_iter().map(|w| w.join().unwrap_or(0.0)).sum()
        });
        best = best.max(flops / t.elapsed().as_secs_f64());
    }
    Some(best)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::ITERS;
    use std::arch::x86_64::*;
    use std::hint::black_box;

    /// 12 independent accumulators: enough chains to cover latency × ports on every CPU here.
    const CHAINS: usize = 12;

    /// # Safety
    /// AVX2 + FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fma_avx2() -> f64 {
        // Opaque, distinct starting values: nothing to fold or merge at compile time.
        let (a, b) = black_box((_mm256_set1_ps(0.999), _mm256_set1_ps(1e-3)));
        let mut acc: [__m256; CHAINS] =
            black_box(std::array::from_fn(|i| _mm256_set1_ps(i as f32)));
        for _ in 0..ITERS {
            for c in acc.iter_mut() {
                *c = _mm256_fmadd_ps(*c, a, b);
            }
        }
        black_box(acc);
        (ITERS as usize * CHAINS * 8 * 2) as f64
    }

    /// # Safety
    /// AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma_avx512() -> f64 {
        let (a, b) = black_box((_mm512_set1_ps(0.999), _mm512_set1_ps(1e-3)));
        let mut acc: [__m512; CHAINS] =
            black_box(std::array::from_fn(|i| _mm512_set1_ps(i as f32)));
        for _ in 0..ITERS {
            for c in acc.iter_mut() {
                *c = _mm512_fmadd_ps(*c, a, b);
            }
        }
        black_box(acc);
        (ITERS as usize * CHAINS * 16 * 2) as f64
    }

    /// # Safety
    /// AVX512-BF16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn dpbf16() -> f64 {
        let a: __m512bh = black_box(std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi16(
            0x3F80,
        )));
        let mut acc: [__m512; CHAINS] =
            black_box(std::array::from_fn(|i| _mm512_set1_ps(i as f32)));
        for _ in 0..ITERS {
            for c in acc.iter_mut() {
                *c = _mm512_dpbf16_ps(*c, a, a);
            }
        }
        black_box(acc);
        // 32 products and 32 additions per lane group of 16 sums.
        (ITERS as usize * CHAINS * 32 * 2) as f64
    }

    /// # Safety
    /// AMX-BF16 with the tile state granted.
    pub unsafe fn amx() -> f64 {
        use std::arch::asm;
        let tiles = crate::runtime::cpu::isa::AmxTiles::configure();
        asm!(
            "tilezero tmm4",
            "tilezero tmm5",
            "tilezero tmm6",
            "tilezero tmm7",
            options(nomem, nostack, preserves_flags)
        );
        // Four independent 16×16×32 products per iteration, as the GEMM's 32×32 block does.
        let iters = ITERS / 64;
        for _ in 0..iters {
            asm!(
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                options(nomem, nostack, preserves_flags)
            );
        }
        drop(tiles);
        (iters as usize * 4 * 16 * 16 * 32 * 2) as f64
    }
}
