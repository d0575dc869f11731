//! Resident memory of this process, for load benchmarks and reports: what the kernel says
//! in `/proc/self/status` (Linux only; elsewhere nothing).
//!
//! Resident counts every page mapped in (the checkpoint is read into memory tpc owns, a batch
//! of rows at a time, not mapped).

/// Peak resident set size of this process so far (`VmHWM`), `None` where unavailable.
pub fn peak_resident_bytes() -> Option<u64> {
    status_field("VmHWM:")
}

/// Current resident set size (`VmRSS`), `None` where unavailable.
pub fn resident_bytes() -> Option<u64> {
    status_field("VmRSS:")
}

/// Memory the kernel says can be given to a new allocation without swapping
/// (`MemAvailable` in `/proc/meminfo`), `None` where unavailable.
pub fn available_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_kib(&text, "MemAvailable:")
}

/// The least memory a run of `plan` allocates in this process: every rank's weights (2 bytes
/// an element in bf16, else 4; the checkpoint is read a few MiB at a time) and the KV caches for
/// `tokens` positions over all sequences (f32). Saturates instead of wrapping.
pub fn least_run_bytes(plan: &crate::plan::Plan, bf16: bool, tokens: u64) -> (u64, u64) {
    use crate::ir::saturating::sum;
    let per_element = if bf16 { 2 } else { 4 };
    let weights = sum(plan.ranks.iter().flat_map(|r| {
        r.weights
            .iter()
            .map(|w| w.local_elements().saturating_mul(per_element))
    }));
    let summary = crate::plan::report::summarize(plan);
    let kv_per_token = sum(summary
        .kv_cache_bytes_per_token_per_rank
        .iter()
        .map(|&b| b.saturating_mul(4) / plan.dtype.size_bytes().max(1)));
    (weights, kv_per_token.saturating_mul(tokens))
}

/// Refuses a run that cannot fit in the memory this host has available, before anything is
/// allocated (an allocation that fails later aborts the process).
pub fn check_fits(
    plan: &crate::plan::Plan,
    bf16: bool,
    tokens: u64,
) -> Result<(), crate::runtime::error::RunError> {
    check_fits_copies(plan, bf16, tokens, 1, false)
}

/// Bytes of the weights of `plan`'s ranks that are stacks of experts (`plan::experts`).
pub fn expert_bytes(plan: &crate::plan::Plan, bf16: bool) -> u64 {
    let per_element = if bf16 { 2 } else { 4 };
    crate::ir::saturating::sum(plan.ranks.iter().flat_map(|r| {
        r.weights
            .iter()
            .filter(|w| crate::plan::experts::is_stacked(&w.tensor))
            .map(|w| w.local_elements().saturating_mul(per_element))
    }))
}

/// Bytes of `copies` copies of `plan`'s weights (data-parallel replicas; one copy of the
/// experts between them with `experts_shared`, `--ep`).
pub fn copies_weight_bytes(
    plan: &crate::plan::Plan,
    bf16: bool,
    copies: u64,
    experts_shared: bool,
) -> u64 {
    let weights = least_run_bytes(plan, bf16, 0).0;
    copies_of(plan, bf16, weights, copies, experts_shared)
}

/// `copies` copies of `weights` bytes of `plan`'s weights, with one copy of the experts
/// between them where `experts_shared`.
fn copies_of(
    plan: &crate::plan::Plan,
    bf16: bool,
    weights: u64,
    copies: u64,
    experts_shared: bool,
) -> u64 {
    let experts = if experts_shared {
        expert_bytes(plan, bf16)
    } else {
        0
    };
    (weights - experts.min(weights))
        .saturating_mul(copies.max(1))
        .saturating_add(experts)
}

/// [`check_fits`] for `copies` copies of the weights (data-parallel replicas) whose KV
/// caches hold `tokens` in all; with `experts_shared` (`--ep`) the replicas hold one copy of
/// the experts between them.
pub fn check_fits_copies(
    plan: &crate::plan::Plan,
    bf16: bool,
    tokens: u64,
    copies: u64,
    experts_shared: bool,
) -> Result<(), crate::runtime::error::RunError> {
    let Some(available) = available_bytes() else {
        return Ok(());
    };
    let (weights, kv) = least_run_bytes(plan, bf16, tokens);
    let weights = copies_of(plan, bf16, weights, copies, experts_shared);
    let needed = weights.saturating_add(kv);
    if needed > available {
        return Err(crate::runtime::error::RunError::OutOfMemory {
            needed,
            weights,
            kv,
            available,
        });
    }
    Ok(())
}

fn status_field(key: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    parse_kib(&text, key)
}

/// `key   1234 kB` → bytes.
fn parse_kib(status: &str, key: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with(key))?;
    let mut words = line[key.len()..].split_whitespace();
    let value: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => value.checked_mul(1024),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_kernel_format() {
        let s = "Name:\ttpc\nVmHWM:\t  123456 kB\nVmRSS:\t    2048 kB\n";
        assert_eq!(parse_kib(s, "VmHWM:"), Some(123456 * 1024));
        assert_eq!(parse_kib(s, "VmRSS:"), Some(2048 * 1024));
        assert_eq!(
            parse_kib("MemTotal: 10 kB\nMemAvailable:   7 kB\n", "MemAvailable:"),
            Some(7 * 1024)
        );
        assert_eq!(parse_kib(s, "VmSwap:"), None);
        assert_eq!(parse_kib("VmRSS: 12 pages\n", "VmRSS:"), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn touching_memory_raises_resident_and_peak() {
        let mut v = vec![0u8; 64 << 20];
        // Write every page so that it is really resident.
        for b in v.iter_mut().step_by(4096) {
            *b = 1;
        }
        let during = resident_bytes().expect("VmRSS on Linux");
        let peak = peak_resident_bytes().expect("VmHWM on Linux");
        assert!(std::hint::black_box(&v)
            .iter()
            .step_by(4096)
            .all(|&b| b == 1));
        // Other tests in this process allocate and free concurrently: only bounds that hold
        // whatever they do.
        assert!(during >= 64 << 20, "{during}");
        assert!(peak >= during);
    }
}
