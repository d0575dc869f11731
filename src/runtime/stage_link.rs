//! A rank's link to the other stages of its pipeline (the ranks of its PP group: the same
//! tp rank on every stage, ranked by stage). Activations cross between neighbouring
//! stages, each preceded by a small header with its shape, so the receiver allocates
//! exactly what comes (a sequence-parallel stream's rows are the sender's to know). The
//! last stage's leading rank schedules, and every last-stage rank tells the earlier stages
//! of its pipeline each engine step (`engine::step::StepMessage`): the first stage needs the
//! token ids, and every stage must run the same forward calls in the same order.

use super::backend::{Activation, Backend};
use super::collectives::Collectives;
use super::error::{Result, RunError};
use super::tensor::Tensor;
use crate::ir::DType;

/// Integers sent as f32 are exact below this.
const EXACT_F32: usize = 1 << 24;

/// One rank's pipeline link.
pub struct StageLink<C> {
    /// The PP group: rank `s` is this tp rank on stage `s`.
    pub comm: C,
    pub stage: usize,
    pub stages: usize,
    /// Value ids received from the previous stage before the program runs, in order.
    pub recv: Vec<u32>,
    /// Value ids sent to the next stage after it ran, in order.
    pub send: Vec<u32>,
    /// Each instruction's index in the tp program (errors name the same place).
    pub origin: Vec<usize>,
}

fn protocol(problem: impl Into<String>) -> RunError {
    RunError::Pipeline(problem.into())
}

fn to_f32(what: &str, v: usize) -> Result<f32> {
    if v >= EXACT_F32 {
        return Err(protocol(format!(
            "{what} {v} is too large to pass between stages (at most {})",
            EXACT_F32 - 1
        )));
    }
    Ok(v as f32)
}

fn to_usize(what: &str, v: f32) -> Result<usize> {
    if !(v >= 0.0 && v < EXACT_F32 as f32 && v.fract() == 0.0) {
        return Err(protocol(format!(
            "a stage received {v} as {what}; the stages disagree, which is a bug in tpc"
        )));
    }
    Ok(v as usize)
}

impl<C> StageLink<C> {
    pub fn is_last(&self) -> bool {
        self.stage + 1 >= self.stages
    }

    /// Sends `x` to stage `to`: a `[rows, cols, dtype]` header, then the values.
    pub fn send_act<B: Backend>(&mut self, backend: &B, x: &B::Act, to: usize) -> Result<()>
    where
        C: Collectives<B::Act>,
    {
        let (rows, cols) = x.rows_cols();
        let dtype = match x.dtype() {
            DType::Bf16 => 1.0,
            _ => 0.0,
        };
        let header = [
            to_f32("a row count", rows)?,
            to_f32("a column count", cols)?,
            dtype,
        ];
        self.send_floats(backend, &header, to)?;
        self.comm.send(x, to)?;
        Ok(())
    }

    /// Receives what [`StageLink::send_act`] sent from stage `from`.
    pub fn recv_act<B: Backend>(&mut self, backend: &B, from: usize) -> Result<B::Act>
    where
        C: Collectives<B::Act>,
    {
        let header = self.recv_floats(backend, 3, from)?;
        let rows = to_usize("a row count", header[0])?;
        let cols = to_usize("a column count", header[1])?;
        let dtype = if header[2] == 1.0 {
            DType::Bf16
        } else {
            DType::F32
        };
        let mut x = backend
            .alloc(&[rows, cols], dtype)
            .map_err(|error| RunError::Backend {
                name: "pipeline receive".into(),
                error,
            })?;
        if let Err(e) = self.comm.recv(&mut x, from) {
            backend.release(x);
            return Err(e.into());
        }
        Ok(x)
    }

    /// The last stage: tells every earlier stage `message` (an engine step, encoded).
    pub fn tell<B: Backend>(&mut self, backend: &B, message: &[f32]) -> Result<()>
    where
        C: Collectives<B::Act>,
    {
        let len = [to_f32("a message length", message.len())?];
        for to in 0..self.stage {
            self.send_floats(backend, &len, to)?;
            self.send_floats(backend, message, to)?;
        }
        Ok(())
    }

    /// An earlier stage: what the last stage says next.
    pub fn listen<B: Backend>(&mut self, backend: &B) -> Result<Vec<f32>>
    where
        C: Collectives<B::Act>,
    {
        let last = self.stages.saturating_sub(1);
        let len = to_usize("a message length", self.recv_floats(backend, 1, last)?[0])?;
        self.recv_floats(backend, len, last)
    }

    fn send_floats<B: Backend>(&mut self, backend: &B, data: &[f32], to: usize) -> Result<()>
    where
        C: Collectives<B::Act>,
    {
        let x = backend
            .upload_host(&Tensor::new(vec![data.len()], data.to_vec()))
            .map_err(|error| RunError::Backend {
                name: "pipeline message".into(),
                error,
            })?;
        let sent = self.comm.send(&x, to);
        backend.release(x);
        Ok(sent?)
    }

    fn recv_floats<B: Backend>(&mut self, backend: &B, n: usize, from: usize) -> Result<Vec<f32>>
    where
        C: Collectives<B::Act>,
    {
        let mut x = backend
            .alloc(&[n], DType::F32)
            .map_err(|error| RunError::Backend {
                name: "pipeline message".into(),
                error,
            })?;
        if let Err(e) = self.comm.recv(&mut x, from) {
            backend.release(x);
            return Err(e.into());
        }
        let host = backend.to_host(x).map_err(|error| RunError::Backend {
            name: "pipeline message".into(),
            error,
        })?;
        Ok(host.data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_f32_cannot_hold_exactly_is_refused() {
        assert!(to_f32("a length", 1 << 24).is_err());
        assert_eq!(to_f32("a length", (1 << 24) - 1).unwrap(), 16_777_215.0);
        for v in [0.5, -1.0, f32::NAN, 16_777_216.0] {
            assert!(to_usize("a length", v).is_err(), "{v}");
        }
        assert_eq!(to_usize("a length", 7.0).unwrap(), 7);
    }
}
