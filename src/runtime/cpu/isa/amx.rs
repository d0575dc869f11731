//! AMX-BF16 prompt GEMM tiles, through `asm!` (the AMX intrinsics are unstable).
//!
//! One block is up to 32 rows × 32 columns: C in tmm0..3 (rows 0/16 × panels 0/1), A rows in
//! tmm4/5, weight panels in tmm6/7; every tile is 16 rows × 64 bytes (one configuration for
//! all). A k-block is 32 steps: A tile = 16 rows × 32 bf16 activations, B tile = 16 pair
//! rows × 16 columns × 2 of a weight panel — the panel's own layout, 1 KiB contiguous.
//! Activations are packed the same way, 1 KiB per tile ([`TILE`] values): rows of a
//! row-major matrix whose length is a multiple of 4 KiB would share L1 sets and evict each
//! other (measured: 15–18 % of the tile peak with row-major A).
//!
//! Every tile must start on a cache line (`runtime::cpu::aligned`): on the Xeon this was tuned
//! on, a tile load whose rows straddle lines took ~48 cycles against ~7, which alone held
//! the product to a third of the peak.

/// bf16 values in one 16 × 32 tile.
pub const TILE: usize = 16 * BF16_K_ALIGN;

use super::{BF16_K_ALIGN, NR};
use std::arch::asm;
use std::marker::PhantomData;

/// The 64-byte tile configuration (palette 1).
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

/// This thread's tiles, configured for [`AmxTiles::block`]; released when dropped. Not
/// `Send`: the configuration belongs to the thread that loaded it.
pub struct AmxTiles {
    _thread: PhantomData<*const ()>,
}

impl AmxTiles {
    /// # Safety
    /// The host has AMX-BF16 and the process was granted the tile state
    /// ([`super::Isa::Amx`] is supported).
    pub unsafe fn configure() -> AmxTiles {
        let mut cfg = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        for t in 0..8 {
            cfg.colsb[t] = 64;
            cfg.rows[t] = 16;
        }
        asm!("ldtilecfg [{}]", in(reg) &cfg, options(nostack, readonly, preserves_flags));
        AmxTiles {
            _thread: PhantomData,
        }
    }

    /// `c[16·R16 rows][16·P cols] (+)= a · w` over `kblocks` blocks of 32 steps: `a` is
    /// `R16` row tiles, `a_next` values apart, of `kblocks` packed A tiles each (zero past the
    /// depth), `b` are weight panels from the same step on, `c` rows `ldc` f32 apart. With
    /// `accumulate` the block adds to what `c` holds (an earlier slice of the depth), else
    /// overwrites it.
    ///
    /// Meanwhile asks for `ahead.1` cache lines per step from `ahead.0` on into L2 (the
    /// weights the next blocks read, so memory streams while the tiles compute).
    ///
    /// # Safety
    /// `a` holds `R16` row tiles of `kblocks` tiles of [`TILE`] values; each `b` `kblocks`
    /// tiles; `c` is valid for `16·R16` rows of `16·P` values. (`ahead` may point anywhere:
    /// prefetches never fault.)
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn block<const R16: usize, const P: usize>(
        &self,
        (a, a_next): (*const u16, usize),
        b: [*const u16; P],
        kblocks: usize,
        (c, ldc): (*mut f32, usize),
        accumulate: bool,
        ahead: (*const u8, usize),
    ) {
        let (sa, sb, sc) = (64usize, 64usize, ldc * 4);
        let c1 = c.wrapping_add(16 * ldc);
        if accumulate {
            asm!("tileloadd tmm0, [{p} + {s}*1]", p = in(reg) c, s = in(reg) sc, options(nostack, readonly, preserves_flags));
            if P == 2 {
                asm!("tileloadd tmm1, [{p} + {s}*1]", p = in(reg) c.add(NR), s = in(reg) sc, options(nostack, readonly, preserves_flags));
            }
            if R16 == 2 {
                asm!("tileloadd tmm2, [{p} + {s}*1]", p = in(reg) c1, s = in(reg) sc, options(nostack, readonly, preserves_flags));
                if P == 2 {
                    asm!("tileloadd tmm3, [{p} + {s}*1]", p = in(reg) c1.add(NR), s = in(reg) sc, options(nostack, readonly, preserves_flags));
                }
            }
        } else {
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                options(nomem, nostack, preserves_flags)
            );
        }
        // Only read when R16 = 2 (wrapping: for one row tile it may point past `a`).
        let a1 = a.wrapping_add(a_next);
        // Each load is issued right before the first product that needs it. Measured against
        // all four loads first: no difference beyond the noise (bench-gemm, AMX, 128/512
        // rows, two alternations).
        for t in 0..kblocks {
            let (ka, kb) = (t * TILE, t * BF16_K_ALIGN * NR);
            for l in 0..ahead.1 {
                let line = ahead.0.wrapping_add((t * ahead.1 + l) * 64) as *const i8;
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(line);
            }
            asm!("tileloadd tmm4, [{p} + {s}*1]", p = in(reg) a.add(ka), s = in(reg) sa, options(nostack, readonly, preserves_flags));
            asm!("tileloadd tmm6, [{p} + {s}*1]", p = in(reg) b[0].add(kb), s = in(reg) sb, options(nostack, readonly, preserves_flags));
            asm!(
                "tdpbf16ps tmm0, tmm4, tmm6",
                options(nomem, nostack, preserves_flags)
            );
            if P == 2 {
                asm!("tileloadd tmm7, [{p} + {s}*1]", p = in(reg) b[P - 1].add(kb), s = in(reg) sb, options(nostack, readonly, preserves_flags));
                asm!(
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    options(nomem, nostack, preserves_flags)
                );
            }
            if R16 == 2 {
                asm!("tileloadd tmm5, [{p} + {s}*1]", p = in(reg) a1.add(ka), s = in(reg) sa, options(nostack, readonly, preserves_flags));
                asm!(
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    options(nomem, nostack, preserves_flags)
                );
                if P == 2 {
                    asm!(
                        "tdpbf16ps tmm3, tmm5, tmm7",
                        options(nomem, nostack, preserves_flags)
                    );
                }
            }
        }
        asm!("tilestored [{p} + {s}*1], tmm0", p = in(reg) c, s = in(reg) sc, options(nostack, preserves_flags));
        if P == 2 {
            asm!("tilestored [{p} + {s}*1], tmm1", p = in(reg) c.add(NR), s = in(reg) sc, options(nostack, preserves_flags));
        }
        if R16 == 2 {
            asm!("tilestored [{p} + {s}*1], tmm2", p = in(reg) c1, s = in(reg) sc, options(nostack, preserves_flags));
            if P == 2 {
                asm!("tilestored [{p} + {s}*1], tmm3", p = in(reg) c1.add(NR), s = in(reg) sc, options(nostack, preserves_flags));
            }
        }
    }
}

/// One-tile products for attention (`runtime::cpu::attention::amx`): a C tile summed over
/// `steps` pairs of 1 KiB A and B tiles, then stored.
impl AmxTiles {
    /// `c[16][16] = Σ_s a_s · b_s` for `s < steps`, A tiles `a_next` values apart, B tiles
    /// `b_next` apart; `c` rows `ldc` f32 apart.
    ///
    /// # Safety
    /// `a` and `b` hold `steps` tiles at those strides, 64-byte aligned for speed; `c` 16
    /// rows of 16 values.
    pub unsafe fn product_tile(
        &self,
        (a, a_next): (*const u16, usize),
        (b, b_next): (*const u16, usize),
        steps: usize,
        (c, ldc): (*mut f32, usize),
    ) {
        let (s, sc) = (64usize, ldc * 4);
        asm!("tilezero tmm0", options(nomem, nostack, preserves_flags));
        for t in 0..steps {
            asm!("tileloadd tmm4, [{p} + {s}*1]", p = in(reg) a.add(t * a_next), s = in(reg) s, options(nostack, readonly, preserves_flags));
            asm!("tileloadd tmm6, [{p} + {s}*1]", p = in(reg) b.add(t * b_next), s = in(reg) s, options(nostack, readonly, preserves_flags));
            asm!(
                "tdpbf16ps tmm0, tmm4, tmm6",
                options(nomem, nostack, preserves_flags)
            );
        }
        asm!("tilestored [{p} + {s}*1], tmm0", p = in(reg) c, s = in(reg) sc, options(nostack, preserves_flags));
    }
}

impl Drop for AmxTiles {
    fn drop(&mut self) {
        // SAFETY: the tiles were configured by this thread (`configure`), so AMX exists.
        unsafe { asm!("tilerelease", options(nomem, nostack, preserves_flags)) };
    }
}
