//! The proxy itself: upstream client, router, health probes and metrics.
//!
//! `main.rs` runs it from the command line; the integration tests in `tests/proxy/` include
//! this file to run the very same code against stub servers.

use std::collections::HashSet;
use std::fmt;
use std::future::Future;
use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body as AxumBody;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Request, Response, StatusCode, Uri, Version};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use tokio::task::JoinSet;
use tower::retry::Retry;
use tower::{Layer, Service, ServiceBuilder, ServiceExt};
use tower_affinity::discover::{self, FleetChannel, FleetHandle};
use tower_affinity::key::{BodyKeyLayer, ExtensionKey, FirstOf, HeaderKey};
use tower_affinity::placement::{LeastLoaded, NodeThenBackend, Placement, Rendezvous, RoundRobin};
use tower_affinity::{
    Backend, BackendStatus, BoxError, Decision, ErrorToResponse, Outcome, Overflow, RetryOnce,
    SessionAffinity, SessionAffinityLayer,
};

/// The request body once [`BodyKeyLayer`] has buffered it: cloneable, so a failed attempt can
/// be retried.
pub(crate) type ReqBody = Full<Bytes>;

/// The balancer as the proxy builds it.
pub(crate) type Affinity =
    SessionAffinity<FleetChannel<Upstream>, FirstOf<HeaderKey, ExtensionKey>, Arc<dyn Placement>>;

// === configuration ===

/// One `--backend NODE=URL[,slots=N][,id=NAME]`.
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
    pub(crate) policy: Policy,
    pub(crate) overflow: Overflow,
    pub(crate) connect_timeout: Duration,
    pub(crate) failure_cooldown: Duration,
    pub(crate) body_limit: usize,
    pub(crate) read_timeout: Option<Duration>,
    /// `None` turns the active probe off.
    pub(crate) probe_interval: Option<Duration>,
    pub(crate) probe_timeout: Duration,
    /// Learn the slot count of backends given without `slots=` from llama-server's `/slots`.
    pub(crate) probe_slots: bool,
}

impl Config {
    pub(crate) fn new(backends: Vec<BackendSpec>) -> Self {
        Config {
            backends,
            policy: Policy::NodeThenBackend,
            overflow: Overflow::default(),
            connect_timeout: Duration::from_secs(2),
            failure_cooldown: Duration::from_secs(5),
            body_limit: BodyKeyLayer::DEFAULT_LIMIT,
            read_timeout: Some(Duration::from_secs(60)),
            probe_interval: Some(Duration::from_secs(2)),
            probe_timeout: Duration::from_secs(2),
            probe_slots: true,
        }
    }
}

// === upstream ===

/// One backend's HTTP client: sends the request to the backend's scheme and authority and
/// leaves everything else as the client sent it, except hop-by-hop headers.
#[derive(Clone, Debug)]
pub(crate) struct Upstream {
    client: Client<HttpConnector, ReqBody>,
    scheme: Scheme,
    authority: Authority,
}

/// Headers that describe one connection, not the message (RFC 9110, section 7.6.1). `Host`
/// goes too: the client sets it from the backend's authority.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in [
        header::CONNECTION,
        header::TE,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
        header::PROXY_AUTHORIZATION,
        HeaderName::from_static("keep-alive"),
        HeaderName::from_static("proxy-connection"),
    ] {
        headers.remove(name);
    }
}

type UpstreamFuture = Pin<Box<dyn Future<Output = Result<Response<Incoming>, BoxError>> + Send>>;

impl Service<Request<ReqBody>> for Upstream {
    type Response = Response<Incoming>;
    type Error = BoxError;
    type Future = UpstreamFuture;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // The client pools connections itself and is always ready.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut req: Request<ReqBody>) -> Self::Future {
        let mut parts = req.uri().clone().into_parts();
        parts.scheme = Some(self.scheme.clone());
        parts.authority = Some(self.authority.clone());
        if parts.path_and_query.is_none() {
            parts.path_and_query = Some(PathAndQuery::from_static("/"));
        }
        match Uri::from_parts(parts) {
            Ok(uri) => *req.uri_mut() = uri,
            Err(e) => return Box::pin(std::future::ready(Err(e.into()))),
        }
        strip_hop_by_hop(req.headers_mut());
        req.headers_mut().remove(header::HOST);
        // The backend connection is HTTP/1.1 whatever the client spoke.
        *req.version_mut() = Version::HTTP_11;
        let fut = self.client.request(req);
        Box::pin(async move {
            let mut res = fut.await?;
            strip_hop_by_hop(res.headers_mut());
            Ok(res)
        })
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
        let probe_client = Client::builder(TokioExecutor::new()).build(connector);

        let (fleet, discovery) = discover::channel();
        let upstreams: Vec<_> = config
            .backends
            .iter()
            .map(|spec| {
                let upstream = Upstream {
                    client: client.clone(),
                    scheme: spec.scheme.clone(),
                    authority: spec.authority.clone(),
                };
                (spec.clone(), upstream)
            })
            .collect();
        for (spec, upstream) in &upstreams {
            let slots = spec.slots.unwrap_or(NonZeroU32::MIN);
            fleet.insert(
                spec.id.as_str(),
                Backend::new(spec.node.as_str(), upstream.clone()).slots(slots),
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

    /// `/metrics` answered here; every other request goes to a backend.
    pub(crate) fn router(&self) -> Router {
        let registry = self.registry.clone();
        let wait_seconds = self.wait_seconds.clone();
        let mut body_key = BodyKeyLayer::new().limit(self.config.body_limit);
        if let Some(t) = self.config.read_timeout {
            body_key = body_key.read_timeout(t);
        }
        let forward = ServiceBuilder::new()
            .layer(body_key)
            .map_response(move |res: Response<_>| {
                if let Some(d) = res.extensions().get::<Decision>() {
                    wait_seconds.observe(d.waited.unwrap_or_default().as_secs_f64());
                }
                res
            })
            .service(ErrorToResponse::new(Retry::new(
                RetryOnce::new(),
                self.affinity.clone(),
            )));
        Router::new()
            .route("/metrics", get(move || metrics(registry.clone())))
            .fallback_service(forward)
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
        // Same id: an update that keeps the backend's sessions.
        self.fleet.insert(
            spec.id.as_str(),
            Backend::new(spec.node.as_str(), upstream.clone()).slots(slots),
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
fn causes(e: &(dyn std::error::Error + 'static)) -> String {
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

async fn metrics(registry: Arc<Registry>) -> impl IntoResponse {
    let mut text = String::new();
    match prometheus_client::encoding::prometheus_text::encode(&mut text, &registry) {
        Ok(()) => (
            [(
                header::CONTENT_TYPE,
                prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
            )],
            AxumBody::from(text),
        )
            .into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
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
        Ok(())
    }
}

// === serving ===

/// Serves `router` on `listener` until `shutdown` resolves, then lets open responses finish.
pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await
}
