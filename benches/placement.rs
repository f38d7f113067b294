//! Placement decision cost (issue 6, part 1).
//!
//! - `policy/*`: the default policy alone, through [`Snapshot::choose`] (probe mode: no slot is
//!   taken), for a home hit, a same-node spill, a new session and a keyless request, on fleets of
//!   2x2, 16x8, 64x8 and 256x8 (nodes x backends per node). `policy/view/*` is the cost of
//!   building the snapshot's view alone, which `choose` pays on every call (the service does
//!   not: it keeps the fleet-wide in-flight count up to date).
//! - `call/*`: the whole `SessionAffinity` call path over mock backends that answer at once:
//!   readiness, key extraction, session-table lookup, placement, slot, backend call, response
//!   wrapping and dropping the response (which frees the slot). `call/direct` is the same
//!   request sent straight to one mock backend; the router's own cost is `call/* - call/direct`.
//! - `key/*`: the SHA-256 digest of a session id alone, and the default `HeaderKey` extractor
//!   finding a key (`header`) and finding none in a keyless request's headers (`header_none`).
//! - `chained/*`: keyless requests with prompt chains, over fleets whose cache models hold
//!   other conversations: what asking every backend's model costs (see [`chained`]).
//! - `table/*`: home hits through the service with 1 thousand, 100 thousand and 1 million
//!   sessions in the table, on keys spread over the whole table; `table/bare_read/*`: one
//!   dependent random read in a plain array of the same size (the memory latency alone).
//!
//! Requests are built outside the timed region, in chunks of 1024.
//!
//! Run with `cargo bench --bench placement`. Under `cargo test`, which runs each benchmark once
//! to show that it works, the tables hold 1 to 4 thousand sessions and `chained/*` runs on 16x8
//! alone.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, BenchmarkId, Criterion};
use tower::Layer;
use tower_affinity::key::{ExtensionKey, HeaderKey, KeyExtractor, SessionKey};
use tower_affinity::placement::{
    Candidates, FleetView, NodeThenBackend, Placement, PlacementRequest,
};
use tower_affinity::{Decision, Outcome, SessionAffinityLayer, Sessions};

#[path = "common/mod.rs"]
mod common;

use common::{
    call_now, header_request, key, keyless_request, mix, mock, request, Req, Shape, SHAPES,
};

/// The service the table benches drive: session ids from the request's extensions.
type Svc = tower_affinity::SessionAffinity<
    tower_affinity::discover::StaticFleet<common::Mock>,
    ExtensionKey,
    NodeThenBackend,
>;

/// Requests are built in chunks of this many, outside the timed region.
const CHUNK: u64 = 1024;

/// Hot keys cycled through by the home-hit and new-session benches.
const HOT_KEYS: u64 = 1024;

/// Times `run` over `iters` requests made by `build(i)`, building them outside the timing.
fn chunked(iters: u64, mut build: impl FnMut(u64) -> Req, mut run: impl FnMut(Req)) -> Duration {
    let mut total = Duration::ZERO;
    let mut buf = Vec::with_capacity(CHUNK as usize);
    let mut done = 0;
    while done < iters {
        let n = CHUNK.min(iters - done);
        buf.extend((done..done + n).map(&mut build));
        let start = Instant::now();
        for req in buf.drain(..) {
            run(req);
        }
        total += start.elapsed();
        done += n;
    }
    total
}

fn outcome_of<B>(res: &http::Response<B>) -> Outcome {
    res.extensions()
        .get::<Decision>()
        .map(|d| d.outcome)
        .expect("every response carries its decision")
}

/// Key extraction alone: the SHA-256 digest of a session id, and the default extractor reading
/// it from a header.
fn keys(c: &mut Criterion) {
    let mut g = c.benchmark_group("key");
    g.bench_function("sha256", |b| {
        b.iter(|| SessionKey::from_bytes(black_box(b"agent-00000042")))
    });
    let extractor = HeaderKey::default();
    let req = header_request(42);
    g.bench_function("header", |b| b.iter(|| extractor.extract(black_box(&req))));
    // A keyless request as OpenAI-compatible clients send it: every default name looked up,
    // none found.
    let keyless = keyless_request();
    g.bench_function("header_none", |b| {
        b.iter(|| extractor.extract(black_box(&keyless)))
    });
    g.finish();
}

/// The default policy alone, through `Snapshot::choose`.
fn policy(c: &mut Criterion) {
    let policy = NodeThenBackend::new();
    let keys: Vec<SessionKey> = (0..HOT_KEYS).map(key).collect();
    let mut g = c.benchmark_group("policy");
    for shape in SHAPES {
        let label = shape.label();
        let fleet = shape.snapshot(1);
        let k = keys[0];
        let home = fleet
            .choose(&policy, Some(k), None)
            .expect("an idle fleet has room");
        let home = home.as_str().to_owned();

        g.bench_function(BenchmarkId::new("view", &label), |b| {
            b.iter(|| black_box(fleet.view()).len())
        });

        g.bench_function(BenchmarkId::new("home_hit", &label), |b| {
            b.iter(|| fleet.choose(&policy, black_box(Some(k)), Some(&home)))
        });

        // The home is full: the session spills to another backend on the home's node.
        let full = shape.snapshot(1).in_flight(&home, 1);
        let spilled = full
            .choose(&policy, Some(k), Some(&home))
            .expect("the home's node has room");
        assert_eq!(
            spilled.as_str().split('-').next(),
            home.split('-').next(),
            "a same-node spill"
        );
        g.bench_function(BenchmarkId::new("same_node_spill", &label), |b| {
            b.iter(|| full.choose(&policy, black_box(Some(k)), Some(&home)))
        });

        g.bench_function(BenchmarkId::new("new_session", &label), |b| {
            let mut i = 0;
            b.iter(|| {
                i = (i + 1) % keys.len();
                fleet.choose(&policy, black_box(Some(keys[i])), None)
            })
        });

        g.bench_function(BenchmarkId::new("keyless", &label), |b| {
            b.iter(|| fleet.choose(&policy, black_box(None), None))
        });

        // A policy wrapping the default that passes over half the fleet first, as one keeping
        // tenants apart would: O(backends) a request to pass them over.
        let halved = PassOverHalf(NodeThenBackend::new());
        let home = fleet
            .choose(&halved, Some(k), None)
            .expect("an idle fleet has room");
        let home = home.as_str().to_owned();
        g.bench_function(
            BenchmarkId::new("home_hit_passing_over_half", &label),
            |b| b.iter(|| fleet.choose(&halved, black_box(Some(k)), Some(&home))),
        );
    }
    g.finish();
}

/// `NodeThenBackend`, after passing over every other backend of the fleet.
struct PassOverHalf(NodeThenBackend);

impl Placement for PassOverHalf {
    fn place(&self, f: &FleetView<'_>, r: &PlacementRequest<'_>, c: &mut Candidates<'_>) {
        for b in f.backends().step_by(2) {
            c.pass_over(b);
        }
        self.0.place(f, r, c)
    }
}

/// The whole call path, per fleet and outcome.
fn call(c: &mut Criterion) {
    let mut g = c.benchmark_group("call");

    // Baselines: the same requests sent straight to one mock backend.
    g.bench_function("direct", |b| {
        let mut backend = mock();
        b.iter_custom(|iters| {
            chunked(
                iters,
                |i| request(Some(key(i % HOT_KEYS))),
                |req| drop(black_box(call_now(&mut backend, req))),
            )
        })
    });
    g.bench_function("direct_header", |b| {
        let mut backend = mock();
        b.iter_custom(|iters| {
            chunked(
                iters,
                |i| header_request(i % HOT_KEYS),
                |req| drop(black_box(call_now(&mut backend, req))),
            )
        })
    });

    for shape in SHAPES {
        let label = shape.label();
        let layer = SessionAffinityLayer::new().key(ExtensionKey);
        let svc = layer.layer(shape.fleet(1));

        // Home hits on 1024 sessions placed beforehand.
        {
            let mut svc = svc.clone();
            for i in 0..HOT_KEYS {
                let res = call_now(&mut svc, request(Some(key(i))));
                assert_eq!(outcome_of(&res), Outcome::NewSession);
            }
            let res = call_now(&mut svc, request(Some(key(0))));
            assert_eq!(outcome_of(&res), Outcome::HomeHit);
            drop(res);
            g.bench_function(BenchmarkId::new("home_hit", &label), |b| {
                b.iter_custom(|iters| {
                    chunked(
                        iters,
                        |i| request(Some(key(i % HOT_KEYS))),
                        |req| drop(black_box(call_now(&mut svc, req))),
                    )
                })
            });
        }

        // Same-node spills: one slot per backend; the session's previous response is still
        // being read, so its home is full and it spills to the next backend on the node. The
        // home then moves there, and the next turn spills back (the key's two best backends
        // on its node take turns).
        {
            let mut svc = svc.clone();
            let k = key(u64::MAX);
            let mut held = call_now(&mut svc, request(Some(k)));
            assert_eq!(outcome_of(&held), Outcome::NewSession);
            for _ in 0..4 {
                let res = call_now(&mut svc, request(Some(k)));
                assert_eq!(outcome_of(&res), Outcome::SameNodeSpill);
                held = res;
            }
            let mut held = Some(held);
            g.bench_function(BenchmarkId::new("same_node_spill", &label), |b| {
                b.iter_custom(|iters| {
                    chunked(
                        iters,
                        |_| request(Some(k)),
                        |req| {
                            let res = call_now(&mut svc, req);
                            drop(black_box(held.replace(res)));
                        },
                    )
                })
            });
            let res = held.take().expect("held");
            assert_eq!(outcome_of(&res), Outcome::SameNodeSpill);
        }

        // New sessions: a key never seen before on every call. The table (100,000 entries by
        // default) fills during warm-up, so most of these also evict an entry.
        {
            let mut svc = svc.clone();
            let mut next = 1u64 << 40;
            g.bench_function(BenchmarkId::new("new_session", &label), |b| {
                b.iter_custom(|iters| {
                    let first = next;
                    next += iters;
                    chunked(
                        iters,
                        |i| request(Some(key(first + i))),
                        |req| drop(black_box(call_now(&mut svc, req))),
                    )
                })
            });
            let res = call_now(&mut svc, request(Some(key(next))));
            assert_eq!(outcome_of(&res), Outcome::NewSession);
        }

        {
            let mut svc = svc.clone();
            g.bench_function(BenchmarkId::new("keyless", &label), |b| {
                b.iter_custom(|iters| {
                    chunked(
                        iters,
                        |_| request(None),
                        |req| drop(black_box(call_now(&mut svc, req))),
                    )
                })
            });
        }
    }

    // Home hits with the default extractor: the session id read from a header and hashed
    // with SHA-256 on every request.
    {
        let shape = Shape::new(16, 8);
        let mut svc = SessionAffinityLayer::new().layer(shape.fleet(1));
        for i in 0..HOT_KEYS {
            drop(call_now(&mut svc, header_request(i)));
        }
        let res = call_now(&mut svc, header_request(0));
        assert_eq!(outcome_of(&res), Outcome::HomeHit);
        drop(res);
        g.bench_function(BenchmarkId::new("home_hit_header", shape.label()), |b| {
            b.iter_custom(|iters| {
                chunked(
                    iters,
                    |i| header_request(i % HOT_KEYS),
                    |req| drop(black_box(call_now(&mut svc, req))),
                )
            })
        });
    }
    g.finish();
}

/// A request without a key, its prompt a chain of 20 links of 50 tokens: `first` is its
/// opening link, `own` makes the rest its own.
fn chained_keyless(first: u64, own: u64) -> Req {
    let chain = tower_affinity::PromptChain::from_blocks(
        std::iter::once((first, 50)).chain((1..20).map(|i| (own << 32 | i, 50))),
    );
    let mut req = request(None);
    req.extensions_mut()
        .insert(tower_affinity::key::PromptFacts::from_chain(chain));
    req
}

/// What a request with a prompt chain and no usable home costs: placement asks every
/// backend's cache model how much of the chain it holds. `keyless_chain/*`: conversations
/// that open alike with none the backends hold (other agents' conversations fill their
/// models), so a backend answers from the chain's first link; `keyless_shared/*`: every
/// conversation, those in the models too, opening with one link every backend holds, so each
/// searches its model for where the chain leaves it. Models of 32,768 tokens a backend holding
/// eight conversations of 1,000 tokens each when the timing starts, and each timed request's
/// after it; 4 slots, requests sent beyond the slots.
fn chained(c: &mut Criterion) {
    let mut g = c.benchmark_group("chained");
    // Under `cargo test`, the smallest: filling 256x8's models asks each of 2,048 backends for
    // every one of 16,384 conversations, a minute unoptimised.
    let all = [Shape::new(16, 8), Shape::new(64, 8), Shape::new(256, 8)];
    for &shape in common::sized(&all[..], &all[..1]) {
        let backends = (shape.nodes * shape.per_node) as u64;
        for (name, first) in [("keyless_chain", None), ("keyless_shared", Some(7u64))] {
            let mut svc = SessionAffinityLayer::new()
                .key(ExtensionKey)
                .overflow(tower_affinity::Overflow::Overcommit)
                .layer(shape.fleet_with_cache(4, 32_768));
            // Eight conversations' worth a backend, each recorded whole.
            for d in 0..backends * 8 {
                let opening = first.unwrap_or((1 << 40) + d);
                drop(call_now(&mut svc, chained_keyless(opening, (1 << 20) + d)));
            }
            let mut next = 0;
            g.bench_function(BenchmarkId::new(name, shape.label()), |b| {
                b.iter_custom(|iters| {
                    chunked(
                        iters,
                        |_| {
                            next += 1;
                            chained_keyless(first.unwrap_or((2 << 40) + next), (2 << 20) + next)
                        },
                        |req| drop(black_box(call_now(&mut svc, req))),
                    )
                })
            });
        }
    }
    g.finish();
}

/// The table sizes of `table/*` and of the paired table rounds.
const TABLE_SIZES: [u64; 3] = [1_000, 100_000, 1_000_000];

/// [`TABLE_SIZES`] when measuring; under `cargo test`, tables small enough to fill at once.
fn table_sizes() -> [u64; 3] {
    common::sized(TABLE_SIZES, [1_000, 2_000, 4_000])
}

/// A prime that divides none of the table sizes: visiting `i * STRIDE mod n` touches every
/// session once per `n` calls, in an order the caches cannot follow.
const STRIDE: u64 = 999_983;

/// A service on 16x8 whose table holds sessions `0..n`, each placed once.
fn filled_table(n: u64) -> Svc {
    // Room for a tenth more than `n`, so that uneven shards evict none of the `n`.
    let entries = usize::try_from(n + n / 10).expect("fits");
    let mut svc = SessionAffinityLayer::new()
        .key(ExtensionKey)
        .sessions(Sessions::new().max_entries(entries))
        .layer(Shape::new(16, 8).fleet(1));
    for i in 0..n {
        drop(call_now(&mut svc, request(Some(key(i)))));
    }
    assert_eq!(svc.stats().sessions, n as usize, "every session is held");
    svc
}

/// Home hits on `working` of `svc`'s `n` sessions (spread over the table), from the
/// `first`-th call on: `iters` calls timed. With `working == n` every session takes its turn.
fn spread_home_hits(svc: &mut Svc, n: u64, working: u64, first: u64, iters: u64) -> Duration {
    chunked(
        iters,
        |i| request(Some(key((first + i) % working * STRIDE % n))),
        |req| drop(black_box(call_now(svc, req))),
    )
}

/// One random cycle through every word of an array of `bytes` bytes (Sattolo's shuffle), so
/// that a chain of reads never settles into a loop small enough to stay in cache.
fn random_cycle(bytes: usize) -> Vec<usize> {
    let len = bytes / 8;
    let mut next: Vec<usize> = (0..len).collect();
    for i in (1..len).rev() {
        let j = (mix(i as u64) % i as u64) as usize;
        next.swap(i, j);
    }
    next
}

/// Home hits with 1 thousand to 1 million sessions in the table, on keys spread over it.
fn table(c: &mut Criterion) {
    let mut g = c.benchmark_group("table");
    for n in table_sizes() {
        let mut svc = filled_table(n);
        let before = svc.stats();
        let mut cursor = 0u64;
        g.bench_function(BenchmarkId::new("home_hit", n), |b| {
            b.iter_custom(|iters| {
                let first = cursor;
                cursor += iters;
                spread_home_hits(&mut svc, n, n, first, iters)
            })
        });
        let after = svc.stats();
        let hits = after.home_hits - before.home_hits;
        let placed = after.placed() - before.placed();
        eprintln!(
            "table/home_hit/{n}: {hits} home hits of {placed} calls; {} sessions, {} table bytes",
            after.sessions, after.session_table_bytes
        );
        assert_eq!(hits, placed, "every measured call is a home hit");

        // The bound: one random read in an array as big as the table, each read's address
        // depending on the last one's value, as a lookup's miss stalls its call. What the
        // hardware charges for the table's size, with no table code at all.
        let next = random_cycle(after.session_table_bytes);
        let mut at = 0usize;
        g.bench_function(BenchmarkId::new("bare_read", n), |b| {
            b.iter(|| {
                at = next[at];
                black_box(at)
            })
        });
    }
    g.finish();
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
    targets = keys, policy, call, chained, table
}
/// The router costs again, in rounds that alternate the contenders: each round times the same
/// number of calls straight to the mock backend and through the service, one after the other
/// in an order that rotates, so that the machine's other load touches all of them alike. The
/// router cost of a round is its time per call minus the direct time per call of that round.
fn paired(rounds: usize, calls: u64) {
    const N_NEW: u64 = 1 << 40;
    let small = Shape::new(16, 8);
    let large = Shape::new(64, 8);
    let hot = |svc: &mut dyn FnMut(Req)| {
        for i in 0..HOT_KEYS {
            svc(request(Some(key(i))));
        }
    };
    let mut direct = mock();
    let mut home = SessionAffinityLayer::new()
        .key(ExtensionKey)
        .layer(small.fleet(1));
    let mut noext = SessionAffinityLayer::new()
        .key(ExtensionKey)
        .decision_extension(false)
        .layer(small.fleet(1));
    let mut fresh = SessionAffinityLayer::new()
        .key(ExtensionKey)
        .layer(large.fleet(1));
    hot(&mut |r| drop(call_now(&mut home, r)));
    hot(&mut |r| drop(call_now(&mut noext, r)));
    let mut next_new = N_NEW;
    let names = [
        "direct to the mock backend",
        "home hit, 16x8",
        "home hit, 16x8, `decision_extension(false)`",
        "new session, 64x8",
    ];
    let run = |who: usize| -> f64 {
        let t = match who {
            0 => chunked(
                calls,
                |i| request(Some(key(i % HOT_KEYS))),
                |r| drop(black_box(call_now(&mut direct, r))),
            ),
            1 => chunked(
                calls,
                |i| request(Some(key(i % HOT_KEYS))),
                |r| drop(black_box(call_now(&mut home, r))),
            ),
            2 => chunked(
                calls,
                |i| request(Some(key(i % HOT_KEYS))),
                |r| drop(black_box(call_now(&mut noext, r))),
            ),
            _ => {
                let first = next_new;
                next_new += calls;
                chunked(
                    calls,
                    |i| request(Some(key(first + i))),
                    |r| drop(black_box(call_now(&mut fresh, r))),
                )
            }
        };
        t.as_secs_f64() * 1e9 / calls as f64
    };
    // The unmeasured first round also fills the new-session table to its bound.
    let per_call: Vec<[f64; 4]> = common::rotating_rounds(rounds, run);
    println!("\n## Paired rounds ({rounds} rounds of {calls} calls a contender)\n");
    println!("| path | per call, median | router cost (minus direct), median (min to max) |");
    println!("|---|---:|---:|");
    for (who, name) in names.iter().enumerate() {
        let (t, _, _) = median(per_call.iter().map(|r| r[who]).collect());
        let cost = if who == 0 {
            "—".to_string()
        } else {
            let (m, lo, hi) = median(per_call.iter().map(|r| r[who] - r[0]).collect());
            format!("{m:.0} ns ({lo:.0} to {hi:.0} ns)")
        };
        println!("| {name} | {t:.0} ns | {cost} |");
    }
}

/// How many sessions the working-set rounds keep coming back to, whatever the table holds.
const WORKING_SET: u64 = 1_000;

/// Home hits by table size again, in rotating rounds: 1 thousand, 100 thousand and 1 million
/// sessions, each once with every session taking its turn (the working set is the whole table)
/// and once with the same 1,000 sessions coming back (the working set stays small while the
/// table grows), and one dependent random read in an array as big as the million-session table.
/// The ratios to 1 thousand are taken within each round.
fn paired_tables(rounds: usize, calls: u64) {
    let table_sizes = table_sizes();
    let mut svcs: Vec<(u64, Svc)> = table_sizes.iter().map(|&n| (n, filled_table(n))).collect();
    let largest = svcs
        .last()
        .map_or(0, |(_, s)| s.stats().session_table_bytes);
    let next = random_cycle(largest);
    let mut at = 0usize;
    let mut cursor = 0u64;
    let sizes = table_sizes.len();
    let run = |who: usize| -> f64 {
        let t = if who == sizes {
            let start = Instant::now();
            for _ in 0..calls {
                at = next[at];
            }
            black_box(at);
            start.elapsed()
        } else {
            // 0..sizes: the whole table; sizes + 1..: the small working set.
            let (whole, i) = if who < sizes {
                (true, who)
            } else {
                (false, who - sizes - 1)
            };
            let (n, svc) = &mut svcs[i];
            let working = if whole { *n } else { WORKING_SET.min(*n) };
            spread_home_hits(svc, *n, working, cursor, calls)
        };
        cursor += calls;
        t.as_secs_f64() * 1e9 / calls as f64
    };
    let per_call: Vec<[f64; 7]> = common::rotating_rounds(rounds, run);
    println!("\n## Paired table rounds ({rounds} rounds of {calls} calls a contender)\n");
    println!(
        "| sessions | working set: the whole table, median | ratio to 1 thousand, median (min to max) \
         | working set: {WORKING_SET} sessions, median | ratio to 1 thousand, median (min to max) |"
    );
    println!("|---:|---:|---:|---:|---:|");
    for (who, n) in table_sizes.iter().enumerate() {
        let mut cells = vec![];
        for first in [0, sizes + 1] {
            let (t, _, _) = median(per_call.iter().map(|r| r[first + who]).collect());
            let (m, lo, hi) = median(per_call.iter().map(|r| r[first + who] / r[first]).collect());
            cells.push(format!("{t:.0} ns | {m:.2}x ({lo:.2}x to {hi:.2}x)"));
        }
        println!("| {n} | {} | {} |", cells[0], cells[1]);
    }
    let (t, lo, hi) = median(per_call.iter().map(|r| r[sizes]).collect());
    println!(
        "\nOne random read in a {largest}-byte array: {t:.0} ns, median ({lo:.0} to {hi:.0} ns)."
    );
}

/// The median, least and greatest of `v`.
fn median(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

fn main() {
    common::main_with_paired(benches, |full| {
        if full {
            paired(21, 200_000);
            paired_tables(21, 200_000);
        } else {
            paired(1, 2_000);
            paired_tables(1, 2_000);
        }
    });
}
