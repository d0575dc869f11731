//! One engine step as every rank runs it: the sequences of the batch, each with its new
//! tokens, the position they start at and its block table, and what the output exchange
//! returns. The leading rank's scheduler makes it; the others receive it encoded as exact
//! small integers in f32 (what every communicator moves), as pipeline control messages are.

/// What a step's output is reduced to before it leaves the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exchange {
    /// Each row's greedy token only (every sequence greedy, no log-probabilities).
    Argmax,
    /// The whole logits of each row (sampling, log-probabilities).
    Logits,
    /// Each row's `k` best (logit, token) candidates (every sequence greedy or sampling
    /// with a top-k of at most `k`, no log-probabilities).
    TopK(usize),
    /// The whole logits of every position the step computes, not only each sequence's last
    /// (`tpc run`'s prompt logits).
    AllLogits,
}

/// One sequence's part of a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedSeq {
    /// Positions already in the cache; the tokens go at `start..start + tokens.len()`.
    pub start: usize,
    pub tokens: Vec<i64>,
    /// Covers at least `start + tokens.len()` positions.
    pub blocks: Vec<u32>,
}

/// What the leading rank tells the others before each step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StepMessage {
    Step {
        seqs: Vec<PlannedSeq>,
        exchange: Exchange,
    },
    /// The logits of request `sequence` at `step` (0: its prompt, k: its k-th new token) are
    /// not finite: every rank recomputes its `tokens` to find the op they come from, and the
    /// batch fails with it (`tpc run`).
    Locate {
        sequence: usize,
        step: usize,
        tokens: Vec<i64>,
    },
    /// A replica with no requests answers one forward call of the replicas that share its
    /// experts (`--ep`); `done`: it will have no requests again, so it answers until every
    /// replica is done.
    Answer { done: bool },
    /// The engine stops: leave the loop.
    Stop,
}

/// Integers up to this pass through f32 exactly.
const EXACT: u64 = 1 << 24;

/// A message that cannot be decoded: ranks out of step, a bug in tpc.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("engine step message: {0} (the ranks are out of step; a bug in tpc)")]
pub struct StepCodeError(pub String);

fn exact(what: &str, v: u64) -> Result<f32, StepCodeError> {
    if v >= EXACT {
        return Err(StepCodeError(format!(
            "{what} {v} does not pass between ranks exactly (at most {})",
            EXACT - 1
        )));
    }
    Ok(v as f32)
}

impl StepMessage {
    /// `[0]` (stop), `[1, exchange.., count, (start, n_tokens, n_blocks, tokens..,
    /// blocks..)..]` (a step; the exchange is one value, or `3, k` for a top-k),
    /// `[2, sequence, step, n_tokens, tokens..]` (locate) or `[3, done]` (answer).
    pub fn encode(&self) -> Result<Vec<f32>, StepCodeError> {
        let mut out = Vec::new();
        match self {
            StepMessage::Stop => out.push(0.0),
            StepMessage::Answer { done } => out.extend([3.0, f32::from(u8::from(*done))]),
            StepMessage::Locate {
                sequence,
                step,
                tokens,
            } => {
                out.push(2.0);
                out.push(exact("a sequence", *sequence as u64)?);
                out.push(exact("a step", *step as u64)?);
                out.push(exact("a token count", tokens.len() as u64)?);
                for &t in tokens {
                    out.push(exact("a token id", u64::try_from(t).unwrap_or(u64::MAX))?);
                }
            }
            StepMessage::Step { seqs, exchange } => {
                out.push(1.0);
                match exchange {
                    Exchange::Argmax => out.push(0.0),
                    Exchange::Logits => out.push(1.0),
                    Exchange::AllLogits => out.push(2.0),
                    Exchange::TopK(k) => {
                        out.push(3.0);
                        out.push(exact("a top-k", *k as u64)?);
                    }
                }
                out.push(exact("a batch size", seqs.len() as u64)?);
                for s in seqs {
                    out.push(exact("a position", s.start as u64)?);
                    out.push(exact("a token count", s.tokens.len() as u64)?);
                    out.push(exact("a block count", s.blocks.len() as u64)?);
                    for &t in &s.tokens {
                        out.push(exact("a token id", u64::try_from(t).unwrap_or(u64::MAX))?);
                    }
                    for &b in &s.blocks {
                        out.push(exact("a block id", b as u64)?);
                    }
                }
            }
        }
        Ok(out)
    }

    pub fn decode(data: &[f32]) -> Result<StepMessage, StepCodeError> {
        let mut r = Reader(data.iter().copied());
        match r.int("its kind")? {
            0 => Ok(StepMessage::Stop),
            3 => {
                let done = match r.int("whether it is done")? {
                    0 => false,
                    1 => true,
                    d => return Err(StepCodeError(format!("answer's done flag {d}"))),
                };
                r.end("the done flag")?;
                Ok(StepMessage::Answer { done })
            }
            2 => {
                let sequence = r.int("a sequence")? as usize;
                let step = r.int("a step")? as usize;
                let tokens = r.counted("a token count", "a token id", |t| t as i64)?;
                r.end("the last token")?;
                Ok(StepMessage::Locate {
                    sequence,
                    step,
                    tokens,
                })
            }
            1 => {
                let exchange = match r.int("the exchange")? {
                    0 => Exchange::Argmax,
                    1 => Exchange::Logits,
                    2 => Exchange::AllLogits,
                    3 => Exchange::TopK(r.int("a top-k")? as usize),
                    e => return Err(StepCodeError(format!("exchange {e}"))),
                };
                let count = r.int("the batch size")? as usize;
                let mut seqs = Vec::with_capacity(count.min(data.len()));
                for _ in 0..count {
                    let start = r.int("a position")? as usize;
                    let n = r.int("a token count")?;
                    let b = r.int("a block count")?;
                    let tokens = r.many(n, "a token id", |t| t as i64)?;
                    let blocks = r.many(b, "a block id", |b| b as u32)?;
                    seqs.push(PlannedSeq {
                        start,
                        tokens,
                        blocks,
                    });
                }
                r.end("the last sequence")?;
                Ok(StepMessage::Step { seqs, exchange })
            }
            k => Err(StepCodeError(format!("kind {k}"))),
        }
    }
}

/// Reads a message's exact integers in order.
struct Reader<I>(I);

impl<I: Iterator<Item = f32>> Reader<I> {
    fn int(&mut self, what: &str) -> Result<u64, StepCodeError> {
        let v = self
            .0
            .next()
            .ok_or_else(|| StepCodeError(format!("ends before {what}")))?;
        if !(v >= 0.0 && (v as u64) < EXACT && v.fract() == 0.0) {
            return Err(StepCodeError(format!("{what} is {v}")));
        }
        Ok(v as u64)
    }

    /// `n` values of `what`.
    fn many<T>(
        &mut self,
        n: u64,
        what: &str,
        of: impl Fn(u64) -> T,
    ) -> Result<Vec<T>, StepCodeError> {
        (0..n).map(|_| self.int(what).map(&of)).collect()
    }

    /// A count (`count`), then that many values of `what`.
    fn counted<T>(
        &mut self,
        count: &str,
        what: &str,
        of: impl Fn(u64) -> T,
    ) -> Result<Vec<T>, StepCodeError> {
        let n = self.int(count)?;
        self.many(n, what, of)
    }

    /// Nothing follows `after`.
    fn end(&mut self, after: &str) -> Result<(), StepCodeError> {
        match self.0.next() {
            Some(_) => Err(StepCodeError(format!("values after {after}"))),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_survive_the_round_trip() {
        let step = StepMessage::Step {
            seqs: vec![
                PlannedSeq {
                    start: 0,
                    tokens: vec![5, 0, 151_000],
                    blocks: vec![3],
                },
                PlannedSeq {
                    start: 40,
                    tokens: vec![7],
                    blocks: vec![9, 1, 4],
                },
            ],
            exchange: Exchange::Logits,
        };
        let mut top_k = step.clone();
        if let StepMessage::Step { exchange, .. } = &mut top_k {
            *exchange = Exchange::TopK(40);
        }
        let locate = StepMessage::Locate {
            sequence: 3,
            step: 7,
            tokens: vec![1, 2, 0],
        };
        let answers = [
            StepMessage::Answer { done: false },
            StepMessage::Answer { done: true },
        ];
        for m in [step, top_k, locate, StepMessage::Stop]
            .into_iter()
            .chain(answers)
        {
            assert_eq!(StepMessage::decode(&m.encode().unwrap()).unwrap(), m);
        }
    }

    #[test]
    fn values_that_do_not_pass_exactly_or_torn_messages_are_errors() {
        let big = StepMessage::Step {
            seqs: vec![PlannedSeq {
                start: 1 << 24,
                tokens: vec![1],
                blocks: vec![0],
            }],
            exchange: Exchange::Argmax,
        };
        assert!(big.encode().is_err());
        let ok = StepMessage::Step {
            seqs: vec![PlannedSeq {
                start: 2,
                tokens: vec![1, 2],
                blocks: vec![0],
            }],
            exchange: Exchange::Argmax,
        }
        .encode()
        .unwrap();
        assert!(StepMessage::decode(&ok[..ok.len() - 1]).is_err());
        let mut extra = ok.clone();
        extra.push(0.0);
        assert!(StepMessage::decode(&extra).is_err());
        let mut frac = ok;
        frac[3] = 2.5;
        assert!(StepMessage::decode(&frac).is_err());
        assert!(StepMessage::decode(&[]).is_err());
        assert!(StepMessage::decode(&[3.0, 2.0]).is_err());
        assert!(StepMessage::decode(&[3.0, 1.0, 0.0]).is_err());
    }
}
