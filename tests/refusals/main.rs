//! A prompt its backend refuses as too long for its context, read (`ReadRefusals`) and retried
//! (`RetryOnce`) on a backend that takes it, with mock llama-servers on paused time.

#[path = "../support/logs.rs"]
mod support_logs;

use std::num::{NonZeroU32, NonZeroU64};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::StatusCode;
use http_body::{Frame, SizeHint};
use http_body_util::BodyExt;
use tower::retry::Retry;
use tower::util::BoxCloneSyncService;
use tower::{Layer, Service, ServiceExt};
use tower_affinity::discover::StaticFleet;
use tower_affinity::key::PromptFacts;
use tower_affinity::{
    Backend, BoxError, ContextRefusal, Decision, Error, Outcome, PromptChain, ReadRefusals,
    ReadRefusalsLayer, ResponseBody, RetryOnce, SessionAffinityLayer,
};

type Req = http::Request<String>;
type Mock = BoxCloneSyncService<Req, http::Response<MockBody>, BoxError>;
type Res = http::Response<ResponseBody<MockBody>>;

/// A mock answer's body: its bytes with their length known, the same bytes of unknown length,
/// or some bytes of a length it says and then a failure.
enum MockBody {
    Full(Option<Bytes>),
    Chunked(Option<Bytes>),
    Broken { said: u64, sent: bool },
}

impl http_body::Body for MockBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Poll::Ready(match self.get_mut() {
            MockBody::Full(data) | MockBody::Chunked(data) => {
                data.take().map(|d| Ok(Frame::data(d)))
            }
            MockBody::Broken { sent, .. } if !*sent => {
                *sent = true;
                Some(Ok(Frame::data(Bytes::from_static(b"{\"error\""))))
            }
            MockBody::Broken { .. } => Some(Err("connection reset".into())),
        })
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            MockBody::Full(data) => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            MockBody::Chunked(_) => SizeHint::default(),
            MockBody::Broken { said, .. } => SizeHint::with_exact(*said),
        }
    }
}

/// The header giving the prompt's tokens as the backends count them.
const TOKENS: &str = "x-tokens";

/// A mock llama-server named `name` whose slots take `context` tokens: a prompt of that many
/// tokens or more (by the request's `x-tokens`) is refused with llama-server's `400`, with its
/// length known. `x-other-400` gets another `400`; `x-chunked-400` a refusal of unknown length;
/// `x-broken-400` a refusal whose body fails; `x-refusal-bytes: N` a refusal padded with
/// spaces to `N` bytes. `calls` counts the requests it got.
fn llama(name: &'static str, context: u64, calls: Arc<AtomicUsize>) -> Mock {
    BoxCloneSyncService::new(tower::service_fn(move |req: Req| {
        calls.fetch_add(1, Ordering::Relaxed);
        let header = |h: &str| req.headers().get(h).is_some();
        let tokens: u64 = req
            .headers()
            .get(TOKENS)
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .unwrap_or(0);
        let mut refusal = format!(
            r#"{{"error":{{"code":400,"message":"request ({tokens} tokens) exceeds the available context size ({context} tokens), try increasing it","type":"exceed_context_size_error","n_prompt_tokens":{tokens},"n_ctx":{context}}}}}"#
        );
        let padded: Option<usize> = req
            .headers()
            .get("x-refusal-bytes")
            .and_then(|v| v.to_str().ok()?.parse().ok());
        if let Some(n) = padded {
            let spaces = n.saturating_sub(refusal.len());
            refusal.push_str(&" ".repeat(spaces));
        }
        let res = http::Response::builder().header("x-served-by", name);
        let res = if header("x-other-400") {
            let body = r#"{"error":{"code":400,"message":"'messages' is required","type":"invalid_request_error"}}"#;
            res.status(StatusCode::BAD_REQUEST)
                .body(MockBody::Full(Some(Bytes::from(body))))
        } else if tokens >= context && header("x-chunked-400") {
            res.status(StatusCode::BAD_REQUEST)
                .body(MockBody::Chunked(Some(Bytes::from(refusal))))
        } else if tokens >= context && header("x-broken-400") {
            let said = refusal.len() as u64;
            res.status(StatusCode::BAD_REQUEST)
                .body(MockBody::Broken { said, sent: false })
        } else if tokens >= context {
            res.status(StatusCode::BAD_REQUEST)
                .body(MockBody::Full(Some(Bytes::from(refusal))))
        } else {
            res.body(MockBody::Full(Some(Bytes::from(name))))
        };
        std::future::ready(Ok::<_, BoxError>(res.unwrap()))
    }))
}

/// `(name, node, context a slot, whether the balancer is given that context)`, one slot each;
/// and each backend's count of the requests it got.
fn fleet(spec: &[(&'static str, &str, u64, bool)]) -> (StaticFleet<Mock>, Vec<Arc<AtomicUsize>>) {
    let calls: Vec<_> = spec.iter().map(|_| Arc::default()).collect();
    let fleet = StaticFleet::new(spec.iter().zip(&calls).map(
        |(&(name, node, context, given), calls)| {
            let mut b = Backend::new(node, llama(name, context, Arc::clone(calls)))
                .slots(NonZeroU32::new(1).unwrap());
            if given {
                b = b.request_context_tokens(NonZeroU64::new(context).unwrap());
            }
            (name, b)
        },
    ));
    (fleet, calls)
}

/// A turn of `session` whose prompt the backends count as `tokens`, and whose chain estimates
/// `estimate`: its first block is the conversation's, shared by its turns.
fn turn(session: Option<&str>, estimate: u32, tokens: u64) -> Req {
    let mut req = http::Request::post("/v1/chat/completions");
    if let Some(s) = session {
        req = req.header("x-session-id", s);
    }
    let mut req = req.header(TOKENS, tokens).body(String::new()).unwrap();
    let opening = session.map_or(7, |s| s.len() as u64);
    let chain = PromptChain::from_blocks([(opening, 100), (u64::from(estimate), estimate - 100)]);
    req.extensions_mut().insert(PromptFacts::from_chain(chain));
    req
}

async fn send<S>(svc: &mut S, req: Req) -> Res
where
    S: Service<Req, Response = Res, Error = Error>,
{
    svc.ready().await.unwrap().call(req).await.unwrap()
}

fn decision(res: &Res) -> Decision {
    res.extensions().get::<Decision>().cloned().unwrap()
}

async fn text(res: Res) -> String {
    String::from_utf8(res.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap()
}

type Affinity = tower_affinity::SessionAffinity<
    StaticFleet<Mock>,
    tower_affinity::key::HeaderKey,
    tower_affinity::placement::NodeThenBackend,
>;

type Balancer = Retry<RetryOnce, ReadRefusals<Affinity>>;

/// The balancer over `fleet`, a request waiting up to a minute for a slot (eight at most).
fn waiting(fleet: StaticFleet<Mock>) -> Affinity {
    SessionAffinityLayer::new()
        .overflow(tower_affinity::Overflow::wait(
            std::time::Duration::from_secs(60),
            8,
        ))
        .layer(fleet)
}

fn balancer(fleet: StaticFleet<Mock>) -> Balancer {
    let affinity = SessionAffinityLayer::new().layer(fleet);
    Retry::new(RetryOnce::new(), ReadRefusalsLayer::new().layer(affinity))
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_prompt_its_home_refuses_as_too_long_is_retried_on_a_backend_that_takes_it() {
    let (fleet, calls) = fleet(&[
        ("small", "node-a", 1_000, true),
        ("large", "node-b", 100_000, true),
    ]);
    let mut svc = balancer(fleet);
    // A conversation homed on the small backend: its first turns fit.
    let mut session = None;
    for i in 0..32 {
        let s = format!("s{i}");
        let res = send(&mut svc, turn(Some(&s), 300, 300)).await;
        if decision(&res).backend.as_str() == "small" {
            session = Some(s);
            break;
        }
    }
    let session = session.expect("no session homed on the small backend");
    let before = calls[0].load(Ordering::Relaxed);
    // Its next turn is estimated at 600 tokens, under the home's 1,000, but holds 1,500 by
    // the backends' count (denser text than the home's average): refused at home, and
    // answered by the large backend; the client sees the answer alone.
    let res = send(&mut svc, turn(Some(&session), 600, 1_500)).await;
    let d = decision(&res);
    assert_eq!(
        (res.status(), d.backend.as_str()),
        (StatusCode::OK, "large")
    );
    assert_eq!(d.outcome, Outcome::CrossNodeSpill);
    assert!(res.extensions().get::<ContextRefusal>().is_none());
    assert_eq!(text(res).await, "large");
    assert_eq!(
        calls[0].load(Ordering::Relaxed),
        before + 1,
        "refused once at home"
    );
    // Its home is there now.
    let res = send(&mut svc, turn(Some(&session), 700, 1_700)).await;
    assert_eq!(decision(&res).backend.as_str(), "large");
    assert_eq!(decision(&res).outcome, Outcome::HomeHit);
    assert_eq!(calls[0].load(Ordering::Relaxed), before + 1);
    let stats = svc.get_ref().get_ref().stats();
    assert_eq!((stats.refusals_retried, stats.refusals_answered), (1, 0));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn without_reading_refusals_the_refusal_reaches_the_client() {
    let (fleet, _) = fleet(&[
        ("small", "node-a", 1_000, true),
        ("large", "node-b", 100_000, true),
    ]);
    let affinity = SessionAffinityLayer::new().layer(fleet);
    let mut svc = Retry::new(RetryOnce::new(), affinity);
    let mut refused = 0;
    for i in 0..8 {
        let s = format!("s{i}");
        send(&mut svc, turn(Some(&s), 300, 300)).await;
        let res = send(&mut svc, turn(Some(&s), 600, 1_500)).await;
        if res.status() == StatusCode::BAD_REQUEST {
            refused += 1;
            assert!(text(res).await.contains("exceed_context_size_error"));
        }
    }
    assert!(
        refused > 0,
        "no conversation was homed on the small backend"
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_refusal_passes_over_the_backend_that_refused_though_its_limit_was_not_given() {
    // No limits given: the refusal alone says the first backend is too small.
    let (fleet, calls) = fleet(&[
        ("small", "node-a", 1_000, false),
        ("large", "node-a", 100_000, false),
    ]);
    let mut svc = balancer(fleet);
    for i in 0..8 {
        let s = format!("k{i}");
        send(&mut svc, turn(Some(&s), 300, 300)).await;
        let res = send(&mut svc, turn(Some(&s), 600, 1_500)).await;
        assert_eq!(
            (res.status(), decision(&res).backend.as_str()),
            (StatusCode::OK, "large"),
            "{i}"
        );
    }
    assert!(calls[0].load(Ordering::Relaxed) > 0);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_refusal_that_no_backend_can_take_is_answered_as_it_came_without_a_retry() {
    let (fleet, calls) = fleet(&[("a", "node-a", 1_000, true), ("b", "node-b", 2_000, true)]);
    let mut svc = balancer(fleet);
    // Estimated short, 5,000 tokens by the backends' count: more than either takes.
    let res = send(&mut svc, turn(None, 300, 5_000)).await;
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    let refusal = res.extensions().get::<ContextRefusal>().cloned().unwrap();
    assert_eq!(refusal.prompt_tokens, 5_000);
    let refuser = refusal.backend.clone().unwrap();
    // The first answer, its decision the first placement's.
    let d = decision(&res);
    assert_eq!((d.backend.clone(), d.outcome), (refuser, Outcome::Keyless));
    assert!(res.headers().contains_key("x-served-by"));
    let body = text(res).await;
    assert!(body.contains("\"n_prompt_tokens\":5000"), "{body}");
    let total: usize = calls.iter().map(|c| c.load(Ordering::Relaxed)).sum();
    assert_eq!(total, 1, "not sent again");
    let stats = svc.get_ref().get_ref().stats();
    assert_eq!(stats.placed(), 1);
    assert_eq!((stats.refusals_retried, stats.refusals_answered), (1, 1));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_refusal_given_back_is_read_and_logged_once() {
    let logs = support_logs::capture(tracing::Level::DEBUG);
    let (fleet, calls) = fleet(&[("a", "node-a", 1_000, true), ("b", "node-b", 2_000, true)]);
    let mut svc = balancer(fleet);
    // More than either takes: refused once, and given back by the retry.
    let res = send(&mut svc, turn(None, 300, 5_000)).await;
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    let body = text(res).await;
    assert!(body.contains("\"n_prompt_tokens\":5000"), "{body}");
    let total: usize = calls.iter().map(|c| c.load(Ordering::Relaxed)).sum();
    assert_eq!(total, 1);
    let refused = "prompt refused as too long for the backend's context";
    assert_eq!(logs.count(&[refused]), 1, "{}", logs.text());
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn services_between_reading_refusals_and_the_balancer_keep_both_answers() {
    // A concurrency limit and a request's mapping between `ReadRefusals` and the balancer:
    // the balancer still answers a refusal no other backend takes with the refusal, and
    // retries one that fits elsewhere.
    let (fleet, calls) = fleet(&[("a", "node-a", 1_000, true), ("b", "node-b", 2_000, true)]);
    let affinity = SessionAffinityLayer::new().layer(fleet);
    let mapped = tower::ServiceBuilder::new()
        .concurrency_limit(8)
        .map_request(|mut req: Req| {
            req.headers_mut()
                .insert("x-mapped", http::HeaderValue::from_static("1"));
            req
        })
        .service(affinity);
    let mut svc = Retry::new(RetryOnce::new(), ReadRefusalsLayer::new().layer(mapped));
    let total = || {
        calls
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .sum::<usize>()
    };
    // 5,000 tokens by the backends' count: neither takes it.
    let res = send(&mut svc, turn(None, 300, 5_000)).await;
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    let refuser = res.extensions().get::<ContextRefusal>().cloned().unwrap();
    assert_eq!(Some(decision(&res).backend), refuser.backend);
    assert!(text(res).await.contains("\"n_prompt_tokens\":5000"));
    assert_eq!(total(), 1, "not sent again");
    // 1,500: `b` takes it, wherever it went first.
    let res = send(&mut svc, turn(None, 300, 1_500)).await;
    assert_eq!(
        (res.status(), decision(&res).backend.as_str()),
        (StatusCode::OK, "b")
    );
    assert!((2..=3).contains(&total()), "{}", total());
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn in_a_fleet_of_one_slot_context_a_refused_turn_stays_home_unretried() {
    let (fleet, calls) = fleet(&[("a", "node-a", 1_000, true), ("b", "node-b", 1_000, true)]);
    let mut svc = balancer(fleet);
    let home = decision(&send(&mut svc, turn(Some("s"), 300, 300)).await).backend;
    // Counted at 1,200 by the backends: neither takes it.
    let res = send(&mut svc, turn(Some("s"), 600, 1_200)).await;
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert_eq!(
        (decision(&res).backend, decision(&res).outcome),
        (home.clone(), Outcome::HomeHit)
    );
    let total = || {
        calls
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .sum::<usize>()
    };
    assert_eq!(total(), 2);
    // The conversation, compacted, is home again.
    let res = send(&mut svc, turn(Some("s"), 200, 200)).await;
    assert_eq!(
        (res.status(), decision(&res).backend),
        (StatusCode::OK, home)
    );
    assert_eq!(total(), 3);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_refused_request_continuing_a_response_stored_where_it_was_refused_is_not_retried() {
    let (fleet, calls) = fleet(&[
        ("small", "node-a", 1_000, true),
        ("large", "node-b", 100_000, true),
    ]);
    let mut svc = balancer(fleet);
    // A Responses request continuing a response `small` stored: it goes there whatever its
    // size, and a retry would go there again.
    let mut req = turn(None, 300, 1_500);
    let facts = req.extensions_mut().get_mut::<PromptFacts>().unwrap();
    facts.stored_on = Some("small".into());
    let res = send(&mut svc, req).await;
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert_eq!(decision(&res).backend.as_str(), "small");
    let count = |i: usize| calls[i].load(Ordering::Relaxed);
    assert_eq!((count(0), count(1)), (1, 0), "refused once, not sent again");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_refusal_teaches_a_backend_its_limit_where_none_was_known() {
    // Neither backend's limit is given (no health probe).
    let (fleet, calls) = fleet(&[
        ("small", "node-a", 1_000, false),
        ("large", "node-b", 100_000, false),
    ]);
    let mut svc = balancer(fleet);
    let limit = |svc: &Balancer, id: &str| {
        let all = svc.get_ref().get_ref().backends();
        all.into_iter()
            .find(|b| b.id.as_str() == id)
            .unwrap()
            .request_context_limit
    };
    svc.get_ref().get_ref().apply_discovery();
    assert_eq!(limit(&svc, "small"), None);
    // Prompts too long for `small` until one is sent there and refused.
    let mut i = 0;
    while calls[0].load(Ordering::Relaxed) == 0 {
        let res = send(&mut svc, turn(Some(&format!("s{i}")), 1_500, 1_500)).await;
        assert_eq!(res.status(), StatusCode::OK);
        i += 1;
        assert!(i < 16, "no prompt went to small");
    }
    assert_eq!(limit(&svc, "small"), Some(1_000), "the refusal's n_ctx");
    assert_eq!(limit(&svc, "large"), None);
    // From then on such prompts go to `large` at once, new conversations as well.
    let refused = calls[0].load(Ordering::Relaxed);
    for j in 0..8 {
        let res = send(&mut svc, turn(Some(&format!("t{j}")), 1_500, 1_500)).await;
        assert_eq!(decision(&res).backend.as_str(), "large");
    }
    assert_eq!(calls[0].load(Ordering::Relaxed), refused);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_refusal_is_retried_where_another_backends_context_is_not_known() {
    // `b`'s limit is not given: it may take the prompt, and is tried, until a refusal of its
    // own, retried, has told the balancer its limit.
    let (fleet, calls) = fleet(&[("a", "node-a", 1_000, true), ("b", "node-b", 2_000, false)]);
    let mut svc = balancer(fleet);
    let count = |i: usize| calls[i].load(Ordering::Relaxed);
    let on_a = homed_on(&mut svc, "a", "on-a-").await;
    let on_b = homed_on(&mut svc, "b", "on-b-").await;
    let long = |s: &str| turn(Some(s), 300, 5_000);
    // Refused by `a`, then by `b`: the answer is the retry's.
    let (a, b) = (count(0), count(1));
    let res = send(&mut svc, long(&on_a)).await;
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert_eq!(decision(&res).backend.as_str(), "b");
    assert_eq!((count(0), count(1)), (a + 1, b + 1), "retried on b");
    // Refused by `b` first: `a`'s limit is known to be too small, so not retried; and the
    // retried request has told the balancer `b`'s limit.
    let (a, b) = (count(0), count(1));
    let res = send(&mut svc, long(&on_b)).await;
    assert_eq!(decision(&res).backend.as_str(), "b");
    assert_eq!((count(0), count(1)), (a, b + 1), "not retried");
    // Another session homed on `a`: its refusal is the answer now.
    let on_a = homed_on(&mut svc, "a", "again-on-a-").await;
    let (a, b) = (count(0), count(1));
    let res = send(&mut svc, long(&on_a)).await;
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert_eq!(decision(&res).backend.as_str(), "a");
    assert_eq!((count(0), count(1)), (a + 1, b), "not retried on b");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn other_answers_pass_unread_and_unretried() {
    let (fleet, calls) = fleet(&[
        ("small", "node-a", 1_000, true),
        ("large", "node-b", 100_000, true),
    ]);
    let mut svc = balancer(fleet);
    // Another 400: its bytes reach the client, and it is not retried.
    let mut req = turn(None, 300, 300);
    req.headers_mut()
        .insert("x-other-400", http::HeaderValue::from_static("1"));
    let res = send(&mut svc, req).await;
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert!(res.extensions().get::<ContextRefusal>().is_none());
    assert!(text(res).await.contains("invalid_request_error"));
    let total = || {
        calls
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .sum::<usize>()
    };
    assert_eq!(total(), 1);
    // A refusal of unknown length is not read: it reaches the client as it came.
    let mut req = turn(None, 300, 200_000);
    req.headers_mut()
        .insert("x-chunked-400", http::HeaderValue::from_static("1"));
    let res = send(&mut svc, req).await;
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert!(res.extensions().get::<ContextRefusal>().is_none());
    assert!(text(res).await.contains("exceed_context_size_error"));
    assert_eq!(total(), 2);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_refusal_of_up_to_16_kib_is_read_and_a_longer_one_passes_unread() {
    let (fleet, calls) = fleet(&[
        ("small", "node-a", 1_000, true),
        ("large", "node-b", 100_000, true),
    ]);
    let mut svc = balancer(fleet);
    let padded = |session: &str, bytes: usize| {
        let mut req = turn(Some(session), 600, 1_500);
        let v = http::HeaderValue::from(bytes);
        req.headers_mut().insert("x-refusal-bytes", v);
        req
    };
    // A refusal of 16 KiB exactly is read, and its request retried where it fits.
    let session = homed_on(&mut svc, "small", "at-limit-").await;
    let before = calls[0].load(Ordering::Relaxed);
    let res = send(&mut svc, padded(&session, 16 * 1024)).await;
    assert_eq!(
        (res.status(), decision(&res).backend.as_str()),
        (StatusCode::OK, "large")
    );
    assert_eq!(calls[0].load(Ordering::Relaxed), before + 1, "refused once");
    // One byte longer, it is not read: it reaches the client as it came, unretried.
    let session = homed_on(&mut svc, "small", "past-limit-").await;
    let (small, large) = (
        calls[0].load(Ordering::Relaxed),
        calls[1].load(Ordering::Relaxed),
    );
    let res = send(&mut svc, padded(&session, 16 * 1024 + 1)).await;
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert!(res.extensions().get::<ContextRefusal>().is_none());
    let body = text(res).await;
    assert_eq!(body.len(), 16 * 1024 + 1);
    assert!(body.contains("exceed_context_size_error"));
    assert_eq!(
        (
            calls[0].load(Ordering::Relaxed),
            calls[1].load(Ordering::Relaxed)
        ),
        (small + 1, large)
    );
}

/// A `ReadRefusalsFuture` shows in its debug output which step it is at.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_read_refusals_future_names_its_step_in_its_debug_output() {
    let (fleet, _) = fleet(&[("a", "node-a", 1_000, true)]);
    let mut svc = ReadRefusalsLayer::new().layer(SessionAffinityLayer::new().layer(fleet));
    let fut = svc.ready().await.unwrap().call(turn(None, 300, 300));
    assert_eq!(
        format!("{fut:?}"),
        r#"ReadRefusalsFuture { state: "call" }"#
    );
    assert_eq!(fut.await.unwrap().status(), StatusCode::OK);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_refusal_whose_body_fails_is_the_backends_failure() {
    let (fleet, _) = fleet(&[("small", "node-a", 1_000, true)]);
    let affinity = SessionAffinityLayer::new().layer(fleet);
    let mut svc = ReadRefusalsLayer::new().layer(affinity.clone());
    let mut req = turn(None, 300, 5_000);
    req.headers_mut()
        .insert("x-broken-400", http::HeaderValue::from_static("1"));
    let err = svc.ready().await.unwrap().call(req).await.unwrap_err();
    match err {
        Error::Backend {
            backend, source, ..
        } => {
            assert_eq!(backend.as_str(), "small");
            assert!(source.to_string().contains("connection reset"), "{source}");
        }
        e => panic!("{e:?}"),
    }
    assert_eq!(affinity.stats().in_flight, 0, "the slot is free again");
}

/// A `400` whose body fails while `ReadRefusals` reads it is a failure of its backend, which
/// `RetryOnce` retries: the backend is passed over for the failure cooldown, as one that
/// failed before answering is, so that the retry does not go back to it.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_refusal_whose_body_fails_marks_its_backend_down_and_the_retry_goes_elsewhere() {
    let (fleet, calls) = fleet(&[
        ("small", "node-a", 1_000, false),
        ("large", "node-b", 100_000, false),
    ]);
    let affinity = SessionAffinityLayer::new().layer(fleet);
    let mut svc = Retry::new(
        RetryOnce::new(),
        ReadRefusalsLayer::new().layer(affinity.clone()),
    );
    let session = homed_on(&mut svc, "small", "f").await;
    let before = calls[0].load(Ordering::Relaxed);
    let errors = affinity.stats().backend_errors;
    let mut req = turn(Some(&session), 600, 1_500);
    req.headers_mut()
        .insert("x-broken-400", http::HeaderValue::from_static("1"));
    let res = svc.ready().await.unwrap().call(req).await;
    let res = res.expect("the retry is answered elsewhere");
    assert_eq!(
        (res.status(), decision(&res).backend.as_str()),
        (StatusCode::OK, "large")
    );
    assert_eq!(
        calls[0].load(Ordering::Relaxed),
        before + 1,
        "small tried once"
    );
    let small = affinity
        .backends()
        .into_iter()
        .find(|b| b.id.as_str() == "small")
        .unwrap();
    assert!(!small.healthy, "{small:?}");
    assert_eq!((small.failures, small.cut_answers), (1, 0), "{small:?}");
    assert_eq!(affinity.stats().backend_errors, errors + 1);
    // Up again after the cooldown.
    tokio::time::sleep(std::time::Duration::from_secs(6)).await;
    assert!(affinity.backends().iter().all(|b| b.healthy));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_refusal_names_its_backend_from_the_decision_kept_in_the_body() {
    let (fleet, _) = fleet(&[
        ("small", "node-a", 1_000, false),
        ("large", "node-a", 100_000, false),
    ]);
    let affinity = SessionAffinityLayer::new()
        .decision_extension(false)
        .layer(fleet);
    let mut svc = ReadRefusalsLayer::new().layer(affinity);
    for i in 0..8 {
        let res = send(&mut svc, turn(Some(&format!("d{i}")), 600, 1_500)).await;
        if res.status() != StatusCode::BAD_REQUEST {
            continue;
        }
        let refusal = res.extensions().get::<ContextRefusal>().cloned().unwrap();
        assert_eq!(refusal.backend.as_ref().map(|b| b.as_str()), Some("small"));
        assert_eq!(
            (refusal.prompt_tokens, refusal.context_tokens),
            (1_500, 1_000)
        );
        // The body keeps its decision, and its bytes.
        let body = res.into_body();
        assert_eq!(body.decision().map(|d| d.backend.as_str()), Some("small"));
        let bytes = body.collect().await.unwrap().to_bytes();
        assert!(ContextRefusal::from_body(&bytes).is_some());
        return;
    }
    panic!("no request went to the small backend");
}

#[test]
fn vllms_and_sglangs_refusals_are_read_from_their_words() {
    let refusals = [
        // vLLM, in its versions' words.
        (
            r#"{"object":"error","message":"This model's maximum context length is 32768 tokens. However, you requested 40000 tokens (39000 in the messages, 1000 in the completion). Please reduce the length of the messages or completion.","type":"BadRequestError","param":null,"code":400}"#,
            32_768,
        ),
        (
            r#"{"error":{"message":"This model's maximum context length is 8192 tokens. However, your request has 9000 input tokens. Please reduce the length of the input messages.","type":"BadRequestError","param":null,"code":400}}"#,
            8_192,
        ),
        (
            r#"{"error":{"message":"The decoder prompt (length 5000) is longer than the maximum model length of 4096. Make sure that `max_model_len` is no smaller than the number of text tokens.","type":"BadRequestError","code":400}}"#,
            4_096,
        ),
        // SGLang.
        (
            r#"{"object":"error","message":"The input (150000 tokens) is longer than the model's context length (131072 tokens).","type":"BadRequestError","param":null,"code":400}"#,
            131_072,
        ),
        (
            r#"{"object":"error","message":"Requested token count exceeds the model's maximum context length of 4096 tokens. You requested a total of 5000 tokens","type":"BadRequestError","code":400}"#,
            4_096,
        ),
    ];
    for (body, context) in refusals {
        assert_eq!(
            ContextRefusal::from_body(body.as_bytes()),
            Some(ContextRefusal::new(context, context)),
            "{body}"
        );
    }
    for body in [
        r#"{"object":"error","message":"'messages' is required","type":"BadRequestError","code":400}"#,
        r#"{"error":{"message":"context length exceeded","type":"BadRequestError"}}"#,
        r#"{"error":{"message":"the context length is not what 12 people said","type":"x"}}"#,
        r#"{"message":"maximum context length is 0 tokens"}"#,
    ] {
        assert_eq!(ContextRefusal::from_body(body.as_bytes()), None, "{body}");
    }
}

#[test]
fn llama_servers_refusal_is_read_from_its_fields() {
    let refusal = br#"{"error":{"code":400,"message":"request (256 tokens) exceeds the available context size (256 tokens), try increasing it","type":"exceed_context_size_error","n_prompt_tokens":256,"n_ctx":256}}"#;
    assert_eq!(
        ContextRefusal::from_body(refusal),
        Some(ContextRefusal::new(256, 256))
    );
    for body in [
        &br#"{"error":{"type":"exceed_context_size_error","n_prompt_tokens":256}}"#[..],
        br#"{"error":{"type":"exceed_context_size_error","n_prompt_tokens":0,"n_ctx":256}}"#,
        br#"{"error":{"type":"exceed_context_size_error","n_prompt_tokens":"256","n_ctx":256}}"#,
        br#"{"error":{"type":"invalid_request_error","n_prompt_tokens":256,"n_ctx":256}}"#,
        br#"{"type":"exceed_context_size_error","n_prompt_tokens":256,"n_ctx":256}"#,
        br#"{"error":{"type":"exceed_context_size_error","message":"context length (256 tokens)"}}"#,
        br#"{"error":"exceed_context_size_error"}"#,
        b"request too long",
        b"",
    ] {
        assert_eq!(
            ContextRefusal::from_body(body),
            None,
            "{}",
            String::from_utf8_lossy(body)
        );
    }
}

/// A session homed on the backend `name` (by its first turn, estimated and counted at 300).
async fn homed_on(svc: &mut Balancer, name: &str, prefix: &str) -> String {
    for i in 0..64 {
        let s = format!("{prefix}{i}");
        let res = send(svc, turn(Some(&s), 300, 300)).await;
        if decision(&res).backend.as_str() == name {
            return s;
        }
    }
    panic!("no session homed on {name}");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_refusal_passes_over_another_backend_whose_limit_its_count_reaches() {
    // Two small backends on one node (the second a little larger), a large one on another.
    let (fleet, calls) = fleet(&[
        ("small-a", "node-a", 1_000, true),
        ("small-b", "node-a", 1_200, true),
        ("large", "node-b", 100_000, true),
    ]);
    let mut svc = balancer(fleet);
    let session = homed_on(&mut svc, "small-a", "t").await;
    let before = calls[1].load(Ordering::Relaxed);
    // Estimated at 600 (under either small backend's limit), 1,500 by the count of the one
    // that refused it: the other small one, larger than the refuser, would refuse it too,
    // and is passed over.
    let res = send(&mut svc, turn(Some(&session), 600, 1_500)).await;
    assert_eq!(
        (res.status(), decision(&res).backend.as_str()),
        (StatusCode::OK, "large")
    );
    assert_eq!(
        calls[1].load(Ordering::Relaxed),
        before,
        "small-b not tried"
    );
}

/// Sends `req` while `held`, an answer not yet read, keeps the large backend's one slot: it is
/// not answered within a second, and once `held` is dropped the large backend answers it.
async fn answered_by_large_once_freed(svc: &mut Balancer, req: Req, held: Res) {
    let mut task = Box::pin(async {
        let res = send(svc, req).await;
        (res.status(), decision(&res).backend, text(res).await)
    });
    tokio::select! {
        _ = &mut task => panic!("answered while the large backend was full"),
        () = tokio::time::sleep(std::time::Duration::from_secs(1)) => {}
    }
    drop(held);
    let (status, backend, body) = task.await;
    assert_eq!(
        (status, backend.as_str(), body.as_str()),
        (StatusCode::OK, "large", "large")
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_refused_retry_that_waits_for_a_slot_keeps_its_refusal_when_woken() {
    let (fleet, calls) = fleet(&[
        ("small", "node-a", 1_000, true),
        ("large", "node-b", 100_000, true),
    ]);
    let affinity = waiting(fleet);
    let mut svc = Retry::new(
        RetryOnce::new(),
        ReadRefusalsLayer::new().layer(affinity.clone()),
    );
    let session = homed_on(&mut svc, "small", "w").await;
    // The large backend's one slot is held by an answer not yet read.
    let held = send(&mut svc, turn(None, 5_000, 5_000)).await;
    assert_eq!(decision(&held).backend.as_str(), "large");
    let before = calls[0].load(Ordering::Relaxed);
    // Refused at home; its retry waits for the large backend, not for the small one that
    // refused it (free all along).
    answered_by_large_once_freed(&mut svc, turn(Some(&session), 600, 1_500), held).await;
    assert_eq!(calls[0].load(Ordering::Relaxed), before + 1, "refused once");
    let stats = affinity.stats();
    assert_eq!(stats.in_flight, 0);
    // Counted once, though it looked again each time a slot freed.
    assert_eq!((stats.refusals_retried, stats.refusals_answered), (1, 0));
    assert_eq!(stats.waited, 1);
}

/// Every call of the balancer is exactly one of: placed (by outcome), rejected, refused for
/// want of a backend, abandoned, or answered with a kept refusal.
fn accounted(s: &tower_affinity::Stats) -> u64 {
    s.placed() + s.rejected + s.no_backends + s.abandoned + s.refusals_answered
}

/// Counts the calls that reach the balancer.
fn counting(n: &Arc<AtomicUsize>) -> impl Fn(Req) -> Req + Clone {
    let n = Arc::clone(n);
    move |req| {
        n.fetch_add(1, Ordering::Relaxed);
        req
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn tower_services_between_keep_the_refusal_where_the_refuser_is_the_only_backend_up() {
    // `b` would take the prompt, but it is down: `a`, the only backend up, refuses it, and
    // the client gets that refusal once, through a buffer, a concurrency limit and a mapping.
    let (fleet, calls) = fleet(&[("a", "node-a", 1_000, true), ("b", "node-b", 2_000, true)]);
    let affinity = SessionAffinityLayer::new().layer(fleet);
    affinity.apply_discovery();
    assert!(affinity.mark_down("b", None));
    let reached = Arc::new(AtomicUsize::new(0));
    let between = tower::ServiceBuilder::new()
        .map_err(|e: BoxError| match e.downcast::<Error>() {
            Ok(e) => *e,
            Err(e) => Error::backend("buffer", e),
        })
        .buffer(8)
        .concurrency_limit(4)
        .map_request(counting(&reached))
        .service(affinity.clone());
    let mut svc = Retry::new(RetryOnce::new(), ReadRefusalsLayer::new().layer(between));
    let res = send(&mut svc, turn(Some("s"), 300, 1_500)).await;
    let d = decision(&res);
    assert_eq!(
        (res.status(), d.backend.as_str(), d.outcome),
        (StatusCode::BAD_REQUEST, "a", Outcome::NewSession)
    );
    let body = text(res).await;
    assert!(body.contains("\"n_prompt_tokens\":1500"), "{body}");
    let sent: Vec<_> = calls.iter().map(|c| c.load(Ordering::Relaxed)).collect();
    assert_eq!(sent, [1, 0], "refused once, sent nowhere else");
    let stats = affinity.stats();
    assert_eq!(
        reached.load(Ordering::Relaxed),
        2,
        "the retry reaches the balancer"
    );
    assert_eq!((stats.refusals_retried, stats.refusals_answered), (1, 1));
    assert_eq!(accounted(&stats), 2, "{stats:?}");
    assert_eq!((stats.in_flight, stats.waiting), (0, 0));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_refused_retry_waiting_for_a_slot_is_answered_with_its_refusal_once_none_else_takes_it() {
    // The retry waits for `large`, full; `large` goes down meanwhile: no other backend takes
    // the prompt now, and the waiting retry is answered with `small`'s refusal. Its place in
    // the queue is given up, no slot is left taken, and the calls add up.
    let (fleet, calls) = fleet(&[
        ("small", "node-a", 1_000, true),
        ("large", "node-b", 100_000, true),
    ]);
    let affinity = waiting(fleet);
    let reached = Arc::new(AtomicUsize::new(0));
    let counted = tower::ServiceBuilder::new()
        .map_request(counting(&reached))
        .service(affinity.clone());
    let mut svc = Retry::new(RetryOnce::new(), ReadRefusalsLayer::new().layer(counted));
    let held = send(&mut svc, turn(None, 5_000, 5_000)).await;
    assert_eq!(decision(&held).backend.as_str(), "large");
    let small_before = calls[0].load(Ordering::Relaxed);
    let mut task = Box::pin(async {
        let res = send(&mut svc, turn(Some("w"), 600, 1_500)).await;
        (res.status(), decision(&res), text(res).await)
    });
    tokio::select! {
        _ = &mut task => panic!("answered while the large backend was full and up"),
        () = tokio::time::sleep(std::time::Duration::from_secs(1)) => {}
    }
    assert_eq!(affinity.stats().waiting, 1);
    assert!(affinity.mark_down("large", None));
    let (status, d, body) = task.await;
    assert_eq!(
        (status, d.backend.as_str(), d.outcome),
        (StatusCode::BAD_REQUEST, "small", Outcome::NewSession)
    );
    assert!(body.contains("\"n_prompt_tokens\":1500"), "{body}");
    assert_eq!(calls[0].load(Ordering::Relaxed), small_before + 1);
    drop(held);
    let stats = affinity.stats();
    assert_eq!((stats.waiting, stats.in_flight), (0, 0), "{stats:?}");
    assert_eq!((stats.refusals_retried, stats.refusals_answered), (1, 1));
    assert_eq!(stats.abandoned, 0);
    assert_eq!(
        accounted(&stats),
        reached.load(Ordering::Relaxed) as u64,
        "{stats:?}"
    );
    // `small`'s slot is free: a turn that fits takes it at once.
    let res = send(&mut svc, turn(Some("w"), 300, 300)).await;
    assert_eq!(
        (res.status(), decision(&res).backend.as_str()),
        (StatusCode::OK, "small")
    );
}

/// A shared store that knows no home: every read answers at once, missing.
#[derive(Debug)]
struct EmptyStore;

impl tower_affinity::store::HomeStore for EmptyStore {
    fn read(
        &self,
        _: tower_affinity::key::SessionKey,
        _: std::time::Duration,
    ) -> tower_affinity::store::ReadHome {
        Box::pin(async { Ok(tower_affinity::store::Lookup::Missing) })
    }

    fn write(
        &self,
        _: tower_affinity::key::SessionKey,
        _: tower_affinity::store::StoredHome,
        _: std::time::Duration,
    ) -> tower_affinity::store::WriteHome {
        Box::pin(async { Ok(()) })
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn with_a_shared_store_a_refusal_no_other_backend_takes_is_answered_after_the_read() {
    let (fleet, calls) = fleet(&[("a", "node-a", 1_000, true), ("b", "node-b", 1_000, true)]);
    let affinity = SessionAffinityLayer::new()
        .home_store(EmptyStore)
        .layer(fleet);
    let mut svc = Retry::new(
        RetryOnce::new(),
        ReadRefusalsLayer::new().layer(affinity.clone()),
    );
    let res = send(&mut svc, turn(Some("s"), 300, 1_500)).await;
    let first = decision(&res).backend;
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    let total: usize = calls.iter().map(|c| c.load(Ordering::Relaxed)).sum();
    assert_eq!(total, 1, "refused by {first} only");
    let stats = affinity.stats();
    assert_eq!((stats.refusals_answered, stats.abandoned), (1, 0));
    assert_eq!(accounted(&stats), 2, "{stats:?}");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_waiting_retry_answered_when_woken_for_a_slot_passes_that_slot_on() {
    // `small` (1,000, two slots) and `large` (limit not known, one slot, held). The retry of
    // a turn `small` refused waits for `large`; so does a keyless turn too long for `small`.
    // Another refusal, by `large` this time, teaches the balancer `large`'s limit (1,200), so
    // that nothing but `small` could take the first turn now. A slot freed on `small` wakes
    // the retry (its home is there): it is answered with its refusal, and the slot goes on
    // to the other waiter, which takes it (any size, as nothing is large enough).
    let calls: Vec<Arc<AtomicUsize>> = vec![Arc::default(), Arc::default()];
    let fleet = StaticFleet::new([
        (
            "small",
            Backend::new("node-a", llama("small", 1_000, Arc::clone(&calls[0])))
                .slots(NonZeroU32::new(2).unwrap())
                .request_context_tokens(NonZeroU64::new(1_000).unwrap()),
        ),
        (
            "large",
            Backend::new("node-b", llama("large", 2_000, Arc::clone(&calls[1])))
                .slots(NonZeroU32::new(1).unwrap()),
        ),
    ]);
    let affinity = waiting(fleet);
    let svc = Retry::new(
        RetryOnce::new(),
        ReadRefusalsLayer::new().layer(affinity.clone()),
    );
    let held = send(&mut svc.clone(), turn(None, 1_500, 300)).await;
    assert_eq!(decision(&held).backend.as_str(), "large");
    let mut s = svc.clone();
    let mut retry = tokio_test::task::spawn(async move {
        let res = send(&mut s, turn(Some("r"), 300, 1_500)).await;
        (res.status(), decision(&res).backend)
    });
    assert!(retry.poll().is_pending());
    let mut s = svc.clone();
    let mut other = tokio_test::task::spawn(async move {
        let res = send(&mut s, turn(None, 1_200, 900)).await;
        (res.status(), decision(&res).backend)
    });
    assert!(other.poll().is_pending());
    assert_eq!(affinity.stats().waiting, 2, "{:?}", affinity.stats());
    // A refusal by `large`, read elsewhere: `large` takes 1,200 at most.
    let mut x = turn(None, 300, 300);
    x.extensions_mut()
        .insert(ContextRefusal::new(5_000, 1_200).by("large"));
    let x = affinity.clone().oneshot(x).await.unwrap();
    assert_eq!(decision(&x).backend.as_str(), "small");
    assert!(!retry.is_woken() && !other.is_woken());
    drop(x);
    assert!(retry.is_woken(), "the retry is woken for the freed slot");
    let Poll::Ready((status, backend)) = retry.poll() else {
        panic!("the retry not answered");
    };
    assert_eq!(
        (status, backend.as_str()),
        (StatusCode::BAD_REQUEST, "small")
    );
    assert!(
        other.is_woken(),
        "the slot is passed on to the other waiter"
    );
    let Poll::Ready((status, backend)) = other.poll() else {
        panic!("the other waiter not placed");
    };
    assert_eq!((status, backend.as_str()), (StatusCode::OK, "small"));
    drop(held);
    let stats = affinity.stats();
    assert_eq!(
        (stats.waiting, stats.in_flight, stats.abandoned),
        (0, 0, 0),
        "{stats:?}"
    );
    // The retry and the request carrying `large`'s refusal, which was placed.
    assert_eq!(
        (stats.refusals_retried, stats.refusals_answered),
        (2, 1),
        "{stats:?}"
    );
    // `held`, the turn and its retry, the other waiter, the request carrying a refusal.
    assert_eq!(accounted(&stats), 5, "{stats:?}");
    assert_eq!(
        calls[1].load(Ordering::Relaxed),
        1,
        "large served `held` only"
    );
}

/// A shared store whose reads never answer (its deadline is far off).
#[derive(Debug)]
struct SilentStore;

impl tower_affinity::store::HomeStore for SilentStore {
    fn read(
        &self,
        _: tower_affinity::key::SessionKey,
        _: std::time::Duration,
    ) -> tower_affinity::store::ReadHome {
        Box::pin(std::future::pending())
    }

    fn write(
        &self,
        _: tower_affinity::key::SessionKey,
        _: tower_affinity::store::StoredHome,
        _: std::time::Duration,
    ) -> tower_affinity::store::WriteHome {
        Box::pin(async { Ok(()) })
    }
}

/// A request carrying a backend's refusal, as `RetryOnce` sends it again.
fn retried(session: Option<&str>) -> Req {
    let mut req = turn(session, 600, 1_500);
    req.extensions_mut()
        .insert(ContextRefusal::new(1_500, 1_000).by("small"));
    req
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_refused_retry_is_counted_retried_however_it_ends() {
    // Sent again to a fleet that has no backend left: refused for want of one, and a retry.
    let empty: StaticFleet<Mock> = StaticFleet::new(std::iter::empty::<(&str, Backend<Mock>)>());
    let affinity = SessionAffinityLayer::new().layer(empty);
    let err = affinity
        .clone()
        .oneshot(retried(Some("s")))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::NoBackends { .. }), "{err:?}");
    let stats = affinity.stats();
    assert_eq!(
        (stats.no_backends, stats.refusals_retried),
        (1, 1),
        "{stats:?}"
    );
    // Given up on while the shared store is read: abandoned, and a retry.
    let (fleet, _) = fleet(&[("small", "node-a", 1_000, true)]);
    let affinity = SessionAffinityLayer::new()
        .home_store(SilentStore)
        .store_deadline(std::time::Duration::from_secs(3600))
        .layer(fleet);
    let mut svc = affinity.clone();
    svc.ready().await.unwrap();
    let mut fut = tokio_test::task::spawn(svc.call(retried(Some("s"))));
    assert!(fut.poll().is_pending());
    drop(fut);
    let stats = affinity.stats();
    assert_eq!(
        (stats.abandoned, stats.refusals_retried),
        (1, 1),
        "{stats:?}"
    );
}

/// `ReadRefusals` is made and taken apart as tower's and tower-http's middleware are, and as
/// `ErrorToResponse` is: a layer from the type, and the balancer back by reference, mutably
/// and whole.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn read_refusals_gives_its_balancer_back() {
    let (fleet, _) = fleet(&[("a", "node-a", 1_000, true)]);
    let mut svc = tower::ServiceBuilder::new()
        .layer(tower_affinity::ErrorToResponse::<Affinity>::layer())
        .layer(ReadRefusals::<Affinity>::layer())
        .service(SessionAffinityLayer::new().layer(fleet));
    let res = svc.ready().await.unwrap().call(turn(None, 300, 5_000));
    assert_eq!(res.await.unwrap().status(), StatusCode::BAD_REQUEST);
    let read: &mut ReadRefusals<Affinity> = svc.get_mut();
    assert_eq!(read.get_mut().stats().placed(), 1);
    let affinity: Affinity = svc.into_inner().into_inner();
    assert_eq!(affinity.stats().placed(), 1);
}

/// Offers only the backend that refused the request's prompt, if it carries a refusal by a
/// backend named; else places as `NodeThenBackend` does.
#[derive(Clone, Debug, Default)]
struct OnlyTheRefuser(tower_affinity::placement::NodeThenBackend);

impl tower_affinity::placement::Placement for OnlyTheRefuser {
    fn place(
        &self,
        fleet: &tower_affinity::placement::FleetView<'_>,
        req: &tower_affinity::placement::PlacementRequest<'_>,
        c: &mut tower_affinity::placement::Candidates<'_>,
    ) {
        let refuser = req.extensions.get::<ContextRefusal>();
        let Some(refuser) = refuser.and_then(|r| r.backend.clone()) else {
            return self.0.place(fleet, req, c);
        };
        if let Some(b) = fleet.backends().find(|b| *b.id() == refuser) {
            let _ = c.offer(b);
        }
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_refusal_that_does_not_say_its_context_is_placed_as_one_that_does() {
    // A policy that offers only the refuser, which is too small while another backend takes
    // the prompt: passed over, nothing offered takes the prompt, so the request is placed as
    // if no backend had a limit, and the refuser answers it as it did before.
    for context in [1_000, 0] {
        let (fleet, calls) = fleet(&[
            ("small", "node-a", 1_000, false),
            ("large", "node-b", 100_000, false),
        ]);
        let mut svc = SessionAffinityLayer::new()
            .placement(OnlyTheRefuser::default())
            .layer(fleet);
        let mut req = turn(Some("s"), 600, 1_500);
        req.extensions_mut()
            .insert(ContextRefusal::new(1_500, context).by("small"));
        let res = svc.ready().await.unwrap().call(req).await;
        let res = res.unwrap_or_else(|e| panic!("context {context}: {e:?}"));
        assert_eq!(
            (res.status(), decision(&res).backend.as_str()),
            (StatusCode::BAD_REQUEST, "small"),
            "context {context}"
        );
        assert_eq!(calls[0].load(Ordering::Relaxed), 1, "context {context}");
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_refused_request_continuing_a_response_stored_on_a_backend_down_is_retried_where_it_fits()
{
    let (fleet, calls) = fleet(&[
        ("small", "node-a", 1_000, true),
        ("large", "node-b", 100_000, true),
        ("stored", "node-c", 100_000, true),
    ]);
    let affinity = waiting(fleet);
    affinity.apply_discovery();
    assert!(affinity.mark_down("stored", None));
    let mut svc = Retry::new(
        RetryOnce::new(),
        ReadRefusalsLayer::new().layer(affinity.clone()),
    );
    // The large backend's one slot is held by an answer not yet read.
    let held = send(&mut svc, turn(None, 5_000, 5_000)).await;
    assert_eq!(decision(&held).backend.as_str(), "large");
    // A request continuing a response `stored` stored: that backend is down, so it is placed
    // around it, on `small`, which refuses it. Its retry is not held to where the response
    // is stored, nor to the refuser: it waits for `large`, which takes it.
    let mut req = turn(None, 300, 1_500);
    let facts = req.extensions_mut().get_mut::<PromptFacts>().unwrap();
    facts.stored_on = Some("stored".into());
    answered_by_large_once_freed(&mut svc, req, held).await;
    let sent: Vec<_> = calls.iter().map(|c| c.load(Ordering::Relaxed)).collect();
    assert_eq!(sent, [1, 2, 0], "refused once on small, then sent to large");
    let stats = affinity.stats();
    assert_eq!((stats.refusals_retried, stats.refusals_answered), (1, 0));
}
