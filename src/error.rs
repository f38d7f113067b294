//! The service's one error type and its mapping to HTTP.

use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, StatusCode};

use crate::body::ResponseBody;
use crate::BackendId;

/// A boxed error, as tower uses.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why a request was not served.
///
/// Every variant maps to an HTTP answer ([`Error::status`], [`Error::into_response`]):
///
/// | variant | status | headers |
/// |---|---|---|
/// | [`NoBackends`](Error::NoBackends) (the fleet is empty, every backend is down, or the placement policy passed over every backend up: the message says which) | 503 Service Unavailable | `Retry-After: <seconds>` when a backend's failure cooldown is the first to end |
/// | [`Saturated`](Error::Saturated) | 429 Too Many Requests | `Retry-After: <seconds>` |
/// | [`Backend`](Error::Backend) | 502 Bad Gateway; 504 Gateway Timeout if the backend timed out; 400 Bad Request if the request's own body failed on its way to an `HttpBackend`; 501 Not Implemented for a request an `HttpBackend` does not forward (a `CONNECT`, a transfer coding other than `chunked`); 503 Service Unavailable for the backend's own 503, given back by [`RetryOnce`](crate::RetryOnce) where its retry found no backend up | the backend's `Retry-After`, for its 503 |
///
/// A backend "timed out" when its error, or any error in its [source] chain, is an
/// [`io::Error`](std::io::Error) of kind [`TimedOut`](std::io::ErrorKind::TimedOut), or the
/// `Elapsed` error of `tokio::time::timeout` or of `tower::timeout::Timeout`.
///
/// [source]: std::error::Error::source
///
/// ```
/// use std::time::Duration;
/// use tower_affinity::Error;
///
/// let e = Error::saturated(Duration::from_secs(2));
/// let res = e.into_response::<http_body_util::Empty<bytes::Bytes>>();
/// assert_eq!(res.status(), 429);
/// assert_eq!(res.headers()["retry-after"], "2");
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// No backend can take the request: the fleet is empty (none discovered yet, or all
    /// removed), every backend is marked down (a failure cooldown, a probe's mark), or the
    /// placement policy [passed over](crate::placement::Candidates::pass_over) every one that
    /// is up. `retry_after` is when the first of the backends down for a failure cooldown
    /// comes back (a llama-server restarting: its refused connection took it down for the
    /// cooldown), which the message and the `Retry-After` header give in whole seconds,
    /// rounded up; `None` when none is (the fleet is empty, or its backends are down until a
    /// probe says otherwise). A backend the policy passed over for the request does not
    /// count: its coming back does not serve it.
    ///
    /// `backends` and `up` tell the cases apart, and the message says which it is: an empty
    /// fleet (`backends` is 0), a fleet with every backend down (`up` is 0), or a policy that
    /// placed the request on none of the backends up (`up` is more than 0).
    ///
    /// ```
    /// # use tower_affinity::Error;
    /// fn log(e: &Error) {
    ///     if let Error::NoBackends { backends, up, .. } = e {
    ///         if *up > 0 {
    ///             eprintln!("the policy refused a request: {up} of {backends} backends up");
    ///         }
    ///     }
    /// }
    /// ```
    #[non_exhaustive]
    NoBackends {
        /// A hint for the client's `Retry-After`.
        retry_after: Option<Duration>,
        /// How many backends the fleet had: 0 when it was empty.
        backends: usize,
        /// How many of them were up (not marked down), each one passed over by the placement
        /// policy: 0 when the fleet was empty or every backend in it was down.
        up: usize,
    },
    /// Every candidate was full and the request could not wait (or waited too long, or too
    /// many were waiting already). Try again after `retry_after`, which the message and the
    /// `Retry-After` header give in whole seconds, rounded up, at least 1.
    #[non_exhaustive]
    Saturated {
        /// A hint for the client's `Retry-After`.
        retry_after: Duration,
    },
    /// The chosen backend failed before answering (its readiness or its call failed, or it
    /// was not ready within the [ready timeout]), or while [`ReadRefusals`] read its `400`;
    /// or, where [`RetryOnce`]'s retry found no other backend up, it answered `503` (its
    /// [source] then says so). With an `HttpBackend`, also a request that could not be sent
    /// to it through its own fault: its body failed on its way, or it is not one a proxy
    /// forwards ([`Error::status`] says which, and the backend is not passed over for it).
    ///
    /// [ready timeout]: crate::SessionAffinityLayer::ready_timeout
    /// [`ReadRefusals`]: crate::ReadRefusals
    /// [`RetryOnce`]: crate::RetryOnce
    /// [source]: std::error::Error::source
    #[non_exhaustive]
    Backend {
        /// The backend that failed.
        backend: BackendId,
        /// Its error.
        source: BoxError,
    },
}

impl Error {
    /// [`Error::Saturated`]: try again after `retry_after`.
    pub fn saturated(retry_after: Duration) -> Self {
        Error::Saturated { retry_after }
    }

    /// [`Error::NoBackends`]: none can take the request; the first back after `retry_after`,
    /// if known. It counts no backends (`backends` and `up` are 0): without a `retry_after`
    /// its message says the fleet is empty; with one, only that no backends are available.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_affinity::Error;
    ///
    /// let e = Error::no_backends(Some(Duration::from_millis(4_200)));
    /// assert_eq!(e.to_string(), "no backends available; retry after 5 s");
    /// let res = e.into_response::<http_body_util::Empty<bytes::Bytes>>();
    /// assert_eq!(res.status(), 503);
    /// assert_eq!(res.headers()["retry-after"], "5");
    /// assert_eq!(
    ///     Error::no_backends(None).to_string(),
    ///     "no backends available: the fleet is empty"
    /// );
    /// ```
    pub fn no_backends(retry_after: Option<Duration>) -> Self {
        Error::no_backends_of(retry_after, 0, 0)
    }

    /// [`Error::NoBackends`] over a fleet of `backends`, `up` of them up and passed over by
    /// the policy.
    pub(crate) fn no_backends_of(
        retry_after: Option<Duration>,
        backends: usize,
        up: usize,
    ) -> Self {
        Error::NoBackends {
            retry_after,
            backends,
            up,
        }
    }

    /// [`Error::Backend`]: `backend` failed with `source`.
    pub fn backend(backend: impl Into<BackendId>, source: impl Into<BoxError>) -> Self {
        Error::Backend {
            backend: backend.into(),
            source: source.into(),
        }
    }

    /// The HTTP status this error maps to.
    pub fn status(&self) -> StatusCode {
        match self {
            Error::NoBackends { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Error::Saturated { .. } => StatusCode::TOO_MANY_REQUESTS,
            Error::Backend { source, .. } => match request_fault(&**source) {
                Some(status) => status,
                None if unavailable(&**source).is_some() => StatusCode::SERVICE_UNAVAILABLE,
                None if timed_out(&**source) => StatusCode::GATEWAY_TIMEOUT,
                None => StatusCode::BAD_GATEWAY,
            },
        }
    }

    /// The `Retry-After` hint: for [`Error::Saturated`]; for [`Error::NoBackends`], when a
    /// backend's failure cooldown ends; and for a backend's own `503`, that
    /// [`RetryOnce`](crate::RetryOnce) gives back where its retry found no backend up, the
    /// backend's, when it gave one in seconds (one given as a date is not read here, and
    /// goes on as it came in [`into_response`](Self::into_response)).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_affinity::Error;
    ///
    /// assert_eq!(Error::saturated(Duration::from_secs(2)).retry_after(), Some(Duration::from_secs(2)));
    /// assert_eq!(Error::no_backends(None).retry_after(), None);
    /// ```
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Error::Saturated { retry_after } => Some(*retry_after),
            Error::NoBackends { retry_after, .. } => *retry_after,
            Error::Backend { source, .. } => unavailable(&**source).and_then(Unavailable::seconds),
        }
    }

    /// An HTTP response for this error: its [status](Self::status), `Retry-After` when
    /// saturated or when with no backend up a failure cooldown is the first to end (and the
    /// backend's own, as it gave it, for a backend's `503` given back by
    /// [`RetryOnce`](crate::RetryOnce)), and a JSON body with a short message
    /// ([`Error::json_body`]). [`ErrorToResponse`] applies it to every error of a service.
    ///
    /// The message of a [`Backend`](Error::Backend) error names the backend and says what its
    /// error says (`backend gpu-0 failed: connection refused: ...`; for a request whose own
    /// body failed on its way, `the request's own body failed on its way to backend gpu-0:`
    /// and the cause, as `client went away`); map the error yourself
    /// where clients must not see either. Its response carries the backend's [`BackendId`] in
    /// its extensions, where a [`Decision`](crate::Decision) would be on an answer, for the
    /// middleware that logs which backend failed.
    pub fn into_response<B>(self) -> http::Response<ResponseBody<B>> {
        self.response()
    }

    /// An HTTP response for an error of a stack of layers around the service, as tower's
    /// `Buffer`, `Timeout` and `LoadShed` box them ([`BoxError`]):
    ///
    /// - this crate's [`Error`], `e` itself or in its [source] chain, as
    ///   [`Error::into_response`] makes it;
    /// - a timeout (the `Elapsed` error of `tower::timeout::Timeout` or of
    ///   `tokio::time::timeout`, an [`io::Error`](std::io::Error) of kind
    ///   [`TimedOut`](std::io::ErrorKind::TimedOut)): `504 Gateway Timeout`;
    /// - `tower::load_shed`'s `Overloaded`: `503 Service Unavailable`;
    /// - anything else: `500 Internal Server Error`.
    ///
    /// Each with a JSON body ([`Error::json_body`]) whose message says what `e` says.
    /// [`ErrorToResponse`] applies it to every error of the service it wraps.
    ///
    /// [source]: std::error::Error::source
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_affinity::{BoxError, Error};
    ///
    /// // What `tower::buffer::Buffer` hands on: the service's error, boxed.
    /// let e: BoxError = Error::saturated(Duration::from_secs(2)).into();
    /// let res = Error::response_for::<http_body_util::Empty<bytes::Bytes>>(&*e);
    /// assert_eq!(res.status(), 429);
    ///
    /// let e: BoxError = tower::timeout::error::Elapsed::new().into();
    /// let res = Error::response_for::<http_body_util::Empty<bytes::Bytes>>(&*e);
    /// assert_eq!(res.status(), 504);
    /// ```
    pub fn response_for<B>(
        e: &(dyn std::error::Error + 'static),
    ) -> http::Response<ResponseBody<B>> {
        let mut next: Option<&(dyn std::error::Error + 'static)> = Some(e);
        while let Some(cause) = next {
            if let Some(ours) = cause.downcast_ref::<Error>() {
                return ours.response();
            }
            next = cause.source();
        }
        let status = if timed_out(e) {
            StatusCode::GATEWAY_TIMEOUT
        } else if e.is::<tower::load_shed::error::Overloaded>() {
            StatusCode::SERVICE_UNAVAILABLE
        } else {
            StatusCode::INTERNAL_SERVER_ERROR
        };
        json_response(status, &e.to_string())
    }

    /// The body of every error response this crate makes: the error object llama-server
    /// answers its own errors with (OpenAI's shape), so that a client reads the router's
    /// refusals as it reads the backend's.
    ///
    /// ```json
    /// {"error":{"code":503,"message":"no backends available: the fleet is empty","type":"unavailable_error"}}
    /// ```
    ///
    /// `code` is the status; `type` is llama-server's for the statuses it names,
    /// `authentication_error` for 401, `permission_error` for 403, `not_found_error` for 404,
    /// `not_supported_error` for 501 and `unavailable_error` for 503, else `rate_limit_error`
    /// for 429, `timeout_error` for 504, `invalid_request_error` for any other 4xx and
    /// `server_error` for the rest. For a proxy's own refusals in the same shape:
    ///
    /// ```
    /// use http::StatusCode;
    /// use tower_affinity::Error;
    ///
    /// let body = Error::json_body(StatusCode::UNAUTHORIZED, "no \"api key\"");
    /// assert_eq!(
    ///     &body[..],
    ///     br#"{"error":{"code":401,"message":"no \"api key\"","type":"authentication_error"}}"#
    /// );
    /// ```
    pub fn json_body(status: StatusCode, message: &str) -> Bytes {
        let object = serde_json::json!({
            "error": {
                "code": status.as_u16(),
                "message": message,
                "type": error_type(status),
            }
        });
        Bytes::from(object.to_string())
    }

    fn response<B>(&self) -> http::Response<ResponseBody<B>> {
        let (text, failed) = match self {
            // The kind is said already: the cause is what the client is told.
            Error::Backend { backend, source } if request_at_fault(&**source) => {
                let mut cause: &(dyn std::error::Error + 'static) = &**source;
                while let Some(next) = cause.source() {
                    cause = next;
                }
                (format!("{self}: {cause}"), Some(backend))
            }
            Error::Backend { backend, source } => (format!("{self}: {source}"), Some(backend)),
            _ => (self.to_string(), None),
        };
        let mut res = json_response(self.status(), &text);
        if let Some(backend) = failed {
            res.extensions_mut().insert(backend.clone());
        }
        let hint = match self {
            Error::Saturated { retry_after } => {
                Some(HeaderValue::from(whole_seconds(*retry_after)))
            }
            Error::NoBackends { retry_after, .. } => {
                retry_after.map(|after| HeaderValue::from(whole_seconds(after)))
            }
            // The backend's own, as it gave it: in seconds, or a date.
            Error::Backend { source, .. } => {
                unavailable(&**source).and_then(|u| u.retry_after.clone())
            }
        };
        if let Some(hint) = hint {
            res.headers_mut().insert(header::RETRY_AFTER, hint);
        }
        res
    }
}

/// A `Retry-After` in whole seconds, as the header gives it: rounded up, at least 1 (0 would
/// ask for the retry at once), and `u64::MAX` for a wait longer than that.
fn whole_seconds(after: Duration) -> u64 {
    let secs = after
        .as_secs()
        .saturating_add(u64::from(after.subsec_nanos() > 0));
    secs.max(1)
}

/// [`Error::response_for`] a boxed error.
fn boxed_response<B>(e: BoxError) -> http::Response<ResponseBody<B>> {
    Error::response_for(&*e)
}

/// A response of `status` with `message` in its JSON body ([`Error::json_body`]).
fn json_response<B>(status: StatusCode, message: &str) -> http::Response<ResponseBody<B>> {
    let mut res = http::Response::new(ResponseBody::full(Error::json_body(status, message)));
    *res.status_mut() = status;
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    res
}

/// The `type` of an error object answered with `status`: llama-server's names where it has
/// one for the status, else the nearest of OpenAI's and Anthropic's.
fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        429 => "rate_limit_error",
        501 => "not_supported_error",
        503 => "unavailable_error",
        504 => "timeout_error",
        400..=499 => "invalid_request_error",
        _ => "server_error",
    }
}

/// The status of a failure that is the request's own, not the backend's (an
/// [`HttpBackend`](crate::client::HttpBackend)'s [`FailureKind::RequestBody`], 400, or
/// [`FailureKind::Unsupported`], 501), if `e` is one.
///
/// [`FailureKind::RequestBody`]: crate::client::FailureKind::RequestBody
/// [`FailureKind::Unsupported`]: crate::client::FailureKind::Unsupported
pub(crate) fn request_fault(e: &(dyn std::error::Error + 'static)) -> Option<StatusCode> {
    #[cfg(feature = "client")]
    {
        e.downcast_ref::<crate::client::HttpBackendError>()
            .filter(|e| e.kind().is_request_fault())
            .map(|e| e.status())
    }
    #[cfg(not(feature = "client"))]
    {
        let _ = e;
        None
    }
}

/// Whether `e` is the request's own fault, not the backend's (see [`request_fault`]).
pub(crate) fn request_at_fault(e: &(dyn std::error::Error + 'static)) -> bool {
    request_fault(e).is_some()
}

/// A backend's answer `503 Service Unavailable`, as the failure it is: what
/// [`RetryOnce`](crate::RetryOnce) keeps of it (the answer's body is dropped, which frees its
/// slot) and gives back, as the source of an [`Error::Backend`], where its retry finds no
/// backend up. That error answers 503, with the backend's `Retry-After` if it gave one.
#[derive(Debug)]
pub(crate) struct Unavailable {
    retry_after: Option<HeaderValue>,
}

impl Unavailable {
    /// The 503 whose answer had `headers`.
    pub(crate) fn new(headers: &HeaderMap) -> Self {
        Unavailable {
            retry_after: headers.get(header::RETRY_AFTER).cloned(),
        }
    }

    /// The backend's `Retry-After`, if it gave it in seconds (`delta-seconds`).
    fn seconds(&self) -> Option<Duration> {
        let digits = self.retry_after.as_ref()?.as_bytes();
        if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
            return None;
        }
        let secs = std::str::from_utf8(digits).ok()?.parse().ok()?;
        Some(Duration::from_secs(secs))
    }
}

impl fmt::Display for Unavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("it answered 503 Service Unavailable")?;
        match self.retry_after.as_ref().map(HeaderValue::to_str) {
            Some(Ok(after)) => write!(f, ", Retry-After: {after}"),
            _ => Ok(()),
        }
    }
}

impl std::error::Error for Unavailable {}

/// The backend's 503 that `e` is, if it is one.
fn unavailable<'e>(e: &'e (dyn std::error::Error + 'static)) -> Option<&'e Unavailable> {
    e.downcast_ref()
}

/// Whether `e` or an error in its source chain is a timeout.
fn timed_out(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(e);
    while let Some(e) = next {
        if e.is::<tokio::time::error::Elapsed>()
            || e.is::<tower::timeout::error::Elapsed>()
            || e.downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
        {
            return true;
        }
        next = e.source();
    }
    false
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::NoBackends {
                retry_after,
                backends,
                up,
            } => {
                match (*backends, *up) {
                    // The policy's refusal, not the fleet's state.
                    (backends, up @ 1..) => write!(
                        f,
                        "no backend for the request: the placement policy passed over every \
                         backend up ({up} of {backends} in the fleet)"
                    )?,
                    // Counted by no one (`Error::no_backends`): an empty fleet has no
                    // cooldown to wait for.
                    (0, _) if retry_after.is_some() => f.write_str("no backends available")?,
                    (0, _) => f.write_str("no backends available: the fleet is empty")?,
                    (backends, 0) => write!(
                        f,
                        "no backends available: every backend is down ({backends} in the fleet)"
                    )?,
                }
                match retry_after {
                    Some(after) => write!(f, "; retry after {} s", whole_seconds(*after)),
                    None => Ok(()),
                }
            }
            Error::Saturated { retry_after } => write!(
                f,
                "all backends are at capacity; retry after {} s",
                whole_seconds(*retry_after)
            ),
            // The request's own fault: the backend did nothing wrong.
            Error::Backend { backend, source } => match request_fault(&**source) {
                Some(StatusCode::BAD_REQUEST) => write!(
                    f,
                    "the request's own body failed on its way to backend {backend}"
                ),
                Some(_) => write!(f, "the request cannot be forwarded to backend {backend}"),
                None if unavailable(&**source).is_some() => {
                    write!(f, "backend {backend} is unavailable")
                }
                // What it failed with is the source's to say.
                None => write!(f, "backend {backend} failed"),
            },
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Backend { source, .. } => Some(&**source),
            _ => None,
        }
    }
}

/// Turns a service's errors into HTTP responses, making it infallible, as
/// `axum::Router::fallback_service` requires. (axum's `HandleErrorLayer` does the same with
/// `|e: tower_affinity::Error| async move { e.into_response::<Body>() }` over the balancer
/// and layers that keep its error, a [`BodyKeyLayer`](crate::key::BodyKeyLayer) or tower's
/// `ConcurrencyLimit`; under one that boxes it, tower's `Timeout`, `Buffer` or `LoadShed`,
/// with `|e: BoxError| async move { Error::response_for::<Body>(&*e) }`, as below. Given
/// `|e: Error|` there, axum's compile error says only that `HandleError<..>` is not a
/// `Service`.)
///
/// The service's errors are this crate's [`Error`] ([`Error::into_response`]), or, with
/// tower's layers between (`Buffer`, `Timeout`, `LoadShed`), boxed errors
/// ([`Error::response_for`]: this crate's error found inside them keeps its status, a timeout
/// is `504`). It answers with the balancer's own body type, [`ResponseBody`], so it goes
/// between a [`BodyKeyLayer`](crate::key::BodyKeyLayer) and the balancer, not in front of
/// the `BodyKeyLayer`.
///
/// ```
/// # fn doc<S>(svc: S) where S: tower::Service<http::Request<axum::body::Body>,
/// #   Response = http::Response<tower_affinity::ResponseBody<axum::body::Body>>,
/// #   Error = tower_affinity::Error> + Clone + Send + Sync + 'static, S::Future: Send + 'static {
/// use tower_affinity::ErrorToResponse;
///
/// let app: axum::Router = axum::Router::new().fallback_service(ErrorToResponse::new(svc));
/// # }
/// ```
///
/// The same answers from axum's `HandleErrorLayer`, in front of tower's `Timeout` and
/// `ConcurrencyLimit`. A request the timeout gives up on frees its slot (or its place in the
/// wait queue: [`Stats::abandoned`](crate::Stats::abandoned)); the timeout bounds the wait
/// for the answer's headers, not a streamed answer's body, and the concurrency limit gives
/// its permit back with the headers too: the backends' slots are what bound the answers
/// being streamed.
///
/// ```
/// use std::convert::Infallible;
/// use std::time::Duration;
///
/// use axum::body::Body;
/// use axum::error_handling::HandleErrorLayer;
/// use axum::Router;
/// use bytes::Bytes;
/// use http_body_util::Full;
/// use tower::{service_fn, Layer, ServiceBuilder, ServiceExt};
/// use tower_affinity::discover::StaticFleet;
/// use tower_affinity::key::BodyKeyLayer;
/// use tower_affinity::{Backend, BoxError, Error, SessionAffinityLayer};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() {
/// // A backend that never answers.
/// let backend = service_fn(|_req: http::Request<Full<Bytes>>| async {
///     std::future::pending::<Result<http::Response<Body>, Infallible>>().await
/// });
/// let balancer = SessionAffinityLayer::new()
///     .layer(StaticFleet::new([("gpu-0", Backend::new("host-a", backend))]));
/// let forward = ServiceBuilder::new()
///     // `Timeout` boxes the errors under it: the handler takes a `BoxError`.
///     .layer(HandleErrorLayer::new(|e: BoxError| async move {
///         Error::response_for::<Body>(&*e)
///     }))
///     .timeout(Duration::from_secs(600))
///     .concurrency_limit(256)
///     .layer(BodyKeyLayer::new())
///     .service(balancer.clone());
/// let app = Router::new().fallback_service(forward);
///
/// let req = http::Request::post("/v1/chat/completions")
///     .header("x-session-id", "agent-1")
///     .body(Body::from("{}"))
///     .unwrap();
/// let res = app.oneshot(req).await.unwrap();
/// assert_eq!(res.status(), 504);
/// assert_eq!(balancer.stats().in_flight, 0, "the slot is free again");
/// # }
/// ```
#[derive(Debug)]
pub struct ErrorToResponse<S> {
    inner: S,
    pending: Option<BoxError>,
}

impl<S: Clone> Clone for ErrorToResponse<S> {
    fn clone(&self) -> Self {
        ErrorToResponse::new(self.inner.clone())
    }
}

impl<S> ErrorToResponse<S> {
    /// Wraps `inner`.
    pub fn new(inner: S) -> Self {
        ErrorToResponse {
            inner,
            pending: None,
        }
    }

    /// A layer that wraps services in `ErrorToResponse`.
    pub const fn layer() -> ErrorToResponseLayer {
        ErrorToResponseLayer::new()
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The wrapped service, unwrapped.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

/// Wraps a service in [`ErrorToResponse`]: for tower's `ServiceBuilder`.
///
/// ```
/// # fn doc<S>(balancer: S) where S: tower::Service<http::Request<String>,
/// #   Response = http::Response<tower_affinity::ResponseBody<String>>,
/// #   Error = tower_affinity::Error> {
/// use tower::ServiceBuilder;
/// use tower_affinity::ErrorToResponseLayer;
///
/// let svc = ServiceBuilder::new().layer(ErrorToResponseLayer::new()).service(balancer);
/// # }
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct ErrorToResponseLayer {
    _priv: (),
}

impl ErrorToResponseLayer {
    /// The layer.
    pub const fn new() -> Self {
        ErrorToResponseLayer { _priv: () }
    }
}

impl<S> tower::Layer<S> for ErrorToResponseLayer {
    type Service = ErrorToResponse<S>;

    fn layer(&self, inner: S) -> ErrorToResponse<S> {
        ErrorToResponse::new(inner)
    }
}

impl<S, Req, B> tower::Service<Req> for ErrorToResponse<S>
where
    S: tower::Service<Req, Response = http::Response<ResponseBody<B>>>,
    S::Error: Into<BoxError>,
{
    type Response = http::Response<ResponseBody<B>>;
    type Error = std::convert::Infallible;
    type Future = ErrorToResponseFuture<S::Future>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        use std::task::Poll;
        if self.pending.is_some() {
            return Poll::Ready(Ok(()));
        }
        // Ready when the inner service is; a readiness error is answered as the next call's
        // response.
        match self.inner.poll_ready(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Ok(())) => Poll::Ready(Ok(())),
            Poll::Ready(Err(e)) => {
                self.pending = Some(e.into());
                Poll::Ready(Ok(()))
            }
        }
    }

    fn call(&mut self, req: Req) -> Self::Future {
        let state = match self.pending.take() {
            Some(e) => State::Failed { error: Some(e) },
            None => State::Inner {
                fut: self.inner.call(req),
            },
        };
        ErrorToResponseFuture { state }
    }
}

pin_project_lite::pin_project! {
    /// The future of [`ErrorToResponse`].
    pub struct ErrorToResponseFuture<F> {
        #[pin]
        state: State<F>,
    }
}

impl<F> fmt::Debug for ErrorToResponseFuture<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ErrorToResponseFuture")
            .finish_non_exhaustive()
    }
}

pin_project_lite::pin_project! {
    #[project = StateProj]
    enum State<F> {
        // Waiting for the inner service.
        Inner { #[pin] fut: F },
        // The inner service failed to become ready.
        Failed { error: Option<BoxError> },
    }
}

impl<F, B, E> std::future::Future for ErrorToResponseFuture<F>
where
    F: std::future::Future<Output = Result<http::Response<ResponseBody<B>>, E>>,
    E: Into<BoxError>,
{
    type Output = Result<http::Response<ResponseBody<B>>, std::convert::Infallible>;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Inner { fut } => fut
                .poll(cx)
                .map(|r| Ok(r.unwrap_or_else(|e| boxed_response(e.into())))),
            StateProj::Failed { error } => std::task::Poll::Ready(Ok(boxed_response(
                error
                    .take()
                    .unwrap_or_else(|| Error::no_backends(None).into()),
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error that wraps another, as client errors wrap connection errors.
    #[derive(Debug)]
    struct Wrapped(BoxError);

    impl fmt::Display for Wrapped {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("request failed")
        }
    }

    impl std::error::Error for Wrapped {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&*self.0)
        }
    }

    fn backend(source: BoxError) -> Error {
        Error::Backend {
            backend: BackendId::from("b"),
            source,
        }
    }

    #[test]
    fn a_backend_that_timed_out_is_504_anywhere_in_the_chain() {
        let timed_out = || std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer");
        assert_eq!(backend(timed_out().into()).status(), 504);
        assert_eq!(
            backend(Box::new(Wrapped(Box::new(Wrapped(timed_out().into()))))).status(),
            504
        );
        assert_eq!(
            backend(Box::new(tower::timeout::error::Elapsed::new())).status(),
            504
        );
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        let elapsed = rt
            .block_on(async {
                tokio::time::timeout(Duration::ZERO, std::future::pending::<()>()).await
            })
            .unwrap_err();
        assert_eq!(backend(Box::new(Wrapped(Box::new(elapsed)))).status(), 504);
    }

    #[tokio::test]
    async fn error_to_response_is_ready_only_when_its_inner_service_is() {
        use tokio_test::{assert_pending, assert_ready, task};
        use tower::{Service, ServiceExt};

        let ok = tower::service_fn(|_: ()| async {
            Ok::<_, Error>(http::Response::new(ResponseBody::<()>::full(Bytes::new())))
        });
        // One permit: a service that reserves capacity in `poll_ready`, and panics on a call
        // it did not make ready.
        let svc = ErrorToResponse::new(tower::limit::ConcurrencyLimit::new(ok, 1));
        let mut first = svc.clone();
        let held = first.ready().await.unwrap().call(());
        let mut second = svc.clone();
        let mut ready = task::spawn(second.ready());
        assert_pending!(ready.poll());
        drop(held);
        assert!(ready.is_woken());
        let second = assert_ready!(ready.poll()).unwrap();
        assert_eq!(second.call(()).await.unwrap().status(), 200);
    }

    #[test]
    fn an_error_body_is_llama_servers_error_object_with_the_type_of_its_status() {
        for (status, kind) in [
            (400, "invalid_request_error"),
            (401, "authentication_error"),
            (403, "permission_error"),
            (404, "not_found_error"),
            (408, "invalid_request_error"),
            (413, "invalid_request_error"),
            (429, "rate_limit_error"),
            (500, "server_error"),
            (501, "not_supported_error"),
            (502, "server_error"),
            (503, "unavailable_error"),
            (504, "timeout_error"),
        ] {
            let status = StatusCode::from_u16(status).unwrap();
            // Quotes, a line break and a control character: escaped, the JSON still whole.
            let body = Error::json_body(status, "a \"b\"\nc\u{1}");
            let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(
                body,
                serde_json::json!({"error": {"code": status.as_u16(), "message": "a \"b\"\nc\u{1}", "type": kind}}),
                "{status}"
            );
        }
        let res = Error::saturated(Duration::from_secs(2))
            .into_response::<http_body_util::Empty<Bytes>>();
        assert_eq!(res.headers()[header::CONTENT_TYPE], "application/json");
        assert_eq!(res.headers()[header::RETRY_AFTER], "2");
    }

    #[tokio::test]
    async fn a_backend_failure_is_said_once_in_the_chain_and_whole_in_the_answer() {
        use http_body_util::BodyExt;

        let e = Error::backend("b", "broken");
        assert_eq!(e.to_string(), "backend b failed");
        assert_eq!(std::error::Error::source(&e).unwrap().to_string(), "broken");
        let res = e.into_response::<http_body_util::Full<Bytes>>();
        assert_eq!(res.extensions().get::<BackendId>().unwrap().as_str(), "b");
        assert_eq!(res.headers()[header::CONTENT_TYPE], "application/json");
        let body = res.into_body().collect().await.unwrap().to_bytes();
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            body,
            serde_json::json!({"error": {"code": 502, "message": "backend b failed: broken", "type": "server_error"}})
        );
    }

    #[test]
    fn a_retry_after_of_any_length_is_the_same_whole_seconds_in_the_text_and_the_header() {
        let max = u64::MAX.to_string();
        for (after, secs) in [
            (Duration::ZERO, "1"),
            (Duration::from_millis(1), "1"),
            (Duration::from_secs(1), "1"),
            (Duration::from_millis(1_500), "2"),
            (Duration::from_secs(u64::MAX), max.as_str()),
            (Duration::MAX, max.as_str()),
        ] {
            let e = Error::saturated(after);
            assert_eq!(
                e.to_string(),
                format!("all backends are at capacity; retry after {secs} s"),
                "{after:?}"
            );
            let res = e.into_response::<()>();
            assert_eq!(res.headers()[header::RETRY_AFTER], secs, "{after:?}");
        }
    }

    #[test]
    fn any_other_backend_failure_is_502() {
        let refused = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        assert_eq!(backend(refused.into()).status(), 502);
        assert_eq!(backend("broken".into()).status(), 502);
        assert_eq!(
            backend(Box::new(Wrapped("broken".into())))
                .into_response::<()>()
                .status(),
            502
        );
    }
}
