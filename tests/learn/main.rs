//! Learning from the backends' answers: the usage they report, read as the bytes pass; the
//! cache model corrected by it; and waiting for a full backend versus moving.
//!
//! The backends are scripted services: each request carries its answer (headers, frames and
//! when each comes) as an extension, so a test says exactly what the backend does. Time is
//! tokio's paused clock.

mod ask;
#[path = "../support/logs.rs"]
mod support_logs;

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use tokio::time::{Instant, Sleep};
use tower::{service_fn, BoxError, Layer, ServiceExt};
use tower_affinity::discover::StaticFleet;
use tower_affinity::key::PromptFacts;
use tower_affinity::placement::{
    Candidates, FleetView, NodeThenBackend, Placement, PlacementRequest,
};
use tower_affinity::{
    Backend, BackendStatus, ContextRefusal, Decision, Outcome, Overflow, PromptChain, ResponseBody,
    SessionAffinity, SessionAffinityLayer, Usage,
};

// === the scripted backend ===

/// What a backend answers: after `headers_after`, this status and these headers; then each
/// frame after its delay. A frame that is `Err` fails the body there.
#[derive(Clone, Debug)]
struct Reply {
    status: http::StatusCode,
    headers_after: Duration,
    content_type: Option<&'static str>,
    encoding: Option<&'static str>,
    frames: Vec<(Duration, Result<Bytes, &'static str>)>,
}

impl Reply {
    fn new(content_type: &'static str, frames: &[&'static [u8]]) -> Self {
        Reply {
            status: http::StatusCode::OK,
            headers_after: Duration::ZERO,
            content_type: Some(content_type),
            encoding: None,
            frames: frames
                .iter()
                .map(|f| (Duration::ZERO, Ok(Bytes::from_static(f))))
                .collect(),
        }
    }

    fn json(body: &'static [u8]) -> Self {
        Reply::new("application/json", &[body])
    }

    /// An SSE stream of these frames, each after its delay.
    fn sse(frames: &[(Duration, &'static [u8])]) -> Self {
        Reply {
            frames: frames
                .iter()
                .map(|&(after, f)| (after, Ok(Bytes::from_static(f))))
                .collect(),
            ..Reply::new("text/event-stream", &[])
        }
    }

    /// An SSE stream of llama-server's shape: a first chunk after `first`, then after
    /// `rest` the last chunk, with its usage and timings.
    fn llama_stream(
        prompt: u64,
        reused: u64,
        prompt_ms: u64,
        first: Duration,
        rest: Duration,
    ) -> Self {
        let last = format!(
            "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":{prompt},\"prompt_tokens_details\":{{\"cached_tokens\":{reused}}}}},\"timings\":{{\"prompt_n\":{},\"cache_n\":{reused},\"prompt_ms\":{prompt_ms}}}}}\n\ndata: [DONE]\n\n",
            prompt - reused
        );
        Reply {
            status: http::StatusCode::OK,
            headers_after: Duration::ZERO,
            content_type: Some("text/event-stream"),
            encoding: None,
            frames: vec![
                (
                    first,
                    Ok(Bytes::from_static(
                        b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n",
                    )),
                ),
                (rest, Ok(Bytes::from(last))),
            ],
        }
    }
}

struct Scripted {
    frames: VecDeque<(Duration, Result<Bytes, &'static str>)>,
    sleep: Option<Pin<Box<Sleep>>>,
}

impl Body for Scripted {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let Some((after, _)) = self.frames.front() else {
            return Poll::Ready(None);
        };
        let after = *after;
        let sleep = self
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(after)));
        if sleep.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        self.sleep = None;
        let (_, frame) = self.frames.pop_front().expect("a frame");
        Poll::Ready(Some(frame.map(Frame::data).map_err(Into::into)))
    }

    fn is_end_stream(&self) -> bool {
        self.frames.is_empty()
    }
}

type Req = http::Request<String>;
type Res = http::Response<ResponseBody<Scripted>>;

fn scripted(
) -> impl tower::Service<Req, Response = http::Response<Scripted>, Error = Infallible, Future: Send>
       + Clone
       + Send {
    service_fn(|req: Req| async move {
        let reply = req
            .extensions()
            .get::<Reply>()
            .cloned()
            .unwrap_or_else(|| Reply::json(b"{}"));
        tokio::time::sleep(reply.headers_after).await;
        let mut res = http::Response::new(Scripted {
            frames: reply.frames.into(),
            sleep: None,
        });
        *res.status_mut() = reply.status;
        if let Some(ct) = reply.content_type {
            res.headers_mut()
                .insert("content-type", ct.parse().unwrap());
        }
        if let Some(enc) = reply.encoding {
            res.headers_mut()
                .insert("content-encoding", enc.parse().unwrap());
        }
        Ok::<_, Infallible>(res)
    })
}

/// A backend of four slots on node `n1`, answering as [`scripted`] does, whose slots share a
/// context of `context` tokens.
fn four_slots_of_context(
    context: u64,
) -> Backend<
    impl tower::Service<Req, Response = http::Response<Scripted>, Error = Infallible, Future: Send>
        + Clone
        + Send,
> {
    Backend::new("n1", scripted())
        .slots(NonZeroU32::new(4).unwrap())
        .context_tokens(std::num::NonZeroU64::new(context).unwrap())
}

/// A backend of one slot on node `n1`, answering as [`scripted`] does, with a cache budget
/// of 1M tokens: each call the same type, for a test to announce it again.
fn one_slot_backend() -> Backend<
    impl tower::Service<Req, Response = http::Response<Scripted>, Error = Infallible, Future: Send>
        + Clone
        + Send,
> {
    Backend::new("n1", scripted())
        .slots(NonZeroU32::MIN)
        .cache_tokens(1 << 20)
}

type Svc<S, P = tower_affinity::placement::NodeThenBackend> =
    SessionAffinity<StaticFleet<S>, tower_affinity::key::HeaderKey, P>;

/// A fleet of one-slot backends, `(id, node)`, each with a cache budget of 1M tokens.
fn fleet<S: Clone>(backends: &[(&'static str, &'static str)], svc: S) -> StaticFleet<S> {
    StaticFleet::new(backends.iter().map(|&(id, node)| {
        let b = Backend::new(node, svc.clone())
            .slots(NonZeroU32::MIN)
            .cache_tokens(1 << 20);
        (id, b)
    }))
}

fn service(
    backends: &[(&'static str, &'static str)],
) -> Svc<
    impl tower::Service<Req, Response = http::Response<Scripted>, Error = Infallible, Future: Send>
        + Clone
        + Send,
> {
    SessionAffinityLayer::new().layer(fleet(backends, scripted()))
}

/// A chain of blocks `ids`, each of `tokens` tokens.
fn chain(ids: &[u64], tokens: u32) -> PromptChain {
    PromptChain::from_blocks(ids.iter().map(|&id| (id, tokens)))
}

fn request(session: Option<&str>, chain: Option<PromptChain>, reply: Reply) -> Req {
    request_to("/v1/chat/completions", session, chain, reply)
}

/// A request to `path`, as [`request`] makes one.
fn request_to(path: &str, session: Option<&str>, chain: Option<PromptChain>, reply: Reply) -> Req {
    let mut req = http::Request::post(path);
    if let Some(s) = session {
        req = req.header("x-session-id", s);
    }
    let mut req = req.body(String::new()).unwrap();
    if let Some(c) = chain {
        req.extensions_mut().insert(PromptFacts::from_chain(c));
    }
    req.extensions_mut().insert(reply);
    req
}

/// Sends a request and reads its answer to the end: its decision, its body's bytes, and the
/// usage the service read from them.
async fn exchange<S, P>(svc: &Svc<S, P>, req: Req) -> (Decision, Vec<u8>, Option<Usage>)
where
    Svc<S, P>: tower::Service<Req, Response = Res, Error = tower_affinity::Error>,
    <Svc<S, P> as tower::Service<Req>>::Future: Send,
{
    let res = svc.clone().oneshot(req).await.expect("an answer");
    let decision = res
        .extensions()
        .get::<Decision>()
        .cloned()
        .expect("a decision");
    let mut body = res.into_body();
    let mut bytes = Vec::new();
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(f) => bytes.extend_from_slice(f.data_ref().map_or(&[][..], |d| d)),
            Err(_) => break,
        }
    }
    (decision, bytes, body.usage())
}

/// Checks that no request is left in flight or waiting.
fn assert_idle<S, P>(svc: &Svc<S, P>) {
    let stats = svc.stats();
    assert_eq!((stats.in_flight, stats.waiting), (0, 0), "{stats:?}");
}

/// Stops a task that keeps a backend busy, and waits until it has stopped.
async fn stop(task: tokio::task::JoinHandle<()>) {
    task.abort();
    let _ = task.await;
}

/// Sends session `held`'s turn of blocks 1 to 4 (1,000 tokens each), which reuses the first
/// three, and checks that it goes home to `a` as the cache model predicted: a hit, and no
/// correction.
async fn held_turn_goes_home_as_predicted<S, P>(svc: &Svc<S, P>)
where
    Svc<S, P>: tower::Service<Req, Response = Res, Error = tower_affinity::Error>,
    <Svc<S, P> as tower::Service<Req>>::Future: Send,
{
    let turn = request(
        Some("held"),
        Some(chain(&[1, 2, 3, 4], 1000)),
        reused(4000, 3000),
    );
    let (d, _, _) = exchange(svc, turn).await;
    assert_eq!(d.outcome, Outcome::HomeHit);
    assert_eq!(status(svc, "a").corrections, 0);
}

fn status<S, P>(svc: &Svc<S, P>, id: &str) -> BackendStatus {
    svc.backends()
        .into_iter()
        .find(|b| b.id.as_str() == id)
        .expect("a backend")
}

// === the observer ===

const CHAT_ANSWER: &[u8] = br#"{"id":"c1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"done"}}],"usage":{"prompt_tokens":1200,"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":1024}}}"#;

#[tokio::test(start_paused = true)]
async fn usage_in_a_json_answer_is_counted_for_its_backend_and_the_body_is_unchanged() {
    let svc = service(&[("a", "n1")]);
    let (d, body, usage) = exchange(&svc, request(Some("s"), None, Reply::json(CHAT_ANSWER))).await;
    assert_eq!(body, CHAT_ANSWER);
    let usage = usage.expect("the answer's usage");
    assert_eq!(
        (usage.prompt_tokens, usage.reused_tokens),
        (1200, Some(1024))
    );
    let a = status(&svc, d.backend.as_str());
    assert_eq!(
        (a.usage_reports, a.prompt_tokens, a.reused_tokens),
        (1, 1200, 1024)
    );
    let stats = svc.stats();
    assert_eq!(
        (
            stats.usage_reports,
            stats.prompt_tokens,
            stats.reused_tokens
        ),
        (1, 1200, 1024)
    );
}

#[tokio::test(start_paused = true)]
async fn each_answer_read_is_one_debug_line_with_the_reuse_its_backend_said() {
    let logs = support_logs::capture(tracing::Level::DEBUG);
    let svc = service(&[("a", "n1")]);
    exchange(&svc, request(Some("s"), None, Reply::json(CHAT_ANSWER))).await;
    exchange(&svc, request(Some("s"), None, Reply::json(b"{}"))).await;
    let text = logs.text();
    let lines: Vec<&str> = text.lines().filter(|l| l.contains("answer read")).collect();
    assert_eq!(lines.len(), 2, "{text}");
    for field in [
        "backend=a ",
        "outcome=new-session ",
        "success=true ",
        "prompt_tokens=1200 ",
        "reused_tokens=1024 ",
    ] {
        assert!(lines[0].contains(field), "{field} in {}", lines[0]);
    }
    // An answer without figures says so by their absence, and one whose backend's slots the
    // router does not assign names none.
    assert!(lines[1].contains("outcome=home-hit "), "{}", lines[1]);
    assert!(!lines[1].contains("prompt_tokens="), "{}", lines[1]);
    assert!(!lines.iter().any(|l| l.contains("slot=")), "{text}");
}

#[tokio::test(start_paused = true)]
async fn an_answer_read_names_the_slot_the_router_assigned_its_request() {
    // The line is written once the answer has been read, after its slot is free again: an
    // operator compares it with the slot llama-server says it took.
    let logs = support_logs::capture(tracing::Level::DEBUG);
    let backend = Backend::new("n1", scripted())
        .slots(NonZeroU32::new(2).unwrap())
        .cache_tokens(1 << 20)
        .assign_slots();
    let svc = SessionAffinityLayer::new().layer(StaticFleet::new([("a", backend)]));
    for (session, ids) in [("x", [1, 2]), ("y", [5, 6])] {
        let req = request(
            Some(session),
            Some(chain(&ids, 100)),
            Reply::json(CHAT_ANSWER),
        );
        exchange(&svc, req).await;
    }
    let text = logs.text();
    let lines: Vec<&str> = text.lines().filter(|l| l.contains("answer read")).collect();
    assert_eq!(lines.len(), 2, "{text}");
    assert!(lines[0].contains("slot=0"), "{}", lines[0]);
    assert!(lines[1].contains("slot=1"), "{}", lines[1]);
    assert_idle(&svc);
}

#[tokio::test(start_paused = true)]
async fn an_answer_read_after_a_wait_for_a_slot_says_how_long_it_waited() {
    let logs = support_logs::capture(tracing::Level::DEBUG);
    let svc = service(&[("a", "n1")]);
    // The one slot is busy for 5 s; the session's next turn waits for it.
    let long = Reply::llama_stream(100, 0, 500, Duration::ZERO, Duration::from_secs(5));
    let streaming = keep_busy(&svc, request(Some("s"), None, long), "a").await;
    let (d, _, _) = exchange(&svc, request(Some("s"), None, Reply::json(CHAT_ANSWER))).await;
    assert_eq!(d.waited, Some(Duration::from_secs(5)));
    streaming.await.unwrap();
    let text = logs.text();
    let lines: Vec<&str> = text.lines().filter(|l| l.contains("answer read")).collect();
    assert_eq!(lines.len(), 2, "{text}");
    // The first did not wait; the second's `ms` counts from its dispatch, after the wait.
    assert!(lines.iter().any(|l| l.contains("waited_ms=5000")), "{text}");
    assert_eq!(
        lines.iter().filter(|l| l.contains("waited_ms=")).count(),
        1,
        "{text}"
    );
}

#[tokio::test(start_paused = true)]
async fn usage_in_an_sse_stream_split_over_frames_is_read() {
    let svc = service(&[("a", "n1")]);
    let frames: &[&'static [u8]] = &[
        b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n",
        b"data: {\"choices\":[],\"us",
        b"age\":{\"prompt_tokens\":40,\"prompt_tok",
        b"ens_details\":{\"cached_tokens\":32}}}\n\ndata: [DONE]\n\n",
    ];
    let (_, body, usage) = exchange(
        &svc,
        request(
            None,
            None,
            Reply::new("text/event-stream; charset=utf-8", frames),
        ),
    )
    .await;
    assert_eq!(body, frames.concat());
    let usage = usage.expect("the stream's usage");
    assert_eq!((usage.prompt_tokens, usage.reused_tokens), (40, Some(32)));
}

#[tokio::test(start_paused = true)]
async fn llama_cpp_timings_on_the_last_chunk_give_the_figures_and_the_prefill_rate() {
    let svc = service(&[("a", "n1")]);
    let reply = Reply::llama_stream(
        10_256,
        256,
        50_000,
        Duration::from_secs(50),
        Duration::from_secs(2),
    );
    let (d, _, usage) = exchange(&svc, request(None, None, reply)).await;
    let usage = usage.unwrap();
    assert_eq!(
        (usage.prompt_tokens, usage.reused_tokens),
        (10_256, Some(256))
    );
    assert_eq!(usage.prompt_time, Some(Duration::from_secs(50)));
    let a = status(&svc, d.backend.as_str());
    assert_eq!(a.prefill_rate, Some(200));
    assert_eq!(a.first_byte_time, Some(Duration::from_secs(50)));
    assert_eq!(a.request_time, Some(Duration::from_secs(52)));
}

/// One odd answer, or two in a row on opposite sides, teaches nothing: a prompt the backend
/// found cached, said to be read in a millisecond, and a request stalled for ten minutes.
/// Without the median, the first would make the backend read 12,500 times faster for dozens
/// of answers, and the second would more than double its learned request time.
#[tokio::test(start_paused = true)]
async fn one_odd_answer_moves_neither_the_prefill_rate_nor_the_request_time() {
    let svc = service(&[("a", "n1")]);
    let normal = || {
        Reply::llama_stream(
            10_000,
            0,
            50_000,
            Duration::from_secs(50),
            Duration::from_secs(2),
        )
    };
    for _ in 0..3 {
        exchange(&svc, request(None, None, normal())).await;
    }
    let learned = |svc: &Svc<_>| {
        let a = status(svc, "a");
        (a.prefill_rate, a.request_time)
    };
    let before = (Some(200), Some(Duration::from_secs(52)));
    assert_eq!(learned(&svc), before);
    let ms = Duration::from_millis(1);
    let cached = Reply::llama_stream(10_000, 0, 1, ms, ms);
    exchange(&svc, request(None, None, cached)).await;
    assert_eq!(learned(&svc), before, "a read of 10,000 tokens in 1 ms");
    let stalled = Reply::llama_stream(
        10_000,
        0,
        50_000,
        Duration::from_secs(50),
        Duration::from_secs(600),
    );
    exchange(&svc, request(None, None, stalled)).await;
    assert_eq!(learned(&svc), before, "a request of 650 s");
    // Two in a row on the same side are followed: the backend changed.
    let slower = || {
        Reply::llama_stream(
            10_000,
            0,
            100_000,
            Duration::from_secs(100),
            Duration::from_secs(4),
        )
    };
    exchange(&svc, request(None, None, slower())).await;
    exchange(&svc, request(None, None, slower())).await;
    let (rate, took) = learned(&svc);
    assert!(rate < Some(200), "{rate:?}");
    assert!(took > Some(Duration::from_secs(52)), "{took:?}");
    assert_idle(&svc);
}

/// The time to first byte follows a backend that got slower from its second slow answer on,
/// however long it was fast before: a mean over every answer so far would take as many slow
/// answers as fast ones to reach halfway. One odd answer alone does not move it.
#[tokio::test(start_paused = true)]
async fn the_time_to_first_byte_follows_recent_answers_not_all_of_them() {
    let svc = service(&[("a", "n1")]);
    let after = |secs: f64| Reply {
        headers_after: Duration::from_secs_f64(secs),
        ..Reply::json(b"{}")
    };
    let first_byte = |svc: &Svc<_>| status(svc, "a").first_byte_time.unwrap().as_secs_f64();
    for _ in 0..20 {
        exchange(&svc, request(None, None, after(50.0))).await;
    }
    assert_eq!(first_byte(&svc), 50.0);
    exchange(&svc, request(None, None, after(0.001))).await;
    assert_eq!(first_byte(&svc), 50.0, "one odd answer");
    for _ in 0..6 {
        exchange(&svc, request(None, None, after(100.0))).await;
    }
    // Five slow answers blended at a quarter each: 50 s + 50 s * (1 - 0.75^5).
    let t = first_byte(&svc);
    assert!((t - 88.13).abs() < 0.01, "{t}");
    assert_idle(&svc);
}

/// Whether a stream opens before its prompt is read is the request's API's to say, not the
/// shape of its usage: an Anthropic stream's first event (`message_start`) follows the read,
/// also from a server whose usage gives `input_tokens` alone, as vLLM's `/v1/messages` does,
/// a shape a Responses answer has too. Here its reuse comes from timings without their time
/// (an older llama-server's, a fork's): the first byte times the read.
#[tokio::test(start_paused = true)]
async fn an_anthropic_stream_with_input_tokens_alone_times_the_read_at_its_first_byte() {
    let svc = service(&[("a", "n1")]);
    let reply = Reply::sse(&[
        (
            Duration::from_secs(50),
            b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"m1\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"usage\":{\"input_tokens\":10256,\"output_tokens\":0}}}\n\n",
        ),
        (
            Duration::from_secs(1),
            b"event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"input_tokens\":10256,\"output_tokens\":1},\"timings\":{\"prompt_n\":10000,\"cache_n\":256}}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
        ),
    ]);
    let (d, _, usage) = exchange(&svc, request_to("/v1/messages", None, None, reply)).await;
    let usage = usage.expect("the stream's usage");
    assert_eq!(
        (usage.prompt_tokens, usage.reused_tokens, usage.prompt_time),
        (10_256, Some(256), None)
    );
    assert_eq!(status(&svc, d.backend.as_str()).prefill_rate, Some(200));
}

/// A Responses stream (vLLM's, SGLang's) opens with `response.created` and
/// `response.in_progress` as soon as the request is taken, and gives its usage in
/// `response.completed`: its first byte comes before the prompt is read. The first event
/// after those (`response.output_item.added`) follows the read: it times the read, and the
/// backend's backlog keeps the prompt until then, wherever the network cuts the events. A
/// stream to a path the service does not know is watched for the same events.
#[tokio::test(start_paused = true)]
async fn a_responses_stream_times_the_read_at_its_first_event_after_the_opening_ones() {
    for path in ["/v1/responses", "/api/respond"] {
        responses_stream_to(path).await;
    }
}

async fn responses_stream_to(path: &str) {
    let svc = service(&[("a", "n1")]);
    let opened: &[u8] = b"event: response.created\ndata: {\"response\":{\"id\":\"r1\",\"object\":\"response\",\"status\":\"in_progress\",\"output\":[],\"usage\":null},\"sequence_number\":0,\"type\":\"response.created\"}\n\n\
event: response.in_progress\ndata: {\"response\":{\"id\":\"r1\",\"object\":\"response\",\"status\":\"in_progress\",\"output\":[],\"usage\":null},\"sequence_number\":1,\"type\":\"response.in_progress\"}\n\nevent: response.outp";
    let output: &[u8] = b"ut_item.added\ndata: {\"item\":{\"id\":\"m1\",\"content\":[],\"role\":\"assistant\",\"status\":\"in_progress\",\"type\":\"message\"},\"output_index\":0,\"sequence_number\":2,\"type\":\"response.output_item.added\"}\n\n\
event: response.output_text.delta\ndata: {\"delta\":\"done\",\"sequence_number\":3,\"type\":\"response.output_text.delta\"}\n\n";
    let completed: &[u8] = b"event: response.completed\ndata: {\"type\":\"response.completed\",\"sequence_number\":4,\"response\":{\"id\":\"r1\",\"object\":\"response\",\"status\":\"completed\",\"usage\":{\"input_tokens\":10256,\"input_tokens_details\":{\"cached_tokens\":256},\"output_tokens\":1,\"output_tokens_details\":{\"reasoning_tokens\":0},\"total_tokens\":10257}}}\n\n";
    let reply = Reply::sse(&[
        (Duration::from_millis(20), opened),
        (Duration::from_secs(50), output),
        (Duration::from_secs(2), completed),
    ]);
    let req = request_to(path, None, Some(chain(&[1, 2, 3], 1_000)), reply);
    let res = svc.clone().oneshot(req).await.expect("an answer");
    let mut body = res.into_body();
    let mut frame = async || body.frame().await.expect("a frame").expect("data");
    frame().await;
    let a = status(&svc, "a");
    assert_eq!(
        (a.unread_tokens, a.first_byte_time),
        (3_000, None),
        "{path}: opened, not read yet"
    );
    frame().await;
    assert_eq!(status(&svc, "a").unread_tokens, 0, "{path}: read");
    frame().await;
    assert!(body.frame().await.is_none());
    let usage = body.usage().expect("the stream's usage");
    assert_eq!(
        (usage.prompt_tokens, usage.reused_tokens),
        (10_256, Some(256))
    );
    let a = status(&svc, "a");
    // 10,000 tokens read in 50.02 s, not in 20 ms.
    assert_eq!(a.prefill_rate, Some(200), "{path}");
    assert_eq!(a.first_byte_time, Some(Duration::from_millis(50_020)));
    assert_eq!(a.request_time, Some(Duration::from_millis(52_020)));
}

/// llama-server asked for its prompt's progress (`"return_progress": true`, as its web UI
/// asks) streams a chunk with a `prompt_progress` member as it reads each batch of the
/// prompt: those come before the read. Its first token follows it: that times the read, and
/// the backend's backlog keeps the prompt until then.
#[tokio::test(start_paused = true)]
async fn llama_servers_progress_chunks_are_not_the_first_byte_after_the_read() {
    let svc = service(&[("a", "n1")]);
    let chunk = |delta: &str, tail: &str| {
        Bytes::from(format!(
            "data: {{\"choices\":[{{\"finish_reason\":null,\"index\":0,\"delta\":{delta}}}],\"created\":1764547200,\"id\":\"chatcmpl-1\",\"model\":\"qwen\",\"object\":\"chat.completion.chunk\"{tail}}}\n\n"
        ))
    };
    let role = r#"{"role":"assistant","content":null}"#;
    let progress = |processed: u32| {
        chunk(
            role,
            &format!(
                r#","prompt_progress":{{"total":10256,"cache":256,"processed":{processed},"time_ms":1.5}}"#
            ),
        )
    };
    let last = Bytes::from_static(b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":10256,\"prompt_tokens_details\":{\"cached_tokens\":256}}}\n\ndata: [DONE]\n\n");
    let reply = Reply {
        frames: vec![
            (Duration::from_millis(20), Ok(progress(2_304))),
            (Duration::from_secs(25), Ok(progress(10_256))),
            (
                Duration::from_secs(25),
                Ok(chunk(r#"{"content":"Done."}"#, "")),
            ),
            (Duration::from_secs(1), Ok(last)),
        ],
        ..Reply::sse(&[])
    };
    let req = request(None, Some(chain(&[1, 2, 3], 1_000)), reply);
    let res = svc.clone().oneshot(req).await.expect("an answer");
    let mut body = res.into_body();
    let mut frame = async || body.frame().await.expect("a frame").expect("data");
    frame().await;
    frame().await;
    assert_eq!(status(&svc, "a").unread_tokens, 3_000, "reading, not read");
    frame().await;
    assert_eq!(status(&svc, "a").unread_tokens, 0, "read");
    frame().await;
    assert!(body.frame().await.is_none());
    let a = status(&svc, "a");
    // 10,000 tokens read in 50.02 s, not in 20 ms.
    assert_eq!(a.first_byte_time, Some(Duration::from_millis(50_020)));
    assert_eq!(a.prefill_rate, Some(200));
}

/// An answer not read for its usage (compressed, or neither JSON nor SSE) has read its
/// prompt once its first frame comes: the backend's backlog no longer holds the prompt,
/// though the body goes on.
#[tokio::test(start_paused = true)]
async fn an_answer_not_read_for_usage_has_read_its_prompt_at_its_first_frame() {
    let svc = service(&[("a", "n1")]);
    let mut gzip = Reply::json(b"\x1f\x8b");
    gzip.encoding = Some("gzip");
    let plain = Reply::new("text/plain", &[b"Done."]);
    for (what, mut reply, blocks) in [("gzip", gzip, [1, 2, 3]), ("text/plain", plain, [4, 5, 6])] {
        reply
            .frames
            .push((Duration::from_secs(5), Ok(Bytes::from_static(b"."))));
        let req = request(None, Some(chain(&blocks, 1_000)), reply);
        let res = svc.clone().oneshot(req).await.expect("an answer");
        assert_eq!(
            status(&svc, "a").unread_tokens,
            3_000,
            "{what}: not read yet"
        );
        let mut body = res.into_body();
        body.frame().await.expect("a frame").expect("data");
        assert_eq!(status(&svc, "a").unread_tokens, 0, "{what}: read");
        body.frame().await.expect("a frame").expect("data");
        assert!(body.frame().await.is_none());
    }
}

/// A chat stream's first chunk is its first token: it came after the read, and times it.
#[tokio::test(start_paused = true)]
async fn a_chat_streams_first_byte_times_the_read() {
    let svc = service(&[("a", "n1")]);
    let chat = Reply::sse(&[
        (
            Duration::from_secs(50),
            b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n",
        ),
        (
            Duration::from_secs(1),
            b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":10256,\"prompt_tokens_details\":{\"cached_tokens\":256}}}\n\ndata: [DONE]\n\n",
        ),
    ]);
    exchange(&svc, request(None, None, chat)).await;
    let a = status(&svc, "a");
    assert_eq!(a.prefill_rate, Some(200));
    assert_eq!(a.first_byte_time, Some(Duration::from_secs(50)));
}

#[tokio::test(start_paused = true)]
async fn answers_that_cannot_be_read_pass_through_untouched_with_no_figure() {
    let svc = service(&[("a", "n1")]);
    let malformed: &'static [u8] =
        br#"{"usage":{"prompt_tokens":12,"prompt_tokens_details":{"cached_tokens":"#;
    let mistyped: &'static [u8] =
        br#"{"usage":{"prompt_tokens":"1200","prompt_tokens_details":{"cached_tokens":1024}}}"#;
    let mut gzip = Reply::json(CHAT_ANSWER);
    gzip.encoding = Some("gzip");
    let mut plain = Reply::json(CHAT_ANSWER);
    plain.content_type = Some("text/plain");
    let mut untyped = Reply::json(CHAT_ANSWER);
    untyped.content_type = None;
    let mut cut = Reply::new(
        "text/event-stream",
        &[b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,"],
    );
    cut.frames.push((Duration::ZERO, Err("connection reset")));
    let cases = [
        (
            "malformed usage",
            Reply::json(malformed),
            malformed.to_vec(),
        ),
        (
            "usage of an unexpected type",
            Reply::json(mistyped),
            mistyped.to_vec(),
        ),
        ("a gzip-encoded answer", gzip, CHAT_ANSWER.to_vec()),
        ("a text/plain answer", plain, CHAT_ANSWER.to_vec()),
        (
            "an answer without a content type",
            untyped,
            CHAT_ANSWER.to_vec(),
        ),
        (
            "a stream cut mid-chunk",
            cut,
            b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,".to_vec(),
        ),
        (
            "an answer reporting nothing",
            Reply::json(b"{\"choices\":[]}"),
            b"{\"choices\":[]}".to_vec(),
        ),
    ];
    for (what, reply, expected) in cases {
        let (_, body, usage) = exchange(&svc, request(None, None, reply)).await;
        assert_eq!(body, expected, "{what}: the bytes pass unchanged");
        assert_eq!(usage, None, "{what}: no figure");
    }
    assert_eq!(svc.stats().usage_reports, 0);
    assert_eq!(
        svc.stats().backend_errors,
        0,
        "a body error is not a backend failure"
    );
}

#[tokio::test(start_paused = true)]
async fn a_stream_dropped_after_its_last_chunk_is_counted_and_one_cut_before_it_is_not() {
    let svc = service(&[("a", "n1")]);
    // llama-server's stream, and then its end a long while later: the client stops reading at
    // the last chunk (an SSE client at `data: [DONE]`) and drops the body before its end.
    let mut done = Reply::llama_stream(1_200, 1_000, 400, Duration::ZERO, Duration::ZERO);
    done.frames
        .push((Duration::from_secs(3_600), Ok(Bytes::from_static(b""))));
    // A stream that stops in the middle of its usage chunk, dropped the same way.
    let mut cut = Reply::new(
        "text/event-stream",
        &[b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,"],
    );
    cut.frames
        .push((Duration::from_secs(3_600), Ok(Bytes::from_static(b""))));
    for (reply, frames, counted) in [(cut, 1, 0), (done, 2, 1)] {
        read_then_drop(&svc, request(None, None, reply), frames).await;
        let a = status(&svc, "a");
        assert_eq!((a.in_flight, a.usage_reports), (0, counted));
    }
    let a = status(&svc, "a");
    assert_eq!((a.prompt_tokens, a.reused_tokens), (1_200, 1_000));
}

/// An empty data frame after a stream's last chunk leaves the stream read to its end: a
/// client that drops the body then has read the answer, and it is counted.
#[tokio::test(start_paused = true)]
async fn an_empty_frame_after_a_streams_last_chunk_leaves_it_read_to_its_end() {
    let svc = service(&[("a", "n1")]);
    let mut reply = Reply::llama_stream(1_200, 1_000, 400, Duration::ZERO, Duration::ZERO);
    reply
        .frames
        .push((Duration::ZERO, Ok(Bytes::from_static(b""))));
    reply
        .frames
        .push((Duration::from_secs(3_600), Ok(Bytes::from_static(b""))));
    read_then_drop(&svc, request(None, None, reply), 3).await;
    let a = status(&svc, "a");
    assert_eq!((a.in_flight, a.usage_reports), (0, 1));
    assert_eq!((a.prompt_tokens, a.reused_tokens), (1_200, 1_000));
}

/// An event stream may write its fields without the space after the colon (`data:[DONE]`):
/// an SSE client reads it as `data: [DONE]`, stops there and drops the body before its end.
/// The answer it has read is counted, as it is for `data: [DONE]`; `[DONE]` without the
/// space was taken for no last event, so its usage chunk, read whole, taught nothing.
#[tokio::test(start_paused = true)]
async fn a_stream_dropped_after_its_done_written_without_a_space_is_counted() {
    let svc = service(&[("a", "n1")]);
    for (done, counted) in [
        (&b"data: [DONE]\n\n"[..], 1),
        (b"data:[DONE]\n\n", 2),
        (b"data:[DONE]\r\n\r\n", 3),
    ] {
        let mut reply = Reply::new(
            "text/event-stream",
            &[
                b"data:{\"choices\":[],\"usage\":{\"prompt_tokens\":1200,\"prompt_tokens_details\":{\"cached_tokens\":1000}}}\n\n",
            ],
        );
        reply
            .frames
            .push((Duration::ZERO, Ok(Bytes::copy_from_slice(done))));
        reply
            .frames
            .push((Duration::from_secs(3_600), Ok(Bytes::from_static(b""))));
        read_then_drop(&svc, request(None, None, reply), 2).await;
        let a = status(&svc, "a");
        assert_eq!(
            (a.in_flight, a.usage_reports),
            (0, counted),
            "{}",
            String::from_utf8_lossy(done)
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_backend_that_once_reported_its_reuse_reused_nothing_when_it_leaves_it_out() {
    // vLLM leaves `cached_tokens` out when it is 0.
    let svc = service(&[("a", "n1")]);
    let without: &'static [u8] = br#"{"usage":{"prompt_tokens":500}}"#;
    let (_, _, first) = exchange(&svc, request(None, None, Reply::json(without))).await;
    assert_eq!(first.unwrap().reused_tokens, None, "nothing known yet");
    exchange(&svc, request(None, None, Reply::json(CHAT_ANSWER))).await;
    let (_, _, later) = exchange(&svc, request(None, None, Reply::json(without))).await;
    assert_eq!(later.unwrap().reused_tokens, Some(0));
}

#[tokio::test(start_paused = true)]
async fn observe_usage_off_reads_nothing() {
    let svc = SessionAffinityLayer::new()
        .observe_usage(false)
        .layer(fleet(&[("a", "n1")], scripted()));
    let res = svc
        .clone()
        .oneshot(request(None, None, Reply::json(CHAT_ANSWER)))
        .await
        .unwrap();
    let body = res.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], CHAT_ANSWER);
    assert_eq!(svc.stats().usage_reports, 0);
}

// === the cache model learns ===

/// A JSON answer that reports `reused` of `prompt` tokens.
fn reused(prompt: u64, reused: u64) -> Reply {
    let body = format!(
        r#"{{"usage":{{"prompt_tokens":{prompt},"prompt_tokens_details":{{"cached_tokens":{reused}}}}}}}"#
    );
    Reply {
        status: http::StatusCode::OK,
        headers_after: Duration::ZERO,
        content_type: Some("application/json"),
        encoding: None,
        frames: vec![(Duration::ZERO, Ok(Bytes::from(body)))],
    }
}

/// A backend removed and announced again may be another server, one that never says its
/// reuse (vLLM without `--enable-prompt-tokens-details`): that the one before said it does not
/// make the new one's answers read as reusing nothing, which would correct the cache model
/// for a conversation the backend holds.
#[tokio::test(start_paused = true)]
async fn a_backend_announced_again_learns_again_whether_it_says_its_reuse() {
    let (handle, stream) = tower_affinity::discover::channel();
    handle.insert("a", one_slot_backend());
    let svc = SessionAffinityLayer::new().layer(stream);
    svc.apply_discovery();
    let first = request(None, Some(chain(&[1, 2], 1000)), reused(2000, 0));
    decision_of(&svc, first).await;
    handle.remove("a");
    svc.apply_discovery();
    handle.insert("a", one_slot_backend());
    svc.apply_discovery();
    let without: &'static [u8] = br#"{"usage":{"prompt_tokens":3000}}"#;
    let next = request(None, Some(chain(&[1, 2, 3], 1000)), Reply::json(without));
    let res = svc.clone().oneshot(next).await.expect("an answer");
    let mut body = res.into_body();
    while body.frame().await.is_some() {}
    assert_eq!(body.usage().unwrap().reused_tokens, None);
    let a = svc.backends().into_iter().next().expect("a backend");
    assert_eq!((a.usage_reports, a.corrections), (2, 0));
    assert_eq!(svc.stats().in_flight, 0);
}

/// An answer to a request sent before its backend was removed and announced again is the
/// old server's: it teaches the server back nothing. An old answer that said its reuse, ending
/// after the backend came back, made the new server's answers without it read as reusing
/// nothing; its time was taken as the new server's request time.
#[tokio::test(start_paused = true)]
async fn an_answer_to_a_request_sent_before_its_backend_came_back_teaches_nothing() {
    let (handle, stream) = tower_affinity::discover::channel();
    handle.insert("a", one_slot_backend());
    let svc = SessionAffinityLayer::new().layer(stream);
    svc.apply_discovery();
    // The old server's answer says its reuse, and ends 10 s after its request was sent.
    let slow = Reply {
        headers_after: Duration::from_secs(10),
        ..reused(2000, 0)
    };
    let old = request(None, Some(chain(&[1, 2], 1000)), slow);
    let old = tokio::spawn({
        let svc = svc.clone();
        async move {
            let mut body = svc.oneshot(old).await.expect("an answer").into_body();
            while body.frame().await.is_some() {}
            body.usage()
        }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    handle.remove("a");
    svc.apply_discovery();
    handle.insert("a", one_slot_backend());
    svc.apply_discovery();
    let usage = old.await.unwrap();
    assert_eq!(
        usage.unwrap().reused_tokens,
        Some(0),
        "as the old server said"
    );
    let a = svc.backends().into_iter().next().expect("a backend");
    assert_eq!(a.request_time, None, "{a:?}");
    // The server back never says its reuse.
    let without: &'static [u8] = br#"{"usage":{"prompt_tokens":3000}}"#;
    let next = request(None, Some(chain(&[1, 2, 3], 1000)), Reply::json(without));
    let mut body = svc
        .clone()
        .oneshot(next)
        .await
        .expect("an answer")
        .into_body();
    while body.frame().await.is_some() {}
    assert_eq!(body.usage().unwrap().reused_tokens, None);
    let a = svc.backends().into_iter().next().expect("a backend");
    assert_eq!((a.usage_reports, a.corrections), (2, 0), "{a:?}");
    assert_eq!(svc.stats().in_flight, 0);
}

/// A backend removed and announced again may serve another model, whose tokenizer counts a
/// prompt otherwise: its tokens per token of the chain's estimate are learned again, from its
/// first answer, rather than blended into the old server's. The scale sizes the context a
/// request takes there.
#[tokio::test(start_paused = true)]
async fn a_backend_announced_again_learns_its_token_scale_afresh() {
    let (handle, stream) = tower_affinity::discover::channel();
    let backend = || four_slots_of_context(100_000);
    handle.insert("a", backend());
    let svc = SessionAffinityLayer::new().layer(stream);
    svc.apply_discovery();
    let said = |ids: &[u64], tokens: &'static [u8]| {
        request(None, Some(chain(ids, 2_000)), Reply::json(tokens))
    };
    // The first server counts four of its tokens a token of the estimate.
    let four: &[u8] = br#"{"usage":{"prompt_tokens":8000}}"#;
    for id in 1..=3 {
        decision_of(&svc, said(&[id], four)).await;
    }
    let context = || svc.backends()[0].context_in_flight;
    assert_eq!(
        context_while_held(&svc, said(&[4], four), context).await,
        8_000
    );
    handle.remove("a");
    svc.apply_discovery();
    handle.insert("a", backend());
    svc.apply_discovery();
    // The server back counts one; one answer says so.
    let one: &[u8] = br#"{"usage":{"prompt_tokens":2000}}"#;
    decision_of(&svc, said(&[5], one)).await;
    assert_eq!(
        context_while_held(&svc, said(&[6], one), context).await,
        2_000
    );
    assert_eq!(svc.stats().in_flight, 0);
}

/// One answer far off the learned token scale (a long prompt the backend truncated to its
/// context and counted as it kept it, a count of only the tokens it did not find cached)
/// teaches nothing of it: in a ratio of averages a long prompt weighs the most, and that one
/// would halve the context every request is taken to need there. Two in a row on the same
/// side are followed: the backend changed.
#[tokio::test(start_paused = true)]
async fn one_answer_far_off_the_token_scale_does_not_move_it() {
    let fleet = StaticFleet::new([("a", four_slots_of_context(1_000_000))]);
    let svc: Svc<_> = SessionAffinityLayer::new().layer(fleet);
    let said = |ids: &[u64], tokens: &'static [u8]| {
        request(None, Some(chain(ids, 2_000)), Reply::json(tokens))
    };
    let held_for = |ids: &'static [u64]| {
        let one: &[u8] = br#"{"usage":{"prompt_tokens":1}}"#;
        context_while_held(&svc, said(ids, one), || status(&svc, "a").context_in_flight)
    };
    // Four of the backend's tokens a token of the estimate, on prompts of 2,000.
    let four: &[u8] = br#"{"usage":{"prompt_tokens":8000}}"#;
    for id in 1..=3 {
        decision_of(&svc, said(&[id], four)).await;
    }
    assert_eq!(held_for(&[100]).await, 8_000);
    // A prompt of 40,000 tokens by the estimate, counted as the 1,000 the backend kept.
    let long: Vec<u64> = (10..30).collect();
    let kept: &[u8] = br#"{"usage":{"prompt_tokens":1000}}"#;
    decision_of(&svc, said(&long, kept)).await;
    assert_eq!(held_for(&[101]).await, 8_000);
    // A second in a row is followed.
    let long: Vec<u64> = (30..50).collect();
    decision_of(&svc, said(&long, kept)).await;
    assert!(held_for(&[102]).await < 4_000);
    assert_eq!(svc.stats().in_flight, 0);
}

/// An answer that does not say what it reused still says how many tokens its prompt was, in
/// the backend's own count: it teaches the backend's tokens per token of the chain's estimate
/// (vLLM without `--enable-prompt-tokens-details`, an Anthropic endpoint that gives
/// `input_tokens` alone). Until then a backend with a context counts each token of the
/// estimate as two, and holds requests back that fit.
#[tokio::test(start_paused = true)]
async fn an_answer_that_does_not_say_its_reuse_teaches_the_backends_token_count() {
    let fleet = StaticFleet::new([("a", four_slots_of_context(6_000))]);
    let svc: Svc<_> = SessionAffinityLayer::new().layer(fleet);
    let said = |body: &'static [u8], path: &str, ids: &[u64]| {
        request_to(path, None, Some(chain(ids, 2_000)), Reply::json(body))
    };
    let chat: &[u8] = br#"{"choices":[],"usage":{"prompt_tokens":2000,"completion_tokens":1}}"#;
    let anthropic: &[u8] =
        br#"{"type":"message","content":[],"usage":{"input_tokens":2000,"output_tokens":1}}"#;
    for (body, path, ids) in [
        (chat, "/v1/chat/completions", &[1][..]),
        (anthropic, "/v1/messages", &[2][..]),
    ] {
        let (_, _, usage) = exchange(&svc, said(body, path, ids)).await;
        assert_eq!(usage.unwrap().reused_tokens, None);
    }
    assert_eq!(status(&svc, "a").unreported_prompt_tokens, 4_000);
    // A prompt of 2,000 tokens by the estimate takes 2,000 of the backend's, not 4,000.
    let held = svc
        .clone()
        .oneshot(said(chat, "/v1/chat/completions", &[3]))
        .await
        .expect("an answer");
    assert_eq!(status(&svc, "a").context_in_flight, 2_000);
    drop(held);
}

/// A count no prompt reaches (a C++ server's `size_t` gone below zero is 18446744073709551615)
/// is not a figure its backend measured: it is left out, and the figures the service adds up
/// stay the answers' sums rather than overflowing.
#[tokio::test(start_paused = true)]
async fn a_usage_figure_no_prompt_reaches_is_left_out_not_added_up() {
    let svc = service(&[("a", "n1")]);
    let huge = u64::MAX;
    let turns = [(None, huge, 0), (Some("s"), huge, huge), (None, 500, 100)];
    for (session, prompt, reuse) in turns {
        let (_, _, usage) = exchange(&svc, request(session, None, reused(prompt, reuse))).await;
        if prompt == huge {
            assert_eq!(usage, None);
        }
    }
    let stats = svc.stats();
    assert_eq!((stats.prompt_tokens, stats.reused_tokens), (500, 100));
    let a = status(&svc, "a");
    assert_eq!((a.prompt_tokens, a.reused_tokens), (500, 100));
}

/// What answers report is counted under how their requests were placed too, and over every
/// outcome adds up to the fleet's figures.
#[tokio::test(start_paused = true)]
async fn reported_reuse_is_counted_by_the_outcome_of_its_request() {
    let svc = service(&[("a", "n1")]);
    let turns = [(None, 500, 0), (Some("s"), 600, 0), (Some("s"), 700, 600)];
    let mut outcomes = Vec::new();
    for (session, prompt, reuse) in turns {
        let (d, _, _) = exchange(&svc, request(session, None, reused(prompt, reuse))).await;
        outcomes.push(d.outcome);
    }
    assert_eq!(
        outcomes,
        [Outcome::Keyless, Outcome::NewSession, Outcome::HomeHit]
    );
    let stats = svc.stats();
    let reuse = |o| {
        let r = stats.reuse(o);
        (r.prompt_tokens, r.reused_tokens)
    };
    assert_eq!(reuse(Outcome::Keyless), (500, 0));
    assert_eq!(reuse(Outcome::NewSession), (600, 0));
    assert_eq!(reuse(Outcome::HomeHit), (700, 600));
    assert_eq!(reuse(Outcome::ColdHome), (0, 0));
    assert_eq!(stats.reuse(Outcome::HomeHit).share(), Some(600.0 / 700.0));
    assert_eq!(stats.reuse(Outcome::ColdHome).share(), None);
    let sum = |f: fn(tower_affinity::Reuse) -> u64| -> u64 {
        Outcome::ALL.iter().map(|&o| f(stats.reuse(o))).sum()
    };
    assert_eq!(
        (sum(|r| r.prompt_tokens), sum(|r| r.reused_tokens)),
        (stats.prompt_tokens, stats.reused_tokens)
    );
}

/// Two sessions on `svc`'s one backend: "old"'s first turn of the blocks `old`, then "new"'s
/// first turn of blocks 10 to 12, and its second turn of blocks 10 to 13, answered with
/// `second` (the model predicts 3,000 of its 4,000 tokens held). 1,000 tokens a block.
/// Returns the second turn's decision and the usage it reported.
async fn old_then_new<S, P>(
    svc: &Svc<S, P>,
    old: &[u64],
    second: Reply,
) -> (Decision, Option<Usage>)
where
    Svc<S, P>: tower::Service<Req, Response = Res, Error = tower_affinity::Error>,
    <Svc<S, P> as tower::Service<Req>>::Future: Send,
{
    let tokens = 1000 * old.len() as u64;
    let first = request(Some("old"), Some(chain(old, 1000)), reused(tokens, 0));
    assert_eq!(exchange(svc, first).await.0.outcome, Outcome::NewSession);
    let first = request(
        Some("new"),
        Some(chain(&[10, 11, 12], 1000)),
        reused(3000, 0),
    );
    exchange(svc, first).await;
    let next = request(Some("new"), Some(chain(&[10, 11, 12, 13], 1000)), second);
    let (d, _, usage) = exchange(svc, next).await;
    (d, usage)
}

#[tokio::test(start_paused = true)]
async fn a_backend_reusing_far_less_than_predicted_corrects_the_model() {
    let svc = service(&[("a", "n1")]);
    // "new"'s second turn: the model predicts its 3,000 tokens held, the backend reused none.
    let (d, _) = old_then_new(&svc, &[1, 2, 3], reused(4000, 0)).await;
    assert_eq!(d.outcome, Outcome::HomeHit);
    let a = status(&svc, "a");
    assert_eq!(a.corrections, 1);
    assert_eq!(svc.stats().corrections, 1);
    // The backend evicted "new"'s prefix, so it evicted "old"'s, used before it: the model
    // knows, and places "old"'s next turn as a cold home.
    let (d, _, _) = exchange(
        &svc,
        request(
            Some("old"),
            Some(chain(&[1, 2, 3, 4], 1000)),
            reused(4000, 0),
        ),
    )
    .await;
    assert_eq!(d.outcome, Outcome::ColdHome);
    // "new" has just been read again: its next turn is a hit, and predicted so.
    let (d, _, _) = exchange(
        &svc,
        request(
            Some("new"),
            Some(chain(&[10, 11, 12, 13, 14], 1000)),
            reused(5000, 4000),
        ),
    )
    .await;
    assert_eq!(d.outcome, Outcome::HomeHit);
    assert_eq!(
        status(&svc, "a").corrections,
        1,
        "a prediction borne out is no correction"
    );
}

/// A backend that reused part of what the model predicted, far less than predicted, evicted
/// the rest: the model forgets as many tokens as it over-predicted (the predicted share less
/// the share the answer reused, of the prompt), oldest first.
#[tokio::test(start_paused = true)]
async fn a_backend_reusing_part_of_a_prediction_makes_the_model_forget_the_rest() {
    let svc = service(&[("a", "n1")]);
    // "new"'s second turn: 3,000 of its 4,000 tokens predicted held, 1,000 reused. The backend
    // evicted 2,000 tokens used no later than "new"'s prefix: all of "old"'s.
    let (d, _) = old_then_new(&svc, &[1, 2], reused(4000, 1000)).await;
    assert_eq!(d.outcome, Outcome::HomeHit);
    assert_eq!(status(&svc, "a").corrections, 1);
    let (d, _, _) = exchange(
        &svc,
        request(Some("old"), Some(chain(&[1, 2, 3], 1000)), reused(3000, 0)),
    )
    .await;
    assert_eq!(d.outcome, Outcome::ColdHome);
}

/// An answer that reports a prompt of 0 tokens says nothing of what the backend reused of
/// the prompt it was sent (Ollama's OpenAI endpoint reports `prompt_tokens: 0` for a prompt
/// it found whole in its cache, ollama/ollama#5370): it is no sign of an eviction. Read as
/// one, it made the model forget the home's conversation and every one used before it, and
/// their next turns left their warm homes as cold homes.
#[tokio::test(start_paused = true)]
async fn an_answer_reporting_a_prompt_of_no_tokens_corrects_nothing() {
    let svc = service(&[("a", "n1")]);
    // "new"'s second turn, predicted held: the answer counts no prompt at all.
    let (d, usage) = old_then_new(&svc, &[1, 2, 3], reused(0, 0)).await;
    assert_eq!(d.outcome, Outcome::HomeHit);
    assert_eq!(usage.map(|u| u.prompt_tokens), Some(0));
    let corrections = status(&svc, "a").corrections;
    // Nothing was learned of an eviction: both conversations are still home.
    for (session, next) in [("old", [1, 2, 3, 4]), ("new", [10, 11, 12, 14])] {
        let (d, _, _) = exchange(
            &svc,
            request(Some(session), Some(chain(&next, 1000)), reused(4000, 3000)),
        )
        .await;
        assert_eq!(d.outcome, Outcome::HomeHit, "{session}");
    }
    assert_eq!(corrections, 0);
}

/// Two conversations that open alike start on one backend at once. The second cannot reuse
/// the opening the first is still reading (llama-server shares no prefix between busy
/// slots), so it reuses none of what the model predicted. That shortfall is not an eviction:
/// before, the model took it for one and forgot the first conversation, whose next turn then
/// left its home as a cold home.
#[tokio::test(start_paused = true)]
async fn a_prefix_another_request_is_still_reading_is_no_eviction_when_it_is_not_reused() {
    let two = NonZeroU32::new(2).unwrap();
    let backend = Backend::new("n1", scripted())
        .slots(two)
        .cache_tokens(1 << 20);
    let svc = SessionAffinityLayer::new().layer(StaticFleet::new([("a", backend)]));
    let slow = Reply {
        headers_after: Duration::from_secs(10),
        ..reused(4000, 0)
    };
    let req = request(Some("first"), Some(chain(&[1, 2, 10, 11], 1000)), slow);
    let first = tokio::spawn({
        let svc = svc.clone();
        async move { exchange(&svc, req).await }
    });
    // The first is sent, and reads its prompt for ten seconds.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (d, _, _) = exchange(
        &svc,
        request(
            Some("second"),
            Some(chain(&[1, 2, 20, 21], 1000)),
            reused(4000, 0),
        ),
    )
    .await;
    assert_eq!(d.backend.as_str(), "a");
    let (d, _, _) = first.await.unwrap();
    assert_eq!(d.outcome, Outcome::NewSession);
    for (session, next) in [
        ("first", [1, 2, 10, 11, 12]),
        ("second", [1, 2, 20, 21, 22]),
    ] {
        let (d, _, _) = exchange(
            &svc,
            request(Some(session), Some(chain(&next, 1000)), reused(5000, 4000)),
        )
        .await;
        assert_eq!(d.outcome, Outcome::HomeHit, "{session}");
    }
    assert_eq!(status(&svc, "a").corrections, 0);
    // A shortfall once nothing predicted is in flight is an eviction, as before.
    let (d, _, _) = exchange(
        &svc,
        request(
            Some("first"),
            Some(chain(&[1, 2, 10, 11, 12, 13], 1000)),
            reused(6000, 0),
        ),
    )
    .await;
    assert_eq!(d.outcome, Outcome::HomeHit);
    assert_eq!(status(&svc, "a").corrections, 1);
}

/// llama-server's answer to a prompt longer than a slot's context.
fn exceeds_context() -> Reply {
    Reply {
        status: http::StatusCode::BAD_REQUEST,
        ..Reply::json(br#"{"error":{"code":400,"type":"exceed_context_size_error"}}"#)
    }
}

#[tokio::test(start_paused = true)]
async fn a_prompt_the_backend_refused_leaves_its_model_holding_what_it_held() {
    let svc = service(&[("a", "n1")]);
    let (d, _, _) = exchange(
        &svc,
        request(Some("held"), Some(chain(&[1, 2, 3], 1000)), reused(3000, 0)),
    )
    .await;
    assert_eq!(d.outcome, Outcome::NewSession);
    // Another session sends 2M tokens, twice the backend's whole budget; it refuses them.
    let huge: Vec<u64> = (100..300).collect();
    let (d, _, _) = exchange(
        &svc,
        request(Some("huge"), Some(chain(&huge, 10_000)), exceeds_context()),
    )
    .await;
    assert_eq!(d.backend.as_str(), "a");
    let a = status(&svc, "a");
    assert_eq!((a.cached_tokens, a.conversations), (3000, 1), "{a:?}");
    // The first session's next turn still finds its home holding it.
    held_turn_goes_home_as_predicted(&svc).await;
    // Its next turn is refused for a passing reason; the one after still goes home, which
    // holds what it held before, and is predicted so (no correction).
    let failed = Reply {
        status: http::StatusCode::INTERNAL_SERVER_ERROR,
        ..Reply::json(b"{}")
    };
    let five = chain(&[1, 2, 3, 4, 5], 1000);
    exchange(&svc, request(Some("held"), Some(five.clone()), failed)).await;
    assert_eq!(status(&svc, "a").cached_tokens, 4000);
    let (d, _, _) = exchange(&svc, request(Some("held"), Some(five), reused(5000, 4000))).await;
    assert_eq!(d.outcome, Outcome::HomeHit);
    let a = status(&svc, "a");
    assert_eq!((a.cached_tokens, a.corrections), (5000, 0), "{a:?}");
}

/// An error answer did not take its prompt (the backend refused it, or failed on it): a
/// usage in its body (a gateway's in front of the backend, the count of the prompt it
/// refused) says nothing of what the backend holds or reuses. Read as an answer's, one that
/// said no reuse corrected the model, which forgot the conversation the backend still held,
/// and was counted among the backend's reports.
#[tokio::test(start_paused = true)]
async fn an_error_answers_usage_teaches_nothing() {
    let svc = service(&[("a", "n1")]);
    exchange(
        &svc,
        request(Some("held"), Some(chain(&[1, 2, 3], 1000)), reused(3000, 0)),
    )
    .await;
    let before = status(&svc, "a");
    for code in [
        http::StatusCode::BAD_REQUEST,
        http::StatusCode::INTERNAL_SERVER_ERROR,
    ] {
        let failed = Reply {
            status: code,
            ..Reply::json(
                br#"{"error":{"code":500,"message":"generation failed","type":"server_error"},"usage":{"prompt_tokens":4000,"completion_tokens":0,"prompt_tokens_details":{"cached_tokens":0}}}"#,
            )
        };
        let (_, _, usage) = exchange(
            &svc,
            request(Some("held"), Some(chain(&[1, 2, 3, 4], 1000)), failed),
        )
        .await;
        let a = status(&svc, "a");
        assert_eq!(
            (a.usage_reports, a.prompt_tokens, a.corrections),
            (before.usage_reports, before.prompt_tokens, 0),
            "{code}: {a:?}"
        );
        assert_eq!(usage, None, "{code}");
        assert_eq!(svc.stats().usage_reports, 1, "{code}");
    }
    // The conversation is still held there: its next turn is a hit, and predicted so.
    held_turn_goes_home_as_predicted(&svc).await;
    assert_idle(&svc);
}

#[tokio::test(start_paused = true)]
async fn the_turn_after_one_the_backend_refused_is_not_a_compaction() {
    let svc = service(&[("a", "n1")]);
    let turn = |blocks: &[u64], reply| request(Some("s"), Some(chain(blocks, 1000)), reply);
    exchange(&svc, turn(&[1, 2, 3], reused(3000, 0))).await;
    // The client pastes a file too long for the context: refused.
    let refused = exchange(&svc, turn(&[1, 2, 3, 40, 41, 42, 43], exceeds_context())).await;
    assert_eq!(refused.0.outcome, Outcome::HomeHit);
    // It sends a shorter message instead: its prompt goes on from the turn before the refused
    // one, not from the refused one. It goes home, as a home hit.
    let (d, _, _) = exchange(&svc, turn(&[1, 2, 3, 5], reused(4000, 3000))).await;
    assert_eq!(d.outcome, Outcome::HomeHit);
    let stats = svc.stats();
    assert_eq!((stats.compactions, stats.home_hits), (0, 2), "{stats:?}");
    // A prompt whose leading messages changed is still a compaction.
    let (d, _, _) = exchange(&svc, turn(&[9, 2, 3, 5, 6], reused(5000, 0))).await;
    assert_eq!(d.outcome, Outcome::Compaction);
}

// === wait versus move ===

const SESSION_BLOCKS: [u64; 10] = [100, 101, 102, 103, 104, 105, 106, 107, 108, 109];

/// Teaches both backends: each reads a cold 10,000-token prompt in 50 s (200 tokens/s), and
/// its requests take `took` from dispatch to the end of the answer.
async fn teach<S, P>(svc: &Svc<S, P>, took: Duration)
where
    Svc<S, P>: tower::Service<Req, Response = Res, Error = tower_affinity::Error>,
    <Svc<S, P> as tower::Service<Req>>::Future: Send,
{
    let first = Duration::from_secs(50).min(took);
    let lesson = || Reply::llama_stream(10_000, 0, 50_000, first, took - first);
    // Two at once on one-slot backends: one each.
    let (a, b) = tokio::join!(
        exchange(svc, request(None, Some(chain(&[7, 8], 5000)), lesson())),
        exchange(svc, request(None, Some(chain(&[9, 10], 5000)), lesson())),
    );
    assert_ne!(a.0.backend, b.0.backend, "one lesson each");
    for s in svc.backends() {
        assert_eq!(s.prefill_rate, Some(200), "{}", s.id);
    }
}

/// The first turn of session `key`: where it went.
async fn first_turn<S, P>(svc: &Svc<S, P>, key: &str) -> String
where
    Svc<S, P>: tower::Service<Req, Response = Res, Error = tower_affinity::Error>,
    <Svc<S, P> as tower::Service<Req>>::Future: Send,
{
    let (d, _, _) = exchange(
        svc,
        request(
            Some(key),
            Some(chain(&SESSION_BLOCKS[..8], 1000)),
            reused(8000, 0),
        ),
    )
    .await;
    d.backend.to_string()
}

/// A turn of session `key` that keeps its home busy for `busy`: the task streaming it.
async fn hold_home<S, P>(
    svc: &Svc<S, P>,
    key: &str,
    home: &str,
    busy: Duration,
) -> tokio::task::JoinHandle<()>
where
    S: Send + Sync + 'static,
    Svc<S, P>:
        tower::Service<Req, Response = Res, Error = tower_affinity::Error> + Send + Sync + 'static,
    <Svc<S, P> as tower::Service<Req>>::Future: Send,
{
    let long = Reply::llama_stream(9000, 8000, 5000, Duration::ZERO, busy);
    let turn = request(Some(key), Some(chain(&SESSION_BLOCKS[..9], 1000)), long);
    keep_busy(svc, turn, home).await
}

/// Sends `req`, which must go to `backend`, and reads its answer in a task of its own: the
/// backend's slot stays taken until the task ends.
async fn keep_busy<S, P>(svc: &Svc<S, P>, req: Req, backend: &str) -> tokio::task::JoinHandle<()>
where
    S: Send + Sync + 'static,
    Svc<S, P>:
        tower::Service<Req, Response = Res, Error = tower_affinity::Error> + Send + Sync + 'static,
    <Svc<S, P> as tower::Service<Req>>::Future: Send,
{
    let res = svc.clone().oneshot(req).await.unwrap();
    assert_eq!(
        res.extensions().get::<Decision>().unwrap().backend.as_str(),
        backend
    );
    tokio::spawn(async move {
        let _ = res.into_body().collect().await;
    })
}

/// Session "s" on its home, then a turn of it that keeps the home busy for `busy`: returns
/// the home and the task streaming that turn.
async fn busy_home<S, P>(svc: &Svc<S, P>, busy: Duration) -> (String, tokio::task::JoinHandle<()>)
where
    S: Send + Sync + 'static,
    Svc<S, P>:
        tower::Service<Req, Response = Res, Error = tower_affinity::Error> + Send + Sync + 'static,
    <Svc<S, P> as tower::Service<Req>>::Future: Send,
{
    let home = first_turn(svc, "s").await;
    let streaming = hold_home(svc, "s", &home, busy).await;
    (home, streaming)
}

/// The next turn of "s", sent while its home is busy.
async fn next_turn<S, P>(svc: &Svc<S, P>) -> (Decision, Duration)
where
    Svc<S, P>: tower::Service<Req, Response = Res, Error = tower_affinity::Error>,
    <Svc<S, P> as tower::Service<Req>>::Future: Send,
{
    next_turn_of(svc, "s").await
}

/// The next turn of session `key`, sent while its home is busy.
async fn next_turn_of<S, P>(svc: &Svc<S, P>, key: &str) -> (Decision, Duration)
where
    Svc<S, P>: tower::Service<Req, Response = Res, Error = tower_affinity::Error>,
    <Svc<S, P> as tower::Service<Req>>::Future: Send,
{
    let t0 = Instant::now();
    let (d, _, _) = exchange(
        svc,
        request(
            Some(key),
            Some(chain(&SESSION_BLOCKS, 1000)),
            reused(10_000, 9000),
        ),
    )
    .await;
    (d, t0.elapsed())
}

#[tokio::test(start_paused = true)]
async fn wait_for_the_full_backend_holding_the_prefix_when_its_slot_frees_sooner_than_moving_costs()
{
    let svc = service(&[("a", "n1"), ("b", "n2")]);
    // Requests take 10 s; moving costs reading 10,000 tokens at 200 tokens/s: 50 s.
    teach(&svc, Duration::from_secs(10)).await;
    let (home, streaming) = busy_home(&svc, Duration::from_secs(5)).await;
    let (d, _) = next_turn(&svc).await;
    assert_eq!(d.backend.as_str(), home);
    assert_eq!(d.outcome, Outcome::HomeHit);
    assert_eq!(d.waited, Some(Duration::from_secs(5)));
    streaming.await.unwrap();
}

/// Waiting for the full backend holding the prefix would be cheaper, but the queue has no room
/// for the request: it cannot wait, so it moves at once rather than being refused.
#[tokio::test(start_paused = true)]
async fn a_request_that_would_wait_for_the_holder_moves_when_the_queue_has_no_room() {
    let svc = SessionAffinityLayer::new()
        .overflow(Overflow::wait(Duration::from_secs(60), 0))
        .layer(fleet(&[("a", "n1"), ("b", "n2")], scripted()));
    teach(&svc, Duration::from_secs(10)).await;
    let (home, streaming) = busy_home(&svc, Duration::from_secs(5)).await;
    let (d, took) = next_turn(&svc).await;
    assert_ne!(d.backend.as_str(), home);
    assert_eq!((d.waited, took), (None, Duration::ZERO));
    streaming.await.unwrap();
    let stats = svc.stats();
    assert_eq!((stats.rejected, stats.waiting), (0, 0));
}

/// The one backend a request that carries it may go to.
#[derive(Clone, Copy, Debug)]
struct Only(&'static str);

/// `NodeThenBackend`, except that a request carrying [`Only`] is offered that backend alone.
#[derive(Clone, Debug, Default)]
struct OnlyNamed(NodeThenBackend);

impl Placement for OnlyNamed {
    fn place(&self, fleet: &FleetView<'_>, req: &PlacementRequest<'_>, c: &mut Candidates<'_>) {
        let Some(&Only(id)) = req.extensions.get::<Only>() else {
            return self.0.place(fleet, req, c);
        };
        if let Some(b) = fleet.backends().find(|b| b.id().as_str() == id) {
            let _ = c.offer(b);
        }
    }
}

/// Waiting for the full backend holding the prefix would be cheaper, but the queue is full,
/// of a request that may go to that backend alone: the turn cannot wait, and takes the free
/// slot elsewhere rather than give it back (promised to that waiter, which would not take
/// it) and be refused.
#[tokio::test(start_paused = true)]
async fn a_request_that_cannot_wait_for_the_holder_takes_the_slot_it_ruled_against() {
    let svc: Svc<_, OnlyNamed> = SessionAffinityLayer::new()
        .placement(OnlyNamed::default())
        .overflow(Overflow::wait(Duration::from_secs(60), 1))
        .layer(fleet(&[("a", "n1"), ("b", "n2")], scripted()));
    teach(&svc, Duration::from_secs(10)).await;
    let (home, streaming) = busy_home(&svc, Duration::from_secs(5)).await;
    let home: &'static str = if home == "a" { "a" } else { "b" };
    let mut only_home = request(None, None, Reply::json(b"{}"));
    only_home.extensions_mut().insert(Only(home));
    let mut waiter = tokio_test::task::spawn(svc.clone().oneshot(only_home));
    assert!(waiter.poll().is_pending());
    assert_eq!(svc.stats().waiting, 1, "the queue is full");
    let next = request(
        Some("s"),
        Some(chain(&SESSION_BLOCKS, 1000)),
        reused(10_000, 9000),
    );
    let res = svc.clone().oneshot(next).await.expect("a slot was free");
    let d = res.extensions().get::<Decision>().unwrap();
    assert_ne!(d.backend.as_str(), home);
    assert_eq!(d.waited, None);
    drop(res);
    let res = waiter.await.unwrap();
    assert_eq!(
        res.extensions().get::<Decision>().unwrap().backend.as_str(),
        home
    );
    streaming.await.unwrap();
    assert_eq!(svc.stats().rejected, 0);
}

/// The full backend holding the prefix is down: no slot there will serve the request while
/// the mark lasts, so it moves at once however much moving costs.
#[tokio::test(start_paused = true)]
async fn a_full_backend_holding_the_prefix_is_not_waited_for_while_down() {
    let svc = service(&[("a", "n1"), ("b", "n2")]);
    teach(&svc, Duration::from_secs(10)).await;
    let (home, streaming) = busy_home(&svc, Duration::from_secs(5)).await;
    assert!(svc.mark_down(&home, Some(Duration::from_secs(60))));
    let (d, took) = next_turn(&svc).await;
    assert_ne!(d.backend.as_str(), home);
    assert_eq!((d.waited, took), (None, Duration::ZERO));
    streaming.await.unwrap();
}

/// `NodeThenBackend`, except that it offers nothing once when armed: a request that finds the
/// fleet full at its first look and, at the look it takes on joining the queue, a slot free
/// (as one freed meanwhile on another thread would be).
#[derive(Default)]
struct FullOnce {
    armed: AtomicBool,
}

impl Placement for FullOnce {
    fn place(&self, f: &FleetView<'_>, r: &PlacementRequest<'_>, c: &mut Candidates<'_>) {
        if !self.armed.swap(false, Ordering::Relaxed) {
            NodeThenBackend::new().place(f, r, c);
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_slot_found_on_joining_the_queue_is_weighed_against_waiting_for_the_holder() {
    let policy = Arc::new(FullOnce::default());
    let svc: Svc<_, _> = SessionAffinityLayer::new()
        .placement(policy.clone())
        .layer(fleet(&[("a", "n1"), ("b", "n2")], scripted()));
    teach(&svc, Duration::from_secs(10)).await;
    let (home, streaming) = busy_home(&svc, Duration::from_secs(5)).await;
    // The other backend's slot, taken and ruled against on joining the queue, woke this
    // request's own ticket: it is passed on, and the request waits for its home as ruled.
    policy.armed.store(true, Ordering::Relaxed);
    let (d, _) = next_turn(&svc).await;
    assert!(!policy.armed.load(Ordering::Relaxed));
    assert_eq!(d.backend.as_str(), home);
    assert_eq!(d.outcome, Outcome::HomeHit);
    assert_eq!(d.waited, Some(Duration::from_secs(5)));
    streaming.await.unwrap();
    assert_idle(&svc);
    // Nothing is left promised: two requests of a second each take both slots at once.
    let slow = Reply {
        headers_after: Duration::from_secs(1),
        ..Reply::json(b"{}")
    };
    let new = |key| request(Some(key), None, slow.clone());
    let (x, y) = tokio::join!(exchange(&svc, new("x")), exchange(&svc, new("y")));
    assert_ne!(x.0.backend, y.0.backend);
    assert_eq!((x.0.waited, y.0.waited), (None, None));
}

/// The whole fleet is full when the turn comes, so it waits for any slot. A slot frees on
/// the other backend first: the turn is weighed then, as one finding that slot at once would
/// be, and waits for its home rather than read its whole prompt there.
#[tokio::test(start_paused = true)]
async fn a_request_that_found_the_fleet_full_is_weighed_when_a_slot_elsewhere_frees() {
    let svc = service(&[("a", "n1"), ("b", "n2")]);
    // Requests take 10 s; moving costs reading 10,000 tokens at 200 tokens/s: 50 s.
    teach(&svc, Duration::from_secs(10)).await;
    let (home, streaming) = busy_home(&svc, Duration::from_secs(30)).await;
    let other = if home == "a" { "b" } else { "a" };
    // The other backend busy for 5 s with a prompt of its own.
    let own = Reply::llama_stream(1000, 0, 5000, Duration::ZERO, Duration::from_secs(5));
    let busy = keep_busy(&svc, request(None, Some(chain(&[77], 1000)), own), other).await;
    let (d, _) = next_turn(&svc).await;
    assert_eq!(
        (d.backend.as_str(), d.outcome, d.waited),
        (
            home.as_str(),
            Outcome::HomeHit,
            Some(Duration::from_secs(30))
        )
    );
    busy.await.unwrap();
    streaming.await.unwrap();
    assert_idle(&svc);
}

/// A turn of another conversation under the key (a sub-agent's: it does not extend the key's
/// last turn, but extends a prompt of its own held elsewhere) has its cache where its own
/// prefix is, not at the key's home: it is weighed against waiting for that backend, as a
/// home hit is against waiting for its home.
#[tokio::test(start_paused = true)]
async fn a_turn_of_another_conversation_under_the_key_waits_for_the_full_backend_holding_its_own_prefix(
) {
    let svc = service(&[("a", "n1"), ("b", "n2")]);
    // Requests take 10 s; moving costs reading 10,000 tokens at 200 tokens/s: 50 s.
    teach(&svc, Duration::from_secs(10)).await;
    // The key's last turn is on its home, busy for 2 s.
    let (home, streaming) = busy_home(&svc, Duration::from_secs(2)).await;
    let other = if home == "a" { "b" } else { "a" };
    // The sub-agent's conversation, 10,000 tokens, is on the other backend, busy for 5 s.
    let sub = || (300..310).collect::<Vec<u64>>();
    let opening = Reply::llama_stream(10_000, 0, 5000, Duration::ZERO, Duration::from_secs(5));
    let busy = keep_busy(
        &svc,
        request(None, Some(chain(&sub(), 1000)), opening),
        other,
    )
    .await;
    // Its next turn, under the key: the fleet is full; the home frees first, but the other
    // backend, 3 s later, costs less than reading the sub-agent's prompt again there.
    let turn = chain(&[sub(), vec![310, 311]].concat(), 1000);
    let (d, _, _) = exchange(&svc, request(Some("s"), Some(turn), reused(12_000, 10_000))).await;
    assert_eq!(
        (d.backend.as_str(), d.outcome, d.waited),
        (other, Outcome::PrefixHit, Some(Duration::from_secs(5)))
    );
    busy.await.unwrap();
    streaming.await.unwrap();
    assert_idle(&svc);
}

/// As above, but the home stays busy: the turn holds out for it from the other slot's
/// freeing for as long as moving costs more than staying, then takes that slot. A request
/// holds out once: the look at the hold's end is not weighed again, though the home still
/// reads as worth waiting for (its request is overdue by the figures).
#[tokio::test(start_paused = true)]
async fn a_request_that_held_out_from_a_later_look_moves_when_its_hold_ends() {
    let max_wait = Duration::from_secs(900);
    let svc: Svc<_> = SessionAffinityLayer::new()
        .overflow(Overflow::wait(max_wait, 16))
        .layer(fleet(&[("a", "n1"), ("b", "n2")], scripted()));
    teach(&svc, Duration::from_secs(10)).await;
    let (home, streaming) = busy_home(&svc, Duration::from_secs(1000)).await;
    let other = if home == "a" { "b" } else { "a" };
    let own = Reply::llama_stream(1000, 0, 5000, Duration::ZERO, Duration::from_secs(5));
    let busy = keep_busy(&svc, request(None, Some(chain(&[77], 1000)), own), other).await;
    let (d, _) = next_turn(&svc).await;
    assert_eq!(
        (d.backend.as_str(), d.outcome),
        (other, Outcome::CrossNodeSpill)
    );
    // Moving reads 10,000 tokens (50 s) and delays the requests reaching the other backend
    // meanwhile; staying reads 1,000 (5 s): a hold of minutes from 5 s on, ended well before
    // the wait's 900 s.
    let waited = d.waited.expect("it waited");
    assert!(
        waited > Duration::from_secs(60) && waited < Duration::from_secs(600),
        "{waited:?}"
    );
    busy.await.unwrap();
    streaming.abort();
}

/// `NodeThenBackend`, except that it offers nothing, as if the fleet were full, while the
/// clock is before the blind spell's end (`base` plus `until_ms`).
struct Blind {
    base: Instant,
    until_ms: AtomicU64,
}

impl Blind {
    fn until(&self, until: Instant) {
        let ms = until.duration_since(self.base).as_millis();
        self.until_ms
            .store(ms.try_into().unwrap(), Ordering::Relaxed);
    }
}

impl Placement for Blind {
    fn place(&self, f: &FleetView<'_>, r: &PlacementRequest<'_>, c: &mut Candidates<'_>) {
        let until = self.base + Duration::from_millis(self.until_ms.load(Ordering::Relaxed));
        if Instant::now() >= until {
            NodeThenBackend::new().place(f, r, c);
        }
    }
}

/// A request whose wait is over takes the slot its last look finds, though its home is full
/// and worth waiting for by the figures: holding it out then would refuse it.
#[tokio::test(start_paused = true)]
async fn the_last_look_of_a_wait_takes_a_slot_elsewhere_rather_than_hold_out_for_the_home() {
    let max_wait = Duration::from_secs(20);
    let policy = Arc::new(Blind {
        base: Instant::now(),
        until_ms: AtomicU64::new(0),
    });
    let svc: Svc<_, _> = SessionAffinityLayer::new()
        .overflow(Overflow::wait(max_wait, 16))
        .placement(policy.clone())
        .layer(fleet(&[("a", "n1"), ("b", "n2")], scripted()));
    // Requests take 10 s, so the home, busy for 100 s, reads as due at once.
    teach(&svc, Duration::from_secs(10)).await;
    let (home, streaming) = busy_home(&svc, Duration::from_secs(100)).await;
    // Blind for the whole wait: the turn's only look that sees the fleet is its last.
    policy.until(Instant::now() + max_wait);
    let (d, took) = next_turn(&svc).await;
    assert_ne!(d.backend.as_str(), home);
    assert_eq!(
        (d.outcome, d.waited),
        (Outcome::CrossNodeSpill, Some(max_wait))
    );
    assert_eq!(took, max_wait);
    streaming.abort();
}

/// Offers every backend but the one that refused the request's prompt, if it carries a
/// refusal; else places as `NodeThenBackend` does.
#[derive(Clone, Debug, Default)]
struct AvoidsTheRefuser(NodeThenBackend);

impl Placement for AvoidsTheRefuser {
    fn place(&self, fleet: &FleetView<'_>, req: &PlacementRequest<'_>, c: &mut Candidates<'_>) {
        let refuser = req.extensions.get::<ContextRefusal>();
        let Some(refuser) = refuser.and_then(|r| r.backend.clone()) else {
            return self.0.place(fleet, req, c);
        };
        for b in fleet.backends().filter(|b| *b.id() != refuser) {
            if c.offer(b).is_break() {
                return;
            }
        }
    }
}

/// A retry of a prompt its home refused as too long, from a policy that never offers the
/// refuser, is not held for that home, full though it is and cheaper to wait for than moving
/// by what it learned: the wait's look for the home finds no candidate, and widens at once.
#[tokio::test(start_paused = true)]
async fn a_retry_is_not_held_for_the_backend_that_refused_its_prompt() {
    let svc: Svc<_, AvoidsTheRefuser> = SessionAffinityLayer::new()
        .placement(AvoidsTheRefuser::default())
        .layer(fleet(&[("a", "n1"), ("b", "n2")], scripted()));
    // As in the test above: waiting for the home (5 s) costs less than moving (50 s).
    teach(&svc, Duration::from_secs(10)).await;
    let (home, streaming) = busy_home(&svc, Duration::from_secs(5)).await;
    let mut req = request(
        Some("s"),
        Some(chain(&SESSION_BLOCKS, 1000)),
        reused(10_000, 0),
    );
    req.extensions_mut()
        .insert(ContextRefusal::new(12_000, 4_096).by(home.as_str()));
    let t0 = Instant::now();
    let (d, _, _) = exchange(&svc, req).await;
    assert_ne!(d.backend.as_str(), home);
    assert_eq!((d.waited, t0.elapsed()), (None, Duration::ZERO), "{d:?}");
    streaming.await.unwrap();
    assert_idle(&svc);
}

/// An error answer (a request the backend turned down at once: malformed, refused as too
/// long, or while it loads its model) says nothing of how long its requests take to answer.
/// Taken for one, a few quick ones made a backend whose answers take minutes look as if its
/// slots freed in seconds, and a turn whose home was busy waited for it rather than move.
#[tokio::test(start_paused = true)]
async fn an_error_answer_teaches_nothing_of_how_long_requests_take() {
    let svc = service(&[("a", "n1"), ("b", "n2")]);
    // Requests take 200 s: a busy home's slot is due far later than moving costs (50 s).
    teach(&svc, Duration::from_secs(200)).await;
    let home = first_turn(&svc, "s").await;
    let before = status(&svc, &home).request_time;
    let turned_down = || {
        Reply {
        status: http::StatusCode::BAD_REQUEST,
        headers_after: Duration::from_millis(20),
        ..Reply::json(br#"{"error":{"code":400,"message":"'messages' is required","type":"invalid_request_error"}}"#)
    }
    };
    for _ in 0..5 {
        let (d, _, _) = exchange(&svc, request(Some("s"), None, turned_down())).await;
        assert_eq!(d.backend.as_str(), home);
    }
    let after = status(&svc, &home).request_time;
    let streaming = hold_home(&svc, "s", &home, Duration::from_secs(200)).await;
    let (d, _) = next_turn(&svc).await;
    assert_eq!(
        (d.backend.as_str() != home, d.waited),
        (true, None),
        "{d:?}"
    );
    assert_eq!(after, before);
    streaming.abort();
}

#[tokio::test(start_paused = true)]
async fn move_at_once_when_the_wait_would_cost_more_than_moving() {
    let svc = service(&[("a", "n1"), ("b", "n2")]);
    // Requests take 200 s: the home's slot is due far later than 50 s.
    teach(&svc, Duration::from_secs(200)).await;
    let (home, streaming) = busy_home(&svc, Duration::from_secs(200)).await;
    let (d, _) = next_turn(&svc).await;
    assert_ne!(d.backend.as_str(), home);
    assert_eq!(d.outcome, Outcome::CrossNodeSpill);
    assert_eq!(d.waited, None);
    streaming.abort();
}

/// A backend removed and announced again keeps its prefill rate and forgets its token scale.
/// Until an answer teaches the scale again, its reads are counted at the mean scale of the
/// fleet's backends that know theirs, not at one token a token of the estimate. Here the
/// busy home and the backend with room both forgot theirs: counted at one token a token,
/// moving would save less than the wait for the home, and the turn would move.
#[tokio::test(start_paused = true)]
async fn a_backend_that_forgot_its_scale_reads_at_the_fleets_scale_while_it_knows_its_rate() {
    let (handle, stream) = tower_affinity::discover::channel();
    let backend = |node| {
        Backend::new(node, scripted())
            .slots(NonZeroU32::MIN)
            .cache_tokens(1 << 20)
    };
    let nodes = [("a", "n1"), ("b", "n2"), ("c", "n3")];
    let ids = nodes.map(|(id, _)| id);
    for (id, node) in nodes {
        handle.insert(id, backend(node));
    }
    let svc = SessionAffinityLayer::new().layer(stream);
    svc.apply_discovery();
    // Each reads 10,000 of its tokens in 50 s (200 tokens/s), a prompt of 5,000 by the
    // estimate (2 of its tokens a token); its requests take 100 s.
    let lesson = || {
        Reply::llama_stream(
            10_000,
            0,
            50_000,
            Duration::from_secs(50),
            Duration::from_secs(50),
        )
    };
    let lessons = tokio::join!(
        decision_of(&svc, request(None, Some(chain(&[7, 8], 2500)), lesson())),
        decision_of(&svc, request(None, Some(chain(&[9, 10], 2500)), lesson())),
        decision_of(&svc, request(None, Some(chain(&[11, 12], 2500)), lesson())),
    );
    let mut taught = [lessons.0, lessons.1, lessons.2].map(|d| d.backend.to_string());
    taught.sort();
    assert_eq!(taught, ids, "one lesson each");
    let first = request(
        Some("s"),
        Some(chain(&SESSION_BLOCKS[..8], 1000)),
        reused(8000, 0),
    );
    let home = decision_of(&svc, first).await.backend.to_string();
    let home = ids.into_iter().find(|&id| id == home).unwrap();
    let mut others = ids.into_iter().filter(|&id| id != home);
    let (free, busy) = (others.next().unwrap(), others.next().unwrap());
    // The home and the backend the next turn may move to come back: they keep their rates and
    // their request times, and forget their scales.
    for id in [home, free] {
        let (_, node) = nodes.into_iter().find(|&(n, _)| n == id).unwrap();
        assert!(handle.remove(id));
        svc.apply_discovery();
        handle.insert(id, backend(node));
        svc.apply_discovery();
    }
    for id in ids {
        let s = svc
            .backends()
            .into_iter()
            .find(|s| s.id.as_str() == id)
            .unwrap();
        assert_eq!(
            (s.prefill_rate, s.request_time),
            (Some(200), Some(Duration::from_secs(100))),
            "{id}"
        );
    }
    let busy_for =
        |secs| Reply::llama_stream(9000, 8000, 5000, Duration::ZERO, Duration::from_secs(secs));
    let turn = request(
        Some("s"),
        Some(chain(&SESSION_BLOCKS[..9], 1000)),
        busy_for(5),
    );
    let streaming = held_on(&svc, turn, home).await;
    let own = pinned_to(request(None, Some(chain(&[77], 1000)), busy_for(100)), busy);
    let held = held_on(&svc, own, busy).await;
    // `busy` is full: the turn may move to `free` alone, and the fleet's scale is `busy`'s.
    // The home's slot is due in 100 s. At 2 tokens a token, staying reads the 1,000 tokens
    // the home lacks in 10 s; moving reads 10,000 on `free` in 100 s, and delays the requests
    // reaching it meanwhile (one every 100 s) as long: 200 s, which saves 190 s, and the turn
    // waits. At one token a token moving would cost 50 s + 25 s and save 70 s.
    let next = request(
        Some("s"),
        Some(chain(&SESSION_BLOCKS, 1000)),
        reused(10_000, 9000),
    );
    let d = decision_of(&svc, next).await;
    assert_eq!(
        (d.backend.as_str(), d.waited),
        (home, Some(Duration::from_secs(5)))
    );
    streaming.await.unwrap();
    held.await.unwrap();
    assert_eq!(svc.stats().in_flight, 0);
}

/// Sends `req`, which must go to `backend`, and reads its answer in a task of its own, as
/// [`keep_busy`] does, on any service of this crate's response type.
async fn held_on<T>(svc: &T, req: Req, backend: &str) -> tokio::task::JoinHandle<()>
where
    T: tower::Service<Req, Response = Res, Error = tower_affinity::Error> + Clone,
{
    let res = svc.clone().oneshot(req).await.expect("an answer");
    assert_eq!(
        res.extensions().get::<Decision>().unwrap().backend.as_str(),
        backend
    );
    tokio::spawn(async move {
        let _ = res.into_body().collect().await;
    })
}

#[tokio::test(start_paused = true)]
async fn a_request_behind_others_waiting_for_the_holder_counts_their_turns_in_its_wait() {
    let svc: Svc<_> = SessionAffinityLayer::new()
        .overflow(Overflow::wait(Duration::from_secs(600), 16))
        .layer(fleet(&[("a", "n1"), ("b", "n2")], scripted()));
    teach(&svc, Duration::from_secs(60)).await;
    // Conversations of their own, each first turn 8,000 tokens: three homed on a.
    let blocks = |k: u64| -> Vec<u64> { (0..10).map(|i| 1000 * (k + 1) + i).collect() };
    let mut homed = Vec::new();
    for k in 0..200 {
        let key = format!("s{k}");
        let first = request(
            Some(&key),
            Some(chain(&blocks(k)[..8], 1000)),
            reused(8000, 0),
        );
        if exchange(&svc, first).await.0.backend.as_str() == "a" {
            homed.push((key, k));
        }
        if homed.len() == 3 {
            break;
        }
    }
    assert_eq!(homed.len(), 3);
    let minute = Duration::from_secs(60);
    let (key, k) = &homed[0];
    let long = Reply::llama_stream(9000, 8000, 5000, Duration::ZERO, minute);
    let busy = request(Some(key), Some(chain(&blocks(*k)[..9], 1000)), long);
    let streaming = keep_busy(&svc, busy, "a").await;
    // The next turns of the two others, one after another, each lacking 2,000 tokens on a
    // (10 s to read) and 10,000 on b (50 s, and about 42 s more for the requests reaching b
    // meanwhile): waiting for a is worth up to about 82 s. a's slot is due in 60 s, and the
    // next 60 s later, to the request waiting ahead: the first waits, the second moves at
    // once (it waited its 82 s for a slot that came at 120 s, then moved).
    let mut turns = Vec::new();
    for (key, k) in homed[1..].iter().cloned() {
        let svc = svc.clone();
        let answer = Reply::llama_stream(10_000, 8000, 5000, Duration::ZERO, minute);
        let next = request(Some(&key), Some(chain(&blocks(k), 1000)), answer);
        turns.push(tokio::spawn(async move { exchange(&svc, next).await.0 }));
        for _ in 0..8 {
            tokio::task::yield_now().await;
        }
    }
    let mut decisions = Vec::new();
    for t in turns {
        let d = tokio::time::timeout(Duration::from_secs(600), t)
            .await
            .expect("every turn ends")
            .unwrap();
        decisions.push(d);
    }
    let [first, second] = &decisions[..] else {
        panic!("two turns")
    };
    assert_eq!(
        (first.backend.as_str(), first.outcome, first.waited),
        ("a", Outcome::HomeHit, Some(minute))
    );
    assert_eq!(
        (second.backend.as_str(), second.waited),
        ("b", None),
        "{second:?}"
    );
    streaming.await.unwrap();
}

/// A home whose one slot has freed and is promised to a request waiting for it, which has not
/// run yet, is as full as one whose request is in flight: the slot is that request's for as
/// long as requests take. A turn homed there counts that, and moves at once when moving costs
/// less; it is not told its wait is none because no request holds the slot yet.
#[tokio::test(start_paused = true)]
async fn a_home_whose_free_slot_is_promised_to_a_waiter_is_no_wait_of_no_time() {
    let svc = service(&[("a", "n1"), ("b", "n2")]);
    // Requests take 200 s. A move reads the 10,000 tokens it lacks in 50 s, and about 12.5 s
    // more for the requests reaching the other backend meanwhile; staying reads 1,000 in
    // 5 s: waiting is worth up to about 57.5 s.
    teach(&svc, Duration::from_secs(200)).await;
    let home = first_turn(&svc, "s").await;
    let mut other = None;
    for n in 0..16 {
        let k = format!("w{n}");
        if first_turn(&svc, &k).await == home {
            other = Some(k);
            break;
        }
    }
    let other = other.expect("a second session homed with the first");
    // A turn of "s" holds the home, its answer unread; 190 s later its slot is due in about
    // 10 s, so the next turn of the other session waits for it.
    let long = Reply::llama_stream(9000, 8000, 5000, Duration::ZERO, Duration::from_secs(10));
    let busy = request(
        Some("s"),
        Some(chain(&SESSION_BLOCKS[..9], 1000)),
        long.clone(),
    );
    let held = svc.clone().oneshot(busy).await.unwrap();
    assert_eq!(
        held.extensions()
            .get::<Decision>()
            .unwrap()
            .backend
            .as_str(),
        home
    );
    tokio::time::advance(Duration::from_secs(190)).await;
    let next = request(
        Some(&other),
        Some(chain(&SESSION_BLOCKS, 1000)),
        reused(10_000, 9000),
    );
    let mut waiter = tokio_test::task::spawn(svc.clone().oneshot(next));
    assert!(waiter.poll().is_pending());
    assert_eq!(svc.stats().waiting, 1, "waits for its home");
    // The home's slot frees and is promised to that waiter, which has not run yet: the next
    // turn of "s" would wait some 200 s for it, and moves at once.
    drop(held);
    let (d, _) = next_turn(&svc).await;
    assert_ne!(d.backend.as_str(), home, "{d:?}");
    assert_eq!(d.waited, None, "{d:?}");
    let res = waiter.await.unwrap();
    let d = res.extensions().get::<Decision>().unwrap();
    assert_eq!(
        (d.backend.as_str(), d.outcome),
        (home.as_str(), Outcome::HomeHit)
    );
}

#[tokio::test(start_paused = true)]
async fn a_wait_for_the_holder_ends_when_moving_would_have_cost_less() {
    // Waits may last longer than the default minute.
    let svc: Svc<_> = SessionAffinityLayer::new()
        .overflow(Overflow::wait(Duration::from_secs(600), 16))
        .layer(fleet(&[("a", "n1"), ("b", "n2")], scripted()));
    // Requests usually take 10 s, but this one holds the home for 300 s: after waiting as long
    // as moving costs more than staying, the turn moves. Moving reads 50 s, and the five
    // requests reaching the other backend meanwhile (one in flight per 10 s) wait as long:
    // 300 s. Staying reads 5 s.
    teach(&svc, Duration::from_secs(10)).await;
    let (home, streaming) = busy_home(&svc, Duration::from_secs(300)).await;
    let (d, waited) = next_turn(&svc).await;
    assert_ne!(d.backend.as_str(), home);
    assert_eq!(d.outcome, Outcome::CrossNodeSpill);
    let hold = Duration::from_secs(295);
    assert_eq!(d.waited, Some(hold));
    assert!(waited >= hold);
    streaming.abort();
}

#[tokio::test(start_paused = true)]
async fn a_move_counts_its_read_for_the_requests_that_reach_the_other_backend_meanwhile() {
    let svc = service(&[("a", "n1"), ("b", "n2")]);
    // Requests take 100 s; a move reads the 10,000 tokens it lacks in 50 s, staying reads
    // 1,000 in 5 s. The home's slot frees in 50 s: alone, the move saves 45 s and would go
    // at once. But requests reach the other backend at one per 100 s (its one request in
    // flight, the move's own, over 100 s), so half a request waits behind the 50 s read:
    // moving costs 75 s, staying 5 s, and the turn waits for its home.
    teach(&svc, Duration::from_secs(100)).await;
    let (home, streaming) = busy_home(&svc, Duration::from_secs(100)).await;
    tokio::time::sleep(Duration::from_secs(50)).await;
    let (d, _) = next_turn(&svc).await;
    assert_eq!(d.backend.as_str(), home);
    assert_eq!(d.outcome, Outcome::HomeHit);
    assert_eq!(d.waited, Some(Duration::from_secs(50)));
    streaming.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_move_waits_behind_the_prompts_the_other_backend_is_still_reading() {
    // a has one slot, b two. Requests take 200 s, so the home's slot is due in about 200 s,
    // later than reading the 10,000 tokens a move lacks (50 s): alone, the turn would move
    // (`move_at_once_when_the_wait_would_cost_more_than_moving`). But b is reading a cold
    // 60,000-token prompt it has not answered yet (300 s at 200 tokens/s), and a move there
    // would wait behind it: the turn waits for its home.
    let fleet = StaticFleet::new([("a", "n1", 1), ("b", "n2", 2)].map(|(id, node, slots)| {
        let b = Backend::new(node, scripted())
            .slots(NonZeroU32::new(slots).unwrap())
            .cache_tokens(1 << 20);
        (id, b)
    }));
    // Waits may last longer than the default minute.
    let svc: Svc<_> = SessionAffinityLayer::new()
        .overflow(Overflow::wait(Duration::from_secs(600), 16))
        .layer(fleet);
    teach(&svc, Duration::from_secs(200)).await;
    // A session homed on a: the first of a few keys whose first turn lands there.
    let mut key = None;
    for n in 0..16 {
        let k = format!("s{n}");
        if first_turn(&svc, &k).await == "a" {
            key = Some(k);
            break;
        }
    }
    let key = key.expect("a key homed on a");
    let streaming = hold_home(&svc, &key, "a", Duration::from_secs(200)).await;
    assert_eq!(status(&svc, "b").unread_tokens, 0);
    // A cold prompt without a key goes to b, the only free slot; its answer starts in 400 s.
    let mut cold = Reply::llama_stream(60_000, 0, 300_000, Duration::ZERO, Duration::ZERO);
    cold.headers_after = Duration::from_secs(400);
    let cold = request(None, Some(chain(&[900, 901, 902], 20_000)), cold);
    let reading = tokio::spawn({
        let svc = svc.clone();
        async move { exchange(&svc, cold).await.0 }
    });
    while status(&svc, "b").in_flight < 1 {
        tokio::task::yield_now().await;
    }
    assert_eq!(status(&svc, "b").unread_tokens, 60_000);
    let (d, _) = next_turn_of(&svc, &key).await;
    assert_eq!(d.backend.as_str(), "a");
    assert_eq!(d.outcome, Outcome::HomeHit);
    assert_eq!(d.waited, Some(Duration::from_secs(200)));
    streaming.await.unwrap();
    assert_eq!(reading.await.unwrap().backend.as_str(), "b");
    assert_eq!(status(&svc, "b").unread_tokens, 0, "answered: read");
}

#[tokio::test(start_paused = true)]
async fn a_prompt_sent_and_never_answered_leaves_the_backlog_when_its_request_ends() {
    let svc = service(&[("a", "n1")]);
    let mut slow = Reply::llama_stream(6_000, 0, 30_000, Duration::ZERO, Duration::ZERO);
    slow.headers_after = Duration::from_secs(400);
    let req = request(None, Some(chain(&[1, 2, 3], 2_000)), slow);
    let call = tokio::spawn({
        let svc = svc.clone();
        async move { exchange(&svc, req).await }
    });
    while svc.backends().iter().all(|b| b.in_flight == 0) {
        tokio::task::yield_now().await;
    }
    assert_eq!(status(&svc, "a").unread_tokens, 6_000);
    // The client gives up before the backend answers.
    call.abort();
    let _ = call.await;
    let a = status(&svc, "a");
    assert_eq!((a.in_flight, a.unread_tokens), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn a_keyless_turn_waits_for_the_one_backend_holding_most_of_its_prompt_even_when_another_conversation_continues_it(
) {
    let svc = service(&[("a", "n1"), ("b", "n2")]);
    // Requests take 10 s; moving costs reading 10,000 tokens at 200 tokens/s: 50 s.
    teach(&svc, Duration::from_secs(10)).await;
    let turn1 = chain(&SESSION_BLOCKS[..8], 1000);
    let (d, _, _) = exchange(&svc, request(None, Some(turn1), reused(8000, 0))).await;
    let holder = d.backend.to_string();
    // A branch: another conversation continues the same 8,000 tokens on the same backend,
    // and keeps it busy for 5 s. The prefix is no longer one conversation's own.
    let branch = chain(&[100, 101, 102, 103, 104, 105, 106, 107, 900, 901], 1000);
    let long = Reply::llama_stream(10_000, 8000, 5000, Duration::ZERO, Duration::from_secs(5));
    let streaming = keep_busy(&svc, request(None, Some(branch), long), &holder).await;
    assert_eq!(status(&svc, &holder).in_flight, 1);
    let next = chain(&SESSION_BLOCKS, 1000);
    // The next turn of the first conversation: 8,000 of its 10,000 tokens are held there and
    // nowhere else, and its slot frees in 5 s, sooner than reading them elsewhere.
    let (d, _, _) = exchange(&svc, request(None, Some(next), reused(10_000, 8000))).await;
    assert_eq!(d.backend.as_str(), holder);
    assert_eq!(
        d.outcome,
        Outcome::Keyless,
        "a continued prefix is not a prefix hit"
    );
    assert_eq!(d.waited, Some(Duration::from_secs(5)));
    streaming.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_keyless_prompt_sent_again_whole_waits_for_the_backend_it_was_sent_to() {
    let svc = service(&[("a", "n1"), ("b", "n2")]);
    teach(&svc, Duration::from_secs(10)).await;
    let turn1 = chain(&SESSION_BLOCKS[..8], 1000);
    let (d, _, _) = exchange(&svc, request(None, Some(turn1.clone()), reused(8000, 0))).await;
    let holder = d.backend.to_string();
    // Another conversation branches from the first 6,000 tokens there and keeps it busy for
    // 5 s; nothing continues the first turn itself.
    let branch = chain(&[100, 101, 102, 103, 104, 105, 900, 901], 1000);
    let long = Reply::llama_stream(8_000, 6000, 5000, Duration::ZERO, Duration::from_secs(5));
    let streaming = keep_busy(&svc, request(None, Some(branch), long), &holder).await;
    // The first turn sent again (a retry): its slot frees in 5 s, sooner than reading its
    // 8,000 tokens elsewhere (40 s).
    let (d, _, _) = exchange(&svc, request(None, Some(turn1), reused(8000, 8000))).await;
    assert_eq!(d.backend.as_str(), holder);
    assert_eq!(d.outcome, Outcome::PrefixHit);
    assert_eq!(d.waited, Some(Duration::from_secs(5)));
    streaming.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_keyless_opening_that_another_prompt_continues_does_not_wait_for_its_holder() {
    // A prompt sent whole again after another prompt continued it there is an opening that
    // several conversations share (agents that open with the same prompt all send it): it is
    // not drawn to where it is held, nor does it wait there.
    let svc = service(&[("a", "n1"), ("b", "n2")]);
    teach(&svc, Duration::from_secs(10)).await;
    let opening = chain(&SESSION_BLOCKS[..8], 1000);
    let (d, _, _) = exchange(&svc, request(None, Some(opening.clone()), reused(8000, 0))).await;
    let holder = d.backend.to_string();
    // The holder busy for 5 s with a continuation of it, sooner than reading 8,000 tokens
    // elsewhere (40 s).
    let long = Reply::llama_stream(10_000, 8000, 5000, Duration::ZERO, Duration::from_secs(5));
    let next = request(None, Some(chain(&SESSION_BLOCKS, 1000)), long);
    let streaming = keep_busy(&svc, next, &holder).await;
    let (d, _, _) = exchange(&svc, request(None, Some(opening), reused(8000, 0))).await;
    assert_ne!(d.backend.as_str(), holder);
    assert_eq!(d.waited, None);
    streaming.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_new_conversation_is_not_held_for_a_busy_holder_already_homing_its_share_of_the_prefixs_conversations(
) {
    // Agents that open with the same 8,000 tokens, on one-slot backends. Two conversations of
    // that opening went to its holder; the holder is busy for 5 s with the first one's next
    // turn. A third new conversation would wait there rather than read the opening elsewhere
    // (40 s), and be the third conversation homed on one slot: but the holder homes two of
    // the two that the opening drew, past its share (1.25 x 3 x 1/2, rounded up: 2, and
    // its one slot), so the policy offers the free backend first, and the request is not
    // held for the holder.
    let svc = service(&[("a", "n1"), ("b", "n2")]);
    teach(&svc, Duration::from_secs(10)).await;
    let opening = |own: u64| chain(&[100, 101, 102, 103, 104, 105, 106, 107, own], 1000);
    let (d, _, _) = exchange(&svc, request(None, Some(opening(900)), reused(9000, 0))).await;
    let holder = d.backend.to_string();
    let (d, _, _) = exchange(&svc, request(None, Some(opening(901)), reused(9000, 8000))).await;
    assert_eq!(d.backend.as_str(), holder, "the opening draws the second");
    let next = chain(&[100, 101, 102, 103, 104, 105, 106, 107, 900, 910], 1000);
    let long = Reply::llama_stream(10_000, 9000, 5000, Duration::ZERO, Duration::from_secs(5));
    let streaming = keep_busy(&svc, request(None, Some(next), long), &holder).await;
    let (d, _, _) = exchange(&svc, request(None, Some(opening(902)), reused(9000, 0))).await;
    assert_ne!(d.backend.as_str(), holder);
    assert_eq!(d.waited, None);
    streaming.await.unwrap();
}

/// Where a new opening's conversations go after four conversations of ten minutes ago, on two
/// one-slot backends, with `policy`: the backend of each of three conversations that start
/// with an opening of 8,000 tokens new to the fleet, the holder's first.
async fn an_openings_conversations_after_a_pause(policy: NodeThenBackend) -> Vec<String> {
    let svc = SessionAffinityLayer::new()
        .placement(policy)
        .layer(fleet(&[("a", "n1"), ("b", "n2")], scripted()));
    for c in 0..4 {
        let own = chain(&[500 + c, 600 + c], 1000);
        exchange(&svc, request(None, Some(own), reused(2000, 0))).await;
    }
    tokio::time::sleep(Duration::from_secs(600)).await;
    let opening = |own: u64| chain(&[100, 101, 102, 103, 104, 105, 106, 107, own], 1000);
    let mut placed = Vec::new();
    for own in 900..903 {
        // Each after the first says it reused the opening (where it was not held, the model
        // grows its budget, which changes nothing here).
        let reply = reused(9000, if own == 900 { 0 } else { 8000 });
        let (d, _, _) = exchange(&svc, request(None, Some(opening(own)), reply)).await;
        placed.push(d.backend.to_string());
    }
    assert_idle(&svc);
    placed
}

#[tokio::test(start_paused = true)]
async fn a_new_openings_holder_draws_its_share_of_the_conversations_still_going_on() {
    // Counted against the six conversations the models remember, the holder's share takes
    // the third too (1.25 x 7 / 2, rounded up: 5 on a slot); counted against those with a
    // turn in the last five minutes, the third finds it at its share (1.25 x 3 / 2, rounded
    // up: 2) and goes to the other backend, which has no conversation going on.
    let live = an_openings_conversations_after_a_pause(NodeThenBackend::new()).await;
    assert_eq!(live[1], live[0], "the opening draws the second");
    assert_ne!(live[2], live[0]);
    let all = NodeThenBackend::new().live_window(Duration::ZERO);
    let all = an_openings_conversations_after_a_pause(all).await;
    assert_eq!((&all[1], &all[2]), (&all[0], &all[0]));
}

#[tokio::test(start_paused = true)]
async fn move_at_once_while_nothing_is_learned() {
    let svc = service(&[("a", "n1"), ("b", "n2")]);
    let (home, streaming) = busy_home(&svc, Duration::from_secs(5)).await;
    let (d, _) = next_turn(&svc).await;
    assert_ne!(d.backend.as_str(), home);
    assert_eq!(d.waited, None);
    streaming.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_keyless_turn_whose_prefix_holder_is_full_spills_within_its_node_and_says_so() {
    let svc = service(&[("a1", "n1"), ("a2", "n1"), ("b1", "n2"), ("b2", "n2")]);
    let turn = |n: usize| Some(chain(&SESSION_BLOCKS[..n], 1000));
    let (d, _, _) = exchange(&svc, request(None, turn(8), reused(8000, 0))).await;
    assert_eq!(d.outcome, Outcome::Keyless);
    let (holder, node) = (d.backend.to_string(), d.node);
    // Its next turn keeps the holder busy for 5 s.
    let long = Reply::llama_stream(9000, 8000, 5000, Duration::ZERO, Duration::from_secs(5));
    let streaming = keep_busy(&svc, request(None, turn(9), long), &holder).await;
    // The turn after comes meanwhile (a client that did not wait for the answer): the
    // holder is full, and nothing learned says waiting pays.
    let (d, _, _) = exchange(&svc, request(None, turn(10), reused(10_000, 0))).await;
    assert_ne!(d.backend.as_str(), holder);
    assert_eq!((d.outcome, d.node), (Outcome::SameNodeSpill, node));
    assert_eq!(svc.stats().same_node_spills, 1);
    streaming.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn node_patience_overrides_wait_versus_move() {
    let svc = SessionAffinityLayer::new()
        .node_patience(Duration::from_secs(1))
        .layer(fleet(&[("a", "n1"), ("b", "n2")], scripted()));
    teach(&svc, Duration::from_secs(10)).await;
    let (home, streaming) = busy_home(&svc, Duration::from_secs(5)).await;
    // A fixed patience of 1 s, not the learned estimate: the turn moves after 1 s.
    let (d, _) = next_turn(&svc).await;
    assert_ne!(d.backend.as_str(), home);
    assert_eq!(d.waited, Some(Duration::from_secs(1)));
    streaming.await.unwrap();
}

// === replicas ===

#[tokio::test(start_paused = true)]
async fn replicas_model_their_share_of_each_backends_cache_and_count_all_its_slots() {
    // 4 slots and room for 2,000 tokens.
    let backend = || {
        StaticFleet::new([(
            "a",
            Backend::new("n1", scripted())
                .slots(NonZeroU32::new(4).unwrap())
                .cache_tokens(2_000),
        )])
    };
    let two = NonZeroU32::new(2).unwrap();
    let svc = SessionAffinityLayer::new()
        .replicas(two)
        .overflow(tower_affinity::Overflow::Reject)
        .layer(backend());
    svc.apply_discovery();
    assert_eq!(
        status(&svc, "a").slots,
        4,
        "every slot: the backend queues the excess"
    );
    // Two conversations of 600 tokens each: one router's model holds both (1,200 of 2,000);
    // one of two replicas sees about half of the backend's requests, and keeps half the room.
    let conversations = [chain(&[1, 2, 3], 200), chain(&[4, 5, 6], 200)];
    let alone = SessionAffinityLayer::new().layer(backend());
    for c in &conversations {
        exchange(
            &alone,
            request(None, Some(c.clone()), Reply::json(CHAT_ANSWER)),
        )
        .await;
        exchange(
            &svc,
            request(None, Some(c.clone()), Reply::json(CHAT_ANSWER)),
        )
        .await;
    }
    assert_eq!(status(&alone, "a").cached_tokens, 1_200);
    assert_eq!(status(&alone, "a").evicted_blocks, 0);
    let a = status(&svc, "a");
    assert!(a.cached_tokens <= 1_000, "{a:?}");
    assert!(a.evicted_blocks > 0, "{a:?}");
    // Four requests held open take the replica's four slots; a fifth is refused.
    let slow = || {
        let mut r = Reply::json(CHAT_ANSWER);
        r.frames[0].0 = Duration::from_secs(10);
        request(None, None, r)
    };
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(svc.clone().oneshot(slow()).await.unwrap());
    }
    let fifth = svc.clone().oneshot(slow()).await;
    assert!(matches!(
        fifth,
        Err(tower_affinity::Error::Saturated { .. })
    ));
    drop(held);
}

// === holding out from a later look ===

const WAIT_LIMIT: Duration = Duration::from_secs(1800);

/// The decision of a turn spawned to wait, and how long it took; a turn that does not end
/// within [`WAIT_LIMIT`] fails the test rather than hang it.
async fn ended(turn: tokio::task::JoinHandle<(Decision, Duration)>) -> (Decision, Duration) {
    tokio::time::timeout(WAIT_LIMIT, turn)
        .await
        .expect("the turn ends")
        .unwrap()
}

/// A service of two one-slot backends a (n1), b (n2), waiting up to `max_wait`.
fn wait_service(
    max_wait: Duration,
) -> Svc<
    impl tower::Service<Req, Response = http::Response<Scripted>, Error = Infallible, Future: Send>
        + Clone
        + Send,
> {
    SessionAffinityLayer::new()
        .overflow(Overflow::wait(max_wait, 64))
        .layer(fleet(&[("a", "n1"), ("b", "n2")], scripted()))
}

/// The session's home busy for `home_busy`, the other backend busy for `other_busy` with a
/// keyless prompt of its own: the whole fleet is full. Returns (home, other, tasks).
async fn fleet_full<S, P>(
    svc: &Svc<S, P>,
    home_busy: Duration,
    other_busy: Duration,
) -> (
    String,
    &'static str,
    tokio::task::JoinHandle<()>,
    tokio::task::JoinHandle<()>,
)
where
    S: Send + Sync + 'static,
    Svc<S, P>:
        tower::Service<Req, Response = Res, Error = tower_affinity::Error> + Send + Sync + 'static,
    <Svc<S, P> as tower::Service<Req>>::Future: Send,
{
    teach(svc, Duration::from_secs(10)).await;
    let (home, streaming) = busy_home(svc, home_busy).await;
    let other = if home == "a" { "b" } else { "a" };
    let own = Reply::llama_stream(1000, 0, 5000, Duration::ZERO, other_busy);
    let busy = keep_busy(svc, request(None, Some(chain(&[77], 1000)), own), other).await;
    (home, other, streaming, busy)
}

/// The next turn of "s" in a task of its own.
fn spawn_turn<S, P>(svc: &Svc<S, P>) -> tokio::task::JoinHandle<(Decision, Duration)>
where
    S: Send + Sync + 'static,
    Svc<S, P>:
        tower::Service<Req, Response = Res, Error = tower_affinity::Error> + Send + Sync + 'static,
    <Svc<S, P> as tower::Service<Req>>::Future: Send,
{
    let svc = svc.clone();
    tokio::spawn(async move { next_turn(&svc).await })
}

/// Checks: the home, holding out (from the other slot's freeing at 5 s, a later look) for
/// minutes, is marked down at 10 s. The turn must move to the free other backend at once
/// (waited 10 s), not wait out its hold, and never hang.
#[tokio::test(start_paused = true)]
async fn home_marked_down_during_a_hold_from_a_later_look_moves_at_once() {
    let svc = wait_service(Duration::from_secs(900));
    let (home, other, streaming, busy) =
        fleet_full(&svc, Duration::from_secs(1000), Duration::from_secs(5)).await;
    let turn = spawn_turn(&svc);
    tokio::time::sleep(Duration::from_secs(10)).await;
    // It holds out: waiting, with the other backend free.
    assert_eq!(svc.stats().waiting, 1, "held out at 10 s");
    assert_eq!(status(&svc, other).in_flight, 0);
    assert!(svc.mark_down(&home, Some(Duration::from_secs(600))));
    let (d, _) = ended(turn).await;
    assert_eq!(
        (d.backend.as_str(), d.waited),
        (other, Some(Duration::from_secs(10)))
    );
    busy.await.unwrap();
    stop(streaming).await;
    assert_idle(&svc);
}

/// Checks: a waiter cancelled while holding out from a later look leaves nothing behind:
/// the slot it declined at 5 s reached the keyless waiter queued after it at once, its queue
/// place is released, and no slot stays promised (a new request is placed at once).
#[tokio::test(start_paused = true)]
async fn a_waiter_cancelled_while_holding_out_from_a_later_look_leaves_nothing_promised() {
    let svc = wait_service(Duration::from_secs(900));
    let (_home, other, streaming, busy) =
        fleet_full(&svc, Duration::from_secs(1000), Duration::from_secs(5)).await;
    let turn = spawn_turn(&svc);
    for _ in 0..8 {
        tokio::task::yield_now().await;
    }
    // A keyless request with a prompt cached nowhere, queued after the turn.
    let behind = {
        let svc = svc.clone();
        let quick = Reply::llama_stream(1000, 0, 5000, Duration::ZERO, Duration::from_secs(1));
        let req = request(None, Some(chain(&[555], 1000)), quick);
        tokio::spawn(async move { exchange(&svc, req).await.0 })
    };
    for _ in 0..8 {
        tokio::task::yield_now().await;
    }
    assert_eq!(svc.stats().waiting, 2);
    let d = tokio::time::timeout(WAIT_LIMIT, behind)
        .await
        .expect("the request behind ends")
        .unwrap();
    assert_eq!(
        (d.backend.as_str(), d.waited),
        (other, Some(Duration::from_secs(5))),
        "the declined slot reached the waiter behind"
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(svc.stats().waiting, 1, "the turn still holds out");
    turn.abort();
    let _ = turn.await;
    assert_eq!(svc.stats().waiting, 0, "its place is released");
    // Nothing promised: a new keyless request takes the free slot at once.
    let req = request(None, Some(chain(&[556], 1000)), Reply::json(b"{}"));
    let (d, _, _) = tokio::time::timeout(WAIT_LIMIT, exchange(&svc, req))
        .await
        .expect("ends");
    assert_eq!((d.backend.as_str(), d.waited), (other, None));
    busy.await.unwrap();
    stop(streaming).await;
    assert_idle(&svc);
}

/// Checks: with a short max_wait (20 s), a turn holding out from a later look (5 s) is
/// not refused at the end of its wait while the other backend is free: it takes it at 20 s.
#[tokio::test(start_paused = true)]
async fn a_hold_from_a_later_look_never_makes_a_short_wait_refuse_a_free_slot() {
    let max_wait = Duration::from_secs(20);
    let svc = wait_service(max_wait);
    let (_home, other, streaming, busy) =
        fleet_full(&svc, Duration::from_secs(1000), Duration::from_secs(5)).await;
    let turn = spawn_turn(&svc);
    let (d, took) = tokio::time::timeout(WAIT_LIMIT, turn)
        .await
        .expect("the turn ends")
        .expect("answered, not refused");
    assert_eq!((d.backend.as_str(), d.waited), (other, Some(max_wait)));
    assert_eq!(took, max_wait);
    busy.await.unwrap();
    stop(streaming).await;
    assert_idle(&svc);
}

/// Checks: with node patience, which turns wait versus move off, a turn that found the fleet
/// full waits for its home node for its patience only, then takes the other backend's slot
/// as it frees (30 s): no later look holds it for the backend holding its prefix.
#[tokio::test(start_paused = true)]
async fn with_node_patience_a_request_that_found_the_fleet_full_is_not_held_by_a_later_look() {
    let svc: Svc<_> = SessionAffinityLayer::new()
        .overflow(Overflow::wait(Duration::from_secs(900), 16))
        .node_patience(Duration::from_secs(20))
        .layer(fleet(&[("a", "n1"), ("b", "n2")], scripted()));
    let (_home, other, streaming, busy) =
        fleet_full(&svc, Duration::from_secs(1000), Duration::from_secs(30)).await;
    let turn = spawn_turn(&svc);
    let (d, _) = ended(turn).await;
    assert_eq!(
        (d.backend.as_str(), d.waited),
        (other, Some(Duration::from_secs(30)))
    );
    busy.await.unwrap();
    stop(streaming).await;
    assert_idle(&svc);
}

/// Checks: a keyless request (prompt chain only, cached on its backend) that finds the fleet
/// full ends, wherever it goes, and leaves nothing queued or in flight. Its prefix's backend
/// frees at 30 s, the other at 5 s: as the keyed turn does, it should hold out for the
/// holder and land there at 30 s.
#[tokio::test(start_paused = true)]
async fn a_keyless_request_that_found_the_fleet_full_ends_and_is_weighed() {
    let svc = wait_service(Duration::from_secs(900));
    teach(&svc, Duration::from_secs(10)).await;
    let blocks: Vec<u64> = (0..10).map(|i| 4000 + i).collect();
    let (d, _, _) = exchange(
        &svc,
        request(None, Some(chain(&blocks[..8], 1000)), reused(8000, 0)),
    )
    .await;
    let holder = d.backend.to_string();
    let other = if holder == "a" { "b" } else { "a" };
    let long = Reply::llama_stream(9000, 8000, 5000, Duration::ZERO, Duration::from_secs(30));
    let streaming = keep_busy(
        &svc,
        request(None, Some(chain(&blocks[..9], 1000)), long),
        &holder,
    )
    .await;
    let own = Reply::llama_stream(1000, 0, 5000, Duration::ZERO, Duration::from_secs(5));
    let busy = keep_busy(&svc, request(None, Some(chain(&[77], 1000)), own), other).await;
    let next = request(None, Some(chain(&blocks, 1000)), reused(10_000, 9000));
    let (d, _, _) = tokio::time::timeout(WAIT_LIMIT, exchange(&svc, next))
        .await
        .expect("the keyless turn ends");
    busy.await.unwrap();
    streaming.await.unwrap();
    assert_idle(&svc);
    assert_eq!(
        (d.backend.as_str(), d.waited),
        (holder.as_str(), Some(Duration::from_secs(30))),
        "weighed as the keyed turn is (other: {other})"
    );
}

/// Checks: a request pinned to the backend holding its stored response goes only there,
/// though the fleet is full and a slot frees elsewhere first (5 s): it lands on its pinned
/// backend when that frees (30 s).
#[tokio::test(start_paused = true)]
async fn a_pinned_request_that_found_the_fleet_full_goes_only_to_its_pinned_backend() {
    let svc = wait_service(Duration::from_secs(900));
    let (home, _other, streaming, busy) =
        fleet_full(&svc, Duration::from_secs(30), Duration::from_secs(5)).await;
    let mut req = request(
        Some("s"),
        Some(chain(&SESSION_BLOCKS, 1000)),
        reused(10_000, 9000),
    );
    req.extensions_mut()
        .get_mut::<PromptFacts>()
        .unwrap()
        .stored_on = Some(home.as_str().into());
    let (d, _, _) = tokio::time::timeout(WAIT_LIMIT, exchange(&svc, req))
        .await
        .expect("the pinned turn ends");
    assert_eq!(
        (d.backend.as_str(), d.waited),
        (home.as_str(), Some(Duration::from_secs(30)))
    );
    busy.await.unwrap();
    streaming.await.unwrap();
    assert_idle(&svc);
}

/// Checks: a request pinned to the backend that does NOT hold its prefix is never held out
/// for the prefix's holder: the pinned backend frees at 5 s and it goes there at once.
#[tokio::test(start_paused = true)]
async fn a_pinned_request_is_not_held_out_for_the_holder_of_its_prefix() {
    let svc = wait_service(Duration::from_secs(900));
    let (home, other, streaming, busy) =
        fleet_full(&svc, Duration::from_secs(1000), Duration::from_secs(5)).await;
    let mut req = request(
        Some("s"),
        Some(chain(&SESSION_BLOCKS, 1000)),
        reused(10_000, 0),
    );
    req.extensions_mut()
        .get_mut::<PromptFacts>()
        .unwrap()
        .stored_on = Some(other.into());
    let (d, _, _) = tokio::time::timeout(WAIT_LIMIT, exchange(&svc, req))
        .await
        .expect("the pinned turn ends");
    assert_ne!(d.backend.as_str(), home);
    assert_eq!(
        (d.backend.as_str(), d.waited),
        (other, Some(Duration::from_secs(5)))
    );
    busy.await.unwrap();
    streaming.abort();
}

/// Sessions homed on a and on b, `n` of each, with their blocks.
async fn homed_on<S, P>(svc: &Svc<S, P>, n: usize) -> (Vec<(String, u64)>, Vec<(String, u64)>)
where
    Svc<S, P>: tower::Service<Req, Response = Res, Error = tower_affinity::Error>,
    <Svc<S, P> as tower::Service<Req>>::Future: Send,
{
    let (mut on_a, mut on_b) = (Vec::new(), Vec::new());
    for k in 0..200u64 {
        let key = format!("h{k}");
        let first = request(
            Some(&key),
            Some(chain(&own_blocks(k)[..8], 1000)),
            reused(8000, 0),
        );
        let d = exchange(svc, first).await.0;
        let list = if d.backend.as_str() == "a" {
            &mut on_a
        } else {
            &mut on_b
        };
        if list.len() < n {
            list.push((key, k));
        }
        if on_a.len() == n && on_b.len() == n {
            break;
        }
    }
    assert_eq!((on_a.len(), on_b.len()), (n, n));
    (on_a, on_b)
}

fn own_blocks(k: u64) -> Vec<u64> {
    (0..10).map(|i| 100_000 * (k + 1) + i).collect()
}

/// Several waiters with the fleet full, their caches on a and on b (and keyless ones cached
/// nowhere); a frees after `a_busy`, b after `b_busy`. Checks: every request ends answered,
/// never are both backends idle for two samples running while a request waits (a lost wake),
/// and stats show nothing in flight or waiting at the end.
async fn mixed_waiters(a_busy: u64, b_busy: u64, each: u64) {
    let svc = wait_service(Duration::from_secs(900));
    teach(&svc, Duration::from_secs(10)).await;
    let (on_a, on_b) = homed_on(&svc, 3).await;
    let hold = |(key, k): &(String, u64), backend: &str, secs: u64| {
        let long = Reply::llama_stream(9000, 8000, 5000, Duration::ZERO, Duration::from_secs(secs));
        let req = request(Some(key), Some(chain(&own_blocks(*k)[..9], 1000)), long);
        (req, backend.to_string())
    };
    let (ra, ba) = hold(&on_a[0], "a", a_busy);
    let fill_a = keep_busy(&svc, ra, &ba).await;
    let (rb, bb) = hold(&on_b[0], "b", b_busy);
    let fill_b = keep_busy(&svc, rb, &bb).await;
    let mut turns = Vec::new();
    let mut spawn = |req: Req| {
        let svc = svc.clone();
        turns.push(tokio::spawn(async move {
            tokio::time::timeout(WAIT_LIMIT, exchange(&svc, req))
                .await
                .map(|r| r.0)
        }));
    };
    let answer = || {
        Reply::llama_stream(
            10_000,
            9000,
            5000,
            Duration::ZERO,
            Duration::from_secs(each),
        )
    };
    for i in 1..3 {
        for (key, k) in [&on_a[i], &on_b[i]] {
            spawn(request(
                Some(key),
                Some(chain(&own_blocks(*k), 1000)),
                answer(),
            ));
        }
        spawn(request(
            None,
            Some(chain(&[900 + i as u64], 1000)),
            answer(),
        ));
    }
    let n = turns.len();
    // The sampler: a request waiting with both backends idle, twice running, is a lost wake.
    let mut idle_runs = 0;
    let mut lost = Vec::new();
    let start = Instant::now();
    while !turns.iter().all(|t| t.is_finished()) && start.elapsed() < WAIT_LIMIT {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let stats = svc.stats();
        let idle = svc.backends().iter().all(|b| b.in_flight == 0);
        if stats.waiting > 0 && idle {
            idle_runs += 1;
            if idle_runs >= 2 {
                lost.push((start.elapsed(), stats.waiting));
            }
        } else {
            idle_runs = 0;
        }
    }
    let mut decisions = Vec::new();
    for t in turns {
        let d = t.await.unwrap().expect("every request ends");
        decisions.push(d);
    }
    assert_eq!(decisions.len(), n);
    assert!(lost.is_empty(), "lost wakes (at, waiting): {lost:?}");
    fill_a.abort();
    fill_b.abort();
    let _ = (fill_a.await, fill_b.await);
    assert_idle(&svc);
}

#[tokio::test(start_paused = true)]
async fn mixed_waiters_a_frees_first() {
    mixed_waiters(20, 40, 10).await;
}

#[tokio::test(start_paused = true)]
async fn mixed_waiters_b_frees_first() {
    mixed_waiters(40, 20, 10).await;
}

#[tokio::test(start_paused = true)]
async fn mixed_waiters_both_free_at_once() {
    mixed_waiters(20, 20, 10).await;
}

#[tokio::test(start_paused = true)]
async fn mixed_waiters_long_answers() {
    mixed_waiters(5, 300, 200).await;
}

/// What `context` reads (a backend's context in flight) while `req`'s answer is held, before
/// the answer is dropped.
async fn context_while_held<T>(svc: &T, req: Req, context: impl Fn() -> u64) -> u64
where
    T: tower::Service<Req, Response = Res, Error = tower_affinity::Error> + Clone,
{
    let held = svc.clone().oneshot(req).await.expect("an answer");
    let now = context();
    drop(held);
    now
}

/// Sends `req`, reads `frames` frames of its answer and drops the body there: a client that
/// stops reading.
async fn read_then_drop<T>(svc: &T, req: Req, frames: usize)
where
    T: tower::Service<Req, Response = Res, Error = tower_affinity::Error> + Clone,
{
    let res = svc.clone().oneshot(req).await.expect("an answer");
    let mut body = res.into_body();
    for _ in 0..frames {
        body.frame().await.expect("a frame").expect("data");
    }
}

/// Sends `req` to any service of this crate's response type and reads the answer to its end.
async fn decision_of<T>(svc: &T, req: Req) -> Decision
where
    T: tower::Service<Req, Response = Res, Error = tower_affinity::Error> + Clone,
{
    let res = svc.clone().oneshot(req).await.expect("an answer");
    let d = res
        .extensions()
        .get::<Decision>()
        .cloned()
        .expect("a decision");
    let _ = res.into_body().collect().await;
    d
}

/// Checks: the home, held out for from a later look (the other slot's freeing at 5 s), is
/// removed by discovery at 10 s. The turn must move to the free other backend at once, not
/// wait out its hold for a backend that is gone, and never hang.
#[tokio::test(start_paused = true)]
async fn home_removed_by_discovery_during_a_hold_from_a_later_look_moves_at_once() {
    let (handle, stream) = tower_affinity::discover::channel();
    let backend = |node| {
        Backend::new(node, scripted())
            .slots(NonZeroU32::MIN)
            .cache_tokens(1 << 20)
    };
    handle.insert("a", backend("n1"));
    handle.insert("b", backend("n2"));
    let svc = SessionAffinityLayer::new()
        .overflow(Overflow::wait(Duration::from_secs(900), 16))
        .layer(stream);
    svc.apply_discovery();
    // Teach both: 200 tokens/s, requests of 10 s.
    let lesson = || Reply::llama_stream(10_000, 0, 50_000, Duration::from_secs(10), Duration::ZERO);
    let (x, y) = tokio::join!(
        decision_of(&svc, request(None, Some(chain(&[7, 8], 5000)), lesson())),
        decision_of(&svc, request(None, Some(chain(&[9, 10], 5000)), lesson())),
    );
    assert_ne!(x.backend, y.backend);
    let first = request(
        Some("s"),
        Some(chain(&SESSION_BLOCKS[..8], 1000)),
        reused(8000, 0),
    );
    let home = decision_of(&svc, first).await.backend.to_string();
    let other = if home == "a" { "b" } else { "a" };
    let busy_for =
        |secs| Reply::llama_stream(9000, 8000, 5000, Duration::ZERO, Duration::from_secs(secs));
    let res = svc
        .clone()
        .oneshot(request(
            Some("s"),
            Some(chain(&SESSION_BLOCKS[..9], 1000)),
            busy_for(1000),
        ))
        .await
        .unwrap();
    assert_eq!(
        res.extensions().get::<Decision>().unwrap().backend.as_str(),
        home
    );
    let streaming = tokio::spawn(async move {
        let _ = res.into_body().collect().await;
    });
    let own = Reply::llama_stream(1000, 0, 5000, Duration::ZERO, Duration::from_secs(5));
    let res = svc
        .clone()
        .oneshot(request(None, Some(chain(&[77], 1000)), own))
        .await
        .unwrap();
    assert_eq!(
        res.extensions().get::<Decision>().unwrap().backend.as_str(),
        other
    );
    let busy = tokio::spawn(async move {
        let _ = res.into_body().collect().await;
    });
    let turn = {
        let svc = svc.clone();
        let next = request(
            Some("s"),
            Some(chain(&SESSION_BLOCKS, 1000)),
            reused(10_000, 9000),
        );
        tokio::spawn(async move { decision_of(&svc, next).await })
    };
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(svc.stats().waiting, 1, "held out at 10 s");
    assert!(handle.remove(home.clone()));
    let d = tokio::time::timeout(WAIT_LIMIT, turn)
        .await
        .expect("the turn ends")
        .unwrap();
    assert_eq!(
        (d.backend.as_str(), d.waited),
        (other, Some(Duration::from_secs(10)))
    );
    busy.await.unwrap();
    stop(streaming).await;
    let stats = svc.stats();
    assert_eq!((stats.in_flight, stats.waiting), (0, 0));
}

/// Keyless requests with prompts cached nowhere (`ids`), each answered after `secs`, queued
/// one after another in tasks of their own.
async fn queue_keyless<S, P>(
    svc: &Svc<S, P>,
    ids: &[u64],
    secs: u64,
) -> Vec<tokio::task::JoinHandle<Decision>>
where
    S: Send + Sync + 'static,
    Svc<S, P>:
        tower::Service<Req, Response = Res, Error = tower_affinity::Error> + Send + Sync + 'static,
    <Svc<S, P> as tower::Service<Req>>::Future: Send,
{
    let mut tasks = Vec::new();
    for &id in ids {
        let svc = svc.clone();
        let answer = Reply::llama_stream(1000, 0, 5000, Duration::ZERO, Duration::from_secs(secs));
        let req = request(None, Some(chain(&[id], 1000)), answer);
        tasks.push(tokio::spawn(async move { exchange(&svc, req).await.0 }));
        for _ in 0..8 {
            tokio::task::yield_now().await;
        }
    }
    tasks
}

/// Offers a, then c, then b (by id), leaving c out while it is hidden.
struct AThenCThenB {
    c_hidden: AtomicBool,
}

impl Placement for AThenCThenB {
    fn place(&self, f: &FleetView<'_>, _: &PlacementRequest<'_>, c: &mut Candidates<'_>) {
        let hidden = self.c_hidden.load(Ordering::Relaxed);
        for id in ["a", "c", "b"] {
            if id == "c" && hidden {
                continue;
            }
            let backend = f.backends().find(|b| b.id().as_str() == id).unwrap();
            if c.offer(backend).is_break() {
                return;
            }
        }
    }
}

/// A waiter woken for b's slot takes c's instead, which its policy offers first, and gives it
/// back to hold out for its own backend: both slots are free, so both go on to the waiters
/// behind it, one each, at once.
#[tokio::test(start_paused = true)]
async fn a_later_hold_that_gave_back_another_backends_slot_passes_on_the_one_it_was_woken_for() {
    let policy = Arc::new(AThenCThenB {
        c_hidden: AtomicBool::new(true),
    });
    let svc: Svc<_, _> = SessionAffinityLayer::new()
        .overflow(Overflow::wait(Duration::from_secs(900), 16))
        .placement(policy.clone())
        .layer(fleet(&[("a", "n1"), ("b", "n2"), ("c", "n3")], scripted()));
    // a and b learn 10 s requests read at 200 tokens a second; c reads as they do.
    let lesson = || {
        let (first, rest) = (Duration::from_secs(10), Duration::ZERO);
        Reply::llama_stream(10_000, 0, 50_000, first, rest)
    };
    let (x, y) = tokio::join!(
        exchange(&svc, request(None, Some(chain(&[7, 8], 5000)), lesson())),
        exchange(&svc, request(None, Some(chain(&[9, 10], 5000)), lesson())),
    );
    assert_eq!((x.0.backend.as_str(), y.0.backend.as_str()), ("a", "b"));
    let (home, streaming) = busy_home(&svc, Duration::from_secs(30)).await;
    assert_eq!(home, "a");
    let own = Reply::llama_stream(1000, 0, 5000, Duration::ZERO, Duration::from_secs(5));
    let busy = keep_busy(&svc, request(None, Some(chain(&[77], 1000)), own), "b").await;
    // The turn, then two keyless requests, all waiting for any slot with c hidden.
    let turn = spawn_turn(&svc);
    for _ in 0..8 {
        tokio::task::yield_now().await;
    }
    let ks = queue_keyless(&svc, &[551, 552], 50).await;
    assert_eq!(svc.stats().waiting, 3);
    // c comes into view without a slot freeing: nobody looks until b's frees at 5 s.
    policy.c_hidden.store(false, Ordering::Relaxed);
    let mut got = Vec::new();
    for k in ks {
        let d = tokio::time::timeout(WAIT_LIMIT, k)
            .await
            .expect("ends")
            .unwrap();
        got.push((d.backend.to_string(), d.waited));
    }
    got.sort();
    let at_5 = Some(Duration::from_secs(5));
    assert_eq!(
        got,
        [("b".to_string(), at_5), ("c".to_string(), at_5)],
        "both served when b freed"
    );
    let (d, _) = tokio::time::timeout(WAIT_LIMIT, turn)
        .await
        .expect("ends")
        .unwrap();
    assert_eq!(
        (d.backend.as_str(), d.outcome, d.waited),
        ("a", Outcome::HomeHit, Some(Duration::from_secs(30)))
    );
    busy.await.unwrap();
    streaming.await.unwrap();
    assert_idle(&svc);
}

/// Checks: the turn of "s" (queued first, the fleet full) holds out from a later look when
/// the other backend's slot frees at 5 s and declines it. Keyless waiters K1, K2, K3 queued
/// after it in that order wait for any slot: the declined slot must go to the oldest, K1, at
/// 5 s, as a freed slot goes to the oldest waiter it suits.
#[tokio::test(start_paused = true)]
async fn the_slot_a_later_hold_declines_goes_to_the_oldest_waiter_behind() {
    let svc = wait_service(Duration::from_secs(900));
    let (_home, other, streaming, busy) =
        fleet_full(&svc, Duration::from_secs(1000), Duration::from_secs(5)).await;
    let turn = spawn_turn(&svc);
    for _ in 0..8 {
        tokio::task::yield_now().await;
    }
    let ks = queue_keyless(&svc, &[551, 552, 553], 100).await;
    assert_eq!(svc.stats().waiting, 4);
    let mut got = Vec::new();
    for k in ks {
        let d = tokio::time::timeout(WAIT_LIMIT, k)
            .await
            .expect("ends")
            .unwrap();
        got.push((d.backend.to_string(), d.waited));
    }
    assert_eq!(
        (got[0].0.as_str(), got[0].1),
        (other, Some(Duration::from_secs(5))),
        "K1, the oldest waiter behind, takes the declined slot: {got:?}"
    );
    let _ = tokio::time::timeout(WAIT_LIMIT, turn).await;
    busy.await.unwrap();
    stop(streaming).await;
    assert_idle(&svc);
}

/// The fleet full: a busy for `a_busy`, b for `b_busy` (turns of sessions homed there).
/// Then waiters queue in the order of `pattern`: 'a' a turn of a session homed on a, 'b' on
/// b, 'k' a keyless request cached nowhere (which never holds out), each answered after
/// `each`. Checks: every request ends answered; a keyless request never waits while a
/// backend is idle for two samples running (a lost wake: a freed slot left with a waiter
/// that could use it asleep); nothing in flight or waiting at the end. Returns the decisions
/// in queue order.
async fn queue_pattern(a_busy: u64, b_busy: u64, each: u64, pattern: &str) -> Vec<Decision> {
    let svc = wait_service(Duration::from_secs(900));
    teach(&svc, Duration::from_secs(10)).await;
    let need = pattern
        .chars()
        .filter(|&c| c == 'a')
        .count()
        .max(pattern.chars().filter(|&c| c == 'b').count())
        + 1;
    let (on_a, on_b) = homed_on(&svc, need).await;
    let hold = |(key, k): &(String, u64), secs: u64| {
        let long = Reply::llama_stream(9000, 8000, 5000, Duration::ZERO, Duration::from_secs(secs));
        request(Some(key), Some(chain(&own_blocks(*k)[..9], 1000)), long)
    };
    let fill_a = keep_busy(&svc, hold(&on_a[0], a_busy), "a").await;
    let fill_b = keep_busy(&svc, hold(&on_b[0], b_busy), "b").await;
    let (mut ia, mut ib, mut ik) = (1, 1, 0u64);
    let mut turns = Vec::new();
    for c in pattern.chars() {
        let answer = Reply::llama_stream(
            10_000,
            9000,
            5000,
            Duration::ZERO,
            Duration::from_secs(each),
        );
        let req = match c {
            'a' => {
                ia += 1;
                let (key, k) = &on_a[ia - 1];
                request(Some(key), Some(chain(&own_blocks(*k), 1000)), answer)
            }
            'b' => {
                ib += 1;
                let (key, k) = &on_b[ib - 1];
                request(Some(key), Some(chain(&own_blocks(*k), 1000)), answer)
            }
            _ => {
                ik += 1;
                let fresh =
                    Reply::llama_stream(1000, 0, 5000, Duration::ZERO, Duration::from_secs(each));
                request(None, Some(chain(&[7000 + ik], 1000)), fresh)
            }
        };
        let svc2 = svc.clone();
        // Set once the request is placed (its answer's headers came): it waits no more.
        let placed = Arc::new(AtomicBool::new(false));
        let set = placed.clone();
        turns.push((
            c,
            placed,
            tokio::spawn(async move {
                tokio::time::timeout(WAIT_LIMIT, async move {
                    let res = svc2.oneshot(req).await.expect("an answer");
                    set.store(true, Ordering::Relaxed);
                    let d = res
                        .extensions()
                        .get::<Decision>()
                        .cloned()
                        .expect("a decision");
                    let _ = res.into_body().collect().await;
                    d
                })
                .await
            }),
        ));
        for _ in 0..8 {
            tokio::task::yield_now().await;
        }
    }
    assert_eq!(svc.stats().waiting as usize, pattern.len(), "all queued");
    let mut runs = 0;
    let mut lost = Vec::new();
    let start = Instant::now();
    while !turns.iter().all(|(_, _, t)| t.is_finished()) && start.elapsed() < WAIT_LIMIT {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let keyless_waiting = turns
            .iter()
            .any(|(c, placed, _)| *c == 'k' && !placed.load(Ordering::Relaxed));
        let idle = svc.backends().iter().any(|b| b.in_flight == 0);
        if keyless_waiting && idle {
            runs += 1;
            if runs >= 2 {
                lost.push(start.elapsed());
            }
        } else {
            runs = 0;
        }
    }
    let mut decisions = Vec::new();
    for (_, _, t) in turns {
        let d = t.await.unwrap().expect("every request ends");
        decisions.push(d);
    }
    assert!(
        lost.is_empty(),
        "a keyless waiter asleep beside an idle backend at {lost:?}"
    );
    fill_a.abort();
    fill_b.abort();
    let _ = (fill_a.await, fill_b.await);
    assert_idle(&svc);
    decisions
}

#[tokio::test(start_paused = true)]
async fn pattern_b_waiters_hold_while_a_frees() {
    queue_pattern(5, 300, 10, "bbk").await;
}

#[tokio::test(start_paused = true)]
async fn pattern_b_waiters_hold_while_a_frees_many() {
    queue_pattern(5, 300, 10, "bbbkbk").await;
}

#[tokio::test(start_paused = true)]
async fn pattern_interleaved_holds_on_both() {
    queue_pattern(30, 60, 10, "abkbak").await;
}

#[tokio::test(start_paused = true)]
async fn pattern_keyless_first_then_holders() {
    queue_pattern(5, 300, 50, "kbbbk").await;
}

/// Checks: keyless waiters (cached nowhere, never held) are served in their queue order
/// though sessions queued before them hold out from later looks and decline the slots
/// freed on a: the first keyless request is placed no later than the second.
#[tokio::test(start_paused = true)]
async fn keyless_waiters_keep_their_order_behind_later_holds() {
    for pattern in ["bbbkbk", "abkbak", "bkk"] {
        let d = queue_pattern(5, 300, 10, pattern).await;
        let ks: Vec<_> = pattern
            .char_indices()
            .filter(|&(_, c)| c == 'k')
            .map(|(i, _)| d[i].waited.expect("it waited"))
            .collect();
        assert!(
            ks.windows(2).all(|w| w[0] <= w[1]),
            "{pattern}: keyless waiters served out of order: {ks:?}"
        );
    }
}

/// `NodeThenBackend`, counting its calls: one per look for a slot.
#[derive(Default)]
struct CountingLooks {
    looks: AtomicU64,
}

impl Placement for CountingLooks {
    fn place(&self, f: &FleetView<'_>, r: &PlacementRequest<'_>, c: &mut Candidates<'_>) {
        self.looks.fetch_add(1, Ordering::Relaxed);
        NodeThenBackend::new().place(f, r, c);
    }
}

/// Marks a request that its policy offers only the backend named.
#[derive(Clone)]
struct OnlyOn(&'static str);

/// `NodeThenBackend`, except for requests marked [`OnlyOn`], which are offered their one
/// backend and counted.
#[derive(Default)]
struct OnlyOnSome {
    looks: AtomicU64,
}

impl Placement for OnlyOnSome {
    fn place(&self, f: &FleetView<'_>, r: &PlacementRequest<'_>, c: &mut Candidates<'_>) {
        match r.extensions.get::<OnlyOn>() {
            Some(OnlyOn(id)) => {
                self.looks.fetch_add(1, Ordering::Relaxed);
                let backend = f.backends().find(|b| b.id().as_str() == *id).unwrap();
                let _ = c.offer(backend);
            }
            None => NodeThenBackend::new().place(f, r, c),
        }
    }
}

/// A waiter that declined a slot is not woken for it again when a later look takes that slot
/// and gives it back to hold out: the slot goes back unannounced and its wake is passed on,
/// with who declined it. Here the waiter queued first may take only the busy home; woken for
/// the other backend's slot at 5 s, it declines it once, and the turn behind it holds out.
#[tokio::test(start_paused = true)]
async fn a_slot_given_back_by_a_later_hold_does_not_wake_those_that_declined_it_again() {
    let policy = Arc::new(OnlyOnSome::default());
    let svc: Svc<_, _> = SessionAffinityLayer::new()
        .overflow(Overflow::wait(Duration::from_secs(900), 16))
        .placement(policy.clone())
        .layer(fleet(&[("a", "n1"), ("b", "n2")], scripted()));
    let (home, other, streaming, busy) =
        fleet_full(&svc, Duration::from_secs(1000), Duration::from_secs(5)).await;
    let home: &'static str = if home == "a" { "a" } else { "b" };
    let mut only_home = request(None, Some(chain(&[991], 1000)), reused(1000, 0));
    only_home.extensions_mut().insert(OnlyOn(home));
    let waiter = {
        let svc = svc.clone();
        tokio::spawn(async move { decision_of(&svc, only_home).await })
    };
    for _ in 0..8 {
        tokio::task::yield_now().await;
    }
    let turn = spawn_turn(&svc);
    for _ in 0..8 {
        tokio::task::yield_now().await;
    }
    assert_eq!(svc.stats().waiting, 2);
    let before = policy.looks.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(
        policy.looks.load(Ordering::Relaxed) - before,
        1,
        "the waiter that may take only its home looked once at 5 s"
    );
    // Both still wait, the turn holding out, with the other backend's slot free.
    assert_eq!(svc.stats().waiting, 2);
    assert_eq!(status(&svc, other).in_flight, 0);
    waiter.abort();
    turn.abort();
    let _ = (waiter.await, turn.await);
    busy.await.unwrap();
    stop(streaming).await;
}

/// Checks: one slot freed (the other backend's, at 5 s) and declined by a turn holding out
/// from a later look costs a bounded number of looks: the turn's, then the oldest keyless
/// waiter's, which takes it. A freed slot wakes one waiter at a time, so with six keyless
/// waiters behind, no more than a few looks happen at 5 s (not one or more per waiter).
#[tokio::test(start_paused = true)]
async fn a_slot_declined_by_a_later_hold_wakes_waiters_one_at_a_time() {
    let policy = Arc::new(CountingLooks::default());
    let svc: Svc<_, _> = SessionAffinityLayer::new()
        .overflow(Overflow::wait(Duration::from_secs(900), 64))
        .placement(policy.clone())
        .layer(fleet(&[("a", "n1"), ("b", "n2")], scripted()));
    let (_home, _other, streaming, busy) =
        fleet_full(&svc, Duration::from_secs(1000), Duration::from_secs(5)).await;
    let turn = spawn_turn(&svc);
    for _ in 0..8 {
        tokio::task::yield_now().await;
    }
    let ks = queue_keyless(&svc, &[561, 562, 563, 564, 565, 566], 100).await;
    let before = policy.looks.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(5001)).await;
    let looks = policy.looks.load(Ordering::Relaxed) - before;
    assert!(looks <= 3, "{looks} looks for one slot freed at 5 s");
    for k in ks {
        k.abort();
    }
    turn.abort();
    let _ = turn.await;
    busy.abort();
    streaming.abort();
    let _ = (busy.await, streaming.await);
}

/// An Anthropic stream gives its prompt's figures in its first event, `message_start`,
/// before the answer is written: a client that stops it in the middle (a "stop generating")
/// and drops the body has not read the answer, which is counted as cut short, not learned
/// as a whole one. One read to its last event, `message_stop`, and dropped before its end
/// is polled, is learned.
#[tokio::test(start_paused = true)]
async fn an_anthropic_stream_dropped_midway_is_not_counted_and_one_read_to_its_last_event_is() {
    let svc = service(&[("a", "n1")]);
    let start: &'static [u8] = b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"usage\":{\"input_tokens\":100,\"cache_read_input_tokens\":3000,\"output_tokens\":1}}}\n\n";
    let text: &'static [u8] = b"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hel\"}}\n\n";
    let stop: &'static [u8] = b"event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":9}}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
    let stopped = Reply::new("text/event-stream", &[start, text]);
    // Stopped at once, after the event that gives the prompt's figures.
    let at_start = Reply::new("text/event-stream", &[start, text]);
    let whole = Reply::new("text/event-stream", &[start, text, stop]);
    for (mut reply, frames, counted) in [(at_start, 1, 0), (stopped, 2, 0), (whole, 3, 1)] {
        // The rest of the stream, or its end, a long while later.
        reply
            .frames
            .push((Duration::from_secs(3_600), Ok(Bytes::from_static(b""))));
        read_then_drop(&svc, request_to("/v1/messages", None, None, reply), frames).await;
        let a = status(&svc, "a");
        assert_eq!((a.in_flight, a.usage_reports), (0, counted));
    }
    let a = status(&svc, "a");
    assert_eq!((a.prompt_tokens, a.reused_tokens), (3_100, 3_000));
}

/// vLLM with `stream_options: {"include_usage": true, "continuous_usage_stats": true}`
/// puts a usage object in every chunk, from the role's chunk on; llama-server with
/// `timings_per_token` puts its timings in every chunk. Such a stream dropped before its
/// last event (the chunk whose `finish_reason` is not null, the usage chunk after it,
/// `data: [DONE]`) has not been read to its end and is not learned; dropped after it, it is.
#[tokio::test(start_paused = true)]
async fn a_stream_with_figures_in_every_chunk_is_learned_only_when_dropped_after_its_finish() {
    // vLLM's chat chunks: the role, three tokens, the finish (its `stop_reason` null: an end
    // of sequence), the usage chunk, `[DONE]`.
    let vllm: Vec<&'static [u8]> = vec![
        b"data: {\"id\":\"chatcmpl-9a1\",\"object\":\"chat.completion.chunk\",\"created\":1730000000,\"model\":\"qwen\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"logprobs\":null,\"finish_reason\":null}],\"usage\":{\"prompt_tokens\":1200,\"total_tokens\":1200,\"completion_tokens\":0}}\n\n",
        b"data: {\"id\":\"chatcmpl-9a1\",\"object\":\"chat.completion.chunk\",\"created\":1730000000,\"model\":\"qwen\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"},\"logprobs\":null,\"finish_reason\":null}],\"usage\":{\"prompt_tokens\":1200,\"total_tokens\":1201,\"completion_tokens\":1}}\n\n",
        b"data: {\"id\":\"chatcmpl-9a1\",\"object\":\"chat.completion.chunk\",\"created\":1730000000,\"model\":\"qwen\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo\"},\"logprobs\":null,\"finish_reason\":null}],\"usage\":{\"prompt_tokens\":1200,\"total_tokens\":1202,\"completion_tokens\":2}}\n\n",
        b"data: {\"id\":\"chatcmpl-9a1\",\"object\":\"chat.completion.chunk\",\"created\":1730000000,\"model\":\"qwen\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\".\"},\"logprobs\":null,\"finish_reason\":null}],\"usage\":{\"prompt_tokens\":1200,\"total_tokens\":1203,\"completion_tokens\":3}}\n\n",
        b"data: {\"id\":\"chatcmpl-9a1\",\"object\":\"chat.completion.chunk\",\"created\":1730000000,\"model\":\"qwen\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"\"},\"logprobs\":null,\"finish_reason\":\"stop\",\"stop_reason\":null}],\"usage\":{\"prompt_tokens\":1200,\"total_tokens\":1204,\"completion_tokens\":4}}\n\n",
        b"data: {\"id\":\"chatcmpl-9a1\",\"object\":\"chat.completion.chunk\",\"created\":1730000000,\"model\":\"qwen\",\"choices\":[],\"usage\":{\"prompt_tokens\":1200,\"total_tokens\":1204,\"completion_tokens\":4,\"prompt_tokens_details\":{\"cached_tokens\":1024}}}\n\n",
        b"data: [DONE]\n\n",
    ];
    // llama-server's chunks with `timings_per_token`: two tokens, the finish.
    let llama: Vec<&'static [u8]> = vec![
        b"data: {\"choices\":[{\"finish_reason\":null,\"index\":0,\"delta\":{\"content\":\"Hel\"}}],\"created\":1730000000,\"id\":\"chatcmpl-Xy\",\"model\":\"qwen\",\"system_fingerprint\":\"b5000\",\"object\":\"chat.completion.chunk\",\"timings\":{\"prompt_n\":176,\"prompt_ms\":40.2,\"prompt_per_token_ms\":0.23,\"prompt_per_second\":4378.1,\"predicted_n\":1,\"predicted_ms\":0.1,\"predicted_per_token_ms\":0.1,\"predicted_per_second\":10000.0,\"cache_n\":1024}}\n\n",
        b"data: {\"choices\":[{\"finish_reason\":null,\"index\":0,\"delta\":{\"content\":\"lo\"}}],\"created\":1730000000,\"id\":\"chatcmpl-Xy\",\"model\":\"qwen\",\"system_fingerprint\":\"b5000\",\"object\":\"chat.completion.chunk\",\"timings\":{\"prompt_n\":176,\"prompt_ms\":40.2,\"prompt_per_token_ms\":0.23,\"prompt_per_second\":4378.1,\"predicted_n\":2,\"predicted_ms\":12.3,\"predicted_per_token_ms\":6.1,\"predicted_per_second\":162.6,\"cache_n\":1024}}\n\n",
        b"data: {\"choices\":[{\"finish_reason\":\"stop\",\"index\":0,\"delta\":{}}],\"created\":1730000000,\"id\":\"chatcmpl-Xy\",\"model\":\"qwen\",\"system_fingerprint\":\"b5000\",\"object\":\"chat.completion.chunk\",\"usage\":{\"completion_tokens\":2,\"prompt_tokens\":1200,\"total_tokens\":1202},\"timings\":{\"prompt_n\":176,\"prompt_ms\":40.2,\"prompt_per_token_ms\":0.23,\"prompt_per_second\":4378.1,\"predicted_n\":2,\"predicted_ms\":12.4,\"predicted_per_token_ms\":6.2,\"predicted_per_second\":161.3,\"cache_n\":1024}}\n\n",
        b"data: [DONE]\n\n",
    ];
    for (name, frames, finish) in [("vllm", vllm, 4), ("llama-server", llama, 2)] {
        for read in 1..=frames.len() {
            let svc = service(&[("a", "n1")]);
            let mut reply = Reply::new("text/event-stream", &frames);
            // The rest of the stream, or its end, a long while later.
            reply
                .frames
                .push((Duration::from_secs(3_600), Ok(Bytes::from_static(b""))));
            read_then_drop(&svc, request(None, None, reply), read).await;
            let a = status(&svc, "a");
            let counted = u64::from(read > finish);
            assert_eq!(
                (a.in_flight, a.usage_reports),
                (0, counted),
                "{name}, dropped after {read} frames"
            );
            let prompt = a.prompt_tokens + a.unreported_prompt_tokens;
            assert_eq!(
                prompt,
                1_200 * counted,
                "{name}, dropped after {read} frames"
            );
        }
    }
}

/// An Anthropic stream's first event, `message_start`, carries the prompt's figures before
/// the answer is written, and the frames a backend sends may cut it anywhere: after the
/// event's type and before its usage ends, or in the middle of the type. A client that drops
/// the body after it, whatever the cut, has not read the answer, which is not learned.
#[tokio::test(start_paused = true)]
async fn an_anthropic_stream_dropped_after_its_first_event_is_not_learned_wherever_the_event_is_cut(
) {
    const START: &str = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"usage\":{\"input_tokens\":100,\"cache_read_input_tokens\":3000,\"output_tokens\":1}}}\n\n";
    let cuts = [
        // In the usage object, after the type.
        START.find("\"cache_read").unwrap(),
        // In the middle of the type's value.
        START.find("_start\",").unwrap(),
        // In the event line.
        START.find("start\ndata").unwrap(),
    ];
    for cut in cuts {
        let svc = service(&[("a", "n1")]);
        let (head, tail) = START.as_bytes().split_at(cut);
        let mut reply = Reply::sse(&[]);
        reply.frames = vec![
            (Duration::ZERO, Ok(Bytes::copy_from_slice(head))),
            (Duration::ZERO, Ok(Bytes::copy_from_slice(tail))),
            // The rest of the stream, or its end, a long while later.
            (Duration::from_secs(3_600), Ok(Bytes::new())),
        ];
        read_then_drop(&svc, request_to("/v1/messages", None, None, reply), 2).await;
        let a = status(&svc, "a");
        assert_eq!((a.in_flight, a.usage_reports), (0, 0), "cut at {cut}");
        assert_eq!(
            a.prompt_tokens + a.unreported_prompt_tokens,
            0,
            "cut at {cut}"
        );
    }
}

/// A request may ask for several choices (`n`): vLLM streams each one's chunks, with
/// `continuous_usage_stats` a usage object in every chunk, and each choice's finish
/// (`finish_reason` not null) comes while the others may still stream. A client that drops
/// the body after one choice's finish, or after every choice's, before the usage chunk that
/// follows the choices, may not have read the answer to its end: it is not learned. Dropped
/// after the usage chunk, it is.
#[tokio::test(start_paused = true)]
async fn a_stream_of_several_choices_is_not_learned_when_dropped_after_one_choices_finish() {
    let chunk = |index: u32, delta: &str, finish: &str, completion: u32| {
        format!(
            "data: {{\"id\":\"chatcmpl-n2\",\"object\":\"chat.completion.chunk\",\"created\":1730000000,\"model\":\"qwen\",\"choices\":[{{\"index\":{index},\"delta\":{delta},\"logprobs\":null,\"finish_reason\":{finish}}}],\"usage\":{{\"prompt_tokens\":1200,\"total_tokens\":{},\"completion_tokens\":{completion}}}}}\n\n",
            1200 + completion
        )
    };
    let frames = [
        chunk(0, r#"{"role":"assistant","content":""}"#, "null", 0),
        chunk(1, r#"{"role":"assistant","content":""}"#, "null", 0),
        chunk(0, r#"{"content":"Hi"}"#, "null", 1),
        chunk(1, r#"{"content":"Hel"}"#, "null", 2),
        // The first choice's finish: the second still streams.
        chunk(0, r#"{"content":""}"#, "\"stop\"", 2),
        chunk(1, r#"{"content":"lo"}"#, "null", 3),
        chunk(1, r#"{"content":""}"#, "\"stop\"", 3),
        "data: {\"id\":\"chatcmpl-n2\",\"object\":\"chat.completion.chunk\",\"created\":1730000000,\"model\":\"qwen\",\"choices\":[],\"usage\":{\"prompt_tokens\":1200,\"total_tokens\":1203,\"completion_tokens\":3,\"prompt_tokens_details\":{\"cached_tokens\":1024}}}\n\n".to_string(),
        "data: [DONE]\n\n".to_string(),
    ];
    // The usage chunk after the choices is the 8th.
    for read in 1..=frames.len() {
        let svc = service(&[("a", "n1")]);
        let mut reply = Reply::sse(&[]);
        reply.frames = frames
            .iter()
            .map(|f| (Duration::ZERO, Ok(Bytes::from(f.clone()))))
            .collect();
        // The rest of the stream, or its end, a long while later.
        reply
            .frames
            .push((Duration::from_secs(3_600), Ok(Bytes::new())));
        read_then_drop(&svc, request(None, None, reply), read).await;
        let a = status(&svc, "a");
        let counted = u64::from(read >= 8);
        assert_eq!(
            (a.in_flight, a.usage_reports),
            (0, counted),
            "dropped after {read} frames"
        );
    }
}

/// `req`, continuing a response stored on `backend`: it goes there.
fn pinned_to(mut req: Req, backend: &str) -> Req {
    let facts = req.extensions_mut().get_mut::<PromptFacts>().unwrap();
    facts.stored_on = Some(backend.into());
    req
}

#[tokio::test(start_paused = true)]
async fn a_keyless_turn_whose_prefix_two_full_backends_hold_alike_waits_for_neither() {
    let svc = service(&[("a", "n1"), ("b", "n2"), ("c", "n3")]);
    // Each backend reads a cold 10,000-token prompt in 50 s; requests take 10 s.
    let lesson = || Reply::llama_stream(10_000, 0, 50_000, Duration::from_secs(10), Duration::ZERO);
    let lessons = tokio::join!(
        exchange(&svc, request(None, Some(chain(&[7, 8], 5000)), lesson())),
        exchange(&svc, request(None, Some(chain(&[9, 10], 5000)), lesson())),
        exchange(&svc, request(None, Some(chain(&[11, 12], 5000)), lesson())),
    );
    let mut taught = [lessons.0 .0, lessons.1 .0, lessons.2 .0].map(|d| d.backend.to_string());
    taught.sort();
    assert_eq!(taught, ["a", "b", "c"], "one lesson each");
    // The same 8,000 tokens are held on a and on b, and nowhere else.
    let opening = chain(&SESSION_BLOCKS[..8], 1000);
    for b in ["a", "b"] {
        let req = pinned_to(request(None, Some(opening.clone()), reused(8000, 0)), b);
        assert_eq!(exchange(&svc, req).await.0.backend.as_str(), b);
    }
    // Both busy for 5 s, sooner than reading 8,000 tokens on c (40 s).
    let mut busy = Vec::new();
    for (b, ids) in [("a", [900, 901]), ("b", [910, 911])] {
        let long = Reply::llama_stream(2000, 0, 1000, Duration::ZERO, Duration::from_secs(5));
        let req = pinned_to(request(None, Some(chain(&ids, 1000)), long), b);
        busy.push(keep_busy(&svc, req, b).await);
    }
    // A prompt extending them: a prefix that two backends hold alike is no one backend's to
    // wait for. (Its last blocks rank a first among the holders.)
    let mut ids = SESSION_BLOCKS[..8].to_vec();
    ids.extend([508, 509]);
    let (d, _, _) = exchange(
        &svc,
        request(None, Some(chain(&ids, 1000)), reused(10_000, 0)),
    )
    .await;
    assert_eq!((d.backend.as_str(), d.waited), ("c", None));
    for task in busy {
        task.await.unwrap();
    }
}
