//! A stress run of the service on a multi-thread runtime: many clients sending keyed and keyless
//! requests over a few backends with tight slots, cancelling at random (while waiting for a
//! slot, midway through a body, right after readiness), while the fleet changes (backends
//! removed, inserted again, their slots updated, moved to another node, marked down and up).
//! At the end, with every client done: nothing in flight, nobody waiting, every request
//! answered, no request sent to a backend after its removal, and a full round of requests
//! served at once; then rounds of every slot held and requests waiting, the slots freed from
//! several tasks while some waiters give up, in which every waiter that stays is served.
//!
//! A request placed on a backend that was not ready yet (half the backends, in half the runs,
//! are ready only a few milliseconds after their first poll) holds its slot there, and is sent
//! once the backend is ready, removed or not: those are counted apart and not held against
//! the removal.
//!
//! In most runs the service has a short readiness timeout (20 to 200 ms, drawn from the
//! seed): the odd backends' clones are then ready after a delay drawn around it (a third
//! within 3 ms, the rest between half and one and a half times the timeout), and backend 0 is
//! never ready while a gate is shut (stretches of a half to three timeouts). Besides the
//! above: every request that timed out waiting for readiness failed with `Error::Backend`,
//! 504, no sooner than the timeout, on a backend that can be slow, was never sent to it, and
//! found it listed down right after (or removed, or its health changed by the chaos task
//! meanwhile); no request was sent much later than the timeout after its backend's first
//! readiness poll; and the service's counters (`placed()`, `rejected`, `no_backends`,
//! `abandoned`, `backend_errors` and each backend's `failures`) add up with what the
//! clients saw, a dropped response future counted by the state it was dropped in.
//!
//! Ignored by default (it runs for seconds of real time). `STRESS_SEED`, `STRESS_THREADS`,
//! `STRESS_SECS` and `STRESS_RUNS` pick the runs:
//!
//! ```text
//! STRESS_SEED=7 STRESS_THREADS=4 cargo test --test stress -- --ignored --nocapture
//! ```

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Once};
use std::task::{Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame};
use http_body_util::StreamBody;
use parking_lot::Mutex;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tower::util::BoxCloneSyncService;
use tower::{Layer, Service, ServiceExt};
use tower_affinity::discover::{self, FleetChannel, FleetHandle};
use tower_affinity::key::{HeaderKey, PromptFacts};
use tower_affinity::placement::NodeThenBackend;
use tower_affinity::{
    Backend, BoxError, Decision, Error, Overflow, PromptChain, ResponseBody, SessionAffinity,
    SessionAffinityLayer,
};

type Chunk = Result<Frame<Bytes>, BoxError>;
type MockBody = StreamBody<UnboundedReceiverStream<Chunk>>;
type Req = http::Request<String>;
type MockService = BoxCloneSyncService<Req, http::Response<MockBody>, BoxError>;
type Svc = SessionAffinity<FleetChannel<MockService>, HeaderKey, NodeThenBackend>;
type Res = http::Response<ResponseBody<MockBody>>;

const BACKENDS: usize = 4;
const NODES: usize = 3;
const CLIENTS: usize = 64;
/// Most requests one client sends in a run.
const PER_CLIENT: u64 = 400;
/// A response future or a body frame that takes longer than this is hung: every wait and
/// every answer here is far shorter.
const HANG: Duration = Duration::from_secs(5);

/// A small seeded generator (SplitMix64).
#[derive(Clone, Debug)]
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed ^ 0x5851_f42d_4c95_7f2d)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// What happened, counted.
#[derive(Default, Debug)]
struct Tally {
    issued: AtomicU64,
    ok: AtomicU64,
    ok_503: AtomicU64,
    saturated: AtomicU64,
    saturated_at_deadline: AtomicU64,
    no_backends: AtomicU64,
    backend_errors: AtomicU64,
    other_errors: AtomicU64,
    waited: AtomicU64,
    dropped_after_ready: AtomicU64,
    dropped_unpolled: AtomicU64,
    cancelled: AtomicU64,
    cancelled_waiting: AtomicU64,
    bodies_ended: AtomicU64,
    bodies_dropped: AtomicU64,
    body_errors: AtomicU64,
    hung_futures: AtomicU64,
    hung_bodies: AtomicU64,
    missing_decision: AtomicU64,
    removals: AtomicU64,
    inserts: AtomicU64,
    updates: AtomicU64,
    moves: AtomicU64,
    marks_down: AtomicU64,
    marks_up: AtomicU64,
    backend_calls: AtomicU64,
    producers: AtomicUsize,
    over_slots: AtomicU64,
    over_queued: AtomicU64,
    /// Requests that failed because their backend was not ready within `ready_timeout`.
    ready_timeouts: AtomicU64,
    /// Of them, those whose backend was listed down right after (the rest: removed, or a
    /// mark changed by the chaos task meanwhile).
    ready_timeouts_seen_down: AtomicU64,
    ready_timeouts_removed: AtomicU64,
    ready_timeouts_excused: AtomicU64,
    /// Requests dropped (unpolled or cancelled) whose future said it was placed (calling, or
    /// waiting for its backend), waiting for a slot, or done (refused).
    dropped_placed: AtomicU64,
    dropped_waiting: AtomicU64,
    dropped_done: AtomicU64,
    /// Requests sent to a backend they had waited for the readiness of, and the longest such
    /// wait (microseconds).
    sent_after_pending: AtomicU64,
    longest_pending_us: AtomicU64,
    /// The next request id (`x-id`).
    next_id: AtomicU64,
    /// The ids of the requests some backend was called with.
    called: Mutex<HashSet<u64>>,
    /// The requests that timed out waiting for readiness: id and backend.
    timed_out: Mutex<Vec<(u64, String)>>,
    /// Failures observed per backend: `Error::Backend` results and 503 answers.
    failures_seen: Mutex<HashMap<String, u64>>,
    /// Readiness timeouts per backend.
    timeouts_by_backend: Mutex<HashMap<String, u64>>,
    /// Invariant violations found by the clients as they happen (the first few, and a count).
    violations: Mutex<Vec<String>>,
    violation_count: AtomicU64,
    /// When the chaos task last changed a backend's health (mark down or up, removal,
    /// insertion), in microseconds since `epoch`, and whether it is doing so now.
    health_events: [AtomicU64; BACKENDS],
    health_busy: [AtomicBool; BACKENDS],
    epoch: Mutex<Option<Instant>>,
}

impl Tally {
    fn violation(&self, what: String) {
        bump(&self.violation_count);
        let mut v = self.violations.lock();
        if v.len() < 20 {
            v.push(what);
        }
    }

    fn micros_since_epoch(&self, t: Instant) -> u64 {
        let epoch = self.epoch.lock().expect("epoch set");
        t.saturating_duration_since(epoch).as_micros() as u64
    }

    /// The chaos task is about to change backend `b`'s health.
    fn health_begin(&self, b: usize) {
        self.health_busy[b].store(true, Ordering::SeqCst);
    }

    /// It has.
    fn health_end(&self, b: usize) {
        let now = self.micros_since_epoch(Instant::now());
        self.health_events[b].store(now, Ordering::SeqCst);
        self.health_busy[b].store(false, Ordering::SeqCst);
    }

    /// Whether the chaos task changed backend `b`'s health since `since`, or is doing so.
    fn health_changed_since(&self, b: usize, since: Instant) -> bool {
        self.health_busy[b].load(Ordering::SeqCst)
            || self.health_events[b].load(Ordering::SeqCst) >= self.micros_since_epoch(since)
    }
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

fn get(c: &AtomicU64) -> u64 {
    c.load(Ordering::Relaxed)
}

/// One incarnation of a backend: from its insertion to its removal.
#[derive(Debug)]
struct Incarnation {
    name: String,
    /// When its removal had been applied to the service.
    retired: Mutex<Option<Instant>>,
    /// Requests it received after that, and how long after.
    late: Mutex<Vec<Duration>>,
    /// The same, for requests placed on it while it was not ready yet.
    late_delayed: Mutex<Vec<Duration>>,
}

/// Counts a body producer for as long as it runs.
struct Producer(Arc<Tally>);

impl Producer {
    fn new(tally: &Arc<Tally>) -> Self {
        tally.producers.fetch_add(1, Ordering::SeqCst);
        Producer(tally.clone())
    }
}

impl Drop for Producer {
    fn drop(&mut self) {
        self.0.producers.fetch_sub(1, Ordering::SeqCst);
    }
}

fn mode_of(req: &Req) -> (String, u64) {
    let h = |n: &str| {
        req.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    (h("x-mode"), h("x-rand").parse().unwrap_or(0))
}

/// A mock backend: answers after a short random time with a body of a few frames; some
/// answers fail, some are 503, some bodies fail or end midway. `hold` answers at once with a
/// body that stays open until dropped.
fn mock(inc: Arc<Incarnation>, tally: Arc<Tally>) -> MockService {
    BoxCloneSyncService::new(tower::service_fn(move |req: Req| {
        let (inc, tally) = (inc.clone(), tally.clone());
        let called = Instant::now();
        bump(&tally.backend_calls);
        if let Some(id) = req
            .headers()
            .get("x-id")
            .and_then(|v| v.to_str().ok()?.parse().ok())
        {
            tally.called.lock().insert(id);
        }
        if let Some(Delayed(d)) = req.extensions().get::<Delayed>() {
            bump(&tally.sent_after_pending);
            tally
                .longest_pending_us
                .fetch_max(d.as_micros() as u64, Ordering::Relaxed);
        }
        if let Some(t) = *inc.retired.lock() {
            let late = called.saturating_duration_since(t);
            match req.extensions().get::<Delayed>() {
                Some(_) => inc.late_delayed.lock().push(late),
                None => inc.late.lock().push(late),
            }
        }
        async move {
            let (mode, r) = mode_of(&req);
            let mut rng = Rng::new(r);
            let (tx, rx) = mpsc::unbounded_channel::<Chunk>();
            let body = StreamBody::new(UnboundedReceiverStream::new(rx));
            if mode == "hold" {
                let p = Producer::new(&tally);
                tokio::spawn(async move {
                    let _p = p;
                    tx.closed().await;
                });
                return Ok(http::Response::new(body));
            }
            tokio::time::sleep(Duration::from_millis(rng.below(6))).await;
            let p = rng.below(1000);
            if p < 12 {
                return Err::<_, BoxError>(format!("{} failed", inc.name).into());
            }
            if p < 24 {
                drop(tx);
                let mut res = http::Response::new(body);
                *res.status_mut() = http::StatusCode::SERVICE_UNAVAILABLE;
                return Ok(res);
            }
            let prompt: u64 = req
                .headers()
                .get("x-prompt-tokens")
                .and_then(|v| v.to_str().ok()?.parse().ok())
                .unwrap_or(0);
            let cached = prompt.saturating_sub(rng.below(prompt / 2 + 1));
            let frames = 1 + rng.below(4);
            let fail_at = (p < 80).then(|| rng.below(frames));
            let end_at = (80..130).contains(&p).then(|| rng.below(frames));
            let producer = Producer::new(&tally);
            tokio::spawn(async move {
                let _p = producer;
                for i in 0..frames {
                    if fail_at == Some(i) {
                        let _ = tx.send(Err("body failed midway".into()));
                        return;
                    }
                    if end_at == Some(i) {
                        return;
                    }
                    let chunk = if i + 1 == frames && prompt > 0 {
                        Bytes::from(format!(
                            r#"{{"usage":{{"prompt_tokens":{prompt},"prompt_tokens_details":{{"cached_tokens":{cached}}}}}}}"#
                        ))
                    } else {
                        Bytes::from(format!("{{\"frame\":{i}}}\n"))
                    };
                    if tx.send(Ok(Frame::data(chunk))).is_err() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(rng.below(4))).await;
                }
            });
            let mut res = http::Response::new(body);
            res.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/json"),
            );
            Ok(res)
        }
    }))
}

/// Marks a request that its backend was not ready for at first: how long after its first
/// readiness poll it was sent.
#[derive(Clone, Copy, Debug)]
struct Delayed(Duration);

/// What makes the slow backends slow, shared by all their clones.
#[derive(Debug, Default)]
struct Slowness {
    /// Everything is ready at once (the final rounds).
    calm: AtomicBool,
    /// The readiness timeout the delays are drawn around; `None`: the few milliseconds of
    /// the runs without a short timeout.
    around: Option<Duration>,
    /// Draws the delays (SplitMix64 over a counter).
    draws: AtomicU64,
    seed: u64,
    /// The gated backend's gate: while shut, it is never ready.
    shut: AtomicBool,
    wakers: Mutex<Vec<Waker>>,
}

impl Slowness {
    /// A delay for one clone of a slow backend: when drawn around the timeout, a third of
    /// them ready within a few milliseconds, the rest between half and one and a half times
    /// the timeout.
    fn draw(&self, fixed: Duration) -> Duration {
        if self.calm.load(Ordering::Relaxed) {
            return Duration::ZERO;
        }
        let Some(t) = self.around else { return fixed };
        let n = self.draws.fetch_add(1, Ordering::Relaxed);
        let mut rng = Rng::new(self.seed ^ n.wrapping_mul(0x2545_f491_4f6c_dd1d));
        let t = t.as_micros() as u64;
        if rng.chance(33) {
            Duration::from_micros(rng.below(3_000))
        } else {
            Duration::from_micros(t / 2 + rng.below(t))
        }
    }

    fn open(&self) -> bool {
        self.calm.load(Ordering::SeqCst) || !self.shut.load(Ordering::SeqCst)
    }

    fn set_shut(&self, shut: bool) {
        self.shut.store(shut, Ordering::SeqCst);
        if !shut {
            for w in std::mem::take(&mut *self.wakers.lock()) {
                w.wake();
            }
        }
    }
}

/// A backend each clone of which is ready only some time after its first readiness poll, as
/// a pool that must connect first: a few milliseconds, or (with a short readiness timeout) a
/// delay drawn around that timeout for each clone. Or, `gated`, a backend that is never
/// ready while its gate is shut (stretches of up to a few timeouts).
#[derive(Clone)]
struct SlowReady {
    inner: MockService,
    delay: Duration,
    slowness: Arc<Slowness>,
    gated: bool,
    /// When first polled, and when it is ready then.
    first_poll: Option<Instant>,
    ready_at: Option<Instant>,
    /// Whether a readiness poll ever found it pending.
    pending: bool,
}

impl SlowReady {
    fn new(inner: MockService, delay: Duration, slowness: Arc<Slowness>, gated: bool) -> Self {
        SlowReady {
            inner,
            delay,
            slowness,
            gated,
            first_poll: None,
            ready_at: None,
            pending: false,
        }
    }
}

impl Service<Req> for SlowReady {
    type Response = http::Response<MockBody>;
    type Error = BoxError;
    type Future = <MockService as Service<Req>>::Future;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> Poll<Result<(), BoxError>> {
        let now = Instant::now();
        self.first_poll.get_or_insert(now);
        if self.gated {
            if !self.slowness.open() {
                self.slowness.wakers.lock().push(cx.waker().clone());
                // Opened meanwhile: its wakers may have been taken before this one went in.
                if !self.slowness.open() {
                    self.pending = true;
                    return Poll::Pending;
                }
            }
            return self.inner.poll_ready(cx);
        }
        let at = match self.ready_at {
            Some(at) => at,
            None => *self.ready_at.insert(now + self.slowness.draw(self.delay)),
        };
        if now < at && !self.slowness.calm.load(Ordering::Relaxed) {
            let waker = cx.waker().clone();
            tokio::spawn(async move {
                tokio::time::sleep_until(at).await;
                waker.wake();
            });
            self.pending = true;
            return Poll::Pending;
        }
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Req) -> Self::Future {
        if self.pending {
            let first = self.first_poll.unwrap_or_else(Instant::now);
            req.extensions_mut().insert(Delayed(first.elapsed()));
        }
        self.inner.call(req)
    }
}

/// The run's settings, drawn from its seed.
#[derive(Clone, Copy, Debug)]
struct Settings {
    seed: u64,
    threads: usize,
    secs: u64,
    max_wait: Duration,
    max_queued: usize,
    cooldown: Duration,
    node_patience: Duration,
    slow_ready: bool,
    chains: bool,
    /// A short readiness timeout: then the slow backends' delays are drawn around it, and
    /// backend 0 is gated (never ready for stretches). `None`: the library's default (30 s).
    ready_timeout: Option<Duration>,
}

/// The backend that, with a short readiness timeout, is never ready for stretches.
const GATED: usize = 0;

/// Whether backend `b` may be slow to be ready in run `s`.
fn may_be_slow(s: &Settings, b: &str) -> bool {
    let b: usize = b.trim_start_matches('b').parse().unwrap_or(usize::MAX);
    (s.slow_ready && b % 2 == 1) || (s.ready_timeout.is_some() && b == GATED)
}

/// The test's view of the fleet it announced.
struct FleetModel {
    handle: FleetHandle<MockService>,
    tally: Arc<Tally>,
    live: HashMap<usize, (Arc<Incarnation>, usize, u32)>,
    all: Vec<Arc<Incarnation>>,
    marked_forever: Vec<usize>,
    /// Whether the odd-numbered backends are ready only a little after their first poll.
    slow_ready: bool,
    slowness: Arc<Slowness>,
}

impl FleetModel {
    fn name(b: usize) -> String {
        format!("b{b}")
    }

    fn insert_new(&mut self, b: usize, node: usize, slots: u32) {
        let inc = Arc::new(Incarnation {
            name: Self::name(b),
            retired: Mutex::new(None),
            late: Mutex::new(Vec::new()),
            late_delayed: Mutex::new(Vec::new()),
        });
        self.all.push(inc.clone());
        self.announce(b, &inc, node, slots);
        self.live.insert(b, (inc, node, slots));
    }

    fn announce(&self, b: usize, inc: &Arc<Incarnation>, node: usize, slots: u32) {
        let mut svc = mock(inc.clone(), self.tally.clone());
        if self.slow_ready && b % 2 == 1 {
            let delay = Duration::from_millis(1 + (b as u64 % 3));
            svc =
                BoxCloneSyncService::new(SlowReady::new(svc, delay, self.slowness.clone(), false));
        } else if b == GATED && self.slowness.around.is_some() {
            let gated = SlowReady::new(svc, Duration::ZERO, self.slowness.clone(), true);
            svc = BoxCloneSyncService::new(gated);
        }
        let mut backend =
            Backend::new(format!("n{node}"), svc).slots(NonZeroU32::new(slots).unwrap());
        // Every third backend's slots share a context that two long prompts overfill.
        if b.is_multiple_of(3) {
            backend = backend.context_tokens(std::num::NonZeroU64::new(CONTEXT).unwrap());
        }
        assert!(self.handle.insert(Self::name(b), backend));
    }
}

fn request(session: Option<&str>, mode: &str, r: u64) -> Req {
    let mut b = http::Request::post("/v1/chat/completions")
        .header("x-mode", mode)
        .header("x-rand", r.to_string());
    if let Some(s) = session {
        b = b.header("x-session-id", s);
    }
    b.body(String::new()).unwrap()
}

/// The context of the backends given one: two prompts of a few turns do not fit in it.
const CONTEXT: u64 = 8_000;

/// Conversation `conv`'s prompt at turn `turn`: a system prompt every conversation shares,
/// its first message, then an answer and a question a turn.
fn conversation(conv: u64, turn: u64) -> PromptChain {
    let blocks = [(1, 2_000), (100 + conv, 200)]
        .into_iter()
        .chain((0..2 * turn).map(|i| (1_000 * (conv + 1) + i, 300)));
    PromptChain::from_blocks(blocks)
}

/// A request with `chain` as its prompt, as `BodyKeyLayer` would hand it on.
fn with_chain(mut req: Req, chain: PromptChain) -> Req {
    let tokens = chain.tokens();
    req.headers_mut()
        .insert("x-prompt-tokens", http::HeaderValue::from(tokens));
    req.extensions_mut().insert(PromptFacts::from_chain(chain));
    req
}

/// Reads a body, or drops it midway.
async fn read_body(mut res: Res, rng: &mut Rng, tally: &Tally) {
    let drop_after = rng.chance(20).then(|| rng.below(3));
    let mut frames = 0;
    loop {
        if drop_after == Some(frames) {
            bump(&tally.bodies_dropped);
            return;
        }
        let frame = std::future::poll_fn(|cx| Pin::new(res.body_mut()).poll_frame(cx));
        match tokio::time::timeout(HANG, frame).await {
            Err(_) => {
                bump(&tally.hung_bodies);
                return;
            }
            Ok(None) => {
                bump(&tally.bodies_ended);
                return;
            }
            Ok(Some(Ok(_))) => frames += 1,
            Ok(Some(Err(_))) => {
                bump(&tally.body_errors);
                return;
            }
        }
    }
}

async fn client(id: usize, svc: Svc, s: Settings, deadline: Instant, tally: Arc<Tally>) {
    let mut rng = Rng::new(s.seed.wrapping_mul(1000).wrapping_add(id as u64));
    let mut sent = 0;
    let mut session_no = 0;
    while Instant::now() < deadline && sent < PER_CLIENT {
        let session = rng.chance(70).then(|| {
            session_no += 1;
            format!("c{id}-s{session_no}")
        });
        let turns = 1 + rng.below(4);
        for turn in 0..turns {
            if Instant::now() >= deadline || sent >= PER_CLIENT {
                break;
            }
            let mut svc = svc.clone();
            svc.ready().await.expect("always ready");
            let action = rng.below(100);
            if action < 3 {
                bump(&tally.dropped_after_ready);
                continue;
            }
            sent += 1;
            bump(&tally.issued);
            let mut req = request(session.as_deref(), "answer", rng.next());
            let id = tally.next_id.fetch_add(1, Ordering::Relaxed);
            req.headers_mut()
                .insert("x-id", http::HeaderValue::from(id));
            if s.chains {
                // Keyed: the session's own conversation; keyless: one of a few shared ones.
                let conv = match &session {
                    Some(_) => id * 1_000 + session_no,
                    None => rng.below(6),
                };
                req = with_chain(req, conversation(conv, turn + rng.below(2)));
            }
            let started = Instant::now();
            let fut = svc.call(req);
            if action < 6 {
                count_dropped(&format!("{fut:?}"), &tally);
                drop(fut);
                bump(&tally.dropped_unpolled);
                continue;
            }
            let mut fut = Box::pin(fut);
            let result = if action < 22 {
                // Given up on after a short while, whatever it is doing.
                let first = std::future::poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await;
                match first {
                    Poll::Ready(r) => Some(r),
                    Poll::Pending => {
                        let waiting = format!("{fut:?}").contains("waiting for a slot");
                        let patience = Duration::from_millis(rng.below(60));
                        match tokio::time::timeout(patience, fut.as_mut()).await {
                            Ok(r) => Some(r),
                            Err(_) => {
                                let still = format!("{fut:?}").contains("waiting for a slot");
                                if waiting && still {
                                    bump(&tally.cancelled_waiting);
                                }
                                count_dropped(&format!("{fut:?}"), &tally);
                                drop(fut);
                                bump(&tally.cancelled);
                                None
                            }
                        }
                    }
                }
            } else {
                match tokio::time::timeout(HANG, fut.as_mut()).await {
                    Ok(r) => Some(r),
                    Err(_) => {
                        eprintln!("hung response future: {fut:?}");
                        count_dropped(&format!("{fut:?}"), &tally);
                        bump(&tally.hung_futures);
                        None
                    }
                }
            };
            let Some(result) = result else { continue };
            match result {
                Ok(res) => {
                    bump(&tally.ok);
                    if res.status() == http::StatusCode::SERVICE_UNAVAILABLE {
                        bump(&tally.ok_503);
                        if let Some(d) = res.extensions().get::<Decision>() {
                            *tally
                                .failures_seen
                                .lock()
                                .entry(d.backend.to_string())
                                .or_default() += 1;
                        }
                    }
                    match res.extensions().get::<Decision>() {
                        Some(d) if d.waited.is_some() => bump(&tally.waited),
                        Some(_) => {}
                        None => bump(&tally.missing_decision),
                    }
                    read_body(res, &mut rng, &tally).await;
                }
                Err(Error::Saturated { .. }) => {
                    bump(&tally.saturated);
                    if started.elapsed() >= s.max_wait {
                        bump(&tally.saturated_at_deadline);
                    }
                    // Back off a little, as a client told to retry later would.
                    tokio::time::sleep(Duration::from_millis(5 + rng.below(30))).await;
                }
                Err(Error::NoBackends { .. }) => {
                    bump(&tally.no_backends);
                    tokio::time::sleep(Duration::from_millis(5 + rng.below(20))).await;
                }
                Err(e @ Error::Backend { .. }) => {
                    bump(&tally.backend_errors);
                    backend_failed(&svc, &s, id, started, e, &tally);
                }
                Err(e) => {
                    eprintln!("unexpected error: {e}");
                    bump(&tally.other_errors);
                }
            }
            if rng.chance(30) {
                tokio::time::sleep(Duration::from_millis(rng.below(5))).await;
            }
        }
    }
}

/// Counts a response future dropped before its answer by the state it was in: placed (sent
/// to its backend, or waiting for its backend to be ready), waiting for a slot, or refused.
fn count_dropped(state: &str, tally: &Tally) {
    if state.contains("calling") || state.contains("waiting for its backend to be ready") {
        bump(&tally.dropped_placed);
    } else if state.contains("waiting for a slot") {
        bump(&tally.dropped_waiting);
    } else if state.contains("\"done\"") {
        bump(&tally.dropped_done);
    } else {
        tally.violation(format!("dropped in an unknown state: {state}"));
    }
}

/// A request `id`, called at `started`, failed with `e` (an `Error::Backend`): if its backend
/// was not ready in time, checks what must hold of that at once.
fn backend_failed(svc: &Svc, s: &Settings, id: u64, started: Instant, e: Error, tally: &Tally) {
    let status = e.status();
    let Error::Backend {
        backend, source, ..
    } = e
    else {
        unreachable!()
    };
    let name = backend.to_string();
    let message = source.to_string();
    // Right away: the backend's health as the timeout left it.
    let listed = svc.backends().into_iter().find(|b| b.id == backend);
    let checked = Instant::now();
    *tally.failures_seen.lock().entry(name.clone()).or_default() += 1;
    if !message.contains("not ready within") {
        if status == http::StatusCode::GATEWAY_TIMEOUT {
            tally.violation(format!(
                "request {id}: 504 from a failure that is no readiness timeout: {name}: {message}"
            ));
        }
        return;
    }
    bump(&tally.ready_timeouts);
    tally.timed_out.lock().push((id, name.clone()));
    *tally
        .timeouts_by_backend
        .lock()
        .entry(name.clone())
        .or_default() += 1;
    let elapsed = started.elapsed();
    let Some(timeout) = s.ready_timeout else {
        tally.violation(format!("request {id}: readiness timeout on {name} without a short ready_timeout, after {elapsed:?}: {message}"));
        return;
    };
    if status != http::StatusCode::GATEWAY_TIMEOUT {
        tally.violation(format!(
            "request {id}: readiness timeout on {name} answered {status}, not 504"
        ));
    }
    if elapsed + Duration::from_millis(1) < timeout {
        tally.violation(format!("request {id}: readiness timeout on {name} after {elapsed:?}, before the timeout {timeout:?}"));
    }
    if !may_be_slow(s, &name) {
        tally.violation(format!(
            "request {id}: readiness timeout on {name}, which is always ready"
        ));
    }
    if tally.called.lock().contains(&id) {
        tally.violation(format!(
            "request {id}: timed out waiting for {name} but was sent to it"
        ));
    }
    let b: usize = name.trim_start_matches('b').parse().unwrap();
    match listed {
        None => bump(&tally.ready_timeouts_removed),
        Some(st) if !st.healthy => bump(&tally.ready_timeouts_seen_down),
        Some(_) if tally.health_changed_since(b, started) => bump(&tally.ready_timeouts_excused),
        Some(st) => tally.violation(format!(
            "request {id}: timed out on {name} after {elapsed:?} (timeout {timeout:?}, cooldown {:?}), \
             but {name} was listed healthy {:?} after the failure: {st:?}; message {message}",
            s.cooldown,
            checked.elapsed()
        )),
    }
}

/// Changes the fleet at random until the deadline.
async fn chaos(svc: Svc, model: Arc<Mutex<FleetModel>>, s: Settings, deadline: Instant) {
    let mut rng = Rng::new(s.seed ^ 0xc4a0_5000);
    let tally = model.lock().tally.clone();
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5 + rng.below(40))).await;
        let b = rng.below(BACKENDS as u64) as usize;
        let name = FleetModel::name(b);
        let what = rng.below(100);
        let mut m = model.lock();
        match (what, m.live.get(&b).cloned()) {
            (0..25, Some((inc, ..))) => {
                tally.health_begin(b);
                assert!(m.handle.remove(name.clone()));
                drop(m);
                svc.apply_discovery();
                tally.health_end(b);
                *inc.retired.lock() = Some(Instant::now());
                let mut m = model.lock();
                m.live.remove(&b);
                m.marked_forever.retain(|&x| x != b);
                bump(&tally.removals);
            }
            (0..50, None) => {
                let (node, slots) = (rng.below(NODES as u64) as usize, 1 + rng.below(2) as u32);
                tally.health_begin(b);
                m.insert_new(b, node, slots);
                drop(m);
                svc.apply_discovery();
                tally.health_end(b);
                bump(&tally.inserts);
            }
            // A new slot count (50..65) or a move to another node (65..75), announced again.
            (roll @ 50..75, Some((inc, node, slots))) => {
                let (node, slots, counter) = if roll < 65 {
                    (node, 1 + rng.below(2) as u32, &tally.updates)
                } else {
                    (rng.below(NODES as u64) as usize, slots, &tally.moves)
                };
                m.announce(b, &inc, node, slots);
                m.live.insert(b, (inc, node, slots));
                drop(m);
                if rng.chance(50) {
                    svc.apply_discovery();
                }
                bump(counter);
            }
            (75..90, Some(_)) => {
                let forever = rng.chance(25);
                if forever {
                    m.marked_forever.push(b);
                }
                drop(m);
                let cooldown = (!forever).then(|| Duration::from_millis(10 + rng.below(150)));
                tally.health_begin(b);
                svc.mark_down(&name, cooldown);
                tally.health_end(b);
                bump(&tally.marks_down);
            }
            (90..100, Some(_)) => {
                m.marked_forever.retain(|&x| x != b);
                drop(m);
                tally.health_begin(b);
                svc.mark_up(&name);
                tally.health_end(b);
                bump(&tally.marks_up);
            }
            _ => {}
        }
    }
}

/// Shuts and opens the gated backend's gate until the deadline: shut for a half to three
/// readiness timeouts, open for 5 to 200 ms; open at the end.
async fn gatekeeper(
    slowness: Arc<Slowness>,
    s: Settings,
    deadline: Instant,
    shut_count: Arc<AtomicU64>,
) {
    let Some(t) = s.ready_timeout else { return };
    let mut rng = Rng::new(s.seed ^ 0x6a7e);
    let t = t.as_micros() as u64;
    while Instant::now() < deadline {
        slowness.set_shut(true);
        shut_count.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(Duration::from_micros(t / 2 + rng.below(5 * t / 2))).await;
        slowness.set_shut(false);
        tokio::time::sleep(Duration::from_millis(5 + rng.below(196))).await;
    }
    slowness.set_shut(false);
}

/// Checks limits that hold at every moment: no backend beyond its most slots, the queue
/// within its bound.
async fn sampler(svc: Svc, s: Settings, deadline: Instant, tally: Arc<Tally>) {
    while Instant::now() < deadline {
        for b in svc.backends() {
            if b.in_flight > 2 {
                eprintln!("beyond its slots: {b:?}");
                bump(&tally.over_slots);
            }
        }
        if svc.stats().waiting > s.max_queued {
            bump(&tally.over_queued);
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

static PANICS: AtomicUsize = AtomicUsize::new(0);

fn count_panics() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, Ordering::SeqCst);
            default(info);
        }));
    });
}

fn settings(seed: u64, threads: usize, secs: u64) -> Settings {
    let mut rng = Rng::new(seed);
    Settings {
        seed,
        threads,
        secs,
        max_wait: Duration::from_millis(50 + rng.below(151)),
        max_queued: 8 + rng.below(25) as usize,
        cooldown: Duration::from_millis(30 + rng.below(150)),
        node_patience: match rng.chance(30) {
            true => Duration::from_millis(5 + rng.below(30)),
            false => Duration::ZERO,
        },
        slow_ready: rng.chance(50),
        chains: rng.chance(70),
        // Most runs: a short readiness timeout, and the slow backends slow around it.
        ready_timeout: rng
            .chance(85)
            .then(|| Duration::from_millis(20 + rng.below(181))),
    }
    .with_timeouts()
}

impl Settings {
    /// With a short readiness timeout the odd backends are always slow, around it.
    fn with_timeouts(mut self) -> Self {
        if self.ready_timeout.is_some() {
            self.slow_ready = true;
        }
        self
    }
}

/// One run; returns what it found wrong.
fn run(s: Settings) -> Vec<String> {
    count_panics();
    let panics_before = PANICS.load(Ordering::SeqCst);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(s.threads)
        .enable_all()
        .build()
        .unwrap();
    let mut problems = rt.block_on(run_on(s));
    rt.shutdown_timeout(Duration::from_secs(5));
    let panics = PANICS.load(Ordering::SeqCst) - panics_before;
    if panics > 0 {
        problems.push(format!("{panics} panics"));
    }
    problems
}

async fn run_on(s: Settings) -> Vec<String> {
    let tally = Arc::new(Tally::default());
    *tally.epoch.lock() = Some(Instant::now());
    let slowness = Arc::new(Slowness {
        around: s.ready_timeout,
        seed: s.seed,
        ..Slowness::default()
    });
    let (handle, stream) = discover::channel::<MockService>();
    let model = Arc::new(Mutex::new(FleetModel {
        handle,
        tally: tally.clone(),
        live: HashMap::new(),
        all: Vec::new(),
        marked_forever: Vec::new(),
        slow_ready: s.slow_ready,
        slowness: slowness.clone(),
    }));
    let mut rng = Rng::new(s.seed ^ 0xf1ee7);
    {
        let mut m = model.lock();
        for b in 0..BACKENDS {
            let slots = 1 + rng.below(2) as u32;
            m.insert_new(b, b % NODES, slots);
        }
    }
    let mut layer = SessionAffinityLayer::new();
    if let Some(t) = s.ready_timeout {
        layer = layer.ready_timeout(t);
    }
    let svc: Svc = layer
        .overflow(Overflow::wait(s.max_wait, s.max_queued))
        .failure_cooldown(s.cooldown)
        .node_patience(s.node_patience)
        .random_seed(s.seed)
        .layer(stream);
    svc.apply_discovery();

    let deadline = Instant::now() + Duration::from_secs(s.secs);
    let chaos = tokio::spawn(chaos(svc.clone(), model.clone(), s, deadline));
    let sampler = tokio::spawn(sampler(svc.clone(), s, deadline, tally.clone()));
    let shuts = Arc::new(AtomicU64::new(0));
    let gate = tokio::spawn(gatekeeper(slowness.clone(), s, deadline, shuts.clone()));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|i| tokio::spawn(client(i, svc.clone(), s, deadline, tally.clone())))
        .collect();

    let mut problems = Vec::new();
    let join_by = deadline + HANG * 3;
    for (i, c) in clients.into_iter().enumerate() {
        match tokio::time::timeout_at(join_by, c).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => problems.push(format!("client {i} failed: {e}")),
            Err(_) => problems.push(format!("client {i} hung")),
        }
    }
    for (what, task) in [("chaos", chaos), ("sampler", sampler), ("gatekeeper", gate)] {
        match tokio::time::timeout_at(join_by, task).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => problems.push(format!("{what} failed: {e}")),
            Err(_) => problems.push(format!("{what} hung")),
        }
    }
    // Every body producer ends once its body is gone.
    let quiet = Instant::now() + Duration::from_secs(2);
    while tally.producers.load(Ordering::SeqCst) > 0 && Instant::now() < quiet {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    if tally.producers.load(Ordering::SeqCst) > 0 {
        problems.push(format!(
            "{} body producers still running",
            tally.producers.load(Ordering::SeqCst)
        ));
    }

    // The counters, with everything done.
    let stats = svc.stats();
    if stats.in_flight != 0 {
        problems.push(format!("in flight at the end: {}", stats.in_flight));
    }
    if stats.waiting != 0 {
        problems.push(format!("waiting at the end: {}", stats.waiting));
    }
    for b in svc.backends() {
        if b.in_flight != 0 || b.context_in_flight != 0 {
            problems.push(format!("backend in flight at the end: {b:?}"));
        }
    }
    let answered = get(&tally.ok)
        + get(&tally.saturated)
        + get(&tally.no_backends)
        + get(&tally.backend_errors)
        + get(&tally.other_errors)
        + get(&tally.cancelled)
        + get(&tally.dropped_unpolled)
        + get(&tally.hung_futures);
    if answered != get(&tally.issued) {
        problems.push(format!(
            "issued {} but accounted for {answered}",
            get(&tally.issued)
        ));
    }
    for (what, n) in [
        ("hung response futures", get(&tally.hung_futures)),
        ("hung bodies", get(&tally.hung_bodies)),
        ("unexpected errors", get(&tally.other_errors)),
        ("answers without a decision", get(&tally.missing_decision)),
        ("samples beyond 2 slots", get(&tally.over_slots)),
        ("samples beyond max_queued", get(&tally.over_queued)),
    ] {
        if n > 0 {
            problems.push(format!("{n} {what}"));
        }
    }
    // No request reached a backend after its removal was applied (beyond the microseconds
    // between a placement on the fleet as it was and its call).
    let (mut late, mut late_delayed) = (Vec::new(), Vec::new());
    for inc in &model.lock().all {
        late.extend(inc.late.lock().iter().copied());
        late_delayed.extend(inc.late_delayed.lock().iter().copied());
    }
    let late_delayed_max = late_delayed.iter().max().copied().unwrap_or_default();
    let late_max = late.iter().max().copied().unwrap_or_default();
    if late_max > Duration::from_millis(20) {
        problems.push(format!(
            "{} requests after their backend's removal, the latest {late_max:?} after",
            late.len()
        ));
    }

    if let Some(t) = s.ready_timeout {
        // A request that waited for its backend's readiness was sent within about the
        // timeout of its first readiness poll, removal or not (readiness that comes between
        // the deadline and the task's next poll still wins: hence the margin).
        let bound = t + Duration::from_millis(50);
        if late_delayed_max > bound {
            problems.push(format!(
                "a request waiting for readiness sent {late_delayed_max:?} after its backend's removal (timeout {t:?})"
            ));
        }
        // The gate was shut for stretches longer than the timeout: some requests timed out.
        if shuts.load(Ordering::Relaxed) >= 5 && get(&tally.ready_timeouts) == 0 {
            problems.push(format!(
                "no readiness timeout in {} stretches of the gate shut",
                shuts.load(Ordering::Relaxed)
            ));
        }
        let longest = Duration::from_micros(tally.longest_pending_us.load(Ordering::Relaxed));
        if longest > bound {
            problems.push(format!(
                "a request sent {longest:?} after its backend's first readiness poll (timeout {t:?})"
            ));
        }
    }

    // What the clients found as it happened.
    let count = get(&tally.violation_count);
    if count > 0 {
        problems.push(format!(
            "{count} violations seen by the clients, the first: {:#?}",
            tally.violations.lock()
        ));
    }
    // No request that timed out waiting for readiness reached its backend, then or later.
    {
        let called = tally.called.lock();
        let sent: Vec<_> = tally
            .timed_out
            .lock()
            .iter()
            .filter(|(id, _)| called.contains(id))
            .cloned()
            .collect();
        if !sent.is_empty() {
            problems.push(format!(
                "{} requests timed out waiting for readiness and were sent all the same: {:?}",
                sent.len(),
                &sent[..sent.len().min(10)]
            ));
        }
    }
    // The service's counters against what the clients saw, with every client done.
    let counted = svc.stats();
    let seen_failures = get(&tally.backend_errors) + get(&tally.ok_503);
    if counted.backend_errors != seen_failures {
        problems.push(format!(
            "stats: {} backend errors, the clients saw {seen_failures} ({} errors, {} 503s)",
            counted.backend_errors,
            get(&tally.backend_errors),
            get(&tally.ok_503)
        ));
    }
    let seen_placed = get(&tally.ok) + get(&tally.backend_errors) + get(&tally.dropped_placed);
    if counted.placed() != seen_placed {
        problems.push(format!(
            "stats: {} placed, the clients saw {seen_placed} ({} answers, {} backend errors, {} dropped placed)",
            counted.placed(),
            get(&tally.ok),
            get(&tally.backend_errors),
            get(&tally.dropped_placed)
        ));
    }
    let seen_refused = get(&tally.saturated) + get(&tally.no_backends) + get(&tally.dropped_done);
    if counted.rejected + counted.no_backends != seen_refused {
        problems.push(format!(
            "stats: {} rejected and {} without backends, the clients saw {seen_refused}",
            counted.rejected, counted.no_backends
        ));
    }
    if counted.abandoned != get(&tally.dropped_waiting) {
        problems.push(format!(
            "stats: {} abandoned, the clients dropped {} waiting",
            counted.abandoned,
            get(&tally.dropped_waiting)
        ));
    }
    let total = counted.placed() + counted.rejected + counted.no_backends + counted.abandoned;
    if total != get(&tally.issued) {
        problems.push(format!(
            "stats: placed, refused and abandoned add up to {total}, for {} issued",
            get(&tally.issued)
        ));
    }

    // Everything ready at once from now on.
    slowness.calm.store(true, Ordering::SeqCst);
    slowness.set_shut(false);

    // A full round: the fleet whole again and up, past every cooldown; one request a slot,
    // each held, all served at once without waiting.
    {
        let mut m = model.lock();
        for b in 0..BACKENDS {
            match m.live.get(&b).cloned() {
                Some((inc, _, _)) => {
                    m.announce(b, &inc, b % NODES, 2);
                    m.live.insert(b, (inc, b % NODES, 2));
                }
                None => m.insert_new(b, b % NODES, 2),
            }
        }
    }
    svc.apply_discovery();
    // Each backend's failures, as the clients saw them (every backend is live again, and
    // keeps its count across its removals: no other backend takes its place).
    {
        let seen = tally.failures_seen.lock();
        for b in svc.backends() {
            let saw = seen.get(b.id.as_str()).copied().unwrap_or(0);
            if b.failures != saw {
                problems.push(format!(
                    "{}: {} failures counted, the clients saw {saw}",
                    b.id, b.failures
                ));
            }
        }
    }
    tokio::time::sleep(s.cooldown + Duration::from_millis(200)).await;
    for b in 0..BACKENDS {
        svc.mark_up(&FleetModel::name(b));
    }
    let slots: u32 = svc.backends().iter().map(|b| b.slots).sum();
    if slots != 2 * BACKENDS as u32 {
        problems.push(format!("slots after the restore: {slots}"));
    }
    let mut held = Vec::new();
    for i in 0..slots {
        match hold_slot(&svc, i).await {
            Ok(Ok(res)) => {
                let d = res.extensions().get::<Decision>().unwrap();
                if d.waited.is_some() {
                    problems.push(format!("final round: request {i} waited: {d:?}"));
                }
                held.push(res);
            }
            Ok(Err(e)) => problems.push(format!("final round: request {i} failed: {e}")),
            Err(_) => problems.push(format!(
                "final round: request {i} not served within 1 s; backends {:?}",
                svc.backends()
                    .iter()
                    .map(|b| (b.id.to_string(), b.in_flight, b.slots, b.healthy))
                    .collect::<Vec<_>>()
            )),
        }
    }
    if svc.stats().in_flight != slots as usize {
        problems.push(format!(
            "final round: {} in flight for {slots} held",
            svc.stats().in_flight
        ));
    }
    // One more waits; freeing a slot serves it.
    let mut svc2 = svc.clone();
    svc2.ready().await.unwrap();
    let mut extra = Box::pin(svc2.call(request(None, "hold", 99)));
    let first = std::future::poll_fn(|cx| Poll::Ready(extra.as_mut().poll(cx))).await;
    if first.is_ready() || svc.stats().waiting != 1 {
        problems.push("final round: the request beyond the slots did not wait".into());
    }
    held.pop();
    match tokio::time::timeout(Duration::from_secs(1), extra).await {
        Ok(Ok(res)) => held.push(res),
        Ok(Err(e)) => problems.push(format!("final round: the waiting request failed: {e}")),
        Err(_) => problems.push("final round: a freed slot did not serve the waiter".into()),
    }
    drop(held);
    let stats = svc.stats();
    if stats.in_flight != 0 || stats.waiting != 0 {
        problems.push(format!(
            "after the final round: {} in flight, {} waiting",
            stats.in_flight, stats.waiting
        ));
    }

    let (rounds, served) = liveness(&svc, s, slots, &mut problems).await;
    // Every slot free at the end.
    for b in svc.backends() {
        if b.in_flight != 0 || b.context_in_flight != 0 {
            problems.push(format!("after the rounds, a slot still taken: {b:?}"));
        }
    }
    if svc.stats().in_flight != 0 || svc.stats().waiting != 0 {
        problems.push(format!("after the rounds: {:?}", svc.stats()));
    }

    let t = &tally;
    let usage = svc.stats().usage_reports;
    eprintln!(
        "seed {} threads {} {:?} usage {usage}: issued {} ok {} (503 {}) waited {} saturated {} (at deadline {}) \
         no-backends {} backend-errors {} cancelled {} (waiting {}) unpolled {} after-ready {} \
         bodies ended {} dropped {} failed {} | calls {} late {} (max {:?}) late after readiness {} \
         (max {:?}) | removals {} \
         inserts {} updates {} moves {} down {} up {} | stats waited {} abandoned {} rejected {} \
         | liveness rounds {} served {} | ready timeout {:?}: timed out {} (seen down {}, removed {}, \
         excused by chaos {}) by backend {:?}, gate shut {} times, sent after pending {} (longest {:?}) \
         | dropped placed {} waiting {} done {}",
        s.seed,
        s.threads,
        (s.max_wait, s.max_queued, s.cooldown, s.node_patience, s.slow_ready, s.chains),
        get(&t.issued),
        get(&t.ok),
        get(&t.ok_503),
        get(&t.waited),
        get(&t.saturated),
        get(&t.saturated_at_deadline),
        get(&t.no_backends),
        get(&t.backend_errors),
        get(&t.cancelled),
        get(&t.cancelled_waiting),
        get(&t.dropped_unpolled),
        get(&t.dropped_after_ready),
        get(&t.bodies_ended),
        get(&t.bodies_dropped),
        get(&t.body_errors),
        get(&t.backend_calls),
        late.len(),
        late_max,
        late_delayed.len(),
        late_delayed_max,
        get(&t.removals),
        get(&t.inserts),
        get(&t.updates),
        get(&t.moves),
        get(&t.marks_down),
        get(&t.marks_up),
        stats.waited,
        stats.abandoned,
        stats.rejected,
        rounds,
        served,
        s.ready_timeout,
        get(&t.ready_timeouts),
        get(&t.ready_timeouts_seen_down),
        get(&t.ready_timeouts_removed),
        get(&t.ready_timeouts_excused),
        {
            let mut v: Vec<_> = t.timeouts_by_backend.lock().clone().into_iter().collect();
            v.sort();
            v
        },
        shuts.load(Ordering::Relaxed),
        get(&t.sent_after_pending),
        Duration::from_micros(t.longest_pending_us.load(Ordering::Relaxed)),
        get(&t.dropped_placed),
        get(&t.dropped_waiting),
        get(&t.dropped_done),
    );
    problems
}

/// Rounds of: every slot held, some requests waiting, the slots freed from several tasks at
/// once while some waiters give up: every waiter that stays is served, none refused.
/// Request `i` of a round that holds every slot: its answer, if it came within a second.
async fn hold_slot(svc: &Svc, i: u32) -> Result<Result<Res, Error>, tokio::time::error::Elapsed> {
    let mut svc = svc.clone();
    svc.ready().await.unwrap();
    let fut = svc.call(request(None, "hold", u64::from(i)));
    tokio::time::timeout(Duration::from_secs(1), fut).await
}

async fn liveness(svc: &Svc, s: Settings, slots: u32, problems: &mut Vec<String>) -> (u32, u32) {
    let mut rng = Rng::new(s.seed ^ 0x11fe);
    let waiters = (s.max_queued as u32).min(slots);
    let mut served_total = 0;
    for round in 0..30 {
        let mut held = Vec::new();
        for i in 0..slots {
            match hold_slot(svc, i).await {
                Ok(Ok(res)) => held.push(res),
                other => {
                    problems.push(format!(
                        "liveness round {round}: slot {i} not served at once: {:?}",
                        other.map(|r| r.map(|_| ()))
                    ));
                    return (round, served_total);
                }
            }
        }
        let mut tasks = Vec::new();
        let mut staying = 0;
        for w in 0..waiters {
            let mut svc = svc.clone();
            let give_up = rng.chance(25).then(|| Duration::from_millis(rng.below(4)));
            staying += usize::from(give_up.is_none());
            let linger = Duration::from_millis(rng.below(3));
            tasks.push(tokio::spawn(async move {
                svc.ready().await.unwrap();
                let started = Instant::now();
                let fut = svc.call(request(Some(&format!("w{w}")), "hold", 0));
                let result = match give_up {
                    Some(t) => match tokio::time::timeout(t, fut).await {
                        Ok(r) => r,
                        Err(_) => return None,
                    },
                    None => match tokio::time::timeout(Duration::from_secs(2), fut).await {
                        Ok(r) => r,
                        Err(_) => return Some(Err("hung".to_string())),
                    },
                };
                let r = result.map_err(|e| {
                    format!(
                        "{e} after {:?}; backends {:?} waiting {}",
                        started.elapsed(),
                        svc.backends()
                            .iter()
                            .map(|b| (b.id.to_string(), b.in_flight, b.slots, b.healthy))
                            .collect::<Vec<_>>(),
                        svc.stats().waiting
                    )
                });
                tokio::time::sleep(linger).await;
                Some(r.map(drop))
            }));
        }
        // Those that stay are queued soon (those that give up may be gone already); the
        // slots are freed well within the wait's deadline.
        let by = Instant::now() + s.max_wait / 4;
        while svc.stats().waiting < staying && Instant::now() < by {
            tokio::task::yield_now().await;
        }
        let mut releases = Vec::new();
        for res in held {
            let after = Duration::from_micros(rng.below(3000));
            releases.push(tokio::spawn(async move {
                tokio::time::sleep(after).await;
                drop(res);
            }));
        }
        for r in releases {
            r.await.unwrap();
        }
        for (w, t) in tasks.into_iter().enumerate() {
            match tokio::time::timeout(Duration::from_secs(5), t).await {
                Ok(Ok(None)) => {}
                Ok(Ok(Some(Ok(())))) => served_total += 1,
                Ok(Ok(Some(Err(e)))) => problems.push(format!(
                    "liveness round {round}: waiter {w} of {waiters} over {slots} slots: {e}"
                )),
                Ok(Err(e)) => problems.push(format!("liveness round {round}: waiter {w}: {e}")),
                Err(_) => problems.push(format!("liveness round {round}: waiter {w} hung")),
            }
        }
        let stats = svc.stats();
        if stats.in_flight != 0 || stats.waiting != 0 {
            problems.push(format!(
                "liveness round {round}: after it {} in flight, {} waiting",
                stats.in_flight, stats.waiting
            ));
            return (round + 1, served_total);
        }
    }
    (30, served_total)
}

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
#[ignore = "a stress run of seconds of real time: run with --ignored"]
fn stress() {
    let first = env("STRESS_SEED", 1);
    let runs = env("STRESS_RUNS", 1);
    let secs = env("STRESS_SECS", 6);
    let threads = std::env::var("STRESS_THREADS").ok();
    let mut failed = Vec::new();
    for seed in first..first + runs {
        let threads = match &threads {
            Some(t) => t.parse().unwrap(),
            None => [2, 4, 8][(seed % 3) as usize],
        };
        let problems = run(settings(seed, threads, secs));
        if !problems.is_empty() {
            eprintln!("seed {seed} threads {threads}: {problems:#?}");
            failed.push((seed, threads, problems));
        }
    }
    assert!(failed.is_empty(), "failed runs: {failed:#?}");
}
