//! The order the decode GEMVs read a weight panel in: as [`STREAMS`] parts at once, each a
//! sequential run of its own pages. One sequential stream per thread leaves the memory
//! system idle between the lines the prefetchers ask for; several keep more lines in
//! flight. Measured on this project's 2-core Xeon (two threads summing 64 KiB panels of a
//! 1 GiB buffer): one stream with a prefetch 2 KiB ahead 26.1 GB/s, four streams 28.7, eight
//! streams each with a prefetch 512 B ahead 30.3; TinyLlama bf16 decode 11.3 → 13.0 tok/s.
//! The AVX512-BF16 GEMV no longer reads that way: on a Zen 5 guest one stream prefetched
//! 4 KiB ahead read faster (`avx512bf16::gemv_one_row`); the AVX2 and AVX-512F GEMVs
//! still do (not re-measured on that host).

/// Parts a panel is read as at once.
pub const STREAMS: usize = 8;
/// Bytes ahead of each part's read that are asked for in L1.
pub const PREFETCH_BYTES: usize = 512;
/// Bytes ahead of the read that the integer GEMVs (INT8, INT4), which read a panel as one
/// stream, ask for in L1. Measured on the 2-core Zen 1 host (TinyLlama decode, tp 1, best
/// of 3): W8A16 with 512 B 17.3–17.5 tok/s, 1 KiB 18.1–18.3, 2 KiB 18.1–18.5, 4 KiB
/// 18.2–18.7, 16 KiB 18.3–18.4; GPTQ 22.6–23.3 with 512 B, 23.8–24.0 with 4 KiB; FP8 (the
/// AVX2 code GEMV) 8.91–8.95 with 512 B, 9.02–9.09 with 4 KiB; W8A16 in an f32 run (the same
/// GEMV) 10.91–10.97 before (512 B and widening through i32), 11.34–11.40 after. Reading a
/// block of INT8 codes as several parts at once, as the bf16 GEMV does, ran slower there
/// (14.3–15.5). On a Zen 5 guest the AVX-512 code GEMV (INT8, FP8), then 512 B ahead,
/// waited on its loads (perf: half its cycles on the widening's load); with 4 KiB, INT8
/// decode 33.1 → 47.0 tok/s and FP8 32.5 → 41.2 (medians of 4 alternating passes; 8 KiB
/// 37.2 and 31.5 in the same passes, on a guest whose bandwidth drifted by 20 %).
pub const ONE_STREAM_PREFETCH_BYTES: usize = 4096;

/// Runs `body` for every pair row `j` in `0..pairs`, each once: the first
/// `STREAMS · (pairs / STREAMS)` rows as `STREAMS` parts read round robin (`s` is the part),
/// then the rest in order (as part 0). Before each row of a part it prefetches the row
/// `PREFETCH_BYTES` further on from the panel at `base` (`pair_bytes` per row).
///
/// A macro, not a function taking a closure: a closure is compiled without its caller's
/// `target_feature`s, and one too big to inline then calls every intrinsic out of line
/// (AVX2 GEMV of 3 rows: 50x slower). The constant part loop also lets `s` index registers.
macro_rules! for_each_pair {
    ($pairs:expr, $base:expr, $pair_bytes:expr, |$j:ident, $s:ident| $body:block) => {{
        use $crate::runtime::cpu::isa::streams::{prefetch_pair, STREAMS};
        let (pairs, base, pair_bytes): (usize, *const u8, usize) = ($pairs, $base, $pair_bytes);
        let part = pairs / STREAMS;
        for i in 0..part {
            for $s in 0..STREAMS {
                let $j = $s * part + i;
                prefetch_pair(base, $j, pair_bytes);
                $body
            }
        }
        for $j in STREAMS * part..pairs {
            let $s = 0usize;
            $body
        }
    }};
}
pub(super) use for_each_pair;

/// Asks for the line [`ONE_STREAM_PREFETCH_BYTES`] past `p` in L1: the GEMVs that read a
/// panel as one stream (INT8, INT4, and the code GEMVs) call it once a step.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub fn prefetch_one_stream(p: *const u8) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    // SAFETY: a prefetch reads nothing architecturally, whatever the address.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(ONE_STREAM_PREFETCH_BYTES) as *const i8) };
}

/// Asks for every 64-byte line of pair row `j + PREFETCH_BYTES / pair_bytes` in L1.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub fn prefetch_pair(base: *const u8, j: usize, pair_bytes: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    // Prefetches never fault: past the panel's end is harmless.
    let ahead = base.wrapping_add(j * pair_bytes + PREFETCH_BYTES);
    for line in (0..pair_bytes).step_by(64) {
        // SAFETY: a prefetch reads nothing architecturally, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line) as *const i8) };
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    #[test]
    fn every_pair_row_is_visited_once_with_its_part() {
        for pairs in [0, 1, 7, 8, 9, 16, 17, 63, 64, 1000] {
            let mut seen = vec![0u32; pairs];
            let mut order = Vec::new();
            for_each_pair!(pairs, std::ptr::null(), 64, |j, s| {
                seen[j] += 1;
                order.push((j, s));
            });
            assert!(seen.iter().all(|&c| c == 1), "pairs {pairs}: {seen:?}");
            let part = pairs / STREAMS;
            for &(j, s) in &order {
                let expected = if j < STREAMS * part { j / part } else { 0 };
                assert_eq!(s, expected, "pairs {pairs}, row {j}");
            }
            // Round robin: the first STREAMS visits start every part.
            if part > 0 {
                let firsts: Vec<usize> = order[..STREAMS].iter().map(|&(j, _)| j).collect();
                let want: Vec<usize> = (0..STREAMS).map(|s| s * part).collect();
                assert_eq!(firsts, want);
            }
        }
    }
}

/// Asks for every line of `runs` in L1: a panel's scales (and zeros), read a line per
/// block apart from its codes, are asked for before its first block, so no block's end
/// waits on them. GPTQ decode on the Zen 5 guest, tp 1, medians of 6 alternating passes:
/// 54.5 → 57.9 tok/s (perf: the scale and zero loads had held 30 % of the GEMV's cycles).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub fn prefetch_runs(runs: &[&[f32]]) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    for run in runs {
        for line in run.chunks(16) {
            // SAFETY: a prefetch reads nothing architecturally, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(line.as_ptr() as *const i8) };
        }
    }
}
