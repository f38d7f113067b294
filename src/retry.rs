//! [`RetryOnce`]: retry a request whose backend failed before answering, answered 503, or
//! refused its prompt as too long for its context ([`ReadRefusals`], [`ContextRefusal`]).

use std::fmt;
use std::future::{ready, Future, Ready};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::{BufMut, Bytes, BytesMut};
use http::StatusCode;
use http_body::Body;
use parking_lot::Mutex;
use pin_project_lite::pin_project;
use tower::retry::Policy;
use tower::{Layer, Service};

use crate::{BackendId, BoxError, Decision, Error, ResponseBody};

/// A [`tower::retry::Policy`] that retries a request once when its backend failed before
/// sending a response ([`Error::Backend`]), answered `503 Service Unavailable` (it serves
/// nothing now: llama-server answers so while it loads its model), or refused the prompt as
/// too long for its context (a [`ContextRefusal`] on the answer, which [`ReadRefusals`] puts
/// there). Nothing has reached the client yet, so the retry is invisible to it; the 503's
/// body is dropped.
///
/// A backend that failed or answered 503 is marked down (see
/// [`SessionAffinityLayer::failure_cooldown`]), so the retry is placed on the next
/// candidate. With the cooldown turned off (`Duration::ZERO`) nothing marks it down, and the
/// retry is placed as the first attempt was: a session's retry goes back to its home, the
/// backend that just failed. A refused request is retried with the refusal among its
/// extensions: the balancer then counts the prompt as the refusing backend did and passes
/// over that backend, and any whose request context is no larger, for one that takes it;
/// the backend that refused stays up. Other answers, errors included, are the backend's to
/// give. Where the retry of a failure finds no backend up (the one that failed was the only
/// one), the answer is that failure, not [`Error::NoBackends`]; for a 503, an
/// [`Error::Backend`] of that backend that answers 503 with its `Retry-After`, if it gave
/// one (its body is not kept: it would hold the backend's slot). A failure that is the
/// request's own is not retried: its body failed on its way to the backend (the client went
/// away, a body limit), or it is not one a proxy forwards (a `CONNECT`, a transfer coding
/// other than `chunked`). The backend is not at fault, and the same request would fail again.
///
/// The request body must be `Clone`: buffer it first (a `Full<Bytes>` body is). The retry is
/// a request of its own to the balancer: under [`Overflow::Wait`](crate::Overflow::Wait) it may
/// wait for a slot as the first attempt may, so a request retried can wait up to twice
/// `max_wait` in all.
///
/// ```
/// use tower::retry::RetryLayer;
/// use tower_affinity::RetryOnce;
///
/// let layer = RetryLayer::new(RetryOnce::new());
/// # let _ = layer;
/// ```
///
/// [`SessionAffinityLayer::failure_cooldown`]: crate::SessionAffinityLayer::failure_cooldown
#[derive(Clone, Copy, Debug, Default)]
pub struct RetryOnce {
    retried: bool,
}

impl RetryOnce {
    /// A policy that has not retried yet.
    pub const fn new() -> Self {
        RetryOnce { retried: false }
    }

    /// Whether to retry an attempt that `failed` (before answering, or with a 503).
    fn once(&mut self, failed: bool) -> Option<Ready<()>> {
        if !failed || self.retried {
            return None;
        }
        self.retried = true;
        Some(ready(()))
    }

    /// Whether to retry an answer refusing the prompt as too long: once, with the refusal
    /// among the request's extensions, and the answer as [`ReadRefusals`] read it, for the
    /// balancer to give back if no other backend takes the prompt.
    fn refused<B, ResB>(
        &mut self,
        req: &mut http::Request<B>,
        res: &mut http::Response<ResB>,
    ) -> Option<Ready<()>> {
        let refusal = res.extensions().get::<ContextRefusal>()?.clone();
        let retry = self.once(true)?;
        if let Some(read) = res.extensions_mut().remove::<RefusalRead>() {
            let first = FirstAnswer {
                status: res.status(),
                version: res.version(),
                headers: std::mem::take(res.headers_mut()),
                extensions: std::mem::take(res.extensions_mut()),
                read,
            };
            req.extensions_mut().insert(Kept::new(first));
        }
        req.extensions_mut().insert(refusal);
        Some(retry)
    }
}

/// A `503` answer, `res`, as the failure to give back where its retry finds no backend up:
/// its backend's, 503, with its `Retry-After`. The backend is named by the answer's
/// [`Decision`], or, with the decision kept in the body, by the [`BackendId`] the balancer puts
/// among a 503's extensions.
fn unavailable<ResB>(res: &http::Response<ResB>) -> Error {
    let extensions = res.extensions();
    let backend = (extensions.get::<Decision>().map(|d| &d.backend))
        .or_else(|| extensions.get::<BackendId>())
        .map_or_else(|| BackendId::from("unknown"), BackendId::clone);
    Error::backend(backend, crate::error::Unavailable::new(res.headers()))
}

/// Nothing reached the client: the backend failed before answering, or answered that it
/// serves nothing now.
fn failed<ResB>(result: Result<&http::Response<ResB>, &Error>) -> bool {
    match result {
        Err(Error::Backend { source, .. }) => !crate::error::request_at_fault(&**source),
        Ok(res) => res.status() == StatusCode::SERVICE_UNAVAILABLE,
        Err(_) => false,
    }
}

impl<B: Clone, ResB> Policy<http::Request<B>, http::Response<ResB>, Error> for RetryOnce {
    type Future = Ready<()>;

    fn retry(
        &mut self,
        req: &mut http::Request<B>,
        result: &mut Result<http::Response<ResB>, Error>,
    ) -> Option<Self::Future> {
        if let Ok(res) = result {
            if res.status() == StatusCode::BAD_REQUEST {
                return self.refused(req, res);
            }
        }
        if self.retried {
            Kept::give_back(req, result, |e| matches!(e, Error::NoBackends { .. }));
        }
        let retry = self.once(failed(result.as_ref()))?;
        match result {
            Ok(res) => Kept::insert(req, unavailable(res)),
            Err(_) => Kept::keep(req, result, Error::no_backends(None)),
        }
        Some(retry)
    }

    fn clone_request(&mut self, req: &http::Request<B>) -> Option<http::Request<B>> {
        Some(req.clone())
    }
}

/// Behind a layer that boxes errors (tower's `Buffer`, `Timeout`): this crate's [`Error`]
/// inside the box is retried as above; any other error is not.
impl<B: Clone, ResB> Policy<http::Request<B>, http::Response<ResB>, BoxError> for RetryOnce {
    type Future = Ready<()>;

    fn retry(
        &mut self,
        req: &mut http::Request<B>,
        result: &mut Result<http::Response<ResB>, BoxError>,
    ) -> Option<Self::Future> {
        if let Ok(res) = result {
            if res.status() == StatusCode::BAD_REQUEST {
                return self.refused(req, res);
            }
        }
        if self.retried {
            let no_backends =
                |e: &BoxError| matches!(e.downcast_ref(), Some(Error::NoBackends { .. }));
            Kept::give_back(req, result, no_backends);
        }
        let failed = match result {
            Ok(res) => failed::<ResB>(Ok(res)),
            Err(e) => e
                .downcast_ref::<Error>()
                .is_some_and(|e| failed::<ResB>(Err(e))),
        };
        let retry = self.once(failed)?;
        match result {
            Ok(res) => Kept::insert(req, BoxError::from(unavailable(res))),
            Err(_) => Kept::keep(req, result, Error::no_backends(None).into()),
        }
        Some(retry)
    }

    fn clone_request(&mut self, req: &http::Request<B>) -> Option<http::Request<B>> {
        Some(req.clone())
    }
}

// === what a first attempt gave, kept for its retry ===

/// What a request's first attempt gave, among the extensions of its retry, for whoever
/// answers the retry to give back in its place; taken once. A refusal as it came
/// (`Kept<FirstAnswer>`), which the balancer gives back where no other backend takes the
/// prompt; a failure (`Kept<Error>`, or `Kept<BoxError>` behind layers that box errors),
/// given back where the retry finds no backend up ([`Error::NoBackends`]), as when the backend
/// that failed was the only one: the client is told of the failure (a refused connection's
/// 502 and its cause, a timeout's 504, a 503 with the backend's `Retry-After`), not of a
/// want of backends.
pub(crate) struct Kept<T>(Arc<Mutex<Option<T>>>);

impl<T> Clone for Kept<T> {
    fn clone(&self) -> Self {
        Kept(self.0.clone())
    }
}

impl<T> Kept<T> {
    fn new(first: T) -> Self {
        Kept(Arc::new(Mutex::new(Some(first))))
    }

    /// What the first attempt gave, if no one has taken it yet.
    pub(crate) fn take(&self) -> Option<T> {
        self.0.lock().take()
    }
}

impl<E: Send + Sync + 'static> Kept<E> {
    /// Keeps the failure in `result`, if it is one, with `req`, about to be retried; what is
    /// left in its place is dropped unread.
    fn keep<B, ResB>(req: &mut http::Request<B>, result: &mut Result<ResB, E>, placeholder: E) {
        if result.is_ok() {
            return;
        }
        if let Err(first) = std::mem::replace(result, Err(placeholder)) {
            req.extensions_mut().insert(Kept::new(first));
        }
    }

    /// Keeps `first`, a failure the first attempt amounts to, with `req`, about to be retried.
    fn insert<B>(req: &mut http::Request<B>, first: E) {
        req.extensions_mut().insert(Kept::new(first));
    }

    /// The first attempt's failure, in place of the retry's want of backends.
    fn give_back<B, ResB>(
        req: &http::Request<B>,
        result: &mut Result<ResB, E>,
        no_backends: impl Fn(&E) -> bool,
    ) {
        if !result.as_ref().is_err_and(no_backends) {
            return;
        }
        let kept = req.extensions().get::<Kept<E>>();
        if let Some(first) = kept.and_then(Kept::take) {
            *result = Err(first);
        }
    }
}

// === a refusal of a prompt too long ===

/// A backend refused a request's prompt as longer than one request can take there: its count
/// of the prompt's tokens and the context it has for a request. llama-server answers so,
/// with `400 exceed_context_size_error`, for a prompt of its slot's `n_ctx` tokens or more;
/// vLLM and SGLang with a `400` whose message states their context length (see
/// [`from_body`](Self::from_body)).
///
/// [`ReadRefusals`] puts it among a refusal's extensions, naming the backend from the
/// answer's [`Decision`]; [`RetryOnce`] moves it into the request it retries. A request that
/// carries it is placed by it: the backend named, and any whose
/// [request context](crate::Backend::request_context_tokens) is no larger than the prompt's
/// tokens, are passed over while a backend up takes the prompt. The prompt's tokens are the
/// refusing backend's count, which holds exactly for backends serving the same model.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ContextRefusal {
    /// The backend that refused the prompt, when known.
    pub backend: Option<BackendId>,
    /// The prompt's tokens, as that backend counted them; where it did not say, at least
    /// its context.
    pub prompt_tokens: u64,
    /// The most tokens one request can take on that backend (llama-server's slot `n_ctx`,
    /// vLLM's `max_model_len`, SGLang's context length); 0 where it did not say, which holds
    /// that backend to fewer than `prompt_tokens` for this request, and teaches no limit for
    /// the requests after it.
    pub context_tokens: u64,
}

impl ContextRefusal {
    /// A refusal of a prompt of `prompt_tokens` by a backend that takes `context_tokens` a
    /// request, on no backend named.
    pub fn new(prompt_tokens: u64, context_tokens: u64) -> Self {
        ContextRefusal {
            backend: None,
            prompt_tokens,
            context_tokens,
        }
    }

    /// The same refusal, by `backend`.
    pub fn by(mut self, backend: impl Into<BackendId>) -> Self {
        self.backend = Some(backend.into());
        self
    }

    /// A refusal, from its answer's body: llama-server's
    /// `{"error": {"type": "exceed_context_size_error", "n_prompt_tokens": N, "n_ctx": M, ..}}`;
    /// or a message that says the model's context length in words, as vLLM's and SGLang's do
    /// (`"This model's maximum context length is M tokens. However, ..."`, `"... longer than
    /// the model's context length (M tokens)"`, `"... the maximum model length of M"`), in
    /// `message` or `error.message`. Such a message's count of the prompt, where it gives
    /// one, is worded differently from version to version, and may count the answer's
    /// `max_tokens` too: the prompt is taken to be at least `M` tokens, which passes over
    /// backends of no larger a context, as the request needs. `None` for any other body.
    ///
    /// ```
    /// use tower_affinity::ContextRefusal;
    ///
    /// let body = br#"{"error":{"code":400,"message":"request (6024 tokens) exceeds the available context size (4096 tokens), try increasing it","type":"exceed_context_size_error","n_prompt_tokens":6024,"n_ctx":4096}}"#;
    /// assert_eq!(ContextRefusal::from_body(body), Some(ContextRefusal::new(6024, 4096)));
    /// let vllm = br#"{"object":"error","message":"This model's maximum context length is 32768 tokens. However, you requested 40000 tokens (39000 in the messages, 1000 in the completion). Please reduce the length of the messages or completion.","type":"BadRequestError","param":null,"code":400}"#;
    /// assert_eq!(ContextRefusal::from_body(vllm), Some(ContextRefusal::new(32768, 32768)));
    /// assert_eq!(ContextRefusal::from_body(br#"{"error":{"type":"invalid_request_error"}}"#), None);
    /// ```
    pub fn from_body(body: &[u8]) -> Option<Self> {
        let answer: serde_json::Value = serde_json::from_slice(body).ok()?;
        let error = answer.get("error");
        let kind = error.and_then(|e| e.get("type")?.as_str());
        if let (Some(error), Some("exceed_context_size_error")) = (error, kind) {
            let count = |name: &str| error.get(name)?.as_u64().filter(|&n| n > 0);
            return Some(ContextRefusal::new(
                count("n_prompt_tokens")?,
                count("n_ctx")?,
            ));
        }
        let message = (error.and_then(|e| e.get("message")))
            .or_else(|| answer.get("message"))?
            .as_str()?;
        let context = context_length_in(message)?;
        Some(ContextRefusal::new(context, context))
    }
}

/// The model's context length that `message` states: the number right after "context
/// length" or "model length" (a word or a parenthesis between them at most).
fn context_length_in(message: &str) -> Option<u64> {
    let lower = message.to_ascii_lowercase();
    ["context length", "model length"]
        .iter()
        .find_map(|phrase| {
            let rest = &lower[lower.find(phrase)? + phrase.len()..];
            let start = rest
                .find(|c: char| c.is_ascii_digit())
                .filter(|&at| at <= 5)?;
            let digits = &rest[start..];
            let end = digits
                .find(|c: char| !c.is_ascii_digit())
                .unwrap_or(digits.len());
            digits[..end].parse().ok().filter(|&n| n > 0)
        })
}

/// The most of a `400` answer [`ReadRefusals`] reads: a refusal is a few hundred bytes.
const REFUSAL_LIMIT: u64 = 16 * 1024;

/// What [`ReadRefusals`] read of a refusal, beside its [`ContextRefusal`]: the body, and the
/// decision it kept, for [`RetryOnce`] to keep with the retried request.
#[derive(Clone)]
struct RefusalRead {
    bytes: Bytes,
    decision: Option<Decision>,
}

/// A refused answer's parts, as they came, to be given back whole.
pub(crate) struct FirstAnswer {
    status: StatusCode,
    version: http::Version,
    headers: http::HeaderMap,
    extensions: http::Extensions,
    read: RefusalRead,
}

impl FirstAnswer {
    pub(crate) fn into_response<B>(self) -> http::Response<ResponseBody<B>> {
        let body = ResponseBody::read_back(self.read.bytes, self.read.decision);
        let mut res = http::Response::new(body);
        *res.status_mut() = self.status;
        *res.version_mut() = self.version;
        *res.headers_mut() = self.headers;
        *res.extensions_mut() = self.extensions;
        res
    }
}

/// A [`Layer`] for [`ReadRefusals`].
#[derive(Clone, Copy, Debug, Default)]
pub struct ReadRefusalsLayer {
    _priv: (),
}

impl ReadRefusalsLayer {
    /// The layer.
    pub const fn new() -> Self {
        ReadRefusalsLayer { _priv: () }
    }
}

impl<S> Layer<S> for ReadRefusalsLayer {
    type Service = ReadRefusals<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ReadRefusals::new(inner)
    }
}

/// Reads the body of each `400` answer of a [`SessionAffinity`] (of up to 16 KiB, its length
/// known), and marks a refusal of the prompt as too long for the backend's context with a
/// [`ContextRefusal`] among the answer's extensions, for [`RetryOnce`] to retry the request
/// on a backend that takes it. The answer goes on with the same status, headers and bytes.
/// Other answers pass as they are, unread.
///
/// A conversation outgrows a backend's slots on a turn whose prompt the balancer estimates
/// from its bytes, in the backend's tokens as its answers taught (see
/// [`Backend::request_context_tokens`](crate::Backend::request_context_tokens)): a prompt
/// of denser text than that backend's average (numbers, another language, minified code)
/// can be more tokens than estimated, and be refused where it was sent. Read and retried, it
/// is answered by a backend that takes it, and a keyed conversation's home moves there.
///
/// The retried request carries the refusal as it came. A [`SessionAffinity`] balancer
/// answers it with that refusal, its decision the first placement's, where no backend up
/// other than the one that refused may take the prompt (its request context larger, or not
/// known), or where the request continues a response stored on the one that refused (it would
/// go there again): no backend sees it twice. Services between `ReadRefusals` and the
/// balancer (a concurrency limit, a request's mapping, a buffer) are no matter, as long as
/// they pass the request's extensions on and answer with the balancer's response and
/// [`Error`] (map a boxed error back, as after tower's `Buffer`).
///
/// Put it inside the retry, so that the retry sees the mark; the request body must be
/// `Clone` for the retry (buffer it first). The cost on other answers is a look at the
/// status; a refusal is answered after its body is read whole (a few hundred bytes, read at
/// once). A `400` of unknown length, or longer, is not read, and its trailers, if it has
/// any, are not passed on. A `400` whose body fails as it is read is its backend's failure
/// ([`Error::Backend`]), which reached no client: the backend is passed over for the
/// failure cooldown, as one that fails before answering is, and [`RetryOnce`] sends the
/// request elsewhere.
///
/// ```
/// use tower::retry::Retry;
/// use tower::Layer;
/// use tower_affinity::{ReadRefusalsLayer, RetryOnce};
///
/// # fn wrap<S>(affinity: S) -> Retry<RetryOnce, tower_affinity::ReadRefusals<S>> {
/// let balancer = Retry::new(RetryOnce::new(), ReadRefusalsLayer::new().layer(affinity));
/// # balancer }
/// ```
///
/// [`SessionAffinity`]: crate::SessionAffinity
#[derive(Clone, Debug)]
pub struct ReadRefusals<S> {
    inner: S,
}

impl<S> ReadRefusals<S> {
    /// Reads the refusals of `inner`.
    pub const fn new(inner: S) -> Self {
        ReadRefusals { inner }
    }

    /// A layer that wraps services in `ReadRefusals`.
    pub const fn layer() -> ReadRefusalsLayer {
        ReadRefusalsLayer::new()
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The inner service, unwrapped.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, ReqB, B> Service<http::Request<ReqB>> for ReadRefusals<S>
where
    S: Service<http::Request<ReqB>, Response = http::Response<ResponseBody<B>>, Error = Error>,
    B: Body,
    B::Data: From<Bytes>,
    B::Error: Into<BoxError>,
{
    type Response = http::Response<ResponseBody<B>>;
    type Error = Error;
    type Future = ReadRefusalsFuture<S::Future, B>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<ReqB>) -> Self::Future {
        ReadRefusalsFuture {
            state: ReadState::Call {
                fut: self.inner.call(req),
            },
        }
    }
}

pin_project! {
    /// The response future of [`ReadRefusals`].
    pub struct ReadRefusalsFuture<F, B> {
        #[pin]
        state: ReadState<F, B>,
    }
}

pin_project! {
    #[project = ReadStateProj]
    enum ReadState<F, B> {
        Call { #[pin] fut: F },
        Read {
            parts: Option<http::response::Parts>,
            #[pin]
            body: ResponseBody<B>,
            read: BytesMut,
        },
    }
}

impl<F, B> fmt::Debug for ReadRefusalsFuture<F, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.state {
            ReadState::Call { .. } => "call",
            ReadState::Read { .. } => "read",
        };
        f.debug_struct("ReadRefusalsFuture")
            .field("state", &state)
            .finish()
    }
}

impl<F, B> Future for ReadRefusalsFuture<F, B>
where
    F: Future<Output = Result<http::Response<ResponseBody<B>>, Error>>,
    B: Body,
    B::Data: From<Bytes>,
    B::Error: Into<BoxError>,
{
    type Output = Result<http::Response<ResponseBody<B>>, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut state = self.project().state;
        loop {
            match state.as_mut().project() {
                ReadStateProj::Call { fut } => {
                    let res = ready!(fut.poll(cx))?;
                    let length = res.body().size_hint().upper();
                    // A refusal the balancer gave back (its retry found no other backend
                    // that takes the prompt) was read already, on its first way back.
                    if res.status() != StatusCode::BAD_REQUEST
                        || length.is_none_or(|n| n > REFUSAL_LIMIT)
                        || res.extensions().get::<ContextRefusal>().is_some()
                    {
                        return Poll::Ready(Ok(res));
                    }
                    let (parts, body) = res.into_parts();
                    let read = BytesMut::with_capacity(length.unwrap_or(0) as usize);
                    state.set(ReadState::Read {
                        parts: Some(parts),
                        body: body.read_whole(),
                        read,
                    });
                }
                ReadStateProj::Read {
                    parts,
                    mut body,
                    read,
                } => {
                    while let Some(frame) = ready!(body.as_mut().poll_frame(cx)) {
                        match frame {
                            Ok(frame) => {
                                if let Ok(data) = frame.into_data() {
                                    read.put(data);
                                }
                            }
                            Err(e) => {
                                // The body marked its backend down (the failure cooldown),
                                // as for a failure before an answer: a retry goes elsewhere.
                                let parts = parts.take().expect("polled after completion");
                                let decision = body.as_mut().take_decision();
                                let backend = answered_by(&parts, decision.as_ref())
                                    .unwrap_or_else(|| BackendId::from("unknown"));
                                let e: BoxError = e.into();
                                tracing::warn!(%backend, error = %e, "backend failed while its 400 was read");
                                return Poll::Ready(Err(Error::backend(backend, e)));
                            }
                        }
                    }
                    let mut parts = parts.take().expect("polled after completion");
                    let read = read.split().freeze();
                    let decision = body.as_mut().take_decision();
                    if let Some(refusal) = ContextRefusal::from_body(&read) {
                        let backend = answered_by(&parts, decision.as_ref());
                        let refusal = ContextRefusal { backend, ..refusal };
                        tracing::debug!(
                            backend = ?refusal.backend,
                            prompt_tokens = refusal.prompt_tokens,
                            context_tokens = refusal.context_tokens,
                            "prompt refused as too long for the backend's context"
                        );
                        parts.extensions.insert(refusal);
                        parts.extensions.insert(RefusalRead {
                            bytes: read.clone(),
                            decision: decision.clone(),
                        });
                    }
                    let body = ResponseBody::read_back(read, decision);
                    return Poll::Ready(Ok(http::Response::from_parts(parts, body)));
                }
            }
        }
    }
}

/// The backend that gave an answer: by its decision, in its extensions or `kept` in its body.
fn answered_by(parts: &http::response::Parts, kept: Option<&Decision>) -> Option<BackendId> {
    let decision = parts.extensions.get::<Decision>().or(kept)?;
    Some(decision.backend.clone())
}
