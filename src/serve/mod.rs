//! `tpc serve`'s HTTP server: OpenAI's completion, chat, model, health and metrics
//! endpoints over any [`Serving`] engine, so it is tested over a stand-in engine. It sits
//! above `runtime` (the engine's API) and `frontend` (tokenizer, model-folder settings) and
//! below `cli`.

mod api_error;
mod app;
pub mod chat_template;
mod fields;
mod generation;
pub mod offline;
mod params;
mod responses;
mod stream;
mod strftime;
mod text_emitter;
pub mod text_side;

pub use api_error::ApiError;
pub use text_side::{GenerationDefaults, TextSide};

use crate::runtime::engine::api::Serving;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;

/// How and where the server listens, and how it stops.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    pub host: String,
    /// 0: the system picks a free port (`on_listening` gets it).
    pub port: u16,
    /// Request bodies larger than this are refused with 413.
    pub max_body_bytes: usize,
    /// After SIGTERM (or `stop`), how long running requests may take to finish.
    pub shutdown_timeout: Duration,
    /// Stop on SIGTERM and SIGINT (off in tests, which share their process).
    pub handle_signals: bool,
    /// `notify_one()` stops the server as SIGTERM does.
    pub stop: Option<Arc<Notify>>,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            host: "127.0.0.1".into(),
            port: 8000,
            max_body_bytes: 32 << 20,
            shutdown_timeout: Duration::from_secs(30),
            handle_signals: true,
            stop: None,
        }
    }
}

/// Why the server could not start or run; each message says the fix.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot listen on {addr}: {source}; {hint}")]
    Bind {
        addr: String,
        source: std::io::Error,
        hint: &'static str,
    },
    #[error("{}: {message}", path.display())]
    ModelFile { path: PathBuf, message: String },
    #[error(transparent)]
    Model(#[from] crate::TpcError),
    #[error("cannot start the server's threads: {0}; free some memory or threads and retry")]
    Runtime(std::io::Error),
    #[error("cannot watch for SIGTERM and SIGINT: {0}")]
    Signal(std::io::Error),
    #[error("the HTTP server failed: {0}")]
    Serve(std::io::Error),
}

fn bind_hint(e: &std::io::Error) -> &'static str {
    match e.kind() {
        std::io::ErrorKind::AddrInUse => {
            "another program listens on that port; give another --port, or --port 0 to pick a free one"
        }
        std::io::ErrorKind::PermissionDenied => {
            "ports below 1024 need privileges; give a port above 1023, or --port 0"
        }
        _ => "check --host (an address or name of this machine, such as 127.0.0.1 or 0.0.0.0) and --port",
    }
}

/// The model folder's chat template, compiled (`None`: it has none).
fn compiled_template(text: &TextSide) -> Result<Option<chat_template::ChatTemplate>, ServeError> {
    match &text.chat_template {
        None => Ok(None),
        Some(source) => chat_template::ChatTemplate::new(source)
            .map(Some)
            .map_err(|message| ServeError::ModelFile {
                path: "tokenizer_config.json".into(),
                message: format!("the chat template does not compile: {message}"),
            }),
    }
}

/// Serves `engine` until SIGTERM/SIGINT (or `opts.stop`), then stops accepting, drains the
/// engine and waits up to `opts.shutdown_timeout` for running requests before returning.
/// `on_listening` gets the bound address once requests are accepted.
pub fn serve_blocking(
    engine: Arc<dyn Serving>,
    text: TextSide,
    opts: ServerOptions,
    on_listening: impl FnOnce(SocketAddr),
) -> Result<(), ServeError> {
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .clamp(1, 4);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name("tpc-http")
        .enable_all()
        .build()
        .map_err(ServeError::Runtime)?;
    // Dropping the runtime afterwards drops requests still running past the timeout, which
    // cancels them in the engine.
    runtime.block_on(serve(engine, text, opts, on_listening))
}

async fn serve(
    engine: Arc<dyn Serving>,
    text: TextSide,
    opts: ServerOptions,
    on_listening: impl FnOnce(SocketAddr),
) -> Result<(), ServeError> {
    let template = compiled_template(&text)?;
    let addr = format!("{}:{}", opts.host, opts.port);
    let listener = tokio::net::TcpListener::bind((opts.host.as_str(), opts.port))
        .await
        .map_err(|source| ServeError::Bind {
            hint: bind_hint(&source),
            addr: addr.clone(),
            source,
        })?;
    let local = listener.local_addr().map_err(|source| ServeError::Bind {
        hint: bind_hint(&source),
        addr,
        source,
    })?;
    let app = Arc::new(app::App {
        engine: engine.clone(),
        text: Arc::new(text),
        template,
        created: app::now_secs(),
        max_body_bytes: opts.max_body_bytes,
        next_id: AtomicU64::new(0),
    });
    // Installed before the address is announced, so a signal right after it is not lost.
    let stopped = stop_signal(opts.handle_signals, opts.stop.clone())?;
    on_listening(local);
    let (began_tx, began_rx) = tokio::sync::oneshot::channel();
    let drain_engine = engine.clone();
    let shutdown = async move {
        stopped.await;
        drain_engine.drain();
        let _ = began_tx.send(tokio::time::Instant::now());
    };
    let server = axum::serve(listener, app::router(app)).with_graceful_shutdown(shutdown);
    let server = std::future::IntoFuture::into_future(server);
    tokio::pin!(server);
    let timeout = opts.shutdown_timeout;
    let mut began_rx = began_rx;
    // The server ends once every connection has closed; running streams keep theirs open,
    // so past the deadline it is left (and its requests cancelled when the runtime drops).
    let deadline = tokio::select! {
        served = &mut server => {
            served.map_err(ServeError::Serve)?;
            match began_rx.try_recv() {
                Ok(began) => began + timeout,
                Err(_) => tokio::time::Instant::now() + timeout,
            }
        }
        began = &mut began_rx => {
            let deadline = began.unwrap_or_else(|_| tokio::time::Instant::now()) + timeout;
            if let Ok(served) = tokio::time::timeout_at(deadline, &mut server).await {
                served.map_err(ServeError::Serve)?;
            }
            deadline
        }
    };
    // Requests the engine still holds (their clients gone) get the rest of the time.
    while engine.load() != (0, 0) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

/// Resolves on SIGTERM, SIGINT (when `signals`) or `stop`'s notification.
fn stop_signal(
    signals: bool,
    stop: Option<Arc<Notify>>,
) -> Result<impl std::future::Future<Output = ()>, ServeError> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut streams = Vec::new();
    if signals {
        for kind in [SignalKind::terminate(), SignalKind::interrupt()] {
            streams.push(signal(kind).map_err(ServeError::Signal)?);
        }
    }
    Ok(async move {
        let any_signal = async {
            if streams.is_empty() {
                std::future::pending::<()>().await;
            }
            let waits = streams.iter_mut().map(|s| Box::pin(s.recv()));
            futures_util::future::select_all(waits).await;
        };
        let notified = async {
            match &stop {
                Some(n) => n.notified().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = any_signal => {}
            _ = notified => {}
        }
    })
}
