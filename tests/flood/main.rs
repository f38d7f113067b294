//! A flood of distinct session keys: the session table stays within its bound, its memory
//! stays flat once full, and the cost of a request stays flat as the flood goes on.
//!
//! Ignored by default (ten million requests). Run it in release:
//!
//! ```text
//! cargo test --release --test flood -- --ignored --nocapture
//! ```
//!
//! It prints, for each million requests, the time taken, the sessions held, the table's bytes
//! and the process's resident memory. Timings are printed, not asserted.

use std::convert::Infallible;
use std::fmt::Write as _;
use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use tower::{Layer, Service, ServiceExt};
use tower_affinity::discover::StaticFleet;
use tower_affinity::{Backend, SessionAffinityLayer, Sessions};

const REQUESTS: u64 = 10_000_000;
const PER_ROUND: u64 = 1_000_000;
const BOUND: usize = 1_000_000;

/// Resident memory of this process in bytes, from `/proc/self/statm` (0 where there is none).
fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}

#[tokio::test(flavor = "current_thread")]
#[ignore = "ten million requests: run in release with --ignored --nocapture"]
async fn ten_million_distinct_keys_keep_the_table_bounded_and_flat() {
    // Backends that answer at once with an empty body.
    let answer = tower::service_fn(|_req: http::Request<Full<Bytes>>| async {
        Ok::<_, Infallible>(http::Response::new(Full::new(Bytes::new())))
    });
    let slots = NonZeroU32::new(8).unwrap();
    let fleet = StaticFleet::new(
        ["a1", "a2", "b1", "b2"].map(|id| (id, Backend::new(&id[..1], answer).slots(slots))),
    );
    let mut svc = SessionAffinityLayer::new()
        .sessions(
            Sessions::new()
                .max_entries(BOUND)
                .idle_timeout(Duration::from_secs(24 * 3600)),
        )
        .layer(fleet);

    let mut key = String::with_capacity(32);
    let mut table_bytes = Vec::new();
    let mut report = String::new();
    let start = Instant::now();
    let mut round_start = start;
    for i in 0..REQUESTS {
        key.clear();
        write!(key, "flood-session-{i}").unwrap();
        let req = http::Request::post("/v1/chat/completions")
            .header("x-session-id", key.as_str())
            .body(Full::new(Bytes::new()))
            .unwrap();
        let res = svc.ready().await.unwrap().call(req).await.unwrap();
        // Dropping the response releases its slot.
        drop(res);

        if (i + 1) % PER_ROUND == 0 {
            let round = round_start.elapsed();
            round_start = Instant::now();
            let stats = svc.stats();
            assert!(stats.sessions <= BOUND, "table over its bound: {stats:?}");
            assert_eq!(stats.in_flight, 0);
            table_bytes.push(stats.session_table_bytes);
            let line = format!(
                "{:>3} M requests: {:>7.1} ms this million ({:>5.0} ns/request), sessions {:>9}, table {:>6.1} MiB, rss {:>6.1} MiB\n",
                (i + 1) / PER_ROUND,
                round.as_secs_f64() * 1e3,
                round.as_nanos() as f64 / PER_ROUND as f64,
                stats.sessions,
                stats.session_table_bytes as f64 / (1 << 20) as f64,
                rss_bytes() as f64 / (1 << 20) as f64,
            );
            print!("{line}");
            report.push_str(&line);
        }
    }
    let stats = svc.stats();
    println!(
        "total {:.1} s; new sessions {}, home hits {}, bytes per session at the bound {:.1}",
        start.elapsed().as_secs_f64(),
        stats.new_sessions,
        stats.home_hits,
        stats.session_table_bytes as f64 / stats.sessions as f64
    );
    // Every key was new: none was ever seen twice.
    assert_eq!(stats.new_sessions, REQUESTS);
    assert_eq!((stats.in_flight, stats.waiting), (0, 0));
    // Full after the first two million at the latest, and flat from then on.
    assert!(stats.sessions > BOUND * 9 / 10, "{stats:?}");
    let full = table_bytes[1];
    assert!(
        table_bytes[1..].iter().all(|&b| b == full),
        "table memory grew after it filled: {table_bytes:?}"
    );
    assert!(full <= BOUND * 64, "{full} bytes for {BOUND} sessions");
}
