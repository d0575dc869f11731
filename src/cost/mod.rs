//! The cost model: hardware profiles and what a plan costs on them (`tpc simulate`).

pub mod algorithms;
pub mod calibrate;
pub mod decide;
pub mod profile;
pub mod simulate;
