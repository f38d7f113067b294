//! Chaos through real HTTP: the proxy example's app in front of stub backends on loopback,
//! thousands of session requests while backends are killed, restarted, slowed, answer 500 or
//! cut a stream in the middle.
//!
//! Every request has a deadline and every loop a bound: a regression fails fast instead of
//! hanging.

#[allow(dead_code)]
#[path = "../../examples/proxy/app.rs"]
mod app;
#[allow(dead_code)]
#[path = "../../examples/proxy/per_client.rs"]
mod per_client;
#[path = "../support/proxy.rs"]
mod proxy;
#[path = "../support/server.rs"]
mod server;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use bytes::Bytes;
use http::uri::{Authority, Scheme};
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, Semaphore};
use tokio::task::{JoinHandle, JoinSet};
use tower_affinity::Overflow;

use app::{BackendSpec, Config, Proxy};

/// The longest any client request (headers and whole body) may take.
const DEADLINE: Duration = Duration::from_secs(10);

// === a stub backend that misbehaves on command ===

const OK: u8 = 0;
const FAIL_500: u8 = 1;
const CUT: u8 = 2;
const HANG: u8 = 3;
/// One event, then the stream stays open without sending more.
const STALL: u8 = 4;

#[derive(Debug)]
struct StubState {
    name: String,
    mode: AtomicU8,
    delay_ms: AtomicU64,
    chats: AtomicUsize,
}

/// A stub on a fixed loopback port that can be killed (listener and every connection closed,
/// as a crashed process) and started again on the same port.
#[derive(Debug)]
struct Stub {
    addr: SocketAddr,
    state: Arc<StubState>,
    server: Mutex<Option<server::Served>>,
}

impl Stub {
    async fn start(name: &str) -> Arc<Stub> {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let stub = Arc::new(Stub {
            addr: listener.local_addr().unwrap(),
            state: Arc::new(StubState {
                name: name.to_string(),
                mode: AtomicU8::new(OK),
                delay_ms: AtomicU64::new(0),
                chats: AtomicUsize::new(0),
            }),
            server: Mutex::new(None),
        });
        stub.serve(listener);
        stub
    }

    fn serve(&self, listener: TcpListener) {
        let router = Router::new()
            .route("/health", get(|| async { "ok" }))
            .route("/v1/chat/completions", post(chat))
            .with_state(self.state.clone());
        let server = server::spawn(listener, router);
        *self.server.lock() = Some(server);
    }

    /// Closes the listener and every open connection, and returns once all have ended.
    async fn kill(&self) {
        let Some(server) = self.server.lock().take() else {
            return;
        };
        server.stop().await;
    }

    /// Listens again on the same port, if it is not listening. Gives up (and says so) if the
    /// port stays taken, as it can when an outgoing connection happens to hold it.
    async fn restart(&self) -> bool {
        if self.server.lock().is_some() {
            return true;
        }
        for _ in 0..50 {
            if let Ok(listener) = TcpListener::bind(self.addr).await {
                self.serve(listener);
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }

    fn set(&self, mode: u8, delay: Duration) {
        self.state.mode.store(mode, Ordering::Relaxed);
        self.state
            .delay_ms
            .store(delay.as_millis() as u64, Ordering::Relaxed);
    }

    fn spec(&self, node: &str) -> BackendSpec {
        BackendSpec {
            id: self.state.name.clone(),
            node: node.to_string(),
            scheme: Scheme::HTTP,
            authority: Authority::try_from(self.addr.to_string()).unwrap(),
            slots: Some(std::num::NonZeroU32::new(64).unwrap()),
            context: None,
            request_context: None,
            model: None,
            assign_slots: false,
        }
    }
}

/// An SSE answer of three events and `[DONE]`; in `CUT` mode the stream fails after its first
/// event, which closes the connection mid-body.
async fn chat(State(s): State<Arc<StubState>>, _body: Bytes) -> Response {
    s.chats.fetch_add(1, Ordering::Relaxed);
    let delay = s.delay_ms.load(Ordering::Relaxed);
    let mode = s.mode.load(Ordering::Relaxed);
    if mode == HANG {
        std::future::pending::<()>().await;
    }
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    if mode == FAIL_500 {
        return (StatusCode::INTERNAL_SERVER_ERROR, "stub failure").into_response();
    }
    let name = s.name.clone();
    let cut = mode == CUT;
    let events = (0..4).map(move |i| {
        if cut && i == 1 {
            return Err(std::io::Error::other("stream cut"));
        }
        let line = if i == 3 {
            "data: [DONE]\n\n".to_string()
        } else {
            format!("data: {name} {i}\n\n")
        };
        Ok(Bytes::from(line))
    });
    let stall_after = (mode == STALL).then_some(1);
    let stream = futures_stream(events, stall_after);
    (
        [("content-type", "text/event-stream")],
        Body::from_stream(stream),
    )
        .into_response()
}

/// A stream of the given items that yields between them, so a cut lands after a frame was
/// written; with `stall_after`, it stays pending after that many items.
fn futures_stream<I>(
    items: I,
    stall_after: Option<usize>,
) -> impl futures_core::Stream<Item = I::Item> + Send + 'static
where
    I: Iterator + Send + Unpin + 'static,
{
    struct Yielding<I> {
        items: I,
        yielded: bool,
        stall_after: Option<usize>,
    }
    impl<I: Iterator + Unpin> futures_core::Stream for Yielding<I> {
        type Item = I::Item;
        fn poll_next(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<I::Item>> {
            if self.stall_after == Some(0) {
                return std::task::Poll::Pending;
            }
            if !self.yielded {
                self.yielded = true;
                cx.waker().wake_by_ref();
                return std::task::Poll::Pending;
            }
            self.yielded = false;
            if let Some(n) = self.stall_after.as_mut() {
                *n -= 1;
            }
            std::task::Poll::Ready(self.items.next())
        }
    }
    Yielding {
        items,
        yielded: false,
        stall_after,
    }
}

// === the proxy ===

struct Running {
    addr: SocketAddr,
    proxy: Arc<Proxy>,
    _stop: oneshot::Sender<()>,
    _server: JoinHandle<std::io::Result<()>>,
}

async fn start(backends: Vec<BackendSpec>) -> Running {
    start_with(backends, |_| {}).await
}

/// [`start`], with `adjust` applied to the proxy's configuration last.
async fn start_with(backends: Vec<BackendSpec>, adjust: impl FnOnce(&mut Config)) -> Running {
    let mut config = Config::new(backends);
    config.probe_interval = None;
    config.connect_timeout = Some(Duration::from_millis(500));
    config.failure_cooldown = Duration::from_millis(300);
    config.read_timeout = Some(Duration::from_secs(5));
    config.overflow = Overflow::wait(Duration::from_secs(3), 4096);
    adjust(&mut config);
    let served = proxy::serve(config).await;
    Running {
        addr: served.addr,
        proxy: served.proxy,
        _stop: served.stop,
        _server: served.server,
    }
}

impl Running {
    /// Waits (bounded) until no request holds a slot, and says whether that happened.
    async fn settled(&self) -> bool {
        for _ in 0..300 {
            let stats = self.proxy.affinity().stats();
            let backends = self.proxy.affinity().backends();
            if stats.in_flight == 0
                && stats.waiting == 0
                && backends.iter().all(|b| b.in_flight == 0)
            {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }
}

/// Counts panics anywhere in the process, spawned tasks included.
fn count_panics() -> Arc<AtomicUsize> {
    let panics = Arc::new(AtomicUsize::new(0));
    let seen = panics.clone();
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        seen.fetch_add(1, Ordering::Relaxed);
        previous(info);
    }));
    panics
}

/// How one client request ended.
#[derive(Clone, Debug, PartialEq, Eq)]
enum End {
    /// 200 with the whole stream.
    Complete,
    /// 200, then the body failed: the backend cut its stream. What arrived before the cut.
    Cut(String),
    /// The connection closed after the request was sent, before any response: a backend cut
    /// its stream so soon that the proxy's response head was still in its write buffer, and
    /// hyper closes a connection whose response body fails without flushing what it holds.
    CutUnseen,
    /// 200 and a body that ended cleanly but short: a cut passed off as an end.
    Truncated(usize),
    /// A status other than 200, with its body read.
    Status(u16),
    /// No response: the proxy connection failed.
    NoResponse(String),
    /// Past the deadline.
    Hung,
}

/// Sends one turn of `session` and reads its answer to the end, within [`DEADLINE`].
async fn turn(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
    addr: SocketAddr,
    session: usize,
) -> (End, Option<String>) {
    let req = Request::post(format!("http://{addr}/v1/chat/completions"))
        .header("x-session-id", format!("chaos-{session}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(format!(
            r#"{{"messages":[{{"role":"user","content":"turn of {session}"}}],"stream":true}}"#
        ))))
        .unwrap();
    let exchange = async {
        let res = match client.request(req).await {
            Ok(res) => res,
            Err(e) => {
                let incomplete = std::error::Error::source(&e)
                    .and_then(|s| s.downcast_ref::<hyper::Error>())
                    .is_some_and(hyper::Error::is_incomplete_message);
                let end = if incomplete {
                    End::CutUnseen
                } else {
                    End::NoResponse(causes(&e))
                };
                return (end, None);
            }
        };
        let backend = res
            .headers()
            .get("x-affinity-backend")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let status = res.status();
        // Frame by frame, so that what arrived before a cut is kept.
        let mut body = res.into_body();
        let mut read = Vec::new();
        let cut = loop {
            match body.frame().await {
                Some(Ok(frame)) => read.extend_from_slice(frame.data_ref().map_or(&[][..], |d| d)),
                Some(Err(_)) => break true,
                None => break false,
            }
        };
        let end = match (status, cut) {
            (StatusCode::OK, false) if read.ends_with(b"data: [DONE]\n\n") => End::Complete,
            (StatusCode::OK, false) => End::Truncated(read.len()),
            (StatusCode::OK, true) => End::Cut(String::from_utf8_lossy(&read).into_owned()),
            (s, _) => End::Status(s.as_u16()),
        };
        (end, backend)
    };
    tokio::time::timeout(DEADLINE, exchange)
        .await
        .unwrap_or((End::Hung, None))
}

const SESSIONS: usize = 1000;
const TURNS: usize = 3;
const CONCURRENCY: usize = 32;

/// Thousands of requests of a thousand sessions while `a2` is killed and restarted, `b2` is
/// slowed and answers 500, and `c1` cuts its streams. Every request ends within its deadline
/// with a full answer, a cut stream (only from `c1` or the killed `a2`) or an error status;
/// nothing panics; sessions whose backend was never killed never move; every slot is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_ends_every_request_and_loses_no_slot() {
    let panics = count_panics();
    let a1 = Stub::start("a1").await;
    let a2 = Stub::start("a2").await;
    let b1 = Stub::start("b1").await;
    let b2 = Stub::start("b2").await;
    let c1 = Stub::start("c1").await;
    let running = start(vec![
        a1.spec("node-a"),
        a2.spec("node-a"),
        b1.spec("node-b"),
        b2.spec("node-b"),
        c1.spec("node-c"),
    ])
    .await;
    let started = std::time::Instant::now();

    // The chaos: a fixed cycle of faults, one step every 100 ms, until the clients are done.
    let done = Arc::new(AtomicBool::new(false));
    let chaos = {
        let (a2, b2, c1, done) = (a2.clone(), b2.clone(), c1.clone(), done.clone());
        tokio::spawn(async move {
            let (mut kills, mut restarts) = (0, 0);
            for step in 0..600u32 {
                if done.load(Ordering::Relaxed) {
                    break;
                }
                match step % 10 {
                    0 => {
                        a2.kill().await;
                        kills += 1;
                    }
                    1 => b2.set(OK, Duration::from_millis(300)),
                    2 => c1.set(CUT, Duration::ZERO),
                    4 => restarts += u32::from(a2.restart().await),
                    5 => b2.set(FAIL_500, Duration::ZERO),
                    6 => c1.set(OK, Duration::ZERO),
                    8 => b2.set(OK, Duration::ZERO),
                    _ => {}
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            (kills, restarts)
        })
    };

    // The clients: each session's turns in order, at most CONCURRENCY requests at once. A
    // fresh connection for every request: a stream the proxy cuts ends its connection, and a
    // pooled client can pick such a connection up as it closes and fail before sending (a
    // client-side race that real clients retry), which is not what this test is about.
    let client = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(0)
        .build_http::<Full<Bytes>>();
    let gate = Arc::new(Semaphore::new(CONCURRENCY));
    let mut sessions = JoinSet::new();
    for s in 0..SESSIONS {
        let (client, gate, addr) = (client.clone(), gate.clone(), running.addr);
        sessions.spawn(async move {
            let mut ends = Vec::with_capacity(TURNS);
            for _ in 0..TURNS {
                let _permit = gate.acquire().await.unwrap();
                ends.push(turn(&client, addr, s).await);
            }
            (s, ends)
        });
    }
    let mut results: HashMap<usize, Vec<(End, Option<String>)>> = HashMap::new();
    while let Some(r) = sessions.join_next().await {
        let (s, ends) = r.expect("a client task panicked");
        results.insert(s, ends);
    }
    done.store(true, Ordering::Relaxed);
    let (kills, restarts) = chaos.await.unwrap();
    let elapsed = started.elapsed();

    // Tally.
    let mut tally: HashMap<String, usize> = HashMap::new();
    let mut moved = Vec::new();
    for (s, ends) in &results {
        for (end, backend) in ends {
            let what = match end {
                End::Complete => "complete".to_string(),
                End::Cut(_) => format!("cut on {}", backend.as_deref().unwrap_or("?")),
                End::CutUnseen => "cut before the response head".to_string(),
                End::Truncated(n) => format!("truncated at {n} bytes"),
                End::Status(code) => format!("status {code}"),
                End::NoResponse(e) => format!("no response: {e}"),
                End::Hung => "hung".to_string(),
            };
            *tally.entry(what).or_default() += 1;
        }
        // Where each turn was served, for turns a backend answered.
        let served: Vec<&str> = ends.iter().filter_map(|(_, b)| b.as_deref()).collect();
        if let Some(&home) = served.first() {
            if home != "a2" && served.iter().any(|&b| b != home) {
                moved.push((*s, served.clone()));
            }
        }
    }
    let mut lines: Vec<_> = tally.iter().collect();
    lines.sort();
    println!(
        "{} requests in {elapsed:?}, a2 killed {kills} times, restarted {restarts}: {lines:?}",
        SESSIONS * TURNS
    );
    let stats = running.proxy.affinity().stats();
    println!("{stats:?}");

    // Every request ended, none hung, none lost its connection to the proxy but through a cut
    // stream; cuts too early for the client to see the response head are rare.
    assert_eq!(results.len(), SESSIONS);
    let unseen = tally
        .get("cut before the response head")
        .copied()
        .unwrap_or(0);
    assert!(unseen * 100 <= SESSIONS * TURNS, "{tally:?}");
    for (end, backend) in results.values().flatten() {
        match end {
            End::Complete | End::CutUnseen => {}
            End::Cut(read) => {
                assert!(
                    matches!(backend.as_deref(), Some("c1" | "a2")),
                    "a stream cut on {backend:?}"
                );
                // What the client got before the cut is the backend's stream as it was sent.
                let whole = format!(
                    "data: {b} 0\n\ndata: {b} 1\n\ndata: {b} 2\n\ndata: [DONE]\n\n",
                    b = backend.as_deref().unwrap_or("?")
                );
                assert!(whole.starts_with(read.as_str()), "cut after {read:?}");
            }
            // `b2`'s own 500, passed on as it answered it.
            End::Status(500) => assert_eq!(backend.as_deref(), Some("b2"), "a 500"),
            // The proxy's 502 when a backend and its retry both failed.
            End::Status(502) => {}
            other => panic!("request ended as {other:?} on {backend:?}"),
        }
    }
    assert!(kills >= 1, "the chaos ran");
    // Each fault reached clients: b2's 500s and c1's cuts.
    for fault in ["status 500", "cut on c1"] {
        assert!(
            tally.get(fault).copied().unwrap_or(0) > 0,
            "no {fault}: {tally:?}"
        );
    }
    assert!(
        tally.get("complete").copied().unwrap_or(0) > SESSIONS,
        "{tally:?}"
    );
    // Sessions whose backend was never killed stayed on it.
    assert!(moved.is_empty(), "sessions moved: {moved:?}");
    // Every slot came back, and nothing panicked.
    assert!(
        running.settled().await,
        "slots held: {:?} {:?}",
        running.proxy.affinity().stats(),
        running.proxy.affinity().backends()
    );
    assert_eq!(panics.load(Ordering::Relaxed), 0, "a task panicked");
    assert!(a1.state.chats.load(Ordering::Relaxed) > 0);
}

/// A backend that takes requests and never answers: past the response timeout it has failed
/// the request, is passed over, and the request is answered by another backend; when every
/// backend hangs, the answer is 504.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_that_never_answers_is_passed_over_after_the_response_timeout() {
    // Long enough that a loaded machine's proxy and stub answer well within it.
    const TIMEOUT: Duration = Duration::from_secs(1);
    let hung = Stub::start("h1").await;
    let fine = Stub::start("h2").await;
    hung.set(HANG, Duration::ZERO);
    let specs = vec![hung.spec("node-a"), fine.spec("node-a")];
    let timed = |c: &mut Config| {
        c.response_timeout = Some(TIMEOUT);
        c.failure_cooldown = Duration::from_secs(60);
    };
    let running = start_with(specs.clone(), timed).await;
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();

    // New sessions until one is placed on the hung backend first (each has even odds).
    let mut slow = None;
    for session in 0..32 {
        let started = tokio::time::Instant::now();
        let (end, backend) = turn(&client, running.addr, session).await;
        assert_eq!((end, backend.as_deref()), (End::Complete, Some("h2")));
        if hung.state.chats.load(Ordering::Relaxed) > 0 {
            slow = Some(started.elapsed());
            break;
        }
    }
    let slow = slow.expect("a session was placed on h1 first");
    assert!(slow >= TIMEOUT, "answered after the timeout: {slow:?}");
    let failures = |id: &str| {
        running
            .proxy
            .affinity()
            .backends()
            .into_iter()
            .find(|b| b.id.as_str() == id)
            .map(|b| (b.failures, b.healthy))
    };
    assert_eq!(
        failures("h1"),
        Some((1, false)),
        "h1 failed once and is down"
    );
    assert_eq!(failures("h2"), Some((0, true)));

    assert!(running.settled().await, "a timed-out request held its slot");

    // Every backend hangs (a second proxy, with neither marked down yet): the first attempt
    // times out, the retry times out too: 504.
    fine.set(HANG, Duration::ZERO);
    let both_hung = start_with(specs, timed).await;
    let attempts =
        || hung.state.chats.load(Ordering::Relaxed) + fine.state.chats.load(Ordering::Relaxed);
    let before = attempts();
    let started = tokio::time::Instant::now();
    let (end, _) = turn(&client, both_hung.addr, 1_000).await;
    assert_eq!(end, End::Status(504));
    assert_eq!(attempts() - before, 2, "the request and its one retry");
    // Two timeouts, and scheduling on a loaded machine.
    assert!(started.elapsed() < 4 * TIMEOUT, "{:?}", started.elapsed());
    assert!(
        both_hung.settled().await,
        "a timed-out request held its slot"
    );
}

/// A client that goes away releases its slot: while its backend has not answered yet, and in
/// the middle of a stream. The response timeout is off, so the leaving is what frees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_releases_its_slot() {
    let stub = Stub::start("h1").await;
    // No response timeout: nothing but the client's leaving frees the slot.
    let running = start_with(vec![stub.spec("node-h")], |c| c.response_timeout = None).await;
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();

    // Before the answer: the backend hangs, the client gives up after 200 ms.
    stub.set(HANG, Duration::ZERO);
    let gave_up =
        tokio::time::timeout(Duration::from_millis(200), turn(&client, running.addr, 1)).await;
    assert!(gave_up.is_err(), "the backend hangs");
    drop(client);
    assert!(
        running.settled().await,
        "slot held after the client left: {:?}",
        running.proxy.affinity().backends()
    );

    // In the middle of a stream: the backend sends one event, then waits; the client reads
    // the headers and leaves.
    stub.set(STALL, Duration::ZERO);
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let req = Request::post(format!("http://{}/v1/chat/completions", running.addr))
        .header("x-session-id", "leaver")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    let res = tokio::time::timeout(DEADLINE, client.request(req))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(res.status(), 200);
    let mut body = res.into_body();
    let first = tokio::time::timeout(DEADLINE, body.frame()).await.unwrap();
    assert!(first.is_some(), "the first event arrives");
    assert_eq!(running.proxy.affinity().stats().in_flight, 1);
    drop(body);
    drop(client);
    assert!(running.settled().await, "slot held after the client left");
}

/// An error with its causes, as hyper's top-level messages ("client error (Connect)") name
/// only the step that failed.
fn causes(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}
