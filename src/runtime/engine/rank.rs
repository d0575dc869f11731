//! The engine's steps on one rank of a running plan. The leading rank (tp rank 0 of the
//! last pipeline stage) broadcasts each step to its tensor-parallel group; every rank of the
//! last stage passes it on to the earlier stages of its pipeline, which run the step's
//! forward call and send their values on. Every rank of the last stage takes part in the
//! output exchange; only the leading rank's output is used.

use super::driver::StepRunner;
use super::scheduler::StepOutput;
use super::step::{Exchange, PlannedSeq, StepMessage};
use super::ticks::ReplicaTicks;
use crate::runtime::backend::Backend;
use crate::runtime::collectives::Collectives;
use crate::runtime::error::{Result, RunError};
use crate::runtime::executor::{OutputRows, SeqStep};
use crate::runtime::expert_exchange::ExpertMember;
use crate::runtime::generate::RankRuntime;

/// How a server's leading rank whose replica shares its experts (`--ep`) learns that the
/// other replicas call on them.
pub enum ExpertWatch {
    /// Replicas as threads: the exchange of its first stage with MoE layers, tp rank 0,
    /// where another replica's call arrives first.
    Exchange(ExpertMember),
    /// Replicas as processes: the replicas' leading ranks tick together.
    Ticks(Box<dyn ReplicaTicks>),
}

/// A rank of a running plan as the engine drives it.
pub struct RankSteps<'r, 'p, B: Backend, C: Collectives<B::Act>> {
    pub rt: &'r mut RankRuntime<'p, B, C>,
    /// On a server's leading rank (`tpc serve`) whose replica shares its experts, watched
    /// between requests. `None` elsewhere, and in `tpc run`'s batch, which answers the
    /// calls after its generations instead (`RankRuntime::generate_in_expert_group`).
    pub watch: Option<ExpertWatch>,
}

fn protocol(e: impl std::fmt::Display) -> RunError {
    RunError::Pipeline(e.to_string())
}

impl<B: Backend, C: Collectives<B::Act>> StepRunner for RankSteps<'_, '_, B, C> {
    fn share(&mut self, message: Option<&StepMessage>) -> Result<StepMessage> {
        let exec = &mut self.rt.exec;
        if !exec.has_output() {
            return StepMessage::decode(&exec.listen()?).map_err(protocol);
        }
        let body = match message {
            Some(m) => Some(m.encode().map_err(protocol)?),
            None => None,
        };
        let body = exec.broadcast_floats(body)?;
        let decoded = StepMessage::decode(&body).map_err(protocol)?;
        exec.tell(&body)?;
        Ok(decoded)
    }

    fn run(&mut self, seqs: &[PlannedSeq], exchange: Exchange) -> Result<Option<StepOutput>> {
        let exec = &mut self.rt.exec;
        let steps: Vec<SeqStep<'_>> = seqs
            .iter()
            .map(|s| SeqStep {
                tokens: &s.tokens,
                start: s.start,
                blocks: &s.blocks,
            })
            .collect();
        if !exec.has_output() {
            exec.forward_stage_steps(&steps)?;
            return Ok(None);
        }
        let unknown = || "find the op with `tpc run` on this prompt".to_string();
        Ok(Some(match exchange {
            Exchange::Argmax => match exec.forward_steps_argmax(&steps, OutputRows::LastOfEach)? {
                Ok(picks) => StepOutput::Argmax(picks),
                Err(row) => StepOutput::NonFinite {
                    row,
                    origin: unknown(),
                },
            },
            Exchange::TopK(k) => {
                match exec.forward_steps_top_k(&steps, OutputRows::LastOfEach, k)? {
                    Ok(candidates) => StepOutput::Candidates(candidates),
                    Err(row) => StepOutput::NonFinite {
                        row,
                        origin: unknown(),
                    },
                }
            }
            Exchange::Logits | Exchange::AllLogits => {
                let rows = if exchange == Exchange::AllLogits {
                    OutputRows::All
                } else {
                    OutputRows::LastOfEach
                };
                let logits = exec.forward_steps(&steps, rows)?;
                let out = match logits.first_non_finite_row() {
                    Some(row) => StepOutput::NonFinite {
                        row,
                        origin: unknown(),
                    },
                    None => StepOutput::Logits {
                        data: logits.data.clone(),
                        vocab: logits.cols(),
                    },
                };
                logits.release();
                out
            }
        }))
    }

    fn shares_experts(&self) -> bool {
        self.watch.is_some()
    }

    fn wait_for_expert_call(&mut self, timeout: std::time::Duration) -> Result<bool> {
        match &mut self.watch {
            Some(ExpertWatch::Exchange(m)) => m
                .exchange
                .wait_for_call(m.member, timeout)
                .map_err(RunError::ExpertExchange),
            Some(ExpertWatch::Ticks(t)) => {
                if t.tick(false, false)?.any_busy {
                    return Ok(true);
                }
                // Nobody runs anything: look for a request of this replica's again soon.
                std::thread::sleep(timeout);
                Ok(false)
            }
            None => Ok(false),
        }
    }

    fn answer_experts(&mut self, done: bool) -> Result<()> {
        if done {
            self.rt.exec.serve_expert_group()
        } else {
            self.rt.exec.answer_expert_calls(false).map(|_| ())
        }
    }

    fn before_forward(&mut self) -> Result<()> {
        if let Some(ExpertWatch::Ticks(t)) = &mut self.watch {
            t.tick(true, false)?;
        }
        Ok(())
    }

    fn answer_until_all_done(&mut self) -> Result<()> {
        if !matches!(self.watch, Some(ExpertWatch::Ticks(_))) {
            return super::driver::answer_experts(self, true);
        }
        // Every tick until all are done: answer a forward call where one runs, else wait
        // a little (the others may be between requests for a while).
        loop {
            let Some(ExpertWatch::Ticks(t)) = &mut self.watch else {
                return Ok(());
            };
            let tick = t.tick(false, true)?;
            if tick.all_done {
                return Ok(());
            }
            if tick.any_busy {
                super::driver::answer_experts(self, false)?;
            } else {
                std::thread::sleep(super::driver::IDLE_CALL_WAIT);
            }
        }
    }

    fn locate(&mut self, sequence: usize, step: usize, tokens: &[i64]) -> RunError {
        match self.rt.exec.locate_non_finite(tokens) {
            Ok(origin) => RunError::NonFiniteLogits {
                sequence,
                step: step_name(step),
                origin,
            },
            Err(e) => e,
        }
    }
}

/// "the prompt" (step 0) or "decode step N".
fn step_name(step: usize) -> String {
    if step == 0 {
        "the prompt".into()
    } else {
        format!("decode step {step}")
    }
}
