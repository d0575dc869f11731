//! `tpc serve`'s HTTP server (src/serve/) over a stand-in engine: the OpenAI endpoints'
//! shapes, text, stop strings, streaming, log-probabilities, every error with its status
//! and `param`, a client that disconnects, a full queue, and the drain on shutdown. A real
//! HTTP client (ureq) on the test side.

use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tpc::frontend::text::TextTokenizer;
use tpc::runtime::engine::api::{
    Event, EventSink, FinishReason, GenRequest, ModelInfo, RequestId, Serving, SubmitError,
    TokenLogprobs, Usage,
};
use tpc::serve::{serve_blocking, GenerationDefaults, ServeError, ServerOptions, TextSide};

/// The Llama-2-style folder with a real tokenizer and a chat template.
const TEXT_MODEL: &str = "tests/fixtures/text/llama";
/// Its prompt, and the ids its tokenizer makes of it (without the `<s>` it adds first).
const PROMPT: &str = "the quick cat sat on the red stone by the river";
const PROMPT_IDS: [i64; 15] = [
    33, 96, 69, 14, 203, 181, 75, 33, 95, 7, 244, 8, 101, 33, 108,
];
const BOS: i64 = 1;
/// A bounded wait for what must happen; a hang becomes a failure, not a stuck test.
const PATIENCE: Duration = Duration::from_secs(120);

/// How the stand-in engine behaves; changed by tests while it runs.
#[derive(Default)]
struct Knobs {
    /// Wait before each token.
    delay: Duration,
    queue_full: bool,
    /// Fail each request after its first token.
    fail: bool,
}

#[derive(Default)]
struct Books {
    next_id: RequestId,
    running: HashMap<RequestId, Arc<AtomicBool>>,
    submitted: Vec<GenRequest>,
    cancels: Vec<RequestId>,
    draining: bool,
}

/// An engine that "generates" the prompt back (its ids without `<s>`, over and over), one
/// thread per request: deterministic text to check the server's against.
struct Fake {
    info: ModelInfo,
    registry: Arc<prometheus::Registry>,
    submits: prometheus::IntCounter,
    knobs: Mutex<Knobs>,
    books: Mutex<Books>,
}

impl Fake {
    fn new(context: usize) -> Arc<Fake> {
        let registry = prometheus::Registry::new();
        let submits =
            prometheus::IntCounter::new("tpc_fake_requests_total", "requests submitted").unwrap();
        registry.register(Box::new(submits.clone())).unwrap();
        Arc::new(Fake {
            info: ModelInfo {
                name: "llama".into(),
                vocab: 250,
                context,
            },
            registry: Arc::new(registry),
            submits,
            knobs: Mutex::new(Knobs::default()),
            books: Mutex::new(Books::default()),
        })
    }

    fn submitted(&self) -> Vec<GenRequest> {
        self.books.lock().unwrap().submitted.clone()
    }

    fn last(&self) -> GenRequest {
        self.submitted()
            .pop()
            .expect("a request reached the engine")
    }

    fn cancels(&self) -> Vec<RequestId> {
        self.books.lock().unwrap().cancels.clone()
    }

    /// The tokens it generates for `prompt`.
    fn script(prompt: &[i64]) -> Vec<i64> {
        let own: Vec<i64> = prompt.iter().copied().filter(|&t| t != BOS).collect();
        if own.is_empty() {
            vec![3]
        } else {
            own
        }
    }

    fn run(
        self: Arc<Self>,
        id: RequestId,
        req: GenRequest,
        mut sink: EventSink,
        cancelled: Arc<AtomicBool>,
    ) {
        let script = Fake::script(&req.prompt);
        let (delay, fail) = {
            let k = self.knobs.lock().unwrap();
            (k.delay, k.fail)
        };
        let usage = |n| Usage {
            prompt_tokens: req.prompt.len(),
            completion_tokens: n,
            cached_prompt_tokens: 0,
        };
        let mut reason = FinishReason::Length;
        let mut n = 0;
        for i in 0..req.max_tokens {
            std::thread::sleep(delay);
            if cancelled.load(Ordering::SeqCst) {
                reason = FinishReason::Cancelled;
                break;
            }
            let token = script[i % script.len()];
            let logprobs = req.logprobs.map(|k| TokenLogprobs {
                logprob: -0.25 * (i + 1) as f32,
                top: (0..k)
                    .map(|j| (script[(i + j) % script.len()], -0.25 * (j + 1) as f32))
                    .collect(),
            });
            sink(Event::Token {
                id: token,
                logprobs,
            });
            n += 1;
            if fail {
                sink(Event::Failed {
                    message: "rank 1 stopped".into(),
                });
                self.books.lock().unwrap().running.remove(&id);
                return;
            }
            if i >= req.min_tokens && req.stop_ids.contains(&token) {
                reason = FinishReason::Stop;
                break;
            }
        }
        self.books.lock().unwrap().running.remove(&id);
        sink(Event::Finished {
            reason,
            usage: usage(n),
        });
    }
}

/// A handle to call the engine's own methods through the trait object the server holds.
struct Shared(Arc<Fake>);

impl Serving for Shared {
    fn info(&self) -> &ModelInfo {
        &self.0.info
    }

    fn submit(&self, request: GenRequest, sink: EventSink) -> Result<RequestId, SubmitError> {
        if request.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        let mut books = self.0.books.lock().unwrap();
        if books.draining {
            return Err(SubmitError::ShuttingDown);
        }
        if self.0.knobs.lock().unwrap().queue_full {
            return Err(SubmitError::QueueFull { waiting: 7 });
        }
        self.0.submits.inc();
        books.next_id += 1;
        let id = books.next_id;
        let cancelled = Arc::new(AtomicBool::new(false));
        books.running.insert(id, cancelled.clone());
        books.submitted.push(request.clone());
        let fake = self.0.clone();
        std::thread::spawn(move || fake.run(id, request, sink, cancelled));
        Ok(id)
    }

    fn cancel(&self, id: RequestId) {
        let mut books = self.0.books.lock().unwrap();
        books.cancels.push(id);
        if let Some(flag) = books.running.get(&id) {
            flag.store(true, Ordering::SeqCst);
        }
    }

    fn drain(&self) {
        self.0.books.lock().unwrap().draining = true;
    }

    fn load(&self) -> (usize, usize) {
        (self.0.books.lock().unwrap().running.len(), 0)
    }

    fn registry(&self) -> Arc<prometheus::Registry> {
        self.0.registry.clone()
    }
}

/// A server on a free port, stopped (and joined) when dropped.
struct Server {
    addr: SocketAddr,
    fake: Arc<Fake>,
    stop: Arc<tokio::sync::Notify>,
    thread: Option<JoinHandle<Result<(), ServeError>>>,
}

impl Server {
    fn start(fake: Arc<Fake>, text: TextSide, opts: ServerOptions) -> Server {
        let stop = Arc::new(tokio::sync::Notify::new());
        let opts = ServerOptions {
            host: "127.0.0.1".into(),
            port: 0,
            handle_signals: false,
            stop: Some(stop.clone()),
            ..opts
        };
        let (tx, rx) = std::sync::mpsc::channel();
        let engine: Arc<dyn Serving> = Arc::new(Shared(fake.clone()));
        let thread = std::thread::spawn(move || {
            serve_blocking(engine, text, opts, move |addr| {
                tx.send(addr).unwrap();
            })
        });
        let addr = rx.recv_timeout(PATIENCE).expect("the server listens");
        Server {
            addr,
            fake,
            stop,
            thread: Some(thread),
        }
    }

    /// Over the text fixture, with its tokenizer and chat template.
    fn text(context: usize) -> Server {
        Server::start(Fake::new(context), text_side(), ServerOptions::default())
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    fn post(&self, path: &str, body: &str) -> (u16, Value) {
        let mut r = agent()
            .post(&self.url(path))
            .header("Content-Type", "application/json")
            .send(body)
            .unwrap();
        let status = r.status().as_u16();
        let text = r.body_mut().read_to_string().unwrap();
        let json = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        (status, json)
    }

    fn post_json(&self, path: &str, body: &Value) -> (u16, Value) {
        self.post(path, &body.to_string())
    }

    /// A successful response's JSON.
    fn ok(&self, path: &str, body: &Value) -> Value {
        let (status, v) = self.post_json(path, body);
        assert_eq!(status, 200, "{body}: {v}");
        v
    }

    /// The `data:` payloads of a streamed response, up to and with `[DONE]`.
    fn stream(&self, path: &str, body: &Value) -> Vec<String> {
        let r = agent()
            .post(&self.url(path))
            .header("Content-Type", "application/json")
            .send(body.to_string())
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        let content_type = r.headers().get("content-type").unwrap().to_str().unwrap();
        assert!(
            content_type.starts_with("text/event-stream"),
            "{content_type}"
        );
        let mut out = Vec::new();
        for line in BufReader::new(r.into_body().into_reader()).lines() {
            let line = line.unwrap();
            if let Some(data) = line.strip_prefix("data: ") {
                out.push(data.to_string());
            } else {
                assert!(line.is_empty(), "not an event line: {line:?}");
            }
        }
        assert_eq!(out.last().map(String::as_str), Some("[DONE]"), "{out:?}");
        out
    }

    fn get(&self, path: &str) -> (u16, String) {
        let mut r = agent().get(&self.url(path)).call().unwrap();
        (r.status().as_u16(), r.body_mut().read_to_string().unwrap())
    }

    /// Stops it as SIGTERM does and waits for `serve_blocking` to return.
    fn shut_down(&mut self) -> Result<(), ServeError> {
        self.stop.notify_one();
        self.thread.take().unwrap().join().unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.thread.is_some() {
            let _ = self.shut_down();
        }
    }
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into()
}

fn text_side() -> TextSide {
    TextSide::open(Path::new(TEXT_MODEL)).unwrap()
}

fn tokenizer() -> TextTokenizer {
    TextTokenizer::open(Path::new(TEXT_MODEL)).unwrap()
}

/// The chunks' JSON (without `[DONE]`).
fn chunks(events: &[String]) -> Vec<Value> {
    events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap_or_else(|err| panic!("{err}: {e}")))
        .collect()
}

/// The text of a completions stream's chunks, each piece apart.
fn pieces(events: &[String], key: &str) -> Vec<String> {
    chunks(events)
        .iter()
        .filter_map(|c| {
            let choice = c["choices"].get(0)?;
            let text = match key {
                "text" => choice["text"].as_str(),
                _ => choice["delta"]["content"].as_str(),
            };
            text.map(str::to_string)
        })
        .collect()
}

/// Checks OpenAI's error shape and returns (message, param).
fn error_of(status: u16, v: &Value, want_status: u16) -> (String, Value) {
    assert_eq!(status, want_status, "{v}");
    let e = &v["error"];
    for key in ["message", "type", "param", "code"] {
        assert!(e.get(key).is_some(), "no `{key}` in {v}");
    }
    (
        e["message"].as_str().unwrap().to_string(),
        e["param"].clone(),
    )
}

/// A folder of its own under the system's temporary folder.
fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tpc-serve-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < PATIENCE, "waited too long for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn completions_take_text_or_token_ids_and_answer_in_openais_shape() {
    let s = Server::text(64);
    let v = s.ok(
        "/v1/completions",
        &json!({ "model": "llama", "prompt": PROMPT, "max_tokens": 15, "temperature": 0 }),
    );
    assert_eq!(v["object"], "text_completion");
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"), "{v}");
    assert_eq!(v["model"], "llama");
    assert!(v["created"].as_u64().unwrap() > 0);
    // The engine echoes the prompt's own tokens: the text comes back whole.
    let choice = &v["choices"][0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["text"], PROMPT, "{v}");
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(choice["logprobs"], Value::Null);
    assert_eq!(v["usage"]["prompt_tokens"], 16);
    assert_eq!(v["usage"]["completion_tokens"], 15);
    assert_eq!(v["usage"]["total_tokens"], 31);
    // The request the engine got: <s> first, the EOS ids of generation_config.json, greedy.
    let req = s.fake.last();
    let mut with_bos = vec![BOS];
    with_bos.extend(PROMPT_IDS);
    assert_eq!(req.prompt, with_bos);
    assert_eq!(req.max_tokens, 15);
    assert_eq!(req.stop_ids, vec![2, 230]);
    assert_eq!(req.sampling.temperature, 0.0);
    assert_eq!((req.sampling.top_k, req.sampling.top_p), (None, None));
    assert_eq!(req.logprobs, None);

    // Token ids, flat or as a list of one list, are taken as they are (no <s> added).
    for prompt in [
        json!([33, 96, 69, 14]),
        json!([[33, 96, 69, 14]]),
        json!(["the quick"]),
    ] {
        let v = s.ok(
            "/v1/completions",
            &json!({ "prompt": prompt, "max_tokens": 4, "return_token_ids": true }),
        );
        assert_eq!(v["choices"][0]["text"], "the quick", "{prompt}: {v}");
        assert_eq!(v["choices"][0]["token_ids"], json!([33, 96, 69, 14]));
    }
    assert_eq!(s.fake.last().prompt, vec![BOS, 33, 96, 69, 14]);
    // OpenAI's default length is 16 tokens.
    s.ok("/v1/completions", &json!({ "prompt": [33] }));
    assert_eq!(s.fake.last().max_tokens, 16);
    // No temperature in the request or generation_config.json: 1, as vLLM.
    assert_eq!(s.fake.last().sampling.temperature, 1.0);
}

#[test]
fn sampling_parameters_reach_the_engine_and_greedy_ignores_top_k_and_top_p() {
    let s = Server::text(64);
    s.ok(
        "/v1/completions",
        &json!({ "prompt": [33], "temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 42,
                 "max_tokens": 3, "min_tokens": 2, "logprobs": 3 }),
    );
    let r = s.fake.last();
    assert_eq!(r.sampling.temperature, 0.7);
    assert_eq!(r.sampling.top_p, Some(0.9));
    assert_eq!(r.sampling.top_k, Some(5));
    assert_eq!(r.sampling.seed, 42);
    assert_eq!((r.max_tokens, r.min_tokens, r.logprobs), (3, 2, Some(3)));
    // top_k -1 and top_p 1 mean no limit; clients send them with temperature 0 too.
    s.ok(
        "/v1/completions",
        &json!({ "prompt": [33], "temperature": 0.5, "top_p": 1, "top_k": -1 }),
    );
    assert_eq!(
        (s.fake.last().sampling.top_k, s.fake.last().sampling.top_p),
        (None, None)
    );
    s.ok(
        "/v1/completions",
        &json!({ "prompt": [33], "temperature": 0, "top_p": 0.5, "top_k": 3 }),
    );
    let r = s.fake.last();
    assert_eq!(
        (r.sampling.temperature, r.sampling.top_k, r.sampling.top_p),
        (0.0, None, None)
    );
    // ignore_eos: no stop ids.
    s.ok(
        "/v1/completions",
        &json!({ "prompt": [33], "ignore_eos": true }),
    );
    assert!(s.fake.last().stop_ids.is_empty());
}

#[test]
fn defaults_come_from_generation_config_json() {
    let dir = scratch("defaults");
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(Path::new(TEXT_MODEL).join(f), dir.join(f)).unwrap();
    }
    std::fs::write(
        dir.join("generation_config.json"),
        r#"{"eos_token_id": 2, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 7}"#,
    )
    .unwrap();
    let text = TextSide::open(&dir).unwrap();
    assert_eq!(
        text.defaults,
        GenerationDefaults {
            temperature: Some(0.6),
            top_p: Some(0.9),
            top_k: Some(20),
            max_new_tokens: Some(7),
        }
    );
    assert_eq!(text.eos, vec![2]);
    let s = Server::start(Fake::new(64), text, ServerOptions::default());
    s.ok("/v1/completions", &json!({ "prompt": [33] }));
    let r = s.fake.last();
    assert_eq!(r.sampling.temperature, 0.6);
    assert_eq!((r.sampling.top_k, r.sampling.top_p), (Some(20), Some(0.9)));
    // min(OpenAI's 16, max_new_tokens 7).
    assert_eq!(r.max_tokens, 7);
    s.ok(
        "/v1/chat/completions",
        &json!({ "messages": [{ "role": "user", "content": "hi" }], "temperature": 0.2 }),
    );
    let r = s.fake.last();
    assert_eq!((r.sampling.temperature, r.max_tokens), (0.2, 7));
    // A malformed value is refused at start, naming the file.
    std::fs::write(
        dir.join("generation_config.json"),
        r#"{"temperature": "warm"}"#,
    )
    .unwrap();
    let e = TextSide::open(&dir).err().unwrap().to_string();
    assert!(
        e.contains("generation_config.json") && e.contains("temperature"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn chat_renders_the_template_and_adds_no_special_tokens_again() {
    let s = Server::text(64);
    let messages = json!([{ "role": "user", "content": "the quick cat" }]);
    let v = s.ok(
        "/v1/chat/completions",
        &json!({ "model": "llama", "messages": messages, "max_completion_tokens": 5, "temperature": 0 }),
    );
    // The rendering of Python's jinja2 with transformers' settings.
    let expected = tokenizer()
        .encode_plain("<s>[INST] the quick cat [/INST]")
        .unwrap();
    let req = s.fake.last();
    assert_eq!(req.prompt, expected);
    assert_eq!(req.prompt.iter().filter(|&&t| t == BOS).count(), 1);
    assert_eq!(req.max_tokens, 5);
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    let choice = &v["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    let echoed = tokenizer().decode(&Fake::script(&expected)[..5]).unwrap();
    assert_eq!(choice["message"]["content"], echoed.as_str(), "{v}");
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(v["usage"]["prompt_tokens"], expected.len());
    // max_tokens is taken too; a list of text parts is one text.
    s.ok(
        "/v1/chat/completions",
        &json!({ "messages": [{ "role": "user", "content": [
            { "type": "text", "text": "the quick" }, { "type": "text", "text": "cat" }] }],
            "max_tokens": 2 }),
    );
    let req = s.fake.last();
    assert_eq!(req.max_tokens, 2);
    assert_eq!(
        req.prompt,
        tokenizer()
            .encode_plain("<s>[INST] the quick\ncat [/INST]")
            .unwrap()
    );
    // Without a length the rest of the context.
    s.ok("/v1/chat/completions", &json!({ "messages": messages }));
    assert_eq!(s.fake.last().max_tokens, 64 - expected.len());
    // The template's own refusal is a 400 naming messages.
    let (status, v) = s.post_json(
        "/v1/chat/completions",
        &json!({ "messages": [{ "role": "assistant", "content": "x" }] }),
    );
    let (message, param) = error_of(status, &v, 400);
    assert!(message.contains("roles must alternate"), "{message}");
    assert_eq!(param, "messages");
}

#[test]
fn a_model_without_a_chat_template_refuses_chat() {
    let text = TextSide {
        chat_template: None,
        ..text_side()
    };
    let s = Server::start(Fake::new(64), text, ServerOptions::default());
    let (status, v) = s.post_json(
        "/v1/chat/completions",
        &json!({ "messages": [{ "role": "user", "content": "hi" }] }),
    );
    let (message, _) = error_of(status, &v, 400);
    assert!(message.contains("has no chat template"), "{message}");
}

#[test]
fn streams_end_with_done_and_carry_the_same_text() {
    let s = Server::text(64);
    let body = json!({ "prompt": PROMPT, "max_tokens": 15, "stream": true });
    let events = s.stream("/v1/completions", &body);
    assert_eq!(pieces(&events, "text").concat(), PROMPT);
    let cs = chunks(&events);
    for c in &cs {
        assert_eq!(c["object"], "text_completion");
        assert!(c.get("usage").is_none(), "{c}");
    }
    assert_eq!(cs.last().unwrap()["choices"][0]["finish_reason"], "length");
    assert!(cs[..cs.len() - 1]
        .iter()
        .all(|c| c["choices"][0]["finish_reason"].is_null()));
    // With usage: every chunk carries `usage: null`, the last one the counts and no choice.
    let body = json!({ "prompt": PROMPT, "max_tokens": 3, "stream": true,
                       "stream_options": { "include_usage": true } });
    let cs = chunks(&s.stream("/v1/completions", &body));
    let (last, rest) = cs.split_last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 3);
    assert_eq!(last["usage"]["prompt_tokens"], 16);
    assert!(rest
        .iter()
        .all(|c| c["usage"].is_null() && c.get("usage").is_some()));

    // Chat: the first chunk names the role, the deltas make the text.
    let body = json!({ "messages": [{ "role": "user", "content": "the quick cat" }],
                       "max_tokens": 6, "stream": true });
    let events = s.stream("/v1/chat/completions", &body);
    let cs = chunks(&events);
    assert_eq!(cs[0]["choices"][0]["delta"]["role"], "assistant");
    for c in &cs {
        assert_eq!(c["object"], "chat.completion.chunk");
    }
    let streamed = pieces(&events, "content").concat();
    let whole = s.ok(
        "/v1/chat/completions",
        &json!({ "messages": [{ "role": "user", "content": "the quick cat" }], "max_tokens": 6 }),
    );
    assert_eq!(whole["choices"][0]["message"]["content"], streamed.as_str());
    assert_eq!(cs.last().unwrap()["choices"][0]["finish_reason"], "length");
}

#[test]
fn a_stop_string_cuts_the_text_and_cancels_the_request() {
    let s = Server::text(64);
    let v = s.ok(
        "/v1/completions",
        &json!({ "prompt": PROMPT, "max_tokens": 15, "stop": " sat" }),
    );
    assert_eq!(v["choices"][0]["text"], "the quick cat");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // " sat" is the 6th token.
    assert_eq!(v["usage"]["completion_tokens"], 6);
    wait_for("the cancel", || s.fake.cancels().contains(&1));
    // Streamed, with a stop string over three tokens ("ic", "k", "▁cat"): its start is
    // never sent.
    let body = json!({ "prompt": PROMPT, "max_tokens": 15, "stop": ["zzz", "ick cat"],
                       "stream": true });
    let events = s.stream("/v1/completions", &body);
    let sent = pieces(&events, "text");
    assert_eq!(sent.concat(), "the qu", "{sent:?}");
    let cs = chunks(&events);
    assert_eq!(cs.last().unwrap()["choices"][0]["finish_reason"], "stop");
    wait_for("the cancel", || s.fake.cancels().contains(&2));
    // A start that turns out not to be the stop string is sent once that is known.
    let body = json!({ "prompt": PROMPT, "max_tokens": 5, "stop": "ick dog", "stream": true });
    let sent = pieces(&s.stream("/v1/completions", &body), "text");
    assert_eq!(sent.concat(), "the quick cat");
    assert!(!sent.iter().any(|p| p == "ic"), "{sent:?}");
    // Chat too.
    let v = s.ok(
        "/v1/chat/completions",
        &json!({ "messages": [{ "role": "user", "content": "the quick cat" }], "stop": "quick" }),
    );
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(!content.contains("quick"), "{content}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
}

#[test]
fn a_stop_id_ends_the_text_uncounted_in_it_but_returned_and_counted_in_usage() {
    let s = Server::text(64);
    // The engine echoes 33 96 230: 230 is an EOS id of generation_config.json.
    let v = s.ok(
        "/v1/completions",
        &json!({ "prompt": [33, 96, 230, 69], "max_tokens": 10, "logprobs": 1,
                 "return_token_ids": true }),
    );
    let choice = &v["choices"][0];
    assert_eq!(choice["text"], "the qu");
    assert_eq!(choice["finish_reason"], "stop");
    // As in HF and vLLM: the stop id is among the returned ids and log-probabilities.
    assert_eq!(choice["token_ids"], json!([33, 96, 230]));
    assert_eq!(choice["logprobs"]["tokens"].as_array().unwrap().len(), 3);
    assert_eq!(v["usage"]["completion_tokens"], 3);
    // Streamed, the last chunk carries it.
    let events = s.stream(
        "/v1/completions",
        &json!({ "prompt": [33, 96, 230, 69], "max_tokens": 10, "stream": true,
                 "return_token_ids": true }),
    );
    let ids: Vec<Value> = chunks(&events)
        .iter()
        .flat_map(|c| {
            c["choices"][0]["token_ids"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .collect();
    assert_eq!(ids, vec![json!(33), json!(96), json!(230)]);
    // Before min_tokens it is text like any other token.
    let v = s.ok(
        "/v1/completions",
        &json!({ "prompt": [33, 96, 230, 69], "max_tokens": 4, "min_tokens": 4 }),
    );
    assert_eq!(v["choices"][0]["text"], "the qu downic");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
}

/// A byte-fallback tokenizer whose "€" is three tokens, one byte each.
fn byte_tokenizer_side() -> TextSide {
    let dir = scratch("bytes");
    let special = |id: u32, content: &str| {
        json!({ "id": id, "content": content, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true })
    };
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
        "normalizer": null,
        "pre_tokenizer": null,
        "post_processor": null,
        "decoder": { "type": "Sequence", "decoders": [
            { "type": "Replace", "pattern": { "String": "▁" }, "content": " " },
            { "type": "ByteFallback" },
            { "type": "Fuse" },
            { "type": "Strip", "content": " ", "start": 1, "stop": 0 }
        ] },
        "model": {
            "type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
            "vocab": { "<unk>": 0, "<s>": 1, "</s>": 2, "<0xE2>": 3, "<0x82>": 4, "<0xAC>": 5,
                       "▁a": 6, "b": 7 },
            "merges": []
        }
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let side = TextSide {
        tokenizer: Some(TextTokenizer::open(&dir).unwrap()),
        ..TextSide::default()
    };
    let _ = std::fs::remove_dir_all(dir);
    side
}

#[test]
fn a_character_split_over_tokens_is_never_cut() {
    let s = Server::start(
        Fake::new(64),
        byte_tokenizer_side(),
        ServerOptions::default(),
    );
    // "▁a", the three bytes of "€", "b".
    let prompt = json!([6, 3, 4, 5, 7]);
    let v = s.ok(
        "/v1/completions",
        &json!({ "prompt": prompt, "max_tokens": 5 }),
    );
    assert_eq!(v["choices"][0]["text"], "a€b");
    for (path, key, body) in [
        (
            "/v1/completions",
            "text",
            json!({ "prompt": prompt, "max_tokens": 5, "stream": true }),
        ),
        // A stop string right after the character: held back with it, then cut.
        (
            "/v1/completions",
            "text",
            json!({ "prompt": prompt, "max_tokens": 5, "stream": true, "stop": "€c" }),
        ),
    ] {
        let sent = pieces(&s.stream(path, &body), key);
        assert!(
            sent.iter().all(|p| !p.contains('\u{FFFD}')),
            "{body}: {sent:?}"
        );
        assert_eq!(sent.concat(), "a€b", "{body}: {sent:?}");
    }
    // The generation ends inside the character: what is there is sent at the end.
    let v = s.ok(
        "/v1/completions",
        &json!({ "prompt": prompt, "max_tokens": 2 }),
    );
    assert_eq!(v["choices"][0]["text"], "a\u{FFFD}");
}

#[test]
fn logprobs_in_the_completions_and_chat_shapes() {
    let s = Server::text(64);
    let v = s.ok(
        "/v1/completions",
        &json!({ "prompt": [33, 96, 69], "max_tokens": 3, "logprobs": 2 }),
    );
    let lp = &v["choices"][0]["logprobs"];
    // Each token as the text has it: the tokens make the text.
    assert_eq!(lp["tokens"], json!(["the", " qu", "ic"]));
    assert_eq!(v["choices"][0]["text"], "the quic");
    assert_eq!(lp["token_logprobs"], json!([-0.25, -0.5, -0.75]));
    assert_eq!(lp["text_offset"], json!([0, 3, 6]));
    let tops = lp["top_logprobs"].as_array().unwrap();
    assert_eq!(tops.len(), 3);
    assert_eq!(tops[0], json!({ "the": -0.25, "qu": -0.5 }));
    assert_eq!(s.fake.last().logprobs, Some(2));
    // logprobs 0: the chosen token's only.
    let v = s.ok(
        "/v1/completions",
        &json!({ "prompt": [33], "max_tokens": 1, "logprobs": 0 }),
    );
    assert_eq!(v["choices"][0]["logprobs"]["top_logprobs"], json!([{}]));
    // Streamed: each chunk carries its tokens; offsets run on.
    let events = s.stream(
        "/v1/completions",
        &json!({ "prompt": [33, 96, 69], "max_tokens": 3, "logprobs": 1, "stream": true }),
    );
    let offsets: Vec<Value> = chunks(&events)
        .iter()
        .flat_map(|c| {
            c["choices"][0]["logprobs"]["text_offset"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .collect();
    assert_eq!(offsets, [json!(0), json!(3), json!(6)]);

    let v = s.ok(
        "/v1/chat/completions",
        &json!({ "messages": [{ "role": "user", "content": "the quick" }], "max_tokens": 2,
                 "logprobs": true, "top_logprobs": 2 }),
    );
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 2);
    for (i, entry) in content.iter().enumerate() {
        let token = entry["token"].as_str().unwrap();
        assert_eq!(entry["logprob"], json!(-0.25 * (i + 1) as f64));
        assert_eq!(entry["bytes"], json!(token.as_bytes()));
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2);
        assert!(top[0]["token"].is_string() && top[0]["bytes"].is_array());
    }
    // logprobs true alone: no top ones; without logprobs none at all.
    s.ok(
        "/v1/chat/completions",
        &json!({ "messages": [{ "role": "user", "content": "hi" }], "max_tokens": 1, "logprobs": true }),
    );
    assert_eq!(s.fake.last().logprobs, Some(0));
}

#[test]
fn every_bad_request_gets_openais_error_shape_with_its_status_and_param() {
    let s = Server::text(64);
    let c = "/v1/completions";
    let chat = "/v1/chat/completions";
    let user = json!([{ "role": "user", "content": "hi" }]);
    // (path, body, status, param, words in the message)
    let cases: Vec<(&str, String, u16, Value, &str)> = vec![
        (c, "{\"prompt\": ".into(), 400, Value::Null, "not valid JSON"),
        (c, "[1, 2]".into(), 400, Value::Null, "JSON object"),
        (c, "{}".into(), 400, json!("prompt"), "required"),
        (chat, "{}".into(), 400, json!("messages"), "required"),
        (c, json!({ "prompt": 5 }).to_string(), 400, json!("prompt"), "a string or a list"),
        (c, json!({ "prompt": [] }).to_string(), 400, json!("prompt"), "empty"),
        (c, json!({ "prompt": ["a", "b"] }).to_string(), 400, json!("prompt"), "one per request"),
        (c, json!({ "prompt": [1, "x"] }).to_string(), 400, json!("prompt"), "whole numbers"),
        (c, json!({ "prompt": [1, 250] }).to_string(), 400, json!("prompt"), "outside the vocabulary"),
        (c, json!({ "prompt": [-1] }).to_string(), 400, json!("prompt"), "outside the vocabulary"),
        (c, json!({ "prompt": vec![33; 64] }).to_string(), 400, json!("prompt"), "context is 64"),
        (c, json!({ "prompt": "x", "model": "gpt-4" }).to_string(), 404, json!("model"), "gpt-4"),
        (c, json!({ "prompt": "x", "n": 2 }).to_string(), 400, json!("n"), "n = 1"),
        (c, json!({ "prompt": "x", "echo": true }).to_string(), 400, json!("echo"), "echo"),
        (c, json!({ "prompt": "x", "best_of": 3 }).to_string(), 400, json!("best_of"), "best_of"),
        (c, json!({ "prompt": "x", "temperature": "hot" }).to_string(), 400, json!("temperature"), "a number"),
        (c, json!({ "prompt": "x", "temperature": -1 }).to_string(), 400, json!("temperature"), "-1"),
        (c, json!({ "prompt": "x", "top_p": 0 }).to_string(), 400, json!("top_p"), "(0, 1]"),
        (c, json!({ "prompt": "x", "top_p": 1.5 }).to_string(), 400, json!("top_p"), "1.5"),
        (c, json!({ "prompt": "x", "top_k": -2 }).to_string(), 400, json!("top_k"), "-2"),
        (c, json!({ "prompt": "x", "top_k": 1.5 }).to_string(), 400, json!("top_k"), "whole number"),
        (c, json!({ "prompt": "x", "max_tokens": 0 }).to_string(), 400, json!("max_tokens"), "at least 1"),
        (c, json!({ "prompt": [33, 96, 69], "max_tokens": 1000000 }).to_string(), 400, json!("max_tokens"), "at most 61 new tokens"),
        (c, json!({ "prompt": "x", "max_tokens": 2, "min_tokens": 3 }).to_string(), 400, json!("min_tokens"), "0 to 2"),
        (c, json!({ "prompt": "x", "stop": [""] }).to_string(), 400, json!("stop"), "empty"),
        (c, json!({ "prompt": "x", "stop": 3 }).to_string(), 400, json!("stop"), "list of strings"),
        (c, json!({ "prompt": "x", "stop": vec!["a"; 65] }).to_string(), 400, json!("stop"), "at most 64"),
        (c, json!({ "prompt": "x", "stream": "yes" }).to_string(), 400, json!("stream"), "true or false"),
        (c, json!({ "prompt": "x", "stream_options": { "include_usage": true } }).to_string(), 400, json!("stream_options"), "stream"),
        (c, json!({ "prompt": "x", "logprobs": 50 }).to_string(), 400, json!("logprobs"), "0 to 20"),
        (c, json!({ "prompt": "x", "frequency_penalty": 0.5 }).to_string(), 400, json!("frequency_penalty"), "not supported"),
        (chat, json!({ "messages": user, "top_logprobs": 2 }).to_string(), 400, json!("top_logprobs"), "logprobs"),
        (chat, json!({ "messages": user, "max_completion_tokens": 100 }).to_string(), 400, json!("max_completion_tokens"), "max_completion_tokens"),
        (chat, json!({ "messages": [] }).to_string(), 400, json!("messages"), "empty"),
        (chat, json!({ "messages": [{ "content": "hi" }] }).to_string(), 400, json!("messages"), "role"),
        (chat, json!({ "messages": [{ "role": "user", "content": 7 }] }).to_string(), 400, json!("messages"), "content"),
        (chat, json!({ "messages": [{ "role": "user", "content": [{ "type": "image_url", "image_url": {} }] }] }).to_string(), 400, json!("messages"), "text only"),
        (chat, json!({ "messages": user, "tools": [{ "type": "function" }] }).to_string(), 400, json!("tools"), "tool"),
        (chat, json!({ "messages": user, "model": "x" }).to_string(), 404, json!("model"), "llama"),
    ];
    for (path, body, status, param, words) in cases {
        let (got, v) = s.post(path, &body);
        let (message, got_param) = error_of(got, &v, status);
        assert_eq!(got_param, param, "{body}: {v}");
        assert!(message.contains(words), "{body}: {message}");
        if status == 404 {
            assert_eq!(v["error"]["code"], "model_not_found");
        }
    }
    // The room left in the context is named with the numbers.
    let (status, v) = s.post_json(c, &json!({ "prompt": [33, 96, 69], "max_tokens": 62 }));
    let (message, _) = error_of(status, &v, 400);
    assert!(
        message.contains("62") && message.contains("3 tokens") && message.contains("64"),
        "{message}"
    );
    // None of it reached the engine, and the server still serves.
    assert!(s.fake.submitted().is_empty());
    s.ok(c, &json!({ "prompt": "x", "max_tokens": 1 }));
    // Unknown paths and methods answer in the same shape.
    let r = agent().get(&s.url("/v1/nothing")).call().unwrap();
    assert_eq!(r.status().as_u16(), 404);
    let mut r = agent().get(&s.url("/v1/completions")).call().unwrap();
    assert_eq!(r.status().as_u16(), 405);
    let v: Value = serde_json::from_str(&r.body_mut().read_to_string().unwrap()).unwrap();
    error_of(405, &v, 405);
}

#[test]
fn a_body_over_the_limit_is_413() {
    let opts = ServerOptions {
        max_body_bytes: 1024,
        ..ServerOptions::default()
    };
    let s = Server::start(Fake::new(64), text_side(), opts);
    let body = json!({ "prompt": "x ".repeat(2000) }).to_string();
    let (status, v) = s.post("/v1/completions", &body);
    let (message, _) = error_of(status, &v, 413);
    assert!(message.contains("1024 bytes"), "{message}");
    s.ok(
        "/v1/completions",
        &json!({ "prompt": "x", "max_tokens": 1 }),
    );
}

#[test]
fn a_full_queue_or_a_draining_engine_is_503_and_a_failure_500() {
    let s = Server::text(64);
    s.fake.knobs.lock().unwrap().queue_full = true;
    let (status, v) = s.post_json("/v1/completions", &json!({ "prompt": "x" }));
    let (message, _) = error_of(status, &v, 503);
    assert!(message.contains("--max-waiting"), "{message}");
    s.fake.knobs.lock().unwrap().queue_full = false;

    s.fake.knobs.lock().unwrap().fail = true;
    let (status, v) = s.post_json("/v1/completions", &json!({ "prompt": "x" }));
    let (message, _) = error_of(status, &v, 500);
    assert!(message.contains("rank 1 stopped"), "{message}");
    // Streamed: an error event, then the end.
    let events = s.stream("/v1/completions", &json!({ "prompt": "x", "stream": true }));
    let last: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert!(
        last["error"]["message"]
            .as_str()
            .unwrap()
            .contains("rank 1 stopped"),
        "{events:?}"
    );
    s.fake.knobs.lock().unwrap().fail = false;

    s.fake.books.lock().unwrap().draining = true;
    let (status, v) = s.post_json("/v1/completions", &json!({ "prompt": "x" }));
    let (message, _) = error_of(status, &v, 503);
    assert!(message.contains("shutting down"), "{message}");
}

#[test]
fn a_client_that_disconnects_mid_stream_cancels_its_request() {
    let s = Server::text(64);
    s.fake.knobs.lock().unwrap().delay = Duration::from_millis(50);
    let body = json!({ "prompt": [33, 96], "max_tokens": 60, "stream": true });
    let r = agent()
        .post(&s.url("/v1/completions"))
        .header("Content-Type", "application/json")
        .send(body.to_string())
        .unwrap();
    let mut lines = BufReader::new(r.into_body().into_reader()).lines();
    let first = lines.next().unwrap().unwrap();
    assert!(first.starts_with("data: "), "{first}");
    drop(lines);
    wait_for("the cancel of the disconnected stream", || {
        s.fake.cancels().contains(&1)
    });
    wait_for("the engine to be empty", || {
        s.fake.books.lock().unwrap().running.is_empty()
    });
}

#[test]
fn a_client_that_disconnects_while_waiting_for_a_whole_response_cancels_too() {
    use std::io::Write;
    let s = Server::text(64);
    s.fake.knobs.lock().unwrap().delay = Duration::from_millis(50);
    let body = json!({ "prompt": [33, 96], "max_tokens": 60 }).to_string();
    let mut socket = std::net::TcpStream::connect(s.addr).unwrap();
    write!(
        socket,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    wait_for("the request to reach the engine", || {
        !s.fake.submitted().is_empty()
    });
    drop(socket);
    wait_for("the cancel of the abandoned request", || {
        s.fake.cancels().contains(&1)
    });
}

#[test]
fn models_health_and_metrics() {
    let s = Server::text(64);
    let (status, text) = s.get("/v1/models");
    assert_eq!(status, 200);
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["object"], "list");
    let m = &v["data"][0];
    assert_eq!(m["id"], "llama");
    assert_eq!(m["object"], "model");
    assert_eq!(m["owned_by"], "tpc");
    assert_eq!(m["max_model_len"], 64);
    assert!(m["created"].as_u64().unwrap() > 0);
    assert_eq!(s.get("/health").0, 200);
    s.ok(
        "/v1/completions",
        &json!({ "prompt": "x", "max_tokens": 1 }),
    );
    let (status, text) = s.get("/metrics");
    assert_eq!(status, 200);
    assert!(text.contains("tpc_fake_requests_total 1"), "{text}");
}

#[test]
fn shutdown_drains_lets_running_requests_finish_and_returns() {
    let mut s = Server::text(64);
    s.fake.knobs.lock().unwrap().delay = Duration::from_millis(20);
    let url = s.url("/v1/completions");
    let body = json!({ "prompt": [33, 96], "max_tokens": 20, "stream": true });
    let r = agent()
        .post(&url)
        .header("Content-Type", "application/json")
        .send(body.to_string())
        .unwrap();
    let mut lines = BufReader::new(r.into_body().into_reader()).lines();
    assert!(lines.next().unwrap().unwrap().starts_with("data: "));
    let stopping = std::thread::spawn({
        let stop = s.stop.clone();
        let thread = s.thread.take().unwrap();
        move || {
            stop.notify_one();
            thread.join().unwrap()
        }
    });
    // The running stream runs to its end.
    let rest: Vec<String> = lines.map(|l| l.unwrap()).collect();
    assert!(rest.iter().any(|l| l == "data: [DONE]"), "{rest:?}");
    assert!(
        rest.iter()
            .any(|l| l.contains("\"finish_reason\":\"length\"")),
        "{rest:?}"
    );
    stopping.join().unwrap().unwrap();
    assert!(s.fake.books.lock().unwrap().draining);
    assert!(s.fake.cancels().is_empty());
    // Nothing listens any more.
    assert!(agent().get(&s.url("/health")).call().is_err());
}

#[test]
fn shutdown_gives_up_on_requests_after_the_timeout_and_cancels_them() {
    let opts = ServerOptions {
        shutdown_timeout: Duration::from_millis(200),
        ..ServerOptions::default()
    };
    let mut s = Server::start(Fake::new(4096), text_side(), opts);
    // Far longer than the timeout: 2000 tokens of 50 ms.
    s.fake.knobs.lock().unwrap().delay = Duration::from_millis(50);
    let body = json!({ "prompt": [33, 96], "max_tokens": 2000, "stream": true });
    let r = agent()
        .post(&s.url("/v1/completions"))
        .header("Content-Type", "application/json")
        .send(body.to_string())
        .unwrap();
    let mut lines = BufReader::new(r.into_body().into_reader()).lines();
    assert!(lines.next().unwrap().unwrap().starts_with("data: "));
    s.shut_down().unwrap();
    wait_for("the cancel after the timeout", || {
        s.fake.cancels().contains(&1)
    });
}

#[test]
fn text_side_reads_the_model_folder() {
    let t = text_side();
    assert!(t.tokenizer.is_some());
    assert!(t.chat_template.as_deref().unwrap().contains("[INST]"));
    assert_eq!(t.bos_token.as_deref(), Some("<s>"));
    assert_eq!(t.eos_token.as_deref(), Some("</s>"));
    assert_eq!(t.eos, vec![2, 230]);
    // The list form of chat_template: the one named "default".
    let dir = scratch("template-list");
    std::fs::copy(
        Path::new(TEXT_MODEL).join("tokenizer.json"),
        dir.join("tokenizer.json"),
    )
    .unwrap();
    let config = json!({ "chat_template": [
        { "name": "tool_use", "template": "T" }, { "name": "default", "template": "D" }] });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    assert_eq!(
        TextSide::open(&dir).unwrap().chat_template.as_deref(),
        Some("D")
    );
    // A template that does not compile is refused at start, naming the file.
    let config = json!({ "chat_template": "{% for m in messages %}" });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    let e = TextSide::open(&dir).err().unwrap().to_string();
    assert!(
        e.contains("tokenizer_config.json") && e.contains("chat template"),
        "{e}"
    );
    // No tokenizer: token ids only.
    let empty = scratch("no-tokenizer");
    let t = TextSide::open(&empty).unwrap();
    assert!(t.tokenizer.is_none() && t.chat_template.is_none());
    let s = Server::start(Fake::new(64), t, ServerOptions::default());
    let (status, v) = s.post_json("/v1/completions", &json!({ "prompt": "hi" }));
    let (message, param) = error_of(status, &v, 400);
    assert!(message.contains("token ids"), "{message}");
    assert_eq!(param, "prompt");
    let v = s.ok(
        "/v1/completions",
        &json!({ "prompt": [5], "max_tokens": 2 }),
    );
    assert_eq!(v["choices"][0]["text"], "");
    assert_eq!(v["usage"]["completion_tokens"], 2);
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_dir_all(empty);
}

#[test]
fn a_port_in_use_is_a_clear_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let opts = ServerOptions {
        port,
        handle_signals: false,
        ..ServerOptions::default()
    };
    let engine: Arc<dyn Serving> = Arc::new(Shared(Fake::new(64)));
    let e = serve_blocking(engine, TextSide::default(), opts, |_| {
        panic!("must not listen")
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains(&port.to_string()) && e.contains("--port 0"),
        "{e}"
    );
}
