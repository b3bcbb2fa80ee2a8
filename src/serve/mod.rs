//! `nanogpt serve`: the model behind an OpenAI-compatible HTTP API, so that chat UIs,
//! scripts written for OpenAI's API and lm-evaluation-harness can use it.
//!
//! ```text
//! POST /v1/completions        prompt (text, token ids, or lists of them), echo, logprobs
//! POST /v1/chat/completions   messages, in the model's chat template
//! GET  /v1/models             the one model
//! GET  /health                status, queue, request and token counts
//! GET  /tokenizer_info, POST /tokenize, /detokenize   vLLM's (lm-evaluation-harness)
//! ```
//!
//! One model is in memory, on one thread ([`engine`]); requests wait in a bounded
//! queue (a 503 when it is full) and are generated one at a time. HTTP runs on a
//! single-threaded tokio runtime beside it (`http`), so that the cores stay the
//! model's.

pub mod api;
pub mod engine;
mod http;
pub mod request;

use crate::chat::ChatFormat;
use crate::data::instruct::instruct_eot;
use crate::model_source::LoadedModel;
use anyhow::{bail, Context, Result};
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use axum::Router;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

/// Request bodies above this are refused (413): a full context of token ids takes a
/// few kilobytes, a batch of 256 of them a few megabytes.
pub const MAX_BODY_BYTES: usize = 8 << 20;

/// How the server runs.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    pub addr: SocketAddr,
    /// The name under which `/v1/models` lists the model.
    pub model_name: String,
    /// Requests refused with 401 unless they carry `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
    /// Requests that may wait for the model (beyond the one it runs).
    pub queue: usize,
    /// Matmul weights in bf16, a prompt's products on this back-end; None: f32.
    pub bf16: Option<crate::kernels::bf16::Backend>,
    /// The template of `/v1/chat/completions`.
    pub template: ChatFormat,
}

/// Counts for the log and `/health`.
#[derive(Default)]
pub struct Counts {
    pub requests: AtomicU64,
    pub busy: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
}

/// What every request handler reads.
pub struct Shared {
    model_name: String,
    model: request::Model,
    api_key: Option<String>,
    jobs: tokio::sync::mpsc::Sender<engine::Job>,
    queue_capacity: usize,
    counts: Counts,
    created: u64,
}

/// Serves `model` until SIGINT or SIGTERM: binds `opts.addr`, prints the address on
/// stderr (`listening on http://ADDR`), then answers requests.
pub fn serve(model: LoadedModel, opts: ServeOptions) -> Result<()> {
    if opts.queue == 0 {
        bail!("--queue must be at least 1");
    }
    let tokenizer = Arc::new(model.tokenizer.clone());
    let (jobs, queued) = tokio::sync::mpsc::channel(opts.queue);
    let shared = Arc::new(Shared {
        model_name: opts.model_name.clone(),
        model: request::Model {
            tokenizer: Arc::clone(&tokenizer),
            eot: instruct_eot(&tokenizer).ok(),
            vocab: model.config.vocab_size,
            block: model.config.block_size,
            template: opts.template,
        },
        api_key: opts.api_key.clone(),
        jobs,
        queue_capacity: opts.queue,
        counts: Counts::default(),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    });
    let engine = engine::Engine::new(model.config, model.params, tokenizer, opts.bf16);
    let model_thread = std::thread::Builder::new()
        .name("model".into())
        .spawn(move || engine.run(queued))
        .context("cannot start the model's thread")?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .context("cannot start the HTTP runtime")?;
    crate::shutdown::install()?;
    let result = runtime.block_on(run_http(shared, &opts));
    // The model's thread ends when the last sender (the router's state) is gone.
    drop(runtime);
    let _ = model_thread.join();
    result
}

async fn run_http(shared: Arc<Shared>, opts: &ServeOptions) -> Result<()> {
    let listener = tokio::net::TcpListener::bind(opts.addr)
        .await
        .with_context(|| {
            format!(
                "cannot listen on {}; is another server using that port? pick another with --port",
                opts.addr
            )
        })?;
    let addr = listener.local_addr()?;
    crate::errln!(
        "listening on http://{addr} (model {}; queue {}, {})",
        shared.model_name,
        opts.queue,
        match &opts.api_key {
            Some(_) => "API key required",
            None => "no API key",
        }
    );
    if !addr.ip().is_loopback() {
        crate::errln!(
            "warning: listening on {} — reachable from other machines{}",
            addr.ip(),
            if opts.api_key.is_none() {
                ", with no API key"
            } else {
                ""
            }
        );
    }
    let app = Router::new()
        .route("/v1/completions", post(http::completions))
        .route("/v1/chat/completions", post(http::chat_completions))
        .route("/v1/models", get(http::models))
        .route("/health", get(http::health))
        .route("/tokenizer_info", get(http::tokenizer_info))
        .route("/tokenize", post(http::tokenize))
        .route("/detokenize", post(http::detokenize))
        .fallback(http::not_found)
        .method_not_allowed_fallback(http::method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(shared);
    axum::serve(listener, app)
        .with_graceful_shutdown(stop_requested())
        .await
        .context("the HTTP server failed")?;
    crate::errln!("stopped");
    Ok(())
}

/// Resolves at the first SIGINT/SIGTERM (a second one exits at once).
async fn stop_requested() {
    while crate::shutdown::requested().is_none() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    crate::errln!("stopping: finishing the requests in progress (again to quit at once)");
}
