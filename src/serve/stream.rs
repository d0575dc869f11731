//! A streamed response: server-sent events, one chunk per step with text, the usage chunk
//! when asked for, then `data: [DONE]`. The stream owns the [`Generation`], so a client that
//! disconnects (hyper drops the body) cancels the request.

use super::generation::{Generation, Step};
use super::responses::{Endpoint, Head};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use std::collections::VecDeque;
use std::convert::Infallible;

struct State {
    generation: Generation,
    head: Head,
    include_usage: bool,
    /// Where the next token starts in the text (completions' `text_offset`).
    offset: usize,
    queue: VecDeque<String>,
    done: bool,
}

impl State {
    fn on_step(&mut self, step: Step) {
        let tokens: Vec<_> = step.token.into_iter().collect();
        let worth_sending = !step.text.is_empty()
            || step.finish.is_some()
            || ((self.head.want_logprobs || self.head.return_token_ids) && !tokens.is_empty());
        if worth_sending {
            let chunk = self.head.chunk(
                &step.text,
                &tokens,
                step.finish.as_ref(),
                &mut self.offset,
                self.include_usage,
            );
            self.queue.push_back(chunk.to_string());
        }
        if let Some(finish) = step.finish {
            if self.include_usage {
                self.queue
                    .push_back(self.head.usage_chunk(&finish.usage).to_string());
            }
            self.finish();
        }
    }

    fn finish(&mut self) {
        self.queue.push_back("[DONE]".into());
        self.done = true;
    }
}

/// The event-stream response of a started generation.
pub fn respond(generation: Generation, head: Head, include_usage: bool) -> Response {
    let mut queue = VecDeque::new();
    if head.endpoint == Endpoint::Chat {
        queue.push_back(head.role_chunk(include_usage).to_string());
    }
    let state = State {
        generation,
        head,
        include_usage,
        offset: 0,
        queue,
        done: false,
    };
    let events = futures_util::stream::unfold(state, |mut st| async move {
        loop {
            if let Some(data) = st.queue.pop_front() {
                return Some((Ok::<_, Infallible>(Event::default().data(data)), st));
            }
            if st.done {
                return None;
            }
            match st.generation.next().await {
                Some(Ok(step)) => st.on_step(step),
                Some(Err(e)) => {
                    st.queue.push_back(e.body().to_string());
                    st.finish();
                }
                None => st.finish(),
            }
        }
    });
    Sse::new(events).into_response()
}
