//! The `metrics` facade's figures, read back through a recorder (feature `metrics`).
#![cfg(feature = "metrics")]

use std::convert::Infallible;
use std::num::NonZeroU32;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use metrics_util::{CompositeKey, MetricKind};
use tower::{service_fn, Layer, Service, ServiceExt};
use tower_affinity::discover::StaticFleet;
use tower_affinity::key::{PromptFacts, SessionKey};
use tower_affinity::store::{HomeStore, Lookup, ReadHome, StoredHome, WriteHome};
use tower_affinity::{Backend, Outcome, Overflow, PromptChain, SessionAffinityLayer};

const ANSWER: &str =
    r#"{"usage":{"prompt_tokens":1200,"prompt_tokens_details":{"cached_tokens":1024}}}"#;
/// vLLM's answer on its Anthropic endpoint: no figure of reuse.
const MESSAGES_ANSWER: &str =
    r#"{"type":"message","usage":{"input_tokens":1100,"output_tokens":3}}"#;

type Entry = (
    CompositeKey,
    Option<metrics::Unit>,
    Option<metrics::SharedString>,
    DebugValue,
);

fn value<'a>(
    snapshot: &'a [Entry],
    kind: MetricKind,
    name: &str,
    labels: &[(&str, &str)],
) -> Option<&'a DebugValue> {
    snapshot
        .iter()
        .find(|(k, ..)| {
            k.kind() == kind
                && k.key().name() == name
                && labels
                    .iter()
                    .all(|(l, v)| k.key().labels().any(|x| x.key() == *l && x.value() == *v))
        })
        .map(|(.., v)| v)
}

/// llama-server's answer with its timings: 1,000 tokens read in half a second, a prefill
/// rate of 2,000 tokens a second learned.
const TIMED_ANSWER: &str = r#"{"usage":{"prompt_tokens":1024},"timings":{"prompt_n":1000,"cache_n":24,"prompt_ms":500.0}}"#;

/// A backend's answer: a chat completion (or a message, on `/v1/messages`, or one with
/// llama-server's timings, on `/timed`) with its usage.
async fn answering(req: http::Request<String>) -> Result<http::Response<Full<Bytes>>, Infallible> {
    let answer = match req.uri().path() {
        "/v1/messages" => MESSAGES_ANSWER,
        "/timed" => TIMED_ANSWER,
        _ => ANSWER,
    };
    let mut res = http::Response::new(Full::new(Bytes::from_static(answer.as_bytes())));
    res.headers_mut()
        .insert("content-type", "application/json".parse().unwrap());
    Ok(res)
}

/// A backend's answer: at once, empty.
async fn empty(_req: http::Request<String>) -> Result<http::Response<String>, Infallible> {
    Ok(http::Response::new(String::new()))
}

/// Runs `f` on a current-thread runtime with a recorder of its own installed: what `f`
/// returned, and what the recorder holds then.
fn recorded<T>(f: impl std::future::Future<Output = T>) -> (T, Vec<Entry>) {
    let recorder = DebuggingRecorder::new();
    let snapshotter: Snapshotter = recorder.snapshotter();
    let out = run_with(&recorder, f);
    (out, snapshotter.snapshot().into_vec())
}

/// Runs `f` on a current-thread runtime with `recorder` installed for it alone.
fn run_with<T>(recorder: &impl metrics::Recorder, f: impl std::future::Future<Output = T>) -> T {
    metrics::with_local_recorder(recorder, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap()
            .block_on(f)
    })
}

/// A Prometheus recorder that drops, at each render, every series idle since the last one:
/// as if each render came after the exporter's idle timeout.
fn dropping_idle_series() -> metrics_exporter_prometheus::PrometheusRecorder {
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .idle_timeout(
            metrics_util::MetricKindMask::ALL,
            Some(std::time::Duration::ZERO),
        )
        .build_recorder()
}

/// Sends session `s` a turn to each of `paths` in turn, each answer read whole.
async fn turns_to<S, B>(svc: &S, paths: &[&str])
where
    S: Service<http::Request<String>, Response = http::Response<B>> + Clone,
    S::Error: std::fmt::Debug,
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    for path in paths {
        let req = http::Request::post(*path)
            .header("x-session-id", "s")
            .body(String::new())
            .unwrap();
        let res = svc.clone().oneshot(req).await.unwrap();
        res.into_body().collect().await.unwrap();
    }
}

#[test]
fn decisions_reported_tokens_and_levels_reach_the_recorder() {
    let ((), snapshot) = recorded(async {
        let fleet = StaticFleet::new([(
            "a1",
            Backend::new("node-a", service_fn(answering)).slots(NonZeroU32::new(2).unwrap()),
        )]);
        let svc = SessionAffinityLayer::new().layer(fleet);
        turns_to(
            &svc,
            &[
                "/v1/chat/completions",
                "/v1/chat/completions",
                "/v1/messages",
            ],
        )
        .await;
        svc.publish_metrics();
    });
    let counter =
        |name: &str, labels: &[(&str, &str)]| value(&snapshot, MetricKind::Counter, name, labels);
    assert_eq!(
        counter(
            "tower_affinity_decisions_total",
            &[("outcome", "new-session")]
        ),
        Some(&DebugValue::Counter(1))
    );
    assert_eq!(
        counter("tower_affinity_decisions_total", &[("outcome", "home-hit")]),
        Some(&DebugValue::Counter(2))
    );
    let backend = [("backend", "a1"), ("node", "node-a")];
    assert_eq!(
        counter("tower_affinity_backend_prompt_tokens_total", &backend),
        Some(&DebugValue::Counter(2400))
    );
    assert_eq!(
        counter("tower_affinity_backend_reused_tokens_total", &backend),
        Some(&DebugValue::Counter(2048))
    );
    // An answer that does not say its reuse is counted apart, not as reusing nothing.
    assert_eq!(
        counter(
            "tower_affinity_backend_unreported_prompt_tokens_total",
            &backend
        ),
        Some(&DebugValue::Counter(1100))
    );
    let first_bytes = value(
        &snapshot,
        MetricKind::Histogram,
        "tower_affinity_backend_first_byte_seconds",
        &backend,
    );
    assert!(matches!(first_bytes, Some(DebugValue::Histogram(v)) if v.len() == 3));
    // The same figures by the outcome of their requests: the first turn a new session, the
    // other two home hits (the second an answer that does not say its reuse).
    for (outcome, prompt, reused, answers) in
        [("new-session", 1200, 1024, 1), ("home-hit", 1200, 1024, 2)]
    {
        let labels = [("outcome", outcome)];
        assert_eq!(
            counter("tower_affinity_prompt_tokens_total", &labels),
            Some(&DebugValue::Counter(prompt)),
            "{outcome}"
        );
        assert_eq!(
            counter("tower_affinity_reused_tokens_total", &labels),
            Some(&DebugValue::Counter(reused)),
            "{outcome}"
        );
        let first_bytes = value(
            &snapshot,
            MetricKind::Histogram,
            "tower_affinity_first_byte_seconds",
            &labels,
        );
        assert!(
            matches!(first_bytes, Some(DebugValue::Histogram(v)) if v.len() == answers),
            "{outcome}: {first_bytes:?}"
        );
    }
    // Published at 0 for the outcomes no answer has had yet.
    assert_eq!(
        counter(
            "tower_affinity_reused_tokens_total",
            &[("outcome", "cold-home")]
        ),
        Some(&DebugValue::Counter(0))
    );
    let gauge = |name: &str| value(&snapshot, MetricKind::Gauge, name, &backend);
    assert_eq!(
        gauge("tower_affinity_backend_slots"),
        Some(&DebugValue::Gauge(2.0.into()))
    );
    assert_eq!(
        gauge("tower_affinity_backend_healthy"),
        Some(&DebugValue::Gauge(1.0.into()))
    );
    assert_eq!(
        gauge("tower_affinity_backend_in_flight"),
        Some(&DebugValue::Gauge(0.0.into()))
    );
    assert_eq!(
        gauge("tower_affinity_backend_context_tokens"),
        Some(&DebugValue::Gauge(0.0.into()))
    );
    assert_eq!(
        gauge("tower_affinity_backend_request_context_tokens"),
        Some(&DebugValue::Gauge(0.0.into()))
    );
    assert_eq!(
        value(&snapshot, MetricKind::Gauge, "tower_affinity_sessions", &[]),
        Some(&DebugValue::Gauge(1.0.into()))
    );
    every_metric_has_help(&snapshot);
}

/// The names carry their units, as Prometheus has them (`_seconds`, `_bytes`, `_tokens`):
/// an exporter told to add each metric's unit to its name (`metrics-exporter-prometheus`'s
/// `set_enable_unit_suffix`) writes them as they are, not `_seconds_seconds`.
#[test]
fn an_exporter_adding_units_to_names_writes_each_unit_once() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new()
        .set_enable_unit_suffix(true)
        .set_buckets(&[0.1, 1.0, 10.0, 100.0])
        .unwrap()
        .build_recorder();
    let handle = recorder.handle();
    run_with(&recorder, async {
        let fleet = StaticFleet::new([("a1", Backend::new("node-a", service_fn(answering)))]);
        let svc = SessionAffinityLayer::new().layer(fleet);
        let req = http::Request::post("/v1/chat/completions")
            .header("x-session-id", "s")
            .body(String::new())
            .unwrap();
        let res = svc.clone().oneshot(req).await.unwrap();
        res.into_body().collect().await.unwrap();
        svc.publish_metrics();
    });
    let text = handle.render();
    for name in [
        "tower_affinity_first_byte_seconds_bucket{",
        "tower_affinity_backend_first_byte_seconds_count{",
        "tower_affinity_session_table_bytes ",
        "tower_affinity_backend_cached_tokens{",
    ] {
        assert!(text.contains(name), "{name} in {text}");
    }
    assert!(!text.contains("_seconds_seconds"), "{text}");
}

/// A store that keeps nothing: every read finds no home, every write succeeds.
#[derive(Debug)]
struct Forgetful;

impl HomeStore for Forgetful {
    fn read(&self, _session: SessionKey, _ttl: std::time::Duration) -> ReadHome {
        Box::pin(async { Ok(Lookup::Missing) })
    }

    fn write(
        &self,
        _session: SessionKey,
        _home: StoredHome,
        _ttl: std::time::Duration,
    ) -> WriteHome {
        Box::pin(async { Ok(()) })
    }
}

/// An answer the backend began and then cut counts on its backend, and as no failure.
#[test]
fn an_answer_cut_midway_counts_on_its_backend() {
    type Chunks = Vec<Result<http_body::Frame<Bytes>, std::io::Error>>;
    let ((), snapshot) = recorded(async {
        let cuts = service_fn(|_req: http::Request<String>| async {
            let chunks: Chunks = vec![
                Ok(http_body::Frame::data(Bytes::from_static(b"data: 1\n\n"))),
                Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof)),
            ];
            let body = http_body_util::StreamBody::new(tokio_stream::iter(chunks));
            Ok::<_, Infallible>(http::Response::new(body))
        });
        let fleet = StaticFleet::new([("c1", Backend::new("node-c", cuts))]);
        let svc = SessionAffinityLayer::new().layer(fleet);
        let req = http::Request::post("/v1/chat/completions")
            .header("x-session-id", "s")
            .body(String::new())
            .unwrap();
        let res = svc.oneshot(req).await.unwrap();
        assert!(res.into_body().collect().await.is_err());
    });
    let backend = [("backend", "c1"), ("node", "node-c")];
    let counter = |name| value(&snapshot, MetricKind::Counter, name, &backend);
    assert_eq!(
        counter("tower_affinity_backend_cut_answers_total"),
        Some(&DebugValue::Counter(1))
    );
    assert_eq!(
        counter("tower_affinity_backend_failures_total"),
        Some(&DebugValue::Counter(0))
    );
}

/// An answer that reused far less of its prompt than the cache model predicted counts a
/// correction on its backend; an answer that reused what was predicted, or had nothing
/// predicted, counts none.
#[test]
fn only_an_answer_reusing_far_less_than_predicted_counts_a_correction() {
    let ((), snapshot) = recorded_paused(async {
        // The backend reuses what the request's `x-reused` header says.
        let reusing = service_fn(|req: http::Request<String>| async move {
            let reused = req.headers()["x-reused"].to_str().unwrap().to_owned();
            let prompt = req.headers()["x-prompt"].to_str().unwrap().to_owned();
            let answer = format!(
                r#"{{"usage":{{"prompt_tokens":{prompt},"prompt_tokens_details":{{"cached_tokens":{reused}}}}}}}"#
            );
            let mut res = http::Response::new(Full::new(Bytes::from(answer)));
            res.headers_mut()
                .insert("content-type", "application/json".parse().unwrap());
            Ok::<_, Infallible>(res)
        });
        let fleet =
            StaticFleet::new([("a1", Backend::new("node-a", reusing).cache_tokens(1 << 20))]);
        let svc = SessionAffinityLayer::new().layer(fleet);
        // Three turns of one session: nothing predicted; 3,000 tokens predicted and reused;
        // 4,000 predicted and none reused.
        for (blocks, reused) in [(3, 0), (4, 3_000), (5, 0)] {
            let ids: Vec<u64> = (1..=blocks).collect();
            let chain = PromptChain::from_blocks(ids.iter().map(|&id| (id, 1_000)));
            let mut req = http::Request::post("/v1/chat/completions")
                .header("x-session-id", "s")
                .header("x-reused", reused.to_string())
                .header("x-prompt", (blocks * 1_000).to_string())
                .body(String::new())
                .unwrap();
            req.extensions_mut().insert(PromptFacts::from_chain(chain));
            let res = svc.clone().oneshot(req).await.unwrap();
            res.into_body().collect().await.unwrap();
        }
        assert_eq!(svc.stats().corrections, 1);
    });
    let backend = [("backend", "a1"), ("node", "node-a")];
    assert_eq!(
        value(
            &snapshot,
            MetricKind::Counter,
            "tower_affinity_backend_corrections_total",
            &backend
        ),
        Some(&DebugValue::Counter(1))
    );
}

#[test]
fn a_shared_stores_state_and_counters_are_published() {
    let (stats, snapshot) = recorded(async {
        let backend = service_fn(empty);
        let fleet = StaticFleet::new([(
            "a1",
            Backend::new("node-a", backend).slots(NonZeroU32::new(2).unwrap()),
        )]);
        let svc = SessionAffinityLayer::new()
            .home_store(Forgetful)
            .layer(fleet);
        for _ in 0..2 {
            let req = http::Request::post("/v1/chat/completions")
                .header("x-session-id", "s")
                .body(String::new())
                .unwrap();
            svc.clone().oneshot(req).await.unwrap();
        }
        // The writes' tasks run.
        tokio::task::yield_now().await;
        svc.publish_metrics();
        svc.store_stats().unwrap()
    });
    let counter = |name: &str| match value(&snapshot, MetricKind::Counter, name, &[]) {
        Some(DebugValue::Counter(n)) => *n,
        other => panic!("{name}: {other:?}"),
    };
    // Two keyed requests, each reading the store and finding nothing.
    assert_eq!(
        (stats.reads, stats.misses, stats.hits),
        (2, 2, 0),
        "{stats:?}"
    );
    assert_eq!(counter("tower_affinity_store_reads_total"), stats.reads);
    assert_eq!(counter("tower_affinity_store_misses_total"), stats.misses);
    assert_eq!(counter("tower_affinity_store_hits_total"), 0);
    assert_eq!(counter("tower_affinity_store_writes_total"), stats.writes);
    assert!(stats.writes >= 1, "{stats:?}");
    assert_eq!(counter("tower_affinity_store_outages_total"), 0);
    assert_eq!(counter("tower_affinity_store_prompt_own_total"), 0);
    assert_eq!(
        value(&snapshot, MetricKind::Gauge, "tower_affinity_store_up", &[]),
        Some(&DebugValue::Gauge(1.0.into()))
    );
    every_metric_has_help(&snapshot);
}

/// Every metric the recorder holds came with its help text (Prometheus's `# HELP`).
fn every_metric_has_help(snapshot: &[Entry]) {
    let without: Vec<&str> = snapshot
        .iter()
        .filter(|(_, _, help, _)| help.is_none())
        .map(|(k, ..)| k.key().name())
        .collect();
    assert!(without.is_empty(), "no help for {without:?}");
}

#[test]
fn without_a_store_no_store_metrics_are_published() {
    let ((), snapshot) = recorded(async {
        let backend = service_fn(empty);
        let fleet = StaticFleet::new([("a1", Backend::new("node-a", backend))]);
        let svc = SessionAffinityLayer::new().layer(fleet);
        svc.publish_metrics();
    });
    assert!(
        snapshot
            .iter()
            .all(|(k, ..)| !k.key().name().starts_with("tower_affinity_store_")),
        "{:?}",
        snapshot
            .iter()
            .map(|(k, ..)| k.key().name())
            .collect::<Vec<_>>()
    );
}

#[test]
fn a_backend_that_left_reads_zero_and_counters_start_at_zero() {
    let ((), snapshot) = recorded(async {
        let backend = service_fn(empty);
        let (handle, fleet) = tower_affinity::discover::channel();
        let slots = NonZeroU32::new(2).unwrap();
        handle.insert("a1", Backend::new("node-a", backend).slots(slots));
        handle.insert("a2", Backend::new("node-a", backend).slots(slots));
        let mut svc = SessionAffinityLayer::new().layer(fleet);
        svc.ready().await.unwrap();
        svc.publish_metrics();
        handle.remove("a2");
        svc.ready().await.unwrap();
        svc.publish_metrics();
    });
    let level = |name: &str, backend: &str| {
        let labels = [("backend", backend), ("node", "node-a")];
        value(&snapshot, MetricKind::Gauge, name, &labels)
    };
    let gauge = |v: f64| DebugValue::Gauge(v.into());
    assert_eq!(
        level("tower_affinity_backend_healthy", "a1"),
        Some(&gauge(1.0))
    );
    assert_eq!(
        level("tower_affinity_backend_slots", "a1"),
        Some(&gauge(2.0))
    );
    // Gone from the fleet: every level of it reads 0, so sums over backends count a1 only.
    for name in [
        "healthy",
        "slots",
        "in_flight",
        "context_tokens",
        "request_context_tokens",
        "cached_tokens",
        "cache_budget_tokens",
        "conversations",
    ] {
        let name = format!("tower_affinity_backend_{name}");
        assert_eq!(level(&name, "a2"), Some(&gauge(0.0)), "{name}");
    }
    // A prefill rate it never learned has no series, gone or not: a 0 would drag down an
    // average over the fleet.
    assert_eq!(
        level("tower_affinity_backend_prefill_tokens_per_second", "a2"),
        None
    );
    // Nothing refused yet, and no compaction: published at 0, not missing.
    let counter =
        |name: &str, labels: &[(&str, &str)]| value(&snapshot, MetricKind::Counter, name, labels);
    for name in [
        "rejected",
        "no_backends",
        "abandoned",
        "refusals_retried",
        "refusals_answered",
        "backend_errors",
    ] {
        let name = format!("tower_affinity_{name}_total");
        assert_eq!(counter(&name, &[]), Some(&DebugValue::Counter(0)), "{name}");
    }
    assert_eq!(
        counter(
            "tower_affinity_decisions_total",
            &[("outcome", "compaction")]
        ),
        Some(&DebugValue::Counter(0))
    );
}

/// The entry whose labels are exactly `labels`, in any order.
fn exact<'a>(
    snapshot: &'a [Entry],
    kind: MetricKind,
    name: &str,
    labels: &[(&str, &str)],
) -> Option<&'a DebugValue> {
    let mut want: Vec<(&str, &str)> = labels.to_vec();
    want.sort_unstable();
    snapshot
        .iter()
        .find(|(k, ..)| {
            let mut have: Vec<(&str, &str)> =
                k.key().labels().map(|l| (l.key(), l.value())).collect();
            have.sort_unstable();
            k.kind() == kind && k.key().name() == name && have == want
        })
        .map(|(.., v)| v)
}

#[test]
fn two_balancers_in_one_process_keep_their_series_apart_by_their_labels() {
    let ((), snapshot) = recorded(async {
        // A request to `/fail` fails on its backend.
        let backend = service_fn(|req: http::Request<String>| async move {
            match req.uri().path() {
                "/fail" => Err(std::io::Error::other("refused")),
                _ => {
                    let mut res =
                        http::Response::new(Full::new(Bytes::from_static(ANSWER.as_bytes())));
                    res.headers_mut()
                        .insert("content-type", "application/json".parse().unwrap());
                    Ok(res)
                }
            }
        });
        let fleet = |id: &'static str| StaticFleet::new([(id, Backend::new("node-a", backend))]);
        let coder = SessionAffinityLayer::new()
            .metrics_labels([("fleet", "coder"), ("region", "eu")])
            .layer(fleet("c1"));
        // The series' own labels, and one given twice, are left out.
        let titles = SessionAffinityLayer::new()
            .metrics_labels([("fleet", "titles"), ("outcome", "x"), ("fleet", "again")])
            .layer(fleet("t1"));
        for (svc, sessions) in [(&coder, ["a", "b", "c"].as_slice()), (&titles, &["a"])] {
            for session in sessions {
                let req = http::Request::post("/v1/chat/completions")
                    .header("x-session-id", *session)
                    .body(String::new())
                    .unwrap();
                let res = svc.clone().oneshot(req).await.unwrap();
                res.into_body().collect().await.unwrap();
            }
            let req = http::Request::post("/fail").body(String::new()).unwrap();
            assert!(svc.clone().oneshot(req).await.is_err());
            svc.publish_metrics();
        }
    });
    let decisions = |labels: &[(&str, &str)]| {
        exact(
            &snapshot,
            MetricKind::Counter,
            "tower_affinity_decisions_total",
            labels,
        )
    };
    let coder = [("fleet", "coder"), ("region", "eu")];
    let new_session = [("outcome", "new-session")];
    assert_eq!(
        decisions(&[new_session[0], coder[0], coder[1]]),
        Some(&DebugValue::Counter(3))
    );
    assert_eq!(
        decisions(&[new_session[0], ("fleet", "titles")]),
        Some(&DebugValue::Counter(1))
    );
    // No series is written without the balancer's labels.
    assert_eq!(decisions(&new_session), None);
    let sessions = |labels: &[(&str, &str)]| {
        exact(
            &snapshot,
            MetricKind::Gauge,
            "tower_affinity_sessions",
            labels,
        )
    };
    assert_eq!(sessions(&coder), Some(&DebugValue::Gauge(3.0.into())));
    assert_eq!(
        sessions(&[("fleet", "titles")]),
        Some(&DebugValue::Gauge(1.0.into()))
    );
    // A backend's series: its own labels, then the balancer's.
    assert_eq!(
        exact(
            &snapshot,
            MetricKind::Gauge,
            "tower_affinity_backend_slots",
            &[("backend", "t1"), ("node", "node-a"), ("fleet", "titles")],
        ),
        Some(&DebugValue::Gauge(1.0.into()))
    );
    assert_eq!(
        exact(
            &snapshot,
            MetricKind::Counter,
            "tower_affinity_rejected_total",
            &coder,
        ),
        Some(&DebugValue::Counter(0))
    );
    assert_eq!(
        exact(
            &snapshot,
            MetricKind::Counter,
            "tower_affinity_backend_errors_total",
            &[("fleet", "titles")],
        ),
        Some(&DebugValue::Counter(1))
    );
    let first_bytes = exact(
        &snapshot,
        MetricKind::Histogram,
        "tower_affinity_first_byte_seconds",
        &[new_session[0], coder[0], coder[1]],
    );
    assert!(
        matches!(first_bytes, Some(DebugValue::Histogram(v)) if v.len() == 3),
        "{first_bytes:?}"
    );
    let unlabelled: Vec<&str> = snapshot
        .iter()
        .filter(|(k, ..)| !k.key().labels().any(|l| l.key() == "fleet"))
        .map(|(k, ..)| k.key().name())
        .collect();
    assert!(
        unlabelled.is_empty(),
        "without the balancer's labels: {unlabelled:?}"
    );
    every_metric_has_help(&snapshot);
}

#[test]
fn labels_an_exporter_would_refuse_are_left_out() {
    let ((), snapshot) = recorded(async {
        let backend = service_fn(|_req: http::Request<String>| async move {
            let mut res = http::Response::new(Full::new(Bytes::from_static(ANSWER.as_bytes())));
            res.headers_mut()
                .insert("content-type", "application/json".parse().unwrap());
            Ok::<_, Infallible>(res)
        });
        // `le` and `quantile` are the exporter's on a histogram's or a summary's series, an
        // empty name or one starting with `__` invalid, an empty value no label at all.
        let svc = SessionAffinityLayer::new()
            .metrics_labels([
                ("fleet", "coder"),
                ("le", "x"),
                ("quantile", "y"),
                ("", "z"),
                ("__name__", "w"),
                ("region", ""),
            ])
            .layer(StaticFleet::new([("c1", Backend::new("node-a", backend))]));
        let req = http::Request::post("/v1/chat/completions")
            .header("x-session-id", "a")
            .body(String::new())
            .unwrap();
        let res = svc.clone().oneshot(req).await.unwrap();
        res.into_body().collect().await.unwrap();
        svc.publish_metrics();
    });
    let first_bytes = exact(
        &snapshot,
        MetricKind::Histogram,
        "tower_affinity_first_byte_seconds",
        &[("outcome", "new-session"), ("fleet", "coder")],
    );
    assert!(
        matches!(first_bytes, Some(DebugValue::Histogram(v)) if v.len() == 1),
        "{first_bytes:?}"
    );
    for (key, ..) in &snapshot {
        let labels: Vec<&str> = key.key().labels().map(|l| l.key()).collect();
        assert!(
            labels.last() == Some(&"fleet"),
            "{}: {labels:?}",
            key.key().name()
        );
    }
}

#[test]
fn a_backend_moved_to_another_node_keeps_one_series_of_each_level_and_zeroes_it_when_it_leaves() {
    let ((), snapshot) = recorded(async {
        let backend = service_fn(empty);
        let (handle, fleet) = tower_affinity::discover::channel();
        let slots = NonZeroU32::new(2).unwrap();
        handle.insert("a1", Backend::new("node-a", backend).slots(slots));
        let mut svc = SessionAffinityLayer::new().layer(fleet);
        svc.ready().await.unwrap();
        svc.publish_metrics();
        // Discovery moves it: an update of the same backend, on another node.
        handle.insert("a1", Backend::new("node-b", backend).slots(slots));
        svc.ready().await.unwrap();
        svc.publish_metrics();
        handle.remove("a1");
        svc.ready().await.unwrap();
        svc.publish_metrics();
    });
    // Every level of a1 reads 0 once it has left, whichever node label it is under: none
    // stays at what it was, to be summed with the fleet's.
    for (key, _, _, v) in &snapshot {
        let name = key.key().name();
        if key.kind() == MetricKind::Gauge && name.starts_with("tower_affinity_backend_") {
            assert_eq!(v, &DebugValue::Gauge(0.0.into()), "{key:?}");
        }
    }
}

#[test]
fn a_backends_series_dropped_as_idle_come_back_with_its_next_events() {
    // Every series idle since the last render is dropped at the next: a backend quiet for
    // the exporter's idle timeout.
    let recorder = dropping_idle_series();
    let prometheus = recorder.handle();
    let series = |text: &str, name: &str| {
        let prefix = format!("{name}{{backend=\"a1\",node=\"node-a\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()).map(str::to_owned))
    };
    run_with(&recorder, async {
        let fleet = StaticFleet::new([(
            "a1",
            Backend::new("node-a", service_fn(answering)).slots(NonZeroU32::new(2).unwrap()),
        )]);
        let svc = SessionAffinityLayer::new().layer(fleet);
        let turn = || async {
            let req = http::Request::post("/v1/chat/completions")
                .header("x-session-id", "s")
                .body(String::new())
                .unwrap();
            let res = svc.clone().oneshot(req).await.unwrap();
            res.into_body().collect().await.unwrap();
        };
        turn().await;
        let text = prometheus.render();
        let first_byte = "tower_affinity_backend_first_byte_seconds_count";
        let prompt = "tower_affinity_backend_prompt_tokens_total";
        assert_eq!(series(&text, first_byte).as_deref(), Some("1"), "{text}");
        assert_eq!(series(&text, prompt).as_deref(), Some("1200"), "{text}");
        // Quiet: rendered until both are dropped as idle.
        let mut gone = false;
        for _ in 0..1000 {
            let text = prometheus.render();
            if series(&text, first_byte).is_none() && series(&text, prompt).is_none() {
                gone = true;
                break;
            }
        }
        assert!(gone);
        // The backend serves again: its series are there again.
        turn().await;
        let text = prometheus.render();
        assert!(series(&text, first_byte).is_some(), "{text}");
        assert!(series(&text, prompt).is_some(), "{text}");
    });
}

/// The series by outcome are looked up at each event in the recorder installed then: a
/// recorder installed after the service was built and had taken requests gets them, and a
/// series it dropped as idle comes back with its next event.
#[test]
fn series_by_outcome_reach_a_recorder_installed_later_and_come_back_once_dropped_as_idle() {
    let fleet = StaticFleet::new([(
        "a1",
        Backend::new("node-a", service_fn(answering)).slots(NonZeroU32::new(2).unwrap()),
    )]);
    let svc = SessionAffinityLayer::new().layer(fleet);
    let turn = || async {
        let req = http::Request::post("/v1/chat/completions")
            .header("x-session-id", "s")
            .body(String::new())
            .unwrap();
        let res = svc.clone().oneshot(req).await.unwrap();
        res.into_body().collect().await.unwrap();
    };
    // Before any recorder: the facade's no-op one.
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap()
        .block_on(turn());
    let recorder = dropping_idle_series();
    let prometheus = recorder.handle();
    let series = |text: &str, name: &str| {
        let prefix = format!("{name}{{outcome=\"home-hit\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()).map(str::to_owned))
    };
    let decisions = "tower_affinity_decisions_total";
    let prompt = "tower_affinity_prompt_tokens_total";
    let first_byte = "tower_affinity_first_byte_seconds_count";
    run_with(&recorder, async {
        turn().await;
        let text = prometheus.render();
        assert_eq!(series(&text, decisions).as_deref(), Some("1"), "{text}");
        assert_eq!(series(&text, prompt).as_deref(), Some("1200"), "{text}");
        assert_eq!(series(&text, first_byte).as_deref(), Some("1"), "{text}");
        let mut gone = false;
        for _ in 0..1000 {
            let text = prometheus.render();
            if [decisions, prompt, first_byte]
                .iter()
                .all(|name| series(&text, name).is_none())
            {
                gone = true;
                break;
            }
        }
        assert!(gone);
        turn().await;
        let text = prometheus.render();
        for name in [decisions, first_byte] {
            assert_eq!(series(&text, name).as_deref(), Some("1"), "{name}: {text}");
        }
        assert_eq!(series(&text, prompt).as_deref(), Some("1200"), "{text}");
    });
}

/// Under churn (a rolling restart's new ids), an exporter dropping every kind of idle series
/// keeps the series of the fleet and of its live backends, which `publish_metrics` touches,
/// and drops those of the backends that left: their number does not grow with the ids
/// discovery ever named.
#[test]
fn with_every_kind_dropped_when_idle_only_the_backends_that_left_lose_their_series() {
    let recorder = dropping_idle_series();
    let prometheus = recorder.handle();
    let backends = |text: &str| {
        let mut ids: Vec<String> = text
            .lines()
            .filter(|l| l.starts_with("tower_affinity_backend_") && l.contains("_total{"))
            .filter_map(|l| {
                l.split("backend=\"")
                    .nth(1)?
                    .split('"')
                    .next()
                    .map(str::to_owned)
            })
            .collect();
        ids.sort();
        ids.dedup();
        ids
    };
    run_with(&recorder, async {
        let (handle, fleet) = tower_affinity::discover::channel();
        let slots = NonZeroU32::new(2).unwrap();
        handle.insert(
            "v0",
            Backend::new("node-a", service_fn(answering)).slots(slots),
        );
        let mut svc = SessionAffinityLayer::new().layer(fleet);
        for round in 1..=20 {
            let req = http::Request::post("/v1/chat/completions")
                .header("x-session-id", "s")
                .body(String::new())
                .unwrap();
            svc.ready().await.unwrap();
            let res = svc.call(req).await.unwrap();
            res.into_body().collect().await.unwrap();
            // The next version replaces this one.
            handle.remove(format!("v{}", round - 1).as_str());
            handle.insert(
                format!("v{round}").as_str(),
                Backend::new("node-a", service_fn(answering)).slots(slots),
            );
            svc.ready().await.unwrap();
            // Scrapes: each publishes, then renders, dropping what went idle since.
            for _ in 0..2 {
                svc.publish_metrics();
                let _ = prometheus.render();
            }
        }
        svc.publish_metrics();
        let text = prometheus.render();
        assert_eq!(backends(&text), ["v20"], "{text}");
        assert!(
            text.contains("tower_affinity_decisions_total{outcome=\"home-hit\"} "),
            "the fleet's counters stay: {text}"
        );
    });
}

/// Runs `f` as [`recorded`] does, on paused time.
fn recorded_paused<T>(f: impl std::future::Future<Output = T>) -> (T, Vec<Entry>) {
    let recorder = DebuggingRecorder::new();
    let snapshotter: Snapshotter = recorder.snapshotter();
    let out = metrics::with_local_recorder(&recorder, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap()
            .block_on(f)
    });
    (out, snapshotter.snapshot().into_vec())
}

/// A stream's first byte is on the histograms once it has come, however the answer ends: a
/// client that stops reading mid-stream (a "stop generating"), or a backend that cuts it.
#[test]
fn a_streams_first_byte_counts_when_its_answer_is_dropped_or_cut_midway() {
    type Chunks = Vec<Result<http_body::Frame<Bytes>, std::io::Error>>;
    let ((), snapshot) = recorded_paused(async {
        // Two seconds of prefill, a first token, then the stream goes on (`/drop`) or is cut.
        let streams = service_fn(|req: http::Request<String>| async move {
            tokio::time::sleep(std::time::Duration::from_secs(2)).await;
            let first: Chunks = vec![Ok(http_body::Frame::data(Bytes::from_static(
                b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n",
            )))];
            let rest: Chunks = match req.uri().path() {
                "/drop" => Vec::new(),
                _ => vec![Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof))],
            };
            let body = tokio_stream::StreamExt::chain(
                tokio_stream::iter(first),
                tokio_stream::StreamExt::chain(tokio_stream::iter(rest), tokio_stream::pending()),
            );
            let mut res = http::Response::new(http_body_util::StreamBody::new(body));
            res.headers_mut()
                .insert("content-type", "text/event-stream".parse().unwrap());
            Ok::<_, Infallible>(res)
        });
        let fleet = StaticFleet::new([(
            "s1",
            Backend::new("node-s", streams).slots(NonZeroU32::new(2).unwrap()),
        )]);
        let svc = SessionAffinityLayer::new().layer(fleet);
        for (path, session) in [("/drop", "a"), ("/cut", "b")] {
            let req = http::Request::post(path)
                .header("x-session-id", session)
                .body(String::new())
                .unwrap();
            let mut body = svc.clone().oneshot(req).await.unwrap().into_body();
            let first = body.frame().await.unwrap().unwrap();
            assert!(first.is_data());
            if path == "/cut" {
                assert!(body.frame().await.unwrap().is_err());
            }
            drop(body);
        }
        assert_eq!(svc.stats().in_flight, 0);
    });
    let seconds = |name: &str, labels: &[(&str, &str)]| -> Vec<f64> {
        match value(&snapshot, MetricKind::Histogram, name, labels) {
            Some(DebugValue::Histogram(v)) => v.iter().map(|x| x.into_inner()).collect(),
            other => panic!("{name}: {other:?}"),
        }
    };
    assert_eq!(
        seconds(
            "tower_affinity_backend_first_byte_seconds",
            &[("backend", "s1"), ("node", "node-s")]
        ),
        vec![2.0, 2.0]
    );
    assert_eq!(
        seconds(
            "tower_affinity_first_byte_seconds",
            &[("outcome", "new-session")]
        ),
        vec![2.0, 2.0]
    );
}

/// An error answer comes at once, without reading the prompt (llama-server's refusal of a
/// prompt too long for its context, its 503 while it loads its model): it is no first byte
/// of an answer, and would read as the fastest prefill of all.
#[test]
fn an_error_answers_first_byte_is_not_timed() {
    let (mean, snapshot) = recorded_paused(async {
        let backend = service_fn(|req: http::Request<String>| async move {
            let (status, answer) = match req.uri().path() {
                "/refused" => (
                    http::StatusCode::BAD_REQUEST,
                    r#"{"error":{"code":400,"message":"the request exceeds the available context size"}}"#,
                ),
                _ => {
                    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
                    (http::StatusCode::OK, ANSWER)
                }
            };
            let mut res = http::Response::new(Full::new(Bytes::from_static(answer.as_bytes())));
            *res.status_mut() = status;
            res.headers_mut()
                .insert("content-type", "application/json".parse().unwrap());
            Ok::<_, Infallible>(res)
        });
        let fleet = StaticFleet::new([("a1", Backend::new("node-a", backend))]);
        let svc = SessionAffinityLayer::new().layer(fleet);
        turns_to(&svc, &["/refused", "/"]).await;
        svc.backends()[0].first_byte_time
    });
    let seconds = |name: &str, labels: &[(&str, &str)]| -> Vec<f64> {
        match value(&snapshot, MetricKind::Histogram, name, labels) {
            Some(DebugValue::Histogram(v)) => v.iter().map(|x| x.into_inner()).collect(),
            other => panic!("{name}: {other:?}"),
        }
    };
    let backend = [("backend", "a1"), ("node", "node-a")];
    assert_eq!(
        seconds("tower_affinity_backend_first_byte_seconds", &backend),
        vec![2.0]
    );
    let by_outcome: Vec<f64> = Outcome::ALL
        .iter()
        .filter_map(|o| {
            value(
                &snapshot,
                MetricKind::Histogram,
                "tower_affinity_first_byte_seconds",
                &[("outcome", o.as_str())],
            )
        })
        .flat_map(|v| match v {
            DebugValue::Histogram(v) => v.iter().map(|x| x.into_inner()).collect::<Vec<_>>(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(by_outcome, vec![2.0]);
    assert_eq!(mean, Some(std::time::Duration::from_secs(2)));
}

/// A backend's prefill rate is published once learned; before, it has no series: a rate of 0
/// would read as a backend that reads nothing, and drag down any average over the fleet.
#[test]
fn a_prefill_rate_not_learned_yet_is_not_published_as_zero() {
    let (taught, snapshot) = recorded(async {
        let backend = service_fn(|req: http::Request<String>| async move {
            let answer = match req.uri().path() {
                "/timed" => TIMED_ANSWER,
                _ => ANSWER,
            };
            let mut res = http::Response::new(Full::new(Bytes::from_static(answer.as_bytes())));
            res.headers_mut()
                .insert("content-type", "application/json".parse().unwrap());
            Ok::<_, Infallible>(res)
        });
        let fleet = StaticFleet::new([
            ("a1", Backend::new("node-a", backend)),
            ("a2", Backend::new("node-a", backend)),
        ]);
        let svc = SessionAffinityLayer::new().layer(fleet);
        // One answer on each backend (a slot each): one that teaches a rate, one that does
        // not. Both in flight at once, so that each takes a backend of its own.
        let mut answers = Vec::new();
        for (path, session) in [("/timed", "s"), ("/", "t")] {
            let req = http::Request::post(path)
                .header("x-session-id", session)
                .body(String::new())
                .unwrap();
            answers.push(svc.clone().oneshot(req).await.unwrap());
        }
        let mut served = Vec::new();
        for res in answers {
            let decision = res.extensions().get::<tower_affinity::Decision>().unwrap();
            served.push(decision.backend.to_string());
            res.into_body().collect().await.unwrap();
        }
        assert_ne!(served[0], served[1]);
        svc.publish_metrics();
        served.swap_remove(0)
    });
    let other = if taught == "a1" { "a2" } else { "a1" };
    let rate = |backend: &str| {
        value(
            &snapshot,
            MetricKind::Gauge,
            "tower_affinity_backend_prefill_tokens_per_second",
            &[("backend", backend)],
        )
    };
    assert_eq!(rate(&taught), Some(&DebugValue::Gauge(2000.0.into())));
    assert_eq!(rate(other), None);
}

/// A learned prefill rate reads 0 once its backend has left, as every level of it.
#[test]
fn a_learned_prefill_rate_reads_zero_once_its_backend_has_left() {
    let ((), snapshot) = recorded(async {
        let (handle, fleet) = tower_affinity::discover::channel();
        handle.insert("a1", Backend::new("node-a", service_fn(answering)));
        let mut svc = SessionAffinityLayer::new().layer(fleet);
        svc.ready().await.unwrap();
        let req = http::Request::post("/timed")
            .header("x-session-id", "s")
            .body(String::new())
            .unwrap();
        let res = svc.clone().oneshot(req).await.unwrap();
        res.into_body().collect().await.unwrap();
        svc.publish_metrics();
        handle.remove("a1");
        svc.ready().await.unwrap();
        svc.publish_metrics();
    });
    assert_eq!(
        value(
            &snapshot,
            MetricKind::Gauge,
            "tower_affinity_backend_prefill_tokens_per_second",
            &[("backend", "a1")],
        ),
        Some(&DebugValue::Gauge(0.0.into()))
    );
}

/// The series the `metrics` module's docs list, as `(name, kind, labels)`: the rows of its
/// table.
fn documented_series() -> Vec<(String, String, Vec<String>)> {
    let source = include_str!("../../src/metrics.rs");
    let mut rows: Vec<_> = source
        .lines()
        .filter_map(|line| line.strip_prefix("//! | `tower_affinity_"))
        .map(|row| {
            let cells: Vec<&str> = row.split('|').map(str::trim).collect();
            let name = format!("tower_affinity_{}", cells[0].trim_end_matches('`'));
            let kind = cells[1].to_string();
            let mut labels: Vec<String> = (cells[2].split(','))
                .map(|l| l.trim().trim_matches('`').to_string())
                .filter(|l| !l.is_empty())
                .collect();
            labels.sort();
            (name, kind, labels)
        })
        .collect();
    rows.sort();
    rows
}

/// Every series the balancer writes is in the `metrics` module's table, under its kind and
/// with its labels, and every series the table lists is written: a request that waited, its
/// answers' first bytes, a shared store's counters, and what `publish_metrics` sets (a prefill
/// rate among them, learned from the answers' timings).
#[test]
fn the_metrics_modules_table_is_every_series_written() {
    let ((), snapshot) = recorded(async {
        let fleet = StaticFleet::new([("a1", Backend::new("node-a", service_fn(answering)))]);
        let svc = SessionAffinityLayer::new()
            .home_store(Forgetful)
            .layer(fleet);
        let req = || {
            http::Request::post("/timed")
                .header("x-session-id", "s")
                .body(String::new())
                .unwrap()
        };
        // The one slot held by the first answer's body: the second request waits for it.
        let first = svc.clone().oneshot(req()).await.unwrap();
        let second = tokio::spawn(svc.clone().oneshot(req()));
        for _ in 0..8 {
            tokio::task::yield_now().await;
        }
        assert_eq!(svc.stats().waiting, 1);
        first.into_body().collect().await.unwrap();
        let second = second.await.unwrap().unwrap();
        assert!(second
            .extensions()
            .get::<tower_affinity::Decision>()
            .unwrap()
            .waited
            .is_some());
        second.into_body().collect().await.unwrap();
        tokio::task::yield_now().await;
        svc.publish_metrics();
    });
    let kind = |k: MetricKind| match k {
        MetricKind::Counter => "counter",
        MetricKind::Gauge => "gauge",
        MetricKind::Histogram => "histogram",
    };
    let mut written: Vec<(String, String, Vec<String>)> = snapshot
        .iter()
        .map(|(k, ..)| {
            // The series' own labels: the balancer adds none of its own here.
            let mut labels: Vec<String> = k.key().labels().map(|l| l.key().to_string()).collect();
            labels.sort();
            (
                k.key().name().to_string(),
                kind(k.kind()).to_string(),
                labels,
            )
        })
        .collect();
    written.sort();
    written.dedup();
    let documented = documented_series();
    let missing: Vec<_> = documented.iter().filter(|s| !written.contains(s)).collect();
    let undocumented: Vec<_> = written.iter().filter(|s| !documented.contains(s)).collect();
    assert!(
        missing.is_empty() && undocumented.is_empty(),
        "listed in src/metrics.rs but not written: {missing:?}\nwritten but not listed: {undocumented:?}"
    );
}

/// An answer its backend service marks [`SentAgain`](tower_affinity::SentAgain) counts on
/// the backend that gave it; an answer without the mark counts nothing.
#[test]
fn an_answer_marked_sent_again_counts_on_its_backend() {
    let ((), snapshot) = recorded_paused(async {
        // A request to `/again` is answered as if sent a second time.
        let backend = service_fn(|req: http::Request<String>| async move {
            let mut res = http::Response::new(String::new());
            if req.uri().path() == "/again" {
                res.extensions_mut().insert(tower_affinity::SentAgain);
            }
            Ok::<_, Infallible>(res)
        });
        let fleet = StaticFleet::new([("a1", Backend::new("node-a", backend))]);
        let svc = SessionAffinityLayer::new().layer(fleet);
        turns_to(&svc, &["/again", "/"]).await;
        assert_eq!(svc.backends()[0].sent_again, 1);
    });
    assert_eq!(
        value(
            &snapshot,
            MetricKind::Counter,
            "tower_affinity_backend_sent_again_total",
            &[("backend", "a1"), ("node", "node-a")],
        ),
        Some(&DebugValue::Counter(1))
    );
}

/// Each request refused for want of a backend, and each error of the discovery stream,
/// counts once on its fleet-wide counter.
#[test]
fn each_request_refused_without_a_backend_and_each_discovery_error_counts_once() {
    type Boxed =
        tower::util::BoxCloneSyncService<http::Request<String>, http::Response<String>, Infallible>;
    type Changes = Vec<
        Result<tower::discover::Change<tower_affinity::BackendId, Backend<Boxed>>, &'static str>,
    >;
    let ((), snapshot) = recorded_paused(async {
        let changes: Changes = vec![Err("registry unreachable"), Err("registry unreachable")];
        let svc = SessionAffinityLayer::new().layer(tokio_stream::iter(changes));
        for _ in 0..3 {
            let req = http::Request::post("/v1/chat/completions")
                .header("x-session-id", "s")
                .body(String::new())
                .unwrap();
            assert!(svc.clone().oneshot(req).await.is_err());
        }
        let stats = svc.stats();
        assert_eq!((stats.no_backends, stats.discovery_errors), (3, 2));
    });
    let counter = |name: &str| value(&snapshot, MetricKind::Counter, name, &[]);
    let counted = [
        "tower_affinity_no_backends_total",
        "tower_affinity_discovery_errors_total",
    ]
    .map(counter);
    assert_eq!(
        counted,
        [Some(&DebugValue::Counter(3)), Some(&DebugValue::Counter(2))]
    );
}

/// Each level gauge reads the figure of its name: a backend's from its status, the fleet's
/// from the service's stats, each figure a different number, two requests held in flight.
#[test]
fn each_level_reads_the_figure_it_is_named_after() {
    let ((status, stats), snapshot) = recorded_paused(async {
        let fleet = StaticFleet::new([(
            "a1",
            Backend::new("node-a", service_fn(answering))
                .slots(NonZeroU32::new(4).unwrap())
                .cache_tokens(1 << 20)
                .context_tokens(std::num::NonZeroU64::new(100_000).unwrap())
                .request_context_tokens(std::num::NonZeroU64::new(32_000).unwrap()),
        )]);
        let svc = SessionAffinityLayer::new().layer(fleet);
        // Three sessions of different lengths; the last two answers held unread.
        let mut held = Vec::new();
        for (session, blocks) in [("s", 3_u64), ("t", 5), ("u", 7)] {
            let ids: Vec<u64> = (1..=blocks).map(|id| id * 10 + blocks).collect();
            let chain = PromptChain::from_blocks(ids.iter().map(|&id| (id, 1_000)));
            let mut req = http::Request::post("/v1/chat/completions")
                .header("x-session-id", session)
                .body(String::new())
                .unwrap();
            req.extensions_mut().insert(PromptFacts::from_chain(chain));
            let res = svc.clone().oneshot(req).await.unwrap();
            if session == "s" {
                res.into_body().collect().await.unwrap();
            } else {
                held.push(res);
            }
        }
        svc.publish_metrics();
        let status = svc.backends().remove(0);
        (status, svc.stats())
    });
    let backend = [("backend", "a1"), ("node", "node-a")];
    let gauge = |name: &str, labels: &[(&str, &str)]| match value(
        &snapshot,
        MetricKind::Gauge,
        name,
        labels,
    ) {
        Some(DebugValue::Gauge(v)) => v.into_inner(),
        other => panic!("{name}: {other:?}"),
    };
    let levels = [
        ("in_flight", status.in_flight as f64),
        ("context_tokens", status.context_in_flight as f64),
        ("slots", f64::from(status.slots)),
        (
            "request_context_tokens",
            status.request_context_limit.unwrap() as f64,
        ),
        ("healthy", 1.0),
        ("cached_tokens", status.cached_tokens as f64),
        ("cache_budget_tokens", status.cache_budget as f64),
        ("conversations", f64::from(status.conversations)),
    ];
    for (name, want) in levels {
        let name = format!("tower_affinity_backend_{name}");
        assert_eq!(gauge(&name, &backend), want, "{name}");
    }
    let fleet = [
        ("in_flight", stats.in_flight as f64),
        ("waiting", stats.waiting as f64),
        ("sessions", stats.sessions as f64),
        ("session_table_bytes", stats.session_table_bytes as f64),
        ("cache_model_bytes", stats.cache_model_bytes as f64),
    ];
    for (name, want) in fleet {
        let name = format!("tower_affinity_{name}");
        assert_eq!(gauge(&name, &[]), want, "{name}");
    }
    // Each figure differs from the others of its kind: a gauge set from another reads wrong.
    let mut figures: Vec<f64> = levels.iter().map(|(_, v)| *v).collect();
    figures.sort_by(f64::total_cmp);
    figures.dedup();
    assert_eq!(figures.len(), levels.len(), "{levels:?}");
    let mut figures: Vec<f64> = fleet.iter().map(|(_, v)| *v).collect();
    figures.sort_by(f64::total_cmp);
    figures.dedup();
    assert_eq!(figures.len(), fleet.len(), "{fleet:?}");
}

/// A request sent beyond its backend's one slot counts as overcommitted, one refused counts
/// as rejected, and one placed after waiting counts as waited, with how long it waited.
#[test]
fn a_request_overcommitted_rejected_or_placed_after_a_wait_counts_once() {
    let ((), snapshot) = recorded_paused(async {
        let one = NonZeroU32::new(1).unwrap();
        let svc = |overflow| {
            let fleet = StaticFleet::new([(
                "a1",
                Backend::new("node-a", service_fn(answering)).slots(one),
            )]);
            SessionAffinityLayer::new().overflow(overflow).layer(fleet)
        };
        let req = || {
            http::Request::post("/v1/chat/completions")
                .header("x-session-id", "s")
                .body(String::new())
                .unwrap()
        };
        for overflow in [Overflow::Overcommit, Overflow::Reject] {
            let svc = svc(overflow);
            let _held = svc.clone().oneshot(req()).await.unwrap();
            let second = svc.clone().oneshot(req()).await;
            assert_eq!(second.is_ok(), overflow == Overflow::Overcommit);
        }
        let svc = svc(Overflow::wait(std::time::Duration::from_secs(30), 8));
        let held = svc.clone().oneshot(req()).await.unwrap();
        let second = tokio::spawn(svc.clone().oneshot(req()));
        tokio::time::sleep(std::time::Duration::from_secs(3)).await;
        assert_eq!(svc.stats().waiting, 1);
        drop(held);
        let second = second.await.unwrap().unwrap();
        second.into_body().collect().await.unwrap();
    });
    let counter = |name: &str| value(&snapshot, MetricKind::Counter, name, &[]);
    for name in ["overcommitted", "rejected", "waited"] {
        let name = format!("tower_affinity_{name}_total");
        assert_eq!(counter(&name), Some(&DebugValue::Counter(1)), "{name}");
    }
    let waits = match value(
        &snapshot,
        MetricKind::Histogram,
        "tower_affinity_wait_seconds",
        &[],
    ) {
        Some(DebugValue::Histogram(v)) => v.iter().map(|x| x.into_inner()).collect::<Vec<_>>(),
        other => panic!("{other:?}"),
    };
    assert_eq!(waits, [3.0]);
}

/// Label names that differ in a digit after their first character are two labels, as an
/// exporter writes them: both are kept.
#[test]
fn label_names_differing_only_in_a_digit_are_both_kept() {
    let ((), snapshot) = recorded(async {
        let fleet = StaticFleet::new([("a1", Backend::new("node-a", service_fn(empty)))]);
        let svc = SessionAffinityLayer::new()
            .metrics_labels([("zone1", "eu"), ("zone2", "us")])
            .layer(fleet);
        svc.publish_metrics();
    });
    assert_eq!(
        exact(
            &snapshot,
            MetricKind::Gauge,
            "tower_affinity_sessions",
            &[("zone1", "eu"), ("zone2", "us")],
        ),
        Some(&DebugValue::Gauge(0.0.into()))
    );
}
