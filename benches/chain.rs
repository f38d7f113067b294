//! The prompt chain of a request body, and what the cache model costs a home hit.
//!
//! - `chain/from_body/*`: [`PromptFacts::from_body`] on part 4's 130-byte request, and on
//!   OpenAI chat bodies of 16 KiB to 1 MiB,
//!   shaped like a coding agent's: an 8 KiB system prompt, a spec, then turns of short answers
//!   and tool outputs of a few KiB (code with newlines and quotes, so strings carry escapes).
//!   This is the whole parse `BodyKeyLayer` runs on every request: the key fields, the
//!   leading digest and the chain.
//! - `chain/text_prompt/*`: a prompt of the same size as one string (a legacy completions
//!   `prompt`), where the chain is 2 KiB blocks of the text.
//! - `chain/serde_skip/*` and `chain/xxh3/*`: the floors, on the chat bodies: `serde_json`
//!   checking the body as JSON and building nothing (`IgnoredAny`), and one xxh3 of the bytes.
//! - Paired rounds (`paired` in the filter, or no filter): home hits on 16x8 through the
//!   service, with a prompt chain on each request, and with the same chains where the
//!   service does not read them (the requests cost the same to build and drop), in rotating
//!   rounds. Both services are built alike (the same budgets, filled with the same older
//!   conversations) and place each session on the same backend. Each call is timed twice:
//!   until its backend is handed the request (the call path, where the models are read), and
//!   to the end of the response future's first poll (where the chain is recorded). The differences are what the cache model adds to each.
//!   Then the same on 2x2, eight sessions a backend as on 16x8: a fleet whose models (about
//!   1 MB) mostly stay in this machine's caches, so what the model costs when its reads are
//!   mostly not memory misses.
//!
//! Run with `cargo bench --bench chain`. Under `cargo test`, which runs each benchmark once to
//! show that it works, only the smallest body.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, BenchmarkId, Criterion, Throughput};
use tower::Layer;
use tower_affinity::key::{ExtensionKey, PromptFacts};
use tower_affinity::{Decision, Outcome, PromptChain, SessionAffinityLayer};

#[path = "common/mod.rs"]
mod common;

use common::{call_now, chat_body, key, request, Shape};

/// A completions body whose prompt is one string of about `bytes` bytes.
fn text_body(bytes: usize) -> Vec<u8> {
    let line = "fn main() {\n    println!(\"hello, {}\", name);\n}\n";
    let prompt = line.repeat(bytes / line.len() + 1);
    serde_json::to_vec(&serde_json::json!({"model": "qwen", "prompt": prompt})).expect("a body")
}

const SIZES: [(usize, &str); 4] = [
    (16 << 10, "16KiB"),
    (64 << 10, "64KiB"),
    (256 << 10, "256KiB"),
    (1 << 20, "1MiB"),
];

fn from_body(c: &mut Criterion) {
    let mut g = c.benchmark_group("chain");
    // Part 4's request: the small body every proxy benchmark sends.
    let small = br#"{"model":"m","messages":[{"role":"user","content":"session-00042: say ok"}],"max_tokens":1,"stream":false}"#;
    g.throughput(Throughput::Bytes(small.len() as u64));
    g.bench_function(BenchmarkId::new("from_body", "part4"), |b| {
        b.iter(|| PromptFacts::from_body(black_box(small)))
    });
    g.bench_function(BenchmarkId::new("serde_skip", "part4"), |b| {
        b.iter(|| serde_json::from_slice::<serde::de::IgnoredAny>(black_box(small)))
    });
    // `cargo test` only shows that each works: the smallest, since unoptimised the chain of
    // a mebibyte takes seconds.
    for &(bytes, label) in common::sized(&SIZES[..], &SIZES[..1]) {
        let body = chat_body(bytes);
        assert!(PromptFacts::from_body(&body).chain.len() > 2);
        g.throughput(Throughput::Bytes(body.len() as u64));
        g.bench_function(BenchmarkId::new("from_body", label), |b| {
            b.iter(|| PromptFacts::from_body(black_box(&body)))
        });
        // The floors: serde_json checking the body and building nothing, and one xxh3 of it.
        g.bench_function(BenchmarkId::new("serde_skip", label), |b| {
            b.iter(|| serde_json::from_slice::<serde::de::IgnoredAny>(black_box(&body)))
        });
        g.bench_function(BenchmarkId::new("xxh3", label), |b| {
            b.iter(|| xxhash_rust::xxh3::xxh3_64(black_box(&body)))
        });
        let text = text_body(bytes);
        assert!(PromptFacts::from_body(&text).chain.len() > 2);
        g.throughput(Throughput::Bytes(text.len() as u64));
        g.bench_function(BenchmarkId::new("text_prompt", label), |b| {
            b.iter(|| PromptFacts::from_body(black_box(&text)))
        });
    }
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(30)
}

criterion_group! {
    name = benches;
    config = config();
    targets = from_body
}

/// Sessions the paired rounds cycle through, for each backend of the fleet: 1,024 on 16x8.
const SESSIONS_PER_BACKEND: u64 = 8;
/// Turns a session takes before its history starts again (a compaction every 64 turns).
const TURNS: u64 = 64;

/// Session `s`'s chain at turn `t` of its `cycle`-th history: a 20-link head, then two links a
/// turn (an answer and a tool output), each of 50 tokens. Every 64 turns the session compacts
/// and starts a history of new links, as an agent's summary is new content.
fn chain_of(s: u64, cycle: u64, t: u64) -> PromptChain {
    PromptChain::from_blocks((0..20 + 2 * t).map(|i| (s << 40 | cycle << 20 | i, 50)))
}

/// Home hits on `shape` with and without a chain, in rotating rounds: each call's path to its
/// backend (from the call until the backend is handed the request), and the whole call.
fn paired(shape: Shape, rounds: usize, calls: u64) {
    let sessions = SESSIONS_PER_BACKEND * (shape.nodes * shape.per_node) as u64;
    // Both contenders built alike, caches at their budgets as in a fleet that has run a
    // while (each link recorded evicts an older conversation's, and no table grows): they
    // differ only in whether the requests' chains are read.
    let build = || {
        let mut svc = SessionAffinityLayer::new()
            .key(ExtensionKey)
            .layer(shape.fleet_with_cache_of(1, 200_000, common::mock_timed));
        common::fill_caches(&mut svc, 20 * sessions);
        svc
    };
    let (mut bare, mut chained) = (build(), build());
    let with_chain = |i: u64| {
        let (s, n) = (i % sessions, i / sessions);
        let mut req = request(Some(key(s)));
        let chain = chain_of(s, n / TURNS, n % TURNS);
        req.extensions_mut().insert(PromptFacts::from_chain(chain));
        req
    };
    // The same request, its chain under a type the service does not read.
    let unread = |i: u64| {
        let mut req = with_chain(i);
        let facts = req.extensions_mut().remove::<PromptFacts>();
        req.extensions_mut().insert(common::Unread(facts));
        req
    };
    // Every session placed once, so that every measured call is a home hit (or, once in 64
    // turns, a compaction); each in both services on the same backend, as new conversations
    // that no backend holds a prefix of.
    for i in 0..sessions {
        let homes = [
            call_now(&mut bare, unread(i)),
            call_now(&mut chained, with_chain(i)),
        ]
        .map(|res| {
            res.extensions()
                .get::<Decision>()
                .map(|d| d.backend.clone())
        });
        assert_eq!(homes[0], homes[1], "session {i} placed alike in both");
    }
    let tables = [&bare, &chained].map(|svc| svc.stats().sessions);
    assert_eq!(tables[0], tables[1], "both tables hold the same sessions");
    // Each contender's own count of calls, so that each session's turns follow one another.
    let mut next = [sessions; 2];
    let mut outcomes = [0u64; 2];
    // Requests are built in small chunks, outside the timing: a proxy's chain was built by
    // `BodyKeyLayer` just before the call, so it is in cache, as it is here.
    const CHUNK: u64 = 64;
    let mut run = |who: usize| -> Times {
        let first = next[who];
        next[who] += calls;
        let (mut total, mut path) = (Duration::ZERO, Duration::ZERO);
        let mut buf = Vec::with_capacity(CHUNK as usize);
        let mut done = 0;
        while done < calls {
            let n = CHUNK.min(calls - done);
            let from = first + done;
            if who == 0 {
                buf.extend((from..from + n).map(unread));
            } else {
                buf.extend((from..from + n).map(with_chain));
            }
            let svc = if who == 0 { &mut bare } else { &mut chained };
            let start = Instant::now();
            for req in buf.drain(..) {
                let called = Instant::now();
                let res = black_box(call_now(svc, req));
                path += common::handed().map_or(Duration::ZERO, |t| t - called);
                if who == 1 {
                    let hit = res.extensions().get::<Decision>().map(|d| d.outcome)
                        == Some(Outcome::HomeHit);
                    outcomes[usize::from(!hit)] += 1;
                }
                drop(res);
            }
            total += start.elapsed();
            done += n;
        }
        let per_call = |d: Duration| d.as_secs_f64() * 1e9 / calls as f64;
        Times {
            path: per_call(path),
            total: per_call(total),
        }
    };
    let per_round: Vec<[Times; 2]> = common::rotating_rounds(rounds, &mut run);
    let cell = |f: &dyn Fn(&[Times; 2]) -> f64| {
        let mut v: Vec<f64> = per_round.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        let (m, lo, hi) = (v[v.len() / 2], v[0], v[v.len() - 1]);
        format!("{m:.0} ns ({lo:.0} to {hi:.0})")
    };
    println!(
        "\n## Paired rounds: home hits, {} ({rounds} rounds of {calls} calls a contender)\n",
        shape.label()
    );
    println!("| per call, median (min to max) | to the backend (call path) | whole call |");
    println!("|---|---:|---:|");
    for (who, name) in [
        "the same chains, where the service does not read them",
        "with a prompt chain (cache model)",
    ]
    .iter()
    .enumerate()
    {
        let (path, total) = (cell(&|r| r[who].path), cell(&|r| r[who].total));
        println!("| {name} | {path} | {total} |");
    }
    let (path, total) = (
        cell(&|r| r[1].path - r[0].path),
        cell(&|r| r[1].total - r[0].total),
    );
    println!("| **what the cache model adds** | **{path}** | {total} |");
    println!(
        "\nChained calls that were home hits: {} of {} (the rest: compactions, one turn in {TURNS}).",
        outcomes[0],
        outcomes[0] + outcomes[1]
    );
}

/// One contender's round: nanoseconds a call until its backend is handed the request, and for
/// the whole call (the response future's poll included, where the chain is recorded).
#[derive(Clone, Copy, Debug, Default)]
struct Times {
    path: f64,
    total: f64,
}

fn main() {
    common::main_with_paired(benches, |full| {
        for shape in [Shape::new(16, 8), Shape::new(2, 2)] {
            if full {
                paired(shape, 21, 200_000);
            } else {
                paired(shape, 1, 2_000);
            }
        }
    });
}
