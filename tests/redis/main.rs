//! The `redis` feature against a real `redis-server`, which each test starts on a free
//! loopback port and kills when it ends. Real time: the server is a real process on real
//! sockets, so every wait is bounded in count and in time.
//!
//! Without `redis-server` on the `PATH` these tests fail, unless `TOWER_AFFINITY_SKIP_REDIS=1`
//! is set, in which case they say loudly that they skipped.

use std::convert::Infallible;
use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tower::util::BoxCloneService;
use tower::{service_fn, Layer, ServiceExt};
use tower_affinity::discover::StaticFleet;
use tower_affinity::key::SessionKey;
use tower_affinity::store::{RedisStore, StoreState, StoredHome};
use tower_affinity::{Backend, Decision, Outcome, Overflow, SessionAffinityLayer, Sessions};

type Req = http::Request<String>;
type Mock = BoxCloneService<Req, http::Response<String>, Infallible>;
type Svc = tower_affinity::SessionAffinity<
    StaticFleet<Mock>,
    tower_affinity::key::HeaderKey,
    tower_affinity::placement::NodeThenBackend,
>;

#[path = "../support/logs.rs"]
mod logs;
#[path = "../support/redis_server.rs"]
mod redis_server;

use redis_server::{redis_missing, RedisServer};

// === the fleet ===

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap()
}

fn mock(name: &'static str) -> Mock {
    BoxCloneService::new(service_fn(move |_req: Req| async move {
        Ok::<_, Infallible>(http::Response::new(name.to_string()))
    }))
}

/// Four backends of one slot on two nodes: the same fleet in every replica.
fn fleet() -> StaticFleet<Mock> {
    StaticFleet::new([
        ("a1", Backend::new("node-a", mock("a1")).slots(nz(1))),
        ("a2", Backend::new("node-a", mock("a2")).slots(nz(1))),
        ("b1", Backend::new("node-b", mock("b1")).slots(nz(1))),
        ("b2", Backend::new("node-b", mock("b2")).slots(nz(1))),
    ])
}

/// A router replica on the shared store at `url`.
fn replica(url: &str, deadline: Duration, reconnect: Duration) -> Svc {
    let store = RedisStore::builder()
        .reconnect_interval(reconnect)
        .open(url)
        .unwrap();
    SessionAffinityLayer::new()
        .overflow(Overflow::Overcommit)
        .store_deadline(deadline)
        .home_store(store)
        .layer(fleet())
}

fn turn(session: &str) -> Req {
    http::Request::post("/v1/chat/completions")
        .header("x-session-id", session)
        .body(String::new())
        .unwrap()
}

type Res = http::Response<tower_affinity::ResponseBody<String>>;

async fn send(svc: &Svc, session: &str) -> Res {
    svc.clone()
        .oneshot(turn(session))
        .await
        .expect("no request fails")
}

fn decision(res: &Res) -> Decision {
    res.extensions().get::<Decision>().cloned().unwrap()
}

/// The string at `key`; `None` if there is none, or a value of another type.
async fn get(conn: &mut redis::aio::MultiplexedConnection, key: &str) -> Option<String> {
    redis::cmd("GET")
        .arg(key)
        .query_async(conn)
        .await
        .ok()
        .flatten()
}

/// Waits (for at most 10 s, as a loaded machine may need) until Redis holds `key`'s home on
/// `backend`: writes are not awaited by the request that makes them.
async fn until_stored(conn: &mut redis::aio::MultiplexedConnection, key: &str, backend: &str) {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(10) {
        let v = get(conn, key).await;
        if v.as_deref()
            .and_then(|v| StoredHome::decode(v.as_bytes()))
            .is_some_and(|h| h.backend.as_str() == backend)
        {
            return;
        }
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    panic!("Redis never held {key} on {backend}");
}

fn key_of(session: &str) -> String {
    format!(
        "{}{}",
        RedisStore::DEFAULT_PREFIX,
        SessionKey::from_bytes(session.as_bytes())
    )
}

/// One turn of every session, entering through either replica in turn; every one must
/// succeed.
async fn round(replicas: &[Svc], sessions: &[String], requests: &mut u32) {
    for (i, s) in sessions.iter().enumerate() {
        let r = &replicas[(i + *requests as usize) % replicas.len()];
        let res = send(r, s).await;
        assert_eq!(res.status(), http::StatusCode::OK);
    }
    *requests += sessions.len() as u32;
}

/// The store's deadline wherever Redis is meant to answer: long enough that a loaded
/// machine's Redis still answers in time (50 ms read as a timeout on a busy CI run, an outage
/// that never happened). A stopped Redis refuses at once, without waiting for it.
const PATIENT: Duration = Duration::from_secs(5);
const RECONNECT: Duration = Duration::from_millis(300);

/// Two replicas sharing `redis`, with the patient deadline and the tests' reconnect interval.
fn two_replicas(redis: &RedisServer) -> (Svc, Svc) {
    let url = redis.url();
    (
        replica(&url, PATIENT, RECONNECT),
        replica(&url, PATIENT, RECONNECT),
    )
}

// === tests ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spill_on_one_replica_moves_the_next_turn_on_the_other() {
    let Some(redis) = RedisServer::start().await else {
        return;
    };
    let (a, b) = two_replicas(&redis);
    let mut conn = redis.client().await;
    // The first turn, through A: rendezvous picks the home, and A writes it.
    let first = send(&a, "agent-1").await;
    let home = decision(&first);
    assert_eq!(home.outcome, Outcome::NewSession);
    until_stored(&mut conn, &key_of("agent-1"), home.backend.as_str()).await;
    // Its home busy (the first turn's answer still streaming), the next turn through A spills.
    let second = send(&a, "agent-1").await;
    let spilled = decision(&second);
    assert_ne!(spilled.backend, home.backend);
    assert!(matches!(
        spilled.outcome,
        Outcome::SameNodeSpill | Outcome::CrossNodeSpill
    ));
    drop(first);
    drop(second);
    until_stored(&mut conn, &key_of("agent-1"), spilled.backend.as_str()).await;
    // B never saw the session: its local table and rendezvous would send it to the old home.
    // The shared store sends it where the spill went.
    let third = send(&b, "agent-1").await;
    let d = decision(&third);
    assert_eq!(d.backend, spilled.backend, "B follows A's spill");
    assert_eq!(d.outcome, Outcome::HomeHit);
    let s = b.store_stats().unwrap();
    assert_eq!((s.reads, s.hits), (1, 1), "{s:?}");
    assert_eq!(s.writes, 0, "B had nothing new to write: {s:?}");
    // A replica without the store sends that turn to the first home.
    let alone = SessionAffinityLayer::new().layer(fleet());
    let lost = decision(&alone.oneshot(turn("agent-1")).await.unwrap());
    assert_eq!(lost.backend, home.backend);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_and_restarted_fails_no_request_and_affinity_comes_back() {
    let Some(mut redis) = RedisServer::start().await else {
        return;
    };
    let replicas = [
        replica(&redis.url(), PATIENT, RECONNECT),
        replica(&redis.url(), PATIENT, RECONNECT),
    ];
    let sessions: Vec<String> = (0..8).map(|i| format!("agent-{i}")).collect();
    let mut requests = 0u32;
    for _ in 0..4 {
        round(&replicas, &sessions, &mut requests).await;
    }
    for r in &replicas {
        let s = r.store_stats().unwrap();
        assert_eq!(s.state, StoreState::Up);
        assert!(s.hits > 0, "{s:?}");
    }

    redis.kill().await;
    // Every request still succeeds, and within a bounded number of rounds both replicas have
    // seen the store go down.
    let started = Instant::now();
    for _ in 0..200 {
        round(&replicas, &sessions, &mut requests).await;
        if replicas
            .iter()
            .all(|r| r.store_stats().unwrap().state == StoreState::Down)
        {
            break;
        }
    }
    for r in &replicas {
        let s = r.store_stats().unwrap();
        assert_eq!(s.state, StoreState::Down, "{s:?}");
        assert_eq!(s.outages, 1, "{s:?}");
    }
    // While it is down, requests do not wait for it: each request of a round is one that did
    // not (the probe reads go on in tasks of their own).
    let skipped = || -> u64 {
        replicas
            .iter()
            .map(|r| r.store_stats().unwrap().skipped)
            .sum()
    };
    let before = skipped();
    round(&replicas, &sessions, &mut requests).await;
    assert_eq!(
        skipped() - before,
        sessions.len() as u64,
        "a request waited"
    );
    // Down long enough for the reconnect backoff to reach its cap: traffic goes on, paced.
    while started.elapsed() < 3 * RECONNECT {
        round(&replicas, &sessions, &mut requests).await;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    redis.restart().await;
    let back = Instant::now();
    let hits: Vec<u64> = replicas
        .iter()
        .map(|r| r.store_stats().unwrap().hits)
        .collect();
    // Back when each replica's reads hit again: the restarted Redis is empty, the first turns
    // write their homes, and the next ones read them.
    let mut recovered = None;
    for _ in 0..2000 {
        round(&replicas, &sessions, &mut requests).await;
        let all = replicas
            .iter()
            .zip(&hits)
            .all(|(r, &h)| r.store_stats().unwrap().hits > h);
        if all {
            recovered = Some(back.elapsed());
            break;
        }
        if back.elapsed() > Duration::from_secs(20) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let recovered = recovered.expect("reads hit again after the restart");
    eprintln!(
        "affinity back {recovered:?} after Redis answered again ({requests} requests, none failed)"
    );
    // One reconnect interval, and a deadline and some scheduling for the read that finds it.
    assert!(recovered < RECONNECT + PATIENT, "took {recovered:?}");
    for r in &replicas {
        let s = r.store_stats().unwrap();
        assert_eq!(s.state, StoreState::Up, "{s:?}");
        assert_eq!((s.outages, s.recoveries), (1, 1), "{s:?}");
    }
    // Affinity: after the restart the replicas agree again on every session.
    for s in &sessions {
        let x = decision(&send(&replicas[0], s).await).backend;
        let y = decision(&send(&replicas[1], s).await).backend;
        assert_eq!(x, y, "{s}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_never_answers_never_holds_a_request_past_the_deadline() {
    if redis_missing() {
        return;
    }
    // Accepts connections and never answers a byte.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("redis://{}", listener.local_addr().unwrap());
    let silent = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = listener.accept().await {
            held.push(s);
        }
    });
    let deadline = Duration::from_millis(20);
    let svc = replica(&url, deadline, RECONNECT);
    let mut slowest = Duration::ZERO;
    for i in 0..40 {
        let t = Instant::now();
        let res = send(&svc, &format!("agent-{}", i % 4)).await;
        assert_eq!(res.status(), http::StatusCode::OK);
        slowest = slowest.max(t.elapsed());
    }
    let s = svc.store_stats().unwrap();
    eprintln!("slowest request {slowest:?} with a {deadline:?} deadline; {s:?}");
    // The deadline, and scheduling on a loaded machine (which can keep a thread off the CPU
    // for a good part of a second): a request held until Redis answers would never end.
    assert!(slowest < deadline + Duration::from_secs(2), "{slowest:?}");
    assert_eq!(s.state, StoreState::Down);
    assert_eq!(s.outages, 1);
    assert!(s.timeouts >= 1 && s.hits == 0, "{s:?}");
    // Only the first read made a request wait; the probes after it went on in tasks.
    assert!(s.skipped >= 38, "{s:?}");
    silent.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_in_redis_is_ignored_counted_and_written_over() {
    let Some(redis) = RedisServer::start().await else {
        return;
    };
    let mut conn = redis.client().await;
    let () = redis::cmd("SET")
        .arg(key_of("not-json"))
        .arg("v1 a1 node-a")
        .query_async(&mut conn)
        .await
        .unwrap();
    let () = redis::cmd("SET")
        .arg(key_of("unknown-backend"))
        .arg(StoredHome::new("gpu-99", "node-z").encode())
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: i64 = redis::cmd("HSET")
        .arg(key_of("a-hash"))
        .arg("field")
        .arg("value")
        .query_async(&mut conn)
        .await
        .unwrap();
    let svc = replica(&redis.url(), PATIENT, RECONNECT);
    for s in ["not-json", "unknown-backend", "a-hash"] {
        let d = decision(&send(&svc, s).await);
        assert_eq!(
            d.outcome,
            Outcome::NewSession,
            "{s}: placed as if the store had nothing"
        );
        until_stored(&mut conn, &key_of(s), d.backend.as_str()).await;
    }
    let st = svc.store_stats().unwrap();
    assert_eq!(
        (
            st.reads,
            st.garbage,
            st.unknown_backends,
            st.hits,
            st.errors
        ),
        (3, 2, 1, 0, 0),
        "{st:?}"
    );
    assert_eq!(st.state, StoreState::Up);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_holds_digests_under_the_prefix_never_raw_keys() {
    let Some(redis) = RedisServer::start().await else {
        return;
    };
    let store = RedisStore::builder()
        .prefix("test-fleet:home:")
        .open(&redis.url())
        .unwrap();
    let idle = Duration::from_secs(600);
    let svc = SessionAffinityLayer::new()
        .sessions(Sessions::new().idle_timeout(idle))
        .home_store(store)
        .layer(fleet());
    let mut conn = redis.client().await;
    let sessions = ["agent-one", "agent-two", "agent-three"];
    let mut expected = Vec::new();
    for s in sessions {
        let d = decision(&svc.clone().oneshot(turn(s)).await.unwrap());
        let key = format!("test-fleet:home:{}", SessionKey::from_bytes(s.as_bytes()));
        until_stored(&mut conn, &key, d.backend.as_str()).await;
        let v = get(&mut conn, &key).await.unwrap();
        let h = StoredHome::decode(v.as_bytes()).unwrap();
        assert_eq!((&h.backend, &h.node, h.tip), (&d.backend, &d.node, None));
        assert!(h.placed.is_some(), "{h:?}");
        let ttl: i64 = redis::cmd("PTTL")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert!(ttl > 0 && ttl <= idle.as_millis() as i64, "{ttl}");
        expected.push(key);
    }
    let mut keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut conn)
        .await
        .unwrap();
    keys.sort();
    expected.sort();
    assert_eq!(keys, expected);
    for k in &keys {
        let hex = k.strip_prefix("test-fleet:home:").unwrap();
        assert_eq!(hex.len(), 32);
        assert!(hex.bytes().all(|b| b.is_ascii_hexdigit()));
        assert!(sessions.iter().all(|s| !k.contains(s)));
    }
}

/// The `redis` crate's connection manager reconnects after I/O errors only: once all its
/// attempts failed on a refused password, the store must still try again, so that it reads
/// Redis once the password is right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_refused_its_password_connects_once_the_password_is_right() {
    use tower_affinity::store::HomeStore;
    let Some(redis) = RedisServer::start().await else {
        return;
    };
    let mut admin = redis.client().await;
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("requirepass")
        .arg("old")
        .query_async(&mut admin)
        .await
        .unwrap();
    let store = RedisStore::builder()
        .reconnect_interval(Duration::from_millis(50))
        .open(&format!("redis://:new@127.0.0.1:{}", redis.port))
        .unwrap();
    let session = SessionKey::from_bytes(b"a session");
    let ttl = Duration::from_secs(60);
    // Until the manager's attempts are over: its error comes only then.
    let mut refused = false;
    for _ in 0..100 {
        if let Err(e) = store.read(session, ttl).await {
            assert!(e.to_string().contains("authentication"), "{e}");
            refused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(refused, "the wrong password was never refused");
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("requirepass")
        .arg("new")
        .query_async(&mut admin)
        .await
        .unwrap();
    let start = Instant::now();
    let mut last = None;
    while start.elapsed() < Duration::from_secs(10) {
        match store.read(session, ttl).await {
            Ok(found) => {
                assert_eq!(found, tower_affinity::store::Lookup::Missing);
                return;
            }
            Err(e) => last = Some(e.to_string()),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("never read Redis with the right password: {last:?}");
}

/// A store that cannot connect says why in the log (its reads only time out at their
/// deadline while the connection manager still tries): a refused password, once however
/// long it stays wrong and never with the password; a port that refuses connections; and
/// once it connects, that it did.
#[tokio::test]
async fn a_store_that_cannot_connect_logs_why_once() {
    let Some(redis) = RedisServer::start().await else {
        return;
    };
    let logs = logs::capture(tracing::Level::INFO);
    let mut admin = redis.client().await;
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("requirepass")
        .arg("right")
        .query_async(&mut admin)
        .await
        .unwrap();
    let reconnect = Duration::from_millis(50);
    let wrong = replica(
        &format!("redis://:s3cret@127.0.0.1:{}/2", redis.port),
        Duration::from_millis(20),
        reconnect,
    );
    let why = [
        "cannot connect to the shared session store",
        "authentication",
    ];
    let start = Instant::now();
    // Requests go on (each probes the store while it is down, and a probe's failure starts
    // the manager again) until the refusal was logged, and some more.
    let mut logged = None;
    for i in 0..400 {
        let res = send(&wrong, &format!("agent-{}", i % 4)).await;
        assert_eq!(res.status(), http::StatusCode::OK);
        if logged.is_none() && logs.count(&why) > 0 {
            logged = Some(start.elapsed());
        }
        if logged.is_some_and(|at| start.elapsed() > at + 10 * reconnect) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(start.elapsed() < Duration::from_secs(20), "{}", logs.text());
    }
    let text = logs.text();
    assert!(
        logged.is_some(),
        "the refused password was never logged: {text}"
    );
    assert_eq!(logs.count(&why), 1, "{text}");
    assert_eq!(logs.count(&why[..1]), 1, "{text}");
    assert_eq!(logs.count(&["127.0.0.1", "db=2"]), 1, "{text}");
    assert!(!text.contains("s3cret"), "{text}");
    // The password set right: the store connects, and says so.
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("requirepass")
        .arg("s3cret")
        .query_async(&mut admin)
        .await
        .unwrap();
    let connected = ["connected to the shared session store"];
    for i in 0..400 {
        if logs.count(&connected) > 0 {
            break;
        }
        send(&wrong, &format!("agent-{}", i % 4)).await;
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(start.elapsed() < Duration::from_secs(40), "{}", logs.text());
    }
    assert_eq!(logs.count(&connected), 1, "{}", logs.text());

    // Nothing listens on the port of a Redis that is gone.
    let mut gone = RedisServer::start().await.unwrap();
    let url = gone.url();
    gone.kill().await;
    let _refused = replica(&url, Duration::from_millis(20), reconnect);
    for _ in 0..200 {
        if logs.count(&["cannot connect", "refused"]) > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(
        logs.count(&["cannot connect", "refused"]),
        1,
        "{}",
        logs.text()
    );
}

/// A Redis ACL user for the store that may not `SELECT` the database its URL names: every
/// connection is refused as it opens, with an error the `redis` crate's manager does not
/// reconnect after. Once the user may, the store connects and reads Redis again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_refused_its_database_connects_once_it_is_allowed() {
    use tower_affinity::store::HomeStore;
    let Some(redis) = RedisServer::start().await else {
        return;
    };
    let mut admin = redis.client().await;
    let acl = |rules: &[&str]| {
        let mut cmd = redis::cmd("ACL");
        cmd.arg("SETUSER").arg("store").arg(rules);
        cmd
    };
    let () = acl(&[
        "on",
        ">pw",
        "~tower-affinity:*",
        "+getrange",
        "+pexpire",
        "+set",
        "+ping",
    ])
    .query_async(&mut admin)
    .await
    .unwrap();
    let store = RedisStore::builder()
        .reconnect_interval(Duration::from_millis(50))
        .open(&format!("redis://store:pw@127.0.0.1:{}/1", redis.port))
        .unwrap();
    let session = SessionKey::from_bytes(b"a session");
    let ttl = Duration::from_secs(60);
    let mut refused = false;
    for _ in 0..100 {
        if let Err(e) = store.read(session, ttl).await {
            assert!(e.to_string().contains("switch database"), "{e}");
            refused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(refused, "the database was never refused");
    let () = acl(&["+select"]).query_async(&mut admin).await.unwrap();
    let start = Instant::now();
    let mut last = None;
    while start.elapsed() < Duration::from_secs(10) {
        match store.read(session, ttl).await {
            Ok(found) => {
                assert_eq!(found, tower_affinity::store::Lookup::Missing);
                return;
            }
            Err(e) => last = Some(e.to_string()),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("never read Redis once its database was allowed: {last:?}");
}

/// A session table that never forgets (an idle timeout of `Duration::MAX`, which it takes as
/// its longest) has a store that keeps homes as long: Redis refuses a `PX` that takes the
/// expiry past its clock's range, which failed every read and write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_longest_idle_timeout_keeps_homes_in_redis_and_reads_them() {
    use tower_affinity::store::{HomeStore, Lookup};
    let Some(redis) = RedisServer::start().await else {
        return;
    };
    let store = RedisStore::open(&redis.url()).unwrap();
    let session = SessionKey::from_bytes(b"a session");
    let home = StoredHome::new("a1", "node-a");
    for ttl in [Duration::MAX, Duration::from_secs(u64::MAX / 1000)] {
        store.write(session, home.clone(), ttl).await.unwrap();
        assert_eq!(
            store.read(session, ttl).await.unwrap(),
            Lookup::Home(home.clone())
        );
        store.write_prompt(7, home.clone(), ttl).await.unwrap();
        assert_eq!(
            store.read_prompts(&[7], ttl).await.unwrap(),
            [Lookup::Home(home.clone())]
        );
    }
    let mut conn = redis.client().await;
    let ttl: i64 = redis::cmd("PTTL")
        .arg(store.key_of(session))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(ttl > 100 * 365 * 24 * 3600 * 1000, "{ttl}");
    // And through the service: the store stays up.
    let svc = SessionAffinityLayer::new()
        .sessions(Sessions::new().idle_timeout(Duration::MAX))
        .home_store(store)
        .layer(fleet());
    let d = decision(&svc.clone().oneshot(turn("forever")).await.unwrap());
    until_stored(&mut conn, &key_of("forever"), d.backend.as_str()).await;
    let st = svc.store_stats().unwrap();
    assert_eq!((st.errors, st.state), (0, StoreState::Up), "{st:?}");
}

#[test]
fn opening_a_store_outside_a_runtime_is_an_error_not_a_panic() {
    let e = RedisStore::open("redis://127.0.0.1:1").unwrap_err();
    assert!(e.to_string().contains("Tokio runtime"), "{e}");
    assert!(RedisStore::open("not a url").is_err());
}

// === keyless conversations ===

/// Turn `turn` of keyless conversation `c`: a system prompt all share, then its own blocks,
/// two more each turn (an answer and a tool's output).
fn keyless_chain(c: u64, turn: u64) -> tower_affinity::PromptChain {
    let own = (0..2 * turn + 2).map(|j| (1_000 * (c + 1) + j, 300));
    tower_affinity::PromptChain::from_blocks(std::iter::once((1, 2_000)).chain(own))
}

fn keyless_turn(chain: tower_affinity::PromptChain) -> Req {
    let mut req = http::Request::post("/v1/chat/completions")
        .body(String::new())
        .unwrap();
    req.extensions_mut()
        .insert(tower_affinity::key::PromptFacts::from_chain(chain));
    req
}

/// Where a keyless prompt's tip's home is kept.
fn prompt_key(chain: &tower_affinity::PromptChain) -> String {
    let links = chain.links();
    link_key(links[links.len().saturating_sub(2)].digest)
}

/// Where a keyless prompt's last link's home is kept (written after the tip's).
fn last_link_key(chain: &tower_affinity::PromptChain) -> String {
    link_key(chain.links().last().unwrap().digest)
}

fn link_key(digest: u64) -> String {
    format!(
        "{}{}{digest:016x}",
        RedisStore::DEFAULT_PREFIX,
        RedisStore::PROMPT_PREFIX
    )
}

/// Until both of a keyless turn's writes (its tip's, then its last link's) have landed.
async fn until_prompt_stored(
    conn: &mut redis::aio::MultiplexedConnection,
    chain: &tower_affinity::PromptChain,
    backend: &str,
) {
    until_stored(conn, &prompt_key(chain), backend).await;
    until_stored(conn, &last_link_key(chain), backend).await;
}

/// Conversation `c` through replicas `a` and `b` (the same one twice: one replica): its
/// first turn through A, its second through A too while the first's answer still holds the
/// slot, so that it spills; then four more, entering B, A, B, A. Returns the backend the
/// spill went to and the backends of the four.
async fn keyless_conversation(
    a: &Svc,
    b: &Svc,
    c: u64,
    mut conn: Option<&mut redis::aio::MultiplexedConnection>,
) -> (String, Vec<String>) {
    let backend = |res: &Res| decision(res).backend.as_str().to_string();
    let first = a
        .clone()
        .oneshot(keyless_turn(keyless_chain(c, 0)))
        .await
        .unwrap();
    let second_chain = keyless_chain(c, 1);
    let second = a
        .clone()
        .oneshot(keyless_turn(second_chain.clone()))
        .await
        .unwrap();
    let spilled = backend(&second);
    assert_ne!(spilled, backend(&first), "the second turn spilled");
    drop((first, second));
    if let Some(conn) = conn.as_deref_mut() {
        until_prompt_stored(conn, &second_chain, &spilled).await;
    }
    let mut later = Vec::new();
    for turn in 2..6 {
        let via = if turn % 2 == 0 { b } else { a };
        let chain = keyless_chain(c, turn);
        let res = via
            .clone()
            .oneshot(keyless_turn(chain.clone()))
            .await
            .unwrap();
        let landed = backend(&res);
        drop(res);
        if let Some(conn) = conn.as_deref_mut() {
            until_prompt_stored(conn, &chain, &landed).await;
        }
        later.push(landed);
    }
    (spilled, later)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyless_turns_alternating_between_replicas_stay_where_a_spill_went() {
    let Some(redis) = RedisServer::start().await else {
        return;
    };
    let (a, b) = two_replicas(&redis);
    let mut conn = redis.client().await;
    for c in 0..8 {
        let (spilled, later) = keyless_conversation(&a, &b, c, Some(&mut conn)).await;
        assert!(
            later.iter().all(|l| *l == spilled),
            "conversation {c}: spilled to {spilled}, then {later:?}"
        );
    }
    let (sa, sb) = (a.store_stats().unwrap(), b.store_stats().unwrap());
    // B read every one of its turns' prompts in time and found the latest turn's backend.
    assert_eq!((sb.prompt_reads, sb.prompt_hits), (16, 16), "{sb:?}");
    // Every read of a turn before which the other replica served one found that one's write
    // (16 on each); A's second turns found A's own first turns when their writes had landed
    // (the test waits for writes only from the second turn on), and left them to A's model.
    assert_eq!(sb.prompt_own, 0, "{sb:?}");
    assert_eq!(sa.prompt_own, sa.prompt_hits - 16, "{sa:?}");
    assert_eq!(sb.prompt_writes, 16, "{sb:?}");
    assert_eq!(sa.prompt_writes, 32, "{sa:?}");
    assert_eq!((sa.timeouts + sb.timeouts, sa.errors + sb.errors), (0, 0));
    // Apart from the sessions' keys, and holding homes.
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{}*", RedisStore::DEFAULT_PREFIX))
        .query_async(&mut conn)
        .await
        .unwrap();
    // Each turn's tip and its last link.
    assert_eq!(keys.len(), 8 * 6 * 2, "{keys:?}");
    for k in &keys {
        assert!(k.starts_with("tower-affinity:home:prompt:"), "{k}");
        let v = get(&mut conn, k).await.unwrap();
        assert!(StoredHome::decode(v.as_bytes()).is_some(), "{k}: {v}");
    }

    // Two replicas without the store: B knows nothing of A's spill, and places the
    // conversation's turns by its own cache model.
    let (a, b) = (
        SessionAffinityLayer::new()
            .overflow(Overflow::Overcommit)
            .layer(fleet()),
        SessionAffinityLayer::new()
            .overflow(Overflow::Overcommit)
            .layer(fleet()),
    );
    let mut kept = 0;
    for c in 0..8 {
        let (spilled, later) = keyless_conversation(&a, &b, c, None).await;
        kept += usize::from(later.iter().all(|l| *l == spilled));
    }
    println!("without the store, {kept} of 8 conversations kept their backend");
    assert!(
        kept <= 6,
        "without the store, {kept} of 8 conversations kept their backend"
    );
}

// === the home's tip ===

fn keyed_turn(session: &str, chain: tower_affinity::PromptChain) -> Req {
    let mut req = turn(session);
    req.extensions_mut()
        .insert(tower_affinity::key::PromptFacts::from_chain(chain));
    req
}

/// Where a prompt's turn ended: the link a home's tip names.
fn tip_of(chain: &tower_affinity::PromptChain) -> u64 {
    let links = chain.links();
    links[links.len().saturating_sub(2)].digest
}

async fn stored(conn: &mut redis::aio::MultiplexedConnection, session: &str) -> StoredHome {
    let v = get(conn, &key_of(session)).await.expect("a home");
    StoredHome::decode(v.as_bytes()).expect("a home")
}

/// Waits (bounded) until the home of `session` has tip `tip`.
async fn until_tip(conn: &mut redis::aio::MultiplexedConnection, session: &str, tip: u64) {
    for _ in 0..500 {
        if get(conn, &key_of(session))
            .await
            .and_then(|v| StoredHome::decode(v.as_bytes()))
            .is_some_and(|h| h.tip == Some(tip))
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    panic!("the home of {session} never had tip {tip:016x}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_homes_tip_tells_another_replica_a_compaction_and_an_old_value_still_reads() {
    let Some(redis) = RedisServer::start().await else {
        return;
    };
    let (a, b) = two_replicas(&redis);
    let mut conn = redis.client().await;
    let sent = |svc: &Svc, session: &str, chain: &tower_affinity::PromptChain| {
        svc.clone().oneshot(keyed_turn(session, chain.clone()))
    };
    let first = tower_affinity::PromptChain::from_blocks([(1, 2_000), (2, 300), (3, 300)]);
    let next = tower_affinity::PromptChain::from_blocks([
        (1, 2_000),
        (2, 300),
        (3, 300),
        (4, 300),
        (5, 300),
    ]);
    // The first turn through A: the home is written with where its prompt ended.
    let d = decision(&sent(&a, "s", &first).await.unwrap());
    assert_eq!(d.outcome, Outcome::NewSession);
    until_tip(&mut conn, "s", tip_of(&first)).await;
    assert_eq!(stored(&mut conn, "s").await.backend, d.backend);
    // The next through B, which finds the tip in its prompt: the home holds it.
    let hit = decision(&sent(&b, "s", &next).await.unwrap());
    assert_eq!(
        (hit.backend.clone(), hit.outcome),
        (d.backend.clone(), Outcome::HomeHit)
    );
    // B writes where this turn's prompt ended, so that A, if it served the session next,
    // would know a later turn went home.
    until_tip(&mut conn, "s", tip_of(&next)).await;
    assert_eq!(b.store_stats().unwrap().writes, 1);
    // A compacted history through B: the tip is not in the prompt, as the replica that
    // placed the home would tell; B writes the new tip.
    let compacted = tower_affinity::PromptChain::from_blocks([(1, 2_000), (9, 400), (10, 300)]);
    let c = decision(&sent(&b, "s", &compacted).await.unwrap());
    assert_eq!(c.outcome, Outcome::Compaction);
    until_tip(&mut conn, "s", tip_of(&compacted)).await;

    // A value written before homes had tips reads as a home, and gets one.
    redis::cmd("SET")
        .arg(key_of("old"))
        .arg(r#"{"v":1,"backend":"b2","node":"node-b"}"#)
        .query_async::<()>(&mut conn)
        .await
        .unwrap();
    let old = decision(&sent(&a, "old", &next).await.unwrap());
    assert_eq!(
        (old.backend.as_str(), old.outcome),
        ("b2", Outcome::HomeHit)
    );
    until_tip(&mut conn, "old", tip_of(&next)).await;
    let h = stored(&mut conn, "old").await;
    assert_eq!((h.backend.as_str(), h.node.as_str()), ("b2", "node-b"));
    assert!(h.placed.is_some(), "{h:?}");
}

/// A failover: the address the store connects to moves to the new primary, and the old one,
/// which the store's connection still reaches, becomes its replica and refuses every write
/// (`READONLY`), the `PEXPIRE` of a read among them. The store connects again and reads the new primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_left_on_a_demoted_primary_connects_to_the_new_one() {
    use std::sync::Arc;
    use tower_affinity::store::{HomeStore, Lookup};
    let Some(old) = RedisServer::start().await else {
        return;
    };
    let new = RedisServer::start().await.unwrap();
    // The address that moves: each connection made to it goes to the primary of the moment.
    let primary = Arc::new(parking_lot::Mutex::new(old.port));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let to = primary.clone();
    let forward = tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            let port = *to.lock();
            tokio::spawn(async move {
                if let Ok(mut server) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                }
            });
        }
    });
    let store = RedisStore::builder()
        .reconnect_interval(Duration::from_millis(50))
        .open(&format!("redis://{address}"))
        .unwrap();
    let session = SessionKey::from_bytes(b"a session");
    let ttl = Duration::from_secs(60);
    assert_eq!(store.read(session, ttl).await.unwrap(), Lookup::Missing);
    // The failover. The sync between the servers goes through memory only: a snapshot on
    // disk, in the working directory, would be loaded by every server started after it.
    let mut demoted = old.client().await;
    let mut admin = new.client().await;
    for (to_new, name, value) in [
        (true, "repl-diskless-sync", "yes"),
        (true, "repl-diskless-sync-delay", "0"),
        (false, "repl-diskless-load", "swapdb"),
    ] {
        let conn = if to_new { &mut admin } else { &mut demoted };
        let () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(name)
            .arg(value)
            .query_async(conn)
            .await
            .unwrap();
    }
    *primary.lock() = new.port;
    let () = redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(new.port)
        .query_async(&mut demoted)
        .await
        .unwrap();
    let home = StoredHome::new("a1", "node-a");
    let () = redis::cmd("SET")
        .arg(
            RedisStore::builder()
                .open(&new.url())
                .unwrap()
                .key_of(session),
        )
        .arg(home.encode())
        .query_async(&mut admin)
        .await
        .unwrap();
    let start = Instant::now();
    let mut last = None;
    while start.elapsed() < Duration::from_secs(10) {
        match store.read(session, ttl).await {
            Ok(found) => {
                assert_eq!(found, Lookup::Home(home));
                forward.abort();
                return;
            }
            Err(e) => last = Some(e.to_string()),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    forward.abort();
    panic!("never read the new primary: {last:?}");
}

// === values that are not homes ===

/// A loopback address forwarding each connection to the Redis on `port`, whose answers reach
/// the client at `rate` bytes a second at most (what the client sends goes at once): a slow
/// link, on which what a read takes is the size of what it reads. Stops with the task.
async fn slow_link(port: u16, rate: usize) -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let mut links = tokio::task::JoinSet::new();
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
                continue;
            };
            let (mut from_client, mut to_client) = client.into_split();
            let (mut from_server, mut to_server) = server.into_split();
            links.spawn(async move {
                let _ = tokio::io::copy(&mut from_client, &mut to_server).await;
            });
            links.spawn(async move {
                // A hundredth of a second's worth at a time.
                let mut buf = vec![0; (rate / 100).max(1)];
                while let Ok(n) = from_server.read(&mut buf).await {
                    if n == 0 || to_client.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            });
        }
    });
    (address, task)
}

/// A value far larger than a home under a session's key, or a keyless prompt's, is a value
/// that is not a home: counted as garbage and written over, not an outage. Read whole, on a
/// link where it takes longer than the deadline, it timed out, marked the store down, and
/// held the connection every other read shares until it was through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_value_under_a_key_is_garbage_not_an_outage() {
    let Some(redis) = RedisServer::start().await else {
        return;
    };
    let mut conn = redis.client().await;
    let chain = keyless_chain(0, 1);
    // 64 MiB each, made in Redis (zeros, then an `x`) rather than sent to it.
    for key in [key_of("huge"), prompt_key(&chain)] {
        let _: i64 = redis::cmd("SETRANGE")
            .arg(&key)
            .arg((64 << 20) - 1)
            .arg("x")
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    // 4 MiB a second: 16 s for the value, past the patient deadline.
    let (link, task) = slow_link(redis.port, 4 << 20).await;
    let svc = replica(&format!("redis://{link}"), PATIENT, RECONNECT);
    let d = decision(&send(&svc, "huge").await);
    assert_eq!(d.outcome, Outcome::NewSession);
    let keyless = svc.clone().oneshot(keyless_turn(chain)).await.unwrap();
    drop(keyless);
    // And a read after them is answered at once.
    let other = decision(&send(&svc, "other").await);
    let s = svc.store_stats().unwrap();
    assert_eq!(
        (s.reads, s.garbage, s.misses, s.timeouts, s.errors, s.outages),
        (3, 2, 1, 0, 0, 0),
        "{s:?}"
    );
    assert_eq!(s.state, StoreState::Up);
    // The session's home is written over the value.
    until_stored(&mut conn, &key_of("huge"), d.backend.as_str()).await;
    until_stored(&mut conn, &key_of("other"), other.backend.as_str()).await;
    task.abort();
}

/// What the store reads each kind of value as, its expiry kept by the read's `PEXPIRE`, and a
/// home too long to be read back is not written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_of_value_reads_as_what_it_is() {
    use tower_affinity::store::{HomeStore, Lookup};
    let Some(redis) = RedisServer::start().await else {
        return;
    };
    let mut conn = redis.client().await;
    let store = RedisStore::open(&redis.url()).unwrap();
    let home = StoredHome::new("a1", "node-a");
    // The home's value, padded to past 16 KiB: JSON still, but no home is that long.
    let padded = format!("{}{}", home.encode(), " ".repeat(16 * 1024));
    let values: [(&str, Option<&str>, Lookup); 4] = [
        ("missing", None, Lookup::Missing),
        ("empty", Some(""), Lookup::Garbage),
        ("home", Some(&home.encode()), Lookup::Home(home.clone())),
        ("padded", Some(&padded), Lookup::Garbage),
    ];
    let ttl = Duration::from_secs(60);
    let session = |name: &str| SessionKey::from_bytes(name.as_bytes());
    let prompt = |i: usize| 1_000 + i as u64;
    for (i, (name, value, _)) in values.iter().enumerate() {
        if let Some(v) = value {
            for key in [store.key_of(session(name)), store.key_of_prompt(prompt(i))] {
                let () = redis::cmd("SET")
                    .arg(key)
                    .arg(*v)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
            }
        }
    }
    let _: i64 = redis::cmd("HSET")
        .arg(store.key_of(session("hash")))
        .arg("field")
        .arg("value")
        .query_async(&mut conn)
        .await
        .unwrap();
    for (name, _, expected) in &values {
        assert_eq!(
            &store.read(session(name), ttl).await.unwrap(),
            expected,
            "{name}"
        );
    }
    assert_eq!(
        store.read(session("hash"), ttl).await.unwrap(),
        Lookup::Garbage
    );
    // The read kept the home for the ttl.
    let kept: i64 = redis::cmd("PTTL")
        .arg(store.key_of(session("home")))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(kept > 0 && kept <= 60_000, "{kept}");
    // The same, by prompts, in one read, with a key of another type among them.
    let mut asked: Vec<u64> = (0..values.len()).map(prompt).collect();
    let _: i64 = redis::cmd("HSET")
        .arg(store.key_of_prompt(7))
        .arg("field")
        .arg("value")
        .query_async(&mut conn)
        .await
        .unwrap();
    asked.push(7);
    let mut expected: Vec<Lookup> = values.iter().map(|v| v.2.clone()).collect();
    // Without the expiry's answer, an empty string is no key.
    expected[1] = Lookup::Missing;
    expected.push(Lookup::Garbage);
    assert_eq!(store.read_prompts(&asked, ttl).await.unwrap(), expected);
    // A home whose names are too long to be read back is not written.
    let long = StoredHome::new("b".repeat(16 * 1024), "node-b");
    let e = store
        .write(session("long"), long, ttl)
        .await
        .expect_err("too long");
    assert!(e.to_string().contains("longer than"), "{e}");
    assert_eq!(get(&mut conn, &store.key_of(session("long"))).await, None);
}

/// A home sent again after an outage is set over what the store's readers would not keep
/// (no key, garbage, a key of another type, a value too long to read) and over a home placed
/// before it or at the same millisecond, and not over a home placed later or one whose
/// `placed` a reader does not take: the store's rule agrees with `StoredHome::decode`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_home_sent_again_is_set_only_over_no_home_or_one_placed_before_it() {
    use std::time::{SystemTime, UNIX_EPOCH};
    use tower_affinity::store::{HomeStore, Lookup};
    let Some(redis) = RedisServer::start().await else {
        return;
    };
    let mut conn = redis.client().await;
    let store = RedisStore::open(&redis.url()).unwrap();
    let at = |ms: u64| UNIX_EPOCH + Duration::from_millis(ms);
    let placed = |ms: u64| StoredHome::new("b1", "node-b").with_placed(at(ms));
    let sent = StoredHome::new("a1", "node-a").with_placed(at(2_000_000));
    let bare = StoredHome::new("b1", "node-b");
    let padded = format!("{}{}", placed(1).encode(), " ".repeat(16 * 1024));
    // What the key holds before, and whether the home sent again is set over it.
    let cases: [(&str, Option<String>, bool); 11] = [
        ("missing", None, true),
        ("garbage", Some("not a home".into()), true),
        ("padded", Some(padded), true),
        ("earlier", Some(placed(1_999_999).encode()), true),
        ("same", Some(placed(2_000_000).encode()), true),
        ("later", Some(placed(2_000_001).encode()), false),
        ("undated", Some(bare.encode()), false),
        (
            "fraction",
            Some(r#"{"v":1,"backend":"b1","node":"node-b","placed":1.5}"#.into()),
            false,
        ),
        (
            "negative",
            Some(r#"{"v":1,"backend":"b1","node":"node-b","placed":-1}"#.into()),
            false,
        ),
        (
            "text",
            Some(r#"{"v":1,"backend":"b1","node":"node-b","placed":"1"}"#.into()),
            false,
        ),
        (
            "version 2",
            Some(r#"{"v":2,"backend":"b1","node":"node-b","placed":1}"#.into()),
            true,
        ),
    ];
    let ttl = Duration::from_secs(60);
    let session = |name: &str| SessionKey::from_bytes(name.as_bytes());
    for (name, value, _) in &cases {
        if let Some(v) = value {
            let () = redis::cmd("SET")
                .arg(store.key_of(session(name)))
                .arg(v)
                .query_async(&mut conn)
                .await
                .unwrap();
        }
    }
    let _: i64 = redis::cmd("HSET")
        .arg(store.key_of(session("hash")))
        .arg("field")
        .arg("value")
        .query_async(&mut conn)
        .await
        .unwrap();
    for (name, value, set) in cases.iter().chain([&("hash", None, true)]) {
        // The rule as a reader sees the value: a home it reads is kept unless placed before.
        let read = store.read(session(name), ttl).await.unwrap();
        let reader_keeps = match &read {
            Lookup::Home(h) => h.placed.is_none_or(|p| p > at(2_000_000)),
            _ => false,
        };
        assert_eq!(!reader_keeps, *set, "{name}: read as {read:?}");
        store
            .rewrite(session(name), sent.clone(), ttl)
            .await
            .unwrap();
        let now = get(&mut conn, &store.key_of(session(name))).await;
        let expected = if *set {
            Some(sent.encode())
        } else {
            value.clone()
        };
        assert_eq!(now, expected, "{name}");
    }
    // Set with the ttl.
    let kept: i64 = redis::cmd("PTTL")
        .arg(store.key_of(session("missing")))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(kept > 0 && kept <= 60_000, "{kept}");
    // A home that does not say when it was placed is set over no home only.
    store
        .rewrite(session("earlier"), bare.clone(), ttl)
        .await
        .unwrap();
    store
        .rewrite(session("fresh"), bare.clone(), ttl)
        .await
        .unwrap();
    let (earlier, fresh) = (
        get(&mut conn, &store.key_of(session("earlier"))).await,
        get(&mut conn, &store.key_of(session("fresh"))).await,
    );
    assert_eq!(earlier, Some(sent.encode()));
    assert_eq!(fresh, Some(bare.encode()));
    // Today's clock, in milliseconds, is far within what the script's numbers hold exactly.
    let today = StoredHome::new("a1", "node-a").with_placed(SystemTime::now());
    store.rewrite(session("later"), today, ttl).await.unwrap();
    let later = get(&mut conn, &store.key_of(session("later"))).await;
    assert_eq!(
        later
            .and_then(|v| StoredHome::decode(v.as_bytes()))
            .map(|h| h.backend.to_string()),
        Some("a1".into())
    );
}

/// Redis is killed and restarted empty. Replica A placed a session's turn while it was
/// down, and its write failed; replica B places the session's next turn once it is back.
/// When A finds the store again, it sends its failed home again: the store keeps B's,
/// placed later, and A follows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_home_sent_again_after_an_outage_keeps_the_one_another_replica_placed_since() {
    let Some(mut redis) = RedisServer::start().await else {
        return;
    };
    let a = replica(&redis.url(), PATIENT, RECONNECT);
    let mut conn = redis.client().await;
    let key = key_of("agent-1");
    // Another session, homed elsewhere, whose next turn below writes nothing.
    let other = decision(&send(&a, "agent-0").await);
    until_stored(&mut conn, &key_of("agent-0"), other.backend.as_str()).await;
    let first = send(&a, "agent-1").await;
    let home = decision(&first);
    assert_ne!(home.backend, other.backend);
    until_stored(&mut conn, &key, home.backend.as_str()).await;
    // A's write of that home landed; its answer is read too before Redis goes, so that the
    // write failing below is the next turn's: a read on A's connection after it, answered.
    let again = decision(&send(&a, "agent-0").await);
    assert_eq!(again.outcome, Outcome::HomeHit);
    // Down: A's next turn of the session spills off its busy home, and the write fails.
    redis.kill().await;
    let second = send(&a, "agent-1").await;
    let spilled = decision(&second);
    assert_ne!(spilled.backend, home.backend);
    drop((first, second));
    let start = Instant::now();
    while a.store_stats().unwrap().write_errors == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the write never failed"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(a.store_stats().unwrap().state, StoreState::Down);
    // Back, empty. B, new, places the session's next turn and writes it.
    redis.restart().await;
    let mut conn = redis.client().await;
    let b = replica(&redis.url(), PATIENT, RECONNECT);
    let by_b = decision(&send(&b, "agent-1").await);
    assert_ne!(by_b.backend, spilled.backend);
    until_stored(&mut conn, &key, by_b.backend.as_str()).await;
    // A finds the store again (its requests probe it) and sends its failed home again.
    let start = Instant::now();
    while a.store_stats().unwrap().state != StoreState::Up {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "A never found the store"
        );
        send(&a, "agent-2").await;
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let start = Instant::now();
    while rewrite_reads(&mut conn).await == 0 {
        let held = get(&mut conn, &key)
            .await
            .and_then(|v| StoredHome::decode(v.as_bytes()));
        assert_ne!(
            held.map(|h| h.backend),
            Some(spilled.backend.clone()),
            "A's failed home was set over B's, placed later"
        );
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "A never sent its home again"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    until_stored(&mut conn, &key, by_b.backend.as_str()).await;
    // The replicas agree on the session again.
    assert_eq!(decision(&send(&a, "agent-1").await).backend, by_b.backend);
}

/// How many reads of homes sent again the server answered: its `GETRANGE`s less its
/// `PEXPIRE`s, as a session's read sends one of each, and a home sent again a `GETRANGE`
/// alone (with no keyless requests, which read prompts by `GETRANGE` alone too).
async fn rewrite_reads(conn: &mut redis::aio::MultiplexedConnection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .unwrap();
    // `cmdstat_getrange:calls=N,..`
    let calls = |name: &str| -> u64 {
        info.lines()
            .find_map(|l| l.strip_prefix(&format!("cmdstat_{name}:calls=")))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    calls("getrange").saturating_sub(calls("pexpire"))
}

/// A store says when its first connection opened, and when its attempts failed: a proxy
/// that waits for it before serving starts with the store up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_says_whether_its_first_connection_opened() {
    let Some(redis) = RedisServer::start().await else {
        return;
    };
    let bounded = Duration::from_secs(10);
    let store = RedisStore::open(&redis.url()).unwrap();
    assert!(tokio::time::timeout(bounded, store.connected())
        .await
        .unwrap());
    // Asked again, it says so at once.
    assert!(tokio::time::timeout(bounded, store.connected())
        .await
        .unwrap());
    // A port nothing listens on: the attempts fail, quickly with a short reconnect interval.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let refused = RedisStore::builder()
        .reconnect_interval(Duration::from_millis(20))
        .open(&format!("redis://127.0.0.1:{port}"))
        .unwrap();
    assert!(!tokio::time::timeout(bounded, refused.connected())
        .await
        .unwrap());
}

/// A value of JSON, or nearly: members picked from those a home has, spelled every way a
/// JSON reader might take or refuse (numbers with a fraction or an exponent, in hex, with a
/// leading zero, infinite; names not UTF-8; deep nesting; members twice), by the `n`th draw
/// of a fixed sequence.
fn jsonish(n: u64) -> Vec<u8> {
    let mut state = n.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x2545_f491_4f6c_dd1d;
    let mut pick = |len: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % len as u64) as usize
    };
    let numbers: [&[u8]; 18] = [
        b"1",
        b"1.0",
        b"1e0",
        b"01",
        b"0x1",
        b"2",
        b"-1",
        b"-0",
        b"1999999",
        b"2000000",
        b"2000001",
        b"2000001.0",
        b"2.000001e6",
        b"1.5",
        b"Infinity",
        b"NaN",
        b"18446744073709551616",
        b"1e400",
    ];
    let others: [&[u8]; 8] = [
        b"\"1\"",
        b"\"b1\"",
        b"\"\"",
        b"null",
        b"true",
        b"\"\xff\"",
        b"\"\\u00fc\"",
        b"[1]",
    ];
    let value = |pick: &mut dyn FnMut(usize) -> usize| -> Vec<u8> {
        if pick(2) == 0 {
            numbers[pick(numbers.len())].to_vec()
        } else {
            others[pick(others.len())].to_vec()
        }
    };
    let mut members: Vec<Vec<u8>> = Vec::new();
    for name in ["v", "backend", "node", "placed", "tip", "x"] {
        // Usually the member a home has; else another value, or none; now and then twice.
        let times = [1, 1, 1, 0, 2][pick(5)];
        for _ in 0..times {
            let v = match (name, pick(3)) {
                ("v", 0 | 1) => b"1".to_vec(),
                ("backend", 0 | 1) => b"\"b1\"".to_vec(),
                ("node", 0 | 1) => b"\"node-b\"".to_vec(),
                ("tip", 0 | 1) => b"\"0000000000000007\"".to_vec(),
                ("x", 0) => {
                    let depth = [1, 126, 127, 128, 200][pick(5)];
                    [b"[".repeat(depth), b"]".repeat(depth)].concat()
                }
                _ => value(&mut pick),
            };
            members.push([format!("\"{name}\":").into_bytes(), v].concat());
        }
    }
    let space: [&[u8]; 3] = [b"", b" ", b"\n\t"];
    let mut out = space[pick(3)].to_vec();
    out.push(b'{');
    out.extend(members.join(&b","[..]));
    out.push(b'}');
    out.extend(space[pick(3)]);
    match pick(12) {
        0 => out.extend(b" x"),
        1 => out = [b"[".to_vec(), out, b"]".to_vec()].concat(),
        _ => {}
    }
    out
}

/// The Lua script that sets a home sent again and `StoredHome::decode` agree on every value:
/// the home is set exactly when a reader of the value held would not keep it (it reads no
/// home, or one placed before the home sent). 600 values, one round trip or two each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_home_sent_again_is_set_exactly_when_a_reader_would_not_keep_the_value_held() {
    use std::time::UNIX_EPOCH;
    let Some(redis) = RedisServer::start().await else {
        return;
    };
    let mut conn = redis.client().await;
    let store = RedisStore::open(&redis.url()).unwrap();
    let sent_at = UNIX_EPOCH + Duration::from_millis(2_000_000);
    let sent = StoredHome::new("a1", "node-a").with_placed(sent_at);
    let started = Instant::now();
    let values: Vec<Vec<u8>> = (0..600).map(jsonish).collect();
    let keeps = |value: &[u8]| {
        StoredHome::decode(value).is_some_and(|h| h.placed.is_none_or(|p| p > sent_at))
    };
    let kept = set_over(&store, &mut conn, &values, &sent, true, keeps).await;
    // The draws hold both kinds, plenty of each.
    assert!((20..580).contains(&kept), "{kept} of 600 kept");
    assert!(started.elapsed() < Duration::from_secs(30));
}

/// Each of `values` set under a key of its own, then `sent` written over it, sent again
/// (`again`: `HomeStore::rewrite`) or not (`HomeStore::write`): checks that it was set exactly
/// where `keeps` says a reader of the value held would not keep it, and returns how many
/// `keeps` kept.
async fn set_over(
    store: &RedisStore,
    conn: &mut redis::aio::MultiplexedConnection,
    values: &[Vec<u8>],
    sent: &StoredHome,
    again: bool,
    keeps: impl Fn(&[u8]) -> bool,
) -> usize {
    use tower_affinity::store::HomeStore;
    let ttl = Duration::from_secs(60);
    let mut disagree = Vec::new();
    let mut kept = 0;
    for (n, value) in values.iter().enumerate() {
        let session = SessionKey::from_bytes(format!("set-over-{again}-{n}").as_bytes());
        let key = store.key_of(session);
        let () = redis::cmd("SET")
            .arg(&key)
            .arg(value)
            .query_async(conn)
            .await
            .unwrap();
        let reader_keeps = keeps(value);
        kept += usize::from(reader_keeps);
        if again {
            store.rewrite(session, sent.clone(), ttl).await.unwrap();
        } else {
            store.write(session, sent.clone(), ttl).await.unwrap();
        }
        let now: Vec<u8> = redis::cmd("GET").arg(&key).query_async(conn).await.unwrap();
        let set = now == sent.encode().into_bytes();
        if set == reader_keeps {
            disagree.push(format!(
                "{:?}: read as {:?}, set {set}",
                String::from_utf8_lossy(value),
                StoredHome::decode(value)
            ));
        }
    }
    assert!(
        disagree.is_empty(),
        "{} of {} values:\n{}",
        disagree.len(),
        values.len(),
        disagree.join("\n")
    );
    kept
}

/// A relay to `port` whose traffic toward Redis can be held: what a client sends while
/// `hold` is true stays in the relay (counted in the second value) until it turns false.
async fn holding_relay(
    port: u16,
    hold: tokio::sync::watch::Receiver<bool>,
) -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let held = std::sync::Arc::new(AtomicUsize::new(0));
    let counted = held.clone();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
                return;
            };
            let (mut from_client, mut to_client) = client.into_split();
            let (mut from_server, mut to_server) = server.into_split();
            tokio::spawn(async move {
                let _ = tokio::io::copy(&mut from_server, &mut to_client).await;
            });
            let mut hold = hold.clone();
            let held = counted.clone();
            tokio::spawn(async move {
                let mut buf = vec![0; 64 * 1024];
                loop {
                    let Ok(n @ 1..) = from_client.read(&mut buf).await else {
                        return;
                    };
                    if *hold.borrow() {
                        held.fetch_add(n, Ordering::SeqCst);
                        if hold.wait_for(|h| !*h).await.is_err() {
                            return;
                        }
                    }
                    if to_server.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, held)
}

/// A write that its replica gave up on, held up on its way to Redis while another replica
/// wrote the home of a later turn, lands after that one and leaves it: the store keeps the
/// home placed last, not the one that arrived last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_that_lands_late_keeps_the_home_placed_after_it() {
    use std::sync::atomic::Ordering;
    use std::time::UNIX_EPOCH;
    use tower_affinity::store::HomeStore;
    let Some(redis) = RedisServer::start().await else {
        return;
    };
    let (hold, held) = tokio::sync::watch::channel(false);
    let (relay, arrived) = holding_relay(redis.port, held).await;
    let a = RedisStore::open(&format!("redis://{relay}")).unwrap();
    let b = RedisStore::open(&redis.url()).unwrap();
    let bounded = Duration::from_secs(10);
    for store in [&a, &b] {
        assert!(tokio::time::timeout(bounded, store.connected())
            .await
            .unwrap());
    }
    let session = SessionKey::from_bytes(b"agent-late");
    let key = a.key_of(session);
    let ttl = Duration::from_secs(60);
    let at = UNIX_EPOCH + Duration::from_millis(1_796_601_600_000);
    let earlier = StoredHome::new("a1", "node-a").with_placed(at);
    let later = StoredHome::new("b1", "node-b").with_placed(at + Duration::from_secs(1));
    // A's write is held on the way; A gives up on it, as the service does after a second.
    hold.send_replace(true);
    let gave_up = tokio::time::timeout(
        Duration::from_millis(200),
        a.write(session, earlier.clone(), ttl),
    )
    .await;
    assert!(gave_up.is_err(), "the write was held, not answered");
    let start = Instant::now();
    while arrived.load(Ordering::SeqCst) == 0 {
        assert!(
            start.elapsed() < bounded,
            "the write never reached the relay"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // B places the session's next turn and writes it.
    b.write(session, later.clone(), ttl).await.unwrap();
    let mut conn = redis.client().await;
    assert_eq!(get(&mut conn, &key).await, Some(later.encode()));
    // A's write goes on and lands; a read on A's connection after it is answered after it.
    hold.send_replace(false);
    let other = SessionKey::from_bytes(b"agent-other");
    tokio::time::timeout(bounded, a.read(other, ttl))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        get(&mut conn, &key).await,
        Some(later.encode()),
        "a home placed earlier was set over one placed later"
    );
}

/// A home written is set exactly when a reader of the value held would not find a home
/// placed after it there: over no home, garbage, a home that does not say when, or one
/// placed before (or in the same millisecond); never over one placed later. The values in
/// the form the store writes are judged by its script, the others by `StoredHome::decode`
/// in the store; both agree with a reader on 600 values and on names of every kind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_home_written_is_set_exactly_when_the_value_held_is_not_a_home_placed_later() {
    use std::time::UNIX_EPOCH;
    use tower_affinity::store::HomeStore;
    let Some(redis) = RedisServer::start().await else {
        return;
    };
    let mut conn = redis.client().await;
    let store = RedisStore::open(&redis.url()).unwrap();
    let sent_at = UNIX_EPOCH + Duration::from_millis(2_000_000);
    let sent = StoredHome::new("a1", "node-a").with_placed(sent_at);
    let ttl = Duration::from_secs(60);
    let ms = |m: u64| UNIX_EPOCH + Duration::from_millis(m);
    let mut values: Vec<Vec<u8>> = Vec::new();
    for backend in ["b1", "gpu \"0\"", "b\\1", "gpü-0", "b\n1"] {
        let home = StoredHome::new(backend, "node-b");
        for h in [
            home.clone(),
            home.clone().with_tip(7),
            home.clone().with_placed(ms(1_999_999)),
            home.clone().with_placed(ms(2_000_000)),
            home.clone().with_placed(ms(2_000_001)),
            home.clone().with_placed(ms(20_000_000)),
            home.clone().with_placed(ms(200_000)),
            home.clone().with_tip(7).with_placed(ms(2_000_001)),
            home.clone().with_tip(7).with_placed(ms(1_999_999)),
            home.clone().with_placed(ms(u64::MAX / 2)),
        ] {
            values.push(h.encode().into_bytes());
        }
    }
    values.extend((0..600).map(jsonish));
    values.push(Vec::new());
    values.push(b"x".repeat(20_000));
    let keeps = |value: &[u8]| {
        StoredHome::decode(value)
            .filter(|_| value.len() <= 16 * 1024)
            .is_some_and(|h| h.placed.is_some_and(|p| p > sent_at))
    };
    let kept = set_over(&store, &mut conn, &values, &sent, false, keeps).await;
    // Both kinds, plenty of each.
    assert!((20..values.len() - 100).contains(&kept), "{kept} kept");
    // A key of another type is set over.
    let session = SessionKey::from_bytes(b"written-list");
    let key = store.key_of(session);
    let () = redis::cmd("RPUSH")
        .arg(&key)
        .arg("x")
        .query_async(&mut conn)
        .await
        .unwrap();
    store.write(session, sent.clone(), ttl).await.unwrap();
    assert_eq!(get(&mut conn, &key).await, Some(sent.encode()));
}
