//! Resident memory of this process, for load benchmarks and reports: what the kernel says
//! in `/proc/self/status` (Linux only; elsewhere nothing).
//!
//! Resident counts every page mapped in: heap, and also the pages of a memory-mapped
//! checkpoint that have been read and not yet released.

/// Peak resident set size of this process so far (`VmHWM`), `None` where unavailable.
pub fn peak_resident_bytes() -> Option<u64> {
    status_field("VmHWM:")
}

/// Current resident set size (`VmRSS`), `None` where unavailable.
pub fn resident_bytes() -> Option<u64> {
    status_field("VmRSS:")
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
