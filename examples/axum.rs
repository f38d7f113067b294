//! An axum reverse proxy with session affinity, health probes, retries and Prometheus metrics, in front of four
//! tiny stand-ins for llama-server on loopback (two nodes of two backends each). It sends a
//! few sessions' turns through the proxy, prints where each landed, and exits.
//!
//! ```sh
//! cargo run --features health,metrics --example axum
//! ```
//!
//! [`proxy`] is all a proxy of your own needs; the rest of the file is the demonstration.

use std::net::SocketAddr;
use std::time::Duration;

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use metrics_exporter_prometheus::PrometheusBuilder;
use metrics_util::MetricKindMask;
use tokio::net::TcpListener;
use tower::retry::RetryLayer;
use tower::{Layer, ServiceBuilder};
use tower_affinity::client::HttpBackend;
use tower_affinity::discover::StaticFleet;
use tower_affinity::health::{HealthProbe, ProbeTask};
use tower_affinity::key::{BodyKeyLayer, ExtensionKey, FirstOf, HeaderKey};
use tower_affinity::{
    Backend, BoxError, ErrorToResponseLayer, ReadRefusalsLayer, RetryOnce, SessionAffinityLayer,
};

/// The proxy: one `HttpBackend` per backend (`(id, node, url)`), probed for `/health` and
/// `/slots`, behind the balancer with one retry, the key read from headers or the JSON body,
/// and `/metrics` in Prometheus's format. Keep the returned task: probing stops when it is
/// dropped.
async fn proxy(backends: &[(&str, &str, String)]) -> Result<(Router, ProbeTask), BoxError> {
    // The recorder first: the balancer registers each backend's metrics as it learns of it.
    // Its histograms (seconds) get buckets, up to the minutes a cold prompt can take: without
    // them the exporter renders summaries. Series not updated for ten minutes are dropped:
    // those of backends that have left the fleet, which would otherwise pile up with every
    // rolling restart's new ids (every scrape publishes the fleet's and the live backends'
    // counters and gauges again; a quiet backend's histogram comes back with its next answer).
    let prometheus = PrometheusBuilder::new()
        .set_buckets(&[
            0.01, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
        ])?
        .idle_timeout(MetricKindMask::ALL, Some(Duration::from_secs(600)))
        .install_recorder()?;
    // The exporter drains its histograms' samples and drops idle series on upkeep (or on a
    // scrape): without one, a proxy nobody scrapes keeps every request's samples.
    let upkeep = prometheus.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(5));
        loop {
            every.tick().await;
            upkeep.run_upkeep();
        }
    });
    let http = HttpBackend::<Full<Bytes>>::builder()
        .connect_timeout(Duration::from_secs(2))
        .response_timeout(Duration::from_secs(600));
    let mut fleet = Vec::new();
    for (id, node, url) in backends {
        // No `.slots(n)`: the probe reads them from `/slots`.
        fleet.push((*id, Backend::new(*node, http.build(url)?)));
    }
    let (fleet, prober) = HealthProbe::new()
        .interval(Duration::from_secs(2))
        .discover(StaticFleet::new(fleet));
    let affinity = SessionAffinityLayer::new()
        .key(FirstOf::new(HeaderKey::default(), ExtensionKey))
        .decision_headers(true)
        .layer(fleet);
    // Before the first request: slot counts known, a loading or unreachable backend down.
    prober.round(&affinity).await;
    let probes = prober.spawn(affinity.clone());

    let metrics = {
        let affinity = affinity.clone();
        move || async move {
            affinity.publish_metrics();
            prometheus.render()
        }
    };
    let forward = ServiceBuilder::new()
        // Buffers the body (so a retry can resend it), reads its key and prompt chain; a
        // client that has not sent its body within a minute gets 408.
        .layer(BodyKeyLayer::new().read_timeout(Duration::from_secs(60)))
        .layer(ErrorToResponseLayer::new())
        .layer(RetryLayer::new(RetryOnce::new()))
        // Marks a prompt refused as too long for its backend's slots, for the retry to send
        // it to a backend that takes it.
        .layer(ReadRefusalsLayer::new())
        .service(affinity);
    let app = Router::new()
        .route("/metrics", get(metrics))
        .fallback_service(forward);
    Ok((app, probes))
}

// === the demonstration ===

/// Starts a stand-in for llama-server: `/health`, `/slots` (two), and an answer naming itself.
async fn start_backend(name: &'static str) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let slots = r#"[{"id":0,"is_processing":false},{"id":1,"is_processing":false}]"#;
    let app = Router::new()
        .route("/health", get(|| async { r#"{"status":"ok"}"# }))
        .route("/slots", get(move || async move { slots }))
        .fallback(move || async move { format!("answered by {name}") });
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(addr)
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let mut backends = Vec::new();
    for (id, node) in [
        ("a1", "node-a"),
        ("a2", "node-a"),
        ("b1", "node-b"),
        ("b2", "node-b"),
    ] {
        backends.push((id, node, format!("http://{}", start_backend(id).await?)));
    }
    let (app, _probes) = proxy(&backends).await?;
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    println!("proxy on http://{addr}, four backends on two nodes\n");

    let client = Client::builder(TokioExecutor::new()).build_http::<Body>();
    println!(
        "{:<10} {:>4}  {:<8} {:<7} {:<16} answer",
        "session", "turn", "backend", "node", "outcome"
    );
    for turn in 1..=3 {
        for session in ["agent-1", "agent-2", "agent-3", ""] {
            let req = http::Request::post(format!("http://{addr}/v1/chat/completions"))
                .header("x-session-id", session)
                .body(Body::from(r#"{"messages":[]}"#))?;
            let res = client.request(req).await?;
            let header = |name: &str| {
                let value = res.headers().get(name).and_then(|v| v.to_str().ok());
                value.unwrap_or("-").to_string()
            };
            let (backend, node) = (header("x-affinity-backend"), header("x-affinity-node"));
            let outcome = header("x-affinity-outcome");
            let answer = res.into_body().collect().await?.to_bytes();
            let session = if session.is_empty() {
                "(none)"
            } else {
                session
            };
            println!(
                "{session:<10} {turn:>4}  {backend:<8} {node:<7} {outcome:<16} {}",
                String::from_utf8_lossy(&answer)
            );
        }
    }
    let metrics = client
        .get(format!("http://{addr}/metrics").parse()?)
        .await?
        .into_body()
        .collect()
        .await?
        .to_bytes();
    let decisions = String::from_utf8_lossy(&metrics);
    println!("\n/metrics, the decisions:");
    for line in decisions
        .lines()
        .filter(|l| l.starts_with("tower_affinity_decisions_total"))
    {
        println!("  {line}");
    }
    Ok(())
}
