//! Allocations on the call path, counted by the allocator: a request placed on its home, its
//! decision kept in its body (`decision_extension(false)`), allocates nothing, and reading its
//! answer to the end, the usage it reports included, allocates only the reader's state; with
//! the `metrics` feature too (its series by outcome, and its backend's, are looked up by keys
//! built beforehand, in whichever recorder is installed then).
//!
//! The allocator counts the whole process, so this is a binary of its own, without the test
//! harness: the harness's own thread allocates while a test it has just started runs, which
//! would be counted now and then. Its checks run one after the other on the main thread.

#[path = "../../benches/common/mod.rs"]
mod common;

use std::alloc::System;
use std::convert::Infallible;
use std::future::{ready, Ready};
use std::hint::black_box;
use std::num::NonZeroU32;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http_body::Body;
use http_body_util::Full;
use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};
use tower::{service_fn, Layer};
use tower_affinity::discover::StaticFleet;
use tower_affinity::key::ExtensionKey;
use tower_affinity::{Backend, SessionAffinityLayer};

use common::{call_now, key, request, Req, Shape};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// A llama-server's answer to a chat request: its usage, the reuse in it.
const ANSWER: &[u8] = br#"{"id":"c1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"done"}}],"usage":{"prompt_tokens":1200,"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":1024}},"timings":{"prompt_n":176,"cache_n":1024,"prompt_ms":88.0}}"#;

fn answer(_req: Req) -> Ready<Result<http::Response<Full<Bytes>>, Infallible>> {
    let mut res = http::Response::new(Full::new(Bytes::from_static(ANSWER)));
    res.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    ready(Ok(res))
}

/// Polls `body` to its end, which must come at once; the frames it gave.
fn read_now<B: Body>(body: B) -> usize
where
    B::Error: std::fmt::Debug,
{
    let mut cx = Context::from_waker(Waker::noop());
    let mut body = pin!(body);
    let mut frames = 0;
    loop {
        match body.as_mut().poll_frame(&mut cx) {
            Poll::Ready(Some(Ok(_))) => frames += 1,
            Poll::Ready(Some(Err(e))) => panic!("body failed: {e:?}"),
            Poll::Ready(None) => return frames,
            Poll::Pending => panic!("body not ready at once"),
        }
    }
}

const HOT: u64 = 64;
const N: u64 = 1_000;

fn main() {
    let checks: [(&str, fn()); 3] = [
        ("a_home_hit_allocates_nothing", a_home_hit_allocates_nothing),
        ("reading_an_answer_allocates_only_its_readers_state", || {
            reading_an_answer_allocates_only_its_readers_state(SessionAffinityLayer::new())
        }),
        (
            "reading_an_answer_allocates_only_its_readers_state_under_a_balancers_labels",
            || {
                let layer = SessionAffinityLayer::new();
                #[cfg(feature = "metrics")]
                let layer = layer.metrics_labels([("fleet", "qwen3-coder")]);
                reading_an_answer_allocates_only_its_readers_state(layer)
            },
        ),
    ];
    for (name, check) in checks {
        check();
        println!("test {name} ... ok");
    }
}

fn a_home_hit_allocates_nothing() {
    let mut svc = SessionAffinityLayer::new()
        .key(ExtensionKey)
        .decision_extension(false)
        .layer(Shape::new(2, 2).fleet(1));
    for i in 0..HOT {
        drop(call_now(&mut svc, request(Some(key(i)))));
    }
    let reqs: Vec<Req> = (0..N).map(|i| request(Some(key(i % HOT)))).collect();
    let region = Region::new(GLOBAL);
    for req in reqs {
        drop(black_box(call_now(&mut svc, req)));
    }
    let s = region.change();
    assert_eq!((s.allocations, s.bytes_allocated), (0, 0), "{N} requests");
}

/// An answer read to the end: the first byte timed, the usage learned and counted, on its
/// backend's series too.
fn reading_an_answer_allocates_only_its_readers_state(layer: SessionAffinityLayer) {
    let slots = NonZeroU32::new(1_000).expect("not zero");
    let backends = Shape::new(2, 2).names().into_iter().map(|(id, node)| {
        let backend = service_fn(answer as fn(Req) -> _);
        (id, Backend::new(node, backend).slots(slots))
    });
    let mut svc = layer
        .key(ExtensionKey)
        .decision_extension(false)
        .layer(StaticFleet::new(backends));
    for i in 0..HOT {
        assert_eq!(
            read_now(call_now(&mut svc, request(Some(key(i)))).into_body()),
            1
        );
    }
    // The backend's own allocations (its answer's headers), to tell apart.
    let reqs: Vec<Req> = (0..N).map(|i| request(Some(key(i % HOT)))).collect();
    let region = Region::new(GLOBAL);
    for req in reqs {
        drop(black_box(answer(req)));
    }
    let backend = region.change();
    let reqs: Vec<Req> = (0..N).map(|i| request(Some(key(i % HOT)))).collect();
    let region = Region::new(GLOBAL);
    for req in reqs {
        let res = black_box(call_now(&mut svc, req));
        black_box(read_now(res.into_body()));
    }
    let s = region.change();
    // One allocation an answer is the router's: its reader's state, boxed so that a body
    // that carries no usage stays small.
    assert_eq!(
        s.allocations - backend.allocations,
        N as usize,
        "{N} requests and their answers: {s:?}, the backend's own {backend:?}"
    );
    let stats = svc.stats();
    assert_eq!(
        stats.usage_reports,
        HOT + N,
        "every answer's usage was read"
    );
    assert_eq!(stats.reused_tokens, (HOT + N) * 1024);
}
