//! Bad input: header keys that are not UTF-8, long or repeated; JSON bodies that are malformed,
//! deeply nested, oversize or slow; an empty fleet; discovery streams that fail, end or never
//! yield; a failure cooldown too short for the fleet's clock. Each has a defined answer (a status code, a keyless pass-through or an error from the
//! service) and none panics or buffers without bound.
//!
//! The front is the proxy's stack without the network: [`BodyKeyLayer`] in front of
//! [`ErrorToResponse`] in front of the balancer, over backends that echo the request body.
//! Time-dependent tests run on paused time.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Request, StatusCode};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Full};
use tokio::time::Sleep;
use tower::discover::Change;
use tower::util::BoxCloneSyncService;
use tower::{Layer, Service, ServiceExt};
use tower_affinity::discover::{self, StaticFleet};
use tower_affinity::key::{BodyKey, BodyKeyLayer, ExtensionKey, FirstOf, HeaderKey, PromptFacts};
use tower_affinity::placement::NodeThenBackend;
use tower_affinity::{
    Backend, BackendId, BoxError, Decision, Error, ErrorToResponse, Outcome, SessionAffinity,
    SessionAffinityLayer, Sessions,
};

type Echo = BoxCloneSyncService<Request<Full<Bytes>>, http::Response<Full<Bytes>>, BoxError>;
type Key = FirstOf<HeaderKey, ExtensionKey>;

/// Requests the backends have seen.
#[derive(Clone, Default)]
struct Calls(Arc<AtomicUsize>);

impl Calls {
    fn get(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }
}

/// A backend that answers at once with the body it was sent.
fn echo(calls: &Calls) -> Echo {
    let calls = calls.clone();
    BoxCloneSyncService::new(tower::service_fn(move |req: Request<Full<Bytes>>| {
        calls.0.fetch_add(1, Ordering::Relaxed);
        async move {
            let body = req.into_body().collect().await?.to_bytes();
            Ok::<_, BoxError>(http::Response::new(Full::new(body)))
        }
    }))
}

fn two_backends(calls: &Calls) -> StaticFleet<Echo> {
    let two = NonZeroU32::new(2).unwrap();
    StaticFleet::new([
        ("a1", Backend::new("node-a", echo(calls)).slots(two)),
        ("b1", Backend::new("node-b", echo(calls)).slots(two)),
    ])
}

type Affinity = SessionAffinity<StaticFleet<Echo>, Key, NodeThenBackend>;

fn affinity(calls: &Calls, sessions: Sessions) -> Affinity {
    SessionAffinityLayer::new()
        .key(FirstOf::new(HeaderKey::default(), ExtensionKey))
        .sessions(sessions)
        .layer(two_backends(calls))
}

/// What came back.
#[derive(Debug)]
struct Answer {
    status: StatusCode,
    outcome: Option<Outcome>,
    body: Bytes,
}

/// The message of a refusal's JSON error body.
fn message(body: &[u8]) -> String {
    let body: serde_json::Value = serde_json::from_slice(body).expect("a JSON error body");
    body["error"]["message"]
        .as_str()
        .expect("an error message")
        .to_owned()
}

/// Sends `req` through `BodyKeyLayer` -> `ErrorToResponse` -> `svc` and reads the whole answer.
async fn through<S, B>(layer: &BodyKeyLayer, svc: S, req: Request<B>) -> Answer
where
    S: Service<
            Request<Full<Bytes>>,
            Response = http::Response<tower_affinity::ResponseBody<Full<Bytes>>>,
            Error = Error,
        > + Clone,
    B: Body,
    B::Error: Into<BoxError>,
{
    let front: BodyKey<ErrorToResponse<S>> = layer.layer(ErrorToResponse::new(svc));
    let res = front.oneshot(req).await.unwrap();
    let status = res.status();
    let outcome = res.extensions().get::<Decision>().map(|d| d.outcome);
    let body = res.into_body().collect().await.unwrap().to_bytes();
    Answer {
        status,
        outcome,
        body,
    }
}

fn post(body: impl Into<Bytes>) -> Request<Full<Bytes>> {
    let body = body.into();
    Request::post("/v1/chat/completions")
        .header(header::CONTENT_LENGTH, body.len())
        .body(Full::new(body))
        .unwrap()
}

fn with_header(name: &'static str, value: &[u8]) -> Request<Full<Bytes>> {
    Request::post("/v1/chat/completions")
        .header(name, HeaderValue::from_bytes(value).unwrap())
        .body(Full::new(Bytes::new()))
        .unwrap()
}

// === a body driven by a script, on tokio time ===

enum Step {
    Data(&'static [u8]),
    Sleep(Duration),
    Fail,
    Stall,
}

/// A request body that plays its steps in order, then ends; no declared length.
struct Script {
    steps: VecDeque<Step>,
    sleep: Option<Pin<Box<Sleep>>>,
}

impl Script {
    fn new(steps: impl IntoIterator<Item = Step>) -> Self {
        Script {
            steps: steps.into_iter().collect(),
            sleep: None,
        }
    }

    /// `n` bytes of `chunk`, one chunk every `every`.
    fn trickle(chunk: &'static [u8], n: usize, every: Duration) -> Self {
        Script::new((0..n).flat_map(|_| [Step::Sleep(every), Step::Data(chunk)]))
    }
}

impl Body for Script {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        loop {
            if let Some(s) = self.sleep.as_mut() {
                std::task::ready!(s.as_mut().poll(cx));
                self.sleep = None;
            }
            return match self.steps.pop_front() {
                None => Poll::Ready(None),
                Some(Step::Data(d)) => Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(d))))),
                Some(Step::Fail) => Poll::Ready(Some(Err("client reset the stream".into()))),
                Some(Step::Stall) => {
                    self.steps.push_front(Step::Stall);
                    Poll::Pending
                }
                Some(Step::Sleep(t)) => {
                    self.sleep = Some(Box::pin(tokio::time::sleep(t)));
                    continue;
                }
            };
        }
    }
}

// === header keys ===

/// A header value that is not UTF-8 (obs-text bytes) is a key like any other: its bytes are
/// digested, and the session sticks.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_non_utf8_header_key_is_a_session_that_sticks() {
    let calls = Calls::default();
    let svc = affinity(&calls, Sessions::new());
    let layer = BodyKeyLayer::new();
    let raw: &[u8] = &[0xff, 0xfe, 0x80, b'a', 0xa0];
    let first = through(&layer, svc.clone(), with_header("x-session-id", raw)).await;
    let again = through(&layer, svc.clone(), with_header("x-session-id", raw)).await;
    let other = through(&layer, svc.clone(), with_header("x-session-id", &raw[..4])).await;
    assert_eq!(
        [first.outcome, again.outcome, other.outcome],
        [
            Some(Outcome::NewSession),
            Some(Outcome::HomeHit),
            Some(Outcome::NewSession)
        ]
    );
    assert_eq!(first.status, StatusCode::OK);
    // The affinity header is read the same way.
    let aff = through(&layer, svc.clone(), with_header("x-session-affinity", raw)).await;
    assert_eq!(aff.outcome, Some(Outcome::HomeHit));
    assert_eq!(svc.stats().in_flight, 0);
}

/// A repeated key header: its first value is the key; the others are ignored. A blank value is
/// no key (the request is placed by load).
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_repeated_header_key_is_its_first_value_and_a_blank_one_is_none() {
    let calls = Calls::default();
    let svc = affinity(&calls, Sessions::new());
    let layer = BodyKeyLayer::new();
    let first = through(&layer, svc.clone(), with_header("x-session-id", b"one")).await;
    assert_eq!(first.outcome, Some(Outcome::NewSession));
    for _ in 0..3 {
        let req = Request::post("/")
            .header("x-session-id", "one")
            .header("x-session-id", "two")
            .header("x-session-id", "three")
            .body(Full::new(Bytes::new()))
            .unwrap();
        let a = through(&layer, svc.clone(), req).await;
        assert_eq!(a.outcome, Some(Outcome::HomeHit));
    }
    assert_eq!(svc.stats().sessions, 1, "the later values are not sessions");
    let blank = through(&layer, svc.clone(), with_header("x-session-id", b" \t ")).await;
    assert_eq!(blank.outcome, Some(Outcome::Keyless));
}

/// Keys are digested: two hundred 64 KiB keys take exactly the table memory of two hundred
/// three-byte keys.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_key_size_never_reaches_memory() {
    let calls = Calls::default();
    // One shard, so the table's growth depends on the count of keys alone.
    let sessions = Sessions::new().max_entries(1000);
    let long = affinity(&calls, sessions);
    let short = affinity(&calls, sessions);
    let layer = BodyKeyLayer::new();
    let pad = "k".repeat(64 * 1024);
    for i in 0..200u32 {
        let long_key = format!("{pad}{i}");
        let a = through(
            &layer,
            long.clone(),
            with_header("x-session-id", long_key.as_bytes()),
        );
        let b = through(
            &layer,
            short.clone(),
            with_header("x-session-id", format!("{i:03}").as_bytes()),
        );
        assert_eq!(a.await.status, StatusCode::OK);
        assert_eq!(b.await.status, StatusCode::OK);
    }
    let (l, s) = (long.stats(), short.stats());
    assert_eq!((l.sessions, s.sessions), (200, 200));
    assert_eq!(l.session_table_bytes, s.session_table_bytes);
    assert!(
        l.session_table_bytes < 64 * 1024,
        "less than one raw key: {l:?}"
    );
}

// === bodies ===

/// A body that is not a JSON object, or is broken JSON, is forwarded byte for byte without a
/// key: it is placed by load.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn malformed_json_passes_through_keyless_and_untouched() {
    let calls = Calls::default();
    let svc = affinity(&calls, Sessions::new());
    let layer = BodyKeyLayer::new();
    let bodies: &[&[u8]] = &[
        br#"{"user":"u""#,
        br#"{"user":"u"}}"#,
        br#"{"user":"u",}"#,
        br#"{"user":"u"} trailing"#,
        b"{\"user\":\"\xff\xfe\"}",
        b"{\"user\":\"a\x00b\"}",
        br#"{"user":"\ud800"}"#,
        br#"{"user":NaN}"#,
        br#"{"user":1e999999}"#,
        br#"[{"user":"u"}]"#,
        br#""user""#,
        // A byte order mark is skipped only at the very start, as llama-server skips it.
        b" \xef\xbb\xbf{\"user\":\"bom\"}",
        b"\xef\xbb\xbf\xef\xbb\xbf{\"user\":\"bom\"}",
        b"{",
        b"}",
        b"",
        b"\x00\x01\x02",
    ];
    for &body in bodies {
        let a = through(&layer, svc.clone(), post(body)).await;
        assert_eq!(a.status, StatusCode::OK, "{body:?}");
        assert_eq!(a.outcome, Some(Outcome::Keyless), "{body:?}");
        assert_eq!(&a.body[..], body, "forwarded byte for byte");
    }
    assert_eq!(calls.get(), bodies.len());
    let stats = svc.stats();
    assert_eq!((stats.sessions, stats.in_flight), (0, 0));
}

fn nested(open: &str, close: &str, depth: usize, inner: &str) -> Vec<u8> {
    let mut v = Vec::with_capacity((open.len() + close.len()) * depth + inner.len());
    for _ in 0..depth {
        v.extend_from_slice(open.as_bytes());
    }
    v.extend_from_slice(inner.as_bytes());
    for _ in 0..depth {
        v.extend_from_slice(close.as_bytes());
    }
    v
}

/// JSON nested 100,000 deep is refused by the parser's depth limit (128), not by the stack: the
/// body goes on keyless, even when its key field is at the top level. Nesting within the limit
/// is read as usual.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn deeply_nested_json_passes_through_keyless() {
    let calls = Calls::default();
    let svc = affinity(&calls, Sessions::new());
    let layer = BodyKeyLayer::new();
    let mut bodies = vec![
        nested("[", "", 100_000, ""),
        nested("[", "]", 100_000, ""),
        nested("{\"a\":", "}", 100_000, "1"),
    ];
    let mut keyed_deep = br#"{"user":"deep","x":"#.to_vec();
    keyed_deep.extend(nested("[", "]", 100_000, ""));
    keyed_deep.push(b'}');
    bodies.push(keyed_deep);
    for body in bodies {
        let len = body.len();
        let a = through(&layer, svc.clone(), post(body)).await;
        assert_eq!(a.status, StatusCode::OK);
        assert_eq!(a.outcome, Some(Outcome::Keyless));
        assert_eq!(a.body.len(), len);
    }
    // 100 levels is fine: the key is read.
    let mut shallow = br#"{"user":"deep","x":"#.to_vec();
    shallow.extend(nested("[", "]", 100, ""));
    shallow.push(b'}');
    let a = through(&layer, svc.clone(), post(shallow)).await;
    assert_eq!(a.outcome, Some(Outcome::NewSession));
}

/// The body reader's parse does not recurse without bound: a million levels are read on a
/// 512 KiB stack (a quarter of a tokio worker's).
#[test]
fn deep_json_is_read_on_a_small_stack() {
    let bodies = [
        nested("{\"a\":[", "]}", 1_000_000, ""),
        nested("{\"messages\":", "}", 1_000_000, "[]"),
        {
            let mut b = br#"{"messages":[{"role":"system","content":"#.to_vec();
            b.extend(nested("[", "]", 100_000, ""));
            b.extend(b"}]}");
            b
        },
    ];
    let facts = std::thread::Builder::new()
        .stack_size(512 * 1024)
        .spawn(move || bodies.map(|b| PromptFacts::from_body(&b)))
        .unwrap()
        .join()
        .expect("no stack overflow");
    for f in facts {
        assert_eq!((f.messages, f.leading_digest()), (0, None));
    }
}

/// An oversize body is 413 and never reaches a backend or takes a slot: from its
/// `Content-Length` before reading, or once the bytes read pass the limit, whatever length it
/// declared. A `Content-Length` that does not parse counts as unknown; the limit still holds.
/// A chat body of a 4 KiB system prompt and `turns` exchanges of 600 bytes each way.
fn conversation(tag: &str, turns: usize) -> Vec<u8> {
    let mut messages = vec![serde_json::json!({"role": "system", "content": "S".repeat(4096)})];
    for t in 0..turns {
        let q = format!("{tag} question {t} {}", "q".repeat(600));
        let a = format!("{tag} answer {t} {}", "a".repeat(600));
        messages.push(serde_json::json!({"role": "user", "content": q}));
        messages.push(serde_json::json!({"role": "assistant", "content": a}));
    }
    serde_json::to_vec(&serde_json::json!({"model": "m", "messages": messages})).unwrap()
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_prompt_of_tiny_messages_evicts_no_more_of_the_model_than_its_tokens() {
    // One backend with the default cache budget (131,072 tokens) homes ten conversations of
    // about 2,000 tokens each.
    let calls = Calls::default();
    let svc: Affinity = SessionAffinityLayer::new()
        .key(FirstOf::new(HeaderKey::default(), ExtensionKey))
        .layer(StaticFleet::new([(
            "a1",
            Backend::new("node-a", echo(&calls)).slots(NonZeroU32::new(4).unwrap()),
        )]));
    let layer = BodyKeyLayer::new();
    let send = |key: &str, body: Vec<u8>| {
        let mut req = post(body);
        req.headers_mut()
            .insert("x-session-id", HeaderValue::from_str(key).unwrap());
        through(&layer, svc.clone(), req)
    };
    let victims: Vec<String> = (0..10).map(|v| format!("victim-{v}")).collect();
    for v in &victims {
        send(v, conversation(v, 1)).await;
    }
    // 8,192 empty messages in 230 KB: some 57,000 tokens, which the budget has room for
    // beside the ten. A link at every message would be 8,192 links, the model's whole bound.
    let mut tiny = br#"{"model":"m","messages":["#.to_vec();
    for i in 0..8_192 {
        if i > 0 {
            tiny.push(b',');
        }
        tiny.extend_from_slice(br#"{"role":"user","content":""}"#);
    }
    tiny.extend_from_slice(b"]}");
    let answer = send("tiny", tiny).await;
    assert_eq!(answer.status, StatusCode::OK);
    let status = &svc.backends()[0];
    assert!(status.cached_blocks < 8_192 / 2, "{status:?}");
    assert_eq!(status.evicted_blocks, 0, "{status:?}");
    for v in &victims {
        let next = send(v, conversation(v, 2)).await;
        assert_eq!(next.outcome, Some(Outcome::HomeHit), "{v}");
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn an_oversize_body_is_413_and_takes_no_slot() {
    let calls = Calls::default();
    let svc = affinity(&calls, Sessions::new());
    let layer = BodyKeyLayer::new().limit(1000);
    let big = Bytes::from(vec![b'x'; 1001]);

    // Declared.
    let declared = Request::post("/")
        .header(header::CONTENT_LENGTH, "1001")
        .body(Script::new([Step::Stall]))
        .unwrap();
    let a = through(&layer, svc.clone(), declared).await;
    assert_eq!(a.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(message(&a.body).starts_with("request body is larger than the limit of 1000 bytes"));
    // Declared as huge as a u64 goes.
    let huge = Request::post("/")
        .header(header::CONTENT_LENGTH, u64::MAX.to_string())
        .body(Script::new([Step::Stall]))
        .unwrap();
    let a = through(&layer, svc.clone(), huge).await;
    assert_eq!(a.status, StatusCode::PAYLOAD_TOO_LARGE);
    // Streamed with no length, 100 bytes at a time.
    let chunk: &'static [u8] = &[b'y'; 100];
    let streamed = Request::post("/")
        .body(Script::new((0..20).map(|_| Step::Data(chunk))))
        .unwrap();
    assert_eq!(
        through(&layer, svc.clone(), streamed).await.status,
        StatusCode::PAYLOAD_TOO_LARGE
    );
    // A length that lies low.
    let lying = Request::post("/")
        .header(header::CONTENT_LENGTH, "10")
        .body(Full::new(big.clone()))
        .unwrap();
    assert_eq!(
        through(&layer, svc.clone(), lying).await.status,
        StatusCode::PAYLOAD_TOO_LARGE
    );
    // Lengths that do not parse: the limit holds while reading.
    for bad in ["abc", "-1", "99999999999999999999999", "1000, 1000"] {
        let req = Request::post("/")
            .header(header::CONTENT_LENGTH, bad)
            .body(Full::new(big.clone()))
            .unwrap();
        let a = through(&layer, svc.clone(), req).await;
        assert_eq!(a.status, StatusCode::PAYLOAD_TOO_LARGE, "{bad}");
    }
    assert_eq!(calls.get(), 0, "no backend saw an oversize body");
    let stats = svc.stats();
    assert_eq!((stats.placed(), stats.in_flight, stats.sessions), (0, 0, 0));

    // Exactly at the limit goes through.
    let at = through(&layer, svc.clone(), post(vec![b'x'; 1000])).await;
    assert_eq!(at.status, StatusCode::OK);
}

/// The read deadline is for the whole body, from the call: a client that trickles a byte a
/// second is answered 408 at the deadline even though bytes keep coming. It never reaches a
/// backend nor takes a slot. A body that completes in time goes through.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_slow_body_is_408_at_the_read_deadline() {
    let calls = Calls::default();
    let svc = affinity(&calls, Sessions::new());
    let layer = BodyKeyLayer::new().read_timeout(Duration::from_secs(30));
    let start = tokio::time::Instant::now();
    let slow = Request::post("/")
        .body(Script::trickle(b"x", 1000, Duration::from_secs(1)))
        .unwrap();
    let a = through(&layer, svc.clone(), slow).await;
    assert_eq!(a.status, StatusCode::REQUEST_TIMEOUT);
    assert!(message(&a.body).starts_with("request body did not arrive within 30 s"));
    assert_eq!(start.elapsed(), Duration::from_secs(30));
    // A stalled body: the same.
    let stalled = Request::post("/")
        .body(Script::new([Step::Data(b"{\"user\""), Step::Stall]))
        .unwrap();
    assert_eq!(
        through(&layer, svc.clone(), stalled).await.status,
        StatusCode::REQUEST_TIMEOUT
    );
    assert_eq!(calls.get(), 0);
    assert_eq!(svc.stats().in_flight, 0);
    // Slow but in time.
    let in_time = Request::post("/")
        .body(Script::trickle(b"x", 29, Duration::from_secs(1)))
        .unwrap();
    let a = through(&layer, svc.clone(), in_time).await;
    assert_eq!((a.status, a.body.len()), (StatusCode::OK, 29));
}

/// Without a read timeout (the layer's default) a stalled body waits for as long as the client
/// keeps the connection open: the future stays pending, but holds no slot and no backend, and
/// dropping it (the client going away) leaves nothing behind. The proxy example sets one (60 s).
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn without_a_read_timeout_a_stalled_body_holds_no_slot() {
    let calls = Calls::default();
    let svc = affinity(&calls, Sessions::new());
    let front = BodyKeyLayer::new().layer(ErrorToResponse::new(svc.clone()));
    let stalled = Request::post("/")
        .body(Script::new([Step::Data(b"{\"user\":\"u"), Step::Stall]))
        .unwrap();
    let mut fut = tokio_test::task::spawn(front.oneshot(stalled));
    tokio_test::assert_pending!(fut.poll());
    tokio::time::advance(Duration::from_secs(24 * 3600)).await;
    tokio_test::assert_pending!(fut.poll());
    let stats = svc.stats();
    assert_eq!((stats.in_flight, stats.waiting, calls.get()), (0, 0, 0));
    drop(fut);
    assert_eq!(svc.stats().in_flight, 0);
}

/// A body that fails while it is read (the client reset the stream) is 400; nothing reaches a
/// backend.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_body_that_fails_mid_read_is_400() {
    let calls = Calls::default();
    let svc = affinity(&calls, Sessions::new());
    let req = Request::post("/")
        .body(Script::new([Step::Data(b"{\"user\":"), Step::Fail]))
        .unwrap();
    let a = through(&BodyKeyLayer::new(), svc.clone(), req).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert!(message(&a.body).starts_with("failed to read the request body"));
    assert_eq!((calls.get(), svc.stats().in_flight), (0, 0));
}

// === fleet and discovery ===

type Changes = Vec<Result<Change<BackendId, Backend<Echo>>, &'static str>>;

/// An empty fleet is 503 with its reason in a JSON error body, whatever made it empty: no backend yet,
/// every backend removed, or every backend marked down.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn an_empty_or_all_down_fleet_is_503() {
    let calls = Calls::default();
    let layer = BodyKeyLayer::new();
    let (handle, stream) = discover::channel::<Echo>();
    let svc = SessionAffinityLayer::new()
        .key(FirstOf::new(HeaderKey::default(), ExtensionKey))
        .layer(stream);
    let a = through(&layer, svc.clone(), post(r#"{"user":"u"}"#)).await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        &a.body[..],
        br#"{"error":{"code":503,"message":"no backends available: the fleet is empty","type":"unavailable_error"}}"#
    );

    handle.insert("a1", Backend::new("node-a", echo(&calls)));
    let a = through(&layer, svc.clone(), post(r#"{"user":"u"}"#)).await;
    assert_eq!(a.status, StatusCode::OK);

    svc.mark_down("a1", None);
    let a = through(&layer, svc.clone(), post(r#"{"user":"u"}"#)).await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
    svc.mark_up("a1");

    handle.remove("a1");
    let a = through(&layer, svc.clone(), post(r#"{"user":"u"}"#)).await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
    let stats = svc.stats();
    assert_eq!((stats.no_backends, stats.in_flight), (3, 0));
}

/// A discovery stream that fails before naming any backend, then ends, leaves an empty fleet
/// for good: every request is 503 and each error is counted once.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_discovery_stream_that_only_fails_then_ends_is_503() {
    let changes: Changes = vec![Err("registry unreachable"), Err("registry unreachable")];
    let svc = SessionAffinityLayer::new()
        .key(FirstOf::new(HeaderKey::default(), ExtensionKey))
        .layer(tokio_stream::iter(changes));
    for _ in 0..3 {
        let a = through(&BodyKeyLayer::new(), svc.clone(), post("{}")).await;
        assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
    }
    assert_eq!(svc.stats().discovery_errors, 2);
    assert_eq!(svc.stats().no_backends, 3);
}

/// A discovery stream that never yields does not make requests wait for it: they are 503 at
/// once (on paused time, no time passes).
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_discovery_stream_that_never_yields_is_503_at_once() {
    let never = tokio_stream::pending::<Result<Change<BackendId, Backend<Echo>>, Infallible>>();
    let svc = SessionAffinityLayer::new()
        .key(FirstOf::new(HeaderKey::default(), ExtensionKey))
        .layer(never);
    let start = tokio::time::Instant::now();
    let a = through(&BodyKeyLayer::new(), svc.clone(), post("{}")).await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(start.elapsed(), Duration::ZERO);
}

/// When every `FleetHandle` is dropped the stream ends and the fleet stays as it was: requests
/// keep flowing and sessions keep their homes.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_discovery_channel_whose_handles_are_dropped_keeps_the_fleet() {
    let calls = Calls::default();
    let (handle, stream) = discover::channel::<Echo>();
    handle.insert("a1", Backend::new("node-a", echo(&calls)));
    handle.insert("b1", Backend::new("node-b", echo(&calls)));
    let svc = SessionAffinityLayer::new()
        .key(FirstOf::new(HeaderKey::default(), ExtensionKey))
        .layer(stream);
    let layer = BodyKeyLayer::new();
    let first = through(&layer, svc.clone(), post(r#"{"user":"u"}"#)).await;
    drop(handle);
    for _ in 0..3 {
        let a = through(&layer, svc.clone(), post(r#"{"user":"u"}"#)).await;
        assert_eq!(a.outcome, Some(Outcome::HomeHit));
    }
    assert_eq!(first.outcome, Some(Outcome::NewSession));
    assert_eq!(svc.backends().len(), 2);
}

/// A failure cooldown shorter than a millisecond still passes the failed backend over for
/// the retry that follows at once: it is counted in whole milliseconds, rounded up, not
/// rounded away to none.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_failure_cooldown_under_a_millisecond_still_sends_the_retry_elsewhere() {
    let calls = Calls::default();
    let refusing: Echo = BoxCloneSyncService::new(tower::service_fn(|_: Request<Full<Bytes>>| {
        std::future::ready(Err::<http::Response<Full<Bytes>>, BoxError>(
            "connection refused".into(),
        ))
    }));
    let fleet = StaticFleet::new([
        ("a1", Backend::new("node-a", refusing)),
        ("b1", Backend::new("node-b", echo(&calls))),
    ]);
    let svc = SessionAffinityLayer::new()
        .failure_cooldown(Duration::from_micros(500))
        .layer(fleet);
    let retrying = tower::retry::Retry::new(tower_affinity::RetryOnce::new(), svc.clone());
    for n in 0..16 {
        let req = Request::post("/v1/chat/completions")
            .header("x-session-id", format!("s{n}"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let answer = retrying.clone().oneshot(req).await;
        assert!(answer.is_ok(), "s{n}: {answer:?}");
        // The cooldown over, the next session finds both backends up.
        tokio::time::advance(Duration::from_millis(1)).await;
    }
    // Some sessions began on the refusing backend, and were answered by the other.
    let failed = svc.stats().backend_errors;
    assert!((1..16).contains(&failed), "{failed}");
    assert_eq!(calls.get(), 16);
}
