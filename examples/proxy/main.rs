//! An OpenAI-compatible reverse proxy for llama-server fleets, built on `tower-affinity`.
//!
//! ```text
//! cargo run --release --features health,dns,redis --example proxy -- --listen 127.0.0.1:8080 \
//!     --backend node-a=http://host-a:8081,slots=2 \
//!     --backend node-a=http://host-a:8082,slots=2 \
//!     --backend node-b=http://host-b:8081,slots=2 \
//!     --policy node-then-backend
//! ```
//!
//! Each request's session key comes from `X-Session-Affinity` / `X-Session-Id` or a coding
//! agent's own session header (`HeaderKey::default()`), else from the JSON body (`prompt_cache_key`, `user`, `metadata.user_id`). Requests are forwarded as sent
//! (only the scheme and authority change), responses stream back frame by frame, and the
//! backend's slot is held until the response ends. A request whose backend fails before
//! answering is retried once elsewhere. `/health` (and `/slots`) of each backend is polled;
//! `GET /metrics` answers in the Prometheus text format. Each request gets an `x-request-id`
//! (unless it has one), sent to the backend and returned; `-v` logs a span per request.
//! `--help` lists every option.
//!
//! It is wiring over the library's features `client` (`HttpBackend`) and `health`
//! (`HealthProbe`): `cargo run --features health,dns,redis --example proxy -- ...`.

mod app;
mod cli;
mod per_client;

use std::process::ExitCode;
use std::sync::Arc;

use app::Proxy;
use cli::Command;

fn main() -> ExitCode {
    let args = match cli::parse(std::env::args().skip(1)) {
        Ok(Command::Run(args)) => *args,
        Ok(Command::Help) => {
            // Not `println!`, which panics when the reader has gone (`proxy --help | head`).
            use std::io::Write;
            let _ = writeln!(std::io::stdout(), "{}", cli::USAGE);
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("proxy: {e}");
            return ExitCode::from(2);
        }
    };
    let level = if args.verbose {
        tracing::Level::DEBUG
    } else {
        tracing::Level::INFO
    };
    // Logs go to stderr, coloured only on a terminal so log files stay plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .init();

    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    runtime.enable_all();
    if let Some(n) = args.worker_threads {
        runtime.worker_threads(n.get());
    }
    let result = match runtime.build() {
        Ok(runtime) => runtime.block_on(run(args)),
        Err(e) => Err(e.into()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "proxy stopped");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: cli::Args) -> Result<(), tower_affinity::BoxError> {
    let config = args.config;
    let policy = config.policy.name();
    let probe = config.probe_interval.is_some();
    for b in &config.backends {
        let slots = match b.slots {
            Some(n) => n.to_string(),
            None if probe && config.probe_slots => "from /slots".to_string(),
            None => "1 (no slots= given, and /slots is not read)".to_string(),
        };
        let cache_tokens = config.cache_tokens(&b.id);
        // A backend given `model=` says so; the others, as without models, do not.
        let model = b.model.as_deref();
        tracing::info!(backend = %b.id, node = %b.node, url = %format!("{}://{}", b.scheme, b.authority), %slots, cache_tokens, model, "backend");
    }
    let proxy = Arc::new(Proxy::new(config).await?);
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| format!("--listen {}: {e}", args.listen))?;
    tracing::info!(listen = %listener.local_addr()?, policy, "proxy listening");
    if probe {
        // Before the first request: a loading backend is down and slot counts are known.
        proxy.probe_all().await;
    }
    let probe_tasks = proxy.spawn_probes();
    app::serve(listener, proxy.front(), shutdown_signal()).await?;
    drop(probe_tasks);
    for fleet in proxy.fleets() {
        let stats = fleet.affinity.stats();
        tracing::info!(
            model = fleet.model.as_deref(),
            placed = stats.placed(),
            home_hits = stats.home_hits,
            spills = stats.same_node_spills + stats.cross_node_spills,
            backend_errors = stats.backend_errors,
            probe_transitions = fleet.prober.transitions(),
            "proxy stopped"
        );
    }
    Ok(())
}

/// Ctrl-C or SIGTERM: stop accepting, let open responses finish.
async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
    tracing::info!("shutting down: no new connections, open responses finish");
}
