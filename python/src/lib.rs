//! tpc's Python extension, `tpc._tpc`: the offline engine (`tpc::serve::offline`), the
//! compiler and the cost model. Batches and results cross as JSON; the Python layer
//! (`tpc/__init__.py`) gives them vLLM's shapes. Loading and generation release the GIL;
//! Ctrl-C during a generation cancels its requests and raises `KeyboardInterrupt`.

use pyo3::exceptions::{PyKeyboardInterrupt, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use serde_json::{Map, Value};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Mutex;
use tpc::runtime::device::Device;
use tpc::runtime::engine::launch::EngineOptions;
use tpc::runtime::generate::ComputeDtype;
use tpc::serve::offline::{
    compile_model, served_name, OfflineEngine, OfflineError, OfflineOptions, PromptIn,
};

fn offline_error(e: OfflineError) -> PyErr {
    match e {
        OfflineError::Invalid(m) => PyValueError::new_err(m),
        OfflineError::Engine(m) => PyRuntimeError::new_err(m),
        OfflineError::Interrupted => PyKeyboardInterrupt::new_err(e.to_string()),
    }
}

fn value_error(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// `tp_shares` ("3,1,1,1"), checked as `--tp-shares` is.
fn shares_of(text: Option<&str>) -> PyResult<Option<tpc::ir::TpShares>> {
    text.map(|t| {
        t.parse()
            .map_err(|e: String| value_error(format!("tp_shares {t:?}: {e}")))
    })
    .transpose()
}

fn dtype_of(name: &str) -> PyResult<ComputeDtype> {
    match name {
        "auto" => Ok(ComputeDtype::Auto),
        "float32" | "float" | "f32" => Ok(ComputeDtype::F32),
        "bfloat16" | "bf16" => Ok(ComputeDtype::Bf16),
        other => Err(PyValueError::new_err(format!(
            "dtype `{other}`: give \"auto\" (the checkpoint's), \"float32\" or \"bfloat16\" (linear weights kept in bf16, f32 arithmetic)"
        ))),
    }
}

/// A loaded model and its engine, running until `close()`.
#[pyclass(module = "tpc._tpc")]
struct Engine {
    inner: Mutex<Option<OfflineEngine>>,
}

impl Engine {
    fn with<T>(&self, f: impl FnOnce(&OfflineEngine) -> PyResult<T>) -> PyResult<T> {
        let guard = self
            .inner
            .lock()
            .map_err(|_| PyRuntimeError::new_err("the engine failed in another thread"))?;
        match guard.as_ref() {
            Some(e) => f(e),
            None => Err(PyRuntimeError::new_err(
                "this LLM is closed; make a new one",
            )),
        }
    }
}

/// One batch item: `{"prompt": text or ids}` or `{"messages": [...]}`, with `"params"`.
fn batch_item(item: Value) -> PyResult<(PromptIn, Map<String, Value>)> {
    let Value::Object(mut item) = item else {
        return Err(value_error("a batch item must be an object"));
    };
    let params = match item.remove("params") {
        Some(Value::Object(p)) => p,
        None => Map::new(),
        Some(_) => return Err(value_error("a batch item's params must be an object")),
    };
    let prompt = match (item.remove("prompt"), item.remove("messages")) {
        (Some(Value::String(s)), None) => PromptIn::Text(s),
        (Some(Value::Array(ids)), None) => PromptIn::Ids(
            ids.iter()
                .map(|v| {
                    v.as_i64().ok_or_else(|| {
                        value_error(format!(
                            "a token-id prompt holds whole numbers only, found {v}"
                        ))
                    })
                })
                .collect::<PyResult<_>>()?,
        ),
        (None, Some(messages)) => PromptIn::Chat(messages),
        _ => return Err(value_error("a batch item needs a prompt or messages")),
    };
    Ok((prompt, params))
}

#[pymethods]
impl Engine {
    #[new]
    #[pyo3(signature = (
        model, tp=1, pp=None, dp=1, device="cpu", dtype="auto", max_model_len=None,
        kv_cache_memory=None, max_num_seqs=None, max_num_batched_tokens=None, block_size=16,
        enable_prefix_caching=true, threads_per_rank=0, tp_shares=None,
        enable_expert_parallel=false
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        model: PathBuf,
        tp: u64,
        pp: Option<u64>,
        dp: usize,
        device: &str,
        dtype: &str,
        max_model_len: Option<usize>,
        kv_cache_memory: Option<u64>,
        max_num_seqs: Option<usize>,
        max_num_batched_tokens: Option<usize>,
        block_size: usize,
        enable_prefix_caching: bool,
        threads_per_rank: usize,
        tp_shares: Option<&str>,
        enable_expert_parallel: bool,
    ) -> PyResult<Engine> {
        let shares = shares_of(tp_shares)?;
        let mut device: Device = device.parse().map_err(value_error)?;
        if let Device::Cpu(cpu) = &mut device {
            cpu.threads_per_rank = threads_per_rank;
        }
        if block_size == 0 || block_size > 1024 {
            return Err(value_error(format!(
                "block_size {block_size}: give 1 to 1024 token slots per KV-cache block"
            )));
        }
        let defaults = EngineOptions::default();
        let name = served_name(&model);
        let options = OfflineOptions {
            tp,
            shares,
            pp,
            dp,
            device,
            dtype: dtype_of(dtype)?,
            engine: EngineOptions {
                block_size,
                kv_cache_memory,
                max_num_seqs: max_num_seqs.unwrap_or(defaults.max_num_seqs),
                max_num_batched_tokens: max_num_batched_tokens
                    .unwrap_or(defaults.max_num_batched_tokens),
                // An offline batch is queued whole.
                max_waiting: usize::MAX,
                prefix_caching: enable_prefix_caching,
                max_model_len,
                model_name: name,
                expert_parallel: enable_expert_parallel,
            },
        };
        let engine = py
            .allow_threads(|| OfflineEngine::start(&model, options))
            .map_err(offline_error)?;
        Ok(Engine {
            inner: Mutex::new(Some(engine)),
        })
    }

    /// `{"name", "vocab", "context", "layout"}` as JSON.
    fn info(&self) -> PyResult<String> {
        self.with(|e| {
            let i = e.info();
            Ok(serde_json::json!({
                "name": i.name, "vocab": i.vocab, "context": i.context, "layout": e.layout,
            })
            .to_string())
        })
    }

    /// Runs a batch (a JSON list of items) and returns the results as a JSON list, in order.
    #[pyo3(signature = (batch, progress=false))]
    fn generate(&self, py: Python<'_>, batch: &str, progress: bool) -> PyResult<String> {
        let items: Vec<Value> = serde_json::from_str(batch).map_err(value_error)?;
        let items = items
            .into_iter()
            .map(batch_item)
            .collect::<PyResult<Vec<_>>>()?;
        let bar = if progress && std::io::stderr().is_terminal() {
            let bar = indicatif::ProgressBar::new(items.len() as u64);
            bar.set_message("generating");
            bar
        } else {
            indicatif::ProgressBar::hidden()
        };
        self.with(|engine| {
            let mut raised: Option<PyErr> = None;
            let result = py.allow_threads(|| {
                engine.generate(
                    items,
                    &mut |done, _| bar.set_position(done as u64),
                    &mut || {
                        Python::with_gil(|py| match py.check_signals() {
                            Ok(()) => false,
                            Err(e) => {
                                raised = Some(e);
                                true
                            }
                        })
                    },
                )
            });
            bar.finish_and_clear();
            match result {
                Ok(outs) => serde_json::to_string(&outs).map_err(value_error),
                Err(OfflineError::Interrupted) => {
                    Err(raised.unwrap_or_else(|| offline_error(OfflineError::Interrupted)))
                }
                Err(e) => Err(offline_error(e)),
            }
        })
    }

    /// The model folder's tokenizer: `text`'s ids, with the special tokens HF adds.
    fn encode(&self, text: &str) -> PyResult<Vec<i64>> {
        self.with(|e| {
            let t = e.text_side().tokenizer.as_ref().ok_or_else(|| {
                value_error("this model folder has no tokenizer.json; give token ids")
            })?;
            t.encode(text).map_err(value_error)
        })
    }

    fn decode(&self, ids: Vec<i64>) -> PyResult<String> {
        self.with(|e| {
            let t = e.text_side().tokenizer.as_ref().ok_or_else(|| {
                value_error("this model folder has no tokenizer.json, so ids cannot be decoded")
            })?;
            t.decode(&ids).map_err(value_error)
        })
    }

    /// Stops the engine and waits for its ranks; later calls fail.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let engine = self
            .inner
            .lock()
            .map_err(|_| PyRuntimeError::new_err("the engine failed in another thread"))?
            .take();
        match engine {
            Some(mut e) => py.allow_threads(|| e.close()).map_err(offline_error),
            None => Ok(()),
        }
    }
}

/// A compiled plan.
#[pyclass(module = "tpc._tpc")]
struct Plan {
    plan: tpc::plan::Plan,
}

#[pymethods]
impl Plan {
    /// The report `tpc compile` prints.
    fn summary(&self) -> String {
        tpc::plan::report::render_table(&tpc::plan::report::summarize(&self.plan))
    }

    /// The report as `tpc compile --json` gives it.
    fn summary_json(&self) -> PyResult<String> {
        serde_json::to_string(&tpc::plan::report::summarize(&self.plan)).map_err(value_error)
    }

    /// Every rank's program as text.
    fn to_text(&self) -> String {
        tpc::plan::text::render_plan(&self.plan)
    }

    /// The plan as Graphviz DOT.
    fn to_dot(&self) -> String {
        tpc::plan::dot::draw(&self.plan, &tpc::plan::dot::DotOptions::default()).text
    }

    /// Writes the plan (RON, or JSON for a `.json` name), as `tpc compile -o`.
    fn save(&self, path: PathBuf) -> PyResult<()> {
        self.plan.save(&path).map_err(value_error)
    }
}

/// Compiles a model (.ron, HF folder or config.json) for `tp` ranks (and `pp` stages).
#[pyfunction]
#[pyo3(signature = (model, tp=1, pp=None, tp_shares=None))]
fn compile(
    py: Python<'_>,
    model: PathBuf,
    tp: u64,
    pp: Option<u64>,
    tp_shares: Option<&str>,
) -> PyResult<Plan> {
    let shares = shares_of(tp_shares)?;
    let plan = py
        .allow_threads(|| compile_model(&model, tp, pp, shares))
        .map_err(offline_error)?;
    Ok(Plan { plan })
}

/// The cost model's estimate of the plan for `tp` × `pp` on a hardware profile, as JSON.
#[pyfunction]
#[pyo3(signature = (model, tp=1, pp=1, hw="h100-sxm-nvswitch-8", batch=1, prompt_len=128, gen=128, tp_shares=None))]
#[allow(clippy::too_many_arguments)]
fn simulate(
    py: Python<'_>,
    model: PathBuf,
    tp: u64,
    pp: u64,
    hw: &str,
    batch: u64,
    prompt_len: u64,
    gen: u64,
    tp_shares: Option<&str>,
) -> PyResult<String> {
    let shares = shares_of(tp_shares)?;
    py.allow_threads(|| {
        let hw = tpc::cost::shipped_profiles::find_profile(std::path::Path::new(hw))
            .map_err(value_error)?;
        let plan = compile_model(&model, tp, None, shares).map_err(offline_error)?;
        let work = tpc::cost::simulate::Workload {
            batch,
            prompt: prompt_len,
            gen,
        };
        let numerics = tpc::cost::simulate::Numerics::for_profile(&plan, &hw);
        let e = tpc::cost::simulate::simulate_pp(&plan, &hw, work, numerics, pp)
            .map_err(value_error)?;
        serde_json::to_string(&e).map_err(value_error)
    })
}

#[pymodule]
fn _tpc(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Engine>()?;
    m.add_class::<Plan>()?;
    m.add_function(wrap_pyfunction!(compile, m)?)?;
    m.add_function(wrap_pyfunction!(simulate, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
