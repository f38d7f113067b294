//! The shared store seam: what the service reads and writes, its deadline and its faults,
//! with a store in memory whose answers the test controls, on paused time.

use std::collections::HashMap;
use std::convert::Infallible;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use parking_lot::Mutex;
use tokio::time::Instant;
use tower::util::BoxCloneService;
use tower::{service_fn, Layer, ServiceExt};
use tower_affinity::discover::StaticFleet;
use tower_affinity::key::{HeaderKey, PromptFacts, SessionKey};
use tower_affinity::placement::NodeThenBackend;
use tower_affinity::store::{
    HomeStore, Lookup, ReadHome, ReadPrompts, StoreState, StoredHome, WriteHome,
};
use tower_affinity::{
    Backend, Decision, Outcome, PromptChain, ResponseBody, SessionAffinity, SessionAffinityLayer,
    Sessions,
};

type Req = http::Request<String>;
type Mock = BoxCloneService<Req, http::Response<String>, Infallible>;
type Svc = SessionAffinity<StaticFleet<Mock>, HeaderKey, NodeThenBackend>;

/// How the store in memory answers reads.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Answer,
    Hang,
    Fail,
    Garbage,
}

#[derive(Debug)]
struct State {
    mode: Mode,
    homes: HashMap<SessionKey, StoredHome>,
    /// Keyless conversations' homes, by their prompts' tips.
    prompts: HashMap<u64, StoredHome>,
    writes: Vec<(SessionKey, StoredHome, Duration)>,
    /// The homes sent again after an outage, written or not.
    rewrites: Vec<(SessionKey, StoredHome)>,
    read_ttls: Vec<Duration>,
    /// Whether writes fail (reads follow `mode`).
    fail_writes: bool,
    /// Whether writes made now never answer.
    hang_writes: bool,
    /// While set, writes made now wait for a permit of this semaphore (first come, first
    /// served), then land.
    gate: Option<Arc<tokio::sync::Semaphore>>,
}

#[derive(Clone, Debug)]
struct MemoryStore(Arc<Mutex<State>>);

impl MemoryStore {
    fn new() -> Self {
        MemoryStore(Arc::new(Mutex::new(State {
            mode: Mode::Answer,
            homes: HashMap::new(),
            prompts: HashMap::new(),
            writes: Vec::new(),
            rewrites: Vec::new(),
            read_ttls: Vec::new(),
            fail_writes: false,
            hang_writes: false,
            gate: None,
        })))
    }

    fn mode(&self, mode: Mode) {
        self.0.lock().mode = mode;
    }

    /// Reads and writes fail (`true`), or both answer again.
    fn down(&self, down: bool) {
        let mut s = self.0.lock();
        s.mode = if down { Mode::Fail } else { Mode::Answer };
        s.fail_writes = down;
    }

    fn put(&self, session: &str, backend: &str, node: &str) {
        self.0
            .lock()
            .homes
            .insert(key(session), StoredHome::new(backend, node));
    }

    fn writes(&self) -> Vec<(SessionKey, StoredHome, Duration)> {
        self.0.lock().writes.clone()
    }

    /// The home of the keyless prompt ending at `link` of `chain`, as another replica wrote it.
    fn put_prompt(&self, chain: &PromptChain, link: usize, backend: &str, node: &str) {
        self.0
            .lock()
            .prompts
            .insert(chain.links()[link].digest, StoredHome::new(backend, node));
    }
}

impl HomeStore for MemoryStore {
    fn read(&self, session: SessionKey, ttl: Duration) -> ReadHome {
        let mut s = self.0.lock();
        s.read_ttls.push(ttl);
        let found = s.homes.get(&session).cloned();
        match s.mode {
            Mode::Answer => {
                Box::pin(async move { Ok(found.map_or(Lookup::Missing, Lookup::Home)) })
            }
            Mode::Garbage => Box::pin(async { Ok(Lookup::Garbage) }),
            Mode::Fail => Box::pin(async { Err("connection refused".into()) }),
            Mode::Hang => Box::pin(std::future::pending()),
        }
    }

    fn write(&self, session: SessionKey, home: StoredHome, ttl: Duration) -> WriteHome {
        self.land(session, home, ttl, false)
    }

    /// As a store that compares and sets: kept when the store holds a home placed later, or
    /// one that does not say when.
    fn rewrite(&self, session: SessionKey, home: StoredHome, ttl: Duration) -> WriteHome {
        self.land(session, home, ttl, true)
    }

    fn read_prompts(&self, prompts: &[u64], _ttl: Duration) -> ReadPrompts {
        let s = self.0.lock();
        if s.mode == Mode::Garbage {
            let found = vec![Lookup::Garbage; prompts.len()];
            return Box::pin(async move { Ok(found) });
        }
        let found = prompts
            .iter()
            .map(|p| {
                s.prompts
                    .get(p)
                    .cloned()
                    .map_or(Lookup::Missing, Lookup::Home)
            })
            .collect();
        Box::pin(async move { Ok(found) })
    }

    fn write_prompt(&self, prompt: u64, home: StoredHome, _ttl: Duration) -> WriteHome {
        self.0.lock().prompts.insert(prompt, home);
        Box::pin(async { Ok(()) })
    }
}

impl MemoryStore {
    /// A write landing: over whatever the store holds, or (`again`) only over no home or one
    /// placed before it.
    fn land(&self, session: SessionKey, home: StoredHome, ttl: Duration, again: bool) -> WriteHome {
        if self.0.lock().hang_writes {
            return Box::pin(std::future::pending());
        }
        let state = self.0.clone();
        let gate = self.0.lock().gate.clone();
        Box::pin(async move {
            if let Some(gate) = gate {
                gate.acquire().await.expect("never closed").forget();
            }
            let mut s = state.lock();
            if s.fail_writes {
                return Err("connection refused".into());
            }
            if again {
                s.rewrites.push((session, home.clone()));
                let held = s.homes.get(&session).map(|h| h.placed);
                if held.is_some_and(|placed| placed.is_none_or(|p| Some(p) > home.placed)) {
                    return Ok(());
                }
            }
            s.writes.push((session, home.clone(), ttl));
            s.homes.insert(session, home);
            Ok(())
        })
    }
}

fn key(session: &str) -> SessionKey {
    SessionKey::from_bytes(session.as_bytes())
}

fn mock(name: &'static str) -> Mock {
    BoxCloneService::new(service_fn(move |_req: Req| async move {
        Ok::<_, Infallible>(http::Response::new(name.to_string()))
    }))
}

fn fleet() -> StaticFleet<Mock> {
    let one = NonZeroU32::new(1).unwrap();
    StaticFleet::new([
        ("a1", Backend::new("node-a", mock("a1")).slots(one)),
        ("a2", Backend::new("node-a", mock("a2")).slots(one)),
        ("b1", Backend::new("node-b", mock("b1")).slots(one)),
        ("b2", Backend::new("node-b", mock("b2")).slots(one)),
    ])
}

const IDLE: Duration = Duration::from_secs(900);
const DEADLINE: Duration = Duration::from_millis(5);

fn service(store: &MemoryStore) -> Svc {
    service_over(store, fleet())
}

fn service_over(store: &MemoryStore, fleet: StaticFleet<Mock>) -> Svc {
    SessionAffinityLayer::new()
        .sessions(Sessions::new().idle_timeout(IDLE))
        .home_store(store.clone())
        .store_deadline(DEADLINE)
        .layer(fleet)
}

type Res = http::Response<ResponseBody<String>>;

async fn send(svc: &Svc, session: &str) -> Decision {
    let req = http::Request::post("/v1/chat/completions")
        .header("x-session-id", session)
        .body(String::new())
        .unwrap();
    let res: Res = svc.clone().oneshot(req).await.expect("no request fails");
    res.extensions().get::<Decision>().cloned().unwrap()
}

/// A request of `session` whose answer is kept: its slot stays taken until it is dropped.
async fn hold(svc: &Svc, session: &str) -> Res {
    let req = http::Request::post("/")
        .header("x-session-id", session)
        .body(String::new())
        .unwrap();
    svc.clone().oneshot(req).await.unwrap()
}

/// The next turn of `session` through `svc`, while its home (`first`'s) is busy: it goes
/// elsewhere. Its home is free again, and the writes have run, when this returns.
async fn moved_off(svc: &Svc, session: &str, first: &Decision) -> Decision {
    let busy = hold(svc, session).await;
    let moved = send(svc, session).await;
    assert_ne!(moved.backend, first.backend);
    drop(busy);
    settle().await;
    moved
}

/// A request of `session` through `svc`, after which `svc` has the store in `state`.
async fn noticed(svc: &Svc, session: &str, state: StoreState) {
    send(svc, session).await;
    settle().await;
    assert_eq!(svc.store_stats().unwrap().state, state);
}

/// Lets the writes' tasks run.
/// A service on `store` whose session `s` moved off its busy home in an outage, that write
/// failing: the service, and the session's first and second homes.
async fn moved_in_an_outage(store: &MemoryStore) -> (Svc, Decision, Decision) {
    let svc = service(store);
    let first = send(&svc, "s").await;
    settle().await;
    store.down(true);
    let moved = moved_off(&svc, "s", &first).await;
    assert_eq!(svc.store_stats().unwrap().write_errors, 1);
    (svc, first, moved)
}

async fn settle() {
    for _ in 0..8 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn a_home_in_the_store_is_followed_and_not_written_again() {
    let store = MemoryStore::new();
    let svc = service(&store);
    // Where rendezvous would put it, and somewhere else that another replica chose.
    let first = SessionAffinityLayer::new().layer(fleet());
    let rendezvous = {
        let req = http::Request::post("/")
            .header("x-session-id", "s")
            .body(String::new())
            .unwrap();
        let res = first.oneshot(req).await.unwrap();
        res.extensions().get::<Decision>().unwrap().backend.clone()
    };
    let other = ["a1", "a2", "b1", "b2"]
        .into_iter()
        .find(|b| *b != rendezvous.as_str())
        .unwrap();
    store.put("s", other, "whatever-node");
    let d = send(&svc, "s").await;
    assert_eq!(d.backend.as_str(), other);
    assert_eq!(d.outcome, Outcome::HomeHit);
    settle().await;
    assert!(store.writes().is_empty(), "{:?}", store.writes());
    let s = svc.store_stats().unwrap();
    assert_eq!((s.reads, s.hits, s.writes), (1, 1, 0), "{s:?}");
    // The read asked the store to keep the home for the idle timeout.
    assert_eq!(store.0.lock().read_ttls, vec![IDLE]);
}

#[tokio::test(start_paused = true)]
async fn a_new_home_is_written_with_the_idle_timeout_and_only_when_it_changes() {
    let store = MemoryStore::new();
    let svc = service(&store);
    let before = SystemTime::now() - Duration::from_millis(1);
    let d = send(&svc, "s").await;
    let after = SystemTime::now();
    assert_eq!(d.outcome, Outcome::NewSession);
    settle().await;
    let writes = store.writes();
    assert_eq!(writes.len(), 1);
    assert_eq!(writes[0].0, key("s"));
    // With when it was placed, to the millisecond.
    let placed = writes[0].1.placed.expect("placed");
    assert!(before <= placed && placed <= after, "{writes:?}");
    assert_eq!(
        writes[0].1,
        StoredHome::new(d.backend.as_str(), d.node.as_str()).with_placed(placed)
    );
    assert_eq!(writes[0].2, IDLE);
    // Later turns find it there: nothing more to write.
    for _ in 0..3 {
        assert_eq!(send(&svc, "s").await.outcome, Outcome::HomeHit);
    }
    settle().await;
    assert_eq!(store.writes().len(), 1);
    let s = svc.store_stats().unwrap();
    assert_eq!((s.reads, s.misses, s.hits, s.writes), (4, 1, 3, 1), "{s:?}");
}

#[tokio::test(start_paused = true)]
async fn a_store_that_never_answers_holds_a_request_for_the_deadline_at_most() {
    let store = MemoryStore::new();
    store.mode(Mode::Hang);
    let svc = service(&store);
    let t = Instant::now();
    send(&svc, "s").await;
    assert_eq!(
        t.elapsed(),
        DEADLINE,
        "the first request waits out the deadline"
    );
    let s = svc.store_stats().unwrap();
    assert_eq!((s.timeouts, s.outages), (1, 1), "{s:?}");
    assert_eq!(s.state, StoreState::Down);
    // Down: the next requests do not wait at all, and one probe at a time is in flight.
    let t = Instant::now();
    for _ in 0..10 {
        assert_eq!(send(&svc, "s").await.outcome, Outcome::HomeHit);
    }
    assert_eq!(t.elapsed(), Duration::ZERO);
    let s = svc.store_stats().unwrap();
    assert_eq!((s.reads, s.skipped), (2, 10), "{s:?}");
}

#[tokio::test(start_paused = true)]
async fn a_failing_store_is_passed_over_and_found_again_by_a_probe() {
    let store = MemoryStore::new();
    store.mode(Mode::Fail);
    let svc = service(&store);
    let home = send(&svc, "s").await.backend;
    let s = svc.store_stats().unwrap();
    assert_eq!((s.errors, s.state), (1, StoreState::Down), "{s:?}");
    assert_eq!(
        send(&svc, "s").await.backend,
        home,
        "the local table answers"
    );
    settle().await;
    store.mode(Mode::Answer);
    // This request does not wait; its probe finds the store up.
    assert_eq!(send(&svc, "s").await.backend, home);
    settle().await;
    let s = svc.store_stats().unwrap();
    assert_eq!(s.state, StoreState::Up, "{s:?}");
    assert_eq!((s.outages, s.recoveries), (1, 1), "{s:?}");
    // And the next one reads it again.
    let reads = s.reads;
    send(&svc, "s").await;
    assert_eq!(svc.store_stats().unwrap().reads, reads + 1);
}

#[tokio::test(start_paused = true)]
async fn a_request_given_up_while_the_store_is_read_is_counted_abandoned() {
    let store = MemoryStore::new();
    store.mode(Mode::Hang);
    let svc = service(&store);
    let req = http::Request::post("/")
        .header("x-session-id", "s")
        .body(String::new())
        .unwrap();
    // The caller gives up before the store's deadline.
    let gave_up = tokio::time::timeout(DEADLINE / 2, svc.clone().oneshot(req)).await;
    assert!(gave_up.is_err());
    let s = svc.stats();
    assert_eq!((s.abandoned, s.rejected, s.no_backends), (1, 0, 0), "{s:?}");
    assert_eq!(s.in_flight, 0);
}

#[tokio::test(start_paused = true)]
async fn a_check_finds_the_store_down_and_up_again_with_no_request() {
    let store = MemoryStore::new();
    let svc = service(&store);
    assert_eq!(svc.check_store().await, Some(StoreState::Up));
    store.mode(Mode::Fail);
    assert_eq!(svc.check_store().await, Some(StoreState::Down));
    store.mode(Mode::Answer);
    assert_eq!(svc.check_store().await, Some(StoreState::Up));
    store.mode(Mode::Hang);
    let started = Instant::now();
    assert_eq!(svc.check_store().await, Some(StoreState::Down));
    assert_eq!(started.elapsed(), DEADLINE, "bounded by the deadline");
    let s = svc.store_stats().unwrap();
    assert_eq!(
        (s.reads, s.misses, s.hits),
        (4, 0, 0),
        "reads, not misses: {s:?}"
    );
    assert_eq!((s.errors, s.timeouts), (1, 1), "{s:?}");
    assert_eq!((s.outages, s.recoveries), (2, 1), "{s:?}");
    // Down now, found by the check: a request places by the local table at once.
    let started = Instant::now();
    send(&svc, "s").await;
    assert_eq!(started.elapsed(), Duration::ZERO);
    assert_eq!(svc.store_stats().unwrap().skipped, 1);
    // No store, nothing to check.
    let none = SessionAffinityLayer::new().layer(fleet());
    assert_eq!(none.check_store().await, None);
}

#[tokio::test(start_paused = true)]
async fn garbage_and_unknown_backends_are_ignored_counted_and_written_over() {
    let store = MemoryStore::new();
    store.mode(Mode::Garbage);
    let svc = service(&store);
    assert_eq!(send(&svc, "s").await.outcome, Outcome::NewSession);
    store.mode(Mode::Answer);
    store.put("t", "gpu-99", "node-z");
    let d = send(&svc, "t").await;
    assert_eq!(d.outcome, Outcome::NewSession);
    settle().await;
    let s = svc.store_stats().unwrap();
    assert_eq!(
        (s.garbage, s.unknown_backends, s.hits, s.state),
        (1, 1, 0, StoreState::Up),
        "{s:?}"
    );
    // Both were written over with real homes.
    assert_eq!(store.writes().len(), 2);
    assert_eq!(store.0.lock().homes[&key("t")].backend, d.backend);
}

#[tokio::test(start_paused = true)]
async fn requests_without_a_key_never_touch_the_store_and_no_store_means_no_stats() {
    let store = MemoryStore::new();
    let svc = service(&store);
    let req = http::Request::post("/").body(String::new()).unwrap();
    svc.clone().oneshot(req).await.unwrap();
    settle().await;
    let s = svc.store_stats().unwrap();
    assert_eq!((s.reads, s.writes), (0, 0));
    let plain = SessionAffinityLayer::new().layer(fleet());
    assert!(plain.store_stats().is_none());
}

#[tokio::test(start_paused = true)]
async fn a_home_that_failed_to_be_written_is_written_when_the_store_comes_back() {
    let store = MemoryStore::new();
    let svc = service(&store);
    // The store's home for the session, from before the outage.
    let first = send(&svc, "s").await;
    settle().await;
    assert_eq!(store.writes().len(), 1);
    assert!(first_placed(&store).is_some());
    // Down: reads and writes fail. The session moves (its home is busy), and the write fails.
    store.down(true);
    let moved = moved_off(&svc, "s", &first).await;
    let s = svc.store_stats().unwrap();
    assert_eq!((s.state, s.write_errors), (StoreState::Down, 1), "{s:?}");
    // Back: the probe finds it up, and the failed home is written again.
    store.down(false);
    send(&svc, "s").await;
    settle().await;
    assert_eq!(svc.store_stats().unwrap().state, StoreState::Up);
    assert_eq!(store.0.lock().homes[&key("s")].backend, moved.backend);
    // Sent again as such, with when it was placed: over the home placed before it.
    let rewrites = store.0.lock().rewrites.clone();
    assert_eq!(rewrites.len(), 1, "{rewrites:?}");
    assert!(rewrites[0].1.placed >= first_placed(&store), "{rewrites:?}");
    // So the next read sends the session where it went, not back to its old home.
    assert_eq!(send(&svc, "s").await.backend, moved.backend);
}

/// A home whose write failed while the store answered reads (refusing writes, as a Redis out
/// of memory does) is not written again at a later, unrelated recovery: another replica may
/// have written the session's home since, and the old one would send it back.
#[tokio::test(start_paused = true)]
async fn a_home_that_failed_while_the_store_answered_is_not_written_over_a_newer_one() {
    let store = MemoryStore::new();
    let svc = service(&store);
    let first = send(&svc, "s").await;
    settle().await;
    // Writes refused, reads answered. The session moves (its home is busy); the write fails.
    store.0.lock().fail_writes = true;
    let moved = moved_off(&svc, "s", &first).await;
    let stats = svc.store_stats().unwrap();
    assert_eq!(
        (stats.state, stats.write_errors),
        (StoreState::Up, 1),
        "{stats:?}"
    );
    // Writes are taken again, and another replica moves the session on and writes it.
    store.0.lock().fail_writes = false;
    let later = ["a1", "a2", "b1", "b2"]
        .into_iter()
        .find(|b| *b != first.backend.as_str() && *b != moved.backend.as_str())
        .unwrap();
    store.put(
        "s",
        later,
        if later.starts_with('a') {
            "node-a"
        } else {
            "node-b"
        },
    );
    tokio::time::advance(Duration::from_secs(60)).await;
    // Much later, an outage of its own and a recovery.
    store.mode(Mode::Fail);
    noticed(&svc, "t", StoreState::Down).await;
    store.mode(Mode::Answer);
    noticed(&svc, "u", StoreState::Up).await;
    assert_eq!(store.0.lock().homes[&key("s")].backend.as_str(), later);
}

/// Homes whose writes failed while the store answered reads, 4,096 of them (as many as are
/// kept), do not crowd out a home that fails in a later outage: that one is written when the
/// store comes back.
#[tokio::test(start_paused = true)]
async fn homes_refused_long_before_an_outage_do_not_crowd_out_one_that_failed_in_it() {
    let store = MemoryStore::new();
    let svc = service(&store);
    let first = send(&svc, "s").await;
    settle().await;
    // Writes refused, reads answered, for 4,096 new sessions.
    store.0.lock().fail_writes = true;
    for i in 0..4_096 {
        send(&svc, &format!("other-{i}")).await;
        if i % 64 == 0 {
            settle().await;
        }
    }
    settle().await;
    let stats = svc.store_stats().unwrap();
    assert_eq!(
        (stats.state, stats.write_errors),
        (StoreState::Up, 4_096),
        "{stats:?}"
    );
    store.0.lock().fail_writes = false;
    tokio::time::advance(Duration::from_secs(60)).await;
    // Much later, an outage: the session moves and its write fails.
    store.down(true);
    let moved = moved_off(&svc, "s", &first).await;
    assert_eq!(svc.store_stats().unwrap().state, StoreState::Down);
    store.down(false);
    noticed(&svc, "u", StoreState::Up).await;
    assert_eq!(
        store.0.lock().homes[&key("s")].backend,
        moved.backend,
        "the moved home failed in the outage and was not written at its recovery"
    );
}

/// An outage fails more writes than are kept (4,096): those kept are the first, each written
/// when the store comes back, and a write that fails once they fill the room is not kept.
/// They failed with the outage, so a failure seconds later, when room is wanted, does not
/// push them out.
#[tokio::test(start_paused = true)]
async fn a_full_room_of_an_outages_failed_homes_keeps_them_and_takes_no_more() {
    const KEPT: usize = 4_096;
    let store = MemoryStore::new();
    let svc = service(&store);
    noticed(&svc, "warm", StoreState::Up).await;
    store.down(true);
    // The request that finds the outage is the first whose write fails.
    noticed(&svc, "new-0", StoreState::Down).await;
    for i in 1..KEPT {
        send(&svc, &format!("new-{i}")).await;
        if i % 64 == 0 {
            settle().await;
        }
    }
    settle().await;
    assert_eq!(svc.store_stats().unwrap().write_errors, KEPT as u64);
    // Two seconds on, still down, one more home fails: there is no room for it.
    tokio::time::advance(Duration::from_secs(2)).await;
    send(&svc, "late").await;
    settle().await;
    assert_eq!(svc.store_stats().unwrap().write_errors, KEPT as u64 + 1);
    store.down(false);
    noticed(&svc, "back", StoreState::Up).await;
    for _ in 0..32 {
        settle().await;
    }
    let s = svc.store_stats().unwrap();
    assert_eq!(store.0.lock().rewrites.len(), KEPT, "{s:?}");
    let homes = &store.0.lock().homes;
    let missing = (0..KEPT)
        .filter(|i| !homes.contains_key(&key(&format!("new-{i}"))))
        .count();
    assert_eq!(
        missing, 0,
        "{missing} homes of the outage never written again: {s:?}"
    );
    assert!(!homes.contains_key(&key("late")), "{s:?}");
}

/// A home whose write failed in an outage, and then a newer home of the session written while
/// the store took writes again (its reads still failing): the older home is not sent again
/// at the recovery. A store without a compare and set would write it over the newer one.
#[tokio::test(start_paused = true)]
async fn a_failed_home_is_not_sent_again_once_a_newer_write_of_its_session_landed() {
    let store = MemoryStore::new();
    let (svc, _, moved) = moved_in_an_outage(&store).await;
    // Writes land again, reads still fail: the session moves on, and that write lands.
    store.0.lock().fail_writes = false;
    let latest = moved_off(&svc, "s", &moved).await;
    assert_eq!(store.0.lock().homes[&key("s")].backend, latest.backend);
    store.mode(Mode::Answer);
    noticed(&svc, "u", StoreState::Up).await;
    settle().await;
    let rewrites = store.0.lock().rewrites.clone();
    assert!(rewrites.is_empty(), "{rewrites:?}");
    assert_eq!(store.0.lock().homes[&key("s")].backend, latest.backend);
}

// === replicas and prompt chains ===

/// Backends whose cache models hold 10,000 tokens each.
fn small_caches() -> StaticFleet<Mock> {
    let four = NonZeroU32::new(4).unwrap();
    let b = |node: &str, name: &'static str| {
        Backend::new(node, mock(name))
            .slots(four)
            .cache_tokens(10_000)
    };
    StaticFleet::new([
        ("a1", b("node-a", "a1")),
        ("a2", b("node-a", "a2")),
        ("b1", b("node-b", "b1")),
        ("b2", b("node-b", "b2")),
    ])
}

fn replica(store: &MemoryStore) -> Svc {
    service_over(store, small_caches())
}

/// A conversation's prompt after `turns` turns: a 2,000-token system prompt, then 300 tokens
/// a turn.
fn conversation(first: u64, turns: u64) -> PromptChain {
    PromptChain::from_blocks(
        std::iter::once((first, 2_000)).chain((1..=turns).map(|t| (first + t, 300))),
    )
}

async fn send_chain(svc: &Svc, session: &str, chain: PromptChain) -> Decision {
    send_turn(svc, Some(session), chain).await
}

/// A keyless turn of `chain` through `svc`.
async fn send_keyless(svc: &Svc, chain: PromptChain) -> Decision {
    send_turn(svc, None, chain).await
}

async fn send_turn(svc: &Svc, session: Option<&str>, chain: PromptChain) -> Decision {
    let mut req = http::Request::post("/v1/chat/completions");
    if let Some(session) = session {
        req = req.header("x-session-id", session);
    }
    let mut req = req.body(String::new()).unwrap();
    req.extensions_mut().insert(PromptFacts::from_chain(chain));
    let res: Res = svc.clone().oneshot(req).await.expect("no request fails");
    let d = res.extensions().get::<Decision>().cloned().unwrap();
    // The store has what this turn wrote before the next one reads it.
    settle().await;
    d
}

/// Through `svc`, a prompt of 9,500 tokens at `home` (where the store says it lives): a model
/// of 10,000 tokens there keeps nothing older.
async fn fill(svc: &Svc, store: &MemoryStore, home: &Decision) {
    store.put("filler", home.backend.as_str(), home.node.as_str());
    let d = send_chain(svc, "filler", PromptChain::from_blocks([(900, 9_500)])).await;
    assert_eq!(d.backend, home.backend);
}

/// Two turns of session "s" through `svc`, then its model of their home filled: returns
/// where they went.
async fn two_turns_then_filled(svc: &Svc, store: &MemoryStore) -> Decision {
    let home = send_chain(svc, "s", conversation(1, 1)).await;
    let next = send_chain(svc, "s", conversation(1, 2)).await;
    assert_eq!(next.outcome, Outcome::HomeHit);
    fill(svc, store, &home).await;
    home
}

#[tokio::test(start_paused = true)]
async fn a_chained_turn_writes_where_its_prompt_ended_even_at_home() {
    let store = MemoryStore::new();
    let svc = replica(&store);
    let first = send_chain(&svc, "s", conversation(1, 1)).await;
    assert_eq!(first.outcome, Outcome::NewSession);
    let next = conversation(1, 3);
    let hit = send_chain(&svc, "s", next.clone()).await;
    assert_eq!(hit.outcome, Outcome::HomeHit);
    let writes = store.writes();
    assert_eq!(writes.len(), 2, "{writes:?}");
    let tip = next.links()[next.len() - 2].digest;
    let placed = writes[1].1.placed.expect("placed");
    assert_eq!(
        writes[1].1,
        StoredHome::new(first.backend.as_str(), first.node.as_str())
            .with_tip(tip)
            .with_placed(placed)
    );
}

#[tokio::test(start_paused = true)]
async fn a_home_another_replica_served_since_is_not_cold_on_this_one() {
    let store = MemoryStore::new();
    let (a, b) = (replica(&store), replica(&store));
    // Two turns through B, then B's model of the home fills with another prompt.
    let home = two_turns_then_filled(&b, &store).await;
    // A serves the next turn there, so the backend has used the conversation since.
    let on_a = send_chain(&a, "s", conversation(1, 3)).await;
    assert_eq!(
        (on_a.backend.clone(), on_a.outcome),
        (home.backend.clone(), Outcome::HomeHit)
    );
    // B's own model evicted the conversation, but the store says a later turn went home.
    let d = send_chain(&b, "s", conversation(1, 4)).await;
    assert_eq!((d.backend, d.outcome), (home.backend, Outcome::HomeHit));
}

#[tokio::test(start_paused = true)]
async fn a_home_this_replica_served_last_is_cold_when_its_model_evicted_it() {
    let store = MemoryStore::new();
    let b = replica(&store);
    two_turns_then_filled(&b, &store).await;
    // The store holds B's own last turn: it says nothing B's model does not know.
    let d = send_chain(&b, "s", conversation(1, 3)).await;
    assert_eq!(d.outcome, Outcome::ColdHome);
}

#[tokio::test(start_paused = true)]
async fn a_keyless_prompt_another_replica_served_is_held_where_it_went() {
    let store = MemoryStore::new();
    let (a, b) = (replica(&store), replica(&store));
    let first = send_keyless(&a, conversation(1, 3)).await;
    // B never saw the conversation: the store says where its latest turn went.
    let d = send_keyless(&b, conversation(1, 5)).await;
    assert_eq!((d.backend, d.outcome), (first.backend, Outcome::PrefixHit));
    let stats = b.store_stats().unwrap();
    assert_eq!((stats.prompt_hits, stats.prompt_own), (1, 0), "{stats:?}");
}

/// A keyless conversation's second turn, entering another replica, finds where its first
/// went, though its first prompt's tip is a system prompt other conversations open with
/// too (and wrote over): the first message is written as well, and is the conversation's own.
#[tokio::test(start_paused = true)]
async fn a_keyless_second_turn_finds_its_first_through_another_replica() {
    let store = MemoryStore::new();
    let (a, b) = (replica(&store), replica(&store));
    // A 2,000-token system prompt, then the conversation's own messages of 300 tokens.
    let turn = |c: u64, turns: u64| {
        PromptChain::from_blocks(
            std::iter::once((1, 2_000)).chain((1..=turns).map(|t| (c * 100 + t, 300))),
        )
    };
    let first = send_keyless(&a, turn(1, 1)).await;
    // Another conversation opening with the same system prompt went to another backend since,
    // through another replica, and wrote the system prompt's key over.
    let other = if first.backend.as_str() == "a1" {
        ("b1", "node-b")
    } else {
        ("a1", "node-a")
    };
    store.put_prompt(&turn(2, 1), 0, other.0, other.1);
    let d = send_keyless(&b, turn(1, 3)).await;
    assert_eq!((d.backend, d.outcome), (first.backend, Outcome::PrefixHit));
}

#[tokio::test(start_paused = true)]
async fn a_keyless_prompt_this_replica_served_last_is_left_to_its_own_model() {
    let store = MemoryStore::new();
    let b = replica(&store);
    let first = send_keyless(&b, conversation(1, 3)).await;
    // B's model of that backend then fills with another prompt: the conversation is evicted.
    fill(&b, &store, &first).await;
    // The store holds B's own write: it says nothing B's model does not know, and is not
    // taken as a fresh sign that the backend holds the prompt.
    let d = send_keyless(&b, conversation(1, 5)).await;
    assert_eq!(d.outcome, Outcome::Keyless);
    let stats = b.store_stats().unwrap();
    assert_eq!((stats.prompt_hits, stats.prompt_own), (1, 1), "{stats:?}");
}

/// A store whose reads fail and answer in turn, in the order they are made.
#[derive(Clone, Debug, Default)]
struct Flapping(Arc<std::sync::atomic::AtomicU64>);

impl HomeStore for Flapping {
    fn read(&self, _: SessionKey, _: Duration) -> ReadHome {
        let n = self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Box::pin(async move {
            match n % 2 {
                0 => Err("refused".into()),
                _ => Ok(Lookup::Missing),
            }
        })
    }

    fn write(&self, _: SessionKey, _: StoredHome, _: Duration) -> WriteHome {
        Box::pin(async { Ok(()) })
    }
}

/// Checks on two threads find a flapping store down and up again and again, while its stats
/// are read: each snapshot counts one outage more than recoveries while the store is down,
/// and as many while it is up. (No clock is involved: every read answers at once.)
#[test]
fn outages_and_recoveries_agree_with_the_state_in_every_snapshot() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let svc: Svc = SessionAffinityLayer::new()
        .home_store(Flapping::default())
        .store_deadline(Duration::from_secs(60))
        .layer(fleet());
    let checkers: Vec<_> = (0..2)
        .map(|_| {
            let checks: Vec<_> = (0..100_000).map(|_| svc.check_store()).collect();
            runtime.spawn(async move {
                for check in checks {
                    check.await;
                }
            })
        })
        .collect();
    let mut bad = None;
    while bad.is_none() && checkers.iter().any(|c| !c.is_finished()) {
        let s = svc.store_stats().unwrap();
        let down = u64::from(s.state == StoreState::Down);
        if s.outages != s.recoveries + down {
            bad = Some(s);
        }
    }
    drop(runtime);
    assert_eq!(bad, None);
}

/// More homes fail in an outage than writes may be in flight at once (1,024), but fewer than
/// are kept (4,096): every one of them is written when the store comes back, none dropped.
#[tokio::test(start_paused = true)]
async fn every_home_kept_through_an_outage_is_written_when_the_store_comes_back() {
    let store = MemoryStore::new();
    let svc = service(&store);
    noticed(&svc, "warm", StoreState::Up).await;
    store.down(true);
    noticed(&svc, "probe", StoreState::Down).await;
    // New sessions placed while it is down: each home's write fails.
    const SESSIONS: usize = 3_000;
    for i in 0..SESSIONS {
        send(&svc, &format!("new-{i}")).await;
        if i % 64 == 0 {
            settle().await;
        }
    }
    settle().await;
    let before = svc.store_stats().unwrap();
    assert_eq!(before.writes_dropped, 0, "{before:?}");
    store.down(false);
    noticed(&svc, "back", StoreState::Up).await;
    for _ in 0..16 {
        settle().await;
    }
    let homes = &store.0.lock().homes;
    let missing = (0..SESSIONS)
        .filter(|i| !homes.contains_key(&key(&format!("new-{i}"))))
        .count();
    let after = svc.store_stats().unwrap();
    assert_eq!(missing, 0, "{missing} homes never written again: {after:?}");
    assert_eq!(after.writes_dropped, 0, "{after:?}");
}

/// A write that hangs until its second is over fails after a later write of the same session
/// went through: the older home must not be written over the newer one at the store's next
/// recovery.
#[tokio::test(start_paused = true)]
async fn a_write_that_fails_after_a_newer_one_landed_is_not_written_again() {
    let store = MemoryStore::new();
    let svc = service(&store);
    let first = send(&svc, "s").await;
    settle().await;
    // Down: the session moves off its busy home, and that write hangs.
    store.mode(Mode::Fail);
    noticed(&svc, "t", StoreState::Down).await;
    store.0.lock().hang_writes = true;
    let moved = moved_off(&svc, "s", &first).await;
    store.0.lock().hang_writes = false;
    // Back, before the hanging write's second is over.
    store.mode(Mode::Answer);
    noticed(&svc, "u", StoreState::Up).await;
    // The session moves twice more, each write landing: its latest home is a third backend.
    let at_first = hold(&svc, "s").await;
    let at_moved = hold(&svc, "s").await;
    let latest = send(&svc, "s").await;
    drop((at_first, at_moved));
    settle().await;
    assert_ne!(latest.backend, moved.backend);
    assert_eq!(store.0.lock().homes[&key("s")].backend, latest.backend);
    // The hanging write fails; a short outage and a recovery follow.
    tokio::time::advance(Duration::from_millis(1_001)).await;
    settle().await;
    store.mode(Mode::Fail);
    noticed(&svc, "v", StoreState::Down).await;
    store.mode(Mode::Answer);
    noticed(&svc, "w", StoreState::Up).await;
    settle().await;
    assert_eq!(
        store.0.lock().homes[&key("s")].backend,
        latest.backend,
        "the older home, whose write failed last, was written over the newer one"
    );
}

/// A Redis coming back: the writes held up while it was away (the connection's commands wait
/// for it to reconnect) land as it answers again, in the order they were sent. A session
/// whose write failed in the outage and which has moved again since, its newer home's write
/// among those held up, is not written again with the older home at the recovery: that one
/// would land last and send the session back.
#[tokio::test(start_paused = true)]
async fn a_home_moved_again_while_its_write_waits_is_not_written_over_at_the_recovery() {
    let store = MemoryStore::new();
    let (svc, _, moved) = moved_in_an_outage(&store).await;
    // Writes now wait for the store to come back. The session moves again: its write waits.
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    {
        let mut s = store.0.lock();
        s.fail_writes = false;
        s.gate = Some(gate.clone());
    }
    let latest = moved_off(&svc, "s", &moved).await;
    // Back: the probe finds it up, and the writes held up land in their order.
    store.mode(Mode::Answer);
    noticed(&svc, "u", StoreState::Up).await;
    gate.add_permits(64);
    settle().await;
    assert_eq!(
        store.0.lock().homes[&key("s")].backend,
        latest.backend,
        "the home that failed in the outage was written over the session's latest"
    );
    assert_eq!(send(&svc, "s").await.backend, latest.backend);
}

/// When the store's first write says its home was placed.
fn first_placed(store: &MemoryStore) -> Option<SystemTime> {
    store.writes()[0].1.placed
}

/// A home whose write failed in an outage is sent again when the store comes back, but
/// another replica placed a later turn of the session meanwhile and wrote it: the store keeps
/// that one, where the newest cache is, and this replica follows it.
#[tokio::test(start_paused = true)]
async fn a_home_sent_again_after_an_outage_does_not_replace_one_placed_later() {
    let store = MemoryStore::new();
    let (svc, first, moved) = moved_in_an_outage(&store).await;
    // Another replica places the session's next turn on a third backend, a second later, and
    // its write lands as the store comes back.
    let later = ["a1", "a2", "b1", "b2"]
        .into_iter()
        .find(|b| *b != first.backend.as_str() && *b != moved.backend.as_str())
        .unwrap();
    let node = if later.starts_with('a') {
        "node-a"
    } else {
        "node-b"
    };
    let placed = SystemTime::now() + Duration::from_secs(1);
    store
        .0
        .lock()
        .homes
        .insert(key("s"), StoredHome::new(later, node).with_placed(placed));
    store.down(false);
    noticed(&svc, "u", StoreState::Up).await;
    settle().await;
    let rewrites = store.0.lock().rewrites.clone();
    assert_eq!(rewrites.len(), 1, "{rewrites:?}");
    assert_eq!(rewrites[0].1.backend, moved.backend);
    assert!(rewrites[0].1.placed < Some(placed), "{rewrites:?}");
    assert_eq!(
        store.0.lock().homes[&key("s")].backend.as_str(),
        later,
        "the home sent again replaced the one placed after it"
    );
    assert_eq!(send(&svc, "s").await.backend.as_str(), later);
}

/// A session moves twice while the store is down: the first move's write is slow, the
/// second's fails at once, and then the slow one lands. The store holds the older home; the
/// newer one, whose write failed, is still written when the store comes back.
#[tokio::test(start_paused = true)]
async fn a_failed_home_is_kept_when_an_older_write_of_its_session_lands_after_it() {
    let store = MemoryStore::new();
    let svc = service(&store);
    let first = send(&svc, "s").await;
    settle().await;
    store.mode(Mode::Fail);
    noticed(&svc, "t", StoreState::Down).await;
    // The first move's write waits at the gate.
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    store.0.lock().gate = Some(gate.clone());
    let moved = moved_off(&svc, "s", &first).await;
    // The second move's write fails.
    {
        let mut s = store.0.lock();
        s.gate = None;
        s.fail_writes = true;
    }
    let latest = moved_off(&svc, "s", &moved).await;
    // The slow write lands: the store holds the older home.
    store.0.lock().fail_writes = false;
    gate.add_permits(1);
    settle().await;
    assert_eq!(store.0.lock().homes[&key("s")].backend, moved.backend);
    // Back: the newer home is written again over it.
    store.mode(Mode::Answer);
    noticed(&svc, "u", StoreState::Up).await;
    settle().await;
    assert_eq!(
        store.0.lock().homes[&key("s")].backend,
        latest.backend,
        "the older write's landing dropped the newer home that failed"
    );
    assert_eq!(send(&svc, "s").await.backend, latest.backend);
}

/// A write made while the store is down hangs, the store comes back, and the write fails
/// after that, its second over: it failed with the outage, and is written again at once, not
/// kept until a recovery that would no longer count it as the outage's.
#[tokio::test(start_paused = true)]
async fn a_write_of_the_outage_that_fails_after_the_recovery_is_written_again() {
    let store = MemoryStore::new();
    let svc = service(&store);
    let first = send(&svc, "s").await;
    settle().await;
    store.mode(Mode::Fail);
    noticed(&svc, "t", StoreState::Down).await;
    // Down: the session moves off its busy home, and that write hangs.
    store.0.lock().hang_writes = true;
    let moved = moved_off(&svc, "s", &first).await;
    store.0.lock().hang_writes = false;
    // Back, before the hanging write's second is over; then it fails.
    store.mode(Mode::Answer);
    noticed(&svc, "u", StoreState::Up).await;
    tokio::time::advance(Duration::from_millis(1_001)).await;
    settle().await;
    assert_eq!(svc.store_stats().unwrap().write_errors, 1);
    assert_eq!(
        store.0.lock().homes[&key("s")].backend,
        moved.backend,
        "the home that failed with the outage was not written again"
    );
    assert_eq!(send(&svc, "s").await.backend, moved.backend);
}

/// A keyless request's read asks for several links at once; it is still one read, counted
/// once by what it found, as a session's read is.
#[tokio::test(start_paused = true)]
async fn a_keyless_read_counts_once_whatever_each_link_found() {
    let store = MemoryStore::new();
    let svc = replica(&store);
    // Garbage at every link.
    store.mode(Mode::Garbage);
    send_keyless(&svc, conversation(1, 5)).await;
    let s = svc.store_stats().unwrap();
    assert_eq!((s.reads, s.garbage, s.misses), (1, 1, 0), "{s:?}");
    // Homes at two links, both on a backend this replica does not know.
    store.mode(Mode::Answer);
    let chain = conversation(11, 5);
    store.put_prompt(&chain, 3, "gpu-98", "node-y");
    store.put_prompt(&chain, 4, "gpu-99", "node-z");
    send_keyless(&svc, chain).await;
    let s = svc.store_stats().unwrap();
    assert_eq!((s.reads, s.unknown_backends, s.hits), (2, 1, 0), "{s:?}");
    // One on an unknown backend, the shorter on a known one: a hit.
    let chain = conversation(21, 5);
    store.put_prompt(&chain, 4, "gpu-99", "node-z");
    store.put_prompt(&chain, 3, "b1", "node-b");
    send_keyless(&svc, chain).await;
    let s = svc.store_stats().unwrap();
    assert_eq!((s.reads, s.unknown_backends, s.hits), (3, 1, 1), "{s:?}");
    let outcomes = s.hits + s.misses + s.garbage + s.unknown_backends + s.timeouts + s.errors;
    assert_eq!(outcomes, s.reads, "{s:?}");
}

/// A store behind this replica (a write of its lost: a Redis restored from an older
/// snapshot, or a failover that lost the last writes) holds the home of an earlier turn than
/// the one this replica placed elsewhere since: the session stays where this replica's later
/// turn went, and that home is written over the stale one.
#[tokio::test(start_paused = true)]
async fn a_home_the_store_holds_from_before_this_replicas_later_turn_elsewhere_is_not_taken() {
    let store = MemoryStore::new();
    let svc = service(&store);
    let first = send_chain(&svc, "s", conversation(1, 1)).await;
    let stale = store.0.lock().homes[&key("s")].clone();
    assert_eq!(stale.backend, first.backend);
    // The next turn goes elsewhere (its home is busy), and is written.
    let busy = hold(&svc, "s").await;
    let moved = send_chain(&svc, "s", conversation(1, 2)).await;
    assert_ne!(moved.backend, first.backend);
    drop(busy);
    settle().await;
    assert_eq!(store.0.lock().homes[&key("s")].backend, moved.backend);
    // The store loses that write: it holds the first turn's home again.
    store.0.lock().homes.insert(key("s"), stale);
    let next = send_chain(&svc, "s", conversation(1, 3)).await;
    assert_eq!(next.backend, moved.backend, "{next:?}");
    assert_eq!(store.0.lock().homes[&key("s")].backend, moved.backend);
}

/// Another replica placed the turn this replica placed elsewhere (the same turn, sent to it
/// again): the stored home ends where this replica's own last turn ended, so the store is
/// not behind, and the session follows the store.
#[tokio::test(start_paused = true)]
async fn a_home_the_store_holds_from_the_turn_this_replica_placed_elsewhere_is_taken() {
    let store = MemoryStore::new();
    let svc = service(&store);
    let first = send_chain(&svc, "s", conversation(1, 1)).await;
    // The next turn goes elsewhere (its home is busy), and is written.
    let busy = hold(&svc, "s").await;
    let turn = conversation(1, 2);
    let moved = send_chain(&svc, "s", turn.clone()).await;
    assert_ne!(moved.backend, first.backend);
    drop(busy);
    settle().await;
    // Another replica placed the same turn on the first home since.
    let tip = turn.links()[turn.len() - 2].digest;
    let other = StoredHome::new(first.backend.as_str(), first.node.as_str())
        .with_tip(tip)
        .with_placed(SystemTime::now());
    store.0.lock().homes.insert(key("s"), other);
    let next = send_chain(&svc, "s", conversation(1, 3)).await;
    assert_eq!(next.backend, first.backend, "{next:?}");
}
