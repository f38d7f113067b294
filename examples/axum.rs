//! An axum reverse proxy with session affinity, health probes, retries and Prometheus
//! metrics, in front of four tiny stand-ins for llama-server on loopback (two nodes of two
//! backends each). It sends a few sessions' turns through the proxy, prints where each
//! landed, and exits; its test (`cargo test --features health,metrics --example axum`)
//! checks where they land.
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
use hyper_util::client::legacy::connect::HttpConnector;
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
        .response_timeout(Duration::from_secs(600))
        // llama-server closes its connection after each streamed answer, unannounced: a
        // request sent on it just then, never read, is sent again on another.
        .resend_on_close(true);
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

/// The four stand-ins and the proxy in front of them, on loopback: the proxy's address, and
/// its probe task.
async fn start() -> Result<(SocketAddr, ProbeTask), BoxError> {
    let mut backends = Vec::new();
    for (id, node) in [
        ("a1", "node-a"),
        ("a2", "node-a"),
        ("b1", "node-b"),
        ("b2", "node-b"),
    ] {
        backends.push((id, node, format!("http://{}", start_backend(id).await?)));
    }
    let (app, probes) = proxy(&backends).await?;
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok((addr, probes))
}

/// Where a turn landed, as the decision headers say, and what the backend answered.
struct Landed {
    backend: String,
    node: String,
    outcome: String,
    answer: String,
}

/// One turn of `session` (none if empty) through the proxy at `addr`.
async fn turn(
    client: &Client<HttpConnector, Body>,
    addr: SocketAddr,
    session: &str,
) -> Result<Landed, BoxError> {
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
    Ok(Landed {
        backend,
        node,
        outcome,
        answer: String::from_utf8_lossy(&answer).into_owned(),
    })
}

/// The lines of the proxy's `/metrics` that count its decisions.
async fn decisions(
    client: &Client<HttpConnector, Body>,
    addr: SocketAddr,
) -> Result<Vec<String>, BoxError> {
    let metrics = client
        .get(format!("http://{addr}/metrics").parse()?)
        .await?
        .into_body()
        .collect()
        .await?
        .to_bytes();
    Ok(String::from_utf8_lossy(&metrics)
        .lines()
        .filter(|l| l.starts_with("tower_affinity_decisions_total"))
        .map(str::to_string)
        .collect())
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let (addr, _probes) = start().await?;
    println!("proxy on http://{addr}, four backends on two nodes\n");

    let client = Client::builder(TokioExecutor::new()).build_http::<Body>();
    println!(
        "{:<10} {:>4}  {:<8} {:<7} {:<16} answer",
        "session", "turn", "backend", "node", "outcome"
    );
    for n in 1..=3 {
        for session in ["agent-1", "agent-2", "agent-3", ""] {
            let Landed {
                backend,
                node,
                outcome,
                answer,
            } = turn(&client, addr, session).await?;
            let session = if session.is_empty() {
                "(none)"
            } else {
                session
            };
            println!("{session:<10} {n:>4}  {backend:<8} {node:<7} {outcome:<16} {answer}");
        }
    }
    println!("\n/metrics, the decisions:");
    for line in decisions(&client, addr).await? {
        println!("  {line}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The demonstration, checked: each session's turns go to the backend that served its
    /// first, which answers them; a keyless turn is placed by load; `/metrics` counts both.
    #[tokio::test]
    async fn sessions_return_home_through_the_proxy_and_metrics_count_them() {
        let run = async {
            let (addr, _probes) = start().await?;
            let client = Client::builder(TokioExecutor::new()).build_http::<Body>();
            let mut homes = Vec::new();
            for session in ["agent-1", "agent-2", "agent-3"] {
                let first = turn(&client, addr, session).await?;
                assert_eq!(first.outcome, "new-session", "{session}");
                assert_eq!(first.answer, format!("answered by {}", first.backend));
                for _ in 0..2 {
                    let next = turn(&client, addr, session).await?;
                    assert_eq!(next.outcome, "home-hit", "{session}");
                    assert_eq!((&next.backend, &next.node), (&first.backend, &first.node));
                    assert_eq!(next.answer, first.answer);
                }
                homes.push(first.backend);
            }
            homes.sort();
            homes.dedup();
            assert_eq!(
                homes.len(),
                3,
                "three new sessions on three of four backends"
            );
            assert_eq!(turn(&client, addr, "").await?.outcome, "keyless");
            let counted = decisions(&client, addr).await?;
            for line in [
                r#"tower_affinity_decisions_total{outcome="new-session"} 3"#,
                r#"tower_affinity_decisions_total{outcome="home-hit"} 6"#,
                r#"tower_affinity_decisions_total{outcome="keyless"} 1"#,
            ] {
                assert!(
                    counted.iter().any(|l| l == line),
                    "{line} not in {counted:?}"
                );
            }
            Ok::<_, BoxError>(())
        };
        tokio::time::timeout(Duration::from_secs(20), run)
            .await
            .expect("the demonstration ran within 20 s")
            .unwrap();
    }
}
