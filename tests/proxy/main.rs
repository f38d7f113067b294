//! The proxy example, end to end over loopback HTTP against stub llama-servers.
//!
//! Every request has a deadline, every loop a bound: a regression fails fast instead of
//! hanging.

// The example's own modules, compiled here as they are there; main-only items go unused.
#[allow(dead_code)]
#[path = "../../examples/proxy/app.rs"]
mod app;
#[allow(dead_code)]
#[path = "../../examples/proxy/cli.rs"]
mod cli;
#[allow(dead_code)]
#[path = "../dns/server.rs"]
mod dns_server;
mod idle_clients;
#[allow(dead_code)]
#[path = "../support/llama_stub.rs"]
mod llama_stub;
#[path = "../support/logs.rs"]
mod logs;
mod overload;
#[path = "../../examples/proxy/per_client.rs"]
mod per_client;
#[path = "../support/proxy.rs"]
mod proxy;
#[allow(dead_code)]
#[path = "../support/redis_server.rs"]
mod redis_server;
#[path = "../support/refusing.rs"]
mod refusing;
mod replicas;

use refusing::Refusing;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tower_affinity::{Backend, Overflow};

use app::{Config, Proxy, UpstreamMode};
use llama_stub::Stub;

/// The longest any single request or body read may take.
const DEADLINE: Duration = Duration::from_secs(5);

// === harness ===

struct Running {
    addr: SocketAddr,
    proxy: Arc<Proxy>,
    client: Client<HttpConnector, Full<Bytes>>,
    _stop: oneshot::Sender<()>,
    _server: JoinHandle<std::io::Result<()>>,
}

/// Config for `(node, stub)` pairs, two slots each, the stub's name as the backend id, no
/// background probe (tests probe by hand).
/// A proxy's configuration of the `--backend` specs given, without probes.
fn config_of(specs: &[String]) -> Config {
    let backends = specs.iter().map(|spec| cli::backend(spec).unwrap().0);
    let mut config = Config::new(backends.collect());
    config.probe_interval = None;
    config
}

fn config(stubs: &[(&str, &Stub)]) -> Config {
    let backends = stubs
        .iter()
        .map(|(node, stub)| {
            let spec = format!("{node}={},slots=2,id={}", stub.url(), stub.state.name);
            cli::backend(&spec).unwrap().0
        })
        .collect();
    let mut config = Config::new(backends);
    config.probe_interval = None;
    config
}

/// `config` reaching its backends the `mode` way.
fn upstream(mut config: Config, mode: UpstreamMode) -> Config {
    config.upstream = mode;
    config
}

async fn start(config: Config) -> Running {
    let served = proxy::serve(config).await;
    Running {
        addr: served.addr,
        proxy: served.proxy,
        client: Client::builder(TokioExecutor::new()).build_http(),
        _stop: served.stop,
        _server: served.server,
    }
}

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Answer {
    fn backend(&self) -> &str {
        self.header("x-affinity-backend")
    }

    fn outcome(&self) -> &str {
        self.header("x-affinity-outcome")
    }

    fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .map_or("-", |v| v.to_str().unwrap_or("?"))
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "{e}: {} {:?}",
                self.status,
                String::from_utf8_lossy(&self.body)
            )
        })
    }
}

impl Running {
    /// What the service says of backend `id` now.
    fn status(&self, id: &str) -> tower_affinity::BackendStatus {
        self.proxy
            .affinity()
            .backends()
            .into_iter()
            .find(|s| s.id.as_str() == id)
            .unwrap_or_else(|| panic!("no backend {id}"))
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    async fn send(&self, req: Request<Full<Bytes>>) -> Response<Incoming> {
        tokio::time::timeout(DEADLINE, self.client.request(req))
            .await
            .expect("no response in time")
            .expect("request failed")
    }

    async fn fetch(&self, req: Request<Full<Bytes>>) -> Answer {
        let res = self.send(req).await;
        let (parts, body) = res.into_parts();
        let body = tokio::time::timeout(DEADLINE, body.collect())
            .await
            .expect("no body in time")
            .expect("body failed")
            .to_bytes();
        Answer {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    }

    async fn post_json(&self, headers: &[(&str, &str)], body: &Value) -> Answer {
        let mut req = Request::post(self.url("/v1/chat/completions"))
            .header("content-type", "application/json");
        for (n, v) in headers {
            req = req.header(*n, *v);
        }
        self.fetch(req.body(Full::new(Bytes::from(body.to_string()))).unwrap())
            .await
    }

    /// A keyed conversation whose first turn went to `backend`: sessions `{prefix}0`,
    /// `{prefix}1`... are tried in turn.
    async fn conversation_on(&self, backend: &str, prefix: &str) -> Conversation {
        for i in 0..32 {
            let mut c = Conversation::new(&format!("{prefix}{i}"));
            let answer = self.turn(&mut c).await;
            assert_eq!(answer.status, 200);
            c.answered(&answer);
            if answer.backend() == backend {
                return c;
            }
        }
        panic!("no conversation went to {backend}");
    }

    /// The next turn of keyed conversation `c`, its name its session key.
    async fn turn(&self, c: &mut Conversation) -> Answer {
        let body = c.next(json!({}));
        let session = c.name.clone();
        self.post_json(&[("x-session-id", &session)], &body).await
    }

    async fn get(&self, path: &str) -> Answer {
        self.fetch(
            Request::get(self.url(path))
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await
    }
}

/// An agent conversation: the same system prompt and task as every other, then turns that
/// append the answer and new tool output.
struct Conversation {
    name: String,
    messages: Vec<Value>,
    turns: usize,
}

impl Conversation {
    fn new(name: &str) -> Self {
        Conversation {
            name: name.to_string(),
            messages: vec![
                json!({"role": "system", "content": "You are a coding agent. Be brief."}),
                json!({"role": "user", "content": "Implement the spec in SPEC.md, step by step."}),
            ],
            turns: 0,
        }
    }

    /// The request body of the next turn, with `extra` fields merged in.
    fn next(&mut self, extra: Value) -> Value {
        self.turns += 1;
        if self.turns > 1 {
            let output = format!(
                "tool output {} of {}: {}",
                self.turns,
                self.name,
                "x".repeat(100)
            );
            self.messages
                .push(json!({"role": "user", "content": output}));
        }
        let mut body = json!({"model": "stub", "messages": self.messages});
        if let (Value::Object(b), Value::Object(e)) = (&mut body, extra) {
            b.extend(e);
        }
        body
    }

    fn answered(&mut self, answer: &Answer) {
        let content = answer.json()["choices"][0]["message"]["content"].clone();
        self.messages
            .push(json!({"role": "assistant", "content": content}));
    }

    fn prompt_tokens(&self) -> u64 {
        self.messages
            .iter()
            .map(|m| m["content"].as_str().map_or(0, str::len) as u64)
            .sum()
    }
}

fn usage(answer: &Answer) -> (u64, u64) {
    let u = &answer.json()["usage"];
    (
        u["prompt_tokens"].as_u64().unwrap(),
        u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
    )
}

// === placement ===

#[tokio::test]
async fn turns_of_a_session_return_to_the_same_backend() {
    turns_of_a_session_return_to_the_same_backend_with(UpstreamMode::Pooled).await;
}

#[tokio::test]
async fn per_client_turns_of_a_session_return_to_the_same_backend() {
    turns_of_a_session_return_to_the_same_backend_with(UpstreamMode::PerClient).await;
}

async fn turns_of_a_session_return_to_the_same_backend_with(mode: UpstreamMode) {
    let (a1, a2, b1) = (
        Stub::start("a1", 2).await,
        Stub::start("a2", 2).await,
        Stub::start("b1", 2).await,
    );
    let proxy = start(upstream(
        config(&[("node-a", &a1), ("node-a", &a2), ("node-b", &b1)]),
        mode,
    ))
    .await;

    for s in 0..4 {
        let mut conv = Conversation::new(&format!("agent-{s}"));
        let sid = conv.name.clone();
        let mut home = None;
        let mut previous_prompt = 0;
        for turn in 1..=4 {
            let body = conv.next(json!({}));
            let sent_prompt = conv.prompt_tokens();
            let answer = proxy.post_json(&[("x-session-id", &sid)], &body).await;
            assert_eq!(answer.status, 200, "{sid} turn {turn}");
            assert_eq!(
                answer.backend(),
                answer.header("x-stub"),
                "the header names the stub that answered"
            );
            let backend = answer.backend().to_string();
            let (prompt, cached) = usage(&answer);
            assert_eq!(prompt, sent_prompt);
            if turn == 1 {
                assert_eq!(answer.outcome(), "new-session");
                home = Some(backend);
            } else {
                assert_eq!(answer.outcome(), "home-hit", "{sid} turn {turn}");
                assert_eq!(Some(backend), home, "{sid} turn {turn} moved");
                assert_eq!(
                    cached, previous_prompt,
                    "{sid} turn {turn}: the whole previous conversation is cached"
                );
            }
            conv.answered(&answer);
            previous_prompt = conv.prompt_tokens();
        }
    }
    let stats = proxy.proxy.affinity().stats();
    assert_eq!((stats.new_sessions, stats.home_hits), (4, 12));
}

// === streaming ===

#[tokio::test]
async fn a_stream_reaches_the_client_before_it_ends_and_holds_its_slot_until_then() {
    a_stream_reaches_the_client_before_it_ends_and_holds_its_slot_until_then_with(
        UpstreamMode::Pooled,
    )
    .await;
}

#[tokio::test]
async fn per_client_a_stream_reaches_the_client_before_it_ends_and_holds_its_slot_until_then() {
    a_stream_reaches_the_client_before_it_ends_and_holds_its_slot_until_then_with(
        UpstreamMode::PerClient,
    )
    .await;
}

async fn a_stream_reaches_the_client_before_it_ends_and_holds_its_slot_until_then_with(
    mode: UpstreamMode,
) {
    let a = Stub::start("a", 2).await;
    let proxy = start(upstream(config(&[("node-a", &a)]), mode)).await;
    a.hold_streams();

    let body = Conversation::new("streamer").next(json!({"stream": true}));
    let req = Request::post(proxy.url("/v1/chat/completions"))
        .header("x-session-id", "streamer")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let res = proxy.send(req).await;
    assert_eq!(res.status(), 200);
    assert_eq!(res.headers()["content-type"], "text/event-stream");
    let mut body = res.into_body();

    let first = tokio::time::timeout(DEADLINE, body.frame())
        .await
        .expect("the first chunk did not arrive while the stub held the rest")
        .unwrap()
        .unwrap()
        .into_data()
        .unwrap();
    let first = String::from_utf8(first.to_vec()).unwrap();
    assert!(first.starts_with("data: {"), "{first:?}");
    assert!(first.contains(r#""role":"assistant""#), "{first:?}");
    assert_eq!(
        a.state
            .streams_finished
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    assert_eq!(
        proxy.proxy.affinity().backends()[0].in_flight,
        1,
        "the slot is held while the stream runs"
    );

    a.release_streams();
    let mut rest = String::new();
    for _ in 0..64 {
        let Some(frame) = tokio::time::timeout(DEADLINE, body.frame())
            .await
            .expect("the stream stalled")
        else {
            break;
        };
        if let Ok(data) = frame.unwrap().into_data() {
            rest.push_str(std::str::from_utf8(&data).unwrap());
        }
    }
    assert!(rest.ends_with("data: [DONE]\n\n"), "{rest:?}");
    assert!(rest.contains(r#""cached_tokens":0"#), "{rest:?}");
    assert_eq!(
        proxy.proxy.affinity().backends()[0].in_flight,
        0,
        "the slot is free once the stream ended"
    );
}

/// A `--body-idle-timeout` too long for the clock to hold (some 300 billion years: the
/// command line takes up to `u64::MAX` seconds) is as none: a stream goes through whole,
/// where the deadline set at its first frame overflowed the clock and panicked, and the
/// client got no answer.
#[tokio::test]
async fn a_body_idle_timeout_too_long_for_the_clock_lets_a_stream_through() {
    let a = Stub::start("a", 2).await;
    let spec = format!("node-a={},slots=2,id=a", a.url());
    let args = [
        "--backend",
        &spec,
        "--body-idle-timeout",
        "10000000000000000000",
    ];
    let cli::Command::Run(run) = cli::parse(args).unwrap() else {
        panic!("not a run");
    };
    let mut config = run.config;
    assert!(config.body_idle_timeout > Some(Duration::from_secs(i64::MAX as u64)));
    config.probe_interval = None;
    let proxy = start(config).await;
    let body = Conversation::new("streamer").next(json!({"stream": true}));
    let req = Request::post(proxy.url("/v1/chat/completions"))
        .header("x-session-id", "streamer")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let answer = proxy.fetch(req).await;
    assert_eq!(answer.status, 200);
    let text = String::from_utf8_lossy(&answer.body);
    assert!(text.ends_with("data: [DONE]\n\n"), "{text:?}");
    assert_eq!(proxy.status("a").in_flight, 0);
}

/// Ctrl-C stops accepting and lets an open stream finish; a second Ctrl-C does not wait for
/// it: the proxy stops at once.
#[tokio::test]
async fn a_second_signal_stops_the_proxy_with_a_stream_still_open() {
    second_signal_stops_the_proxy_with_a_stream_open(false).await;
}

#[tokio::test]
async fn a_second_signal_stops_the_proxy_with_an_http2_stream_still_open() {
    // HTTP/2 connections are driven with their idle timer: the other loop.
    second_signal_stops_the_proxy_with_a_stream_open(true).await;
}

async fn second_signal_stops_the_proxy_with_a_stream_open(http2: bool) {
    let a = Stub::start("a", 2).await;
    let proxy = Arc::new(Proxy::new(config(&[("node-a", &a)])).await.unwrap());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (first, first_signal) = oneshot::channel::<()>();
    let (second, second_signal) = oneshot::channel::<()>();
    let mut server = tokio::spawn(app::serve(
        listener,
        proxy.front(),
        async {
            let _ = first_signal.await;
        },
        async {
            let _ = second_signal.await;
        },
    ));
    a.hold_streams();
    let client = Client::builder(TokioExecutor::new())
        .http2_only(http2)
        .build_http::<Full<Bytes>>();
    let url = format!("http://{addr}/v1/chat/completions");
    let mut body = open_stream(&client, url, "streamer", None).await;
    // Paused only now: an HTTP/2 handshake on loopback can be outrun by a paused clock that
    // jumps ahead whenever the runtime has nothing to do.
    tokio::time::pause();

    first.send(()).unwrap();
    // The stream is open, so the first signal does not end the proxy, however long it runs.
    let waited = tokio::time::timeout(Duration::from_secs(300), &mut server).await;
    assert!(waited.is_err(), "stopped with a stream open: {waited:?}");

    second.send(()).unwrap();
    let stopped = tokio::time::timeout(DEADLINE, server)
        .await
        .expect("the second signal did not stop the proxy");
    assert!(matches!(stopped, Ok(Ok(()))), "{stopped:?}");
    // The stream was cut off, not finished: it ends with an error, and the stub's stream is
    // still held.
    let mut ended = None;
    for _ in 0..64 {
        match tokio::time::timeout(DEADLINE, body.frame()).await {
            Err(_) => panic!("the stream is still open"),
            Ok(Some(Ok(_))) => continue,
            Ok(end) => {
                ended = Some(end.map(|frame| frame.map(|_| ())));
                break;
            }
        }
    }
    assert!(matches!(ended, Some(Some(Err(_)))), "{ended:?}");
    let finished = a
        .state
        .streams_finished
        .load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(finished, 0);
    a.release_streams();
}

/// The first signal is logged by the serving loop as it stops accepting, so the line that says
/// the proxy is shutting down comes before the one that says it stopped, which `main` logs once
/// `serve` has returned: with no response open, at once.
#[tokio::test]
async fn the_shutdown_is_logged_before_the_serving_loop_returns() {
    let logs = logs::capture(tracing::Level::INFO);
    let a = Stub::start("a", 2).await;
    let proxy = Arc::new(Proxy::new(config(&[("node-a", &a)])).await.unwrap());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (first, first_signal) = oneshot::channel::<()>();
    let server = tokio::spawn(app::serve(
        listener,
        proxy.front(),
        async {
            let _ = first_signal.await;
        },
        std::future::pending(),
    ));
    tokio::task::yield_now().await;
    assert_eq!(logs.count(&["shutting down"]), 0, "{}", logs.text());
    first.send(()).unwrap();
    let stopped = tokio::time::timeout(DEADLINE, server).await.unwrap();
    assert!(matches!(stopped, Ok(Ok(()))), "{stopped:?}");
    assert_eq!(
        logs.count(&[
            "INFO",
            "shutting down: no new connections, open responses finish"
        ]),
        1,
        "{}",
        logs.text()
    );
}

/// The start log shows the fleet and the settings the proxy runs with: each backend's
/// `context=`, `request-context=` and `assign-slots`, each `--backend-dns` name, and on the
/// listening line the overflow mode, the store (without its password), `--replicas`,
/// `--upstream`, `--ask-stream-usage` and `--no-decision-headers`.
#[test]
fn the_start_log_shows_the_fleet_and_the_settings_the_proxy_runs_with() {
    let logs = logs::capture(tracing::Level::INFO);
    let parsed = cli::parse([
        "--listen",
        "127.0.0.1:20901",
        "--backend",
        "a=http://127.0.0.1:20902,context=8k,request-context=4k,assign-slots",
        "--backend",
        "b=http://127.0.0.1:20903,slots=2",
        "--backend-dns",
        "llama.internal:20904,slots=2,context=16k,assign-slots",
        "--overflow",
        "reject",
        "--replicas",
        "2",
        "--upstream",
        "per-client",
        "--redis",
        "redis://:s3cret@127.0.0.1:20905",
        "--ask-stream-usage",
        "--no-decision-headers",
    ]);
    let Ok(cli::Command::Run(args)) = parsed else {
        panic!("{parsed:?}");
    };
    app::log_fleet(&args.config);
    app::log_listening(&args.config, args.listen);
    let text = logs.text();
    let a = [
        "node=a",
        "context=8192",
        "request_context=4096",
        "assign_slots=true",
    ];
    assert_eq!(logs.count(&a), 1, "{text}");
    let b = ["node=b", "slots=2", "request_context=from /slots"];
    assert_eq!(logs.count(&b), 1, "{text}");
    assert_eq!(logs.count(&["node=b", "assign_slots=false"]), 1, "{text}");
    assert_eq!(logs.count(&["node=b", " context="]), 0, "{text}");
    let dns = [
        "name=llama.internal:20904",
        "slots=2",
        "context=16384",
        "assign_slots=true",
    ];
    assert_eq!(logs.count(&dns), 1, "{text}");
    let listening = [
        "proxy listening",
        "listen=127.0.0.1:20901",
        "overflow=\"reject\"",
        "redis=redis://***@127.0.0.1:20905",
        "replicas=2",
        "upstream=\"per-client\"",
        "ask_stream_usage=true",
        "decision_headers=false",
    ];
    assert_eq!(logs.count(&listening), 1, "{text}");
    assert!(!text.contains("s3cret"), "{text}");
}

/// With `--overflow wait` the listening line gives the longest wait and the most requests
/// waiting; without `--redis`, no store.
#[test]
fn the_listening_line_gives_the_wait_bounds_of_overflow_wait() {
    let logs = logs::capture(tracing::Level::INFO);
    let parsed = cli::parse([
        "--backend",
        "a=http://127.0.0.1:20902",
        "--max-wait",
        "30s",
        "--max-queued",
        "16",
    ]);
    let Ok(cli::Command::Run(args)) = parsed else {
        panic!("{parsed:?}");
    };
    app::log_listening(&args.config, args.listen);
    let line = [
        "proxy listening",
        "overflow=\"wait\"",
        "max_wait=30s",
        "max_queued=16",
        "replicas=1",
        "upstream=\"pooled\"",
        "ask_stream_usage=false",
        "decision_headers=true",
    ];
    assert_eq!(logs.count(&line), 1, "{}", logs.text());
    assert_eq!(logs.count(&["redis="]), 0, "{}", logs.text());
}

/// With the store down, the proxy says when its wait at start ends that it serves from its
/// local tables until the store answers: the store itself warns only once its attempts to
/// connect run out, seconds later.
#[tokio::test(start_paused = true)]
async fn a_store_not_connected_when_the_start_wait_ends_is_logged_then() {
    let logs = logs::capture(tracing::Level::INFO);
    // A port nothing listens on.
    let refusing = Refusing::new();
    let mut config = config_of(&["n=http://127.0.0.1:20906,slots=1".to_string()]);
    let port = refusing.addr.port();
    config.redis = Some(format!("redis://:s3cret@127.0.0.1:{port}"));
    let started = tokio::time::Instant::now();
    let _proxy = Proxy::new(config).await.unwrap();
    let took = started.elapsed();
    assert!(took <= Duration::from_secs(1), "the start took {took:?}");
    let warning = [
        "WARN",
        "the proxy serves from its local tables until the store answers",
        &format!("redis=redis://***@127.0.0.1:{port}"),
    ];
    assert_eq!(logs.count(&warning), 1, "{}", logs.text());
    assert!(!logs.text().contains("s3cret"), "{}", logs.text());
}

/// With the store down and several models, each with its own store, the start waits once for
/// them all, not a second for each, and names each model's store in its warning.
#[tokio::test(start_paused = true)]
async fn the_stores_of_several_models_are_waited_for_once_at_the_start() {
    let logs = logs::capture(tracing::Level::INFO);
    let refusing = Refusing::new();
    let mut config = config_of(&[
        "n=http://127.0.0.1:20907,slots=1,model=one".to_string(),
        "n=http://127.0.0.1:20908,slots=1,model=two".to_string(),
        "n=http://127.0.0.1:20909,slots=1,model=three".to_string(),
    ]);
    config.redis = Some(format!("redis://127.0.0.1:{}", refusing.addr.port()));
    let started = tokio::time::Instant::now();
    let _proxy = Proxy::new(config).await.unwrap();
    let took = started.elapsed();
    assert!(took <= Duration::from_secs(1), "the start took {took:?}");
    for model in ["one", "two", "three"] {
        let warning = [
            "WARN",
            "the proxy serves from its local tables until the store answers",
            &format!("model=\"{model}\""),
        ];
        assert_eq!(logs.count(&warning), 1, "{model}: {}", logs.text());
    }
}

/// Ctrl-C stops accepting and lets an open stream finish: new connections are refused, the
/// stream goes on to its end, its slot is freed, and then the proxy stops of itself.
#[tokio::test]
async fn a_first_signal_lets_an_open_stream_finish_and_then_the_proxy_stops() {
    for (http2, mode) in [
        (false, UpstreamMode::Pooled),
        (true, UpstreamMode::Pooled),
        (false, UpstreamMode::PerClient),
    ] {
        first_signal_lets_a_stream_finish(http2, mode).await;
    }
}

async fn first_signal_lets_a_stream_finish(http2: bool, mode: UpstreamMode) {
    let what = format!("http2 {http2}, {mode:?}");
    let a = Stub::start("a", 2).await;
    let proxy = Arc::new(
        Proxy::new(upstream(config(&[("node-a", &a)]), mode))
            .await
            .unwrap(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (first, first_signal) = oneshot::channel::<()>();
    let mut server = tokio::spawn(app::serve(
        listener,
        proxy.front(),
        async {
            let _ = first_signal.await;
        },
        std::future::pending(),
    ));
    a.hold_streams();
    let client = Client::builder(TokioExecutor::new())
        .http2_only(http2)
        .build_http::<Full<Bytes>>();
    let url = format!("http://{addr}/v1/chat/completions");
    let body = open_stream(&client, url, "streamer", None).await;

    first.send(()).unwrap();
    // Accepting stops: a new connection is refused once the serving loop has seen the signal
    // and dropped its listener.
    let mut refused = false;
    for _ in 0..100 {
        if tokio::net::TcpStream::connect(addr).await.is_err() {
            refused = true;
            break;
        }
        tokio::task::yield_now().await;
    }
    assert!(refused, "{what}: still accepting after the signal");
    assert!(!server.is_finished(), "{what}: stopped with a stream open");
    assert_eq!(proxy.affinity().stats().in_flight, 1, "{what}");

    a.release_streams();
    let rest = tokio::time::timeout(DEADLINE, body.collect())
        .await
        .unwrap_or_else(|_| panic!("{what}: the stream did not finish"));
    let rest = rest.unwrap_or_else(|e| panic!("{what}: the stream was cut: {e}"));
    assert!(!rest.to_bytes().is_empty(), "{what}");
    let finished = a
        .state
        .streams_finished
        .load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(finished, 1, "{what}");
    let stopped = tokio::time::timeout(DEADLINE, &mut server)
        .await
        .unwrap_or_else(|_| panic!("{what}: the proxy did not stop once the stream ended"));
    assert!(matches!(stopped, Ok(Ok(()))), "{what}: {stopped:?}");
    assert_eq!(proxy.affinity().stats().in_flight, 0, "{what}");
}

// === health ===

#[tokio::test]
async fn a_killed_backend_is_skipped_and_its_sessions_placed_again_without_an_error() {
    a_killed_backend_is_skipped_and_its_sessions_placed_again_without_an_error_with(
        UpstreamMode::Pooled,
    )
    .await;
}

#[tokio::test]
async fn per_client_a_killed_backend_is_skipped_and_its_sessions_placed_again_without_an_error() {
    a_killed_backend_is_skipped_and_its_sessions_placed_again_without_an_error_with(
        UpstreamMode::PerClient,
    )
    .await;
}

async fn a_killed_backend_is_skipped_and_its_sessions_placed_again_without_an_error_with(
    mode: UpstreamMode,
) {
    let (a, b) = (Stub::start("a", 2).await, Stub::start("b", 2).await);
    let proxy = start(upstream(config(&[("node-a", &a), ("node-b", &b)]), mode)).await;

    // Sessions until a few are homed on `a` (rendezvous spreads them; 32 tries are plenty).
    let mut on_a = Vec::new();
    for s in 0..32 {
        let mut conv = Conversation::new(&format!("agent-{s}"));
        let sid = conv.name.clone();
        let answer = proxy
            .post_json(&[("x-session-id", &sid)], &conv.next(json!({})))
            .await;
        conv.answered(&answer);
        if answer.backend() == "a" {
            on_a.push(conv);
            if on_a.len() == 3 {
                break;
            }
        }
    }
    assert_eq!(on_a.len(), 3, "no sessions homed on a");

    a.kill().await;
    for conv in &mut on_a {
        let sid = conv.name.clone();
        let answer = proxy
            .post_json(&[("x-session-id", &sid)], &conv.next(json!({})))
            .await;
        assert_eq!(
            answer.status,
            200,
            "{sid}: {:?}",
            String::from_utf8_lossy(&answer.body)
        );
        assert_eq!(answer.backend(), "b", "{sid}");
        let (_, cached) = usage(&answer);
        assert!(cached < conv.prompt_tokens() / 2, "b never saw {sid}");
        conv.answered(&answer);
        // The session's home is now b, where its cache is.
        let answer = proxy
            .post_json(&[("x-session-id", &sid)], &conv.next(json!({})))
            .await;
        assert_eq!(
            (answer.backend(), answer.outcome()),
            ("b", "home-hit"),
            "{sid}"
        );
        conv.answered(&answer);
    }
    let stats = proxy.proxy.affinity().stats();
    assert_eq!(
        stats.backend_errors, 1,
        "one failed attempt, then a is passed over"
    );
    let backends = proxy.proxy.affinity().backends();
    let a_status = backends.iter().find(|s| s.id.as_str() == "a").unwrap();
    assert!(!a_status.healthy);
    assert_eq!(a_status.failures, 1);

    let metrics = String::from_utf8(proxy.get("/metrics").await.body.to_vec()).unwrap();
    assert!(
        metrics.contains(r#"tower_affinity_backend_healthy{backend="a",node="node-a"} 0"#),
        "{metrics}"
    );
    assert!(
        metrics.contains("tower_affinity_backend_errors_total 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"tower_affinity_backend_failures_total{backend="a",node="node-a"} 1"#),
        "{metrics}"
    );
    assert!(
        metrics
            .contains(r#"tower_affinity_backend_cut_answers_total{backend="a",node="node-a"} 0"#),
        "a failure before the answer is no cut answer: {metrics}"
    );
}

#[tokio::test]
async fn the_probe_marks_a_loading_backend_down_until_ready_and_learns_slots() {
    let (a, b) = (Stub::start("a", 3).await, Stub::start("b", 2).await);
    let mut config = config(&[("node-a", &a), ("node-b", &b)]);
    // `a` without slots=: its count comes from /slots.
    config.backends[0] = cli::backend(&format!("node-a={},id=a", a.url())).unwrap().0;
    let proxy = start(config).await;
    let status = |id: &str| proxy.status(id);
    assert_eq!(status("a").slots, 1);

    proxy.proxy.probe_all().await;
    assert_eq!(status("a").slots, 3, "read from /slots");
    assert_eq!(status("b").slots, 2, "given on the command line");

    a.set_health(503);
    proxy.proxy.probe_all().await;
    assert!(!status("a").healthy);
    for i in 0..6 {
        let answer = proxy
            .post_json(&[], &Conversation::new(&format!("k{i}")).next(json!({})))
            .await;
        // The same opening prompt each time: a prefix hit the second time, when b has been
        // sent it whole once (a retry, for all the router can tell), keyless after that.
        let outcome = if i == 1 { "prefix-hit" } else { "keyless" };
        assert_eq!((answer.backend(), answer.outcome()), ("b", outcome), "{i}");
    }

    a.set_health(200);
    proxy.proxy.probe_all().await;
    assert!(status("a").healthy);
    assert_eq!(a.chats(), 0);

    a.kill().await;
    proxy.proxy.probe_all().await;
    assert!(!status("a").healthy, "an unreachable backend is down");
}

/// `--probe-header` gives the probe the backends' API key: a llama-server run with `--api-key`
/// answers `/slots` with a 401 without it, and counted as one slot whatever its `-np`.
#[tokio::test]
async fn probe_header_gives_the_probe_the_backends_api_key() {
    let a = Stub::start("a", 3).await;
    a.require_api_key("sk-backends");
    let config = |extra: &[&str]| {
        let backend = format!("node-a={},id=a", a.url());
        let mut args = vec!["--backend", backend.as_str(), "--probe-interval", "0"];
        args.extend(extra);
        let cli::Command::Run(run) = cli::parse(args).unwrap() else {
            panic!("not a run");
        };
        run.config
    };
    let without = start(config(&[])).await;
    without.proxy.probe_all().await;
    assert!(without.status("a").healthy, "/health wants no key");
    assert_eq!(without.status("a").slots, 1, "/slots answered 401");

    let with = start(config(&[
        "--probe-header",
        "Authorization: Bearer sk-backends",
    ]))
    .await;
    with.proxy.probe_all().await;
    assert_eq!(with.status("a").slots, 3, "read from /slots");
}

/// An option that another option turns off is refused, not ignored without a word: a wait's
/// bounds without `--overflow wait`, the store's deadline without a store, the DNS options
/// without a name to resolve, the live window with a policy that does not read it. Each
/// with what it needs is taken.
#[test]
fn an_option_that_another_turns_off_is_refused() {
    for (args, said) in [
        (
            vec!["--overflow", "reject", "--max-wait", "5s"],
            "--max-wait is given without --overflow wait",
        ),
        (
            vec!["--max-queued", "9", "--overflow=overcommit"],
            "--max-queued is given without --overflow wait",
        ),
        (
            vec!["--redis-timeout", "5ms"],
            "--redis-timeout is given without --redis",
        ),
        (
            vec!["--dns-server", "127.0.0.1:53"],
            "--dns-server is given without --backend-dns",
        ),
        (
            vec!["--dns-removal-grace", "1m"],
            "--dns-removal-grace is given without --backend-dns",
        ),
        (
            vec!["--policy", "round-robin", "--live-window", "0"],
            "--live-window is given without --policy node-then-backend",
        ),
    ] {
        let mut all = vec!["--backend", "n=http://x:1"];
        all.extend(&args);
        let Err(e) = cli::parse(all) else {
            panic!("{args:?}: accepted");
        };
        assert!(e.starts_with(said), "{args:?}: {e}");
    }
    for args in [
        vec![
            "--overflow",
            "wait",
            "--max-wait",
            "5s",
            "--max-queued",
            "9",
        ],
        vec!["--max-wait", "5s"],
        vec!["--redis", "redis://127.0.0.1:1", "--redis-timeout", "5ms"],
        vec![
            "--backend-dns",
            "llm.test:80",
            "--dns-server",
            "127.0.0.1:53",
            "--dns-removal-grace",
            "1m",
        ],
        vec!["--live-window", "0"],
        vec!["--policy", "node-then-backend", "--live-window", "0"],
    ] {
        let mut all = vec!["--backend", "n=http://x:1"];
        all.extend(&args);
        assert!(
            matches!(cli::parse(all.clone()), Ok(cli::Command::Run(_))),
            "{args:?}: {:?}",
            cli::parse(all).err()
        );
    }
}

/// An option that takes one value, given twice, is refused: the second would silently
/// replace the first (a `--listen` typed again at the end of a long command line). Those
/// that add one more (`--backend`, `--backend-dns`, `--dns-server`, `--probe-header`) and
/// the switches may be given again.
#[test]
fn an_option_of_one_value_given_twice_is_refused() {
    for (args, flag) in [
        (
            vec!["--listen", "127.0.0.1:1", "--listen", "127.0.0.1:2"],
            "--listen",
        ),
        (
            vec!["--policy", "rendezvous", "--policy=least-loaded"],
            "--policy",
        ),
        (vec!["--max-wait=1s", "--max-wait=2s"], "--max-wait"),
        (
            vec!["--redis-timeout", "5ms", "--redis-timeout", "5ms"],
            "--redis-timeout",
        ),
    ] {
        let mut all = vec!["--backend", "n=http://x:1"];
        all.extend(&args);
        let Err(e) = cli::parse(all) else {
            panic!("{args:?}: accepted");
        };
        assert_eq!(
            e,
            format!(
                "{flag} is given twice: it takes one value, and the second would replace the first"
            ),
            "{args:?}"
        );
    }
    let again = [
        "--backend",
        "a=http://x:1",
        "--backend",
        "b=http://y:1",
        "--backend-dns",
        "llm.test:80",
        "--dns-server",
        "127.0.0.1:53",
        "--dns-server",
        "127.0.0.1:54",
        "--probe-header",
        "A: 1",
        "--probe-header",
        "B: 2",
        "-v",
        "--verbose",
        "--ask-stream-usage",
        "--ask-stream-usage",
    ];
    assert!(
        matches!(cli::parse(again), Ok(cli::Command::Run(_))),
        "{:?}",
        cli::parse(again).err()
    );
}

/// `--probe-header NAME: VALUE` takes a header for each, marked sensitive; a bad one is a
/// command-line error (exit code 2) that names the flag, and neither its errors nor the
/// parsed configuration's `Debug` show the value: a key, as a rule.
#[test]
fn probe_header_is_name_colon_value_and_its_value_is_never_shown() {
    let parse = |headers: &[&str]| {
        let mut args = vec!["--backend", "n=http://x:1"];
        for h in headers {
            args.extend(["--probe-header", h]);
        }
        cli::parse(args)
    };
    let Ok(cli::Command::Run(run)) = parse(&["Authorization:  Bearer sk-1 ", "X-Api-Key:sk-2"])
    else {
        panic!("not a run");
    };
    let headers: Vec<_> = (run.config.probe_headers.iter())
        .map(|(n, v)| (n.as_str(), v.to_str().unwrap(), v.is_sensitive()))
        .collect();
    assert_eq!(
        headers,
        [
            ("authorization", "Bearer sk-1", true),
            ("x-api-key", "sk-2", true)
        ]
    );
    let shown = format!("{run:?}");
    assert!(
        !shown.contains("sk-") && shown.contains("Sensitive"),
        "{shown}"
    );
    // `--probe-header=...` as the other flags take it.
    let inline = cli::parse(["--backend", "n=http://x:1", "--probe-header=X-Api-Key: a=b"]);
    let Ok(cli::Command::Run(inline)) = inline else {
        panic!("not a run");
    };
    assert_eq!(inline.config.probe_headers[0].1, "a=b");

    for (headers, needle) in [
        (
            vec!["Authorization Bearer sk-1"],
            "--probe-header: expected NAME: VALUE",
        ),
        (
            vec!["Auth orization: sk-1"],
            "--probe-header \"Auth orization\": not a header name",
        ),
        (vec![": sk-1"], "--probe-header \"\": not a header name"),
        (
            vec!["X-Api-Key: "],
            "--probe-header \"x-api-key\": the value is empty",
        ),
        // `Bearer $KEY`, the variable unset.
        (
            vec!["Authorization: Bearer "],
            "Bearer with no key after it",
        ),
        (
            vec!["X-Api-Key: sk-\u{1}1"],
            "only visible ASCII characters",
        ),
        (
            vec!["X-Api-Key: sk-\u{e9}1"],
            "only visible ASCII characters",
        ),
        (
            vec!["Authorization: Bearer sk-1", "authorization: Bearer sk-2"],
            "--probe-header \"authorization\": given twice",
        ),
    ] {
        let err = parse(&headers).map(|_| ()).unwrap_err();
        assert!(err.contains(needle), "{headers:?}: {err}");
        assert!(!err.contains("sk-"), "{headers:?}: {err}");
    }
}

/// llama-server run with `-np` gives each slot its share of `-c` and refuses a longer prompt
/// (400). The probe reads each backend's share from `/slots` (`n_ctx`): a conversation that
/// outgrows its home's slots moves to a backend whose slots take it, and stays there, rather
/// than be refused at home.
#[tokio::test]
async fn a_conversation_that_outgrows_its_homes_slots_moves_to_a_backend_that_takes_it() {
    let (small, large) = (Stub::start("small", 2).await, Stub::start("large", 2).await);
    small.set_context(2_000);
    large.set_context(100_000);
    let proxy = start(config(&[("node-a", &small), ("node-b", &large)])).await;
    proxy.proxy.probe_all().await;
    assert_eq!(proxy.status("small").request_context_limit, Some(2_000));
    assert_eq!(proxy.status("large").request_context_limit, Some(100_000));
    let metrics = String::from_utf8(proxy.get("/metrics").await.body.to_vec()).unwrap();
    for line in [
        r#"tower_affinity_backend_request_context_tokens{backend="small",node="node-a"} 2000"#,
        r#"tower_affinity_backend_request_context_tokens{backend="large",node="node-b"} 100000"#,
    ] {
        assert!(
            metrics.lines().any(|l| l == line),
            "{line} not in:\n{metrics}"
        );
    }
    // A conversation whose first turn went to the small backend.
    let mut c = proxy.conversation_on("small", "c").await;
    // Turns that fit its home stay there, and teach the router its tokens.
    for _ in 0..3 {
        let answer = proxy.turn(&mut c).await;
        assert_eq!((answer.status.as_u16(), answer.backend()), (200, "small"));
        c.answered(&answer);
    }
    // A tool's output of 3,000 tokens: past what a slot of the home takes.
    c.messages
        .push(json!({"role": "user", "content": "y".repeat(3_000)}));
    for i in 0..4 {
        let answer = proxy.turn(&mut c).await;
        assert_eq!(
            answer.status,
            200,
            "{i}: {}",
            String::from_utf8_lossy(&answer.body)
        );
        let outcome = if i == 0 {
            "cross-node-spill"
        } else {
            "home-hit"
        };
        assert_eq!(
            (answer.backend(), answer.outcome()),
            ("large", outcome),
            "{i}"
        );
        c.answered(&answer);
    }
    assert!(c.prompt_tokens() > 3_000);
    assert_eq!(small.refused(), 0);
}

/// A turn of numbers, which the backends count a token a digit as the router estimates them:
/// over the home's slot context by the estimate, sent where it fits, and never refused.
#[tokio::test]
async fn a_turn_of_digits_too_long_for_its_home_goes_where_it_fits_unrefused() {
    a_dense_turn_is_answered_elsewhere(Dense::AsEstimated).await;
}

/// A turn denser than the router's estimate (a stub counting a digit as many tokens, denser
/// than any tokenizer): estimated under the home's slot context, refused there, and answered
/// through the retry by a backend that takes it; its next turns go there.
#[tokio::test]
async fn a_turn_its_home_refuses_as_too_long_is_answered_by_a_backend_that_takes_it() {
    a_dense_turn_is_answered_elsewhere(Dense::Refused { vllm: false }).await;
}

/// The same, the home refusing as vLLM does: its message states its context length.
#[tokio::test]
async fn a_turn_its_home_refuses_in_vllms_words_is_answered_by_a_backend_that_takes_it() {
    a_dense_turn_is_answered_elsewhere(Dense::Refused { vllm: true }).await;
}

/// How the backends count [`a_dense_turn_is_answered_elsewhere`]'s digits.
#[derive(Clone, Copy)]
enum Dense {
    /// As many tokens as the router estimates (a token a digit, at the scale prose taught).
    AsEstimated,
    /// Four times as many, refused in llama-server's words or vLLM's.
    Refused { vllm: bool },
}

async fn a_dense_turn_is_answered_elsewhere(dense: Dense) {
    let (small, large) = (Stub::start("small", 2).await, Stub::start("large", 2).await);
    small.set_context(2_000);
    large.set_context(100_000);
    // Prose is counted a token a byte, so the router learns four tokens an estimated token.
    let (digit_tokens, digits, refusals) = match dense {
        Dense::AsEstimated => (4, 600, 0),
        Dense::Refused { .. } => (16, 150, 1),
    };
    for stub in [&small, &large] {
        stub.set_digit_tokens(digit_tokens);
        if let Dense::Refused { vllm: true } = dense {
            stub.refuse_as_vllm();
        }
    }
    let proxy = start(config(&[("node-a", &small), ("node-b", &large)])).await;
    proxy.proxy.probe_all().await;
    // A conversation whose first turn went to the small backend.
    let mut c = proxy.conversation_on("small", "d").await;
    // Prose: the router learns a token a byte.
    for _ in 0..3 {
        let answer = proxy.turn(&mut c).await;
        assert_eq!((answer.status.as_u16(), answer.backend()), (200, "small"));
        c.answered(&answer);
    }
    // 2,400 tokens by the backends' count: 600 digits, over the home's 2,000 by the router's
    // estimate too; or 150, under it by the estimate.
    c.messages
        .push(json!({"role": "user", "content": "0123456789".repeat(digits / 10)}));
    let answer = proxy.turn(&mut c).await;
    assert_eq!(
        (answer.status.as_u16(), answer.backend(), answer.outcome()),
        (200, "large", "cross-node-spill"),
        "{}",
        String::from_utf8_lossy(&answer.body)
    );
    c.answered(&answer);
    assert_eq!(small.refused(), refusals);
    for _ in 0..2 {
        let answer = proxy.turn(&mut c).await;
        assert_eq!(
            (answer.status.as_u16(), answer.backend(), answer.outcome()),
            (200, "large", "home-hit")
        );
        c.answered(&answer);
    }
    assert_eq!(small.refused(), refusals);
}

/// Two backends of the same slot context, a turn denser than the router's estimate: refused
/// where it was sent, and that refusal is what the client gets, as the backend gave it. No
/// other backend takes the prompt, so none is sent it again.
#[tokio::test]
async fn a_turn_no_backend_takes_gets_its_refusal_and_is_sent_nowhere_else() {
    let (a, b) = (Stub::start("a", 2).await, Stub::start("b", 2).await);
    for stub in [&a, &b] {
        stub.set_context(2_000);
        stub.set_digit_tokens(16);
    }
    let proxy = start(config(&[("node-a", &a), ("node-b", &b)])).await;
    proxy.proxy.probe_all().await;
    let mut c = proxy.conversation_on("a", "e").await;
    for _ in 0..3 {
        let answer = proxy.turn(&mut c).await;
        assert_eq!((answer.status.as_u16(), answer.backend()), (200, "a"));
        c.answered(&answer);
    }
    // 150 digits: 2,400 tokens by the backends' count, under 2,000 by the estimate.
    c.messages
        .push(json!({"role": "user", "content": "0123456789".repeat(15)}));
    let answer = proxy.turn(&mut c).await;
    let body = String::from_utf8_lossy(&answer.body);
    assert_eq!(
        (answer.status.as_u16(), answer.backend(), answer.outcome()),
        (400, "a", "home-hit"),
        "{body}"
    );
    assert!(body.contains("exceed_context_size_error"), "{body}");
    assert_eq!((a.refused(), b.refused()), (1, 0));
    let metrics = String::from_utf8(proxy.get("/metrics").await.body.to_vec()).unwrap();
    for line in [
        "tower_affinity_refusals_answered_total 1",
        "tower_affinity_refusals_retried_total 1",
    ] {
        assert!(
            metrics.lines().any(|l| l == line),
            "{line} not in:\n{metrics}"
        );
    }
}

#[tokio::test]
async fn the_probe_finds_a_shared_store_down_in_every_fleet_before_any_request() {
    let a = Stub::start("a", 2).await;
    // A port nothing listens on.
    let refusing = Refusing::new();
    let port = refusing.addr.port();
    let backends = [
        format!("n={},slots=2,id=a,model=one", a.url()),
        format!("n={},slots=2,id=b,model=two", a.url()),
    ];
    let mut config = config_of(&backends);
    config.redis = Some(format!("redis://127.0.0.1:{port}"));
    let proxy = start(config).await;
    proxy.proxy.probe_all().await;
    let metrics = String::from_utf8(proxy.get("/metrics").await.body.to_vec()).unwrap();
    for model in ["one", "two"] {
        let line = format!("tower_affinity_store_up{{model=\"{model}\"}} 0");
        assert!(metrics.contains(&line), "{line} in\n{metrics}");
    }
}

/// The first probe of every model's fleet runs at once: a fleet whose backend never answers
/// holds the start back one probe timeout, not one for each fleet.
#[tokio::test(start_paused = true)]
async fn the_fleets_of_several_models_are_probed_together() {
    // Listeners that never accept: a probe's connection is made, and never answered.
    let mut silent = Vec::new();
    for _ in 0..3 {
        silent.push(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap());
    }
    let backends = (silent.iter().enumerate())
        .map(|(i, l)| {
            let spec = format!("n{i}=http://{},slots=1,model=m{i}", l.local_addr().unwrap());
            cli::backend(&spec).unwrap().0
        })
        .collect();
    let mut config = Config::new(backends);
    config.probe_interval = None;
    config.probe_timeout = Duration::from_secs(1);
    let proxy = start(config).await;
    let started = tokio::time::Instant::now();
    proxy.proxy.probe_all().await;
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "the first probe took {took:?}"
    );
    for fleet in proxy.proxy.fleets() {
        let status = fleet.affinity.backends();
        assert!(!status[0].healthy, "{:?} is down", fleet.model);
    }
}

// === the cache model ===

/// Sessions keyed by header, each with a prompt of its own of about 3,000 tokens by the cache
/// model's estimate, until `a` has served one, and `b` too if `and_b`.
async fn fill(proxy: &Running, round: &str, and_b: bool) {
    let (mut on_a, mut on_b) = (0, 0);
    for s in 0..32 {
        let sid = format!("{round}-{s}");
        let body = json!({"model": "stub", "messages": [
            {"role": "system", "content": format!("{sid}: {}", "lorem ipsum ".repeat(1000))},
            {"role": "user", "content": "go"},
        ]});
        let answer = proxy.post_json(&[("x-session-id", &sid)], &body).await;
        assert_eq!(
            (answer.status, answer.outcome()),
            (StatusCode::OK, "new-session")
        );
        match answer.backend() {
            "a" => on_a += 1,
            _ => on_b += 1,
        }
        if on_a > 0 && (on_b > 0 || !and_b) {
            return;
        }
    }
    panic!("{round}: a served {on_a}, b {on_b}");
}

#[tokio::test]
async fn a_backends_cache_budget_reaches_the_cache_model_and_outlives_a_slots_update() {
    let (a, b) = (Stub::start("a", 3).await, Stub::start("b", 2).await);
    // As `main` builds it: `a` holds 1,024 tokens and learns its slots from /slots; `b` has the
    // default budget.
    let args = [
        "--backend".to_string(),
        format!("node-a={},id=a,cache=1k", a.url()),
        "--backend".to_string(),
        format!("node-b={},slots=2,id=b", b.url()),
        "--probe-interval".to_string(),
        "0".to_string(),
    ];
    let cli::Command::Run(run) = cli::parse(args).unwrap() else {
        panic!("not a run");
    };
    let proxy = start(run.config).await;
    let status = |id: &str| proxy.status(id);

    // Keyed by a header, and their bodies read all the same: the cache model sees them.
    fill(&proxy, "before", true).await;
    let (sa, sb) = (status("a"), status("b"));
    assert!(
        sa.cached_tokens <= 1024 && sa.evicted_blocks > 0,
        "a: {sa:?}"
    );
    assert!(
        sb.cached_tokens > 1024 && sb.evicted_blocks == 0,
        "b: {sb:?}"
    );

    // The probe reads a's slots and updates it: the update keeps its budget.
    proxy.proxy.probe_all().await;
    assert_eq!(status("a").slots, 3);
    let evicted = status("a").evicted_blocks;
    // `a` now looks empty to the cache model (it holds less than one prompt), so new sessions
    // go there: one is enough.
    fill(&proxy, "after", false).await;
    let sa = status("a");
    assert!(
        sa.cached_tokens <= 1024 && sa.evicted_blocks > evicted,
        "a after the update: {sa:?}"
    );
}

/// A system prompt of about 4 KB, the same for every agent.
fn system_prompt() -> String {
    let mut text = String::from("You are a coding agent working in a Rust repository.\n");
    for i in 0..40 {
        text.push_str(&format!(
            "Rule {i:02}: read the relevant files before editing, keep changes small, run the \
             tests after each step.\n"
        ));
    }
    text
}

/// A spec of about 4 KB, the same for every agent.
fn spec() -> String {
    let mut text = String::from("Implement the following specification, step by step.\n");
    for i in 0..50 {
        text.push_str(&format!(
            "{i:02}. The balancer keeps each session on the backend that holds its cache.\n"
        ));
    }
    text
}

/// About 2 KB of tool output, distinct for each agent and turn: enough that from the third
/// turn on, a backend holding only the shared system prompt and spec would reuse less than
/// 80% of the previous prompt.
fn tool_output(agent: usize, turn: usize) -> String {
    let mut text = format!("$ cargo test # agent {agent}, turn {turn}\n");
    for i in 0..48 {
        text.push_str(&format!(
            "test agent_{agent}::turn_{turn}::case_{i:02} ... ok ({} ms)\n",
            (agent * 31 + turn * 7 + i) % 97
        ));
    }
    text
}

/// One turn of one agent, as the client saw it.
#[derive(Debug)]
struct AgentTurn {
    agent: usize,
    turn: usize,
    backend: String,
    outcome: String,
    prompt: u64,
    cached: u64,
}

/// One agent: `turns` turns, one after another, each its previous turn's messages, the
/// answer the stub gave and a new tool output of its own. `keyed`: with `x-session-id`.
async fn agent(proxy: Arc<Running>, agent: usize, turns: usize, keyed: bool) -> Vec<AgentTurn> {
    let sid = format!("agent-{agent}");
    let headers: &[(&str, &str)] = if keyed {
        &[("x-session-id", &sid)]
    } else {
        &[]
    };
    let mut messages = vec![
        json!({"role": "system", "content": system_prompt()}),
        json!({"role": "user", "content": spec()}),
    ];
    let mut record = Vec::new();
    for turn in 1..=turns {
        if turn > 1 {
            messages.push(json!({"role": "user", "content": tool_output(agent, turn)}));
            // A think time of 0 to 2 yields, so the agents interleave differently each turn
            // (nothing sleeps for real).
            for _ in 0..(agent + turn) % 3 {
                tokio::task::yield_now().await;
            }
        }
        let body = json!({"model": "stub", "messages": messages});
        let answer = proxy.post_json(headers, &body).await;
        assert_eq!(answer.status, 200, "agent {agent} turn {turn}");
        assert_eq!(answer.backend(), answer.header("x-stub"));
        let (prompt, cached) = usage(&answer);
        record.push(AgentTurn {
            agent,
            turn,
            backend: answer.backend().to_string(),
            outcome: answer.outcome().to_string(),
            prompt,
            cached,
        });
        let content = answer.json()["choices"][0]["message"]["content"].clone();
        messages.push(json!({"role": "assistant", "content": content}));
    }
    record
}

/// What a workload measured.
struct Measured {
    /// Later turns (2 and on) that reused at least 80% of their previous prompt, and all of
    /// them.
    warm: usize,
    later: usize,
    /// Chat requests each stub served, in the stubs' order.
    served: Vec<(String, usize)>,
    /// Later turns that went to another backend than the turn before.
    moved: usize,
    outcomes: std::collections::BTreeMap<String, usize>,
    /// Each agent's backends, turn by turn.
    paths: Vec<String>,
}

impl Measured {
    fn share_warm(&self) -> f64 {
        self.warm as f64 / self.later.max(1) as f64
    }

    fn spread(&self) -> (usize, usize) {
        let counts = self.served.iter().map(|(_, n)| *n);
        (counts.clone().min().unwrap_or(0), counts.max().unwrap_or(0))
    }
}

impl std::fmt::Display for Measured {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (min, max) = self.spread();
        write!(
            f,
            "warm {}/{} later turns ({:.0}%), moved {}; served {:?} (max/min {max}/{min}); \
             outcomes {:?}; paths {:?}",
            self.warm,
            self.later,
            100.0 * self.share_warm(),
            self.moved,
            self.served,
            self.outcomes,
            self.paths,
        )
    }
}

/// 6 agents of 8 turns at once on 2 nodes x 2 backends x 2 slots, all with the same system
/// prompt and spec.
async fn six_agents_on_four_backends(keyed: bool) -> Measured {
    const AGENTS: usize = 6;
    const TURNS: usize = 8;
    let (a1, a2, b1, b2) = (
        Stub::start("a1", 2).await,
        Stub::start("a2", 2).await,
        Stub::start("b1", 2).await,
        Stub::start("b2", 2).await,
    );
    let stubs = [&a1, &a2, &b1, &b2];
    let proxy = Arc::new(
        start(config(&[
            ("node-a", &a1),
            ("node-a", &a2),
            ("node-b", &b1),
            ("node-b", &b2),
        ]))
        .await,
    );
    let mut agents = tokio::task::JoinSet::new();
    for a in 0..AGENTS {
        agents.spawn(agent(proxy.clone(), a, TURNS, keyed));
    }
    let mut turns = Vec::new();
    while let Some(done) = tokio::time::timeout(DEADLINE * 4, agents.join_next())
        .await
        .expect("the agents did not finish in time")
    {
        turns.extend(done.unwrap());
    }
    turns.sort_by_key(|t| (t.agent, t.turn));
    let (mut warm, mut later, mut moved) = (0, 0, 0);
    let mut outcomes = std::collections::BTreeMap::new();
    for t in &turns {
        *outcomes.entry(t.outcome.clone()).or_default() += 1;
    }
    for pair in turns.windows(2) {
        let (before, t) = (&pair[0], &pair[1]);
        if t.agent != before.agent {
            continue;
        }
        later += 1;
        // Integer form of cached >= 0.8 x previous prompt.
        if t.cached * 5 >= before.prompt * 4 {
            warm += 1;
        }
        if t.backend != before.backend {
            moved += 1;
        }
    }
    let paths = (0..AGENTS)
        .map(|a| {
            let path: Vec<&str> = turns
                .iter()
                .filter(|t| t.agent == a)
                .map(|t| t.backend.as_str())
                .collect();
            path.join(">")
        })
        .collect();
    assert_eq!(later, AGENTS * (TURNS - 1));
    Measured {
        warm,
        later,
        served: stubs
            .iter()
            .map(|s| (s.state.name.clone(), s.chats()))
            .collect(),
        moved,
        outcomes,
        paths,
    }
}

/// The fleet-wide targets: 90% of later turns warm, every backend serving, the busiest at
/// most twice the least busy.
fn assert_warm_and_spread(m: &Measured, what: &str) {
    let (min, max) = m.spread();
    assert!(
        m.warm * 10 >= m.later * 9,
        "{what}: fewer than 90% of later turns reused 80% of their previous prompt: {m}"
    );
    assert!(min > 0, "{what}: a backend served nothing: {m}");
    assert!(
        max <= 2 * min,
        "{what}: the busiest backend served more than twice the least busy: {m}"
    );
}

/// The agents' first turns are one and the same prompt, so a second turn finds nothing of its
/// own anywhere, only the shared system prompt and spec on every backend that served a first
/// turn: it is placed by the conversations each backend homes, then by the tokens it holds.
#[tokio::test]
async fn keyless_agents_sharing_a_system_prompt_keep_their_caches_and_spread() {
    let m = six_agents_on_four_backends(false).await;
    println!("keyless: {m}");
    assert_warm_and_spread(&m, "keyless");
}

#[tokio::test]
async fn keyed_agents_sharing_a_system_prompt_keep_their_caches_and_spread() {
    let m = six_agents_on_four_backends(true).await;
    println!("keyed: {m}");
    assert_warm_and_spread(&m, "keyed");
}

/// A client without a key sends a turn again (a retry after a dropped connection, a second
/// answer): it goes to the backend it was sent to, which reuses all of it. Sent a third time,
/// the prompt says nothing more of whose it is (agents that open alike send one prompt many
/// times), and is placed by load.
#[tokio::test]
async fn a_keyless_turn_sent_again_goes_where_it_was_sent_and_reuses_all_of_it() {
    let (a1, a2, b1, b2) = (
        Stub::start("a1", 2).await,
        Stub::start("a2", 2).await,
        Stub::start("b1", 2).await,
        Stub::start("b2", 2).await,
    );
    let proxy = start(config(&[
        ("node-a", &a1),
        ("node-a", &a2),
        ("node-b", &b1),
        ("node-b", &b2),
    ]))
    .await;
    let mut conv = Conversation::new("retry");
    let first = proxy.post_json(&[], &conv.next(json!({}))).await;
    conv.answered(&first);
    let turn = conv.next(json!({}));
    let second = proxy.post_json(&[], &turn).await;
    assert_eq!(second.backend(), first.backend());
    let again = proxy.post_json(&[], &turn).await;
    assert_eq!(
        (again.backend(), again.outcome()),
        (second.backend(), "prefix-hit")
    );
    let (prompt, cached) = usage(&again);
    assert_eq!(cached, prompt, "the whole prompt, from the backend's cache");
    // The backend that served it homes the only conversation: by load, another one.
    let third = proxy.post_json(&[], &turn).await;
    assert_eq!(third.outcome(), "keyless");
    assert_ne!(third.backend(), second.backend());
}

// === body keys ===

#[tokio::test]
async fn body_fields_key_sessions_and_a_header_wins_over_the_body() {
    let (a1, a2, b1) = (
        Stub::start("a1", 2).await,
        Stub::start("a2", 2).await,
        Stub::start("b1", 2).await,
    );
    let proxy = start(config(&[("node-a", &a1), ("node-a", &a2), ("node-b", &b1)])).await;

    let fields = [
        json!({"prompt_cache_key": "pck-1"}),
        json!({"user": "user-1"}),
        json!({"metadata": {"user_id": "meta-1"}}),
        json!({"user": 12345}),
    ];
    for extra in fields {
        let mut conv = Conversation::new("body");
        let first = proxy.post_json(&[], &conv.next(extra.clone())).await;
        assert_eq!(first.outcome(), "new-session", "{extra}");
        conv.answered(&first);
        let second = proxy.post_json(&[], &conv.next(extra.clone())).await;
        assert_eq!(second.outcome(), "home-hit", "{extra}");
        assert_eq!(second.backend(), first.backend(), "{extra}");
        let (_, cached) = usage(&second);
        assert!(cached > 0, "{extra}");
    }

    // One key, whichever way it comes: header first, then body.
    let mut conv = Conversation::new("both");
    let by_header = proxy
        .post_json(&[("x-session-id", "same-k")], &conv.next(json!({})))
        .await;
    conv.answered(&by_header);
    let by_body = proxy
        .post_json(&[], &conv.next(json!({"user": "same-k"})))
        .await;
    assert_eq!(
        (by_body.outcome(), by_body.backend()),
        ("home-hit", by_header.backend())
    );

    // Header and body disagree: the header is the key, the body's is never recorded.
    let mut conv = Conversation::new("disagree");
    let both = proxy
        .post_json(
            &[("x-session-affinity", "hdr-k")],
            &conv.next(json!({"prompt_cache_key": "body-k"})),
        )
        .await;
    assert_eq!(both.outcome(), "new-session");
    let header_only = proxy
        .post_json(&[("x-session-affinity", "hdr-k")], &conv.next(json!({})))
        .await;
    assert_eq!(header_only.outcome(), "home-hit");
    let body_only = proxy
        .post_json(&[], &conv.next(json!({"prompt_cache_key": "body-k"})))
        .await;
    assert_eq!(body_only.outcome(), "new-session");

    let keyless = proxy
        .post_json(&[], &Conversation::new("none").next(json!({"user": ""})))
        .await;
    assert_eq!(keyless.outcome(), "keyless");
}

#[tokio::test]
async fn an_oversize_body_is_413_and_never_reaches_a_backend() {
    let a = Stub::start("a", 2).await;
    let mut config = config(&[("node-a", &a)]);
    config.body_limit = 1024;
    let proxy = start(config).await;

    let big = json!({"user": "u", "messages": [{"role": "user", "content": "y".repeat(2048)}]});
    let answer = proxy.post_json(&[("x-session-id", "s")], &big).await;
    assert_eq!(answer.status, StatusCode::PAYLOAD_TOO_LARGE);
    let text = String::from_utf8(answer.body.to_vec()).unwrap();
    assert!(
        text.contains("larger than the limit of 1024 bytes"),
        "{text:?}"
    );
    assert_eq!(a.chats(), 0);
    assert!(a.echoed().is_empty());
    assert_eq!(proxy.proxy.affinity().stats().placed(), 0);

    let small = json!({"user": "u", "messages": [{"role": "user", "content": "y"}]});
    assert_eq!(proxy.post_json(&[], &small).await.status, 200);
}

/// A client that sends part of its headers and stops is disconnected at the header timeout:
/// otherwise each such client would hold a connection and a file descriptor for good.
#[tokio::test(start_paused = true)]
async fn a_client_stalled_in_its_headers_is_disconnected_at_the_header_timeout() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let a = Stub::start("a", 2).await;
    let proxy = start(config(&[("node-a", &a)])).await;
    let mut stalled = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    stalled
        .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let started = tokio::time::Instant::now();
    let mut buf = [0u8; 256];
    let read = tokio::time::timeout(Duration::from_secs(120), stalled.read(&mut buf))
        .await
        .expect("the proxy closes the connection");
    // Closed: nothing more to read, or a reset.
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(30) && waited < Duration::from_secs(32),
        "{waited:?}"
    );
    // A client that sends its headers in time is served.
    let small = json!({"messages": [{"role": "user", "content": "y"}]});
    assert_eq!(proxy.post_json(&[], &small).await.status, 200);
}

#[tokio::test]
async fn a_non_json_request_passes_through_byte_for_byte() {
    a_non_json_request_passes_through_byte_for_byte_with(UpstreamMode::Pooled).await;
}

#[tokio::test]
async fn per_client_a_non_json_request_passes_through_byte_for_byte() {
    a_non_json_request_passes_through_byte_for_byte_with(UpstreamMode::PerClient).await;
}

async fn a_non_json_request_passes_through_byte_for_byte_with(mode: UpstreamMode) {
    let a = Stub::start("a", 2).await;
    let proxy = start(upstream(config(&[("node-a", &a)]), mode)).await;

    let payload: &'static [u8] = b"\x00\x01\xfe\xff{not json\r\n\x7f";
    let req = Request::post(proxy.url("/upload/raw?x=1&y=%20z"))
        .header("content-type", "application/octet-stream")
        .header("x-custom", "kept")
        .header("authorization", "Bearer secret")
        .header("keep-alive", "timeout=5")
        .header("x-per-hop", "dropped")
        .header("connection", "x-per-hop")
        .body(Full::new(Bytes::from_static(payload)))
        .unwrap();
    let answer = proxy.fetch(req).await;
    assert_eq!(
        answer.status,
        StatusCode::CREATED,
        "the backend's status comes back"
    );
    assert_eq!(&answer.body[..], payload, "the backend's body comes back");
    assert_eq!(answer.outcome(), "keyless");

    let seen = a.echoed();
    assert_eq!(seen.len(), 1);
    let seen = &seen[0];
    assert_eq!(seen.method, http::Method::POST);
    assert_eq!(
        seen.uri.path_and_query().unwrap().as_str(),
        "/upload/raw?x=1&y=%20z"
    );
    assert!(
        seen.uri.authority().is_none(),
        "the request line is origin-form: {}",
        seen.uri
    );
    assert_eq!(&seen.body[..], payload);
    assert_eq!(seen.headers["content-type"], "application/octet-stream");
    assert_eq!(seen.headers["x-custom"], "kept");
    assert_eq!(seen.headers["authorization"], "Bearer secret");
    assert_eq!(seen.headers["host"], a.addr.to_string());
    for hop in ["keep-alive", "x-per-hop"] {
        assert!(!seen.headers.contains_key(hop), "{hop} is hop-by-hop");
    }

    let get = proxy.get("/v1/models?limit=1").await;
    assert_eq!(get.status, StatusCode::CREATED);
    assert_eq!(
        a.echoed()[1].uri.path_and_query().unwrap().as_str(),
        "/v1/models?limit=1"
    );
}

/// An HTTP/1.0 backend's answer goes on in the proxy's own version, HTTP/1.1 (RFC 9110,
/// section 6.2), as the request went on in the backend's: its stream, of no declared length,
/// ended by the close of the backend's connection, reaches an HTTP/1.1 client chunked, so
/// that a cut shows as a body error, as for any other backend's cut stream, rather than as
/// the close that ends an HTTP/1.0 answer whole.
#[tokio::test]
async fn an_http10_backends_stream_goes_on_as_http11_and_its_cut_shows() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let cut = Arc::new(tokio::sync::Notify::new());
    let cutting = cut.clone();
    tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        let mut head = Vec::new();
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
        let answer = b"HTTP/1.0 200 OK\r\ncontent-type: text/event-stream\r\n\r\ndata: {}\n\n";
        stream.write_all(answer).await.unwrap();
        cutting.notified().await;
        // Cut: a reset, not the close that would end the answer.
        #[allow(deprecated)]
        let _ = stream.set_linger(Some(Duration::ZERO));
        drop(stream);
    });
    let proxy = start(config_of(&[format!("node-a=http://{addr},slots=2,id=old")])).await;
    let req = Request::get(proxy.url("/v1/events"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let res = proxy.send(req).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.version(), http::Version::HTTP_11);
    let body = after_first_chunk(res).await;
    cut.notify_one();
    let rest = tokio::time::timeout(DEADLINE, body.collect())
        .await
        .expect("the cut stream did not end");
    assert!(rest.is_err(), "a cut stream reached the client as whole");
}

#[tokio::test]
async fn a_request_id_is_set_sent_to_the_backend_and_returned() {
    let a = Stub::start("a", 2).await;
    let proxy = start(config(&[("node-a", &a)])).await;

    let first = proxy.get("/v1/models").await;
    let second = proxy.get("/v1/models").await;
    let (id1, id2) = (first.header("x-request-id"), second.header("x-request-id"));
    assert_ne!(id1, "-", "the proxy sets one");
    assert_ne!(id1, id2, "one per request");
    let seen = a.echoed();
    assert_eq!(seen[0].headers["x-request-id"], id1, "the backend sees it");
    assert_eq!(seen[1].headers["x-request-id"], id2);

    // A client's own is kept.
    let req = Request::get(proxy.url("/v1/models"))
        .header("x-request-id", "client-7")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let answer = proxy.fetch(req).await;
    assert_eq!(answer.header("x-request-id"), "client-7");
    assert_eq!(a.echoed()[2].headers["x-request-id"], "client-7");
}

#[test]
fn a_request_id_is_the_process_prefix_and_the_counter_in_hex() {
    for (prefix, n) in [
        (0, 0),
        (0xdead_beef, 1),
        (0x0000_00a0, 15),
        (7, 16),
        (u32::MAX, 0x1234_5678_9abc),
        (1, u64::MAX),
    ] {
        let id = app::request_id(prefix, n).unwrap();
        assert_eq!(id, format!("{prefix:08x}-{n:x}").as_str());
    }
}

/// Sends `n` GETs one after another on one client connection of its own to the proxy; the
/// first names its target in absolute-form, as a client of a forward proxy would.
async fn gets_on_one_connection(proxy: &Running, n: usize) {
    let stream = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let (mut tx, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    let conn = tokio::spawn(conn);
    for i in 0..n {
        let target = if i == 0 {
            format!("http://{}/v1/models?i={i}", proxy.addr)
        } else {
            format!("/v1/models?i={i}")
        };
        let req = Request::get(target)
            .header("host", proxy.addr.to_string())
            .body(Full::new(Bytes::new()))
            .unwrap();
        let res = tokio::time::timeout(DEADLINE, tx.send_request(req))
            .await
            .expect("no response in time")
            .unwrap();
        assert_eq!(res.status(), StatusCode::CREATED);
        tokio::time::timeout(DEADLINE, res.into_body().collect())
            .await
            .expect("no body in time")
            .unwrap();
    }
    drop(tx);
    tokio::time::timeout(DEADLINE, conn)
        .await
        .expect("the client connection did not close")
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn per_client_requests_of_one_client_connection_share_one_backend_connection() {
    let a = Stub::start("a", 2).await;
    let proxy = start(upstream(config(&[("node-a", &a)]), UpstreamMode::PerClient)).await;

    gets_on_one_connection(&proxy, 5).await;
    assert_eq!(a.echoed().len(), 5);
    assert_eq!(a.connections(), 1, "one backend connection for the five");
    gets_on_one_connection(&proxy, 3).await;
    assert_eq!(a.echoed().len(), 8);
    assert_eq!(
        a.connections(),
        2,
        "one more for the second client connection"
    );
    for seen in a.echoed() {
        assert!(seen.uri.authority().is_none(), "origin-form: {}", seen.uri);
        assert!(seen.uri.path().starts_with("/v1/models"), "{}", seen.uri);
    }
}

#[tokio::test]
async fn per_client_http2_streams_go_through_the_pool_and_are_served() {
    let n = 6;
    let a = Stub::start("a", n).await;
    let mut config = upstream(config(&[("node-a", &a)]), UpstreamMode::PerClient);
    config.backends[0].slots = std::num::NonZeroU32::new(u32::try_from(n).unwrap());
    let proxy = start(config).await;
    a.hold_streams();

    // One HTTP/2 client connection carrying `n` streams at once, each held after its first
    // chunk. hyper serves each stream in a task of its own, so they go through the pooled
    // client: one backend connection per stream in flight.
    let client = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http::<Full<Bytes>>();
    let mut bodies = Vec::new();
    for s in 0..n {
        let session = format!("h2-{s}");
        let url = proxy.url("/v1/chat/completions");
        bodies.push(open_stream(&client, url, &session, Some(&session)).await);
    }
    assert_eq!(proxy.proxy.affinity().stats().in_flight, n);
    assert_eq!(a.connections(), n, "one backend connection per stream");

    a.release_streams();
    for (s, body) in bodies.into_iter().enumerate() {
        let rest = tokio::time::timeout(DEADLINE, body.collect())
            .await
            .expect("the stream stalled")
            .unwrap()
            .to_bytes();
        let rest = String::from_utf8(rest.to_vec()).unwrap();
        assert!(rest.ends_with("data: [DONE]\n\n"), "stream {s}: {rest:?}");
    }
    assert_eq!(proxy.proxy.affinity().stats().in_flight, 0);
}

// === overflow and metrics ===

#[tokio::test]
async fn a_full_backend_makes_requests_wait_and_metrics_show_it() {
    let a = Stub::start("a", 1).await;
    let mut config = config(&[("node-a", &a)]);
    config.backends[0] = cli::backend(&format!("node-a={},slots=1,id=a", a.url()))
        .unwrap()
        .0;
    config.overflow = Overflow::wait(DEADLINE, 8);
    let proxy = Arc::new(start(config).await);
    a.hold_streams();

    let streaming = Conversation::new("first").next(json!({"stream": true}));
    let req = Request::post(proxy.url("/v1/chat/completions"))
        .header("x-session-id", "first")
        .body(Full::new(Bytes::from(streaming.to_string())))
        .unwrap();
    let res = proxy.send(req).await;
    let waiter = {
        let proxy = proxy.clone();
        tokio::spawn(async move {
            let body = Conversation::new("second").next(json!({}));
            proxy.post_json(&[("x-session-id", "second")], &body).await
        })
    };
    // Until the balancer holds it (a bounded wait for the event, not a fixed sleep).
    let waiting = async {
        while proxy.proxy.affinity().stats().waiting != 1 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(DEADLINE, waiting)
        .await
        .expect("the second request should wait for the only slot");
    let metrics = String::from_utf8(proxy.get("/metrics").await.body.to_vec()).unwrap();
    assert!(metrics.contains("tower_affinity_waiting 1"), "{metrics}");
    assert!(
        metrics.contains(r#"tower_affinity_backend_in_flight{backend="a",node="node-a"} 1"#),
        "{metrics}"
    );

    a.release_streams();
    tokio::time::timeout(DEADLINE, res.into_body().collect())
        .await
        .unwrap()
        .unwrap();
    let second = tokio::time::timeout(DEADLINE, waiter)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(second.status, 200);

    let res = proxy.get("/metrics").await;
    assert_eq!(res.status, 200);
    assert_eq!(
        res.header("content-type"),
        "text/plain; version=0.0.4; charset=utf-8"
    );
    let metrics = String::from_utf8(res.body.to_vec()).unwrap();
    for line in [
        r#"tower_affinity_decisions_total{outcome="new-session"} 2"#,
        r#"tower_affinity_decisions_total{outcome="home-hit"} 0"#,
        "tower_affinity_waited_total 1",
        "tower_affinity_waiting 0",
        "tower_affinity_in_flight 0",
        "tower_affinity_wait_seconds_count 1",
        r#"tower_affinity_backend_slots{backend="a",node="node-a"} 1"#,
        r#"tower_affinity_backend_healthy{backend="a",node="node-a"} 1"#,
        "tower_affinity_backend_errors_total 0",
        "tower_affinity_rejected_total 0",
        "tower_affinity_abandoned_total 0",
    ] {
        assert!(metrics.contains(line), "missing {line:?} in\n{metrics}");
    }
    // What the cache model says the backend holds: the two prompts it served.
    let value = |name: &str| -> u64 {
        let series = format!(r#"{name}{{backend="a",node="node-a"}} "#);
        let line = metrics.lines().find(|l| l.starts_with(&series));
        let line = line.unwrap_or_else(|| panic!("missing {series:?} in\n{metrics}"));
        line[series.len()..].parse().unwrap()
    };
    let model = proxy.proxy.affinity().backends();
    assert_eq!(
        value("tower_affinity_backend_cached_tokens"),
        model[0].cached_tokens
    );
    assert!(model[0].cached_tokens > 0);
    assert_eq!(
        value("tower_affinity_backend_cache_budget_tokens"),
        model[0].cache_budget
    );
    assert!(model[0].cache_budget >= model[0].cached_tokens);
    assert_eq!(
        value("tower_affinity_backend_conversations"),
        u64::from(model[0].conversations)
    );
}

// === several models ===

/// Backends given `model=` are a fleet of their own: a request goes to its body's model's
/// fleet, any other to the backends given without a model; each fleet keeps its own sessions,
/// and `/metrics` labels every series with its fleet's model, each family described once.
#[tokio::test]
async fn each_model_has_a_fleet_of_its_own_and_its_own_series() {
    let (a, b, small) = (
        Stub::start("a", 2).await,
        Stub::start("b", 2).await,
        Stub::start("small", 2).await,
    );
    let backends = [
        format!("node-a={},slots=2,id=a", a.url()),
        format!("node-b={},slots=2,id=b", b.url()),
        format!("node-c={},slots=2,id=small,model=qwen3-4b", small.url()),
    ];
    let proxy = start(config_of(&backends)).await;

    let session = [("x-session-id", "agent-1")];
    let mut main = Conversation::new("agent-1");
    let mut served = Vec::new();
    for turn in 0..3 {
        // The agent's turn (a model no fleet names), then a title under the same key.
        let res = proxy
            .post_json(&session, &main.next(json!({"model": "coder"})))
            .await;
        assert_eq!(res.status, 200, "turn {turn}");
        served.push((res.backend().to_string(), res.outcome().to_string()));
        let title =
            json!({"model": "qwen3-4b", "messages": [{"role": "user", "content": "Name this."}]});
        let res = proxy.post_json(&session, &title).await;
        assert_eq!(
            (res.status, res.backend()),
            (StatusCode::OK, "small"),
            "title {turn}"
        );
    }
    // The titles did not move the agent's session: each later turn is a home hit.
    assert_ne!(served[0].0, "small");
    for (backend, outcome) in &served[1..] {
        assert_eq!(
            (backend, outcome.as_str()),
            (&served[0].0, "home-hit"),
            "{served:?}"
        );
    }
    // A token count goes to its model's fleet too, placed apart from the session (the stub
    // echoes a path it does not serve, with a 201).
    let count = json!({"model": "qwen3-4b", "messages": [{"role": "user", "content": "Count."}]});
    let req = Request::post(proxy.url("/v1/messages/count_tokens"))
        .header("content-type", "application/json")
        .header("x-session-id", "agent-1")
        .body(Full::new(Bytes::from(count.to_string())))
        .unwrap();
    let res = proxy.fetch(req).await;
    assert_eq!(
        (res.status, res.backend(), res.outcome()),
        (StatusCode::CREATED, "small", "keyless")
    );
    // Without a model, or not JSON: the fleet without a model.
    let res = proxy
        .post_json(
            &[],
            &json!({"messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert!(matches!(res.backend(), "a" | "b"), "{}", res.backend());

    let fleets = proxy.proxy.fleets();
    let models: Vec<_> = fleets.iter().map(|f| f.model.as_deref()).collect();
    assert_eq!(models, [None, Some("qwen3-4b")]);
    // The proxy lists the models given; the fleet without one serves any other name.
    assert_eq!(listed_models(&proxy).await, ["qwen3-4b"]);
    assert_eq!(fleets[1].affinity.stats().placed(), 4);

    let metrics = String::from_utf8(proxy.get("/metrics").await.body.to_vec()).unwrap();
    for line in [
        r#"tower_affinity_decisions_total{outcome="home-hit",model=""} 2"#,
        r#"tower_affinity_decisions_total{outcome="new-session",model="qwen3-4b"} 1"#,
        r#"tower_affinity_decisions_total{outcome="home-hit",model="qwen3-4b"} 2"#,
        r#"tower_affinity_sessions{model="qwen3-4b"} 1"#,
        r#"tower_affinity_rejected_total{model=""} 0"#,
        r#"tower_affinity_backend_slots{backend="small",node="node-c",model="qwen3-4b"} 2"#,
        r#"tower_affinity_backend_slots{backend="a",node="node-a",model=""} 2"#,
        r#"tower_affinity_wait_seconds_count{model="qwen3-4b"} 0"#,
    ] {
        assert!(metrics.contains(line), "missing {line:?} in\n{metrics}");
    }
    // Every series of the balancers carries the label, and each family is described once.
    let mut described = HashSet::new();
    for line in metrics.lines() {
        if let Some(family) = line.strip_prefix("# TYPE ") {
            assert!(
                described.insert(family.to_string()),
                "described twice: {family}"
            );
        } else if line.starts_with("tower_affinity_") {
            assert!(line.contains("model=\""), "without its model: {line}");
        }
    }
}

/// The decision headers, on by default, can be left out (`--no-decision-headers`): they tell
/// a client where its prompt went, and so what the caches hold.
#[tokio::test]
async fn decision_headers_can_be_left_out() {
    let a = Stub::start("a", 2).await;
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    for on in [true, false] {
        let mut config = config(&[("node-a", &a)]);
        config.decision_headers = on;
        let proxy = start(config).await;
        let res = proxy.post_json(&[("x-session-id", "s")], &body).await;
        assert_eq!(res.status, StatusCode::OK);
        let said = [
            "x-affinity-backend",
            "x-affinity-node",
            "x-affinity-outcome",
        ]
        .map(|h| res.headers.contains_key(h));
        assert_eq!(said, [on; 3], "decision headers {on}");
    }
}

/// A config without backends (which the command line refuses) serves all the same: 503.
#[tokio::test]
async fn a_proxy_without_backends_answers_503() {
    let mut config = Config::new(Vec::new());
    config.probe_interval = None;
    let proxy = start(config).await;
    let res = proxy
        .post_json(&[], &json!({"model": "m", "messages": []}))
        .await;
    assert_eq!(res.status, StatusCode::SERVICE_UNAVAILABLE);
}

/// The only backend fails, refusing the connection: the retry finds no other backend up (the
/// failure's cooldown passes that one over), and the client is told of the failure, 502 with
/// its cause, as for a retry that fails too, not 503 "no backends available". (The same for a
/// response timeout, 504, is `client::the_only_backend_failing_is_its_failure_after_the_retry_not_no_backends`,
/// on paused time.)
#[tokio::test]
async fn the_only_backend_failing_is_502_not_no_backends() {
    let closed = Refusing::new();
    let refusing = closed.addr;
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    let proxy = start(config_of(&[format!(
        "node-a=http://{refusing},slots=2,id=only"
    )]))
    .await;
    let res = proxy.post_json(&[], &body).await;
    let text = String::from_utf8_lossy(&res.body);
    assert_eq!(res.status, StatusCode::BAD_GATEWAY, "{text}");
    let body: serde_json::Value = serde_json::from_slice(&res.body).unwrap();
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with("backend only failed: connection refused"),
        "{text}"
    );
    assert_eq!(proxy.status("only").failures, 1);
}

/// A backend that closes a pooled connection just as a request goes out on it (llama-server
/// closes its connection after each streamed answer, unannounced, and a request a freed
/// slot lets through takes it back from the pool before the close is seen) never read that
/// request: it is sent again on another connection, and the backend is not failed for it.
#[tokio::test]
async fn a_request_on_a_connection_its_backend_closed_unanswered_is_sent_again_on_another() {
    a_request_on_a_connection_its_backend_closed_unanswered_is_sent_again_on_another_with(
        UpstreamMode::Pooled,
    )
    .await;
}

/// The same on a client connection's own backend connection: the client's next request goes
/// out on it as soon as the previous answer ends.
#[tokio::test]
async fn per_client_a_request_on_a_connection_its_backend_closed_unanswered_is_sent_again_on_another(
) {
    a_request_on_a_connection_its_backend_closed_unanswered_is_sent_again_on_another_with(
        UpstreamMode::PerClient,
    )
    .await;
}

async fn a_request_on_a_connection_its_backend_closed_unanswered_is_sent_again_on_another_with(
    mode: UpstreamMode,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // Each connection: its first request answered, its second read and left unanswered, the
    // connection closed.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        for _ in 0..16 {
            let Ok((mut conn, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut seen = Vec::new();
                let mut buf = [0u8; 4096];
                for answered in [true, false] {
                    // One request: its head, then the body its Content-Length gives.
                    let want = loop {
                        if let Some(end) = seen.windows(4).position(|w| w == b"\r\n\r\n") {
                            let head = String::from_utf8_lossy(&seen[..end]).to_ascii_lowercase();
                            let length = (head.lines())
                                .find_map(|l| l.strip_prefix("content-length:"))
                                .map_or(0, |n| n.trim().parse::<usize>().unwrap());
                            break end + 4 + length;
                        }
                        match conn.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => seen.extend_from_slice(&buf[..n]),
                        }
                    };
                    while seen.len() < want {
                        match conn.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => seen.extend_from_slice(&buf[..n]),
                        }
                    }
                    seen.drain(..want);
                    if !answered {
                        return;
                    }
                    let body = r#"{"choices":[{"message":{"role":"assistant","content":"hi"}}]}"#;
                    let head = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                        body.len()
                    );
                    if conn.write_all((head + body).as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    let spec = format!("node-a=http://{addr},slots=2,id=only");
    let proxy = start(upstream(config_of(&[spec]), mode)).await;
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    for turn in 0..3 {
        let res = proxy.post_json(&[("x-session-id", "s")], &body).await;
        let text = String::from_utf8_lossy(&res.body);
        assert_eq!(res.status, StatusCode::OK, "{mode:?}, turn {turn}: {text}");
        assert_eq!(res.backend(), "only");
    }
    assert_eq!(proxy.status("only").failures, 0, "{mode:?}");
    assert!(proxy.status("only").healthy, "{mode:?}");
    // Turn 1 found its connection closed, and was counted; so did turn 2 on the client
    // connection's own (the pool keeps no connection opened for a request sent again).
    let again = match mode {
        UpstreamMode::Pooled => 1,
        UpstreamMode::PerClient => 2,
    };
    assert_eq!(proxy.status("only").sent_again, again, "{mode:?}");
    let metrics = String::from_utf8(proxy.get("/metrics").await.body.to_vec()).unwrap();
    let line = metrics
        .lines()
        .find(|l| l.starts_with("tower_affinity_backend_sent_again_total{"));
    assert!(
        line.is_some_and(|l| l.contains(r#"backend="only""#) && l.ends_with(&format!(" {again}"))),
        "{mode:?}: {line:?} in:\n{metrics}"
    );
    server.abort();
}

/// When every backend names its model, a request naming none of them goes to the first
/// model given.
#[tokio::test]
async fn without_a_fleet_for_other_models_the_first_model_takes_them() {
    let (coder, small) = (Stub::start("coder", 2).await, Stub::start("small", 2).await);
    let backends = [
        format!("node-a={},slots=2,id=small,model=qwen3-4b", small.url()),
        format!("node-b={},slots=2,id=coder,model=qwen3-coder", coder.url()),
    ];
    let proxy = start(config_of(&backends)).await;
    for (model, backend) in [
        ("qwen3-coder", "coder"),
        ("qwen3-4b", "small"),
        ("other", "small"),
    ] {
        let body = json!({"model": model, "messages": [{"role": "user", "content": "hi"}]});
        let res = proxy.post_json(&[], &body).await;
        assert_eq!(
            (res.status, res.backend()),
            (StatusCode::OK, backend),
            "{model}"
        );
    }
    let res = proxy
        .fetch(
            Request::post(proxy.url("/v1/chat/completions"))
                .body(Full::new(Bytes::from_static(b"not json")))
                .unwrap(),
        )
        .await;
    assert_eq!(res.backend(), "small");
    assert_eq!(proxy.proxy.affinity().backends()[0].id.as_str(), "small");
    assert_eq!(listed_models(&proxy).await, ["qwen3-4b", "qwen3-coder"]);
    // One model by name, as OpenAI's `models.retrieve` asks; another name goes on to the
    // fleet that serves other names.
    let one = proxy.get("/v1/models/qwen3-coder").await;
    assert_eq!((one.status, one.backend()), (StatusCode::OK, "-"));
    assert_eq!(one.json()["id"], "qwen3-coder");
    assert_eq!(one.json()["object"], "model");
    let other = proxy.get("/v1/models/other").await;
    assert_eq!(other.backend(), "small");
}

/// With several fleets, the balancer's 503 for want of a backend names the fleet, then says
/// what the balancer's own refusal says: here that every backend of the fleet is down, and
/// how many it has, not only that none is available.
#[tokio::test]
async fn a_fleet_with_no_backend_up_says_which_model_it_serves_and_that_its_backends_are_down() {
    let (small, coder) = (Stub::start("small", 2).await, Stub::start("coder", 2).await);
    let backends = [
        format!("node-a={},slots=2,id=small", small.url()),
        format!("node-b={},slots=2,id=coder,model=qwen3-coder", coder.url()),
    ];
    let proxy = start(config_of(&backends)).await;
    coder.set_health(503);
    small.set_health(503);
    proxy.proxy.probe_all().await;
    for (model, says) in [
        (
            "qwen3-coder",
            "model \"qwen3-coder\": no backends available: every backend is down (1 in the fleet)",
        ),
        (
            "other",
            "the models not given a fleet: no backends available: every backend is down \
             (1 in the fleet)",
        ),
    ] {
        let body = json!({"model": model, "messages": [{"role": "user", "content": "hi"}]});
        let res = proxy.post_json(&[], &body).await;
        assert_eq!(res.status, StatusCode::SERVICE_UNAVAILABLE, "{model}");
        let body: serde_json::Value = serde_json::from_slice(&res.body).unwrap();
        assert_eq!(body["error"]["message"], says, "{model}");
        assert_eq!(body["error"]["type"], "unavailable_error", "{model}");
    }
    // Ready again (two probes): served.
    small.set_health(200);
    proxy.proxy.probe_all().await;
    proxy.proxy.probe_all().await;
    let body = json!({"model": "other", "messages": [{"role": "user", "content": "hi"}]});
    assert_eq!(proxy.post_json(&[], &body).await.status, StatusCode::OK);
}

/// With several fleets, the balancer's 503 that names the fleet keeps its time to retry
/// after: a fleet whose only backend refused a connection is back when its failure cooldown
/// ends, and the message says so with the `Retry-After` header, as the balancer's own does.
#[tokio::test]
async fn with_several_fleets_the_503_naming_the_fleet_says_when_to_retry() {
    let closed = Refusing::new();
    let small = Stub::start("small", 2).await;
    let backends = [
        format!("node-a={},slots=2,id=small", small.url()),
        format!(
            "node-b=http://{},slots=2,id=coder,model=qwen3-coder",
            closed.addr
        ),
    ];
    let proxy = start(config_of(&backends)).await;
    let body = json!({"model": "qwen3-coder", "messages": [{"role": "user", "content": "hi"}]});
    // Refused: the backend's failure, and its cooldown begins.
    let res = proxy.post_json(&[], &body).await;
    assert_eq!(res.status, StatusCode::BAD_GATEWAY);
    let res = proxy.post_json(&[], &body).await;
    assert_eq!(res.status, StatusCode::SERVICE_UNAVAILABLE);
    let after = res.header("retry-after");
    assert!(after.parse::<u64>().is_ok_and(|s| s >= 1), "{after:?}");
    let body: serde_json::Value = serde_json::from_slice(&res.body).unwrap();
    assert_eq!(
        body["error"]["message"],
        format!(
            "model \"qwen3-coder\": no backends available: every backend is down \
             (1 in the fleet); retry after {after} s"
        )
    );
}

/// With several fleets, a 503 that a backend gave (both backends of the default fleet
/// loading, the retry's answer passed through) goes to the client as the backend gave it: the
/// text naming the fleet is for the balancer's own 503 alone. It replaced the backend's body
/// under the backend's `content-length`, which the new body did not match.
#[tokio::test]
async fn with_several_fleets_a_backends_own_503_passes_through_as_it_came() {
    let (a, b, coder) = (
        Stub::start("a", 2).await,
        Stub::start("b", 2).await,
        Stub::start("coder", 2).await,
    );
    let backends = [
        format!("node-a={},slots=2,id=a", a.url()),
        format!("node-b={},slots=2,id=b", b.url()),
        format!("node-c={},slots=2,id=coder,model=qwen3-coder", coder.url()),
    ];
    let proxy = start(config_of(&backends)).await;
    // Loading, and not probed since: the first answers 503, the retry on the other too.
    a.set_health(503);
    b.set_health(503);
    let res = proxy.get("/health").await;
    assert_eq!(res.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(matches!(res.backend(), "a" | "b"), "{}", res.backend());
    assert_eq!(res.header("content-type"), "application/json");
    assert_eq!(res.json()["error"]["message"], "Loading model");
}

#[tokio::test]
async fn a_model_is_retrieved_by_its_name_escaped_or_not() {
    let a = Stub::start("a", 2).await;
    let spec = format!("n={},id=a,model=org/Model 4B", a.url());
    let proxy = start(config_of(&[spec])).await;
    for path in [
        "/v1/models/org/Model%204B",
        "/v1/models/org%2FModel%204B",
        "/v1/models/org%2fModel%204B",
    ] {
        let one = proxy.get(path).await;
        assert_eq!((one.status, one.backend()), (StatusCode::OK, "-"), "{path}");
        assert_eq!(one.json()["id"], "org/Model 4B", "{path}");
    }
    // Not one of the models given, or not a well-formed escape: the backend answers.
    for path in [
        "/v1/models/org",
        "/v1/models/org%2",
        "/v1/models/org%+fModel",
    ] {
        assert_eq!(proxy.get(path).await.backend(), "a", "{path}");
    }
}

/// The ids of the models `GET /v1/models` lists, answered by the proxy itself.
async fn listed_models(proxy: &Running) -> Vec<String> {
    let list = proxy.get("/v1/models").await;
    assert_eq!(
        (list.status, list.header("content-type"), list.backend()),
        (StatusCode::OK, "application/json", "-")
    );
    let data = list.json()["data"].as_array().cloned().unwrap_or_default();
    data.iter()
        .map(|m| m["id"].as_str().unwrap_or_default().to_string())
        .collect()
}

/// Reads a streamed answer's chunks: their JSON, past `data: ` (without `[DONE]`).
fn chunks(body: &[u8]) -> Vec<Value> {
    String::from_utf8_lossy(body)
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

#[tokio::test]
async fn with_ask_stream_usage_a_vllm_stream_is_read_and_the_client_gets_what_it_asked_for() {
    let a = Stub::start("a", 2).await;
    a.stream_usage_when_asked();
    let mut config = config(&[("node-a", &a)]);
    config.ask_stream_usage = true;
    let proxy = start(config).await;
    let mut conv = Conversation::new("s");
    let stream = |conv: &mut Conversation, extra: Value| {
        let mut body = conv.next(json!({"stream": true}));
        if let (Value::Object(b), Value::Object(e)) = (&mut body, extra) {
            b.extend(e);
        }
        body
    };
    // A client that did not ask: no usage chunk reaches it, and the proxy read the usage.
    let unasked = proxy
        .post_json(&[("x-session-id", "s")], &stream(&mut conv, json!({})))
        .await;
    assert_eq!(unasked.status, 200);
    let got = chunks(&unasked.body);
    assert!(!got.is_empty() && got.iter().all(|c| c["choices"] != json!([])));
    assert!(got.iter().all(|c| c.get("usage").is_none()), "{got:?}");
    assert!(String::from_utf8_lossy(&unasked.body).ends_with("data: [DONE]\n\n"));
    let stats = proxy.proxy.affinity().stats();
    assert_eq!(stats.usage_reports, 1);
    assert!(stats.prompt_tokens > 0);
    // A client that asked gets the usage chunk.
    let asked = proxy
        .post_json(
            &[("x-session-id", "s")],
            &stream(
                &mut conv,
                json!({"stream_options": {"include_usage": true}}),
            ),
        )
        .await;
    let got = chunks(&asked.body);
    let last = got.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert!(last["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
    assert_eq!(proxy.proxy.affinity().stats().usage_reports, 2);

    // Without asking, the same stub's streams report nothing.
    let mut config = self::config(&[("node-a", &a)]);
    config.ask_stream_usage = false;
    let plain = start(config).await;
    let _ = plain
        .post_json(&[("x-session-id", "s")], &stream(&mut conv, json!({})))
        .await;
    assert_eq!(plain.proxy.affinity().stats().usage_reports, 0);
}

#[tokio::test]
async fn metrics_answers_get_and_head_only_and_never_reaches_a_backend() {
    let a = Stub::start("a", 1).await;
    let proxy = start(config(&[("node-a", &a)])).await;
    let head = Request::head(proxy.url("/metrics"))
        .body(Full::default())
        .unwrap();
    let head = proxy.fetch(head).await;
    assert_eq!(head.status, 200);
    assert!(head.body.is_empty());
    let post = Request::post(proxy.url("/metrics"))
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    let post = proxy.fetch(post).await;
    assert_eq!(post.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(post.header("allow"), "GET,HEAD");
    assert!(a.echoed().is_empty());
}

#[tokio::test]
async fn with_overflow_reject_a_full_fleet_answers_429() {
    let a = Stub::start("a", 1).await;
    let mut config = config(&[("node-a", &a)]);
    config.backends[0] = cli::backend(&format!("node-a={},slots=1,id=a", a.url()))
        .unwrap()
        .0;
    config.overflow = Overflow::Reject;
    let proxy = start(config).await;
    a.hold_streams();

    let streaming = Conversation::new("first").next(json!({"stream": true}));
    let req = Request::post(proxy.url("/v1/chat/completions"))
        .body(Full::new(Bytes::from(streaming.to_string())))
        .unwrap();
    let held = proxy.send(req).await;
    let answer = proxy
        .post_json(&[], &Conversation::new("second").next(json!({})))
        .await;
    assert_eq!(answer.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(answer.header("retry-after"), "1");
    a.release_streams();
    drop(held);
}

// === command line ===

#[test]
fn the_e2e_command_line_parses() {
    let args = [
        "--listen",
        "127.0.0.1:18080",
        "--backend",
        "node-a=http://127.0.0.1:18081,slots=2",
        "--backend",
        "node-a=http://127.0.0.1:18082,slots=2",
        "--backend",
        "node-b=http://127.0.0.1:18083,slots=2",
        "--policy",
        "node-then-backend",
    ];
    let cli::Command::Run(run) = cli::parse(args).unwrap() else {
        panic!("not a run");
    };
    assert_eq!(run.listen, "127.0.0.1:18080".parse().unwrap());
    assert_eq!(run.worker_threads, None);
    let c = &run.config;
    let ids: Vec<_> = c.backends.iter().map(|b| b.id.as_str()).collect();
    assert_eq!(
        ids,
        ["127.0.0.1:18081", "127.0.0.1:18082", "127.0.0.1:18083"]
    );
    let nodes: Vec<_> = c.backends.iter().map(|b| b.node.as_str()).collect();
    assert_eq!(nodes, ["node-a", "node-a", "node-b"]);
    assert!(c
        .backends
        .iter()
        .all(|b| b.slots.map(|s| s.get()) == Some(2)));
    assert_eq!(c.policy, app::Policy::NodeThenBackend);
}

#[test]
fn every_option_parses_and_bad_values_are_explained() {
    let args = [
        "--listen=0.0.0.0:9000",
        "--backend",
        "n=http://localhost:8081,id=gpu0,cache=64k,model=qwen3-coder,assign-slots",
        "--backend-dns",
        "small.llm.internal:8080,model=qwen3-4b,context=96k,assign-slots",
        "--policy=round-robin",
        "--overflow",
        "wait",
        "--max-wait",
        "1.5s",
        "--max-queued",
        "7",
        "--connect-timeout",
        "250ms",
        "--response-timeout",
        "0",
        "--body-idle-timeout",
        "90s",
        "--tcp-keepalive",
        "1.5m",
        "--client-tcp-keepalive=2m",
        "--failure-cooldown",
        "1m",
        "--probe-interval",
        "0",
        "--probe-timeout",
        "3",
        "--probe-failures",
        "3",
        "--probe-successes=2",
        "--no-slots-probe",
        "--body-limit",
        "2MiB",
        "--read-timeout",
        "0",
        "--header-timeout",
        "0",
        "--worker-threads",
        "3",
        "--upstream",
        "per-client",
        "--replicas",
        "3",
        "-v",
    ];
    let cli::Command::Run(run) = cli::parse(args).unwrap() else {
        panic!("not a run");
    };
    let c = &run.config;
    assert!(run.verbose);
    assert_eq!(run.worker_threads.map(|n| n.get()), Some(3));
    assert_eq!(c.backends[0].id, "gpu0");
    assert_eq!(c.backends[0].slots, None);
    assert_eq!(c.backends[0].model.as_deref(), Some("qwen3-coder"));
    assert!(c.backends[0].assign_slots);
    assert_eq!(
        c.backend_dns[0].target.to_string(),
        "small.llm.internal:8080"
    );
    assert_eq!(c.backend_dns[0].model.as_deref(), Some("qwen3-4b"));
    assert_eq!(c.backend_dns[0].context.map(|n| n.get()), Some(96 * 1024));
    assert!(c.backend_dns[0].assign_slots);
    assert_eq!(c.cache_tokens("gpu0"), 64 * 1024);
    assert_eq!(c.policy, app::Policy::RoundRobin);
    assert_eq!(c.overflow, Overflow::wait(Duration::from_millis(1500), 7));
    assert_eq!(c.connect_timeout, Some(Duration::from_millis(250)));
    assert_eq!(c.response_timeout, None);
    assert_eq!(c.body_idle_timeout, Some(Duration::from_secs(90)));
    assert_eq!(c.tcp_keepalive, Some(Duration::from_secs(90)));
    assert_eq!(c.client_tcp_keepalive, Some(Duration::from_secs(120)));
    assert_eq!(c.failure_cooldown, Duration::from_secs(60));
    assert_eq!(c.probe_interval, None);
    assert_eq!(c.probe_timeout, Duration::from_secs(3));
    assert_eq!((c.probe_failures, c.probe_successes), (3, 2));
    assert!(!c.probe_slots);
    assert_eq!(c.body_limit, 2 << 20);
    assert_eq!(c.read_timeout, None);
    assert_eq!(c.header_timeout, None);
    assert_eq!(c.upstream, UpstreamMode::PerClient);
    assert_eq!(c.replicas.get(), 3);

    let cli::Command::Run(defaults) = cli::parse(["--backend", "n=http://x:1"]).unwrap() else {
        panic!("not a run");
    };
    let d = &defaults.config;
    assert_eq!(d.response_timeout, Some(Duration::from_secs(600)));
    assert_eq!(d.body_idle_timeout, None);
    assert_eq!(d.tcp_keepalive, Some(Duration::from_secs(30)));
    assert_eq!(d.client_tcp_keepalive, Some(Duration::from_secs(30)));
    assert_eq!(d.read_timeout, Some(Duration::from_secs(60)));
    assert_eq!(d.header_timeout, Some(Duration::from_secs(30)));
    assert_eq!(d.connect_timeout, Some(Duration::from_secs(2)));
    assert_eq!(d.upstream, UpstreamMode::Pooled);
    assert_eq!(d.replicas.get(), 1);
    assert_eq!((d.probe_failures, d.probe_successes), (1, 1));
    assert_eq!(d.cache_tokens("x:1"), Backend::<()>::DEFAULT_CACHE_TOKENS);
    assert_eq!(d.backends[0].model, None);

    for (args, needle) in [
        (
            vec!["--policy", "random"],
            "expected one of node-then-backend",
        ),
        (vec!["--backend", "http://x:1"], "no NODE="),
        (vec!["--probe-failures", "0"], "at least 1"),
        (vec!["--backend", "n=http://x:1/v1"], "paths are forwarded"),
        (vec!["--backend", "n=http://:8080"], "URL has no host"),
        (vec!["--backend", "n=http://x:1,slots=0"], "at least 1"),
        (vec!["--backend", "n=https://x:1"], "only http://"),
        (
            vec!["--backend", "n=http://x:1,cache=0"],
            "at least 1 token",
        ),
        (
            vec!["--backend", "n=http://x:1,cache=8GiB"],
            "number of tokens",
        ),
        (
            vec!["--backend", "n=http://x:1", "--max-wait", "soon"],
            "duration",
        ),
        (
            vec!["--backend", "n=http://x:1", "--max-queued", "-1"],
            "--max-queued \"-1\": expected a number of requests, 0 or more",
        ),
        (
            vec!["--backend", "n=http://x:1", "--overflow", "drop"],
            "wait, overcommit or reject",
        ),
        // Rounds to 0, which would turn the timeout off.
        (
            vec![
                "--backend",
                "n=http://x:1",
                "--read-timeout",
                "0.0000000001",
            ],
            "--read-timeout \"0.0000000001\": at least 1ms",
        ),
        (
            vec!["--backend", "n=http://x:1", "--probe-interval", "0.0001ms"],
            "at least 1ms, or 0",
        ),
        (vec!["--listen", "127.0.0.1:8080"], "at least one --backend"),
        (vec!["--bogus"], "unknown argument"),
        (
            vec!["--backend", "n=http://x:1", "--worker-threads", "0"],
            "at least 1",
        ),
        (vec!["--backend"], "needs a value"),
        (
            vec!["--backend", "n=http://x:1", "--replicas", "0"],
            "number of instances, at least 1",
        ),
        (
            vec!["--backend", "n=http://x:1", "--upstream", "shared"],
            "pooled or per-client",
        ),
        (
            vec!["--backend", "n=http://x:1", "--tcp-keepalive", "off"],
            "--tcp-keepalive \"off\": expected a duration",
        ),
        // The system counts keepalive in whole seconds, and takes at most 32767 of them.
        (
            vec!["--backend", "n=http://x:1", "--tcp-keepalive", "500ms"],
            "--tcp-keepalive \"500ms\": whole seconds from 1s to 32767s",
        ),
        (
            vec!["--backend", "n=http://x:1", "--tcp-keepalive", "1.5s"],
            "whole seconds from 1s to 32767s",
        ),
        (
            vec!["--backend", "n=http://x:1", "--tcp-keepalive", "32768"],
            "whole seconds from 1s to 32767s",
        ),
        (
            vec!["--backend", "n=http://x:1", "--client-tcp-keepalive", "off"],
            "--client-tcp-keepalive \"off\": expected a duration",
        ),
        (
            vec!["--backend", "n=http://x:1", "--client-tcp-keepalive", "2.5s"],
            "--client-tcp-keepalive \"2.5s\": whole seconds from 1s to 32767s",
        ),
        (
            vec!["--backend", "n=http://x:1", "--client-tcp-keepalive=10h"],
            "--client-tcp-keepalive \"10h\": whole seconds from 1s to 32767s",
        ),
        (
            vec!["--backend", "n=http://x:1", "--probe-timeout", "0"],
            "--probe-timeout must be more than 0",
        ),
        (
            vec!["--backend", "n=http://x:1", "--body-limit", "0"],
            "--body-limit must be more than 0",
        ),
        (vec!["--backend", "n=http://user:secret@x:1"], "user info"),
        (
            vec!["--backend", "n=http://x:1,slots=2,slots=3"],
            "slots= is given twice",
        ),
        (
            vec!["--backend", "n=http://x:1,model="],
            "model= needs the name",
        ),
        (vec!["--backend", "n=http://x:1,id="], "id= needs a name"),
        (vec!["--backend", "n=http://x:1,id= gpu0"], "spaces around it"),
        (
            vec!["--backend", "n=http://x:1,model= qwen"],
            "spaces around it",
        ),
        (
            vec!["--backend-dns", "llm.internal:8080,id=gpu0"],
            "unknown option \"id=gpu0\" (expected NAME:PORT[,slots=N][,cache=TOKENS][,context=TOKENS][,request-context=TOKENS][,model=NAME][,assign-slots])",
        ),
        (
            vec!["--backend-dns", "llm.internal:8080,assign-slots,assign-slots"],
            "assign-slots is given twice",
        ),
        (
            vec!["--backend", "n=http://x:1,assign-slots,assign-slots"],
            "assign-slots is given twice",
        ),
        (
            vec!["--backend", "n=http://x:1,assign-slots=yes"],
            "unknown option \"assign-slots=yes\"",
        ),
        (
            vec!["--backend-dns", "llm.internal:8080,slots=0"],
            "slots must be at least 1",
        ),
        (
            vec!["--backend-dns", "llm.internal:8080,slots=many"],
            "slots must be a number",
        ),
        (
            vec!["--backend-dns", "llm.internal:8080,cache=8GiB"],
            "number of tokens",
        ),
        (
            vec!["--backend-dns", "llm.internal:8080,context=0"],
            "context must be at least 1 token",
        ),
        (
            vec!["--backend-dns", "llm.internal:8080,context=1k,context=2k"],
            "context= is given twice",
        ),
        (
            vec!["--backend-dns", "llm.internal:8080,model="],
            "model= needs the name",
        ),
        (
            vec!["--backend-dns", "llm.internal:8080,model=a,model=b"],
            "model= is given twice",
        ),
        (
            vec![
                "--backend-dns",
                "llm.internal:8080,model=a",
                "--backend-dns",
                "llm.internal:8080,model=a",
            ],
            "given twice for the same model",
        ),
    ] {
        let err = cli::parse(args.clone()).unwrap_err();
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    assert!(matches!(cli::parse(["--help"]), Ok(cli::Command::Help)));
}

/// `--tcp-keepalive` reaches the backends' connections, as the system sees them: probed after
/// that long without a byte, then every third of it, three probes; `0` turns keepalive off;
/// left out, the client's default of 30 s. A host that vanished (no FIN, no RST) is found
/// only so.
#[tokio::test]
async fn tcp_keepalive_sets_the_backend_connections_keepalive() {
    use tower::ServiceExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let keepalive = |given: &[&str]| {
        let mut args = vec!["--backend".to_string(), format!("n={url}")];
        args.extend(given.iter().map(|s| s.to_string()));
        let cli::Command::Run(run) = cli::parse(args).unwrap() else {
            panic!("not a run");
        };
        let backend = run.config.http().build(&url).unwrap();
        async move {
            let connect = backend
                .connector()
                .clone()
                .oneshot(backend.base_uri().clone());
            let io = tokio::time::timeout(DEADLINE, connect)
                .await
                .expect("no connection in time")
                .unwrap();
            let socket = socket2::SockRef::from(io.inner());
            socket.keepalive().unwrap().then(|| {
                (
                    socket.tcp_keepalive_time().unwrap(),
                    socket.tcp_keepalive_interval().unwrap(),
                    socket.tcp_keepalive_retries().unwrap(),
                )
            })
        }
    };
    let secs = Duration::from_secs;
    assert_eq!(keepalive(&[]).await, Some((secs(30), secs(10), 3)));
    assert_eq!(
        keepalive(&["--tcp-keepalive", "1.5m"]).await,
        Some((secs(90), secs(30), 3))
    );
    assert_eq!(
        keepalive(&["--tcp-keepalive=32767"]).await,
        Some((secs(32767), secs(10922), 3))
    );
    assert_eq!(keepalive(&["--tcp-keepalive", "0"]).await, None);
    drop(listener);
}

/// `--client-tcp-keepalive` reaches the connections the proxy accepts, as the system sees
/// them: `TCP_NODELAY`, and probed after that long without a byte, then every third of it,
/// three probes, and on Linux bytes left unacknowledged as long as the probes take closing
/// it too (`TCP_USER_TIMEOUT`); `0` turns keepalive off; left out, 30 s, as on backend
/// connections. A client whose host vanished (no FIN, no RST) while its request waits on a
/// long prompt's reading is found only so: the connection closed, the request and its slot
/// go with it (see `a_client_that_goes_away_releases_its_slot` in tests/chaos). Read on a
/// loopback connection accepted by `app::accept`, which the proxy's accept loop takes each
/// connection from.
#[tokio::test]
async fn client_tcp_keepalive_sets_the_accepted_connections_keepalive() {
    let accepted = |given: &[&str]| {
        let mut args = vec!["--backend", "n=http://127.0.0.1:1"];
        args.extend_from_slice(given);
        let cli::Command::Run(run) = cli::parse(args).unwrap() else {
            panic!("not a run");
        };
        let keepalive = run.config.client_tcp_keepalive;
        async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let both = async {
                tokio::join!(
                    app::accept(&listener, keepalive),
                    tokio::net::TcpStream::connect(addr)
                )
            };
            let (stream, client) = tokio::time::timeout(DEADLINE, both)
                .await
                .expect("no connection in time");
            let (stream, _client) = (stream.unwrap(), client.unwrap());
            let socket = socket2::SockRef::from(&stream);
            assert!(socket.tcp_nodelay().unwrap(), "TCP_NODELAY");
            let probed = socket.keepalive().unwrap().then(|| {
                (
                    socket.tcp_keepalive_time().unwrap(),
                    socket.tcp_keepalive_interval().unwrap(),
                    socket.tcp_keepalive_retries().unwrap(),
                )
            });
            #[cfg(target_os = "linux")]
            assert_eq!(
                socket.tcp_user_timeout().unwrap(),
                probed.map(|(time, interval, probes)| time + interval * probes),
                "TCP_USER_TIMEOUT"
            );
            probed
        }
    };
    let secs = Duration::from_secs;
    assert_eq!(accepted(&[]).await, Some((secs(30), secs(10), 3)));
    assert_eq!(
        accepted(&["--client-tcp-keepalive", "1.5m"]).await,
        Some((secs(90), secs(30), 3))
    );
    assert_eq!(
        accepted(&["--client-tcp-keepalive=1"]).await,
        Some((secs(1), secs(1), 3))
    );
    assert_eq!(
        accepted(&["--client-tcp-keepalive=32767"]).await,
        Some((secs(32767), secs(10922), 3))
    );
    assert_eq!(accepted(&["--client-tcp-keepalive", "0"]).await, None);
    // Each side's own: the backends' keepalive off leaves the clients' on, and the other way.
    assert_eq!(
        accepted(&["--tcp-keepalive", "0"]).await,
        Some((secs(30), secs(10), 3))
    );
}

/// A client connection that fails while its request waits on a long prompt's reading, no
/// byte going either way (here reset; a vanished host's keepalive fails it alike, with a
/// timeout where this has a reset), ends its request: the backend's connection is closed,
/// which stops llama-server's work on it, and the slot is free. A failed read, not only a
/// closed one (`chaos::a_client_that_goes_away_releases_its_slot`), is a client gone.
#[tokio::test]
async fn a_client_connection_failing_while_its_prompt_is_read_ends_the_backend_call() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    for mode in [UpstreamMode::Pooled, UpstreamMode::PerClient] {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (got, got_request) = oneshot::channel();
        let (ended, backend_closed) = oneshot::channel();
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut seen = Vec::new();
            let mut buf = [0u8; 4096];
            let mut got = Some(got);
            // Reads the prompt and never answers, until the proxy closes the connection.
            loop {
                match stream.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => seen.extend_from_slice(&buf[..n]),
                }
                if seen.windows(4).any(|w| w == b"\r\n\r\n") {
                    if let Some(got) = got.take() {
                        let _ = got.send(());
                    }
                }
            }
            let _ = ended.send(());
        });
        let spec = format!("node-a=http://{addr},slots=1,id=a");
        let proxy = start(upstream(config_of(&[spec]), mode)).await;
        let body = Conversation::new("vanishing").next(json!({"stream": true}));
        let body = body.to_string();
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: proxy\r\n\
             content-type: application/json\r\nx-session-id: vanishing\r\n\
             content-length: {}\r\n\r\n",
            body.len()
        );
        let mut client = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
        client.write_all(head.as_bytes()).await.unwrap();
        client.write_all(body.as_bytes()).await.unwrap();
        tokio::time::timeout(DEADLINE, got_request)
            .await
            .expect("the request did not reach the backend")
            .unwrap();
        assert_eq!(proxy.status("a").in_flight, 1, "{mode:?}");
        // A reset, not the close a client that leaves sends.
        #[allow(deprecated)]
        client.set_linger(Some(Duration::ZERO)).unwrap();
        drop(client);
        tokio::time::timeout(DEADLINE, backend_closed)
            .await
            .unwrap_or_else(|_| panic!("{mode:?}: the backend call went on"))
            .unwrap();
        assert_eq!(proxy.status("a").in_flight, 0, "{mode:?}: the slot is held");
    }
}

/// `--redis-timeout 0` is refused, as `--probe-timeout 0` is: where the other timeouts' 0
/// turns them off, a store read that may not wait gets no answer, so the store went down at
/// its first read and again at each check after a recovery, its homes unread.
#[test]
fn a_redis_timeout_of_zero_is_refused() {
    let args = |timeout: &'static str| {
        [
            "--backend",
            "n=http://127.0.0.1:8081",
            "--redis",
            "redis://127.0.0.1:6379",
            "--redis-timeout",
            timeout,
        ]
    };
    let err = cli::parse(args("0")).map(|_| ()).unwrap_err();
    assert!(err.contains("--redis-timeout must be more than 0"), "{err}");
    let cli::Command::Run(run) = cli::parse(args("1ms")).unwrap() else {
        panic!("not a run");
    };
    assert_eq!(run.config.redis_timeout, Duration::from_millis(1));
}

/// `TOKIO_WORKER_THREADS`, which `--help` names, is read as `--worker-threads` is: a value
/// that is no count of threads is a command-line error, where tokio would panic on it.
/// `--worker-threads` wins, the variable then unread, as tokio has it.
#[test]
fn a_bad_tokio_worker_threads_is_an_error_not_a_panic() {
    use std::ffi::OsStr;
    let three = std::num::NonZeroUsize::new(3);
    for bad in ["abc", "0", "-1", "", " 2", "1.5"] {
        let err = cli::worker_threads(None, Some(OsStr::new(bad))).unwrap_err();
        assert!(err.contains("TOKIO_WORKER_THREADS"), "{bad:?}: {err}");
        assert!(err.contains("at least 1"), "{bad:?}: {err}");
    }
    assert_eq!(cli::worker_threads(None, Some(OsStr::new("3"))), Ok(three));
    assert_eq!(cli::worker_threads(None, None), Ok(None));
    assert_eq!(
        cli::worker_threads(three, Some(OsStr::new("abc"))),
        Ok(three)
    );
}

/// A `--backend` whose URL is the proxy's own listening address is refused: the proxy would
/// send each request, and each probe, to itself, and say only that the backend did not
/// answer. Left out, `--listen` is `127.0.0.1:8080`, the port a llama-server takes by default.
#[test]
fn a_backend_at_the_proxys_own_listen_address_is_refused() {
    let parse = |listen: Option<&str>, url: &str| {
        let mut args = vec!["--backend".to_string(), format!("n={url}")];
        if let Some(listen) = listen {
            args.push(format!("--listen={listen}"));
        }
        cli::parse(args).map(|_| ())
    };
    for (listen, url) in [
        (None, "http://127.0.0.1:8080"),
        (None, "http://LOCALHOST:8080"),
        (Some("127.0.0.1:80"), "http://127.0.0.1"),
        (Some("0.0.0.0:9000"), "http://127.0.0.1:9000"),
        (Some("0.0.0.0:9000"), "http://localhost:9000"),
        (Some("[::]:9000"), "http://[::1]:9000"),
        (Some("[::1]:9000"), "http://[0:0::1]:9000"),
        (Some("10.0.0.5:9000"), "http://10.0.0.5:9000"),
    ] {
        let err = parse(listen, url).unwrap_err();
        let listen = listen.unwrap_or("127.0.0.1:8080");
        assert!(err.contains(&format!("--backend n={url}")), "{err}");
        assert!(err.contains(&format!("(--listen {listen})")), "{err}");
        assert!(err.contains("would send each request to itself"), "{err}");
    }
    for (listen, url) in [
        (None, "http://127.0.0.1:8081"),
        (Some("127.0.0.1:9000"), "http://127.0.0.2:9000"),
        (Some("0.0.0.0:9000"), "http://[::1]:9000"),
        (Some("0.0.0.0:9000"), "http://gpu-a:9000"),
        (Some("127.0.0.1:0"), "http://127.0.0.1:8080"),
    ] {
        assert_eq!(parse(listen, url), Ok(()), "{url} on {listen:?}");
    }
}

/// A `--backend` at the proxy's own IPv4 address written as IPv6 (`[::ffff:127.0.0.1]`) is
/// refused as the address itself is: a connection to it reaches the proxy over IPv4.
#[test]
fn a_backend_at_the_listen_address_written_as_ipv4_mapped_ipv6_is_refused() {
    let parse = |listen: &str, url: &str| {
        cli::parse(["--backend", &format!("n={url}"), "--listen", listen]).map(|_| ())
    };
    for (listen, url) in [
        ("127.0.0.1:9000", "http://[::ffff:127.0.0.1]:9000"),
        ("0.0.0.0:9000", "http://[::ffff:127.0.0.1]:9000"),
        ("0.0.0.0:9000", "http://[::ffff:0.0.0.0]:9000"),
        ("10.0.0.5:9000", "http://[::ffff:a00:5]:9000"),
    ] {
        let err = parse(listen, url).unwrap_err();
        assert!(
            err.contains("would send each request to itself"),
            "{url}: {err}"
        );
    }
    for (listen, url) in [
        ("127.0.0.1:9000", "http://[::ffff:127.0.0.2]:9000"),
        ("127.0.0.1:9000", "http://[::ffff:127.0.0.1]:9001"),
        ("[::1]:9000", "http://[::ffff:127.0.0.1]:9000"),
    ] {
        assert_eq!(parse(listen, url), Ok(()), "{url} on {listen}");
    }
}

/// A `--backend` on IPv4 loopback at the port of a `--listen [::]` socket that takes IPv4
/// connections too (a dual-stack socket, the default on Linux) is refused once the socket is
/// bound: the proxy would send each request to itself.
#[tokio::test]
async fn a_backend_on_ipv4_loopback_is_refused_where_a_listen_on_ipv6_any_takes_ipv4_too() {
    let Ok(listener) = tokio::net::TcpListener::bind("[::]:0").await else {
        // No IPv6 here.
        return;
    };
    let port = listener.local_addr().unwrap().port();
    let given: SocketAddr = "[::]:0".parse().unwrap();
    let refused = |url: String| {
        let spec = cli::backend(&format!("n={url}")).unwrap().0;
        cli::refuse_own_listener(&listener, given, &[spec])
    };
    // What the socket does: with IPv6 only (`net.ipv6.bindv6only`), no loop, and no refusal.
    let takes_ipv4 = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_ok();
    if std::fs::read_to_string("/proc/sys/net/ipv6/bindv6only").is_ok_and(|v| v.trim() == "0") {
        assert!(takes_ipv4, "a dual-stack socket on [::] takes 127.0.0.1");
    }
    for url in [
        format!("http://127.0.0.1:{port}"),
        format!("http://127.0.0.2:{port}"),
        format!("http://0.0.0.0:{port}"),
        format!("http://[::1]:{port}"),
    ] {
        let ipv4 = !url.contains('[');
        match refused(url.clone()) {
            Err(e) => {
                assert!(takes_ipv4 || !ipv4, "{url}: {e}");
                assert!(e.contains(&format!("--backend n={url}")), "{e}");
                assert!(e.contains("(--listen [::]:0)"), "{e}");
                assert!(e.contains("would send each request to itself"), "{e}");
            }
            Ok(()) => assert!(!takes_ipv4 && ipv4, "{url} is refused"),
        }
    }
    // Another port, or an address that is not this host's, is another server.
    let other = if port == u16::MAX { port - 1 } else { port + 1 };
    for url in [
        format!("http://127.0.0.1:{other}"),
        format!("http://10.0.0.5:{port}"),
    ] {
        assert_eq!(refused(url.clone()), Ok(()), "{url}");
    }
}

/// A number past what its option holds (`slots=99999999999`, extra zeros) is refused with the
/// option and the most it takes, not as a value that is no number at all.
#[test]
fn a_number_past_its_options_range_is_refused_with_the_range() {
    let u32_max = format!("at most {}", u32::MAX);
    let u64_max = format!("at most {}", u64::MAX);
    let usize_max = format!("at most {}", usize::MAX);
    let past = |n: u128| (n + 1).to_string();
    let cases = [
        (
            vec!["--backend", "n=http://x:1,slots=99999999999"],
            "slots must be a number from 1 to 4294967295".to_string(),
        ),
        (
            vec!["--backend", "n=http://x:1,cache=99999999999999999999"],
            u64_max.clone(),
        ),
        (
            vec![
                "--backend-dns",
                "llm.internal:8080,context=18014398509481984k",
            ],
            u64_max.clone(),
        ),
    ];
    for (args, needle) in cases {
        let err = cli::parse(args.clone()).map(|_| ()).unwrap_err();
        assert!(
            err.contains(args[0]) && err.contains(&needle),
            "{args:?}: {err}"
        );
    }
    for (flag, value, needle) in [
        ("--probe-failures", past(u32::MAX.into()), &u32_max),
        ("--probe-successes", past(u32::MAX.into()), &u32_max),
        ("--replicas", past(u32::MAX.into()), &u32_max),
        ("--max-queued", past(usize::MAX as u128), &usize_max),
        ("--body-limit", past(usize::MAX as u128), &usize_max),
        ("--body-limit", "17179869184GiB".to_string(), &usize_max),
    ] {
        let args = ["--backend", "n=http://x:1", flag, value.as_str()];
        let err = cli::parse(args).map(|_| ()).unwrap_err();
        assert!(
            err.contains(&format!("{flag} {value:?}")) && err.contains(needle.as_str()),
            "{args:?}: {err}"
        );
    }
}

/// A duration that is negative or longer than a `Duration` holds is refused saying which, not
/// as a value that is no duration at all.
#[test]
fn a_negative_or_too_long_duration_says_which() {
    for (value, reason) in [
        ("-1s", "cannot be negative".to_string()),
        ("-0.5m", "cannot be negative".to_string()),
        ("1e30", "expected a duration".to_string()),
        (
            "100000000000000000000",
            format!("too long, at most {}s", u64::MAX),
        ),
        (
            "9999999999999999h",
            format!("too long, at most {}s", u64::MAX),
        ),
    ] {
        let args = ["--backend", "n=http://x:1", "--max-wait", value];
        let err = cli::parse(args).map(|_| ()).unwrap_err();
        assert!(err.contains(&format!("--max-wait {value:?}: ")), "{err}");
        assert!(err.contains(&reason), "{value}: {err}");
    }
}

/// `--worker-threads` and `TOKIO_WORKER_THREADS` are held to `cli::MOST_WORKER_THREADS`: tokio
/// starts every worker thread when its runtime is built, and a count far past the CPUs (a
/// typo, `80000` for `8`) failed there with an allocation that aborted, an overflow that
/// panicked, or a thread that could not be spawned.
#[test]
fn more_worker_threads_than_the_bound_are_refused() {
    use std::ffi::OsStr;
    let most = cli::MOST_WORKER_THREADS;
    let parsed = |n: &str| {
        cli::parse(["--backend", "n=http://x:1", "--worker-threads", n]).map(|run| match run {
            cli::Command::Run(run) => run.worker_threads.map(|n| n.get()),
            cli::Command::Help => panic!("not a run"),
        })
    };
    assert_eq!(parsed(&most.to_string()), Ok(Some(most)));
    let env = |n: &str| cli::worker_threads(None, Some(OsStr::new(n)));
    assert_eq!(env(&most.to_string()).unwrap().map(|n| n.get()), Some(most));
    let bound = format!("at most {most}");
    for n in [
        (most + 1).to_string(),
        "99999999999".into(),
        usize::MAX.to_string(),
    ] {
        let err = parsed(&n).unwrap_err();
        assert!(err.contains(&format!("--worker-threads {n:?}")), "{err}");
        assert!(err.contains(&bound), "{n}: {err}");
        let err = env(&n).unwrap_err();
        assert!(
            err.contains(&format!("TOKIO_WORKER_THREADS={n:?}")),
            "{err}"
        );
        assert!(err.contains(&bound), "{n}: {err}");
    }
    assert!(cli::USAGE.contains(&format!("tokio worker threads, {bound}")));
}

/// An argument that is not UTF-8 (a file name in another encoding, bytes from a script) is a
/// command-line error that says which argument it is, wherever it comes: a flag, a value, a
/// value given with `=`. The proxy reads its arguments with `std::env::args_os`, as
/// `std::env::args` panics on such an argument.
#[test]
fn an_argument_that_is_not_utf8_is_an_error_not_a_panic() {
    use std::ffi::OsString;
    use std::os::unix::ffi::OsStringExt;
    let bad = |text: &str| {
        let mut bytes = text.as_bytes().to_vec();
        bytes.push(0xff);
        OsString::from_vec(bytes)
    };
    let cases = [
        (vec!["--backend".into(), bad("n=http://x:1")], 2),
        (
            vec![bad("--verbose"), "--backend".into(), "n=http://x:1".into()],
            1,
        ),
        (
            vec![
                "--backend".into(),
                "n=http://x:1".into(),
                bad("--listen=127.0.0.1:"),
            ],
            3,
        ),
    ];
    for (args, position) in cases {
        let shown = format!("{:?}", args[position - 1]);
        let err = cli::parse(args).map(|_| ()).unwrap_err();
        assert!(
            err.contains(&format!("argument {position} ({shown})")),
            "{shown}: {err}"
        );
        assert!(err.contains("not UTF-8"), "{err}");
    }
    let main = include_str!("../../examples/proxy/main.rs");
    assert!(main.contains("cli::parse(std::env::args_os()"));
}

/// The proxy's log goes on when its stderr is a pipe whose reader has gone (`proxy 2>&1 |
/// tee log`, `tee` stopped): the line is lost, the proxy is not. The test runs itself again
/// with stderr such a pipe, and the run logs there.
#[test]
fn a_log_whose_reader_has_gone_loses_the_line_not_the_proxy() {
    const CHILD: &str = "TOWER_AFFINITY_TEST_LOG_TO_A_CLOSED_PIPE";
    const NAME: &str = "a_log_whose_reader_has_gone_loses_the_line_not_the_proxy";
    if std::env::var_os(CHILD).is_some() {
        let logs = app::logs(tracing::Level::INFO).finish();
        tracing::subscriber::with_default(logs, || {
            tracing::info!(backend = "gpu-0", "backend up");
            tracing::warn!("and a second line");
        });
        return;
    }
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args([NAME, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(writer)
        .status()
        .unwrap();
    assert!(
        status.success(),
        "logging to a pipe whose reader has gone ended the run: {status}"
    );
}

/// A switch takes no value: `--ask-stream-usage=false` is refused, not read as the switch.
#[test]
fn a_switch_given_a_value_is_refused() {
    for switch in [
        "--ask-stream-usage",
        "--no-slots-probe",
        "--no-resend-on-close",
        "--verbose",
        "--help",
    ] {
        for value in ["false", "0", ""] {
            let arg = format!("{switch}={value}");
            let err = cli::parse(["--backend", "n=http://127.0.0.1:8081", arg.as_str()])
                .map(|_| ())
                .expect_err(&arg);
            assert!(err.contains("takes no value"), "{arg}: {err}");
            assert!(err.contains(switch), "{arg}: {err}");
        }
    }
    // Given bare, each is the switch it always was.
    let cli::Command::Run(run) = cli::parse([
        "--backend",
        "n=http://127.0.0.1:8081",
        "--ask-stream-usage",
        "--no-slots-probe",
        "--no-decision-headers",
        "--no-resend-on-close",
    ])
    .unwrap() else {
        panic!("not a run");
    };
    assert!(run.config.ask_stream_usage && !run.config.probe_slots);
    assert!(!run.config.decision_headers);
    assert!(format!("{:?}", run.config.http()).contains("resend_on_close: false"));
}

// === what the docs say of the command line and of /metrics ===

/// The flags `--help` lists: the first words of its option lines (`  -v, --verbose  ...`).
fn help_flags() -> Vec<String> {
    let mut flags: Vec<String> = cli::USAGE
        .lines()
        .filter(|line| line.starts_with("  -"))
        .flat_map(|line| {
            line.split_whitespace()
                .map(|word| word.trim_end_matches(','))
                .take_while(|word| word.starts_with('-'))
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect();
    flags.sort();
    flags
}

/// The flags the parser matches on: the `"-..."` patterns of `cli::parse`'s arms.
fn parsed_flags() -> Vec<String> {
    let source = include_str!("../../examples/proxy/cli.rs");
    let start = source.find("pub(crate) fn parse").expect("cli::parse");
    let end = start
        + source[start..]
            .find("\nfn ")
            .expect("the function after parse");
    let mut flags: Vec<String> = source[start..end]
        .split('"')
        .skip(1)
        .step_by(2)
        .filter(|s| {
            let name = s.trim_start_matches('-');
            (s.starts_with("--") || s.len() == 2 && s.starts_with('-'))
                && !name.is_empty()
                && name.chars().all(|c| c.is_ascii_lowercase() || c == '-')
        })
        .map(str::to_string)
        .collect();
    flags.sort();
    flags.dedup();
    flags
}

/// The flags the README's table under "Running it as a proxy" lists, from its rows' first
/// cells (`` | `--overflow O`, `--max-wait D` | ``).
fn readme_flags() -> Vec<String> {
    let readme = include_str!("../../README.md");
    let start = readme
        .find("| flag | meaning (default) |")
        .expect("the README's table of flags");
    let mut flags: Vec<String> = readme[start..]
        .lines()
        .skip(2)
        .take_while(|line| line.starts_with('|'))
        .flat_map(|line| {
            let first = line.split(" | ").next().unwrap_or_default();
            first
                .split('`')
                .skip(1)
                .step_by(2)
                .filter_map(|code| code.split_whitespace().next())
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect();
    flags.sort();
    flags
}

/// `--help` lists every flag the parser takes and no other, each one it lists is taken, and
/// the README's table lists the same (`--help` itself aside).
#[test]
fn help_the_parser_and_the_readme_name_the_same_flags() {
    let help = help_flags();
    assert!(help.len() > 20, "{help:?}");
    assert_eq!(help, parsed_flags(), "--help against cli::parse");
    for flag in &help {
        let err = cli::parse([flag.as_str()]).map(|_| ()).err();
        assert!(
            !err.as_deref()
                .unwrap_or_default()
                .contains("unknown argument"),
            "{flag}: {err:?}"
        );
    }
    let without_help: Vec<_> = (help.iter())
        .filter(|f| !matches!(f.as_str(), "-h" | "--help"))
        .cloned()
        .collect();
    assert_eq!(readme_flags(), without_help, "README.md against --help");
}

/// Every default `--help` and the README's table state is the parser's: each phrase is in
/// both texts (whitespace aside), and the option left out has that value.
#[test]
fn the_defaults_help_and_the_readme_state_are_the_parsers() {
    let flat = |text: &str| text.split_whitespace().collect::<Vec<_>>().join(" ");
    let help = flat(cli::USAGE);
    let readme = include_str!("../../README.md");
    let start = readme.find("| flag | meaning (default) |").unwrap();
    let end = start + readme[start..].find("\n\n").unwrap();
    let table = flat(&readme[start..end]);
    let cli::Command::Run(run) = cli::parse(["--backend", "n=http://127.0.0.1:8081"]).unwrap()
    else {
        panic!("not a run");
    };
    let c = &run.config;
    let secs = Duration::from_secs;
    let defaults: [(&str, &str, bool); 23] = [
        (
            "(default 127.0.0.1:8080)",
            "(`127.0.0.1:8080`)",
            run.listen == SocketAddr::from(([127, 0, 0, 1], 8080)),
        ),
        (
            "(k = 1024; default 128k)",
            "(131,072 when left out)",
            c.cache_tokens("127.0.0.1:8081") == 128 * 1024,
        ),
        (
            "(default 0s: gone",
            "(0s: gone at once)",
            c.dns_removal_grace.is_zero(),
        ),
        (
            "(default 5ms; more than 0)",
            "(5 ms; more than 0)",
            c.redis_timeout == Duration::from_millis(5),
        ),
        (
            "cache (default 1)",
            "spreads turns evenly (1)",
            c.replicas.get() == 1,
        ),
        (
            "node-then-backend (default)",
            "(`node-then-backend`)",
            c.policy.name() == "node-then-backend",
        ),
        (
            "(default 5m; 0: every",
            "(`5m`; `0` counts every",
            c.live_window == secs(300),
        ),
        (
            "wait (default) | overcommit | reject",
            "`wait` up to `D`",
            matches!(c.overflow, Overflow::Wait { .. }),
        ),
        (
            "with --overflow wait (default 60s)",
            "(60 s, at most",
            matches!(c.overflow, Overflow::Wait { max_wait, .. } if max_wait == secs(60)),
        ),
        (
            "(default 1024; 0: none wait",
            "`N` = 1024 waiting)",
            matches!(
                c.overflow,
                Overflow::Wait {
                    max_queued: 1024,
                    ..
                }
            ),
        ),
        (
            "connect timeout (default 2s; 0 turns it off)",
            "connect timeout (2 s; `0` turns it off)",
            c.connect_timeout == Some(secs(2)),
        ),
        (
            "(default 10m; 0 turns it off)",
            "(10 min; `0` turns it off)",
            c.response_timeout == Some(secs(600)),
        ),
        (
            "fails its requests (default 30s; 0 turns it off;",
            "instead of holding their slots (30 s; `0` turns it off;",
            c.tcp_keepalive == Some(secs(30)),
        ),
        (
            "its slot freed (default 30s; 0 turns it off;",
            "and its backend slot freed (30 s; `0` turns it off;",
            c.client_tcp_keepalive == Some(secs(30)),
        ),
        (
            "is passed over (default 5s)",
            "is passed over (5 s)",
            c.failure_cooldown == secs(5),
        ),
        (
            "0 turns the probe off (default 2s)",
            "(every 2 s; `0` turns it off)",
            c.probe_interval == Some(secs(2)),
        ),
        (
            "takes, /slots included (default 2s)",
            "together (2 s; more than 0)",
            c.probe_timeout == secs(2),
        ),
        (
            "others; none by default)",
            "repeated for others (none)",
            c.probe_headers.is_empty(),
        ),
        (
            "take a backend down (default 1;",
            "take a backend down (1;",
            c.probe_failures == 1,
        ),
        (
            "bring it up again (default 1)",
            "bring it up again (1)",
            c.probe_successes == 1,
        ),
        (
            "e.g. 16MiB (default)",
            "(16 MiB, then 413)",
            c.body_limit == 16 << 20,
        ),
        (
            "(default 60s; 0 turns it off); slower is 408",
            "(60 s, then 408; `0` turns it off)",
            c.read_timeout == Some(secs(60)),
        ),
        (
            "HTTP/2 ping's answer (default 30s; 0 turns it off)",
            "send a request's headers (30 s; `0` turns it off)",
            c.header_timeout == Some(secs(30)),
        ),
    ];
    for (in_help, in_readme, holds) in defaults {
        assert!(help.contains(in_help), "--help: {in_help:?}");
        assert!(table.contains(in_readme), "README.md: {in_readme:?}");
        assert!(holds, "{in_help:?} is not the default");
    }
    assert!(help.contains("pooled (default)") && table.contains("(`pooled`)"));
    assert_eq!(c.upstream, UpstreamMode::Pooled);
    // Switches: the decision headers on, the rest off.
    assert!(c.decision_headers && c.probe_slots && !c.ask_stream_usage && !run.verbose);
    assert_eq!(run.worker_threads, None);
}

/// The session keys `--help` names are the proxy's: the default headers, then the default
/// body fields, in the order they are tried.
#[test]
fn the_session_keys_help_names_are_the_ones_read_in_their_order() {
    use tower_affinity::key::{BodyKeyLayer, HeaderKey};
    let help = cli::USAGE.split_whitespace().collect::<Vec<_>>().join(" ");
    let start = help
        .find("Session keys: the headers ")
        .expect("the keys in --help");
    let listed = help[start..]
        .split_once(": the headers ")
        .and_then(|(_, rest)| rest.split_once(". "))
        .map(|(keys, _)| keys)
        .unwrap();
    let (headers, fields) = listed.split_once(", then the JSON body's ").unwrap();
    let headers: Vec<String> = headers.split(", ").map(str::to_ascii_lowercase).collect();
    assert_eq!(headers, HeaderKey::DEFAULT_NAMES, "{listed}");
    let fields: Vec<&str> = fields.split(", ").collect();
    assert_eq!(fields, BodyKeyLayer::DEFAULT_FIELDS, "{listed}");
}

/// The metric names `passage` gives, braces expanded and labels left out:
/// `` `tower_affinity_{a,b}_total{outcome}` `` is `tower_affinity_a_total` and
/// `tower_affinity_b_total`.
fn named_metrics(passage: &str) -> Vec<String> {
    fn expand(name: &str) -> Vec<String> {
        let Some(open) = name.find('{') else {
            return vec![name.to_string()];
        };
        let close = open + name[open..].find('}').expect("a closing brace");
        let (head, tail) = (&name[..open], &name[close + 1..]);
        let inner = &name[open + 1..close];
        if !inner.contains(',') && tail.is_empty() {
            // Labels.
            return vec![head.to_string()];
        }
        inner
            .split(',')
            .flat_map(|alt| expand(&format!("{head}{alt}{tail}")))
            .collect()
    }
    let mut names: Vec<String> = passage
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|code| code.starts_with("tower_affinity_"))
        .flat_map(expand)
        .collect();
    names.sort();
    names.dedup();
    names
}

/// The series names a scrape holds, from its `# TYPE` lines (a counter's with its `_total`).
fn scraped_metrics(scrape: &str) -> Vec<String> {
    let mut names: Vec<String> = scrape
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .filter_map(|typed| Some(typed.split_once(' ')?.0.to_string()))
        .collect();
    names.sort();
    names
}

/// The README's "Metrics" under "Running it as a proxy" names every series `/metrics`
/// serves, and `/metrics` serves every one it names: those of a shared store and of a DNS
/// name with `--redis` and `--backend-dns` (of the store's counters, the README names some
/// and points at the rest).
#[tokio::test]
async fn the_readme_names_every_series_of_the_proxys_metrics() {
    let readme = include_str!("../../README.md");
    let start = readme
        .find("- **Metrics.** `GET /metrics`")
        .expect("the proxy's metrics in the README");
    let end = start
        + readme[start..]
            .find("- **Models.**")
            .expect("the next item");
    let named = named_metrics(&readme[start..end]);

    let a = Stub::start("a", 2).await;
    let dns = dns_server::Dns::start().await;
    // A port nothing listens on: the store is down, and its series are served all the same.
    let refusing = Refusing::new();
    let redis_port = refusing.addr.port();
    let proxy = start_args(vec![
        "--backend".into(),
        format!("node-a={},slots=2,id=a", a.url()),
        "--backend-dns".into(),
        "missing.fleet.test:8080".into(),
        "--dns-server".into(),
        dns.addr.to_string(),
        "--redis".into(),
        format!("redis://127.0.0.1:{redis_port}"),
        "--probe-interval".into(),
        "0".into(),
    ])
    .await;
    let scrape = String::from_utf8(proxy.get("/metrics").await.body.to_vec()).unwrap();
    let scraped = scraped_metrics(&scrape);
    let store = |name: &String| name.starts_with("tower_affinity_store_");
    let unnamed: Vec<_> = (scraped.iter())
        .filter(|s| !named.contains(s) && !store(s))
        .collect();
    let unserved: Vec<_> = named.iter().filter(|n| !scraped.contains(n)).collect();
    assert!(
        unnamed.is_empty() && unserved.is_empty(),
        "served but not in the README: {unnamed:?}\nin the README but not served: {unserved:?}\n{scrape}"
    );
    assert!(scraped.iter().any(store), "{scrape}");
}

#[test]
fn cache_budgets_are_tokens_plain_or_in_units_of_1024() {
    for (v, tokens) in [
        ("131072", 131_072),
        ("128k", 128 * 1024),
        ("128K", 128 * 1024),
        ("1", 1),
    ] {
        assert_eq!(cli::tokens("cache", v), Ok(tokens), "{v}");
    }
    for v in [
        "",
        "k",
        "0",
        "0k",
        "1.5k",
        "-1",
        "64 k",
        "64kb",
        "64M",
        "18446744073709551615k",
    ] {
        assert!(cli::tokens("cache", v).is_err(), "{v:?}");
    }
    let (spec, cache) = cli::backend("n=http://x:1,cache=2k,slots=3").unwrap();
    assert_eq!((spec.slots.map(|n| n.get()), cache), (Some(3), Some(2048)));
    let (_, cache) = cli::backend("n=http://x:1").unwrap();
    assert_eq!(cache, None);
    assert!(cli::USAGE.contains("[,cache=TOKENS]"));
}

#[test]
fn a_backends_context_is_tokens_as_its_cache_is() {
    let spec = cli::backend("n=http://x:1,context=128k").unwrap().0;
    assert_eq!(spec.context.map(|n| n.get()), Some(128 * 1024));
    assert_eq!(cli::backend("n=http://x:1").unwrap().0.context, None);
    for bad in [
        "context=0",
        "context=",
        "context=1.5k",
        "context=1,context=2",
    ] {
        let e = cli::backend(&format!("n=http://x:1,{bad}")).unwrap_err();
        assert!(e.contains("context"), "{bad}: {e}");
    }
    assert!(cli::USAGE.contains("[,context=TOKENS]"));
}

#[test]
fn a_backends_request_context_is_tokens_as_its_context_is() {
    let spec = cli::backend("n=http://x:1,request-context=16k").unwrap().0;
    assert_eq!(spec.request_context.map(|n| n.get()), Some(16 * 1024));
    assert_eq!(spec.context, None);
    assert_eq!(
        cli::backend("n=http://x:1").unwrap().0.request_context,
        None
    );
    for bad in [
        "request-context=0",
        "request-context=",
        "request-context=2x",
        "request-context=1,request-context=2",
    ] {
        let e = cli::backend(&format!("n=http://x:1,{bad}")).unwrap_err();
        assert!(e.contains("request-context"), "{bad}: {e}");
    }
    assert!(cli::USAGE.contains("[,request-context=TOKENS]"));
}

/// `context=` reaches the balancer: a backend's running requests are kept within it, by
/// their prompts' estimates. Two prompts of about 10,000 tokens each, counted as 20,000
/// before the backend's first answer teaches its tokens, do not fit in 32k together: the
/// second waits for the first, though the backend has slots free.
#[tokio::test]
async fn a_backends_context_option_limits_its_requests_in_flight_by_their_prompts() {
    let a = Stub::start("a", 4).await;
    let mut config = config(&[("node-a", &a)]);
    config.backends[0] = cli::backend(&format!("node-a={},slots=4,id=a,context=32k", a.url()))
        .unwrap()
        .0;
    let proxy = start(config).await;
    assert_eq!(proxy.status("a").context_limit, Some(32 * 1024));
    a.hold_streams();
    let streamed = |session: &str| {
        let text = format!("{session} ").repeat(40_000 / (session.len() + 1));
        let body = json!({"messages": [{"role": "user", "content": text}], "stream": true});
        Request::post(proxy.url("/v1/chat/completions"))
            .header("x-session-id", session)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .unwrap()
    };
    let second_req = streamed("two");
    let first = proxy.send(streamed("one")).await;
    assert_eq!(first.status(), 200);
    let held = proxy.status("a").context_in_flight;
    assert!((18_000..22_000).contains(&held), "{held}");
    // The second is not sent while the first runs.
    let proxy = Arc::new(proxy);
    let second = tokio::spawn({
        let proxy = proxy.clone();
        async move { proxy.send(second_req).await }
    });
    // Until the balancer holds it (a bounded wait for the event, not a fixed sleep).
    let holding = async {
        while proxy.proxy.affinity().stats().waiting == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(DEADLINE, holding)
        .await
        .expect("the second never waited");
    assert!(!second.is_finished());
    assert_eq!((proxy.status("a").in_flight, a.chats()), (1, 1));
    // The first ends: the second goes.
    a.release_streams();
    first.into_body().collect().await.unwrap();
    let second = tokio::time::timeout(DEADLINE, second)
        .await
        .expect("the second never went")
        .unwrap();
    assert_eq!(second.status(), 200);
    second.into_body().collect().await.unwrap();
    assert_eq!(a.chats(), 2);
    let status = proxy.status("a");
    assert_eq!((status.in_flight, status.context_in_flight), (0, 0));
}

#[tokio::test]
async fn two_backends_with_one_id_are_refused() {
    let spec = cli::backend("n=http://127.0.0.1:1").unwrap().0;
    let err = Proxy::new(Config::new(vec![spec.clone(), spec]))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("given twice"), "{err}");
    // On the command line, with its other errors (exit code 2, before anything runs).
    let err = cli::parse([
        "--backend",
        "n=http://127.0.0.1:1",
        "--backend",
        "m=http://127.0.0.1:1/",
    ])
    .map(|_| ())
    .unwrap_err();
    assert!(
        err.contains("--backend: backend id \"127.0.0.1:1\" is given twice"),
        "{err}"
    );
}

/// One server given under two names (`127.0.0.1` and `localhost`, which resolve alike here)
/// has two ids: the start warns, naming both its flags. Two ports of one host are two
/// servers, and a name that does not resolve now says nothing: it may come up later. (Not on
/// paused time: the names resolve on a thread of their own.)
#[tokio::test]
async fn one_server_given_under_two_names_is_warned_of() {
    let resolved: Vec<_> = tokio::net::lookup_host("localhost:1")
        .await
        .unwrap()
        .collect();
    assert!(
        resolved.contains(&"127.0.0.1:1".parse().unwrap()),
        "{resolved:?}"
    );
    let check = |urls: &[&str]| {
        let specs: Vec<_> = (urls.iter().enumerate())
            .map(|(i, url)| cli::backend(&format!("n{i}={url}")).unwrap().0)
            .collect();
        async move { app::one_server_each(&specs).await }
    };
    let err = check(&["http://127.0.0.1:8081", "http://localhost:8081"])
        .await
        .unwrap_err();
    assert!(
        err.starts_with("--backend \"n0=http://127.0.0.1:8081\" and --backend \"n1=http://localhost:8081\" are both at 127.0.0.1:8081: if they are one server, "),
        "{err}"
    );
    // Without its port, a URL's is 80.
    let err = check(&[
        "http://localhost",
        "http://10.0.0.7:80",
        "http://127.0.0.1:80",
    ])
    .await
    .unwrap_err();
    assert!(err.contains("both at 127.0.0.1:80"), "{err}");

    assert_eq!(
        check(&["http://127.0.0.1:8081", "http://localhost:8082"]).await,
        Ok(())
    );
    // A label longer than DNS's 63 bytes: a name no resolver answers, refused without asking
    // any nameserver.
    let nowhere = |host: &str| format!("http://{}.{host}:8081", "a".repeat(64));
    let (a, b) = (nowhere("a.test"), nowhere("b.test"));
    assert_eq!(check(&["http://127.0.0.1:8081", &a, &b]).await, Ok(()));
}

/// A TLS URL (`rediss://`, `valkeys://`) is refused in words an operator can act on: this
/// proxy has no TLS for Redis (the `redis` crate's own error speaks of "the feature", which
/// the proxy's command line cannot turn on); from the command line and from a configuration
/// built in code alike.
#[tokio::test]
async fn a_tls_redis_url_is_refused_as_one_this_proxy_cannot_reach() {
    for url in [
        "rediss://default:s3cret@redis.internal:6380",
        "valkeys://redis.internal:6380/1",
    ] {
        let parsed = cli::parse(["--backend", "n=http://127.0.0.1:1", "--redis", url]);
        let mut config = config_of(&["n=http://127.0.0.1:1".to_string()]);
        config.redis = Some(url.into());
        let started = Proxy::new(config).await.map(|_| ());
        for err in [
            parsed.map(|_| ()).unwrap_err(),
            started.unwrap_err().to_string(),
        ] {
            assert!(
                err.contains("this proxy is built without TLS for Redis"),
                "{url}: {err}"
            );
            assert!(!err.contains("the feature"), "{url}: {err}");
            assert!(!err.contains("s3cret"), "{url}: {err}");
        }
    }
}

/// A `--redis` URL the store cannot use is a command-line error (exit code 2, before anything
/// runs), not the proxy's failure once started; and no error shows its password, which a log
/// would keep.
#[tokio::test]
async fn a_redis_url_that_cannot_be_used_is_refused_without_its_password() {
    let redis =
        |url: &str| cli::parse(["--backend", "n=http://127.0.0.1:1", "--redis", url]).map(|_| ());
    for (url, shown) in [
        (
            "rediss://default:s3cret@redis.internal:6380",
            "\"rediss://***@redis.internal:6380\"",
        ),
        (
            "redis://:s3cret@127.0.0.1:6379/db",
            "\"redis://***@127.0.0.1:6379/db\"",
        ),
        ("redis://127.0.0.1:6379/db", "\"redis://127.0.0.1:6379/db\""),
    ] {
        let err = redis(url).unwrap_err();
        assert!(
            err.starts_with(&format!("--redis {shown}: ")),
            "{url}: {err}"
        );
        assert!(!err.contains("s3cret"), "{url}: {err}");
    }
    assert!(redis("redis://:s3cret@127.0.0.1:6379/2").is_ok());
    // A configuration built in code is checked when the proxy starts: the same words.
    let mut config = config_of(&["n=http://127.0.0.1:1".to_string()]);
    config.redis = Some("rediss://default:s3cret@redis.internal:6380".into());
    let err = Proxy::new(config).await.unwrap_err().to_string();
    assert!(
        err.starts_with("--redis \"rediss://***@redis.internal:6380\": "),
        "{err}"
    );
}

/// The password a Unix socket URL gives in its query (`?pass=`) is not shown either: not in a
/// refusal of the URL, nor where the log names the store.
#[test]
fn a_redis_url_s_password_in_its_query_is_not_shown() {
    let url = "unix:///run/redis.sock?db=x&pass=s3cret";
    let parsed = cli::parse(["--backend", "n=http://127.0.0.1:1", "--redis", url]);
    let err = parsed.map(|_| ()).unwrap_err();
    assert!(
        err.starts_with("--redis \"unix:///run/redis.sock?db=x&pass=***\": "),
        "{err}"
    );
    for (url, shown) in [
        (
            "redis+unix:///run/redis.sock?p%61ss=s3cret&db=1",
            "redis+unix:///run/redis.sock?p%61ss=***&db=1",
        ),
        (
            "redis://:s3cret@127.0.0.1:6379/0?pass=s3cret",
            "redis://***@127.0.0.1:6379/0?pass=***",
        ),
        (
            "redis://127.0.0.1:6379/0?protocol=resp3",
            "redis://127.0.0.1:6379/0?protocol=resp3",
        ),
        ("redis://127.0.0.1:6379", "redis://127.0.0.1:6379"),
    ] {
        assert_eq!(app::redis_url_shown(url), shown, "{url}");
    }
}

/// A backend's id is its URL's `host:port` written one way for each server: the port 80 when
/// the URL leaves it out, a host name in lower case, an address as `--backend-dns` names the
/// backend at it. So `http://gpu-a` and `http://gpu-a:80` are one backend, which is refused
/// twice as any other, and an address a name resolves to is that name's backend.
#[tokio::test]
async fn a_backend_given_with_or_without_its_default_port_is_one_backend() {
    for (url, id) in [
        ("http://gpu-a", "gpu-a:80"),
        ("http://gpu-a/", "gpu-a:80"),
        ("http://gpu-a:80", "gpu-a:80"),
        ("http://GPU-A:080", "gpu-a:80"),
        ("http://gpu-a:8081", "gpu-a:8081"),
        ("http://10.0.0.7", "10.0.0.7:80"),
        ("http://[::1]", "[::1]:80"),
        ("http://[FD00:0::7]:8080", "[fd00::7]:8080"),
    ] {
        let spec = cli::backend(&format!("n={url}")).unwrap().0;
        assert_eq!(spec.id, id, "{url}");
    }
    let address = "[fd00::7]:8080".parse::<SocketAddr>().unwrap();
    let named = tower_affinity::discover::dns::DnsEndpoint::new(address).id();
    assert_eq!(
        cli::backend("n=http://[FD00::0:7]:8080").unwrap().0.id,
        named.as_str()
    );
    // `id=` is kept as given.
    assert_eq!(cli::backend("n=http://x,id=GPU0").unwrap().0.id, "GPU0");

    let (bare, port) = (cli::backend("n=http://127.0.0.1"), "m=http://127.0.0.1:80");
    let specs = vec![bare.unwrap().0, cli::backend(port).unwrap().0];
    let err = Proxy::new(Config::new(specs)).await.unwrap_err();
    assert!(
        err.to_string().contains("\"127.0.0.1:80\" is given twice"),
        "{err}"
    );

    // A port that is none is refused with the other command-line errors, before anything runs.
    for url in ["http://x:0", "http://x:99999", "http://x:65536"] {
        let err = cli::parse(["--backend", &format!("n={url}")]).unwrap_err();
        assert!(
            err.contains("port must be a number from 1 to 65535"),
            "{url}: {err}"
        );
    }
}

/// A backend URL whose port is empty (`http://gpu-a:`, as `http://gpu-a:$PORT` reads with the
/// variable unset) is refused at the command line, not taken for port 80: that backend would
/// be another server, or none.
#[test]
fn a_backend_url_with_an_empty_port_is_refused_not_taken_for_port_80() {
    for url in [
        "http://gpu-a:",
        "http://gpu-a:/",
        "http://10.0.0.7:",
        "http://[::1]:",
    ] {
        let err = cli::parse(["--backend", &format!("n={url},slots=2")]).unwrap_err();
        assert!(
            err.contains("the URL's port is empty (an unset variable?)"),
            "{url}: {err}"
        );
    }
    // Left out with its colon, the port is 80.
    assert_eq!(cli::backend("n=http://gpu-a").unwrap().0.id, "gpu-a:80");
}

/// A node name with spaces around it is refused: `gpu-a ` and `gpu-a` would be two nodes, and a
/// spill between their backends would count as crossing nodes.
#[test]
fn a_node_name_with_spaces_around_it_is_refused() {
    for node in ["gpu-a ", " gpu-a", "\tgpu-a"] {
        let err = cli::parse(["--backend", &format!("{node}=http://127.0.0.1:8080")]).unwrap_err();
        assert!(err.contains("has spaces around it"), "{node:?}: {err}");
    }
    assert!(cli::backend("gpu a=http://127.0.0.1:8080").is_ok());
}

/// A proxy, without probes, over `--backend-dns` entries `names`, on a nameserver on loopback
/// where `llama.fleet.test` is 127.0.0.1 and a stub serves: each entry is `NAME`, to which the
/// stub's port is added, or has `{port}` where it goes. The proxy, the stub and the nameserver.
async fn dns_proxy(names: &[&str]) -> (Running, Stub, dns_server::Dns) {
    let stub = Stub::start("a1", 2).await;
    let dns = dns_server::Dns::start().await;
    dns.set_ips("llama.fleet.test.", 60, &["127.0.0.1"]).await;
    let port = stub.addr.port().to_string();
    let mut args = Vec::new();
    for name in names {
        let entry = match name.contains("{port}") {
            true => name.replace("{port}", &port),
            false => format!("{name}:{port}"),
        };
        args.extend(["--backend-dns".to_string(), entry]);
    }
    args.extend(["--dns-server".into(), dns.addr.to_string()]);
    args.extend(["--probe-interval".into(), "0".into()]);
    (start_args(args).await, stub, dns)
}

/// `--backend-dns` takes `slots=` and `cache=` as `--backend` does, for each backend the name
/// gives: a vLLM or SGLang fleet behind a Kubernetes headless service, which has no `/slots`
/// to read, served one request at a time a backend, its slots left idle.
#[tokio::test(start_paused = true)]
async fn backend_dns_gives_its_backends_slots_and_cache_budgets() {
    let (proxy, stub, _dns) = dns_proxy(&["llama.fleet.test:{port},slots=6,cache=64k"]).await;
    let id = format!("127.0.0.1:{}", stub.addr.port());
    let affinity = proxy.proxy.affinity();
    // The name resolves in the background: a bounded wait (on the paused clock) for it.
    for _ in 0..200 {
        affinity.apply_discovery();
        if affinity.backends().iter().any(|b| b.id.as_str() == id) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let status = proxy.status(&id);
    assert_eq!((status.slots, status.cache_budget), (6, 64 * 1024));
}

/// The first probes, before the first request, wait for a `--backend-dns` name's first
/// answer: its backends' slot counts are read then, as a `--backend`'s are, not one slot each
/// until the first interval ends.
#[tokio::test(start_paused = true)]
async fn the_first_probes_wait_for_a_dns_names_first_answer() {
    let stub = Stub::start("a1", 3).await;
    let dns = dns_server::Dns::start().await;
    dns.set_ips("llama.fleet.test.", 60, &["127.0.0.1"]).await;
    let port = stub.addr.port();
    let proxy = start_args(vec![
        "--backend-dns".into(),
        format!("llama.fleet.test:{port}"),
        "--dns-server".into(),
        dns.addr.to_string(),
        "--probe-interval".into(),
        "1h".into(),
    ])
    .await;
    proxy.proxy.probe_all().await;
    let status = proxy.status(&format!("127.0.0.1:{port}"));
    assert_eq!((status.slots, status.healthy), (3, true));
}

/// A proxy started from the command line `args`.
async fn start_args(args: Vec<String>) -> Running {
    let cli::Command::Run(parsed) = cli::parse(args).unwrap() else {
        panic!("a run");
    };
    start(parsed.config).await
}

/// `--backend-dns` follows a name on a real nameserver; `/metrics` says how each name
/// resolves, a name without records too.
#[tokio::test(start_paused = true)]
async fn backend_dns_names_backends_from_a_real_nameserver_on_loopback() {
    let (proxy, stub, _dns) = dns_proxy(&["llama.fleet.test", "missing.fleet.test"]).await;
    let port = stub.addr.port();
    // The name resolves in the background: a bounded wait (on the paused clock) for it.
    let id = format!("127.0.0.1:{port}");
    for _ in 0..200 {
        if proxy
            .proxy
            .affinity()
            .backends()
            .iter()
            .any(|b| b.id.as_str() == id)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut convo = Conversation::new("dns");
    let answer = proxy
        .post_json(&[("x-session-id", "dns")], &convo.next(json!({})))
        .await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(answer.backend(), id);
    assert_eq!(answer.header("x-affinity-node"), "127.0.0.1");
    assert_eq!(stub.chats(), 1);

    // The missing name has failed at least once by now (bounded wait, paused clock).
    let failed =
        format!("tower_affinity_dns_failures_total{{name=\"missing.fleet.test:{port}\"}} ");
    let mut metrics = String::new();
    for _ in 0..200 {
        metrics = String::from_utf8(proxy.get("/metrics").await.body.to_vec()).unwrap();
        if metrics
            .lines()
            .any(|l| l.starts_with(&failed) && !l.ends_with(" 0"))
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let value = |series: &str| {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("no {series} in {metrics}"))
            .parse::<u64>()
            .unwrap()
    };
    let (found, missing) = (
        format!("{{name=\"llama.fleet.test:{port}\"}}"),
        format!("{{name=\"missing.fleet.test:{port}\"}}"),
    );
    assert_eq!(value(&format!("tower_affinity_dns_backends{found}")), 1);
    assert_eq!(
        value(&format!("tower_affinity_dns_failures_total{found}")),
        0
    );
    assert!(value(&format!("tower_affinity_dns_resolutions_total{found}")) >= 1);
    assert_eq!(value(&format!("tower_affinity_dns_backends{missing}")), 0);
    let failures = value(&format!("tower_affinity_dns_failures_total{missing}"));
    assert!(failures >= 1, "{metrics}");
    assert_eq!(
        value(&format!("tower_affinity_dns_consecutive_failures{missing}")),
        failures
    );
}

/// `--dns-removal-grace` keeps a backend that an answer leaves out until answers have left it
/// out for the grace.
#[tokio::test(start_paused = true)]
async fn dns_removal_grace_keeps_a_backend_answers_leave_out_for_a_while() {
    let stub = Stub::start("a1", 2).await;
    let dns = dns_server::Dns::start().await;
    dns.set_ips("llama.fleet.test.", 5, &["127.0.0.1", "127.0.0.2"])
        .await;
    let port = stub.addr.port();
    let args: Vec<String> = [
        "--backend-dns".to_string(),
        format!("llama.fleet.test:{port}"),
        "--dns-server".into(),
        dns.addr.to_string(),
        "--dns-removal-grace".into(),
        "30s".into(),
        "--probe-interval".into(),
        "0".into(),
    ]
    .into();
    let proxy = start_args(args).await;
    let affinity = proxy.proxy.affinity();
    let backends = || {
        affinity.apply_discovery();
        affinity.backends().len()
    };
    // Both addresses come in (a bounded wait on the paused clock).
    for _ in 0..400 {
        if backends() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(backends(), 2);
    // The answers leave one out: it stays for 30 s of them, then goes.
    dns.set_ips("llama.fleet.test.", 5, &["127.0.0.1"]).await;
    tokio::time::sleep(Duration::from_secs(20)).await;
    assert_eq!(backends(), 2, "removed within its grace");
    tokio::time::sleep(Duration::from_secs(20)).await;
    assert_eq!(backends(), 1, "kept past its grace");
}

/// With a fleet for each model, the `--backend-dns` series carry their fleet's `model` too:
/// one name given for two models is two series apart, not one series written twice (which a
/// scrape keeps only one of).
#[tokio::test]
async fn backend_dns_series_carry_their_fleets_model() {
    let names = [
        "llama.fleet.test:{port},model=qwen3-coder",
        "llama.fleet.test:{port},model=qwen3-4b",
    ];
    let (proxy, stub, _dns) = dns_proxy(&names).await;
    let port = stub.addr.port();
    let metrics = String::from_utf8(proxy.get("/metrics").await.body.to_vec()).unwrap();
    for model in ["qwen3-coder", "qwen3-4b"] {
        let line = format!(
            "tower_affinity_dns_backends{{name=\"llama.fleet.test:{port}\",model=\"{model}\"}} "
        );
        assert!(
            metrics.lines().any(|l| l.starts_with(&line)),
            "missing {line:?} in\n{metrics}"
        );
    }
    let mut seen = HashSet::new();
    for line in metrics.lines().filter(|l| l.starts_with("tower_affinity_")) {
        assert!(line.contains("model=\""), "without its model: {line}");
        let series = line.rsplit_once(' ').map_or(line, |(series, _)| series);
        assert!(seen.insert(series), "written twice: {series}");
    }
}

/// A backend that a `--backend` and two `--backend-dns` names all name (the same
/// `IP:PORT`) is one backend, as the `--backend` gives it, and stays while any names it.
#[tokio::test(start_paused = true)]
async fn a_backend_named_by_a_flag_and_by_names_is_one_backend_kept_while_any_names_it() {
    let stub = Stub::start("a1", 2).await;
    let dns = dns_server::Dns::start().await;
    for name in ["llama.fleet.test.", "also.fleet.test."] {
        dns.set_ips(name, 5, &["127.0.0.1"]).await;
    }
    let port = stub.addr.port();
    let args: Vec<String> = [
        "--backend".to_string(),
        format!("gpu-host=http://127.0.0.1:{port},slots=3"),
        "--backend-dns".into(),
        format!("llama.fleet.test:{port}"),
        "--backend-dns".into(),
        format!("also.fleet.test:{port}"),
        "--dns-server".into(),
        dns.addr.to_string(),
        "--probe-interval".into(),
        "0".into(),
    ]
    .into();
    let proxy = start_args(args).await;
    // Until each name's `tower_affinity_dns_backends` reads `count` (a bounded wait on the
    // paused clock).
    let names_hold = |count: &'static str| {
        let proxy = &proxy;
        async move {
            for _ in 0..400 {
                let metrics = String::from_utf8(proxy.get("/metrics").await.body.to_vec()).unwrap();
                let held = ["llama.fleet.test", "also.fleet.test"].iter().all(|n| {
                    let series =
                        format!("tower_affinity_dns_backends{{name=\"{n}:{port}\"}} {count}");
                    metrics.lines().any(|l| l == series)
                });
                if held {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            panic!("the names never held {count}");
        }
    };
    names_hold("1").await;
    proxy.proxy.affinity().apply_discovery();
    let backends = proxy.proxy.affinity().backends();
    assert_eq!(backends.len(), 1, "{backends:?}");
    let b = &backends[0];
    assert_eq!(
        (b.id.as_str(), b.node.as_str(), b.slots),
        (format!("127.0.0.1:{port}").as_str(), "gpu-host", 3)
    );

    // The names move to another address: the --backend still names the first, and the
    // second, named by both names, is one backend.
    for name in ["llama.fleet.test.", "also.fleet.test."] {
        dns.set_ips(name, 5, &["127.0.0.2"]).await;
    }
    let moved = format!("127.0.0.2:{port}");
    let affinity = proxy.proxy.affinity();
    for _ in 0..400 {
        affinity.apply_discovery();
        if affinity.backends().iter().any(|b| b.id == moved.as_str()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    names_hold("1").await;
    affinity.apply_discovery();
    let mut backends = affinity.backends();
    backends.sort_by(|a, b| a.id.cmp(&b.id));
    let seen: Vec<_> = (backends.iter())
        .map(|b| (b.id.to_string(), b.node.to_string()))
        .collect();
    assert_eq!(
        seen,
        [
            (format!("127.0.0.1:{port}"), "gpu-host".to_string()),
            (moved, "127.0.0.2".to_string())
        ]
    );
    assert_eq!(backends[0].slots, 3);
}

/// A streamed chat turn of conversation `convo` (under `session`, if given) sent to `url`
/// through `client`: its body once the first chunk has come.
async fn open_stream(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
    url: String,
    convo: &str,
    session: Option<&str>,
) -> Incoming {
    let body = Conversation::new(convo).next(json!({"stream": true}));
    let mut req = Request::post(url).header("content-type", "application/json");
    if let Some(session) = session {
        req = req.header("x-session-id", session);
    }
    let req = req.body(Full::new(Bytes::from(body.to_string()))).unwrap();
    let res = tokio::time::timeout(DEADLINE, client.request(req))
        .await
        .expect("no response in time")
        .unwrap();
    after_first_chunk(res).await
}

/// The body of `res`, an answer 200, once its first chunk has come.
async fn after_first_chunk(res: Response<Incoming>) -> Incoming {
    assert_eq!(res.status(), StatusCode::OK);
    let mut body = res.into_body();
    tokio::time::timeout(DEADLINE, body.frame())
        .await
        .expect("no first chunk in time")
        .unwrap()
        .unwrap();
    body
}

/// A request the proxy does not forward (a body in a transfer coding other than `chunked`,
/// answered 501) costs a per-client connection nothing: it neither opens a backend
/// connection nor closes the free one the client connection holds.
#[tokio::test]
async fn per_client_a_request_not_forwarded_keeps_the_backend_connection() {
    let a = Stub::start("a", 2).await;
    let proxy = start(upstream(config(&[("node-a", &a)]), UpstreamMode::PerClient)).await;

    let stream = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let (mut tx, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    let conn = tokio::spawn(conn);
    let mut send = async |req: Request<Full<Bytes>>| {
        let res = tokio::time::timeout(DEADLINE, tx.send_request(req))
            .await
            .expect("no response in time")
            .unwrap();
        let status = res.status();
        tokio::time::timeout(DEADLINE, res.into_body().collect())
            .await
            .expect("no body in time")
            .unwrap();
        status
    };
    let get = || {
        Request::get("/v1/models")
            .header("host", proxy.addr.to_string())
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    assert_eq!(send(get()).await, StatusCode::CREATED);
    assert_eq!(a.connections(), 1);
    let coded = Request::post("/v1/chat/completions")
        .header("host", proxy.addr.to_string())
        .header("transfer-encoding", "gzip, chunked")
        .body(Full::new(Bytes::from_static(b"not really gzip")))
        .unwrap();
    assert_eq!(send(coded).await, StatusCode::NOT_IMPLEMENTED);
    assert_eq!(send(get()).await, StatusCode::CREATED);
    assert_eq!(
        a.echoed().len(),
        2,
        "the coded request never reached the backend"
    );
    assert_eq!(
        a.connections(),
        1,
        "the free backend connection served the third request too"
    );
    drop(tx);
    tokio::time::timeout(DEADLINE, conn)
        .await
        .expect("the client connection did not close")
        .unwrap()
        .unwrap();
}

/// `assign-slots`: the proxy sends each chat with the slot it assigned as `id_slot`, each
/// conversation on a slot of its own though two share their system prompt; a backend
/// without the option gets no `id_slot`, whatever the client sent.
#[tokio::test]
async fn a_backend_given_assign_slots_gets_each_conversation_on_a_slot_of_its_own() {
    let (a, b) = (Stub::start("a", 2).await, Stub::start("b", 2).await);
    let proxy = start(config_of(&[format!(
        "node-a={},slots=2,id=a,assign-slots",
        a.url()
    )]))
    .await;
    let system = json!({"role": "system", "content": "You are a careful coding assistant."});
    let mut histories = [vec![system.clone()], vec![system.clone()]];
    for turn in 0..2 {
        for (agent, history) in histories.iter_mut().enumerate() {
            history.push(json!({"role": "user", "content": format!("agent {agent}, turn {turn}")}));
            let answer = proxy
                .post_json(&[], &json!({"model": "m", "messages": history}))
                .await;
            assert_eq!(answer.status, 200);
            let content = answer.json()["choices"][0]["message"]["content"].clone();
            history.push(json!({"role": "assistant", "content": content}));
        }
    }
    assert_eq!(a.id_slots(), [Some(0), Some(1), Some(0), Some(1)]);

    let plain = start(config(&[("node-b", &b)])).await;
    let answer = plain
        .post_json(&[], &json!({"model": "m", "messages": [system]}))
        .await;
    assert_eq!(answer.status, 200);
    assert_eq!(b.id_slots(), [None]);
}
