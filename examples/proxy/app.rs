//! The proxy itself: configuration and wiring of the library's parts, the metrics, and the
//! serving loop.
//!
//! `main.rs` runs it from the command line; the integration tests in `tests/proxy/` include
//! this file to run the very same code against stub servers.
//!
//! From the library: each backend is a `client::HttpBackend` (target rewrite, hop-by-hop
//! headers, timeouts, failures by kind), probed by `health::HealthProbe` (`/health`,
//! `/slots`), behind `BodyKeyLayer` (body limit, read timeout, key, prompt chain and model),
//! `RetryOnce`, `ReadRefusals` (a prompt refused as too long is retried where it fits) and a
//! `SessionAffinity` for each model's fleet ([`ByModel`] picks it by the body's `model`; with
//! no `model=` given there is one).
//!
//! From tower-http, around the whole front service:
//! - `TraceLayer`: a `request` span per request (method, URI, request id) with its response
//!   events, at debug level (`-v`); the balancer's own 5xx answers are logged where they are
//!   made, so its failure events stay at debug too. Without debug logs the layer is left out,
//!   since it would record nothing and still cost every request;
//! - `SetRequestIdLayer` / `PropagateRequestIdLayer`: an `x-request-id` for each request that
//!   comes without one ([`RequestIds`]: a counter, no random number per request), sent to the
//!   backend with the other headers and returned on the response;
//!
//! Hand-written still, and why:
//! - the body limit (413) and read timeout (408): `BodyKeyLayer` reads the whole body for its
//!   key and prompt chain and enforces both as it reads; `RequestBodyLimitLayer` and
//!   `TimeoutLayer` in front would count the same bytes twice;
//! - the response-header timeout: it is the backend's (`HttpBackend`), so that a backend past
//!   it fails that attempt, is passed over and the request retried; tower-http's
//!   `TimeoutLayer` would answer 408 for the whole request instead;
//! - nothing that marks headers sensitive (`SetSensitiveRequestHeadersLayer`): the request
//!   spans name no header but `x-request-id`, and a layer would cost every request lookups;
//! - `/metrics` beside the forwarding service ([`Front`]): one path match, where a router
//!   would be a dependency for one route. Its registry (prometheus-client) is the proxy's
//!   own and reads `stats()` and `backends()` at each scrape, so that several proxies in one
//!   process (as its tests run them) each show their own figures; the library's `metrics`
//!   feature records into one recorder per process instead, which `examples/axum.rs` serves;
//! - the serving loop ([`serve`]): hyper-util's connection builder with graceful shutdown,
//!   bounds on connections that have no request open (hyper has none for a connection's
//!   first bytes, nor for an idle HTTP/2 connection), and the per-client upstream mode,
//!   which must drive each client connection's own backend connections in its task (see
//!   [`per_client`]); tower-http has no serving loop.

use std::collections::{HashMap, HashSet};
use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::num::{NonZeroU32, NonZeroU64};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::Either as Route;
use http::header::{self, HeaderValue};
use http::uri::{Authority, Scheme};
use http::{Method, Request, Response, StatusCode, Uri};
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use pin_project_lite::pin_project;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;
use tower::discover::Change;
use tower::retry::Retry;
use tower::util::Oneshot;
use tower::{Layer, Service, ServiceBuilder, ServiceExt};
use tower_affinity::client::{write_id_slot, BackendBody, HttpBackend, HttpBackendError};
use tower_affinity::discover::dns::{
    DnsEndpoint, DnsFleet, DnsFleetBuilder, DnsHandle, DnsStats, DnsTarget,
};
use tower_affinity::discover::StaticFleet;
use tower_affinity::health::{HealthProbe, ProbeTarget, ProbeTask, Probed, Prober};
use tower_affinity::key::{
    BodyKey, BodyKeyFuture, BodyKeyLayer, BodyKeyResponseBody, ExtensionKey, FirstOf, HeaderKey,
    PromptFacts,
};
use tower_affinity::placement::{LeastLoaded, NodeThenBackend, Placement, Rendezvous, RoundRobin};
use tower_affinity::store::{RedisStore, StoreState, StoreStats};
use tower_affinity::{
    Backend, BackendStatus, BoxError, Decision, Error, Outcome, Overflow, ReadRefusals,
    ResponseBody, RetryOnce, Reuse, SessionAffinity, SessionAffinityLayer, Stats,
};
use tower_http::request_id::{
    MakeRequestId, PropagateRequestIdLayer, RequestId, SetRequestIdLayer,
};
use tower_http::trace::TraceLayer;

use crate::per_client;

/// The request body once [`BodyKeyLayer`] has buffered it: cloneable, so a failed attempt can
/// be retried.
pub(crate) type ReqBody = Full<Bytes>;

/// The balancer as the proxy builds it.
pub(crate) type Affinity =
    SessionAffinity<Probed<Fleets, Upstream>, FirstOf<HeaderKey, ExtensionKey>, Arc<dyn Placement>>;

// === configuration ===

/// One `--backend NODE=URL[,slots=N][,id=NAME][,cache=TOKENS][,context=TOKENS][,request-context=TOKENS][,model=NAME][,assign-slots]`,
/// less its cache budget (see [`Config::cache_tokens`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct BackendSpec {
    /// The backend's name in decisions and metrics: `id=`, else the URL's `host:port`.
    pub(crate) id: String,
    pub(crate) node: String,
    pub(crate) scheme: Scheme,
    pub(crate) authority: Authority,
    /// `None`: one slot until the probe reads `/slots`.
    pub(crate) slots: Option<NonZeroU32>,
    /// `context=`: the tokens of context its running requests share (see
    /// [`Backend::context_tokens`]); `None`, only its slots count.
    pub(crate) context: Option<NonZeroU64>,
    /// `request-context=`: the most tokens of context one request can take there (see
    /// [`Backend::request_context_tokens`]); `None`, read from `/slots` by the probe.
    pub(crate) request_context: Option<NonZeroU64>,
    /// The model it serves: the backends of a model are a fleet of their own (see
    /// [`Proxy`]); `None`, the fleet of the requests that name no other.
    pub(crate) model: Option<String>,
    /// `assign-slots`: the proxy assigns its slots (see [`Backend::assign_slots`]).
    pub(crate) assign_slots: bool,
}

/// One `--backend-dns NAME:PORT[,slots=N][,cache=TOKENS][,context=TOKENS][,request-context=TOKENS][,model=NAME][,assign-slots]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct DnsSpec {
    pub(crate) target: DnsTarget,
    /// Each of its backends' slots (see [`BackendSpec::slots`]); `None`, read from `/slots`.
    pub(crate) slots: Option<NonZeroU32>,
    /// Each of its backends' cache budget in tokens; `None`, the default (see
    /// [`Config::cache_tokens`]).
    pub(crate) cache_tokens: Option<u64>,
    /// The model its backends serve (see [`BackendSpec::model`]).
    pub(crate) model: Option<String>,
    /// The context each of its backends' requests share (see [`BackendSpec::context`]).
    pub(crate) context: Option<NonZeroU64>,
    /// The most one request can take on each of its backends (see
    /// [`BackendSpec::request_context`]).
    pub(crate) request_context: Option<NonZeroU64>,
    /// Whether the proxy assigns each of its backends' slots (see
    /// [`BackendSpec::assign_slots`]).
    pub(crate) assign_slots: bool,
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

    fn build(self, live_window: Duration) -> Arc<dyn Placement> {
        match self {
            Policy::NodeThenBackend => Arc::new(NodeThenBackend::new().live_window(live_window)),
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
    /// `NodeThenBackend::live_window`, for `--policy node-then-backend`.
    pub(crate) live_window: Duration,
    pub(crate) overflow: Overflow,
    /// The longest wait for a backend connection; `None` waits as long as the system does.
    pub(crate) connect_timeout: Option<Duration>,
    /// The longest wait for a backend's response headers; `None` waits as long as it takes.
    /// A backend past it has failed the request: it is passed over for `failure_cooldown`
    /// and the request is retried once elsewhere.
    pub(crate) response_timeout: Option<Duration>,
    /// The longest silence between two frames of a backend's answer once its first came;
    /// `None` (the default) waits as long as it takes.
    pub(crate) body_idle_timeout: Option<Duration>,
    /// TCP keepalive on the backends' connections: probed after this long without a byte,
    /// so that a backend host that vanished fails its requests; `None` turns it off.
    pub(crate) tcp_keepalive: Option<Duration>,
    /// TCP keepalive on the clients' connections, as `tcp_keepalive` on the backends': a
    /// client whose host vanished while its request waited on a long prompt's reading, no
    /// byte going either way, is disconnected and its request ended, its slot freed; `None`
    /// turns it off (see [`accept`]).
    pub(crate) client_tcp_keepalive: Option<Duration>,
    pub(crate) failure_cooldown: Duration,
    pub(crate) body_limit: usize,
    pub(crate) read_timeout: Option<Duration>,
    /// The longest time a client may take to send a request's headers, and that a
    /// connection is held with no request open: its first bytes, the next request on an
    /// HTTP/1 connection, an idle HTTP/2 connection (told to go, then closed after as long
    /// again), a ping's answer on HTTP/2 (pinged after as long without a frame). `None`
    /// waits as long as it takes. A connection past it is closed: clients that send nothing
    /// would otherwise hold connections (and file descriptors) for good. Open responses are
    /// not bounded.
    pub(crate) header_timeout: Option<Duration>,
    /// `None` turns the active probe off.
    pub(crate) probe_interval: Option<Duration>,
    pub(crate) probe_timeout: Duration,
    /// Failed probes in a row that take a backend down (a 503 does at once).
    pub(crate) probe_failures: u32,
    /// Ready probes in a row that bring a backend that is down up again.
    pub(crate) probe_successes: u32,
    /// Learn the slot count of backends given without `slots=` from llama-server's `/slots`.
    pub(crate) probe_slots: bool,
    /// `--probe-header`: sent with every probe request (the backends' API key), each value
    /// marked sensitive, so that `Debug` does not show it.
    pub(crate) probe_headers: Vec<(header::HeaderName, HeaderValue)>,
    /// Ask streams for their usage on the clients' behalf.
    pub(crate) ask_stream_usage: bool,
    /// Say on each answer where it was placed and why (`x-affinity-*`): off between tenants,
    /// as they tell a client what the caches hold.
    pub(crate) decision_headers: bool,
    /// Send once more a request whose backend connection closed before any answer
    /// (`client::Builder::resend_on_close`).
    pub(crate) resend_on_close: bool,
    /// How requests reach the backends.
    pub(crate) upstream: UpstreamMode,
    /// `--backend-dns`: names whose records are backends too.
    pub(crate) backend_dns: Vec<DnsSpec>,
    /// `--dns-server`: the nameservers to ask for them; none, the system's.
    pub(crate) dns_servers: Vec<std::net::SocketAddr>,
    /// `--dns-removal-grace`: how long a backend that answers leave out stays.
    pub(crate) dns_removal_grace: Duration,
    /// `--redis`: the store of homes shared with other instances.
    pub(crate) redis: Option<String>,
    /// `--redis-timeout`: how long a request waits for the store's answer.
    pub(crate) redis_timeout: Duration,
    /// `--replicas`: how many instances share the backends' traffic.
    pub(crate) replicas: NonZeroU32,
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

impl UpstreamMode {
    /// Its name on the command line.
    pub(crate) fn name(self) -> &'static str {
        match self {
            UpstreamMode::Pooled => "pooled",
            UpstreamMode::PerClient => "per-client",
        }
    }
}

impl Config {
    pub(crate) fn new(backends: Vec<BackendSpec>) -> Self {
        Config {
            backends,
            cache_tokens: HashMap::new(),
            policy: Policy::NodeThenBackend,
            live_window: NodeThenBackend::DEFAULT_LIVE_WINDOW,
            overflow: Overflow::default(),
            connect_timeout: Some(Duration::from_secs(2)),
            // Long: a non-streamed answer comes after its whole prompt is read and its whole
            // reply written, minutes on modest GPUs.
            response_timeout: Some(Duration::from_secs(600)),
            body_idle_timeout: None,
            tcp_keepalive: Some(Duration::from_secs(30)),
            client_tcp_keepalive: Some(Duration::from_secs(30)),
            failure_cooldown: Duration::from_secs(5),
            body_limit: BodyKeyLayer::DEFAULT_LIMIT,
            read_timeout: Some(Duration::from_secs(60)),
            header_timeout: Some(Duration::from_secs(30)),
            probe_interval: Some(Duration::from_secs(2)),
            probe_timeout: Duration::from_secs(2),
            probe_failures: 1,
            probe_successes: 1,
            probe_slots: true,
            probe_headers: Vec::new(),
            ask_stream_usage: false,
            decision_headers: true,
            resend_on_close: true,
            upstream: UpstreamMode::Pooled,
            backend_dns: Vec::new(),
            dns_servers: Vec::new(),
            dns_removal_grace: DnsFleetBuilder::DEFAULT_REMOVAL_GRACE,
            redis: None,
            redis_timeout: SessionAffinityLayer::STORE_DEADLINE,
            replicas: NonZeroU32::MIN,
        }
    }

    /// The client options every backend's connections are made with, the `--backend`s' and
    /// those a `--backend-dns` name gives.
    pub(crate) fn http(&self) -> tower_affinity::client::Builder<ReqBody> {
        HttpBackend::<ReqBody>::builder()
            .connect_timeout(self.connect_timeout)
            .response_timeout(self.response_timeout)
            .body_idle_timeout(self.body_idle_timeout)
            .tcp_keepalive(self.tcp_keepalive)
            // llama-server closes its connection after each streamed answer, unannounced.
            .resend_on_close(self.resend_on_close)
    }

    /// The cache budget of the backend with id `id`, in tokens: what the cache model assumes
    /// it holds of the prompts it served (see [`Backend::cache_tokens`]).
    pub(crate) fn cache_tokens(&self, id: &str) -> u64 {
        self.cache_tokens
            .get(id)
            .copied()
            .unwrap_or(Backend::<Upstream>::DEFAULT_CACHE_TOKENS)
    }
}

// === upstream ===

/// One backend's service: the library's [`HttpBackend`], and with `--upstream per-client`
/// the client connection's own backend connections when it has them (see [`per_client`]).
///
/// Cloned for every request it serves: a reference count and a flag.
#[derive(Clone, Debug)]
pub(crate) struct Upstream {
    pub(crate) http: HttpBackend<ReqBody>,
    per_client: bool,
}

impl Service<Request<ReqBody>> for Upstream {
    type Response = Response<BackendBody>;
    type Error = HttpBackendError;
    type Future = UpstreamFuture;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // The client pools connections itself and is always ready.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        // The slot the balancer assigned, if this backend's are (`assign-slots`), as
        // llama-server's `id_slot`.
        let req = write_id_slot(req);
        match self.per_client.then(per_client::current).flatten() {
            Some(conns) => Route::Right(Box::pin(per_client::send(conns, &self.http, req))),
            None => Route::Left(self.http.call(req)),
        }
    }
}

impl ProbeTarget for Upstream {
    fn base_uri(&self) -> &Uri {
        self.http.base_uri()
    }

    fn http2_prior_knowledge(&self) -> bool {
        self.http.http2_prior_knowledge()
    }
}

/// The response future of [`Upstream`]: the pooled client's, or a client connection's own.
pub(crate) type UpstreamFuture = Route<
    tower_affinity::client::ResponseFuture,
    Pin<Box<dyn Future<Output = Result<Response<BackendBody>, HttpBackendError>> + Send>>,
>;

/// The proxy's discovery: the `--backend`s, then as they change the backends behind each
/// `--backend-dns` name.
///
/// A backend id that two of them name (a `--backend` whose id, its `host:port` unless given
/// `id=`, is an address a name resolves to, or two names resolving to one address) is one
/// backend: the first to name it gives its node and slots, and it stays while any of them
/// names it. Each time another source comes to name it too, that is logged. Passed on as they
/// came, the second would have rewritten the first's node and slots, and its removal removed a
/// backend the other still names. A `--backend` given another `id=` for an address a name
/// resolves to is two backends, whose slots both count.
pub(crate) struct Fleets {
    fixed: Option<StaticFleet<Upstream>>,
    dns: Vec<DnsFleet<Upstream>>,
    /// Which sources name each backend, the one whose backend was passed on first; a source is
    /// 0 for the `--backend`s, `1 + i` for `dns[i]`.
    named: HashMap<tower_affinity::BackendId, Vec<usize>>,
}

type FleetChange = Change<tower_affinity::BackendId, Backend<Upstream>>;

impl Fleets {
    fn new(fixed: StaticFleet<Upstream>, dns: Vec<DnsFleet<Upstream>>) -> Self {
        Fleets {
            fixed: Some(fixed),
            dns,
            named: HashMap::new(),
        }
    }

    /// Source `source`'s change, as the balancer is to see it, if at all.
    fn merge(&mut self, source: usize, change: FleetChange) -> Option<FleetChange> {
        match change {
            Change::Insert(id, backend) => {
                let names = self.named.entry(id.clone()).or_default();
                match names.first() {
                    None => names.push(source),
                    // An update from the source that gave it.
                    Some(&first) if first == source => {}
                    Some(&first) => {
                        if !names.contains(&source) {
                            names.push(source);
                            tracing::warn!(
                                backend = %id,
                                kept = %self.source_name(first),
                                also = %self.source_name(source),
                                "backend named twice: one backend, as the first named it"
                            );
                        }
                        return None;
                    }
                }
                Some(Change::Insert(id, backend))
            }
            Change::Remove(id) => {
                let names = self.named.get_mut(&id)?;
                names.retain(|&s| s != source);
                if !names.is_empty() {
                    return None;
                }
                self.named.remove(&id);
                Some(Change::Remove(id))
            }
        }
    }

    fn source_name(&self, source: usize) -> String {
        match source.checked_sub(1) {
            None => "--backend".into(),
            Some(i) => format!("--backend-dns {}", self.dns[i].handle().target()),
        }
    }
}

impl futures_core::Stream for Fleets {
    type Item = Result<FleetChange, Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        while let Some(fixed) = this.fixed.as_mut() {
            match Pin::new(fixed).poll_next(cx) {
                Poll::Ready(Some(Ok(change))) => {
                    if let Some(change) = this.merge(0, change) {
                        return Poll::Ready(Some(Ok(change)));
                    }
                }
                // The static list is told once; the names go on.
                Poll::Ready(None) => this.fixed = None,
                Poll::Pending => break,
            }
        }
        let mut i = 0;
        while i < this.dns.len() {
            match Pin::new(&mut this.dns[i]).poll_next(cx) {
                Poll::Ready(Some(Ok(change))) => {
                    if let Some(change) = this.merge(1 + i, change) {
                        return Poll::Ready(Some(Ok(change)));
                    }
                    // Passed over: this name may have more ready.
                }
                _ => i += 1,
            }
        }
        if this.dns.is_empty() {
            Poll::Ready(None)
        } else {
            Poll::Pending
        }
    }
}

// === proxy ===

/// The backends of one model, with their own balancer and probe.
pub(crate) struct ModelFleet {
    /// The model they serve; `None`, the requests that name no other.
    pub(crate) model: Option<String>,
    pub(crate) affinity: Affinity,
    pub(crate) prober: Prober<Upstream>,
}

/// The proxy: a balancer and its probe for each model's fleet, and the metrics registry.
///
/// Backends given `model=NAME` are a fleet of their own: their own sessions, cache models and
/// metrics (labelled `model`), for the requests whose body's `model` is `NAME`. Every other
/// request goes to the backends given without a model, or if every backend has one, to the
/// first model's. With one fleet (no `model=` at all, the usual case) nothing is labelled.
pub(crate) struct Proxy {
    fleets: Vec<ModelFleet>,
    /// The fleet of the requests no other fleet's model names.
    default: usize,
    config: Config,
    registry: Arc<Registry>,
    /// Each fleet's, in the order of `fleets`.
    wait_seconds: Vec<Histogram>,
    /// One for each `--backend-dns` name: the first probes wait for its first answer.
    dns: Vec<DnsHandle>,
}

impl fmt::Debug for Proxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Proxy")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Proxy {
    /// Builds a balancer over each model's backends. The fleets are in place when this
    /// returns, so probes and metrics see them before the first request.
    pub(crate) async fn new(config: Config) -> Result<Self, BoxError> {
        one_id_each(&config.backends)?;
        // The models, in the order first given.
        let mut models: Vec<Option<&str>> = Vec::new();
        let given = (config.backends.iter().map(|b| b.model.as_deref()))
            .chain(config.backend_dns.iter().map(|d| d.model.as_deref()));
        for model in given {
            if !models.contains(&model) {
                models.push(model);
            }
        }
        // No backend at all (the command line refuses it; a config built in code may not): one
        // fleet all the same, which answers 503 until it has backends.
        if models.is_empty() {
            models.push(None);
        }
        let default = models.iter().position(Option::is_none).unwrap_or(0);
        let labelled = models.len() > 1;
        let http = config.http();
        let mut fleets = Vec::new();
        let mut dns_handles = Vec::new();
        // One wait for every model's store, not one each: N models' stores down hold the start
        // a second, not N.
        let store_wait_ends = tokio::time::Instant::now() + STORE_CONNECT_WAIT;
        for &model in &models {
            let (fleet, dns) = Self::fleet(&config, &http, model)?;
            // A name's series carry its fleet's model too: the same name may serve two.
            let label = labelled.then(|| model.unwrap_or_default().to_owned());
            dns_handles.extend(dns.into_iter().map(|h| (label.clone(), h)));
            // Without `slots=`, one slot until the probe reads `/slots`. The probe's settings
            // apply to rounds run by hand too, when the background probe is off.
            let mut probe = HealthProbe::new()
                .interval(config.probe_interval.unwrap_or(Duration::from_secs(2)))
                .timeout(config.probe_timeout)
                .failure_threshold(config.probe_failures)
                .success_threshold(config.probe_successes)
                .learn_slots(config.probe_slots);
            // The backends' API key, if they want one.
            for (name, value) in &config.probe_headers {
                probe = probe.header(name.clone(), value.clone());
            }
            let (fleet, prober) = probe.discover(fleet);
            let mut layer = SessionAffinityLayer::new()
                .key(FirstOf::new(HeaderKey::default(), ExtensionKey))
                .placement(config.policy.build(config.live_window))
                .overflow(config.overflow)
                .failure_cooldown(config.failure_cooldown)
                .replicas(config.replicas)
                .decision_headers(config.decision_headers);
            if let Some(url) = &config.redis {
                // A model's sessions are apart from another's in Redis too.
                let mut store = RedisStore::builder();
                if let Some(model) = model {
                    store = store.prefix(format!("tower-affinity:home:model={model}:"));
                }
                refuse_redis_tls(url)?;
                let store = store
                    .open(url)
                    .map_err(|e| format!("--redis {:?}: {e}", redis_url_shown(url)))?;
                // Connected before serving, so that the first reads (the health probe's check,
                // the first requests) do not take the connection's opening for an outage. A
                // Redis down then is said here: the store logs only once its attempts run out,
                // seconds later. Serving starts without it.
                let wait = tokio::time::timeout_at(store_wait_ends, store.connected()).await;
                if !matches!(wait, Ok(true)) {
                    tracing::warn!(
                        redis = %redis_url_shown(url),
                        model,
                        waited = ?STORE_CONNECT_WAIT,
                        "the shared session store is not connected; the proxy serves from its local tables until the store answers"
                    );
                }
                layer = layer.home_store(store).store_deadline(config.redis_timeout);
            }
            let affinity = layer.layer(fleet);
            affinity.apply_discovery();
            fleets.push(ModelFleet {
                model: model.map(str::to_owned),
                affinity,
                prober,
            });
        }

        let buckets = || {
            Histogram::new([
                0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
                600.0,
            ])
        };
        let (name, help) = (
            "tower_affinity_wait_seconds",
            "How long requests that waited for a free slot, and were answered, waited before being placed (tower_affinity_waited_total counts every wait that ended in a placement)",
        );
        let mut registry = Registry::default();
        let wait_seconds = if labelled {
            let family = Family::<Vec<(&'static str, String)>, Histogram>::new_with_constructor(
                buckets as fn() -> Histogram,
            );
            let each = fleets
                .iter()
                .map(|f| family.get_or_create_owned(&vec![model_label(&f.model)]))
                .collect();
            registry.register(name, help, family);
            each
        } else {
            let wait_seconds = buckets();
            registry.register(name, help, wait_seconds.clone());
            vec![wait_seconds]
        };
        let dns = dns_handles.iter().map(|(_, h)| h.clone()).collect();
        registry.register_collector(Box::new(AffinityCollector {
            fleets: fleets
                .iter()
                .map(|f| (labelled.then(|| f.model.clone()), f.affinity.clone()))
                .collect(),
            dns: dns_handles,
        }));

        Ok(Proxy {
            fleets,
            default,
            config,
            registry: Arc::new(registry),
            wait_seconds,
            dns,
        })
    }

    /// The discovery of `model`'s backends: its `--backend`s, then its `--backend-dns` names'
    /// records as they change; and a handle on each name, for the metrics.
    fn fleet(
        config: &Config,
        http: &tower_affinity::client::Builder<ReqBody>,
        model: Option<&str>,
    ) -> Result<(Fleets, Vec<DnsHandle>), BoxError> {
        let per_client = config.upstream == UpstreamMode::PerClient;
        let backends = (config.backends.iter())
            .filter(|spec| spec.model.as_deref() == model)
            .map(|spec| {
                let url = format!("{}://{}", spec.scheme, spec.authority);
                let upstream = Upstream {
                    http: http.build(&url)?,
                    per_client,
                };
                let mut backend = Backend::new(spec.node.as_str(), upstream)
                    .cache_tokens(config.cache_tokens(&spec.id));
                if let Some(slots) = spec.slots {
                    backend = backend.slots(slots);
                }
                if let Some(context) = spec.context {
                    backend = backend.context_tokens(context);
                }
                if let Some(tokens) = spec.request_context {
                    backend = backend.request_context_tokens(tokens);
                }
                if spec.assign_slots {
                    backend = backend.assign_slots();
                }
                Ok((spec.id.as_str(), backend))
            })
            .collect::<Result<Vec<_>, BoxError>>()?;
        let dns = (config.backend_dns.iter())
            .filter(|d| d.model.as_deref() == model)
            .map(|d| {
                let http = http.clone();
                let mut builder =
                    DnsFleet::builder(d.target.clone()).removal_grace(config.dns_removal_grace);
                if let Some(slots) = d.slots {
                    builder = builder.slots(slots);
                }
                if let Some(tokens) = d.cache_tokens {
                    builder = builder.cache_tokens(tokens);
                }
                if let Some(context) = d.context {
                    builder = builder.context_tokens(context);
                }
                if let Some(tokens) = d.request_context {
                    builder = builder.request_context_tokens(tokens);
                }
                if d.assign_slots {
                    builder = builder.assign_slots();
                }
                let builder = config
                    .dns_servers
                    .iter()
                    .fold(builder, |b, &ns| b.nameserver(ns));
                builder.try_build(move |ep: &DnsEndpoint| {
                    let url = format!("http://{}", ep.authority());
                    http.build(&url).map(|http| Upstream { http, per_client })
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let handles = dns.iter().map(DnsFleet::handle).collect();
        Ok((Fleets::new(StaticFleet::new(backends), dns), handles))
    }

    /// The balancer of the requests that name no model of another fleet: with one fleet, the
    /// balancer.
    #[cfg_attr(not(test), expect(dead_code, reason = "the tests read it"))]
    #[cfg_attr(
        test,
        allow(
            dead_code,
            reason = "tests/proxy reads it, the example's own tests do not"
        )
    )]
    pub(crate) fn affinity(&self) -> &Affinity {
        &self.fleets[self.default].affinity
    }

    /// Each model's fleet, in the order their models were first given.
    pub(crate) fn fleets(&self) -> &[ModelFleet] {
        &self.fleets
    }

    /// The configuration it was built with.
    pub(crate) fn config(&self) -> &Config {
        &self.config
    }

    /// The default fleet's probe, for what it found.
    #[cfg_attr(not(test), expect(dead_code, reason = "the tests read it"))]
    #[cfg_attr(
        test,
        allow(
            dead_code,
            reason = "tests/proxy reads it, the example's own tests do not"
        )
    )]
    pub(crate) fn prober(&self) -> &Prober<Upstream> {
        &self.fleets[self.default].prober
    }

    /// The service that [`serve`] runs: `/metrics` answered here, every other request sent to
    /// a backend.
    pub(crate) fn front(&self) -> Front {
        // Every JSON body is read, a request keyed by a header too: headers still win for the
        // key (see `Affinity`), but the balancer's cache model needs every request's prompt
        // chain (`PromptFacts`) to know what each backend holds, and the body's `model` says
        // which fleet serves it.
        let mut body_key = BodyKeyLayer::new()
            .limit(self.config.body_limit)
            .ask_stream_usage(self.config.ask_stream_usage);
        if let Some(t) = self.config.read_timeout {
            body_key = body_key.read_timeout(t);
        }
        let routes = (self.fleets.iter().zip(&self.wait_seconds))
            .map(|(fleet, wait_seconds)| ModelRoute {
                model: fleet.model.clone(),
                service: Retry::new(RetryOnce::new(), ReadRefusals::new(fleet.affinity.clone())),
                wait_seconds: wait_seconds.clone(),
            })
            .collect();
        let forward = body_key.layer(ByModel {
            routes: Arc::new(Routes {
                routes,
                default: self.default,
            }),
        });
        Front {
            shared: Arc::new(FrontShared {
                registry: self.registry.clone(),
                models: self.model_list(),
                upstream: self.config.upstream,
                header_timeout: self.config.header_timeout,
                client_tcp_keepalive: self.config.client_tcp_keepalive,
            }),
            forward,
        }
    }

    /// With `model=` given, what `GET /v1/models` and `GET /v1/models/NAME` answer: the models
    /// given, in OpenAI's format, for clients that offer the models an endpoint lists. The
    /// fleet without a model serves any other name, which no list can say.
    fn model_list(&self) -> Option<ModelList> {
        let models: Vec<&str> = self
            .fleets
            .iter()
            .filter_map(|f| f.model.as_deref())
            .collect();
        if models.is_empty() {
            return None;
        }
        let object = |id: &str| serde_json::json!({"id": id, "object": "model", "created": 0, "owned_by": "tower-affinity"});
        let data: Vec<serde_json::Value> = models.iter().map(|id| object(id)).collect();
        let list = serde_json::json!({"object": "list", "data": data});
        Some(ModelList {
            list: Bytes::from(list.to_string()),
            each: (models.iter())
                .map(|id| (id.to_string(), Bytes::from(object(id).to_string())))
                .collect(),
        })
    }

    /// Probes every backend once, now: marks the loading and the unreachable down, the ready
    /// up, and reads slot counts. The fleets are probed together: one whose backends do not
    /// answer holds the others back one probe timeout at most.
    ///
    /// A `--backend-dns` name's backends are known once its first answer is in, which the
    /// probes wait for, one probe timeout at most (a nameserver that does not answer takes
    /// its resolver's timeouts to fail): else they were probed only at the first interval's
    /// end, and the requests before it found them one slot each and a loading one up.
    pub(crate) async fn probe_all(&self) {
        let first = self.dns.iter().map(|dns| dns.resolved(1));
        let answers = futures_util::future::join_all(first);
        let _ = tokio::time::timeout(self.config.probe_timeout, answers).await;
        let rounds = (self.fleets.iter()).map(|fleet| fleet.prober.round(&fleet.affinity));
        futures_util::future::join_all(rounds).await;
    }

    /// Starts probing every `probe_interval` in the background, until the tasks are dropped;
    /// none when probing is off.
    pub(crate) fn spawn_probes(&self) -> Vec<ProbeTask> {
        if self.config.probe_interval.is_none() {
            return Vec::new();
        }
        (self.fleets.iter())
            .map(|f| f.prober.clone().spawn(f.affinity.clone()))
            .collect()
    }
}

/// The proxy's log at `level`: to stderr, coloured only on a terminal, so that log files stay
/// plain text. A line that cannot be written is dropped: tracing-subscriber would otherwise
/// report the failure with `eprintln!`, which panics when stderr is a pipe whose reader has
/// gone (`proxy 2>&1 | tee log` with `tee` stopped, a log shipper restarted), and the proxy
/// would stop with it, or lose the task that logged (a probe's, for good).
pub(crate) fn logs(
    level: tracing::Level,
) -> tracing_subscriber::fmt::SubscriberBuilder<
    tracing_subscriber::fmt::format::DefaultFields,
    tracing_subscriber::fmt::format::Format,
    tracing_subscriber::filter::LevelFilter,
    fn() -> std::io::Stderr,
> {
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr as fn() -> std::io::Stderr)
        .with_ansi(ansi)
        .log_internal_errors(false)
}

/// Logs the fleet the proxy starts with: a line for each `--backend` (its node, URL, slots,
/// cache budget, `context=`, `request-context=`, model and `assign-slots`) and for each
/// `--backend-dns` name (the same for each of its backends). A field that is left out was not
/// given and has no value to show.
pub(crate) fn log_fleet(config: &Config) {
    let from_slots = config.probe_interval.is_some() && config.probe_slots;
    let slots = |given: Option<NonZeroU32>| match given {
        Some(n) => n.to_string(),
        None if from_slots => "from /slots".to_string(),
        None => "1 (no slots= given, and /slots is not read)".to_string(),
    };
    // Without `request-context=`: each slot's context as `/slots` gives it, else `context=`.
    let request_context = |given: Option<NonZeroU64>| match given {
        Some(n) => Some(n.to_string()),
        None if from_slots => Some("from /slots".to_string()),
        None => None,
    };
    for b in &config.backends {
        tracing::info!(
            backend = %b.id,
            node = %b.node,
            url = %format!("{}://{}", b.scheme, b.authority),
            slots = %slots(b.slots),
            cache_tokens = config.cache_tokens(&b.id),
            context = b.context.map(NonZeroU64::get),
            request_context = request_context(b.request_context).map(tracing::field::display),
            assign_slots = b.assign_slots,
            // A backend given `model=` says so; the others, as without models, do not.
            model = b.model.as_deref(),
            "backend"
        );
    }
    for d in &config.backend_dns {
        tracing::info!(
            name = %d.target,
            slots = %slots(d.slots),
            cache_tokens = d
                .cache_tokens
                .unwrap_or(Backend::<Upstream>::DEFAULT_CACHE_TOKENS),
            context = d.context.map(NonZeroU64::get),
            request_context = request_context(d.request_context).map(tracing::field::display),
            assign_slots = d.assign_slots,
            model = d.model.as_deref(),
            "backends from DNS"
        );
    }
}

/// Logs that the proxy listens on `listen`, with the settings it serves by: the policy, what
/// a request does when every candidate is full, the shared store (`--redis`, without its
/// password), `--replicas`, `--upstream`, and whether it asks streams for their usage and
/// answers with decision headers.
pub(crate) fn log_listening(config: &Config, listen: SocketAddr) {
    let (overflow, max_wait, max_queued) = match config.overflow {
        Overflow::Wait {
            max_wait,
            max_queued,
            ..
        } => ("wait", Some(max_wait), Some(max_queued)),
        Overflow::Overcommit => ("overcommit", None, None),
        Overflow::Reject => ("reject", None, None),
        _ => ("other", None, None),
    };
    tracing::info!(
        %listen,
        policy = config.policy.name(),
        overflow,
        max_wait = max_wait.map(tracing::field::debug),
        max_queued,
        redis = (config.redis.as_deref()).map(|url| tracing::field::display(redis_url_shown(url))),
        replicas = config.replicas.get(),
        upstream = config.upstream.name(),
        ask_stream_usage = config.ask_stream_usage,
        decision_headers = config.decision_headers,
        "proxy listening"
    );
}

/// Refuses two backends of one id: one server given twice would count its slots twice.
pub(crate) fn one_id_each(backends: &[BackendSpec]) -> Result<(), String> {
    let mut ids = HashSet::new();
    for b in backends {
        if !ids.insert(b.id.as_str()) {
            return Err(format!(
                "backend id {:?} is given twice: give each server once (a server listed twice counts its slots twice), or name different servers apart with id=NAME",
                b.id
            ));
        }
    }
    Ok(())
}

/// How long a `--backend` host's name may take to resolve at start before it is passed over.
const RESOLVE_WITHIN: Duration = Duration::from_secs(2);

/// Finds two backends whose hosts resolve to one address, for a warning: one server given
/// under two names (`http://127.0.0.1:8081` and `http://localhost:8081`) has two ids, and
/// would count its slots twice; but two servers behind one front that routes by `Host` (an
/// ingress) are given so too. A name that does not resolve within [`RESOLVE_WITHIN`] is
/// passed over: it may come up later.
pub(crate) async fn one_server_each(backends: &[BackendSpec]) -> Result<(), String> {
    let lookups = backends.iter().map(|b| async move {
        let host = b.authority.host();
        let host = (host.strip_prefix('[').and_then(|h| h.strip_suffix(']'))).unwrap_or(host);
        let port = b.authority.port_u16().unwrap_or(80);
        match tokio::time::timeout(RESOLVE_WITHIN, tokio::net::lookup_host((host, port))).await {
            Ok(Ok(addrs)) => addrs.collect(),
            _ => Vec::new(),
        }
    });
    let resolved: Vec<Vec<SocketAddr>> = futures_util::future::join_all(lookups).await;
    let mut first: HashMap<SocketAddr, usize> = HashMap::new();
    for (i, addrs) in resolved.iter().enumerate() {
        for &addr in addrs {
            let j = *first.entry(addr).or_insert(i);
            if j != i {
                let flag = |b: &BackendSpec| format!("{}={}://{}", b.node, b.scheme, b.authority);
                return Err(format!(
                    "--backend {:?} and --backend {:?} are both at {addr}: if they are one server, give it once, or its slots count twice (two servers behind one front that routes by Host are fine)",
                    flag(&backends[j]),
                    flag(&backends[i]),
                ));
            }
        }
    }
    Ok(())
}

/// The longest the proxy waits at its start for Redis's first connections to open (one wait
/// for every model's store); a store not connected by then is logged as a warning, and
/// serving starts without it.
const STORE_CONNECT_WAIT: Duration = Duration::from_secs(1);

/// Refuses a TLS URL (`rediss://`, `valkeys://`) in words an operator can act on: the
/// proxy's `redis` dependency is built without TLS, and that crate's own error speaks of a
/// feature that no flag of the proxy turns on.
pub(crate) fn refuse_redis_tls(url: &str) -> Result<(), String> {
    let scheme = url.split_once("://").map_or("", |(scheme, _)| scheme);
    if scheme.eq_ignore_ascii_case("rediss") || scheme.eq_ignore_ascii_case("valkeys") {
        return Err(format!(
            "--redis {:?}: a TLS URL ({scheme}://), and this proxy is built without TLS for Redis: give a redis:// URL, on a network you trust or through a TLS tunnel on this host (stunnel, say)",
            redis_url_shown(url)
        ));
    }
    Ok(())
}

/// A Redis URL as errors and the log show it: its user info (`user:password@`), which holds
/// the password, as `***@`, and the value of its query's `pass` (a Unix socket URL's
/// password, `unix:///run/redis.sock?pass=...`) as `***`, so that no log keeps it.
pub(crate) fn redis_url_shown(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let (rest, fragment) = match rest.split_once('#') {
        Some((rest, fragment)) => (rest, Some(fragment)),
        None => (rest, None),
    };
    let (rest, query) = match rest.split_once('?') {
        Some((rest, query)) => (rest, Some(query)),
        None => (rest, None),
    };
    let authority = rest.split('/').next().unwrap_or_default();
    let mut shown = match authority.rfind('@') {
        Some(at) => format!("{scheme}://***{}", &rest[at..]),
        None => format!("{scheme}://{rest}"),
    };
    if let Some(query) = query {
        // The `redis` crate decodes the query's names as a form's: `p%61ss` is `pass` too.
        let pairs = query.split('&').map(|pair| match pair.split_once('=') {
            Some((name, _))
                if percent_decoded(&name.replace('+', " ")).as_deref() == Some("pass") =>
            {
                format!("{name}=***")
            }
            _ => pair.to_string(),
        });
        shown.push('?');
        shown.push_str(&pairs.collect::<Vec<_>>().join("&"));
    }
    if let Some(fragment) = fragment {
        shown.push('#');
        shown.push_str(fragment);
    }
    shown
}

/// The `model` label of a fleet's series, when there is more than one: its model, or empty
/// (Prometheus's "no such label") for the fleet of the requests that name no other.
fn model_label(model: &Option<String>) -> (&'static str, String) {
    ("model", model.clone().unwrap_or_default())
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

/// Reads each balancer's counters and backend states at every scrape, so the numbers are the
/// balancers' own, never a copy that could drift.
struct AffinityCollector {
    /// Each model's balancer, with the value of its `model` label when there is more than one
    /// fleet (`Some(None)`: the fleet of the requests that name no other model).
    fleets: Vec<(Option<Option<String>>, Affinity)>,
    /// One for each `--backend-dns` name: its resolutions and failures, with the value of
    /// its fleet's `model` label when there is more than one fleet.
    dns: Vec<(Option<String>, DnsHandle)>,
}

impl fmt::Debug for AffinityCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AffinityCollector").finish_non_exhaustive()
    }
}

/// A series' labels: its own, then its fleet's `model` when there is more than one fleet.
fn labels<'a>(
    own: &[(&'static str, &'a str)],
    model: Option<&'a str>,
) -> Vec<(&'static str, &'a str)> {
    let mut labels = own.to_vec();
    labels.extend(model.map(|m| ("model", m)));
    labels
}

/// A family with one value for each fleet, labelled with its model; with one fleet, a single
/// unlabelled value.
fn per_fleet<M: EncodeMetric + TypedMetric>(
    enc: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    values: &[(Option<&str>, M)],
) -> fmt::Result {
    let mut m = enc.encode_descriptor(name, help, None, M::TYPE)?;
    if let [(None, v)] = values {
        return v.encode(m);
    }
    for (model, v) in values {
        v.encode(m.encode_family(&labels(&[], *model))?)?;
    }
    Ok(())
}

/// A backend's own labels.
fn backend(b: &BackendStatus) -> [(&'static str, &str); 2] {
    [("backend", b.id.as_str()), ("node", b.node.as_str())]
}

/// What the collector reads of one fleet at a scrape.
struct Scraped<'a> {
    model: Option<&'a str>,
    stats: Stats,
    backends: Vec<BackendStatus>,
    store: Option<StoreStats>,
}

impl Collector for AffinityCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> fmt::Result {
        let fleets: Vec<Scraped<'_>> = (self.fleets.iter())
            .map(|(model, affinity)| Scraped {
                model: model.as_ref().map(|m| m.as_deref().unwrap_or("")),
                stats: affinity.stats(),
                backends: affinity.backends(),
                store: affinity.store_stats(),
            })
            .collect();
        {
            let mut m = enc.encode_descriptor(
                "tower_affinity_decisions",
                "Requests placed, by where they went relative to their session's home",
                None,
                MetricType::Counter,
            )?;
            for f in &fleets {
                for &outcome in Outcome::ALL {
                    let labels = labels(&[("outcome", outcome.as_str())], f.model);
                    let v = f.stats.outcome(outcome);
                    ConstCounter::new(v).encode(m.encode_family(&labels)?)?;
                }
            }
        }
        // What the answers reported, by how their requests were placed: a home hit's reuse
        // near 1 and a cold home's near 0 say the cache model sees what the backends hold.
        type ByOutcome = (&'static str, &'static str, fn(Reuse) -> u64);
        let by_outcome: [ByOutcome; 2] = [
            (
                "tower_affinity_prompt_tokens",
                "Prompt tokens of the answers that said how many they reused, by their requests' outcome",
                |r| r.prompt_tokens,
            ),
            (
                "tower_affinity_reused_tokens",
                "Of them, tokens the backends reused from their caches, by their requests' outcome",
                |r| r.reused_tokens,
            ),
        ];
        for (name, help, value) in by_outcome {
            let mut m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
            for f in &fleets {
                for &outcome in Outcome::ALL {
                    let labels = labels(&[("outcome", outcome.as_str())], f.model);
                    let v = value(f.stats.reuse(outcome));
                    ConstCounter::new(v).encode(m.encode_family(&labels)?)?;
                }
            }
        }
        let as_i64 = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        type Counted = (&'static str, &'static str, fn(&Stats) -> u64);
        let fleet_counters: [Counted; 8] = [
            (
                "tower_affinity_waited",
                "Requests that waited for a slot before being placed",
                |s| s.waited,
            ),
            (
                "tower_affinity_overcommitted",
                "Requests sent beyond a backend's slots",
                |s| s.overcommitted,
            ),
            (
                "tower_affinity_rejected",
                "Requests refused with 429: no free slot and no room or time to wait",
                |s| s.rejected,
            ),
            (
                "tower_affinity_no_backends",
                "Requests refused with 503: no backend up",
                |s| s.no_backends,
            ),
            (
                "tower_affinity_abandoned",
                "Requests whose client left while they waited for a slot or the shared store",
                |s| s.abandoned,
            ),
            (
                "tower_affinity_refusals_retried",
                "Requests sent again after a backend refused their prompt as too long for its context",
                |s| s.refusals_retried,
            ),
            (
                "tower_affinity_refusals_answered",
                "Of them, those answered with the refusal: no other backend takes the prompt, or the request continues a response stored where it was refused",
                |s| s.refusals_answered,
            ),
            (
                "tower_affinity_backend_errors",
                "Attempts whose backend failed before answering, or answered 503 (a first attempt is retried once; its retry is counted too)",
                |s| s.backend_errors,
            ),
        ];
        for (name, help, value) in fleet_counters {
            let values: Vec<_> = (fleets.iter())
                .map(|f| (f.model, ConstCounter::new(value(&f.stats))))
                .collect();
            per_fleet(&mut enc, name, help, &values)?;
        }
        type Level = (&'static str, &'static str, fn(&Stats) -> usize);
        let fleet_gauges: [Level; 3] = [
            (
                "tower_affinity_in_flight",
                "Requests dispatched whose response has not ended",
                |s| s.in_flight,
            ),
            (
                "tower_affinity_waiting",
                "Requests waiting for a free slot",
                |s| s.waiting,
            ),
            (
                "tower_affinity_sessions",
                "Sessions in the session table",
                |s| s.sessions,
            ),
        ];
        for (name, help, value) in fleet_gauges {
            let values: Vec<_> = (fleets.iter())
                .map(|f| (f.model, ConstGauge::new(as_i64(value(&f.stats)))))
                .collect();
            per_fleet(&mut enc, name, help, &values)?;
        }

        type Read = fn(&BackendStatus) -> i64;
        let per_backend: [(&str, &str, Read); 8] = [
            (
                "tower_affinity_backend_in_flight",
                "Requests on the backend whose response has not ended",
                |b| i64::from(b.in_flight),
            ),
            (
                "tower_affinity_backend_context_tokens",
                "Tokens of the backend's shared context its requests in flight take, by the router's estimate",
                |b| i64::try_from(b.context_in_flight).unwrap_or(i64::MAX),
            ),
            (
                "tower_affinity_backend_cached_tokens",
                "Prompt tokens the cache model says the backend holds",
                |b| i64::try_from(b.cached_tokens).unwrap_or(i64::MAX),
            ),
            (
                "tower_affinity_backend_cache_budget_tokens",
                "Prompt tokens the cache model lets the backend hold",
                |b| i64::try_from(b.cache_budget).unwrap_or(i64::MAX),
            ),
            (
                "tower_affinity_backend_conversations",
                "Conversations the cache model says the backend homes",
                |b| i64::from(b.conversations),
            ),
            (
                "tower_affinity_backend_slots",
                "Requests the backend serves at once",
                |b| i64::from(b.slots),
            ),
            (
                "tower_affinity_backend_request_context_tokens",
                "The most tokens of context one request can take on the backend; 0 without a limit",
                |b| b.request_context_limit.map_or(0, |n| i64::try_from(n).unwrap_or(i64::MAX)),
            ),
            (
                "tower_affinity_backend_healthy",
                "1 if the backend takes requests, 0 while it is marked down",
                |b| i64::from(b.healthy),
            ),
        ];
        for (name, help, value) in per_backend {
            let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for f in &fleets {
                for b in &f.backends {
                    let labels = labels(&backend(b), f.model);
                    ConstGauge::new(value(b)).encode(m.encode_family(&labels)?)?;
                }
            }
        }
        // What the backends' answers reported: reused over prompt tokens is the reuse
        // placement achieved, one PromQL division.
        let per_backend: [Reported; 7] = [
            (
                "tower_affinity_backend_failures",
                "Requests that failed on the backend before it answered, or that it answered 503",
                |b| b.failures,
            ),
            (
                "tower_affinity_backend_cut_answers",
                "Answers the backend began and cut before their end",
                |b| b.cut_answers,
            ),
            (
                "tower_affinity_backend_sent_again",
                "Answers to requests sent to the backend a second time, their first connection closed before any answer",
                |b| b.sent_again,
            ),
            (
                "tower_affinity_backend_prompt_tokens",
                "Prompt tokens of the backend's answers that said how many they reused",
                |b| b.prompt_tokens,
            ),
            (
                "tower_affinity_backend_reused_tokens",
                "Of them, tokens the backend reused from its cache",
                |b| b.reused_tokens,
            ),
            (
                "tower_affinity_backend_unreported_prompt_tokens",
                "Prompt tokens of the backend's answers that did not say how many they reused",
                |b| b.unreported_prompt_tokens,
            ),
            (
                "tower_affinity_backend_corrections",
                "Answers that reused far less than the cache model predicted",
                |b| b.corrections,
            ),
        ];
        for (name, help, value) in per_backend {
            let mut m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
            for f in &fleets {
                for b in &f.backends {
                    let labels = labels(&backend(b), f.model);
                    ConstCounter::new(value(b)).encode(m.encode_family(&labels)?)?;
                }
            }
        }
        let mut m = enc.encode_descriptor(
            "tower_affinity_backend_prefill_tokens_per_second",
            "The backend's prefill rate, learned from its answers",
            None,
            MetricType::Gauge,
        )?;
        for f in &fleets {
            for b in &f.backends {
                if let Some(rate) = b.prefill_rate {
                    let labels = labels(&backend(b), f.model);
                    ConstGauge::new(i64::from(rate)).encode(m.encode_family(&labels)?)?;
                }
            }
        }
        let stores: Vec<(Option<&str>, &StoreStats)> = (fleets.iter())
            .filter_map(|f| f.store.as_ref().map(|s| (f.model, s)))
            .collect();
        if let Some((_, first)) = stores.first() {
            let up: Vec<_> = (stores.iter())
                .map(|(model, s)| {
                    (
                        *model,
                        ConstGauge::new(i64::from(s.state == StoreState::Up)),
                    )
                })
                .collect();
            per_fleet(
                &mut enc,
                "tower_affinity_store_up",
                "1 while the shared store's reads answer in time, 0 while it is down",
                &up,
            )?;
            for (i, (name, help, _)) in first.counters().enumerate() {
                let values: Vec<_> = (stores.iter())
                    .map(|(model, s)| {
                        let value = s.counters().nth(i).map_or(0, |c| c.2);
                        (*model, ConstCounter::new(value))
                    })
                    .collect();
                per_fleet(
                    &mut enc,
                    &format!("tower_affinity_store_{name}"),
                    help,
                    &values,
                )?;
            }
        }
        self.encode_dns(&mut enc)
    }
}

impl AffinityCollector {
    /// Each `--backend-dns` name's resolutions: a failing one keeps its last fleet, so only
    /// these say that the fleet has stopped following the name.
    fn encode_dns(&self, enc: &mut DescriptorEncoder<'_>) -> fmt::Result {
        if self.dns.is_empty() {
            return Ok(());
        }
        let stats: Vec<(String, Option<&str>, DnsStats)> = self
            .dns
            .iter()
            .map(|(model, h)| (h.target().to_string(), model.as_deref(), h.stats()))
            .collect();
        type Read = fn(&DnsStats) -> u64;
        let series: [(&str, &str, MetricType, Read); 4] = [
            (
                "tower_affinity_dns_resolutions",
                "Resolutions of the --backend-dns name, successful or not",
                MetricType::Counter,
                |s| s.resolutions,
            ),
            (
                "tower_affinity_dns_failures",
                "Resolutions of the name that failed; each kept the fleet it had",
                MetricType::Counter,
                |s| s.failures,
            ),
            (
                "tower_affinity_dns_consecutive_failures",
                "Failed resolutions of the name since its last success",
                MetricType::Gauge,
                |s| s.consecutive_failures,
            ),
            (
                "tower_affinity_dns_backends",
                "Backends the name's records give",
                MetricType::Gauge,
                |s| s.backends as u64,
            ),
        ];
        for (name, help, kind, value) in series {
            let mut m = enc.encode_descriptor(name, help, None, kind)?;
            for (target, model, s) in &stats {
                let labels = labels(&[("name", target.as_str())], *model);
                let v = value(s);
                if kind == MetricType::Counter {
                    ConstCounter::new(v).encode(m.encode_family(&labels)?)?;
                } else {
                    let v = i64::try_from(v).unwrap_or(i64::MAX);
                    ConstGauge::new(v).encode(m.encode_family(&labels)?)?;
                }
            }
        }
        Ok(())
    }
}

/// A per-backend counter of what the answers reported: its name, its help, its value.
type Reported = (&'static str, &'static str, fn(&BackendStatus) -> u64);

// === serving ===

/// One model's balancer, with one retry (of a failure, or of a prompt refused as too long
/// for its backend's context), as a request reaches it. [`ByModelFuture`] answers its errors.
type Balancer = Retry<RetryOnce, ReadRefusals<Affinity>>;

/// Everything but `/metrics`: the body read for its key, prompt chain and model, then that
/// model's balancer.
type Forward = BodyKey<ByModel>;

/// A fleet as [`ByModel`] sends requests to it.
struct ModelRoute {
    model: Option<String>,
    service: Balancer,
    /// How long its requests waited for a slot, as the `metrics` feature records it.
    wait_seconds: Histogram,
}

struct Routes {
    routes: Vec<ModelRoute>,
    /// The route of the requests whose model names no other.
    default: usize,
}

/// Sends each request to the balancer of the model its body names (`PromptFacts::model`),
/// else to the default fleet's. Ready at once: each request takes a clone of its balancer and
/// waits for that to be ready (a balancer always is, once it has applied its discovery), so
/// no model's requests wait for another's.
#[derive(Clone)]
pub(crate) struct ByModel {
    routes: Arc<Routes>,
}

impl Service<Request<ReqBody>> for ByModel {
    type Response = Response<ResponseBody<BackendBody>>;
    type Error = Infallible;
    type Future = ByModelFuture;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let routes = &self.routes;
        let index = match routes.routes.as_slice() {
            [_] => 0,
            all => {
                let model = req
                    .extensions()
                    .get::<PromptFacts>()
                    .and_then(PromptFacts::model);
                (model.and_then(|m| all.iter().position(|r| r.model.as_deref() == Some(m))))
                    .unwrap_or(routes.default)
            }
        };
        ByModelFuture {
            fut: routes.routes[index].service.clone().oneshot(req),
            routes: routes.clone(),
            index,
        }
    }
}

pin_project! {
    /// The response future of [`ByModel`].
    pub(crate) struct ByModelFuture {
        #[pin]
        fut: Oneshot<Balancer, Request<ReqBody>>,
        routes: Arc<Routes>,
        index: usize,
    }
}

impl Future for ByModelFuture {
    type Output = Result<Response<ResponseBody<BackendBody>>, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let route = &this.routes.routes[*this.index];
        let res = match ready!(this.fut.poll(cx)) {
            Ok(res) => res,
            Err(e) => {
                let several = this.routes.routes.len() > 1;
                return Poll::Ready(Ok(answer_error(e, route.model.as_deref(), several)));
            }
        };
        // As the `metrics` feature records it: the requests that waited.
        if let Some(waited) = res.extensions().get::<Decision>().and_then(|d| d.waited) {
            route.wait_seconds.observe(waited.as_secs_f64());
        }
        Poll::Ready(Ok(res))
    }
}

/// The answer to a request its balancer failed, as [`Error::into_response`] makes it. With
/// several fleets, the balancer's own refusal for want of a backend ([`Error::NoBackends`])
/// names the fleet first, `model "NAME": ` (or `the models not given a fleet: `), then says
/// what the balancer's message says: the fleet is empty, every backend is down, or the policy
/// passed over every backend up, with the counts and the time to retry after. Any other error
/// is answered as the balancer's mapping answers it, and a 503 that a backend gave as its
/// answer is no error here: it goes on as the backend gave it.
fn answer_error(
    e: Error,
    model: Option<&str>,
    several: bool,
) -> Response<ResponseBody<BackendBody>> {
    let named = match &e {
        Error::NoBackends { .. } if several => Some(match model {
            Some(model) => format!("model {model:?}: {e}"),
            None => format!("the models not given a fleet: {e}"),
        }),
        _ => None,
    };
    let mut res = e.into_response();
    if let Some(text) = named {
        *res.body_mut() = ResponseBody::full(Error::json_body(res.status(), &text));
    }
    res
}

/// The response body of [`Front`]: a backend's (or the balancer's refusal), or the proxy's
/// own answer.
pub(crate) type FrontBody = Either<BodyKeyResponseBody<ResponseBody<BackendBody>>, Full<Bytes>>;

/// The proxy's front service, one clone per request: `/metrics` answered here, every other
/// request forwarded.
#[derive(Clone)]
pub(crate) struct Front {
    shared: Arc<FrontShared>,
    forward: Forward,
}

struct FrontShared {
    registry: Arc<Registry>,
    /// With a fleet for each model, the answers about the models given.
    models: Option<ModelList>,
    upstream: UpstreamMode,
    header_timeout: Option<Duration>,
    client_tcp_keepalive: Option<Duration>,
}

/// The models given, as OpenAI's API lists them.
struct ModelList {
    /// `GET /v1/models`.
    list: Bytes,
    /// `GET /v1/models/NAME`, by name.
    each: HashMap<String, Bytes>,
}

impl ModelList {
    /// The answer to a `GET` of `path`, if it asks about the models given: the list, or one
    /// of them by its name (percent-encoded or not; a name may hold a `/`). Another name goes
    /// on to the fleet that serves other names.
    fn answer(&self, path: &str) -> Option<Bytes> {
        if path == "/v1/models" {
            return Some(self.list.clone());
        }
        let name = percent_decoded(path.strip_prefix("/v1/models/")?)?;
        self.each.get(&name).cloned()
    }
}

/// `s` with its `%XX` escapes decoded, if they are well formed and make UTF-8.
fn percent_decoded(s: &str) -> Option<String> {
    let mut bytes = Vec::with_capacity(s.len());
    let mut rest = s.as_bytes();
    while let Some((&b, tail)) = rest.split_first() {
        if b == b'%' {
            let hex = tail
                .get(..2)
                .filter(|h| h.iter().all(u8::is_ascii_hexdigit))?;
            bytes.push(u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()?);
            rest = &tail[2..];
        } else {
            bytes.push(b);
            rest = tail;
        }
    }
    String::from_utf8(bytes).ok()
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
        if let Some(models) = &self.shared.models {
            let listing = matches!(*req.method(), Method::GET | Method::HEAD);
            if let Some(answer) = listing.then(|| models.answer(req.uri().path())).flatten() {
                let mut res = Response::new(FrontBody::Right(Full::new(answer)));
                res.headers_mut().insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                );
                return FrontFuture::Answered { res: Some(res) };
            }
        }
        FrontFuture::Forwarding {
            fut: self.forward.call(req),
        }
    }
}

pin_project! {
    /// The response future of [`Front`].
    #[project = FrontFutureProj]
    pub(crate) enum FrontFuture {
        Forwarding {
            #[pin]
            fut: BodyKeyFuture<ByModel, Incoming>,
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
            FrontFutureProj::Forwarding { fut } => {
                let res = ready!(fut.poll(cx))?;
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

/// Serves `front` on `listener` until `shutdown` resolves (the first Ctrl-C or SIGTERM), then
/// logs that it is shutting down, stops accepting and lets open responses finish, unless
/// `force` resolves first: then it closes the connections still open
/// and returns (a second Ctrl-C, with a stream that would run for minutes, or a backend that
/// never answers).
pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    front: Front,
    shutdown: impl Future<Output = ()> + Send + 'static,
    force: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let mode = front.shared.upstream;
    let keepalive = front.shared.client_tcp_keepalive;
    // hyper adds it to the time now, which panics past what the clock holds: a timeout that
    // long is as good as one of thirty years.
    let header_timeout =
        (front.shared.header_timeout).map(|t| t.min(Duration::from_secs(30 * 365 * 86_400)));
    // An `x-request-id` for a request that comes without one; it goes on to the backend with
    // the other headers, and back on the response.
    let ids = ServiceBuilder::new().layer(SetRequestIdLayer::x_request_id(RequestIds::new()));
    let propagate = PropagateRequestIdLayer::x_request_id();
    // The request spans are debug events: without a subscriber that takes them (no `-v`),
    // `TraceLayer` would only cost every request its clock readings and wrappers.
    if tracing::level_filters::LevelFilter::current() < tracing::Level::DEBUG {
        let service = ids.layer(propagate).service(front);
        return serve_with(
            listener,
            service,
            mode,
            header_timeout,
            keepalive,
            shutdown,
            force,
        )
        .await;
    }
    let service = ids
        .layer(
            TraceLayer::new_for_http()
                .make_span_with(|req: &Request<Incoming>| {
                    tracing::debug_span!(
                        "request",
                        method = %req.method(),
                        uri = %req.uri(),
                        request_id = req
                            .headers()
                            .get("x-request-id")
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or("-"),
                    )
                })
                // The balancer's own 5xx answers are logged where they are made.
                .on_failure(
                    tower_http::trace::DefaultOnFailure::new().level(tracing::Level::DEBUG),
                ),
        )
        .layer(propagate)
        .service(front);
    serve_with(
        listener,
        service,
        mode,
        header_timeout,
        keepalive,
        shutdown,
        force,
    )
    .await
}

/// The serving loop of [`serve`], over the front service with its tower-http layers.
///
/// Each connection is served in a task of its own ([`connection`]). Every wait on a client
/// that has no request open is bounded by `header_timeout`, so that no client holds a
/// connection (and a file descriptor) for good by sending nothing:
/// - its first bytes: hyper-util's `auto::Builder` reads up to 24 of them, with no timeout,
///   to tell HTTP/1 from HTTP/2, and no timer of hyper's runs before it has them;
/// - an HTTP/1 request's headers, and the next request after a response: hyper's header
///   timeout, which starts whenever the connection waits for a request head;
/// - an HTTP/2 connection with no open stream: hyper has no idle timeout for HTTP/2
///   (hyperium/hyper#1628), so [`drive`] sends it a GOAWAY, and closes it if it is still
///   open with no stream as long again (a client that does not answer the GOAWAY's ping);
/// - an HTTP/2 client that stops answering: hyper pings it after that long without a frame
///   and closes the connection if the ping is not answered within as long again, open
///   streams or not (the peer is gone or stuck).
///
/// Open responses are not bounded: a stream runs as long as its backend sends. A client whose
/// host vanished, open request or not, is found by TCP keepalive (see [`accept`]).
async fn serve_with<S, B>(
    listener: tokio::net::TcpListener,
    service: S,
    mode: UpstreamMode,
    header_timeout: Option<Duration>,
    keepalive: Option<Duration>,
    shutdown: impl Future<Output = ()> + Send + 'static,
    force: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()>
where
    S: Service<Request<Incoming>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // hyper's timeouts take effect only with a timer. Half-close stays off: hyper then reads
    // an HTTP/1 connection whose request waits on its answer, and so sees its client go (a
    // close, or the error TCP keepalive gives for a vanished host) with nothing sent yet.
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout);
    let mut http2 = builder.http2();
    http2.timer(TokioTimer::new());
    if let Some(after) = header_timeout {
        http2.keep_alive_interval(after).keep_alive_timeout(after);
    }
    let builder = Arc::new(builder);
    // Shutdown: each connection holds a receiver, shuts down gracefully when `GRACEFUL` is
    // sent, ends at once when `AT_ONCE` is, and drops the receiver when it ends; `closed`
    // waits for the last.
    let (stop, stopped) = tokio::sync::watch::channel(SERVING);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = accept(&listener, keepalive) => match accepted {
                Ok(stream) => stream,
                Err(e) => {
                    accept_error(e).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let conn = connection(
            stream,
            builder.clone(),
            service.clone(),
            header_timeout,
            stopped.clone(),
        );
        let ended = |r: Result<(), BoxError>| {
            if let Err(e) = r {
                tracing::trace!(error = %e, "connection ended with an error");
            }
        };
        match mode {
            UpstreamMode::Pooled => tokio::spawn(async move { ended(conn.await) }),
            UpstreamMode::PerClient => {
                tokio::spawn(async move { ended(per_client::WithClientConns::new(conn).await) })
            }
        };
    }
    drop(listener);
    // Said here, before the connections are told: the line that says the proxy stopped
    // comes once `serve` has returned, so the two are logged in the order they happen.
    tracing::info!(
        "shutting down: no new connections, open responses finish (a second Ctrl-C or SIGTERM stops at once)"
    );
    drop(stopped);
    let _ = stop.send(GRACEFUL);
    tokio::select! {
        () = stop.closed() => return Ok(()),
        () = force => {}
    }
    tracing::warn!("stopping at once: open connections are closed");
    let _ = stop.send(AT_ONCE);
    stop.closed().await;
    Ok(())
}

/// The keepalive probes left unanswered that close a client connection, as the client's
/// backend connections have it.
const KEEPALIVE_PROBES: u32 = 3;

/// Accepts the next client connection and sets its socket up: `TCP_NODELAY`, and with
/// `keepalive`, TCP keepalive as the library's client has it on backend connections
/// (`Builder::tcp_keepalive`): after `keepalive` without a byte either way the system probes
/// the client's host, again every third of it (at least 1 s), and closes the connection after
/// three probes unanswered. A client whose host vanished (its lid closed, its network cut: no
/// FIN, no RST) while its request waited on a long prompt's reading, nothing flowing for
/// minutes, is so found within about twice `keepalive`: hyper, reading the connection while
/// a request is open, gets the error and drops the connection, and with it the request, its
/// backend call and its slot. On Linux, bytes the client's host leaves unacknowledged (an
/// answer's first chunks sent as it vanished) close the connection after as long
/// (`TCP_USER_TIMEOUT`) rather than after the retransmissions' quarter of an hour; so do
/// bytes a client leaves unread that long with its receive buffer full.
///
/// An option the system refuses is logged; the connection is served without it.
pub(crate) async fn accept(
    listener: &tokio::net::TcpListener,
    keepalive: Option<Duration>,
) -> std::io::Result<tokio::net::TcpStream> {
    let (stream, _) = listener.accept().await?;
    let socket = socket2::SockRef::from(&stream);
    // Streamed answers go out a few bytes a token: not held back waiting for the client's
    // acknowledgement of the last ones (Nagle's algorithm, 40 ms against a delayed ACK).
    if let Err(e) = socket.set_tcp_nodelay(true) {
        tracing::debug!(error = %e, "TCP_NODELAY not set on a client connection");
    }
    if let Some(idle) = keepalive {
        // Whole seconds, as the system counts them (`--client-tcp-keepalive` is), up to the
        // most Linux takes.
        let idle = Duration::from_secs(idle.as_secs().clamp(1, 32_767));
        let interval = Duration::from_secs((idle.as_secs() / 3).max(1));
        let params = socket2::TcpKeepalive::new().with_time(idle);
        #[cfg(any(
            target_os = "android",
            target_os = "dragonfly",
            target_os = "freebsd",
            target_os = "fuchsia",
            target_os = "illumos",
            target_os = "ios",
            target_os = "linux",
            target_os = "macos",
            target_os = "netbsd",
        ))]
        let params = params
            .with_interval(interval)
            .with_retries(KEEPALIVE_PROBES);
        if let Err(e) = socket.set_tcp_keepalive(&params) {
            tracing::debug!(error = %e, "TCP keepalive not set on a client connection");
        }
        // Keepalive probes only a connection with nothing in flight: bytes the vanished
        // host never acknowledges (an answer's first chunks, sent as it went) leave the
        // connection to the retransmissions, a quarter of an hour. They are given as long as
        // the probes.
        #[cfg(any(target_os = "android", target_os = "fuchsia", target_os = "linux"))]
        if let Err(e) = socket.set_tcp_user_timeout(Some(idle + interval * KEEPALIVE_PROBES)) {
            tracing::debug!(error = %e, "TCP_USER_TIMEOUT not set on a client connection");
        }
    }
    Ok(stream)
}

/// What the connections are told to do: serve, shut down gracefully (finish what is open),
/// or end at once.
const SERVING: u8 = 0;
const GRACEFUL: u8 = 1;
const AT_ONCE: u8 = 2;

/// What a client sends first on an HTTP/2 connection with prior knowledge.
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Serves one client connection: waits up to `header_timeout` for its first bytes (closing
/// it if none come), then has hyper serve it until it ends or `stopped` changes. A
/// connection whose first bytes may begin the HTTP/2 preface is served with its open streams
/// counted, and closed once it has had none for `header_timeout` (see [`serve_with`]).
async fn connection<S, B>(
    stream: tokio::net::TcpStream,
    builder: Arc<auto::Builder<TokioExecutor>>,
    service: S,
    header_timeout: Option<Duration>,
    mut stopped: tokio::sync::watch::Receiver<u8>,
) -> Result<(), BoxError>
where
    S: Service<Request<Incoming>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    // Peeked, not read: hyper reads them again.
    let mut first = [0; H2_PREFACE.len()];
    let peek = stream.peek(&mut first);
    let peeked = tokio::select! {
        peeked = async {
            match header_timeout {
                Some(after) => tokio::time::timeout(after, peek).await.ok(),
                None => Some(peek.await),
            }
        } => peeked,
        _ = stopped.changed() => return Ok(()),
    };
    let n = match peeked {
        // Silent past the header timeout: dropping the stream closes it.
        None => return Ok(()),
        Some(Ok(0)) => return Ok(()),
        Some(Ok(n)) => n,
        Some(Err(e)) => return Err(e.into()),
    };
    let io = TokioIo::new(stream);
    match header_timeout {
        Some(idle) if H2_PREFACE.starts_with(&first[..n]) => {
            let streams = Arc::new(Streams::default());
            let service = TowerToHyperService::new(Counted {
                inner: service,
                streams: streams.clone(),
            });
            let conn = builder.serve_connection(io, service);
            drive(conn, stopped, Some((streams, idle))).await
        }
        _ => {
            let conn = builder.serve_connection(io, TowerToHyperService::new(service));
            drive(conn, stopped, None).await
        }
    }
}

/// Drives a connection to its end, starting its graceful shutdown when `stopped` changes
/// (or its sender goes), and dropping it when `stopped` says to end at once. With `idle`,
/// also starts its graceful shutdown when it has had no open stream for that long (since its
/// first bytes came, or since its last stream ended), and drops it if it still has none after
/// as long again.
async fn drive<I, S, B>(
    conn: auto::Connection<'_, I, S, TokioExecutor>,
    mut stopped: tokio::sync::watch::Receiver<u8>,
    idle: Option<(Arc<Streams>, Duration)>,
) -> Result<(), BoxError>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    S: hyper::service::Service<Request<Incoming>, Response = Response<B>> + Send,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    let mut conn = std::pin::pin!(conn);
    let Some((streams, after)) = idle else {
        tokio::select! {
            ended = conn.as_mut() => return ended,
            _ = stopped.changed() => {}
        }
        // Told to end at once: dropping the connection closes it, and ends what it serves.
        if *stopped.borrow() == AT_ONCE {
            return Ok(());
        }
        conn.as_mut().graceful_shutdown();
        return tokio::select! {
            ended = conn.as_mut() => ended,
            () = at_once(stopped) => Ok(()),
        };
    };
    let mut stopping = false;
    let mut told_to_go = false;
    // Armed while no stream is open.
    let mut armed = true;
    let mut deadline = std::pin::pin!(tokio::time::sleep(after));
    // One look at the shutdown watch a poll, told to end gracefully or at once.
    let mut listening = true;
    loop {
        tokio::select! {
            ended = conn.as_mut() => return ended,
            changed = stopped.changed(), if listening => {
                // The server gone (its sender dropped) is a graceful end too.
                listening = changed.is_ok();
                if listening && *stopped.borrow() == AT_ONCE {
                    return Ok(());
                }
                if !stopping {
                    stopping = true;
                    conn.as_mut().graceful_shutdown();
                }
            }
            // The last open stream ended (or a notice of it is left over).
            () = streams.idle.notified() => {
                if streams.open() == 0 {
                    armed = true;
                    deadline.as_mut().reset(tokio::time::Instant::now() + after);
                }
            }
            () = deadline.as_mut(), if armed => {
                if streams.open() > 0 {
                    // Rearmed when the last of them ends.
                    armed = false;
                } else if told_to_go {
                    return Ok(());
                } else {
                    // On HTTP/2 a GOAWAY; before hyper has chosen a protocol (an incomplete
                    // preface), the end; on an idle HTTP/1 connection, the close.
                    told_to_go = true;
                    conn.as_mut().graceful_shutdown();
                    deadline.as_mut().reset(tokio::time::Instant::now() + after);
                }
            }
        }
    }
}

/// Resolves when the connections are told to end at once; never if the server is gone.
async fn at_once(mut stopped: tokio::sync::watch::Receiver<u8>) {
    if stopped.wait_for(|&s| s == AT_ONCE).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// The streams open on a connection: requests in the service, and responses not yet sent
/// to their end.
#[derive(Default)]
struct Streams {
    open: std::sync::atomic::AtomicUsize,
    /// Notified when the last open stream ends.
    idle: tokio::sync::Notify,
}

impl Streams {
    fn open(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    fn start(self: &Arc<Self>) -> OpenStream {
        self.open.fetch_add(1, Ordering::AcqRel);
        OpenStream(self.clone())
    }
}

/// One open stream of [`Streams`], counted until dropped.
struct OpenStream(Arc<Streams>);

impl Drop for OpenStream {
    fn drop(&mut self) {
        if self.0.open.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_one();
        }
    }
}

/// A service whose requests count as open [`Streams`] until their responses are sent.
#[derive(Clone)]
struct Counted<S> {
    inner: S,
    streams: Arc<Streams>,
}

impl<S, B> Service<Request<Incoming>> for Counted<S>
where
    S: Service<Request<Incoming>, Response = Response<B>>,
{
    type Response = Response<CountedBody<B>>;
    type Error = S::Error;
    type Future = CountedFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Incoming>) -> Self::Future {
        CountedFuture {
            open: Some(self.streams.start()),
            fut: self.inner.call(req),
        }
    }
}

pin_project! {
    /// The response future of [`Counted`].
    struct CountedFuture<F> {
        #[pin]
        fut: F,
        open: Option<OpenStream>,
    }
}

impl<F, B, E> Future for CountedFuture<F>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<CountedBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let res = ready!(this.fut.poll(cx))?;
        let open = this.open.take();
        Poll::Ready(Ok(res.map(|inner| CountedBody { inner, _open: open })))
    }
}

pin_project! {
    /// A response body of [`Counted`]: its stream is open until it is dropped.
    struct CountedBody<B> {
        #[pin]
        inner: B,
        _open: Option<OpenStream>,
    }
}

impl<B: http_body::Body> http_body::Body for CountedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        self.project().inner.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// `x-request-id` for requests that come without one: a random prefix for this process and a
/// counter, unique without a random number per request.
#[derive(Clone, Debug)]
pub(crate) struct RequestIds {
    prefix: u32,
    next: Arc<AtomicU64>,
}

impl RequestIds {
    pub(crate) fn new() -> Self {
        use std::hash::{BuildHasher, Hasher};
        let prefix = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish() as u32;
        RequestIds {
            prefix,
            next: Arc::default(),
        }
    }
}

impl MakeRequestId for RequestIds {
    fn make_request_id<B>(&mut self, _: &Request<B>) -> Option<RequestId> {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        request_id(self.prefix, n).map(RequestId::new)
    }
}

/// `{prefix:08x}-{n:x}`, written out by hand: through `format!` it cost about 1,000
/// instructions a request.
pub(crate) fn request_id(prefix: u32, n: u64) -> Option<HeaderValue> {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut id = IdBytes([0; 8 + 1 + 16], 0);
    for (i, b) in id.0[..8].iter_mut().enumerate() {
        *b = HEX[((prefix >> (28 - 4 * i)) & 0xf) as usize];
    }
    id.0[8] = b'-';
    let digits = (64 - (n | 1).leading_zeros()).div_ceil(4) as usize;
    for (i, b) in id.0[9..9 + digits].iter_mut().enumerate() {
        *b = HEX[((n >> (4 * (digits - 1 - i))) & 0xf) as usize];
    }
    id.1 = 9 + digits;
    // One allocation, shared by the clones the layers make (the request's, its extension's,
    // the response's), where bytes copied from a slice would be copied again at the first.
    HeaderValue::from_maybe_shared(Bytes::from_owner(id)).ok()
}

/// A request id's bytes and their length.
struct IdBytes([u8; 8 + 1 + 16], usize);

impl AsRef<[u8]> for IdBytes {
    fn as_ref(&self) -> &[u8] {
        &self.0[..self.1]
    }
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
