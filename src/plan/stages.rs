//! Pipeline stages: a plan's decoder layers split into `pp` contiguous runs, each run one
//! stage of `tp` ranks (global rank = stage · tp + tp rank, vLLM's `[PP, TP]` order).
//!
//! A stage's program is derived from the tensor-parallel program of the same tp rank, never
//! stored: its layers' instructions in program order, the inputs and weights they read (a
//! weight two stages read — a tied embedding — is loaded by each), the values earlier
//! stages computed received from the previous stage, and the values later stages read sent
//! to the next. The verified tp program stays the one source of truth, so the stages
//! compute exactly what it computes, op for op.

use super::{Instr, Plan, RankProgram};
pub use crate::error::StageError;
use crate::ir::{Name, Op, TensorFact};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeSet, HashMap};

/// The most pipeline stages a plan may have.
pub const MAX_PP: u64 = 256;

/// How the decoder layers are split over pipeline stages.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pipeline {
    pub stages: Vec<StageSpan>,
}

/// The decoder layers one stage runs: `first_layer .. first_layer + layers`. The first
/// stage also runs the embedding, the last the final norm and the LM head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageSpan {
    pub first_layer: u32,
    pub layers: u32,
}

/// A value that crosses a stage boundary: computed on an earlier stage, read on a later.
#[derive(Debug, Clone, PartialEq)]
pub struct Boundary {
    pub id: u32,
    pub name: Name,
    /// The value on this tp rank (the layout of the tp program: a partial sum stays one).
    pub fact: TensorFact,
}

impl Boundary {
    /// Bytes per token this rank moves for the value.
    pub fn bytes_per_token(&self) -> u64 {
        self.fact
            .shape
            .fixed_elements()
            .saturating_mul(self.fact.dtype.size_bytes())
    }
}

/// One rank's part of a pipelined plan.
#[derive(Debug, Clone, PartialEq)]
pub struct StageProgram {
    pub stage: usize,
    pub stages: usize,
    /// The stage's instructions and weight manifest; `rank` is the global rank.
    pub program: RankProgram,
    /// For each instruction, its index in the tp program (so errors name the same place).
    pub origin: Vec<usize>,
    /// Received from stage − 1 before the first instruction, in this order.
    pub recv: Vec<Boundary>,
    /// Sent to stage + 1 after the last instruction, in this order.
    pub send: Vec<Boundary>,
    /// The plan's numerics mode.
    pub numerics: crate::ir::NumericsMode,
}

/// Decoder layers of a program: one more than the largest layer index.
pub fn layer_count(program: &RankProgram) -> usize {
    program
        .instrs
        .iter()
        .filter_map(|i| i.layer)
        .max()
        .map_or(0, |l| l as usize + 1)
}

/// Where each instruction lies: before the decoder layers (embedding, 0), in layer `l`
/// (`1 + l`), or after them (final norm, LM head, `layers + 1`).
pub fn segments(program: &RankProgram, layers: usize) -> Vec<usize> {
    let mut seen_layer = false;
    program
        .instrs
        .iter()
        .map(|i| match i.layer {
            Some(l) => {
                seen_layer = true;
                (l as usize).min(layers.saturating_sub(1)) + 1
            }
            None if seen_layer => layers + 1,
            None => 0,
        })
        .collect()
}

impl Plan {
    /// Pipeline stages (1 without a pipeline).
    pub fn pp(&self) -> usize {
        self.pipeline.as_ref().map_or(1, |p| p.stages.len().max(1))
    }

    /// Every rank of the plan: pp · tp.
    pub fn world(&self) -> usize {
        self.pp().saturating_mul(self.ranks.len())
    }
}

fn valid_counts(layers: u64) -> String {
    match layers {
        0 | 1 => "1".into(),
        n => format!("1 to {n}"),
    }
}

/// Splits `plan`'s layers into `pp` stages: `explicit` layer counts when given, else
/// balanced by cost, where a layer's cost is its share of the parameter bytes plus its
/// share of the linear weights (the compute per token), both over tp rank 0's program; the
/// embedding counts with the first layer, the final norm and LM head with the last.
pub fn split(plan: &Plan, pp: u64, explicit: Option<&[u64]>) -> Result<Pipeline, StageError> {
    let program = plan.ranks.first();
    let layers = program.map_or(0, layer_count) as u64;
    if let Some(counts) = explicit {
        let given = counts
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(",");
        let bad = |problem: String| StageError::Layers {
            given: given.clone(),
            layers,
            problem,
        };
        if counts.len() as u64 != pp {
            return Err(bad(format!("{} count(s) for --pp {pp}", counts.len())));
        }
        if counts.contains(&0) {
            return Err(bad("a stage with no layers".into()));
        }
        let total = counts.iter().try_fold(0u64, |a, &c| a.checked_add(c));
        if total != Some(layers) {
            return Err(bad(format!(
                "they sum to {}",
                total.map_or("more than 2^64".into(), |t| t.to_string())
            )));
        }
    }
    if pp == 0 || pp > layers.max(1) || pp > MAX_PP {
        return Err(StageError::Count {
            model: plan.model.clone(),
            pp,
            layers,
            valid: valid_counts(layers.min(MAX_PP)),
        });
    }
    let counts: Vec<u64> = match explicit {
        Some(c) => c.to_vec(),
        None => {
            let costs = program.map(|p| layer_costs(p, layers as usize));
            let starts = super::balance::balanced_split(&costs.unwrap_or_default(), pp as usize);
            counts_from_starts(&starts, layers)
        }
    };
    Ok(pipeline_of(&counts))
}

/// What [`split`] cuts without explicit counts, for every pp from 1 to `max_pp` (at most
/// the layers and [`MAX_PP`]), in that order, balanced once for all of them.
pub fn balanced_pipelines(plan: &Plan, max_pp: u64) -> Vec<Pipeline> {
    let Some(program) = plan.ranks.first() else {
        return Vec::new();
    };
    let layers = layer_count(program);
    let max_pp = max_pp.min(MAX_PP).min(layers as u64) as usize;
    super::balance::balanced_splits(&layer_costs(program, layers), max_pp)
        .iter()
        .map(|starts| pipeline_of(&counts_from_starts(starts, layers as u64)))
        .collect()
}

/// Layer counts of the runs that start at `starts`, the last ending at `layers`.
fn counts_from_starts(starts: &[usize], layers: u64) -> Vec<u64> {
    let mut ends: Vec<u64> = starts.iter().skip(1).map(|&s| s as u64).collect();
    ends.push(layers);
    let mut prev = 0;
    ends.iter()
        .map(|&e| {
            let c = e - prev;
            prev = e;
            c
        })
        .collect()
}

/// Contiguous stages of `counts` layers each, from layer 0.
fn pipeline_of(counts: &[u64]) -> Pipeline {
    let mut first = 0u32;
    let stages = counts
        .iter()
        .map(|&c| {
            let layers = u32::try_from(c).unwrap_or(u32::MAX);
            let span = StageSpan {
                first_layer: first,
                layers,
            };
            first = first.saturating_add(layers);
            span
        })
        .collect();
    Pipeline { stages }
}

/// Each layer's cost for balancing: its share of the parameter bytes plus its share of
/// the linear weight elements (the compute per token).
fn layer_costs(program: &RankProgram, layers: usize) -> Vec<f64> {
    let seg = segments(program, layers);
    let bytes: HashMap<&str, u64> = program
        .weights
        .iter()
        .map(|w| (&*w.tensor, w.local_bytes()))
        .collect();
    let by_id: HashMap<u32, &Instr> = program.instrs.iter().map(|i| (i.id, i)).collect();
    let mut param = vec![0.0f64; layers + 2];
    let mut linear = vec![0.0f64; layers + 2];
    for (i, &s) in program.instrs.iter().zip(&seg) {
        match &i.op {
            Op::Param(p) => param[s] += bytes.get(&*p.tensor).copied().unwrap_or(0) as f64,
            Op::Linear(_) => {
                let w = i.inputs.get(1).and_then(|id| by_id.get(id));
                linear[s] += w.map_or(0.0, |w| w.fact.shape.fixed_elements() as f64);
            }
            _ => {}
        }
    }
    let share = |v: &[f64]| {
        let total: f64 = v.iter().sum();
        v.iter()
            .map(|x| if total > 0.0 { x / total } else { 0.0 })
            .collect::<Vec<f64>>()
    };
    let (param, linear) = (share(&param), share(&linear));
    let mut costs: Vec<f64> = (1..=layers).map(|s| param[s] + linear[s]).collect();
    if let (Some(first), true) = (costs.first_mut(), layers > 0) {
        *first += param[0] + linear[0];
    }
    if let Some(last) = costs.last_mut() {
        *last += param[layers + 1] + linear[layers + 1];
    }
    costs
}

/// Checks the pipeline against the plan's layers: contiguous spans from layer 0, each
/// non-empty, covering every layer.
pub fn check_spans(plan: &Plan) -> Result<(), StageError> {
    let Some(pipeline) = &plan.pipeline else {
        return Ok(());
    };
    let layers = plan.ranks.first().map_or(0, layer_count) as u64;
    let bad = |problem: String| Err(StageError::Spans { problem });
    if pipeline.stages.is_empty() || pipeline.stages.len() as u64 > MAX_PP {
        return bad(format!(
            "has {} stages (1 to {MAX_PP})",
            pipeline.stages.len()
        ));
    }
    let mut next = 0u64;
    for (s, span) in pipeline.stages.iter().enumerate() {
        if u64::from(span.first_layer) != next || span.layers == 0 {
            return bad(format!(
                "stage {s} starts at layer {} with {} layer(s), expected layer {next} and at least one",
                span.first_layer, span.layers
            ));
        }
        next += u64::from(span.layers);
    }
    if next != layers {
        return bad(format!("covers {next} layer(s) of {layers}"));
    }
    Ok(())
}

/// The stage of each segment (see [`segments`]).
fn stage_of_segment(pipeline: &Pipeline, layers: usize, seg: usize) -> usize {
    let last = pipeline.stages.len().saturating_sub(1);
    match seg {
        0 => 0,
        s if s > layers => last,
        s => {
            let layer = (s - 1) as u64;
            pipeline
                .stages
                .iter()
                .position(|sp| {
                    layer >= u64::from(sp.first_layer)
                        && layer < u64::from(sp.first_layer) + u64::from(sp.layers)
                })
                .unwrap_or(last)
        }
    }
}

/// Whether an instruction is placed on every stage that reads it (no transfer).
fn replicated(op: &Op) -> bool {
    matches!(op, Op::Input(_) | Op::Param(_))
}

/// The program of tp rank `rank` on stage `stage`. Without a pipeline, stage 0 is the
/// whole program.
pub fn stage_program(plan: &Plan, rank: usize, stage: usize) -> Result<StageProgram, StageError> {
    check_spans(plan)?;
    let no_such = || StageError::NoSuchStage {
        stage,
        rank,
        stages: plan.pp(),
        tp: plan.tp,
    };
    let full = plan.ranks.get(rank).ok_or_else(no_such)?;
    let stages = plan.pp();
    if stage >= stages {
        return Err(no_such());
    }
    let Some(pipeline) = &plan.pipeline else {
        return Ok(StageProgram {
            stage: 0,
            stages: 1,
            program: full.clone(),
            origin: (0..full.instrs.len()).collect(),
            recv: Vec::new(),
            send: Vec::new(),
            numerics: plan.numerics,
        });
    };
    let layers = layer_count(full);
    let seg = segments(full, layers);
    let index: HashMap<u32, usize> = full
        .instrs
        .iter()
        .enumerate()
        .map(|(k, i)| (i.id, k))
        .collect();
    // Where each computed value lives; inputs and weights live where they are read.
    let mut home: Vec<Option<usize>> = vec![None; full.instrs.len()];
    for (k, i) in full.instrs.iter().enumerate() {
        if !replicated(&i.op) {
            home[k] = Some(stage_of_segment(pipeline, layers, seg[k]));
        }
    }
    // Per stage: the replicated instructions it reads, and the values it reads from earlier.
    let mut reads_replicated: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); stages];
    let mut reads_earlier: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); stages];
    for (k, i) in full.instrs.iter().enumerate() {
        let Some(s) = home[k] else { continue };
        for &input in &i.inputs {
            let Some(&d) = index.get(&input) else {
                continue;
            };
            match home[d] {
                None => {
                    reads_replicated[s].insert(d);
                }
                Some(ds) if ds > s => {
                    return Err(StageError::Backward {
                        stage: s,
                        name: i.name.to_string(),
                        id: i.id,
                        input,
                        defined: ds,
                    })
                }
                Some(ds) if ds < s => {
                    reads_earlier[s].insert(d);
                }
                Some(_) => {}
            }
        }
    }
    // Values crossing into stage t: computed before t, read at t or later.
    let crossing = |t: usize| -> Vec<usize> {
        let mut set: BTreeSet<usize> = BTreeSet::new();
        for later in reads_earlier.iter().skip(t) {
            set.extend(later.iter().filter(|&&d| home[d].is_some_and(|h| h < t)));
        }
        set.into_iter().collect()
    };
    let boundary = |d: usize| {
        let i = &full.instrs[d];
        Boundary {
            id: i.id,
            name: i.name.clone(),
            fact: i.fact.clone(),
        }
    };
    let recv: Vec<Boundary> = if stage > 0 {
        crossing(stage).into_iter().map(boundary).collect()
    } else {
        Vec::new()
    };
    let send: Vec<Boundary> = if stage + 1 < stages {
        crossing(stage + 1).into_iter().map(boundary).collect()
    } else {
        Vec::new()
    };
    let keep: Vec<usize> = (0..full.instrs.len())
        .filter(|&k| home[k] == Some(stage) || reads_replicated[stage].contains(&k))
        .collect();
    let instrs: Vec<Instr> = keep.iter().map(|&k| full.instrs[k].clone()).collect();
    let tensors: BTreeSet<&str> = instrs
        .iter()
        .filter_map(|i| match &i.op {
            Op::Param(p) => Some(&*p.tensor),
            _ => None,
        })
        .collect();
    let weights = full
        .weights
        .iter()
        .filter(|w| tensors.contains(&*w.tensor))
        .cloned()
        .collect();
    Ok(StageProgram {
        stage,
        stages,
        program: RankProgram {
            rank: (stage as u64)
                .saturating_mul(plan.tp)
                .saturating_add(rank as u64),
            weights,
            fused: super::fuse::within(&full.fused, &instrs),
            instrs,
            sequence_shares: full.sequence_shares,
        },
        origin: keep,
        recv,
        send,
        numerics: plan.numerics,
    })
}

/// Every stage program of tp rank 0, in stage order (what reports and pictures show).
pub fn rank0_stages(plan: &Plan) -> Result<Vec<StageProgram>, StageError> {
    (0..plan.pp()).map(|s| stage_program(plan, 0, s)).collect()
}

/// Splits a compiled plan's layers into `pp` pipeline stages (`layers`: the count of each,
/// else balanced by cost); `pp = 1` without `layers` leaves the plan as it is.
pub fn split_stages(plan: &mut Plan, pp: u64, layers: Option<&[u64]>) -> crate::error::Result<()> {
    if pp == 1 && layers.is_none() {
        plan.pipeline = None;
        return Ok(());
    }
    let pipeline = split(plan, pp, layers)?;
    plan.pipeline = (pipeline.stages.len() > 1).then_some(pipeline);
    // The derived stage programs must hold together (no value read before a stage has it).
    if let Err(e) = rank0_stages(plan) {
        plan.pipeline = None;
        return Err(e.into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::build::shipped;

    fn pipelined(name: &str, tp: u64, pp: u64) -> Plan {
        let mut plan = shipped::plan(name, tp);
        crate::plan::stages::split_stages(&mut plan, pp, None).unwrap();
        plan
    }

    #[test]
    fn every_computed_value_lives_on_exactly_one_stage() {
        for (name, tp, pp) in [
            ("tiny-llama", 2, 2),
            ("tiny-gpt2", 1, 2),
            ("tiny-qwen3", 2, 2),
        ] {
            let plan = pipelined(name, tp, pp);
            plan.verify().unwrap();
            for t in 0..tp as usize {
                let full = &plan.ranks[t];
                let stages: Vec<StageProgram> = (0..pp as usize)
                    .map(|s| stage_program(&plan, t, s).unwrap())
                    .collect();
                for (k, i) in full.instrs.iter().enumerate() {
                    let homes: Vec<usize> = stages
                        .iter()
                        .filter(|sp| sp.origin.contains(&k))
                        .map(|sp| sp.stage)
                        .collect();
                    if replicated(&i.op) {
                        assert!(!homes.is_empty(), "{name}: {} on no stage", i.name);
                    } else {
                        assert_eq!(homes.len(), 1, "{name}: {} on {homes:?}", i.name);
                    }
                }
                // The embedding is on the first stage, the output on the last.
                let has = |sp: &StageProgram, kind: &str| {
                    sp.program.instrs.iter().any(|i| i.op.kind() == kind)
                };
                assert!(has(&stages[0], "embedding") && !has(&stages[1], "embedding"));
                assert!(has(&stages[1], "output") && !has(&stages[0], "output"));
                // What stage 0 sends is what stage 1 receives, and stage 1 reads it.
                assert_eq!(stages[0].send, stages[1].recv);
                assert!(!stages[1].recv.is_empty());
                for b in &stages[1].recv {
                    assert!(stages[1]
                        .program
                        .instrs
                        .iter()
                        .any(|i| i.inputs.contains(&b.id)));
                }
                // Global ranks in [PP, TP] order.
                assert_eq!(stages[1].program.rank, tp + t as u64);
                // Every weight is loaded by some stage; a stage loads only what it reads.
                for w in &full.weights {
                    assert!(stages.iter().any(|sp| sp.program.weights.contains(w)));
                }
            }
        }
    }

    #[test]
    fn a_residual_stream_crosses_once_per_boundary() {
        // tiny-llama at tp 1: the residual after layer 0 is the only value crossing.
        let plan = pipelined("tiny-llama", 1, 2);
        let s1 = stage_program(&plan, 0, 1).unwrap();
        assert_eq!(s1.recv.len(), 1);
        assert_eq!(s1.recv[0].bytes_per_token(), 64 * 4);
        // Positions are an input every stage reads itself; nothing else crosses.
        assert!(s1.program.instrs.iter().any(|i| matches!(
            i.op,
            Op::Input(crate::ir::InputOp {
                kind: crate::ir::InputKind::Positions
            })
        )));
    }

    #[test]
    fn four_stages_pass_values_through() {
        let mut plan = shipped::plan("tinyllama-1.1b", 1);
        crate::plan::stages::split_stages(&mut plan, 4, Some(&[6, 6, 5, 5])).unwrap();
        let spans: Vec<(u32, u32)> = plan
            .pipeline
            .as_ref()
            .unwrap()
            .stages
            .iter()
            .map(|s| (s.first_layer, s.layers))
            .collect();
        assert_eq!(spans, vec![(0, 6), (6, 6), (12, 5), (17, 5)]);
        let stages = rank0_stages(&plan).unwrap();
        for pair in stages.windows(2) {
            assert_eq!(pair[0].send, pair[1].recv);
        }
        assert!(stages[0].recv.is_empty() && stages[3].send.is_empty());
    }

    #[test]
    fn balanced_split_covers_every_layer_and_weights_the_lm_head() {
        let plan = pipelined("llama3-8b", 2, 4);
        let spans = &plan.pipeline.as_ref().unwrap().stages;
        assert_eq!(spans.iter().map(|s| s.layers).sum::<u32>(), 32);
        // The LM head (128k × 4096) weighs on the last stage: it gets the fewest layers.
        let last = spans.last().unwrap().layers;
        assert!(spans.iter().all(|s| s.layers >= last), "{spans:?}");
        check_spans(&plan).unwrap();
    }

    #[test]
    fn infeasible_stage_counts_are_clear_errors() {
        let plan = shipped::plan("tiny-llama", 1);
        let err = split(&plan, 3, None).unwrap_err();
        assert!(err.to_string().contains("1 to 2"), "{err}");
        assert!(matches!(
            split(&plan, 0, None),
            Err(StageError::Count { .. })
        ));
        for bad in [&[1u64][..], &[2, 0], &[1, 2]] {
            let err = split(&plan, 2, Some(bad)).unwrap_err();
            assert!(matches!(err, StageError::Layers { .. }), "{bad:?}: {err}");
        }
        assert_eq!(split(&plan, 2, Some(&[1, 1])).unwrap().stages.len(), 2);
    }

    #[test]
    fn a_pipeline_that_does_not_cover_the_layers_fails_verification() {
        let mut plan = pipelined("tiny-llama", 1, 2);
        plan.pipeline.as_mut().unwrap().stages[1].layers = 3;
        let err = plan.verify().unwrap_err();
        assert!(err.to_string().contains("covers 4 layer(s) of 2"), "{err}");
        plan.pipeline.as_mut().unwrap().stages[1] = StageSpan {
            first_layer: 0,
            layers: 1,
        };
        assert!(plan.verify().is_err());
        assert!(stage_program(&plan, 0, 0).is_err());
    }
}
