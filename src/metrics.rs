//! Metrics through the [`metrics`](https://docs.rs/metrics) facade (feature `metrics`).
//!
//! A library must not choose its application's exporter. The `metrics` facade is how the
//! ecosystem's libraries report: it does nothing until the application installs a recorder
//! (`metrics-exporter-prometheus`, or an OpenTelemetry bridge), and then every library's
//! figures reach the same exporter without a registry passed around.
//! (`prometheus-client` with a registry passed in would tie the application to Prometheus's
//! data model and to one registry.)
//!
//! Events are recorded as they happen, each on its series as the recorder has it then (so that
//! a series an exporter dropped as idle comes back with its next event): install the recorder
//! before the service takes its first request. Levels (what is
//! in flight, the backends' health, what the caches hold) are read off the service when the
//! application asks, with [`SessionAffinity::publish_metrics`](crate::SessionAffinity::publish_metrics),
//! typically just before rendering a scrape, so that no request pays for a gauge.
//!
//! The recorder is the process's: two balancers in one process (a fleet for each model, say)
//! would write the same series, and the fleet-wide ones (`tower_affinity_decisions_total`,
//! `tower_affinity_sessions`, ...) would add up both, or take whichever published last. Give
//! each balancer labels of its own with
//! [`SessionAffinityLayer::metrics_labels`](crate::SessionAffinityLayer::metrics_labels):
//! they are added to every series it writes, after the series' own: a fleet for each model,
//! `metrics_labels([("fleet", "qwen3-coder")])` on one balancer and
//! `metrics_labels([("fleet", "qwen3-4b")])` on the other.
//!
//! `publish_metrics` also publishes the counters at 0 until their first event (so a rate
//! reads 0, not nothing), and zeroes the levels of a backend that has left the fleet. A
//! recorder keeps a series once set, and every backend id discovery ever named has series of
//! its own: under a fleet's churn (a rolling restart's new pod names) they would grow with
//! every deploy. So give the exporter an idle timeout over every kind of series
//! (`metrics-exporter-prometheus`: `PrometheusBuilder::idle_timeout(MetricKindMask::ALL, ..)`):
//! `publish_metrics` touches every counter and gauge of the fleet and of its live backends,
//! so only a removed backend's go idle and are dropped. Histograms are touched only by their
//! events: one quiet for the timeout (a backend's first bytes, the waits) is dropped until
//! its next event.
//!
//! The histograms are what the exporter makes of them: `metrics-exporter-prometheus` renders
//! a summary unless it is given buckets (`set_buckets`, or `set_buckets_for_metric`); waits
//! run to `max_wait` (60 s by default) and a cold prompt's first byte to minutes. The
//! first-byte histograms time the successful (2xx) answers read for their usage (JSON or SSE,
//! not compressed: see [`observe_usage`](crate::SessionAffinityLayer::observe_usage)), each as
//! its first byte comes, whether the answer then ends, is cut, or is dropped by its client (an
//! error comes at once, its prompt unread: it is not timed). A Responses stream's first byte
//! is that of its first event after `response.created` and `response.in_progress`, which its
//! backend sends before it has read the prompt. An answer that is not streamed (a request
//! without `"stream": true`) comes whole: its first byte comes after the generation too, so
//! the prefill's cost shows only in the streams'.
//!
//! | name | kind | labels | what |
//! |---|---|---|---|
//! | `tower_affinity_decisions_total` | counter | `outcome` | requests placed, by [`Outcome`] |
//! | `tower_affinity_prompt_tokens_total` | counter | `outcome` | prompt tokens of the answers that said how many they reused, by their requests' outcome ([`Stats::reuse`](crate::Stats::reuse)) |
//! | `tower_affinity_reused_tokens_total` | counter | `outcome` | of them, reused from the backends' caches: a home hit's share near 1 and a cold home's near 0 say the cache model is right |
//! | `tower_affinity_first_byte_seconds` | histogram | `outcome` | dispatch to a successful answer's first byte (a Responses stream's first event after those that open it), by the request's outcome: what a cold prefill costs against a warm one |
//! | `tower_affinity_waited_total` | counter | | requests placed after waiting for a slot (a wait that ends in a refusal counts in `rejected`, one its caller gave up on in `abandoned`) |
//! | `tower_affinity_wait_seconds` | histogram | | how long they waited before being placed |
//! | `tower_affinity_overcommitted_total` | counter | | requests sent beyond a backend's slots |
//! | `tower_affinity_rejected_total` | counter | | requests refused: no slot, no room to wait |
//! | `tower_affinity_no_backends_total` | counter | | requests refused: no backend |
//! | `tower_affinity_abandoned_total` | counter | | requests their caller gave up on while they waited for a slot or the shared store |
//! | `tower_affinity_refusals_retried_total` | counter | | requests sent again after a backend refused their prompt as too long for its context |
//! | `tower_affinity_refusals_answered_total` | counter | | of them, those answered with the refusal: no other backend takes the prompt, or the request continues a response stored where it was refused |
//! | `tower_affinity_backend_errors_total` | counter | | requests whose backend failed or answered 503, over the fleet |
//! | `tower_affinity_discovery_errors_total` | counter | | errors from the discovery stream |
//! | `tower_affinity_backend_failures_total` | counter | `backend`, `node` | requests that failed on this backend, or that it answered with 503 |
//! | `tower_affinity_backend_cut_answers_total` | counter | `backend`, `node` | answers it began and cut before their end (their body failed); they mark nothing down ([`BackendStatus::cut_answers`](crate::BackendStatus::cut_answers)) |
//! | `tower_affinity_backend_sent_again_total` | counter | `backend`, `node` | answers to requests sent to it a second time, their first connection closed before any answer ([`BackendStatus::sent_again`](crate::BackendStatus::sent_again)) |
//! | `tower_affinity_backend_prompt_tokens_total` | counter | `backend`, `node` | prompt tokens of its answers that said how many they reused |
//! | `tower_affinity_backend_reused_tokens_total` | counter | `backend`, `node` | of them, reused from its cache |
//! | `tower_affinity_backend_unreported_prompt_tokens_total` | counter | `backend`, `node` | prompt tokens of its answers that did not say (vLLM's Anthropic endpoint, vLLM without `--enable-prompt-tokens-details`, or SGLang without `--enable-cache-report`) |
//! | `tower_affinity_backend_corrections_total` | counter | `backend`, `node` | answers far below the cache model's prediction |
//! | `tower_affinity_backend_first_byte_seconds` | histogram | `backend`, `node` | dispatch to its successful answer's first byte |
//! | `tower_affinity_in_flight` | gauge | | requests in flight (published) |
//! | `tower_affinity_waiting` | gauge | | requests waiting for a slot (published) |
//! | `tower_affinity_sessions` | gauge | | sessions in the table (published) |
//! | `tower_affinity_session_table_bytes` | gauge | | bytes the session table holds (published) |
//! | `tower_affinity_cache_model_bytes` | gauge | | bytes the cache model holds, over the live backends (published) |
//! | `tower_affinity_backend_in_flight` | gauge | `backend`, `node` | (published) |
//! | `tower_affinity_backend_context_tokens` | gauge | `backend`, `node` | tokens of its shared context its requests in flight take, by the router's estimate; 0 without [`Backend::context_tokens`](crate::Backend::context_tokens) (published) |
//! | `tower_affinity_backend_slots` | gauge | `backend`, `node` | (published) |
//! | `tower_affinity_backend_request_context_tokens` | gauge | `backend`, `node` | the most tokens of context one request can take there, given or read by the [probe](crate::health) (`/slots`, `/props`, `/v1/models`); 0 without a limit ([`Backend::request_context_tokens`](crate::Backend::request_context_tokens); published) |
//! | `tower_affinity_backend_healthy` | gauge | `backend`, `node` | 1 or 0 (published; 0 once the backend has left the fleet, as every level of it) |
//! | `tower_affinity_backend_cached_tokens` | gauge | `backend`, `node` | what the cache model says it holds (published) |
//! | `tower_affinity_backend_cache_budget_tokens` | gauge | `backend`, `node` | the budget the cache model keeps it to (published) |
//! | `tower_affinity_backend_conversations` | gauge | `backend`, `node` | conversations it homes (published) |
//! | `tower_affinity_backend_prefill_tokens_per_second` | gauge | `backend`, `node` | its learned prefill rate; no series until it is learned, from an answer that read 256 prompt tokens or more (published) |
//! | `tower_affinity_store_up` | gauge | | with a [shared store](crate::store): 1 while its reads answer in time, 0 while it is down; checked with each [probe](crate::health) round (published) |
//! | `tower_affinity_store_reads_total` | counter | | reads sent to the store (published, as the counters below) |
//! | `tower_affinity_store_hits_total` | counter | | reads that found a home on a live backend in time |
//! | `tower_affinity_store_misses_total` | counter | | reads that found no home in time |
//! | `tower_affinity_store_timeouts_total` | counter | | reads unanswered at the deadline |
//! | `tower_affinity_store_errors_total` | counter | | reads that failed |
//! | `tower_affinity_store_garbage_total` | counter | | values that are not a home |
//! | `tower_affinity_store_unknown_backends_total` | counter | | homes found on a backend this replica does not know (removed, or not yet discovered) |
//! | `tower_affinity_store_skipped_total` | counter | | requests that did not wait for a store that was down |
//! | `tower_affinity_store_writes_total` | counter | | writes sent |
//! | `tower_affinity_store_write_errors_total` | counter | | writes that failed or took over a second |
//! | `tower_affinity_store_writes_dropped_total` | counter | | writes not sent: too many in flight |
//! | `tower_affinity_store_outages_total` | counter | | times the store went down |
//! | `tower_affinity_store_recoveries_total` | counter | | times it came back |
//! | `tower_affinity_store_prompt_reads_total` | counter | | of the reads, keyless requests' |
//! | `tower_affinity_store_prompt_hits_total` | counter | | of the hits, keyless requests' |
//! | `tower_affinity_store_prompt_own_total` | counter | | of those, homes this replica wrote itself |
//! | `tower_affinity_store_prompt_writes_total` | counter | | of the writes, keyless requests' |
//!
//! The reuse placement achieves is one division in PromQL:
//!
//! ```text
//! sum by (backend) (rate(tower_affinity_backend_reused_tokens_total[5m]))
//!   / sum by (backend) (rate(tower_affinity_backend_prompt_tokens_total[5m]))
//! ```
//!
//! The `node` label is the node discovery first gave the backend. The store's counters are
//! kept by the service (its [store stats](crate::store::StoreStats)) and published as absolute
//! values, so they reach the recorder only through `publish_metrics`. The share of reads
//! that waited out the deadline, the share of scrapes that found the store up, and its
//! outages, over the last hour, in PromQL:
//!
//! ```text
//! rate(tower_affinity_store_timeouts_total[1h]) / rate(tower_affinity_store_reads_total[1h])
//! avg_over_time(tower_affinity_store_up[1h])
//! increase(tower_affinity_store_outages_total[1h])
//! ```

use std::time::Duration;

#[cfg(feature = "metrics")]
use std::sync::Arc;

#[cfg(feature = "metrics")]
use metrics::{counter, gauge, histogram, Counter, Gauge, Histogram, Key, Label, Level, Metadata};

#[cfg(feature = "metrics")]
use crate::store::{StoreState, StoreStats};
use crate::{BackendId, Decision, NodeId, Outcome};
#[cfg(feature = "metrics")]
use crate::{BackendStatus, Stats};

/// The labels a balancer adds to every series it writes
/// ([`metrics_labels`](crate::SessionAffinityLayer::metrics_labels)); none by default, and
/// nothing without the feature.
#[derive(Clone, Debug, Default)]
pub(crate) struct Labels {
    #[cfg(feature = "metrics")]
    extra: Option<Arc<Extra>>,
}

/// A balancer's own labels, and the keys of its series by outcome in them.
#[cfg(feature = "metrics")]
#[derive(Debug)]
struct Extra {
    labels: Box<[Label]>,
    /// Each series of [`BY_OUTCOME`] for each outcome (in the order of [`Outcome::ALL`]):
    /// built once, where a key built at each request would allocate and hash its labels.
    by_outcome: Box<[Key]>,
}

/// The fleet-wide series by outcome, written at every request.
#[cfg(feature = "metrics")]
#[derive(Clone, Copy, Debug)]
enum ByOutcome {
    Decisions,
    PromptTokens,
    ReusedTokens,
    FirstByte,
}

/// The names of the series of [`ByOutcome`], in its order.
#[cfg(feature = "metrics")]
const BY_OUTCOME: [&str; 4] = [
    "tower_affinity_decisions_total",
    "tower_affinity_prompt_tokens_total",
    "tower_affinity_reused_tokens_total",
    "tower_affinity_first_byte_seconds",
];

/// Why a balancer's label `name` with `value` would be refused or clash, if it would: `given`
/// says whether the balancer has a label of that name already.
#[cfg(feature = "metrics")]
pub(crate) fn refused_label(name: &str, value: &str, given: bool) -> Option<&'static str> {
    Some(match name {
        "backend" | "node" | "outcome" => "the series use it themselves",
        "le" | "quantile" => "exporters add it to histograms and summaries",
        _ if name.is_empty() || exported_label(name).starts_with("__") => {
            "empty, or reserved by Prometheus (`__`)"
        }
        _ if value.is_empty() => "Prometheus reads an empty value as no label",
        _ if given => "given twice",
        _ => return None,
    })
}

/// A label name as Prometheus's exporter writes it: each character other than
/// `[a-zA-Z0-9_]` (a digit too, first) as `_`. Two names written alike are one label there,
/// given twice on a series: a scrape refuses the whole page.
#[cfg(feature = "metrics")]
pub(crate) fn exported_label(name: &str) -> String {
    name.chars()
        .enumerate()
        .map(|(i, c)| match c {
            'a'..='z' | 'A'..='Z' | '_' => c,
            '0'..='9' if i > 0 => c,
            _ => '_',
        })
        .collect()
}

#[cfg(feature = "metrics")]
impl Labels {
    /// `pairs` as labels, in order; none (and no cost) if empty. Shared, so that a series'
    /// labels copy no string.
    pub(crate) fn new(pairs: &[(String, String)]) -> Self {
        let shared = |s: &str| Arc::<str>::from(s);
        let extra: Vec<Label> = pairs
            .iter()
            .map(|(k, v)| Label::new(shared(k), shared(v)))
            .collect();
        if extra.is_empty() {
            return Labels { extra: None };
        }
        let by_outcome = BY_OUTCOME
            .iter()
            .flat_map(|&name| {
                let extra = &extra;
                Outcome::ALL.iter().map(move |&outcome| {
                    let own = [outcome_label(outcome)];
                    Key::from_parts(
                        name,
                        own.into_iter()
                            .chain(extra.iter().cloned())
                            .collect::<Vec<_>>(),
                    )
                })
            })
            .collect();
        Labels {
            extra: Some(Arc::new(Extra {
                labels: extra.into(),
                by_outcome,
            })),
        }
    }

    /// `own` (a series' own labels), then the balancer's.
    fn with<const N: usize>(&self, own: [Label; N]) -> Vec<Label> {
        own.into_iter()
            .chain(self.extra.iter().flat_map(|x| x.labels.iter().cloned()))
            .collect()
    }

    /// A backend's series' labels: its own, then the balancer's.
    fn of_backend(&self, backend: &str, node: &str) -> Vec<Label> {
        self.with([
            Label::new("backend", Arc::<str>::from(backend)),
            Label::new("node", Arc::<str>::from(node)),
        ])
    }

    /// A fleet-wide counter without labels of its own.
    fn counter(&self, name: &'static str) -> Counter {
        match &self.extra {
            None => counter!(name),
            Some(_) => counter!(name, self.with([])),
        }
    }

    /// A fleet-wide counter by outcome.
    fn counter_by(&self, series: ByOutcome, outcome: Outcome) -> Counter {
        match &self.extra {
            None => metrics::with_recorder(|r| {
                r.register_counter(&by_outcome(series, outcome), &METADATA)
            }),
            Some(extra) => metrics::with_recorder(|r| {
                r.register_counter(extra.key(series, outcome), &METADATA)
            }),
        }
    }

    /// A fleet-wide histogram without labels of its own.
    fn histogram(&self, name: &'static str) -> Histogram {
        match &self.extra {
            None => histogram!(name),
            Some(_) => histogram!(name, self.with([])),
        }
    }

    /// A fleet-wide histogram by outcome.
    fn histogram_by(&self, series: ByOutcome, outcome: Outcome) -> Histogram {
        match &self.extra {
            None => metrics::with_recorder(|r| {
                r.register_histogram(&by_outcome(series, outcome), &METADATA)
            }),
            Some(extra) => metrics::with_recorder(|r| {
                r.register_histogram(extra.key(series, outcome), &METADATA)
            }),
        }
    }

    /// A fleet-wide gauge without labels of its own.
    fn gauge(&self, name: &'static str) -> Gauge {
        match &self.extra {
            None => gauge!(name),
            Some(_) => gauge!(name, self.with([])),
        }
    }
}

#[cfg(feature = "metrics")]
impl Extra {
    /// The key of `series` by `outcome`, the balancer's labels after its own.
    fn key(&self, series: ByOutcome, outcome: Outcome) -> &Key {
        &self.by_outcome[series as usize * Outcome::ALL.len() + outcome as usize]
    }
}

/// What the `metrics` macros give a series looked up from this module: its target and level.
#[cfg(feature = "metrics")]
static METADATA: Metadata<'static> =
    Metadata::new(module_path!(), Level::INFO, Some(module_path!()));

/// Each outcome's label, in the order of the enum's variants ([`Outcome::ALL`]'s).
#[cfg(feature = "metrics")]
static OUTCOME_LABELS: [Label; Outcome::ALL.len()] = [
    outcome_label(Outcome::HomeHit),
    outcome_label(Outcome::SameNodeSpill),
    outcome_label(Outcome::CrossNodeSpill),
    outcome_label(Outcome::NewSession),
    outcome_label(Outcome::Keyless),
    outcome_label(Outcome::Replaced),
    outcome_label(Outcome::ColdHome),
    outcome_label(Outcome::Compaction),
    outcome_label(Outcome::PrefixHit),
];

/// The label of a series by outcome.
#[cfg(feature = "metrics")]
const fn outcome_label(outcome: Outcome) -> Label {
    Label::from_static_parts("outcome", outcome.as_str())
}

/// The key of the series `name` by `outcome`, without the balancer's labels: built from
/// static parts, so that it allocates nothing, and looked up in the recorder at each event
/// as the macros do (a recorder installed after the service was built, or a series an
/// exporter dropped as idle, is found again). The macros build a vector of the labels for a
/// value not written in the call (`"outcome" => label`): 48 bytes at every request.
#[cfg(feature = "metrics")]
fn by_outcome(series: ByOutcome, outcome: Outcome) -> Key {
    let label = std::slice::from_ref(&OUTCOME_LABELS[outcome as usize]);
    Key::from_static_parts(BY_OUTCOME[series as usize], label)
}

/// One backend's series' keys; nothing without the feature.
///
/// Each event looks its series up in the recorder by its key rather than keeping the handles
/// the recorder gave when the backend was discovered: an exporter with an idle timeout
/// drops a series quiet for that long (a backend without traffic overnight), and a handle
/// kept from before writes to what it dropped, never rendered again. The keys are built once,
/// with the backend: the macros would build one at each event, its labels' vector allocated
/// and hashed anew (three allocations for an answer that reports its usage).
#[derive(Debug)]
pub(crate) struct BackendMetrics {
    /// The balancer's labels, for the fleet-wide series it also counts in.
    #[cfg(feature = "metrics")]
    fleet: Labels,
    /// The keys of the backend's series, its own labels then the balancer's: its counters in
    /// the order of [`BACKEND_COUNTERS`], then its histogram, then its gauges in the order of
    /// [`LEVELS`].
    #[cfg(feature = "metrics")]
    keys: Box<[Key]>,
    /// What of the backend's levels is published, held while they are set.
    #[cfg(feature = "metrics")]
    published: parking_lot::Mutex<Published>,
}

/// What of a backend's levels is published.
#[cfg(feature = "metrics")]
#[derive(Debug, Default)]
struct Published {
    /// The backend has left the fleet: a scrape that read the fleet before it left, and sets
    /// its levels after its removal zeroed them, sets nothing (they would read as a backend
    /// in the fleet until the exporter's idle timeout, or for good without one).
    gone: bool,
    /// Its prefill rate has a series (it was learned): zeroed when the backend leaves, where
    /// one never learned gets none.
    rate: bool,
}

/// The per-backend gauges [`publish`] sets.
#[cfg(feature = "metrics")]
const LEVELS: [&str; 9] = [
    "tower_affinity_backend_in_flight",
    "tower_affinity_backend_context_tokens",
    "tower_affinity_backend_slots",
    "tower_affinity_backend_request_context_tokens",
    "tower_affinity_backend_healthy",
    "tower_affinity_backend_cached_tokens",
    "tower_affinity_backend_cache_budget_tokens",
    "tower_affinity_backend_conversations",
    "tower_affinity_backend_prefill_tokens_per_second",
];

/// A backend's counters.
#[cfg(feature = "metrics")]
const BACKEND_COUNTERS: [&str; 7] = [
    "tower_affinity_backend_failures_total",
    "tower_affinity_backend_cut_answers_total",
    "tower_affinity_backend_prompt_tokens_total",
    "tower_affinity_backend_reused_tokens_total",
    "tower_affinity_backend_unreported_prompt_tokens_total",
    "tower_affinity_backend_corrections_total",
    "tower_affinity_backend_sent_again_total",
];

/// Where each of a backend's counters is in [`BACKEND_COUNTERS`] (and its key in
/// [`BackendMetrics::keys`]).
#[cfg(feature = "metrics")]
const FAILURES: usize = 0;
#[cfg(feature = "metrics")]
const CUT_ANSWERS: usize = 1;
#[cfg(feature = "metrics")]
const PROMPT_TOKENS: usize = 2;
#[cfg(feature = "metrics")]
const REUSED_TOKENS: usize = 3;
#[cfg(feature = "metrics")]
const UNREPORTED_PROMPT_TOKENS: usize = 4;
#[cfg(feature = "metrics")]
const CORRECTIONS: usize = 5;
#[cfg(feature = "metrics")]
const SENT_AGAIN: usize = 6;

/// A backend's histogram, and where its key is in [`BackendMetrics::keys`].
#[cfg(feature = "metrics")]
const FIRST_BYTE: (&str, usize) = (
    "tower_affinity_backend_first_byte_seconds",
    BACKEND_COUNTERS.len(),
);

/// Where the first of a backend's gauges' keys is in [`BackendMetrics::keys`].
#[cfg(feature = "metrics")]
const FIRST_LEVEL: usize = FIRST_BYTE.1 + 1;

impl BackendMetrics {
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn new(backend: &BackendId, node: &NodeId, fleet: &Labels) -> Self {
        #[cfg(feature = "metrics")]
        {
            let labels = fleet.of_backend(backend.as_str(), node.as_str());
            let names = BACKEND_COUNTERS
                .iter()
                .chain([&FIRST_BYTE.0])
                .chain(&LEVELS);
            let metrics = BackendMetrics {
                fleet: fleet.clone(),
                keys: names
                    .map(|&name| Key::from_parts(name, labels.clone()))
                    .collect(),
                published: parking_lot::Mutex::default(),
            };
            // Its counters and histogram are there from its discovery on, at 0.
            for i in 0..BACKEND_COUNTERS.len() {
                let _ = metrics.counter(i);
            }
            let _ = metrics.histogram(FIRST_BYTE.1);
            metrics
        }
        #[cfg(not(feature = "metrics"))]
        BackendMetrics {}
    }

    /// The backend's counter `i` (of [`BACKEND_COUNTERS`]), as the recorder has it now.
    #[cfg(feature = "metrics")]
    fn counter(&self, i: usize) -> Counter {
        metrics::with_recorder(|r| r.register_counter(&self.keys[i], &METADATA))
    }

    /// The backend's histogram whose key is `i`, as the recorder has it now.
    #[cfg(feature = "metrics")]
    fn histogram(&self, i: usize) -> Histogram {
        metrics::with_recorder(|r| r.register_histogram(&self.keys[i], &METADATA))
    }

    /// The backend's gauge `i` (of [`LEVELS`]), as the recorder has it now.
    #[cfg(feature = "metrics")]
    fn gauge(&self, i: usize) -> Gauge {
        metrics::with_recorder(|r| r.register_gauge(&self.keys[FIRST_LEVEL + i], &METADATA))
    }

    pub(crate) fn failure(&self) {
        #[cfg(feature = "metrics")]
        {
            self.counter(FAILURES).increment(1);
            self.fleet
                .counter("tower_affinity_backend_errors_total")
                .increment(1);
        }
    }

    pub(crate) fn cut_answer(&self) {
        #[cfg(feature = "metrics")]
        self.counter(CUT_ANSWERS).increment(1);
    }

    pub(crate) fn sent_again(&self) {
        #[cfg(feature = "metrics")]
        self.counter(SENT_AGAIN).increment(1);
    }

    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn answer(&self, prompt: u64, reused: Option<u64>, correction: bool) {
        #[cfg(feature = "metrics")]
        {
            // Only the answers that said their reuse count against it.
            match reused {
                Some(reused) => {
                    self.counter(PROMPT_TOKENS).increment(prompt);
                    self.counter(REUSED_TOKENS).increment(reused);
                }
                None => self.counter(UNREPORTED_PROMPT_TOKENS).increment(prompt),
            }
            if correction {
                self.counter(CORRECTIONS).increment(1);
            }
        }
    }

    /// Sets the backend's level gauges from its status `b`, and touches its counters: an
    /// exporter that drops idle series (`MetricKindMask::ALL`) keeps those of the backends in
    /// the fleet, however quiet, and drops those of the backends that have left it. Nothing,
    /// once the backend has left (`b` was read off a fleet from before).
    #[cfg(feature = "metrics")]
    pub(crate) fn publish(&self, b: &BackendStatus) {
        let mut published = self.published.lock();
        if published.gone {
            return;
        }
        for i in 0..BACKEND_COUNTERS.len() {
            self.counter(i).increment(0);
        }
        let levels = [
            f64::from(b.in_flight),
            b.context_in_flight as f64,
            f64::from(b.slots),
            b.request_context_limit.unwrap_or(0) as f64,
            if b.healthy { 1.0 } else { 0.0 },
            b.cached_tokens as f64,
            b.cache_budget as f64,
            f64::from(b.conversations),
        ];
        for (i, value) in levels.into_iter().enumerate() {
            self.gauge(i).set(value);
        }
        // Not looked up before it is learned: a recorder shows a gauge it was asked for, at
        // 0, and a rate of 0 would read as a backend that reads nothing.
        if let Some(rate) = b.prefill_rate {
            self.gauge(levels.len()).set(f64::from(rate));
            published.rate = true;
        }
    }

    /// The backend left the fleet: its levels read 0 from now on (a recorder keeps a series
    /// once set; the exporter's idle timeout is what drops it), so that sums over the
    /// backends count only those in the fleet. A prefill rate never learned gets no series.
    pub(crate) fn removed(&self) {
        #[cfg(feature = "metrics")]
        {
            let mut published = self.published.lock();
            published.gone = true;
            // The prefill rate is the last of the levels.
            let levels = if published.rate {
                LEVELS.len()
            } else {
                LEVELS.len() - 1
            };
            for i in 0..levels {
                self.gauge(i).set(0.0);
            }
        }
    }

    /// The backend is back in the fleet (announced again after it left): its levels are
    /// published again.
    pub(crate) fn returned(&self) {
        #[cfg(feature = "metrics")]
        {
            self.published.lock().gone = false;
        }
    }

    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn first_byte(&self, after: Duration) {
        #[cfg(feature = "metrics")]
        self.histogram(FIRST_BYTE.1).record(after.as_secs_f64());
    }
}

/// A request was placed.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn decision(labels: &Labels, d: &Decision) {
    #[cfg(feature = "metrics")]
    {
        labels
            .counter_by(ByOutcome::Decisions, d.outcome)
            .increment(1);
        if let Some(waited) = d.waited {
            labels.counter("tower_affinity_waited_total").increment(1);
            labels
                .histogram("tower_affinity_wait_seconds")
                .record(waited.as_secs_f64());
        }
        if d.overcommitted {
            labels
                .counter("tower_affinity_overcommitted_total")
                .increment(1);
        }
    }
}

/// An answer of a request placed with `outcome` reported `prompt` tokens, `reused` of them
/// reused.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn reuse(labels: &Labels, outcome: Outcome, prompt: u64, reused: u64) {
    #[cfg(feature = "metrics")]
    {
        labels
            .counter_by(ByOutcome::PromptTokens, outcome)
            .increment(prompt);
        labels
            .counter_by(ByOutcome::ReusedTokens, outcome)
            .increment(reused);
    }
}

/// The answer to a request placed with `outcome` began `after` its dispatch.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn first_byte(labels: &Labels, outcome: Outcome, after: Duration) {
    #[cfg(feature = "metrics")]
    labels
        .histogram_by(ByOutcome::FirstByte, outcome)
        .record(after.as_secs_f64());
}

/// A fleet-wide event without labels of its own, by its counter's name.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn event(labels: &Labels, name: &'static str) {
    #[cfg(feature = "metrics")]
    labels.counter(name).increment(1);
}

/// The fleet's counters, which count events: published at 0 until their first, so that a
/// query's rate or ratio reads 0, not nothing.
#[cfg(feature = "metrics")]
const EVENTS: [&str; 9] = [
    "tower_affinity_waited_total",
    "tower_affinity_overcommitted_total",
    "tower_affinity_rejected_total",
    "tower_affinity_no_backends_total",
    "tower_affinity_abandoned_total",
    "tower_affinity_refusals_retried_total",
    "tower_affinity_refusals_answered_total",
    "tower_affinity_backend_errors_total",
    "tower_affinity_discovery_errors_total",
];

#[cfg(feature = "metrics")]
#[derive(Clone, Copy)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// Each metric's help, as an exporter shows it (Prometheus's `# HELP`); the store's come with
/// its [counters](StoreStats::counters).
#[cfg(feature = "metrics")]
const HELP: [(&str, Kind, &str); 37] = [
    (
        "tower_affinity_decisions_total",
        Kind::Counter,
        "Requests placed, by outcome",
    ),
    (
        "tower_affinity_prompt_tokens_total",
        Kind::Counter,
        "Prompt tokens of the answers that said how many they reused, by their requests' outcome",
    ),
    (
        "tower_affinity_reused_tokens_total",
        Kind::Counter,
        "Of them, tokens the backends reused from their caches, by their requests' outcome",
    ),
    (
        "tower_affinity_first_byte_seconds",
        Kind::Histogram,
        "Dispatch to a successful answer's first byte, by the request's outcome",
    ),
    (
        "tower_affinity_waited_total",
        Kind::Counter,
        "Requests that waited for a slot before being placed",
    ),
    (
        "tower_affinity_wait_seconds",
        Kind::Histogram,
        "How long requests placed after waiting for a slot waited",
    ),
    (
        "tower_affinity_overcommitted_total",
        Kind::Counter,
        "Requests sent beyond a backend's slots",
    ),
    (
        "tower_affinity_rejected_total",
        Kind::Counter,
        "Requests refused: no free slot and no room or time to wait",
    ),
    (
        "tower_affinity_no_backends_total",
        Kind::Counter,
        "Requests refused: no backend up",
    ),
    (
        "tower_affinity_abandoned_total",
        Kind::Counter,
        "Requests their caller gave up on while they waited for a slot or the shared store",
    ),
    (
        "tower_affinity_refusals_retried_total",
        Kind::Counter,
        "Requests sent again after a backend refused their prompt as too long for its context",
    ),
    (
        "tower_affinity_refusals_answered_total",
        Kind::Counter,
        "Of them, those answered with the refusal: no other backend takes the prompt, or the request continues a response stored where it was refused",
    ),
    (
        "tower_affinity_backend_errors_total",
        Kind::Counter,
        "Requests whose backend failed or answered 503",
    ),
    (
        "tower_affinity_discovery_errors_total",
        Kind::Counter,
        "Errors from the discovery stream",
    ),
    (
        "tower_affinity_backend_failures_total",
        Kind::Counter,
        "Requests that failed on the backend, or that it answered 503",
    ),
    (
        "tower_affinity_backend_cut_answers_total",
        Kind::Counter,
        "Answers the backend began and cut before their end",
    ),
    (
        "tower_affinity_backend_prompt_tokens_total",
        Kind::Counter,
        "Prompt tokens of the backend's answers that said how many they reused",
    ),
    (
        "tower_affinity_backend_reused_tokens_total",
        Kind::Counter,
        "Of them, tokens the backend reused from its cache",
    ),
    (
        "tower_affinity_backend_unreported_prompt_tokens_total",
        Kind::Counter,
        "Prompt tokens of the backend's answers that did not say how many they reused",
    ),
    (
        "tower_affinity_backend_corrections_total",
        Kind::Counter,
        "Answers that reused far less than the cache model predicted",
    ),
    (
        "tower_affinity_backend_sent_again_total",
        Kind::Counter,
        "Answers to requests sent to the backend a second time, their first connection closed before any answer",
    ),
    (
        "tower_affinity_backend_first_byte_seconds",
        Kind::Histogram,
        "Dispatch to the first byte of the backend's successful answer",
    ),
    (
        "tower_affinity_in_flight",
        Kind::Gauge,
        "Requests dispatched whose response has not ended",
    ),
    (
        "tower_affinity_waiting",
        Kind::Gauge,
        "Requests waiting for a free slot",
    ),
    (
        "tower_affinity_sessions",
        Kind::Gauge,
        "Sessions in the session table",
    ),
    (
        "tower_affinity_session_table_bytes",
        Kind::Gauge,
        "Bytes the session table holds",
    ),
    (
        "tower_affinity_cache_model_bytes",
        Kind::Gauge,
        "Bytes the cache model holds, over the live backends",
    ),
    (
        "tower_affinity_backend_in_flight",
        Kind::Gauge,
        "Requests on the backend whose response has not ended",
    ),
    (
        "tower_affinity_backend_context_tokens",
        Kind::Gauge,
        "Tokens of the backend's shared context its requests in flight take, by the router's estimate",
    ),
    (
        "tower_affinity_backend_slots",
        Kind::Gauge,
        "Requests the backend serves at once",
    ),
    (
        "tower_affinity_backend_request_context_tokens",
        Kind::Gauge,
        "The most tokens of context one request can take on the backend; 0 without a limit",
    ),
    (
        "tower_affinity_backend_healthy",
        Kind::Gauge,
        "1 if the backend takes requests, 0 while it is down or gone",
    ),
    (
        "tower_affinity_backend_cached_tokens",
        Kind::Gauge,
        "Prompt tokens the cache model says the backend holds",
    ),
    (
        "tower_affinity_backend_cache_budget_tokens",
        Kind::Gauge,
        "Prompt tokens the cache model lets the backend hold",
    ),
    (
        "tower_affinity_backend_conversations",
        Kind::Gauge,
        "Conversations the cache model says the backend homes",
    ),
    (
        "tower_affinity_backend_prefill_tokens_per_second",
        Kind::Gauge,
        "The backend's learned prefill rate",
    ),
    (
        "tower_affinity_store_up",
        Kind::Gauge,
        "1 while the shared store's reads answer in time, 0 while it is down",
    ),
];

/// Gives the recorder each metric's help (cheap: a recorder keeps the last it was given).
/// No unit: each name carries its own, as Prometheus's conventions have it (`_seconds`), and
/// an exporter that adds a metric's unit to its name (`metrics-exporter-prometheus`'s
/// `set_enable_unit_suffix`) would write `_seconds_seconds`.
#[cfg(feature = "metrics")]
fn describe() {
    for (name, kind, help) in HELP {
        match kind {
            Kind::Counter => metrics::describe_counter!(name, help),
            Kind::Gauge => metrics::describe_gauge!(name, help),
            Kind::Histogram => metrics::describe_histogram!(name, help),
        }
    }
}

/// Sets the fleet's level gauges from a snapshot of the service (the backends' are set
/// through their own handles: [`BackendMetrics::publish`]).
#[cfg(feature = "metrics")]
pub(crate) fn publish(fleet: &Labels, stats: &Stats) {
    describe();
    for name in EVENTS {
        fleet.counter(name).increment(0);
    }
    for &outcome in Outcome::ALL {
        for series in [
            ByOutcome::Decisions,
            ByOutcome::PromptTokens,
            ByOutcome::ReusedTokens,
        ] {
            fleet.counter_by(series, outcome).increment(0);
        }
    }
    let level = |name, value: usize| fleet.gauge(name).set(value as f64);
    level(
        "tower_affinity_session_table_bytes",
        stats.session_table_bytes,
    );
    level("tower_affinity_cache_model_bytes", stats.cache_model_bytes);
    level("tower_affinity_in_flight", stats.in_flight);
    level("tower_affinity_waiting", stats.waiting);
    level("tower_affinity_sessions", stats.sessions);
}

/// Sets the shared store's state and counters from a snapshot of them.
#[cfg(feature = "metrics")]
pub(crate) fn publish_store(fleet: &Labels, s: &StoreStats) {
    let up = if s.state == StoreState::Up { 1.0 } else { 0.0 };
    fleet.gauge("tower_affinity_store_up").set(up);
    for (name, help, value) in s.counters() {
        let name = format!("tower_affinity_store_{name}_total");
        metrics::describe_counter!(name.clone(), help);
        counter!(name, fleet.with([])).absolute(value);
    }
}

#[cfg(all(test, feature = "metrics"))]
mod tests {
    use super::*;

    #[test]
    fn each_outcomes_series_carries_its_own_label() {
        let labelled = Labels::new(&[("fleet".into(), "a".into())]);
        let extra = labelled.extra.as_ref().expect("a label");
        for (i, series) in [
            ByOutcome::Decisions,
            ByOutcome::PromptTokens,
            ByOutcome::ReusedTokens,
            ByOutcome::FirstByte,
        ]
        .into_iter()
        .enumerate()
        {
            for &outcome in Outcome::ALL {
                let labels = |key: &Key| -> Vec<_> {
                    key.labels()
                        .map(|l| (l.key().to_owned(), l.value().to_owned()))
                        .collect()
                };
                let own = ("outcome".to_owned(), outcome.as_str().to_owned());
                let key = by_outcome(series, outcome);
                assert_eq!(key.name(), BY_OUTCOME[i]);
                assert_eq!(labels(&key), std::slice::from_ref(&own));
                let key = extra.key(series, outcome);
                assert_eq!(key.name(), BY_OUTCOME[i]);
                assert_eq!(labels(key), [own, ("fleet".to_owned(), "a".to_owned())]);
            }
        }
    }

    /// A scrape that read the fleet before a backend left and publishes its levels after
    /// (`publish_metrics` on one thread, discovery on another) sets nothing: the levels the
    /// removal zeroed stay 0, where they would read as a backend still in the fleet, its
    /// slots counted in their sum. Announced again, the backend is published again.
    #[test]
    fn a_fleet_read_before_a_backend_left_does_not_publish_it_after() {
        use metrics_util::debugging::{DebugValue, DebuggingRecorder};
        use metrics_util::MetricKind;
        use std::num::NonZeroU32;

        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let slots = || {
            snapshotter
                .snapshot()
                .into_vec()
                .into_iter()
                .find(|(k, ..)| {
                    k.kind() == MetricKind::Gauge
                        && k.key().name() == "tower_affinity_backend_slots"
                })
                .map(|(.., v)| v)
        };
        let gauge = |v: f64| Some(DebugValue::Gauge(v.into()));
        metrics::with_local_recorder(&recorder, || {
            let mut fleet = crate::fleet::Topology::default();
            let two = NonZeroU32::new(2).unwrap();
            fleet.insert("a".into(), &"n".into(), two, None, 1_000);
            fleet.publish_levels(0);
            assert_eq!(slots(), gauge(2.0));
            let before = fleet.clone();
            fleet.remove(&"a".into());
            assert_eq!(slots(), gauge(0.0));
            before.publish_levels(0);
            assert_eq!(slots(), gauge(0.0), "published after it left");
            fleet.insert("a".into(), &"n".into(), two, None, 1_000);
            fleet.publish_levels(0);
            assert_eq!(slots(), gauge(2.0), "announced again");
        });
    }

    #[test]
    fn names_an_exporter_writes_alike_are_given_twice_and_a_written_dunder_is_refused() {
        assert_eq!(exported_label("model.name"), "model_name");
        assert_eq!(exported_label("1x"), "_x");
        assert_eq!(
            refused_label("-_x", "v", false),
            refused_label("__x", "v", false)
        );
        assert!(refused_label("-_x", "v", false).is_some());
        assert!(refused_label("model_name", "v", false).is_none());
    }
}
