//! The routes and their handlers over one engine and one model folder's text side.

use super::api_error::ApiError;
use super::chat_template::{ChatContext, ChatTemplate};
use super::fields::{kind_of, Fields};
use super::generation::{Finish, Generation, TokenOut};
use super::params::{gen_request, read_common, Common, MAX_TOP_LOGPROBS};
use super::responses::{Endpoint, Head};
use super::stream;
use super::text_side::TextSide;
use crate::runtime::engine::api::Serving;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// What every handler shares.
pub struct App {
    pub engine: Arc<dyn Serving>,
    pub text: Arc<TextSide>,
    pub template: Option<ChatTemplate>,
    /// When the server started (seconds since the epoch): the model's `created`.
    pub created: u64,
    pub max_body_bytes: usize,
    pub next_id: AtomicU64,
}

pub fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

pub fn router(app: Arc<App>) -> Router {
    let limit = app.max_body_bytes;
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(|uri: Uri| async move { ApiError::not_found_path(uri.path()) })
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed() })
        .layer(DefaultBodyLimit::max(limit))
        .with_state(app)
}

fn respond(result: Result<Response, ApiError>) -> Response {
    result.unwrap_or_else(IntoResponse::into_response)
}

/// The body as JSON: over the limit → 413, not JSON → 400.
fn parse_body(app: &App, body: Result<Bytes, BytesRejection>) -> Result<Value, ApiError> {
    let bytes = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(app.max_body_bytes)
        } else {
            ApiError::invalid(format!("cannot read the request body: {rejection}"))
        }
    })?;
    serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::invalid(format!("the request body is not valid JSON: {e}")))
}

fn check_model(app: &App, c: &Common) -> Result<(), ApiError> {
    let served = &app.engine.info().name;
    match &c.model {
        Some(m) if m != served => Err(ApiError::model_not_found(m, served)),
        _ => Ok(()),
    }
}

fn head(app: &App, endpoint: Endpoint, c: &Common) -> Head {
    let n = app.next_id.fetch_add(1, Ordering::Relaxed);
    let prefix = match endpoint {
        Endpoint::Completions => "cmpl",
        Endpoint::Chat => "chatcmpl",
    };
    Head {
        endpoint,
        id: format!("{prefix}-{:x}{n:x}", app.created),
        created: now_secs(),
        model: app.engine.info().name.clone(),
        want_logprobs: c.logprobs.is_some(),
        return_token_ids: c.return_token_ids,
    }
}

/// Runs a started generation to its end, or streams it.
async fn finish(
    mut generation: Generation,
    head: Head,
    c: &Common,
    prompt: Vec<i64>,
) -> Result<Response, ApiError> {
    if c.stream {
        return Ok(stream::respond(generation, head, c.include_usage));
    }
    let mut text = String::new();
    let mut tokens: Vec<TokenOut> = Vec::new();
    let mut end: Option<Finish> = None;
    while let Some(step) = generation.next().await {
        let step = step?;
        text.push_str(&step.text);
        tokens.extend(step.token);
        if step.finish.is_some() {
            end = step.finish;
        }
    }
    let end = end.ok_or_else(|| ApiError::internal("the request ended without a finish"))?;
    let body = head.response(&text, &tokens, generation.token_ids(), &prompt, &end);
    Ok(json_response(&body))
}

fn json_response(body: &Value) -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn no_tokenizer(param: &str) -> ApiError {
    ApiError::param(
        param,
        "this model folder has no tokenizer.json, so text cannot be tokenized; give the prompt as token ids",
    )
}

/// `prompt`: a string, a list of one string, a list of ids, or a list of one list of ids.
pub(crate) fn completion_prompt(text: &TextSide, f: &Fields) -> Result<Vec<i64>, ApiError> {
    let encode = |s: &str| -> Result<Vec<i64>, ApiError> {
        let t = text
            .tokenizer
            .as_ref()
            .ok_or_else(|| no_tokenizer("prompt"))?;
        t.encode(s)
            .map_err(|e| ApiError::param("prompt", e.to_string()))
    };
    let ids = |items: &[Value]| -> Result<Vec<i64>, ApiError> {
        items
            .iter()
            .map(|v| {
                v.as_i64().ok_or_else(|| {
                    ApiError::param(
                        "prompt",
                        format!(
                            "a token-id prompt must hold whole numbers only, found {}",
                            kind_of(v)
                        ),
                    )
                })
            })
            .collect()
    };
    let one_only = || {
        ApiError::param(
            "prompt",
            "`prompt` holds several prompts; this server takes one per request: send them as separate requests",
        )
    };
    match f.get("prompt") {
        None => Err(ApiError::param(
            "prompt",
            "`prompt` is required: a string or a list of token ids",
        )),
        Some(Value::String(s)) => encode(s),
        Some(Value::Array(items)) => match items.first() {
            None => Err(ApiError::param(
                "prompt",
                "`prompt` is an empty list; give text or token ids",
            )),
            Some(Value::String(s)) if items.len() == 1 => encode(s),
            Some(Value::Array(inner)) if items.len() == 1 => ids(inner),
            Some(Value::String(_)) | Some(Value::Array(_)) => Err(one_only()),
            Some(_) => ids(items),
        },
        Some(v) => Err(ApiError::param(
            "prompt",
            format!(
                "`prompt` must be a string or a list of token ids, found {}",
                kind_of(v)
            ),
        )),
    }
}

async fn completions(State(app): State<Arc<App>>, body: Result<Bytes, BytesRejection>) -> Response {
    respond(completions_inner(app, body).await)
}

async fn completions_inner(
    app: Arc<App>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let json = parse_body(&app, body)?;
    let f = Fields::of(&json)?;
    let mut c = read_common(&f, &["max_tokens"])?;
    check_model(&app, &c)?;
    if f.bool("echo")?.unwrap_or(false) {
        return Err(ApiError::param(
            "echo",
            "`echo` is not supported by this server; drop it or send false",
        ));
    }
    if f.str("suffix")?.is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::param(
            "suffix",
            "`suffix` is not supported by this server; drop it",
        ));
    }
    c.logprobs = completion_logprobs(&f)?;
    let prompt = completion_prompt(&app.text, &f)?;
    // OpenAI's default length for completions.
    let request = gen_request(
        &c,
        prompt.clone(),
        "prompt",
        Some(16),
        app.engine.info(),
        &app.text,
    )?;
    let head = head(&app, Endpoint::Completions, &c);
    let generation = Generation::start(
        app.engine.clone(),
        app.text.clone(),
        request,
        c.stop.clone(),
    )?;
    finish(generation, head, &c, prompt).await
}

/// The completions endpoint's `logprobs`: how many top log-probabilities per token.
pub(crate) fn completion_logprobs(f: &Fields) -> Result<Option<usize>, ApiError> {
    match f.i64("logprobs")? {
        None => Ok(None),
        Some(k) if (0..=MAX_TOP_LOGPROBS as i64).contains(&k) => Ok(Some(k as usize)),
        Some(k) => Err(ApiError::param(
            "logprobs",
            format!("`logprobs` is {k}; give 0 to {MAX_TOP_LOGPROBS} (the top log-probabilities per token)"),
        )),
    }
}

/// A message's `content` as text: a string, or a list of text parts joined by newlines.
fn message_text(content: &Value, at: usize) -> Result<Value, ApiError> {
    match content {
        Value::Null | Value::String(_) => Ok(content.clone()),
        Value::Array(parts) => {
            let mut texts = Vec::new();
            for part in parts {
                match (part.get("type").and_then(Value::as_str), part.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => texts.push(t),
                    _ => {
                        return Err(ApiError::param(
                            "messages",
                            format!("message {at} has a content part that is not text (`{{\"type\": \"text\", \"text\": …}}`); this server takes text only"),
                        ))
                    }
                }
            }
            Ok(Value::from(texts.join("\n")))
        }
        v => Err(ApiError::param(
            "messages",
            format!(
                "message {at}'s `content` must be a string or a list of text parts, found {}",
                kind_of(v)
            ),
        )),
    }
}

/// `messages` checked (each an object with a string `role`) and its contents made text.
fn chat_messages(f: &Fields) -> Result<Value, ApiError> {
    let items = match f.get("messages") {
        None => {
            return Err(ApiError::param(
                "messages",
                "`messages` is required: a list of {\"role\", \"content\"} objects",
            ))
        }
        Some(Value::Array(items)) if !items.is_empty() => items,
        Some(Value::Array(_)) => {
            return Err(ApiError::param(
                "messages",
                "`messages` is empty; give at least one message",
            ))
        }
        Some(v) => {
            return Err(ApiError::param(
                "messages",
                format!(
                    "`messages` must be a list of messages, found {}",
                    kind_of(v)
                ),
            ))
        }
    };
    let mut out = Vec::with_capacity(items.len());
    for (at, item) in items.iter().enumerate() {
        let Some(obj) = item.as_object() else {
            return Err(ApiError::param(
                "messages",
                format!(
                    "message {at} must be an object with `role` and `content`, found {}",
                    kind_of(item)
                ),
            ));
        };
        if !obj.get("role").is_some_and(Value::is_string) {
            return Err(ApiError::param(
                "messages",
                format!(
                    "message {at} needs a string `role` (\"system\", \"user\" or \"assistant\")"
                ),
            ));
        }
        let mut obj = obj.clone();
        let content = message_text(obj.get("content").unwrap_or(&Value::Null), at)?;
        obj.insert("content".into(), content);
        out.push(Value::Object(obj));
    }
    Ok(Value::Array(out))
}

/// The prompt ids of a chat request's `messages`: rendered with the model's chat template
/// (`add_generation_prompt`, default true), then tokenized without added special tokens.
pub(crate) fn chat_prompt(
    text: &TextSide,
    template: Option<&ChatTemplate>,
    name: &str,
    f: &Fields,
) -> Result<Vec<i64>, ApiError> {
    let messages = chat_messages(f)?;
    let template = template.ok_or_else(|| {
        ApiError::invalid(format!(
            "the model `{name}` has no chat template (its tokenizer_config.json has no `chat_template`), so it cannot take chat messages; use /v1/completions with a prompt"
        ))
    })?;
    let tokenizer = text
        .tokenizer
        .as_ref()
        .ok_or_else(|| no_tokenizer("messages"))?;
    let ctx = ChatContext {
        bos_token: text.bos_token.as_deref(),
        eos_token: text.eos_token.as_deref(),
        add_generation_prompt: f.bool("add_generation_prompt")?.unwrap_or(true),
    };
    let rendered = template.render(&messages, &ctx).map_err(|e| {
        ApiError::param(
            "messages",
            format!("the model's chat template refused the messages: {e}"),
        )
    })?;
    // The template wrote the special tokens; none are added again.
    tokenizer
        .encode_plain(&rendered)
        .map_err(|e| ApiError::param("messages", e.to_string()))
}

async fn chat(State(app): State<Arc<App>>, body: Result<Bytes, BytesRejection>) -> Response {
    respond(chat_inner(app, body).await)
}

async fn chat_inner(
    app: Arc<App>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let json = parse_body(&app, body)?;
    let f = Fields::of(&json)?;
    let mut c = read_common(&f, &["max_completion_tokens", "max_tokens"])?;
    check_model(&app, &c)?;
    let top = f.i64("top_logprobs")?;
    c.logprobs = match (f.bool("logprobs")?.unwrap_or(false), top) {
        (false, None) => None,
        (false, Some(_)) => {
            return Err(ApiError::param(
                "top_logprobs",
                "`top_logprobs` needs `logprobs` set to true",
            ))
        }
        (true, None) => Some(0),
        (true, Some(k)) if (0..=MAX_TOP_LOGPROBS as i64).contains(&k) => Some(k as usize),
        (true, Some(k)) => {
            return Err(ApiError::param(
                "top_logprobs",
                format!("`top_logprobs` is {k}; give 0 to {MAX_TOP_LOGPROBS}"),
            ))
        }
    };
    if f.get("tools")
        .is_some_and(|t| t.as_array().is_none_or(|a| !a.is_empty()))
    {
        return Err(ApiError::param(
            "tools",
            "tool calling is not supported by this server; drop `tools`",
        ));
    }
    let prompt = chat_prompt(
        &app.text,
        app.template.as_ref(),
        &app.engine.info().name,
        &f,
    )?;
    let request = gen_request(
        &c,
        prompt.clone(),
        "messages",
        None,
        app.engine.info(),
        &app.text,
    )?;
    let head = head(&app, Endpoint::Chat, &c);
    let generation = Generation::start(
        app.engine.clone(),
        app.text.clone(),
        request,
        c.stop.clone(),
    )?;
    finish(generation, head, &c, prompt).await
}

async fn models(State(app): State<Arc<App>>) -> Response {
    let info = app.engine.info();
    json_response(&json!({
        "object": "list",
        "data": [{
            "id": info.name,
            "object": "model",
            "created": app.created,
            "owned_by": "tpc",
            "max_model_len": info.context,
        }],
    }))
}

async fn health() -> Response {
    json_response(&json!({ "status": "ok" }))
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    use prometheus::Encoder;
    let encoder = prometheus::TextEncoder::new();
    let families = app.engine.registry().gather();
    let mut out = Vec::new();
    match encoder.encode(&families, &mut out) {
        Ok(()) => (
            [(header::CONTENT_TYPE, encoder.format_type().to_string())],
            out,
        )
            .into_response(),
        Err(e) => ApiError::internal(format!("cannot write the metrics: {e}")).into_response(),
    }
}
