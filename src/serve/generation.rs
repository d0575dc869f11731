//! One request's run on the engine as the server sees it: submitted, its events turned into
//! steps of settled text (stop ids returned but left out of the text, stop strings found, partial characters held),
//! and cancelled when the server stops listening before it finished (a client that went
//! away drops the [`Generation`]).

use super::api_error::ApiError;
use super::text_emitter::TextEmitter;
use super::text_side::TextSide;
use crate::runtime::engine::api::{
    Event, FinishReason, GenRequest, RequestId, Serving, SubmitError, Usage,
};
use std::sync::Arc;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// A log-probability that JSON can carry (vLLM's floor for -inf).
fn finite(lp: f32) -> f32 {
    if lp.is_nan() {
        -9999.0
    } else {
        lp.max(-9999.0)
    }
}

/// One generated token as the response shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenOut {
    pub id: i64,
    /// Its text, where log-probabilities were asked for (they list it); else empty.
    pub text: String,
    /// With log-probabilities asked for: the token's and the most likely ones'.
    pub logprob: Option<f32>,
    pub top: Vec<(String, f32)>,
    /// The ids of `top`, in its order.
    pub top_ids: Vec<i64>,
}

/// How a generation ended, as OpenAI names it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Finish {
    pub reason: &'static str,
    pub usage: Usage,
}

/// What one engine event adds to the response.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Step {
    pub text: String,
    pub token: Option<TokenOut>,
    pub finish: Option<Finish>,
}

/// A submitted request, until it finishes or is dropped (then it is cancelled).
pub struct Generation {
    engine: Arc<dyn Serving>,
    text_side: Arc<TextSide>,
    id: RequestId,
    events: UnboundedReceiver<Event>,
    stop_ids: Vec<i64>,
    min_tokens: usize,
    prompt_tokens: usize,
    /// Tokens the engine generated (the stop id included).
    generated: usize,
    /// The tokens of the text (the stop id left out).
    ids: Vec<i64>,
    /// Every generated token (the stop id included), as `token_ids` returns them.
    returned: Vec<i64>,
    emitter: TextEmitter,
    finished: bool,
}

/// The response status of a request the engine refused.
pub fn submit_error(e: SubmitError) -> ApiError {
    match e {
        SubmitError::QueueFull { .. } | SubmitError::ShuttingDown => {
            ApiError::unavailable(e.to_string())
        }
        SubmitError::Stopped(_) => ApiError::internal(e.to_string()),
        SubmitError::EmptyPrompt
        | SubmitError::TokenOutOfRange { .. }
        | SubmitError::PromptTooLong { .. }
        | SubmitError::PoolTooSmall { .. } => ApiError::param("prompt", e.to_string()),
    }
}

impl Generation {
    pub fn start(
        engine: Arc<dyn Serving>,
        text_side: Arc<TextSide>,
        request: GenRequest,
        stops: Vec<String>,
    ) -> Result<Generation, ApiError> {
        let (tx, events) = unbounded_channel();
        let stop_ids = request.stop_ids.clone();
        let min_tokens = request.min_tokens;
        let prompt_tokens = request.prompt.len();
        // The receiver gone (the response dropped) is no error for the engine.
        let sink = Box::new(move |event| {
            let _ = tx.send(event);
        });
        let id = engine.submit(request, sink).map_err(submit_error)?;
        Ok(Generation {
            engine,
            text_side,
            id,
            events,
            stop_ids,
            min_tokens,
            prompt_tokens,
            generated: 0,
            ids: Vec::new(),
            returned: Vec::new(),
            emitter: TextEmitter::new(stops),
            finished: false,
        })
    }

    /// The generated ids so far, the stop id included (its text is left out).
    pub fn token_ids(&self) -> &[i64] {
        &self.returned
    }

    /// The next step; `None` once the generation has finished.
    pub async fn next(&mut self) -> Option<Result<Step, ApiError>> {
        if self.finished {
            return None;
        }
        let event = self.events.recv().await;
        Some(self.on(event))
    }

    fn on(&mut self, event: Option<Event>) -> Result<Step, ApiError> {
        match event {
            None => {
                self.finished = true;
                Err(ApiError::internal(
                    "the engine dropped the request without finishing it",
                ))
            }
            Some(Event::Failed { message }) => {
                self.finished = true;
                Err(ApiError::internal(format!(
                    "the engine failed to run the request: {message}"
                )))
            }
            Some(Event::Finished { reason, usage }) => {
                self.finished = true;
                let full = self.decode()?;
                let text = self.emitter.advance(&full, true).text;
                let reason = match reason {
                    FinishReason::Stop => "stop",
                    FinishReason::Length => "length",
                    FinishReason::Cancelled => "abort",
                };
                Ok(Step {
                    text,
                    token: None,
                    finish: Some(Finish { reason, usage }),
                })
            }
            Some(Event::Token { id, logprobs }) => {
                let index = self.generated;
                self.generated += 1;
                let after = self.ids.last().copied();
                let token = match logprobs {
                    Some(lp) => TokenOut {
                        id,
                        text: self.token_text(id, after),
                        logprob: Some(finite(lp.logprob)),
                        top: lp
                            .top
                            .iter()
                            .map(|&(t, l)| (self.token_text(t, after), finite(l)))
                            .collect(),
                        top_ids: lp.top.iter().map(|&(t, _)| t).collect(),
                    },
                    None => TokenOut {
                        id,
                        text: String::new(),
                        logprob: None,
                        top: vec![],
                        top_ids: vec![],
                    },
                };
                self.returned.push(id);
                if index >= self.min_tokens && self.stop_ids.contains(&id) {
                    // The stop id: returned and counted (as in HF and vLLM), never text;
                    // `Finished` follows.
                    return Ok(Step {
                        text: String::new(),
                        token: Some(token),
                        finish: None,
                    });
                }
                self.ids.push(id);
                let full = self.decode()?;
                let advance = self.emitter.advance(&full, false);
                let finish = if advance.stopped {
                    // A stop string: the request ends here, whatever the engine says next.
                    self.finished = true;
                    self.engine.cancel(self.id);
                    Some(Finish {
                        reason: "stop",
                        usage: Usage {
                            prompt_tokens: self.prompt_tokens,
                            completion_tokens: self.generated,
                            cached_prompt_tokens: 0,
                        },
                    })
                } else {
                    None
                };
                Ok(Step {
                    text: advance.text,
                    token: Some(token),
                    finish,
                })
            }
        }
    }

    fn decode(&self) -> Result<String, ApiError> {
        match &self.text_side.tokenizer {
            None => Ok(String::new()),
            Some(t) => t
                .decode(&self.ids)
                .map_err(|e| ApiError::internal(format!("cannot decode the output: {e}"))),
        }
    }

    fn token_text(&self, id: i64, after: Option<i64>) -> String {
        self.text_side
            .tokenizer
            .as_ref()
            .and_then(|t| t.token_text(id, after))
            .unwrap_or_else(|| format!("token_id:{id}"))
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        if !self.finished {
            self.engine.cancel(self.id);
        }
    }
}
