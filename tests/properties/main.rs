//! Properties of the service under random operation: requests, streamed bodies ended or
//! dropped, futures dropped, backend failures and 503 answers, backends inserted, updated and
//! removed, marked down and up by a probe, time passing; half the backends are ready only at
//! their second readiness poll. Checked after every step and at the end.

#[path = "../support/hang.rs"]
mod hang;
#[path = "../service/mock.rs"]
mod mock;

use std::collections::{HashMap, HashSet};
use std::num::NonZeroU32;
use std::task::Poll;
use std::time::Duration;

use http_body::Body;
use mock::{backend, Chunk, MockBody, MockService, Req, Streams};
use proptest::prelude::*;
use tokio::sync::mpsc::UnboundedSender;
use tokio_test::task::{spawn, Spawn};
use tower::{Layer, Service};
use tower_affinity::discover::{self, FleetChannel};
use tower_affinity::key::{HeaderKey, PromptFacts, SessionKey};
use tower_affinity::placement::{NodeThenBackend, Snapshot};
use tower_affinity::{
    Backend, BackendId, Decision, Error, Overflow, PromptChain, ResponseBody, ResponseFuture,
    SessionAffinity, SessionAffinityLayer,
};

const BACKENDS: u8 = 6;
const SESSIONS: u8 = 10;
const COOLDOWN: Duration = Duration::from_secs(5);

#[derive(Clone, Copy, Debug)]
enum Mode {
    Stream,
    Hang,
    Fail,
    /// Answered 503 wherever it goes (a backend loading its model).
    Unavailable,
}

#[derive(Clone, Debug)]
enum Op {
    Call {
        session: Option<u8>,
        mode: Mode,
    },
    EndBody(usize),
    DropBody(usize),
    DropFuture(usize),
    Insert {
        backend: u8,
        node: u8,
        slots: u32,
    },
    Remove(u8),
    /// A health probe marks the backend up, or down for 2 s or until further notice (either
    /// replacing the mark it had).
    Probe {
        backend: u8,
        up: bool,
        for_2s: bool,
    },
    Advance(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (proptest::option::weighted(0.85, 0..SESSIONS), prop_oneof![
            8 => Just(Mode::Stream), 1 => Just(Mode::Hang), 1 => Just(Mode::Fail),
            1 => Just(Mode::Unavailable)
        ])
            .prop_map(|(session, mode)| Op::Call { session, mode }),
        3 => any::<usize>().prop_map(Op::EndBody),
        2 => any::<usize>().prop_map(Op::DropBody),
        1 => any::<usize>().prop_map(Op::DropFuture),
        1 => (0..BACKENDS, 0..3u8, 1..4u32)
            .prop_map(|(backend, node, slots)| Op::Insert { backend, node, slots }),
        1 => (0..BACKENDS).prop_map(Op::Remove),
        1 => (0..BACKENDS, any::<bool>(), any::<bool>())
            .prop_map(|(backend, up, for_2s)| Op::Probe { backend, up, for_2s }),
        1 => (1..20u64).prop_map(Op::Advance),
    ]
}

fn overflow() -> impl Strategy<Value = Overflow> {
    prop_oneof![
        Just(Overflow::Reject),
        Just(Overflow::Overcommit),
        Just(Overflow::wait(Duration::from_secs(30), 4)),
    ]
}

type Svc = SessionAffinity<FleetChannel<MockService>, HeaderKey, NodeThenBackend>;
type Fut = Spawn<ResponseFuture<MockService, NodeThenBackend, String>>;
type Res = http::Response<ResponseBody<MockBody>>;

struct Open {
    res: Res,
    tx: Option<UnboundedSender<Chunk>>,
}

struct Pending {
    fut: Fut,
    session: Option<u8>,
    stream: bool,
}

/// A backend each clone of which is not ready at its first readiness poll, as a pool that
/// must connect first: the odd-numbered backends are these, so that requests go both through
/// a backend called at once and through one readied later.
struct ReadyOnSecondPoll {
    inner: MockService,
    polled: bool,
}

impl Clone for ReadyOnSecondPoll {
    fn clone(&self) -> Self {
        ReadyOnSecondPoll {
            inner: self.inner.clone(),
            polled: false,
        }
    }
}

impl Service<Req> for ReadyOnSecondPoll {
    type Response = <MockService as Service<Req>>::Response;
    type Error = <MockService as Service<Req>>::Error;
    type Future = <MockService as Service<Req>>::Future;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> Poll<Result<(), Self::Error>> {
        if !std::mem::replace(&mut self.polled, true) {
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        self.inner.call(req)
    }
}

/// What the test knows of the fleet and the sessions, to check the service against.
#[derive(Default)]
struct Model {
    live: HashMap<String, u32>,
    down_until: HashMap<String, tokio::time::Instant>,
    homes: HashMap<u8, String>,
    /// Sessions whose home was removed (or changed) since their last turn.
    unsure: HashSet<u8>,
}

impl Model {
    /// The backend is down for `cooldown` from now, or longer if it was marked so.
    fn mark_down(&mut self, id: &str, cooldown: Duration) {
        let until = tokio::time::Instant::now() + cooldown;
        let at = self.down_until.entry(id.to_string()).or_insert(until);
        *at = (*at).max(until);
    }
}

fn request(session: Option<u8>, mode: Mode) -> Req {
    let mut b = http::Request::post("/");
    if let Some(s) = session {
        b = b.header("x-session-id", format!("s{s}"));
    }
    let mode = match mode {
        Mode::Stream => "stream",
        Mode::Hang => "hang",
        Mode::Fail => "fail",
        Mode::Unavailable => {
            for i in 0..BACKENDS {
                b = b.header("x-unavailable-on", format!("b{i}"));
            }
            "once"
        }
    };
    b.header("x-mode", mode).body(String::new()).unwrap()
}

struct Harness {
    svc: Svc,
    patience: Duration,
    handle: discover::FleetHandle<MockService>,
    streams: Streams,
    overflow: Overflow,
    model: Model,
    open: Vec<Open>,
    pending: Vec<Pending>,
}

impl Harness {
    fn drain_discovery(&mut self) {
        let mut ready = spawn(std::future::poll_fn(|cx| self.svc.poll_ready(cx)));
        assert!(matches!(ready.poll(), Poll::Ready(Ok(()))), "always ready");
    }

    fn up_backends_with_room(&self) -> Vec<String> {
        let now = tokio::time::Instant::now();
        self.svc
            .backends()
            .into_iter()
            .filter(|b| b.in_flight < b.slots)
            .filter(|b| {
                self.model
                    .down_until
                    .get(b.id.as_str())
                    .is_none_or(|&t| t <= now)
            })
            .map(|b| b.id.to_string())
            .collect()
    }

    /// Checks a placement and records it.
    fn placed(&mut self, d: &Decision, session: Option<u8>, expected_home: Option<&String>) {
        let id = d.backend.as_str();
        assert!(
            self.model.live.contains_key(id),
            "placed on removed backend {id}"
        );
        let now = tokio::time::Instant::now();
        if let Some(&t) = self.model.down_until.get(id) {
            assert!(t <= now, "placed on {id}, which is down");
        }
        let status = self
            .svc
            .backends()
            .into_iter()
            .find(|b| b.id.as_str() == id)
            .unwrap();
        if !d.overcommitted {
            assert!(
                status.in_flight <= status.slots,
                "{id} beyond its slots: {status:?}"
            );
        } else {
            assert_eq!(self.overflow, Overflow::Overcommit);
        }
        if let Some(home) = expected_home {
            assert_eq!(
                id, home,
                "session {session:?} had a free home but went elsewhere"
            );
        }
        if let Some(s) = session {
            self.model.homes.insert(s, id.to_string());
            self.model.unsure.remove(&s);
        }
    }

    fn settle(&mut self, pending: Pending, poll: Poll<Result<Res, Error>>) {
        let Pending {
            fut,
            session,
            stream,
        } = pending;
        match poll {
            Poll::Pending => {
                // Dispatched to a backend that has not answered, or waiting: either way the
                // model no longer knows the session's home until its next answer.
                if let Some(s) = session {
                    self.model.unsure.insert(s);
                }
                self.pending.push(Pending {
                    fut,
                    session,
                    stream,
                });
            }
            Poll::Ready(Ok(res)) => {
                let d = res.extensions().get::<Decision>().cloned().unwrap();
                self.placed(&d, session, None);
                if res.status() == http::StatusCode::SERVICE_UNAVAILABLE {
                    self.model.mark_down(d.backend.as_str(), COOLDOWN);
                }
                let tx = if stream {
                    let (name, tx) = self.streams.take_last().unwrap();
                    assert_eq!(name, d.backend.as_str());
                    Some(tx)
                } else {
                    None
                };
                self.open.push(Open { res, tx });
            }
            Poll::Ready(Err(Error::Backend { backend, .. })) => {
                self.model.mark_down(backend.as_str(), COOLDOWN);
                // The home is recorded at dispatch, failed or not.
                if let Some(s) = session {
                    self.model.homes.insert(s, backend.to_string());
                    self.model.unsure.remove(&s);
                }
            }
            Poll::Ready(Err(Error::Saturated { .. })) => {}
            Poll::Ready(Err(Error::NoBackends { .. })) => {
                assert!(self.up_backends_with_room().is_empty());
            }
            Poll::Ready(Err(e)) => panic!("unexpected error {e}"),
        }
    }

    fn step(&mut self, op: Op) {
        self.apply(op);
        self.progress();
    }

    fn apply(&mut self, op: Op) {
        match op {
            Op::Call { session, mode } => {
                self.drain_discovery();
                // The home rule: a session whose home is live, up and has a free slot gets it.
                let room = self.up_backends_with_room();
                let expected = session
                    .filter(|s| !self.model.unsure.contains(s))
                    .and_then(|s| self.model.homes.get(&s))
                    .filter(|h| room.contains(h))
                    .cloned();
                let rejected_with_room = !room.is_empty();
                let waiting_before = self.svc.stats().waiting;
                let fut = spawn(self.svc.call(request(session, mode)));
                let mut p = Pending {
                    fut,
                    session,
                    stream: matches!(mode, Mode::Stream),
                };
                let poll = p.fut.poll();
                // The backends answer at once unless told to hang: a request still pending
                // after its first poll is one waiting for a slot.
                if poll.is_pending() && !matches!(mode, Mode::Hang) {
                    assert_eq!(
                        self.svc.stats().waiting,
                        waiting_before + 1,
                        "pending without waiting for a slot"
                    );
                }
                if let Poll::Ready(Ok(res)) = &poll {
                    let d = res.extensions().get::<Decision>().unwrap();
                    if let Some(h) = &expected {
                        assert_eq!(d.backend.as_str(), h, "free home not taken");
                    }
                    // Beyond its slots only when no candidate had room.
                    assert!(
                        !d.overcommitted || room.is_empty(),
                        "overcommitted {} while {room:?} had room",
                        d.backend
                    );
                }
                // Refused at once only when no backend had room, however it overflows: one
                // held for its home node that finds the queue full does not wait, so is not
                // held either.
                if let Poll::Ready(Err(Error::Saturated { .. })) = &poll {
                    assert!(!rejected_with_room, "rejected while {room:?} had room");
                }
                self.settle(p, poll);
            }
            Op::EndBody(i) if !self.open.is_empty() => {
                let mut o = self.open.swap_remove(i % self.open.len());
                drop(o.tx.take());
                let mut body = spawn(std::future::poll_fn(|cx| {
                    std::pin::Pin::new(o.res.body_mut()).poll_frame(cx)
                }));
                loop {
                    match body.poll() {
                        Poll::Ready(Some(_)) => continue,
                        Poll::Ready(None) => break,
                        Poll::Pending => panic!("an ended stream must end"),
                    }
                }
            }
            Op::DropBody(i) if !self.open.is_empty() => {
                drop(self.open.swap_remove(i % self.open.len()));
            }
            Op::DropFuture(i) if !self.pending.is_empty() => {
                drop(self.pending.swap_remove(i % self.pending.len()));
            }
            Op::Insert {
                backend: b,
                node,
                slots,
            } => {
                let id = format!("b{b}");
                let svc = backend(&id, &self.streams);
                let svc = if b % 2 == 1 {
                    MockService::new(ReadyOnSecondPoll {
                        inner: svc,
                        polled: false,
                    })
                } else {
                    svc
                };
                let be =
                    Backend::new(format!("n{node}"), svc).slots(NonZeroU32::new(slots).unwrap());
                self.handle.insert(id.clone(), be);
                self.model.live.insert(id, slots);
                self.drain_discovery();
            }
            Op::Remove(b) => {
                let id = format!("b{b}");
                self.handle.remove(id.clone());
                self.model.live.remove(&id);
                self.model.down_until.remove(&id);
                for (s, h) in &self.model.homes {
                    if *h == id {
                        self.model.unsure.insert(*s);
                    }
                }
                self.drain_discovery();
            }
            Op::Probe {
                backend: b,
                up,
                for_2s,
            } => {
                self.drain_discovery();
                let id = format!("b{b}");
                // Until further notice: as good as forever here.
                let (cooldown, down) = match for_2s {
                    true => (Some(Duration::from_secs(2)), Duration::from_secs(2)),
                    false => (None, Duration::from_secs(10 * 365 * 86_400)),
                };
                if up {
                    if self.svc.mark_up(&id) {
                        self.model.down_until.remove(&id);
                    }
                } else if self.svc.mark_down(&id, cooldown) {
                    let until = tokio::time::Instant::now() + down;
                    self.model.down_until.insert(id, until);
                }
            }
            // Time passes in `run`, where the runtime fires the timers due.
            _ => {}
        }
    }

    /// Waiting requests make progress when slots free, backends come, or time passes.
    fn progress(&mut self) {
        let pending = std::mem::take(&mut self.pending);
        for mut p in pending {
            let poll = p.fut.poll();
            self.settle(p, poll);
        }
        // Then the woken ones run, as an executor runs woken tasks, before the next step: a
        // waiter handed a slot that another passed on holds it promised until it runs.
        for _ in 0..64 {
            let (woken, asleep) = std::mem::take(&mut self.pending)
                .into_iter()
                .partition::<Vec<_>, _>(|p| p.fut.is_woken());
            self.pending = asleep;
            if woken.is_empty() {
                break;
            }
            for mut p in woken {
                let poll = p.fut.poll();
                self.settle(p, poll);
            }
        }
        assert!(
            self.pending.iter().all(|p| !p.fut.is_woken()),
            "requests still woken after 64 rounds: they wake one another in a circle"
        );
        let waiting = self.svc.stats().waiting;
        assert!(waiting <= 4, "the wait queue is bounded");
        // Without node patience (and without prompt chains, so without waits for a prefix's
        // holder), a request waits only while no backend it may take has room.
        if self.patience.is_zero() && waiting > 0 {
            let room = self.up_backends_with_room();
            assert!(
                room.is_empty(),
                "{waiting} waiting while {room:?} have room"
            );
        }
    }

    fn finish(mut self) {
        self.pending.clear();
        self.open.clear();
        let stats = self.svc.stats();
        assert_eq!(stats.in_flight, 0, "{stats:?}");
        assert_eq!(stats.waiting, 0, "{stats:?}");
        for b in self.svc.backends() {
            assert_eq!(b.in_flight, 0, "{b:?}");
        }
    }
}

/// Runs `ops` on a fleet of three one-slot backends on two nodes, checking every invariant
/// after each step and at the end. `seed` seeds the placements' random numbers, so that a
/// failing case replays.
fn run(overflow: Overflow, patience: u64, seed: u64, ops: Vec<Op>) {
    let case = format!("{:?}", (overflow, patience, seed, &ops));
    hang::within_a_minute(&case, move || {
        run_on_paused_time(overflow, patience, seed, ops)
    });
}

fn run_on_paused_time(overflow: Overflow, patience: u64, seed: u64, ops: Vec<Op>) {
    // The whole run is one poll of the runtime's task: unconstrained, so that tokio's budget
    // for a task's poll does not run out and make timers read pending when they are due.
    paused_runtime().block_on(tokio::task::unconstrained(async move {
        let (handle, stream) = discover::channel();
        let svc = SessionAffinityLayer::new()
            .overflow(overflow)
            .failure_cooldown(COOLDOWN)
            .node_patience(Duration::from_secs(patience))
            .random_seed(seed)
            .layer(stream);
        let mut h = Harness {
            svc,
            patience: Duration::from_secs(patience),
            handle,
            streams: Streams::default(),
            overflow,
            model: Model::default(),
            open: Vec::new(),
            pending: Vec::new(),
        };
        for b in 0..3u8 {
            h.step(Op::Insert {
                backend: b,
                node: b % 2,
                slots: 1,
            });
        }
        for op in ops {
            match op {
                Op::Advance(secs) => {
                    tokio::time::advance(Duration::from_secs(secs)).await;
                    h.progress();
                }
                op => h.step(op),
            }
        }
        h.finish();
    }));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn random_operation_keeps_every_invariant(
        overflow in overflow(),
        patience in prop_oneof![Just(0u64), Just(5u64)],
        seed in any::<u64>(),
        ops in proptest::collection::vec(op(), 1..80),
    ) {
        run(overflow, patience, seed, ops);
    }
}

/// A case the property above found: the last turn's home, freed by its own stream's end, was
/// promised to a waiter woken by another that took a slot elsewhere, and is not free until
/// that waiter runs. The harness did not run it before the next step (seeds 0, 1, 3 and 19
/// of the first twenty failed; 0 is kept).
#[test]
fn a_slot_passed_on_to_a_woken_waiter_is_not_a_free_home() {
    use Mode::{Fail, Stream};
    let call = |session, mode| Op::Call { session, mode };
    let seed = 0;
    run(
        Overflow::wait(Duration::from_secs(30), 4),
        0,
        seed,
        vec![
            call(None, Stream),
            Op::Insert {
                backend: 3,
                node: 2,
                slots: 3,
            },
            call(None, Fail),
            call(None, Fail),
            call(None, Stream),
            call(None, Stream),
            call(None, Stream),
            call(None, Stream),
            Op::DropFuture(1049748689806444584),
            Op::Advance(16),
            call(Some(2), Stream),
            call(Some(9), Stream),
            Op::EndBody(9282634188694262722),
            call(Some(2), Stream),
        ],
    );
}

// === the cache model ===

/// A request carrying `chain`, as `BodyKeyLayer` would hand it on.
fn chain_request(session: Option<String>, chain: PromptChain, fail: bool) -> Req {
    let mut b = http::Request::post("/v1/chat/completions");
    if let Some(s) = session {
        b = b.header("x-session-id", s);
    }
    if fail {
        b = b.header("x-mode", "fail");
    }
    let mut req = b.body(String::new()).unwrap();
    req.extensions_mut().insert(PromptFacts::from_chain(chain));
    req
}

fn paused_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap()
}

/// Budgets: tiny ones where the tokens bind, large ones where chains of small blocks run
/// into the links bound first.
fn budget() -> impl Strategy<Value = u64> {
    prop_oneof![1..4_000u64, 16_384..40_000u64]
}

/// Block sizes for the ids 0..8: sometimes all one token, so the links bound binds.
fn block_tokens() -> impl Strategy<Value = Vec<u32>> {
    prop_oneof![Just(vec![1; 8]), proptest::collection::vec(1..700u32, 8),]
}

/// What a backend's cache model may cost a link of its bound on links, as `src/cache.rs`
/// states it (under 770 KB at the default budget's 8,192 links).
const MODEL_BYTES_PER_LINK: usize = 94;
/// The log of a backend's last 256 evictions, 32 bytes each.
const EVICTION_LOG_BYTES: usize = 256 * 32;

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// Whatever chains the service records, no backend's model holds more tokens than its
    /// budget, or more links than one per 16 tokens of it (at least 1,024), and the models
    /// hold no more memory than the bound their docs state for those links.
    #[test]
    fn the_cache_model_never_exceeds_its_bound(
        budgets in proptest::collection::vec(budget(), 3),
        tokens in block_tokens(),
        turns in proptest::collection::vec(
            (proptest::option::of(0..4u8), proptest::collection::vec(0..8u8, 1..400)),
            1..30,
        ),
    ) {
        paused_runtime().block_on(async move {
            let streams = Streams::default();
            let fleet = discover::StaticFleet::new(budgets.iter().enumerate().map(|(i, &b)| {
                let id = format!("b{i}");
                let svc = backend(&id, &streams);
                (id, Backend::new(format!("n{}", i % 2), svc)
                    .slots(NonZeroU32::new(2).unwrap())
                    .cache_tokens(b))
            }));
            let mut svc = SessionAffinityLayer::new().overflow(Overflow::Reject).layer(fleet);
            let budget_of: HashMap<String, u64> = budgets
                .iter()
                .enumerate()
                .map(|(i, &b)| (format!("b{i}"), b))
                .collect();
            let max_blocks =
                |budget: u64| usize::try_from(budget / 16).unwrap().max(1024);
            // The memory bound the cache model's docs state: under 94 bytes a link of the
            // bound on links, and the log of the last 256 evictions, 8 KiB.
            let max_bytes: usize = budgets
                .iter()
                .map(|&b| max_blocks(b) * MODEL_BYTES_PER_LINK + EVICTION_LOG_BYTES)
                .sum();
            for (session, blocks) in turns {
                let chain = PromptChain::from_blocks(
                    blocks.iter().map(|&i| (u64::from(i), tokens[usize::from(i)])),
                );
                let req = chain_request(session.map(|s| format!("s{s}")), chain, false);
                let res = tower::ServiceExt::ready(&mut svc).await.unwrap().call(req).await;
                drop(res.unwrap());
                for b in svc.backends() {
                    let budget = budget_of[b.id.as_str()];
                    let max_blocks = max_blocks(budget);
                    assert!(b.cached_tokens <= budget, "{b:?} over {budget} tokens");
                    assert!(b.cached_blocks <= max_blocks, "{b:?} over {max_blocks} links");
                    assert!(b.conversations as usize <= b.cached_blocks, "{b:?}");
                }
                let bytes = svc.stats().cache_model_bytes;
                assert!(bytes <= max_bytes, "the models hold {bytes} bytes, over {max_bytes}");
            }
            assert!(svc.stats().cache_model_bytes > 0);
        });
    }
}

#[derive(Clone, Debug)]
enum ChainOp {
    /// The next turn of conversation `conv`, keyed or not; with `fail`, the backend it goes to
    /// fails it (and is marked down, holding the conversation's earlier turns); with `hold`,
    /// its answer's body stays open, holding its slot, until a `Release`.
    Turn {
        conv: u8,
        keyed: bool,
        fail: bool,
        hold: bool,
    },
    /// Ends one answer held open.
    Release(usize),
    Insert {
        backend: u8,
        node: u8,
        slots: u32,
    },
    Remove(u8),
    /// A health probe marks the backend up, or down for 2 s or until further notice.
    Probe {
        backend: u8,
        up: bool,
        for_2s: bool,
    },
    Advance(u64),
}

fn chain_op() -> impl Strategy<Value = ChainOp> {
    prop_oneof![
        8 => (0..4u8, any::<bool>(), proptest::bool::weighted(0.2), proptest::bool::weighted(0.4))
            .prop_map(|(conv, keyed, fail, hold)| ChainOp::Turn { conv, keyed, fail, hold }),
        3 => any::<usize>().prop_map(ChainOp::Release),
        1 => (0..BACKENDS, 0..3u8, 1..3u32)
            .prop_map(|(backend, node, slots)| ChainOp::Insert { backend, node, slots }),
        2 => (0..BACKENDS).prop_map(ChainOp::Remove),
        2 => (0..BACKENDS, any::<bool>(), any::<bool>())
            .prop_map(|(backend, up, for_2s)| ChainOp::Probe { backend, up, for_2s }),
        1 => (1..8u64).prop_map(ChainOp::Advance),
    ]
}

/// Conversation `conv`'s prompt at turn `turn`: a system prompt every conversation shares,
/// its first message, then an answer and a question a turn.
fn conversation(conv: u8, turn: u32) -> PromptChain {
    let c = u64::from(conv);
    let blocks = [(1, 2_000), (100 + c, 200)]
        .into_iter()
        .chain((0..2 * u64::from(turn)).map(|i| (1_000 * (c + 1) + i, 50)));
    PromptChain::from_blocks(blocks)
}

type ChainSvc = SessionAffinity<FleetChannel<MockService>, HeaderKey, NodeThenBackend>;

/// The fleet as the test knows it, to check each placement against when it is made.
#[derive(Default)]
struct Fleet {
    live: HashSet<String>,
    down_until: HashMap<String, tokio::time::Instant>,
}

impl Fleet {
    fn up(&self) -> Vec<String> {
        let now = tokio::time::Instant::now();
        let mut up: Vec<String> = self
            .live
            .iter()
            .filter(|b| self.down_until.get(*b).is_none_or(|&t| t <= now))
            .cloned()
            .collect();
        up.sort();
        up
    }

    /// Checks what a request's poll came to, made now; keeps an answer held open.
    fn settle(
        &mut self,
        poll: Poll<Result<Res, Error>>,
        fail: bool,
        hold: bool,
        open: &mut Vec<Res>,
    ) -> bool {
        let up = self.up();
        match poll {
            Poll::Pending => return false,
            Poll::Ready(Ok(res)) => {
                let d = res.extensions().get::<Decision>().cloned().unwrap();
                let id = d.backend.to_string();
                assert!(self.live.contains(&id), "placed on removed backend {id}");
                assert!(up.contains(&id), "placed on {id}, which is down");
                if hold {
                    open.push(res);
                }
            }
            Poll::Ready(Err(Error::Backend { backend, .. })) => {
                let id = backend.to_string();
                assert!(fail, "{id} failed unasked");
                assert!(self.live.contains(&id), "placed on removed backend {id}");
                assert!(up.contains(&id), "placed on {id}, which is down");
                let until = tokio::time::Instant::now() + COOLDOWN;
                let at = self.down_until.entry(id).or_insert(until);
                *at = (*at).max(until);
            }
            Poll::Ready(Err(Error::NoBackends { .. })) => {
                assert!(up.is_empty(), "turned away while {up:?} were up");
            }
            // Full: every slot it may take is held, or its wait ran out.
            Poll::Ready(Err(Error::Saturated { .. })) => {}
            Poll::Ready(Err(e)) => panic!("unexpected error {e}"),
        }
        true
    }
}

fn drain(svc: &mut ChainSvc) {
    let mut ready = spawn(std::future::poll_fn(|cx| svc.poll_ready(cx)));
    assert!(matches!(ready.poll(), Poll::Ready(Ok(()))), "always ready");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// With prompts whose prefixes the backends hold, no request goes to a backend that is
    /// removed or marked down (by a failure or a probe), though the one holding its prefix
    /// (or its home) is: placed at once, or after waiting for a slot (answers held open fill
    /// the backends), held for its home's node, or overcommitted. A request is turned away
    /// as having no backend only when every live backend is down.
    #[test]
    fn no_request_goes_to_a_removed_or_down_backend_whatever_it_holds(
        overflow in overflow(),
        patience in prop_oneof![Just(0u64), Just(5u64)],
        ops in proptest::collection::vec(chain_op(), 1..60),
    ) {
        paused_runtime().block_on(tokio::task::unconstrained(async move {
            let (handle, stream) = discover::channel();
            let streams = Streams::default();
            let mut svc: ChainSvc = SessionAffinityLayer::new()
                .overflow(overflow)
                .failure_cooldown(COOLDOWN)
                .node_patience(Duration::from_secs(patience))
                .layer(stream);
            let mut fleet = Fleet::default();
            let mut open: Vec<Res> = Vec::new();
            let mut pending: Vec<(Fut, bool, bool)> = Vec::new();
            let mut turns = [0u32; 4];
            let setup = (0..3u8).map(|b| ChainOp::Insert { backend: b, node: b % 2, slots: 1 });
            for op in setup.chain(ops) {
                match op {
                    ChainOp::Turn { conv, keyed, fail, hold } => {
                        drain(&mut svc);
                        let chain = conversation(conv, turns[usize::from(conv)]);
                        turns[usize::from(conv)] += 1;
                        let session = keyed.then(|| format!("c{conv}"));
                        let mut fut = spawn(svc.call(chain_request(session, chain, fail)));
                        let poll = fut.poll();
                        if !fleet.settle(poll, fail, hold, &mut open) {
                            pending.push((fut, fail, hold));
                        }
                    }
                    ChainOp::Release(i) if !open.is_empty() => {
                        drop(open.swap_remove(i % open.len()));
                    }
                    ChainOp::Release(_) => {}
                    ChainOp::Insert { backend: b, node, slots } => {
                        let id = format!("b{b}");
                        let be = Backend::new(format!("n{node}"), backend(&id, &streams))
                            .slots(NonZeroU32::new(slots).unwrap());
                        handle.insert(id.clone(), be);
                        fleet.live.insert(id);
                        drain(&mut svc);
                    }
                    ChainOp::Remove(b) => {
                        let id = format!("b{b}");
                        handle.remove(id.clone());
                        fleet.live.remove(&id);
                        fleet.down_until.remove(&id);
                        drain(&mut svc);
                    }
                    ChainOp::Probe { backend: b, up, for_2s } => {
                        drain(&mut svc);
                        let id = format!("b{b}");
                        // Until further notice: as good as forever here.
                        let (cooldown, down) = match for_2s {
                            true => (Some(Duration::from_secs(2)), Duration::from_secs(2)),
                            false => (None, Duration::from_secs(10 * 365 * 86_400)),
                        };
                        if up {
                            if svc.mark_up(&id) {
                                fleet.down_until.remove(&id);
                            }
                        } else if svc.mark_down(&id, cooldown) {
                            let until = tokio::time::Instant::now() + down;
                            fleet.down_until.insert(id, until);
                        }
                    }
                    ChainOp::Advance(secs) => tokio::time::advance(Duration::from_secs(secs)).await,
                }
                // Waiting requests make progress when slots free, backends come or go, or
                // time passes; the woken ones run before the next step, as an executor
                // runs woken tasks (a bounded number of rounds).
                for round in 0..64 {
                    let before = pending.len();
                    let mut still = Vec::new();
                    for (mut fut, fail, hold) in std::mem::take(&mut pending) {
                        if round > 0 && !fut.is_woken() {
                            still.push((fut, fail, hold));
                            continue;
                        }
                        let poll = fut.poll();
                        if !fleet.settle(poll, fail, hold, &mut open) {
                            still.push((fut, fail, hold));
                        }
                    }
                    pending = still;
                    if pending.len() == before && pending.iter().all(|p| !p.0.is_woken()) {
                        break;
                    }
                }
            }
        }));
    }
}

/// A fleet of backends with the given slots, spread over `nodes` nodes.
fn slotted(slots: &[u32], nodes: usize) -> Snapshot {
    slots
        .iter()
        .enumerate()
        .fold(Snapshot::new(), |s, (i, &n)| {
            s.backend(&format!("b{i}"), &format!("n{}", i % nodes), n)
        })
}

/// How the conversations of a case look: `shared` links (a system prompt, a spec) that every
/// conversation starts with, then `own` links of its own first turn; between new
/// conversations, `later[i]` picks an earlier one whose next turn its home serves.
#[derive(Clone, Debug)]
struct Shape {
    shared: u64,
    own: u64,
    later: Vec<u8>,
}

fn shape() -> impl Strategy<Value = Shape> {
    (
        1..4u64,
        1..4u64,
        proptest::collection::vec(any::<u8>(), 0..60),
    )
        .prop_map(|(shared, own, later)| Shape { shared, own, later })
}

/// Places `n` new conversations one after another, each starting with the same prefix and
/// then its own first turn, recording each on the backend chosen (as the service does), and
/// between them the later turns of earlier ones on their homes; returns how many new
/// conversations each backend took.
fn place_sharing_a_prefix(
    mut fleet: Snapshot,
    n: u32,
    keyed: bool,
    shape: &Shape,
) -> HashMap<String, u32> {
    let p = NodeThenBackend::new();
    let mut took = HashMap::new();
    let mut placed: Vec<(Vec<(u64, u32)>, BackendId)> = Vec::new();
    for i in 0..n {
        let blocks: Vec<(u64, u32)> = (0..shape.shared)
            .map(|s| (1 + s, 1_000))
            .chain((0..shape.own).map(|o| (10_000 + 10 * u64::from(i) + o, 100)))
            .collect();
        let chain = PromptChain::from_blocks(blocks.iter().copied());
        let key = keyed.then(|| SessionKey::from_u128(u128::from(i) * 7_919 + 1));
        fleet = fleet.prompt(chain.clone());
        let id = fleet.choose(&p, key, None).unwrap();
        fleet = fleet.holds(id.as_str(), &chain);
        *took.entry(id.to_string()).or_insert(0) += 1;
        placed.push((blocks, id));
        if let Some(&c) = shape.later.get(i as usize) {
            let c = usize::from(c) % placed.len();
            let (blocks, home) = &mut placed[c];
            let next = (1_000_000 + 1_000 * c as u64 + blocks.len() as u64, 80);
            blocks.push(next);
            fleet = fleet.holds(
                home.as_str(),
                &PromptChain::from_blocks(blocks.iter().copied()),
            );
        }
    }
    took
}

/// What the conversation bound lets backend `slots` home once `n` conversations are placed on
/// a fleet of `total` slots: 1.25 times its share, rounded up, and never fewer than its slots.
fn allowance(n: u32, slots: u32, total: u32) -> u32 {
    let share = f64::from(n) * f64::from(slots) / f64::from(total);
    ((1.25 * share).ceil() as u32).max(slots)
}

/// Checks that no backend took more than the conversation bound allows by the end, and so
/// that the conversations went to at least as many backends as that forces.
fn check_spread(slots: &[u32], took: &HashMap<String, u32>, n: u32) -> Result<(), TestCaseError> {
    let total: u32 = slots.iter().sum();
    let mut most = 0;
    for (i, &s) in slots.iter().enumerate() {
        let got = took.get(&format!("b{i}")).copied().unwrap_or(0);
        let allowed = allowance(n, s, total);
        most = most.max(allowed);
        prop_assert!(
            got <= allowed,
            "b{} ({} slots) took {} of {}, over {}: {:?}",
            i,
            s,
            got,
            n,
            allowed,
            took
        );
    }
    prop_assert!(took.len() as u32 >= n.div_ceil(most), "{:?}", took);
    Ok(())
}

proptest! {
    /// A prefix every conversation shares (a system prompt, and a spec after it) draws new
    /// conversations only up to the conversation bound, while earlier conversations go on:
    /// none pins them to one backend, keyed or keyless. Backends of two slots or more; see
    /// the next property for one-slot backends.
    #[test]
    fn a_prefix_shared_by_every_conversation_never_pins_new_conversations_to_one_backend(
        slots in proptest::collection::vec(2..5u32, 2..8),
        nodes in 1..4usize,
        n in 1..60u32,
        keyed in any::<bool>(),
        shape in shape(),
    ) {
        let took = place_sharing_a_prefix(slotted(&slots, nodes), n, keyed, &shape);
        check_spread(&slots, &took, n)?;
    }

    /// The same with one-slot backends in the fleet.
    #[test]
    fn a_prefix_shared_by_every_conversation_never_pins_new_conversations_to_one_slot_backends(
        slots in proptest::collection::vec(1..5u32, 2..8),
        nodes in 1..4usize,
        n in 1..60u32,
        keyed in any::<bool>(),
        shape in shape(),
    ) {
        let took = place_sharing_a_prefix(slotted(&slots, nodes), n, keyed, &shape);
        check_spread(&slots, &took, n)?;
    }
}

/// A case the property above found: slots freed by failed requests on a backend marked
/// down, which none of three waiters could take, went from waiter to waiter in a circle,
/// each waking the next for as long as the backend stayed down (a spin, caught by the
/// harness's bound on wakes). Such slots now wake nobody, and a slot that no waiter takes
/// wakes each at most once.
#[test]
fn a_slot_no_waiter_can_take_wakes_each_waiter_once() {
    use Mode::{Fail, Hang, Stream};
    let call = |session, mode| Op::Call { session, mode };
    run(
        Overflow::wait(Duration::from_secs(30), 4),
        0,
        0,
        vec![
            call(None, Stream),
            call(Some(0), Hang),
            Op::Insert {
                backend: 5,
                node: 0,
                slots: 1,
            },
            call(Some(0), Fail),
            call(None, Stream),
            Op::Remove(5),
            call(None, Stream),
            call(None, Stream),
            call(Some(0), Fail),
            call(None, Stream),
            Op::Advance(5),
            Op::EndBody(4508789763449935303),
        ],
    );
}
