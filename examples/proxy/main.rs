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
//! agent's own session header (`HeaderKey::default()`), else from the JSON body
//! (`prompt_cache_key`, `user`, `metadata.user_id`). Requests are forwarded as sent but for the
//! scheme, authority and `Host` (the backend's), hop-by-hop headers and `Accept-Encoding`
//! (`identity`, so that the answer's usage can be read, except on a `GET` or `HEAD`);
//! responses stream back frame by frame, and the backend's slot is held until the response
//! ends. A request whose backend fails before answering is retried once elsewhere. `/health`
//! (and `/slots`) of each backend is polled; `GET /metrics` answers in the Prometheus text
//! format. Each request gets an `x-request-id` (unless it has one), sent to the backend and
//! returned; `-v` logs a span per request.
//! `--help` lists every option.
//!
//! It is wiring over the library's features `client` (`HttpBackend`), `health`
//! (`HealthProbe`), `dns` (`DnsFleet`, for `--backend-dns`) and `redis` (`RedisStore`, for
//! `--redis`): `cargo run --features health,dns,redis --example proxy -- ...`.

mod app;
mod cli;
mod per_client;

use std::process::ExitCode;
use std::sync::Arc;

use app::Proxy;
use cli::Command;

fn main() -> ExitCode {
    // `args_os`: `args` panics on an argument that is not UTF-8.
    let parsed = cli::parse(std::env::args_os().skip(1)).and_then(|command| match command {
        Command::Run(mut args) => {
            let env = std::env::var_os("TOKIO_WORKER_THREADS");
            args.worker_threads = cli::worker_threads(args.worker_threads, env.as_deref())?;
            Ok(Command::Run(args))
        }
        help => Ok(help),
    });
    let args = match parsed {
        Ok(Command::Run(args)) => *args,
        Ok(Command::Help) => {
            // Not `println!`, which panics when the reader has gone (`proxy --help | head`).
            use std::io::Write;
            let _ = writeln!(std::io::stdout(), "{}", cli::USAGE);
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            // Nor `eprintln!`, which panics when stderr is a pipe whose reader has gone: the
            // exit status (2, not a panic's 101) still says it.
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "proxy: {e}");
            return ExitCode::from(2);
        }
    };
    let level = if args.verbose {
        tracing::Level::DEBUG
    } else {
        tracing::Level::INFO
    };
    app::logs(level).init();

    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    runtime.enable_all();
    // Given, tokio does not read `TOKIO_WORKER_THREADS` itself (and panic on a bad one).
    if let Some(n) = args.worker_threads {
        runtime.worker_threads(n.get());
    }
    let result = match runtime.build() {
        Ok(runtime) => {
            // A warning, not a refusal: two names of one address may be two servers behind
            // a front that routes by `Host`, which each backend is sent.
            if let Err(e) = runtime.block_on(app::one_server_each(&args.config.backends)) {
                tracing::warn!("{e}");
            }
            runtime.block_on(run(args))
        }
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
    let backends = config.backends.clone();
    let probe = config.probe_interval.is_some();
    app::log_fleet(&config);
    let proxy = Arc::new(Proxy::new(config).await?);
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| format!("--listen {}: {e}", args.listen))?;
    cli::refuse_own_listener(&listener, args.listen, &backends)?;
    app::log_listening(proxy.config(), listener.local_addr()?);
    if probe {
        // Before the first request: a loading backend is down and slot counts are known.
        proxy.probe_all().await;
    }
    let probe_tasks = proxy.spawn_probes();
    // The first Ctrl-C or SIGTERM lets open responses finish; a second stops at once.
    let (signalled, signals) = tokio::sync::watch::channel(0u32);
    tokio::spawn(count_signals(Signals::new(), signalled));
    let nth = |n: u32| {
        let mut signals = signals.clone();
        async move {
            let _ = signals.wait_for(|&count| count >= n).await;
        }
    };
    app::serve(listener, proxy.front(), nth(1), nth(2)).await?;
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

/// Counts each Ctrl-C and SIGTERM: the first stops accepting and lets open responses
/// finish, a second given later stops at once.
async fn count_signals(mut signals: Signals, count: tokio::sync::watch::Sender<u32>) {
    signals.next().await;
    // The serving loop logs that it is shutting down.
    count.send_replace(1);
    // One signal may come more than once: `timeout` forwards it to the proxy and to its
    // process group, the proxy among them. Those come within moments of each other; a second
    // signal is one given later.
    let settle = tokio::time::sleep(std::time::Duration::from_millis(500));
    let mut settle = std::pin::pin!(settle);
    loop {
        tokio::select! {
            () = &mut settle => break,
            () = signals.next() => {}
        }
    }
    signals.next().await;
    count.send_replace(2);
}

/// Ctrl-C and SIGTERM. On Unix both are listened for for good, so that none is missed
/// between two waits.
struct Signals {
    #[cfg(unix)]
    listeners: Vec<tokio::signal::unix::Signal>,
}

impl Signals {
    fn new() -> Self {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            // A signal that cannot be listened for never comes.
            let listeners = [SignalKind::interrupt(), SignalKind::terminate()]
                .into_iter()
                .filter_map(|kind| signal(kind).ok())
                .collect();
            Signals { listeners }
        }
        #[cfg(not(unix))]
        Signals {}
    }

    async fn next(&mut self) {
        #[cfg(unix)]
        {
            let received = std::future::poll_fn(|cx| {
                for listener in &mut self.listeners {
                    if let std::task::Poll::Ready(got) = listener.poll_recv(cx) {
                        return std::task::Poll::Ready(got.is_some());
                    }
                }
                std::task::Poll::Pending
            });
            if !received.await {
                std::future::pending::<()>().await;
            }
        }
        #[cfg(not(unix))]
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}
