//! Helpers shared by the integration tests.

use std::path::PathBuf;

/// The tiny HF reference checkpoints (`scripts/make_fixtures.py`), in a fixed order.
pub fn fixtures() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir("tests/fixtures/checkpoints")
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("config.json").exists())
        .collect();
    dirs.sort();
    assert!(
        dirs.len() >= 7,
        "expected the seven reference checkpoints, found {dirs:?}"
    );
    dirs
}
