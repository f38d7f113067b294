//! [`ProbeStatus`]: what the probe knows of one backend.

use std::num::{NonZeroU32, NonZeroU64};

use crate::BackendId;

/// What the probe knows of one backend, from [`Prober::status`](super::Prober::status).
///
/// ```
/// use tower_affinity::health::Prober;
///
/// /// One line for each backend the probe has down, and why.
/// fn down<S>(prober: &Prober<S>) -> Vec<String> {
///     let mut lines: Vec<String> = (prober.statuses().into_iter())
///         .filter(|s| !s.up)
///         .map(|s| {
///             let why = if s.loading { "loading" } else { "failing" };
///             let error = s.last_error.unwrap_or_default();
///             format!("{}: {why} after {} probes ({error})", s.id, s.probes)
///         })
///         .collect();
///     lines.sort();
///     lines
/// }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ProbeStatus {
    /// The backend.
    pub id: BackendId,
    /// Whether the probe has it up. A backend starts up, as the balancer has it.
    pub up: bool,
    /// Whether its last `/health` answered 503: llama-server loading its model, SGLang
    /// starting, shutting down or stuck, vLLM with its engine dead.
    pub loading: bool,
    /// Probes in a row that failed (503 counts as one).
    pub failures: u32,
    /// Probes in a row that found it ready.
    pub successes: u32,
    /// Probes of it whose answer (or failure) was recorded: not one dropped because the
    /// backend was announced again at another address while it was out.
    pub probes: u64,
    /// Times the probe marked it down or up.
    pub transitions: u64,
    /// Why its last failed probe failed.
    pub last_error: Option<String>,
    /// Its slot count as `/slots` (or a llama-server's `/props`) last gave it, if read.
    pub slots: Option<NonZeroU32>,
    /// Slots that `/slots` showed processing a request (`is_processing: true`, or in
    /// llama-server's releases of 2024 a `state` other than 0), if the last
    /// probe read them: every probe does with [`busy_slots`](super::HealthProbe::busy_slots);
    /// otherwise a llama-server's slots are read from its `/props` once its `/slots` was (or
    /// answered 501, as one run with `--no-slots` does), and this is `None`.
    pub busy_slots: Option<u32>,
    /// The most tokens of context one request can take, as `/slots` (or a llama-server's
    /// `/props`) last gave it (the slots' `n_ctx`), or for a backend without slots
    /// `/v1/models` (vLLM's and SGLang's `max_model_len`), if read: the backend's
    /// [request context](crate::Backend::request_context_tokens) unless it was announced
    /// with its own.
    pub request_context: Option<NonZeroU64>,
    /// Why its last `/slots` could not be read (vLLM and SGLang answer 404; a llama-server
    /// run with `--no-slots` answers 501, and is read from its `/props` then, unless that
    /// does not give the slots either), while it cannot; `None` once the slots are read, or
    /// while it has never been asked.
    pub slots_error: Option<String>,
    /// Why its last `/v1/models` could not be read for the request context (a vLLM or SGLang
    /// run with `--api-key` answers 401 without it), while it cannot; `None` once it is read,
    /// or while it has never been asked.
    pub models_error: Option<String>,
    /// `/slots` answered that the backend has none (404, or 501 with a `/props` that answered
    /// without them): it is not asked again for its request context alone, until the backend
    /// fails or loads (a restart, perhaps as another server).
    pub(crate) no_slots: bool,
    /// Whether `/health` has ever answered ready: until it has, one failure takes the
    /// backend down and one success brings it up (there is no record to debounce).
    pub(crate) ready_once: bool,
}

impl ProbeStatus {
    pub(crate) fn new(id: BackendId) -> Self {
        ProbeStatus {
            id,
            up: true,
            loading: false,
            failures: 0,
            successes: 0,
            probes: 0,
            transitions: 0,
            last_error: None,
            slots: None,
            busy_slots: None,
            request_context: None,
            slots_error: None,
            models_error: None,
            no_slots: false,
            ready_once: false,
        }
    }
}
