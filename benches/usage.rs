//! What reading the backends' answers for their usage costs.
//!
//! - `usage/json_4k/{observed,unobserved}`: a request through the service whose backend
//!   answers a 4 KiB chat completion (`application/json`, usage at the end), the body read to
//!   its end; with the answers observed (the default) and with
//!   `observe_usage(false)`. The difference is the observer's cost per answer.
//! - `usage/sse_64/{observed,unobserved}`: the same with an SSE stream of 64 token chunks
//!   (about 150 bytes each, no usage: the client did not ask for it) and llama-server's last
//!   chunk with its `timings`. The difference over 65 is the cost per frame.
//! - `usage/from_body/*`: [`Usage::from_body`] alone on the same bytes.
//! - `usage/ask_sse_64/{asked,not_asked}`: a streaming chat request (130 bytes) through
//!   `BodyKeyLayer` alone, with `ask_stream_usage(true)` and without, to a backend that
//!   answers 64 token chunks, the chunk finishing the choice and a usage chunk of its own (as
//!   vLLM does when asked); the answer read to its end. The difference is what asking costs:
//!   the body rewritten, each frame passed through the filter, the usage chunk taken out.
//!
//! Run with `cargo bench --bench usage`. For instruction counts, which other load on the
//! machine does not disturb, the same paths run a fixed number of times:
//!
//! ```text
//! cargo bench --bench usage --no-run
//! valgrind --tool=callgrind --toggle-collect='*measure*' \
//!     target/release/deps/usage-<hash> callgrind json_4k observed 10000
//! ```
//!
//! (`json_4k` or `sse_64`; `observed` or `unobserved`; divide the total by the count. Any
//! other word is an error, exit status 2.)

use std::convert::Infallible;
use std::future::Future;
use std::hint::black_box;
use std::num::NonZeroU32;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use criterion::{criterion_group, Criterion, Throughput};
use http_body::Body;
use http_body_util::Full;
use tower::{service_fn, Layer, Service};
use tower_affinity::discover::StaticFleet;
use tower_affinity::key::BodyKeyLayer;
use tower_affinity::{Backend, SessionAffinityLayer, Usage};

#[path = "common/mod.rs"]
mod common;

/// A chat completion of about 4 KiB, usage last.
fn json_answer() -> Bytes {
    let content = "Here is the change to src/main.rs:\n```rust\nfn main() {\n    println!(\"hello\");\n}\n```\n".repeat(44);
    let body = serde_json::json!({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "qwen",
        "choices": [{"index": 0, "finish_reason": "stop",
            "message": {"role": "assistant", "content": content}}],
        "usage": {"prompt_tokens": 30160, "completion_tokens": 900,
            "prompt_tokens_details": {"cached_tokens": 30000}},
    });
    Bytes::from(serde_json::to_vec(&body).expect("a body"))
}

/// 64 token chunks, then the usage chunk and `[DONE]`.
fn sse_frames() -> Vec<Bytes> {
    let mut frames: Vec<Bytes> = (0..64)
        .map(|i| {
            Bytes::from(format!(
                "data: {{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"qwen\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"tok{i} \"}}}}]}}\n\n"
            ))
        })
        .collect();
    frames.push(Bytes::from_static(
        b"data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"timings\":{\"cache_n\":30000,\"prompt_n\":160,\"prompt_ms\":800.5,\"predicted_n\":64}}\n\ndata: [DONE]\n\n",
    ));
    frames
}

/// A body of fixed frames.
struct Frames(std::vec::IntoIter<Bytes>);

impl Body for Frames {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        Poll::Ready(self.0.next().map(|b| Ok(http_body::Frame::data(b))))
    }

    fn is_end_stream(&self) -> bool {
        self.0.len() == 0
    }
}

/// Polls `f` once: every future here is ready at once.
fn now<F: Future>(f: F) -> F::Output {
    match pin!(f).poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => unreachable!("the backend answers at once"),
    }
}

/// The service over one backend that answers `frames` with `content_type`.
fn service(
    content_type: &'static str,
    frames: Vec<Bytes>,
    observed: bool,
) -> impl Service<
    http::Request<()>,
    Response = http::Response<tower_affinity::ResponseBody<Frames>>,
    Error = tower_affinity::Error,
> {
    let backend = service_fn(move |_: http::Request<()>| {
        let mut res = http::Response::new(Frames(frames.clone().into_iter()));
        res.headers_mut()
            .insert("content-type", content_type.parse().expect("a header"));
        std::future::ready(Ok::<_, Infallible>(res))
    });
    let fleet = StaticFleet::new([(
        "a",
        Backend::new("n", backend).slots(NonZeroU32::new(1024).expect("slots")),
    )]);
    SessionAffinityLayer::new()
        .observe_usage(observed)
        .layer(fleet)
}

/// One request through `svc`, its answer read to the end.
fn exchange<S>(svc: &mut S) -> (usize, Option<Usage>)
where
    S: Service<
        http::Request<()>,
        Response = http::Response<tower_affinity::ResponseBody<Frames>>,
        Error = tower_affinity::Error,
    >,
{
    let _ = now(std::future::poll_fn(|cx| svc.poll_ready(cx)));
    let res = now(svc.call(http::Request::new(()))).expect("an answer");
    let mut body = pin!(res.into_body());
    let mut cx = Context::from_waker(Waker::noop());
    let mut n = 0;
    while let Poll::Ready(Some(Ok(frame))) = body.as_mut().poll_frame(&mut cx) {
        n += frame.data_ref().map_or(0, |d| d.len());
    }
    (n, body.usage())
}

fn answer(name: &str) -> Option<(&'static str, Vec<Bytes>)> {
    match name {
        "json_4k" => Some(("application/json", vec![json_answer()])),
        "sse_64" => Some(("text/event-stream", sse_frames())),
        _ => None,
    }
}

fn bench_path(c: &mut Criterion, name: &str) {
    let (content_type, frames) = answer(name).expect("a known answer");
    let mut group = c.benchmark_group(format!("usage/{name}"));
    group.throughput(Throughput::Elements(1));
    for observed in [true, false] {
        let mut svc = service(content_type, frames.clone(), observed);
        let label = if observed { "observed" } else { "unobserved" };
        group.bench_function(label, |b| b.iter(|| black_box(exchange(&mut svc))));
    }
    group.finish();
}

#[inline(never)]
fn measure<S>(svc: &mut S, count: u64)
where
    S: Service<
        http::Request<()>,
        Response = http::Response<tower_affinity::ResponseBody<Frames>>,
        Error = tower_affinity::Error,
    >,
{
    for _ in 0..count {
        black_box(exchange(svc));
    }
}

/// What a vLLM-like backend streams when asked for usage: 64 token chunks, the finishing
/// chunk, the usage chunk, `[DONE]`; a frame each.
fn asked_frames() -> Vec<Bytes> {
    let mut frames = sse_frames();
    frames.pop();
    frames.push(Bytes::from_static(
        b"data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"qwen\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
    ));
    frames.push(Bytes::from_static(
        b"data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"qwen\",\"choices\":[],\"usage\":{\"prompt_tokens\":30160,\"completion_tokens\":64,\"prompt_tokens_details\":{\"cached_tokens\":30000}}}\n\n",
    ));
    frames.push(Bytes::from_static(b"data: [DONE]\n\n"));
    frames
}

const STREAM_REQUEST: &[u8] = br#"{"model":"qwen","stream":true,"messages":[{"role":"system","content":"You are a coding agent."},{"role":"user","content":"Fix the failing test."}]}"#;

fn bench_ask(c: &mut Criterion) {
    let frames = asked_frames();
    let mut group = c.benchmark_group("usage/ask_sse_64");
    group.throughput(Throughput::Elements(1));
    for ask in [true, false] {
        let frames = frames.clone();
        let backend = service_fn(move |_: http::Request<Full<Bytes>>| {
            let mut res = http::Response::new(Frames(frames.clone().into_iter()));
            res.headers_mut().insert(
                "content-type",
                "text/event-stream".parse().expect("a header"),
            );
            std::future::ready(Ok::<_, Infallible>(res))
        });
        let mut svc = BodyKeyLayer::new().ask_stream_usage(ask).layer(backend);
        let label = if ask { "asked" } else { "not_asked" };
        group.bench_function(label, |b| {
            b.iter(|| {
                let _ = now(std::future::poll_fn(|cx| {
                    Service::<http::Request<Full<Bytes>>>::poll_ready(&mut svc, cx)
                }));
                let req = http::Request::post("/v1/chat/completions")
                    .body(Full::new(Bytes::from_static(STREAM_REQUEST)))
                    .expect("a request");
                let res = now(svc.call(req)).expect("an answer");
                let mut body = pin!(res.into_body());
                let mut cx = Context::from_waker(Waker::noop());
                let mut n = 0;
                while let Poll::Ready(Some(Ok(frame))) = body.as_mut().poll_frame(&mut cx) {
                    n += frame.data_ref().map_or(0, |d| d.len());
                }
                black_box(n)
            })
        });
    }
    group.finish();
}

fn benches(c: &mut Criterion) {
    let json = json_answer();
    let sse = sse_frames();
    bench_path(c, "json_4k");
    bench_path(c, "sse_64");
    bench_ask(c);
    let mut group = c.benchmark_group("usage/from_body");
    group.bench_function("json_4k", |b| {
        b.iter(|| black_box(Usage::from_body(black_box(&json))))
    });
    let frame = sse[0].clone();
    group.bench_function("sse_frame_without_usage", |b| {
        b.iter(|| black_box(Usage::from_body(black_box(&frame))))
    });
    group.finish();
}

criterion_group!(usage, benches);

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("callgrind") {
        let (name, observed, count) = match common::usage_args(&args[2..]) {
            Ok(a) => a,
            Err(e) => {
                eprintln!("usage bench: {e}");
                std::process::exit(2);
            }
        };
        let (content_type, frames) = answer(name).expect("usage_args names a known answer");
        let mut svc = service(content_type, frames, observed);
        // Warm: the first answers allocate what later ones reuse. Not named `measure*`, so
        // that callgrind's `--toggle-collect='*measure*'` counts the measured answers alone.
        warm(&mut svc);
        measure(&mut svc, count);
        return;
    }
    usage();
    Criterion::default().configure_from_args().final_summary();
}

fn warm<S>(svc: &mut S)
where
    S: Service<
        http::Request<()>,
        Response = http::Response<tower_affinity::ResponseBody<Frames>>,
        Error = tower_affinity::Error,
    >,
{
    for _ in 0..100 {
        black_box(exchange(svc));
    }
}
