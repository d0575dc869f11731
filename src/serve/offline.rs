//! An engine held open in this process for offline use — the Python API's `LLM` (crate
//! `python/`): the model compiled and loaded once, its ranks on threads (CPUs or GPUs) behind
//! a thread of their own, and batches of prompts run through it with the server's parameter
//! checks, prompt building, text and stop handling, so that a prompt gets here what
//! `/v1/completions` (or, with messages, `/v1/chat/completions`) gives it.

use super::app::{chat_prompt, completion_logprobs, completion_prompt};
use super::chat_template::ChatTemplate;
use super::fields::Fields;
use super::generation::Generation;
use super::params::{gen_request, read_common};
use super::{compiled_template, ApiError, TextSide};
use crate::runtime::device::Device;
use crate::runtime::engine::api::{ModelInfo, Serving};
use crate::runtime::engine::launch::EngineOptions;
use crate::runtime::generate::ComputeDtype;
use crate::runtime::run::serve_on_device;
use crate::runtime::weights::Checkpoint;
use serde_json::{Map, Value};
use std::path::Path;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Why a call failed; each message names the problem and the fix.
#[derive(Debug, thiserror::Error)]
pub enum OfflineError {
    /// The caller's input: a prompt, a parameter, an option (Python's `ValueError`).
    #[error("{0}")]
    Invalid(String),
    /// The model could not be loaded, or the engine failed (Python's `RuntimeError`).
    #[error("{0}")]
    Engine(String),
    /// `interrupted` said stop (Ctrl-C): the batch's requests were cancelled.
    #[error("interrupted: the batch's requests were cancelled")]
    Interrupted,
}

impl From<ApiError> for OfflineError {
    fn from(e: ApiError) -> Self {
        if e.status.is_client_error() {
            OfflineError::Invalid(e.message)
        } else {
            OfflineError::Engine(e.message)
        }
    }
}

fn invalid(e: impl std::fmt::Display) -> OfflineError {
    OfflineError::Invalid(e.to_string())
}

/// How the engine is laid out and run.
#[derive(Debug, Clone)]
pub struct OfflineOptions {
    pub tp: u64,
    /// Each rank's share of every split dimension (`--tp-shares`); `None`: even.
    pub shares: Option<crate::ir::TpShares>,
    /// Pipeline stages (layers dealt evenly); `None`: one.
    pub pp: Option<u64>,
    pub dp: usize,
    pub device: Device,
    pub dtype: ComputeDtype,
    pub engine: EngineOptions,
}

/// One prompt of a batch.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptIn {
    Text(String),
    Ids(Vec<i64>),
    /// Chat messages (`[{"role", "content"}, …]`), rendered with the model's chat template.
    Chat(Value),
}

/// One generated position's log-probabilities.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TokenLogprobsOut {
    pub token: i64,
    pub logprob: f32,
    /// The most likely tokens: (id, text, log-probability), best first.
    pub top: Vec<(i64, String, f32)>,
}

/// What one prompt produced.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CompletionOut {
    pub prompt_token_ids: Vec<i64>,
    pub text: String,
    /// Every generated id, a stop id included (its text is not).
    pub token_ids: Vec<i64>,
    /// "stop", "length" or "abort".
    pub finish_reason: Option<&'static str>,
    pub logprobs: Option<Vec<TokenLogprobsOut>>,
}

/// `model` (.ron, HF folder or config.json) compiled for `tp` ranks with the default shard
/// options, its layers dealt evenly over `pp` stages.
pub fn compile_model(
    model: &Path,
    tp: u64,
    pp: Option<u64>,
    shares: Option<crate::ir::TpShares>,
) -> Result<crate::plan::Plan, OfflineError> {
    let def = crate::frontend::load::load_model(model).map_err(invalid)?;
    let options = crate::passes::ShardOptions {
        shares,
        ..Default::default()
    };
    let mut plan = crate::pipeline::compile_with(&def, tp, options)
        .map_err(invalid)?
        .plan;
    if let Some(pp) = pp {
        crate::pipeline::split_stages(&mut plan, pp, None).map_err(invalid)?;
    }
    Ok(plan)
}

/// The name a model folder is served under: its own name (`model` if it has none).
pub fn served_name(model: &Path) -> String {
    model
        .canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "model".into())
}

/// A loaded model serving this process until [`OfflineEngine::close`] (or drop).
pub struct OfflineEngine {
    engine: Arc<dyn Serving>,
    text: Arc<TextSide>,
    template: Option<ChatTemplate>,
    close: Option<Sender<()>>,
    thread: Option<JoinHandle<Result<(), String>>>,
    /// tp, pp and dp as the engine runs them.
    pub layout: String,
}

/// How often a running batch asks whether to stop.
const POLL: Duration = Duration::from_millis(50);

impl OfflineEngine {
    /// Compiles and loads `model` (an HF model folder) and starts its engine; returns once
    /// every rank has loaded.
    pub fn start(model: &Path, o: OfflineOptions) -> Result<OfflineEngine, OfflineError> {
        if !model.is_dir() {
            return Err(OfflineError::Invalid(format!(
                "`{}` is not a model directory; give a folder with config.json and model.safetensors",
                model.display()
            )));
        }
        let text = TextSide::open(model).map_err(invalid)?;
        let template = compiled_template(&text).map_err(invalid)?;
        let plan = compile_model(model, o.tp, o.pp, o.shares)?;
        let ckpt = Checkpoint::open(model).map_err(invalid)?;
        let layout = crate::runtime::engine::launch::layout_line(&plan, o.dp, &o.engine);
        let (ready_tx, ready_rx) = channel::<Arc<dyn Serving>>();
        let (close_tx, close_rx) = channel::<()>();
        let thread = std::thread::Builder::new()
            .name("tpc-engine".into())
            .spawn(move || run_engine(&plan, &ckpt, &o, ready_tx, close_rx))
            .map_err(|e| OfflineError::Engine(format!("cannot start the engine's thread: {e}")))?;
        match ready_rx.recv() {
            Ok(engine) => Ok(OfflineEngine {
                engine,
                text: Arc::new(text),
                template,
                close: Some(close_tx),
                thread: Some(thread),
                layout,
            }),
            Err(_) => Err(OfflineError::Engine(match thread.join() {
                Ok(Err(why)) => why,
                Ok(Ok(())) => "the engine stopped before it started".into(),
                Err(_) => "the engine's thread panicked while starting".into(),
            })),
        }
    }

    pub fn info(&self) -> &ModelInfo {
        self.engine.info()
    }

    pub fn text_side(&self) -> &TextSide {
        &self.text
    }

    /// Runs every prompt with its parameters (the completion endpoint's names: `max_tokens`,
    /// `temperature`, `top_p`, `top_k`, `seed`, `stop`, `min_tokens`, `ignore_eos`, `logprobs`;
    /// with chat messages also `add_generation_prompt`), all at once through the engine.
    /// Every prompt is checked before any runs. `progress(done, total)` hears each finished
    /// prompt; `interrupted` is asked every [`POLL`] and, when it says so, the requests are
    /// cancelled and the call fails with [`OfflineError::Interrupted`]. Results are in
    /// prompt order.
    pub fn generate(
        &self,
        batch: Vec<(PromptIn, Map<String, Value>)>,
        progress: &mut dyn FnMut(usize, usize),
        interrupted: &mut dyn FnMut() -> bool,
    ) -> Result<Vec<CompletionOut>, OfflineError> {
        let mut requests = Vec::with_capacity(batch.len());
        for (prompt, params) in batch {
            requests.push(self.request(prompt, params)?);
        }
        let mut running = Vec::with_capacity(requests.len());
        for (prompt_ids, request, stops) in requests {
            let g = Generation::start(self.engine.clone(), self.text.clone(), request, stops)?;
            running.push((prompt_ids, g));
        }
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .map_err(|e| OfflineError::Engine(format!("cannot start a runtime: {e}")))?;
        let total = running.len();
        runtime.block_on(async move {
            let mut outs = Vec::with_capacity(total);
            let mut asked = Instant::now();
            for (prompt_token_ids, mut g) in running {
                let mut out = CompletionOut {
                    prompt_token_ids,
                    text: String::new(),
                    token_ids: Vec::new(),
                    finish_reason: None,
                    logprobs: None,
                };
                loop {
                    let next = tokio::time::timeout(POLL, g.next()).await;
                    if asked.elapsed() >= POLL {
                        asked = Instant::now();
                        if interrupted() {
                            return Err(OfflineError::Interrupted);
                        }
                    }
                    let step = match next {
                        Err(_) => continue,
                        Ok(None) => break,
                        Ok(Some(step)) => step?,
                    };
                    out.text.push_str(&step.text);
                    if let Some(t) = step.token.filter(|t| t.logprob.is_some()) {
                        out.logprobs
                            .get_or_insert_with(Vec::new)
                            .push(TokenLogprobsOut {
                                token: t.id,
                                logprob: t.logprob.unwrap_or(f32::NAN),
                                top: t
                                    .top_ids
                                    .iter()
                                    .zip(t.top)
                                    .map(|(&id, (text, lp))| (id, text, lp))
                                    .collect(),
                            });
                    }
                    if let Some(f) = step.finish {
                        out.finish_reason = Some(f.reason);
                    }
                }
                out.token_ids = g.token_ids().to_vec();
                outs.push(out);
                progress(outs.len(), total);
            }
            Ok(outs)
        })
    }

    /// One prompt's engine request, checked as the server checks it: its prompt ids, the
    /// request and its stop strings.
    fn request(
        &self,
        prompt: PromptIn,
        mut params: Map<String, Value>,
    ) -> Result<
        (
            Vec<i64>,
            crate::runtime::engine::api::GenRequest,
            Vec<String>,
        ),
        OfflineError,
    > {
        let (name, value) = match prompt {
            PromptIn::Text(s) => ("prompt", Value::String(s)),
            PromptIn::Ids(ids) => ("prompt", Value::from(ids)),
            PromptIn::Chat(messages) => ("messages", messages),
        };
        params.insert(name.into(), value);
        let body = Value::Object(params);
        let f = Fields::of(&body)?;
        let mut c = read_common(&f, &["max_tokens"])?;
        c.logprobs = completion_logprobs(&f)?;
        let ids = if name == "messages" {
            chat_prompt(&self.text, self.template.as_ref(), &self.info().name, &f)?
        } else {
            completion_prompt(&self.text, &f)?
        };
        let request = gen_request(&c, ids.clone(), name, Some(16), self.info(), &self.text)?;
        Ok((ids, request, c.stop))
    }

    /// Stops the engine (after the requests it runs) and waits for its ranks to end.
    pub fn close(&mut self) -> Result<(), OfflineError> {
        let Some(close) = self.close.take() else {
            return Ok(());
        };
        self.engine.drain();
        drop(close);
        match self.thread.take().map(JoinHandle::join) {
            Some(Ok(Err(why))) => Err(OfflineError::Engine(why)),
            Some(Err(_)) => Err(OfflineError::Engine("the engine's thread panicked".into())),
            _ => Ok(()),
        }
    }
}

impl Drop for OfflineEngine {
    fn drop(&mut self) {
        let _ = self.close();
    }
}

/// The engine's thread: runs the ranks until closed; hands the engine over once they have
/// loaded.
fn run_engine(
    plan: &crate::plan::Plan,
    ckpt: &Checkpoint,
    o: &OfflineOptions,
    ready: Sender<Arc<dyn Serving>>,
    close: Receiver<()>,
) -> Result<(), String> {
    let client = move |engine: Arc<dyn Serving>, _stopped: Receiver<()>| {
        if ready.send(engine).is_ok() {
            // Held open until the owner closes it or goes away.
            let _ = close.recv();
        }
    };
    let served = serve_on_device(plan, ckpt, &o.device, o.dtype, &o.engine, o.dp, client);
    match served {
        Err(e) => Err(e.to_string()),
        Ok((engine, _)) => engine.map_err(|e| e.to_string()),
    }
}
