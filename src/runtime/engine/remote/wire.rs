//! The messages between a server's front and the engines of its other replicas, as bytes.
//! Little-endian fixed-width numbers, strings and lists behind their lengths; every length
//! is checked against the bytes left before anything is allocated, so a short or corrupt
//! message is an error, never a panic or a huge allocation.

use super::super::api::{
    Event, FinishReason, GenRequest, ModelInfo, SubmitError, TokenLogprobs, Usage,
};
use super::metrics_wire::{read_families, write_families};
use super::LinkError;
use crate::runtime::sampling::Sampling;
use prometheus::proto::MetricFamily;

/// What the front asks of a replica's engine.
#[derive(Debug, Clone, PartialEq)]
pub enum ToReplica {
    Submit {
        id: u64,
        request: GenRequest,
    },
    Cancel {
        id: u64,
    },
    Drain,
    /// The front is done: drop the engine's handle (it stops once idle) and say `Stopped`.
    Close,
    /// The engine's metrics, answered with the same `ask`.
    Metrics {
        ask: u64,
    },
}

/// What a replica tells the front.
#[derive(Debug, Clone, PartialEq)]
pub enum ToFront {
    /// Its engine has loaded and takes requests.
    Ready {
        info: ModelInfo,
    },
    Accepted {
        id: u64,
    },
    Refused {
        id: u64,
        error: SubmitError,
    },
    /// One of request `id`'s events, with the requests waiting in its engine after it.
    Event {
        id: u64,
        event: Event,
        waiting: u64,
    },
    Metrics {
        ask: u64,
        families: Vec<MetricFamily>,
    },
    /// Its engine has stopped; nothing more comes for its requests.
    Stopped {
        why: String,
    },
}

/// Appends values to a message.
#[derive(Default)]
pub(super) struct Writer(pub Vec<u8>);

impl Writer {
    pub fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    pub fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub fn i64(&mut self, v: i64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub fn f32(&mut self, v: f32) {
        self.0.extend_from_slice(&v.to_bits().to_le_bytes());
    }
    pub fn f64(&mut self, v: f64) {
        self.0.extend_from_slice(&v.to_bits().to_le_bytes());
    }
    pub fn usize(&mut self, v: usize) {
        self.u64(v as u64);
    }
    pub fn str(&mut self, v: &str) {
        self.usize(v.len());
        self.0.extend_from_slice(v.as_bytes());
    }
    pub fn opt_usize(&mut self, v: Option<usize>) {
        match v {
            Some(v) => {
                self.u8(1);
                self.usize(v);
            }
            None => self.u8(0),
        }
    }
    pub fn i64s(&mut self, v: &[i64]) {
        self.usize(v.len());
        v.iter().for_each(|&x| self.i64(x));
    }
}

/// Takes values from a message, in the order they were written.
pub(super) struct Reader<'a> {
    bytes: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    pub fn new(bytes: &'a [u8], what: &'static str) -> Self {
        Reader { bytes, what }
    }

    pub fn bad(&self, problem: impl Into<String>) -> LinkError {
        LinkError::Corrupt {
            what: self.what,
            problem: problem.into(),
        }
    }

    fn take<const N: usize>(&mut self) -> Result<[u8; N], LinkError> {
        if self.bytes.len() < N {
            return Err(self.bad(format!("ends {N} bytes short of a value")));
        }
        let (head, rest) = self.bytes.split_at(N);
        self.bytes = rest;
        Ok(head.try_into().expect("split at N"))
    }
    pub fn u8(&mut self) -> Result<u8, LinkError> {
        Ok(self.take::<1>()?[0])
    }
    pub fn u64(&mut self) -> Result<u64, LinkError> {
        Ok(u64::from_le_bytes(self.take()?))
    }
    pub fn i64(&mut self) -> Result<i64, LinkError> {
        Ok(i64::from_le_bytes(self.take()?))
    }
    pub fn f32(&mut self) -> Result<f32, LinkError> {
        Ok(f32::from_bits(u32::from_le_bytes(self.take()?)))
    }
    pub fn f64(&mut self) -> Result<f64, LinkError> {
        Ok(f64::from_bits(u64::from_le_bytes(self.take()?)))
    }
    pub fn usize(&mut self) -> Result<usize, LinkError> {
        let v = self.u64()?;
        usize::try_from(v).map_err(|_| self.bad(format!("{v} does not fit this host")))
    }
    /// A count of items of at least `item_bytes` bytes each, no more than the bytes left
    /// could hold.
    pub fn count(&mut self, item_bytes: usize) -> Result<usize, LinkError> {
        let n = self.usize()?;
        if n.checked_mul(item_bytes.max(1))
            .is_none_or(|b| b > self.bytes.len())
        {
            return Err(self.bad(format!(
                "says {n} items follow and {} bytes do",
                self.bytes.len()
            )));
        }
        Ok(n)
    }
    pub fn str(&mut self) -> Result<String, LinkError> {
        let n = self.count(1)?;
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        String::from_utf8(head.to_vec()).map_err(|_| self.bad("a string is not UTF-8"))
    }
    pub fn opt_usize(&mut self) -> Result<Option<usize>, LinkError> {
        match self.u8()? {
            0 => Ok(None),
            1 => self.usize().map(Some),
            t => Err(self.bad(format!("option tag {t}"))),
        }
    }
    pub fn i64s(&mut self) -> Result<Vec<i64>, LinkError> {
        let n = self.count(8)?;
        (0..n).map(|_| self.i64()).collect()
    }
    /// The message is used up: trailing bytes mean sender and receiver disagree.
    pub fn end(self) -> Result<(), LinkError> {
        if self.bytes.is_empty() {
            Ok(())
        } else {
            Err(self.bad(format!("{} bytes left over", self.bytes.len())))
        }
    }
}

impl ToReplica {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        match self {
            ToReplica::Submit { id, request } => {
                w.u8(0);
                w.u64(*id);
                write_request(&mut w, request);
            }
            ToReplica::Cancel { id } => {
                w.u8(1);
                w.u64(*id);
            }
            ToReplica::Drain => w.u8(2),
            ToReplica::Close => w.u8(3),
            ToReplica::Metrics { ask } => {
                w.u8(4);
                w.u64(*ask);
            }
        }
        w.0
    }

    pub fn decode(bytes: &[u8]) -> Result<ToReplica, LinkError> {
        let mut r = Reader::new(bytes, "a message from the front");
        let m = match r.u8()? {
            0 => ToReplica::Submit {
                id: r.u64()?,
                request: read_request(&mut r)?,
            },
            1 => ToReplica::Cancel { id: r.u64()? },
            2 => ToReplica::Drain,
            3 => ToReplica::Close,
            4 => ToReplica::Metrics { ask: r.u64()? },
            t => return Err(r.bad(format!("unknown kind {t}"))),
        };
        r.end()?;
        Ok(m)
    }
}

impl ToFront {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        match self {
            ToFront::Ready { info } => {
                w.u8(0);
                w.str(&info.name);
                w.u64(info.vocab);
                w.usize(info.context);
            }
            ToFront::Accepted { id } => {
                w.u8(1);
                w.u64(*id);
            }
            ToFront::Refused { id, error } => {
                w.u8(2);
                w.u64(*id);
                write_submit_error(&mut w, error);
            }
            ToFront::Event { id, event, waiting } => {
                w.u8(3);
                w.u64(*id);
                w.u64(*waiting);
                write_event(&mut w, event);
            }
            ToFront::Metrics { ask, families } => {
                w.u8(4);
                w.u64(*ask);
                write_families(&mut w, families);
            }
            ToFront::Stopped { why } => {
                w.u8(5);
                w.str(why);
            }
        }
        w.0
    }

    pub fn decode(bytes: &[u8]) -> Result<ToFront, LinkError> {
        let mut r = Reader::new(bytes, "a message from a replica");
        let m = match r.u8()? {
            0 => ToFront::Ready {
                info: ModelInfo {
                    name: r.str()?,
                    vocab: r.u64()?,
                    context: r.usize()?,
                },
            },
            1 => ToFront::Accepted { id: r.u64()? },
            2 => ToFront::Refused {
                id: r.u64()?,
                error: read_submit_error(&mut r)?,
            },
            3 => ToFront::Event {
                id: r.u64()?,
                waiting: r.u64()?,
                event: read_event(&mut r)?,
            },
            4 => ToFront::Metrics {
                ask: r.u64()?,
                families: read_families(&mut r)?,
            },
            5 => ToFront::Stopped { why: r.str()? },
            t => return Err(r.bad(format!("unknown kind {t}"))),
        };
        r.end()?;
        Ok(m)
    }
}

fn write_request(w: &mut Writer, q: &GenRequest) {
    w.i64s(&q.prompt);
    w.usize(q.max_tokens);
    w.usize(q.min_tokens);
    w.f32(q.sampling.temperature);
    w.opt_usize(q.sampling.top_k);
    match q.sampling.top_p {
        Some(p) => {
            w.u8(1);
            w.f32(p);
        }
        None => w.u8(0),
    }
    w.u64(q.sampling.seed);
    w.i64s(&q.stop_ids);
    w.opt_usize(q.logprobs);
}

fn read_request(r: &mut Reader<'_>) -> Result<GenRequest, LinkError> {
    let prompt = r.i64s()?;
    let max_tokens = r.usize()?;
    let min_tokens = r.usize()?;
    let temperature = r.f32()?;
    let top_k = r.opt_usize()?;
    let top_p = match r.u8()? {
        0 => None,
        1 => Some(r.f32()?),
        t => return Err(r.bad(format!("option tag {t}"))),
    };
    Ok(GenRequest {
        prompt,
        max_tokens,
        min_tokens,
        sampling: Sampling {
            temperature,
            top_k,
            top_p,
            seed: r.u64()?,
        },
        stop_ids: r.i64s()?,
        logprobs: r.opt_usize()?,
    })
}

fn write_event(w: &mut Writer, e: &Event) {
    match e {
        Event::Token { id, logprobs } => {
            w.u8(0);
            w.i64(*id);
            match logprobs {
                Some(l) => {
                    w.u8(1);
                    w.f32(l.logprob);
                    w.usize(l.top.len());
                    for &(t, p) in &l.top {
                        w.i64(t);
                        w.f32(p);
                    }
                }
                None => w.u8(0),
            }
        }
        Event::Finished { reason, usage } => {
            w.u8(1);
            w.u8(match reason {
                FinishReason::Stop => 0,
                FinishReason::Length => 1,
                FinishReason::Cancelled => 2,
            });
            w.usize(usage.prompt_tokens);
            w.usize(usage.completion_tokens);
            w.usize(usage.cached_prompt_tokens);
        }
        Event::Failed { message } => {
            w.u8(2);
            w.str(message);
        }
    }
}

fn read_event(r: &mut Reader<'_>) -> Result<Event, LinkError> {
    Ok(match r.u8()? {
        0 => {
            let id = r.i64()?;
            let logprobs = match r.u8()? {
                0 => None,
                1 => {
                    let logprob = r.f32()?;
                    let n = r.count(12)?;
                    let top = (0..n)
                        .map(|_| Ok((r.i64()?, r.f32()?)))
                        .collect::<Result<_, LinkError>>()?;
                    Some(TokenLogprobs { logprob, top })
                }
                t => return Err(r.bad(format!("option tag {t}"))),
            };
            Event::Token { id, logprobs }
        }
        1 => Event::Finished {
            reason: match r.u8()? {
                0 => FinishReason::Stop,
                1 => FinishReason::Length,
                2 => FinishReason::Cancelled,
                t => return Err(r.bad(format!("finish reason {t}"))),
            },
            usage: Usage {
                prompt_tokens: r.usize()?,
                completion_tokens: r.usize()?,
                cached_prompt_tokens: r.usize()?,
            },
        },
        2 => Event::Failed { message: r.str()? },
        t => return Err(r.bad(format!("event kind {t}"))),
    })
}

fn write_submit_error(w: &mut Writer, e: &SubmitError) {
    match e {
        SubmitError::EmptyPrompt => w.u8(0),
        SubmitError::TokenOutOfRange {
            id,
            position,
            vocab,
        } => {
            w.u8(1);
            w.i64(*id);
            w.usize(*position);
            w.u64(*vocab);
        }
        SubmitError::PromptTooLong { prompt, context } => {
            w.u8(2);
            w.usize(*prompt);
            w.usize(*context);
        }
        SubmitError::PoolTooSmall { needed, total } => {
            w.u8(3);
            w.usize(*needed);
            w.usize(*total);
        }
        SubmitError::QueueFull { waiting } => {
            w.u8(4);
            w.usize(*waiting);
        }
        SubmitError::ShuttingDown => w.u8(5),
        SubmitError::Stopped(why) => {
            w.u8(6);
            w.str(why);
        }
    }
}

fn read_submit_error(r: &mut Reader<'_>) -> Result<SubmitError, LinkError> {
    Ok(match r.u8()? {
        0 => SubmitError::EmptyPrompt,
        1 => SubmitError::TokenOutOfRange {
            id: r.i64()?,
            position: r.usize()?,
            vocab: r.u64()?,
        },
        2 => SubmitError::PromptTooLong {
            prompt: r.usize()?,
            context: r.usize()?,
        },
        3 => SubmitError::PoolTooSmall {
            needed: r.usize()?,
            total: r.usize()?,
        },
        4 => SubmitError::QueueFull {
            waiting: r.usize()?,
        },
        5 => SubmitError::ShuttingDown,
        6 => SubmitError::Stopped(r.str()?),
        t => return Err(r.bad(format!("refusal kind {t}"))),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> GenRequest {
        GenRequest {
            prompt: vec![1, -2, i64::MAX],
            max_tokens: 7,
            min_tokens: 2,
            sampling: Sampling {
                temperature: 0.7,
                top_k: Some(5),
                top_p: Some(0.9),
                seed: u64::MAX,
            },
            stop_ids: vec![2],
            logprobs: Some(0),
        }
    }

    fn to_replica() -> Vec<ToReplica> {
        vec![
            ToReplica::Submit {
                id: 3,
                request: request(),
            },
            ToReplica::Submit {
                id: 4,
                request: GenRequest {
                    sampling: Sampling {
                        temperature: 0.0,
                        top_k: None,
                        top_p: None,
                        seed: 0,
                    },
                    logprobs: None,
                    stop_ids: vec![],
                    ..request()
                },
            },
            ToReplica::Cancel { id: 9 },
            ToReplica::Drain,
            ToReplica::Close,
            ToReplica::Metrics { ask: 12 },
        ]
    }

    fn to_front() -> Vec<ToFront> {
        let mut events = vec![
            Event::Token {
                id: 5,
                logprobs: None,
            },
            Event::Token {
                id: 6,
                logprobs: Some(TokenLogprobs {
                    logprob: f32::NEG_INFINITY,
                    top: vec![(6, -0.5), (1, f32::MIN)],
                }),
            },
            Event::Failed {
                message: "ranks gone — ü".into(),
            },
        ];
        for reason in [
            FinishReason::Stop,
            FinishReason::Length,
            FinishReason::Cancelled,
        ] {
            events.push(Event::Finished {
                reason,
                usage: Usage {
                    prompt_tokens: 3,
                    completion_tokens: 4,
                    cached_prompt_tokens: 1,
                },
            });
        }
        let errors = [
            SubmitError::EmptyPrompt,
            SubmitError::TokenOutOfRange {
                id: -1,
                position: 2,
                vocab: 100,
            },
            SubmitError::PromptTooLong {
                prompt: 9,
                context: 8,
            },
            SubmitError::PoolTooSmall {
                needed: 4,
                total: 3,
            },
            SubmitError::QueueFull { waiting: 10 },
            SubmitError::ShuttingDown,
            SubmitError::Stopped("why".into()),
        ];
        let mut all = vec![
            ToFront::Ready {
                info: ModelInfo {
                    name: "llama".into(),
                    vocab: 256,
                    context: 64,
                },
            },
            ToFront::Accepted { id: 1 },
            ToFront::Metrics {
                ask: 2,
                families: vec![],
            },
            ToFront::Stopped {
                why: "drained".into(),
            },
        ];
        all.extend(
            errors
                .into_iter()
                .map(|error| ToFront::Refused { id: 8, error }),
        );
        all.extend(events.into_iter().map(|event| ToFront::Event {
            id: 7,
            event,
            waiting: 3,
        }));
        all
    }

    #[test]
    fn every_message_comes_back_as_it_went() {
        for m in to_replica() {
            assert_eq!(ToReplica::decode(&m.encode()).unwrap(), m);
        }
        for m in to_front() {
            assert_eq!(ToFront::decode(&m.encode()).unwrap(), m);
        }
    }

    /// Every prefix and a one-byte extension of `bytes` fail to decode with `decode`.
    fn refuses_cut_and_padded<T>(bytes: &[u8], decode: impl Fn(&[u8]) -> Result<T, LinkError>) {
        for cut in 0..bytes.len() {
            assert!(
                decode(&bytes[..cut]).is_err(),
                "a message cut at {cut} decoded"
            );
        }
        let mut long = bytes.to_vec();
        long.push(0);
        let err = decode(&long).err().expect("a padded message decoded");
        assert!(err.to_string().contains("left over"), "{err}");
    }

    #[test]
    fn cut_or_padded_messages_are_errors_not_panics() {
        for m in to_replica() {
            refuses_cut_and_padded(&m.encode(), ToReplica::decode);
        }
        for m in to_front() {
            refuses_cut_and_padded(&m.encode(), ToFront::decode);
        }
        // A length far past the message is refused before allocating.
        let mut w = Writer::default();
        w.u8(0);
        w.u64(1);
        w.u64(u64::MAX / 2);
        let err = ToReplica::decode(&w.0).unwrap_err().to_string();
        assert!(err.contains("items follow"), "{err}");
        let err = ToFront::decode(&[9]).unwrap_err().to_string();
        assert!(err.contains("unknown kind 9"), "{err}");
    }
}
