//! Pinning compute threads to cores: rank `r`'s member `m` of `t` per rank runs on allowed
//! core `(r·t + m) mod cores`, so ranks and their helpers neither share a core while others
//! idle nor migrate between steps. Best effort: where the OS refuses, threads float.

/// The cores this process may run on, in order.
pub fn allowed_cores() -> Vec<usize> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: cpu_set_t is plain data; sched_getaffinity writes at most its size.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0 {
                let cores: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
                    .filter(|&c| libc::CPU_ISSET(c, &set))
                    .collect();
                if !cores.is_empty() {
                    return cores;
                }
            }
        }
    }
    (0..std::thread::available_parallelism().map_or(1, |n| n.get())).collect()
}

/// Pins the calling thread to `core`; false where the OS does not allow it.
pub fn pin_current_thread(core: usize) -> bool {
    #[cfg(target_os = "linux")]
    {
        if core >= libc::CPU_SETSIZE as usize {
            return false;
        }
        // SAFETY: as above; the set names one core and pid 0 is the calling thread.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(core, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = core;
        false
    }
}

/// The core of global compute thread `index` (rank · threads per rank + member).
pub fn core_for(index: usize, cores: &[usize]) -> Option<usize> {
    (!cores.is_empty()).then(|| cores[index % cores.len()])
}

/// Where rank `rank`'s `threads` compute threads go: member `m` on the core of global
/// thread `rank · threads + m`.
pub fn placement(rank: usize, threads: usize) -> Vec<Option<usize>> {
    let cores = allowed_cores();
    (0..threads)
        .map(|m| core_for(rank * threads + m, &cores))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_are_spread_round_robin_over_the_allowed_cores() {
        let cores = [2, 5];
        let got: Vec<_> = (0..5).map(|i| core_for(i, &cores).unwrap()).collect();
        assert_eq!(got, vec![2, 5, 2, 5, 2]);
        assert_eq!(core_for(3, &[]), None);
    }

    #[test]
    fn a_thread_can_be_pinned_to_an_allowed_core_and_reads_it_back() {
        let cores = allowed_cores();
        assert!(!cores.is_empty());
        let last = *cores.last().unwrap();
        std::thread::spawn(move || {
            if pin_current_thread(last) {
                assert_eq!(allowed_cores(), vec![last]);
            }
        })
        .join()
        .unwrap();
    }
}
