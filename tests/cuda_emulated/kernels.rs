//! The CUDA kernels of `kernels/`, run on the CPU (`tests/emulator`: g++ and fibers for
//! CUDA threads), against plain f64 references, with the launch shapes the CUDA backend
//! uses (`src/runtime/cuda/backend.rs`). This is what shows the kernels right with no GPU;
//! it does not show them fast, nor that the GPU's expf and FMA round like the CPU's (the
//! tolerances allow for that).

use crate::emulator;

use emulator::{assert_close, dims, kernel_file, Arg, Buffers, Values};

/// Causal attention of `new` rows at positions start.. over a cache of start + new
/// positions, grouped heads: out [new, q_heads * d].
#[allow(clippy::too_many_arguments)]
fn attention_reference(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    new: usize,
    start: usize,
    q_heads: usize,
    kv_heads: usize,
    d: usize,
    scale: f32,
) -> Vec<f64> {
    let (qc, kc) = (q_heads * d, kv_heads * d);
    let mut out = vec![0.0; new * qc];
    for r in 0..new {
        for h in 0..q_heads {
            let kh = h / (q_heads / kv_heads);
            let seen = start + r + 1;
            let scores: Vec<f64> = (0..seen)
                .map(|p| {
                    (0..d)
                        .map(|i| q[r * qc + h * d + i] as f64 * k[p * kc + kh * d + i] as f64)
                        .sum::<f64>()
                        * scale as f64
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = weights.iter().sum();
            for i in 0..d {
                out[r * qc + h * d + i] = (0..seen)
                    .map(|p| weights[p] * v[p * kc + kh * d + i] as f64)
                    .sum::<f64>()
                    / total;
            }
        }
    }
    out
}

struct AttentionShape {
    new: usize,
    start: usize,
    q_heads: usize,
    kv_heads: usize,
    d: usize,
}

const ATTENTION_SHAPES: &[AttentionShape] = &[
    // a prompt: every row sees a different number of positions
    AttentionShape {
        new: 7,
        start: 0,
        q_heads: 4,
        kv_heads: 2,
        d: 64,
    },
    // decode: one row over a longer cache, grouped heads 8:1
    AttentionShape {
        new: 1,
        start: 70,
        q_heads: 8,
        kv_heads: 1,
        d: 128,
    },
    // a continued prompt, head dims not a multiple of 32 or beyond one word per lane
    AttentionShape {
        new: 3,
        start: 5,
        q_heads: 2,
        kv_heads: 2,
        d: 40,
    },
    AttentionShape {
        new: 2,
        start: 9,
        q_heads: 3,
        kv_heads: 1,
        d: 256,
    },
    AttentionShape {
        new: 1,
        start: 0,
        q_heads: 1,
        kv_heads: 1,
        d: 8,
    },
];

/// How the backend may run one segment's attention (kernels/attention.cu).
#[derive(Clone, Copy, Debug)]
enum Way {
    /// `attention`: a block per (row, head).
    OnePass,
    /// `attention_split` over chunks of this many positions, then `attention_merge` (whose
    /// blocks have this many threads).
    Split { chunk: usize, merge_threads: u32 },
    /// `attention_tiled`: 16 rows a block.
    Tiled,
}

/// How a test lays a sequence's cache out in the paged pool: blocks of `block_size` rows,
/// in order from block 0 or backwards with a free (NaN) block between each two.
#[derive(Clone, Copy, Debug)]
struct Paging {
    block_size: usize,
    backwards: bool,
}

/// The layouts every attention test runs: one block per 16 positions in order, and blocks
/// of 3 and of 1 position backwards.
const PAGINGS: [Paging; 3] = [
    Paging {
        block_size: 16,
        backwards: false,
    },
    Paging {
        block_size: 3,
        backwards: true,
    },
    Paging {
        block_size: 1,
        backwards: true,
    },
];

impl Paging {
    /// The table of a sequence of `positions`.
    fn table(self, positions: usize) -> Vec<i64> {
        let m = positions.div_ceil(self.block_size).max(1);
        (0..m)
            .map(|i| if self.backwards { 2 * (m - i) - 1 } else { i } as i64)
            .collect()
    }

    /// `x [positions, cols]` written through `table` into a pool of NaN (a kernel that reads
    /// a row outside the table makes NaN).
    fn pool(self, x: &[f32], cols: usize, table: &[i64]) -> Vec<f32> {
        let blocks = *table.iter().max().expect("a block") as usize + 2;
        let mut pool = vec![f32::NAN; blocks * self.block_size * cols];
        for (p, row) in x.chunks_exact(cols).enumerate() {
            let at = table[p / self.block_size] as usize * self.block_size + p % self.block_size;
            pool[at * cols..(at + 1) * cols].copy_from_slice(row);
        }
        pool
    }
}

/// Runs one segment's attention the given way over its cache paged as `paging`; the whole
/// output batch.
#[allow(clippy::too_many_arguments)]
fn run_attention(
    way: Way,
    paging: Paging,
    s: &AttentionShape,
    row0: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
) -> Vec<f32> {
    let file = kernel_file("attention.cu");
    let qc = s.q_heads * s.d;
    let kc = s.kv_heads * s.d;
    let scale = 1.0 / (s.d as f32).sqrt();
    let mut bufs = Buffers::default();
    let out = bufs.f32(&vec![0.0; q.len()]);
    let table = paging.table(s.start + s.new);
    let (qb, kb, vb) = (
        bufs.f32(q),
        bufs.f32(&paging.pool(k, kc, &table)),
        bufs.f32(&paging.pool(v, kc, &table)),
    );
    let tb = bufs.i64(&table);
    let heads = [
        Arg::I64(s.q_heads as i64),
        Arg::I64(s.kv_heads as i64),
        Arg::I64(s.d as i64),
        Arg::F32(scale),
    ];
    let (rows, q_heads) = (s.new as u32, s.q_heads as u32);
    let operands = [
        Arg::Buf(qb),
        Arg::Buf(kb),
        Arg::Buf(vb),
        Arg::Buf(tb),
        Arg::I64(paging.block_size as i64),
        Arg::I64(row0 as i64),
    ];
    let launched = match way {
        Way::OnePass => {
            let args = [
                &[Arg::Buf(out)][..],
                &operands,
                &[Arg::I64(s.start as i64)],
                &heads,
            ]
            .concat();
            file.launch(
                "attention",
                dims(rows, q_heads),
                dims(128, 1),
                &args,
                &mut bufs,
            )
        }
        Way::Tiled => {
            let args = [
                &[Arg::Buf(out)][..],
                &operands,
                &[Arg::I64(s.new as i64), Arg::I64(s.start as i64)],
                &heads,
            ]
            .concat();
            let tiles = s.new.div_ceil(16) as u32;
            file.launch(
                "attention_tiled",
                dims(tiles, q_heads),
                dims(128, 1),
                &args,
                &mut bufs,
            )
        }
        Way::Split {
            chunk,
            merge_threads,
        } => {
            let chunks = (s.start + s.new).div_ceil(chunk);
            let slots = s.new * s.q_heads * chunks;
            let part_max = bufs.f32(&vec![0.0; slots]);
            let part_sum = bufs.f32(&vec![0.0; slots]);
            let part_values = bufs.f32(&vec![0.0; slots * s.d]);
            let parts = [
                Arg::Buf(part_max),
                Arg::Buf(part_sum),
                Arg::Buf(part_values),
            ];
            let args = [
                &parts[..],
                &operands,
                &[Arg::I64(s.start as i64)],
                &heads,
                &[Arg::I64(chunk as i64)],
            ]
            .concat();
            let grid = emulator::Dims {
                x: rows,
                y: q_heads,
                z: chunks as u32,
            };
            file.launch("attention_split", grid, dims(128, 1), &args, &mut bufs)
                .and_then(|_| {
                    let args = [
                        &[Arg::Buf(out)][..],
                        &parts,
                        &[
                            Arg::I64(row0 as i64),
                            heads[0],
                            heads[2],
                            Arg::I64(chunks as i64),
                        ],
                    ]
                    .concat();
                    file.launch(
                        "attention_merge",
                        dims(rows, q_heads),
                        dims(merge_threads, 1),
                        &args,
                        &mut bufs,
                    )
                })
        }
    };
    launched.unwrap_or_else(|e| panic!("{way:?} {paging:?}: {e}"));
    let got = bufs.read_f32(out);
    let untouched = |r: &[f32]| r.iter().all(|&x| x == 0.0);
    assert!(
        untouched(&got[..row0 * qc]),
        "{way:?}: wrote rows before the segment"
    );
    assert!(
        untouched(&got[(row0 + s.new) * qc..]),
        "{way:?}: wrote rows after the segment"
    );
    got
}

fn check_attention(way: Way, shapes: &[AttentionShape]) {
    let mut values = Values(0x1234_5678_9abc_def1);
    for s in shapes {
        let positions = s.start + s.new;
        let (qc, kc) = (s.q_heads * s.d, s.kv_heads * s.d);
        // The segment's rows sit at batch row 2 of a batch with one more row after it.
        let row0 = 2;
        let q = values.take((row0 + s.new + 1) * qc);
        let k = values.take(positions * kc);
        let v = values.take(positions * kc);
        let scale = 1.0 / (s.d as f32).sqrt();
        let want = attention_reference(
            &q[row0 * qc..],
            &k,
            &v,
            s.new,
            s.start,
            s.q_heads,
            s.kv_heads,
            s.d,
            scale,
        );
        for paging in PAGINGS {
            let got = run_attention(way, paging, s, row0, &q, &k, &v);
            let what = format!(
                "{way:?} {paging:?}: new {} start {} d {}",
                s.new, s.start, s.d
            );
            assert_close(&what, &got[row0 * qc..(row0 + s.new) * qc], &want, 1e-5);
        }
    }
}

#[test]
fn one_pass_attention_matches_an_f64_reference() {
    check_attention(Way::OnePass, ATTENTION_SHAPES);
}

#[test]
fn split_attention_matches_an_f64_reference() {
    // Chunks that split the cache evenly, unevenly, and past the last row's positions.
    for (chunk, merge_threads) in [(16, 128), (32, 32), (64, 128), (1, 64)] {
        check_attention(
            Way::Split {
                chunk,
                merge_threads,
            },
            ATTENTION_SHAPES,
        );
    }
}

#[test]
fn tiled_attention_matches_an_f64_reference() {
    let prompts = [
        // one full tile, one short tile, two tiles and a bit, continued prompts
        AttentionShape {
            new: 16,
            start: 0,
            q_heads: 4,
            kv_heads: 2,
            d: 64,
        },
        AttentionShape {
            new: 5,
            start: 0,
            q_heads: 2,
            kv_heads: 1,
            d: 128,
        },
        AttentionShape {
            new: 37,
            start: 0,
            q_heads: 2,
            kv_heads: 2,
            d: 40,
        },
        AttentionShape {
            new: 20,
            start: 13,
            q_heads: 8,
            kv_heads: 2,
            d: 64,
        },
        AttentionShape {
            new: 17,
            start: 3,
            q_heads: 1,
            kv_heads: 1,
            d: 256,
        },
    ];
    check_attention(Way::Tiled, &prompts);
    check_attention(Way::Tiled, ATTENTION_SHAPES);
}

#[test]
fn rms_norms_match_an_f64_reference() {
    let file = kernel_file("norm.cu");
    let mut values = Values(42);
    // (groups, group): TinyLlama's hidden size, a q-norm head, and one not a multiple of 32
    for (groups, group) in [(3usize, 2048usize), (8, 64), (2, 77)] {
        let x = values.take(groups * group);
        let residual = values.take(groups * group);
        let w = values.take(group);
        let eps = 1e-5f32;
        let threads = (group.next_multiple_of(32)).clamp(32, 256) as u32;
        let norm = |x: &[f32]| -> Vec<f64> {
            x.chunks(group)
                .flat_map(|g| {
                    let ms = g.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / group as f64;
                    let inv = 1.0 / (ms + eps as f64).sqrt();
                    g.iter()
                        .zip(&w)
                        .map(move |(&v, &s)| s as f64 * v as f64 * inv)
                        .collect::<Vec<_>>()
                })
                .collect()
        };
        let mut bufs = Buffers::default();
        let (out, xb, wb) = (bufs.f32(&vec![0.0; x.len()]), bufs.f32(&x), bufs.f32(&w));
        let rb = bufs.f32(&residual);
        file.launch(
            "rms_norm",
            dims(groups as u32, 1),
            dims(threads, 1),
            &[
                Arg::Buf(out),
                Arg::Buf(xb),
                Arg::Buf(wb),
                Arg::I64(group as i64),
                Arg::F32(eps),
            ],
            &mut bufs,
        )
        .unwrap();
        assert_close("rms_norm", &bufs.read_f32(out), &norm(&x), 1e-5);

        file.launch(
            "add_rms_norm",
            dims(groups as u32, 1),
            dims(threads, 1),
            &[
                Arg::Buf(out),
                Arg::Buf(rb),
                Arg::Buf(xb),
                Arg::Buf(wb),
                Arg::I64(group as i64),
                Arg::F32(eps),
            ],
            &mut bufs,
        )
        .unwrap();
        let sum: Vec<f32> = residual.iter().zip(&x).map(|(a, b)| a + b).collect();
        assert_eq!(bufs.read_f32(rb), sum, "add_rms_norm: the residual");
        assert_close("add_rms_norm", &bufs.read_f32(out), &norm(&sum), 1e-5);
    }
}

/// `kv_write` puts each new row at its position through the table and touches no other
/// row of the pool, for blocks of 1, 3 and 16 positions out of order and a write that
/// starts inside a block.
#[test]
fn kv_write_puts_rows_through_the_block_table() {
    let file = kernel_file("attention.cu");
    let mut values = Values(0x0bad_cafe_f00d_1234);
    let cols = 24;
    for (block_size, table, start, rows) in [
        (1usize, vec![7i64, 2, 5, 0, 3], 1usize, 4usize),
        (3, vec![4, 1, 3], 2, 7),
        (16, vec![2, 0], 5, 20),
    ] {
        let blocks = *table.iter().max().unwrap() as usize + 2;
        let before = vec![-1.0f32; blocks * block_size * cols];
        // The source rows sit at row 2 of a batch with one more row after them.
        let src = values.take((rows + 3) * cols);
        let mut bufs = Buffers::default();
        let pool = bufs.f32(&before);
        let (sb, tb) = (bufs.f32(&src), bufs.i64(&table));
        let args = [
            Arg::Buf(pool),
            Arg::Buf(sb),
            Arg::Buf(tb),
            Arg::I64(block_size as i64),
            Arg::I64(2),
            Arg::I64(start as i64),
            Arg::I64(rows as i64),
            Arg::I64(cols as i64),
        ];
        file.launch("kv_write", dims(2, 1), dims(64, 1), &args, &mut bufs)
            .unwrap_or_else(|e| panic!("kv_write: {e}"));
        let got = bufs.read_f32(pool);
        let mut want = before.clone();
        for r in 0..rows {
            let p = start + r;
            let at = table[p / block_size] as usize * block_size + p % block_size;
            want[at * cols..(at + 1) * cols].copy_from_slice(&src[(2 + r) * cols..(3 + r) * cols]);
        }
        assert_eq!(got, want, "blocks of {block_size}, table {table:?}");
    }
}

/// What `linear_invariant_*` must write for output (row, col), in mode 0 (blocks chained in
/// f32), 1 (exact, the value) or 2 (exact, three limbs): the order of `runtime::exact`
/// computed on the host, each block one chain of fused multiply-adds.
fn invariant_reference(
    x: &[f32],
    w: &dyn Fn(usize, usize) -> f32,
    (m, k, n): (usize, usize, usize),
    block: usize,
    mode: i32,
    bound: f32,
) -> Vec<f32> {
    use tpc::runtime::exact::{encode_limbs, from_units, to_units};
    let mut out = Vec::new();
    for r in 0..m {
        for c in 0..n {
            let (mut chained, mut units) = (0f32, 0f64);
            for (b, start) in (0..k).step_by(block).enumerate() {
                let chain = (start..k.min(start + block))
                    .fold(0f32, |s, p| x[r * k + p].mul_add(w(c, p), s));
                chained = if b == 0 { chain } else { chained + chain };
                units += to_units(chain, bound);
            }
            match mode {
                0 => out.push(chained),
                1 => out.push(from_units(units)),
                _ => out.extend(encode_limbs(units)),
            }
        }
    }
    out
}

/// The invariant products give the host order's bits exactly (so a row's bits follow from
/// its own inputs only), for f32 and bf16 weights in both orders, tails of the depth, of
/// the blocks, of the tiles' rows and columns, and blocks that straddle the staged steps;
/// `decode_limbs` undoes the limbs exactly; a block past the bound gives NaN.
#[test]
fn invariant_products_follow_the_host_order_bit_for_bit() {
    use tpc::runtime::exact::{block_bound, decode_limbs};
    let file = kernel_file("invariant.cu");
    let mut values = Values(77);
    for (m, k, n, block) in [(1, 100, 37, 20), (9, 130, 70, 64), (3, 64, 33, 7)] {
        let x = values.take(m * k);
        let w = values.take(n * k); // w[c][p]
        let bits: Vec<u16> = w
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_bits())
            .collect();
        let blocks = k.div_ceil(block);
        for bf16 in [false, true] {
            let at = |c: usize, p: usize| {
                if bf16 {
                    half::bf16::from_bits(bits[c * k + p]).to_f32()
                } else {
                    w[c * k + p]
                }
            };
            for out_in in [1, 0] {
                for mode in [0i32, 1, 2] {
                    let bound = if mode == 0 {
                        f32::INFINITY
                    } else {
                        block_bound(blocks)
                    };
                    let want = invariant_reference(&x, &at, (m, k, n), block, mode, bound);
                    let mut bufs = Buffers::default();
                    let out = bufs.f32(&vec![0.0; want.len()]);
                    let xb = bufs.f32(&x);
                    // [n, k] as stored, or [k, n].
                    let wb = match (bf16, out_in) {
                        (false, 1) => bufs.f32(&w),
                        (true, 1) => bufs.bf16(&bits),
                        (false, _) => bufs.f32(
                            &(0..k * n)
                                .map(|i| w[(i % n) * k + i / n])
                                .collect::<Vec<_>>(),
                        ),
                        (true, _) => bufs.bf16(
                            &(0..k * n)
                                .map(|i| bits[(i % n) * k + i / n])
                                .collect::<Vec<_>>(),
                        ),
                    };
                    let kernel = if bf16 {
                        "linear_invariant_bf16"
                    } else {
                        "linear_invariant_f32"
                    };
                    file.launch(
                        kernel,
                        dims(n.div_ceil(32) as u32, m.div_ceil(8) as u32),
                        dims(256, 1),
                        &[
                            Arg::Buf(out),
                            Arg::Buf(xb),
                            Arg::Buf(wb),
                            Arg::I64(m as i64),
                            Arg::I64(k as i64),
                            Arg::I64(n as i64),
                            Arg::I32(out_in),
                            Arg::I64(block as i64),
                            Arg::I32(mode),
                            Arg::F32(bound),
                        ],
                        &mut bufs,
                    )
                    .unwrap();
                    let got = bufs.read_f32(out);
                    let what = format!(
                        "[{m}, {k}] x {n} block {block} bf16 {bf16} out_in {out_in} mode {mode}"
                    );
                    let first = (0..want.len()).find(|&i| got[i].to_bits() != want[i].to_bits());
                    assert!(first.is_none(), "{what}: first difference at {first:?}");
                    if mode == 2 {
                        let decoded = bufs.f32(&vec![0.0; m * n]);
                        file.launch(
                            "decode_limbs",
                            dims(1, 1),
                            dims(256, 1),
                            &[Arg::Buf(decoded), Arg::Buf(out), Arg::I64((m * n) as i64)],
                            &mut bufs,
                        )
                        .unwrap();
                        let host: Vec<f32> = got
                            .chunks(3)
                            .map(|l| decode_limbs([l[0], l[1], l[2]]))
                            .collect();
                        let exact = invariant_reference(&x, &at, (m, k, n), block, 1, bound);
                        assert_eq!(host, exact, "{what}: limbs decoded on the host");
                        assert_eq!(bufs.read_f32(decoded), exact, "{what}: decode_limbs");
                    }
                }
            }
        }
    }
    // A block sum past the bound: NaN, in either exact mode.
    let mut bufs = Buffers::default();
    let out = bufs.f32(&[0.0; 3]);
    let (xb, wb) = (bufs.f32(&[1000.0]), bufs.f32(&[1000.0]));
    for mode in [1, 2] {
        file.launch(
            "linear_invariant_f32",
            dims(1, 1),
            dims(256, 1),
            &[
                Arg::Buf(out),
                Arg::Buf(xb),
                Arg::Buf(wb),
                Arg::I64(1),
                Arg::I64(1),
                Arg::I64(1),
                Arg::I32(1),
                Arg::I64(1),
                Arg::I32(mode),
                Arg::F32(1e5),
            ],
            &mut bufs,
        )
        .unwrap();
        assert!(
            bufs.read_f32(out)[0].is_nan(),
            "mode {mode}: {:?}",
            bufs.read_f32(out)
        );
    }
}
