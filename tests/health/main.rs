//! `HealthProbe` against real HTTP stubs on loopback, on paused time: the probe's intervals
//! and timeouts pass without the test waiting for them.

#[path = "../support/refusing.rs"]
mod refusing;
#[path = "../support/logs.rs"]
mod support_logs;

use std::net::SocketAddr;
use std::num::{NonZeroU32, NonZeroU64};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;
use bytes::Bytes;
use http_body_util::Full;
use hyper_util::rt::{TokioExecutor, TokioIo};
use parking_lot::Mutex;
use refusing::Refusing;
use serde_json::{json, Value};
use support_logs::Logs;
use tokio::net::TcpListener;
use tower::Layer;
use tower_affinity::client::{HttpBackend, IdSlotLayer};
use tower_affinity::discover::{self, StaticFleet};
use tower_affinity::health::{HealthProbe, MarkHealth, Prober};
use tower_affinity::{Backend, BackendStatus, SessionAffinity, SessionAffinityLayer};

type Http = HttpBackend<Full<Bytes>>;

/// A stub llama-server's `/health` and `/slots`, set by the test.
#[derive(Debug, Default)]
struct Stub {
    health: AtomicU16,
    /// `/health` never answers.
    hang: AtomicBool,
    /// Its slots, each `true` while processing.
    slots: Mutex<Vec<bool>>,
    /// `/slots` never answers (llama-server busy with a long prefill answers it late).
    slots_hang: AtomicBool,
    /// `/slots` answers this status with no slots, when not 0 (llama-server's `--no-slots`: 501).
    slots_status: AtomicU16,
    /// Each slot's `n_ctx`, left out when `None`; 4096 until set.
    n_ctx: Mutex<Option<Value>>,
    /// Each slot's last prompt, as text, when set (llama-server's `LLAMA_SERVER_SLOTS_DEBUG`).
    prompt: Mutex<Option<String>>,
    /// `/v1/models`' answer (vLLM's shape), 404 when `None`.
    models: Mutex<Option<Value>>,
    /// `/v1/models` never answers.
    models_hang: AtomicBool,
    /// `/props`' answer (llama-server's), 404 when `None`.
    props: Mutex<Option<Value>>,
    /// `/props` answers this status instead, when not 0.
    props_status: AtomicU16,
    /// `/props` never answers.
    props_hang: AtomicBool,
    /// The `Authorization` that `/slots` and `/v1/models` want, when set (a llama-server or a
    /// vLLM run with `--api-key`): 401 without it. `/health` answers without it.
    authorization: Mutex<Option<&'static str>>,
    /// The `Authorization` each `/health` came with, if any.
    health_authorization: Mutex<Vec<Option<String>>>,
    health_hits: AtomicUsize,
    slots_hits: AtomicUsize,
    models_hits: AtomicUsize,
    props_hits: AtomicUsize,
}

/// Whether `headers` carry the key the stub wants, if it wants one.
fn authorized(s: &Stub, headers: &axum::http::HeaderMap) -> Result<(), StatusCode> {
    match *s.authorization.lock() {
        Some(wanted) if headers.get("authorization").is_none_or(|v| v != wanted) => {
            Err(StatusCode::UNAUTHORIZED)
        }
        _ => Ok(()),
    }
}

async fn health(
    State(s): State<Arc<Stub>>,
    headers: axum::http::HeaderMap,
) -> (StatusCode, &'static str) {
    s.health_hits.fetch_add(1, Ordering::Relaxed);
    let authorization = headers
        .get("authorization")
        .map(|v| v.to_str().unwrap().to_string());
    s.health_authorization.lock().push(authorization);
    if s.hang.load(Ordering::Relaxed) {
        std::future::pending::<()>().await;
    }
    let status = StatusCode::from_u16(s.health.load(Ordering::Relaxed)).unwrap();
    (status, "{}")
}

async fn slots(
    State(s): State<Arc<Stub>>,
    headers: axum::http::HeaderMap,
) -> Result<axum::Json<Value>, StatusCode> {
    s.slots_hits.fetch_add(1, Ordering::Relaxed);
    // A server without the route (vLLM, SGLang) answers 404 with or without its key.
    if s.slots_status.load(Ordering::Relaxed) == 404 {
        return Err(StatusCode::NOT_FOUND);
    }
    authorized(&s, &headers)?;
    if s.slots_hang.load(Ordering::Relaxed) {
        std::future::pending::<()>().await;
    }
    match s.slots_status.load(Ordering::Relaxed) {
        0 => {}
        status => return Err(StatusCode::from_u16(status).unwrap()),
    }
    let n_ctx = s.n_ctx.lock().clone();
    let prompt = s.prompt.lock().clone();
    let slots: Vec<Value> = s
        .slots
        .lock()
        .iter()
        .enumerate()
        .map(|(id, busy)| {
            let mut slot = json!({"id": id, "is_processing": busy});
            if let Some(n) = &n_ctx {
                slot["n_ctx"] = n.clone();
            }
            if let Some(p) = &prompt {
                slot["prompt"] = json!(p);
            }
            slot
        })
        .collect();
    Ok(axum::Json(Value::Array(slots)))
}

async fn models(
    State(s): State<Arc<Stub>>,
    headers: axum::http::HeaderMap,
) -> Result<axum::Json<Value>, StatusCode> {
    s.models_hits.fetch_add(1, Ordering::Relaxed);
    authorized(&s, &headers)?;
    if s.models_hang.load(Ordering::Relaxed) {
        std::future::pending::<()>().await;
    }
    s.models
        .lock()
        .clone()
        .map(axum::Json)
        .ok_or(StatusCode::NOT_FOUND)
}

async fn props(State(s): State<Arc<Stub>>) -> Result<axum::Json<Value>, StatusCode> {
    s.props_hits.fetch_add(1, Ordering::Relaxed);
    if s.props_hang.load(Ordering::Relaxed) {
        std::future::pending::<()>().await;
    }
    match s.props_status.load(Ordering::Relaxed) {
        0 => {}
        status => return Err(StatusCode::from_u16(status).unwrap()),
    }
    s.props
        .lock()
        .clone()
        .map(axum::Json)
        .ok_or(StatusCode::NOT_FOUND)
}

async fn start(count: usize) -> (SocketAddr, Arc<Stub>) {
    let stub = Arc::new(Stub {
        health: AtomicU16::new(200),
        slots: Mutex::new(vec![false; count]),
        n_ctx: Mutex::new(Some(json!(4096))),
        ..Stub::default()
    });
    let app = Router::new()
        .route("/health", get(health))
        .route("/slots", get(slots))
        .route("/v1/models", get(models))
        .route("/props", get(props))
        .with_state(stub.clone());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (addr, stub)
}

fn http(addr: SocketAddr) -> Http {
    HttpBackend::new(&format!("http://{addr}")).unwrap()
}

type Affinity = SessionAffinity<
    tower_affinity::health::Probed<StaticFleet<Http>, Http>,
    tower_affinity::key::HeaderKey,
    tower_affinity::placement::NodeThenBackend,
>;

/// The balancer over `backends`, probed with `probe`.
fn balancer(probe: HealthProbe, backends: Vec<(&str, Backend<Http>)>) -> (Affinity, Prober<Http>) {
    let (fleet, prober) = probe.discover(StaticFleet::new(backends));
    (SessionAffinityLayer::new().layer(fleet), prober)
}

fn status<D, K, P>(affinity: &SessionAffinity<D, K, P>, id: &str) -> BackendStatus
where
    D: tower::discover::Discover<Key = tower_affinity::BackendId, Service = Backend<Http>>,
{
    affinity
        .backends()
        .into_iter()
        .find(|b| b.id.as_str() == id)
        .unwrap_or_else(|| panic!("no backend {id}"))
}

/// What this thread logs from now on.
fn logs() -> Logs {
    support_logs::capture(tracing::Level::INFO)
}

/// The lines `logs` has that say `what` of backend `id`.
fn said(logs: &Logs, id: &str, what: &str) -> usize {
    logs.count(&[what, &format!("backend={id} ")])
}

/// A shared store that refuses every read and write, or whose reads and writes never answer
/// (`silent`), counting the reads.
#[derive(Clone, Debug, Default)]
struct BadStore {
    reads: Arc<AtomicUsize>,
    silent: bool,
}

impl BadStore {
    #[allow(clippy::type_complexity)]
    fn answer<T: Send + 'static>(
        &self,
    ) -> std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<T, tower_affinity::BoxError>> + Send>,
    > {
        if self.silent {
            Box::pin(std::future::pending())
        } else {
            Box::pin(async { Err("connection refused".into()) })
        }
    }
}

impl tower_affinity::store::HomeStore for BadStore {
    fn read(
        &self,
        _: tower_affinity::key::SessionKey,
        _: Duration,
    ) -> tower_affinity::store::ReadHome {
        self.reads.fetch_add(1, Ordering::Relaxed);
        self.answer()
    }

    fn write(
        &self,
        _: tower_affinity::key::SessionKey,
        _: tower_affinity::store::StoredHome,
        _: Duration,
    ) -> tower_affinity::store::WriteHome {
        self.answer()
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn each_round_checks_the_shared_store_and_finds_it_down_with_no_request() {
    let (addr, _stub) = start(1).await;
    let store = BadStore::default();
    let (fleet, prober) =
        HealthProbe::new().discover(StaticFleet::new(vec![("a", Backend::new("n", http(addr)))]));
    let affinity: Affinity = SessionAffinityLayer::new()
        .home_store(store.clone())
        .layer(fleet);
    let state = || affinity.store_stats().unwrap().state;
    assert_eq!(
        state(),
        tower_affinity::store::StoreState::Up,
        "not read yet"
    );
    prober.round(&affinity).await;
    assert_eq!(store.reads.load(Ordering::Relaxed), 1);
    assert_eq!(state(), tower_affinity::store::StoreState::Down);
    // The background task's rounds check it too.
    let task = prober.clone().spawn(affinity.clone());
    tokio::time::sleep(Duration::from_secs(25)).await;
    assert!(store.reads.load(Ordering::Relaxed) >= 3, "{store:?}");
    drop(task);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_store_slower_than_the_interval_does_not_hold_the_probes_back() {
    let (addr, stub) = start(1).await;
    let store = BadStore {
        silent: true,
        ..BadStore::default()
    };
    let (fleet, prober) = HealthProbe::new()
        .interval(Duration::from_secs(2))
        .discover(StaticFleet::new(vec![("a", Backend::new("n", http(addr)))]));
    let affinity: Affinity = SessionAffinityLayer::new()
        .home_store(store.clone())
        .store_deadline(Duration::from_secs(10))
        .layer(fleet);
    let task = prober.clone().spawn(affinity.clone());
    tokio::time::sleep(Duration::from_secs(19)).await;
    // A round every 2 s, not one each time the store's check runs out its 10 s.
    let probes = stub.health_hits.load(Ordering::Relaxed);
    assert!(probes >= 9, "{probes} probes in 19 s");
    // One check at a time: at the start, and once the first ran out.
    assert_eq!(store.reads.load(Ordering::Relaxed), 2);
    assert_eq!(
        affinity.store_stats().unwrap().state,
        tower_affinity::store::StoreState::Down
    );
    drop(task);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_loading_backend_is_down_until_two_probes_find_it_ready() {
    let (addr, stub) = start(2).await;
    let two = NonZeroU32::new(2).unwrap();
    let (affinity, prober) = balancer(
        HealthProbe::new(),
        vec![(
            "a",
            Backend::new("n", http(addr))
                .slots(two)
                .request_context_tokens(NonZeroU64::MIN),
        )],
    );

    // Ready once, then loading its model again (restarted).
    prober.round(&affinity).await;
    stub.health.store(503, Ordering::Relaxed);
    prober.round(&affinity).await;
    assert!(!status(&affinity, "a").healthy, "503 is down at once");
    let s = prober.status("a").unwrap();
    assert!(s.loading && !s.up);

    stub.health.store(200, Ordering::Relaxed);
    prober.round(&affinity).await;
    assert!(!status(&affinity, "a").healthy, "one success is not enough");
    assert_eq!(prober.status("a").unwrap().successes, 1);
    prober.round(&affinity).await;
    assert!(status(&affinity, "a").healthy, "two successes bring it up");
    let s = prober.status("a").unwrap();
    assert!(s.up && !s.loading);
    assert_eq!(s.transitions, 2);
    assert_eq!(prober.transitions(), 2);
    assert_eq!(
        stub.slots_hits.load(Ordering::Relaxed),
        0,
        "its slots and context were given"
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_backend_never_ready_goes_down_at_its_first_failure_and_up_at_its_first_success() {
    // One that refuses connections when the proxy starts: nothing listens at its port.
    let refusing = Refusing::new();
    let (addr, stub) = start(2).await;
    stub.health.store(500, Ordering::Relaxed);
    let off: SocketAddr = refusing.addr;
    let (affinity, prober) = balancer(
        HealthProbe::new(),
        vec![
            ("off", Backend::new("n", http(off))),
            ("failing", Backend::new("n", http(addr))),
        ],
    );
    // The round before the first request: both down already.
    prober.round(&affinity).await;
    for id in ["off", "failing"] {
        let s = prober.status(id).unwrap();
        assert!(!s.up && s.failures == 1, "{s:?}");
        assert!(!status(&affinity, id).healthy, "{id}");
    }
    // Ready for the first time: up at once.
    stub.health.store(200, Ordering::Relaxed);
    prober.round(&affinity).await;
    assert!(status(&affinity, "failing").healthy);
    assert_eq!(prober.status("failing").unwrap().transitions, 2);
    // From then on, the thresholds: a failure alone does not take it down.
    stub.health.store(500, Ordering::Relaxed);
    prober.round(&affinity).await;
    assert!(
        status(&affinity, "failing").healthy,
        "one failure is not enough"
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn three_failures_in_a_row_take_a_backend_down_each_interval() {
    let (addr, stub) = start(2).await;
    let (affinity, prober) = balancer(
        HealthProbe::new().interval(Duration::from_secs(1)),
        vec![("a", Backend::new("n", http(addr)))],
    );
    // Ready once; then failing.
    prober.round(&affinity).await;
    stub.health.store(500, Ordering::Relaxed);
    let task = prober.clone().spawn(affinity.clone());

    // Rounds at 0 s, 1 s and 2 s.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(prober.status("a").unwrap().failures, 2);
    assert!(
        status(&affinity, "a").healthy,
        "two failures are not enough"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let s = prober.status("a").unwrap();
    assert_eq!(s.failures, 3);
    assert!(!s.up);
    assert_eq!(
        s.last_error.as_deref(),
        Some("/health answered 500 Internal Server Error")
    );
    assert!(!status(&affinity, "a").healthy);

    // Ready again: up after two rounds.
    stub.health.store(200, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(status(&affinity, "a").healthy);
    drop(task);
    let probes = stub.health_hits.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        stub.health_hits.load(Ordering::Relaxed),
        probes,
        "dropping the task stops it"
    );
}

/// Each backend is probed each interval, whatever the others take to answer: a backend whose
/// `/slots` answers late (llama-server busy with a long prefill) holds no other backend's
/// probes back, and is not asked again while its probe is out.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_backend_slow_to_answer_holds_back_no_other_backends_probes() {
    let (a, stub_a) = start(1).await;
    let (busy, stub_busy) = start(2).await;
    stub_busy.slots_hang.store(true, Ordering::Relaxed);
    let (affinity, prober) = balancer(
        HealthProbe::new()
            .interval(Duration::from_secs(1))
            .timeout(Duration::from_secs(5)),
        vec![
            ("a", Backend::new("n", http(a))),
            ("busy", Backend::new("n", http(busy))),
        ],
    );
    let _task = prober.clone().spawn(affinity.clone());
    // Ready at 0 s; failing from then on: probed at 1, 2 and 3 s, and down at the third.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(prober.status("a").unwrap().up);
    stub_a.health.store(500, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let s = prober.status("a").unwrap();
    assert_eq!((s.probes, s.failures, s.up), (4, 3, false), "{s:?}");
    assert!(!status(&affinity, "a").healthy);
    // Its `/slots` still out, the busy one is up, and was asked once.
    assert!(status(&affinity, "busy").healthy);
    assert_eq!(stub_busy.health_hits.load(Ordering::Relaxed), 1);
    assert_eq!(prober.status("busy").unwrap().probes, 0);
    // Its answer in (a timeout at 5 s), it is probed again at once: intervals ended while its
    // probe was out.
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let s = prober.status("busy").unwrap();
    assert_eq!(s.probes, 1);
    assert!(s.up, "a /slots that does not answer takes nothing down");
    assert_eq!(stub_busy.health_hits.load(Ordering::Relaxed), 2);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn no_answer_within_the_timeout_and_a_refused_connection_are_failures() {
    let (addr, stub) = start(1).await;
    stub.hang.store(true, Ordering::Relaxed);
    let refusing = Refusing::new();
    let gone = refusing.addr;
    let (affinity, prober) = balancer(
        HealthProbe::new()
            .timeout(Duration::from_secs(2))
            .failure_threshold(1),
        vec![
            ("hung", Backend::new("n", http(addr))),
            ("gone", Backend::new("n", http(gone))),
        ],
    );
    let started = tokio::time::Instant::now();
    prober.round(&affinity).await;
    assert!(started.elapsed() >= Duration::from_secs(2));
    let hung = prober.status("hung").unwrap();
    assert!(!hung.up);
    assert!(hung.last_error.unwrap().contains("no answer within 2s"));
    let gone = prober.status("gone").unwrap();
    assert!(!gone.up);
    assert!(gone.last_error.unwrap().contains("connection refused"));
    assert!(affinity.backends().iter().all(|b| !b.healthy));
}

/// The timeout bounds a probe whole: a llama-server that answers `/health` but neither its
/// `/props` nor its `/slots` (busy) is probed again after one timeout, not one for each.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_probe_asking_more_than_health_is_out_no_longer_than_its_timeout() {
    let (addr, stub) = start(2).await;
    *stub.props.lock() =
        Some(json!({"default_generation_settings": {"n_ctx": 4096}, "total_slots": 2}));
    let (affinity, prober) = balancer(
        HealthProbe::new().timeout(Duration::from_secs(2)),
        vec![("a", Backend::new("n", http(addr)))],
    );
    prober.round(&affinity).await;
    assert_eq!(status(&affinity, "a").slots, 2);
    stub.props_hang.store(true, Ordering::Relaxed);
    stub.slots_hang.store(true, Ordering::Relaxed);
    let started = tokio::time::Instant::now();
    prober.round(&affinity).await;
    assert!(
        started.elapsed() <= Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    // `/props` took it all: `/slots` was not asked.
    assert_eq!(stub.props_hits.load(Ordering::Relaxed), 1);
    assert_eq!(stub.slots_hits.load(Ordering::Relaxed), 1);
    let s = prober.status("a").unwrap();
    assert!(s.up, "{s:?}");
    assert_eq!(
        s.slots_error.as_deref(),
        Some("/slots: not asked: the probe's 2s ran out before")
    );
    assert_eq!(status(&affinity, "a").slots, 2);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_zero_timeout_is_the_floor_of_1_ms_and_a_ready_backend_stays_up() {
    let (addr, _stub) = start(1).await;
    let (hung_addr, hung) = start(1).await;
    hung.hang.store(true, Ordering::Relaxed);
    let (affinity, prober) = balancer(
        HealthProbe::new().timeout(Duration::ZERO),
        vec![
            ("ready", Backend::new("n", http(addr))),
            ("hung", Backend::new("n", http(hung_addr))),
        ],
    );
    prober.round(&affinity).await;
    let ready = prober.status("ready").unwrap();
    assert!(
        ready.up,
        "a probe that may not wait gets no answer: {ready:?}"
    );
    assert!(status(&affinity, "ready").healthy);
    // A backend that does not answer still fails, at the floor.
    let hung = prober.status("hung").unwrap();
    assert!(!hung.up);
    assert!(hung.last_error.unwrap().contains("no answer within 1ms"));
}

/// A timeout longer than the clock can count ahead (`Duration::MAX`, "no timeout") waits for
/// the answer: the probe's deadline is as far ahead as the clock goes, not a panic in the
/// probe's task that left every backend unprobed.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_timeout_past_what_the_clock_can_count_waits_for_the_answer() {
    let (addr, _stub) = start(2).await;
    let refusing = Refusing::new();
    let gone = refusing.addr;
    let (affinity, prober) = balancer(
        HealthProbe::new().timeout(Duration::MAX),
        vec![
            ("ready", Backend::new("n", http(addr))),
            ("gone", Backend::new("n", http(gone))),
        ],
    );
    prober.round(&affinity).await;
    let ready = prober.status("ready").unwrap();
    assert_eq!(ready.probes, 1, "{ready:?}");
    assert!(ready.up);
    assert_eq!(status(&affinity, "ready").slots, 2);
    let gone = prober.status("gone").unwrap();
    assert_eq!(gone.probes, 1, "{gone:?}");
    assert!(!gone.up);
    assert!(!status(&affinity, "gone").healthy);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn slots_are_learned_from_slots_and_followed_when_they_change() {
    let (a, stub_a) = start(3).await;
    let (b, stub_b) = start(4).await;
    let (c, stub_c) = start(4).await;
    let two = NonZeroU32::new(2).unwrap();
    let given = NonZeroU64::new(1_000).unwrap();
    let (affinity, prober) = balancer(
        HealthProbe::new(),
        vec![
            ("a", Backend::new("n", http(a))),
            ("b", Backend::new("n", http(b)).slots(two)),
            (
                "c",
                Backend::new("n", http(c))
                    .slots(two)
                    .request_context_tokens(given),
            ),
        ],
    );
    prober.round(&affinity).await;
    assert_eq!(status(&affinity, "a").slots, 3, "learned");
    assert_eq!(status(&affinity, "b").slots, 2, "given");
    // Each slot's `n_ctx` is what one request can take there, unless given.
    assert_eq!(status(&affinity, "a").request_context_limit, Some(4096));
    assert_eq!(status(&affinity, "b").request_context_limit, Some(4096));
    assert_eq!(status(&affinity, "c").request_context_limit, Some(1_000));
    // Asked for its context alone, with its slots given; not at all with both given.
    assert!(stub_b.slots_hits.load(Ordering::Relaxed) > 0);
    assert_eq!(stub_c.slots_hits.load(Ordering::Relaxed), 0);
    assert_eq!(prober.status("a").unwrap().busy_slots, Some(0));
    *stub_b.n_ctx.lock() = Some(json!(8192));
    prober.round(&affinity).await;
    assert_eq!(status(&affinity, "b").request_context_limit, Some(8192));
    // A `/slots` without it keeps the last one read.
    *stub_b.n_ctx.lock() = None;
    prober.round(&affinity).await;
    assert_eq!(status(&affinity, "b").request_context_limit, Some(8192));

    *stub_a.slots.lock() = vec![true, true, false, false, false];
    prober.round(&affinity).await;
    assert_eq!(status(&affinity, "a").slots, 5, "followed");
    let s = prober.status("a").unwrap();
    assert_eq!(
        (s.slots.map(NonZeroU32::get), s.busy_slots),
        (Some(5), Some(2))
    );
    // A steady count announces nothing more.
    prober.round(&affinity).await;
    assert_eq!(status(&affinity, "a").slots, 5);
    assert_eq!(s.transitions, 0);
}

/// A llama-server run with `--sleep-idle-seconds` unloads its model once idle that long; a
/// request to `/slots` wakes it and counts as activity, so asked at every probe it would never
/// sleep. Once its `/slots` was read, its slot count and context are read from `/props`, which
/// neither wakes it nor keeps it awake, and followed there; `/slots` is asked again only when
/// `/props` does not give them.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_llama_server_is_read_from_props_once_its_slots_were_read_and_so_may_sleep() {
    let (addr, stub) = start(3).await;
    let (affinity, prober) = balancer(
        HealthProbe::new(),
        vec![("a", Backend::new("n", http(addr)))],
    );
    let props = |slots: u32, sleeping: bool| {
        json!({
            "default_generation_settings": {"n_ctx": 4096},
            "total_slots": slots,
            "is_sleeping": sleeping,
        })
    };
    *stub.props.lock() = Some(props(3, false));
    prober.round(&affinity).await;
    assert_eq!(status(&affinity, "a").slots, 3);
    assert_eq!(prober.status("a").unwrap().busy_slots, Some(0));
    // Not asked before `/slots` says the backend is a llama-server.
    assert_eq!(stub.props_hits.load(Ordering::Relaxed), 0);
    let slots_asked = stub.slots_hits.load(Ordering::Relaxed);

    *stub.props.lock() = Some(props(3, true));
    for _ in 0..3 {
        prober.round(&affinity).await;
    }
    assert_eq!(
        stub.slots_hits.load(Ordering::Relaxed),
        slots_asked,
        "/slots asked"
    );
    assert_eq!(stub.props_hits.load(Ordering::Relaxed), 3);
    assert_eq!(stub.models_hits.load(Ordering::Relaxed), 0);
    let a = status(&affinity, "a");
    assert!(a.healthy);
    assert_eq!((a.slots, a.request_context_limit), (3, Some(4096)));
    // `/props` does not say which slots are busy.
    let s = prober.status("a").unwrap();
    assert_eq!((s.busy_slots, s.slots_error), (None, None));

    // Restarted with more slots, each with less context: followed from `/props`.
    *stub.props.lock() = Some(json!({
        "default_generation_settings": {"n_ctx": 2048},
        "total_slots": 4,
        "is_sleeping": false,
    }));
    prober.round(&affinity).await;
    let a = status(&affinity, "a");
    assert_eq!((a.slots, a.request_context_limit), (4, Some(2048)));
    assert_eq!(stub.slots_hits.load(Ordering::Relaxed), slots_asked);

    // A `/props` that does not give them (another server now): `/slots` again.
    *stub.props.lock() = None;
    *stub.slots.lock() = vec![true, false];
    prober.round(&affinity).await;
    assert_eq!(status(&affinity, "a").slots, 2);
    assert_eq!(prober.status("a").unwrap().busy_slots, Some(1));
}

/// A llama-server run with `LLAMA_SERVER_SLOTS_DEBUG` answers `/slots` with each slot's last
/// prompt as text: long conversations on a few slots make megabytes, still read.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn slots_that_carry_their_prompts_are_read_however_long() {
    let (a, stub) = start(4).await;
    // About 128k tokens of code a slot, as the debug switch shows it: 2.4 MB in all.
    *stub.prompt.lock() = Some("def f(x):\n    return x + 1\n".repeat(22_000));
    *stub.slots.lock() = vec![true, false, true, false];
    let (affinity, prober) = balancer(HealthProbe::new(), vec![("a", Backend::new("n", http(a)))]);
    prober.round(&affinity).await;
    assert_eq!(status(&affinity, "a").slots, 4);
    assert_eq!(prober.status("a").unwrap().busy_slots, Some(2));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_slots_answer_that_cannot_be_read_is_said_once_and_takes_nothing_down() {
    let logs = logs();
    let warned = |logs: &Logs| said(logs, "noslots", "slot count not readable from /slots");
    let (a, stub) = start(3).await;
    stub.slots_status.store(501, Ordering::Relaxed);
    let (affinity, prober) = balancer(
        HealthProbe::new(),
        vec![("noslots", Backend::new("n", http(a)))],
    );
    prober.round(&affinity).await;
    let b = status(&affinity, "noslots");
    assert!(b.healthy, "/health is what says up or down");
    assert_eq!(b.slots, 1, "one slot until a count is read");
    let s = prober.status("noslots").unwrap();
    assert_eq!(
        s.slots_error.as_deref(),
        Some("/slots answered 501 Not Implemented")
    );
    assert_eq!((s.slots, s.last_error), (None, None));
    prober.round(&affinity).await;
    assert_eq!(warned(&logs), 1, "said once while it lasts");

    // An answer that is no array of slots says so too.
    stub.slots_status.store(0, Ordering::Relaxed);
    stub.slots.lock().clear();
    prober.round(&affinity).await;
    assert_eq!(
        prober.status("noslots").unwrap().slots_error.as_deref(),
        Some("/slots gave no count: a non-empty JSON array of slot objects was expected")
    );

    // Readable again: the count is learned and the reason goes.
    *stub.slots.lock() = vec![false; 3];
    prober.round(&affinity).await;
    assert_eq!(status(&affinity, "noslots").slots, 3);
    assert_eq!(prober.status("noslots").unwrap().slots_error, None);
    // Failing after a count was read keeps the count, and says nothing more.
    stub.slots_status.store(500, Ordering::Relaxed);
    prober.round(&affinity).await;
    assert_eq!(status(&affinity, "noslots").slots, 3);
    assert_eq!(warned(&logs), 1);
}

/// A llama-server run with `--no-slots` answers `/slots` with 501, but has slots: its
/// `/props` gives their count and context, and is asked in place of `/slots` from then on,
/// as for a llama-server whose `/slots` was read. Not for its busy slots, which neither says.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_llama_server_run_with_no_slots_is_read_from_props() {
    let logs = logs();
    // llama-server 0.94 `--no-slots -np 2 -c 8192`, cut short.
    let no_slots_props = json!({
        "default_generation_settings": {"n_ctx": 4096},
        "total_slots": 2,
        "endpoint_slots": false,
        "is_sleeping": false,
    });
    let mut stubs = Vec::new();
    for _ in 0..3 {
        let (addr, stub) = start(0).await;
        stub.slots_status.store(501, Ordering::Relaxed);
        *stub.props.lock() = Some(no_slots_props.clone());
        stubs.push((addr, stub));
    }
    let five = NonZeroU32::new(5).unwrap();
    let (affinity, prober) = balancer(
        HealthProbe::new(),
        vec![
            ("a", Backend::new("n", http(stubs[0].0))),
            // Its context alone is learned.
            ("b", Backend::new("n", http(stubs[1].0)).slots(five)),
        ],
    );
    prober.round(&affinity).await;
    let a = status(&affinity, "a");
    assert!(a.healthy);
    assert_eq!((a.slots, a.request_context_limit), (2, Some(4096)));
    let b = status(&affinity, "b");
    assert_eq!((b.slots, b.request_context_limit), (5, Some(4096)));
    for id in ["a", "b"] {
        let s = prober.status(id).unwrap();
        assert_eq!((s.slots, s.busy_slots), (NonZeroU32::new(2), None));
        assert_eq!((s.slots_error, s.models_error), (None, None));
        assert_eq!(said(&logs, id, "slot count not readable"), 0);
    }
    assert_eq!(said(&logs, "a", "slot count read from /props"), 1);
    assert_eq!(said(&logs, "b", "request context read from /props"), 1);

    // From then on `/props` alone, and followed there.
    *stubs[0].1.props.lock() = Some(json!({
        "default_generation_settings": {"n_ctx": 2048},
        "total_slots": 4,
    }));
    for _ in 0..3 {
        prober.round(&affinity).await;
    }
    let a = status(&affinity, "a");
    assert_eq!((a.slots, a.request_context_limit), (4, Some(2048)));
    for (_, stub) in &stubs[..2] {
        let hits = |n: &AtomicUsize| n.load(Ordering::Relaxed);
        assert_eq!(
            (hits(&stub.slots_hits), hits(&stub.props_hits)),
            (1, 4),
            "/slots and /props asked"
        );
        // llama-server's `/v1/models` gives no context of the server's.
        assert_eq!(hits(&stub.models_hits), 0);
    }

    // Asked `/slots` at every probe for its busy slots: the count is read from `/props` still.
    let (affinity, prober) = balancer(
        HealthProbe::new().busy_slots(true),
        vec![("c", Backend::new("n", http(stubs[2].0)))],
    );
    prober.round(&affinity).await;
    assert_eq!(status(&affinity, "c").slots, 2);
    let s = prober.status("c").unwrap();
    assert_eq!((s.busy_slots, s.slots_error), (None, None));
}

/// A `/slots` that answers 501 with a `/props` that does not give the slots either is no
/// count: the backend counts as one slot, with the reason of its `/slots`, and it is said
/// once, as before `/props` was asked after a 501.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_501_at_slots_and_no_slots_from_props_is_no_count() {
    let logs = logs();
    let (addr, stub) = start(3).await;
    stub.slots_status.store(501, Ordering::Relaxed);
    stub.props_status.store(501, Ordering::Relaxed);
    *stub.props.lock() =
        Some(json!({"default_generation_settings": {"n_ctx": 4096}, "total_slots": 3}));
    let (affinity, prober) = balancer(
        HealthProbe::new(),
        vec![("a", Backend::new("n", http(addr)))],
    );
    for _ in 0..2 {
        prober.round(&affinity).await;
    }
    let a = status(&affinity, "a");
    assert!(a.healthy);
    assert_eq!((a.slots, a.request_context_limit), (1, None));
    let s = prober.status("a").unwrap();
    assert_eq!(
        s.slots_error.as_deref(),
        Some("/slots answered 501 Not Implemented")
    );
    assert_eq!(said(&logs, "a", "slot count not readable from /slots"), 1);
    // Each probe asks `/props` once, after `/slots`.
    assert_eq!(stub.slots_hits.load(Ordering::Relaxed), 2);
    assert_eq!(stub.props_hits.load(Ordering::Relaxed), 2);

    // A `/props` that answers is read at the next probe.
    stub.props_status.store(0, Ordering::Relaxed);
    prober.round(&affinity).await;
    let a = status(&affinity, "a");
    assert_eq!((a.slots, a.request_context_limit), (3, Some(4096)));
    assert_eq!(prober.status("a").unwrap().slots_error, None);
}

/// A `--no-slots` llama-server whose `/props` fails (500) has not said that it has no slots:
/// the probe says why, and the next probe asks again and reads them once it answers. Read as
/// "none", the backend took the 501 of its `/slots` for its reason, as if it had no slots.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_no_slots_llama_server_whose_props_fails_is_asked_again() {
    let (addr, stub) = start(3).await;
    stub.slots_status.store(501, Ordering::Relaxed);
    stub.props_status.store(500, Ordering::Relaxed);
    *stub.props.lock() =
        Some(json!({"default_generation_settings": {"n_ctx": 4096}, "total_slots": 3}));
    let (affinity, prober) = balancer(
        HealthProbe::new(),
        vec![("a", Backend::new("n", http(addr)))],
    );
    prober.round(&affinity).await;
    let s = prober.status("a").unwrap();
    assert!(s.up, "{s:?}");
    assert_eq!(
        s.slots_error.as_deref(),
        Some(
            "/slots answered 501 Not Implemented, and /props did not say: it answered 500 \
             Internal Server Error"
        )
    );
    stub.props_status.store(0, Ordering::Relaxed);
    prober.round(&affinity).await;
    let a = status(&affinity, "a");
    assert_eq!((a.slots, a.request_context_limit), (3, Some(4096)));
    assert_eq!(prober.status("a").unwrap().slots_error, None);
}

/// A `--no-slots` llama-server whose `/props` gave no answer in time (busy, or not yet
/// listening on it) has not said that it has no slots: it is asked again at the next probe,
/// and its context is learned and followed then. Taken as "none", a backend announced with
/// its slot count was not asked again until it failed or loaded, its context never learned.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_no_slots_llama_server_whose_props_did_not_answer_is_asked_again() {
    let (addr, stub) = start(0).await;
    stub.slots_status.store(501, Ordering::Relaxed);
    *stub.props.lock() =
        Some(json!({"default_generation_settings": {"n_ctx": 4096}, "total_slots": 2}));
    // Its context alone is learned.
    let five = NonZeroU32::new(5).unwrap();
    let (affinity, prober) = balancer(
        HealthProbe::new(),
        vec![("a", Backend::new("n", http(addr)).slots(five))],
    );
    // At its first probe (after `/slots`' 501) and once it was read (before `/slots`).
    for read_before in [false, true] {
        stub.props_hang.store(true, Ordering::Relaxed);
        prober.round(&affinity).await;
        let s = prober.status("a").unwrap();
        assert!(s.up, "{read_before}: {s:?}");
        // Asked first, `/props` took all of the probe's time.
        let error = if read_before {
            "/slots: not asked: the probe's 2s ran out before"
        } else {
            "/slots answered 501 Not Implemented, and /props did not say: no answer within 2s"
        };
        assert_eq!(s.slots_error.as_deref(), Some(error), "{read_before}");
        stub.props_hang.store(false, Ordering::Relaxed);
        let n_ctx = if read_before { 2048 } else { 4096 };
        *stub.props.lock() =
            Some(json!({"default_generation_settings": {"n_ctx": n_ctx}, "total_slots": 2}));
        prober.round(&affinity).await;
        let a = status(&affinity, "a");
        assert_eq!(
            (a.slots, a.request_context_limit),
            (5, Some(n_ctx)),
            "{read_before}"
        );
        assert_eq!(prober.status("a").unwrap().slots_error, None);
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn busy_slots_reads_slots_of_every_backend_and_learns_nothing_from_a_given_count() {
    let (b, stub_b) = start(4).await;
    *stub_b.slots.lock() = vec![true, false, true, true];
    let two = NonZeroU32::new(2).unwrap();
    let (affinity, prober) = balancer(
        HealthProbe::new().busy_slots(true),
        vec![("b", Backend::new("n", http(b)).slots(two))],
    );
    prober.round(&affinity).await;
    assert_eq!(prober.status("b").unwrap().busy_slots, Some(3));
    assert_eq!(status(&affinity, "b").slots, 2, "the given count stays");
}

/// Busy slots are those the last probe read: a backend whose `/health` fails, or whose
/// `/slots` does not answer, has none known, not the count of a probe before.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn busy_slots_are_unknown_once_a_probe_does_not_read_them() {
    let (b, stub) = start(4).await;
    *stub.slots.lock() = vec![true, false, true, true];
    let (affinity, prober) = balancer(
        HealthProbe::new().busy_slots(true),
        vec![("b", Backend::new("n", http(b)))],
    );
    prober.round(&affinity).await;
    assert_eq!(prober.status("b").unwrap().busy_slots, Some(3));
    // `/slots` fails, `/health` is ready.
    stub.slots_status.store(500, Ordering::Relaxed);
    prober.round(&affinity).await;
    let s = prober.status("b").unwrap();
    assert!(s.slots_error.is_some(), "{s:?}");
    assert_eq!(s.busy_slots, None, "{s:?}");
    stub.slots_status.store(0, Ordering::Relaxed);
    prober.round(&affinity).await;
    assert_eq!(prober.status("b").unwrap().busy_slots, Some(3));
    // `/health` fails: `/slots` is not asked.
    stub.health.store(500, Ordering::Relaxed);
    prober.round(&affinity).await;
    let s = prober.status("b").unwrap();
    assert!(s.last_error.is_some(), "{s:?}");
    assert_eq!(s.busy_slots, None, "{s:?}");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_backend_announced_again_keeps_its_learned_slots_and_a_removed_one_is_not_probed() {
    let (a, stub_a) = start(3).await;
    let (handle, fleet) = discover::channel::<Http>();
    let (fleet, prober) = HealthProbe::new().discover(fleet);
    let affinity = SessionAffinityLayer::new().layer(fleet);
    handle.insert("a", Backend::new("n", http(a)));
    prober.round(&affinity).await;
    assert_eq!(status(&affinity, "a").slots, 3);

    // An update from discovery without a count: the learned one stays.
    handle.insert("a", Backend::new("m", http(a)));
    affinity.apply_discovery();
    let s = status(&affinity, "a");
    assert_eq!((s.slots, s.node.as_str()), (3, "m"));

    handle.remove("a");
    affinity.apply_discovery();
    let hits = stub_a.health_hits.load(Ordering::Relaxed);
    prober.round(&affinity).await;
    assert_eq!(stub_a.health_hits.load(Ordering::Relaxed), hits);
    assert!(prober.status("a").is_none());
    assert!(affinity.backends().is_empty());
}

/// A backend announced again at another address is another server: once that one has
/// answered, the balancer has what it says, not what the old one said. A server there without
/// `/slots` (a vLLM, or a llama-server run with `--no-slots`) has an unknown count, taken as
/// one slot, and no request context unless its `/v1/models` gives one.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_backend_announced_again_at_another_address_has_what_the_new_server_says_once_it_answered(
) {
    let (old, _old_stub) = start(4).await;
    let (new, new_stub) = start(0).await;
    new_stub.slots_status.store(404, Ordering::Relaxed);
    let (handle, fleet) = discover::channel::<Http>();
    let (fleet, prober) = HealthProbe::new().discover(fleet);
    let affinity = SessionAffinityLayer::new().layer(fleet);
    handle.insert("a", Backend::new("n", http(old)));
    prober.round(&affinity).await;
    let s = status(&affinity, "a");
    assert_eq!((s.slots, s.request_context_limit), (4, Some(4096)));

    handle.insert("a", Backend::new("n", http(new)));
    affinity.apply_discovery();
    // Before the new server's first answer, what the old one said stands.
    assert_eq!(status(&affinity, "a").slots, 4);
    prober.round(&affinity).await;
    assert!(new_stub.slots_hits.load(Ordering::Relaxed) > 0);
    let s = status(&affinity, "a");
    assert_eq!((s.slots, s.request_context_limit), (1, None), "{s:?}");
    let p = prober.status("a").unwrap();
    assert_eq!((p.slots, p.request_context), (None, None), "{p:?}");
    // A `/v1/models` there gives its request context.
    *new_stub.models.lock() = Some(vllm_models(32_768));
    prober.round(&affinity).await;
    assert_eq!(status(&affinity, "a").request_context_limit, Some(32_768));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_backend_announced_later_is_probed_at_once() {
    let (a, stub_a) = start(3).await;
    let (handle, fleet) = discover::channel::<Http>();
    let (fleet, prober) = HealthProbe::new()
        .interval(Duration::from_secs(60))
        .discover(fleet);
    let affinity = SessionAffinityLayer::new().layer(fleet);
    let _task = prober.clone().spawn(affinity.clone());
    tokio::time::sleep(Duration::from_secs(1)).await;
    handle.insert("a", Backend::new("n", http(a)));
    // Announced to the balancer (by a request's readiness, or here by hand): probed then, not
    // a minute later.
    affinity.apply_discovery();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(stub_a.health_hits.load(Ordering::Relaxed), 1);
    assert_eq!(status(&affinity, "a").slots, 3);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn each_transition_is_logged_once() {
    let logs = logs();
    let (addr, stub) = start(1).await;
    let (affinity, prober) = balancer(
        HealthProbe::new().failure_threshold(2).success_threshold(2),
        vec![("logged", Backend::new("n", http(addr)))],
    );
    stub.health.store(500, Ordering::Relaxed);
    for _ in 0..5 {
        prober.round(&affinity).await;
    }
    stub.health.store(200, Ordering::Relaxed);
    for _ in 0..5 {
        prober.round(&affinity).await;
    }
    assert_eq!(
        said(&logs, "logged", "backend down until /health is 200"),
        1
    );
    assert_eq!(said(&logs, "logged", "backend up: /health is 200"), 1);
    assert_eq!(said(&logs, "logged", "slot count read from /slots"), 1);
    assert_eq!(prober.transitions(), 2);
}

/// The probe through its seam alone: what it asks of the balancer.
#[derive(Default)]
struct Marks(Mutex<Vec<String>>);

impl MarkHealth for Marks {
    fn mark_down(&self, id: &tower_affinity::BackendId) -> bool {
        self.0.lock().push(format!("down {id}"));
        true
    }

    fn mark_up(&self, id: &tower_affinity::BackendId) -> bool {
        self.0.lock().push(format!("up {id}"));
        true
    }

    fn apply_discovery(&self) {}
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_probe_reports_through_mark_health() {
    use futures_util::StreamExt;

    let (addr, stub) = start(1).await;
    stub.health.store(503, Ordering::Relaxed);
    let (mut fleet, prober) = HealthProbe::new()
        .success_threshold(1)
        .discover(StaticFleet::new([("a", Backend::new("n", http(addr)))]));
    // The stream is what registers backends with the prober.
    let first = fleet.next().await.unwrap().unwrap();
    assert!(matches!(first, tower::discover::Change::Insert(ref id, _) if id.as_str() == "a"));
    let marks = Marks::default();
    prober.round(&marks).await;
    stub.health.store(200, Ordering::Relaxed);
    prober.round(&marks).await;
    prober.round(&marks).await;
    assert_eq!(*marks.0.lock(), ["down a", "up a"]);
}

/// A backend with its slot count given is asked `/slots` for its request context: a failed
/// answer (a timeout while llama-server's loop is busy with a long prefill, a 500 from a proxy
/// in front of it) does not stop that; only an answer that it has no `/slots` does.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_transient_slots_failure_does_not_stop_the_request_context_being_learned() {
    let (b, stub_b) = start(2).await;
    stub_b.slots_status.store(500, Ordering::Relaxed);
    let two = NonZeroU32::new(2).unwrap();
    let (affinity, prober) = balancer(
        HealthProbe::new(),
        vec![("b", Backend::new("n", http(b)).slots(two))],
    );
    prober.round(&affinity).await;
    assert_eq!(status(&affinity, "b").request_context_limit, None);
    // It answers again.
    stub_b.slots_status.store(0, Ordering::Relaxed);
    for _ in 0..3 {
        prober.round(&affinity).await;
    }
    assert_eq!(
        status(&affinity, "b").request_context_limit,
        Some(4096),
        "never asked again after one failed /slots (hits: {})",
        stub_b.slots_hits.load(Ordering::Relaxed)
    );
}

/// A backend given more slots than its `/slots` lists (a `slots=4` for a llama-server run
/// with `-np 2`) is warned of, once: the requests past its slots would wait in the server,
/// and an `id_slot` assigned past them names one of its slots in use. One given its count, or
/// fewer (a replica's share), is not.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_backend_given_more_slots_than_its_slots_lists_is_warned_of_once() {
    let logs = logs();
    let (a, _stub_a) = start(2).await;
    let (b, _stub_b) = start(2).await;
    let (c, _stub_c) = start(2).await;
    let given = |n| NonZeroU32::new(n).unwrap();
    let (affinity, prober) = balancer(
        HealthProbe::new(),
        vec![
            (
                "a",
                Backend::new("n", http(a)).slots(given(4)).assign_slots(),
            ),
            (
                "b",
                Backend::new("n", http(b)).slots(given(2)).assign_slots(),
            ),
            ("c", Backend::new("n", http(c)).slots(given(1))),
        ],
    );
    for _ in 0..3 {
        prober.round(&affinity).await;
    }
    let warning = "more slots given than /slots lists";
    assert_eq!(said(&logs, "a", warning), 1, "{}", logs.text());
    assert!(logs.text().contains("given=4 listed=2"), "{}", logs.text());
    assert_eq!(said(&logs, "b", warning), 0);
    assert_eq!(said(&logs, "c", warning), 0);
    // The count given stands: the warning changes nothing.
    assert_eq!(status(&affinity, "a").slots, 4);
}

/// A llama-server whose slots the router assigns goes behind `IdSlot`, around its
/// `HttpBackend`: the probe reaches it where that `HttpBackend` sends, and learns its slots.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn an_id_slot_backend_is_probed_where_its_http_backend_sends() {
    let (addr, stub) = start(3).await;
    let llama = IdSlotLayer::new().layer(http(addr));
    let fleet = StaticFleet::new([("a", Backend::new("n", llama).assign_slots())]);
    let (fleet, prober) = HealthProbe::new().discover(fleet);
    let affinity = SessionAffinityLayer::new().layer(fleet);
    prober.round(&affinity).await;
    assert!(stub.health_hits.load(Ordering::Relaxed) > 0);
    let a = affinity.backends().pop().unwrap();
    assert_eq!((a.id.as_str(), a.slots), ("a", 3), "learned through IdSlot");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_backend_with_its_slots_given_and_no_slots_endpoint_is_not_asked_again_for_its_context() {
    let (b, stub_b) = start(2).await;
    stub_b.slots_status.store(404, Ordering::Relaxed);
    let two = NonZeroU32::new(2).unwrap();
    let (affinity, prober) = balancer(
        HealthProbe::new(),
        vec![("b", Backend::new("n", http(b)).slots(two))],
    );
    for _ in 0..3 {
        prober.round(&affinity).await;
    }
    assert_eq!(stub_b.slots_hits.load(Ordering::Relaxed), 1);
    // A 404 is no llama-server's: its `/props` is not asked.
    assert_eq!(stub_b.props_hits.load(Ordering::Relaxed), 0);
    let s = prober.status("b").unwrap();
    assert_eq!(
        s.slots_error.as_deref(),
        Some("/slots answered 404 Not Found")
    );
    assert_eq!(status(&affinity, "b").request_context_limit, None);
}

/// vLLM's `/v1/models` for one model of `max_model_len` tokens, and a LoRA adapter on it.
fn vllm_models(max_model_len: u64) -> Value {
    json!({"object": "list", "data": [
        {"id": "qwen", "object": "model", "owned_by": "vllm", "max_model_len": max_model_len},
        {"id": "qwen-lora", "object": "model", "owned_by": "vllm", "parent": "qwen",
         "max_model_len": max_model_len},
    ]})
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_backend_without_slots_learns_its_request_context_from_v1_models() {
    let logs = logs();
    // Two vLLM-like backends (no `/slots`), one with its slot count given; a third given its
    // request context.
    let mut stubs = Vec::new();
    for _ in 0..3 {
        let (addr, stub) = start(0).await;
        stub.slots_status.store(404, Ordering::Relaxed);
        *stub.models.lock() = Some(vllm_models(32_768));
        stubs.push((addr, stub));
    }
    let two = NonZeroU32::new(2).unwrap();
    let given = NonZeroU64::new(1_000).unwrap();
    let (affinity, prober) = balancer(
        HealthProbe::new(),
        vec![
            (
                "v-slots-given",
                Backend::new("n", http(stubs[0].0)).slots(two),
            ),
            ("w", Backend::new("n", http(stubs[1].0))),
            (
                "x",
                Backend::new("n", http(stubs[2].0)).request_context_tokens(given),
            ),
        ],
    );
    prober.round(&affinity).await;
    assert_eq!(
        status(&affinity, "v-slots-given").request_context_limit,
        Some(32_768)
    );
    assert_eq!(status(&affinity, "w").request_context_limit, Some(32_768));
    assert_eq!(status(&affinity, "x").request_context_limit, Some(1_000));
    assert_eq!(
        prober.status("w").unwrap().request_context,
        NonZeroU64::new(32_768)
    );
    // The slot counts are what they were: given, and one slot until one is read.
    assert_eq!(status(&affinity, "v-slots-given").slots, 2);
    assert_eq!(status(&affinity, "w").slots, 1);
    assert_eq!(stubs[2].1.models_hits.load(Ordering::Relaxed), 0, "given");
    assert_eq!(
        said(
            &logs,
            "v-slots-given",
            "request context read from /v1/models"
        ),
        1
    );

    // Restarted with a longer context: followed, `/slots` not asked again for it.
    *stubs[0].1.models.lock() = Some(vllm_models(65_536));
    prober.round(&affinity).await;
    assert_eq!(
        status(&affinity, "v-slots-given").request_context_limit,
        Some(65_536)
    );
    assert_eq!(stubs[0].1.slots_hits.load(Ordering::Relaxed), 1);
    // An answer without it, or none, keeps the last one read.
    *stubs[0].1.models.lock() = Some(json!({"object": "list", "data": []}));
    *stubs[1].1.models.lock() = None;
    prober.round(&affinity).await;
    assert_eq!(
        status(&affinity, "v-slots-given").request_context_limit,
        Some(65_536)
    );
    assert_eq!(status(&affinity, "w").request_context_limit, Some(32_768));
    let s = prober.status("w").unwrap();
    assert!((s.up, s.failures) == (true, 0), "{s:?}");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_backend_restarted_as_another_server_is_asked_its_slots_again() {
    // vLLM-like (no `/slots`), its slot count given: its context comes from `/v1/models`.
    let (addr, stub) = start(2).await;
    stub.slots_status.store(404, Ordering::Relaxed);
    *stub.models.lock() = Some(vllm_models(32_768));
    let two = NonZeroU32::new(2).unwrap();
    let probe = HealthProbe::new().failure_threshold(1);
    let (affinity, prober) = balancer(probe, vec![("v", Backend::new("n", http(addr)).slots(two))]);
    for _ in 0..2 {
        prober.round(&affinity).await;
    }
    assert_eq!(status(&affinity, "v").request_context_limit, Some(32_768));
    assert_eq!(stub.slots_hits.load(Ordering::Relaxed), 1, "asked once");
    // Restarted as llama-server at the same address: loading, then ready with slots of
    // 4,096 tokens each and no `max_model_len`.
    stub.health.store(503, Ordering::Relaxed);
    prober.round(&affinity).await;
    assert!(!prober.status("v").unwrap().up);
    stub.health.store(200, Ordering::Relaxed);
    stub.slots_status.store(0, Ordering::Relaxed);
    *stub.models.lock() = None;
    prober.round(&affinity).await;
    assert_eq!(stub.slots_hits.load(Ordering::Relaxed), 2);
    assert_eq!(status(&affinity, "v").request_context_limit, Some(4_096));
    assert_eq!(status(&affinity, "v").slots, 2, "the count given stays");
    // And a server without slots again is asked once more, then no longer.
    stub.health.store(500, Ordering::Relaxed);
    prober.round(&affinity).await;
    stub.health.store(200, Ordering::Relaxed);
    stub.slots_status.store(404, Ordering::Relaxed);
    *stub.models.lock() = Some(vllm_models(16_384));
    for _ in 0..3 {
        prober.round(&affinity).await;
    }
    assert_eq!(stub.slots_hits.load(Ordering::Relaxed), 3);
    assert_eq!(status(&affinity, "v").request_context_limit, Some(16_384));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_backend_with_slots_is_not_asked_its_models() {
    let (a, stub_a) = start(2).await;
    *stub_a.models.lock() = Some(vllm_models(131_072));
    let (affinity, prober) = balancer(HealthProbe::new(), vec![("a", Backend::new("n", http(a)))]);
    for _ in 0..2 {
        prober.round(&affinity).await;
    }
    // `/slots` says each slot's context; `/v1/models` is not asked.
    assert_eq!(status(&affinity, "a").request_context_limit, Some(4096));
    assert_eq!(stub_a.models_hits.load(Ordering::Relaxed), 0);
    // Nor with learning off.
    let (b, stub_b) = start(0).await;
    stub_b.slots_status.store(404, Ordering::Relaxed);
    *stub_b.models.lock() = Some(vllm_models(131_072));
    let probe = HealthProbe::new().learn_slots(false);
    let (affinity, prober) = balancer(probe, vec![("b", Backend::new("n", http(b)))]);
    prober.round(&affinity).await;
    assert_eq!(status(&affinity, "b").request_context_limit, None);
    assert_eq!(stub_b.models_hits.load(Ordering::Relaxed), 0);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn v1_models_is_asked_only_of_a_ready_backend_and_its_context_announced_once() {
    let logs = logs();
    let (addr, stub) = start(0).await;
    stub.slots_status.store(404, Ordering::Relaxed);
    *stub.models.lock() = Some(vllm_models(8_192));
    let probe = HealthProbe::new()
        .timeout(Duration::from_secs(2))
        .failure_threshold(1);
    let (affinity, prober) = balancer(probe, vec![("m1", Backend::new("n", http(addr)))]);
    for _ in 0..3 {
        prober.round(&affinity).await;
    }
    // Read each round, announced once: an unchanged context is not announced again.
    assert_eq!(stub.models_hits.load(Ordering::Relaxed), 3);
    assert_eq!(said(&logs, "m1", "request context read from /v1/models"), 1);
    assert_eq!(status(&affinity, "m1").request_context_limit, Some(8_192));
    // Loading or failing: `/v1/models` is not asked (it would only add a timeout).
    for code in [503, 500] {
        stub.health.store(code, Ordering::Relaxed);
        prober.round(&affinity).await;
    }
    assert_eq!(stub.models_hits.load(Ordering::Relaxed), 3);
    assert!(!prober.status("m1").unwrap().up);
    // A `/slots` failing otherwise than with "none" (a 500 from a proxy) is no reason either.
    stub.health.store(200, Ordering::Relaxed);
    stub.slots_status.store(500, Ordering::Relaxed);
    prober.round(&affinity).await;
    assert_eq!(stub.models_hits.load(Ordering::Relaxed), 3);
    // A `/v1/models` that never answers holds the probe for its timeout, and takes nothing
    // down nor the context away.
    stub.slots_status.store(404, Ordering::Relaxed);
    stub.models_hang.store(true, Ordering::Relaxed);
    let started = tokio::time::Instant::now();
    prober.round(&affinity).await;
    let took = started.elapsed();
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(3),
        "{took:?}"
    );
    let s = prober.status("m1").unwrap();
    assert!(s.up && s.failures == 0, "{s:?}");
    assert_eq!(status(&affinity, "m1").request_context_limit, Some(8_192));
    assert!(status(&affinity, "m1").healthy);
}

/// A backend spoken to in HTTP/2 with prior knowledge (an `h2c` front that takes nothing
/// else) is probed in HTTP/2 too: asked in HTTP/1.1, it would never answer, and be down for
/// good.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_backend_spoken_to_in_http2_is_probed_in_http2() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((io, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(
                    |req: http::Request<hyper::body::Incoming>| async move {
                        let body = match req.uri().path() {
                            "/health" => json!({"status": "ok"}),
                            "/slots" => json!([{"id": 0, "n_ctx": 4096}, {"id": 1, "n_ctx": 4096}]),
                            _ => json!({"error": "not found"}),
                        };
                        let body = Full::new(Bytes::from(body.to_string()));
                        Ok::<_, std::convert::Infallible>(http::Response::new(body))
                    },
                );
                let http2 = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
                let _ = http2.serve_connection(TokioIo::new(io), svc).await;
            });
        }
    });
    let backend = HttpBackend::builder()
        .http2_prior_knowledge(true)
        .build(&format!("http://{addr}"))
        .unwrap();
    let (affinity, prober) = balancer(HealthProbe::new(), vec![("h2", Backend::new("n", backend))]);
    prober.round(&affinity).await;
    let s = prober.status("h2").unwrap();
    assert!(s.up && s.last_error.is_none(), "{s:?}");
    let b = status(&affinity, "h2");
    assert!(b.healthy);
    assert_eq!((b.slots, b.request_context_limit), (2, Some(4096)));
}

/// A backend that does not answer is probed again as soon as its probe runs out, when an
/// interval ended meanwhile, rather than at the next interval: with the timeout as long as the
/// interval (the defaults, 2 s each) or a little longer, three failures in a row take it down
/// after three timeouts, where they took five intervals.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_backend_that_does_not_answer_is_probed_again_as_soon_as_its_probe_runs_out() {
    for (timeout, down_by) in [(2000, 6500), (2500, 8000)] {
        let (addr, stub) = start(1).await;
        let (affinity, prober) = balancer(
            HealthProbe::new().timeout(Duration::from_millis(timeout)),
            vec![("hung", Backend::new("n", http(addr)))],
        );
        prober.round(&affinity).await;
        assert!(prober.status("hung").unwrap().up);
        stub.hang.store(true, Ordering::Relaxed);
        let task = prober.clone().spawn(affinity.clone());
        tokio::time::sleep(Duration::from_millis(down_by)).await;
        let s = prober.status("hung").unwrap();
        assert_eq!(
            (s.failures, s.up),
            (3, false),
            "timeout {timeout} ms: {s:?}"
        );
        assert!(!status(&affinity, "hung").healthy);
        // The round, then one probe at a time: the fourth is out.
        assert_eq!(
            stub.health_hits.load(Ordering::Relaxed),
            5,
            "timeout {timeout} ms"
        );
        drop(task);
    }
}

/// A probe given the backends' API key sends it with every request: a llama-server run with
/// `--api-key` gives its slots (it answers `/slots` with a 401 without the key, and counted
/// as one slot), a vLLM run with one its `max_model_len` (its `/v1/models` wants the key too).
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_probe_given_the_backends_api_key_reads_slots_and_models_that_want_it() {
    let logs = logs();
    let (llama, llama_stub) = start(4).await;
    let (vllm, vllm_stub) = start(0).await;
    vllm_stub.slots_status.store(404, Ordering::Relaxed);
    *vllm_stub.models.lock() = Some(vllm_models(32_768));
    for stub in [&llama_stub, &vllm_stub] {
        *stub.authorization.lock() = Some("Bearer k");
    }
    let backends = || {
        vec![
            ("llama", Backend::new("n", http(llama))),
            ("vllm", Backend::new("n", http(vllm)).slots(NonZeroU32::MIN)),
        ]
    };

    // Without the key: up, as `/health` is public, but one slot and no context, and both
    // say why (each logged once, however many rounds fail).
    let (affinity, prober) = balancer(HealthProbe::new(), backends());
    prober.round(&affinity).await;
    prober.round(&affinity).await;
    assert!(status(&affinity, "llama").healthy);
    assert_eq!(status(&affinity, "llama").slots, 1);
    assert_eq!(
        prober.status("llama").unwrap().slots_error.as_deref(),
        Some(
            "/slots answered 401 Unauthorized: the backend wants an API key, and the probe \
             was given none or another (HealthProbe::header)"
        )
    );
    assert_eq!(status(&affinity, "vllm").request_context_limit, None);
    assert_eq!(
        prober.status("vllm").unwrap().models_error.as_deref(),
        Some(
            "/v1/models answered 401 Unauthorized: the backend wants an API key, and the \
             probe was given none or another (HealthProbe::header)"
        )
    );
    assert_eq!(said(&logs, "vllm", "not readable from /v1/models"), 1);
    assert_eq!(said(&logs, "llama", "not readable from /slots"), 1);

    // With it: read, and sent to `/health` too.
    let bearer = axum::http::HeaderValue::from_static("Bearer k");
    let probe = HealthProbe::new().header(axum::http::header::AUTHORIZATION, bearer);
    let (affinity, prober) = balancer(probe, backends());
    prober.round(&affinity).await;
    assert_eq!(status(&affinity, "llama").slots, 4);
    assert_eq!(status(&affinity, "llama").request_context_limit, Some(4096));
    assert_eq!(prober.status("llama").unwrap().slots_error, None);
    assert_eq!(
        status(&affinity, "vllm").request_context_limit,
        Some(32_768)
    );
    assert_eq!(prober.status("vllm").unwrap().models_error, None);
    let seen = llama_stub.health_authorization.lock().clone();
    assert_eq!(seen, [None, None, Some("Bearer k".to_string())]);
}

/// The key given to the probe is a secret: neither the probe's nor the prober's `Debug`
/// shows it, nor does anything the probe logs or reports, with a key the backend refuses.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_probes_api_key_is_never_shown_nor_logged() {
    let logs = logs();
    let (a, stub) = start(2).await;
    *stub.authorization.lock() = Some("Bearer right");
    let key = "Bearer sk-wrong-9f2c";
    let probe = HealthProbe::new()
        .header(
            axum::http::header::AUTHORIZATION,
            axum::http::HeaderValue::from_static(key),
        )
        .header(
            axum::http::HeaderName::from_static("x-api-key"),
            axum::http::HeaderValue::from_static("sk-other-77aa"),
        );
    assert!(!format!("{probe:?}").contains("sk-"), "{probe:?}");
    let (affinity, prober) = balancer(probe, vec![("a", Backend::new("n", http(a)))]);
    prober.round(&affinity).await;
    let s = prober.status("a").unwrap();
    assert_eq!(
        s.slots_error.as_deref(),
        Some(
            "/slots answered 401 Unauthorized: the backend wants an API key, and the probe \
             was given none or another (HealthProbe::header)"
        )
    );
    assert_eq!(said(&logs, "a", "slot count not readable from /slots"), 1);
    let shown = format!("{prober:?} {:?} {s:?} {}", prober.config(), logs.text());
    assert!(!shown.contains("sk-"), "{shown}");
    assert!(shown.contains("Sensitive"), "{shown}");
}

/// A backend service of one's own that sends under a path prefix (a gateway that routes
/// `/llama-a/...` to one server): its base URI has the prefix.
#[derive(Clone, Debug)]
struct Behind(http::Uri);

impl tower_affinity::health::ProbeTarget for Behind {
    fn base_uri(&self) -> &http::Uri {
        &self.0
    }
}

/// A base URI with a path prefix is probed under it, with or without a trailing `/`: the
/// gateway's own `/health` (here a 404) is not the backend's.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_probe_path_goes_under_the_base_uris_path_prefix() {
    use futures_util::StreamExt;

    let stub = Arc::new(Stub {
        health: AtomicU16::new(200),
        slots: Mutex::new(vec![false; 3]),
        n_ctx: Mutex::new(Some(json!(4096))),
        ..Stub::default()
    });
    let backend = Router::new()
        .route("/health", get(health))
        .route("/slots", get(slots))
        .route("/props", get(props))
        .with_state(stub.clone());
    let gateway = Router::new().nest("/llama-a", backend);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, gateway).await });
    for base in [
        format!("http://{addr}/llama-a/"),
        format!("http://{addr}/llama-a"),
    ] {
        let target = Behind(base.parse().unwrap());
        let (mut fleet, prober) =
            HealthProbe::new().discover(StaticFleet::new([("a", Backend::new("n", target))]));
        fleet.next().await.unwrap().unwrap();
        let marks = Marks::default();
        prober.round(&marks).await;
        let s = prober.status("a").unwrap();
        assert!(s.up && s.last_error.is_none(), "{base}: {s:?}");
        assert_eq!(s.slots.map(NonZeroU32::get), Some(3), "{base}");
        assert!(marks.0.lock().is_empty(), "{base}");
    }
}

/// A backend given its request context and moved to a server without `/slots` loses the
/// slot count read at the old address once the new server answers, though nothing else
/// was learned there: it counts as one slot.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_backend_given_its_context_and_moved_to_a_server_without_slots_counts_one_slot() {
    let (old, _old_stub) = start(4).await;
    let (new, new_stub) = start(0).await;
    new_stub.slots_status.store(404, Ordering::Relaxed);
    let given = NonZeroU64::new(1_000).unwrap();
    let (handle, fleet) = discover::channel::<Http>();
    let (fleet, prober) = HealthProbe::new().discover(fleet);
    let affinity = SessionAffinityLayer::new().layer(fleet);
    handle.insert(
        "a",
        Backend::new("n", http(old)).request_context_tokens(given),
    );
    prober.round(&affinity).await;
    assert_eq!(status(&affinity, "a").slots, 4);
    handle.insert(
        "a",
        Backend::new("n", http(new)).request_context_tokens(given),
    );
    affinity.apply_discovery();
    assert_eq!(
        status(&affinity, "a").slots,
        4,
        "before the new server answers"
    );
    prober.round(&affinity).await;
    assert!(new_stub.slots_hits.load(Ordering::Relaxed) > 0);
    let a = status(&affinity, "a");
    assert_eq!(
        (a.slots, a.request_context_limit),
        (1, Some(1_000)),
        "{a:?}"
    );
}

/// A backend announced again at another address while a probe of the old one is out is
/// probed at the new one each interval, and not once more when the old probe runs out: that
/// probe was owed to the old server.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_probe_owed_to_a_backends_old_address_is_not_sent_to_its_new_one() {
    let (old, old_stub) = start(1).await;
    let (new, new_stub) = start(1).await;
    old_stub.hang.store(true, Ordering::Relaxed);
    let (handle, fleet) = discover::channel::<Http>();
    let (fleet, prober) = HealthProbe::new()
        .interval(Duration::from_secs(1))
        .timeout(Duration::from_millis(4500))
        .discover(fleet);
    let affinity = SessionAffinityLayer::new().layer(fleet);
    handle.insert("a", Backend::new("n", http(old)));
    affinity.apply_discovery();
    let _task = prober.clone().spawn(affinity.clone());
    // The old server's probe is out from 0 s to 4.5 s; intervals end at 1 s and 2 s meanwhile.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(old_stub.health_hits.load(Ordering::Relaxed), 1);
    handle.insert("a", Backend::new("n", http(new)));
    affinity.apply_discovery();
    // The new server is probed at 3 s and 4 s, and at 5 s: not at 4.5 s as well.
    tokio::time::sleep(Duration::from_millis(2700)).await;
    assert_eq!(new_stub.health_hits.load(Ordering::Relaxed), 3);
    assert_eq!(old_stub.health_hits.load(Ordering::Relaxed), 1);
}
