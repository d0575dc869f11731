//! Hardware profiles: what a machine can do, as the cost model needs it — compute peak per
//! dtype, memory bandwidth and capacity per device, and an α-β pair (latency, bandwidth) per
//! collective algorithm over the link that joins the ranks. Shipped as RON in `models/hw/`,
//! each with the sources of its figures.

use crate::error::{Result, TpcError};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// One machine (or group of machines) that a plan's ranks run on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HwProfile {
    pub name: String,
    /// Where each figure comes from (datasheets, published benchmark results).
    #[serde(default)]
    pub sources: Vec<String>,
    /// Devices available in all.
    pub devices: u64,
    /// Memory of one device, bytes.
    pub memory_bytes: f64,
    /// Dense peak of one device, FLOP/s, for bf16/f16 and for f32 operands.
    pub peak_flops_bf16: f64,
    pub peak_flops_f32: f64,
    /// Memory bandwidth of one device, bytes/s.
    pub memory_bandwidth: f64,
    /// Fractions of the peaks a well-tuned kernel reaches (GEMM and streaming reads).
    pub compute_efficiency: f64,
    pub memory_efficiency: f64,
    /// Collective costs among the ranks of one tensor-parallel group.
    pub link: LinkCosts,
}

/// α (seconds per call) and β (bytes/s each rank moves) per collective algorithm.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LinkCosts {
    pub ring: AlphaBeta,
    pub one_shot: AlphaBeta,
    pub two_shot: AlphaBeta,
    pub send_recv: AlphaBeta,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AlphaBeta {
    /// Latency of one call, seconds.
    pub alpha_s: f64,
    /// Bytes per second one rank sends.
    pub beta_bytes_per_s: f64,
}

impl HwProfile {
    /// Reads and checks a profile file.
    pub fn load(path: &Path) -> Result<HwProfile> {
        let text = crate::fsio::read_text(path)?;
        let profile: HwProfile = crate::frontend::load::parse_ron(path, &text)?;
        profile.check().map_err(|message| TpcError::HwProfile {
            path: path.to_path_buf(),
            message,
        })?;
        Ok(profile)
    }

    /// Every figure finite and positive, efficiencies in (0, 1].
    pub fn check(&self) -> std::result::Result<(), String> {
        let l = &self.link;
        let positive = [
            ("memory_bytes", self.memory_bytes),
            ("peak_flops_bf16", self.peak_flops_bf16),
            ("peak_flops_f32", self.peak_flops_f32),
            ("memory_bandwidth", self.memory_bandwidth),
            ("ring.beta_bytes_per_s", l.ring.beta_bytes_per_s),
            ("one_shot.beta_bytes_per_s", l.one_shot.beta_bytes_per_s),
            ("two_shot.beta_bytes_per_s", l.two_shot.beta_bytes_per_s),
            ("send_recv.beta_bytes_per_s", l.send_recv.beta_bytes_per_s),
        ];
        for (what, v) in positive {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("{what} is {v}; it must be a finite number above 0"));
            }
        }
        for (what, v) in [
            ("ring.alpha_s", l.ring.alpha_s),
            ("one_shot.alpha_s", l.one_shot.alpha_s),
            ("two_shot.alpha_s", l.two_shot.alpha_s),
            ("send_recv.alpha_s", l.send_recv.alpha_s),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!(
                    "{what} is {v}; it must be a finite number, 0 or more"
                ));
            }
        }
        for (what, v) in [
            ("compute_efficiency", self.compute_efficiency),
            ("memory_efficiency", self.memory_efficiency),
        ] {
            if !(v > 0.0 && v <= 1.0) {
                return Err(format!("{what} is {v}; it must be in (0, 1]"));
            }
        }
        if self.devices == 0 || self.devices > 1 << 20 {
            return Err(format!(
                "devices is {}; it must be in 1..=2^20",
                self.devices
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_profiles_load() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/models/hw");
        let mut n = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let p = HwProfile::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert!(
                !p.sources.is_empty(),
                "{}: cite the figures",
                path.display()
            );
            n += 1;
        }
        assert!(n >= 3);
    }
}
