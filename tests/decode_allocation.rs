//! The decode loop plans its memory once: after a warm-up step, decoding a token asks the
//! allocator for no activation-sized buffer (all come from the rank's pool, the KV cache
//! was reserved up front). Counted with a global allocator that tallies large requests.

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use tpc::frontend::load::load_model;
use tpc::pipeline::compile;
use tpc::runtime::comm::local_group;
use tpc::runtime::cpu::CpuBackend;
use tpc::runtime::executor::RankExecutor;
use tpc::runtime::random::RandomWeights;

/// Requests at least this large are counted: the smallest activation of the model below
/// (one row of 256 features) is 1 KiB.
const LARGE: usize = 1024;

struct Counting;
static LARGE_ALLOCS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() >= LARGE {
            LARGE_ALLOCS.fetch_add(1, SeqCst);
        }
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size >= LARGE {
            LARGE_ALLOCS.fetch_add(1, SeqCst);
        }
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn decoding_a_token_allocates_no_activation_memory() {
    let dir = std::env::temp_dir().join(format!("tpc-alloc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("m.ron");
    // Wide enough that every activation row is ≥ 1 KiB; GQA and two layers.
    std::fs::write(
        &model,
        std::fs::read_to_string("models/tiny-llama.ron")
            .unwrap()
            .replace("hidden_size: 64", "hidden_size: 256")
            .replace("intermediate_size: 128", "intermediate_size: 512")
            .replace("vocab_size: 250", "vocab_size: 1000"),
    )
    .unwrap();
    let def = load_model(Path::new(&model)).unwrap();
    let plan = compile(&def, 1).unwrap().plan;
    let weights = RandomWeights::new(&plan, 7);
    for threads in [1, 2] {
        let backend = CpuBackend::new(threads);
        let comm = local_group(1).pop().unwrap();
        let mut exec =
            RankExecutor::new(&plan.ranks[0], plan.numerics, &weights, backend, comm).unwrap();
        exec.reserve_positions(64);
        let prompt: Vec<i64> = (0..9).map(|i| i * 37 % 1000).collect();
        let mut logits = exec.forward_rows(&prompt, true).unwrap();
        let mut next = 5;
        // Warm-up: the first decode step fills the pool with one-row buffers.
        for step in 0..12 {
            if step == 2 {
                LARGE_ALLOCS.store(0, SeqCst);
            }
            logits.release();
            logits = exec.forward_rows(&[next], true).unwrap();
            next = (next * 31 + 7) % 1000;
        }
        let n = LARGE_ALLOCS.load(SeqCst);
        assert_eq!(
            n, 0,
            "threads={threads}: {n} allocations of ≥ {LARGE} B in 10 decode steps"
        );
        assert_eq!(logits.shape, vec![1, 1000]);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
