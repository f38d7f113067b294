//! [`HealthProbe`]: the probe's settings, and the adapter it makes of a discovery stream.

use std::time::Duration;

use futures_core::TryStream;
use http::{HeaderMap, HeaderName, HeaderValue};
use tower::discover::Change;

use super::discover::Probed;
use super::prober::Prober;
use super::target::ProbeTarget;
use crate::{Backend, BackendId};

/// Health and slot probes for the backends of a discovery stream.
///
/// [`discover`](Self::discover) wraps any discovery stream (static, channel-fed, DNS) and
/// gives two halves:
///
/// - the wrapped stream, [`Probed`], for [`SessionAffinityLayer::layer`]: it yields the
///   inner stream's changes as they come, and registers each backend with the probe;
/// - its [`Prober`], which probes every backend each [`interval`](Self::interval) once
///   [spawned](Prober::spawn) with the balancer (or a round at a time with
///   [`Prober::round`]), and reports through the balancer's health marks
///   ([`SessionAffinity::mark_down`] and [`mark_up`]).
///
/// Each probe is `GET /health`, in the HTTP version the backend is spoken to in (HTTP/2 with
/// prior knowledge where [`ProbeTarget::http2_prior_knowledge`] says so, else HTTP/1.1):
///
/// - 200: ready. A backend that is down comes up after
///   [`success_threshold`](Self::success_threshold) of these in a row (after its first, if it
///   has never been ready).
/// - 503: loading (llama-server answers so while it loads its model). The backend goes down
///   at once and stays down until ready.
/// - anything else, or no answer within [`timeout`](Self::timeout): a failure. The backend
///   goes down after [`failure_threshold`](Self::failure_threshold) in a row; one that has
///   never been ready (unreachable when the proxy starts), at its first.
///
/// What the servers answer there:
///
/// - llama-server answers at once: 503 with a JSON error (`"Loading model"`) while it loads
///   its model, then 200 with `{"status":"ok"}`.
/// - vLLM serves HTTP only once its model is loaded (before, a connection is refused or not
///   answered: a failure), then answers 200 with no body, and 503 once its engine has died.
/// - SGLang answers 503 while it starts and while it shuts down. Otherwise its `/health` (in
///   recent releases the same as `/health_generate`) has the model generate one token and
///   answers 200 once anything comes out of the scheduler, looking once a second: it takes
///   a second at least, longer while the scheduler reads a long prompt with nothing else to
///   give out, and answers 503 after 20 s of nothing (`SGLANG_HEALTH_CHECK_TIMEOUT`). A
///   [`timeout`](Self::timeout) of a second or less fails every probe of an SGLang backend,
///   and one of a few seconds (the default 2 s) takes a backend that is busy reading a long
///   prompt down for a while; for SGLang give one above its own 20 s, so that its 503 says
///   when it is stuck:
///
/// ```
/// use std::time::Duration;
/// use tower_affinity::health::HealthProbe;
///
/// // SGLang backends: wait longer than SGLang's own health check does.
/// let probe = HealthProbe::new().timeout(Duration::from_secs(25));
/// # drop(probe);
/// ```
///
/// For a backend whose slot count was not given ([`Backend::slots_given`]), a ready backend
/// is also asked `GET /slots` (llama-server's: a JSON array, one object per slot): its length
/// becomes the backend's slot count, announced again through the stream whenever it changes
/// (an update that keeps the backend's sessions). The slots processing a request
/// (`is_processing: true`; in llama-server's releases of 2024, which do not give it, a
/// `state` other than 0) are recorded too ([`ProbeStatus::busy_slots`]). Once its `/slots`
/// was read, a llama-server is asked `GET /props` in its place, which gives the slot count
/// (`total_slots`) and a slot's context (`default_generation_settings.n_ctx`) but not the busy
/// slots: `/slots` is a request to its model, which wakes a llama-server run with
/// `--sleep-idle-seconds` (its model reloaded) and, asked at every probe, would keep it from
/// ever sleeping; `/props` does neither. `/slots` is asked again when `/props` does not give
/// them. With [`busy_slots`](Self::busy_slots) every backend is asked `/slots` at every probe,
/// for its busy slots. A llama-server run with `--no-slots` answers `/slots` with 501: it is
/// asked `/props` then, and from then on as one whose `/slots` was read (its busy slots are
/// never known). A `/slots` that cannot be read otherwise (vLLM and SGLang have none, and
/// answer 404; a 501 whose `/props` does not give the slots either) leaves the count as it
/// was, one slot until one is read, and does not take the backend down: the reason is in
/// [`ProbeStatus::slots_error`], and a `warn` line says so once, while the count is still
/// unknown. Give such backends their count with [`Backend::slots`](crate::Backend::slots).
///
/// `/slots` also says how many tokens of context each slot has (`n_ctx`: llama-server's `-c`
/// divided by `-np`, or all of it with `--kv-unified`): the most one request can take there.
/// For a backend that does not give its own
/// ([`Backend::request_context_given`](crate::Backend::request_context_given)), it becomes its
/// [request context](crate::Backend::request_context_tokens), announced as a slot count is
/// (`/props` gives it too); a backend whose slot count is given is asked `/slots` for it too,
/// until `/slots` answers that it has none (404, or 501 with a `/props` that answers without
/// it). Such a backend is asked `GET /v1/models` instead: vLLM and SGLang give each model's
/// `max_model_len` there, past which they refuse a prompt with a 400, and the largest becomes
/// the backend's request context the same way. A `/v1/models` that cannot be read leaves the
/// context as it was: the reason is in [`ProbeStatus::models_error`], and a `warn` line says
/// so once, while the context is still unknown. (llama-server's `/v1/models` is not read: it
/// gives its model's training context, `meta.n_ctx_train`, and in recent releases a slot's,
/// `meta.n_ctx`, which some of its forks give as the whole context of all slots.)
///
/// A backend announced again at another address is another server: the count and context
/// read at the old address stand until the new server first answers ready, and then only
/// what it says does (a server there without `/slots` has its count unknown: one slot).
///
/// Each transition is logged once (`info` up, `warn` down) and counted
/// ([`ProbeStatus::transitions`], [`Prober::transitions`]).
///
/// ```no_run
/// use std::time::Duration;
/// use axum::body::Body;
/// use tower::Layer;
/// use tower_affinity::client::HttpBackend;
/// use tower_affinity::discover::StaticFleet;
/// use tower_affinity::health::HealthProbe;
/// use tower_affinity::{Backend, SessionAffinityLayer};
///
/// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let fleet = StaticFleet::new([
///     ("a1", Backend::new("node-a", HttpBackend::<Body>::new("http://10.0.0.1:8080")?)),
///     ("b1", Backend::new("node-b", HttpBackend::<Body>::new("http://10.0.0.2:8080")?)),
/// ]);
/// let (fleet, prober) = HealthProbe::new()
///     .interval(Duration::from_secs(2))
///     .discover(fleet);
/// let affinity = SessionAffinityLayer::new().layer(fleet);
/// // Runs until dropped.
/// let probes = prober.spawn(affinity.clone());
/// # drop(probes);
/// # Ok(()) }
/// ```
///
/// # Backends run with an API key
///
/// Their `/health` answers without the key, but what the probe reads besides does not, unless
/// it is given the key with [`header`](Self::header) (`Authorization: Bearer KEY` serves all
/// three servers):
///
/// - llama-server with `--api-key` answers `/health` and `/v1/health` (and its web UI's
///   files) without the key (older releases also `/models` and `/v1/models`; 0.94 not),
///   and once its model is loaded every other path, `/slots` and `/props` among them, with a
///   401 (the key goes in `Authorization: Bearer KEY`, or in `X-Api-Key`). Without it the
///   backend counts as one slot, and a `warn` line says so.
/// - vLLM with `--api-key` (or `VLLM_API_KEY`) wants `Authorization: Bearer KEY` on every
///   path that starts with `/v1`, `/v1/models` among them, and on no other (`/health`,
///   `/slots`' 404). Without it the backend's request context is not learned, and a `warn`
///   line says so.
/// - SGLang with `--api-key` wants it on every path but those that start with `/health` or
///   `/metrics` (and in recent releases `/ready`): `/slots` answers 401 rather than 404, and
///   the backend's request context is not learned.
///
/// ```
/// use http::header::AUTHORIZATION;
/// use http::HeaderValue;
/// use tower_affinity::health::HealthProbe;
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// // Backends started with `--api-key sk-backends`.
/// let key = HeaderValue::from_str("Bearer sk-backends")?;
/// let probe = HealthProbe::new().header(AUTHORIZATION, key);
/// // The key is never shown.
/// assert!(!format!("{probe:?}").contains("sk-backends"));
/// # Ok(()) }
/// ```
///
/// [`SessionAffinityLayer::layer`]: tower::Layer::layer
/// [`SessionAffinity::mark_down`]: crate::SessionAffinity::mark_down
/// [`mark_up`]: crate::SessionAffinity::mark_up
/// [`ProbeStatus::busy_slots`]: super::ProbeStatus::busy_slots
/// [`ProbeStatus::slots_error`]: super::ProbeStatus::slots_error
/// [`ProbeStatus::models_error`]: super::ProbeStatus::models_error
/// [`ProbeStatus::transitions`]: super::ProbeStatus::transitions
#[derive(Clone, Debug)]
pub struct HealthProbe {
    pub(crate) interval: Duration,
    pub(crate) timeout: Duration,
    pub(crate) failure_threshold: u32,
    pub(crate) success_threshold: u32,
    pub(crate) learn_slots: bool,
    pub(crate) busy_slots: bool,
    /// Sent with every probe request; each value marked sensitive.
    pub(crate) headers: HeaderMap,
}

impl Default for HealthProbe {
    fn default() -> Self {
        HealthProbe::new()
    }
}

impl HealthProbe {
    /// The defaults: every 2 s, 2 s to answer, down after 3 failures, up after 2 successes,
    /// slot counts learned from `/slots`.
    pub fn new() -> Self {
        HealthProbe {
            interval: Duration::from_secs(2),
            timeout: Duration::from_secs(2),
            failure_threshold: 3,
            success_threshold: 2,
            learn_slots: true,
            busy_slots: false,
            headers: HeaderMap::new(),
        }
    }

    /// How often each backend is probed (at least 1 ms).
    pub fn interval(mut self, interval: Duration) -> Self {
        self.interval = interval.max(Duration::from_millis(1));
        self
    }

    /// The longest a probe of one backend is out, all it asks (`/health`, and `/props`,
    /// `/slots` or `/v1/models` after it) and connecting included (at least 1 ms): what
    /// `/health` leaves of it is what the others have, and one that gets no answer in the
    /// time left fails as if it had none (`/slots` takes nothing down: see [`HealthProbe`]).
    ///
    /// A probe that may not wait gets no answer, so zero is taken as the floor, 1 ms, rather
    /// than failing every probe and taking the whole fleet down. A timeout too long for the
    /// clock to count ahead ([`Duration::MAX`]) waits about 30 years: as good as none. A
    /// timeout shorter than a backend takes to answer still fails its probes: give one that
    /// suits the network, and the servers (SGLang's `/health` takes a second at least, and up
    /// to 20 s while it reads a long prompt: see [`HealthProbe`]).
    ///
    /// [`Prober::spawn`] does not probe a backend again while its probe is out: with a
    /// timeout longer than the [`interval`](Self::interval), a backend that does not answer
    /// is probed about once a timeout, the others each interval still.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_affinity::health::HealthProbe;
    ///
    /// // A slow link to the backends: wait up to 5 s for each probe.
    /// let probe = HealthProbe::new().timeout(Duration::from_secs(5));
    /// # drop(probe);
    /// ```
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// Failed probes in a row that take a backend down (at least 1). A 503 takes it down at
    /// once, and so does any failure of a backend that has never been ready.
    pub fn failure_threshold(mut self, n: u32) -> Self {
        self.failure_threshold = n.max(1);
        self
    }

    /// Ready probes in a row that bring a backend that is down up again (at least 1). One that
    /// has never been ready comes up at its first.
    pub fn success_threshold(mut self, n: u32) -> Self {
        self.success_threshold = n.max(1);
        self
    }

    /// Whether to learn the slot count and the request context of backends given without them
    /// from `/slots`, and `/v1/models` for a backend without slots (on by default).
    pub fn learn_slots(mut self, on: bool) -> Self {
        self.learn_slots = on;
        self
    }

    /// Whether to read `/slots` of every ready backend at every probe, for its busy slots
    /// ([`ProbeStatus::busy_slots`](super::ProbeStatus::busy_slots)), even when its slot count
    /// was given (off by default). Each `/slots` is a request to a llama-server's model: one
    /// run with `--sleep-idle-seconds` then never sleeps (see [`HealthProbe`]).
    pub fn busy_slots(mut self, on: bool) -> Self {
        self.busy_slots = on;
        self
    }

    /// A header to send with every probe request, `/health`, `/slots` and `/v1/models` alike:
    /// the API key of backends that want one (see [`HealthProbe`], "Backends run with an API
    /// key"). Given again, with the same name or another, it is sent too, as
    /// [`http::request::Builder::header`] adds it.
    ///
    /// The value is taken as a secret, whatever its name: it is [marked
    /// sensitive](HeaderValue::set_sensitive), so the probe's `Debug` output (and so the
    /// [`Prober`]'s) shows `Sensitive` in its place, and HTTP/2 sends it as never indexed. The
    /// probe logs no header.
    ///
    /// ```
    /// use http::{HeaderName, HeaderValue};
    /// use tower_affinity::health::HealthProbe;
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// // The key read from the environment, not written in the code.
    /// let key = std::env::var("BACKEND_API_KEY").unwrap_or_else(|_| "sk-test".into());
    /// let probe = HealthProbe::new()
    ///     .header(HeaderName::from_static("x-api-key"), HeaderValue::from_str(&key)?);
    /// assert_eq!(format!("{probe:?}").matches("Sensitive").count(), 1);
    /// # Ok(()) }
    /// ```
    pub fn header(mut self, name: HeaderName, mut value: HeaderValue) -> Self {
        value.set_sensitive(true);
        self.headers.append(name, value);
        self
    }

    /// Wraps the discovery stream `inner`: the stream for the balancer, and the prober that
    /// probes its backends.
    pub fn discover<D, S>(self, inner: D) -> (Probed<D, S>, Prober<S>)
    where
        D: TryStream<Ok = Change<BackendId, Backend<S>>>,
        S: ProbeTarget + Clone + Send + Sync + 'static,
    {
        let prober = Prober::new(self);
        (Probed::new(inner, prober.clone()), prober)
    }
}
