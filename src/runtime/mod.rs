//! Runtime: executes per-rank plans. Not built yet; plans are its only input.
