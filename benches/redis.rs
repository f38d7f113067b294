//! What the shared store adds to a keyed request, and to a keyless one with a prompt chain: a
//! `RedisStore` on a `redis-server` on loopback, against the local table alone, in the same
//! run (BENCHMARKS.md, part 6).
//!
//! ```text
//! cargo bench --features redis --bench redis [-- ROUNDS REQUESTS]
//! ```
//!
//! (`ROUNDS` and `REQUESTS` whole numbers, at least 1; anything else is an error.)
//!
//! Starts its own `redis-server` (Debian's package) on a free loopback port. Two services over
//! the same 16 mock backends (4 nodes of 4, 8 slots each, answering at once, cache budgets
//! that hold every conversation), one with the store and one without, take turns for 21
//! rounds (by default) of 2,000 home hits each on 1,000 sessions placed beforehand, in
//! alternating order; every request is timed on its own, from `call` to the response,
//! through a current-thread Tokio runtime. Prints each round's p50 and p99 and the medians
//! over the rounds. Then the same for conversations whose requests carry their prompt chain,
//! one link longer than its last turn's: keyless ones, for which the store is read for the
//! homes of the tip and the links before it (in one round trip), and keyed ones, each of whose turns
//! writes where its prompt ended.

use std::convert::Infallible;
use std::num::NonZeroU32;
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;
use tower::util::BoxCloneService;
use tower::{service_fn, Layer, Service, ServiceExt};
use tower_affinity::discover::StaticFleet;
use tower_affinity::key::PromptFacts;
use tower_affinity::store::RedisStore;
use tower_affinity::{Backend, Decision, Outcome, PromptChain, SessionAffinityLayer};

#[path = "common/mod.rs"]
mod common;

type Req = http::Request<String>;
type Mock = BoxCloneService<Req, http::Response<String>, Infallible>;

fn fleet() -> StaticFleet<Mock> {
    let eight = NonZeroU32::new(8).unwrap();
    StaticFleet::new((0..16).map(|i| {
        let backend = BoxCloneService::new(service_fn(|_req: Req| async {
            Ok::<_, Infallible>(http::Response::new(String::new()))
        }));
        // Cache models that hold every conversation: placement goes on finding each home.
        let backend = Backend::new(format!("node-{}", i / 4), backend)
            .slots(eight)
            .cache_tokens(1 << 26);
        (format!("b{i}"), backend)
    }))
}

fn turn(session: u64) -> Req {
    http::Request::post("/v1/chat/completions")
        .header("x-session-id", format!("agent-{session}"))
        .body(String::new())
        .unwrap()
}

/// Conversations, keyed or not: each one's turns so far, as the blocks of its prompt chain.
struct Conversations {
    turns: Vec<Vec<(u64, u32)>>,
    keyed: bool,
}

impl Conversations {
    fn new(sessions: u64, keyed: bool) -> Self {
        // A shared system prompt, then the conversation's own first message.
        let turns = (0..sessions)
            .map(|s| vec![(1, 2_000), ((s << 20) | 1, 300)])
            .collect();
        Conversations { turns, keyed }
    }

    /// The next turn of conversation `s`: its last prompt and one more link.
    fn turn(&mut self, s: u64) -> Req {
        let blocks = &mut self.turns[s as usize];
        let next = (s << 20) | (blocks.len() as u64);
        blocks.push((next, 200));
        let mut req = if self.keyed {
            // Sessions of their own, apart from the keyed part's.
            turn(s | 1 << 40)
        } else {
            http::Request::post("/v1/chat/completions")
                .body(String::new())
                .unwrap()
        };
        req.extensions_mut()
            .insert(PromptFacts::from_chain(PromptChain::from_blocks(
                blocks.iter().copied(),
            )));
        req
    }
}

/// The request latencies of one round, in nanoseconds, sorted; every one a home hit.
async fn round<S>(svc: &mut S, sessions: u64, n: u64, from: u64) -> Vec<u64>
where
    S: Service<Req, Response = http::Response<tower_affinity::ResponseBody<String>>>,
    S::Error: std::fmt::Debug,
{
    timed(
        svc,
        n,
        |i| turn((from + i * 7) % sessions),
        |o| o == Outcome::HomeHit,
    )
    .await
}

/// The latencies of `n` requests made by `make`, sorted; each decision's outcome passes
/// `expected`.
async fn timed<S>(
    svc: &mut S,
    n: u64,
    mut make: impl FnMut(u64) -> Req,
    expected: impl Fn(Outcome) -> bool,
) -> Vec<u64>
where
    S: Service<Req, Response = http::Response<tower_affinity::ResponseBody<String>>>,
    S::Error: std::fmt::Debug,
{
    let mut t = Vec::with_capacity(n as usize);
    for i in 0..n {
        let req = make(i);
        let start = Instant::now();
        let res = svc.ready().await.unwrap().call(req).await.unwrap();
        t.push(start.elapsed().as_nanos() as u64);
        let d = res.extensions().get::<Decision>().unwrap();
        assert!(expected(d.outcome), "{:?}", d.outcome);
        drop(res);
        // Lets the store's own tasks (writes, the connection) run, as a server's would
        // between requests.
        tokio::task::yield_now().await;
    }
    t.sort_unstable();
    t
}

/// Alternates rounds of `n` requests through `local` and `shared` (requests `(round, i)`
/// made by each one's maker) and prints each round's p50 and p99 and the medians.
async fn compare<L, S>(
    local: &mut L,
    shared: &mut S,
    rounds: usize,
    n: u64,
    mut make_local: impl FnMut(usize, u64) -> Req,
    mut make_shared: impl FnMut(usize, u64) -> Req,
    expected: impl Fn(Outcome) -> bool + Copy,
) where
    L: Service<Req, Response = http::Response<tower_affinity::ResponseBody<String>>>,
    L::Error: std::fmt::Debug,
    S: Service<Req, Response = http::Response<tower_affinity::ResponseBody<String>>>,
    S::Error: std::fmt::Debug,
{
    println!("round  local p50  local p99  redis p50  redis p99   (µs)");
    let (mut l50s, mut l99s, mut p50s, mut p99s, mut d50, mut d99) = (
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
    );
    for r in 0..rounds {
        let (l, s) = if r % 2 == 0 {
            let l = timed(local, n, |i| make_local(r, i), expected).await;
            (l, timed(shared, n, |i| make_shared(r, i), expected).await)
        } else {
            let s = timed(shared, n, |i| make_shared(r, i), expected).await;
            (timed(local, n, |i| make_local(r, i), expected).await, s)
        };
        let (l50, l99, s50, s99) = (pct(&l, 0.5), pct(&l, 0.99), pct(&s, 0.5), pct(&s, 0.99));
        println!(
            "{r:>5}  {:>9.1}  {:>9.1}  {:>9.1}  {:>9.1}",
            l50 as f64 / 1e3,
            l99 as f64 / 1e3,
            s50 as f64 / 1e3,
            s99 as f64 / 1e3
        );
        l50s.push(l50 as i64);
        l99s.push(l99 as i64);
        p50s.push(s50 as i64);
        p99s.push(s99 as i64);
        d50.push(s50 as i64 - l50 as i64);
        d99.push(s99 as i64 - l99 as i64);
    }
    println!(
        "medians over {rounds} rounds of {n}: local p50 {:.1} µs, p99 {:.1} µs; redis p50 {:.1} µs, p99 {:.1} µs",
        median(l50s) as f64 / 1e3,
        median(l99s) as f64 / 1e3,
        median(p50s) as f64 / 1e3,
        median(p99s) as f64 / 1e3,
    );
    println!(
        "added by the store (median of the rounds' differences): p50 {:.1} µs, p99 {:.1} µs",
        median(d50) as f64 / 1e3,
        median(d99) as f64 / 1e3
    );
}

/// Sends `req` and drops its answer: the first placements, before anything is timed.
async fn send<S>(svc: &mut S, req: Req)
where
    S: Service<Req>,
    S::Error: std::fmt::Debug,
{
    drop(svc.ready().await.unwrap().call(req).await.unwrap());
}

fn pct(sorted: &[u64], p: f64) -> u64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn median(mut v: Vec<i64>) -> i64 {
    v.sort_unstable();
    v[v.len() / 2]
}

fn main() {
    // `cargo test --all-targets` runs benches without `--bench`: only `cargo bench` measures.
    if !std::env::args().any(|a| a == "--bench") {
        println!("usage: cargo bench --features redis --bench redis [-- ROUNDS REQUESTS]");
        return;
    }
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let (rounds, n) = match common::redis_args(&args) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("redis: {e}");
            std::process::exit(2);
        }
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(run(rounds, n));
}

async fn run(rounds: usize, n: u64) {
    if std::process::Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_err()
    {
        eprintln!("redis-server is not installed (apt-get install redis-server)");
        std::process::exit(1);
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut server = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start redis-server");
    let mut lines = BufReader::new(server.stdout.take().unwrap()).lines();
    tokio::time::timeout(Duration::from_secs(10), async {
        while let Ok(Some(line)) = lines.next_line().await {
            if line.contains("Ready to accept connections") {
                return;
            }
        }
        panic!("redis-server exited");
    })
    .await
    .expect("redis-server ready within 10 s");
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });

    let store = RedisStore::open(&format!("redis://127.0.0.1:{port}")).unwrap();
    let mut local = SessionAffinityLayer::new().layer(fleet());
    // A deadline far above loopback's round trip: the figures are the store's cost, not the
    // deadline's (a read past 5 ms, the default, would be answered by the local table).
    let mut shared = SessionAffinityLayer::new()
        .home_store(store.clone())
        .store_deadline(Duration::from_millis(50))
        .layer(fleet());
    let sessions = 1_000;
    for s in 0..sessions {
        send(&mut local, turn(s)).await;
        send(&mut shared, turn(s)).await;
    }
    // The writes of the first placements land; warm both paths up.
    tokio::time::sleep(Duration::from_millis(200)).await;
    round(&mut local, sessions, n, 0).await;
    round(&mut shared, sessions, n, 0).await;
    println!("keyed: home hits by X-Session-Id");
    compare(
        &mut local,
        &mut shared,
        rounds,
        n,
        |r, i| turn((r as u64 * 13 + i * 7) % sessions),
        |r, i| turn((r as u64 * 13 + i * 7) % sessions),
        |o| o == Outcome::HomeHit,
    )
    .await;
    println!("store: {:?}", shared.store_stats().unwrap());

    // Conversations with prompt chains, keyless and then keyed: a fresh pair of services for
    // each, the same store (keys and prompts under their own prefixes).
    for keyed in [false, true] {
        let mut local = SessionAffinityLayer::new().layer(fleet());
        let mut shared = SessionAffinityLayer::new()
            .home_store(store.clone())
            .store_deadline(Duration::from_millis(50))
            .layer(fleet());
        // Each service its own copy of the conversations, so both see the same turns.
        let (mut to_local, mut to_shared) = (
            Conversations::new(sessions, keyed),
            Conversations::new(sessions, keyed),
        );
        for s in 0..sessions {
            send(&mut local, to_local.turn(s)).await;
            send(&mut shared, to_shared.turn(s)).await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        // A continued keyless prompt is a prefix hit, a spill where its backend is full, or
        // placed as new where its prefix is not its own; a keyed one goes home and writes
        // where its prompt ended.
        let expected = move |o| match keyed {
            true => o == Outcome::HomeHit,
            false => matches!(
                o,
                Outcome::PrefixHit
                    | Outcome::SameNodeSpill
                    | Outcome::CrossNodeSpill
                    | Outcome::Keyless
            ),
        };
        println!(
            "{}: each conversation's next turn, by its prompt chain",
            if keyed { "keyed" } else { "keyless" }
        );
        compare(
            &mut local,
            &mut shared,
            rounds,
            n,
            |r, i| to_local.turn((r as u64 * 13 + i * 7) % sessions),
            |r, i| to_shared.turn((r as u64 * 13 + i * 7) % sessions),
            expected,
        )
        .await;
        println!("store: {:?}", shared.store_stats().unwrap());
    }
    drop(server);
}
