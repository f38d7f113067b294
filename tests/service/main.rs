//! The service's rules, one test each, with mock backends on paused time.

#[path = "../support/hang.rs"]
mod hang;
mod mock;

use std::convert::Infallible;
use std::num::NonZeroU32;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use mock::{backend, MockBody, MockService, Req, Streams};
use tokio_test::{assert_pending, assert_ready};
use tower::discover::Discover;
use tower::{Layer, Service, ServiceExt};
use tower_affinity::discover::{self, StaticFleet};
use tower_affinity::key::{HeaderKey, PromptFacts};
use tower_affinity::placement::Placement;
use tower_affinity::{
    Backend, Decision, Error, Outcome, Overflow, PromptChain, ResponseBody, RetryOnce,
    SessionAffinity, SessionAffinityLayer,
};

type Res = http::Response<ResponseBody<MockBody>>;

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap()
}

/// `(backend, node, slots)`
type Spec<'a> = &'a [(&'a str, &'a str, u32)];

const TWO_BY_TWO: Spec<'static> = &[
    ("a1", "node-a", 1),
    ("a2", "node-a", 1),
    ("b1", "node-b", 1),
    ("b2", "node-b", 1),
];

fn fleet(spec: Spec<'_>, streams: &Streams) -> StaticFleet<MockService> {
    StaticFleet::new(spec.iter().map(|&(id, node, slots)| {
        (
            id,
            Backend::new(node, backend(id, streams)).slots(nz(slots)),
        )
    }))
}

fn request(session: Option<&str>, mode: Option<&str>) -> Req {
    let mut b = http::Request::post("/v1/chat/completions");
    if let Some(s) = session {
        b = b.header("x-session-id", s);
    }
    if let Some(m) = mode {
        b = b.header("x-mode", m);
    }
    b.body(String::new()).unwrap()
}

async fn send<S>(svc: &mut S, session: Option<&str>, mode: Option<&str>) -> Result<Res, Error>
where
    S: Service<Req, Response = Res, Error = Error>,
{
    send_req(svc, request(session, mode)).await
}

async fn send_req<S>(svc: &mut S, req: Req) -> Result<Res, Error>
where
    S: Service<Req, Response = Res, Error = Error>,
{
    svc.ready().await?.call(req).await
}

/// Requests for each of `sessions`, polled once: each must wait for a slot.
async fn waiters<S>(svc: &mut S, sessions: &[&str]) -> Vec<tokio_test::task::Spawn<S::Future>>
where
    S: Service<Req, Response = Res, Error = Error>,
{
    let mut waiting = Vec::new();
    for &session in sessions {
        svc.ready().await.unwrap();
        let mut w = tokio_test::task::spawn(svc.call(request(Some(session), None)));
        assert_pending!(w.poll());
        waiting.push(w);
    }
    waiting
}

/// Awaits every task, failing with `what` if they are not all done within 30 s (a bound for a
/// hang, not a timing).
async fn join_within_30s<T>(tasks: Vec<tokio::task::JoinHandle<T>>, what: &str) {
    let all = async {
        for task in tasks {
            task.await.unwrap();
        }
    };
    tokio::time::timeout(Duration::from_secs(30), all)
        .await
        .expect(what);
}

fn decision(res: &Res) -> Decision {
    res.extensions().get::<Decision>().cloned().unwrap()
}

async fn turn<S>(svc: &mut S, session: &str) -> Decision
where
    S: Service<Req, Response = Res, Error = Error>,
{
    let res = send(svc, Some(session), None).await.unwrap();
    let d = decision(&res);
    res.into_body().collect().await.unwrap();
    d
}

/// The first turns of sessions `s0` to `s{n-1}`, one after another.
async fn first_turns<S>(svc: &mut S, n: usize) -> Vec<Decision>
where
    S: Service<Req, Response = Res, Error = Error>,
{
    let mut homes = Vec::with_capacity(n);
    for i in 0..n {
        homes.push(turn(svc, &format!("s{i}")).await);
    }
    homes
}

fn in_flight<D, K, P, S>(svc: &SessionAffinity<D, K, P>, id: &str) -> u32
where
    D: Discover<Key = tower_affinity::BackendId, Service = Backend<S>>,
{
    status(svc, id).in_flight
}

fn failures<D, K, P, S>(svc: &SessionAffinity<D, K, P>, id: &str) -> u64
where
    D: Discover<Key = tower_affinity::BackendId, Service = Backend<S>>,
{
    status(svc, id).failures
}

fn status<D, K, P, S>(svc: &SessionAffinity<D, K, P>, id: &str) -> tower_affinity::BackendStatus
where
    D: Discover<Key = tower_affinity::BackendId, Service = Backend<S>>,
{
    svc.backends()
        .into_iter()
        .find(|b| b.id.as_str() == id)
        .unwrap_or_else(|| panic!("no backend {id}"))
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn second_turn_returns_to_its_home() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new().layer(fleet(TWO_BY_TWO, &streams));
    let first = turn(&mut svc, "s").await;
    assert_eq!(first.outcome, Outcome::NewSession);
    for _ in 0..5 {
        let next = turn(&mut svc, "s").await;
        assert_eq!(next.outcome, Outcome::HomeHit);
        assert_eq!(next.backend, first.backend);
    }
    let stats = svc.stats();
    assert_eq!(
        (stats.new_sessions, stats.home_hits, stats.sessions),
        (1, 5, 1)
    );
    assert_eq!(stats.in_flight, 0);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn spill_order_on_two_nodes_of_two_backends() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .overflow(Overflow::Reject)
        .layer(fleet(TWO_BY_TWO, &streams));
    let home = turn(&mut svc, "s").await;
    // Each earlier turn keeps streaming, so every later turn finds its preferred backend busy.
    let mut held = Vec::new();
    let mut seen = Vec::new();
    for _ in 0..4 {
        let res = send(&mut svc, Some("s"), Some("stream")).await.unwrap();
        seen.push(decision(&res));
        held.push(res);
    }
    assert_eq!(seen[0].outcome, Outcome::HomeHit);
    assert_eq!(seen[0].backend, home.backend);
    assert_eq!(seen[1].outcome, Outcome::SameNodeSpill);
    assert_eq!(seen[1].node, home.node);
    // Having spilled, the session's home is where it went: the next spill is from there.
    assert_eq!(seen[2].outcome, Outcome::CrossNodeSpill);
    assert_ne!(seen[2].node, home.node);
    assert_eq!(seen[3].outcome, Outcome::SameNodeSpill);
    assert_eq!(seen[3].node, seen[2].node);
    let err = send(&mut svc, Some("s"), None).await.unwrap_err();
    assert!(matches!(err, Error::Saturated { .. }));
    assert_eq!(err.retry_after(), Some(Duration::from_secs(1)));
    drop(held);
    assert_eq!(svc.stats().in_flight, 0);
    assert!(
        svc.stats().session_table_bytes > 0,
        "the session's home is held"
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn header_fall_through_at_the_service() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new().layer(fleet(TWO_BY_TWO, &streams));
    let by_id = turn(&mut svc, "run-1").await;
    let req = http::Request::post("/")
        .header("x-session-affinity", "")
        .header("x-session-id", "run-1")
        .body(String::new())
        .unwrap();
    let res = svc.ready().await.unwrap().call(req).await.unwrap();
    assert_eq!(decision(&res).outcome, Outcome::HomeHit);
    assert_eq!(decision(&res).backend, by_id.backend);
    // X-Session-Affinity wins when both are set.
    let req = http::Request::post("/")
        .header("x-session-affinity", "run-2")
        .header("x-session-id", "run-1")
        .body(String::new())
        .unwrap();
    let res = svc.ready().await.unwrap().call(req).await.unwrap();
    assert_eq!(decision(&res).outcome, Outcome::NewSession);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn keyless_placement_goes_by_load() {
    let streams = Streams::default();
    let spec: Spec<'_> = &[("a1", "a", 3), ("a2", "a", 3), ("b1", "b", 3)];
    let mut svc = SessionAffinityLayer::new().layer(fleet(spec, &streams));
    let mut held = Vec::new();
    for _ in 0..9 {
        let res = send(&mut svc, None, Some("stream")).await.unwrap();
        assert_eq!(decision(&res).outcome, Outcome::Keyless);
        held.push(res);
    }
    // Nine keyless requests on nine slots: each found a free slot while one was left, even
    // when both backends it sampled were full.
    for id in ["a1", "a2", "b1"] {
        assert_eq!(in_flight(&svc, id), 3, "{id}");
    }
    assert_eq!(
        svc.stats().sessions,
        0,
        "keyless requests leave no session behind"
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn two_independent_instances_agree_on_new_sessions() {
    let spec: Spec<'_> = &[
        ("a1", "a", 2),
        ("a2", "a", 2),
        ("b1", "b", 4),
        ("c1", "c", 1),
        ("c2", "c", 1),
        ("c3", "c", 1),
    ];
    let reversed: Vec<_> = spec.iter().rev().copied().collect();
    let (s1, s2) = (Streams::default(), Streams::default());
    let mut one = SessionAffinityLayer::new().layer(fleet(spec, &s1));
    let mut two = SessionAffinityLayer::new().layer(fleet(&reversed, &s2));
    for i in 0..200 {
        let s = format!("session-{i}");
        assert_eq!(
            turn(&mut one, &s).await.backend,
            turn(&mut two, &s).await.backend,
            "{s}"
        );
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn removing_one_backend_moves_only_its_sessions() {
    let streams = Streams::default();
    let (handle, stream) = discover::channel();
    for n in 0..4 {
        for b in 0..2 {
            let id = format!("n{n}-b{b}");
            handle.insert(
                id.clone(),
                Backend::new(format!("n{n}"), backend(&id, &streams)).slots(nz(8)),
            );
        }
    }
    let mut svc = SessionAffinityLayer::new().layer(stream);
    let homes = first_turns(&mut svc, 400).await;
    let victim = homes[0].backend.clone();
    handle.remove(victim.clone());
    let mut replaced = 0;
    for (i, home) in homes.iter().enumerate() {
        let now = turn(&mut svc, &format!("s{i}")).await;
        if home.backend == victim {
            replaced += 1;
            assert_eq!(now.outcome, Outcome::Replaced);
            assert_eq!(now.node, home.node, "same node first");
            assert_ne!(now.backend, victim);
        } else {
            assert_eq!(now.outcome, Outcome::HomeHit);
            assert_eq!(now.backend, home.backend);
        }
    }
    assert!(replaced > 10);
    assert_eq!(svc.stats().replaced, replaced);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn sessions_of_a_node_gone_are_not_drawn_to_the_node_that_takes_its_place() {
    // One backend a node, named by address as DNS discovery names them. The replaced
    // backend's node is forgotten, and so are many others; new nodes come, and one of them
    // takes the forgotten node's place in the router's tables. The sessions homed on the
    // replaced backend are placed anew, spread, not all sent to that newcomer.
    let streams = Streams::default();
    let (handle, stream) = discover::channel();
    let add = |ip: &str| {
        let id = format!("{ip}:8080");
        handle.insert(
            id.clone(),
            Backend::new(ip, backend(&id, &streams)).slots(nz(64)),
        );
    };
    for n in 0..4 {
        add(&format!("10.0.0.{n}"));
    }
    let mut svc = SessionAffinityLayer::new().layer(stream);
    let homes = first_turns(&mut svc, 400).await;
    let victim = homes[0].backend.clone();
    // Others, on nodes of their own, come and go after the victim: their nodes are forgotten
    // after its.
    for n in 0..100 {
        add(&format!("10.0.2.{n}"));
    }
    handle.remove(victim.clone());
    for n in 0..100 {
        handle.remove(format!("10.0.2.{n}:8080"));
    }
    // Newcomers take the removed backends' places, and their nodes the forgotten nodes'.
    for n in 0..200 {
        add(&format!("10.0.1.{n}"));
    }
    let mut replaced = 0;
    let mut by_node: std::collections::HashMap<String, usize> = Default::default();
    for (i, home) in homes.iter().enumerate() {
        let now = turn(&mut svc, &format!("s{i}")).await;
        if home.backend == victim {
            replaced += 1;
            assert_eq!(now.outcome, Outcome::Replaced);
            *by_node.entry(now.node.to_string()).or_default() += 1;
        } else {
            assert_eq!(now.outcome, Outcome::HomeHit);
        }
    }
    assert!(replaced > 40, "{replaced}");
    let most = by_node.values().max().copied().unwrap_or(0);
    assert!(
        most < replaced / 4,
        "{most} of {replaced} on one node: {by_node:?}"
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn reinserting_a_backend_keeps_its_sessions() {
    let streams = Streams::default();
    let (handle, stream) = discover::channel();
    handle.insert("a1", Backend::new("a", backend("a1", &streams)));
    handle.insert("b1", Backend::new("b", backend("b1", &streams)));
    let mut svc = SessionAffinityLayer::new().layer(stream);
    let home = turn(&mut svc, "s").await;
    // An update (more slots) and a quick remove-then-insert both keep the session home.
    handle.insert(
        home.backend.clone(),
        Backend::new(home.node.clone(), backend(home.backend.as_str(), &streams)).slots(nz(4)),
    );
    assert_eq!(turn(&mut svc, "s").await.outcome, Outcome::HomeHit);
    assert_eq!(
        svc.backends()
            .iter()
            .find(|b| b.id == home.backend)
            .unwrap()
            .slots,
        4
    );
    handle.remove(home.backend.clone());
    handle.insert(
        home.backend.clone(),
        Backend::new(home.node.clone(), backend(home.backend.as_str(), &streams)),
    );
    let again = turn(&mut svc, "s").await;
    assert_eq!(
        (again.outcome, again.backend),
        (Outcome::HomeHit, home.backend)
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_streamed_body_holds_its_slot_until_its_last_frame() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new().layer(fleet(&[("a1", "a", 1)], &streams));
    let res = send(&mut svc, Some("s"), Some("stream")).await.unwrap();
    assert_eq!(in_flight(&svc, "a1"), 1, "held after the response headers");
    let (_, tx) = streams.take().unwrap();
    let mut body = res.into_body();
    tx.send(Ok(http_body::Frame::data(Bytes::from_static(b"tok"))))
        .unwrap();
    let frame = body.frame().await.unwrap().unwrap();
    assert_eq!(frame.into_data().unwrap(), "tok");
    assert_eq!(in_flight(&svc, "a1"), 1, "held while the body streams");
    drop(tx);
    assert!(body.frame().await.is_none());
    assert_eq!(in_flight(&svc, "a1"), 0, "released at the end of the body");
    drop(body);
    assert_eq!(svc.stats().in_flight, 0, "and not released twice");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_dropped_body_releases_its_slot() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new().layer(fleet(&[("a1", "a", 1)], &streams));
    let res = send(&mut svc, Some("s"), Some("stream")).await.unwrap();
    assert_eq!(in_flight(&svc, "a1"), 1);
    drop(res);
    assert_eq!(in_flight(&svc, "a1"), 0);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_dropped_future_releases_its_slot() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new().layer(fleet(&[("a1", "a", 1)], &streams));
    svc.ready().await.unwrap();
    let mut fut = tokio_test::task::spawn(svc.call(request(Some("s"), Some("hang"))));
    assert_pending!(fut.poll());
    assert_eq!(in_flight(&svc, "a1"), 1);
    drop(fut);
    assert_eq!(in_flight(&svc, "a1"), 0);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_failed_backend_releases_its_slot_and_is_passed_over() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .failure_cooldown(Duration::from_secs(5))
        .layer(fleet(&[("a1", "a", 1), ("a2", "a", 1)], &streams));
    let home = turn(&mut svc, "s").await;
    let err = send(&mut svc, Some("s"), Some("fail")).await.unwrap_err();
    assert!(matches!(&err, Error::Backend { backend, .. } if *backend == home.backend));
    assert_eq!(err.status(), 502);
    assert_eq!(svc.stats().in_flight, 0);
    assert_eq!(svc.stats().backend_errors, 1);
    assert_eq!(failures(&svc, home.backend.as_str()), 1);
    let moved = turn(&mut svc, "s").await;
    assert_ne!(moved.backend, home.backend, "down for its cooldown");
    assert_eq!(moved.outcome, Outcome::SameNodeSpill);
    tokio::time::advance(Duration::from_secs(6)).await;
    assert!(svc.backends().iter().all(|b| b.healthy));
}

/// A backend whose readiness never comes: it fails, as a connection pool that cannot connect
/// would, or it stays pending, as a backend stuck, or behind a limit of its own lower than
/// its slots.
#[derive(Clone)]
struct NeverReady {
    fails: bool,
}

impl Service<Req> for NeverReady {
    type Response = http::Response<MockBody>;
    type Error = tower_affinity::BoxError;
    type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        if self.fails {
            std::task::Poll::Ready(Err("no connection to the backend".into()))
        } else {
            std::task::Poll::Pending
        }
    }

    fn call(&mut self, _: Req) -> Self::Future {
        unreachable!("called without readiness")
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_backend_not_ready_at_placement_is_called_once_ready_and_holds_its_slot_meanwhile() {
    let streams = Streams::default();
    // One backend with two slots behind a concurrency limit of one, shared by its clones.
    let limited = MockService::new(tower::limit::ConcurrencyLimit::new(
        backend("a1", &streams),
        1,
    ));
    let mut svc = SessionAffinityLayer::new().layer(StaticFleet::new([(
        "a1",
        Backend::new("a", limited).slots(nz(2)),
    )]));
    svc.ready().await.unwrap();
    let mut first = tokio_test::task::spawn(svc.call(request(Some("s"), Some("hang"))));
    assert_pending!(first.poll());
    svc.ready().await.unwrap();
    let mut second = tokio_test::task::spawn(svc.call(request(Some("s"), None)));
    assert_pending!(second.poll(), "the limit is taken by the first request");
    assert_eq!(in_flight(&svc, "a1"), 2, "both hold a slot");
    drop(first);
    assert!(
        second.is_woken(),
        "the freed limit wakes the waiting request"
    );
    let res = assert_ready!(second.poll()).unwrap();
    assert_eq!(decision(&res).backend.as_str(), "a1");
    assert_eq!(res.into_body().collect().await.unwrap().to_bytes(), "a1");
    assert_eq!(in_flight(&svc, "a1"), 0);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_backend_never_ready_fails_its_request_at_the_ready_timeout_and_is_passed_over() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .failure_cooldown(Duration::from_secs(5))
        .layer(StaticFleet::new([
            (
                "a1",
                Backend::new("a", MockService::new(NeverReady { fails: false })),
            ),
            ("a2", Backend::new("a", backend("a2", &streams))),
        ]));
    // A new session placed on a1: the first key whose placement lands there.
    let mut stuck = None;
    for i in 0..64 {
        svc.ready().await.unwrap();
        let mut call = tokio_test::task::spawn(svc.call(request(Some(&format!("s{i}")), None)));
        if call.poll().is_pending() {
            stuck = Some(call);
            break;
        }
    }
    let mut stuck = stuck.expect("a new session placed on a1");
    assert_eq!(in_flight(&svc, "a1"), 1, "it holds its slot meanwhile");
    tokio::time::advance(SessionAffinityLayer::READY_TIMEOUT - Duration::from_millis(1)).await;
    assert_pending!(stuck.poll());
    tokio::time::advance(Duration::from_millis(1)).await;
    assert!(stuck.is_woken());
    let err = assert_ready!(stuck.poll()).unwrap_err();
    assert!(matches!(&err, Error::Backend { backend, .. } if backend.as_str() == "a1"));
    assert_eq!(err.status(), 504, "{err}");
    assert_eq!((in_flight(&svc, "a1"), failures(&svc, "a1")), (0, 1));
    let res = send(&mut svc, None, None).await.unwrap();
    assert_eq!(decision(&res).backend.as_str(), "a2", "a1 is passed over");
}

/// Under `RetryOnce`, a request whose backend was never ready is sent to the next one.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn retry_once_moves_a_request_past_a_backend_never_ready() {
    let streams = Streams::default();
    let svc = SessionAffinityLayer::new().layer(StaticFleet::new([
        (
            "a1",
            Backend::new("a", MockService::new(NeverReady { fails: false })),
        ),
        ("a2", Backend::new("a", backend("a2", &streams))),
    ]));
    let retrying = tower::retry::RetryLayer::new(RetryOnce::new()).layer(svc.clone());
    // A new session placed on a1 first: the first key whose placement lands there.
    for i in 0..64 {
        let mut call = tokio_test::task::spawn(
            retrying
                .clone()
                .oneshot(request(Some(&format!("s{i}")), None)),
        );
        if call.poll().is_ready() {
            continue;
        }
        tokio::time::advance(SessionAffinityLayer::READY_TIMEOUT).await;
        let res = call.await.unwrap();
        assert_eq!(decision(&res).backend.as_str(), "a2");
        assert_eq!(failures(&svc, "a1"), 1);
        return;
    }
    panic!("no session was placed on a1");
}

/// With no ready timeout, a request waits for its backend as long as it takes.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn without_a_ready_timeout_a_request_waits_for_its_backend() {
    let mut svc = SessionAffinityLayer::new()
        .ready_timeout(None)
        .layer(StaticFleet::new([(
            "a1",
            Backend::new("a", MockService::new(NeverReady { fails: false })),
        )]));
    svc.ready().await.unwrap();
    let mut call = tokio_test::task::spawn(svc.call(request(Some("s"), None)));
    assert_pending!(call.poll());
    tokio::time::advance(Duration::from_secs(24 * 3600)).await;
    assert_pending!(call.poll());
    assert_eq!((in_flight(&svc, "a1"), failures(&svc, "a1")), (1, 0));
    drop(call);
    assert_eq!(in_flight(&svc, "a1"), 0);
}

/// A ready timeout of zero does not wait for the timer: the first poll that finds the backend
/// not ready fails the request.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn with_a_ready_timeout_of_zero_a_backend_not_ready_fails_its_request_at_once() {
    let mut svc = SessionAffinityLayer::new()
        .ready_timeout(Duration::ZERO)
        .layer(StaticFleet::new([(
            "a1",
            Backend::new("a", MockService::new(NeverReady { fails: false })),
        )]));
    svc.ready().await.unwrap();
    let mut call = tokio_test::task::spawn(svc.call(request(Some("s"), None)));
    let err = assert_ready!(call.poll()).unwrap_err();
    assert!(matches!(&err, Error::Backend { backend, .. } if backend.as_str() == "a1"));
    assert_eq!((in_flight(&svc, "a1"), failures(&svc, "a1")), (0, 1));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_backend_failing_readiness_fails_the_request_and_is_passed_over() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .failure_cooldown(Duration::from_secs(5))
        .layer(StaticFleet::new([
            (
                "a1",
                Backend::new("a", MockService::new(NeverReady { fails: true })),
            ),
            ("a2", Backend::new("a", backend("a2", &streams))),
        ]));
    // Keyless requests try either backend; within two, one of them lands on `a1`.
    let mut failed = None;
    for _ in 0..64 {
        if let Err(e) = send(&mut svc, None, None).await {
            failed = Some(e);
            break;
        }
    }
    let err = failed.expect("a request reached the backend that is never ready");
    assert!(matches!(&err, Error::Backend { backend, .. } if backend.as_str() == "a1"));
    assert_eq!(err.status(), 502);
    assert_eq!(svc.stats().backend_errors, 1);
    assert_eq!(svc.stats().in_flight, 0);
    assert_eq!((failures(&svc, "a1"), failures(&svc, "a2")), (1, 0));
    for _ in 0..8 {
        let res = send(&mut svc, None, None).await.unwrap();
        assert_eq!(
            decision(&res).backend.as_str(),
            "a2",
            "a1 is down for its cooldown"
        );
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn retry_once_lands_on_the_next_candidate() {
    let streams = Streams::default();
    let svc = SessionAffinityLayer::new().layer(fleet(TWO_BY_TWO, &streams));
    let mut retrying = tower::retry::RetryLayer::new(RetryOnce::new()).layer(svc.clone());
    let home = turn(&mut retrying, "s").await;
    // The home refuses the next turn: the failure never reaches the client, the home is
    // marked down, and the retry goes next door.
    let mut req = request(Some("s"), None);
    req.headers_mut().insert(
        "x-fail-on",
        http::HeaderValue::from_str(home.backend.as_str()).unwrap(),
    );
    let res = retrying.ready().await.unwrap().call(req).await.unwrap();
    let d = decision(&res);
    assert_eq!(d.outcome, Outcome::SameNodeSpill);
    assert_eq!(d.node, home.node);
    assert_eq!(svc.stats().backend_errors, 1);
    drop(res);
    // Only once: a request that fails on two backends in a row reports the second failure.
    let mut req = request(Some("s"), Some("fail"));
    req.headers_mut()
        .insert("x-fail-on", http::HeaderValue::from_static("none"));
    let err = retrying.ready().await.unwrap().call(req).await.unwrap_err();
    assert!(matches!(err, Error::Backend { .. }));
    assert_eq!(svc.stats().backend_errors, 3);
    assert_eq!(svc.stats().in_flight, 0);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_backend_answering_503_is_passed_over_and_the_request_retried() {
    let streams = Streams::default();
    let svc = SessionAffinityLayer::new()
        .failure_cooldown(Duration::from_secs(5))
        .layer(fleet(TWO_BY_TWO, &streams));
    let mut retrying = tower::retry::RetryLayer::new(RetryOnce::new()).layer(svc.clone());
    let home = turn(&mut retrying, "s").await;
    let unavailable_on = |backend: &str| {
        let mut req = request(Some("s"), None);
        let v = http::HeaderValue::from_str(backend).unwrap();
        req.headers_mut().insert("x-unavailable-on", v);
        req
    };
    // The home answers 503: the client never sees it, the home is passed over for its
    // cooldown, and the retry goes next door.
    let req = unavailable_on(home.backend.as_str());
    let res = retrying.ready().await.unwrap().call(req).await.unwrap();
    let d = decision(&res);
    assert_eq!(
        (res.status(), d.outcome),
        (http::StatusCode::OK, Outcome::SameNodeSpill)
    );
    assert_eq!(d.node, home.node);
    drop(res);
    // Passed over, and counted, so that its status says why.
    let passed_over = status(&svc, home.backend.as_str());
    assert_eq!((passed_over.healthy, passed_over.failures), (false, 1));
    assert_eq!(svc.stats().backend_errors, 1);
    let next = turn(&mut retrying, "s").await;
    assert_ne!(next.backend, home.backend, "down for its cooldown");
    tokio::time::advance(Duration::from_secs(6)).await;
    assert!(svc.backends().iter().all(|b| b.healthy));
    // Without a retry the 503 is the answer; the backend is passed over all the same.
    let mut plain = svc.clone();
    let req = unavailable_on(next.backend.as_str());
    let res = plain.ready().await.unwrap().call(req).await.unwrap();
    assert_eq!(res.status(), 503);
    let body = res.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "Loading model");
    assert!(!status(&svc, next.backend.as_str()).healthy);
    assert_eq!(svc.stats().in_flight, 0);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn wait_returns_the_session_to_its_home_when_the_home_frees_first() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .overflow(Overflow::wait(Duration::from_secs(60), 8))
        .layer(fleet(&[("a1", "a", 1), ("b1", "b", 1)], &streams));
    // The session's first turn is still streaming on its home; another session fills the rest.
    let mine = send(&mut svc, Some("mine"), Some("stream")).await.unwrap();
    let home = decision(&mine).backend;
    let other = send(&mut svc, Some("other"), Some("stream")).await.unwrap();
    assert_ne!(decision(&other).backend, home);
    let (_, first_tx) = streams.take().unwrap();
    let (_, _other_tx) = streams.take().unwrap();

    svc.ready().await.unwrap();
    let mut next = tokio_test::task::spawn(svc.call(request(Some("mine"), None)));
    assert_pending!(next.poll());
    assert_eq!(svc.stats().waiting, 1);
    tokio::time::advance(Duration::from_secs(10)).await;
    assert_pending!(next.poll());

    // The home frees first.
    drop(first_tx);
    mine.into_body().collect().await.unwrap();
    assert!(next.is_woken());
    let res = assert_ready!(next.poll()).unwrap();
    let d = decision(&res);
    assert_eq!((d.backend, d.outcome), (home, Outcome::HomeHit));
    assert_eq!(d.waited, Some(Duration::from_secs(10)));
    assert_eq!(svc.stats().waiting, 0);
    assert_eq!(svc.stats().waited, 1);
}

/// Records what `BackendRef::waiting` says of backend `a1` at each placement, then places
/// as `NodeThenBackend` does.
#[derive(Clone, Default)]
struct SeesWaiting(std::sync::Arc<parking_lot::Mutex<Vec<u32>>>);

impl Placement for SeesWaiting {
    fn place(
        &self,
        fleet: &tower_affinity::placement::FleetView<'_>,
        req: &tower_affinity::placement::PlacementRequest<'_>,
        c: &mut tower_affinity::placement::Candidates<'_>,
    ) {
        let a1 = fleet
            .backend(&"a1".into())
            .map_or(u32::MAX, |b| b.waiting());
        self.0.lock().push(a1);
        tower_affinity::placement::NodeThenBackend::new().place(fleet, req, c);
    }
}

/// A policy reads how many requests wait for a slot on a backend, those whose session is
/// homed there: the queue that its in-flight count, bounded by its slots, does not show. A
/// request with its cache nowhere is not counted there, and the count falls as they are
/// served.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_policy_sees_the_requests_waiting_for_a_backend_that_its_cache_is_on() {
    let streams = Streams::default();
    let seen = SeesWaiting::default();
    let mut svc = SessionAffinityLayer::new()
        .placement(seen.clone())
        .layer(fleet(&[("a1", "a", 1)], &streams));
    let last = || *seen.0.lock().last().unwrap();
    let mine = send(&mut svc, Some("mine"), Some("stream")).await.unwrap();
    let (_, first_tx) = streams.take().unwrap();
    assert_eq!(last(), 0);
    let queued = waiters(&mut svc, &["mine", "new"]).await;
    assert_eq!(svc.stats().waiting, 2);
    // The new session's own look, once queued: only the turn homed on a1 waits for it.
    assert_eq!(last(), 1);
    drop(first_tx);
    mine.into_body().collect().await.unwrap();
    for w in queued {
        w.await.unwrap().into_body().collect().await.unwrap();
    }
    assert_eq!(svc.stats().waiting, 0);
    turn(&mut svc, "later").await;
    assert_eq!(last(), 0);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn wait_spills_when_another_backend_frees_first() {
    let streams = Streams::default();
    let mut svc =
        SessionAffinityLayer::new().layer(fleet(&[("a1", "a", 1), ("b1", "b", 1)], &streams));
    let mine = send(&mut svc, Some("mine"), Some("stream")).await.unwrap();
    let other = send(&mut svc, Some("other"), Some("stream")).await.unwrap();
    let (_, _mine_tx) = streams.take().unwrap();
    let (_, other_tx) = streams.take().unwrap();
    svc.ready().await.unwrap();
    let mut next = tokio_test::task::spawn(svc.call(request(Some("mine"), None)));
    assert_pending!(next.poll());
    drop(other_tx);
    other.into_body().collect().await.unwrap();
    let res = assert_ready!(next.poll()).unwrap();
    assert_eq!(decision(&res).outcome, Outcome::CrossNodeSpill);
    assert_ne!(decision(&res).backend, decision(&mine).backend);
}

/// One backend failed (down for its 2 s cooldown), the other held by a stream: a request
/// arriving then waits, for at most `max_wait`. Returns it, and what must stay alive meanwhile.
async fn waiting_while_a_backend_cools_down(
    max_wait: Duration,
) -> (
    tokio_test::task::Spawn<impl std::future::Future<Output = Result<Res, Error>>>,
    impl Sized,
) {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .failure_cooldown(Duration::from_secs(2))
        .overflow(Overflow::wait(max_wait, 8))
        .layer(fleet(&[("a1", "a", 1), ("b1", "b", 1)], &streams));
    let err = send(&mut svc, Some("f"), Some("fail")).await.unwrap_err();
    let Error::Backend {
        backend: failed, ..
    } = err
    else {
        panic!("{err}")
    };
    let held = send(&mut svc, Some("long"), Some("stream")).await.unwrap();
    assert_ne!(
        decision(&held).backend,
        failed,
        "the failed backend is down"
    );
    let stream = streams.take().unwrap();
    svc.ready().await.unwrap();
    let mut next = tokio_test::task::spawn(svc.call(request(Some("next"), None)));
    assert_pending!(next.poll());
    assert_eq!(svc.stats().waiting, 1);
    (next, (held, stream, svc))
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_waiting_request_takes_a_backend_back_when_its_failure_cooldown_ends() {
    let (mut next, _alive) = waiting_while_a_backend_cools_down(Duration::from_secs(60)).await;
    tokio::time::advance(Duration::from_millis(1_990)).await;
    assert!(!next.is_woken());
    assert_pending!(next.poll());
    tokio::time::advance(Duration::from_millis(20)).await;
    assert!(next.is_woken(), "nothing ended, but the cooldown did");
    let res = assert_ready!(next.poll()).unwrap();
    assert_eq!(decision(&res).outcome, Outcome::NewSession);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_wait_ending_as_a_cooldown_does_looks_once_more_before_refusing() {
    let (mut next, _alive) = waiting_while_a_backend_cools_down(Duration::from_secs(2)).await;
    tokio::time::advance(Duration::from_millis(2_010)).await;
    assert!(next.is_woken());
    let res = assert_ready!(next.poll()).expect("the backend is back at the deadline");
    assert_eq!(decision(&res).outcome, Outcome::NewSession);
}

/// Slots freed on a backend that is down wake no waiting request, as none can take them: its
/// going down woke each waiter once, and their timers bring them back when it comes back.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn slots_freed_on_a_backend_that_is_down_wake_no_waiter() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .failure_cooldown(Duration::from_secs(2))
        .overflow(Overflow::wait(Duration::from_secs(60), 8))
        .layer(fleet(&[("a1", "a", 2), ("b1", "b", 1)], &streams));
    let mut on_a = Vec::new();
    let mut on_b = Vec::new();
    for s in ["s1", "s2", "s3"] {
        let res = send(&mut svc, Some(s), Some("stream")).await.unwrap();
        let open = (res, streams.take().unwrap());
        match open.1 .0.as_str() {
            "a1" => on_a.push(open),
            _ => on_b.push(open),
        }
    }
    assert_eq!((on_a.len(), on_b.len()), (2, 1));
    // One of a1's streams ends; a request that will fail there takes its slot, and the next
    // one waits.
    drop(on_a.pop());
    svc.ready().await.unwrap();
    let mut req = request(Some("f"), None);
    req.headers_mut()
        .insert("x-fail-on", http::HeaderValue::from_static("a1"));
    let mut failing = tokio_test::task::spawn(svc.call(req));
    svc.ready().await.unwrap();
    let mut waiting = tokio_test::task::spawn(svc.call(request(Some("w"), None)));
    assert_pending!(waiting.poll());
    // The failure marks a1 down: the waiter looks, and waits for its return.
    assert!(assert_ready!(failing.poll()).is_err());
    assert!(waiting.is_woken(), "the backend going down wakes it");
    assert_pending!(waiting.poll());
    // a1's other stream ends while it is down.
    drop(on_a.pop());
    assert_eq!(in_flight(&svc, "a1"), 0);
    assert!(!waiting.is_woken(), "a slot it cannot take woke it");
    tokio::time::advance(Duration::from_millis(2_010)).await;
    assert!(waiting.is_woken(), "the backend's return wakes it");
    let res = assert_ready!(waiting.poll()).unwrap();
    assert_eq!(decision(&res).backend.as_str(), "a1");
}

/// A mark that ends sooner than the one it replaces (a probe's mark until further notice,
/// then one with a cooldown) wakes the waiting requests: their timers were set for the mark it
/// replaces, or for none, and the slots freed on the backend meanwhile woke nobody.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_mark_down_under_a_millisecond_still_passes_the_backend_over() {
    let streams = Streams::default();
    let mut svc =
        SessionAffinityLayer::new().layer(fleet(&[("a1", "a", 1), ("b1", "b", 1)], &streams));
    let home = decision(&send(&mut svc, Some("s"), None).await.unwrap()).backend;
    // The fleet's clock counts milliseconds: a shorter mark still outlasts the one it began in.
    assert!(svc.mark_down(home.as_str(), Some(Duration::from_micros(500))));
    let res = send(&mut svc, Some("s"), None).await.unwrap();
    assert_ne!(
        decision(&res).backend,
        home,
        "placed on a backend marked down"
    );
    drop(res);
    tokio::time::advance(Duration::from_millis(1)).await;
    let res = send(&mut svc, Some("s"), None).await.unwrap();
    assert_eq!(decision(&res).outcome, Outcome::HomeHit, "its new home");
    // The mark over, the backend takes sessions again.
    svc.mark_down(decision(&res).backend.as_str(), None);
    drop(res);
    let res = send(&mut svc, Some("s"), None).await.unwrap();
    assert_eq!(decision(&res).backend, home);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_mark_down_ending_sooner_than_the_one_it_replaces_wakes_the_waiters() {
    for first in [None, Some(Duration::from_secs(30))] {
        let streams = Streams::default();
        let mut svc = SessionAffinityLayer::new()
            .overflow(Overflow::wait(Duration::from_secs(60), 8))
            .layer(fleet(&[("a1", "a", 1), ("b1", "b", 1)], &streams));
        let mut held = Vec::new();
        for s in ["s1", "s2"] {
            let res = send(&mut svc, Some(s), Some("stream")).await.unwrap();
            held.push((res, streams.take().unwrap()));
        }
        svc.ready().await.unwrap();
        let mut waiting = tokio_test::task::spawn(svc.call(request(Some("w"), None)));
        assert_pending!(waiting.poll());
        // a1 goes down: the waiter looks, and waits.
        assert!(svc.mark_down("a1", first));
        assert!(waiting.is_woken());
        assert_pending!(waiting.poll());
        // Its mark is replaced by a shorter one, and its request ends while it is down.
        assert!(svc.mark_down("a1", Some(Duration::from_secs(1))));
        let at = held.iter().position(|(_, (on, _))| on == "a1").unwrap();
        drop(held.remove(at));
        assert_eq!(in_flight(&svc, "a1"), 0);
        tokio::time::advance(Duration::from_millis(1_010)).await;
        assert!(
            waiting.is_woken(),
            "a1 is back with its slot free, and the waiter sleeps (first mark {first:?})"
        );
        let res = assert_ready!(waiting.poll()).unwrap();
        assert_eq!(decision(&res).backend.as_str(), "a1");
        assert_eq!(decision(&res).waited, Some(Duration::from_millis(1_010)));
    }
}

/// Slots that the policy offers no waiting request, on a backend that is up, are passed from
/// waiter to waiter until each has declined them, and then go unused: each wakes each waiter
/// once. Two such slots went round three waiters in a circle, each waking the next, as a
/// waiter remembered only the last slot it had declined.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn slots_the_policy_offers_no_waiter_wake_each_waiter_once() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use tower_affinity::placement::{Candidates, FleetView, PlacementRequest};
    /// Offers a1 alone while `on_a` is set, else b1 alone.
    #[derive(Clone)]
    struct OneOf(Arc<AtomicBool>);
    impl Placement for OneOf {
        fn place(&self, f: &FleetView<'_>, _: &PlacementRequest<'_>, c: &mut Candidates<'_>) {
            let id = if self.0.load(Ordering::Relaxed) {
                "a1"
            } else {
                "b1"
            };
            if let Some(b) = f.backend(&id.into()) {
                let _ = c.offer(b);
            }
        }
    }
    let streams = Streams::default();
    let on_a = Arc::new(AtomicBool::new(true));
    let mut svc = SessionAffinityLayer::new()
        .placement(OneOf(on_a.clone()))
        .overflow(Overflow::wait(Duration::from_secs(60), 8))
        .layer(fleet(&[("a1", "a", 2), ("b1", "b", 1)], &streams));
    let mut on_a1 = Vec::new();
    for s in ["s1", "s2"] {
        let res = send(&mut svc, Some(s), Some("stream")).await.unwrap();
        on_a1.push((res, streams.take().unwrap()));
    }
    on_a.store(false, Ordering::Relaxed);
    let held = send(&mut svc, Some("s3"), Some("stream")).await.unwrap();
    let mut waiting = waiters(&mut svc, &["w1", "w2", "w3"]).await;
    // Both of a1's slots free; no waiter may take them.
    on_a1.clear();
    let mut looks = 0;
    for _ in 0..64 {
        let mut any = false;
        for w in &mut waiting {
            if w.is_woken() {
                any = true;
                looks += 1;
                assert_pending!(w.poll());
            }
        }
        if !any {
            break;
        }
    }
    assert!(
        waiting.iter().all(|w| !w.is_woken()),
        "still waking one another after {looks} looks"
    );
    assert!(looks <= 6, "{looks} looks for two slots and three waiters");
    assert_eq!(svc.stats().waiting, 3);
    drop(held);
}

/// Slots freed on a backend that has been removed wake no waiting request either, as none can
/// take them: each woke the waiters one after another, each declining it, a look per waiting
/// request for each request still on the backend when it went.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn slots_freed_on_a_removed_backend_wake_no_waiter() {
    let streams = Streams::default();
    let (handle, stream) = discover::channel();
    handle.insert(
        "a1",
        Backend::new("a", backend("a1", &streams)).slots(nz(2)),
    );
    handle.insert(
        "b1",
        Backend::new("b", backend("b1", &streams)).slots(nz(1)),
    );
    let mut svc = SessionAffinityLayer::new()
        .overflow(Overflow::wait(Duration::from_secs(60), 8))
        .layer(stream);
    let mut on_a = Vec::new();
    let mut on_b = Vec::new();
    for s in ["s1", "s2", "s3"] {
        let res = send(&mut svc, Some(s), Some("stream")).await.unwrap();
        match streams.take().unwrap().0.as_str() {
            "a1" => on_a.push(res),
            _ => on_b.push(res),
        }
    }
    assert_eq!((on_a.len(), on_b.len()), (2, 1));
    let mut waiting = waiters(&mut svc, &["w1", "w2", "w3"]).await;
    // a1 goes: the change wakes the waiters, which look once.
    handle.remove("a1");
    svc.ready().await.unwrap();
    for w in &mut waiting {
        assert!(w.is_woken());
        assert_pending!(w.poll());
    }
    // Its requests end: their slots wake nobody.
    on_a.clear();
    assert!(
        waiting.iter().all(|w| !w.is_woken()),
        "a slot on a removed backend woke a waiter"
    );
    // b1's slot frees: the oldest waiter takes it.
    on_b.clear();
    assert!(waiting[0].is_woken());
    let res = assert_ready!(waiting[0].poll()).unwrap();
    assert_eq!(decision(&res).backend.as_str(), "b1");
    // a1 announced again is up, with both slots free: the others take them.
    handle.insert(
        "a1",
        Backend::new("a", backend("a1", &streams)).slots(nz(2)),
    );
    svc.ready().await.unwrap();
    for w in &mut waiting[1..] {
        let res = assert_ready!(w.poll()).unwrap();
        assert_eq!(decision(&res).backend.as_str(), "a1");
    }
}

/// A removed backend's answers still streaming count in flight after another backend takes
/// its place, as in a rolling restart: a drain that waits for `in_flight` to reach 0 waits for
/// them. Before, the new backend took the removed one's index and its count with it.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_removed_backends_answers_count_in_flight_after_a_new_backend_comes() {
    let streams = Streams::default();
    let (handle, stream) = discover::channel();
    handle.insert(
        "old",
        Backend::new("a", backend("old", &streams)).slots(nz(2)),
    );
    let mut svc = SessionAffinityLayer::new().layer(stream);
    let mut open = Vec::new();
    for s in ["s1", "s2"] {
        open.push(send(&mut svc, Some(s), Some("stream")).await.unwrap());
        streams.take().unwrap();
    }
    handle.remove("old");
    handle.insert(
        "new",
        Backend::new("a", backend("new", &streams)).slots(nz(2)),
    );
    svc.ready().await.unwrap();
    assert_eq!(svc.stats().in_flight, 2);
    let res = send(&mut svc, Some("s3"), None).await.unwrap();
    assert_eq!(decision(&res).backend.as_str(), "new");
    drop(res);
    assert_eq!(svc.stats().in_flight, 2, "the old answers, still open");
    open.clear();
    assert_eq!(svc.stats().in_flight, 0);
    // A backend that comes next counts nothing of theirs (the place each takes is
    // `fleet::tests::a_removed_backends_place_waits_for_its_last_request_and_it_takes_none_meanwhile`).
    handle.insert(
        "next",
        Backend::new("b", backend("next", &streams)).slots(nz(1)),
    );
    svc.ready().await.unwrap();
    assert_eq!(svc.backends().len(), 2);
    assert_eq!(svc.stats().in_flight, 0);
}

#[tokio::test]
async fn a_backend_is_asked_for_an_answer_it_can_be_read_in() {
    async fn sent(layer: SessionAffinityLayer, accept: Option<&str>) -> Option<String> {
        let backend = tower::service_fn(|req: http::Request<String>| async move {
            let got = req.headers().get("accept-encoding");
            let body = got.map_or(String::new(), |v| v.to_str().unwrap().to_string());
            Ok::<_, Infallible>(http::Response::new(http_body_util::Full::new(Bytes::from(
                body,
            ))))
        });
        let svc = layer.layer(StaticFleet::new([("a1", Backend::new("a", backend))]));
        let mut req = http::Request::post("/v1/chat/completions");
        if let Some(a) = accept {
            req = req.header("accept-encoding", a);
        }
        let res = svc.oneshot(req.body(String::new()).unwrap()).await.unwrap();
        let body = res.into_body().collect().await.unwrap().to_bytes();
        (!body.is_empty()).then(|| String::from_utf8(body.to_vec()).unwrap())
    }
    let observing = SessionAffinityLayer::new;
    assert_eq!(
        sent(observing(), Some("gzip, deflate")).await.as_deref(),
        Some("identity")
    );
    assert_eq!(sent(observing(), None).await, None);
    let blind = || SessionAffinityLayer::new().observe_usage(false);
    assert_eq!(sent(blind(), Some("gzip")).await.as_deref(), Some("gzip"));
}

#[tokio::test]
async fn a_get_or_head_keeps_the_clients_accept_encoding() {
    // llama-server serves its web UI (`GET /`) only gzip-compressed: asked for `identity`, it
    // answers 415.
    async fn sent(method: http::Method, path: &str) -> (http::StatusCode, Option<String>) {
        let backend = tower::service_fn(|req: http::Request<String>| async move {
            let gzip = req
                .headers()
                .get("accept-encoding")
                .is_some_and(|v| v.to_str().unwrap().contains("gzip"));
            let sent = req.headers().get("accept-encoding").cloned();
            let mut res = http::Response::new(http_body_util::Full::new(Bytes::new()));
            if !gzip {
                *res.status_mut() = http::StatusCode::UNSUPPORTED_MEDIA_TYPE;
            }
            if let Some(v) = sent {
                res.headers_mut().insert("x-sent", v);
            }
            Ok::<_, Infallible>(res)
        });
        let svc = SessionAffinityLayer::new()
            .layer(StaticFleet::new([("a1", Backend::new("a", backend))]));
        let req = http::Request::builder()
            .method(method)
            .uri(path)
            .header("accept-encoding", "gzip, deflate, br")
            .body(String::new())
            .unwrap();
        let res = svc.oneshot(req).await.unwrap();
        let sent = res
            .headers()
            .get("x-sent")
            .map(|v| v.to_str().unwrap().to_string());
        (res.status(), sent)
    }
    for (method, path) in [
        (http::Method::GET, "/"),
        (http::Method::HEAD, "/index.html"),
    ] {
        assert_eq!(
            sent(method.clone(), path).await,
            (http::StatusCode::OK, Some("gzip, deflate, br".to_string())),
            "{method} {path}"
        );
    }
    // A prompt's answer is still asked for as it can be read.
    assert_eq!(
        sent(http::Method::POST, "/v1/chat/completions").await,
        (
            http::StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Some("identity".to_string())
        )
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_503_from_the_retry_too_is_the_answer_and_both_are_passed_over() {
    let streams = Streams::default();
    let svc = SessionAffinityLayer::new()
        .failure_cooldown(Duration::from_secs(5))
        .layer(fleet(&[("a1", "a", 1), ("a2", "a", 1)], &streams));
    let mut retrying = tower::retry::RetryLayer::new(RetryOnce::new()).layer(svc.clone());
    let mut req = request(Some("s"), None);
    for b in ["a1", "a2"] {
        req.headers_mut()
            .append("x-unavailable-on", http::HeaderValue::from_static(b));
    }
    let res = retrying.ready().await.unwrap().call(req).await.unwrap();
    assert_eq!(res.status(), 503);
    let body = res.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "Loading model");
    assert!(svc.backends().iter().all(|b| !b.healthy && b.failures == 1));
    assert_eq!(svc.stats().in_flight, 0);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn wait_gives_up_after_max_wait() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .overflow(Overflow::wait(Duration::from_secs(30), 8))
        .layer(fleet(&[("a1", "a", 1)], &streams));
    let _held = send(&mut svc, Some("s"), Some("stream")).await.unwrap();
    let started = tokio::time::Instant::now();
    let err = send(&mut svc, Some("s"), None).await.unwrap_err();
    assert_eq!(started.elapsed(), Duration::from_secs(30));
    assert!(matches!(err, Error::Saturated { .. }));
    assert_eq!(svc.stats().waiting, 0);
    assert_eq!(svc.stats().rejected, 1);
    assert_eq!(svc.stats().abandoned, 0);
    // What the client hears: 429, and when to try again.
    let res = err.into_response::<MockBody>();
    assert_eq!(res.status(), 429);
    assert_eq!(res.headers()["retry-after"], "1");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_request_its_caller_gives_up_on_while_waiting_is_counted_abandoned() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new().layer(fleet(&[("a1", "a", 1)], &streams));
    let held = send(&mut svc, Some("s"), Some("stream")).await.unwrap();
    let (_, tx) = streams.take().unwrap();
    svc.ready().await.unwrap();
    let mut left = tokio_test::task::spawn(svc.call(request(Some("s"), None)));
    assert_pending!(left.poll());
    svc.ready().await.unwrap();
    let mut served = tokio_test::task::spawn(svc.call(request(Some("t"), None)));
    assert_pending!(served.poll());
    assert_eq!(svc.stats().waiting, 2);
    drop(left);
    drop(tx);
    held.into_body().collect().await.unwrap();
    assert_ready!(served.poll()).unwrap();
    let stats = svc.stats();
    assert_eq!((stats.waiting, stats.abandoned, stats.rejected), (0, 1, 0));
    // Every call is placed, refused or abandoned: 2 placed.
    assert_eq!(stats.home_hits + stats.new_sessions, 2);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn wait_queue_is_bounded() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .overflow(Overflow::wait(Duration::from_secs(30), 1))
        .layer(fleet(&[("a1", "a", 1)], &streams));
    let _held = send(&mut svc, Some("s"), Some("stream")).await.unwrap();
    svc.ready().await.unwrap();
    let mut first = tokio_test::task::spawn(svc.call(request(Some("s"), None)));
    assert_pending!(first.poll());
    let mut second = tokio_test::task::spawn(svc.call(request(Some("t"), None)));
    let err = assert_ready!(second.poll()).unwrap_err();
    assert!(matches!(err, Error::Saturated { .. }));
    drop(first);
    assert_eq!(svc.stats().waiting, 0, "a dropped waiter leaves the queue");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn reject_fails_at_once_with_a_retry_hint() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .overflow(Overflow::Reject)
        .layer(fleet(&[("a1", "a", 1)], &streams));
    let _held = send(&mut svc, Some("s"), Some("stream")).await.unwrap();
    let err = send(&mut svc, Some("s"), None).await.unwrap_err();
    assert!(err.retry_after().is_some());
    let res = err.into_response::<MockBody>();
    assert_eq!(res.status(), 429);
    assert!(res.headers().contains_key("retry-after"));
    assert_eq!(svc.stats().rejected, 1);
    assert_eq!(in_flight(&svc, "a1"), 1);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn overcommit_sends_to_the_first_candidate_anyway() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .overflow(Overflow::Overcommit)
        .layer(fleet(&[("a1", "a", 1), ("b1", "b", 1)], &streams));
    let first = send(&mut svc, Some("s"), Some("stream")).await.unwrap();
    let _other = send(&mut svc, Some("t"), Some("stream")).await.unwrap();
    let home = decision(&first).backend;
    let res = send(&mut svc, Some("s"), Some("stream")).await.unwrap();
    let d = decision(&res);
    assert_eq!(
        (d.backend.clone(), d.outcome, d.overcommitted),
        (home.clone(), Outcome::HomeHit, true)
    );
    assert_eq!(in_flight(&svc, home.as_str()), 2, "beyond its one slot");
    drop(res);
    drop(first);
    assert_eq!(in_flight(&svc, home.as_str()), 0);
    assert_eq!(svc.stats().overcommitted, 1);
}

/// A request continuing a response that `on` stores (the Responses API's
/// `previous_response_id`, as `BodyKeyLayer` marks it).
fn continuing(session: Option<&str>, mode: Option<&str>, on: &str) -> Req {
    let mut req = request(session, mode);
    let mut facts = PromptFacts::from_chain(PromptChain::default());
    facts.stored_on = Some(on.into());
    req.extensions_mut().insert(facts);
    req
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_request_continuing_a_stored_response_waits_for_the_backend_storing_it() {
    let streams = Streams::default();
    let mut svc =
        SessionAffinityLayer::new().layer(fleet(&[("a1", "a", 1), ("a2", "a", 1)], &streams));
    let busy = send(&mut svc, Some("s"), Some("stream")).await.unwrap();
    let home = decision(&busy).backend;
    // Its session would spill to the free backend beside its home; a turn that continues a
    // response its home stores waits for it, as no other backend can answer it.
    svc.ready().await.unwrap();
    let mut next = tokio_test::task::spawn(svc.call(continuing(Some("s"), None, home.as_str())));
    assert_pending!(next.poll());
    assert_eq!(svc.stats().waiting, 1);
    tokio::time::advance(Duration::from_secs(30)).await;
    assert_pending!(next.poll());
    let (_, tx) = streams.take().unwrap();
    drop(tx);
    busy.into_body().collect().await.unwrap();
    assert!(next.is_woken());
    let d = decision(&assert_ready!(next.poll()).unwrap());
    assert_eq!((d.backend, d.outcome), (home, Outcome::HomeHit));
    assert_eq!(d.waited, Some(Duration::from_secs(30)));
    // A keyless one, by any policy, goes to the backend storing its response.
    for p in every_policy() {
        let mut svc = SessionAffinityLayer::new()
            .placement(std::sync::Arc::new(p))
            .layer(fleet(TWO_BY_TWO, &streams));
        for _ in 0..4 {
            let res = svc
                .ready()
                .await
                .unwrap()
                .call(continuing(None, None, "b2"));
            assert_eq!(decision(&res.await.unwrap()).backend.as_str(), "b2");
        }
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_request_continuing_a_stored_response_is_refused_rather_than_sent_elsewhere() {
    let streams = Streams::default();
    let two = || fleet(&[("a1", "a", 1), ("a2", "a", 1)], &streams);
    let mut svc = SessionAffinityLayer::new()
        .overflow(Overflow::Reject)
        .layer(two());
    let busy = send(&mut svc, Some("s"), Some("stream")).await.unwrap();
    let on = decision(&busy).backend;
    let call = svc
        .ready()
        .await
        .unwrap()
        .call(continuing(None, None, on.as_str()));
    assert!(matches!(call.await.unwrap_err(), Error::Saturated { .. }));
    // Waiting, it gives up when the wait does, though the other backend is free all along.
    let mut svc = SessionAffinityLayer::new()
        .overflow(Overflow::wait(Duration::from_secs(20), 8))
        .layer(two());
    let busy = send(&mut svc, Some("s"), Some("stream")).await.unwrap();
    let on = decision(&busy).backend;
    let started = tokio::time::Instant::now();
    let call = svc
        .ready()
        .await
        .unwrap()
        .call(continuing(None, None, on.as_str()));
    assert!(matches!(call.await.unwrap_err(), Error::Saturated { .. }));
    assert_eq!(started.elapsed(), Duration::from_secs(20));
    assert_eq!((svc.stats().waiting, svc.stats().in_flight), (0, 1));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_response_stored_on_a_backend_gone_or_down_does_not_hold_its_request_back() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .failure_cooldown(Duration::from_secs(5))
        .layer(fleet(&[("a1", "a", 1), ("a2", "a", 1)], &streams));
    // Stored on a backend that has left the fleet: placed as any request is.
    let res = svc
        .ready()
        .await
        .unwrap()
        .call(continuing(Some("s"), None, "gone"));
    assert_eq!(decision(&res.await.unwrap()).outcome, Outcome::NewSession);
    // Stored on a backend down for its cooldown: placed around it.
    let home = turn(&mut svc, "s").await.backend;
    send(&mut svc, Some("s"), Some("fail")).await.unwrap_err();
    let res = svc
        .ready()
        .await
        .unwrap()
        .call(continuing(Some("s"), None, home.as_str()));
    let d = decision(&res.await.unwrap());
    assert_ne!(d.backend, home);
    assert_eq!(d.outcome, Outcome::SameNodeSpill);
    assert_eq!(svc.stats().in_flight, 0);
}

/// [`FirstWithRoom`], then a panic if the request says so: a bug in a policy of a user's own.
#[derive(Clone, Copy)]
struct PanicsAfterItsOffer;

#[derive(Clone, Copy)]
struct Panic;

impl Placement for PanicsAfterItsOffer {
    fn place(
        &self,
        fleet: &tower_affinity::placement::FleetView<'_>,
        req: &tower_affinity::placement::PlacementRequest<'_>,
        c: &mut tower_affinity::placement::Candidates<'_>,
    ) {
        FirstWithRoom.place(fleet, req, c);
        if req.extensions.get::<Panic>().is_some() {
            panic!("a bug in the policy");
        }
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_policy_that_panics_after_its_offer_was_taken_gives_the_slot_back() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .placement(PanicsAfterItsOffer)
        .layer(fleet(&[("a1", "a", 1)], &streams));
    svc.ready().await.unwrap();
    let mut req = request(Some("s"), None);
    req.extensions_mut().insert(Panic);
    let call = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| svc.call(req)));
    assert!(call.is_err(), "the policy panicked");
    assert_eq!(svc.stats().in_flight, 0);
    // The slot is free: the next request is served, not refused.
    let d = turn(&mut svc, "s").await;
    assert_eq!(d.backend.as_str(), "a1");
    assert_eq!(svc.stats().in_flight, 0);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn slot_counts_past_what_a_fleet_can_sum_are_capped_not_a_panic() {
    let streams = Streams::default();
    let max = NonZeroU32::MAX;
    let mut svc = SessionAffinityLayer::new().layer(StaticFleet::new([
        ("a1", Backend::new("a", backend("a1", &streams)).slots(max)),
        ("a2", Backend::new("a", backend("a2", &streams)).slots(max)),
        (
            "b1",
            Backend::new("b", backend("b1", &streams)).slots(nz(2)),
        ),
    ]));
    for i in 0..6 {
        turn(&mut svc, &format!("s{i}")).await;
    }
    let slots: Vec<u32> = ["a1", "a2", "b1"]
        .iter()
        .map(|id| status(&svc, id).slots)
        .collect();
    let cap = Backend::<()>::MAX_SLOTS.get();
    assert_eq!(slots, [cap, cap, 2]);
    assert_eq!(Backend::new("a", ()).slots(max).slot_count().get(), cap);
    assert_eq!(svc.stats().in_flight, 0);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn an_empty_fleet_answers_no_backends() {
    let (_handle, stream) = discover::channel::<MockService>();
    let mut svc = SessionAffinityLayer::new().layer(stream);
    let err = send(&mut svc, Some("s"), None).await.unwrap_err();
    assert!(matches!(err, Error::NoBackends { .. }));
    assert_eq!(err.status(), 503);
    assert_eq!(svc.stats().no_backends, 1);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn decision_headers_are_opt_in() {
    let streams = Streams::default();
    let mut plain = SessionAffinityLayer::new().layer(fleet(TWO_BY_TWO, &streams));
    let res = send(&mut plain, Some("s"), None).await.unwrap();
    assert!(!res.headers().contains_key("x-affinity-backend"));
    let mut with = SessionAffinityLayer::new()
        .decision_headers(true)
        .layer(fleet(TWO_BY_TWO, &streams));
    let res = send(&mut with, Some("s"), None).await.unwrap();
    let d = decision(&res);
    assert_eq!(res.headers()["x-affinity-backend"], d.backend.as_str());
    assert_eq!(res.headers()["x-affinity-node"], d.node.as_str());
    assert_eq!(res.headers()["x-affinity-outcome"], "new-session");
}

/// The decision headers say what the router did, or nothing: a backend's own field of that
/// name does not pass for the router's, not even when an id is no header value.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn decision_headers_a_backend_sets_itself_never_pass_for_the_routers() {
    let spoofing = tower::service_fn(|_req: Req| async {
        let mut res = http::Response::new(String::new());
        for name in [
            "x-affinity-backend",
            "x-affinity-node",
            "x-affinity-outcome",
        ] {
            res.headers_mut()
                .insert(name, http::HeaderValue::from_static("spoofed"));
        }
        Ok::<_, Infallible>(res)
    });
    // A backend id with a line break in it, which no header value may hold.
    let svc = SessionAffinityLayer::new()
        .decision_headers(true)
        .layer(StaticFleet::new([(
            "gpu\n0",
            Backend::new("node\n0", spoofing),
        )]));
    let res = svc.oneshot(request(Some("s"), None)).await.unwrap();
    let h = res.headers();
    assert!(!h.contains_key("x-affinity-backend"), "{h:?}");
    assert!(!h.contains_key("x-affinity-node"), "{h:?}");
    assert_eq!(h["x-affinity-outcome"], "new-session");
}

/// The crate's policies, each behind the same trait object.
fn every_policy() -> Vec<Box<dyn Placement>> {
    use tower_affinity::placement::{LeastLoaded, NodeThenBackend, Rendezvous, RoundRobin};
    vec![
        Box::new(NodeThenBackend::new()),
        Box::new(RoundRobin::new()),
        Box::new(LeastLoaded::new()),
        Box::new(Rendezvous),
    ]
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn every_policy_works_through_the_same_service() {
    for p in every_policy() {
        let streams = Streams::default();
        let mut svc = SessionAffinityLayer::new()
            .key(HeaderKey::default())
            .placement(std::sync::Arc::new(p))
            .layer(fleet(TWO_BY_TWO, &streams));
        for i in 0..8 {
            turn(&mut svc, &format!("s{}", i % 3)).await;
        }
        assert_eq!(svc.stats().placed(), 8);
        assert_eq!(svc.stats().in_flight, 0);
    }
}

#[test]
fn the_service_is_send_sync_and_cheap_to_clone() {
    fn assert_send_sync_clone<T: Send + Sync + Clone>() {}
    assert_send_sync_clone::<
        SessionAffinity<
            StaticFleet<MockService>,
            HeaderKey,
            tower_affinity::placement::NodeThenBackend,
        >,
    >();
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_discovery_error_is_counted_and_the_fleet_kept() {
    use tower::discover::Change;
    let streams = Streams::default();
    let changes: Vec<Result<Change<tower_affinity::BackendId, Backend<MockService>>, &str>> = vec![
        Ok(Change::Insert(
            "a1".into(),
            Backend::new("a", backend("a1", &streams)),
        )),
        Err("registry unreachable"),
        Ok(Change::Insert(
            "b1".into(),
            Backend::new("b", backend("b1", &streams)),
        )),
    ];
    let mut svc = SessionAffinityLayer::new().layer(tokio_stream::iter(changes));
    let d = turn(&mut svc, "s").await;
    assert_eq!(d.outcome, Outcome::NewSession);
    assert_eq!(
        svc.backends().len(),
        2,
        "changes after the error still apply"
    );
    assert_eq!(svc.stats().discovery_errors, 1);
    // The stream has ended: the fleet stays and requests keep flowing.
    assert_eq!(turn(&mut svc, "s").await.outcome, Outcome::HomeHit);
    assert_eq!(svc.backends().len(), 2);
}

/// A fleet of more backends than one poll applies (256): readiness applies it over a few
/// polls, `apply_discovery` at once.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_fleet_larger_than_one_drain_is_applied_whole_by_apply_discovery() {
    let streams = Streams::default();
    let spec: Vec<(String, String)> = (0..600)
        .map(|i| (format!("b{i}"), format!("n{}", i / 8)))
        .collect();
    let large = || {
        StaticFleet::new(spec.iter().map(|(id, node)| {
            (
                id.as_str(),
                Backend::new(node.as_str(), backend(id, &streams)).slots(nz(1)),
            )
        }))
    };
    let svc = SessionAffinityLayer::new().layer(large());
    svc.apply_discovery();
    assert_eq!(svc.backends().len(), 600);
    let mut svc = SessionAffinityLayer::new().layer(large());
    let mut polls = Vec::new();
    for _ in 0..3 {
        svc.ready().await.unwrap();
        polls.push(svc.backends().len());
    }
    assert_eq!(polls, [256, 512, 600]);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_discovery_stream_that_never_stops_does_not_hold_a_caller() {
    use tower::discover::Change;
    // An endless stream of updates to one backend: readiness still returns.
    let streams = Streams::default();
    let svc_a1 = backend("a1", &streams);
    let endless = tokio_stream::iter(std::iter::repeat_with(move || {
        Ok::<_, std::convert::Infallible>(Change::Insert(
            tower_affinity::BackendId::from("a1"),
            Backend::new("a", svc_a1.clone()),
        ))
    }));
    let mut svc = SessionAffinityLayer::new().layer(endless);
    assert_eq!(turn(&mut svc, "s").await.outcome, Outcome::NewSession);
    assert_eq!(turn(&mut svc, "s").await.outcome, Outcome::HomeHit);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn readiness_polls_discovery_only_after_the_stream_wakes() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    // The discovery channel, counting how often it is polled.
    let polls = Arc::new(AtomicUsize::new(0));
    let (handle, stream) = discover::channel::<MockService>();
    struct Counted<D> {
        inner: std::pin::Pin<Box<D>>,
        polls: Arc<AtomicUsize>,
    }
    impl<D: Discover> futures_core::Stream for Counted<D> {
        type Item = Result<tower::discover::Change<D::Key, D::Service>, D::Error>;
        fn poll_next(
            self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Self::Item>> {
            let this = self.get_mut();
            this.polls.fetch_add(1, Ordering::Relaxed);
            this.inner.as_mut().poll_discover(cx)
        }
    }
    let counted = Counted {
        inner: Box::pin(stream),
        polls: polls.clone(),
    };
    let streams = Streams::default();
    handle.insert("a1", Backend::new("a", backend("a1", &streams)));
    let mut svc = SessionAffinityLayer::new().layer(counted);
    assert_eq!(turn(&mut svc, "s").await.backend.as_str(), "a1");
    let after_first = polls.load(Ordering::Relaxed);
    assert!(after_first >= 1, "the first readiness drains the stream");
    for _ in 0..100 {
        turn(&mut svc, "s").await;
    }
    assert_eq!(
        polls.load(Ordering::Relaxed),
        after_first,
        "a quiet stream is not polled"
    );
    // A change wakes the stream; the next readiness applies it.
    handle.insert("b1", Backend::new("b", backend("b1", &streams)));
    handle.remove("a1");
    assert_eq!(turn(&mut svc, "s").await.backend.as_str(), "b1");
    assert!(polls.load(Ordering::Relaxed) > after_first);
}

/// One backend of one slot behind a live discovery channel, that slot held by a stream of
/// session "s".
async fn one_slot_held(
    streams: &Streams,
) -> (
    discover::FleetHandle<MockService>,
    SessionAffinity<
        discover::FleetChannel<MockService>,
        HeaderKey,
        tower_affinity::placement::NodeThenBackend,
    >,
    Res,
) {
    let (handle, stream) = discover::channel::<MockService>();
    handle.insert("a1", Backend::new("a", backend("a1", streams)).slots(nz(1)));
    let mut svc = SessionAffinityLayer::new()
        .overflow(Overflow::wait(Duration::from_secs(60), 8))
        .layer(stream);
    let held = send(&mut svc, Some("s"), Some("stream")).await.unwrap();
    (handle, svc, held)
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_waiting_request_takes_a_backend_announced_while_it_waits() {
    // Every slot is taken and a request waits; no other request comes. A backend announced
    // now wakes the waiting request, which finds it.
    let streams = Streams::default();
    let (handle, mut svc, held) = one_slot_held(&streams).await;
    svc.ready().await.unwrap();
    let mut waiting = tokio_test::task::spawn(svc.call(request(Some("t"), None)));
    assert_pending!(waiting.poll());
    assert_eq!(svc.stats().waiting, 1);
    handle.insert(
        "b1",
        Backend::new("b", backend("b1", &streams)).slots(nz(1)),
    );
    assert!(
        waiting.is_woken(),
        "the announcement wakes the waiting request"
    );
    let res = assert_ready!(waiting.poll()).unwrap();
    assert_eq!(decision(&res).backend.as_str(), "b1");
    assert_eq!(svc.stats().waiting, 0);
    drop(held);
}

/// More changes come at once than one drain applies (256), the announcement of a backend
/// last: the waiting request that drains them is woken to come back for the rest, and when it
/// does, it applies them, finds the backend and takes it, rather than waiting out its
/// `max_wait` with the fleet as the first drain left it.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_waiting_request_comes_back_for_the_changes_one_drain_left() {
    let streams = Streams::default();
    let (handle, mut svc, held) = one_slot_held(&streams).await;
    svc.ready().await.unwrap();
    let mut waiting = tokio_test::task::spawn(svc.call(request(Some("t"), None)));
    assert_pending!(waiting.poll());
    for i in 0..300 {
        handle.remove(format!("never-there-{i}"));
    }
    handle.insert(
        "b1",
        Backend::new("b", backend("b1", &streams)).slots(nz(1)),
    );
    let mut polls = 0;
    while waiting.is_woken() && polls < 8 {
        polls += 1;
        if let std::task::Poll::Ready(res) = waiting.poll() {
            let res = res.unwrap();
            assert_eq!(decision(&res).backend.as_str(), "b1");
            assert_eq!(decision(&res).waited, Some(Duration::ZERO));
            drop(held);
            return;
        }
    }
    panic!(
        "still waiting after {polls} polls; fleet: {:?}",
        svc.backends()
    );
}

/// More changes come at once than one drain applies (256), the removal of the backend a
/// request waits for among the last. Readiness applies the first part, the request is placed
/// on the fleet as that left it and waits for the backend's one slot, and readiness applies
/// the rest before the waiting request first looks: the removal must wake it, and it fails at
/// once with no backend left, rather than waiting out its `max_wait` for a slot that no
/// longer exists.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_removal_applied_by_another_drain_wakes_the_request_waiting_for_it() {
    let streams = Streams::default();
    let (handle, mut svc, held) = one_slot_held(&streams).await;
    svc.ready().await.unwrap();
    for i in 0..300 {
        handle.remove(format!("never-there-{i}"));
    }
    handle.remove("a1");
    svc.ready().await.unwrap();
    assert_eq!(svc.backends().len(), 1, "the first drain stops at 256");
    let mut waiting = tokio_test::task::spawn(svc.call(request(Some("t"), None)));
    svc.ready().await.unwrap();
    assert!(svc.backends().is_empty(), "the second drain removes a1");
    let failed = match waiting.poll() {
        std::task::Poll::Ready(res) => res.unwrap_err(),
        std::task::Poll::Pending => panic!(
            "still waiting for a removed backend; waiting: {}",
            svc.stats().waiting
        ),
    };
    assert!(matches!(failed, Error::NoBackends { .. }), "{failed}");
    assert_eq!(svc.stats().waiting, 0);
    drop(held);
}

/// A waiting request applies at most one drain's changes a poll (256), as readiness does: a
/// drain that inserts a backend wakes every waiter, the one draining too, and it drained
/// again within the same poll, for as long as changes were ready: a discovery stream that
/// never stopped yielding held it for good.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn one_poll_of_a_waiting_request_applies_at_most_one_drain() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use tower::discover::Change;
    // Updates of backend a1, `ready` of them at a time: one at first.
    struct Updates {
        ready: Arc<AtomicUsize>,
        waker: Arc<parking_lot::Mutex<Option<std::task::Waker>>>,
        a1: MockService,
    }
    impl futures_core::Stream for Updates {
        type Item = Result<Change<tower_affinity::BackendId, Backend<MockService>>, Infallible>;
        fn poll_next(
            self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Self::Item>> {
            let this = self.get_mut();
            let take = |n: usize| n.checked_sub(1);
            if this
                .ready
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, take)
                .is_err()
            {
                *this.waker.lock() = Some(cx.waker().clone());
                return std::task::Poll::Pending;
            }
            let a1 = Backend::new("a", this.a1.clone()).slots(nz(1));
            std::task::Poll::Ready(Some(Ok(Change::Insert("a1".into(), a1))))
        }
    }
    const BURST: usize = 20_000;
    let streams = Streams::default();
    let ready = Arc::new(AtomicUsize::new(1));
    let waker = Arc::new(parking_lot::Mutex::new(None::<std::task::Waker>));
    let updates = Updates {
        ready: ready.clone(),
        waker: waker.clone(),
        a1: backend("a1", &streams),
    };
    let mut svc = SessionAffinityLayer::new()
        .overflow(Overflow::wait(Duration::from_secs(60), 8))
        .layer(updates);
    let _held = send(&mut svc, Some("s"), Some("stream")).await.unwrap();
    svc.ready().await.unwrap();
    let mut waiting = tokio_test::task::spawn(svc.call(request(Some("t"), None)));
    assert_pending!(waiting.poll());
    // A burst of updates of the full backend, each a change that wakes every waiter.
    ready.store(BURST, Ordering::Relaxed);
    waker.lock().take().unwrap().wake();
    assert!(waiting.is_woken());
    assert_pending!(waiting.poll());
    let applied = BURST - ready.load(Ordering::Relaxed);
    assert!(
        applied <= 256,
        "one poll of a waiting request applied {applied} changes"
    );
    // It is woken to come back for the rest, and applies them a drain a poll.
    let mut polls = 0;
    while waiting.is_woken() && polls < BURST {
        polls += 1;
        assert_pending!(waiting.poll());
    }
    assert_eq!(ready.load(Ordering::Relaxed), 0, "after {polls} more polls");
    assert!(polls >= BURST / 256, "{polls}");
}

/// A slot promised to a woken waiter is not lost when a fleet change wakes every waiter
/// before that one runs.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_fleet_change_before_a_woken_waiter_runs_keeps_its_slot_free() {
    let streams = Streams::default();
    let (handle, mut svc, held) = one_slot_held(&streams).await;
    let (_, tx) = streams.take().unwrap();
    svc.ready().await.unwrap();
    let mut waiting = tokio_test::task::spawn(svc.call(request(Some("t"), None)));
    assert_pending!(waiting.poll());
    // a1 frees (promised to the waiter), then b1 comes before the waiter runs.
    drop(tx);
    held.into_body().collect().await.unwrap();
    handle.insert(
        "b1",
        Backend::new("b", backend("b1", &streams)).slots(nz(1)),
    );
    svc.ready().await.unwrap();
    let res = assert_ready!(waiting.poll()).unwrap();
    drop(res);
    // Both slots can be taken at once: none is left promised.
    let x = send(&mut svc, Some("x"), Some("stream")).await.unwrap();
    let y = send(&mut svc, Some("y"), Some("stream")).await.unwrap();
    assert_ne!(decision(&x).backend, decision(&y).backend);
    assert_eq!((decision(&x).waited, decision(&y).waited), (None, None));
}

/// A slot that frees while requests wait is promised to one of them even when every waiter
/// is woken (a backend marked down, a fleet change) before that one runs, the slot freed
/// before that wake or after it: a request arriving before the waiter runs does not take it.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_slot_freed_around_a_wake_of_every_waiter_is_still_promised_to_one() {
    for freed_first in [false, true] {
        let streams = Streams::default();
        let mut svc = SessionAffinityLayer::new()
            .overflow(Overflow::wait(Duration::from_secs(60), 8))
            .layer(fleet(&[("a1", "a", 1), ("b1", "b", 1)], &streams));
        let on_a = send(&mut svc, Some("s"), Some("stream")).await.unwrap();
        let on_b = send(&mut svc, Some("t"), Some("stream")).await.unwrap();
        let a = if decision(&on_a).backend.as_str() == "a1" {
            on_a
        } else {
            on_b
        };
        svc.ready().await.unwrap();
        let mut waiting = tokio_test::task::spawn(svc.call(request(Some("w"), None)));
        assert_pending!(waiting.poll());
        // a1's slot frees, and b1 goes down, which wakes every waiter to look; then, before
        // the waiter runs, another request comes.
        let mut a = Some(a);
        if freed_first {
            a.take();
        }
        assert!(svc.mark_down("b1", Some(Duration::from_secs(10))));
        assert!(waiting.is_woken());
        a.take();
        svc.ready().await.unwrap();
        let mut later = tokio_test::task::spawn(svc.call(request(Some("x"), None)));
        assert_pending!(
            later.poll(),
            "the later arrival took the waiter's slot (freed first: {freed_first})"
        );
        let res = assert_ready!(waiting.poll()).unwrap();
        assert_eq!(decision(&res).backend.as_str(), "a1");
        drop(res);
        assert_ready!(later.poll()).unwrap();
        while streams.take().is_some() {}
    }
}

type WaitingService = SessionAffinity<
    StaticFleet<MockService>,
    HeaderKey,
    tower_affinity::placement::NodeThenBackend,
>;

/// Two one-slot backends on nodes of their own, `a1` and `b1`, under `Overflow::wait`, each
/// busy with a stream, and requests of sessions `w1` then `w2` waiting for a slot. Returns the
/// service, the stream on `a1`, the one on `b1`, and the waiters.
async fn both_busy_two_waiting(
    streams: &Streams,
) -> (
    WaitingService,
    Res,
    Res,
    Vec<tokio_test::task::Spawn<<WaitingService as Service<Req>>::Future>>,
) {
    let mut svc = SessionAffinityLayer::new()
        .overflow(Overflow::wait(Duration::from_secs(60), 8))
        .layer(fleet(&[("a1", "a", 1), ("b1", "b", 1)], streams));
    let on_a = send(&mut svc, Some("s"), Some("stream")).await.unwrap();
    let on_b = send(&mut svc, Some("t"), Some("stream")).await.unwrap();
    let (a, b) = if decision(&on_a).backend.as_str() == "a1" {
        (on_a, on_b)
    } else {
        (on_b, on_a)
    };
    let waiting = waiters(&mut svc, &["w1", "w2"]).await;
    (svc, a, b, waiting)
}

/// A slot promised to a waiter on a backend that goes down before the waiter runs is not
/// passed on when that waiter cannot take it: nobody may take a slot there, and the other
/// waiters, woken by the mark, have looked already.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_promise_on_a_backend_gone_down_is_passed_to_nobody() {
    let streams = Streams::default();
    let (svc, a, _b, mut waiting) = both_busy_two_waiting(&streams).await;
    // a1's slot frees, promised to the oldest waiter; then a1 goes down, which wakes both.
    drop(a);
    assert!(waiting[0].is_woken() && !waiting[1].is_woken());
    assert!(svc.mark_down("a1", Some(Duration::from_secs(10))));
    assert!(waiting[1].is_woken());
    // The younger looks first, then the older, which cannot take the slot promised to it.
    assert_pending!(waiting[1].poll());
    assert_pending!(waiting[0].poll());
    assert!(
        !waiting[1].is_woken(),
        "a slot on a backend that is down woke a waiter"
    );
    // Back up, a1 serves the oldest.
    tokio::time::advance(Duration::from_secs(10)).await;
    assert!(waiting[0].is_woken());
    let res = assert_ready!(waiting[0].poll()).unwrap();
    assert_eq!(decision(&res).backend.as_str(), "a1");
    while streams.take().is_some() {}
}

/// Two nodes of one one-slot backend each, node patience of five minutes; session "s" homed,
/// its home's slot held by a stream of it. Returns the service, the home and that stream.
async fn patient_with_home_held(
    streams: &Streams,
) -> (
    SessionAffinity<
        StaticFleet<MockService>,
        HeaderKey,
        tower_affinity::placement::NodeThenBackend,
    >,
    Decision,
    Res,
) {
    let mut svc = SessionAffinityLayer::new()
        .overflow(Overflow::wait(Duration::from_secs(600), 8))
        .node_patience(Duration::from_secs(300))
        .layer(fleet(&[("a1", "node-a", 1), ("b1", "node-b", 1)], streams));
    let home = turn(&mut svc, "s").await;
    let held = send(&mut svc, Some("s"), Some("stream")).await.unwrap();
    assert_eq!(decision(&held).backend, home.backend);
    (svc, home, held)
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_request_held_for_its_node_takes_a_slot_elsewhere_once_its_node_is_marked_down() {
    let streams = Streams::default();
    let (mut svc, home, held) = patient_with_home_held(&streams).await;
    svc.ready().await.unwrap();
    let mut waiting = tokio_test::task::spawn(svc.call(request(Some("s"), None)));
    assert_pending!(
        waiting.poll(),
        "held for its node, though the other has room"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_pending!(waiting.poll());
    // A health probe finds the home down: nothing is left to wait for there.
    assert!(svc.mark_down(home.backend.as_str(), None));
    assert!(waiting.is_woken(), "marking its node down wakes it");
    let res = assert_ready!(waiting.poll()).unwrap();
    assert_ne!(decision(&res).backend, home.backend);
    assert_eq!(decision(&res).waited, Some(Duration::from_secs(1)));
    drop(held);
}

/// A backend marked up again wakes the requests waiting for a slot: its slots were free all
/// along, and no request ending will say so.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn marking_a_backend_up_wakes_the_waiting_requests() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .overflow(Overflow::wait(Duration::from_secs(60), 8))
        .layer(fleet(&[("a1", "a", 1), ("b1", "b", 1)], &streams));
    svc.ready().await.unwrap();
    assert!(svc.mark_down("b1", None));
    let held = send(&mut svc, Some("s"), Some("stream")).await.unwrap();
    assert_eq!(decision(&held).backend.as_str(), "a1");
    svc.ready().await.unwrap();
    let mut waiting = tokio_test::task::spawn(svc.call(request(Some("t"), None)));
    assert_pending!(waiting.poll());
    assert_eq!(
        format!("{:?}", *waiting),
        r#"ResponseFuture { state: "waiting for a slot" }"#
    );
    assert!(svc.mark_up("b1"));
    assert!(waiting.is_woken(), "b1's free slot wakes it");
    let res = assert_ready!(waiting.poll()).unwrap();
    assert_eq!(decision(&res).backend.as_str(), "b1");
    assert_eq!(decision(&res).waited, Some(Duration::ZERO));
    // Up already: marking it up again changes nothing, and says it found the backend.
    assert!(svc.mark_up("b1"));
    assert!(!svc.mark_up("nowhere"));
    drop(held);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_request_held_for_a_node_gone_down_waits_for_any_slot() {
    let streams = Streams::default();
    let (mut svc, home, held) = patient_with_home_held(&streams).await;
    // The other node full too.
    let other = send(&mut svc, Some("t"), Some("stream")).await.unwrap();
    assert_ne!(decision(&other).backend, home.backend);
    svc.ready().await.unwrap();
    let mut waiting = tokio_test::task::spawn(svc.call(request(Some("s"), None)));
    assert_pending!(waiting.poll());
    // Its node down, it looks again and finds every slot taken: it waits on, for any slot.
    assert!(svc.mark_down(home.backend.as_str(), None));
    assert_pending!(waiting.poll());
    drop(other);
    assert!(waiting.is_woken(), "a slot on the other node wakes it");
    let res = assert_ready!(waiting.poll()).unwrap();
    assert_eq!(decision(&res).outcome, Outcome::CrossNodeSpill);
    drop(held);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_64_kib_header_key_is_digested() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new().layer(fleet(TWO_BY_TWO, &streams));
    let long = "k".repeat(64 * 1024);
    let first = turn(&mut svc, &long).await;
    let again = turn(&mut svc, &long).await;
    assert_eq!(
        (first.outcome, again.outcome),
        (Outcome::NewSession, Outcome::HomeHit)
    );
    assert!(
        svc.stats().session_table_bytes < 64 * 1024,
        "the raw key is not kept"
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_freed_slot_goes_to_the_waiter_whose_home_it_is() {
    let streams = Streams::default();
    let mut svc =
        SessionAffinityLayer::new().layer(fleet(&[("a1", "a", 1), ("b1", "b", 1)], &streams));
    // Two sessions, each streaming on its own home; the whole fleet is busy.
    let x = send(&mut svc, Some("x"), Some("stream")).await.unwrap();
    let y = send(&mut svc, Some("y"), Some("stream")).await.unwrap();
    let (x_home, y_home) = (decision(&x).backend, decision(&y).backend);
    assert_ne!(x_home, y_home);
    let (_, x_tx) = streams.take().unwrap();
    let (_, y_tx) = streams.take().unwrap();
    // Their next turns wait; y's arrives first.
    svc.ready().await.unwrap();
    let mut y_next = tokio_test::task::spawn(svc.call(request(Some("y"), None)));
    assert_pending!(y_next.poll());
    let mut x_next = tokio_test::task::spawn(svc.call(request(Some("x"), None)));
    assert_pending!(x_next.poll());
    // x's home frees: the slot goes to x, although y has waited longer.
    drop(x_tx);
    x.into_body().collect().await.unwrap();
    assert!(x_next.is_woken());
    assert!(!y_next.is_woken(), "one freed slot wakes one waiter");
    let x_res = assert_ready!(x_next.poll()).unwrap();
    let d = decision(&x_res);
    assert_eq!((d.backend, d.outcome), (x_home, Outcome::HomeHit));
    assert_pending!(y_next.poll());
    drop(y_tx);
    y.into_body().collect().await.unwrap();
    let d = decision(&assert_ready!(y_next.poll()).unwrap());
    assert_eq!((d.backend, d.outcome), (y_home, Outcome::HomeHit));
    drop(x_res);
    assert_eq!(svc.stats().in_flight, 0);
}

/// A freed slot no waiter calls home goes to the oldest waiter whose home is on the slot's
/// node, ahead of older waiters from other nodes: its session stays on its node.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_freed_slot_goes_to_a_waiter_from_its_node_before_an_older_one_from_another() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new().layer(fleet(
        &[("a1", "a", 1), ("a2", "a", 1), ("b1", "b", 1)],
        &streams,
    ));
    // Three sessions fill the fleet, one on each backend.
    let mut on = std::collections::HashMap::new();
    for s in ["s1", "s2", "s3"] {
        let res = send(&mut svc, Some(s), Some("stream")).await.unwrap();
        let (id, tx) = streams.take().unwrap();
        on.insert(id, (s, res, tx));
    }
    let (_, freed, freed_tx) = on.remove("a1").unwrap();
    let (same_node, _same_res, _same_tx) = on.remove("a2").unwrap();
    let (other_node, _other_res, _other_tx) = on.remove("b1").unwrap();
    // The session of the other node waits first, then the one of the freed slot's node.
    let mut waiting = waiters(&mut svc, &[other_node, same_node]).await;
    // a1 frees; its own session is not waiting.
    drop(freed_tx);
    freed.into_body().collect().await.unwrap();
    assert!(waiting[1].is_woken(), "the slot goes to its node's waiter");
    assert!(!waiting[0].is_woken(), "one freed slot wakes one waiter");
    let res = assert_ready!(waiting[1].poll()).unwrap();
    let d = decision(&res);
    assert_eq!(
        (d.backend.as_str(), d.outcome),
        ("a1", Outcome::SameNodeSpill)
    );
    assert_pending!(waiting[0].poll());
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_wake_that_is_not_used_is_passed_on() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new().layer(fleet(&[("a1", "a", 1)], &streams));
    let held = send(&mut svc, None, Some("stream")).await.unwrap();
    let (_, tx) = streams.take().unwrap();
    svc.ready().await.unwrap();
    let mut first = tokio_test::task::spawn(svc.call(request(None, None)));
    assert_pending!(first.poll());
    let mut second = tokio_test::task::spawn(svc.call(request(None, None)));
    assert_pending!(second.poll());
    drop(tx);
    held.into_body().collect().await.unwrap();
    assert!(first.is_woken());
    assert!(!second.is_woken());
    // The oldest waiter gives up before it runs: the slot must not be left idle.
    drop(first);
    assert!(second.is_woken());
    assert!(assert_ready!(second.poll()).is_ok());
    assert_eq!(svc.stats().waiting, 0);
}

/// The wake a waiter leaves unused goes to the waiter the freed slot suits next, however that
/// one is held: to its home node (node patience), or to the backend storing the response it
/// continues. Each would otherwise sit out its whole hold beside an idle backend.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_wake_that_is_not_used_is_passed_on_to_a_waiter_held_for_that_slot() {
    for held in ["node patience", "stored response"] {
        let streams = Streams::default();
        let spec = [("a1", "a", 1), ("a2", "a", 1), ("b1", "b", 1)];
        let mut svc = match held {
            "node patience" => patient(30, &spec[..], &streams),
            _ => SessionAffinityLayer::new().layer(fleet(&spec, &streams)),
        };
        let busy = send(&mut svc, Some("x"), Some("stream")).await.unwrap();
        let on = decision(&busy).backend;
        let (_, tx) = streams.take().unwrap();
        // With node patience, the rest of the home's node is busy too: its turns wait there.
        let mut others = Vec::new();
        if held == "node patience" {
            for session in ["y", "z"] {
                let res = send(&mut svc, Some(session), Some("stream")).await.unwrap();
                others.push((res, streams.take().unwrap().1));
            }
        }
        let next = || match held {
            "node patience" => request(Some("x"), None),
            _ => continuing(Some("x"), None, on.as_str()),
        };
        svc.ready().await.unwrap();
        let mut first = tokio_test::task::spawn(svc.call(next()));
        assert_pending!(first.poll());
        let mut second = tokio_test::task::spawn(svc.call(next()));
        assert_pending!(second.poll());
        assert_eq!(svc.stats().waiting, 2, "{held}");
        drop(tx);
        busy.into_body().collect().await.unwrap();
        assert!(first.is_woken(), "{held}");
        assert!(
            !second.is_woken(),
            "{held}: one freed slot wakes one waiter"
        );
        // The woken waiter's client goes away before it runs: the next one takes the slot.
        drop(first);
        assert!(second.is_woken(), "{held}: the wake is passed on");
        let res = assert_ready!(second.poll()).unwrap();
        let d = decision(&res);
        assert_eq!(
            (d.backend, d.waited),
            (on.clone(), Some(Duration::ZERO)),
            "{held}"
        );
        drop(res);
        assert_eq!(svc.stats().waiting, 0, "{held}");
        drop(others);
    }
}

/// A waiter that takes the slot it was woken for leaves the others asleep: that slot is not
/// passed on, as one it left unused would be.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_waiter_taking_the_slot_it_was_woken_for_wakes_no_other() {
    for freed in ["a1", "b1"] {
        let streams = Streams::default();
        let mut svc =
            SessionAffinityLayer::new().layer(fleet(&[("a1", "a", 1), ("b1", "b", 1)], &streams));
        let mut held = std::collections::HashMap::new();
        for _ in 0..2 {
            let res = send(&mut svc, None, Some("stream")).await.unwrap();
            let (id, tx) = streams.take().unwrap();
            held.insert(id, (res, tx));
        }
        svc.ready().await.unwrap();
        let mut first = tokio_test::task::spawn(svc.call(request(None, None)));
        assert_pending!(first.poll());
        let mut second = tokio_test::task::spawn(svc.call(request(None, None)));
        assert_pending!(second.poll());
        let (ending, tx) = held.remove(freed).unwrap();
        drop(tx);
        ending.into_body().collect().await.unwrap();
        assert!(first.is_woken(), "{freed}");
        let res = assert_ready!(first.poll()).unwrap();
        assert_eq!(decision(&res).backend.as_str(), freed);
        assert!(
            !second.is_woken(),
            "{freed}: the slot taken is passed on to no one"
        );
        assert_pending!(second.poll());
        // Its answer ends: the next waiter's turn.
        drop(res);
        assert!(second.is_woken(), "{freed}");
        assert_ready!(second.poll()).unwrap();
        assert_eq!(svc.stats().waiting, 0, "{freed}");
    }
}

/// A freed slot is promised to the waiter it wakes: a request arriving before that waiter's
/// task runs does not take it, but waits its turn behind it.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_slot_freed_for_a_waiter_is_not_taken_by_a_later_arrival() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new().layer(fleet(&[("a1", "a", 1)], &streams));
    let holder = send(&mut svc, None, Some("stream")).await.unwrap();
    let (_, tx) = streams.take().unwrap();
    svc.ready().await.unwrap();
    let mut waiter = tokio_test::task::spawn(svc.call(request(None, None)));
    assert_pending!(waiter.poll());
    // The slot frees and wakes the waiter; a request arrives before the waiter runs.
    drop(tx);
    holder.into_body().collect().await.unwrap();
    assert!(waiter.is_woken());
    svc.ready().await.unwrap();
    let mut later = tokio_test::task::spawn(svc.call(request(None, None)));
    assert_pending!(later.poll(), "the freed slot is promised to the waiter");
    let res = assert_ready!(waiter.poll()).unwrap();
    assert_eq!(decision(&res).waited, Some(Duration::ZERO));
    // The waiter's answer ends: the later request's turn.
    drop(res);
    assert!(later.is_woken());
    assert_ready!(later.poll()).unwrap();
    assert_eq!(svc.stats().waiting, 0);
}

/// Two thousand requests of 40 sessions, each given up at a random point (waiting, before
/// its answer, in the middle of its stream, or not at all), while a backend leaves and comes
/// back: nothing is left counted, and no slot is left promised to a waiter that is gone.
#[tokio::test(start_paused = true)]
async fn requests_given_up_anywhere_leave_nothing_counted_or_promised() {
    use std::sync::atomic::{AtomicU64, Ordering};
    type Body = http_body_util::StreamBody<
        tokio_stream::wrappers::ReceiverStream<Result<http_body::Frame<Bytes>, Infallible>>,
    >;
    type Svc = tower::util::BoxCloneSyncService<Req, http::Response<Body>, Infallible>;
    static STATE: AtomicU64 = AtomicU64::new(0x9e37_79b9_7f4a_7c15);
    fn rnd(n: u64) -> u64 {
        let mut x = STATE.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed);
        x ^= x >> 31;
        x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x ^= x >> 29;
        x % n
    }
    // Answers after a while, then three frames a while apart.
    fn streaming() -> Svc {
        Svc::new(tower::service_fn(|_req: Req| async move {
            tokio::time::sleep(Duration::from_micros(rnd(2_000))).await;
            let (tx, rx) = tokio::sync::mpsc::channel(4);
            tokio::spawn(async move {
                for _ in 0..3 {
                    tokio::time::sleep(Duration::from_micros(rnd(1_000))).await;
                    if tx
                        .send(Ok(http_body::Frame::data(Bytes::from_static(b"x"))))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
            });
            let body =
                http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx));
            Ok::<_, Infallible>(http::Response::new(body))
        }))
    }
    let (handle, stream) = discover::channel::<Svc>();
    for (id, node) in [("a1", "a"), ("a2", "a"), ("b1", "b")] {
        handle.insert(id, Backend::new(node, streaming()).slots(nz(2)));
    }
    let svc = SessionAffinityLayer::new()
        .overflow(Overflow::wait(Duration::from_millis(50), 10_000))
        .node_patience(Duration::from_millis(3))
        .layer(stream);
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..2_000u64 {
        let mut svc = svc.clone();
        tasks.spawn(async move {
            let fut = svc
                .ready()
                .await
                .unwrap()
                .call(request(Some(&format!("s{}", i % 40)), None));
            let Ok(Ok(res)) = tokio::time::timeout(Duration::from_micros(rnd(6_000)), fut).await
            else {
                return;
            };
            let mut body = res.into_body();
            match rnd(3) {
                0 => drop(body),
                1 => drop(body.frame().await),
                _ => while let Some(Ok(_)) = body.frame().await {},
            }
        });
        match i % 200 {
            100 => drop(handle.remove("a2")),
            150 => drop(handle.insert("a2", Backend::new("a", streaming()).slots(nz(2)))),
            _ => {}
        }
        if i % 8 == 0 {
            tokio::task::yield_now().await;
        }
    }
    while let Some(t) = tasks.join_next().await {
        t.unwrap();
    }
    svc.apply_discovery();
    let stats = svc.stats();
    assert_eq!((stats.in_flight, stats.waiting), (0, 0), "{stats:?}");
    assert!(svc
        .backends()
        .iter()
        .all(|b| b.in_flight == 0 && b.unread_tokens == 0));
    // Every slot is free to take: six requests at once, none waits.
    let mut held = Vec::new();
    for i in 0..6 {
        let mut svc = svc.clone();
        let fut = svc
            .ready()
            .await
            .unwrap()
            .call(request(Some(&format!("after{i}")), None));
        let mut task = tokio_test::task::spawn(fut);
        let _ = task.poll();
        held.push(task);
    }
    tokio::time::advance(Duration::from_millis(3)).await;
    assert_eq!(svc.stats().waiting, 0, "{:?}", svc.backends());
    assert_eq!(svc.stats().in_flight, 6, "{:?}", svc.backends());
    drop(held);
}

/// Marks a request that its policy may only place on `a1`.
#[derive(Clone, Copy)]
struct OnlyA1;

/// A policy of a user's own that serves some requests from one backend only (a model that
/// only `a1` runs, say): the docs allow a policy to offer nothing, the request then waits.
#[derive(Clone, Copy)]
struct SomeOnlyOnA1;

impl Placement for SomeOnlyOnA1 {
    fn place(
        &self,
        fleet: &tower_affinity::placement::FleetView<'_>,
        req: &tower_affinity::placement::PlacementRequest<'_>,
        c: &mut tower_affinity::placement::Candidates<'_>,
    ) {
        let only_a1 = req.extensions.get::<OnlyA1>().is_some();
        offer_in_order(fleet, c, |id| !only_a1 || id == "a1");
    }
}

/// Offers the backends `admit` lets through, in the fleet's order.
fn offer_in_order(
    fleet: &tower_affinity::placement::FleetView<'_>,
    c: &mut tower_affinity::placement::Candidates<'_>,
    admit: impl Fn(&str) -> bool,
) {
    for b in fleet.backends().filter(|b| admit(b.id().as_str())) {
        if c.offer(b).is_break() {
            break;
        }
    }
}

/// A waiter woken for a slot its policy does not offer it looks, finds nothing, and passes
/// the slot on: the next waiter, which that slot serves, takes it at once rather than
/// sleeping beside it until its own `max_wait`.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_wake_its_waiter_cannot_use_is_passed_on() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .placement(SomeOnlyOnA1)
        .overflow(Overflow::wait(Duration::from_secs(30), 8))
        .layer(fleet(&[("a1", "a", 1), ("b1", "b", 1)], &streams));
    let x = send(&mut svc, None, Some("stream")).await.unwrap();
    let y = send(&mut svc, None, Some("stream")).await.unwrap();
    assert_eq!(
        (decision(&x).backend.as_str(), decision(&y).backend.as_str()),
        ("a1", "b1")
    );
    let (_, _x_tx) = streams.take().unwrap();
    let (_, y_tx) = streams.take().unwrap();
    svc.ready().await.unwrap();
    let mut only_a1 = request(None, None);
    only_a1.extensions_mut().insert(OnlyA1);
    let mut first = tokio_test::task::spawn(svc.call(only_a1));
    assert_pending!(first.poll());
    svc.ready().await.unwrap();
    let mut second = tokio_test::task::spawn(svc.call(request(None, None)));
    assert_pending!(second.poll());
    // b1 frees: it wakes the oldest waiter, which only a1 may serve.
    drop(y_tx);
    y.into_body().collect().await.unwrap();
    assert!(first.is_woken());
    assert_pending!(first.poll());
    assert!(
        second.is_woken(),
        "b1 is idle while a waiter it can serve sleeps (until its max_wait)"
    );
    let d = decision(&assert_ready!(second.poll()).unwrap());
    assert_eq!(d.backend.as_str(), "b1");
    drop(x);
}

/// A waiter that takes the slot it was woken for, on a backend without a context limit,
/// wakes no other waiter, even with another slot there free: each freed slot had its wake.
/// (With a context limit, one request's end may free room for more than one:
/// `one_end_that_frees_room_for_two_waiters_wakes_both`.) Here b1's second slot frees while
/// its one waiter is already woken, and a request that only a1 serves queues beside the free
/// slot: it is not woken to look.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_waiter_taking_its_slot_where_no_context_limit_applies_wakes_no_other() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .placement(SomeOnlyOnA1)
        .overflow(Overflow::wait(Duration::from_secs(30), 8))
        .layer(fleet(&[("a1", "a", 1), ("b1", "b", 2)], &streams));
    let mut held = Vec::new();
    for _ in 0..3 {
        let res = send(&mut svc, None, Some("stream")).await.unwrap();
        let (id, tx) = streams.take().unwrap();
        held.push((id, res, tx));
    }
    let ids: Vec<_> = held.iter().map(|(id, ..)| id.as_str()).collect();
    assert_eq!(ids, ["a1", "b1", "b1"]);
    svc.ready().await.unwrap();
    let mut waiter = tokio_test::task::spawn(svc.call(request(None, None)));
    assert_pending!(waiter.poll());
    // Both of b1's streams end: the first wakes the waiter, the second finds none to wake.
    for (_, res, tx) in held.split_off(1) {
        drop(tx);
        res.into_body().collect().await.unwrap();
    }
    assert!(waiter.is_woken());
    svc.ready().await.unwrap();
    let mut only_a1 = request(None, None);
    only_a1.extensions_mut().insert(OnlyA1);
    let mut other = tokio_test::task::spawn(svc.call(only_a1));
    assert_pending!(other.poll());
    let res = assert_ready!(waiter.poll()).unwrap();
    assert_eq!(decision(&res).backend.as_str(), "b1");
    assert!(
        !other.is_woken(),
        "a slot taken on a backend without a context limit passes no room on"
    );
    assert_pending!(other.poll());
    assert_eq!(svc.stats().waiting, 1);
    drop((res, held));
}

/// Whether a request marked with it makes [`B1ThenA1`] panic when it looks: a bug in a policy
/// of a user's own, set off after the request has joined the wait queue.
#[derive(Clone, Default)]
struct PanicWhen(std::sync::Arc<std::sync::atomic::AtomicBool>);

/// Offers `b1`, then `a1`; a request marked [`OnlyA1`] only `a1`. Panics at the look of a
/// request whose [`PanicWhen`] is set.
#[derive(Clone, Copy)]
struct B1ThenA1;

impl Placement for B1ThenA1 {
    fn place(
        &self,
        fleet: &tower_affinity::placement::FleetView<'_>,
        req: &tower_affinity::placement::PlacementRequest<'_>,
        c: &mut tower_affinity::placement::Candidates<'_>,
    ) {
        if req
            .extensions
            .get::<PanicWhen>()
            .is_some_and(|p| p.0.load(std::sync::atomic::Ordering::Relaxed))
        {
            panic!("a bug in the policy");
        }
        let only_a1 = req.extensions.get::<OnlyA1>().is_some();
        for id in ["b1", "a1"] {
            if only_a1 && id != "a1" {
                continue;
            }
            let Some(b) = fleet.backends().find(|b| b.id().as_str() == id) else {
                continue;
            };
            if c.offer(b).is_break() {
                break;
            }
        }
    }
}

/// `a1` and `b1` of one slot each, both taken by streams (`b1`'s first); `b1`'s service
/// panics when it is called with a request carrying `x-panic`.
async fn b1_then_a1_full() -> (
    SessionAffinity<StaticFleet<MockService>, HeaderKey, B1ThenA1>,
    Res,
    Res,
) {
    let streams = Streams::default();
    let b1 = backend("b1", &streams);
    let b1 = MockService::new(tower::service_fn(move |req: Req| {
        if req.headers().contains_key("x-panic") {
            panic!("a bug in the backend's service");
        }
        b1.clone().oneshot(req)
    }));
    let mut svc = SessionAffinityLayer::new()
        .placement(B1ThenA1)
        .overflow(Overflow::wait(Duration::from_secs(30), 8))
        .layer(StaticFleet::new([
            ("a1", Backend::new("a", backend("a1", &streams))),
            ("b1", Backend::new("b", b1)),
        ]));
    let on_b1 = send(&mut svc, None, Some("stream")).await.unwrap();
    let on_a1 = send(&mut svc, None, Some("stream")).await.unwrap();
    assert_eq!(
        (
            decision(&on_b1).backend.as_str(),
            decision(&on_a1).backend.as_str()
        ),
        ("b1", "a1")
    );
    (svc, on_b1, on_a1)
}

/// A waiter woken for a slot, sent to another backend it prefers whose service then panics,
/// still passes the slot it was woken for on: a waiter that only that slot serves takes it
/// rather than sleeping beside it until its `max_wait`.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_wake_whose_waiter_meets_a_panicking_backend_is_passed_on() {
    let (mut svc, on_b1, on_a1) = b1_then_a1_full().await;
    svc.ready().await.unwrap();
    let mut req = request(None, None);
    req.headers_mut()
        .insert("x-panic", http::HeaderValue::from_static("1"));
    let mut first = tokio_test::task::spawn(svc.call(req));
    assert_pending!(first.poll());
    // a1 frees, for the waiter; then b1, which it prefers.
    drop(on_a1);
    drop(on_b1);
    assert!(first.is_woken());
    // A request that a1 alone may serve comes before the woken waiter runs: it waits.
    svc.ready().await.unwrap();
    let mut pinned = tokio_test::task::spawn(svc.call(continuing(None, None, "a1")));
    assert_pending!(pinned.poll());
    // The woken waiter takes b1 and leaves a1 to the other: b1's service panics.
    let polled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| first.poll()));
    assert!(polled.is_err(), "b1's service panicked");
    drop(first);
    assert_eq!(svc.stats().in_flight, 0);
    assert!(
        pinned.is_woken(),
        "a1 is idle while a waiter it can serve sleeps (until its max_wait)"
    );
    let d = decision(&assert_ready!(pinned.poll()).unwrap());
    assert_eq!(d.backend.as_str(), "a1");
}

/// A waiter woken for a slot whose look panics (its policy's bug) passes the slot on: the
/// next waiter takes it rather than sleeping beside it until its `max_wait`.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_wake_whose_waiter_panics_as_it_looks_is_passed_on() {
    let (mut svc, _on_b1, on_a1) = b1_then_a1_full().await;
    let panic_now = PanicWhen::default();
    svc.ready().await.unwrap();
    let mut req = request(None, None);
    req.extensions_mut().insert(panic_now.clone());
    let mut first = tokio_test::task::spawn(svc.call(req));
    assert_pending!(first.poll());
    svc.ready().await.unwrap();
    let mut second = tokio_test::task::spawn(svc.call(request(None, None)));
    assert_pending!(second.poll());
    // a1 frees, for the oldest waiter, whose look then panics.
    drop(on_a1);
    assert!(first.is_woken() && !second.is_woken());
    panic_now
        .0
        .store(true, std::sync::atomic::Ordering::Relaxed);
    let polled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| first.poll()));
    assert!(polled.is_err(), "the policy panicked");
    drop(first);
    assert_eq!(svc.stats().waiting, 1);
    assert!(
        second.is_woken(),
        "a1 is idle while a waiter it can serve sleeps (until its max_wait)"
    );
    let d = decision(&assert_ready!(second.poll()).unwrap());
    assert_eq!(d.backend.as_str(), "a1");
}

/// `request` with a chain of the given blocks, pinned to `on` if given.
fn chained(session: &str, mode: Option<&str>, blocks: &[(u64, u32)], on: Option<&str>) -> Req {
    let mut req = request(Some(session), mode);
    let mut facts = PromptFacts::from_chain(PromptChain::from_blocks(blocks.iter().copied()));
    facts.stored_on = on.map(Into::into);
    req.extensions_mut().insert(facts);
    req
}

/// A session held for its home's node (node patience) whose home evicted its cache, while
/// another node's backend holds its own prefix, is woken by a slot freed on its home's node,
/// where it waits, and not by one on the other node, which it cannot take.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_session_held_for_its_node_is_woken_by_a_slot_there() {
    let streams = Streams::default();
    let spec: Spec<'_> = &[("a1", "a", 1), ("b1", "b", 1)];
    let fleet = StaticFleet::new(spec.iter().map(|&(id, node, slots)| {
        (
            id,
            Backend::new(node, backend(id, &streams))
                .slots(nz(slots))
                .cache_tokens(1_000),
        )
    }));
    let mut svc = SessionAffinityLayer::new()
        .node_patience(Duration::from_secs(10))
        .overflow(Overflow::wait(Duration::from_secs(120), 8))
        .layer(fleet);
    let call = |svc: &mut _, req| {
        let svc: &mut SessionAffinity<_, HeaderKey, _> = svc;
        tokio_test::task::spawn(svc.call(req))
    };
    // Turn 1 of x on P.
    svc.ready().await.unwrap();
    let t1 = call(&mut svc, chained("x", None, &[(1, 100)], None))
        .await
        .unwrap();
    let p = decision(&t1).backend.as_str().to_owned();
    let q = if p == "a1" { "b1" } else { "a1" }.to_owned();
    drop(t1);
    // P busy; turn 2 waits out its patience and spills to Q, its home now.
    svc.ready().await.unwrap();
    let p_busy = call(&mut svc, continuing(Some("p"), Some("stream"), &p))
        .await
        .unwrap();
    let (_, _p_tx) = streams.take().unwrap();
    svc.ready().await.unwrap();
    let mut t2 = call(&mut svc, chained("x", None, &[(1, 100), (2, 100)], None));
    assert_pending!(t2.poll());
    tokio::time::advance(Duration::from_secs(11)).await;
    let t2 = t2.await.unwrap();
    assert_eq!(decision(&t2).backend.as_str(), q);
    drop(t2);
    // Another conversation pushes x out of Q's cache.
    svc.ready().await.unwrap();
    let big = call(&mut svc, chained("big", None, &[(77, 950)], Some(&q)))
        .await
        .unwrap();
    assert_eq!(decision(&big).backend.as_str(), q);
    drop(big);
    // Q busy too; x's turn 3 waits for Q's node (its home's).
    svc.ready().await.unwrap();
    let q_busy = call(&mut svc, continuing(Some("q"), Some("stream"), &q))
        .await
        .unwrap();
    let (_, q_tx) = streams.take().unwrap();
    svc.ready().await.unwrap();
    let mut t3 = call(
        &mut svc,
        chained("x", None, &[(1, 100), (2, 100), (3, 100)], None),
    );
    assert_pending!(t3.poll());
    assert_eq!(svc.stats().waiting, 1);
    // Q frees.
    drop(q_tx);
    q_busy.into_body().collect().await.unwrap();
    tokio::time::advance(Duration::from_secs(1)).await;
    if !t3.is_woken() {
        // It only runs once its patience is over, beside the slot idle since.
        tokio::time::advance(Duration::from_secs(10)).await;
        let d = decision(&assert_ready!(t3.poll()).unwrap());
        panic!(
            "a slot on x's home node ({q}) freed and x, held for that node, slept: \
             placed on {} as {:?} after {:?}",
            d.backend, d.outcome, d.waited
        );
    }
    let d = decision(&assert_ready!(t3.poll()).unwrap());
    assert_eq!(d.backend.as_str(), q);
    drop(p_busy);
}

/// A policy of a user's own: the first backend with room, in the fleet's order, whatever the
/// session's home.
#[derive(Clone, Copy)]
struct FirstWithRoom;

impl Placement for FirstWithRoom {
    fn place(
        &self,
        fleet: &tower_affinity::placement::FleetView<'_>,
        _: &tower_affinity::placement::PlacementRequest<'_>,
        c: &mut tower_affinity::placement::Candidates<'_>,
    ) {
        offer_in_order(fleet, c, |_| true);
    }
}

/// A waiter woken for one slot that its policy places elsewhere passes the slot on, to a
/// waiter that only that slot serves.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_waiter_woken_for_a_slot_it_does_not_take_passes_it_on() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .placement(FirstWithRoom)
        .layer(fleet(&[("a1", "a", 1), ("b1", "b", 1)], &streams));
    // x on a1, then y on b1: y's home is b1.
    let x = send(&mut svc, Some("x"), Some("stream")).await.unwrap();
    let y = send(&mut svc, Some("y"), Some("stream")).await.unwrap();
    assert_eq!(
        (decision(&x).backend.as_str(), decision(&y).backend.as_str()),
        ("a1", "b1")
    );
    let (_, x_tx) = streams.take().unwrap();
    let (_, y_tx) = streams.take().unwrap();
    // y's next turn waits (its home b1), then a turn that only b1 can serve.
    svc.ready().await.unwrap();
    let mut y_next = tokio_test::task::spawn(svc.call(request(Some("y"), None)));
    assert_pending!(y_next.poll());
    let mut pinned = tokio_test::task::spawn(svc.call(continuing(Some("p"), None, "b1")));
    assert_pending!(pinned.poll());
    // b1 frees and wakes y's turn, its home's; then a1 frees, which the pinned turn cannot use.
    drop(y_tx);
    y.into_body().collect().await.unwrap();
    assert!(y_next.is_woken() && !pinned.is_woken());
    drop(x_tx);
    x.into_body().collect().await.unwrap();
    assert!(!pinned.is_woken());
    // The policy sends y's turn to a1, the first with room: b1's wake goes on to the pinned one.
    let res = assert_ready!(y_next.poll()).unwrap();
    assert_eq!(decision(&res).backend.as_str(), "a1");
    assert!(
        pinned.is_woken(),
        "b1 is left idle with a request waiting for it"
    );
    let d = decision(&assert_ready!(pinned.poll()).unwrap());
    assert_eq!((d.backend.as_str(), d.waited), ("b1", Some(Duration::ZERO)));
}

/// A request placed on a backend that is not ready yet, and given up before the backend took
/// it, is not in that backend's cache model: the backend never saw its prompt.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_request_given_up_before_its_backend_was_ready_is_not_modelled_as_cached() {
    // One backend that takes one request at a time: the second one placed on it waits for
    // the backend's readiness, not for a slot.
    let hangs = tower::service_fn(|_req: Req| async {
        std::future::pending::<()>().await;
        Ok::<_, Infallible>(http::Response::new(String::new()))
    });
    let one_at_a_time = tower::limit::ConcurrencyLimit::new(hangs, 1);
    let mut svc = SessionAffinityLayer::new().layer(StaticFleet::new([(
        "a1",
        Backend::new("a", one_at_a_time).slots(nz(2)),
    )]));
    let chained = |session: &str, first_block: u64, tokens: u32| {
        let mut req = request(Some(session), None);
        let chain = PromptChain::from_blocks([(first_block, tokens)]);
        req.extensions_mut().insert(PromptFacts::from_chain(chain));
        req
    };
    ServiceExt::<Req>::ready(&mut svc).await.unwrap();
    let mut sent = tokio_test::task::spawn(svc.call(chained("s1", 1, 1_000)));
    assert_pending!(sent.poll());
    ServiceExt::<Req>::ready(&mut svc).await.unwrap();
    let mut unsent = tokio_test::task::spawn(svc.call(chained("s2", 7, 5_000)));
    assert_pending!(unsent.poll());
    assert_eq!(status(&svc, "a1").in_flight, 2);
    assert_eq!(status(&svc, "a1").cached_tokens, 1_000);
    drop(unsent);
    let a1 = status(&svc, "a1");
    assert_eq!((a1.in_flight, a1.cached_tokens), (1, 1_000));
    drop(sent);
}

fn patient(
    patience: u64,
    spec: Spec<'_>,
    streams: &Streams,
) -> SessionAffinity<StaticFleet<MockService>, HeaderKey, tower_affinity::placement::NodeThenBackend>
{
    SessionAffinityLayer::new()
        .node_patience(Duration::from_secs(patience))
        .layer(fleet(spec, streams))
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn node_patience_keeps_a_session_waiting_for_its_node() {
    let streams = Streams::default();
    let mut svc = patient(10, &[("a1", "a", 1), ("b1", "b", 1)], &streams);
    let first = send(&mut svc, Some("x"), Some("stream")).await.unwrap();
    let home = decision(&first).backend;
    let (_, tx) = streams.take().unwrap();
    svc.ready().await.unwrap();
    let mut next = tokio_test::task::spawn(svc.call(request(Some("x"), None)));
    assert_pending!(
        next.poll(),
        "another node has room, but the home node may free soon"
    );
    tokio::time::advance(Duration::from_secs(4)).await;
    assert_pending!(next.poll());
    drop(tx);
    first.into_body().collect().await.unwrap();
    let res = assert_ready!(next.poll()).unwrap();
    let d = decision(&res);
    assert_eq!((d.backend, d.outcome), (home, Outcome::HomeHit));
    assert_eq!(d.waited, Some(Duration::from_secs(4)));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn node_patience_spills_when_it_runs_out() {
    let streams = Streams::default();
    let mut svc = patient(10, &[("a1", "a", 1), ("b1", "b", 1)], &streams);
    let first = send(&mut svc, Some("x"), Some("stream")).await.unwrap();
    let started = tokio::time::Instant::now();
    let res = send(&mut svc, Some("x"), None).await.unwrap();
    let d = decision(&res);
    assert_eq!(started.elapsed(), Duration::from_secs(10));
    assert_eq!(d.outcome, Outcome::CrossNodeSpill);
    assert_ne!(d.backend, decision(&first).backend);
}

/// A request held for its node sleeps through a backend on another node coming back from its
/// failure cooldown: it may not take that backend until its patience runs out. Each such
/// return woke every request held so, to look and find nothing.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_request_held_for_its_node_sleeps_through_a_return_elsewhere() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .failure_cooldown(Duration::from_secs(2))
        .overflow(Overflow::wait(Duration::from_secs(60), 8))
        .node_patience(Duration::from_secs(10))
        .layer(fleet(&[("a1", "a", 1), ("b1", "b", 1)], &streams));
    let first = send(&mut svc, Some("x"), Some("stream")).await.unwrap();
    let home = decision(&first).backend;
    // The other backend fails a request: down for its cooldown.
    let other = if home.as_str() == "a1" { "b1" } else { "a1" };
    let mut req = request(Some("f"), None);
    req.headers_mut()
        .insert("x-fail-on", http::HeaderValue::from_str(other).unwrap());
    let err = svc.ready().await.unwrap().call(req).await.unwrap_err();
    assert!(matches!(err, Error::Backend { .. }), "{err}");
    svc.ready().await.unwrap();
    let mut next = tokio_test::task::spawn(svc.call(request(Some("x"), None)));
    assert_pending!(next.poll());
    tokio::time::advance(Duration::from_millis(2_010)).await;
    assert!(!next.is_woken(), "a return it may not use woke it");
    tokio::time::advance(Duration::from_millis(7_990)).await;
    assert!(next.is_woken(), "its patience ran out");
    let res = assert_ready!(next.poll()).unwrap();
    let d = decision(&res);
    assert_eq!(d.backend.as_str(), other);
    assert_eq!(d.waited, Some(Duration::from_secs(10)));
    drop(first);
}

/// A request held for its node that is woken and looks again (here by a backend announced on
/// a third node) is still held: its patience, not its `max_wait`, decides when it may go
/// elsewhere.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_request_held_for_its_node_stays_held_after_a_look_that_finds_its_node_full() {
    let streams = Streams::default();
    let (handle, stream) = discover::channel::<MockService>();
    for (id, node) in [("a1", "a"), ("b1", "b")] {
        handle.insert(id, Backend::new(node, backend(id, &streams)).slots(nz(1)));
    }
    let mut svc = SessionAffinityLayer::new()
        .overflow(Overflow::wait(Duration::from_secs(60), 8))
        .node_patience(Duration::from_secs(10))
        .layer(stream);
    let first = send(&mut svc, Some("x"), Some("stream")).await.unwrap();
    let home = decision(&first).backend;
    svc.ready().await.unwrap();
    let mut next = tokio_test::task::spawn(svc.call(request(Some("x"), None)));
    assert_pending!(next.poll(), "held for its node, though the other has room");
    tokio::time::advance(Duration::from_secs(4)).await;
    handle.insert(
        "c1",
        Backend::new("c", backend("c1", &streams)).slots(nz(1)),
    );
    assert!(
        next.is_woken(),
        "an announcement wakes every waiting request"
    );
    assert_pending!(
        next.poll(),
        "the look finds its node full: it is still held"
    );
    // (The drain that applied the announcement woke it too, so it looks once more.)
    tokio::time::advance(Duration::from_millis(5_990)).await;
    assert_pending!(next.poll(), "its patience has not run out");
    tokio::time::advance(Duration::from_millis(10)).await;
    assert!(next.is_woken(), "its patience ran out");
    let res = assert_ready!(next.poll()).unwrap();
    let d = decision(&res);
    assert_ne!(d.backend, home);
    assert_eq!(d.outcome, Outcome::CrossNodeSpill);
    assert_eq!(d.waited, Some(Duration::from_secs(10)));
    drop(first);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn node_patience_is_not_spent_on_a_node_without_a_healthy_backend() {
    let streams = Streams::default();
    let mut svc = patient(10, &[("a1", "a", 1), ("b1", "b", 1)], &streams);
    let home = turn(&mut svc, "x").await;
    svc.mark_down(home.backend.as_str(), None);
    let started = tokio::time::Instant::now();
    let d = turn(&mut svc, "x").await;
    assert_eq!(started.elapsed(), Duration::ZERO);
    assert_eq!(d.outcome, Outcome::CrossNodeSpill);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn node_patience_still_takes_a_free_slot_on_the_home_node() {
    let streams = Streams::default();
    let mut svc = patient(10, TWO_BY_TWO, &streams);
    let home = turn(&mut svc, "x").await;
    let _held = send(&mut svc, Some("x"), Some("stream")).await.unwrap();
    let started = tokio::time::Instant::now();
    let d = turn(&mut svc, "x").await;
    assert_eq!(started.elapsed(), Duration::ZERO);
    assert_eq!((d.outcome, d.node), (Outcome::SameNodeSpill, home.node));
}

/// A request held for its home node that finds no room in the queue to wait (`max_queued`
/// requests wait already, or none may) takes the free slot on another node, as it would
/// without patience, rather than being refused: it is held only while it may wait.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_request_held_for_its_node_with_no_room_to_wait_spills_rather_than_being_refused() {
    let streams = Streams::default();
    for max_queued in [0, 1] {
        let mut svc = SessionAffinityLayer::new()
            .overflow(Overflow::wait(Duration::from_secs(60), max_queued))
            .node_patience(Duration::from_secs(10))
            .layer(fleet(&[("a1", "a", 1), ("b1", "b", 1)], &streams));
        let first = send(&mut svc, Some("x"), Some("stream")).await.unwrap();
        let home = decision(&first).backend;
        // Another session of the same home waits for its node, filling a queue of one.
        let mut queued = Vec::new();
        if max_queued == 1 {
            svc.ready().await.unwrap();
            let mut w = tokio_test::task::spawn(svc.call(request(Some("x"), None)));
            assert_pending!(w.poll());
            queued.push(w);
        }
        assert_eq!(svc.stats().waiting, max_queued);
        let started = tokio::time::Instant::now();
        let res = send(&mut svc, Some("x"), None).await;
        let res = res.unwrap_or_else(|e| panic!("max_queued {max_queued}: {e}"));
        let d = decision(&res);
        assert_eq!(started.elapsed(), Duration::ZERO);
        assert_eq!(
            d.outcome,
            Outcome::CrossNodeSpill,
            "max_queued {max_queued}"
        );
        assert_ne!(d.backend, home);
        let stats = svc.stats();
        assert_eq!((stats.rejected, stats.abandoned), (0, 0));
        drop((res, queued, first));
        while streams.take().is_some() {}
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn node_patience_applies_only_when_requests_may_wait() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .overflow(Overflow::Reject)
        .node_patience(Duration::from_secs(10))
        .layer(fleet(&[("a1", "a", 1), ("b1", "b", 1)], &streams));
    let _held = send(&mut svc, Some("x"), Some("stream")).await.unwrap();
    let d = turn(&mut svc, "x").await;
    assert_eq!(d.outcome, Outcome::CrossNodeSpill);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_decision_rides_on_the_body_even_without_the_extension() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .decision_extension(false)
        .layer(fleet(TWO_BY_TWO, &streams));
    let res = send(&mut svc, Some("s"), None).await.unwrap();
    assert!(res.extensions().get::<Decision>().is_none());
    assert_eq!(res.body().decision().unwrap().outcome, Outcome::NewSession);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_first_requests_all_see_the_discovered_fleet() {
    // Many clones asking at once while one of them applies the first discovery changes: each
    // waits for that drain rather than going on with the still empty fleet.
    for _ in 0..20 {
        let streams = Streams::default();
        let svc = SessionAffinityLayer::new().layer(fleet(TWO_BY_TWO, &streams));
        let calls: Vec<_> = (0..32)
            .map(|i| {
                let mut svc = svc.clone();
                let req = request(Some(&format!("first-{i}")), None);
                tokio::spawn(async move {
                    let res: Result<Res, Error> = match svc.ready().await {
                        Ok(svc) => svc.call(req).await,
                        Err(e) => Err(e),
                    };
                    res.map(|r| decision(&r).outcome)
                })
            })
            .collect();
        for call in calls {
            let outcome = call.await.unwrap();
            assert!(
                !matches!(outcome, Err(Error::NoBackends { .. })),
                "a first request found no backends"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_announced_before_readiness_is_there_when_readiness_returns() {
    // Clones keep asking for readiness on both workers while backends are announced one by
    // one; whichever clone asks after an announcement has been sent finds it applied, even
    // when another clone is in the middle of a drain.
    let streams = Streams::default();
    let (handle, stream) = discover::channel::<MockService>();
    let svc = SessionAffinityLayer::new().layer(stream);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let busy: Vec<_> = (0..4)
        .map(|_| {
            let mut svc = svc.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    svc.ready().await.unwrap();
                    tokio::task::yield_now().await;
                }
            })
        })
        .collect();
    let mut asker = svc.clone();
    for i in 0..200 {
        let id = format!("b{i}");
        handle.insert(id.as_str(), Backend::new("n", backend(&id, &streams)));
        asker.ready().await.unwrap();
        assert!(
            asker.backends().iter().any(|b| b.id.as_str() == id),
            "{id} was announced before readiness but is not in the fleet"
        );
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for task in busy {
        task.await.unwrap();
    }
}

/// How many requests a contended backend is serving, and the most it ever served at once.
#[derive(Default)]
struct Gauge {
    now: std::sync::atomic::AtomicUsize,
    max: std::sync::atomic::AtomicUsize,
    served: std::sync::atomic::AtomicUsize,
}

/// A response body that yields once, sends one frame and ends, counting itself out of its
/// backend's gauge when it ends (or is dropped first).
struct Held {
    gauge: std::sync::Arc<Gauge>,
    yielded: bool,
    sent: bool,
    counted_out: bool,
}

impl Held {
    fn count_out(&mut self) {
        if !std::mem::replace(&mut self.counted_out, true) {
            self.gauge
                .now
                .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
}

impl http_body::Body for Held {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        use std::task::Poll;
        if !self.yielded {
            self.yielded = true;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        if !self.sent {
            self.sent = true;
            return Poll::Ready(Some(Ok(http_body::Frame::data(Bytes::from_static(b"x")))));
        }
        // Out before the end is reported, which is when the balancer frees the slot.
        self.count_out();
        Poll::Ready(None)
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.count_out();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_contention_no_backend_serves_beyond_its_slots_and_every_waiter_is_served() {
    use std::sync::atomic::Ordering::SeqCst;
    use std::sync::Arc;
    const TASKS: usize = 48;
    const TURNS: usize = 25;
    let specs = [("a1", 3u32), ("a2", 2)];
    let gauges: Vec<Arc<Gauge>> = specs.iter().map(|_| Arc::default()).collect();
    let fleet = StaticFleet::new(specs.iter().zip(&gauges).map(|(&(id, slots), gauge)| {
        let gauge = gauge.clone();
        let service = tower::service_fn(move |_req: Req| {
            let now = gauge.now.fetch_add(1, SeqCst) + 1;
            gauge.max.fetch_max(now, SeqCst);
            gauge.served.fetch_add(1, SeqCst);
            let body = Held {
                gauge: gauge.clone(),
                yielded: false,
                sent: false,
                counted_out: false,
            };
            std::future::ready(Ok::<_, std::convert::Infallible>(http::Response::new(body)))
        });
        (id, Backend::new("n", service).slots(nz(slots)))
    }));
    let svc = SessionAffinityLayer::new()
        .overflow(Overflow::wait(Duration::from_secs(60), 4096))
        .layer(fleet);
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let mut svc = svc.clone();
            tokio::spawn(async move {
                for turn in 0..TURNS {
                    // Half the callers are sessions, half are keyless.
                    let session = (t % 2 == 0).then(|| format!("s{t}"));
                    let req = request(session.as_deref(), None);
                    let res = svc.ready().await.unwrap().call(req).await.unwrap();
                    let body = res.into_body().collect().await.unwrap().to_bytes();
                    assert_eq!(body, "x", "task {t}, turn {turn}");
                }
            })
        })
        .collect();
    join_within_30s(tasks, "every waiter was served in time").await;
    for (&(id, slots), gauge) in specs.iter().zip(&gauges) {
        let max = gauge.max.load(SeqCst);
        assert!(
            max <= slots as usize,
            "{id} served {max} at once on {slots} slots"
        );
        assert_eq!(gauge.now.load(SeqCst), 0, "{id}");
    }
    let served: usize = gauges.iter().map(|g| g.served.load(SeqCst)).sum();
    assert_eq!(served, TASKS * TURNS);
    let stats = svc.stats();
    assert_eq!((stats.in_flight, stats.waiting), (0, 0));
    assert!(stats.waited > 0, "the callers contended for slots");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_flow_while_discovery_churns_and_no_slot_is_lost() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    // One backend stays; three others are removed and announced again, over and over, while
    // 32 callers send requests on two workers. Every request is answered, and at the end no
    // slot is held.
    let streams = Streams::default();
    let (handle, stream) = discover::channel::<MockService>();
    let announce = |id: &str| {
        handle.insert(
            id,
            Backend::new(if id == "a1" { "a" } else { "b" }, backend(id, &streams)).slots(nz(4)),
        );
    };
    for id in ["a1", "b1", "b2", "b3"] {
        announce(id);
    }
    let svc = SessionAffinityLayer::new()
        .overflow(Overflow::Overcommit)
        .layer(stream);
    let stop = Arc::new(AtomicBool::new(false));
    let churn = {
        let handle = handle.clone();
        let streams = streams.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut rounds = 0;
            while !stop.load(Ordering::Relaxed) && rounds < 10_000 {
                for id in ["b1", "b2", "b3"] {
                    handle.remove(id);
                    tokio::task::yield_now().await;
                    handle.insert(id, Backend::new("b", backend(id, &streams)).slots(nz(4)));
                }
                rounds += 1;
                tokio::task::yield_now().await;
            }
            rounds
        })
    };
    let callers: Vec<_> = (0..32)
        .map(|t| {
            let mut svc = svc.clone();
            tokio::spawn(async move {
                for turn in 0..50 {
                    let session = format!("s{}", (t * 50 + turn) % 40);
                    let req = request(Some(&session), None);
                    let res = svc.ready().await.unwrap().call(req).await.unwrap();
                    res.into_body().collect().await.unwrap();
                }
            })
        })
        .collect();
    join_within_30s(callers, "every request answered in time").await;
    stop.store(true, Ordering::Relaxed);
    let rounds = churn.await.unwrap();
    assert!(rounds > 0, "the fleet churned");
    let stats = svc.stats();
    assert_eq!(stats.in_flight, 0, "{stats:?}");
    assert_eq!(stats.placed(), 32 * 50);
    assert!(svc.backends().iter().all(|b| b.in_flight == 0));
}

// === the cache model, end to end: JSON chat bodies through BodyKeyLayer ===

type JsonReq = http::Request<http_body_util::Full<Bytes>>;
type JsonService = tower::util::BoxCloneSyncService<
    JsonReq,
    http::Response<http_body_util::Full<Bytes>>,
    tower_affinity::BoxError,
>;
type ChatKey = tower_affinity::key::FirstOf<HeaderKey, tower_affinity::key::ExtensionKey>;
type Chat = tower_affinity::key::BodyKey<
    SessionAffinity<StaticFleet<JsonService>, ChatKey, tower_affinity::placement::NodeThenBackend>,
>;

/// A backend that answers at once with its name.
fn json_backend(name: &str) -> JsonService {
    let name = Bytes::from(name.to_string());
    tower::util::BoxCloneSyncService::new(tower::service_fn(move |_req: JsonReq| {
        let name = name.clone();
        async move {
            Ok::<_, tower_affinity::BoxError>(http::Response::new(http_body_util::Full::new(name)))
        }
    }))
}

/// The proxy's stack without the network: `BodyKeyLayer` in front of the balancer, keys from
/// the headers, then from the body; every backend with a cache budget of `cache_tokens`.
fn chat_stack(spec: Spec<'_>, cache_tokens: u64) -> Chat {
    let fleet = StaticFleet::new(spec.iter().map(|&(id, node, slots)| {
        (
            id,
            Backend::new(node, json_backend(id))
                .slots(nz(slots))
                .cache_tokens(cache_tokens),
        )
    }));
    let affinity = SessionAffinityLayer::new()
        .key(tower_affinity::key::FirstOf::new(
            HeaderKey::default(),
            tower_affinity::key::ExtensionKey,
        ))
        .layer(fleet);
    tower_affinity::key::BodyKeyLayer::new().layer(affinity)
}

fn message(role: &str, content: &str) -> serde_json::Value {
    serde_json::json!({ "role": role, "content": content })
}

/// The tokens the chain estimates for `messages`: a digit a token and other bytes four a
/// token, over each message's JSON without whitespace (as `serde_json` writes it).
fn tokens_of(messages: &[serde_json::Value]) -> u64 {
    let text: String = messages.iter().map(|m| m.to_string()).collect();
    let digits = text.bytes().filter(u8::is_ascii_digit).count() as u64;
    (text.len() as u64 - digits).div_ceil(4) + digits
}

/// One turn of a chat: `messages`, keyed by the body's `user` field when `user` is given, by
/// the `x-session-id` header when `header` is.
async fn chat_turn(
    svc: &mut Chat,
    user: Option<&str>,
    header: Option<&str>,
    messages: &[serde_json::Value],
) -> Decision {
    let (d, res) = chat_send(svc, user, header, messages).await;
    let served_by = res.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(served_by, d.backend.as_str());
    d
}

/// A turn of a chat as in [`chat_turn`], its answer not read: its backend's slot stays taken
/// until the response is dropped.
async fn chat_send(
    svc: &mut Chat,
    user: Option<&str>,
    header: Option<&str>,
    messages: &[serde_json::Value],
) -> (
    Decision,
    http::Response<impl http_body::Body<Error: std::fmt::Debug>>,
) {
    let mut body = serde_json::json!({ "model": "m", "messages": messages });
    if let Some(u) = user {
        body["user"] = u.into();
    }
    let body = Bytes::from(serde_json::to_vec(&body).unwrap());
    let mut req = http::Request::post("/v1/chat/completions")
        .header(http::header::CONTENT_LENGTH, body.len());
    if let Some(h) = header {
        req = req.header("x-session-id", h);
    }
    let req = req.body(http_body_util::Full::new(body)).unwrap();
    let res = ServiceExt::<JsonReq>::ready(svc)
        .await
        .unwrap()
        .call(req)
        .await
        .unwrap();
    assert_eq!(res.status(), http::StatusCode::OK);
    let d = res.extensions().get::<Decision>().cloned().unwrap();
    (d, res)
}

fn chat_status(svc: &Chat, id: &str) -> tower_affinity::BackendStatus {
    svc.get_ref()
        .backends()
        .into_iter()
        .find(|b| b.id.as_str() == id)
        .unwrap_or_else(|| panic!("no backend {id}"))
}

/// A conversation's messages: a system prompt and a first user message; each turn adds the
/// assistant's answer and the next user message.
struct Conversation(Vec<serde_json::Value>);

impl Conversation {
    /// Its first turn.
    fn new(name: &str) -> Self {
        Conversation(vec![
            message(
                "system",
                &format!("You are {name}. {}", "Be brief. ".repeat(40)),
            ),
            message(
                "user",
                &format!("{name}, first question: {}", "why? ".repeat(60)),
            ),
        ])
    }

    fn next_turn(&mut self, n: usize) {
        self.0.push(message(
            "assistant",
            &format!("answer {n}: {}", "because. ".repeat(8)),
        ));
        self.0.push(message(
            "user",
            &format!("question {}: {}", n + 1, "and then? ".repeat(5)),
        ));
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn keyless_turns_of_a_conversation_are_prefix_hits_where_its_prefix_is() {
    let mut svc = chat_stack(TWO_BY_TWO, Backend::<()>::DEFAULT_CACHE_TOKENS);
    let (mut a, mut b) = (Conversation::new("alpha"), Conversation::new("beta"));
    let first_a = chat_turn(&mut svc, None, None, &a.0).await;
    let first_b = chat_turn(&mut svc, None, None, &b.0).await;
    assert_eq!(
        (first_a.outcome, first_b.outcome),
        (Outcome::Keyless, Outcome::Keyless)
    );
    // A new keyless conversation goes to the backend homing the fewest: not alpha's.
    assert_ne!(first_a.backend, first_b.backend);
    // Turn n + 1 repeats turn n's messages and adds the answer and a question: each turn goes
    // where the conversation's own prefix is, interleaved as they are.
    for n in 1..=3 {
        a.next_turn(n);
        b.next_turn(n);
        let da = chat_turn(&mut svc, None, None, &a.0).await;
        let db = chat_turn(&mut svc, None, None, &b.0).await;
        assert_eq!(
            (da.outcome, &da.backend),
            (Outcome::PrefixHit, &first_a.backend),
            "turn {n}"
        );
        assert_eq!(
            (db.outcome, &db.backend),
            (Outcome::PrefixHit, &first_b.backend),
            "turn {n}"
        );
    }
    let stats = svc.get_ref().stats();
    assert_eq!((stats.keyless, stats.prefix_hits), (2, 6));
    assert_eq!(stats.placed(), 8);
    assert_eq!(
        stats.sessions, 0,
        "keyless requests leave no session behind"
    );
    assert!(stats.cache_model_bytes > 0);
    // Each conversation's backend homes it and holds its whole last prompt.
    for (first, conv) in [(&first_a, &a), (&first_b, &b)] {
        let s = chat_status(&svc, first.backend.as_str());
        assert_eq!(s.conversations, 1, "{s:?}");
        assert_eq!(s.cached_tokens, tokens_of(&conv.0), "{s:?}");
        assert_eq!(s.cached_blocks, conv.0.len(), "{s:?}");
        assert_eq!(s.evicted_blocks, 0, "{s:?}");
    }
    let all: u32 = svc
        .get_ref()
        .backends()
        .iter()
        .map(|b| b.conversations)
        .sum();
    assert_eq!(all, 2);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_rewritten_history_is_a_compaction_and_stays_home() {
    let mut svc = chat_stack(TWO_BY_TWO, Backend::<()>::DEFAULT_CACHE_TOKENS);
    // Keyed by the body's `user` field.
    let user = Some("agent-7");
    let mut conv = Conversation::new("gamma");
    let first = chat_turn(&mut svc, user, None, &conv.0).await;
    assert_eq!(first.outcome, Outcome::NewSession);
    conv.next_turn(1);
    let second = chat_turn(&mut svc, user, None, &conv.0).await;
    assert_eq!(
        (second.outcome, &second.backend),
        (Outcome::HomeHit, &first.backend)
    );
    // The client compacts: the system prompt stays, the rest becomes a summary.
    let mut compacted = Conversation(vec![
        conv.0[0].clone(),
        message(
            "user",
            &format!(
                "Summary of the conversation so far: {}",
                "it went well. ".repeat(20)
            ),
        ),
    ]);
    let third = chat_turn(&mut svc, user, None, &compacted.0).await;
    assert_eq!(
        (third.outcome, &third.backend),
        (Outcome::Compaction, &first.backend)
    );
    // The compacted history goes on from there: the home holds it now.
    compacted.next_turn(1);
    let fourth = chat_turn(&mut svc, user, None, &compacted.0).await;
    assert_eq!(
        (fourth.outcome, &fourth.backend),
        (Outcome::HomeHit, &first.backend)
    );
    let stats = svc.get_ref().stats();
    assert_eq!(
        (
            stats.new_sessions,
            stats.home_hits,
            stats.compactions,
            stats.sessions
        ),
        (1, 2, 1, 1)
    );
    // The home holds both histories' tips: the old one is evicted only when room runs out.
    let s = chat_status(&svc, first.backend.as_str());
    assert_eq!(s.conversations, 2, "{s:?}");
    assert_eq!(
        s.cached_tokens,
        tokens_of(&conv.0) + tokens_of(&compacted.0) - tokens_of(&conv.0[..1]),
        "{s:?}"
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_turn_of_another_conversation_under_the_key_goes_where_its_own_prefix_is() {
    // One session header over two conversations, as an agent sends its sub-agents' and its
    // side requests' (a title, a summary) under its own session.
    let mut svc = chat_stack(TWO_BY_TWO, Backend::<()>::DEFAULT_CACHE_TOKENS);
    let key = Some("agent-1");
    let mut main = Conversation::new("main");
    let first = chat_turn(&mut svc, None, key, &main.0).await;
    main.next_turn(1);
    // The main conversation's second turn still streaming: its backend is full when a side
    // request comes, which spills and takes the key's home with it.
    let (second, streaming) = chat_send(&mut svc, None, key, &main.0).await;
    assert_eq!(
        (second.outcome, &second.backend),
        (Outcome::HomeHit, &first.backend)
    );
    let side = Conversation::new("title writer");
    let aside = chat_turn(&mut svc, None, key, &side.0).await;
    assert_eq!(aside.outcome, Outcome::Compaction, "no cache holds it");
    assert_ne!(aside.backend, first.backend);
    drop(streaming);
    // The main conversation goes on where its own prompt is, not where the key went last.
    main.next_turn(2);
    let third = chat_turn(&mut svc, None, key, &main.0).await;
    assert_eq!(
        (third.outcome, &third.backend),
        (Outcome::PrefixHit, &first.backend)
    );
    // So does the side conversation, and each of them from then on.
    let mut side = side;
    side.next_turn(1);
    let aside_again = chat_turn(&mut svc, None, key, &side.0).await;
    assert_eq!(
        (aside_again.outcome, &aside_again.backend),
        (Outcome::PrefixHit, &aside.backend)
    );
    main.next_turn(3);
    let fourth = chat_turn(&mut svc, None, key, &main.0).await;
    assert_eq!(
        (fourth.outcome, &fourth.backend),
        (Outcome::PrefixHit, &first.backend)
    );
    let stats = svc.get_ref().stats();
    assert_eq!(
        (stats.compactions, stats.prefix_hits, stats.sessions),
        (1, 3, 1)
    );
}

/// An Anthropic token count of `messages` under the session header `header`, as Claude Code
/// sends one (at start, for `/context`) beside its turns.
async fn count_tokens(svc: &mut Chat, header: &str, messages: &[serde_json::Value]) -> Decision {
    let body = serde_json::json!({ "model": "m", "messages": messages });
    let body = Bytes::from(serde_json::to_vec(&body).unwrap());
    let req = http::Request::post("/v1/messages/count_tokens")
        .header(http::header::CONTENT_LENGTH, body.len())
        .header("x-claude-code-session-id", header)
        .body(http_body_util::Full::new(body))
        .unwrap();
    let res = ServiceExt::<JsonReq>::ready(svc)
        .await
        .unwrap()
        .call(req)
        .await
        .unwrap();
    assert_eq!(res.status(), http::StatusCode::OK);
    res.extensions().get::<Decision>().cloned().unwrap()
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_token_count_leaves_its_session_where_it_was_and_never_waits() {
    let mut svc = chat_stack(TWO_BY_TWO, Backend::<()>::DEFAULT_CACHE_TOKENS);
    let key = "agent-1";
    let mut main = Conversation::new("main");
    let first = chat_turn(&mut svc, None, Some(key), &main.0).await;
    main.next_turn(1);
    // The second turn still streaming, its backend full, when the agent counts the
    // conversation's tokens under the session.
    let (second, streaming) = chat_send(&mut svc, None, Some(key), &main.0).await;
    assert_eq!(second.backend, first.backend);
    let count = count_tokens(&mut svc, key, &main.0).await;
    assert_eq!(count.outcome, Outcome::Keyless);
    assert_ne!(count.backend, first.backend, "the home is full");
    drop(streaming);
    // The next turn goes home: the count moved nothing, and told no cache model of a prompt.
    main.next_turn(2);
    let third = chat_turn(&mut svc, None, Some(key), &main.0).await;
    assert_eq!(
        (third.outcome, &third.backend),
        (Outcome::HomeHit, &first.backend)
    );
    assert_eq!(chat_status(&svc, count.backend.as_str()).conversations, 0);

    // With every slot taken, a count goes at once rather than waiting for one.
    let mut held = Vec::new();
    for i in 0..4 {
        let other = Conversation::new(&format!("other-{i}"));
        held.push(chat_send(&mut svc, None, Some(&format!("other-{i}")), &other.0).await);
    }
    let started = tokio::time::Instant::now();
    let count = count_tokens(&mut svc, key, &main.0).await;
    assert_eq!(count.outcome, Outcome::Keyless);
    assert_eq!(count.waited, None);
    assert_eq!(started.elapsed(), Duration::ZERO);
    let stats = svc.get_ref().stats();
    assert_eq!(stats.sessions, 5);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_session_whose_home_evicted_it_is_a_cold_home() {
    // Room on each backend for delta's first three turns, not for two conversations.
    let spec: Spec<'_> = &[("a1", "node-a", 1), ("b1", "node-b", 1)];
    let mut delta = Conversation::new("delta");
    let budget = {
        let mut third = Conversation(delta.0.clone());
        third.next_turn(1);
        third.next_turn(2);
        tokens_of(&third.0)
    };
    assert!(budget < 2 * tokens_of(&delta.0));
    let mut svc = chat_stack(spec, budget);
    let home = chat_turn(&mut svc, None, Some("delta"), &delta.0).await;
    assert_eq!(home.outcome, Outcome::NewSession);
    assert_eq!(chat_status(&svc, home.backend.as_str()).conversations, 1);
    // Other sessions until one lands on delta's home and pushes delta out of its cache.
    let mut pushed = false;
    for i in 0..32 {
        let name = format!("other-{i}");
        let other = Conversation::new(&name);
        let d = chat_turn(&mut svc, None, Some(&name), &other.0).await;
        assert_eq!(d.outcome, Outcome::NewSession);
        if d.backend == home.backend {
            pushed = true;
            break;
        }
    }
    assert!(pushed, "no other session went to {}", home.backend);
    let s = chat_status(&svc, home.backend.as_str());
    assert!(s.evicted_blocks >= 2, "{s:?}");
    assert!(s.cached_tokens <= budget, "{s:?}");
    assert_eq!(s.conversations, 1, "{s:?}");
    delta.next_turn(1);
    let next = chat_turn(&mut svc, None, Some("delta"), &delta.0).await;
    assert_eq!(next.outcome, Outcome::ColdHome);
    let stats = svc.get_ref().stats();
    assert_eq!(stats.cold_homes, 1);
    assert_eq!(stats.home_hits, 0);
    // Wherever it went, it is its home now, and that holds it: the next turn is a home hit.
    delta.next_turn(2);
    let after = chat_turn(&mut svc, None, Some("delta"), &delta.0).await;
    assert_eq!(
        (after.outcome, &after.backend),
        (Outcome::HomeHit, &next.backend)
    );
    for b in svc.get_ref().backends() {
        assert!(b.cached_tokens <= budget, "{b:?}");
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_home_that_evicted_a_later_conversation_but_kept_a_one_block_turn_is_a_home_hit() {
    // One backend. s's first turn is a single block, which t's conversation goes on from
    // after z's: when y's makes room, z's is the least recently used and goes, though it came
    // after s's turn. s's home has evicted since s's turn, and still holds it.
    let mut svc = chained_stack(&[("a1", "node-a", 1)]);
    let chain = |blocks: &[(u64, u32)]| tower_affinity::PromptChain::from_blocks(blocks.to_vec());
    for (session, turn) in [
        ("s", chain(&[(20, 1_000)])),
        ("z", chain(&[(40, 60_000)])),
        ("t", chain(&[(20, 1_000), (22, 500)])),
        ("y", chain(&[(30, 100_000)])),
    ] {
        call_chained(&mut svc, session, &turn).await.await.unwrap();
    }
    assert_eq!(cached_tokens(&svc), 101_500, "z evicted, s and t kept");
    let next = chain(&[(20, 1_000), (21, 500)]);
    let res = call_chained(&mut svc, "s", &next).await.await.unwrap();
    let d = res.extensions().get::<Decision>().unwrap();
    assert_eq!(d.outcome, Outcome::HomeHit);
    assert_eq!(cached_tokens(&svc), 102_000);
}

/// A turn with a prompt chain after one without is no compaction: nothing was known of the
/// last turn's prompt, so nothing says this one rewrote it. It goes home, a home hit.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_turn_with_a_prompt_chain_after_one_without_is_a_home_hit_not_a_compaction() {
    let mut svc = chained_stack(TWO_BY_TWO);
    let res = ServiceExt::<http::Request<String>>::ready(&mut svc)
        .await
        .unwrap()
        .call(request(Some("s"), None))
        .await
        .unwrap();
    let first = res.extensions().get::<Decision>().cloned().unwrap();
    drop(res);
    assert_eq!(first.outcome, Outcome::NewSession);
    let chain = tower_affinity::PromptChain::from_blocks([(1, 2_000), (2, 100)]);
    let res = call_chained(&mut svc, "s", &chain).await.await.unwrap();
    let second = res.extensions().get::<Decision>().unwrap();
    assert_eq!(
        (second.outcome, &second.backend),
        (Outcome::HomeHit, &first.backend)
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_new_keyless_conversation_sharing_only_the_system_prompt_is_not_a_prefix_hit() {
    let mut svc = chat_stack(TWO_BY_TWO, Backend::<()>::DEFAULT_CACHE_TOKENS);
    let first = Conversation::new("epsilon");
    let mut second = Conversation::new("epsilon");
    second.0[1] = message("user", "an unrelated question");
    let d1 = chat_turn(&mut svc, None, None, &first.0).await;
    let d2 = chat_turn(&mut svc, None, None, &second.0).await;
    assert_eq!(d1.outcome, Outcome::Keyless);
    // A new conversation: by load, to a backend homing none.
    assert_eq!(d2.outcome, Outcome::Keyless);
    assert_ne!(d2.backend, d1.backend);
}

type Answering =
    tower::util::BoxCloneService<http::Request<String>, http::Response<String>, Infallible>;

type ChainedStack =
    SessionAffinity<StaticFleet<Answering>, HeaderKey, tower_affinity::placement::NodeThenBackend>;

/// Readies `svc` and calls it with a turn of `session` whose prompt is `chain`; the response
/// future comes back unpolled.
async fn call_chained(
    svc: &mut ChainedStack,
    session: &str,
    chain: &tower_affinity::PromptChain,
) -> <ChainedStack as Service<http::Request<String>>>::Future {
    ServiceExt::<http::Request<String>>::ready(svc)
        .await
        .unwrap()
        .call(chained_request(session, chain))
}

/// A service over `spec` whose backends answer at once, keyed by `x-session-id`, for requests
/// that carry their prompt chain as an extension.
fn chained_stack(spec: Spec<'_>) -> ChainedStack {
    let fleet = StaticFleet::new(spec.iter().map(|&(id, node, slots)| {
        let service = Answering::new(tower::service_fn(|_req: http::Request<String>| async {
            Ok::<_, Infallible>(http::Response::new(String::new()))
        }));
        (id, Backend::new(node, service).slots(nz(slots)))
    }));
    SessionAffinityLayer::new().layer(fleet)
}

fn chained_request(session: &str, chain: &tower_affinity::PromptChain) -> http::Request<String> {
    let mut req = http::Request::post("/v1/chat/completions")
        .header("x-session-id", session)
        .body(String::new())
        .unwrap();
    req.extensions_mut()
        .insert(tower_affinity::key::PromptFacts::from_chain(chain.clone()));
    req
}

fn cached_tokens<D, K, P, S>(svc: &SessionAffinity<D, K, P>) -> u64
where
    D: Discover<Key = tower_affinity::BackendId, Service = Backend<S>>,
{
    svc.backends().iter().map(|b| b.cached_tokens).sum()
}

/// A backend announced again with a lower cache budget keeps its model to that budget, in
/// links and tokens and in the memory they take: what the larger budget's links took is given
/// back, and the conversations it keeps are the latest, as before.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_backend_announced_again_with_a_lower_budget_gives_back_its_models_memory() {
    let streams = Streams::default();
    let (handle, stream) = discover::channel();
    let announce = |tokens| Backend::new("n", backend("a", &streams)).cache_tokens(tokens);
    handle.insert("a", announce(1 << 22));
    let mut svc = SessionAffinityLayer::new().layer(stream);
    // Eight conversations of 8,000 links of 16 tokens: 64,000 links, megabytes of model.
    let conversation = |c: u64, links: u64| {
        tower_affinity::PromptChain::from_blocks((0..links).map(move |i| ((c << 32) | i, 16)))
    };
    for c in 0..8 {
        let chain = conversation(c, 8_000);
        let res = send_req(&mut svc, chained_request(&format!("s{c}"), &chain))
            .await
            .unwrap();
        res.into_body().collect().await.unwrap();
    }
    let before = svc.stats().cache_model_bytes;
    assert!(before > 3_000_000, "{before} bytes");
    // The default budget now: 8,192 links at most, under 770 KB, as a backend announced
    // with it from the start.
    handle.insert("a", announce(Backend::<()>::DEFAULT_CACHE_TOKENS));
    svc.ready().await.unwrap();
    let status = &svc.backends()[0];
    assert_eq!(status.cache_budget, Backend::<()>::DEFAULT_CACHE_TOKENS);
    assert_eq!(status.cached_tokens, Backend::<()>::DEFAULT_CACHE_TOKENS);
    let after = svc.stats().cache_model_bytes;
    assert!(after < 770_000, "{after} of {before} bytes");
    // The latest conversation is kept whole, and its next turn is a home hit.
    let res = send_req(&mut svc, chained_request("s7", &conversation(7, 8_001)))
        .await
        .unwrap();
    assert_eq!(decision(&res).outcome, Outcome::HomeHit);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_chain_goes_into_the_cache_model_once_its_request_is_on_its_way() {
    let mut svc = chained_stack(TWO_BY_TWO);
    let chain = tower_affinity::PromptChain::from_blocks([(1, 2_000), (2, 300)]);
    let fut = call_chained(&mut svc, "s1", &chain).await;
    // Placed, its slot taken, its backend called: the model is not written on that path.
    assert_eq!(svc.backends().iter().map(|b| b.in_flight).sum::<u32>(), 1);
    assert_eq!(cached_tokens(&svc), 0);
    // The first poll drives the backend's future, then records the chain.
    let mut fut = tokio_test::task::spawn(fut);
    let res = assert_ready!(fut.poll()).unwrap();
    assert_eq!(cached_tokens(&svc), 2_300);
    assert_eq!(
        res.extensions().get::<Decision>().unwrap().outcome,
        Outcome::NewSession
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_response_future_dropped_before_its_first_poll_still_records_its_chain() {
    let mut svc = chained_stack(TWO_BY_TWO);
    let chain = tower_affinity::PromptChain::from_blocks([(1, 2_000), (2, 300)]);
    let fut = call_chained(&mut svc, "s1", &chain).await;
    let home = svc
        .backends()
        .into_iter()
        .find(|b| b.in_flight == 1)
        .unwrap()
        .id;
    drop(fut);
    assert_eq!(cached_tokens(&svc), 2_300);
    // The next turn finds its home holding the last one.
    let next = tower_affinity::PromptChain::from_blocks([(1, 2_000), (2, 300), (3, 500)]);
    let res = call_chained(&mut svc, "s1", &next).await.await.unwrap();
    let d = res.extensions().get::<Decision>().unwrap();
    assert_eq!((d.outcome, &d.backend), (Outcome::HomeHit, &home));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_turn_placed_before_the_last_one_settled_is_a_home_hit_and_both_are_recorded() {
    let spec: Spec<'_> = &[("a1", "node-a", 2), ("b1", "node-b", 2)];
    let mut svc = chained_stack(spec);
    let first = tower_affinity::PromptChain::from_blocks([(1, 2_000), (2, 300)]);
    let fut1 = call_chained(&mut svc, "s1", &first).await;
    // The next turn arrives while the first is still unpolled: its chain is not in the model
    // yet, but its home is known to have evicted nothing since.
    let second = tower_affinity::PromptChain::from_blocks([(1, 2_000), (2, 300), (3, 500)]);
    let fut2 = call_chained(&mut svc, "s1", &second).await;
    assert_eq!(cached_tokens(&svc), 0);
    // The later turn settles first: what it was told its home held is not there, and the
    // record finds that out instead of trusting it.
    let mut fut2 = tokio_test::task::spawn(fut2);
    let res2 = assert_ready!(fut2.poll()).unwrap();
    assert_eq!(cached_tokens(&svc), 2_800);
    let mut fut1 = tokio_test::task::spawn(fut1);
    let res1 = assert_ready!(fut1.poll()).unwrap();
    assert_eq!(
        cached_tokens(&svc),
        2_800,
        "the first turn's links are the second's"
    );
    let (d1, d2) = (
        res1.extensions().get::<Decision>().unwrap(),
        res2.extensions().get::<Decision>().unwrap(),
    );
    assert_eq!(d1.outcome, Outcome::NewSession);
    assert_eq!((d2.outcome, &d2.backend), (Outcome::HomeHit, &d1.backend));
    let status = svc
        .backends()
        .into_iter()
        .find(|b| b.id == d1.backend)
        .unwrap();
    assert_eq!(status.cached_tokens, 2_800);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn keyless_draws_repeat_with_a_seed_and_spread_without_one() {
    const EIGHT: Spec<'static> = &[
        ("a1", "node-a", 1),
        ("a2", "node-a", 1),
        ("a3", "node-a", 1),
        ("a4", "node-a", 1),
        ("b1", "node-b", 1),
        ("b2", "node-b", 1),
        ("b3", "node-b", 1),
        ("b4", "node-b", 1),
    ];
    async fn run(seed: Option<u64>) -> Vec<tower_affinity::BackendId> {
        let fleet = StaticFleet::new(EIGHT.iter().map(|&(id, node, slots)| {
            let service = Answering::new(tower::service_fn(|_req: http::Request<String>| async {
                Ok::<_, Infallible>(http::Response::new(String::new()))
            }));
            (id, Backend::new(node, service).slots(nz(slots)))
        }));
        let layer = SessionAffinityLayer::new();
        let mut svc = match seed {
            Some(seed) => layer.random_seed(seed),
            None => layer,
        }
        .layer(fleet);
        let mut placed = Vec::new();
        for _ in 0..32 {
            // No key and no prompt: the freer of two sampled backends, all of them free.
            let req = http::Request::post("/v1/chat/completions")
                .body(String::new())
                .unwrap();
            let res = ServiceExt::<http::Request<String>>::ready(&mut svc)
                .await
                .unwrap()
                .call(req)
                .await
                .unwrap();
            placed.push(res.extensions().get::<Decision>().unwrap().backend.clone());
        }
        placed
    }
    let first = run(Some(7)).await;
    assert_eq!(first, run(Some(7)).await);
    let used: std::collections::HashSet<_> = first.iter().collect();
    assert!(used.len() > 4, "the draws spread: {used:?}");
    assert_ne!(first, run(Some(8)).await, "another seed, other draws");
    // Unseeded, each thread's own generator: spread too, and another run draws otherwise
    // (the chance that 32 draws over 8 backends repeat is nil).
    let unseeded = run(None).await;
    let used: std::collections::HashSet<_> = unseeded.iter().collect();
    assert!(used.len() > 4, "the draws spread: {used:?}");
    assert_ne!(unseeded, run(None).await);
}

// With tower's layers between the balancer and `ErrorToResponse` or `RetryOnce`, which box
// errors: the balancer's own errors keep their answers.

/// The front of a stack: `ErrorToResponse` over `svc`, called once.
async fn answer<S>(svc: S, req: Req) -> http::Response<ResponseBody<MockBody>>
where
    S: Service<Req, Response = Res>,
    S::Error: Into<tower_affinity::BoxError>,
{
    let mut front = tower_affinity::ErrorToResponse::new(svc);
    let ready = front.ready().await;
    let Ok(front) = ready;
    let Ok(res) = front.call(req).await;
    res
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn error_to_response_answers_the_balancers_errors_behind_a_buffer() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .overflow(Overflow::Reject)
        .layer(fleet(&[("a1", "a", 1)], &streams));
    let held = send(&mut svc, Some("s"), Some("stream")).await.unwrap();
    let buffered = tower::buffer::Buffer::new(svc.clone(), 4);
    let res = answer(buffered.clone(), request(Some("t"), None)).await;
    assert_eq!(res.status(), 429, "full: Saturated, boxed by the buffer");
    assert_eq!(res.headers()["retry-after"], "1");
    drop(held);
    let res = answer(buffered, request(Some("t"), None)).await;
    assert_eq!(res.status(), 200);
    assert_eq!(decision(&res).backend.as_str(), "a1");
}

/// The message of an error answer's JSON body.
async fn error_message<B>(res: http::Response<B>) -> String
where
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    let body = res.into_body().collect().await.unwrap().to_bytes();
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
    body["error"]["message"].as_str().unwrap().to_owned()
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn error_to_response_answers_a_tower_timeout_504_and_frees_the_slot() {
    let streams = Streams::default();
    let svc = SessionAffinityLayer::new().layer(fleet(&[("a1", "a", 1)], &streams));
    let timed = tower::timeout::TimeoutLayer::new(Duration::from_secs(5)).layer(svc.clone());
    let res = answer(timed, request(Some("s"), Some("hang"))).await;
    assert_eq!(res.status(), 504);
    assert_eq!(error_message(res).await, "request timed out");
    assert_eq!(in_flight(&svc, "a1"), 0, "the dropped call freed its slot");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn error_to_response_answers_a_shed_request_503_and_any_other_error_500() {
    let streams = Streams::default();
    let svc = SessionAffinityLayer::new().layer(fleet(&[("a1", "a", 1)], &streams));
    let limited = tower::ServiceBuilder::new()
        .load_shed()
        .concurrency_limit(1)
        .service(svc);
    // The limit's one permit taken by a clone made ready: the next request is shed.
    let mut first = limited.clone();
    ServiceExt::<Req>::ready(&mut first).await.unwrap();
    let res = answer(limited, request(Some("t"), None)).await;
    assert_eq!(res.status(), 503);
    drop(first);
    let failing = tower::service_fn(|_: Req| async {
        Err::<Res, _>(tower_affinity::BoxError::from("the layer's own failure"))
    });
    let res = answer(failing, request(None, None)).await;
    assert_eq!(res.status(), 500);
    assert_eq!(error_message(res).await, "the layer's own failure");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn retry_once_retries_a_backend_failure_behind_a_buffer() {
    let streams = Streams::default();
    let svc = SessionAffinityLayer::new().layer(fleet(&[("a1", "a", 1), ("a2", "a", 1)], &streams));
    let first = turn(&mut svc.clone(), "s").await;
    let mut req = request(Some("s"), None);
    req.headers_mut().insert(
        "x-fail-on",
        http::HeaderValue::from_str(first.backend.as_str()).unwrap(),
    );
    let retrying = tower::ServiceBuilder::new()
        .retry(RetryOnce::new())
        .buffer(4)
        .service(svc.clone());
    let res = answer(retrying, req).await;
    assert_eq!(res.status(), 200);
    assert_ne!(decision(&res).backend, first.backend, "retried elsewhere");
    // Any other boxed error is not retried: the timeout's is answered at once.
    let retrying = tower::ServiceBuilder::new()
        .retry(RetryOnce::new())
        .timeout(Duration::from_secs(5))
        .service(svc.clone());
    let started = tokio::time::Instant::now();
    let res = answer(retrying, request(Some("s"), Some("hang"))).await;
    assert_eq!(res.status(), 504);
    assert_eq!(started.elapsed(), Duration::from_secs(5));
}

/// tower-http's `TimeoutLayer` makes its `408` with the body's `Default`: it wraps the balancer,
/// and a `BodyKeyLayer` in front of it.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn tower_http_timeout_answers_408_around_the_balancer_and_the_body_key_layer() {
    let streams = Streams::default();
    let svc = SessionAffinityLayer::new().layer(fleet(&[("a1", "a", 1)], &streams));
    let timeout = || {
        tower_http::timeout::TimeoutLayer::with_status_code(
            http::StatusCode::REQUEST_TIMEOUT,
            Duration::from_secs(5),
        )
    };
    let mut bare = timeout().layer(tower_affinity::ErrorToResponse::new(svc.clone()));
    let res = bare
        .ready()
        .await
        .unwrap()
        .call(request(Some("s"), Some("hang")))
        .await
        .unwrap();
    assert_eq!(res.status(), 408);
    assert_eq!(in_flight(&svc, "a1"), 0);
    // Behind a `BodyKeyLayer`, over a backend that never answers.
    let hangs = tower::service_fn(|_: http::Request<http_body_util::Full<Bytes>>| {
        std::future::pending::<Result<http::Response<http_body_util::Full<Bytes>>, Infallible>>()
    });
    let svc = SessionAffinityLayer::new().layer(StaticFleet::new([(
        "h1",
        Backend::new("h", hangs).slots(nz(1)),
    )]));
    let mut keyed = timeout().layer(
        tower_affinity::key::BodyKeyLayer::new()
            .layer(tower_affinity::ErrorToResponse::new(svc.clone())),
    );
    let res = ServiceExt::<Req>::ready(&mut keyed)
        .await
        .unwrap()
        .call(request(Some("s"), None))
        .await
        .unwrap();
    assert_eq!(res.status(), 408);
    assert!(res.into_body().get_ref().is_none());
    assert_eq!(in_flight(&svc, "h1"), 0);
}

/// `NodeThenBackend`, passing over the backends an `Avoid` extension names: a policy that
/// keeps tenants apart, say.
#[derive(Clone, Copy)]
struct AvoidNamed;

#[derive(Clone)]
struct Avoid(&'static [&'static str]);

impl Placement for AvoidNamed {
    fn place(
        &self,
        fleet: &tower_affinity::placement::FleetView<'_>,
        req: &tower_affinity::placement::PlacementRequest<'_>,
        c: &mut tower_affinity::placement::Candidates<'_>,
    ) {
        if let Some(Avoid(names)) = req.extensions.get::<Avoid>() {
            for b in fleet
                .backends()
                .filter(|b| names.contains(&b.id().as_str()))
            {
                c.pass_over(b);
            }
        }
        tower_affinity::placement::NodeThenBackend::new().place(fleet, req, c)
    }
}

fn avoiding(mut req: Req, names: &'static [&'static str]) -> Req {
    req.extensions_mut().insert(Avoid(names));
    req
}

/// With every backend down, the refusal says when the first failure cooldown ends, so that a
/// client retries then (a llama-server restarting) rather than at once; a backend down until
/// a probe says otherwise, or an empty fleet, gives no time.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn with_every_backend_down_the_refusal_says_when_the_first_cooldown_ends() {
    let streams = Streams::default();
    let mut svc =
        SessionAffinityLayer::new().layer(fleet(&[("a1", "a", 1), ("b1", "b", 1)], &streams));
    svc.apply_discovery();
    let retry_after = |err: &Error| match err {
        Error::NoBackends { retry_after, .. } => *retry_after,
        other => panic!("{other}"),
    };
    // Down until a probe says otherwise: no time to give.
    assert!(svc.mark_down("a1", None));
    assert!(svc.mark_down("b1", None));
    let err = send(&mut svc, Some("s"), None).await.unwrap_err();
    assert_eq!(retry_after(&err), None);
    assert_eq!(
        answer(svc.clone(), request(Some("s"), None))
            .await
            .headers()
            .get("retry-after"),
        None
    );
    // One of them in a failure cooldown of 5 s, 1.5 s of it gone: 3.5 s left, said as 4.
    svc.mark_down("b1", Some(Duration::from_secs(5)));
    tokio::time::advance(Duration::from_millis(1_500)).await;
    let err = send(&mut svc, Some("s"), None).await.unwrap_err();
    assert_eq!(retry_after(&err), Some(Duration::from_millis(3_500)));
    assert_eq!(
        err.to_string(),
        "no backends available: every backend is down (2 in the fleet); retry after 4 s"
    );
    let res = answer(svc.clone(), request(Some("s"), None)).await;
    assert_eq!(res.status(), 503);
    assert_eq!(res.headers()["retry-after"], "4");
    // The other's shorter cooldown is the first to end.
    svc.mark_down("a1", Some(Duration::from_secs(2)));
    let err = send(&mut svc, Some("s"), None).await.unwrap_err();
    assert_eq!(retry_after(&err), Some(Duration::from_secs(2)));
    // When it has, the request is served there.
    tokio::time::advance(Duration::from_secs(2)).await;
    let res = send(&mut svc, Some("s"), None).await.unwrap();
    assert_eq!(decision(&res).backend.as_str(), "a1");
    assert_eq!(svc.stats().no_backends, 5);
}

/// A refusal right after a backend went down for a cooldown of whole seconds says those
/// seconds, not one more: the mark ends in the millisecond its time falls in, so the time left
/// read on the fleet's clock of milliseconds is never more than the cooldown.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_cooldown_of_whole_seconds_is_said_in_those_seconds_not_one_more() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new().layer(fleet(&[("a1", "a", 1)], &streams));
    svc.apply_discovery();
    // Between two ticks of the fleet's clock, as any real failure is.
    tokio::time::advance(Duration::from_micros(1_400)).await;
    svc.mark_down("a1", Some(Duration::from_secs(5)));
    let err = send(&mut svc, Some("s"), None).await.unwrap_err();
    assert!(matches!(err, Error::NoBackends { .. }), "{err}");
    let after = err.retry_after().unwrap();
    assert!(after <= Duration::from_secs(5), "{after:?}");
    assert_eq!(
        err.to_string(),
        "no backends available: every backend is down (1 in the fleet); retry after 5 s"
    );
    let res = answer(svc.clone(), request(Some("s"), None)).await;
    assert_eq!(res.headers()["retry-after"], "5");
    // Retried when it says, the backend is back.
    tokio::time::advance(after).await;
    let res = send(&mut svc, Some("s"), None).await.unwrap();
    assert_eq!(decision(&res).backend.as_str(), "a1");
}

/// An empty fleet gives no time to come back after.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn an_empty_fleet_gives_no_time_to_retry_after() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new().layer(fleet(&[], &streams));
    let err = send(&mut svc, Some("s"), None).await.unwrap_err();
    assert!(matches!(err, Error::NoBackends { .. }), "{err}");
    assert_eq!(err.retry_after(), None);
}

/// A refusal over an empty fleet says that the fleet is empty, in the error and in the 503's
/// body, so that it is not read as backends down or as the policy's refusal.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_refusal_over_an_empty_fleet_says_the_fleet_is_empty() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new().layer(fleet(&[], &streams));
    let says = "no backends available: the fleet is empty";
    let err = send(&mut svc, Some("s"), None).await.unwrap_err();
    assert_eq!(err.to_string(), says);
    assert!(
        matches!(
            err,
            Error::NoBackends {
                backends: 0,
                up: 0,
                ..
            }
        ),
        "{err:?}"
    );
    let res = answer(svc.clone(), request(Some("s"), None)).await;
    assert_eq!(res.status(), 503);
    assert_eq!(error_message(res).await, says);
}

/// A refusal with every backend down says that they are down and how many there are, not
/// that the fleet is empty nor that the policy refused the request.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_refusal_with_every_backend_down_says_every_backend_is_down() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .placement(AvoidNamed)
        .layer(fleet(&[("a1", "a", 1), ("b1", "b", 1)], &streams));
    svc.apply_discovery();
    assert!(svc.mark_down("a1", None));
    assert!(svc.mark_down("b1", None));
    let says = "no backends available: every backend is down (2 in the fleet)";
    let err = send(&mut svc, Some("s"), None).await.unwrap_err();
    assert_eq!(err.to_string(), says);
    assert!(
        matches!(
            err,
            Error::NoBackends {
                backends: 2,
                up: 0,
                ..
            }
        ),
        "{err:?}"
    );
    let res = answer(svc.clone(), request(Some("s"), None)).await;
    assert_eq!(res.status(), 503);
    assert_eq!(error_message(res).await, says);
    // One passed over while down is down all the same: no backend up was passed over.
    let req = avoiding(request(Some("s"), None), &["a1"]);
    let err = send_req(&mut svc, req).await.unwrap_err();
    assert_eq!(err.to_string(), says);
}

/// A refusal by the placement policy, which passed over every backend up, says so and how
/// many backends were up, rather than that no backends are available; the status and the
/// `Retry-After` stay those of any refusal for want of a backend.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_refusal_by_the_policy_says_the_policy_passed_over_every_backend_up() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .placement(AvoidNamed)
        .layer(fleet(&[("a1", "a", 1), ("b1", "b", 1)], &streams));
    svc.apply_discovery();
    let says = "no backend for the request: the placement policy passed over every backend up \
                (2 of 2 in the fleet)";
    let req = avoiding(request(Some("s"), None), &["a1", "b1"]);
    let err = send_req(&mut svc, req).await.unwrap_err();
    assert_eq!(err.to_string(), says);
    assert!(
        matches!(
            err,
            Error::NoBackends {
                backends: 2,
                up: 2,
                ..
            }
        ),
        "{err:?}"
    );
    let req = avoiding(request(Some("s"), None), &["a1", "b1"]);
    let res = answer(svc.clone(), req).await;
    assert_eq!(res.status(), 503);
    assert_eq!(res.headers().get("retry-after"), None);
    assert_eq!(error_message(res).await, says);
    // One up and passed over, the other down for a cooldown the request may wait out.
    svc.mark_down("b1", Some(Duration::from_secs(3)));
    let says = "no backend for the request: the placement policy passed over every backend up \
                (1 of 2 in the fleet); retry after 3 s";
    let req = avoiding(request(Some("s"), None), &["a1"]);
    let err = send_req(&mut svc, req).await.unwrap_err();
    assert_eq!(err.to_string(), says);
    assert!(
        matches!(
            err,
            Error::NoBackends {
                backends: 2,
                up: 1,
                ..
            }
        ),
        "{err:?}"
    );
    let req = avoiding(request(Some("s"), None), &["a1"]);
    let res = answer(svc.clone(), req).await;
    assert_eq!(res.status(), 503);
    assert_eq!(res.headers()["retry-after"], "3");
    assert_eq!(error_message(res).await, says);
    assert_eq!(svc.stats().no_backends, 4);
}

/// A backend the policy passes over is no backend for the request, down or up: the end of
/// its failure cooldown is no time to retry after. The first cooldown to end among those the
/// request may go to is.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_backend_passed_over_gives_no_time_to_retry_after() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .placement(AvoidNamed)
        .layer(fleet(&[("a1", "a", 1), ("b1", "b", 1)], &streams));
    svc.apply_discovery();
    // a1 passed over, back in 2 s; b1 down until a probe says otherwise: no time to give.
    svc.mark_down("a1", Some(Duration::from_secs(2)));
    assert!(svc.mark_down("b1", None));
    let err = send_req(&mut svc, avoiding(request(Some("s"), None), &["a1"]))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::NoBackends { .. }), "{err}");
    assert_eq!(err.retry_after(), None);
    let res = answer(svc.clone(), avoiding(request(Some("s"), None), &["a1"])).await;
    assert_eq!(res.status(), 503);
    assert_eq!(res.headers().get("retry-after"), None);
    // b1 in a cooldown of 5 s: that one, not a1's 2 s.
    svc.mark_down("b1", Some(Duration::from_secs(5)));
    let err = send_req(&mut svc, avoiding(request(Some("s"), None), &["a1"]))
        .await
        .unwrap_err();
    assert_eq!(err.retry_after(), Some(Duration::from_secs(5)), "{err}");
    // Neither passed over: a1's, the first to end.
    let err = send(&mut svc, Some("s"), None).await.unwrap_err();
    assert_eq!(err.retry_after(), Some(Duration::from_secs(2)), "{err}");
}

/// A policy that passes over every backend that is up has none for the request: it fails at
/// once with `NoBackends`, as over an empty fleet, rather than waiting out its `max_wait` for
/// a slot it would never take (and being told `Saturated`).
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_policy_passing_over_every_backend_up_has_no_backends() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .placement(AvoidNamed)
        .overflow(Overflow::wait(Duration::from_secs(60), 8))
        .layer(fleet(&[("a1", "a", 1), ("b1", "b", 1)], &streams));
    let started = tokio::time::Instant::now();
    let req = avoiding(request(Some("s"), None), &["a1", "b1"]);
    let err = send_req(&mut svc, req).await.unwrap_err();
    assert!(matches!(err, Error::NoBackends { .. }), "{err}");
    assert_eq!(started.elapsed(), Duration::ZERO);
    // One passed over and the other down: none either.
    assert!(svc.mark_down("b1", None));
    let req = avoiding(request(Some("s"), None), &["a1"]);
    let err = send_req(&mut svc, req).await.unwrap_err();
    assert!(matches!(err, Error::NoBackends { .. }), "{err}");
    assert_eq!(svc.stats().no_backends, 2);
    // One left it may take, but full: that one is waited for.
    assert!(svc.mark_up("b1"));
    let held = send(&mut svc, Some("t"), Some("stream")).await.unwrap();
    let full = decision(&held).backend;
    let other: &'static [&'static str] = if full.as_str() == "a1" {
        &["b1"]
    } else {
        &["a1"]
    };
    svc.ready().await.unwrap();
    let mut waiting = tokio_test::task::spawn(svc.call(avoiding(request(Some("u"), None), other)));
    assert_pending!(waiting.poll());
    drop(held);
    let (_, tx) = streams.take().unwrap();
    drop(tx);
    assert!(waiting.is_woken());
    let res = assert_ready!(waiting.poll()).unwrap();
    assert_eq!(decision(&res).backend, full);
}

/// A keyless request whose own prefix only a backend its policy passed over holds is placed
/// as any keyless request, and says so: `Keyless`, not a spill from a backend it could never
/// take.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_prefix_held_only_where_the_policy_passes_over_is_not_a_spill() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .placement(AvoidNamed)
        .layer(fleet(
            &[("a1", "a", 1), ("a2", "a", 1), ("b1", "b", 1)],
            &streams,
        ));
    let keyless = |blocks: &[(u64, u32)]| {
        let mut req = request(None, None);
        req.extensions_mut()
            .insert(PromptFacts::from_chain(PromptChain::from_blocks(
                blocks.iter().copied(),
            )));
        req
    };
    let first = send_req(&mut svc, keyless(&[(1, 2_000)])).await.unwrap();
    let holder = decision(&first).backend;
    drop(first);
    let res = send_req(&mut svc, keyless(&[(1, 2_000), (2, 300)]))
        .await
        .unwrap();
    assert_eq!(decision(&res).backend, holder);
    assert_eq!(decision(&res).outcome, Outcome::PrefixHit);
    drop(res);
    let avoid: &'static [&'static str] = match holder.as_str() {
        "a1" => &["a1"],
        "a2" => &["a2"],
        _ => &["b1"],
    };
    let res = svc
        .ready()
        .await
        .unwrap()
        .call(avoiding(keyless(&[(1, 2_000), (2, 300), (3, 300)]), avoid))
        .await
        .unwrap();
    let d = decision(&res);
    assert_ne!(d.backend, holder);
    assert_eq!(d.outcome, Outcome::Keyless);
    let stats = svc.stats();
    assert_eq!((stats.same_node_spills, stats.cross_node_spills), (0, 0));
    drop(res);
    // Another conversation, its holder's node down, not passed over: a spill to the other
    // node, and said so.
    let res = send_req(&mut svc, keyless(&[(10, 2_000)])).await.unwrap();
    let holder = decision(&res).backend;
    drop(res);
    let on_holders_node: &[&str] = if holder.as_str() == "b1" {
        &["b1"]
    } else {
        &["a1", "a2"]
    };
    for id in on_holders_node {
        assert!(svc.mark_down(id, None));
    }
    let res = send_req(&mut svc, keyless(&[(10, 2_000), (11, 300)]))
        .await
        .unwrap();
    assert_eq!(decision(&res).outcome, Outcome::CrossNodeSpill);
}

/// `Overflow::wait` at its edges: no room in the queue, or no time to wait, refuses a request
/// that finds the fleet full at once, as `Reject` does; a wait too long for the clock waits
/// until a slot frees, however long that takes.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_wait_of_no_time_or_no_room_refuses_at_once_and_one_of_no_end_is_served() {
    let streams = Streams::default();
    for overflow in [
        Overflow::wait(Duration::ZERO, 8),
        Overflow::wait(Duration::MAX, 0),
    ] {
        let mut svc = SessionAffinityLayer::new()
            .overflow(overflow)
            .layer(fleet(&[("a1", "a", 1)], &streams));
        let held = send(&mut svc, Some("s"), Some("stream")).await.unwrap();
        let started = tokio::time::Instant::now();
        let err = send(&mut svc, Some("t"), None).await.unwrap_err();
        assert!(
            matches!(err, Error::Saturated { .. }),
            "{overflow:?}: {err}"
        );
        assert_eq!(started.elapsed(), Duration::ZERO, "{overflow:?}");
        let stats = svc.stats();
        assert_eq!((stats.rejected, stats.waiting), (1, 0), "{overflow:?}");
        drop(held);
        streams.take().unwrap();
    }
    let mut svc = SessionAffinityLayer::new()
        .overflow(Overflow::wait(Duration::MAX, usize::MAX))
        .layer(fleet(&[("a1", "a", 1)], &streams));
    let held = send(&mut svc, Some("s"), Some("stream")).await.unwrap();
    svc.ready().await.unwrap();
    let mut waiting = tokio_test::task::spawn(svc.call(request(Some("t"), None)));
    assert_pending!(waiting.poll());
    tokio::time::sleep(Duration::from_secs(30 * 86_400)).await;
    assert_pending!(waiting.poll());
    assert_eq!(svc.stats().waiting, 1);
    drop(held);
    streams.take().unwrap();
    assert!(waiting.is_woken());
    let res = assert_ready!(waiting.poll()).unwrap();
    assert_eq!(
        decision(&res).waited,
        Some(Duration::from_secs(30 * 86_400))
    );
}

/// A wait of no time is no wait: a request that finds the fleet full is refused by `call`
/// itself, as under `Reject`. It takes no place in the queue, so it is never counted waiting,
/// and a slot that frees before its future is first polled does not serve it after all.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_wait_of_no_time_takes_no_place_in_the_queue() {
    let streams = Streams::default();
    for overflow in [Overflow::wait(Duration::ZERO, 8), Overflow::Reject] {
        let mut svc = SessionAffinityLayer::new()
            .overflow(overflow)
            .layer(fleet(&[("a1", "a", 1)], &streams));
        let held = send(&mut svc, Some("s"), Some("stream")).await.unwrap();
        svc.ready().await.unwrap();
        let mut refused = tokio_test::task::spawn(svc.call(request(Some("t"), None)));
        assert_eq!(svc.stats().waiting, 0, "{overflow:?}");
        drop(held);
        streams.take().unwrap();
        let err = assert_ready!(refused.poll()).unwrap_err();
        assert!(
            matches!(err, Error::Saturated { .. }),
            "{overflow:?}: {err}"
        );
        let stats = svc.stats();
        assert_eq!((stats.rejected, stats.abandoned), (1, 0), "{overflow:?}");
    }
}

/// A wait of no time needs no timer: on a runtime without tokio's time driver, a request that
/// finds the fleet full is refused, not a panic.
#[test]
fn a_wait_of_no_time_needs_no_time_driver() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(async {
        let streams = Streams::default();
        let mut svc = SessionAffinityLayer::new()
            .overflow(Overflow::wait(Duration::ZERO, 8))
            .layer(fleet(&[("a1", "a", 1)], &streams));
        let _held = send(&mut svc, Some("s"), Some("stream")).await.unwrap();
        let err = send(&mut svc, Some("t"), None).await.unwrap_err();
        assert!(matches!(err, Error::Saturated { .. }), "{err}");
    });
}

/// A policy, counting the looks it is asked for.
#[derive(Clone)]
struct CountsLooks<P>(std::sync::Arc<std::sync::atomic::AtomicUsize>, P);

impl<P: Placement> Placement for CountsLooks<P> {
    fn place(
        &self,
        fleet: &tower_affinity::placement::FleetView<'_>,
        req: &tower_affinity::placement::PlacementRequest<'_>,
        c: &mut tower_affinity::placement::Candidates<'_>,
    ) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.1.place(fleet, req, c)
    }
}

/// A wait that lets no request wait (of no time, or with no room in the queue) places as
/// `Reject` does: in one look, never held out for one place it could not wait for (its home's
/// node; or the full backend holding its prefix, for which a look gives back the free slot it
/// took, leaving it to any request arriving before the next look).
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_wait_that_lets_no_request_wait_places_in_one_look_as_reject_does() {
    for overflow in [
        Overflow::Reject,
        Overflow::wait(Duration::ZERO, 8),
        Overflow::wait(Duration::from_secs(60), 0),
    ] {
        let streams = Streams::default();
        let looks = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut svc = SessionAffinityLayer::new()
            .placement(CountsLooks(
                looks.clone(),
                tower_affinity::placement::NodeThenBackend::new(),
            ))
            .overflow(overflow)
            .node_patience(Duration::from_secs(300))
            .layer(fleet(&[("a1", "a", 1), ("b1", "b", 1)], &streams));
        // Session "s" homed, its home node full with its own stream.
        let held = send(&mut svc, Some("s"), Some("stream")).await.unwrap();
        let home = decision(&held).backend.clone();
        looks.store(0, std::sync::atomic::Ordering::Relaxed);
        let res = send(&mut svc, Some("s"), None).await.unwrap();
        assert_ne!(decision(&res).backend, home, "{overflow:?}");
        assert_eq!(
            looks.load(std::sync::atomic::Ordering::Relaxed),
            1,
            "{overflow:?}"
        );
        drop((held, res));
        while streams.take().is_some() {}
    }
}

/// The backends up with the fewest requests in flight first: a policy that leaves out those
/// marked down rather than offering them.
#[derive(Clone, Copy)]
struct UpOnly;

impl Placement for UpOnly {
    fn place(
        &self,
        fleet: &tower_affinity::placement::FleetView<'_>,
        _: &tower_affinity::placement::PlacementRequest<'_>,
        c: &mut tower_affinity::placement::Candidates<'_>,
    ) {
        let mut up: Vec<_> = fleet.backends().filter(|b| !c.is_down(*b)).collect();
        up.sort_by_key(|b| b.in_flight());
        for b in up {
            if c.offer(b).is_break() {
                return;
            }
        }
    }
}

/// A policy that offers nothing while every backend is down has no backend for the request:
/// it fails at once with `NoBackends`, as when the policy offers the backends down, rather
/// than waiting out its `max_wait` for a slot and being told `Saturated`.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_policy_offering_nothing_while_every_backend_is_down_has_no_backends() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .placement(UpOnly)
        .overflow(Overflow::wait(Duration::from_secs(60), 8))
        .layer(fleet(&[("a1", "a", 1), ("b1", "b", 1)], &streams));
    svc.ready().await.unwrap();
    assert!(svc.mark_down("a1", None) && svc.mark_down("b1", None));
    let started = tokio::time::Instant::now();
    let err = send(&mut svc, Some("s"), None).await.unwrap_err();
    assert!(matches!(err, Error::NoBackends { .. }), "{err}");
    assert_eq!(started.elapsed(), Duration::ZERO);
    let stats = svc.stats();
    assert_eq!((stats.no_backends, stats.rejected), (1, 0));
    // Rejecting at once, as much: no backend, not a full fleet.
    let mut svc = SessionAffinityLayer::new()
        .placement(UpOnly)
        .overflow(Overflow::Reject)
        .layer(fleet(&[("a1", "a", 1)], &streams));
    svc.ready().await.unwrap();
    assert!(svc.mark_down("a1", None));
    let err = send(&mut svc, None, None).await.unwrap_err();
    assert!(matches!(err, Error::NoBackends { .. }), "{err}");
    // One back up, and full: that one is waited for, as before.
    assert!(svc.mark_up("a1"));
    let held = send(&mut svc, Some("t"), Some("stream")).await.unwrap();
    let err = send(&mut svc, Some("u"), None).await.unwrap_err();
    assert!(matches!(err, Error::Saturated { .. }), "{err}");
    drop(held);
}

/// A policy that offers nothing, having passed over no backend as too small for the prompt,
/// is asked once a request: the look again as if no backend had a limit is for a request
/// whose policy passed over those too small. A policy that keeps state between looks (a
/// rotation, a count) would see two looks for one request.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_policy_that_offers_nothing_is_asked_once_a_request() {
    let streams = Streams::default();
    let looks = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut svc = SessionAffinityLayer::new()
        .placement(CountsLooks(looks.clone(), UpOnly))
        .layer(fleet(&[("a1", "a", 1), ("b1", "b", 1)], &streams));
    svc.ready().await.unwrap();
    assert!(svc.mark_down("a1", None) && svc.mark_down("b1", None));
    let err = send(&mut svc, Some("s"), None).await.unwrap_err();
    assert!(matches!(err, Error::NoBackends { .. }), "{err}");
    assert_eq!(looks.load(std::sync::atomic::Ordering::Relaxed), 1);
}

/// Offers only the backends the request names (`Avoid` read as the names to offer), in that
/// order, and passes over none: the others are left out, not refused.
#[derive(Clone, Copy)]
struct OnlyNamed;

impl Placement for OnlyNamed {
    fn place(
        &self,
        fleet: &tower_affinity::placement::FleetView<'_>,
        req: &tower_affinity::placement::PlacementRequest<'_>,
        c: &mut tower_affinity::placement::Candidates<'_>,
    ) {
        let Some(Avoid(names)) = req.extensions.get::<Avoid>() else {
            return;
        };
        for name in names.iter() {
            if let Some(b) = fleet.backends().find(|b| b.id().as_str() == *name) {
                if c.offer(b).is_break() {
                    return;
                }
            }
        }
    }
}

/// A policy that offers only backends that are down, while others are up that it neither
/// offered nor passed over, has not refused the request: it finds no free slot, and waits
/// for the backend it was offered to come back, rather than failing at once with
/// `NoBackends` (whose message would say the policy passed over every backend up). Without
/// a wait, it is refused as any request finding no free slot is.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_policy_offering_only_backends_down_while_others_are_up_waits_for_them() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .placement(OnlyNamed)
        .overflow(Overflow::wait(Duration::from_secs(60), 8))
        .layer(fleet(&[("a1", "a", 1), ("b1", "b", 1)], &streams));
    svc.ready().await.unwrap();
    svc.mark_down("a1", Some(Duration::from_secs(5)));
    let mut waiting =
        tokio_test::task::spawn(svc.call(avoiding(request(Some("s"), None), &["a1"])));
    assert_pending!(waiting.poll());
    tokio::time::advance(Duration::from_secs(5)).await;
    assert!(waiting.is_woken());
    let res = assert_ready!(waiting.poll()).unwrap();
    let d = decision(&res);
    assert_eq!(d.backend.as_str(), "a1");
    assert_eq!(d.waited, Some(Duration::from_secs(5)));
    assert_eq!(svc.stats().no_backends, 0);
    drop(res);
    // Rejecting at once: refused as finding no free slot, not for want of a backend.
    let mut svc = SessionAffinityLayer::new()
        .placement(OnlyNamed)
        .overflow(Overflow::Reject)
        .layer(fleet(&[("a1", "a", 1), ("b1", "b", 1)], &streams));
    svc.ready().await.unwrap();
    assert!(svc.mark_down("a1", None));
    let err = send_req(&mut svc, avoiding(request(Some("s"), None), &["a1"]))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Saturated { .. }), "{err}");
    let stats = svc.stats();
    assert_eq!((stats.no_backends, stats.rejected), (0, 1));
}

/// Which tenant a backend serves, or a request comes from.
#[derive(Clone, Debug, PartialEq)]
struct Tenant(&'static str);

/// `NodeThenBackend` over the request's tenant's backends only.
#[derive(Clone, Copy)]
struct OwnTenant;

impl Placement for OwnTenant {
    fn place(
        &self,
        fleet: &tower_affinity::placement::FleetView<'_>,
        req: &tower_affinity::placement::PlacementRequest<'_>,
        c: &mut tower_affinity::placement::Candidates<'_>,
    ) {
        let tenant = req.extensions.get::<Tenant>();
        for b in fleet
            .backends()
            .filter(|b| b.extensions().get::<Tenant>() != tenant)
        {
            c.pass_over(b);
        }
        tower_affinity::placement::NodeThenBackend::new().place(fleet, req, c)
    }
}

/// What discovery attaches to a backend reaches the policy, and an update replaces it.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_policy_places_by_what_discovery_attached_to_each_backend() {
    let streams = Streams::default();
    let (handle, stream) = discover::channel::<MockService>();
    let tenant_backend = |id: &str, tenant| {
        Backend::new("n", backend(id, &streams))
            .slots(nz(4))
            .extension(Tenant(tenant))
    };
    handle.insert("a1", tenant_backend("a1", "acme"));
    handle.insert("g1", tenant_backend("g1", "globex"));
    let mut svc = SessionAffinityLayer::new()
        .placement(OwnTenant)
        .overflow(Overflow::Reject)
        .layer(stream);
    let of = |tenant, session: &str| {
        let mut req = request(Some(session), None);
        req.extensions_mut().insert(Tenant(tenant));
        req
    };
    for i in 0..8 {
        for (tenant, own) in [("acme", "a1"), ("globex", "g1")] {
            let res = send_req(&mut svc, of(tenant, &format!("{tenant}-{i}")))
                .await
                .unwrap();
            assert_eq!(decision(&res).backend.as_str(), own);
        }
    }
    // g1 serves acme from now on: globex has no backend left.
    handle.insert("g1", tenant_backend("g1", "acme"));
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..16 {
        let res = send_req(&mut svc, of("acme", &format!("new-{i}")))
            .await
            .unwrap();
        seen.insert(decision(&res).backend.as_str().to_owned());
    }
    assert_eq!(seen.into_iter().collect::<Vec<_>>(), ["a1", "g1"]);
    let err = send_req(&mut svc, of("globex", "g")).await.unwrap_err();
    assert!(matches!(err, Error::NoBackends { .. }), "{err}");
}

/// A token count is placed apart from its session, but by the same policy, which sees what
/// the request carries: a tenant's count goes to one of its own backends, as its turns do.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_token_count_is_placed_by_what_its_request_carries() {
    let streams = Streams::default();
    let (handle, stream) = discover::channel::<MockService>();
    for (id, tenant) in [("a1", "acme"), ("g1", "globex")] {
        let b = Backend::new("n", backend(id, &streams))
            .slots(nz(4))
            .extension(Tenant(tenant));
        handle.insert(id, b);
    }
    let mut svc = SessionAffinityLayer::new()
        .placement(OwnTenant)
        .overflow(Overflow::Reject)
        .layer(stream);
    for (tenant, own) in [("acme", "a1"), ("globex", "g1")] {
        for path in ["/v1/messages/count_tokens", "/tokenize"] {
            let mut req = http::Request::post(path)
                .header("x-session-id", tenant)
                .body(String::new())
                .unwrap();
            req.extensions_mut().insert(Tenant(tenant));
            let res = send_req(&mut svc, req).await.expect(path);
            let d = decision(&res);
            assert_eq!((d.backend.as_str(), d.outcome), (own, Outcome::Keyless));
        }
    }
}

/// A compaction that no backend holds a prefix of waits for its home as any turn of its
/// session does: a slot freed there goes to it before an older request waiting only for that
/// node.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_compaction_waits_for_its_home_before_requests_waiting_for_its_node() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .overflow(Overflow::wait(Duration::from_secs(60), 8))
        .layer(fleet(TWO_BY_TWO, &streams));
    let home = decision(
        &send_req(&mut svc, chained("s", None, &[(1, 2_000)], None))
            .await
            .unwrap(),
    )
    .backend;
    let mate = match home.as_str() {
        "a1" => "a2",
        "a2" => "a1",
        "b1" => "b2",
        _ => "b1",
    };
    // A session homed on the home's node mate.
    let u = (0..100)
        .map(|i| format!("u{i}"))
        .find(|u| {
            let fleet = tower_affinity::placement::Snapshot::new()
                .backend("a1", "node-a", 1)
                .backend("a2", "node-a", 1)
                .backend("b1", "node-b", 1)
                .backend("b2", "node-b", 1)
                .in_flight(home.as_str(), 1);
            let key = tower_affinity::key::SessionKey::from_bytes(u.as_bytes());
            fleet.choose(
                &tower_affinity::placement::NodeThenBackend::new(),
                Some(key),
                None,
            ) == Some(mate.into())
        })
        .unwrap();
    // Every slot taken: the session's own stream at home, u's beside it, two more elsewhere.
    let s_stream = send_req(
        &mut svc,
        chained("s", Some("stream"), &[(1, 2_000), (2, 100)], None),
    )
    .await
    .unwrap();
    assert_eq!(decision(&s_stream).backend, home);
    let u_stream = send(&mut svc, Some(&u), Some("stream")).await.unwrap();
    assert_eq!(decision(&u_stream).backend.as_str(), mate);
    let _others = [
        send(&mut svc, Some("x"), Some("stream")).await.unwrap(),
        send(&mut svc, Some("y"), Some("stream")).await.unwrap(),
    ];
    // u's next turn waits first; then the compaction.
    svc.ready().await.unwrap();
    let mut older = tokio_test::task::spawn(svc.call(request(Some(&u), None)));
    assert_pending!(older.poll());
    svc.ready().await.unwrap();
    let mut compaction = tokio_test::task::spawn(svc.call(chained("s", None, &[(9, 500)], None)));
    assert_pending!(compaction.poll());
    // The home frees.
    let (_, tx) = streams.take().unwrap();
    drop(tx);
    s_stream.into_body().collect().await.unwrap();
    assert!(compaction.is_woken(), "its home's slot goes to it");
    assert!(!older.is_woken());
    let res = assert_ready!(compaction.poll()).unwrap();
    assert_eq!(decision(&res).backend, home);
    assert_eq!(decision(&res).outcome, Outcome::Compaction);
    drop(u_stream);
}

/// An answer whose body fails after it began (the backend cut its stream) frees its slot and
/// marks nothing down, as the client has part of it; the backend's status counts it.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn an_answer_cut_midway_is_counted_on_its_backend_and_marks_nothing() {
    type Chunks = Vec<Result<http_body::Frame<Bytes>, std::io::Error>>;
    let cuts = tower::service_fn(|req: Req| async move {
        let mut chunks: Chunks = vec![Ok(http_body::Frame::data(Bytes::from_static(
            b"data: 1\n\n",
        )))];
        if req.headers().contains_key("x-cut") {
            chunks.push(Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof)));
        }
        let body = http_body_util::StreamBody::new(tokio_stream::iter(chunks));
        Ok::<_, Infallible>(http::Response::new(body))
    });
    let svc = SessionAffinityLayer::new().layer(StaticFleet::new([(
        "c1",
        Backend::new("c", cuts).slots(nz(1)),
    )]));
    let mut req = request(Some("s"), None);
    req.headers_mut()
        .insert("x-cut", http::HeaderValue::from_static("1"));
    let res = svc.clone().oneshot(req).await.unwrap();
    assert!(res.into_body().collect().await.is_err());
    let whole = svc.clone().oneshot(request(Some("s"), None)).await.unwrap();
    let outcome = whole.extensions().get::<Decision>().unwrap().outcome;
    assert_eq!(outcome, Outcome::HomeHit);
    whole.into_body().collect().await.unwrap();
    let status = svc.backends().into_iter().next().unwrap();
    assert_eq!(
        (
            status.cut_answers,
            status.failures,
            status.healthy,
            status.in_flight
        ),
        (1, 0, true, 0)
    );
}

/// An answer its backend service marks [`SentAgain`] (its request was sent a second time) is
/// counted for that backend, and only such answers are.
#[tokio::test]
async fn an_answer_marked_sent_again_is_counted_on_its_backend() {
    let marks = tower::service_fn(|req: Req| async move {
        let mut res = http::Response::new(http_body_util::Full::new(Bytes::from_static(b"ok")));
        if req.headers().contains_key("x-again") {
            res.extensions_mut().insert(tower_affinity::SentAgain);
        }
        Ok::<_, Infallible>(res)
    });
    let svc = SessionAffinityLayer::new().layer(StaticFleet::new([(
        "a1",
        Backend::new("a", marks).slots(nz(1)),
    )]));
    for again in [true, false, true] {
        let mut req = request(Some("s"), None);
        if again {
            req.headers_mut()
                .insert("x-again", http::HeaderValue::from_static("1"));
        }
        let res = svc.clone().oneshot(req).await.unwrap();
        assert_eq!(
            res.extensions()
                .get::<tower_affinity::SentAgain>()
                .is_some(),
            again
        );
        res.into_body().collect().await.unwrap();
    }
    let status = svc.backends().into_iter().next().unwrap();
    assert_eq!((status.sent_again, status.failures), (2, 0));
}

// === a context its running requests share ===

/// A fleet of one-node backends `(id, slots, context)`, with a context limit where given.
fn fleet_with_context(
    spec: &[(&str, u32, Option<u64>)],
    streams: &Streams,
) -> StaticFleet<MockService> {
    StaticFleet::new(spec.iter().map(|&(id, slots, context)| {
        let b = Backend::new(id, backend(id, streams)).slots(nz(slots));
        let b = match context {
            Some(c) => b.context_tokens(std::num::NonZeroU64::new(c).unwrap()),
            None => b,
        };
        (id, b)
    }))
}

/// A streamed request of `session` whose prompt is `tokens` of one block `block`. The mock
/// backends report no usage, so a backend with a context counts each of these tokens as two
/// (until answers teach it otherwise, a token of the estimate is counted as two bytes).
fn prompt(session: &str, block: u64, tokens: u32) -> Req {
    let mut req = request(Some(session), Some("stream"));
    let chain = PromptChain::from_blocks([(block, tokens)]);
    req.extensions_mut().insert(PromptFacts::from_chain(chain));
    req
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_prompt_that_does_not_fit_the_context_left_waits_though_a_slot_is_free() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .overflow(Overflow::wait(Duration::from_secs(60), 8))
        .layer(fleet_with_context(&[("a1", 4, Some(6_000))], &streams));
    let first = send_req(&mut svc, prompt("s1", 1, 2_000)).await.unwrap();
    let (_, first_tx) = streams.take().unwrap();
    let a1 = status(&svc, "a1");
    assert_eq!(
        (a1.context_limit, a1.context_in_flight),
        (Some(6_000), 4_000)
    );
    // 4,000 more would pass 6,000: it waits, with three slots free.
    svc.ready().await.unwrap();
    let mut second = tokio_test::task::spawn(svc.call(prompt("s2", 2, 2_000)));
    assert_pending!(second.poll());
    assert_eq!(svc.stats().waiting, 1);
    // 1,800 fit beside the first.
    let small = send_req(&mut svc, prompt("s3", 3, 900)).await.unwrap();
    let (_, small_tx) = streams.take().unwrap();
    assert_eq!(status(&svc, "a1").context_in_flight, 5_800);
    tokio::time::advance(Duration::from_secs(5)).await;
    assert_pending!(second.poll());
    // The first ends: the second fits beside the small one.
    drop(first_tx);
    first.into_body().collect().await.unwrap();
    assert!(second.is_woken());
    let res = assert_ready!(second.poll()).unwrap();
    assert_eq!(decision(&res).waited, Some(Duration::from_secs(5)));
    assert_eq!(status(&svc, "a1").context_in_flight, 5_800);
    drop((small_tx, small, res));
    let a1 = status(&svc, "a1");
    assert_eq!((a1.in_flight, a1.context_in_flight), (0, 0));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_prompt_that_does_not_fit_the_context_left_goes_where_it_fits() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new().layer(fleet_with_context(
        &[("a1", 4, Some(6_000)), ("b1", 4, Some(6_000))],
        &streams,
    ));
    let first = send_req(&mut svc, prompt("s1", 1, 2_000)).await.unwrap();
    let home = decision(&first).backend;
    let second = send_req(&mut svc, prompt("s2", 2, 2_000)).await.unwrap();
    assert_ne!(decision(&second).backend, home);
    for b in ["a1", "b1"] {
        assert_eq!(status(&svc, b).context_in_flight, 4_000);
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_prompt_longer_than_the_whole_context_goes_when_nothing_runs_there() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .overflow(Overflow::wait(Duration::from_secs(60), 8))
        .layer(fleet_with_context(&[("a1", 2, Some(1_000))], &streams));
    // Alone, a prompt longer than the context goes: the backend is the one to refuse it.
    let long = send_req(&mut svc, prompt("s1", 1, 5_000)).await.unwrap();
    let (_, long_tx) = streams.take().unwrap();
    // Anything else waits for it.
    svc.ready().await.unwrap();
    let mut small = tokio_test::task::spawn(svc.call(prompt("s2", 2, 10)));
    assert_pending!(small.poll());
    drop(long_tx);
    long.into_body().collect().await.unwrap();
    assert_ready!(small.poll()).unwrap();
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn without_a_context_limit_only_the_slots_count() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .overflow(Overflow::Reject)
        .layer(fleet_with_context(&[("a1", 2, None)], &streams));
    let first = send_req(&mut svc, prompt("s1", 1, 100_000)).await.unwrap();
    let second = send_req(&mut svc, prompt("s2", 2, 100_000)).await.unwrap();
    assert_eq!(decision(&second).backend.as_str(), "a1");
    let a1 = status(&svc, "a1");
    assert_eq!((a1.context_limit, a1.context_in_flight), (None, 0));
    drop((first, second));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn an_overcommitted_request_takes_its_context_too_and_gives_it_back() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .overflow(Overflow::Overcommit)
        .layer(fleet_with_context(&[("a1", 4, Some(6_000))], &streams));
    let first = send_req(&mut svc, prompt("s1", 1, 2_000)).await.unwrap();
    let second = send_req(&mut svc, prompt("s2", 2, 2_000)).await.unwrap();
    assert_eq!(decision(&second).backend.as_str(), "a1");
    assert_eq!(status(&svc, "a1").context_in_flight, 8_000);
    drop((first, second));
    assert_eq!(status(&svc, "a1").context_in_flight, 0);
}

/// One request's end can free the context for several waiters: each that takes a slot wakes
/// the next, rather than leaving it asleep with room for it until its deadline.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn one_end_that_frees_room_for_two_waiters_wakes_both() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .overflow(Overflow::wait(Duration::from_secs(60), 8))
        .layer(fleet_with_context(&[("a1", 4, Some(2_000))], &streams));
    let big = send_req(&mut svc, prompt("s0", 1, 900)).await.unwrap();
    let (_, big_tx) = streams.take().unwrap();
    svc.ready().await.unwrap();
    let mut w1 = tokio_test::task::spawn(svc.call(prompt("s1", 2, 400)));
    assert_pending!(w1.poll());
    svc.ready().await.unwrap();
    let mut w2 = tokio_test::task::spawn(svc.call(prompt("s2", 3, 400)));
    assert_pending!(w2.poll());
    assert_eq!(svc.stats().waiting, 2);
    tokio::time::advance(Duration::from_secs(1)).await;
    // The 900 (1,800 counted) end: 2,000 free, three slots free; both 400s (800 each) fit.
    drop(big_tx);
    big.into_body().collect().await.unwrap();
    let r1 = assert_ready!(w1.poll()).unwrap();
    assert_eq!(status(&svc, "a1").context_in_flight, 800);
    // w2 fits beside w1 (1,600 of 2,000, two slots of four): it should run now.
    tokio::time::advance(Duration::from_millis(10)).await;
    let woken = w2.is_woken();
    let polled = w2.poll();
    let waited = match &polled {
        std::task::Poll::Ready(Ok(res)) => decision(res).waited,
        _ => None,
    };
    assert!(
        woken && polled.is_ready(),
        "w2 left asleep with room for it (woken: {woken}, ready: {})",
        polled.is_ready()
    );
    assert_eq!(waited, Some(Duration::from_millis(1_010)));
    drop(r1);
}

/// A prompt that does not fit takes no slot, not even for a moment in which the backend would
/// look full to a request that needs no context: under `Overflow::Reject` that one would be
/// refused with a slot free, and under `Overflow::Wait` it could sleep with nobody to wake it
/// for that slot. Two threads, 100,000 requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_that_does_not_fit_never_makes_a_free_slot_look_taken() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .overflow(Overflow::Reject)
        .layer(fleet_with_context(&[("a1", 2, Some(2_000))], &streams));
    // 1,800 of 2,000 held, one slot of two taken, for the whole test.
    let held = send_req(&mut svc, prompt("s0", 1, 900)).await.unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (mut a, s) = (svc.clone(), stop.clone());
    // Prompts of 500 (1,000 counted) that never fit: before, each took the free slot for a
    // moment.
    let noise = tokio::spawn(async move {
        let mut i = 0u64;
        while !s.load(std::sync::atomic::Ordering::Relaxed) {
            i += 1;
            let r: Result<Res, Error> = match a.ready().await {
                Ok(a) => a.call(prompt(&format!("n{i}"), 2 + i, 500)).await,
                Err(e) => Err(e),
            };
            assert!(r.is_err());
        }
    });
    // Requests without a prompt: the second slot is free for each of them.
    let mut refused = 0;
    for _ in 0..100_000 {
        let r = send(&mut svc, None, None).await;
        match r {
            Ok(res) => drop(res),
            Err(_) => refused += 1,
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    noise.await.unwrap();
    drop(held);
    assert_eq!(refused, 0, "requests refused with a slot free");
}

// === a request context: the most one request can take ===

/// A fleet of one-node backends `(id, slots, request context)`.
fn fleet_with_request_context(
    spec: &[(&str, u32, u64)],
    streams: &Streams,
) -> StaticFleet<MockService> {
    StaticFleet::new(spec.iter().map(|&(id, slots, tokens)| {
        let tokens = std::num::NonZeroU64::new(tokens).unwrap();
        let b = Backend::new(id, backend(id, streams))
            .slots(nz(slots))
            .request_context_tokens(tokens);
        (id, b)
    }))
}

/// A request of `session` whose prompt is the blocks `(digest, tokens)`, answered at once,
/// or streamed until its sender is dropped with `stream`.
fn turn_of(session: &str, blocks: &[(u64, u32)], stream: bool) -> Req {
    let mut req = request(Some(session), stream.then_some("stream"));
    let chain = PromptChain::from_blocks(blocks.iter().copied());
    req.extensions_mut().insert(PromptFacts::from_chain(chain));
    req
}

/// A session whose first turn, `first`, went to `backend`: sessions `s0`, `s1`... are tried
/// in turn.
async fn session_homed_on<S>(svc: &mut S, backend: &str, first: &[(u64, u32)]) -> String
where
    S: Service<Req, Response = Res, Error = Error>,
{
    for i in 0..64 {
        let session = format!("s{i}");
        let res = send_req(svc, turn_of(&session, first, false))
            .await
            .unwrap();
        let home = decision(&res).backend;
        res.into_body().collect().await.unwrap();
        if home.as_str() == backend {
            return session;
        }
    }
    panic!("no session homed on {backend}");
}

/// A streamed request holding a slot on `backend` until the returned sender is dropped:
/// requests of sessions `h0`, `h1`... are sent until one goes there (the others end at once).
async fn hold_on<S>(svc: &mut S, streams: &Streams, backend: &str) -> (Res, mock::OpenStream)
where
    S: Service<Req, Response = Res, Error = Error>,
{
    for i in 0..16 {
        let req = turn_of(&format!("h{i}"), &[(100 + i, 10)], true);
        let res = send_req(svc, req).await.unwrap();
        let open = streams.take().unwrap();
        if decision(&res).backend.as_str() == backend {
            return (res, open);
        }
        drop(open);
        res.into_body().collect().await.unwrap();
    }
    panic!("no request went to {backend}");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_prompt_too_long_for_its_homes_slots_goes_to_a_backend_whose_slots_take_it() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new().layer(fleet_with_request_context(
        &[("small", 2, 1_000), ("large", 2, 8_000)],
        &streams,
    ));
    let s = session_homed_on(&mut svc, "small", &[(1, 500)]).await;
    // The conversation outgrows its home's 1,000 tokens a request.
    let res = send_req(&mut svc, turn_of(&s, &[(1, 500), (2, 1_500)], false))
        .await
        .unwrap();
    let d = decision(&res);
    assert_eq!(
        (d.backend.as_str(), d.outcome),
        ("large", Outcome::CrossNodeSpill)
    );
    res.into_body().collect().await.unwrap();
    // Its new home takes it from then on.
    let res = send_req(
        &mut svc,
        turn_of(&s, &[(1, 500), (2, 1_500), (3, 100)], false),
    )
    .await
    .unwrap();
    let d = decision(&res);
    assert_eq!((d.backend.as_str(), d.outcome), ("large", Outcome::HomeHit));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_prompt_too_long_for_every_backend_goes_where_placement_sends_it() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new().layer(fleet_with_request_context(
        &[("a", 2, 1_000), ("b", 2, 1_000)],
        &streams,
    ));
    let s = session_homed_on(&mut svc, "a", &[(1, 500)]).await;
    // Too long for both: the limits are no reason to move it, and its home answers.
    let res = send_req(&mut svc, turn_of(&s, &[(1, 500), (2, 5_000)], false))
        .await
        .unwrap();
    let d = decision(&res);
    assert_eq!((d.backend.as_str(), d.outcome), ("a", Outcome::HomeHit));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn with_every_backend_that_takes_it_down_a_prompt_goes_where_placement_sends_it() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new().layer(fleet_with_request_context(
        &[("small", 2, 1_000), ("large", 2, 8_000)],
        &streams,
    ));
    let s = session_homed_on(&mut svc, "small", &[(1, 500)]).await;
    svc.mark_down("large", Some(Duration::from_secs(60)));
    let res = send_req(&mut svc, turn_of(&s, &[(1, 500), (2, 1_500)], false))
        .await
        .unwrap();
    let d = decision(&res);
    assert_eq!((d.backend.as_str(), d.outcome), ("small", Outcome::HomeHit));
}

#[test]
fn a_request_too_long_for_a_backend_waits_for_one_that_takes_it_rather_than_take_its_slot() {
    // Bounded: a slot that circles between the waiters never lets a poll return.
    hang::within_a_minute("a request waiting for a slot", || {
        hang::paused_runtime().block_on(async {
            let streams = Streams::default();
            let mut svc = SessionAffinityLayer::new()
                .overflow(Overflow::wait(Duration::from_secs(60), 8))
                .layer(fleet_with_request_context(
                    &[("small", 1, 1_000), ("large", 1, 8_000)],
                    &streams,
                ));
            let s = session_homed_on(&mut svc, "small", &[(1, 500)]).await;
            // Both busy.
            let (on_small, small_tx) = hold_on(&mut svc, &streams, "small").await;
            let (on_large, large_tx) = hold_on(&mut svc, &streams, "large").await;
            svc.ready().await.unwrap();
            let mut long =
                tokio_test::task::spawn(svc.call(turn_of(&s, &[(1, 500), (2, 1_500)], false)));
            assert_pending!(long.poll());
            // Its home frees: too small for it, so it waits on.
            drop(small_tx);
            on_small.into_body().collect().await.unwrap();
            tokio::time::advance(Duration::from_secs(1)).await;
            assert_pending!(long.poll());
            assert_eq!(in_flight(&svc, "small"), 0);
            // The backend that takes it frees.
            drop(large_tx);
            on_large.into_body().collect().await.unwrap();
            tokio::time::advance(Duration::from_secs(1)).await;
            let res = assert_ready!(long.poll()).unwrap();
            let d = decision(&res);
            assert_eq!(
                (d.backend.as_str(), d.waited),
                ("large", Some(Duration::from_secs(2)))
            );
        })
    });
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_backend_given_only_a_shared_context_takes_a_request_of_up_to_all_of_it() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new().layer(fleet_with_context(
        &[("a1", 2, Some(1_000)), ("b1", 2, Some(8_000))],
        &streams,
    ));
    // 3,000 tokens (6,000 counted before answers teach otherwise) of a 1,000-token context:
    // the backend whose context takes them all.
    for i in 0..4 {
        let res = send_req(&mut svc, prompt(&format!("s{i}"), i, 3_000))
            .await
            .unwrap();
        assert_eq!(decision(&res).backend.as_str(), "b1");
    }
    assert_eq!(status(&svc, "a1").request_context_limit, Some(1_000));
}

/// A request continuing a response that a backend stores goes to that backend or nowhere
/// ("the service has the last word"): no other backend can answer it, whatever its request
/// context. A prompt too long for the storing backend's slots must not be sent to another
/// backend, which does not store the response.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_request_continuing_a_stored_response_goes_to_the_backend_storing_it_even_if_too_small_for_it(
) {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new().layer(fleet_with_request_context(
        &[("small", 2, 1_000), ("large", 2, 8_000)],
        &streams,
    ));
    // Keyless and keyed alike.
    for session in [None, Some("s")] {
        let mut req = chained("x", None, &[(1, 500), (2, 1_500)], Some("small"));
        if session.is_none() {
            req.headers_mut().remove("x-session-id");
        }
        let res = send_req(&mut svc, req).await.unwrap();
        assert_eq!(
            decision(&res).backend.as_str(),
            "small",
            "a request continuing a response stored on `small` was sent to a backend that does \
             not store it ({session:?})"
        );
        res.into_body().collect().await.unwrap();
    }
}

/// Offers every backend but `large` in the fleet's order, then passes `large` over: a
/// policy that applies its rule (a tenant's, say) after the wrapped one has offered.
#[derive(Clone, Copy)]
struct PassesOverLargeLast;

impl Placement for PassesOverLargeLast {
    fn place(
        &self,
        fleet: &tower_affinity::placement::FleetView<'_>,
        _: &tower_affinity::placement::PlacementRequest<'_>,
        c: &mut tower_affinity::placement::Candidates<'_>,
    ) {
        for b in fleet.backends().filter(|b| b.id().as_str() != "large") {
            if c.offer(b).is_break() {
                return;
            }
        }
        for b in fleet.backends().filter(|b| b.id().as_str() == "large") {
            c.pass_over(b);
        }
    }
}

/// The only backend that takes the prompt is passed over by the policy: no backend up and
/// not passed over takes it, so placement is as without limits, whatever the order of the
/// policy's offers and pass-overs. It must not be refused as if the fleet had no backend.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn with_the_only_backend_that_takes_it_passed_over_after_an_offer_a_prompt_goes_where_placement_sends_it(
) {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .placement(PassesOverLargeLast)
        .layer(fleet_with_request_context(
            &[("small", 2, 1_000), ("large", 2, 8_000)],
            &streams,
        ));
    // Fits small: served there.
    let res = send_req(&mut svc, turn_of("s", &[(1, 500)], false))
        .await
        .unwrap();
    assert_eq!(decision(&res).backend.as_str(), "small");
    res.into_body().collect().await.unwrap();
    // Too long for small; large, which takes it, is passed over by the policy.
    let res = send_req(&mut svc, turn_of("s", &[(1, 500), (2, 1_500)], false)).await;
    match res {
        Ok(res) => assert_eq!(decision(&res).backend.as_str(), "small"),
        Err(e) => panic!("refused ({e:?}) though `small` is up, free and offered"),
    }
}

/// A policy of a user's own that serves some requests from `a1` only (a model only `a1`
/// runs, as `SomeOnlyOnA1`): another backend's request context, which the policy would never
/// offer, is no reason to keep a request off `a1`, free.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_backend_the_policy_never_offers_does_not_keep_a_long_prompt_off_the_one_it_offers() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .placement(SomeOnlyOnA1)
        .overflow(Overflow::wait(Duration::from_secs(30), 8))
        .layer(fleet_with_request_context(
            &[("a1", 2, 1_000), ("b1", 2, 8_000)],
            &streams,
        ));
    let mut req = turn_of("s", &[(1, 500), (2, 1_500)], false);
    req.extensions_mut().insert(OnlyA1);
    let started = tokio::time::Instant::now();
    match send_req(&mut svc, req).await {
        Ok(res) => assert_eq!(decision(&res).backend.as_str(), "a1"),
        Err(e) => panic!(
            "refused ({e:?}) after waiting {:?}, with `a1` free all along",
            started.elapsed()
        ),
    }
}

/// A slot freed on a backend too small for the oldest waiter, whose home it is, goes on to a
/// later waiter that it takes.
#[test]
fn a_slot_too_small_for_its_first_waiter_goes_on_to_one_it_takes() {
    // Bounded: a slot that circles between the waiters never lets a poll return.
    hang::within_a_minute("a request waiting for a slot", || {
        hang::paused_runtime().block_on(async {
            let streams = Streams::default();
            let mut svc = SessionAffinityLayer::new()
                .overflow(Overflow::wait(Duration::from_secs(60), 8))
                .layer(fleet_with_request_context(
                    &[("small", 1, 1_000), ("large", 1, 8_000)],
                    &streams,
                ));
            let s = session_homed_on(&mut svc, "small", &[(1, 500)]).await;
            let (on_small, small_tx) = hold_on(&mut svc, &streams, "small").await;
            let (y, _y_tx) = hold_on(&mut svc, &streams, "large").await;
            svc.ready().await.unwrap();
            let mut long =
                tokio_test::task::spawn(svc.call(turn_of(&s, &[(1, 500), (2, 1_500)], false)));
            assert_pending!(long.poll());
            svc.ready().await.unwrap();
            let mut short = tokio_test::task::spawn(svc.call(turn_of("z", &[(7, 10)], false)));
            assert_pending!(short.poll());
            drop(small_tx);
            on_small.into_body().collect().await.unwrap();
            // Whoever is woken first, the short one ends on small at once.
            for _ in 0..4 {
                if long.is_woken() {
                    assert_pending!(long.poll());
                }
                if short.is_woken() {
                    break;
                }
            }
            assert!(
                short.is_woken(),
                "the short waiter sleeps beside a free slot it can take"
            );
            let d = decision(&assert_ready!(short.poll()).unwrap());
            assert_eq!(
                (d.backend.as_str(), d.waited),
                ("small", Some(Duration::ZERO))
            );
            drop(y);
        })
    });
}

/// Under node patience, a session whose home node has only backends too small for its prompt
/// does not wait for that node.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn node_patience_does_not_hold_a_prompt_for_a_home_node_too_small_for_it() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .overflow(Overflow::wait(Duration::from_secs(60), 8))
        .node_patience(Duration::from_secs(10))
        .layer(fleet_with_request_context(
            &[("small", 1, 1_000), ("large", 1, 8_000)],
            &streams,
        ));
    let s = session_homed_on(&mut svc, "small", &[(1, 500)]).await;
    // Its home busy.
    let _held = hold_on(&mut svc, &streams, "small").await;
    let started = tokio::time::Instant::now();
    let res = send_req(&mut svc, turn_of(&s, &[(1, 500), (2, 1_500)], false))
        .await
        .unwrap();
    let d = decision(&res);
    assert_eq!(
        (d.backend.as_str(), started.elapsed()),
        ("large", Duration::ZERO)
    );
}

/// A request context given, changed or taken away by discovery, in place or
/// with the backend's removal, takes effect on the next placement.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_request_context_follows_discovery_updates_and_removals() {
    let streams = Streams::default();
    let (handle, stream) = discover::channel();
    let tokens = |n| std::num::NonZeroU64::new(n).unwrap();
    let add = |id: &str, limit: Option<u64>| {
        let mut b = Backend::new(id, backend(id, &streams)).slots(nz(4));
        if let Some(n) = limit {
            b = b.request_context_tokens(tokens(n));
        }
        handle.insert(id.to_string(), b);
    };
    add("small", None);
    add("large", None);
    let mut svc = SessionAffinityLayer::new().layer(stream);
    let s = session_homed_on(&mut svc, "small", &[(1, 500)]).await;
    let long = || turn_of(&s, &[(1, 500), (2, 1_500)], false);
    let on = |res: &Res| decision(res).backend.as_str().to_string();
    // No limit anywhere: home.
    let res = send_req(&mut svc, long()).await.unwrap();
    assert_eq!(on(&res), "small");
    res.into_body().collect().await.unwrap();
    // Small given a limit in place: the turn goes to large.
    add("small", Some(1_000));
    let res = send_req(&mut svc, long()).await.unwrap();
    assert_eq!(on(&res), "large");
    res.into_body().collect().await.unwrap();
    // Large removed: nothing up takes it, and it goes to the one backend left.
    handle.remove("large".to_string());
    let res = send_req(&mut svc, long()).await.unwrap();
    assert_eq!(on(&res), "small");
    res.into_body().collect().await.unwrap();
    assert_eq!(status(&svc, "small").request_context_limit, Some(1_000));
    // Its limit raised in place: no longer too small, and the status says so.
    add("small", Some(4_000));
    let res = send_req(&mut svc, long()).await.unwrap();
    assert_eq!(on(&res), "small");
    assert_eq!(status(&svc, "small").request_context_limit, Some(4_000));
}

/// A keyless prompt whose own prefix is on a backend too small for it goes to
/// one that takes it; its outcome says keyless, not a hit on a prefix it did not use.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_keyless_prompt_whose_prefix_is_on_a_backend_too_small_for_it_goes_elsewhere() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new().layer(fleet_with_request_context(
        &[("small", 2, 1_000), ("large", 2, 8_000)],
        &streams,
    ));
    let keyless = |blocks: &[(u64, u32)]| {
        let mut req = request(None, None);
        let chain = PromptChain::from_blocks(blocks.iter().copied());
        req.extensions_mut().insert(PromptFacts::from_chain(chain));
        req
    };
    let mut first = None;
    for i in 0..64 {
        let res = send_req(&mut svc, keyless(&[(100 + i, 500)]))
            .await
            .unwrap();
        let on = decision(&res).backend;
        res.into_body().collect().await.unwrap();
        if on.as_str() == "small" {
            first = Some(100 + i);
            break;
        }
    }
    let d = first.expect("no keyless prompt on small");
    // Fits: back to its prefix.
    let res = send_req(&mut svc, keyless(&[(d, 500), (3, 100)]))
        .await
        .unwrap();
    assert_eq!(
        (decision(&res).backend.as_str(), decision(&res).outcome),
        ("small", Outcome::PrefixHit)
    );
    res.into_body().collect().await.unwrap();
    let res = send_req(&mut svc, keyless(&[(d, 500), (3, 100), (4, 1_500)]))
        .await
        .unwrap();
    assert_eq!(
        (decision(&res).backend.as_str(), decision(&res).outcome),
        ("large", Outcome::Keyless)
    );
}

/// Under `Overflow::Overcommit`, a prompt too long for the free backend is
/// overcommitted on the full one that takes it, not sent to the free one.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn overcommit_puts_a_long_prompt_on_the_full_backend_that_takes_it() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .overflow(Overflow::Overcommit)
        .layer(fleet_with_request_context(
            &[("small", 1, 1_000), ("large", 1, 8_000)],
            &streams,
        ));
    let _held = hold_on(&mut svc, &streams, "large").await;
    assert_eq!(in_flight(&svc, "small"), 0);
    let res = send_req(&mut svc, turn_of("z", &[(1, 500), (2, 1_500)], false))
        .await
        .unwrap();
    let d = decision(&res);
    assert_eq!((d.backend.as_str(), d.overcommitted), ("large", true));
}

/// A fleet of `a1` on node `a` and `b1` on node `b`, one slot each, announced on a channel
/// that the test can announce again on, with node patience of 10 s.
fn patient_channel(
    streams: &Streams,
) -> (
    discover::FleetHandle<MockService>,
    SessionAffinity<
        discover::FleetChannel<MockService>,
        HeaderKey,
        tower_affinity::placement::NodeThenBackend,
    >,
) {
    let (handle, stream) = discover::channel::<MockService>();
    for (id, node) in [("a1", "a"), ("b1", "b")] {
        handle.insert(id, Backend::new(node, backend(id, streams)).slots(nz(1)));
    }
    let svc = SessionAffinityLayer::new()
        .overflow(Overflow::wait(Duration::from_secs(60), 8))
        .node_patience(Duration::from_secs(10))
        .layer(stream);
    (handle, svc)
}

/// A backend announced again on another node, while a request placed before the move is in
/// flight there: a session held for its home node (the new one) is woken when that request
/// ends, as for any slot freed on its node.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_slot_taken_before_its_backend_moved_node_wakes_the_requests_held_for_the_new_node() {
    let streams = Streams::default();
    let (handle, mut svc) = patient_channel(&streams);
    let first = send(&mut svc, Some("x"), Some("stream")).await.unwrap();
    let home = decision(&first).backend;
    let (_, tx) = streams.take().unwrap();
    handle.insert(
        home.as_str(),
        Backend::new("c", backend(home.as_str(), &streams)).slots(nz(1)),
    );
    svc.ready().await.unwrap();
    let mut next = tokio_test::task::spawn(svc.call(request(Some("x"), None)));
    assert_pending!(next.poll(), "held for its home's node, now c");
    tokio::time::advance(Duration::from_secs(1)).await;
    drop(tx);
    first.into_body().collect().await.unwrap();
    assert!(next.is_woken(), "its home's slot freed");
    let res = assert_ready!(next.poll()).unwrap();
    let d = decision(&res);
    assert_eq!((d.backend, d.node.as_str()), (home, "c"));
    assert_eq!(d.waited, Some(Duration::from_secs(1)));
}

/// Requests held for their home's node when the home is announced again on another node
/// follow it there: a slot freed on the home after the move wakes them.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn requests_held_for_their_homes_node_follow_it_to_its_new_node() {
    let streams = Streams::default();
    let (handle, mut svc) = patient_channel(&streams);
    // Two sessions homed on the same backend, then a request holding it.
    let home = turn(&mut svc, "x").await.backend;
    let mut y = 0;
    while turn(&mut svc, &format!("y{y}")).await.backend != home {
        y += 1;
        assert!(y < 64, "no session of 64 homed on {home}");
    }
    let y = format!("y{y}");
    let first = send(&mut svc, Some("x"), Some("stream")).await.unwrap();
    assert_eq!(decision(&first).backend, home);
    let (_, tx) = streams.take().unwrap();
    let mut held = waiters(&mut svc, &["x", y.as_str()]).await;
    // The home moves to node c.
    handle.insert(
        home.as_str(),
        Backend::new("c", backend(home.as_str(), &streams)).slots(nz(1)),
    );
    svc.ready().await.unwrap();
    for w in &mut held {
        assert_pending!(w.poll(), "its home, on c now, is still full");
    }
    tokio::time::advance(Duration::from_secs(1)).await;
    drop(tx);
    first.into_body().collect().await.unwrap();
    // The first waiter takes the slot (and its answer ends); the second is woken for it.
    let mut second = held.pop().unwrap();
    let mut x = held.pop().unwrap();
    assert!(x.is_woken(), "its home's slot freed");
    let res = assert_ready!(x.poll()).unwrap();
    assert_eq!(decision(&res).node.as_str(), "c");
    res.into_body().collect().await.unwrap();
    assert!(second.is_woken(), "its home's slot freed again");
    let res = assert_ready!(second.poll()).unwrap();
    let d = decision(&res);
    assert_eq!((d.backend, d.node.as_str()), (home, "c"));
    assert_eq!(d.waited, Some(Duration::from_secs(1)));
}

// Waiting rules whose regressions no test above would see: each test fails on a small change
// to the rule it is named after.

/// Node patience holds a request within its `max_wait`: a patience longer than the wait ends
/// with the wait, and the request is refused when its `max_wait` is up, not its patience.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn node_patience_longer_than_max_wait_ends_with_the_wait() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .overflow(Overflow::wait(Duration::from_secs(30), 8))
        .node_patience(Duration::from_secs(60))
        .layer(fleet(&[("a1", "a", 1), ("b1", "b", 1)], &streams));
    // Both backends busy: the session's home, and the other with a new session.
    let first = send(&mut svc, Some("x"), Some("stream")).await.unwrap();
    let other = send(&mut svc, Some("y"), Some("stream")).await.unwrap();
    assert_ne!(decision(&first).backend, decision(&other).backend);
    let started = tokio::time::Instant::now();
    let err = send(&mut svc, Some("x"), None).await.unwrap_err();
    assert_eq!(started.elapsed(), Duration::from_secs(30));
    assert!(matches!(err, Error::Saturated { .. }), "{err}");
    let stats = svc.stats();
    assert_eq!((stats.waiting, stats.rejected), (0, 1));
}

// === slots the router assigns ===

/// The slots a backend's requests came with, in order (`None`: no slot assigned).
type SlotsSeen = std::sync::Arc<parking_lot::Mutex<Vec<Option<u32>>>>;

/// A backend of `slots` slots, assigned by the router if `assigned`, that answers each request
/// with the body `answer` makes and notes the slot it came with.
fn slot_backend<B, F>(
    slots: u32,
    assigned: bool,
    answer: F,
) -> (
    SlotsSeen,
    SessionAffinity<
        StaticFleet<
            impl Service<Req, Response = http::Response<B>, Error = Infallible, Future: Send>
                + Clone
                + Send,
        >,
    >,
)
where
    F: Fn() -> B + Clone + Send + 'static,
    B: Send + 'static,
{
    let seen = SlotsSeen::default();
    let record = seen.clone();
    let service = tower::service_fn(move |req: Req| {
        let slot = req.extensions().get::<tower_affinity::AssignedSlot>();
        record.lock().push(slot.map(|s| s.index()));
        let body = answer();
        async move { Ok::<_, Infallible>(http::Response::new(body)) }
    });
    let backend = Backend::new("a", service).slots(nz(slots));
    let backend = if assigned {
        backend.assign_slots()
    } else {
        backend
    };
    let svc = SessionAffinityLayer::new().layer(StaticFleet::new([("a1", backend)]));
    (seen, svc)
}

/// An answer of known length.
fn ok_body() -> http_body_util::Full<Bytes> {
    http_body_util::Full::new(Bytes::from_static(b"ok"))
}

/// Session `session`'s turn of 100-token blocks `ids`, on a chat completion's path.
fn slot_turn(session: &str, ids: &[u64]) -> Req {
    let blocks: Vec<(u64, u32)> = ids.iter().map(|&b| (b, 100)).collect();
    chained(session, None, &blocks, None)
}

/// A backend declared with `assign_slots` receives each request with the slot the router gave
/// it: two conversations of one system prompt, whose turns come out of step, each keep a slot
/// of their own (llama-server would give the second the first's idle slot, by what they
/// share); a slot is free again when its answer ends; a backend without the option gets no
/// slot.
#[tokio::test]
async fn a_backend_whose_slots_are_assigned_gets_each_conversation_on_a_slot_of_its_own() {
    let (seen, svc) = slot_backend(2, true, ok_body);
    // System prompt blocks 1 and 2; conversation x goes on with 3, y with 7.
    let turns: [(&str, &[u64]); 5] = [
        ("x", &[1, 2, 3]),
        ("y", &[1, 2, 7]),
        ("x", &[1, 2, 3, 4]),
        ("y", &[1, 2, 7, 8]),
        ("x", &[1, 2, 3, 4, 5]),
    ];
    for (session, ids) in turns {
        let res = svc.clone().oneshot(slot_turn(session, ids)).await.unwrap();
        res.into_body().collect().await.unwrap();
    }
    assert_eq!(
        *seen.lock(),
        [Some(0), Some(1), Some(0), Some(1), Some(0)],
        "each conversation on its own slot"
    );
    assert_eq!(in_flight(&svc, "a1"), 0);

    let (unassigned, svc) = slot_backend(2, false, ok_body);
    let res = svc.oneshot(slot_turn("x", &[1])).await.unwrap();
    res.into_body().collect().await.unwrap();
    assert_eq!(*unassigned.lock(), [None]);
}

/// A conversation's earlier turn sent again (its answer regenerated) goes to the slot holding
/// the turn after it, which llama-server reuses the whole prompt from, not to an empty slot.
#[tokio::test]
async fn an_earlier_turn_sent_again_goes_to_the_slot_holding_the_turn_after_it() {
    let (seen, svc) = slot_backend(2, true, ok_body);
    for ids in [&[1u64, 2][..], &[1, 2, 3], &[1, 2]] {
        let res = svc.clone().oneshot(slot_turn("x", ids)).await.unwrap();
        res.into_body().collect().await.unwrap();
    }
    assert_eq!(*seen.lock(), [Some(0), Some(0), Some(0)]);
}

/// While a request holds its slot, the next request to the backend is given another: the
/// router never names a slot that one of its requests still holds.
#[tokio::test]
async fn a_slot_held_by_a_request_in_flight_is_not_assigned_again() {
    let (seen, svc) = slot_backend(2, true, ok_body);
    // The same conversation twice at once: the second cannot have the first's slot.
    let first = svc.clone().oneshot(slot_turn("x", &[1])).await.unwrap();
    let second = svc.clone().oneshot(slot_turn("x", &[1, 2])).await.unwrap();
    assert_eq!(*seen.lock(), [Some(0), Some(1)]);
    first.into_body().collect().await.unwrap();
    second.into_body().collect().await.unwrap();
    // Both free: the conversation's latest prompt is on slot 1.
    let third = svc
        .clone()
        .oneshot(slot_turn("x", &[1, 2, 3]))
        .await
        .unwrap();
    third.into_body().collect().await.unwrap();
    assert_eq!(*seen.lock(), [Some(0), Some(1), Some(1)]);
}

/// Conversations x and y take slots 0 and 1 of 3; y's answer is read to its last frame
/// (`frames` of them) and kept, and y's next turn is sent then: it gets its own slot 1, not
/// the empty slot 2 nor x's slot 0.
async fn next_turn_read_before_the_end_gets_its_own_slot<B, F>(answer: F, frames: usize)
where
    F: Fn() -> B + Clone + Send + 'static,
    B: http_body::Body<Data = Bytes, Error = Infallible> + Send + Unpin + 'static,
{
    let (seen, svc) = slot_backend(3, true, answer);
    let x = svc.clone().oneshot(slot_turn("x", &[1, 2])).await.unwrap();
    let y = svc.clone().oneshot(slot_turn("y", &[1, 3])).await.unwrap();
    x.into_body().collect().await.unwrap();
    let mut y = y.into_body();
    for _ in 0..frames {
        y.frame().await.unwrap().unwrap();
    }
    let next = svc
        .clone()
        .oneshot(slot_turn("y", &[1, 3, 4]))
        .await
        .unwrap();
    assert_eq!(*seen.lock(), [Some(0), Some(1), Some(1)]);
    drop(y);
    next.into_body().collect().await.unwrap();
    assert_eq!(in_flight(&svc, "a1"), 0);
}

/// A conversation's next turn sent as soon as its last answer's bytes are read, before the
/// server has dropped that answer's body (hyper's drops a body of known length only once it
/// has written it), goes to its own slot: the backend sent the whole answer, so that slot is
/// free there, though the request still holds its place on the backend until the body drops.
#[tokio::test]
async fn a_turn_sent_before_the_last_answers_body_is_dropped_gets_its_own_slot() {
    next_turn_read_before_the_end_gets_its_own_slot(ok_body, 1).await;
}

/// The same for an event stream: a client stops reading at `data: [DONE]` and sends its next
/// turn before the stream's end is polled; that turn goes to its own slot.
#[tokio::test]
async fn a_turn_sent_at_its_last_answers_done_event_gets_its_own_slot() {
    let events = || {
        let events: Vec<Result<http_body::Frame<Bytes>, Infallible>> = vec![
            Ok(http_body::Frame::data(Bytes::from_static(
                b"data: {\"choices\":[{\"delta\":{\"content\":\"ok\"}}]}\n\n",
            ))),
            Ok(http_body::Frame::data(Bytes::from_static(
                b"data: [DONE]\n\n",
            ))),
        ];
        http_body_util::StreamBody::new(futures_util::stream::iter(events))
    };
    next_turn_read_before_the_end_gets_its_own_slot(events, 2).await;
}

/// The same for a Responses stream, which llama-server ends with `response.completed` and
/// no `[DONE]`: a client stops reading at that event, whose data is the whole response, and
/// its next turn goes to its own slot.
#[tokio::test]
async fn a_turn_sent_at_its_last_answers_response_completed_event_gets_its_own_slot() {
    let events = || {
        let completed = format!(
            "event: response.completed\ndata: {{\"type\":\"response.completed\",\"response\":{{\"output\":[{{\"type\":\"message\",\"content\":[{{\"type\":\"output_text\",\"text\":\"{}\"}}]}}]}}}}\n\n",
            "ok ".repeat(100)
        );
        let events: Vec<Result<http_body::Frame<Bytes>, Infallible>> = vec![
            Ok(http_body::Frame::data(Bytes::from_static(
                b"event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"ok\"}\n\n",
            ))),
            Ok(http_body::Frame::data(Bytes::from(completed))),
        ];
        http_body_util::StreamBody::new(futures_util::stream::iter(events))
    };
    next_turn_read_before_the_end_gets_its_own_slot(events, 2).await;
}

/// An answer that speaks of `data: [DONE]` in its text does not free its slot: a frame cut in
/// the middle of an event, just after those words, is no stream's last event. A request sent
/// meanwhile that goes on from the slot's prompt is given an empty slot, not the one the
/// backend is still generating in, where it would wait for the whole answer.
#[tokio::test]
async fn an_answer_that_says_done_in_its_text_holds_its_slot_to_its_last_event() {
    let events = || {
        let events: Vec<Result<http_body::Frame<Bytes>, Infallible>> = [
            &b"data: {\"choices\":[{\"delta\":{\"content\":\"an SSE stream ends with data: [DONE]"
                [..],
            b"\"}}]}\n\n",
            b"data: [DONE]\n\n",
        ]
        .into_iter()
        .map(|frame| Ok(http_body::Frame::data(Bytes::from_static(frame))))
        .collect();
        http_body_util::StreamBody::new(futures_util::stream::iter(events))
    };
    let (seen, svc) = slot_backend(3, true, events);
    let x = svc.clone().oneshot(slot_turn("x", &[1, 2])).await.unwrap();
    let y = svc.clone().oneshot(slot_turn("y", &[1, 3])).await.unwrap();
    x.into_body().collect().await.unwrap();
    let mut y = y.into_body();
    y.frame().await.unwrap().unwrap();
    // A branch of y's conversation: y's slot would be its own, were it free.
    let branch = svc
        .clone()
        .oneshot(slot_turn("z", &[1, 3, 5]))
        .await
        .unwrap();
    assert_eq!(*seen.lock(), [Some(0), Some(1), Some(2)]);
    y.collect().await.unwrap();
    branch.into_body().collect().await.unwrap();
    assert_eq!(in_flight(&svc, "a1"), 0);
}

/// A backend announced again without `assign_slots`, then with it, while a request it was
/// assigned a slot is in flight: the router still knows that slot busy, and the request's end
/// frees its own slot only, never one given to a later request.
#[tokio::test]
async fn a_slot_in_flight_while_assignment_is_turned_off_and_on_is_still_known_busy() {
    let seen = SlotsSeen::default();
    let record = seen.clone();
    let service = tower::service_fn(move |req: Req| {
        let slot = req.extensions().get::<tower_affinity::AssignedSlot>();
        record.lock().push(slot.map(|s| s.index()));
        async move { Ok::<_, Infallible>(http::Response::new(ok_body())) }
    });
    let (handle, stream) = discover::channel();
    let announce = |assigned: bool| {
        let backend = Backend::new("a", service.clone()).slots(nz(3));
        handle.insert(
            "a1",
            if assigned {
                backend.assign_slots()
            } else {
                backend
            },
        );
    };
    announce(true);
    let svc = SessionAffinityLayer::new().layer(stream);
    // x's answer is not read yet: it holds slot 0.
    let x = svc.clone().oneshot(slot_turn("x", &[1, 2])).await.unwrap();
    announce(false);
    svc.apply_discovery();
    announce(true);
    svc.apply_discovery();
    // y does not take x's slot, which the backend is still generating in.
    let y = svc.clone().oneshot(slot_turn("y", &[5, 6])).await.unwrap();
    // x's end frees x's slot, not y's: a branch of y's conversation, sent while y is in
    // flight, is not given y's slot.
    drop(x);
    let branch = svc
        .clone()
        .oneshot(slot_turn("z", &[5, 6, 7]))
        .await
        .unwrap();
    assert_eq!(*seen.lock(), [Some(0), Some(1), Some(2)]);
    y.into_body().collect().await.unwrap();
    branch.into_body().collect().await.unwrap();
    assert_eq!(in_flight(&svc, "a1"), 0);
}

/// Session `session`'s turn of the user messages `messages`, with `id_slot` (as JSON) as the
/// body's first member if given, its facts read from that body as `BodyKeyLayer` reads them.
fn slot_turn_naming(session: &str, messages: &[&str], id_slot: Option<&str>) -> Req {
    let messages: Vec<String> = messages
        .iter()
        .map(|m| format!(r#"{{"role":"user","content":"{m}"}}"#))
        .collect();
    let named = id_slot.map_or(String::new(), |n| format!(r#""id_slot":{n},"#));
    let body = format!(
        r#"{{{named}"model":"m","messages":[{}]}}"#,
        messages.join(",")
    );
    let mut req = request(Some(session), None);
    req.extensions_mut()
        .insert(PromptFacts::from_body(body.as_bytes()));
    *req.body_mut() = body;
    req
}

/// A request whose body names its slot (`"id_slot": 1`, which `IdSlot` leaves as it is and
/// llama-server runs it in) is assigned that slot, and its prompt is recorded there: the
/// conversation's next turn, naming none, goes back to it, and a new conversation takes the
/// slot still empty.
#[tokio::test]
async fn a_request_naming_its_slot_is_assigned_that_slot_and_its_prompt_recorded_there() {
    let (seen, svc) = slot_backend(2, true, ok_body);
    for (session, messages, id_slot) in [
        ("x", &["hi"][..], Some("1")),
        ("x", &["hi", "more"], None),
        ("y", &["other"], None),
    ] {
        let req = slot_turn_naming(session, messages, id_slot);
        let res = svc.clone().oneshot(req).await.unwrap();
        res.into_body().collect().await.unwrap();
    }
    assert_eq!(*seen.lock(), [Some(1), Some(1), Some(0)]);
    assert_eq!(in_flight(&svc, "a1"), 0);
}

/// While a request that named its slot is in flight there, that slot is assigned to no other
/// request.
#[tokio::test]
async fn a_slot_named_by_a_request_in_flight_is_not_assigned_to_another() {
    let (seen, svc) = slot_backend(2, true, ok_body);
    let x = slot_turn_naming("x", &["hi"], Some("1"));
    let x = svc.clone().oneshot(x).await.unwrap();
    let y = svc
        .clone()
        .oneshot(slot_turn_naming("y", &["other"], None))
        .await
        .unwrap();
    assert_eq!(*seen.lock(), [Some(1), Some(0)]);
    x.into_body().collect().await.unwrap();
    y.into_body().collect().await.unwrap();
}

/// A slot number past the backend's slots wraps around, as llama-server takes it modulo its
/// slots: `"id_slot": 5` of two slots is slot 1.
#[tokio::test]
async fn a_named_slot_past_the_backends_slots_wraps_around() {
    let (seen, svc) = slot_backend(2, true, ok_body);
    let req = slot_turn_naming("x", &["hi"], Some("5"));
    let res = svc.clone().oneshot(req).await.unwrap();
    res.into_body().collect().await.unwrap();
    assert_eq!(*seen.lock(), [Some(1)]);
}

/// A request naming a slot another request holds is queued there, as llama-server queues it:
/// the slot stays taken until it ends too, though the request before it has ended, so the
/// conversation that slot held goes on elsewhere rather than wait behind it; and the slot
/// then holds the queued request's prompt, where its conversation goes back.
#[tokio::test]
async fn a_request_naming_a_taken_slot_keeps_it_taken_until_it_ends_and_leaves_its_prompt_there() {
    let (seen, svc) = slot_backend(2, true, ok_body);
    let x = svc
        .clone()
        .oneshot(slot_turn_naming("x", &["hi"], None))
        .await
        .unwrap();
    let z = svc
        .clone()
        .oneshot(slot_turn_naming("z", &["else"], Some("0")))
        .await
        .unwrap();
    x.into_body().collect().await.unwrap();
    // z runs on slot 0 now: x's next turn is not sent to wait there.
    let next = svc
        .clone()
        .oneshot(slot_turn_naming("x", &["hi", "more"], None))
        .await
        .unwrap();
    z.into_body().collect().await.unwrap();
    next.into_body().collect().await.unwrap();
    let res = svc
        .clone()
        .oneshot(slot_turn_naming("z", &["else", "again"], None))
        .await
        .unwrap();
    res.into_body().collect().await.unwrap();
    assert_eq!(*seen.lock(), [Some(0), Some(0), Some(1), Some(0)]);
    assert_eq!(in_flight(&svc, "a1"), 0);
}

/// A request whose `id_slot` names no slot (`-1`, with which llama-server chooses; `null`; a
/// string; a fraction) is assigned none: `IdSlot` leaves its `id_slot` as it is, so a slot
/// assigned to it would be counted as holding its prompt while another does.
#[tokio::test]
async fn a_request_whose_id_slot_names_no_slot_is_assigned_none() {
    let (seen, svc) = slot_backend(2, true, ok_body);
    for id_slot in ["-1", "null", r#""1""#, "1.5", "true"] {
        let req = slot_turn_naming("x", &["hi"], Some(id_slot));
        let res = svc.clone().oneshot(req).await.unwrap();
        res.into_body().collect().await.unwrap();
    }
    assert_eq!(*seen.lock(), [None; 5]);
    // Nothing was recorded: a new conversation takes the first empty slot.
    let res = svc
        .clone()
        .oneshot(slot_turn_naming("y", &["other"], None))
        .await
        .unwrap();
    res.into_body().collect().await.unwrap();
    assert_eq!(seen.lock()[5], Some(0));
}

/// A token count (or any request a backend does not run in a slot) is given no slot, and the
/// slot of the conversation it counts is still known to hold that conversation.
#[tokio::test]
async fn a_token_count_takes_no_assigned_slot_and_leaves_the_conversations_own() {
    let (seen, svc) = slot_backend(2, true, ok_body);
    for (path, ids) in [
        ("/v1/chat/completions", &[1u64, 2][..]),
        ("/v1/messages/count_tokens", &[1, 2, 3]),
        ("/tokenize", &[1, 2, 3]),
        ("/v1/chat/completions", &[1, 2, 3]),
    ] {
        let mut req = slot_turn("x", ids);
        *req.uri_mut() = path.parse().unwrap();
        let res = svc.clone().oneshot(req).await.unwrap();
        res.into_body().collect().await.unwrap();
    }
    assert_eq!(*seen.lock(), [Some(0), None, None, Some(0)]);
}

/// A request whose body is in a content coding (`Content-Encoding: gzip`) is given no slot:
/// `IdSlot` cannot write one into its bytes, so llama-server chooses, and a slot assigned to
/// it would be counted as taken, and then as holding its prompt, while another slot runs it.
#[tokio::test]
async fn a_request_in_a_content_coding_takes_no_assigned_slot_and_leaves_the_conversations_own() {
    let (seen, svc) = slot_backend(2, true, ok_body);
    for (session, ids, coding) in [
        ("x", &[1u64, 2][..], None),
        ("g", &[7], Some("gzip")),
        ("i", &[8], Some("identity")),
        ("x", &[1, 2, 3], None),
    ] {
        let mut req = slot_turn(session, ids);
        if let Some(coding) = coding {
            let value = http::HeaderValue::from_static(coding);
            req.headers_mut()
                .insert(http::header::CONTENT_ENCODING, value);
        }
        let res = svc.clone().oneshot(req).await.unwrap();
        res.into_body().collect().await.unwrap();
    }
    assert_eq!(*seen.lock(), [Some(0), None, Some(1), Some(0)]);
}

/// An embedding, a reranking or an Anthropic Messages request is given no slot: llama-server
/// runs them in slots of its own choosing, whatever `id_slot` they carry, so a slot assigned
/// to one would be counted as holding its input, and the conversation whose prompt that slot
/// still holds would be sent elsewhere on its next turn.
#[tokio::test]
async fn a_request_llama_server_places_itself_takes_no_assigned_slot_and_leaves_the_conversations_own(
) {
    let (seen, svc) = slot_backend(2, true, ok_body);
    for (path, session, ids) in [
        ("/v1/chat/completions", "x", &[1u64, 2][..]),
        ("/v1/embeddings", "e", &[7]),
        ("/embedding", "e", &[8]),
        ("/v1/rerank", "r", &[9]),
        ("/v1/messages", "m", &[10]),
        ("/v1/chat/completions", "x", &[1, 2, 3]),
    ] {
        let mut req = slot_turn(session, ids);
        *req.uri_mut() = path.parse().unwrap();
        let res = svc.clone().oneshot(req).await.unwrap();
        res.into_body().collect().await.unwrap();
    }
    assert_eq!(*seen.lock(), [Some(0), None, None, None, None, Some(0)]);
}

/// Conversations x and y on slots 0 and 1 (0 the least recently used) of a backend whose
/// slots the router assigns, then a prompt of conversation z, sharing nothing with them,
/// marked `mark`: it is given slot 0, and the backend does not run it, refusing one marked
/// `x-refuse` with a 400 (as llama-server does a prompt longer than a slot's context, before
/// it touches the slot) and failing one marked `x-fail` (no answer at all). x and y then go
/// on, each on its own slot.
async fn a_request_not_run_leaves_its_slot_to_its_conversation(mark: &'static str) {
    let seen = SlotsSeen::default();
    let record = seen.clone();
    let service = tower::service_fn(move |req: Req| {
        let slot = req.extensions().get::<tower_affinity::AssignedSlot>();
        record.lock().push(slot.map(|s| s.index()));
        let (refuse, fail) = (
            req.headers().contains_key("x-refuse"),
            req.headers().contains_key("x-fail"),
        );
        async move {
            if fail {
                return Err(std::io::Error::other("connection reset"));
            }
            let status = if refuse { 400 } else { 200 };
            let res = http::Response::builder().status(status).body(ok_body());
            Ok(res.unwrap())
        }
    });
    let backend = Backend::new("a", service).slots(nz(2)).assign_slots();
    let svc = SessionAffinityLayer::new()
        .failure_cooldown(Duration::ZERO)
        .layer(StaticFleet::new([("a1", backend)]));
    for (session, ids) in [("x", &[1u64, 2][..]), ("y", &[5, 6])] {
        let res = svc.clone().oneshot(slot_turn(session, ids)).await.unwrap();
        res.into_body().collect().await.unwrap();
    }
    let mut req = slot_turn("z", &[20, 21]);
    req.headers_mut()
        .insert(mark, http::HeaderValue::from_static("1"));
    if let Ok(res) = svc.clone().oneshot(req).await {
        assert_eq!(res.status(), 400);
        res.into_body().collect().await.unwrap();
    }
    for (session, ids) in [("x", &[1u64, 2, 3][..]), ("y", &[5, 6, 7])] {
        let res = svc.clone().oneshot(slot_turn(session, ids)).await.unwrap();
        res.into_body().collect().await.unwrap();
    }
    assert_eq!(
        *seen.lock(),
        [Some(0), Some(1), Some(0), Some(0), Some(1)],
        "x and y back on their own slots"
    );
    assert_eq!(in_flight(&svc, "a1"), 0);
}

/// A request the backend refuses (llama-server's 400 to a prompt longer than a slot's
/// context) leaves the slot assigned to it holding what it held: the conversation whose last
/// prompt is there gets it back, rather than take another's slot and drop both caches.
#[tokio::test]
async fn a_slot_whose_request_is_refused_still_holds_its_conversation() {
    a_request_not_run_leaves_its_slot_to_its_conversation("x-refuse").await;
}

/// The same for a request that fails on its way, with no answer at all.
#[tokio::test]
async fn a_slot_whose_request_failed_still_holds_its_conversation() {
    a_request_not_run_leaves_its_slot_to_its_conversation("x-fail").await;
}

/// The 503 of a lone backend, given back where its retry finds no backend up, names that
/// backend when the decision is kept in the body (`decision_extension(false)`) too.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_503_given_back_names_its_backend_without_the_decision_extension() {
    let streams = Streams::default();
    let svc = SessionAffinityLayer::new()
        .decision_extension(false)
        .failure_cooldown(Duration::from_secs(5))
        .layer(fleet(&[("a1", "a", 1)], &streams));
    let mut retrying = tower::retry::RetryLayer::new(RetryOnce::new()).layer(svc.clone());
    let mut req = request(Some("s"), None);
    req.headers_mut()
        .append("x-unavailable-on", http::HeaderValue::from_static("a1"));
    let err = retrying.ready().await.unwrap().call(req).await.unwrap_err();
    match &err {
        Error::Backend { backend, .. } => assert_eq!(backend.as_str(), "a1", "{err}"),
        other => panic!("{other}"),
    }
    let res = err.into_response::<MockBody>();
    assert_eq!(res.status(), 503);
    assert_eq!(
        res.extensions()
            .get::<tower_affinity::BackendId>()
            .unwrap()
            .as_str(),
        "a1"
    );
}

// === whatever the caller does with a request, nothing it took stays taken ===

/// What a backend and the service hold for requests, which are all back at rest once no
/// request is left: slots, context, unread prompt tokens, waiters.
fn at_rest<D, K, P, S>(svc: &SessionAffinity<D, K, P>) -> bool
where
    D: Discover<Key = tower_affinity::BackendId, Service = Backend<S>>,
{
    let stats = svc.stats();
    (stats.in_flight, stats.waiting) == (0, 0)
        && svc
            .backends()
            .iter()
            .all(|b| b.in_flight == 0 && b.context_in_flight == 0 && b.unread_tokens == 0)
}

/// Every request the service was called with is placed, refused, or given up on.
fn accounted<D, K, P, S>(svc: &SessionAffinity<D, K, P>, calls: u64) -> bool
where
    D: Discover<Key = tower_affinity::BackendId, Service = Backend<S>>,
{
    let s = svc.stats();
    s.placed() + s.abandoned + s.rejected + s.no_backends + s.refusals_answered == calls
}

/// A response future dropped before its first poll gives back what its `call` took: the slot
/// and context of a request called at once, of one whose backend was not ready, and the place
/// in the queue of one waiting for a slot.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_response_future_dropped_before_its_first_poll_gives_back_what_its_call_took() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .overflow(Overflow::wait(Duration::from_secs(30), 8))
        .layer(fleet_with_context(&[("a1", 2, Some(100_000))], &streams));
    // Called at once, then dropped.
    svc.ready().await.unwrap();
    drop(svc.call(prompt("s1", 1, 1_000)));
    assert!(at_rest(&svc), "{:?}", svc.backends());
    // One slot taken by a stream; one request then waits for the other, and is dropped.
    let held = send_req(&mut svc, prompt("s2", 2, 1_000)).await.unwrap();
    let held2 = send_req(&mut svc, prompt("s3", 3, 1_000)).await.unwrap();
    svc.ready().await.unwrap();
    drop(svc.call(prompt("s4", 4, 1_000)));
    assert_eq!(svc.stats().waiting, 0);
    drop((held, held2));
    assert!(at_rest(&svc), "{:?}", svc.backends());
    assert!(accounted(&svc, 4), "{:?}", svc.stats());
    assert_eq!(svc.stats().abandoned, 1);
    // A backend not ready: its request dropped before it was polled.
    let hangs = tower::service_fn(|_req: Req| async {
        std::future::pending::<()>().await;
        Ok::<_, Infallible>(http::Response::new(String::new()))
    });
    let one_at_a_time = tower::limit::ConcurrencyLimit::new(hangs, 1);
    let mut svc = SessionAffinityLayer::new().layer(StaticFleet::new([(
        "a1",
        Backend::new("a", one_at_a_time)
            .slots(nz(2))
            .context_tokens(std::num::NonZeroU64::new(100_000).unwrap())
            .assign_slots(),
    )]));
    ServiceExt::<Req>::ready(&mut svc).await.unwrap();
    let mut sent = tokio_test::task::spawn(svc.call(slot_turn("s1", &[1])));
    assert_pending!(sent.poll());
    ServiceExt::<Req>::ready(&mut svc).await.unwrap();
    drop(svc.call(slot_turn("s2", &[2])));
    assert_eq!(status(&svc, "a1").in_flight, 1);
    drop(sent);
    assert!(at_rest(&svc), "{:?}", svc.backends());
}

/// A body polled again after its end gives nothing back twice: the slot of another request
/// stays counted.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_body_polled_after_its_end_gives_nothing_back_twice() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new().layer(fleet(&[("a1", "a", 2)], &streams));
    let other = send(&mut svc, Some("s1"), Some("stream")).await.unwrap();
    let res = send(&mut svc, Some("s2"), None).await.unwrap();
    let mut body = res.into_body();
    assert_eq!(
        body.frame().await.unwrap().unwrap().into_data().unwrap(),
        "a1"
    );
    assert!(body.frame().await.is_none());
    for _ in 0..3 {
        assert!(body.frame().await.is_none());
    }
    drop(body);
    assert_eq!(in_flight(&svc, "a1"), 1);
    drop(other);
    assert!(at_rest(&svc));
}

/// A backend whose future panics gives its slot back as its task unwinds, and a request
/// waiting for that slot takes it.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_backend_that_panics_gives_its_slot_back_as_its_task_unwinds() {
    let go = std::sync::Arc::new(tokio::sync::Notify::new());
    let panic_when = go.clone();
    let panics = tower::service_fn(move |req: Req| {
        let go = panic_when.clone();
        async move {
            if req.headers().contains_key("x-panic") {
                go.notified().await;
                panic!("a bug in the backend");
            }
            Ok::<_, Infallible>(http::Response::new(String::from("ok")))
        }
    });
    let svc = SessionAffinityLayer::new()
        .overflow(Overflow::wait(Duration::from_secs(30), 8))
        .layer(StaticFleet::new([("a1", Backend::new("a", panics))]));
    let mut req = request(Some("s1"), None);
    req.headers_mut()
        .insert("x-panic", http::HeaderValue::from_static("1"));
    let panicking = tokio::spawn(svc.clone().oneshot(req));
    tokio::task::yield_now().await;
    assert_eq!(in_flight(&svc, "a1"), 1);
    let waiting = tokio::spawn(svc.clone().oneshot(request(Some("s2"), None)));
    tokio::task::yield_now().await;
    assert_eq!(svc.stats().waiting, 1);
    go.notify_one();
    assert!(panicking.await.unwrap_err().is_panic());
    let res = waiting.await.unwrap().unwrap();
    assert_eq!(res.into_body().collect().await.unwrap().to_bytes(), "ok");
    assert!(at_rest(&svc));
    assert!(accounted(&svc, 2), "{:?}", svc.stats());
}

/// A `call` no `poll_ready` preceded is placed on the fleet as discovery was last applied:
/// on a service never polled, none, and it is refused as such; after a clone's readiness,
/// the fleet that clone applied. Either way nothing stays counted.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_call_without_readiness_is_placed_on_the_fleet_as_last_applied() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new().layer(fleet(&[("a1", "a", 1)], &streams));
    let err = svc.call(request(Some("s"), None)).await.unwrap_err();
    assert!(matches!(err, Error::NoBackends { .. }), "{err}");
    ServiceExt::<Req>::ready(&mut svc.clone()).await.unwrap();
    let res = svc.call(request(Some("s"), None)).await.unwrap();
    assert_eq!(decision(&res).backend.as_str(), "a1");
    drop(res);
    assert!(at_rest(&svc));
    assert!(accounted(&svc, 2), "{:?}", svc.stats());
}

/// The body tells the backend's body's size and end as it has them, and still holds its slot
/// until it is read to its end or dropped.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_body_tells_the_size_and_end_of_the_backends_body() {
    let (_, mut svc) = slot_backend(1, false, ok_body);
    let req = request(Some("s"), None);
    let res = svc.ready().await.unwrap().call(req).await.unwrap();
    let mut body = res.into_body();
    assert_eq!(http_body::Body::size_hint(&body).exact(), Some(2));
    assert!(!http_body::Body::is_end_stream(&body));
    assert_eq!(
        body.frame().await.unwrap().unwrap().into_data().unwrap(),
        "ok"
    );
    assert!(http_body::Body::is_end_stream(&body));
    assert_eq!(http_body::Body::size_hint(&body).exact(), Some(0));
    assert!(body.frame().await.is_none());
    assert!(at_rest(&svc));
}

/// A body whose last frame says it has ended gives its slot back with that frame: a caller
/// that keeps the body and polls it no more leaves its backend free for the next request,
/// and the end polled later counts nothing twice.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_body_gives_its_slot_back_with_its_last_frame() {
    let (_, mut svc) = slot_backend(1, false, ok_body);
    let req = request(Some("s"), None);
    let res = svc.ready().await.unwrap().call(req).await.unwrap();
    let mut body = res.into_body();
    let frame = body.frame().await.unwrap().unwrap();
    assert_eq!(frame.into_data().unwrap(), "ok");
    assert!(http_body::Body::is_end_stream(&body));
    // Kept, not polled again.
    assert_eq!(in_flight(&svc, "a1"), 0);
    assert!(at_rest(&svc), "{:?}", svc.backends());
    // The one slot is free: the next request is placed on its first poll.
    svc.ready().await.unwrap();
    let mut next = tokio_test::task::spawn(svc.call(request(Some("t"), None)));
    let res = assert_ready!(next.poll()).unwrap();
    assert_eq!(in_flight(&svc, "a1"), 1);
    assert_eq!(svc.stats().waiting, 0);
    drop(res);
    // The end polled later, and the body dropped, count nothing twice.
    assert!(body.frame().await.is_none());
    drop(body);
    assert!(at_rest(&svc), "{:?}", svc.backends());
    assert!(accounted(&svc, 2), "{:?}", svc.stats());
}

/// A request sent beyond a backend's slots (a token count, which never waits) frees no slot
/// as it ends: the backend is as full as before, so no waiter is woken for it. Woken, the
/// oldest waiter would hold a promise of a slot that does not exist, and the slot that frees
/// next would go to the waiter after it, which would then take it first.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_request_beyond_a_backends_slots_frees_none_as_it_ends() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new().layer(fleet(&[("a1", "a", 1)], &streams));
    let holder = send(&mut svc, None, Some("stream")).await.unwrap();
    let (_, holder_tx) = streams.take().unwrap();
    let waiting = waiters(&mut svc, &["older", "younger"]).await;
    let [mut older, mut younger] = <[_; 2]>::try_from(waiting).ok().unwrap();
    // A token count goes beyond the one slot, and ends.
    let count = http::Request::post("/tokenize")
        .header("x-mode", "stream")
        .body(String::new())
        .unwrap();
    let count = send_req(&mut svc, count).await.unwrap();
    assert!(decision(&count).overcommitted);
    let (_, count_tx) = streams.take().unwrap();
    drop(count_tx);
    count.into_body().collect().await.unwrap();
    assert_eq!(in_flight(&svc, "a1"), 1);
    assert!(!older.is_woken(), "no slot freed");
    assert!(!younger.is_woken(), "no slot freed");
    // The holder's end frees the slot: it goes to the older waiter.
    drop(holder_tx);
    holder.into_body().collect().await.unwrap();
    older_then_younger(&mut older, &mut younger, "a1");
    assert_eq!(svc.stats().waiting, 0);
}

/// A request in flight beyond a backend's slots after discovery lowered them frees none as it
/// ends, as an overcommitted one does not: the slot that frees below the new count goes to
/// the oldest waiter.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_request_beyond_a_lowered_slot_count_frees_none_as_it_ends() {
    let streams = Streams::default();
    let (handle, stream) = discover::channel();
    let a1 = || Backend::new("a", backend("a1", &streams));
    handle.insert("a1", a1().slots(nz(2)));
    let mut svc = SessionAffinityLayer::new().layer(stream);
    let first = send(&mut svc, None, Some("stream")).await.unwrap();
    let second = send(&mut svc, None, Some("stream")).await.unwrap();
    let (_, first_tx) = streams.take().unwrap();
    let (_, second_tx) = streams.take().unwrap();
    let waiting = waiters(&mut svc, &["older", "younger"]).await;
    let [mut older, mut younger] = <[_; 2]>::try_from(waiting).ok().unwrap();
    // One slot now: the two in flight fill it and more.
    handle.insert("a1", a1().slots(nz(1)));
    svc.apply_discovery();
    assert_pending!(older.poll());
    assert_pending!(younger.poll());
    drop(first_tx);
    first.into_body().collect().await.unwrap();
    assert!(!older.is_woken(), "no slot freed");
    assert!(!younger.is_woken(), "no slot freed");
    drop(second_tx);
    second.into_body().collect().await.unwrap();
    older_then_younger(&mut older, &mut younger, "a1");
}

/// The slot just freed on `backend` goes to the `older` of two waiters, woken for it, and
/// once its answer is dropped, to the `younger`.
fn older_then_younger<F>(
    older: &mut tokio_test::task::Spawn<F>,
    younger: &mut tokio_test::task::Spawn<F>,
    backend: &str,
) where
    F: std::future::Future<Output = Result<Res, Error>>,
{
    assert!(older.is_woken());
    let res = assert_ready!(older.poll()).unwrap();
    assert_eq!(decision(&res).backend.as_str(), backend);
    assert_pending!(younger.poll());
    drop(res);
    assert_ready!(younger.poll()).unwrap();
}

/// A retried refusal held for its home node that finds no room in the queue looks again for
/// a slot anywhere: that look is not its first, and the refusal is counted once.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_retried_refusal_with_no_room_to_wait_for_its_node_is_counted_once() {
    let streams = Streams::default();
    let mut svc = SessionAffinityLayer::new()
        .overflow(Overflow::wait(Duration::from_secs(60), 1))
        .node_patience(Duration::from_secs(10))
        .layer(fleet(&[("a1", "a", 1), ("b1", "b", 1)], &streams));
    let first = send(&mut svc, Some("x"), Some("stream")).await.unwrap();
    // Another session of the same home waits for its node, filling a queue of one.
    svc.ready().await.unwrap();
    let mut queued = tokio_test::task::spawn(svc.call(request(Some("x"), None)));
    assert_pending!(queued.poll());
    let mut req = request(Some("x"), None);
    req.extensions_mut()
        .insert(tower_affinity::ContextRefusal::new(100, 50));
    let res = send_req(&mut svc, req).await.unwrap();
    assert_eq!(decision(&res).outcome, Outcome::CrossNodeSpill);
    assert_eq!(svc.stats().refusals_retried, 1);
    drop((res, queued, first));
}

/// A slot promised to a waiter on a backend whose down mark has ended is passed on when that
/// waiter leaves before it looks: the backend is up from the millisecond its mark ends, as it
/// was when the slot freed, though no look has cleared the mark yet.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_promise_on_a_backend_whose_cooldown_has_ended_is_passed_on() {
    let streams = Streams::default();
    let (mut svc, a, _b, mut waiting) = both_busy_two_waiting(&streams).await;
    // a1 goes down while busy, which wakes both waiters; neither looks before the end.
    assert!(svc.mark_down("a1", Some(Duration::from_secs(10))));
    // The mark ends this very millisecond, and nothing has looked at a1 since.
    tokio::time::advance(Duration::from_secs(10)).await;
    // a1's slot frees, promised to the oldest waiter, which leaves before it looks.
    drop(a);
    drop(waiting.remove(0));
    // The promise goes on to the other: a request arriving now does not take the slot.
    svc.ready().await.unwrap();
    let mut late = tokio_test::task::spawn(svc.call(request(Some("late"), None)));
    assert_pending!(late.poll(), "a later request took the slot passed on");
    let res = assert_ready!(waiting[0].poll()).unwrap();
    assert_eq!(decision(&res).backend.as_str(), "a1");
    drop((res, late));
    while streams.take().is_some() {}
}
