//! Hardware profiles: what a machine can do, as the cost model needs it — compute peak per
//! dtype, memory bandwidth and capacity per device, and an α-β pair (latency, bandwidth) per
//! collective algorithm over the link that joins the ranks. Shipped as RON in `models/hw/`,
//! each with the sources of its figures.

use super::rank_speed::RankSpeed;
use crate::error::{Result, TpcError};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// How the first source line of a `tpc calibrate --quick` profile begins.
pub const QUICK_SOURCE: &str = "tpc calibrate --quick";

/// One machine (or group of machines) that a plan's ranks run on.
// A misspelled optional field would otherwise be dropped silently and its default priced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
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
    /// Fixed cost of each compute op a rank runs (dispatch to its threads and the join),
    /// seconds; 0 for profiles of large devices, measured by `tpc calibrate` on a CPU host.
    #[serde(default)]
    pub op_overhead_s: f64,
    /// FLOP/s the attention kernel reaches (4 per head and dim per query-key pair), when it
    /// runs apart from the GEMMs and slower (a CPU host); `None`: at the GEMM peak.
    #[serde(default)]
    pub attention_flops: Option<f64>,
    /// The attention kernel's FLOP/s by head size, (head_dim, FLOP/s), where it depends on
    /// it (a CPU kernel's slow path for small heads); an attention op is priced at the
    /// entry of the nearest head size, else at `attention_flops`. Empty unless measured.
    #[serde(default)]
    pub attention_flops_by_head_dim: Vec<(u64, f64)>,
    /// Set when the "devices" are ranks sharing one CPU host (`tpc run` threads): its cores
    /// are shared out over the ranks and its memory bandwidth is shared by all of them.
    /// The peaks and the bandwidth above are then the whole host's.
    #[serde(default)]
    pub shared: Option<SharedHost>,
    /// Set by `tpc calibrate --quick`: figures from a second's measurement of small
    /// products, for trying the commands; what is priced with them is a rough estimate.
    /// Absent (false) in other profiles and in files written before the field.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub rough: bool,
    /// Unequal devices: the speed of the device each rank of a group runs on, in rank
    /// order, relative to the figures above (1.0: as fast; 0.5: each op takes twice as
    /// long), one number or compute and memory apart (`(compute: 0.15, memory: 0.2)`).
    /// Empty: every device alike. `simulate` paces each step by the slowest rank and
    /// `simulate --search` proposes `--tp-shares` from these.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rank_speeds: Vec<RankSpeed>,
}

/// One host whose cores and memory bandwidth the ranks of a group share.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SharedHost {
    /// Cores (hardware threads the runtime counts) the peaks above were measured with.
    pub cores: u64,
    /// The per-op cost when a rank has one thread (tp ≥ cores): no team to wake and wait
    /// for, so less than `op_overhead_s`, which was measured with every core in one team.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub op_overhead_one_thread_s: Option<f64>,
    /// GEMM FLOP/s (bf16, f32 weights) of a one-thread rank while every core runs one
    /// (the pass split over `cores` ranks at once): what a rank of tp ≥ cores gets, measured
    /// rather than taken as 1/cores of the whole host's rate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub one_thread_flops_bf16: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub one_thread_flops_f32: Option<f64>,
}

impl SharedHost {
    /// A host of `cores` cores with nothing measured for one-thread ranks.
    pub fn new(cores: u64) -> SharedHost {
        SharedHost {
            cores,
            op_overhead_one_thread_s: None,
            one_thread_flops_bf16: None,
            one_thread_flops_f32: None,
        }
    }

    /// The per-op cost of one of `tp` ranks: the one-thread figure when the rank gets one
    /// thread of several cores and the profile has it, else `all_cores` (the profile's).
    pub fn op_overhead_s(&self, tp: u64, all_cores: f64) -> f64 {
        match self.op_overhead_one_thread_s {
            Some(one) if self.one_thread_ranks(tp) => one,
            _ => all_cores,
        }
    }

    /// True when each of `tp` ranks gets one thread of a host with several cores.
    fn one_thread_ranks(&self, tp: u64) -> bool {
        self.cores > 1 && self.cores / tp.max(1) <= 1
    }

    /// Compute one of `tp` ranks gets from a host whose whole rate is `host_flops`: the
    /// measured one-thread rate when ranks have one thread each (a fraction of it when
    /// ranks outnumber cores and take turns), else [`SharedHost::compute_share`].
    pub fn rank_flops(&self, tp: u64, host_flops: f64, f32_operands: bool) -> f64 {
        let one = if f32_operands {
            self.one_thread_flops_f32
        } else {
            self.one_thread_flops_bf16
        };
        match one {
            Some(one) if self.one_thread_ranks(tp) => {
                one * (self.cores as f64 / tp.max(1) as f64).min(1.0)
            }
            _ => host_flops * self.compute_share(tp),
        }
    }

    /// The part of the host's compute one of `tp` ranks gets: the runtime gives each rank
    /// max(1, cores / tp) threads (whole cores), and when there are more ranks than cores
    /// they take turns, so a rank never gets more than cores / tp.
    pub fn compute_share(&self, tp: u64) -> f64 {
        let (cores, tp) = (self.cores.max(1) as f64, tp.max(1) as f64);
        let threads = (cores / tp).floor().max(1.0);
        threads.min(cores / tp) / cores
    }

    /// The part of the host's memory bandwidth one of `tp` ranks gets: all ranks stream
    /// their weights at once, so each gets 1 / tp.
    pub fn bandwidth_share(&self, tp: u64) -> f64 {
        1.0 / tp.max(1) as f64
    }
}

/// α (seconds per call) and β (bytes/s each rank moves) per collective algorithm.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkCosts {
    pub ring: AlphaBeta,
    pub one_shot: AlphaBeta,
    pub two_shot: AlphaBeta,
    pub send_recv: AlphaBeta,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
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
        HwProfile::parse(path, &text)
    }

    /// Parses and checks a profile's text; `path` names it in errors.
    pub fn parse(path: &Path, text: &str) -> Result<HwProfile> {
        let profile: HwProfile = crate::frontend::load::parse_ron(path, text)?;
        profile.check().map_err(|message| TpcError::HwProfile {
            path: path.to_path_buf(),
            message,
        })?;
        Ok(profile)
    }

    /// True for a rough profile: marked [`HwProfile::rough`], or written by `tpc calibrate
    /// --quick` before that field existed (its first source line says so).
    pub fn is_rough(&self) -> bool {
        self.rough
            || self
                .sources
                .first()
                .is_some_and(|s| s.starts_with(QUICK_SOURCE))
    }

    /// The profile as RON, in the form [`HwProfile::load`] reads.
    pub fn to_ron(&self) -> Result<String> {
        let cfg = ron::ser::PrettyConfig::new().depth_limit(4);
        crate::frontend::load::ron_options()
            .to_string_pretty(self, cfg)
            .map_err(|e| TpcError::Serialize(e.to_string()))
    }

    /// Checks the profile and writes it atomically (RON).
    pub fn save(&self, path: &Path) -> Result<()> {
        self.check().map_err(|message| TpcError::HwProfile {
            path: path.to_path_buf(),
            message,
        })?;
        crate::fsio::write_text(path, &format!("{}\n", self.to_ron()?))
    }

    /// The attention kernel's FLOP/s (the whole host's) for heads of `head_dim`: the
    /// measured entry nearest to it (by ratio), else `attention_flops`, else `None`.
    pub fn attention_rate(&self, head_dim: u64) -> Option<f64> {
        let d = head_dim.max(1) as f64;
        self.attention_flops_by_head_dim
            .iter()
            .min_by(|a, b| {
                let r = |x: u64| (x.max(1) as f64 / d).ln().abs();
                r(a.0).total_cmp(&r(b.0))
            })
            .map(|e| e.1)
            .or(self.attention_flops)
    }

    /// Compute (FLOP/s, for bf16/f16 or f32 operands) and memory bandwidth (bytes/s) one of
    /// `tp` ranks gets, efficiencies applied: a whole device each, or its share of a shared
    /// host.
    pub fn per_rank(&self, tp: u64, f32_operands: bool) -> (f64, f64) {
        let peak = if f32_operands {
            self.peak_flops_f32
        } else {
            self.peak_flops_bf16
        } * self.compute_efficiency;
        let bandwidth = self.memory_bandwidth * self.memory_efficiency;
        match &self.shared {
            None => (peak, bandwidth),
            Some(h) => (
                h.rank_flops(tp, peak, f32_operands),
                bandwidth * h.bandwidth_share(tp),
            ),
        }
    }

    /// Every figure a normal, finite number within [`BOUNDS`]: a zero, subnormal or huge
    /// rate would price a phase at `inf` seconds (or 0 tokens/s), which no machine does.
    pub fn check(&self) -> std::result::Result<(), String> {
        let l = &self.link;
        let shared = self.shared.unwrap_or(SharedHost::new(1));
        let mut figures = vec![
            ("memory_bytes", self.memory_bytes, MEMORY_BYTES),
            ("peak_flops_bf16", self.peak_flops_bf16, FLOPS),
            ("peak_flops_f32", self.peak_flops_f32, FLOPS),
            ("memory_bandwidth", self.memory_bandwidth, BYTES_PER_S),
            ("compute_efficiency", self.compute_efficiency, EFFICIENCY),
            ("memory_efficiency", self.memory_efficiency, EFFICIENCY),
            ("op_overhead_s", self.op_overhead_s, OP_OVERHEAD_S),
        ];
        for (alpha, beta, ab) in [
            ("ring.alpha_s", "ring.beta_bytes_per_s", l.ring),
            ("one_shot.alpha_s", "one_shot.beta_bytes_per_s", l.one_shot),
            ("two_shot.alpha_s", "two_shot.beta_bytes_per_s", l.two_shot),
            (
                "send_recv.alpha_s",
                "send_recv.beta_bytes_per_s",
                l.send_recv,
            ),
        ] {
            figures.push((alpha, ab.alpha_s, LATENCY_S));
            figures.push((beta, ab.beta_bytes_per_s, BYTES_PER_S));
        }
        let optional = [
            ("attention_flops", self.attention_flops, FLOPS),
            (
                "shared.op_overhead_one_thread_s",
                shared.op_overhead_one_thread_s,
                OP_OVERHEAD_S,
            ),
            (
                "shared.one_thread_flops_bf16",
                shared.one_thread_flops_bf16,
                FLOPS,
            ),
            (
                "shared.one_thread_flops_f32",
                shared.one_thread_flops_f32,
                FLOPS,
            ),
        ];
        figures.extend(
            optional
                .into_iter()
                .filter_map(|(name, v, b)| v.map(|v| (name, v, b))),
        );
        for &(d, a) in &self.attention_flops_by_head_dim {
            if d == 0 || d > MAX_HEAD_DIM {
                return Err(format!(
                    "attention_flops_by_head_dim has head size {d}; head sizes must be in \
                     1..={MAX_HEAD_DIM}"
                ));
            }
            figures.push(("attention_flops_by_head_dim", a, FLOPS));
        }
        for (name, v, bound) in figures {
            bound.check(name, v)?;
        }
        if self.rank_speeds.len() > crate::ir::shares::MAX_SHARED_RANKS {
            return Err(format!(
                "rank_speeds lists {} ranks; it may list at most {}",
                self.rank_speeds.len(),
                crate::ir::shares::MAX_SHARED_RANKS
            ));
        }
        if let Some(v) = self.rank_speeds.iter().find_map(|s| s.out_of_range()) {
            return Err(format!(
                "rank_speeds holds {}; each speed must be a number from 0.001 to 1000 (1.0: as fast as the profile's device)",
                readable(v)
            ));
        }
        if shared.cores == 0 || shared.cores > MAX_DEVICES {
            return Err(format!(
                "shared.cores is {}; it must be in 1..=2^20",
                shared.cores
            ));
        }
        if self.devices == 0 || self.devices > MAX_DEVICES {
            return Err(format!(
                "devices is {}; it must be in 1..=2^20",
                self.devices
            ));
        }
        Ok(())
    }
}

/// Devices (and shared-host cores) a profile may have.
pub const MAX_DEVICES: u64 = 1 << 20;

/// The largest head size `attention_flops_by_head_dim` may list (a model's hidden size
/// limit).
const MAX_HEAD_DIM: u64 = 1 << 24;

/// The range a profile figure must lie in, and what it is measured in.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bound {
    pub min: f64,
    pub max: f64,
    /// Whether exactly 0 is allowed below `min` (a latency the model may leave out).
    pub zero: bool,
    pub unit: &'static str,
}

/// The plausibility bounds of the figures, per device (or per host when shared). Wide
/// enough for any machine from a small CPU to a future accelerator, narrow enough that
/// every estimate stays a finite, positive number of seconds:
/// - FLOP/s (peaks, attention rates): 1e6 (a megaflop) to 1e18 (an exaflop per device);
/// - bytes/s (memory bandwidth, link β): 1e6 (a megabyte per second) to 1e15 (a petabyte);
/// - memory: 1e6 bytes to 1e15 bytes (a petabyte per device);
/// - efficiencies: 0.001 to 1;
/// - latencies (link α): 0, or 1e-12 s (a picosecond) to 1 s;
/// - per-op overheads: 0, or 1e-12 s to 0.1 s.
pub const FLOPS: Bound = Bound {
    min: 1e6,
    max: 1e18,
    zero: false,
    unit: "FLOP/s",
};
pub const BYTES_PER_S: Bound = Bound {
    min: 1e6,
    max: 1e15,
    zero: false,
    unit: "bytes/s",
};
pub const MEMORY_BYTES: Bound = Bound {
    min: 1e6,
    max: 1e15,
    zero: false,
    unit: "bytes",
};
pub const EFFICIENCY: Bound = Bound {
    min: 1e-3,
    max: 1.0,
    zero: false,
    unit: "(a fraction of the peak)",
};
pub const LATENCY_S: Bound = Bound {
    min: 1e-12,
    max: 1.0,
    zero: true,
    unit: "seconds",
};
pub const OP_OVERHEAD_S: Bound = Bound {
    min: 1e-12,
    max: 0.1,
    zero: true,
    unit: "seconds",
};

impl Bound {
    /// `v` in range (NaN, infinities and subnormals never are), else a message naming
    /// `name`, the value and the range.
    pub fn check(&self, name: &str, v: f64) -> std::result::Result<(), String> {
        if (self.zero && v == 0.0) || (v.is_normal() && v >= self.min && v <= self.max) {
            return Ok(());
        }
        let zero = if self.zero { "0 or " } else { "" };
        Err(format!(
            "{name} is {}; it must be {zero}a number from {:e} to {:e} {}",
            readable(v),
            self.min,
            self.max,
            self.unit
        ))
    }
}

/// `v` as written by hand: plain for everyday magnitudes, else in exponent form (a
/// subnormal's plain form has hundreds of digits).
fn readable(v: f64) -> String {
    if v == 0.0 || (1e-4..1e16).contains(&v.abs()) {
        format!("{v}")
    } else {
        format!("{v:e}")
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

    fn shared_profile() -> HwProfile {
        let ab = AlphaBeta {
            alpha_s: 2e-6,
            beta_bytes_per_s: 5e9,
        };
        HwProfile {
            name: "a CPU host".into(),
            sources: vec!["measured".into()],
            devices: 2,
            memory_bytes: 8e9,
            peak_flops_bf16: 8e11,
            peak_flops_f32: 2e11,
            memory_bandwidth: 2e10,
            compute_efficiency: 1.0,
            memory_efficiency: 1.0,
            link: LinkCosts {
                ring: ab,
                one_shot: ab,
                two_shot: ab,
                send_recv: ab,
            },
            op_overhead_s: 1.5e-6,
            attention_flops: Some(5e10),
            attention_flops_by_head_dim: vec![(8, 5e9), (64, 5e10)],
            shared: Some(SharedHost::new(2)),
            rough: false,
            rank_speeds: Vec::new(),
        }
    }

    #[test]
    fn a_rough_profile_says_so_in_its_field_or_in_an_older_quick_file() {
        let mut p = shared_profile();
        assert!(!p.is_rough());
        p.rough = true;
        assert!(p.is_rough());
        let text = p.to_ron().unwrap();
        assert!(text.contains("rough: true"), "{text}");
        // Before the field, only the first source line said `--quick`.
        let mut old = shared_profile();
        old.sources = vec![format!("{QUICK_SOURCE} (rough: small products), tpc 0.1.0")];
        assert!(old.is_rough());
        old.sources.push(old.sources[0].clone());
        old.sources[0] = "tpc calibrate, tpc 0.1.0".into();
        assert!(!old.is_rough());
        // A profile that is not rough does not write the field.
        assert!(!shared_profile().to_ron().unwrap().contains("rough"));
    }

    #[test]
    fn a_calibrated_profile_round_trips_through_its_file() {
        let mut p = shared_profile();
        p.rough = true;
        let dir = std::env::temp_dir().join(format!("tpc-profile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("host.ron");
        p.save(&path).unwrap();
        assert_eq!(HwProfile::load(&path).unwrap(), p);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn check_refuses_bad_new_fields_and_old_files_still_parse() {
        for bad in [f64::NAN, -1e-6, f64::INFINITY, 2.0] {
            let mut p = shared_profile();
            p.op_overhead_s = bad;
            assert!(p.check().unwrap_err().contains("op_overhead_s"), "{bad}");
        }
        for bad in [0.0, -1.0, f64::NAN] {
            let mut p = shared_profile();
            p.peak_flops_bf16 = bad;
            assert!(p.check().is_err());
            let mut p = shared_profile();
            p.memory_bandwidth = bad;
            assert!(p.check().is_err());
            let mut p = shared_profile();
            p.link.ring.beta_bytes_per_s = bad;
            assert!(p.check().is_err());
        }
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let mut p = shared_profile();
            p.attention_flops = Some(bad);
            assert!(p.check().unwrap_err().contains("attention_flops"));
        }
        let mut p = shared_profile();
        p.shared = Some(SharedHost::new(0));
        assert!(p.check().unwrap_err().contains("shared.cores"));
        for bad in [-1e-6, 1.0, f64::NAN, f64::INFINITY] {
            let mut p = shared_profile();
            p.shared = Some(SharedHost {
                op_overhead_one_thread_s: Some(bad),
                ..SharedHost::new(2)
            });
            assert!(p
                .check()
                .unwrap_err()
                .contains("shared.op_overhead_one_thread_s"));
        }
        // A file written before the shared-host fields reads as a profile without them.
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/models/hw/a100-pcie-8.ron");
        let parsed = HwProfile::load(Path::new(dir)).unwrap();
        assert_eq!(parsed.shared, None);
        assert_eq!(parsed.attention_flops, None);
        assert_eq!(parsed.op_overhead_s, 0.0);
    }

    #[test]
    fn ranks_on_a_shared_host_split_its_cores_and_bandwidth() {
        let p = shared_profile();
        assert_eq!(p.per_rank(1, false), (8e11, 2e10));
        assert_eq!(p.per_rank(2, false), (4e11, 1e10));
        assert_eq!(p.per_rank(2, true), (1e11, 1e10));
        // Three ranks on two cores take turns: a third each.
        let (c, _) = p.per_rank(3, false);
        assert!((c - 8e11 / 3.0).abs() < 1.0);
        // Three ranks on eight cores get two threads each: two cores stay idle.
        let h = SharedHost::new(8);
        assert_eq!(h.compute_share(3), 0.25);
        // Ranks with one thread pay the one-thread per-op cost, where the profile has it.
        let h = SharedHost {
            op_overhead_one_thread_s: Some(1e-7),
            ..SharedHost::new(2)
        };
        assert_eq!(h.op_overhead_s(1, 4e-7), 4e-7);
        assert_eq!(h.op_overhead_s(2, 4e-7), 1e-7);
        assert_eq!(h.op_overhead_s(4, 4e-7), 1e-7);
        let one_core = SharedHost {
            op_overhead_one_thread_s: Some(1e-7),
            ..SharedHost::new(1)
        };
        assert_eq!(one_core.op_overhead_s(2, 4e-7), 4e-7);
        // A one-thread rank's GEMM rate where measured (ranks taking turns when they
        // outnumber the cores), else the host's rate shared out.
        let measured = SharedHost {
            one_thread_flops_bf16: Some(3e11),
            one_thread_flops_f32: Some(7e10),
            ..SharedHost::new(2)
        };
        assert_eq!(measured.rank_flops(1, 9e11, false), 9e11);
        assert_eq!(measured.rank_flops(2, 9e11, false), 3e11);
        assert_eq!(measured.rank_flops(2, 2e11, true), 7e10);
        assert_eq!(measured.rank_flops(4, 9e11, false), 1.5e11);
        let mut p = shared_profile();
        p.shared = Some(measured);
        assert_eq!(p.per_rank(2, false), (3e11, 1e10));
        p.shared = Some(SharedHost {
            one_thread_flops_bf16: Some(f64::NAN),
            ..measured
        });
        assert!(p
            .check()
            .unwrap_err()
            .contains("shared.one_thread_flops_bf16"));
        let unmeasured = SharedHost::new(2);
        assert_eq!(unmeasured.op_overhead_s(2, 4e-7), 4e-7);
        let mut d = p.clone();
        d.shared = None;
        assert_eq!(d.per_rank(4, false), (8e11, 2e10));
    }

    #[test]
    fn absurd_figures_are_refused_naming_the_field_and_the_range() {
        let subnormal = f64::MIN_POSITIVE / 4.0;
        type Edit = fn(&mut HwProfile, f64);
        let cases: [(&str, Edit, &[f64]); 8] = [
            (
                "memory_bandwidth",
                |p, v| p.memory_bandwidth = v,
                &[0.0, subnormal, 1e3, 1e20, f64::INFINITY, f64::NAN],
            ),
            (
                "peak_flops_f32",
                |p, v| p.peak_flops_f32 = v,
                &[0.0, subnormal, -1e12, 1e30],
            ),
            (
                "ring.beta_bytes_per_s",
                |p, v| p.link.ring.beta_bytes_per_s = v,
                &[0.0, subnormal, 1e300],
            ),
            (
                "send_recv.alpha_s",
                |p, v| p.link.send_recv.alpha_s = v,
                &[-1e-6, subnormal, 1e-300, 2.0, f64::NAN],
            ),
            (
                "compute_efficiency",
                |p, v| p.compute_efficiency = v,
                &[0.0, subnormal, 1e-9, 1.5],
            ),
            (
                "memory_bytes",
                |p, v| p.memory_bytes = v,
                &[0.0, 1.0, 1e300, f64::NAN],
            ),
            (
                "attention_flops_by_head_dim",
                |p, v| p.attention_flops_by_head_dim[0].1 = v,
                &[subnormal, 1e30],
            ),
            (
                "op_overhead_s",
                |p, v| p.op_overhead_s = v,
                &[subnormal, 0.5],
            ),
        ];
        for (field, edit, values) in cases {
            for &v in values {
                let mut p = shared_profile();
                edit(&mut p, v);
                let e = p.check().unwrap_err();
                assert!(
                    e.starts_with(&format!("{field} is ")) && e.contains("it must be"),
                    "{v}: {e}"
                );
            }
        }
        // A subnormal is named in exponent form, not with hundreds of digits.
        let mut p = shared_profile();
        p.memory_bandwidth = subnormal;
        let e = p.check().unwrap_err();
        assert!(e.contains("5.562684646268003e-309") && e.len() < 200, "{e}");
        // Zero latencies and the bounds themselves are accepted.
        let mut p = shared_profile();
        p.link.ring.alpha_s = 0.0;
        p.op_overhead_s = 0.0;
        p.memory_bandwidth = BYTES_PER_S.max;
        p.peak_flops_bf16 = FLOPS.min;
        p.compute_efficiency = EFFICIENCY.min;
        p.check().unwrap();
    }

    #[test]
    fn a_misspelled_field_is_refused_wherever_it_is() {
        let good = shared_profile().to_ron().unwrap();
        let path = Path::new("host.ron");
        HwProfile::parse(path, &good).unwrap();
        for (from, to, name) in [
            ("devices:", "devises: 2, devices:", "devises"),
            (
                "op_overhead_s:",
                "op_overhead:1e-6, op_overhead_s:",
                "op_overhead",
            ),
            ("cores:", "core: 3, cores:", "core"),
            ("alpha_s:", "alpha: 1e-6, alpha_s:", "alpha"),
            ("ring:", "rings: 1, ring:", "rings"),
        ] {
            assert!(good.contains(from), "{from}");
            let text = good.replacen(from, to, 1);
            let e = HwProfile::parse(path, &text).unwrap_err().to_string();
            assert!(e.contains("host.ron") && e.contains(name), "{to}: {e}");
        }
    }
}
