//! [`SessionAffinityLayer`]: the builder.

use std::sync::Arc;
use std::time::Duration;

use tower::discover::Discover;
use tower::Layer;

use crate::key::HeaderKey;
use crate::placement::NodeThenBackend;
use crate::service::{Config, SessionAffinity};
use crate::store::HomeStore;
use crate::{Backend, BackendId, BoxError, Overflow, Sessions};

/// Builds a [`SessionAffinity`] service over a discovery stream.
///
/// Defaults: keys from [`HeaderKey`] (`X-Session-Affinity`, then `X-Session-Id`, then the agents'
/// own session headers), placement by
/// [`NodeThenBackend`], [`Overflow::Wait`] up to 60 s, a table of 100,000 sessions forgotten
/// after an hour idle, a failing backend passed over for 5 s, no decision headers, no shared
/// store ([`home_store`](Self::home_store)).
///
/// The default key reads headers only. The key a [`BodyKeyLayer`](crate::key::BodyKeyLayer)
/// in front finds in a JSON body (`prompt_cache_key`, `user`, `metadata.user_id`) rides in the
/// request's extensions, and counts only with [`ExtensionKey`](crate::key::ExtensionKey) among
/// the extractors: `.key(FirstOf::new(HeaderKey::default(), ExtensionKey))`. Without it, such a
/// request is placed as keyless (by its prompt chain).
///
/// ```
/// use std::time::Duration;
/// use tower::Layer;
/// use tower_affinity::{discover::StaticFleet, Backend, Overflow, SessionAffinityLayer, Sessions};
/// use tower_affinity::placement::NodeThenBackend;
///
/// # fn backend() -> tower::util::BoxCloneSyncService<http::Request<()>, http::Response<()>, std::convert::Infallible> { unimplemented!() }
/// # fn doc() {
/// let fleet = StaticFleet::new([("gpu-0", Backend::new("host-a", backend()))]);
/// let svc = SessionAffinityLayer::new()
///     .placement(NodeThenBackend::new().load_bound(0.25))
///     .overflow(Overflow::wait(Duration::from_secs(30), 256))
///     .sessions(Sessions::new().max_entries(1_000_000))
///     .decision_headers(true)
///     .layer(fleet);
/// # let _ = svc;
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct SessionAffinityLayer<K = HeaderKey, P = NodeThenBackend> {
    key: K,
    placement: P,
    config: Config,
}

impl SessionAffinityLayer {
    /// The layer with its defaults.
    pub fn new() -> Self {
        SessionAffinityLayer {
            key: HeaderKey::default(),
            placement: NodeThenBackend::new(),
            config: Config {
                overflow: Overflow::default(),
                sessions: Sessions::new(),
                decision_headers: false,
                decision_extension: true,
                failure_cooldown: Duration::from_secs(5),
                ready_timeout: Some(Self::READY_TIMEOUT),
                node_patience: Duration::ZERO,
                wait_versus_move: true,
                observe_usage: true,
                replicas: std::num::NonZeroU32::MIN,
                store: None,
                store_deadline: Self::STORE_DEADLINE,
                random_seed: None,
                #[cfg(feature = "metrics")]
                metrics_labels: Vec::new(),
            },
        }
    }
}

impl SessionAffinityLayer {
    /// How long a request waits for the shared store's answer by default: 5 ms, some fifty
    /// round trips to a Redis on the same host and several across a data centre.
    pub const STORE_DEADLINE: Duration = Duration::from_millis(5);

    /// How long a request waits for the readiness of the backend it was placed on by
    /// default: 30 s (see [`ready_timeout`](Self::ready_timeout)).
    pub const READY_TIMEOUT: Duration = Duration::from_secs(30);
}

impl Default for SessionAffinityLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl<K, P> SessionAffinityLayer<K, P> {
    /// Sets the key extractor.
    pub fn key<K2>(self, key: K2) -> SessionAffinityLayer<K2, P> {
        SessionAffinityLayer {
            key,
            placement: self.placement,
            config: self.config,
        }
    }

    /// Sets the placement policy.
    pub fn placement<P2>(self, placement: P2) -> SessionAffinityLayer<K, P2> {
        SessionAffinityLayer {
            key: self.key,
            placement,
            config: self.config,
        }
    }

    /// Sets what a request does when every candidate is full.
    pub fn overflow(mut self, overflow: Overflow) -> Self {
        self.config.overflow = overflow;
        self
    }

    /// Sets the session table's bounds.
    pub fn sessions(mut self, sessions: Sessions) -> Self {
        self.config.sessions = sessions;
        self
    }

    /// How long a backend whose service returned an error (refused connection, timeout: no
    /// response at all), or that answered `503 Service Unavailable` (llama-server while it
    /// loads its model), is passed over. Default 5 s; zero disables. Any other HTTP error
    /// status is a response, not a failure. A request that fails this way can be retried at
    /// once: the next placement skips the backend (see [`RetryOnce`](crate::RetryOnce)).
    /// With zero it does not: a session's retry goes back to the backend that failed it.
    ///
    /// The cooldown is counted on a clock of whole milliseconds, and ends in the one its time
    /// falls in: any but zero passes the backend over for at least the retry that follows at
    /// once.
    pub fn failure_cooldown(mut self, cooldown: Duration) -> Self {
        self.config.failure_cooldown = cooldown;
        self
    }

    /// How long a request placed on a backend whose service is not ready (its `poll_ready`
    /// pending: a concurrency limit of its own, a connection it cannot make) waits for it.
    /// Past it, the backend counts as failed, as when its readiness fails: it is passed over
    /// for the [failure cooldown](Self::failure_cooldown), and the request fails with
    /// [`Error::Backend`](crate::Error::Backend) (504 Gateway Timeout), which
    /// [`RetryOnce`](crate::RetryOnce) sends elsewhere. Meanwhile the request holds its slot.
    ///
    /// Default [`READY_TIMEOUT`](Self::READY_TIMEOUT), 30 s; `None` waits as long as the
    /// backend takes, and zero not at all. The slots are the backend's concurrency: a backend
    /// that takes as many requests as its slots is always ready for the router's
    /// ([`HttpBackend`] always is), so a wait this long means the backend is stuck, or takes
    /// fewer requests than its slots say.
    ///
    /// [`HttpBackend`]: crate::client::HttpBackend
    pub fn ready_timeout(mut self, timeout: impl Into<Option<Duration>>) -> Self {
        self.config.ready_timeout = timeout.into();
        self
    }

    /// How long a session whose home backend and home node are full waits for a slot on its
    /// home node before it spills to another node: a fixed patience, which overrides
    /// [`wait_versus_move`](Self::wait_versus_move). Default zero: no fixed patience.
    ///
    /// A move between nodes costs the whole prompt again (minutes for a long agent context on a
    /// modest GPU); a turn on the home node often frees a slot within seconds. Applies only under
    /// [`Overflow::Wait`], within its `max_wait` (not at all with a `max_wait` of zero or a
    /// `max_queued` of 0, which let no request wait); the wait counts as waiting. A home node with
    /// no healthy backend is not waited for, and a request that finds no room in the queue
    /// (`max_queued` requests waiting already) takes a slot on another node at once.
    pub fn node_patience(mut self, patience: Duration) -> Self {
        self.config.node_patience = patience;
        self
    }

    /// Shares session homes with other router replicas through `store` (see [`store`]): every
    /// request with a session key reads its home there first, within the
    /// [`store_deadline`](Self::store_deadline), and a placement that changes a session's home
    /// writes it there, without waiting. A keyless request with a prompt reads and writes the
    /// backend of its conversation's latest turn there, by the digests of its prompt. The
    /// local session table and cache model stay the first answer when the store is slow or
    /// down. Needs a Tokio runtime.
    ///
    /// [`store`]: crate::store
    pub fn home_store(mut self, store: impl HomeStore) -> Self {
        self.config.store = Some(Arc::new(store));
        self
    }

    /// How long a request waits for the shared store's answer before the local session table
    /// answers instead. Default [`STORE_DEADLINE`](SessionAffinityLayer::STORE_DEADLINE), 5 ms.
    ///
    /// A read past the deadline marks the store down until a probe finds it again, which is
    /// logged and counted (`outages`). On a busy host (a router sharing two cores with its
    /// backends' clients, say) a few reads a half hour miss 5 ms with nothing wrong, each a
    /// short outage. It ends with the first read that answers in time: the probe the next
    /// request sends (that request is placed by the local table, without waiting for it) or a
    /// [`check_store`](crate::SessionAffinity::check_store) (a `HealthProbe`'s, each round).
    /// Under heavy traffic that is within tens of milliseconds; with a turn a second, a second
    /// or two, and the turns in it are placed without the store. On a host whose cores its
    /// model servers keep busy (two `llama-server`s on two cores), 5 ms missed about one read
    /// in nine; 50 ms, none. Alert on outages that last, or give the store a deadline that
    /// suits the host. A deadline shorter than the store's
    /// round trip (zero, say) finds it down at every read, and the probes that would find it
    /// up again too: the local table then places every request, and the store is written to
    /// but never read.
    pub fn store_deadline(mut self, deadline: Duration) -> Self {
        self.config.store_deadline = deadline;
        self
    }

    /// Whether every response carries its [`Decision`](crate::Decision) as an extension
    /// (default: yes). Turned off, the decision stays in the response body instead, readable
    /// through [`ResponseBody::decision`](crate::ResponseBody::decision), which saves the
    /// allocations `http::Extensions` makes for it on every response (three when the backend's
    /// response has no extensions yet, one when it has). Behind a
    /// [`BodyKeyLayer`](crate::key::BodyKeyLayer), its body reaches this one through
    /// [`BodyKeyResponseBody::get_ref`](crate::key::BodyKeyResponseBody::get_ref). A `503`
    /// answer then carries its backend's [`BackendId`](crate::BackendId) as an extension, by
    /// which [`RetryOnce`](crate::RetryOnce) names the backend in the failure it gives back.
    pub fn decision_extension(mut self, enabled: bool) -> Self {
        self.config.decision_extension = enabled;
        self
    }

    /// Whether a request whose cache is on a full backend may wait for it rather than move
    /// (default: yes, under an [`Overflow::Wait`] that lets requests wait, a `max_wait` above
    /// zero and a `max_queued` above 0, and without [`node_patience`](Self::node_patience)).
    /// A request's cache is its home, while the
    /// cache model says the home holds the session; else the backend holding its own prefix
    /// (see [`FleetView::longest_prefix`](crate::placement::FleetView::longest_prefix)); and
    /// for a request without a key, the one backend holding the most of its prompt, whether
    /// or not that prefix is the conversation's own. Only while the placement policy offers
    /// that backend first: one it passes over, or offers after another (`NodeThenBackend`
    /// does so with a holder of a new conversation's opening that homes its share of the
    /// conversations the opening drew), is not waited for.
    ///
    /// The request waits when the backend's slot is expected to free sooner than another
    /// backend would read the part of the prompt it lacks, and at most that long; then it
    /// moves. Both figures are learned from the backends' answers (see
    /// [`observe_usage`](Self::observe_usage)): the wait from how long their requests take and
    /// how long those in flight have run (a slot freed there and promised to a waiting request
    /// counts as one that starts now), the cost of moving from the backend's measured
    /// prefill rate and the prompts it has been sent and has not answered yet (a backend
    /// reads one prompt after another: a move there waits behind them). The move's read is
    /// counted for the requests that reach that backend while it lasts, too, as they wait
    /// behind it (by Little's law, at its requests in flight over their learned time): a
    /// move of a whole prompt onto a busy backend costs its other sessions' turns as well. A
    /// backend that has taught nothing yet is taken to read as the others do; until anything
    /// is learned, a request moves at once.
    ///
    /// The choice is made when a slot elsewhere is first on offer: on arrival, as the request
    /// joins the wait queue (a slot freed in between), or, for a request that found every
    /// backend full and waits for any slot, when one frees on another backend. A request holds
    /// out this way once; when its hold is over, any slot will do, and the last look of its
    /// wait ([`Overflow::Wait`]'s `max_wait`) takes a slot rather than hold out, as does a
    /// request that finds no room in the queue (its `max_queued`).
    pub fn wait_versus_move(mut self, enabled: bool) -> Self {
        self.config.wait_versus_move = enabled;
        self
    }

    /// Declares this service one of `n` router replicas that share the fleet's traffic evenly
    /// (an L4 balancer in front of them, or one that hashes sessions): each sees about one in
    /// `n` of the requests every backend serves, so its cache model keeps `1/n` of every
    /// backend's cache budget, rounded up. With the whole budget, a replica would not see the
    /// other replicas' prompts push its sessions out of a backend's cache, and would keep
    /// sending turns to homes that no longer hold them. Default 1.
    ///
    /// A replica also homes its share of new conversations on a backend: at least
    /// `slots / n` of them (rounded up) rather than `slots` (see
    /// [`NodeThenBackend::conversation_bound`](crate::placement::NodeThenBackend::conversation_bound)).
    ///
    /// Each replica counts only its own requests in flight against every backend's whole
    /// slots, so together they may send a backend up to `n` times its slots at once, and the
    /// backend queues the excess (llama-server, vLLM and SGLang do). To cap each replica at its
    /// share instead, declare every backend with `slots / n` ([`Backend::slots`]); under
    /// overload that spills more than the backends' queues cost. The README's "Router
    /// replicas" has both measured.
    ///
    /// [`Backend::slots`]: crate::Backend::slots
    ///
    /// ```
    /// use std::num::NonZeroU32;
    /// use tower_affinity::SessionAffinityLayer;
    ///
    /// let layer = SessionAffinityLayer::new().replicas(NonZeroU32::new(2).unwrap());
    /// # let _ = layer;
    /// ```
    pub fn replicas(mut self, n: std::num::NonZeroU32) -> Self {
        self.config.replicas = n;
        self
    }

    /// Whether the backends' answers are read for the usage they report (default: yes):
    /// prompt tokens and reused tokens (OpenAI `usage`, Anthropic's cache counts, llama.cpp's
    /// `timings`), from a JSON answer or an SSE stream, as its bytes pass unchanged. What they
    /// teach goes into [`BackendStatus`](crate::BackendStatus), the cache model (a backend
    /// that reused far less than predicted no longer holds what it evicted) and
    /// [`wait_versus_move`](Self::wait_versus_move). An answer that is not JSON or SSE, is
    /// compressed, or reports nothing costs one header check. An answer other than a success
    /// (2xx) did not take its prompt: what it reports teaches nothing.
    ///
    /// Each answer read ends with a `tracing` event at `debug` level, `answer read`, that
    /// says it per request: `backend`, `outcome`, `success`, then as the answer gave them
    /// `prompt_tokens`, `reused_tokens` and `prompt_ms`, and the router's `first_byte_ms`
    /// and `ms` (of a success, from its dispatch), and `waited_ms` when it waited for a slot
    /// before that. For one line a turn, whether it found its prefix warm:
    ///
    /// ```text
    /// DEBUG tower_affinity::body: answer read backend=gpu-0 outcome=home-hit success=true prompt_tokens=31200 reused_tokens=30950 prompt_ms=410 first_byte_ms=460 ms=5120
    /// ```
    ///
    /// So that answers can be read, a request that names an `Accept-Encoding` goes to its
    /// backend with `Accept-Encoding: identity` (a backend behind a compressing proxy would
    /// otherwise answer gzip: no usage, and no stored response's id for
    /// [`BodyKeyLayer`](crate::key::BodyKeyLayer) to pin the next turn by). A `GET` or `HEAD`,
    /// which sends no prompt, keeps the client's: llama-server serves its web UI only
    /// gzip-compressed, and answers `415` to a request that does not accept gzip. Compress towards
    /// clients in your own stack (tower-http's `CompressionLayer`) if you want to. Turned off,
    /// the header goes as the client sent it.
    pub fn observe_usage(mut self, enabled: bool) -> Self {
        self.config.observe_usage = enabled;
        self
    }

    /// Draws the random number each placement gets
    /// (the `random` of its [`PlacementRequest`](crate::placement::PlacementRequest): a keyless
    /// request without a prompt samples two backends with it) from a fixed sequence that
    /// starts at `seed`, so that a run with the same requests in the same order places them
    /// the same way: for simulations and tests. Unset (the default), each thread draws from a
    /// generator of its own, seeded at random; a seeded service shares one counter between
    /// its threads, so leave it unset in a proxy.
    ///
    /// ```
    /// use tower_affinity::SessionAffinityLayer;
    ///
    /// let layer = SessionAffinityLayer::new().random_seed(1);
    /// # let _ = layer;
    /// ```
    pub fn random_seed(mut self, seed: u64) -> Self {
        self.config.random_seed = Some(seed);
        self
    }

    /// Adds `x-affinity-backend`, `x-affinity-node` and `x-affinity-outcome` to every
    /// response a backend gave (an [`Error`](crate::Error) has none: no backend answered;
    /// a backend's failure names the backend in [`Error::Backend`](crate::Error::Backend)).
    /// The same facts are in the response's extensions as a
    /// [`Decision`](crate::Decision), unless [`decision_extension`](Self::decision_extension)
    /// is off. A backend or node id that is not a valid header value (a line break in it, say)
    /// leaves its header off, with a warning when the backend is discovered.
    ///
    /// The outcome tells a client something of what the caches hold (a keyless `prefix-hit`:
    /// some backend held this prompt's opening). Where clients must not learn of each other's
    /// prompts (tenants sharing a fleet), keep these headers off their answers.
    pub fn decision_headers(mut self, enabled: bool) -> Self {
        self.config.decision_headers = enabled;
        self
    }

    /// Adds `labels` to every series this balancer writes through the
    /// [`metrics`](crate::metrics) facade, after the series' own (`outcome`, or `backend` and
    /// `node`). The recorder is the process's: give each balancer in a process labels of its
    /// own (a fleet for each model, say), or their fleet-wide series add up.
    ///
    /// A label is left out, with a warning, when a scrape would refuse it or it would clash:
    /// one the series use themselves (`backend`, `node`, `outcome`), one an exporter adds to
    /// a histogram's or a summary's series (`le`, `quantile`), an empty name or one starting
    /// with `__` (Prometheus's own), an empty value (Prometheus reads it as no label), or a
    /// name given twice. Prometheus's exporter turns a character other than `[a-zA-Z0-9_]`
    /// in a name into `_`, so names are compared as it writes them: `model.name` after
    /// `model-name` is given twice, and `-_x` starts with `__`. Called
    /// again, the later labels replace the earlier. Without labels (the default) a series is
    /// written as before, at no cost; with them, each event builds its series' labels, an
    /// allocation a placement.
    ///
    /// ```
    /// use tower_affinity::SessionAffinityLayer;
    ///
    /// let layer = SessionAffinityLayer::new().metrics_labels([("fleet", "qwen3-coder")]);
    /// # let _ = layer;
    /// ```
    #[cfg(feature = "metrics")]
    #[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
    pub fn metrics_labels<I, L, V>(mut self, labels: I) -> Self
    where
        I: IntoIterator<Item = (L, V)>,
        L: Into<String>,
        V: Into<String>,
    {
        let mut kept: Vec<(String, String)> = Vec::new();
        for (label, value) in labels {
            let (label, value) = (label.into(), value.into());
            // Written alike by an exporter, one label there (see `exported_label`).
            let exported = crate::metrics::exported_label(&label);
            let given = (kept.iter()).any(|(k, _)| crate::metrics::exported_label(k) == exported);
            match crate::metrics::refused_label(&label, &value, given) {
                Some(why) => tracing::warn!(label, "metrics label left out: {why}"),
                None => kept.push((label, value)),
            }
        }
        self.config.metrics_labels = kept;
        self
    }
}

impl<D, K, P, S> Layer<D> for SessionAffinityLayer<K, P>
where
    D: Discover<Key = BackendId, Service = Backend<S>> + Send + 'static,
    D::Error: Into<BoxError>,
    S: Clone,
    K: Clone,
    P: Clone,
{
    type Service = SessionAffinity<D, K, P>;

    fn layer(&self, discover: D) -> Self::Service {
        SessionAffinity::new(
            discover,
            self.key.clone(),
            self.placement.clone(),
            self.config.clone(),
        )
    }
}

#[cfg(all(test, feature = "metrics"))]
mod tests {
    #[test]
    fn labels_an_exporter_writes_alike_are_given_twice() {
        let layer = super::SessionAffinityLayer::new().metrics_labels([
            ("model_name", "a"),
            ("model.name", "b"),
            ("model-name", "c"),
            ("-_x", "d"),
        ]);
        let names: Vec<&str> = (layer.config.metrics_labels.iter())
            .map(|(k, _)| k.as_str())
            .collect();
        assert_eq!(names, ["model_name"]);
    }
}
