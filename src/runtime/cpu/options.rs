//! The CPU backend's own run settings (`--isa`, `--threads-per-rank`, `--pin`) and the one
//! rule for how many compute threads a rank gets.

use super::isa::Isa;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CpuOptions {
    /// The linear kernels' variant (`--isa`); `None`: the best this host runs.
    pub isa: Option<Isa>,
    /// Compute threads per rank; 0: this host's cores shared out over its ranks.
    pub threads_per_rank: usize,
    /// Pin every rank's compute threads to cores, round robin (`affinity.rs`; `--pin`).
    /// Off by default: on this project's 2-vCPU machine it measured no gain beyond noise.
    pub pin_threads: bool,
}

impl CpuOptions {
    /// Compute threads for each of `ranks_on_host` ranks that share this host's cores: as
    /// asked, or the cores shared out (at least one each).
    pub fn threads_per_rank(&self, ranks_on_host: usize) -> usize {
        if self.threads_per_rank > 0 {
            return self.threads_per_rank;
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        threads_for(cores, ranks_on_host)
    }
}

/// `cores` shared out over `ranks` (at least one thread each).
fn threads_for(cores: usize, ranks: usize) -> usize {
    (cores / ranks.max(1)).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cores_are_shared_out_and_an_explicit_count_wins() {
        assert_eq!(threads_for(16, 4), 4);
        assert_eq!(threads_for(16, 3), 5);
        assert_eq!(threads_for(2, 8), 1);
        assert_eq!(threads_for(8, 0), 8);
        let asked = CpuOptions {
            threads_per_rank: 3,
            ..Default::default()
        };
        assert_eq!(asked.threads_per_rank(64), 3);
        assert!(CpuOptions::default().threads_per_rank(1) >= 1);
    }
}
