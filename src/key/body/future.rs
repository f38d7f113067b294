//! [`BodyKeyFuture`]: reads the body, then calls the inner service.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{header, HeaderValue, StatusCode};
use http_body::Body;
use http_body_util::Full;
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};
use tower::util::Oneshot;
use tower::Service;

use super::ask::{self, UsageStrip};
use super::inspect::Config;
use super::responses::IdSniffer;
use super::BodyKeyResponseBody;
use crate::body::InnerOrBytes;
use crate::{BoxError, Decision};

// === Buffer ===

/// A request body as it arrives. The first chunk is kept as it came, so a body that arrives
/// in one chunk (most do) is neither copied nor reallocated; later chunks are copied after it.
#[derive(Debug)]
struct Buffer {
    first: Option<Bytes>,
    rest: BytesMut,
    /// What to reserve for `rest` once a second chunk arrives.
    capacity: usize,
}

impl Buffer {
    fn new(capacity: usize) -> Self {
        Buffer {
            first: None,
            rest: BytesMut::new(),
            capacity,
        }
    }

    fn len(&self) -> usize {
        self.first.as_ref().map_or(0, Bytes::len) + self.rest.len()
    }

    fn push(&mut self, mut data: impl Buf) {
        let n = data.remaining();
        if n == 0 {
            return;
        }
        if self.first.is_none() && self.rest.is_empty() {
            // Free for `Bytes` (hyper's chunks): a new handle on the same memory.
            self.first = Some(data.copy_to_bytes(n));
            return;
        }
        if let Some(first) = self.first.take() {
            self.rest.reserve(self.capacity.max(first.len() + n));
            self.rest.put(first);
        }
        self.rest.put(data);
    }

    fn take(&mut self) -> Bytes {
        match self.first.take() {
            Some(first) => first,
            None => std::mem::take(&mut self.rest).freeze(),
        }
    }
}

// === BodyKeyFuture ===

/// Why a request was answered without reaching the inner service.
#[derive(Debug)]
pub(super) enum Rejection {
    TooLarge(usize),
    Timeout(Duration),
    Read(BoxError),
}

/// Whether `e`, or an error in its source chain, is `http_body_util`'s body length limit.
fn over_a_limit(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(e);
    while let Some(e) = next {
        if e.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        next = e.source();
    }
    false
}

impl Rejection {
    fn into_response<B>(self) -> http::Response<BodyKeyResponseBody<B>> {
        let (status, message) = match self {
            Rejection::TooLarge(limit) => (
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("request body is larger than the limit of {limit} bytes"),
            ),
            Rejection::Timeout(t) => (
                StatusCode::REQUEST_TIMEOUT,
                format!("request body did not arrive within {} s", t.as_secs_f64()),
            ),
            // A limit of a layer outside this one (tower-http's `RequestBodyLimitLayer`, on a
            // body without a `Content-Length`) is the client's to hear as 413, as axum's
            // extractors answer it.
            Rejection::Read(e) if over_a_limit(&*e) => (
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("request body is larger than the limit: {e}"),
            ),
            Rejection::Read(e) => (
                StatusCode::BAD_REQUEST,
                format!("failed to read the request body: {e}"),
            ),
        };
        let body = crate::Error::json_body(status, &message);
        let mut res = http::Response::new(BodyKeyResponseBody::bytes(body));
        *res.status_mut() = status;
        res.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        res
    }
}

pin_project! {
    /// The response future of [`BodyKey`]: reads the body, then calls the inner service.
    ///
    /// ```
    /// use bytes::Bytes;
    /// use http_body_util::Full;
    /// use tower::Service;
    /// use tower_affinity::key::{BodyKey, BodyKeyFuture};
    ///
    /// fn call<S>(svc: &mut BodyKey<S>, req: http::Request<String>) -> BodyKeyFuture<S, String>
    /// where
    ///     S: Service<http::Request<Full<Bytes>>, Response = http::Response<String>> + Clone,
    /// {
    ///     svc.call(req)
    /// }
    /// # let _ = call::<tower::util::BoxCloneSyncService<http::Request<Full<Bytes>>, http::Response<String>, std::convert::Infallible>>;
    /// ```
    pub struct BodyKeyFuture<S, B>
    where
        S: Service<http::Request<Full<Bytes>>>,
    {
        #[pin]
        state: State<S, B>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, B>
    where
        S: Service<http::Request<Full<Bytes>>>,
    {
        Reading {
            #[pin]
            body: B,
            buf: Buffer,
            parts: Option<http::request::Parts>,
            service: Option<S>,
            config: Arc<Config>,
            // When the call was made, if there is a read timeout.
            started: Option<Instant>,
            // Set at the first poll that finds the body incomplete.
            deadline: Option<Pin<Box<Sleep>>>,
        },
        Calling {
            #[pin]
            fut: Oneshot<S, http::Request<Full<Bytes>>>,
            // A Responses API request: its answer's id is read as the answer passes.
            sniff: Option<Box<IdSniffer>>,
            // A stream asked for its usage on the client's behalf: the usage chunk is taken
            // out of the answer.
            strip: Option<Box<UsageStrip>>,
        },
        Rejected {
            rejection: Option<Rejection>,
        },
    }
}

impl<S, B> BodyKeyFuture<S, B>
where
    S: Service<http::Request<Full<Bytes>>>,
{
    /// Reads `body`, then calls `service` with it.
    pub(super) fn read(
        service: S,
        config: Arc<Config>,
        parts: http::request::Parts,
        body: B,
        declared: u64,
    ) -> Self {
        // A declared length is a claim, not bytes: reserve a little up front and let the
        // buffer grow as data arrives, so idle clients cannot pin memory by announcing size.
        const UP_FRONT: usize = 64 * 1024;
        let capacity = usize::try_from(declared)
            .unwrap_or(0)
            .min(config.limit)
            .min(UP_FRONT);
        // The timer itself is only set if the body is not all there at the first poll.
        let started = config.read_timeout.map(|_| Instant::now());
        BodyKeyFuture {
            state: State::Reading {
                body,
                buf: Buffer::new(capacity),
                parts: Some(parts),
                service: Some(service),
                config,
                started,
                deadline: None,
            },
        }
    }

    pub(super) fn reject(rejection: Rejection) -> Self {
        BodyKeyFuture {
            state: State::Rejected {
                rejection: Some(rejection),
            },
        }
    }
}

impl<S, B, ResB> Future for BodyKeyFuture<S, B>
where
    S: Service<http::Request<Full<Bytes>>, Response = http::Response<ResB>>,
    B: Body,
    B::Error: Into<BoxError>,
{
    type Output = Result<http::Response<BodyKeyResponseBody<ResB>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut state = self.project().state;
        loop {
            match state.as_mut().project() {
                StateProj::Reading {
                    mut body,
                    buf,
                    parts,
                    service,
                    config,
                    started,
                    deadline,
                } => {
                    let rejection = loop {
                        match body.as_mut().poll_frame(cx) {
                            Poll::Ready(Some(Ok(frame))) => {
                                let Ok(data) = frame.into_data() else {
                                    continue;
                                };
                                if buf.len().saturating_add(data.remaining()) > config.limit {
                                    break Some(Rejection::TooLarge(config.limit));
                                }
                                buf.push(data);
                            }
                            Poll::Ready(Some(Err(e))) => break Some(Rejection::Read(e.into())),
                            Poll::Ready(None) => break None,
                            Poll::Pending => {
                                let (Some(timeout), Some(started)) =
                                    (config.read_timeout, *started)
                                else {
                                    return Poll::Pending;
                                };
                                let d = deadline.get_or_insert_with(|| {
                                    Box::pin(match started.checked_add(timeout) {
                                        Some(at) => tokio::time::sleep_until(at),
                                        // Past what the clock can tell: tokio's far future.
                                        None => tokio::time::sleep(timeout),
                                    })
                                });
                                ready!(d.as_mut().poll(cx));
                                break Some(Rejection::Timeout(timeout));
                            }
                        }
                    };
                    if let Some(rejection) = rejection {
                        state.set(State::Rejected {
                            rejection: Some(rejection),
                        });
                        continue;
                    }
                    let (Some(mut parts), Some(service)) = (parts.take(), service.take()) else {
                        panic!("BodyKeyFuture polled after completion");
                    };
                    let mut bytes = buf.take();
                    let (mut sniff, mut strip) = (None, None);
                    // A Responses API request: its answer's id may be remembered, and its body
                    // is read for the stored response it names, whatever its headers say.
                    let responses = parts.uri.path().ends_with("/responses");
                    if config.reads(&parts.headers, responses) {
                        let inspected = config.inspect_request(&bytes);
                        let facts = inspected.facts;
                        if let Some(key) = inspected.key {
                            parts.extensions.insert(key);
                        }
                        let known = !facts.chain.is_empty();
                        // An answer not stored can never be continued: remembering it would
                        // only push out those that can.
                        if (known || inspected.continues.is_some())
                            && !inspected.unstored
                            && responses
                        {
                            // What the answer's id will stand for: this prompt, unless it
                            // continues a conversation not known here.
                            let chain = known.then(|| facts.chain.clone());
                            let store = config.responses.clone();
                            sniff =
                                Some(Box::new(IdSniffer::new(chain, inspected.continues, store)));
                        }
                        parts.extensions.insert(facts);
                        let asks = config.ask_stream_usage
                            && inspected.streams_unasked
                            && ask::asks_for(parts.uri.path());
                        if let Some(asked) = asks.then(|| ask::ask(&bytes)).flatten() {
                            bytes = asked;
                            if parts.headers.contains_key(header::CONTENT_LENGTH) {
                                parts
                                    .headers
                                    .insert(header::CONTENT_LENGTH, HeaderValue::from(bytes.len()));
                            }
                            strip = Some(Box::default());
                        }
                    } else if let Some(facts) = super::inspect::unread_facts(&bytes) {
                        // Left unread, the body still says which slot llama-server runs it
                        // in, when it names one: the router assigns it that slot.
                        parts.extensions.insert(facts);
                    }
                    let req = http::Request::from_parts(parts, Full::new(bytes));
                    state.set(State::Calling {
                        fut: Oneshot::new(service, req),
                        sniff,
                        strip,
                    });
                }
                StateProj::Calling { fut, sniff, strip } => {
                    let mut res = ready!(fut.poll(cx))?;
                    let mut sniff = sniff.take();
                    if let Some(sniff) = &mut sniff {
                        let decision = res.extensions().get::<Decision>();
                        sniff.answered_by(decision.map(|d| d.backend.clone()));
                    }
                    // Only an event stream as it was sent carries the chunk to take out.
                    let strip = strip
                        .take()
                        .filter(|_| ask::is_plain_event_stream(res.headers()));
                    if strip.is_some() {
                        // The answer is shorter than the backend said.
                        res.headers_mut().remove(header::CONTENT_LENGTH);
                    }
                    return Poll::Ready(Ok(res.map(|inner| BodyKeyResponseBody {
                        kind: InnerOrBytes::Inner { inner },
                        ended: false,
                        sniff,
                        strip,
                    })));
                }
                StateProj::Rejected { rejection } => {
                    let Some(rejection) = rejection.take() else {
                        panic!("BodyKeyFuture polled after completion");
                    };
                    return Poll::Ready(Ok(rejection.into_response()));
                }
            }
        }
    }
}

impl<S, B> fmt::Debug for BodyKeyFuture<S, B>
where
    S: Service<http::Request<Full<Bytes>>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Reading { .. } => "reading the body",
            State::Calling { .. } => "calling",
            State::Rejected { .. } => "rejected",
        };
        f.debug_struct("BodyKeyFuture")
            .field("state", &state)
            .finish()
    }
}
