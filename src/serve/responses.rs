//! The JSON of responses and stream chunks, in OpenAI's shapes.

use super::generation::{Finish, TokenOut};
use crate::runtime::engine::api::Usage;
use serde_json::{json, Map, Value};

pub fn usage(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens.saturating_add(u.completion_tokens),
        "prompt_tokens_details": { "cached_tokens": u.cached_prompt_tokens },
    })
}

/// The completions shape: parallel lists of token texts, their log-probabilities, the top
/// few per position, and where each token starts in the text (`offset` carries it over
/// the chunks of a stream).
pub fn completion_logprobs(tokens: &[TokenOut], offset: &mut usize) -> Value {
    let mut texts = Vec::new();
    let mut lps = Vec::new();
    let mut tops = Vec::new();
    let mut offsets = Vec::new();
    for t in tokens {
        texts.push(Value::from(t.text.clone()));
        lps.push(json!(t.logprob));
        let mut top = Map::new();
        for (text, lp) in &t.top {
            top.entry(text.clone()).or_insert(json!(lp));
        }
        tops.push(Value::Object(top));
        offsets.push(json!(*offset));
        *offset = offset.saturating_add(t.text.chars().count());
    }
    json!({
        "tokens": texts,
        "token_logprobs": lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    })
}

/// The chat shape: one entry per token with its bytes and the top few.
pub fn chat_logprobs(tokens: &[TokenOut]) -> Value {
    let entry =
        |text: &str, lp: f32| json!({ "token": text, "logprob": lp, "bytes": text.as_bytes() });
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let mut e = entry(&t.text, t.logprob.unwrap_or(0.0));
            e["top_logprobs"] = t.top.iter().map(|(text, lp)| entry(text, *lp)).collect();
            e
        })
        .collect();
    json!({ "content": content, "refusal": null })
}

/// Which endpoint a response is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

/// What every response and chunk of one request shares.
#[derive(Debug, Clone)]
pub struct Head {
    pub endpoint: Endpoint,
    pub id: String,
    pub created: u64,
    pub model: String,
    pub want_logprobs: bool,
    pub return_token_ids: bool,
}

impl Head {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Completions, _) => "text_completion",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
        }
    }

    fn logprobs(&self, tokens: &[TokenOut], offset: &mut usize) -> Value {
        if !self.want_logprobs {
            return Value::Null;
        }
        match self.endpoint {
            Endpoint::Completions => completion_logprobs(tokens, offset),
            Endpoint::Chat => chat_logprobs(tokens),
        }
    }

    fn wrap(&self, chunk: bool, choices: Value) -> Map<String, Value> {
        let mut m = Map::new();
        m.insert("id".into(), json!(self.id));
        m.insert("object".into(), json!(self.object(chunk)));
        m.insert("created".into(), json!(self.created));
        m.insert("model".into(), json!(self.model));
        m.insert("choices".into(), choices);
        m
    }

    /// The whole response of a request that was not streamed.
    pub fn response(
        &self,
        text: &str,
        tokens: &[TokenOut],
        ids: &[i64],
        prompt: &[i64],
        finish: &Finish,
    ) -> Value {
        let logprobs = self.logprobs(tokens, &mut 0);
        let mut choice = match self.endpoint {
            Endpoint::Completions => json!({
                "index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish.reason,
            }),
            Endpoint::Chat => json!({
                "index": 0,
                "message": { "role": "assistant", "content": text },
                "logprobs": logprobs,
                "finish_reason": finish.reason,
            }),
        };
        let mut m = self.wrap(false, json!([]));
        if self.return_token_ids {
            choice["token_ids"] = json!(ids);
            m.insert("prompt_token_ids".into(), json!(prompt));
        }
        m.insert("choices".into(), json!([choice]));
        m.insert("usage".into(), usage(&finish.usage));
        Value::Object(m)
    }

    /// One chunk of a stream: new text, its tokens, and the finish reason on the last.
    /// `usage_null`: the client asked for usage, so every chunk carries `usage: null` but
    /// the final usage chunk.
    pub fn chunk(
        &self,
        text: &str,
        tokens: &[TokenOut],
        finish: Option<&Finish>,
        offset: &mut usize,
        usage_null: bool,
    ) -> Value {
        let logprobs = self.logprobs(tokens, offset);
        let reason = finish.map(|f| f.reason);
        let mut choice = match self.endpoint {
            Endpoint::Completions => json!({
                "index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason,
            }),
            Endpoint::Chat => {
                let delta = if text.is_empty() && finish.is_some() {
                    json!({})
                } else {
                    json!({ "content": text })
                };
                json!({ "index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason })
            }
        };
        if self.return_token_ids {
            choice["token_ids"] = json!(tokens.iter().map(|t| t.id).collect::<Vec<_>>());
        }
        let mut m = self.wrap(true, json!([choice]));
        if usage_null {
            m.insert("usage".into(), Value::Null);
        }
        Value::Object(m)
    }

    /// A chat stream's first chunk: the assistant's role.
    pub fn role_chunk(&self, usage_null: bool) -> Value {
        let choice = json!({
            "index": 0,
            "delta": { "role": "assistant", "content": "" },
            "logprobs": null,
            "finish_reason": null,
        });
        let mut m = self.wrap(true, json!([choice]));
        if usage_null {
            m.insert("usage".into(), Value::Null);
        }
        Value::Object(m)
    }

    /// The usage chunk after the last (`stream_options.include_usage`).
    pub fn usage_chunk(&self, u: &Usage) -> Value {
        let mut m = self.wrap(true, json!([]));
        m.insert("usage".into(), usage(u));
        Value::Object(m)
    }
}
