//! Why a plan cannot be split into pipeline stages (`--pp`).

use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum StageError {
    #[error("--pp {pp}: {model} has {layers} decoder layer(s), so it splits into {valid} pipeline stage(s); choose one of those")]
    Count {
        model: String,
        pp: u64,
        layers: u64,
        valid: String,
    },
    #[error("--pp-layers {given}: {problem}; give one positive count per stage, summing to the model's {layers} layer(s)")]
    Layers {
        given: String,
        layers: u64,
        problem: String,
    },
    #[error("pipeline stage {stage}: `{name}` (%{id}) reads %{input} which stage {defined} computes later; the model's program does not split at these layer boundaries")]
    Backward {
        stage: usize,
        name: String,
        id: u32,
        input: u32,
        defined: usize,
    },
    #[error(
        "pipeline stage {stage} of tp rank {rank}: the plan has {stages} stage(s) of {tp} rank(s)"
    )]
    NoSuchStage {
        stage: usize,
        rank: usize,
        stages: usize,
        tp: u64,
    },
    #[error("the plan's pipeline {problem}; recompile it with `tpc compile --pp`")]
    Spans { problem: String },
}
