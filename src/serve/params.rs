//! The sampling and length parameters both completion endpoints share: read from the body,
//! checked, filled from the model folder's defaults, and turned into a [`GenRequest`].

use super::api_error::ApiError;
use super::fields::Fields;
use super::text_side::TextSide;
use crate::runtime::engine::api::{GenRequest, ModelInfo};
use crate::runtime::sampling::Sampling;

/// The most top log-probabilities a request may ask for (vLLM's default limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// The parameters as the client gave them; `None` where it gave none.
#[derive(Debug, Clone, Default)]
pub struct Common {
    pub model: Option<String>,
    /// The value and the name it came under (`max_tokens` or `max_completion_tokens`).
    pub max_tokens: Option<(i64, &'static str)>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub seed: Option<i64>,
    pub stop: Vec<String>,
    /// vLLM's extension: ids that end generation besides the model's EOS ids (kept with
    /// `ignore_eos`); returned and counted, not in the text.
    pub stop_token_ids: Vec<i64>,
    /// Top log-probabilities per token, when the client asked for log-probabilities.
    pub logprobs: Option<usize>,
    pub stream: bool,
    pub include_usage: bool,
    pub ignore_eos: bool,
    pub min_tokens: i64,
    /// vLLM's extension: the generated (and prompt) token ids in the response.
    pub return_token_ids: bool,
}

/// Reads the shared parameters; `length_names` are the names `max_tokens` may come under,
/// the first one found wins. Refuses what this server does not do rather than ignore it.
pub fn read_common(f: &Fields, length_names: &[&'static str]) -> Result<Common, ApiError> {
    let mut c = Common {
        model: f.str("model")?.map(str::to_string),
        temperature: f.f64("temperature")?,
        top_p: f.f64("top_p")?,
        top_k: f.i64("top_k")?,
        seed: f.i64("seed")?,
        stop: f.strings("stop")?,
        stop_token_ids: f.ids("stop_token_ids")?,
        stream: f.bool("stream")?.unwrap_or(false),
        ignore_eos: f.bool("ignore_eos")?.unwrap_or(false),
        min_tokens: f.i64("min_tokens")?.unwrap_or(0),
        return_token_ids: f.bool("return_token_ids")?.unwrap_or(false),
        ..Common::default()
    };
    for name in length_names {
        if let Some(v) = f.i64(name)? {
            c.max_tokens = Some((v, name));
            break;
        }
    }
    if let Some(options) = f.object("stream_options")? {
        c.include_usage = options.bool("include_usage")?.unwrap_or(false);
        if !c.stream {
            return Err(ApiError::param(
                "stream_options",
                "`stream_options` is only for streamed responses; set `stream` to true or drop it",
            ));
        }
    }
    match f.i64("n")? {
        None | Some(1) => {}
        Some(n) => {
            return Err(ApiError::param(
                "n",
                format!("`n` is {n}; this server makes one choice per request (n = 1); send {n} requests instead"),
            ))
        }
    }
    match f.i64("best_of")? {
        None | Some(1) => {}
        Some(n) => {
            return Err(ApiError::param(
                "best_of",
                format!(
                    "`best_of` is {n}; this server makes one candidate per request (best_of = 1)"
                ),
            ))
        }
    }
    for (name, neutral) in [
        ("frequency_penalty", 0.0),
        ("presence_penalty", 0.0),
        ("repetition_penalty", 1.0),
    ] {
        if let Some(v) = f.f64(name)? {
            if v != neutral {
                return Err(ApiError::param(
                    name,
                    format!(
                        "`{name}` {v} is not supported by this server; drop it or send {neutral}"
                    ),
                ));
            }
        }
    }
    if let Some(bias) = f.object("logit_bias")? {
        if !bias.0.is_empty() {
            return Err(ApiError::param(
                "logit_bias",
                "`logit_bias` is not supported by this server; drop it",
            ));
        }
    }
    Ok(c)
}

/// Checks the parameters against the prompt and the model and makes the engine's request.
/// `prompt_param` names the prompt's field in messages; `default_max` is the endpoint's
/// length when the client gives none (`None`: the rest of the context), capped by
/// generation_config.json's `max_new_tokens`.
pub fn gen_request(
    c: &Common,
    prompt: Vec<i64>,
    prompt_param: &str,
    default_max: Option<usize>,
    info: &ModelInfo,
    text: &TextSide,
) -> Result<GenRequest, ApiError> {
    if prompt.is_empty() {
        return Err(ApiError::param(
            prompt_param,
            format!("`{prompt_param}` gives no tokens; give at least one"),
        ));
    }
    if let Some((at, &id)) = prompt
        .iter()
        .enumerate()
        .find(|(_, &id)| id < 0 || id as u64 >= info.vocab)
    {
        return Err(ApiError::param(
            prompt_param,
            format!(
                "token id {id} at position {at} is outside the vocabulary: ids run from 0 to {}",
                info.vocab.saturating_sub(1)
            ),
        ));
    }
    if prompt.len() >= info.context {
        return Err(ApiError::param(
            prompt_param,
            format!(
                "the prompt has {} tokens and this model's context is {} tokens, which leaves no room for a new token; shorten the prompt",
                prompt.len(),
                info.context
            ),
        ));
    }
    let room = info.context - prompt.len();
    let max_tokens = match c.max_tokens {
        Some((v, name)) => {
            if v < 1 {
                return Err(ApiError::param(
                    name,
                    format!("`{name}` is {v}; give at least 1"),
                ));
            }
            if v as u64 > room as u64 {
                return Err(ApiError::param(
                    name,
                    format!(
                        "`{name}` is {v}, but the prompt has {} tokens and this model's context is {} tokens, so at most {room} new tokens fit; lower `{name}` or shorten the prompt",
                        prompt.len(),
                        info.context
                    ),
                ));
            }
            v as usize
        }
        // The endpoint's default, capped by generation_config.json's (as vLLM).
        None => {
            let mut m = default_max.unwrap_or(room);
            if let Some(g) = text.defaults.max_new_tokens {
                m = m.min(g);
            }
            m.clamp(1, room)
        }
    };
    if c.min_tokens < 0 || c.min_tokens as u64 > max_tokens as u64 {
        return Err(ApiError::param(
            "min_tokens",
            format!(
                "`min_tokens` is {}; give 0 to {max_tokens} (at most the request's max tokens)",
                c.min_tokens
            ),
        ));
    }
    if let Some(&id) = c
        .stop_token_ids
        .iter()
        .find(|&&id| id < 0 || id as u64 >= info.vocab)
    {
        return Err(ApiError::param(
            "stop_token_ids",
            format!(
                "stop token id {id} is outside the vocabulary: ids run from 0 to {}",
                info.vocab.saturating_sub(1)
            ),
        ));
    }
    let sampling = sampling(c, text)?;
    if !c.stop.is_empty() && text.tokenizer.is_none() {
        return Err(ApiError::param(
            "stop",
            "stop strings need the model's tokenizer, and this model folder has no tokenizer.json; drop `stop`",
        ));
    }
    Ok(GenRequest {
        prompt,
        max_tokens,
        min_tokens: c.min_tokens as usize,
        sampling,
        stop_ids: {
            let mut ids = if c.ignore_eos {
                vec![]
            } else {
                text.eos.clone()
            };
            ids.extend(c.stop_token_ids.iter().filter(|&id| !text.eos.contains(id)));
            ids
        },
        logprobs: c.logprobs,
    })
}

/// Temperature, top-p and top-k from the request, else generation_config.json, else
/// temperature 1 (as vLLM); temperature 0 is greedy and then top-p and top-k are moot.
fn sampling(c: &Common, text: &TextSide) -> Result<Sampling, ApiError> {
    let d = &text.defaults;
    let temperature = c.temperature.or(d.temperature).unwrap_or(1.0);
    if !temperature.is_finite() || temperature < 0.0 || temperature > f32::MAX as f64 {
        return Err(ApiError::param(
            "temperature",
            format!("`temperature` is {temperature}; give 0 (greedy) or a finite number above 0"),
        ));
    }
    let top_p = c.top_p.or(d.top_p).unwrap_or(1.0);
    // Written so that NaN fails too.
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::param(
            "top_p",
            format!("`top_p` is {top_p}; give a probability mass in (0, 1], such as 0.9"),
        ));
    }
    let top_k = c.top_k.or(d.top_k).unwrap_or(-1);
    if top_k < -1 {
        return Err(ApiError::param(
            "top_k",
            format!("`top_k` is {top_k}; give at least 1, or -1 (or 0) for no limit"),
        ));
    }
    let seed = match c.seed {
        Some(s) => s as u64,
        None => fresh_seed(),
    };
    if temperature == 0.0 {
        return Ok(Sampling {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            seed,
        });
    }
    Ok(Sampling {
        temperature: temperature as f32,
        top_k: (top_k >= 1).then(|| usize::try_from(top_k).unwrap_or(usize::MAX)),
        // A mass too small for f32 keeps the best token only, as it would in f64.
        top_p: (top_p < 1.0).then_some((top_p as f32).max(f32::MIN_POSITIVE)),
        seed,
    })
}

/// A seed for a request that gave none: differs between requests, as OpenAI's sampling does.
fn fresh_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNT.fetch_add(1, Ordering::Relaxed));
    h.finish()
}
