//! Decisions, their outcomes, and the counters behind [`SessionAffinity::stats`].
//!
//! [`SessionAffinity::stats`]: crate::SessionAffinity::stats

use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use http::HeaderName;

use crate::{BackendId, NodeId};

/// How a request was placed, relative to its session's home.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Outcome {
    /// Served by its home backend: the prompt cache is where the last turn left it.
    HomeHit,
    /// Served by another backend on the home's node: under
    /// [`NodeThenBackend`](crate::placement::NodeThenBackend), the home was full or down
    /// (a policy of your own may have other reasons; the outcome says where the request
    /// went, not why). For a request without a key, the home is the backend holding its own
    /// conversation's prefix (see [`PrefixHit`](Self::PrefixHit)).
    SameNodeSpill,
    /// Served on another node than the home's: under `NodeThenBackend`, the home's node was
    /// full or down. For a request without a key, as for
    /// [`SameNodeSpill`](Self::SameNodeSpill).
    CrossNodeSpill,
    /// A session the table did not know (first turn, or forgotten).
    NewSession,
    /// The request had no session key, and no backend held a prefix of its own conversation
    /// (see [`PrefixHit`](Self::PrefixHit)): placed as a new conversation (where a prefix many
    /// conversations share is held, else by load). A token count (Anthropic's
    /// `/v1/messages/count_tokens`, OpenAI's `/v1/responses/input_tokens`, `/tokenize`,
    /// `/detokenize`, `/apply-template`), which reads no prompt into a cache, is placed as
    /// one without a prompt, whatever its key: it neither moves its session's home nor waits.
    Keyless,
    /// The home backend had been removed; the session was placed again.
    Replaced,
    /// The cache model said the home had evicted the session (a *cold home*); it was placed
    /// like a new session, preferring the backend holding the longest prefix of its prompt.
    ColdHome,
    /// The session's prompt no longer extends its last one: the client rewrote its history
    /// and no cache holds it, so no backend is better than its home; it went home if there
    /// was room.
    Compaction,
    /// Placed where the cache model says the longest prefix of its own conversation is (a
    /// turn sent again whole, where it was sent: see
    /// [`FleetView::longest_prefix`](crate::placement::FleetView::longest_prefix)): a request
    /// without a key, or one whose prompt does not extend its key's last one but another
    /// conversation's under the same key (a sub-agent's, or the main conversation's after a
    /// side request).
    PrefixHit,
}

impl Outcome {
    /// The outcome as it appears in the `x-affinity-outcome` header and in metrics.
    pub const fn as_str(self) -> &'static str {
        match self {
            Outcome::HomeHit => "home-hit",
            Outcome::SameNodeSpill => "same-node-spill",
            Outcome::CrossNodeSpill => "cross-node-spill",
            Outcome::NewSession => "new-session",
            Outcome::Keyless => "keyless",
            Outcome::Replaced => "replaced",
            Outcome::ColdHome => "cold-home",
            Outcome::Compaction => "compaction",
            Outcome::PrefixHit => "prefix-hit",
        }
    }

    /// Every outcome, in a fixed order.
    pub const ALL: &'static [Outcome] = &[
        Outcome::HomeHit,
        Outcome::SameNodeSpill,
        Outcome::CrossNodeSpill,
        Outcome::NewSession,
        Outcome::Keyless,
        Outcome::Replaced,
        Outcome::ColdHome,
        Outcome::Compaction,
        Outcome::PrefixHit,
    ];
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Reads an outcome as [`Outcome::as_str`] writes it: what a client finds in the
/// `x-affinity-outcome` header.
///
/// ```
/// use tower_affinity::Outcome;
///
/// assert_eq!("cold-home".parse::<Outcome>(), Ok(Outcome::ColdHome));
/// assert!("warm".parse::<Outcome>().is_err());
/// for &o in Outcome::ALL {
///     assert_eq!(o.as_str().parse(), Ok(o));
/// }
/// ```
impl std::str::FromStr for Outcome {
    type Err = ParseOutcomeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Outcome::ALL
            .iter()
            .copied()
            .find(|o| o.as_str() == s)
            .ok_or(ParseOutcomeError { _priv: () })
    }
}

/// A string that names no [`Outcome`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParseOutcomeError {
    _priv: (),
}

impl fmt::Display for ParseOutcomeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("not an outcome of placement (home-hit, cold-home, ...)")
    }
}

impl std::error::Error for ParseOutcomeError {}

/// Where a request went and why. Every answer of a backend carries one in its extensions, or,
/// with [`decision_extension(false)`](crate::SessionAffinityLayer::decision_extension), in its
/// body ([`ResponseBody::decision`](crate::ResponseBody::decision)). A response made for an
/// [`Error`](crate::Error) ([`Error::into_response`](crate::Error::into_response), as
/// [`ErrorToResponse`](crate::ErrorToResponse) and [`Error::response_for`](crate::Error::response_for)
/// make them) carries none: the backend that failed, if one did, is in its extensions as a
/// [`BackendId`](crate::BackendId).
///
/// ```
/// # async fn doc(res: http::Response<()>) {
/// use tower_affinity::Decision;
///
/// if let Some(d) = res.extensions().get::<Decision>() {
///     println!("{} on {}: {}", d.backend, d.node, d.outcome);
/// }
/// # }
/// ```
///
/// ```
/// use tower_affinity::{BackendId, Decision, Error};
///
/// let res = Error::backend("gpu-0", "connection refused").into_response::<String>();
/// assert!(res.extensions().get::<Decision>().is_none());
/// assert_eq!(res.extensions().get::<BackendId>().unwrap().as_str(), "gpu-0");
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Decision {
    /// The backend that served the request.
    pub backend: BackendId,
    /// Its node.
    pub node: NodeId,
    /// How the request was placed.
    pub outcome: Outcome,
    /// How long the request waited for a slot, if it waited.
    pub waited: Option<Duration>,
    /// Whether it was sent beyond the backend's slots: under [`Overflow::Overcommit`], or, under
    /// any overflow, a token count that found every slot taken (it never waits: see
    /// [`Outcome::Keyless`]).
    ///
    /// [`Overflow::Overcommit`]: crate::Overflow::Overcommit
    pub overcommitted: bool,
}

impl Decision {
    /// The response header naming the backend that answered, with
    /// [`decision_headers`](crate::SessionAffinityLayer::decision_headers): `x-affinity-backend`.
    ///
    /// ```
    /// use tower_affinity::{Decision, Outcome};
    ///
    /// // What a client of the proxy reads.
    /// let res = http::Response::builder()
    ///     .header("x-affinity-outcome", "home-hit")
    ///     .body(())
    ///     .unwrap();
    /// let outcome = res.headers().get(Decision::OUTCOME_HEADER).unwrap();
    /// assert_eq!(outcome, Outcome::HomeHit.as_str());
    /// ```
    pub const BACKEND_HEADER: HeaderName = HeaderName::from_static("x-affinity-backend");
    /// The response header naming the backend's node: `x-affinity-node`.
    pub const NODE_HEADER: HeaderName = HeaderName::from_static("x-affinity-node");
    /// The response header with the [`Outcome`], as [`Outcome::as_str`] spells it:
    /// `x-affinity-outcome`.
    pub const OUTCOME_HEADER: HeaderName = HeaderName::from_static("x-affinity-outcome");
}

/// A mark in a backend's response: the backend service sent the request a second time, its
/// first connection having closed before any answer.
/// [`HttpBackend`](crate::client::HttpBackend) marks its answers so with
/// [`resend_on_close`](crate::client::Builder::resend_on_close); a backend service of your
/// own that sends again may do the same. The balancer counts each for the backend that
/// answered ([`BackendStatus::sent_again`](crate::BackendStatus::sent_again), and with the
/// `metrics` feature the `tower_affinity_backend_sent_again_total` series), and leaves the
/// mark in the response.
///
/// ```
/// use tower_affinity::SentAgain;
///
/// let mut res = http::Response::new(());
/// res.extensions_mut().insert(SentAgain);
/// assert!(res.extensions().get::<SentAgain>().is_some());
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SentAgain;

/// A snapshot of the service's counters. Counters only grow; gauges are read at the snapshot.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Requests served by their home backend.
    pub home_hits: u64,
    /// Requests spilled to another backend on their home's node (without a key: on the node
    /// of the backend holding their conversation's own prefix).
    pub same_node_spills: u64,
    /// Requests spilled to another node.
    pub cross_node_spills: u64,
    /// Requests of sessions the table did not know.
    pub new_sessions: u64,
    /// Requests without a key for which no backend held their own conversation's prefix:
    /// placed as new conversations.
    pub keyless: u64,
    /// Requests whose home had been removed.
    pub replaced: u64,
    /// Requests whose home the cache model said had evicted their session.
    pub cold_homes: u64,
    /// Requests whose prompt no longer extended their session's last one.
    pub compactions: u64,
    /// Requests placed where their own conversation's prefix is held: without a key, or with
    /// one whose prompt continues another conversation under the key than its last turn's
    /// (see [`Outcome::PrefixHit`]).
    pub prefix_hits: u64,
    /// Requests that waited for a slot before being placed (also counted by outcome).
    pub waited: u64,
    /// Requests sent beyond a backend's slots (also counted by outcome).
    pub overcommitted: u64,
    /// Requests refused: no free slot and no room or time to wait.
    pub rejected: u64,
    /// Requests refused because no backend was up: the fleet empty, or every backend down.
    pub no_backends: u64,
    /// Requests their caller gave up on (dropped the response future) while they waited for
    /// a slot, or for the shared store's answer: neither placed nor refused. With
    /// [`rejected`](Self::rejected), [`no_backends`](Self::no_backends) and
    /// [`refusals_answered`](Self::refusals_answered), they and the outcomes add up to the
    /// requests the service was called with (a request [`RetryOnce`](crate::RetryOnce)
    /// retries is called twice).
    pub abandoned: u64,
    /// Requests sent again after a backend refused their prompt as too long for its context
    /// (a [`ContextRefusal`](crate::ContextRefusal) among their extensions, as
    /// [`RetryOnce`](crate::RetryOnce) puts it): the prompt chain's estimate of its tokens
    /// fell short there. Each is also placed (and counted by outcome), answered with the
    /// refusal ([`refusals_answered`](Self::refusals_answered)), or refused or abandoned as
    /// any request.
    pub refusals_retried: u64,
    /// Of them, those answered with the refusal: no backend up but the one that refused may
    /// take the prompt, or the request continues a response stored there. Neither placed nor
    /// refused.
    pub refusals_answered: u64,
    /// Requests whose backend failed, or answered 503 Service Unavailable (each is passed over
    /// for the failure cooldown).
    pub backend_errors: u64,
    /// Errors yielded by the discovery stream (the fleet stays as it was).
    pub discovery_errors: u64,
    /// Answers that reported their usage.
    pub usage_reports: u64,
    /// Prompt tokens of those answers that said how many they reused.
    pub prompt_tokens: u64,
    /// Of them, tokens the backends said they reused from their caches: `reused_tokens /
    /// prompt_tokens` is the reuse placement achieved.
    pub reused_tokens: u64,
    /// Prompt tokens of the answers that did not say how many they reused (a backend that
    /// does not report it, such as vLLM without `--enable-prompt-tokens-details`, SGLang
    /// without `--enable-cache-report`, or vLLM's Anthropic endpoint): counted apart, so that they do not read as reusing nothing.
    pub unreported_prompt_tokens: u64,
    /// Answers that reused less than half the share of their prompt the cache model
    /// predicted, where it predicted at least a quarter (each corrected it).
    pub corrections: u64,
    /// Gauge: sessions in the table. An entry idle past the timeout reads as absent at once
    /// but is counted here until a new key takes its place (the table never sweeps), so
    /// after a quiet spell this overstates the sessions alive.
    pub sessions: usize,
    /// Gauge: bytes held by the session table.
    pub session_table_bytes: usize,
    /// Gauge: bytes held by the cache model, over every live backend. The models of the 64
    /// backends removed last are kept besides, for their return, and not counted here; older
    /// removed backends' are dropped.
    pub cache_model_bytes: usize,
    /// Gauge: requests in flight over the fleet.
    pub in_flight: usize,
    /// Gauge: requests waiting for a slot.
    pub waiting: usize,
    /// What the answers reported, by outcome: see [`reuse`](Self::reuse).
    pub(crate) reuse: ReuseByOutcome,
}

/// What the answers reported, by the outcome of their requests, indexed by `Outcome as
/// usize`. Its `Debug` names each outcome, so that `Stats`'s reads as what it counts rather
/// than as nine figures in an order of the crate's own.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct ReuseByOutcome(pub(crate) [Reuse; Outcome::ALL.len()]);

impl fmt::Debug for ReuseByOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let by_name = Outcome::ALL
            .iter()
            .map(|&o| (o.as_str(), &self.0[o as usize]));
        f.debug_map().entries(by_name).finish()
    }
}

/// What the answers of the requests placed one way reported: their prompt tokens, and how
/// many of them their backends reused from their caches. Only answers that said how many they
/// reused count (as in [`Stats::prompt_tokens`]).
///
/// Read by [`Stats::reuse`]. A home hit's reuse near its [`share`](Self::share) of 1 and a
/// cold home's near 0 say the cache model predicts what the backends hold; a prefix hit's says
/// how well requests without a key find their conversations.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Reuse {
    /// Prompt tokens of the answers.
    pub prompt_tokens: u64,
    /// Of them, tokens reused from the backends' caches.
    pub reused_tokens: u64,
}

impl Reuse {
    /// `reused_tokens / prompt_tokens`; `None` before any prompt token.
    pub fn share(&self) -> Option<f64> {
        (self.prompt_tokens > 0).then(|| self.reused_tokens as f64 / self.prompt_tokens as f64)
    }
}

impl Stats {
    /// Requests placed on a backend, by any outcome.
    pub fn placed(&self) -> u64 {
        self.home_hits
            + self.same_node_spills
            + self.cross_node_spills
            + self.new_sessions
            + self.keyless
            + self.replaced
            + self.cold_homes
            + self.compactions
            + self.prefix_hits
    }

    /// What the answers of the requests placed with `outcome` reported: their prompt
    /// tokens, and how many their backends reused. Over every outcome they add up to
    /// [`prompt_tokens`](Self::prompt_tokens) and [`reused_tokens`](Self::reused_tokens).
    ///
    /// ```
    /// # fn doc(stats: tower_affinity::Stats) {
    /// use tower_affinity::Outcome;
    ///
    /// for &outcome in Outcome::ALL {
    ///     if let Some(share) = stats.reuse(outcome).share() {
    ///         println!("{outcome}: {:.0}% of prompt tokens reused", share * 100.0);
    ///     }
    /// }
    /// # }
    /// ```
    pub fn reuse(&self, outcome: Outcome) -> Reuse {
        self.reuse.0[outcome as usize]
    }

    /// The count for one outcome.
    pub fn outcome(&self, outcome: Outcome) -> u64 {
        match outcome {
            Outcome::HomeHit => self.home_hits,
            Outcome::SameNodeSpill => self.same_node_spills,
            Outcome::CrossNodeSpill => self.cross_node_spills,
            Outcome::NewSession => self.new_sessions,
            Outcome::Keyless => self.keyless,
            Outcome::Replaced => self.replaced,
            Outcome::ColdHome => self.cold_homes,
            Outcome::Compaction => self.compactions,
            Outcome::PrefixHit => self.prefix_hits,
        }
    }
}

/// Each thread bumps the per-request counters of its own stripe, so that threads placing
/// requests at once do not write the same cache line; a snapshot sums the stripes.
const STRIPES: usize = 16;

/// The counters every placement bumps, on a cache line of their own (128 bytes: two lines on
/// CPUs that fetch lines in adjacent pairs).
#[derive(Debug, Default)]
#[repr(align(128))]
struct Stripe {
    outcomes: [AtomicU64; Outcome::ALL.len()],
    waited: AtomicU64,
    overcommitted: AtomicU64,
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    stripes: [Stripe; STRIPES],
    pub(crate) rejected: AtomicU64,
    pub(crate) no_backends: AtomicU64,
    pub(crate) abandoned: AtomicU64,
    pub(crate) refusals_retried: AtomicU64,
    pub(crate) refusals_answered: AtomicU64,
    pub(crate) backend_errors: AtomicU64,
    pub(crate) discovery_errors: AtomicU64,
    pub(crate) usage_reports: AtomicU64,
    pub(crate) unreported_prompt_tokens: AtomicU64,
    pub(crate) corrections: AtomicU64,
    /// Reported prompt and reused tokens, by the outcome of their requests.
    reuse: [[AtomicU64; 2]; Outcome::ALL.len()],
    /// The labels the balancer adds to the `metrics` facade's series.
    pub(crate) labels: crate::metrics::Labels,
}

pub(crate) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// This thread's stripe: threads take stripes in turn as they first place a request.
fn stripe() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static STRIPE: usize = NEXT.fetch_add(1, Ordering::Relaxed) % STRIPES;
    }
    STRIPE.with(|s| *s)
}

impl Counters {
    pub(crate) fn count_rejected(&self) {
        bump(&self.rejected);
        crate::metrics::event(&self.labels, "tower_affinity_rejected_total");
    }

    pub(crate) fn count_no_backends(&self) {
        bump(&self.no_backends);
        crate::metrics::event(&self.labels, "tower_affinity_no_backends_total");
    }

    pub(crate) fn count_abandoned(&self) {
        bump(&self.abandoned);
        crate::metrics::event(&self.labels, "tower_affinity_abandoned_total");
    }

    /// A request a backend refused as too long came back (`answered`: false), or was
    /// answered with that refusal. Out of line: it is rare, and the placement it is called
    /// from stays as small as it was.
    #[cold]
    #[inline(never)]
    pub(crate) fn count_refusal(&self, answered: bool) {
        let (counter, name) = if answered {
            (
                &self.refusals_answered,
                "tower_affinity_refusals_answered_total",
            )
        } else {
            (
                &self.refusals_retried,
                "tower_affinity_refusals_retried_total",
            )
        };
        bump(counter);
        crate::metrics::event(&self.labels, name);
    }

    pub(crate) fn count_discovery_error(&self) {
        bump(&self.discovery_errors);
        crate::metrics::event(&self.labels, "tower_affinity_discovery_errors_total");
    }

    /// An answer of a request placed with `outcome` reported `prompt` tokens and said it
    /// reused `reused` of them.
    pub(crate) fn count_reuse(&self, outcome: Outcome, prompt: u64, reused: u64) {
        let [p, r] = &self.reuse[outcome as usize];
        p.fetch_add(prompt, Ordering::Relaxed);
        r.fetch_add(reused, Ordering::Relaxed);
        crate::metrics::reuse(&self.labels, outcome, prompt, reused);
    }

    pub(crate) fn record(&self, d: &Decision) {
        crate::metrics::decision(&self.labels, d);
        let s = &self.stripes[stripe()];
        bump(&s.outcomes[d.outcome as usize]);
        if d.waited.is_some() {
            bump(&s.waited);
        }
        if d.overcommitted {
            bump(&s.overcommitted);
        }
    }

    pub(crate) fn snapshot(&self) -> Stats {
        let sum = |f: &dyn Fn(&Stripe) -> &AtomicU64| -> u64 {
            self.stripes
                .iter()
                .map(|s| f(s).load(Ordering::Relaxed))
                .sum()
        };
        let o = |x: Outcome| sum(&|s| &s.outcomes[x as usize]);
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        // The fleet's figures are the outcomes' added up.
        let reuse: [Reuse; Outcome::ALL.len()] = std::array::from_fn(|i| {
            let [p, r] = &self.reuse[i];
            Reuse {
                prompt_tokens: l(p),
                reused_tokens: l(r),
            }
        });
        Stats {
            home_hits: o(Outcome::HomeHit),
            same_node_spills: o(Outcome::SameNodeSpill),
            cross_node_spills: o(Outcome::CrossNodeSpill),
            new_sessions: o(Outcome::NewSession),
            keyless: o(Outcome::Keyless),
            replaced: o(Outcome::Replaced),
            cold_homes: o(Outcome::ColdHome),
            compactions: o(Outcome::Compaction),
            prefix_hits: o(Outcome::PrefixHit),
            waited: sum(&|s| &s.waited),
            overcommitted: sum(&|s| &s.overcommitted),
            rejected: l(&self.rejected),
            no_backends: l(&self.no_backends),
            abandoned: l(&self.abandoned),
            refusals_retried: l(&self.refusals_retried),
            refusals_answered: l(&self.refusals_answered),
            backend_errors: l(&self.backend_errors),
            discovery_errors: l(&self.discovery_errors),
            usage_reports: l(&self.usage_reports),
            unreported_prompt_tokens: l(&self.unreported_prompt_tokens),
            corrections: l(&self.corrections),
            prompt_tokens: reuse.iter().map(|r| r.prompt_tokens).sum(),
            reused_tokens: reuse.iter().map(|r| r.reused_tokens).sum(),
            reuse: ReuseByOutcome(reuse),
            ..Stats::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_debug_names_the_outcome_of_each_reuse_figure() {
        let counters = Counters::default();
        counters.count_reuse(Outcome::ColdHome, 1_000, 40);
        let shown = format!("{:?}", counters.snapshot());
        assert!(
            shown.contains(r#""cold-home": Reuse { prompt_tokens: 1000, reused_tokens: 40 }"#),
            "{shown}"
        );
        assert_eq!(
            shown.matches("Reuse {").count(),
            Outcome::ALL.len(),
            "{shown}"
        );
    }
}
