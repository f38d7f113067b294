//! [`HttpBackend`] and its [`Builder`].

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::header::{self, HeaderValue};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Request, Uri, Version};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use super::backend_body::BackendBody;
use super::body::{Sending, SentBody};
use super::error::{HttpBackendError, InvalidBackendUrl};
use super::future::{finish_response, Again, ResponseFuture};
use super::hop_by_hop::{accepts_trailers, strip};

/// One backend reached over HTTP: a `tower::Service` that sends each request to the backend's
/// scheme and authority, through hyper-util's pooled client.
///
/// The request keeps its method, path, query, headers and body; its URI gets the backend's
/// scheme and authority, and `Host` the backend's host. The path is the one the service is
/// called with: behind axum's `nest_service`, which takes the nested prefix off the URI, a
/// client's `/v1/chat/completions` would reach the backend as `/chat/completions` (mount the
/// stack with `fallback_service`, or `route_service` at whole paths). Hop-by-hop headers
/// ([`strip_hop_by_hop`](super::strip_hop_by_hop)) are dropped from the request and from the
/// response. The response body is a [`BackendBody`]: hyper's
/// [`Incoming`](hyper::body::Incoming), streamed as the backend sends it, failing past the
/// [idle timeout between frames](Builder::body_idle_timeout) if one is set.
///
/// Its connections have TCP keepalive on ([`Builder::tcp_keepalive`]): a backend host that
/// vanishes (powered off, its network cut, no FIN or RST sent) fails the requests it was
/// answering within about a minute, where the connection would otherwise wait forever.
///
/// In front of llama-server, turn on [`Builder::resend_on_close`]: it closes its connection
/// after each streamed answer, unannounced, and a request that goes out on it just then is
/// never read; sent again on another connection, it is answered, where it would otherwise
/// count as the backend's failure.
///
/// Cheap to clone (one reference count): the balancer clones it for every request. Clones
/// share one pool of connections. Always ready: the pool opens connections as needed.
///
/// `http://` only: `https://` is refused with an [`InvalidBackendUrl`] (put a TLS-terminating
/// sidecar in front of such a backend, or use your own client as the backend's service).
///
/// `B` is the request body the backend is sent. Behind
/// [`BodyKeyLayer`](crate::key::BodyKeyLayer), which buffers every body, that is
/// `Full<Bytes>` (from `http-body-util`), whatever body the server hands the layer (axum's
/// `Body`, hyper's `Incoming`); without it, the server's own body type. A body that fails
/// while it is sent (the client went away, a body limit), or is still arriving from the
/// client when the response timeout passes, fails the request with
/// [`FailureKind::RequestBody`](super::FailureKind::RequestBody), 400: the backend is not
/// at fault and is not passed over.
///
/// ```no_run
/// use http_body_util::Full;
/// use bytes::Bytes;
/// use tower_affinity::client::HttpBackend;
/// use tower_affinity::Backend;
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let gpu0: HttpBackend<Full<Bytes>> = HttpBackend::new("http://10.0.0.1:8080")?;
/// let backend = Backend::new("host-a", gpu0);
/// # let _ = backend;
/// # Ok(())
/// # }
/// ```
pub struct HttpBackend<B> {
    inner: Arc<Inner<B>>,
}

struct Inner<B> {
    client: Client<HttpConnector, SentBody<B>>,
    /// With [`Builder::resend_on_close`]: a client that keeps no idle connection, for the
    /// requests sent again, so that each goes out on a new one.
    fresh: Option<Client<HttpConnector, SentBody<B>>>,
    connector: HttpConnector,
    /// `scheme://authority/`.
    base: Uri,
    scheme: Scheme,
    authority: Authority,
    /// `Host` for the backend, made once: the host, and the port unless it is the default.
    host: HeaderValue,
    version: Version,
    response_timeout: Option<Duration>,
    body_idle_timeout: Option<Duration>,
    /// A copy of a request to send once more ([`Builder::resend_on_close`]).
    resend: Option<Copy<B>>,
}

/// Makes a copy of a request, to send it once more.
type Copy<B> = fn(&Request<B>) -> Request<B>;

/// `req` again: its method, URI, version, headers and body. (Its extensions are the
/// caller's, and nothing of them goes on the wire.)
fn copy_request<B: Clone>(req: &Request<B>) -> Request<B> {
    let mut copy = Request::new(req.body().clone());
    *copy.method_mut() = req.method().clone();
    *copy.uri_mut() = req.uri().clone();
    *copy.version_mut() = req.version();
    *copy.headers_mut() = req.headers().clone();
    copy
}

impl<B> Clone for HttpBackend<B> {
    fn clone(&self) -> Self {
        HttpBackend {
            inner: self.inner.clone(),
        }
    }
}

impl<B> fmt::Debug for HttpBackend<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpBackend")
            .field("base", &self.inner.base)
            .field("version", &self.inner.version)
            .field("response_timeout", &self.inner.response_timeout)
            .field("body_idle_timeout", &self.inner.body_idle_timeout)
            .field("resend_on_close", &self.inner.resend.is_some())
            .finish_non_exhaustive()
    }
}

impl<B> HttpBackend<B>
where
    B: http_body::Body + Send + 'static,
    B::Data: Send,
{
    /// A backend at `url` (`http://host:port`, nothing after the authority but an optional
    /// `/`), with the [`Builder`]'s defaults.
    pub fn new(url: &str) -> Result<Self, InvalidBackendUrl> {
        Builder::new().build(url)
    }

    /// A [`Builder`] for backends with other timeouts or HTTP/2.
    pub fn builder() -> Builder<B> {
        Builder::new()
    }
}

impl<B> HttpBackend<B> {
    /// `scheme://authority/` of the backend: where health probes go, for one.
    pub fn base_uri(&self) -> &Uri {
        &self.inner.base
    }

    /// The connector the pooled client connects with (its connect timeout and TCP keepalive
    /// set), for code that drives connections of its own to this backend.
    pub fn connector(&self) -> &HttpConnector {
        &self.inner.connector
    }

    /// The response-header timeout, if any.
    pub fn response_timeout(&self) -> Option<Duration> {
        self.inner.response_timeout
    }

    /// The idle timeout between the frames of an answer's body, if any
    /// ([`Builder::body_idle_timeout`]).
    pub fn body_idle_timeout(&self) -> Option<Duration> {
        self.inner.body_idle_timeout
    }

    /// A copy of `req` to send once more if its connection closes before any answer, when
    /// [`Builder::resend_on_close`] is on (else `None`): for code that drives connections of
    /// its own to this backend, to do as the pooled client does.
    ///
    /// ```
    /// use http_body_util::Full;
    /// use bytes::Bytes;
    /// use tower_affinity::client::HttpBackend;
    ///
    /// let req = http::Request::post("/v1/chat/completions").body(Full::new(Bytes::from("{}"))).unwrap();
    /// let backend = HttpBackend::<Full<Bytes>>::builder()
    ///     .resend_on_close(true)
    ///     .build("http://10.0.0.1:8080")
    ///     .unwrap();
    /// let again = backend.resend_copy(&req).unwrap();
    /// assert_eq!((again.method(), again.uri()), (req.method(), req.uri()));
    /// let off = HttpBackend::<Full<Bytes>>::new("http://10.0.0.1:8080").unwrap();
    /// assert!(off.resend_copy(&req).is_none());
    /// ```
    pub fn resend_copy(&self, req: &Request<B>) -> Option<Request<B>> {
        self.inner.resend.map(|copy| copy(req))
    }

    /// `body`, an answer's body from a connection of the caller's own to this backend, as
    /// this backend's own answers come: a [`BackendBody`] with its idle timeout between
    /// frames. The twin of [`finish_response`](Self::finish_response) for the body.
    ///
    /// ```no_run
    /// # async fn doc(
    /// #     backend: tower_affinity::client::HttpBackend<http_body_util::Full<bytes::Bytes>>,
    /// #     res: http::Response<hyper::body::Incoming>,
    /// # ) -> Result<(), Box<dyn std::error::Error>> {
    /// let mut res = res.map(|body| backend.response_body(body));
    /// backend.finish_response(&mut res)?;
    /// # Ok(()) }
    /// ```
    pub fn response_body(&self, body: hyper::body::Incoming) -> BackendBody {
        BackendBody::new(body, self.inner.body_idle_timeout)
    }

    /// Whether the backend is spoken to in HTTP/2 with prior knowledge
    /// ([`Builder::http2_prior_knowledge`]); health probes are sent in the same version.
    ///
    /// ```
    /// use http_body_util::Full;
    /// use bytes::Bytes;
    /// use tower_affinity::client::HttpBackend;
    ///
    /// let h2 = HttpBackend::<Full<Bytes>>::builder()
    ///     .http2_prior_knowledge(true)
    ///     .build("http://10.0.0.2:30000")
    ///     .unwrap();
    /// assert!(h2.http2_prior_knowledge());
    /// ```
    pub fn http2_prior_knowledge(&self) -> bool {
        self.inner.version == Version::HTTP_2
    }

    /// `req` as it goes to the backend: hop-by-hop headers dropped (`TE: trailers` sent on
    /// as the proxy's own when the client's `TE` accepts trailers, and a `Content-Length`
    /// that a `Transfer-Encoding` overrode dropped with it), a `Content-Length` that the
    /// body's own exact length contradicts made that length (a layer that rewrote the body
    /// may leave the client's), `Host` set to the backend's, `Cookie` fields joined into one
    /// for an HTTP/1.1 backend (an HTTP/2 client may split them), the version the backend
    /// connection speaks, and, if `absolute`, the backend's scheme and authority in its URI
    /// (else its URI in origin-form, `/path?query`, for an HTTP/1.1 connection of the
    /// caller's own; for an HTTP/2 backend the scheme and authority are set either way, as
    /// an HTTP/2 request carries them in its pseudo-header fields).
    ///
    /// A `CONNECT`, and a body in a transfer coding other than `chunked`, are refused
    /// ([`FailureKind::Unsupported`](super::FailureKind::Unsupported), 501).
    pub fn prepare(
        &self,
        mut req: Request<B>,
        absolute: bool,
    ) -> Result<Request<B>, HttpBackendError>
    where
        B: http_body::Body,
    {
        let inner = &*self.inner;
        if req.method() == http::Method::CONNECT {
            return Err(HttpBackendError::unsupported("a CONNECT is not forwarded"));
        }
        let trailers = accepts_trailers(req.headers());
        if !strip(req.headers_mut()) {
            return Err(HttpBackendError::unsupported(
                "a transfer coding other than chunked is not forwarded",
            ));
        }
        if let Some(len) = req.body().size_hint().exact() {
            agree_content_length(req.headers_mut(), len);
        }
        if trailers {
            // `TE` is the connection's: the proxy asks its own, as it passes trailers on.
            req.headers_mut()
                .insert(header::TE, HeaderValue::from_static("trailers"));
        }
        // The client keeps a `Host` it finds; the client's own names the proxy.
        req.headers_mut().insert(header::HOST, inner.host.clone());
        if inner.version != Version::HTTP_2 {
            join_cookies(req.headers_mut());
        }
        // The backend connection speaks its own version, whatever the client spoke.
        *req.version_mut() = inner.version;
        let mut parts = std::mem::take(req.uri_mut()).into_parts();
        // An HTTP/2 request names its scheme and authority (`:scheme`, `:authority`): an
        // HTTP/2 connection refuses one without, whatever its target's form.
        if absolute || inner.version == Version::HTTP_2 {
            parts.scheme = Some(inner.scheme.clone());
            parts.authority = Some(inner.authority.clone());
        } else {
            parts.scheme = None;
            parts.authority = None;
        }
        if parts.path_and_query.is_none() {
            parts.path_and_query = Some(PathAndQuery::from_static("/"));
        }
        *req.uri_mut() =
            Uri::from_parts(parts).map_err(|e| HttpBackendError::classify(e.into()))?;
        Ok(req)
    }

    /// `res`, the backend's answer, as it goes back to the client: the twin of
    /// [`prepare`](Self::prepare), for code that drives connections of its own to the
    /// backend. Hop-by-hop headers are dropped ([`strip_hop_by_hop`](super::strip_hop_by_hop)),
    /// and an answer no client can be handed is the backend's failure
    /// ([`FailureKind::Other`](super::FailureKind::Other), 502): a `101 Switching Protocols`,
    /// as no `Upgrade` is forwarded, a status from 600 to 999, which HTTP does not have (RFC
    /// 9110, section 15: a client takes it as a server error), or a body in a transfer coding
    /// other than `chunked`, which would reach the client still coded and unmarked. An
    /// HTTP/1.0 answer is made HTTP/1.1, the proxy's own version (RFC 9110, section 6.2).
    pub fn finish_response<T>(&self, res: &mut http::Response<T>) -> Result<(), HttpBackendError> {
        finish_response(res)
    }
}

/// The TCP keepalive probes left unanswered that close a connection.
const KEEPALIVE_PROBES: u32 = 3;

/// The longest silence before keepalive probes that Linux takes, in seconds
/// (`MAX_TCP_KEEPIDLE`).
const MAX_KEEPALIVE: u64 = 32_767;

/// `timeout`, or 1 ms if it is shorter: the floor of the builder's timeouts, where a zero
/// would fail every connection or request at once (as `HealthProbe::timeout` has it).
fn at_least_a_millisecond(timeout: Duration) -> Duration {
    timeout.max(Duration::from_millis(1))
}

/// Makes the `Content-Length` of `headers`, if there is one, the body's exact `len`. The
/// connection frames the body by that field, not by the body: one that says less cuts the
/// body short at the backend, unseen, and one that says more (or a stream's length that
/// differs, over HTTP/2) fails the request as if the backend had.
fn agree_content_length(headers: &mut http::HeaderMap, len: u64) {
    let mut declared = headers.get_all(header::CONTENT_LENGTH).iter();
    let agrees = match (declared.next(), declared.next()) {
        (None, _) => return,
        (Some(v), None) => decimal(v.as_bytes()) == Some(len),
        (Some(_), Some(_)) => false,
    };
    if !agrees {
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    }
}

/// The number `digits` writes in decimal, digits only (no sign, no spaces); `None` for
/// anything else, or one beyond `u64`. Read by hand: a parse through `str` costs the proxy
/// about a hundred instructions a request more.
fn decimal(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() {
        return None;
    }
    digits.iter().try_fold(0u64, |n, &d| {
        if !d.is_ascii_digit() {
            return None;
        }
        n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
    })
}

/// Joins the `Cookie` fields of `headers` into one, with `; `, if there are several: an HTTP/2
/// client may send each cookie as a field of its own, which must be joined before the request
/// goes on over HTTP/1.1 (RFC 9113, section 8.2.3), where a request has one `Cookie` field.
fn join_cookies(headers: &mut http::HeaderMap) {
    let mut cookies = headers.get_all(header::COOKIE).iter();
    if cookies.next().is_none() || cookies.next().is_none() {
        return;
    }
    let mut joined = Vec::new();
    for value in headers.get_all(header::COOKIE) {
        if !joined.is_empty() {
            joined.extend_from_slice(b"; ");
        }
        joined.extend_from_slice(value.as_bytes());
    }
    // Valid field values joined with "; " make a valid field value.
    if let Ok(joined) = HeaderValue::from_bytes(&joined) {
        headers.insert(header::COOKIE, joined);
    }
}

impl<B> tower::Service<Request<B>> for HttpBackend<B>
where
    B: http_body::Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<crate::BoxError>,
{
    type Response = http::Response<BackendBody>;
    type Error = HttpBackendError;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // The client pools connections itself and is always ready.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        match self.prepare(req, true) {
            Ok(req) => {
                let again = self.inner.resend.map(|copy| {
                    let (inner, req) = (self.inner.clone(), copy(&req));
                    Box::new(move || inner.send(req, true)) as Again
                });
                let (fut, sending) = self.inner.send(req, false);
                ResponseFuture::new(
                    fut,
                    self.inner.response_timeout,
                    self.inner.body_idle_timeout,
                    sending,
                    again,
                )
            }
            Err(e) => ResponseFuture::failed(e),
        }
    }
}

impl<B> Inner<B>
where
    B: http_body::Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<crate::BoxError>,
{
    /// Sends `req`, prepared, on the pool, or on a new connection if `fresh` (and sending
    /// again is on). The [`Sending`] says whether the request's body failed while it was
    /// sent, or was still awaited from the client when the response timeout passed: the
    /// request's fault, which the client's error does not tell apart from the backend's
    /// (HTTP/2 resets the stream), nor the timeout.
    fn send(
        &self,
        req: Request<B>,
        fresh: bool,
    ) -> (hyper_util::client::legacy::ResponseFuture, Arc<Sending>) {
        let sending = Arc::new(Sending::default());
        let req = req.map(|body| SentBody::new(body, sending.clone()));
        let client = match &self.fresh {
            Some(new) if fresh => new,
            _ => &self.client,
        };
        (client.request(req), sending)
    }
}

/// Settings for [`HttpBackend`]s of request body `B`: timeouts, HTTP version, pool. Clone it,
/// or call [`build`](Self::build) again, to build many backends alike.
///
/// ```no_run
/// use std::time::Duration;
/// use axum::body::Body;
/// use tower_affinity::client::HttpBackend;
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let backend = HttpBackend::<Body>::builder()
///     .connect_timeout(Duration::from_secs(1))
///     .response_timeout(Some(Duration::from_secs(300)))
///     .http2_prior_knowledge(true)
///     .build("http://10.0.0.2:30000")?;
/// # let _ = backend;
/// # Ok(())
/// # }
/// ```
pub struct Builder<B> {
    connect_timeout: Option<Duration>,
    response_timeout: Option<Duration>,
    body_idle_timeout: Option<Duration>,
    tcp_keepalive: Option<Duration>,
    http2: bool,
    pool_idle_timeout: Option<Duration>,
    pool_max_idle_per_host: usize,
    resend: Option<Copy<B>>,
    _body: PhantomData<fn(B)>,
}

impl<B> Default for Builder<B> {
    fn default() -> Self {
        Builder::new()
    }
}

impl<B> Clone for Builder<B> {
    fn clone(&self) -> Self {
        Builder {
            connect_timeout: self.connect_timeout,
            response_timeout: self.response_timeout,
            body_idle_timeout: self.body_idle_timeout,
            tcp_keepalive: self.tcp_keepalive,
            http2: self.http2,
            pool_idle_timeout: self.pool_idle_timeout,
            pool_max_idle_per_host: self.pool_max_idle_per_host,
            resend: self.resend,
            _body: PhantomData,
        }
    }
}

impl<B> fmt::Debug for Builder<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Builder")
            .field("connect_timeout", &self.connect_timeout)
            .field("response_timeout", &self.response_timeout)
            .field("body_idle_timeout", &self.body_idle_timeout)
            .field("tcp_keepalive", &self.tcp_keepalive)
            .field("http2", &self.http2)
            .field("pool_idle_timeout", &self.pool_idle_timeout)
            .field("pool_max_idle_per_host", &self.pool_max_idle_per_host)
            .field("resend_on_close", &self.resend.is_some())
            .finish()
    }
}

impl<B> Builder<B> {
    /// The default of [`tcp_keepalive`](Self::tcp_keepalive).
    const TCP_KEEPALIVE: Duration = Duration::from_secs(30);

    /// The defaults: 2 s to connect, no response-header timeout, no idle timeout between the
    /// frames of an answer's body, TCP keepalive after 30 s of silence, HTTP/1.1, idle
    /// connections closed after 90 s.
    pub fn new() -> Self {
        Builder {
            connect_timeout: Some(Duration::from_secs(2)),
            response_timeout: None,
            body_idle_timeout: None,
            tcp_keepalive: Some(Self::TCP_KEEPALIVE),
            http2: false,
            pool_idle_timeout: Some(Duration::from_secs(90)),
            pool_max_idle_per_host: usize::MAX,
            resend: None,
            _body: PhantomData,
        }
    }

    /// The longest wait for a connection; `None` waits as long as the system does. At least
    /// 1 ms: a zero would fail every connection before it could be made.
    ///
    /// ```
    /// use std::time::Duration;
    /// use http_body_util::Full;
    /// use bytes::Bytes;
    /// use tower_affinity::client::HttpBackend;
    ///
    /// let builder =
    ///     HttpBackend::<Full<Bytes>>::builder().connect_timeout(Duration::from_millis(500));
    /// # let _ = builder;
    /// ```
    pub fn connect_timeout(mut self, timeout: impl Into<Option<Duration>>) -> Self {
        self.connect_timeout = timeout.into().map(at_least_a_millisecond);
        self
    }

    /// The longest wait for the response headers, from the call; `None` (the default) waits
    /// as long as it takes. An LLM answer that is not streamed comes after its whole prompt is
    /// read and its whole reply written: minutes on modest GPUs. Past it the request fails
    /// with [`FailureKind::Timeout`](super::FailureKind::Timeout), which the balancer
    /// answers with 504, and the backend is passed over for the failure cooldown; unless the
    /// request's own body was then still awaited from the client, which sent it too slowly:
    /// that is [`FailureKind::RequestBody`](super::FailureKind::RequestBody), 400, and the
    /// backend is not passed over. At least 1 ms: a zero would fail every request, and pass
    /// over every backend.
    ///
    /// ```
    /// use std::time::Duration;
    /// use http_body_util::Full;
    /// use bytes::Bytes;
    /// use tower_affinity::client::HttpBackend;
    ///
    /// let backend = HttpBackend::<Full<Bytes>>::builder()
    ///     .response_timeout(Duration::from_secs(600))
    ///     .build("http://10.0.0.1:8080")
    ///     .unwrap();
    /// assert_eq!(backend.response_timeout(), Some(Duration::from_secs(600)));
    /// ```
    pub fn response_timeout(mut self, timeout: impl Into<Option<Duration>>) -> Self {
        self.response_timeout = timeout.into().map(at_least_a_millisecond);
        self
    }

    /// The longest silence between two frames of an answer's body, once its first frame came;
    /// `None` (the default) waits as long as it takes. Past it the body fails with an
    /// [`HttpBackendError`] of kind [`Timeout`](super::FailureKind::Timeout), its connection
    /// is closed (over HTTP/2, its stream reset), and the balancer frees the request's slot
    /// and counts the answer as cut short, as for any body that fails midway. At least 1 ms:
    /// a zero would fail every answer of more than one frame.
    ///
    /// The wait for the first frame is not counted: a server that sends its headers before it
    /// has read the prompt (an SSE stream's, often) sends its first token only once it has,
    /// minutes later for a long prompt on modest GPUs, and bounding that is the
    /// [response timeout](Self::response_timeout)'s business (for the headers) or the
    /// client's. Once tokens flow they come steadily, a few to a hundred a second, but a
    /// server may still pause an answer for as long as a prompt's reading takes (vLLM, when
    /// it preempts a request for room and computes its prompt again): how long a pause is
    /// sound depends on the fleet, hence no default. A backend host that vanished is found
    /// without it, by [TCP keepalive](Self::tcp_keepalive); this one finds a backend that is
    /// up but stuck mid-answer.
    ///
    /// ```
    /// use std::time::Duration;
    /// use http_body_util::Full;
    /// use bytes::Bytes;
    /// use tower_affinity::client::HttpBackend;
    ///
    /// let backend = HttpBackend::<Full<Bytes>>::builder()
    ///     .body_idle_timeout(Duration::from_secs(120))
    ///     .build("http://10.0.0.1:8080")
    ///     .unwrap();
    /// assert_eq!(backend.body_idle_timeout(), Some(Duration::from_secs(120)));
    /// ```
    pub fn body_idle_timeout(mut self, timeout: impl Into<Option<Duration>>) -> Self {
        self.body_idle_timeout = timeout.into().map(at_least_a_millisecond);
        self
    }

    /// TCP keepalive on the backend's connections: after `idle` without a byte either way the
    /// system probes the peer, again every third of `idle` (at least 1 s), and closes the
    /// connection after three probes unanswered. `None` turns it off. On by default, after 30
    /// s: a backend host that vanishes (powered off, its network cut: no FIN, no RST) fails
    /// the requests it was answering within about a minute, as a reset connection does,
    /// instead of holding their slots and their clients forever, whether it vanished before
    /// its answer's headers or midway through its body. A live host's system answers the
    /// probes however long its server takes to answer. In whole seconds, the system's unit: at
    /// least 1 s, and at most 32,767 s (about 9 hours), the longest Linux takes (it refuses a
    /// longer one, and keeps its own two hours).
    ///
    /// Probes go only over a connection with nothing in flight. On Linux, bytes sent that the
    /// backend's host leaves unacknowledged (an HTTP/2 window update sent as it vanished, a
    /// request still on its way) close the connection after as long as the probes would
    /// (`TCP_USER_TIMEOUT`), not after the quarter of an hour of the retransmissions; so do
    /// bytes its server leaves unread that long with its receive buffer full.
    ///
    /// ```
    /// use std::time::Duration;
    /// use http_body_util::Full;
    /// use bytes::Bytes;
    /// use tower_affinity::client::HttpBackend;
    ///
    /// let builder = HttpBackend::<Full<Bytes>>::builder().tcp_keepalive(Duration::from_secs(15));
    /// # let _ = builder;
    /// ```
    pub fn tcp_keepalive(mut self, idle: impl Into<Option<Duration>>) -> Self {
        self.tcp_keepalive =
            (idle.into()).map(|t| Duration::from_secs(t.as_secs().clamp(1, MAX_KEEPALIVE)));
        self
    }

    /// Speak HTTP/2 to the backend without asking first (prior knowledge, `h2c`), as SGLang
    /// and vLLM behind an HTTP/2 front accept; one connection then carries every request.
    /// Off by default: llama-server speaks HTTP/1.1.
    pub fn http2_prior_knowledge(mut self, on: bool) -> Self {
        self.http2 = on;
        self
    }

    /// How long an idle pooled connection is kept; `None` keeps it.
    pub fn pool_idle_timeout(mut self, timeout: impl Into<Option<Duration>>) -> Self {
        self.pool_idle_timeout = timeout.into();
        self
    }

    /// The most idle connections kept to the backend.
    pub fn pool_max_idle(mut self, max: usize) -> Self {
        self.pool_max_idle_per_host = max;
        self
    }

    /// A backend at `url`: `http://host[:port]`, with nothing after the authority but an
    /// optional `/` (paths are forwarded as the client sent them).
    pub fn build(&self, url: &str) -> Result<HttpBackend<B>, InvalidBackendUrl>
    where
        B: http_body::Body + Send + 'static,
        B::Data: Send,
    {
        let bad = |why| InvalidBackendUrl::new(url, why);
        let uri: Uri = url.parse().map_err(|_| bad("not a URL"))?;
        let scheme = uri
            .scheme()
            .cloned()
            .ok_or_else(|| bad("no scheme: expected http://host:port"))?;
        if scheme == Scheme::HTTPS {
            return Err(bad("https is not supported: HttpBackend speaks plain HTTP"));
        }
        if scheme != Scheme::HTTP {
            return Err(bad("the scheme must be http"));
        }
        let authority = uri.authority().cloned().ok_or_else(|| bad("no host"))?;
        // `http://:8080` (a host left out, as a variable that was not set leaves it) parses
        // with an empty host: every request would fail on a name lookup that names nothing.
        if matches!(authority.host(), "" | "[]") {
            return Err(bad("no host"));
        }
        if authority.as_str().contains('@') {
            return Err(bad("user info is not supported"));
        }
        if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
            return Err(bad(
                "expected http://host:port only: paths are forwarded as sent",
            ));
        }
        // A port out of range (`:99999`) parses, but reads as none: the client would connect
        // to port 80 of the host. Port 0 reaches no server. A port with a sign (`:+80`)
        // parses too, and reads as the number: no URI has one.
        let port_given = authority.as_str().len() > authority.host().len() + 1;
        let digits = authority
            .port()
            .is_none_or(|p| p.as_str().bytes().all(|b| b.is_ascii_digit()));
        if port_given && (!digits || authority.port_u16().is_none_or(|p| p == 0)) {
            return Err(bad("the port must be a number from 1 to 65535"));
        }
        let host = match authority.port_u16() {
            Some(port) if port != 80 => format!("{}:{port}", authority.host()),
            _ => authority.host().to_string(),
        };
        let host =
            HeaderValue::try_from(host).map_err(|_| bad("the host is not a valid Host header"))?;
        let base = Uri::builder()
            .scheme(scheme.clone())
            .authority(authority.clone())
            .path_and_query("/")
            .build()
            .map_err(|_| bad("not a URL"))?;

        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(self.connect_timeout);
        connector.set_nodelay(true);
        connector.set_keepalive(self.tcp_keepalive);
        if let Some(idle) = self.tcp_keepalive {
            // Whole seconds, as the system counts them (the builder's idle is).
            let interval = Duration::from_secs((idle.as_secs() / 3).max(1));
            connector.set_keepalive_interval(Some(interval));
            connector.set_keepalive_retries(Some(KEEPALIVE_PROBES));
            // Keepalive probes only a connection with nothing in flight: bytes the vanished
            // host never acknowledges (an HTTP/2 window update sent as it went, a request
            // still on its way) leave the connection to the retransmissions, a quarter of an
            // hour. They are given as long as the probes.
            #[cfg(any(target_os = "android", target_os = "fuchsia", target_os = "linux"))]
            connector.set_tcp_user_timeout(Some(idle + interval * KEEPALIVE_PROBES));
        }
        let client = |max_idle| {
            let mut client = Client::builder(TokioExecutor::new());
            client
                .pool_idle_timeout(self.pool_idle_timeout)
                .pool_max_idle_per_host(max_idle)
                .http2_only(self.http2)
                // Without a timer the pool never closes idle connections.
                .pool_timer(hyper_util::rt::TokioTimer::new());
            client.build(connector.clone())
        };
        // A request sent again goes out on a connection of its own: another idle one in the
        // pool may have been closed unseen as well (several streams ending at once).
        let fresh = self.resend.map(|_| client(0));
        let client = client(self.pool_max_idle_per_host);
        Ok(HttpBackend {
            inner: Arc::new(Inner {
                client,
                fresh,
                connector,
                base,
                scheme,
                authority,
                host,
                version: if self.http2 {
                    Version::HTTP_2
                } else {
                    Version::HTTP_11
                },
                response_timeout: self.response_timeout,
                body_idle_timeout: self.body_idle_timeout,
                resend: self.resend,
            }),
        })
    }
}

impl<B: Clone> Builder<B> {
    /// Send a request once more, on another connection, when the connection it went out on
    /// closes before any answer comes (off by default; for a request body that is `Clone`,
    /// as [`BodyKeyLayer`](crate::key::BodyKeyLayer)'s `Full<Bytes>` is). Turn it on in front
    /// of llama-server.
    ///
    /// llama-server closes its connection after each streamed answer, without saying so
    /// ahead (no `Connection: close`). The slot that answer frees lets a waiting request
    /// through at that very moment, and the request goes out on the same connection, taken
    /// back from the pool before the close is seen: the backend never reads it, and it fails
    /// with [`FailureKind::Reset`](super::FailureKind::Reset). Counted as the backend's
    /// failure, a healthy backend is passed over for the failure cooldown and its sessions
    /// move. Sent again, on a connection opened for it (another idle one in the pool may have
    /// closed unseen too, when several streams end at once), it is answered. A backend that
    /// is really gone fails the second sending too (its connection refused), and that is its
    /// failure. The response timeout counts from the first sending.
    ///
    /// A closed connection does not say whether the backend read the request: every request
    /// whose connection closes before its answer's headers is sent again, one the backend
    /// did read too (it crashed on it and was back at once, or something between cut the
    /// connection while the backend was still reading a long prompt). A model server then
    /// reads that prompt a second time; a backend whose requests act on something, and may
    /// not run twice, is no backend for this setting.
    ///
    /// Over HTTP/2, a backend's `GOAWAY` before the answer, or its refusal of the stream
    /// (`REFUSED_STREAM`), is such a close too: a backend that drains its connections (a
    /// restart, a limit on a connection's age) turns down a stream that came too late, and
    /// says it did not process it.
    ///
    /// An answer to a request sent again carries [`SentAgain`](crate::SentAgain) in its
    /// extensions: the balancer counts it for the backend
    /// ([`BackendStatus::sent_again`](crate::BackendStatus::sent_again)), where a count that
    /// grows says how often the backend closes a connection a request was sent on.
    ///
    /// Each request then keeps a copy of its head (and a clone of its body) until its
    /// answer's headers come.
    ///
    /// ```
    /// use http_body_util::Full;
    /// use bytes::Bytes;
    /// use tower_affinity::client::HttpBackend;
    ///
    /// let backend = HttpBackend::<Full<Bytes>>::builder()
    ///     .resend_on_close(true)
    ///     .build("http://10.0.0.1:8080")
    ///     .unwrap();
    /// assert!(format!("{backend:?}").contains("resend_on_close: true"));
    /// ```
    pub fn resend_on_close(mut self, on: bool) -> Self {
        self.resend = on.then_some(copy_request::<B> as Copy<B>);
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::Empty;

    type Backend = HttpBackend<Empty<bytes::Bytes>>;

    #[test]
    fn only_a_plain_http_authority_is_a_backend_url() {
        for (url, why) in [
            ("https://x:443", "https"),
            ("ftp://x", "scheme"),
            ("x:80", "scheme"),
            ("http://x:80/v1", "paths"),
            ("http://x:80/?a=1", "paths"),
            ("http://u@x:80", "user info"),
            ("not a url", "not a URL"),
            ("http://x:99999", "port"),
            ("http://x:808080", "port"),
            ("http://x:65536", "port"),
            ("http://x:0", "port"),
            ("http://[::1]:70000", "port"),
        ] {
            let e = Backend::new(url).unwrap_err().to_string();
            assert!(e.contains(why), "{url}: {e}");
        }
        for url in [
            "http://x:8080",
            "http://x:8080/",
            "http://[::1]:9",
            "http://x",
            "http://x:",
            "http://x:65535",
        ] {
            Backend::new(url).unwrap_or_else(|e| panic!("{url}: {e}"));
        }
    }

    /// `http`'s parse takes a port with a sign (`:+80`, read as 80 by `u16`'s parse): no
    /// URI has one, and such a URL is refused, as a port of anything but digits is.
    #[test]
    fn a_port_in_a_backend_url_is_digits_alone() {
        for url in [
            "http://x:+80",
            "http://x:+8080/",
            "http://[::1]:+9",
            "http://x:-80",
        ] {
            let e = Backend::new(url).map(|b| b.inner.base.clone());
            let e = e.expect_err(url).to_string();
            assert!(e.contains("port"), "{url}: {e}");
        }
        for url in ["http://x:080", "http://[::1]:9"] {
            Backend::new(url).unwrap_or_else(|e| panic!("{url}: {e}"));
        }
    }

    /// A zero timeout would fail every connection, or every request (and mark every backend
    /// down): each has a floor, as `HealthProbe::timeout` has; `None` turns one off.
    #[test]
    fn a_zero_timeout_is_the_floor_not_a_failure_of_every_request() {
        let ms = Duration::from_millis;
        let zero = Builder::<Empty<bytes::Bytes>>::new()
            .connect_timeout(Duration::ZERO)
            .response_timeout(Duration::ZERO)
            .body_idle_timeout(Duration::ZERO);
        assert_eq!(zero.connect_timeout, Some(ms(1)));
        let backend = zero.build("http://10.0.0.1:8080").unwrap();
        assert_eq!(backend.response_timeout(), Some(ms(1)));
        assert_eq!(backend.body_idle_timeout(), Some(ms(1)));
        let off = Builder::<Empty<bytes::Bytes>>::new()
            .connect_timeout(None)
            .response_timeout(None);
        assert_eq!(off.connect_timeout, None);
        assert_eq!(off.response_timeout, None);
        let kept = Builder::<Empty<bytes::Bytes>>::new().connect_timeout(ms(2));
        assert_eq!(kept.connect_timeout, Some(ms(2)));
    }

    #[test]
    fn a_backend_url_without_a_host_is_refused() {
        for url in [
            "http://:8080",
            "http://:8080/",
            "http://[]:8080",
            "http://:",
        ] {
            let e = Backend::new(url).map(|b| b.inner.base.clone());
            let e = e.expect_err(url).to_string();
            assert!(e.contains("no host"), "{url}: {e}");
        }
        // Beside them, a host of one letter is one.
        Backend::new("http://x:8080").unwrap();
    }

    #[test]
    fn host_is_the_authority_less_the_default_port() {
        let host = |url: &str| Backend::new(url).unwrap().inner.host.clone();
        assert_eq!(host("http://x:8080"), "x:8080");
        assert_eq!(host("http://x:80"), "x");
        assert_eq!(host("http://x"), "x");
        assert_eq!(host("http://[::1]:9"), "[::1]:9");
    }

    #[test]
    fn prepare_rewrites_the_target_and_keeps_path_and_query() {
        let b = Backend::new("http://10.0.0.1:8080").unwrap();
        let req = Request::post("http://proxy:80/v1/chat?x=1")
            .version(Version::HTTP_2)
            .header("host", "proxy")
            .header("connection", "x-hop")
            .header("x-hop", "1")
            .body(Empty::new())
            .unwrap();
        let req = b.prepare(req, true).unwrap();
        assert_eq!(req.uri(), "http://10.0.0.1:8080/v1/chat?x=1");
        assert_eq!(req.headers()["host"], "10.0.0.1:8080");
        assert_eq!(req.version(), Version::HTTP_11);
        assert!(!req.headers().contains_key("x-hop"));
        let req = b.prepare(req, false).unwrap();
        assert_eq!(req.uri(), "/v1/chat?x=1");
    }

    #[test]
    fn a_content_length_goes_as_the_body_says_when_the_body_knows_its_length() {
        fn declared<T>(req: &Request<T>) -> String {
            let v: Vec<_> = req
                .headers()
                .get_all(header::CONTENT_LENGTH)
                .iter()
                .collect();
            format!("{v:?}")
        }
        let b = Backend::new("http://10.0.0.1:8080").unwrap();
        // An empty body is 0 long, whatever was declared; with nothing declared, nothing is
        // added here (the connection adds what it needs).
        let req = Request::post("/").header("content-length", "7");
        let req = b.prepare(req.body(Empty::new()).unwrap(), true).unwrap();
        assert_eq!(declared(&req), r#"["0"]"#);
        let req = Request::post("/").body(Empty::new()).unwrap();
        assert_eq!(declared(&b.prepare(req, true).unwrap()), "[]");

        // A stream that does not know its length keeps the declared one, by which the
        // connection frames it.
        type Stream = http_body_util::StreamBody<
            tokio_stream::Iter<std::vec::IntoIter<Result<http_body::Frame<bytes::Bytes>, String>>>,
        >;
        let b = HttpBackend::<Stream>::new("http://10.0.0.1:8080").unwrap();
        let body = http_body_util::StreamBody::new(tokio_stream::iter(vec![]));
        let req = Request::post("/").header("content-length", "7");
        let req = b.prepare(req.body(body).unwrap(), true).unwrap();
        assert_eq!(declared(&req), r#"["7"]"#);
    }

    /// Every setting of a builder, to compare builders by.
    type Settings = (
        Option<Duration>,
        Option<Duration>,
        Option<Duration>,
        Option<Duration>,
        bool,
        Option<Duration>,
        usize,
        bool,
    );

    fn settings<B>(b: &Builder<B>) -> Settings {
        (
            b.connect_timeout,
            b.response_timeout,
            b.body_idle_timeout,
            b.tcp_keepalive,
            b.http2,
            b.pool_idle_timeout,
            b.pool_max_idle_per_host,
            b.resend.is_some(),
        )
    }

    /// A builder with every setting changed from its default.
    fn changed() -> Builder<Empty<bytes::Bytes>> {
        Builder::new()
            .connect_timeout(Duration::from_millis(5))
            .response_timeout(Duration::from_millis(6))
            .body_idle_timeout(Duration::from_millis(7))
            .tcp_keepalive(Duration::from_secs(8))
            .http2_prior_knowledge(true)
            .pool_idle_timeout(None)
            .pool_max_idle(3)
            .resend_on_close(true)
    }

    #[test]
    fn each_builder_setting_is_kept_as_given() {
        let ms = Duration::from_millis;
        assert_eq!(
            settings(&changed()),
            (
                Some(ms(5)),
                Some(ms(6)),
                Some(ms(7)),
                Some(Duration::from_secs(8)),
                true,
                None,
                3,
                true
            )
        );
        let pool = Builder::<Empty<bytes::Bytes>>::new().pool_idle_timeout(ms(9));
        assert_eq!(pool.pool_idle_timeout, Some(ms(9)));
    }

    /// A clone is how many backends are built alike.
    #[test]
    fn a_cloned_builder_keeps_every_setting() {
        let builder = changed();
        assert_eq!(settings(&builder.clone()), settings(&builder));
    }

    #[test]
    fn a_builders_debug_shows_its_settings() {
        let shown = format!("{:?}", changed());
        for setting in [
            "connect_timeout: Some(5ms)",
            "http2: true",
            "pool_idle_timeout: None",
            "pool_max_idle_per_host: 3",
            "resend_on_close: true",
        ] {
            assert!(shown.contains(setting), "{setting}: {shown}");
        }
    }

    #[test]
    fn http2_prior_knowledge_is_off_unless_asked_for() {
        let http1 = Backend::new("http://x:8080").unwrap();
        assert!(!http1.http2_prior_knowledge());
        let h2 = Backend::builder().http2_prior_knowledge(true);
        assert!(h2.build("http://x:8080").unwrap().http2_prior_knowledge());
    }

    #[test]
    fn a_content_length_is_read_as_decimal_digits_only() {
        assert_eq!(decimal(b"0"), Some(0));
        assert_eq!(decimal(b"007"), Some(7));
        assert_eq!(decimal(b"18446744073709551615"), Some(u64::MAX));
        for bad in [
            &b""[..],
            b"+3",
            b" 3",
            b"3 ",
            b"-0",
            b"1e3",
            b"0x10",
            b"18446744073709551616",
        ] {
            assert_eq!(decimal(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }
}
