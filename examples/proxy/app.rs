//! The proxy itself: upstream client, router, health probes and metrics.
//!
//! `main.rs` runs it from the command line; the integration tests in `tests/proxy/` include
//! this file to run the very same code against stub servers.

use std::collections::{HashMap, HashSet};
use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Method, Request, Response, StatusCode, Uri, Version};
use http_body_util::{BodyExt, Either, Empty, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::{Client, ResponseFuture};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use pin_project_lite::pin_project;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use tokio::task::JoinSet;
use tower::retry::Retry;
use tower::{Layer, Service, ServiceExt};
use tower_affinity::discover::{self, FleetChannel, FleetHandle};
use tower_affinity::key::{
    BodyKey, BodyKeyFuture, BodyKeyLayer, BodyKeyResponseBody, ExtensionKey, FirstOf, HeaderKey,
};
use tower_affinity::placement::{LeastLoaded, NodeThenBackend, Placement, Rendezvous, RoundRobin};
use tower_affinity::{
    Backend, BackendStatus, BoxError, Decision, ErrorToResponse, Outcome, Overflow, ResponseBody,
    RetryOnce, SessionAffinity, SessionAffinityLayer,
};

use crate::per_client;

/// The request body once [`BodyKeyLayer`] has buffered it: cloneable, so a failed attempt can
/// be retried.
pub(crate) type ReqBody = Full<Bytes>;

/// The balancer as the proxy builds it.
pub(crate) type Affinity =
    SessionAffinity<FleetChannel<Upstream>, FirstOf<HeaderKey, ExtensionKey>, Arc<dyn Placement>>;

// === configuration ===

/// One `--backend NODE=URL[,slots=N][,id=NAME][,cache=TOKENS]`, less its cache budget (see
/// [`Config::cache_tokens`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct BackendSpec {
    /// The backend's name in decisions and metrics: `id=`, else the URL's `host:port`.
    pub(crate) id: String,
    pub(crate) node: String,
    pub(crate) scheme: Scheme,
    pub(crate) authority: Authority,
    /// `None`: one slot until the probe reads `/slots`.
    pub(crate) slots: Option<NonZeroU32>,
}

/// `--policy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Policy {
    NodeThenBackend,
    RoundRobin,
    LeastLoaded,
    Rendezvous,
}

impl Policy {
    pub(crate) const NAMES: [(&'static str, Policy); 4] = [
        ("node-then-backend", Policy::NodeThenBackend),
        ("round-robin", Policy::RoundRobin),
        ("least-loaded", Policy::LeastLoaded),
        ("rendezvous", Policy::Rendezvous),
    ];

    pub(crate) fn name(self) -> &'static str {
        Self::NAMES
            .iter()
            .find(|(_, p)| *p == self)
            .map_or("?", |(n, _)| n)
    }

    fn build(self) -> Arc<dyn Placement> {
        match self {
            Policy::NodeThenBackend => Arc::new(NodeThenBackend::new()),
            Policy::RoundRobin => Arc::new(RoundRobin::new()),
            Policy::LeastLoaded => Arc::new(LeastLoaded::new()),
            Policy::Rendezvous => Arc::new(Rendezvous),
        }
    }
}

/// Everything the proxy needs, as parsed from the command line.
#[derive(Clone, Debug)]
pub(crate) struct Config {
    pub(crate) backends: Vec<BackendSpec>,
    /// The cache budgets given with `cache=`, in tokens, by backend id; a backend without one
    /// has [`Backend::DEFAULT_CACHE_TOKENS`]. Beside the specs rather than in them, so that a
    /// spec built field by field needs no budget.
    pub(crate) cache_tokens: HashMap<String, u64>,
    pub(crate) policy: Policy,
    pub(crate) overflow: Overflow,
    pub(crate) connect_timeout: Duration,
    /// The longest wait for a backend's response headers; `None` waits as long as it takes.
    /// A backend past it has failed the request: it is passed over for `failure_cooldown`
    /// and the request is retried once elsewhere.
    pub(crate) response_timeout: Option<Duration>,
    pub(crate) failure_cooldown: Duration,
    pub(crate) body_limit: usize,
    pub(crate) read_timeout: Option<Duration>,
    /// `None` turns the active probe off.
    pub(crate) probe_interval: Option<Duration>,
    pub(crate) probe_timeout: Duration,
    /// Learn the slot count of backends given without `slots=` from llama-server's `/slots`.
    pub(crate) probe_slots: bool,
    /// How requests reach the backends.
    pub(crate) upstream: UpstreamMode,
}

/// How requests reach the backends (`--upstream`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum UpstreamMode {
    /// One pool of backend connections shared by all client connections.
    #[default]
    Pooled,
    /// Each client connection opens and drives its own (see [`per_client`]).
    PerClient,
}

impl Config {
    pub(crate) fn new(backends: Vec<BackendSpec>) -> Self {
        Config {
            backends,
            cache_tokens: HashMap::new(),
            policy: Policy::NodeThenBackend,
            overflow: Overflow::default(),
            connect_timeout: Duration::from_secs(2),
            // Long: a non-streamed answer comes after its whole prompt is read and its whole
            // reply written, minutes on modest GPUs.
            response_timeout: Some(Duration::from_secs(600)),
            failure_cooldown: Duration::from_secs(5),
            body_limit: BodyKeyLayer::DEFAULT_LIMIT,
            read_timeout: Some(Duration::from_secs(60)),
            probe_interval: Some(Duration::from_secs(2)),
            probe_timeout: Duration::from_secs(2),
            probe_slots: true,
            upstream: UpstreamMode::Pooled,
        }
    }

    /// The cache budget of the backend with id `id`, in tokens: what the cache model assumes
    /// it holds of the prompts it served (see [`Backend::cache_tokens`]).
    pub(crate) fn cache_tokens(&self, id: &str) -> u64 {
        self.cache_tokens
            .get(id)
            .copied()
            .unwrap_or(Backend::<Upstream>::DEFAULT_CACHE_TOKENS)
    }

    /// The balancer's view of `spec`: its node, its slots (one until the probe reads them) and
    /// its cache budget.
    fn backend(
        &self,
        spec: &BackendSpec,
        upstream: Upstream,
        slots: NonZeroU32,
    ) -> Backend<Upstream> {
        Backend::new(spec.node.as_str(), upstream)
            .slots(slots)
            .cache_tokens(self.cache_tokens(&spec.id))
    }
}

// === upstream ===

/// One backend's HTTP client: sends the request to the backend's scheme and authority and
/// leaves everything else as the client sent it, except hop-by-hop headers and `Host`.
///
/// Cloned for every request it serves, so it is one reference-counted pointer.
#[derive(Clone, Debug)]
pub(crate) struct Upstream {
    inner: Arc<UpstreamInner>,
}

#[derive(Debug)]
pub(crate) struct UpstreamInner {
    pub(crate) client: Client<HttpConnector, ReqBody>,
    /// Connects a client connection's own backend connections (`--upstream per-client`).
    pub(crate) connector: HttpConnector,
    /// `scheme://authority/`, what `connector` connects to.
    pub(crate) base: Uri,
    scheme: Scheme,
    authority: Authority,
    /// `Host` for the backend, made once: what the client would otherwise format for every
    /// request (the host, and the port unless it is the scheme's default).
    host: HeaderValue,
    response_timeout: Option<Duration>,
    per_client: bool,
}

impl Upstream {
    fn new(
        client: Client<HttpConnector, ReqBody>,
        connector: HttpConnector,
        spec: &BackendSpec,
        config: &Config,
    ) -> Result<Self, BoxError> {
        let (scheme, authority) = (spec.scheme.clone(), spec.authority.clone());
        let default_port = if scheme == Scheme::HTTPS { 443 } else { 80 };
        let host = match authority.port_u16() {
            Some(port) if port != default_port => format!("{}:{port}", authority.host()),
            _ => authority.host().to_string(),
        };
        let host = HeaderValue::try_from(host)?;
        let base = Uri::builder()
            .scheme(scheme.clone())
            .authority(authority.clone())
            .path_and_query("/")
            .build()?;
        Ok(Upstream {
            inner: Arc::new(UpstreamInner {
                client,
                connector,
                base,
                scheme,
                authority,
                host,
                response_timeout: config.response_timeout,
                per_client: config.upstream == UpstreamMode::PerClient,
            }),
        })
    }
}

impl UpstreamInner {
    /// `req` with the backend's scheme and authority in its URI, as the pooled client needs.
    pub(crate) fn absolute(&self, mut req: Request<ReqBody>) -> Result<Request<ReqBody>, BoxError> {
        let mut parts = req.uri().clone().into_parts();
        parts.scheme = Some(self.scheme.clone());
        parts.authority = Some(self.authority.clone());
        if parts.path_and_query.is_none() {
            parts.path_and_query = Some(PathAndQuery::from_static("/"));
        }
        *req.uri_mut() = Uri::from_parts(parts)?;
        Ok(req)
    }
}

/// Headers that describe one connection, not the message (RFC 9110, section 7.6.1), besides
/// those that `Connection` names. `Connection` comes first; the order is that of
/// [`hop_by_hop_index`].
pub(crate) static HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHORIZATION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
];

/// The index in [`HOP_BY_HOP`] of `name`, if it is there: one match on the name's text, the
/// same for standard and custom names.
pub(crate) fn hop_by_hop_index(name: &HeaderName) -> Option<usize> {
    Some(match name.as_str() {
        "connection" => 0,
        "te" => 1,
        "trailer" => 2,
        "transfer-encoding" => 3,
        "upgrade" => 4,
        "proxy-authorization" => 5,
        "keep-alive" => 6,
        "proxy-connection" => 7,
        _ => return None,
    })
}

/// Removes the hop-by-hop headers: those of [`HOP_BY_HOP`] and those `Connection` names.
/// Allocates nothing unless `Connection` has more than one line.
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Which of `HOP_BY_HOP` are present, one bit each: one pass over the names, no lookups.
    // Most requests have none.
    let mut present = 0u8;
    for name in headers.keys() {
        if let Some(i) = hop_by_hop_index(name) {
            present |= 1 << i;
        }
    }
    if present == 0 {
        return;
    }
    if present & 1 != 0 {
        // `Connection` (`HOP_BY_HOP[0]`). Its values are handles on the bytes received, not
        // copies, kept so that the headers they name can be removed.
        let mut connection = headers.get_all(header::CONNECTION).iter();
        let first = connection.next().cloned();
        let more: Vec<HeaderValue> = connection.cloned().collect();
        for value in first.iter().chain(&more) {
            let Ok(value) = value.to_str() else { continue };
            for name in value.split(',').map(str::trim) {
                // Looked up by `&str`, without making a `HeaderName`: an invalid name finds
                // nothing. Those of `HOP_BY_HOP` (`keep-alive`, ...) go below.
                if !name.is_empty()
                    && !HOP_BY_HOP
                        .iter()
                        .any(|h| name.eq_ignore_ascii_case(h.as_str()))
                {
                    headers.remove(name);
                }
            }
        }
    }
    for (i, name) in HOP_BY_HOP.iter().enumerate() {
        if present & (1 << i) != 0 {
            headers.remove(name);
        }
    }
}

impl Service<Request<ReqBody>> for Upstream {
    type Response = Response<Incoming>;
    type Error = BoxError;
    type Future = UpstreamFuture;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // The client pools connections itself and is always ready.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut req: Request<ReqBody>) -> Self::Future {
        let inner = &*self.inner;
        strip_hop_by_hop(req.headers_mut());
        // The client keeps a `Host` it finds.
        req.headers_mut().insert(header::HOST, inner.host.clone());
        // The backend connection is HTTP/1.1 whatever the client spoke.
        *req.version_mut() = Version::HTTP_11;
        if let Some(conns) = inner.per_client.then(per_client::current).flatten() {
            // The request line carries the target in origin-form, as the pooled client writes it.
            if req.uri().authority().is_some() {
                let mut parts = http::uri::Parts::default();
                parts.path_and_query = Some(
                    req.uri()
                        .path_and_query()
                        .cloned()
                        .unwrap_or_else(|| PathAndQuery::from_static("/")),
                );
                match Uri::from_parts(parts) {
                    Ok(uri) => *req.uri_mut() = uri,
                    Err(e) => return UpstreamFuture::failed(e.into()),
                }
            }
            let fut = per_client::send(conns, &self.inner, req);
            return UpstreamFuture::new(inner, Route::PerClient(Box::pin(fut)));
        }
        match inner.absolute(req) {
            Ok(req) => UpstreamFuture::new(inner, Route::Pooled(inner.client.request(req))),
            Err(e) => UpstreamFuture::failed(e),
        }
    }
}

/// Where a request went: through the pooled client, or on a backend connection of its client
/// connection.
enum Route {
    Pooled(ResponseFuture),
    PerClient(Pin<Box<dyn Future<Output = Result<Response<Incoming>, BoxError>> + Send>>),
}

impl Future for Route {
    type Output = Result<Response<Incoming>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.get_mut() {
            Route::Pooled(fut) => Pin::new(fut).poll(cx).map_err(Into::into),
            Route::PerClient(fut) => fut.as_mut().poll(cx),
        }
    }
}

pin_project! {
    /// The response future of [`Upstream`]: the client's, with hop-by-hop headers stripped
    /// from the response, and a deadline for the response headers if one is set.
    pub(crate) struct UpstreamFuture {
        #[pin]
        state: UpstreamState,
    }
}

pin_project! {
    #[project = UpstreamProj]
    enum UpstreamState {
        Sending { fut: Route },
        Timed { #[pin] fut: tokio::time::Timeout<Route>, after: Duration },
        Failed { error: Option<BoxError> },
    }
}

impl UpstreamFuture {
    fn new(inner: &UpstreamInner, fut: Route) -> Self {
        UpstreamFuture {
            state: match inner.response_timeout {
                None => UpstreamState::Sending { fut },
                Some(after) => UpstreamState::Timed {
                    fut: tokio::time::timeout(after, fut),
                    after,
                },
            },
        }
    }

    fn failed(e: BoxError) -> Self {
        UpstreamFuture {
            state: UpstreamState::Failed { error: Some(e) },
        }
    }
}

impl fmt::Debug for UpstreamFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UpstreamFuture").finish_non_exhaustive()
    }
}

impl Future for UpstreamFuture {
    type Output = Result<Response<Incoming>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut res = match self.project().state.project() {
            UpstreamProj::Sending { fut } => ready!(Pin::new(fut).poll(cx))?,
            UpstreamProj::Timed { fut, after } => match ready!(fut.poll(cx)) {
                Ok(res) => res?,
                // A timeout in the error's chain makes the balancer's answer 504, not 502.
                Err(_) => {
                    return Poll::Ready(Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("no response headers within {after:?}"),
                    )
                    .into()))
                }
            },
            UpstreamProj::Failed { error } => {
                return Poll::Ready(Err(error
                    .take()
                    .unwrap_or_else(|| "UpstreamFuture polled after completion".into())))
            }
        };
        strip_hop_by_hop(res.headers_mut());
        Poll::Ready(Ok(res))
    }
}

// === proxy ===

/// The proxy: the balancer, its fleet, and the metrics registry.
pub(crate) struct Proxy {
    affinity: Affinity,
    fleet: FleetHandle<Upstream>,
    upstreams: Vec<(BackendSpec, Upstream)>,
    config: Config,
    registry: Arc<Registry>,
    wait_seconds: Histogram,
    probe_client: Client<HttpConnector, Empty<Bytes>>,
}

impl fmt::Debug for Proxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Proxy")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Proxy {
    /// Builds the balancer over the configured backends. The fleet is in place when this
    /// returns, so probes and metrics see it before the first request.
    pub(crate) async fn new(config: Config) -> Result<Self, BoxError> {
        let mut ids = HashSet::new();
        for b in &config.backends {
            if !ids.insert(b.id.as_str()) {
                return Err(format!("backend id {:?} is given twice; set id=NAME", b.id).into());
            }
        }
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(config.connect_timeout));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new()).build(connector.clone());
        let probe_client = Client::builder(TokioExecutor::new()).build(connector.clone());

        let (fleet, discovery) = discover::channel();
        let upstreams = config
            .backends
            .iter()
            .map(|spec| {
                let upstream = Upstream::new(client.clone(), connector.clone(), spec, &config)?;
                Ok((spec.clone(), upstream))
            })
            .collect::<Result<Vec<_>, BoxError>>()?;
        for (spec, upstream) in &upstreams {
            let slots = spec.slots.unwrap_or(NonZeroU32::MIN);
            fleet.insert(
                spec.id.as_str(),
                config.backend(spec, upstream.clone(), slots),
            );
        }
        let mut affinity = SessionAffinityLayer::new()
            .key(FirstOf::new(HeaderKey::default(), ExtensionKey))
            .placement(config.policy.build())
            .overflow(config.overflow)
            .failure_cooldown(config.failure_cooldown)
            .decision_headers(true)
            .layer(discovery);
        apply_fleet_changes(&mut affinity).await;

        let wait_seconds = Histogram::new([
            0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
        ]);
        let mut registry = Registry::default();
        registry.register(
            "tower_affinity_wait_seconds",
            "Time placed requests waited for a free slot (0 when they did not wait)",
            wait_seconds.clone(),
        );
        registry.register_collector(Box::new(AffinityCollector {
            affinity: affinity.clone(),
        }));

        Ok(Proxy {
            affinity,
            fleet,
            upstreams,
            config,
            registry: Arc::new(registry),
            wait_seconds,
            probe_client,
        })
    }

    /// The balancer, for its stats and backend states.
    pub(crate) fn affinity(&self) -> &Affinity {
        &self.affinity
    }

    /// The service that [`serve`] runs: `/metrics` answered here, every other request sent to
    /// a backend.
    pub(crate) fn front(&self) -> Front {
        // Every JSON body is read, a request keyed by a header too: headers still win for the
        // key (see `Affinity`), but the balancer's cache model needs every request's prompt
        // chain (`PromptFacts`) to know what each backend holds.
        let mut body_key = BodyKeyLayer::new().limit(self.config.body_limit);
        if let Some(t) = self.config.read_timeout {
            body_key = body_key.read_timeout(t);
        }
        let forward = body_key.layer(ErrorToResponse::new(Retry::new(
            RetryOnce::new(),
            self.affinity.clone(),
        )));
        Front {
            shared: Arc::new(FrontShared {
                registry: self.registry.clone(),
                wait_seconds: self.wait_seconds.clone(),
                upstream: self.config.upstream,
            }),
            forward,
        }
    }

    /// A fresh probe state per backend: every backend is taken as up until probed.
    pub(crate) fn probes(&self) -> Vec<Probe> {
        (0..self.upstreams.len()).map(Probe::new).collect()
    }

    /// Probes every backend once, in turn, acting on transitions from `states`.
    pub(crate) async fn probe_all(&self, states: &mut [Probe]) {
        for probe in states {
            self.check(probe).await;
        }
    }

    /// Starts one probe task per backend, each polling every `probe_interval` and carrying on
    /// from `states`. Empty when probing is off. Dropping the set stops them.
    pub(crate) fn spawn_probes(self: &Arc<Self>, states: Vec<Probe>) -> JoinSet<()> {
        let mut tasks = JoinSet::new();
        let Some(interval) = self.config.probe_interval else {
            return tasks;
        };
        for mut probe in states {
            let proxy = self.clone();
            tasks.spawn(async move {
                let mut tick = tokio::time::interval(interval);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                // The first tick is immediate and the caller has just probed.
                tick.tick().await;
                loop {
                    tick.tick().await;
                    proxy.check(&mut probe).await;
                }
            });
        }
        tasks
    }

    async fn check(&self, probe: &mut Probe) {
        let (spec, upstream) = &self.upstreams[probe.backend];
        let health = self.get(spec, "/health").await;
        let ready = match &health {
            Ok((StatusCode::OK, _)) => Ok(()),
            Ok((StatusCode::SERVICE_UNAVAILABLE, _)) => Err("loading".to_string()),
            Ok((status, _)) => Err(format!("/health answered {status}")),
            Err(e) => Err(format!("/health failed: {}", causes(&**e))),
        };
        match (ready, probe.up) {
            (Ok(()), false) => {
                probe.up = true;
                self.affinity.mark_up(&spec.id);
                tracing::info!(backend = %spec.id, node = %spec.node, "backend up: /health is 200");
            }
            (Err(reason), true) => {
                probe.up = false;
                self.affinity.mark_down(&spec.id, None);
                tracing::warn!(backend = %spec.id, node = %spec.node, %reason, "backend down until /health is 200");
            }
            _ => {}
        }
        if !probe.up || !self.config.probe_slots || spec.slots.is_some() {
            return;
        }
        let Ok((StatusCode::OK, body)) = self.get(spec, "/slots").await else {
            return;
        };
        let learned = serde_json::from_slice::<Vec<serde_json::Value>>(&body)
            .ok()
            .and_then(|slots| u32::try_from(slots.len()).ok())
            .and_then(NonZeroU32::new);
        let Some(slots) = learned else { return };
        if probe.slots == Some(slots) {
            return;
        }
        probe.slots = Some(slots);
        tracing::info!(backend = %spec.id, slots = slots.get(), "slot count read from /slots");
        // Same id: an update that keeps the backend's sessions. It sets the cache budget too,
        // so the configured one goes with it.
        self.fleet.insert(
            spec.id.as_str(),
            self.config.backend(spec, upstream.clone(), slots),
        );
        let mut affinity = self.affinity.clone();
        apply_fleet_changes(&mut affinity).await;
    }

    async fn get(
        &self,
        spec: &BackendSpec,
        path: &'static str,
    ) -> Result<(StatusCode, Bytes), BoxError> {
        let uri = Uri::builder()
            .scheme(spec.scheme.clone())
            .authority(spec.authority.clone())
            .path_and_query(path)
            .build()?;
        let fetch = async {
            let res = self.probe_client.get(uri).await?;
            let status = res.status();
            let body = res.into_body().collect().await?.to_bytes();
            Ok::<_, BoxError>((status, body))
        };
        tokio::time::timeout(self.config.probe_timeout, fetch)
            .await
            .map_err(|_| format!("no answer within {:?}", self.config.probe_timeout))?
    }
}

/// An error with its causes, as hyper's top-level messages ("client error (Connect)") name
/// only the step that failed.
pub(crate) fn causes(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// One backend's probe state.
#[derive(Debug)]
pub(crate) struct Probe {
    backend: usize,
    up: bool,
    slots: Option<NonZeroU32>,
}

impl Probe {
    fn new(backend: usize) -> Self {
        // Backends start up, as the balancer has them; the first failed probe marks them down.
        Probe {
            backend,
            up: true,
            slots: None,
        }
    }
}

/// The balancer applies fleet changes when polled for readiness; this polls it now rather
/// than at the next request.
async fn apply_fleet_changes(affinity: &mut Affinity) {
    let _ = ServiceExt::<Request<ReqBody>>::ready(affinity).await;
}

/// `GET /metrics` (or `HEAD`): the registry in the Prometheus text format.
fn metrics(method: &Method, registry: &Registry) -> Response<FrontBody> {
    let mut res = Response::new(FrontBody::Right(Full::default()));
    if !matches!(*method, Method::GET | Method::HEAD) {
        *res.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
        res.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("GET,HEAD"));
        return res;
    }
    let mut text = String::new();
    match prometheus_client::encoding::prometheus_text::encode(&mut text, registry) {
        Ok(()) => {
            *res.body_mut() = FrontBody::Right(Full::new(Bytes::from(text)));
            res.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static(
                    prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
                ),
            );
        }
        Err(_) => *res.status_mut() = StatusCode::INTERNAL_SERVER_ERROR,
    }
    res
}

// === metrics ===

/// Reads the balancer's counters and backend states at every scrape, so the numbers are the
/// balancer's own, never a copy that could drift.
struct AffinityCollector {
    affinity: Affinity,
}

impl fmt::Debug for AffinityCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AffinityCollector").finish_non_exhaustive()
    }
}

fn counter(enc: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: u64) -> fmt::Result {
    let m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
    ConstCounter::new(v).encode(m)
}

fn gauge(enc: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: i64) -> fmt::Result {
    let m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
    ConstGauge::new(v).encode(m)
}

impl Collector for AffinityCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> fmt::Result {
        let stats = self.affinity.stats();
        let backends = self.affinity.backends();
        {
            let mut m = enc.encode_descriptor(
                "tower_affinity_decisions",
                "Requests placed, by where they went relative to their session's home",
                None,
                MetricType::Counter,
            )?;
            for outcome in Outcome::ALL {
                let labels = [("outcome", outcome.as_str())];
                ConstCounter::new(stats.outcome(outcome)).encode(m.encode_family(&labels)?)?;
            }
        }
        let as_i64 = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        counter(
            &mut enc,
            "tower_affinity_waited",
            "Requests that waited for a slot before being placed",
            stats.waited,
        )?;
        counter(
            &mut enc,
            "tower_affinity_overcommitted",
            "Requests sent beyond a backend's slots",
            stats.overcommitted,
        )?;
        counter(
            &mut enc,
            "tower_affinity_rejected",
            "Requests refused with 429: no free slot and no room or time to wait",
            stats.rejected,
        )?;
        counter(
            &mut enc,
            "tower_affinity_no_backends",
            "Requests refused with 503: no backend up",
            stats.no_backends,
        )?;
        counter(
            &mut enc,
            "tower_affinity_backend_errors",
            "Requests whose backend failed before answering (each retried once)",
            stats.backend_errors,
        )?;
        gauge(
            &mut enc,
            "tower_affinity_in_flight",
            "Requests dispatched whose response has not ended",
            as_i64(stats.in_flight),
        )?;
        gauge(
            &mut enc,
            "tower_affinity_waiting",
            "Requests waiting for a free slot",
            as_i64(stats.waiting),
        )?;
        gauge(
            &mut enc,
            "tower_affinity_sessions",
            "Sessions in the session table",
            as_i64(stats.sessions),
        )?;

        type Read = fn(&BackendStatus) -> i64;
        let per_backend: [(&str, &str, Read); 3] = [
            (
                "tower_affinity_backend_in_flight",
                "Requests on the backend whose response has not ended",
                |b| i64::from(b.in_flight),
            ),
            (
                "tower_affinity_backend_slots",
                "Requests the backend serves at once",
                |b| i64::from(b.slots),
            ),
            (
                "tower_affinity_backend_healthy",
                "1 if the backend takes requests, 0 while it is marked down",
                |b| i64::from(b.healthy),
            ),
        ];
        for (name, help, value) in per_backend {
            let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for b in &backends {
                let labels = [("backend", b.id.as_str()), ("node", b.node.as_str())];
                ConstGauge::new(value(b)).encode(m.encode_family(&labels)?)?;
            }
        }
        let mut m = enc.encode_descriptor(
            "tower_affinity_backend_failures",
            "Requests that failed on the backend before it answered",
            None,
            MetricType::Counter,
        )?;
        for b in &backends {
            let labels = [("backend", b.id.as_str()), ("node", b.node.as_str())];
            ConstCounter::new(b.failures).encode(m.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

// === serving ===

/// Everything but `/metrics`: the body read for its key and prompt chain, then the balancer,
/// with one retry.
type Forward = BodyKey<ErrorToResponse<Retry<RetryOnce, Affinity>>>;

/// The response body of [`Front`]: a backend's (or the balancer's refusal), or the proxy's
/// own answer.
pub(crate) type FrontBody = Either<BodyKeyResponseBody<ResponseBody<Incoming>>, Full<Bytes>>;

/// The proxy's front service, one clone per request: `/metrics` answered here, every other
/// request forwarded.
#[derive(Clone)]
pub(crate) struct Front {
    shared: Arc<FrontShared>,
    forward: Forward,
}

struct FrontShared {
    registry: Arc<Registry>,
    wait_seconds: Histogram,
    upstream: UpstreamMode,
}

impl fmt::Debug for Front {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Front").finish_non_exhaustive()
    }
}

impl Service<Request<Incoming>> for Front {
    type Response = Response<FrontBody>;
    type Error = Infallible;
    type Future = FrontFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Service::<Request<Incoming>>::poll_ready(&mut self.forward, cx)
    }

    fn call(&mut self, req: Request<Incoming>) -> Self::Future {
        if req.uri().path() == "/metrics" {
            let res = metrics(req.method(), &self.shared.registry);
            return FrontFuture::Answered { res: Some(res) };
        }
        FrontFuture::Forwarding {
            fut: self.forward.call(req),
            shared: self.shared.clone(),
        }
    }
}

pin_project! {
    /// The response future of [`Front`].
    #[project = FrontFutureProj]
    pub(crate) enum FrontFuture {
        Forwarding {
            #[pin]
            fut: BodyKeyFuture<ErrorToResponse<Retry<RetryOnce, Affinity>>, Incoming>,
            shared: Arc<FrontShared>,
        },
        Answered {
            res: Option<Response<FrontBody>>,
        },
    }
}

impl Future for FrontFuture {
    type Output = Result<Response<FrontBody>, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            FrontFutureProj::Forwarding { fut, shared } => {
                let res = ready!(fut.poll(cx))?;
                if let Some(d) = res.extensions().get::<Decision>() {
                    let waited = d.waited.unwrap_or_default();
                    shared.wait_seconds.observe(waited.as_secs_f64());
                }
                Poll::Ready(Ok(res.map(Either::Left)))
            }
            FrontFutureProj::Answered { res } => Poll::Ready(Ok(res.take().unwrap_or_else(|| {
                // Polled again after its answer: nothing left to give.
                let mut res = Response::new(FrontBody::Right(Full::default()));
                *res.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
                res
            }))),
        }
    }
}

/// Serves `front` on `listener` until `shutdown` resolves, then stops accepting and lets open
/// responses finish.
pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    front: Front,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let builder = auto::Builder::new(TokioExecutor::new());
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    accept_error(e).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let service = TowerToHyperService::new(front.clone());
        let conn = builder.serve_connection(TokioIo::new(stream), service);
        let conn = graceful.watch(conn.into_owned());
        let ended = |r: Result<(), BoxError>| {
            if let Err(e) = r {
                tracing::trace!(error = %e, "connection ended with an error");
            }
        };
        match front.shared.upstream {
            UpstreamMode::Pooled => tokio::spawn(async move { ended(conn.await) }),
            UpstreamMode::PerClient => {
                tokio::spawn(async move { ended(per_client::WithClientConns::new(conn).await) })
            }
        };
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// A failed accept: a connection that went away before it was accepted is nothing; anything
/// else (out of file descriptors, say) is logged and accepting pauses for a second, so as not
/// to spin while it lasts.
async fn accept_error(e: std::io::Error) {
    use std::io::ErrorKind;
    if matches!(
        e.kind(),
        ErrorKind::ConnectionRefused | ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset
    ) {
        return;
    }
    tracing::error!(error = %e, "accept failed; pausing for 1 s");
    tokio::time::sleep(Duration::from_secs(1)).await;
}
