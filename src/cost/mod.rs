//! The cost model: hardware profiles and what a plan costs on them (`tpc simulate`).

pub mod algorithms;
pub mod decide;
pub mod prefer;
pub mod profile;
pub mod rank_speed;
pub mod search;
pub mod shares;
pub mod shipped_profiles;
pub mod simulate;

/// Shipped models and profiles for the cost model's tests.
#[cfg(test)]
pub(crate) mod shipped {
    use std::path::Path;

    pub use crate::plan::build::shipped::{model, plan};

    /// `models/hw/NAME.ron`.
    pub fn profile(name: &str) -> super::profile::HwProfile {
        let path = format!("{}/models/hw/{name}.ron", env!("CARGO_MANIFEST_DIR"));
        super::profile::HwProfile::load(Path::new(&path)).unwrap()
    }
}
