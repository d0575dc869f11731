//! The all-reduce of ranks that share one GPU, as one kernel per rank (the one-shot idea of
//! vLLM's custom all-reduce, without the peer-to-peer mapping: here the buffers are already
//! in one device's memory). NCCL refuses two ranks on one device; this is how multi-rank
//! plans run on a one-GPU machine.
//!
//! A call, on every rank of the group:
//! 1. record `ready[r]` on the rank's stream (its partial sum is then written) and publish
//!    the buffer's address; host barrier;
//! 2. make the stream wait for every `ready[j]`, launch `sum_ranks` reading every rank's
//!    buffer into a scratch buffer of its own, record `done[r]`; host barrier;
//! 3. make the stream wait for every `done[j]` (nobody reads the buffers any more), copy
//!    the sum into the rank's buffer.
//!
//! The events are reused call after call: rank j records `ready[j]` again only after the
//! second barrier of the previous call, by which time every rank has issued its wait on it
//! (a wait binds to the record made before it), and likewise for `done`.

use super::act::CudaAct;
use super::device::{grid_for, GpuRank};
use super::error::device_failure;
use crate::runtime::backend::Activation;
use crate::runtime::collectives::CollectiveError;
use cudarc::driver::{CudaEvent, DevicePtr, PushKernelArg};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// The most ranks one kernel sums (its pointer arguments).
pub const MAX_RANKS: usize = 8;

/// What the ranks of one group share: each rank's events (made by the rank on its first
/// call, on its own thread) and its buffer's address and length for the current call.
pub struct OneShotGroup {
    events: Vec<OnceLock<RankEvents>>,
    addresses: Vec<AtomicU64>,
    lengths: Vec<AtomicU64>,
}

struct RankEvents {
    ready: CudaEvent,
    done: CudaEvent,
}

impl OneShotGroup {
    /// A group of `ranks` ranks (2 to [`MAX_RANKS`]).
    pub fn new(ranks: usize) -> Option<Arc<OneShotGroup>> {
        (2..=MAX_RANKS).contains(&ranks).then(|| {
            Arc::new(OneShotGroup {
                events: (0..ranks).map(|_| OnceLock::new()).collect(),
                addresses: (0..ranks).map(|_| AtomicU64::new(0)).collect(),
                lengths: (0..ranks).map(|_| AtomicU64::new(0)).collect(),
            })
        })
    }

    pub fn ranks(&self) -> usize {
        self.addresses.len()
    }

    fn events(&self, rank: usize) -> Result<&RankEvents, CollectiveError> {
        self.events[rank]
            .get()
            .ok_or_else(|| CollectiveError::Device {
                during: "one-shot all-reduce on one GPU",
                problem: format!("rank {rank} has no events after the barrier (a bug in tpc)"),
            })
    }
}

/// Rank `rank`'s part of one all-reduce of `buf` over the group; `barrier` is the group's
/// host barrier.
pub fn all_reduce(
    group: &OneShotGroup,
    gpu: &GpuRank,
    rank: usize,
    buf: &mut CudaAct,
    barrier: &mut dyn FnMut() -> Result<(), CollectiveError>,
) -> Result<(), CollectiveError> {
    const DURING: &str = "one-shot all-reduce on one GPU";
    let n = buf.elements();
    let stream = gpu.stream.clone();
    if group.events[rank].get().is_none() {
        let event = || {
            gpu.ctx
                .new_event(None)
                .map_err(|e| device_failure(DURING, e))
        };
        let made = RankEvents {
            ready: event()?,
            done: event()?,
        };
        let _ = group.events[rank].set(made);
    }
    group
        .events(rank)?
        .ready
        .record(&stream)
        .map_err(|e| device_failure(DURING, e))?;
    {
        let (address, _guard) = buf.data().device_ptr(&stream);
        group.addresses[rank].store(address, Ordering::Release);
    }
    group.lengths[rank].store(n as u64, Ordering::Release);
    barrier()?;
    // Every rank sees the same lengths, so every rank refuses a mismatch alike.
    let lengths: Vec<u64> = group
        .lengths
        .iter()
        .map(|l| l.load(Ordering::Acquire))
        .collect();
    if lengths.iter().any(|&l| l != n as u64) {
        return Err(CollectiveError::Buffers {
            during: DURING,
            dtype: "f32".into(),
            got: n,
            expected: lengths[0] as usize,
        });
    }
    for r in 0..group.ranks() {
        stream
            .wait(&group.events(r)?.ready)
            .map_err(|e| device_failure(DURING, e))?;
    }
    // SAFETY: device memory, written whole by sum_ranks before the copy back reads it.
    let mut sum =
        unsafe { stream.alloc::<f32>(n.max(1)) }.map_err(|e| device_failure(DURING, e))?;
    let mut pointers = [0u64; MAX_RANKS];
    for (p, a) in pointers.iter_mut().zip(&group.addresses) {
        *p = a.load(Ordering::Acquire);
    }
    let ranks = group.ranks() as i32;
    let n64 = n as i64;
    let f = gpu
        .kernel("sum_ranks")
        .map_err(|e| device_failure(DURING, e))?;
    let mut launch = stream.launch_builder(f);
    launch.arg(&mut sum);
    for p in &pointers {
        launch.arg(p);
    }
    launch.arg(&ranks).arg(&n64);
    // SAFETY: sum_ranks(float*, 8 × const float*, int, long long): the pointers are the
    // group's buffers of `n` floats each (every rank reduces buffers of one shape, as every
    // collective requires), written before the `ready` events this stream waits on; unused
    // pointers are null and not read (r < ranks).
    unsafe { launch.launch(grid_for(n)) }.map_err(|e| device_failure(DURING, e))?;
    group
        .events(rank)?
        .done
        .record(&stream)
        .map_err(|e| device_failure(DURING, e))?;
    barrier()?;
    for r in 0..group.ranks() {
        stream
            .wait(&group.events(r)?.done)
            .map_err(|e| device_failure(DURING, e))?;
    }
    if n > 0 {
        stream
            .memcpy_dtod(&sum.slice(..n), &mut buf.data_mut().slice_mut(..n))
            .map_err(|e| device_failure(DURING, e))?;
    }
    Ok(())
}
