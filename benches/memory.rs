//! Memory per tracked session and per prompt-chain link, and allocations per request (issue 6,
//! part 3; BENCHMARKS.md, 5c).
//!
//! A counting global allocator (`stats_alloc`, a thin wrapper over the system allocator that
//! counts every allocation, reallocation and free) measures the bytes the service holds after
//! placing `n` distinct sessions, for `n` of 1 thousand, 100 thousand and 1 million, with a
//! table bounded at `n` entries. The bytes are checked against the table's own accounting,
//! `stats().session_table_bytes`. Then `2n` more sessions go through the full table, to show
//! that eviction keeps the footprint flat.
//!
//! Second, the cache model's bytes per prompt-chain link: conversations of growing chains
//! placed through the service.
//!
//! Third, the allocations one request makes on the whole call path (requests are built before
//! the counted region; the mock backend itself allocates nothing).
//!
//! Counted bytes are the sizes requested from the allocator; the allocator's own per-block
//! overhead is not included. Not a criterion bench: it prints three Markdown tables.
//!
//! Run with `cargo bench --bench memory`. Under `cargo test`, which runs it once to show that
//! it works, the sizes are smaller (tables of 1 to 4 thousand sessions, 1,000 requests).

use std::alloc::System;
use std::hint::black_box;

use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};
use tower::Layer;
use tower_affinity::key::{ExtensionKey, PromptFacts};
use tower_affinity::{PromptChain, SessionAffinityLayer, Sessions};

#[path = "common/mod.rs"]
mod common;

use common::{call_now, header_request, key, mock, mock_with_extension, request, Req, Shape};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// Bytes allocated and not freed since the region began.
fn held(region: &Region<'_, System>) -> i64 {
    let s = region.change();
    i64::try_from(s.bytes_allocated).expect("fits")
        - i64::try_from(s.bytes_deallocated).expect("fits")
}

fn per_session() {
    let shape = Shape::new(16, 8);
    println!("## Memory per tracked session (fleet {})\n", shape.label());
    println!(
        "| table bound | sessions placed | sessions held | bytes held (allocator) | bytes/session (allocator) | session_table_bytes | bytes/session (accounting) | accounting / allocator | after 2x more sessions: bytes/session (allocator) |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for n in common::sized([1_000u64, 100_000, 1_000_000], [1_000, 2_000, 4_000]) {
        let region = Region::new(GLOBAL);
        let bound = usize::try_from(n).expect("fits");
        let mut svc = SessionAffinityLayer::new()
            .key(ExtensionKey)
            .sessions(Sessions::new().max_entries(bound))
            .layer(shape.fleet(1));
        // The first call applies discovery: the fleet is built before the count starts.
        drop(call_now(&mut svc, request(None)));
        let empty = held(&region);
        let empty_table = svc.stats().session_table_bytes;
        for i in 0..n {
            drop(call_now(&mut svc, request(Some(key(i)))));
        }
        let full = held(&region);
        let stats = svc.stats();
        let bytes = full - empty;
        let sessions = stats.sessions as f64;
        let accounting = stats.session_table_bytes;
        // Churn: twice as many new sessions again, each evicting one.
        for i in n..3 * n {
            drop(call_now(&mut svc, request(Some(key(i)))));
        }
        let churned = held(&region) - empty;
        let churned_sessions = svc.stats().sessions as f64;
        println!(
            "| {n} | {n} | {} | {bytes} | {:.1} | {accounting} | {:.1} | {:.3} | {:.1} |",
            stats.sessions,
            bytes as f64 / sessions,
            accounting as f64 / sessions,
            (accounting - empty_table) as f64 / bytes as f64,
            churned as f64 / churned_sessions,
        );
        drop(svc);
    }
    println!();
}

/// The cache model's memory: conversations of growing chains placed through the service, the
/// bytes the allocator saw it take against the links it tracks, and its own accounting
/// (`stats().cache_model_bytes`).
fn per_block() {
    let shape = Shape::new(16, 8);
    println!(
        "## Memory per tracked prompt-chain link (fleet {})
",
        shape.label()
    );
    println!(
        "| conversations x turns | links tracked | bytes held (allocator, less the session table's) | bytes/link (allocator) | cache_model_bytes | bytes/link (accounting) |"
    );
    println!("|---:|---:|---:|---:|---:|---:|");
    let sizes = common::sized(
        [(128u64, 16u64), (1_024, 16), (4_096, 8)],
        [(128, 16), (256, 16), (512, 8)],
    );
    for (sessions, turns) in sizes {
        let mut svc = SessionAffinityLayer::new()
            .key(ExtensionKey)
            .layer(shape.fleet(1));
        drop(call_now(&mut svc, request(None)));
        let region = Region::new(GLOBAL);
        let (empty, empty_table) = (
            svc.stats().cache_model_bytes,
            svc.stats().session_table_bytes,
        );
        for t in 0..turns {
            for s in 0..sessions {
                let chain = PromptChain::from_blocks((0..10 + 2 * t).map(|i| (s << 32 | i, 40)));
                let mut req = request(Some(key(s)));
                req.extensions_mut().insert(PromptFacts::from_chain(chain));
                drop(call_now(&mut svc, req));
            }
        }
        // The session table grows too: its bytes are not the model's.
        let table = svc.stats().session_table_bytes - empty_table;
        let bytes = held(&region) - table as i64;
        let links: usize = svc.backends().iter().map(|b| b.cached_blocks).sum();
        let accounting = svc.stats().cache_model_bytes - empty;
        println!(
            "| {sessions} x {turns} | {links} | {bytes} | {:.1} | {accounting} | {:.1} |",
            bytes as f64 / links as f64,
            accounting as f64 / links as f64,
        );
    }
    println!();
}

/// Allocations and bytes per request over `n` requests made by `make`, counted around `run`.
fn count(n: u64, make: impl Fn(u64) -> Req, mut run: impl FnMut(Req)) -> (f64, f64) {
    let reqs: Vec<Req> = (0..n).map(make).collect();
    let region = Region::new(GLOBAL);
    for req in reqs {
        run(req);
    }
    let s = region.change();
    (
        s.allocations as f64 / n as f64,
        s.bytes_allocated as f64 / n as f64,
    )
}

fn per_request() {
    let n = common::sized(100_000, 1_000);
    const HOT: u64 = 1024;
    let shape = Shape::new(16, 8);
    println!(
        "## Allocations per request (fleet {}, {n} requests each)\n",
        shape.label()
    );
    println!("| path | allocations/request | bytes allocated/request |");
    println!("|---|---:|---:|");
    let row = |name: &str, (allocs, bytes): (f64, f64)| {
        println!("| {name} | {allocs:.2} | {bytes:.1} |");
    };

    let mut backend = mock();
    row(
        "direct to the mock backend",
        count(
            n,
            |i| request(Some(key(i))),
            |r| drop(black_box(call_now(&mut backend, r))),
        ),
    );

    let mut svc = SessionAffinityLayer::new()
        .key(ExtensionKey)
        .layer(shape.fleet(1));
    for i in 0..HOT {
        drop(call_now(&mut svc, request(Some(key(i)))));
    }
    row(
        "affinity: home hit",
        count(
            n,
            |i| request(Some(key(i % HOT))),
            |r| drop(black_box(call_now(&mut svc, r))),
        ),
    );
    row(
        "affinity: new session (table filling, 100,000 bound)",
        count(
            n,
            |i| request(Some(key(HOT + i))),
            |r| drop(black_box(call_now(&mut svc, r))),
        ),
    );
    row(
        "affinity: new session (full table, evicting)",
        count(
            n,
            |i| request(Some(key(HOT + n + i))),
            |r| drop(black_box(call_now(&mut svc, r))),
        ),
    );
    row(
        "affinity: keyless",
        count(
            n,
            |_| request(None),
            |r| drop(black_box(call_now(&mut svc, r))),
        ),
    );

    let mut svc = SessionAffinityLayer::new()
        .key(ExtensionKey)
        .decision_extension(false)
        .layer(shape.fleet(1));
    for i in 0..HOT {
        drop(call_now(&mut svc, request(Some(key(i)))));
    }
    row(
        "affinity: home hit, `decision_extension(false)`",
        count(
            n,
            |i| request(Some(key(i % HOT))),
            |r| drop(black_box(call_now(&mut svc, r))),
        ),
    );

    // A backend whose responses already carry an extension, as hyper-util's client's do.
    let mut backend = mock_with_extension();
    row(
        "direct to a mock backend whose responses carry an extension",
        count(
            n,
            |i| request(Some(key(i))),
            |r| drop(black_box(call_now(&mut backend, r))),
        ),
    );
    let mut svc = SessionAffinityLayer::new()
        .key(ExtensionKey)
        .layer(shape.fleet_of(1, mock_with_extension));
    for i in 0..HOT {
        drop(call_now(&mut svc, request(Some(key(i)))));
    }
    row(
        "affinity: home hit, same backend",
        count(
            n,
            |i| request(Some(key(i % HOT))),
            |r| drop(black_box(call_now(&mut svc, r))),
        ),
    );

    let mut svc = SessionAffinityLayer::new().layer(shape.fleet(1));
    for i in 0..HOT {
        drop(call_now(&mut svc, header_request(i)));
    }
    row(
        "affinity: home hit, key from header (SHA-256)",
        count(
            n,
            |i| header_request(i % HOT),
            |r| drop(black_box(call_now(&mut svc, r))),
        ),
    );
    println!();
}

fn main() {
    // `cargo bench` passes `--bench` and any filter; this binary has nothing to filter.
    per_session();
    per_block();
    per_request();
}
