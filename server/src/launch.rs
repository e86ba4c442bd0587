//! Wiring: bind, start the worker (which loads the model), the batcher and the HTTP server;
//! stop gracefully on SIGTERM / ctrl-c.

use crate::accept::{self, ConnLimits};
use crate::args::Args;
use crate::batcher::{BatchConfig, Batcher};
use crate::cache::ScoreCache;
use crate::metrics::Metrics;
use crate::routes::{router, AppState, BodyPace, ServerConfig};
use crate::shutdown;
use crate::worker::{self, WorkerConfig};
use anyhow::{anyhow, bail, Context, Result};
use std::io::Write;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};

/// `--check-args`: flags and model directory are valid (weights are not loaded).
pub fn check_args(args: &Args) -> Result<()> {
    args.check().map_err(|e| anyhow!(e))?;
    let max_pos = crate::model::check_model(&args.model)
        .with_context(|| format!("opening {}", args.model.display()))?;
    if let Some(n) = args.max_seq_len {
        if n > max_pos {
            bail!("--max-seq-len {n} exceeds the model's max_position_embeddings {max_pos}");
        }
    }
    Ok(())
}

/// Runs the server until SIGTERM / ctrl-c; in-flight requests finish first.
pub async fn run(args: Args) -> Result<()> {
    args.check().map_err(|e| anyhow!(e))?;
    let metrics = Arc::new(Metrics::default());

    // 0. As many open files as the hard limit allows; keep some for the model and the logs.
    let conn_cap = match accept::raise_fd_limit() {
        Ok(n) => {
            tracing::info!(open_files = n, "file descriptor limit");
            usize::try_from(n.saturating_sub(64))
                .unwrap_or(usize::MAX)
                .max(16)
        }
        Err(e) => {
            tracing::warn!("could not read or raise the open-files limit: {e}");
            usize::MAX
        }
    };

    // 1. Bind first, so health checks see "loading" rather than "connection refused".
    let addr = std::net::SocketAddr::new(args.host, args.port);
    let max_connections = args.max_connections.min(conn_cap);
    let listener =
        accept::bind(addr, max_connections).with_context(|| format!("binding {addr}"))?;
    let local = listener.local_addr()?;
    tracing::info!("listening on {local}");
    // A parseable line for scripts and tests that start the server on port 0.
    println!("listening on {local}");
    let _ = std::io::stdout().flush();

    // 2. The worker thread loads the model and reports on `ready`.
    let (batch_tx, batch_rx) = mpsc::channel(1);
    let (ready_tx, ready_rx) = oneshot::channel();
    let worker_thread = worker::spawn(
        WorkerConfig {
            model: args.model.clone(),
            device: args.device.clone(),
            dtype: args.dtype.clone(),
            max_batch_tokens: args.max_batch_tokens,
            topk: args.topk,
            lm_head: args.lm_head,
            batch_invariant: args.batch_invariant,
            packed_rows: args.packed_rows(),
            gguf_weights: args.gguf_weights.into(),
        },
        metrics.clone(),
        batch_rx,
        ready_tx,
    )
    .context("starting the worker thread")?;
    let batcher = Batcher::start(
        BatchConfig {
            max_batch_tokens: args.max_batch_tokens,
            max_wait: Duration::from_millis(args.max_wait_ms()),
            max_queue_tokens: args.max_queue_tokens,
        },
        batch_tx,
        metrics.clone(),
    );
    let state = Arc::new(AppState {
        config: ServerConfig {
            max_k: args.max_k,
            max_seq_len: args.max_seq_len,
            max_batch_tokens: args.max_batch_tokens,
            max_queue_tokens: args.max_queue_tokens,
            max_sequences: args.max_sequences,
            max_answer_bytes: args.max_answer_bytes,
            max_body_bytes: args.max_body_bytes,
            max_wait_ms: args.max_wait_ms(),
            body_timeout: Duration::from_secs_f64(args.body_timeout_secs),
            body_pace: BodyPace {
                min_rate: args.min_body_rate,
                grace: Duration::from_secs_f64(args.min_rate_grace_secs),
            },
            api_key: args.resolve_api_key().map_err(|e| anyhow!(e))?,
            served_model_name: args.model_name(),
            batch_invariant: args.batch_invariant,
        },
        ready: OnceLock::new(),
        batcher,
        cache: ScoreCache::new(args.cache_bytes),
        metrics,
    });

    // 3. A failed load stops the server with the load error.
    let (stop_tx, stop_rx) = watch::channel(false);
    let load_error: Arc<OnceLock<String>> = Arc::new(OnceLock::new());
    {
        let state = state.clone();
        let load_error = load_error.clone();
        tokio::spawn(async move {
            let mut lm_head = "";
            let outcome = match ready_rx.await {
                Ok(Ok(facts)) => {
                    lm_head = facts.lm_head;
                    state.set_ready(facts)
                }
                Ok(Err(e)) => Err(e),
                Err(_) => Err("the worker thread died while loading".into()),
            };
            match outcome {
                Ok(()) => tracing::info!(
                    host_simd = xdistill_cpu_kernels::simd::Simd::current().name(),
                    lm_head,
                    "ready"
                ),
                Err(e) => {
                    let _ = load_error.set(e);
                    let _ = stop_tx.send(true);
                }
            }
        });
    }

    // 4. Serve until a signal (or a load failure); in-flight requests finish first.
    let limits = ConnLimits {
        header_timeout: Duration::from_secs_f64(args.header_timeout_secs),
        max_connections,
        max_per_client: args.max_connections_per_client,
        drain_timeout: Duration::from_secs(600),
        write_timeout: Duration::from_secs_f64(args.write_timeout_secs),
    };
    accept::serve(
        listener,
        router(state.clone()),
        limits,
        shutdown::signal(stop_rx),
    )
    .await;
    // Dropping the last batcher handle closes the queue; the worker finishes what it has.
    drop(state);
    let _ = tokio::task::spawn_blocking(move || worker_thread.join()).await;
    if let Some(e) = load_error.get() {
        bail!("loading the model failed: {e}");
    }
    tracing::info!("stopped");
    Ok(())
}
