//! Two proxy instances on one real `redis-server` (`--redis`): a turn that spilled on one is
//! followed by the other (real time: Redis is a real process on real sockets; every wait
//! bounded, nothing sleeps); and sixteen sessions on twelve slots whose turns enter either
//! instance at random keep their backends (paused time, as overload.rs).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};

use super::llama_stub::{Stub, Timing};
use super::redis_server::RedisServer;
use super::{cli, start, Conversation, Running};

/// An instance over `stubs` (`(node, stub)`), one slot each, sharing homes through `redis`.
async fn instance(stubs: &[(&str, &Stub)], redis: Option<&RedisServer>) -> Running {
    let mut args = Vec::new();
    for (node, stub) in stubs {
        args.push("--backend".to_string());
        args.push(format!(
            "{node}={},slots=1,id={}",
            stub.url(),
            stub.state.name
        ));
    }
    args.extend([
        "--probe-interval".into(),
        "0".into(),
        "--overflow".into(),
        "reject".into(),
    ]);
    if let Some(r) = redis {
        // Generous: a loaded CI machine must not turn a slow answer into a miss.
        args.extend([
            "--redis".into(),
            r.url(),
            "--redis-timeout".into(),
            "1s".into(),
        ]);
    }
    let cli::Command::Run(parsed) = cli::parse(args).unwrap() else {
        panic!("a run");
    };
    start(parsed.config).await
}

/// A spill on instance one, then the session's next turn through instance two: where it
/// lands, and where the spill went.
async fn spill_then_other_instance(redis: Option<&RedisServer>) -> (String, String, String) {
    let (a, b) = (Stub::start("a1", 1).await, Stub::start("b1", 1).await);
    let stubs = [("node-a", &a), ("node-b", &b)];
    let one = instance(&stubs, redis).await;
    let two = instance(&stubs, redis).await;
    let key = [("x-session-id", "s")];
    let mut convo = Conversation::new("s");
    let first = one.post_json(&key, &convo.next(json!({}))).await;
    convo.answered(&first);
    let home = first.backend().to_string();
    let home_stub = if home == "a1" { &a } else { &b };
    // A streamed turn held open on the home: instance one's slot there is taken.
    home_stub.hold_streams();
    let held = one
        .send(
            http::Request::post(one.url("/v1/chat/completions"))
                .header("content-type", "application/json")
                .header("x-session-id", "s")
                .body(http_body_util::Full::new(bytes::Bytes::from(
                    convo.next(json!({"stream": true})).to_string(),
                )))
                .unwrap(),
        )
        .await;
    assert_eq!(held.headers()["x-affinity-backend"], home.as_str());
    // The next turn spills on instance one.
    let spilled = one.post_json(&key, &convo.next(json!({}))).await;
    assert_ne!(spilled.backend(), home, "the home is full on instance one");
    convo.answered(&spilled);
    home_stub.release_streams();
    drop(held);
    // And the next enters instance two.
    let next = two.post_json(&key, &convo.next(json!({}))).await;
    if redis.is_some() {
        // Instance two's scrape shows the store it read the spill from.
        let metrics = String::from_utf8(two.get("/metrics").await.body.to_vec()).unwrap();
        for line in [
            "tower_affinity_store_up 1",
            "tower_affinity_store_reads_total 1",
            "tower_affinity_store_hits_total 1",
            "tower_affinity_store_timeouts_total 0",
        ] {
            assert!(metrics.contains(line), "missing {line:?} in\n{metrics}");
        }
    }
    (
        home,
        spilled.backend().to_string(),
        next.backend().to_string(),
    )
}

#[tokio::test]
async fn a_turn_entering_another_instance_follows_a_spill_through_redis() {
    let Some(redis) = RedisServer::start().await else {
        return;
    };
    let (_, spilled, next) = spill_then_other_instance(Some(&redis)).await;
    assert_eq!(
        next, spilled,
        "instance two read the spilled home from Redis"
    );
    // Without Redis, instance two knows nothing of the spill and sends the turn back to the
    // session's first home, which no longer holds its latest turn.
    let (home, spilled, next) = spill_then_other_instance(None).await;
    assert_ne!(spilled, home);
    assert_eq!(next, home);
}

// === sixteen sessions through two instances ===

/// Sixteen sessions, as overload.rs's agents: on 2 nodes x 2 backends x 3 slots.
const SESSIONS: usize = 16;
const TURNS: usize = 8;
const SLOTS: usize = 3;
/// The longest a turn may take, in the paused clock's time.
const TURN_DEADLINE: Duration = Duration::from_secs(3_600);
/// The stubs' pace and the agents' think time, as overload.rs has them: a mild overload.
const TIMING: Timing = Timing {
    prefill: 1_000.0,
    decode: Duration::from_secs(3),
};
const THINK: Duration = Duration::from_secs(3);

/// One later turn: where it landed, where the turn before it had, and how it was decided.
struct Landing {
    session: usize,
    turn: usize,
    instance: usize,
    previous: String,
    backend: String,
    outcome: String,
}

/// An xorshift64 stream: each session's entries are the same in every run.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
}

/// An instance as the README says to run two of them: `--replicas 2`, and `--redis` if given.
async fn fleet_instance(stubs: &[Stub], redis: Option<&RedisServer>) -> Running {
    let mut args = Vec::new();
    for (stub, node) in stubs.iter().zip(["node-a", "node-a", "node-b", "node-b"]) {
        args.push("--backend".to_string());
        args.push(format!(
            "{node}={},slots={SLOTS},id={}",
            stub.url(),
            stub.state.name
        ));
    }
    args.extend(
        [
            "--probe-interval",
            "0",
            "--replicas",
            "2",
            "--max-wait",
            "1h",
        ]
        .map(String::from),
    );
    if let Some(r) = redis {
        // Paused time moves on whenever the runtime is idle, and it is idle while a Redis
        // reply is on its way over a real socket: the clock may jump seconds ahead (to the
        // next agent's or stub's timer) before the reply is read. A deadline of an hour of
        // paused time is one no such jump reaches, so every read is answered, as a few
        // milliseconds are on real time.
        args.extend([
            "--redis".into(),
            r.url(),
            "--redis-timeout".into(),
            "1h".into(),
        ]);
    }
    let cli::Command::Run(parsed) = cli::parse(args).unwrap() else {
        panic!("a run");
    };
    assert_eq!(parsed.config.replicas.get(), 2);
    start(parsed.config).await
}

/// A turn through `proxy`, with the session's key, or none when `session` is `None`.
async fn chat(proxy: &Running, session: Option<&str>, body: &Value) -> (String, String, Value) {
    let mut req =
        Request::post(proxy.url("/v1/chat/completions")).header("content-type", "application/json");
    if let Some(session) = session {
        req = req.header("x-session-id", session);
    }
    let req = req.body(Full::new(Bytes::from(body.to_string()))).unwrap();
    let res = tokio::time::timeout(TURN_DEADLINE, proxy.client.request(req))
        .await
        .expect("an answer in time")
        .expect("the request went through");
    assert_eq!(res.status(), 200);
    let header = |name: &str| {
        res.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("-")
            .to_string()
    };
    let (backend, outcome) = (header("x-affinity-backend"), header("x-affinity-outcome"));
    let body = tokio::time::timeout(TURN_DEADLINE, res.into_body().collect())
        .await
        .expect("a body in time")
        .expect("the body went through")
        .to_bytes();
    let answer = serde_json::from_slice(&body).expect("a JSON answer");
    (backend, outcome, answer)
}

/// One session's turns, each entering one of the instances at random, with the session's
/// key in a header or, not `keyed`, none (the instances know it by its prompt).
async fn session(instances: Arc<[Running; 2]>, n: usize, keyed: bool) -> Vec<Landing> {
    let name = format!("session-{n}");
    let mut entry = XorShift(0x9e37_79b9_7f4a_7c15 ^ (n as u64 + 1));
    let mut messages = vec![
        json!({"role": "system", "content": "You are a coding agent working in a Rust repository. Read, then act. ".repeat(40)}),
        json!({"role": "user", "content": "SPEC: a todo service with an HTTP API, a store, and tests for both. ".repeat(15)}),
    ];
    let mut landings = Vec::new();
    let mut previous: Option<String> = None;
    // Sessions start a little apart, as a swarm's do.
    tokio::time::sleep(Duration::from_millis(250 * n as u64)).await;
    for turn in 0..TURNS {
        if turn > 0 {
            let output = format!("tool output {turn} of {name}: {}", "fn f() {} ".repeat(300));
            messages.push(json!({"role": "user", "content": output}));
        }
        let instance = (entry.next() % 2) as usize;
        let body = json!({"model": "stub", "messages": messages});
        let key = keyed.then_some(name.as_str());
        let (backend, outcome, answer) = chat(&instances[instance], key, &body).await;
        if let Some(previous) = previous {
            landings.push(Landing {
                session: n,
                turn,
                instance,
                previous,
                backend: backend.clone(),
                outcome,
            });
        }
        previous = Some(backend);
        let content = answer["choices"][0]["message"]["content"].clone();
        messages.push(json!({"role": "assistant", "content": content}));
        tokio::time::sleep(THINK).await;
    }
    landings
}

/// Keeps the runtime busy while a read of the store is on its way to Redis and back.
///
/// The paused clock moves on whenever the runtime is idle, and it is idle while a reply
/// crosses a real socket: without this, a read that takes a few microseconds of real time
/// could take seconds of the test's time (the clock jumping to the next agent's or stub's
/// timer), which no Redis on a network does. Between reads it looks again every millisecond
/// of the test's time.
async fn awake_while_reading(instances: Arc<[Running; 2]>) {
    // Reads sent, less reads answered (a home found counts once the service has taken it).
    let unanswered = || -> u64 {
        instances
            .iter()
            .filter_map(|r| r.proxy.affinity().store_stats())
            .map(|s| {
                let answered =
                    s.hits + s.misses + s.timeouts + s.errors + s.garbage + s.unknown_backends;
                s.reads.saturating_sub(answered)
            })
            .sum()
    };
    // Bounded: a read that never looks answered to this count lets the clock go on after a
    // while of real time, as if the store had stopped answering.
    let mut spins = 0u32;
    loop {
        if unanswered() > 0 && spins < 100_000 {
            spins += 1;
            tokio::task::yield_now().await;
        } else {
            spins = 0;
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}

/// Sixteen sessions through two instances, with or without a Redis they share: their later
/// turns, each with where it landed and where the session's previous turn had.
async fn two_instances(redis: Option<&RedisServer>, keyed: bool) -> Vec<Landing> {
    let mut stubs = Vec::new();
    for name in ["a1", "a2", "b1", "b2"] {
        stubs.push(Stub::start_timed(name, SLOTS, TIMING).await);
    }
    let instances = Arc::new([
        fleet_instance(&stubs, redis).await,
        fleet_instance(&stubs, redis).await,
    ]);
    let awake = redis.map(|_| tokio::spawn(awake_while_reading(instances.clone())));
    let tasks: Vec<_> = (0..SESSIONS)
        .map(|n| tokio::spawn(session(instances.clone(), n, keyed)))
        .collect();
    let mut later = Vec::new();
    for t in tasks {
        later.extend(t.await.expect("a session finished"));
    }
    if let Some(awake) = awake {
        awake.abort();
    }
    later
}

/// Of the later turns from turn `from` on, the share that landed on their previous turn's
/// backend, and a line for the run with each turn that moved.
fn stayed(what: &str, later: &[Landing], from: usize) -> (f64, String) {
    let later: Vec<_> = later.iter().filter(|l| l.turn >= from).collect();
    let moved: Vec<_> = later.iter().filter(|l| l.backend != l.previous).collect();
    let stayed = later.len() - moved.len();
    let share = stayed as f64 / later.len() as f64;
    let mut s = format!(
        "{what}: {stayed}/{} later turns from turn {from} on their previous turn's backend ({:.1}%)",
        later.len(),
        100.0 * share
    );
    for l in moved {
        s += &format!(
            "\n  session {} turn {} via instance {}: {} -> {} ({})",
            l.session, l.turn, l.instance, l.previous, l.backend, l.outcome
        );
    }
    (share, s)
}

#[tokio::test]
async fn sixteen_sessions_on_twelve_slots_entering_two_instances_at_random_stay_with_redis() {
    // Started on real time: its start is a wait for a real process's log line.
    let Some(redis) = RedisServer::start().await else {
        return;
    };
    tokio::time::pause();
    let (shared, with) = stayed(
        "two instances on one Redis",
        &two_instances(Some(&redis), true).await,
        1,
    );
    let (local, without) = stayed(
        "two instances without Redis",
        &two_instances(None, true).await,
        1,
    );
    println!("{with}\n{without}");
    // The target is 95%. Measured over 6 runs: 99.1% to 100% with Redis (100% in 5), 65.2%
    // without, where 38 of the 39 moves went to a stale home or one an instance placed without
    // having seen the session; 69.6% without since each instance homes only its share of a
    // backend's slots there (99.1% with).
    assert!(shared >= SHARED_FLOOR, "{with}\n{without}");
    assert!(shared - local >= 0.15, "{with}\n{without}");
}

/// What the run with Redis keeps at least: the target (95%) less one turn of the 112, for
/// the variation that real sockets bring to a run on the paused clock.
const SHARED_FLOOR: f64 = 0.94;

/// The same sessions sending no key: the instances know each by its prompt, through Redis by
/// the tip of its latest turn. All of them send the same first prompt (system prompt and
/// spec), whose tip is the system prompt they all share, so a second turn finds nothing of
/// its own and is placed by load; from the third on a turn continues a prompt with an answer
/// of its own, which Redis names the backend of.
#[tokio::test]
async fn sixteen_keyless_conversations_entering_two_instances_at_random_stay_with_redis() {
    let Some(redis) = RedisServer::start().await else {
        return;
    };
    tokio::time::pause();
    let with = two_instances(Some(&redis), false).await;
    let without = two_instances(None, false).await;
    let (_, all_with) = stayed("two instances on one Redis, no keys", &with, 1);
    let (_, all_without) = stayed("two instances without Redis, no keys", &without, 1);
    let (shared, with) = stayed("two instances on one Redis, no keys", &with, 2);
    let (local, without) = stayed("two instances without Redis, no keys", &without, 2);
    println!("{all_with}\n{all_without}\n{with}\n{without}");
    // Measured over 7 runs: from the third turn on, 100% with Redis and 72.9% without; of the
    // second turns, 9 to 11 of 16 move with Redis, 11 without. Now (three runs alike): 100%
    // with Redis, 61.5% without.
    assert!(shared >= SHARED_FLOOR, "{with}\n{without}");
    assert!(shared - local >= 0.15, "{with}\n{without}");
}
