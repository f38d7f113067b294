//! Reading a request body costs memory in proportion to its size, whatever its shape: the
//! shapes that once cost 16 to 48 times the body (an array of small numbers in a prompt item or a
//! key field, an object of many small members in a key field, a great many tiny items) are
//! read within a small multiple of it, all inside the one poll that reads the body.
//!
//! The allocator counts the whole process, so these tests are a binary of their own, and run
//! one after another (a lock), each body built before the count starts.
//!
//! `cargo test --release --test body_memory -- --nocapture` prints what each shape costs;
//! `-- --ignored --nocapture` also times them per byte from 64 KiB to 4 MiB.

use parking_lot::Mutex;
use std::alloc::System;
use std::convert::Infallible;
use std::time::Instant;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};
use tower::{Layer, Service, ServiceExt};
use tower_affinity::key::{BodyKeyLayer, PromptFacts};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// One measurement at a time: the allocator is the process's.
static ONE_AT_A_TIME: Mutex<()> = parking_lot::const_mutex(());

/// `open`, then `unit` repeated (the last one's trailing comma dropped), then `close`, about
/// `size` bytes in all.
fn repeated(open: &str, unit: &str, close: &str, size: usize) -> Bytes {
    let mut b = Vec::with_capacity(size + unit.len() + close.len());
    b.extend_from_slice(open.as_bytes());
    while b.len() + unit.len() + close.len() <= size {
        b.extend_from_slice(unit.as_bytes());
    }
    if b.ends_with(b",") {
        b.pop();
    }
    b.extend_from_slice(close.as_bytes());
    Bytes::from(b)
}

/// `{"metadata":{"0":0,"1":0,...}}`: many members, each key different.
fn metadata_keys(size: usize) -> Bytes {
    let mut b = br#"{"metadata":{"#.to_vec();
    let mut i = 0u64;
    while b.len() + 24 < size {
        b.extend_from_slice(format!(r#""{i:x}":0,"#).as_bytes());
        i += 1;
    }
    b.pop();
    b.extend_from_slice(b"}}");
    Bytes::from(b)
}

/// The shapes, each about `size` bytes.
fn shapes(size: usize) -> Vec<(&'static str, Bytes)> {
    vec![
        (
            "a message that is an array of zeros",
            repeated(r#"{"messages":[["#, "0,", "]]}", size),
        ),
        (
            "a message that is an object of many members",
            repeated(r#"{"messages":[{"#, r#""a":0,"#, "}]}", size),
        ),
        (
            "many empty array messages",
            repeated(r#"{"messages":["#, "[],", "]}", size),
        ),
        (
            "a prompt array of zeros",
            repeated(r#"{"prompt":["#, "0,", "]}", size),
        ),
        (
            "messages read again whole",
            repeated(r#"{"messages":["x","#, "0,", "]}", size),
        ),
        (
            "tiny messages",
            repeated(
                r#"{"messages":["#,
                r#"{"role":"user","content":"hello there"},"#,
                "]}",
                size,
            ),
        ),
        (
            "short messages, kept member by member",
            repeated(
                r#"{"messages":["#,
                &format!(r#"{{"role":"user","content":"{}"}},"#, "x".repeat(64)),
                "]}",
                size,
            ),
        ),
        (
            "the user key field as an array",
            repeated(r#"{"user":["#, "0,", "]}", size),
        ),
        (
            "stream as an array of zeros",
            repeated(r#"{"stream":["#, "0,", "]}", size),
        ),
        (
            "the metadata key field of many members",
            metadata_keys(size),
        ),
        (
            "a key field deep in arrays",
            repeated(r#"{"metadata":{"user_id":["#, "[0],", "]}}", size),
        ),
        (
            "one long string",
            repeated(
                r#"{"messages":[{"role":"user","content":""#,
                "x",
                r#""}]}"#,
                size,
            ),
        ),
    ]
}

/// What reading `body` through `BodyKeyLayer::new()` allocates (bytes, reallocations' growth
/// included), and how long the one poll that reads it takes.
fn read_through_the_layer(body: Bytes) -> (i64, f64) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let mut svc =
        BodyKeyLayer::new().layer(tower::service_fn(|req: Request<Full<Bytes>>| async move {
            let links = req
                .extensions()
                .get::<PromptFacts>()
                .map_or(0, |f| f.chain.len());
            Ok::<_, Infallible>(http::Response::new(links.to_string()))
        }));
    rt.block_on(ServiceExt::<Request<Full<Bytes>>>::ready(&mut svc))
        .unwrap();
    let req = Request::post("/v1/chat/completions")
        .body(Full::new(body))
        .unwrap();
    let region = Region::new(GLOBAL);
    let t = Instant::now();
    let res = rt.block_on(svc.call(req)).unwrap();
    let took = t.elapsed().as_secs_f64();
    let s = region.change();
    drop(res);
    (s.bytes_allocated as i64 + s.bytes_reallocated as i64, took)
}

/// Reads `body` through the layer and prints what it allocated: how many times its size.
fn allocated_over_size(what: &str, body: Bytes) -> f64 {
    let len = body.len() as i64;
    let (allocated, took) = read_through_the_layer(body);
    let times = allocated as f64 / len as f64;
    eprintln!(
        "{what}: body {} KiB, allocated {} KiB ({times:.2} x), {:.1} ms",
        len >> 10,
        allocated >> 10,
        took * 1e3
    );
    times
}

#[test]
fn reading_a_body_of_any_shape_allocates_at_most_three_times_its_size() {
    let _one = ONE_AT_A_TIME.lock();
    let mut over = Vec::new();
    for (what, body) in shapes(4 << 20) {
        let times = allocated_over_size(what, body);
        if times > 3.0 {
            over.push((what, times));
        }
    }
    assert!(
        over.is_empty(),
        "allocated more than 3 times the body: {over:?}"
    );
}

/// Time per byte from 64 KiB to 4 MiB, for each shape (release builds only tell).
#[test]
#[ignore]
fn measure_time_per_byte() {
    let _one = ONE_AT_A_TIME.lock();
    let sizes = [64 << 10, 256 << 10, 1 << 20, 4 << 20];
    let names: Vec<&str> = shapes(1 << 10).into_iter().map(|(n, _)| n).collect();
    for (i, name) in names.iter().enumerate() {
        let mut per_byte = Vec::new();
        for size in sizes {
            let body = shapes(size).swap_remove(i).1;
            let reps = (64 << 20) / size;
            let mut total = 0.0;
            for _ in 0..reps {
                total += read_through_the_layer(body.clone()).1;
            }
            per_byte.push(total * 1e9 / (reps * body.len()) as f64);
        }
        eprintln!(
            "{name:>40}: ns/byte {:.2} {:.2} {:.2} {:.2}  (4 MiB / 64 KiB = {:.2})",
            per_byte[0],
            per_byte[1],
            per_byte[2],
            per_byte[3],
            per_byte[3] / per_byte[0]
        );
    }
}

/// What one body at the default limit (16 MiB) of each shape allocates.
#[test]
#[ignore]
fn measure_one_body_at_the_limit() {
    let _one = ONE_AT_A_TIME.lock();
    for (what, body) in shapes(BodyKeyLayer::DEFAULT_LIMIT - 64) {
        allocated_over_size(what, body);
    }
}
