//! Placement: which backends a request should go to, in order of preference.
//!
//! A [`Placement`] is a plain synchronous function over a read-only [`FleetView`], the
//! session's [`Home`] and the request's facts. It offers candidates to a [`Candidates`] sink,
//! best first; the service takes the first one with room (a free slot, and on a backend with a
//! [context limit](crate::Backend::context_tokens) room for the request's prompt) and tells the
//! policy to stop by returning [`ControlFlow::Break`]. A backend whose
//! [request context](crate::Backend::request_context_tokens) is too small for the prompt is
//! passed over while one up with a larger request context takes it. Offering lazily is what
//! keeps a home hit free of any scan: the policy offers the home, the slot is free, and
//! nothing else is computed.
//!
//! The default policy is [`NodeThenBackend`]. [`RoundRobin`], [`LeastLoaded`] and the
//! stateless [`Rendezvous`] are baselines behind the same trait, so a simulator or a benchmark
//! compares like with like.
//!
//! The view also carries the *cache model*: for each backend, the [prompt
//! chain](crate::PromptChain) links it probably still holds, within the cache budget its
//! [`Backend`](crate::Backend) declares, least recently used evicted first. Every dispatched
//! request's chain is recorded on its backend. A policy asks how many of a request's tokens a
//! backend would reuse ([`BackendRef::cached_tokens`]), which backend holds the longest prefix
//! ([`FleetView::longest_prefix`]), and how many conversations a backend homes
//! ([`BackendRef::conversations`]); the service tells it whether a session's home still holds
//! the session ([`HomeCache`]). One mechanism serves requests without a key, homes that evicted
//! their session, and compaction alike.
//!
//! Policies need no runtime to test: a [`Snapshot`] is a fleet built by hand, and
//! [`Snapshot::order`] lists a policy's full preference order.
//!
//! ```
//! use tower_affinity::key::SessionKey;
//! use tower_affinity::placement::{NodeThenBackend, Snapshot};
//!
//! let fleet = Snapshot::new()
//!     .backend("a1", "node-a", 1)
//!     .backend("a2", "node-a", 1)
//!     .backend("b1", "node-b", 1)
//!     .backend("b2", "node-b", 1);
//! let key = SessionKey::from_bytes(b"agent-1");
//! let order = fleet.order(&NodeThenBackend::new(), Some(key), Some("a1"));
//! // Home first, then its node, then the other node.
//! assert_eq!(order[..2], ["a1", "a2"]);
//! ```
//!
//! A policy of your own reads the same view. This one sends a session home while the home
//! still holds it, and otherwise to the node with the most free slots, its freest backend
//! first:
//!
//! ```
//! use tower_affinity::key::SessionKey;
//! use tower_affinity::placement::{
//!     Candidates, FleetView, HomeCache, Placement, PlacementRequest, Snapshot,
//! };
//!
//! #[derive(Clone)]
//! struct HomeElseFreestNode;
//!
//! impl Placement for HomeElseFreestNode {
//!     fn place(&self, fleet: &FleetView<'_>, req: &PlacementRequest<'_>, c: &mut Candidates<'_>) {
//!         if let Some(home) = &req.home {
//!             if let (Some(b), HomeCache::Holds | HomeCache::Unknown) = (home.backend, home.cache) {
//!                 if c.offer(b).is_break() {
//!                     return;
//!                 }
//!             }
//!         }
//!         let free = |n: &tower_affinity::placement::NodeRef<'_>| {
//!             n.backends().map(|b| b.free_slots()).sum::<u32>()
//!         };
//!         let mut nodes: Vec<_> = fleet.nodes().collect();
//!         nodes.sort_by_key(|n| std::cmp::Reverse(free(n)));
//!         for node in nodes {
//!             let mut backends: Vec<_> = node.backends().collect();
//!             backends.sort_by_key(|b| std::cmp::Reverse(b.free_slots()));
//!             for b in backends {
//!                 if c.offer(b).is_break() {
//!                     return;
//!                 }
//!             }
//!         }
//!     }
//! }
//!
//! let fleet = Snapshot::new()
//!     .backend("a1", "node-a", 2)
//!     .backend("b1", "node-b", 4)
//!     .in_flight("a1", 1)
//!     .home_cache(HomeCache::Holds);
//! let key = Some(SessionKey::from_bytes(b"agent-1"));
//! // At home on a1, which holds it: a1, though node-b is freer.
//! assert_eq!(fleet.choose(&HomeElseFreestNode, key, Some("a1")), Some("a1".into()));
//! // The home evicted it: the freest node.
//! let evicted = Snapshot::new()
//!     .backend("a1", "node-a", 2)
//!     .backend("b1", "node-b", 4)
//!     .home_cache(HomeCache::Evicted);
//! assert_eq!(evicted.choose(&HomeElseFreestNode, key, Some("a1")), Some("b1".into()));
//! ```

mod baselines;
mod node_then_backend;
pub(crate) mod rendezvous;
mod snapshot;
mod view;

use std::fmt;
use std::ops::ControlFlow;
use std::sync::Arc;

use crate::fleet::{Load, SlotGuard, Topology};

pub use baselines::{LeastLoaded, Rendezvous, RoundRobin};
pub use node_then_backend::NodeThenBackend;
pub use snapshot::Snapshot;
pub(crate) use view::request_prefix;
pub use view::{BackendRef, FleetView, Home, HomeCache, NodeRef, PlacementRequest, Prefix};

/// A placement policy.
///
/// `place` offers backends to `candidates` in order of preference and stops as soon as an
/// offer returns [`ControlFlow::Break`] (the service took that backend). It must not block or
/// do I/O: it runs on every request, on the request's path.
///
/// A policy that offers no backend up (nothing, or only backends that are down) leaves the
/// request without a backend; the service then answers
/// [`Error::NoBackends`](crate::Error::NoBackends) if the fleet is empty, if every backend is
/// down (a policy may leave those out, [`Candidates::is_down`]), or if the policy
/// [passed over](Candidates::pass_over) every backend that is up (it has none for the
/// request; the error's message then says so, and its `up` counts them), and otherwise
/// treats the request as finding no free slot: under
/// [`Overflow::Wait`](crate::Overflow::Wait) it waits, and looks again when a slot frees or
/// a backend comes back. A backend left out of the offers is not passed over.
/// A policy that panics loses its request, not the slot it may have taken.
///
/// The service has the last word in two cases, whatever the policy: a request that continues
/// a stored response goes to the backend storing it
/// ([`PromptFacts::stored_on`](crate::key::PromptFacts::stored_on)), even one the policy
/// would pass over (turn [`pin_stored_responses`] off where that matters, as between
/// tenants), and a request whose cache is on a full backend may wait for it rather than take
/// the policy's choice ([`wait_versus_move`](crate::SessionAffinityLayer::wait_versus_move)),
/// unless the policy passed that backend over. The [`Outcome`](crate::Outcome) is the
/// service's too: it says where the request went relative to its home, or to the backend
/// holding its own prefix if the policy did not pass that over.
///
/// [`pin_stored_responses`]: crate::key::BodyKeyLayer::pin_stored_responses
///
/// [`SessionAffinityLayer`](crate::SessionAffinityLayer) clones its policy into each service
/// it builds, so a policy is `Clone`; share one that is not through an `Arc`.
pub trait Placement: Send + Sync + 'static {
    /// Offers candidates for `request`, best first.
    fn place(
        &self,
        fleet: &FleetView<'_>,
        request: &PlacementRequest<'_>,
        candidates: &mut Candidates<'_>,
    );
}

impl<P: Placement + ?Sized> Placement for Box<P> {
    fn place(&self, f: &FleetView<'_>, r: &PlacementRequest<'_>, c: &mut Candidates<'_>) {
        (**self).place(f, r, c)
    }
}

impl<P: Placement + ?Sized> Placement for Arc<P> {
    fn place(&self, f: &FleetView<'_>, r: &PlacementRequest<'_>, c: &mut Candidates<'_>) {
        (**self).place(f, r, c)
    }
}

/// The sink a policy offers its candidates to.
pub struct Candidates<'a> {
    topology: &'a Topology,
    /// Only backends of this node count (a session waiting for its home node).
    only_node: Option<u32>,
    /// Only this backend counts (a request waiting for the backend holding its prefix).
    only_backend: Option<u32>,
    /// Backends a policy wrapping another passes over, a bit each by index (empty, and
    /// unallocated, otherwise): O(1) to mark and to check, however many it passes over.
    passed_over: Vec<u64>,
    now_ms: u64,
    mode: Mode<'a>,
    first: Option<u32>,
    chosen: Option<u32>,
    /// The request's prompt tokens, by its chain's estimate (0: none), for backends with a
    /// context limit.
    prompt_tokens: u64,
    /// The tokens of context taken with the chosen backend's slot.
    context: u32,
    /// The largest [request context](crate::Backend::request_context_tokens) of the backends
    /// up, not passed over, that take a prompt as long as the request's (`u64::MAX`: one
    /// without a limit; 0: none): found once a backend too small for it is offered
    /// ([`NOT_LOOKED`] until then, which no limit is: a sentinel rather than an `Option`, so
    /// that the sink every request builds stays within 128 bytes, which it is moved in without
    /// a call to `memcpy`).
    largest_taking: u64,
    /// Whether a backend too small for the prompt is passed over (not for a request that
    /// continues a response stored on one backend, which goes there or nowhere).
    sized: bool,
    /// The largest request context of the backends passed over as too small (0: none): one
    /// of no larger a limit is passed over too, as it would refuse the prompt as well, though
    /// it may count the prompt a little shorter.
    passed_limit: u64,
    /// A backend's refusal of the prompt as too long, which counts instead of the estimate
    /// ([`ContextRefusal`](crate::ContextRefusal)); by reference, so that the sink every
    /// request builds stays as small as it was.
    refused: Option<&'a Refused>,
}

/// [`Candidates`]' largest limit that takes the prompt, before it is looked for.
const NOT_LOOKED: u64 = u64::MAX - 1;

/// A backend's refusal of a request's prompt as too long, as placement reads it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Refused {
    /// The prompt's tokens, as the backend counted them.
    pub(crate) tokens: u64,
    /// The backend that refused it, if it is in the fleet.
    pub(crate) backend: Option<u32>,
    /// The most tokens one request can take there, as it said.
    pub(crate) context: u64,
}

enum Mode<'a> {
    /// Take a slot on the first candidate that has one.
    Acquire,
    /// Stop at the first candidate that has a free slot, without taking it.
    Probe,
    /// Record every candidate; take nothing.
    Collect(&'a mut Vec<u32>),
}

impl<'a> Candidates<'a> {
    /// A sink that takes the first offered backend with a free slot, and room in its context
    /// for a prompt of `prompt_tokens` by its chain's estimate (0: none), if it has a limit
    /// ([`Backend::context_tokens`](crate::Backend::context_tokens)).
    pub(crate) fn acquire(topology: &'a Topology, now_ms: u64, prompt_tokens: u64) -> Self {
        Candidates {
            topology,
            only_node: None,
            only_backend: None,
            passed_over: Vec::new(),
            now_ms,
            mode: Mode::Acquire,
            first: None,
            chosen: None,
            prompt_tokens,
            context: 0,
            largest_taking: NOT_LOOKED,
            sized: true,
            passed_limit: 0,
            refused: None,
        }
    }

    /// A sink that stops at the first backend with a free slot without taking the slot.
    pub(crate) fn probe(topology: &'a Topology, now_ms: u64) -> Self {
        Candidates {
            topology,
            only_node: None,
            only_backend: None,
            passed_over: Vec::new(),
            now_ms,
            mode: Mode::Probe,
            first: None,
            chosen: None,
            prompt_tokens: 0,
            context: 0,
            largest_taking: NOT_LOOKED,
            sized: true,
            passed_limit: 0,
            refused: None,
        }
    }

    /// A sink that records every offer and takes nothing.
    pub(crate) fn collect(topology: &'a Topology, now_ms: u64, into: &'a mut Vec<u32>) -> Self {
        Candidates {
            topology,
            only_node: None,
            only_backend: None,
            passed_over: Vec::new(),
            now_ms,
            mode: Mode::Collect(into),
            first: None,
            chosen: None,
            prompt_tokens: 0,
            context: 0,
            largest_taking: NOT_LOOKED,
            sized: true,
            passed_limit: 0,
            refused: None,
        }
    }

    /// Offers `backend`. Returns `Break` when the service has taken it (stop offering), and
    /// `Continue` when it is full (offer the next one).
    ///
    /// A backend marked down is passed over, as is a backend from another view, and one
    /// too small for the request's prompt (by its chain's estimate, or as a backend's
    /// [refusal](crate::ContextRefusal) of it counted it) while one up with a larger request
    /// context takes it
    /// ([`Backend::request_context_tokens`](crate::Backend::request_context_tokens)).
    pub fn offer(&mut self, backend: BackendRef<'_>) -> ControlFlow<()> {
        if self.chosen.is_some() {
            return ControlFlow::Break(());
        }
        if !backend.belongs_to(self.topology) {
            return ControlFlow::Continue(());
        }
        let index = backend.index;
        let member = self.topology.member(index);
        if self.only_node.is_some_and(|n| n != member.node)
            || self.only_backend.is_some_and(|b| b != index)
            || self.is_passed_over(index)
        {
            return ControlFlow::Continue(());
        }
        let load = &member.load;
        match load.health(self.now_ms) {
            (true, _) => return ControlFlow::Continue(()),
            (false, true) => tracing::info!(backend = %member.id, "backend up: cooldown over"),
            (false, false) => {}
        }
        if (self.prompt_tokens > 0 || self.refused.is_some())
            && self.sized
            && self.too_small_while_another_takes(index, load)
        {
            self.pass_over_index(index);
            return ControlFlow::Continue(());
        }
        self.first.get_or_insert(index);
        let taken = match &mut self.mode {
            Mode::Collect(seen) => {
                if !seen.contains(&index) {
                    seen.push(index);
                }
                false
            }
            Mode::Acquire if self.prompt_tokens == 0 || !load.has_context_limit() => {
                load.try_acquire()
            }
            Mode::Acquire => self.acquire_with_context(load),
            Mode::Probe => load.has_free_slot(),
        };
        if taken {
            self.chosen = Some(index);
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    }

    /// A slot on `load`, a backend with a context limit, and room in its context for the
    /// request's prompt ([`Backend::context_tokens`](crate::Backend::context_tokens)). A
    /// prompt that does not fit beside those in flight takes nothing: it does not take the
    /// slot even for a moment, in which a request that needs no room would find the backend
    /// full. The slot is given back only when another request took the room between the look
    /// and the slot; that one is in flight, and its end wakes the waiters.
    #[cold]
    fn acquire_with_context(&mut self, load: &Load) -> bool {
        let need = load.context_need(self.prompt_tokens);
        if !load.has_context_for(need) || !load.try_acquire() {
            return false;
        }
        match load.take_context_or_give_back(need) {
            Some(context) => {
                self.context = context;
                true
            }
            None => false,
        }
    }

    /// The largest request context of the backends up and not passed over that take the
    /// request's prompt ([`Backend::request_context_tokens`](crate::Backend::request_context_tokens)):
    /// a backend too small for the prompt (or of no larger a limit than one that was) is
    /// passed over only for a larger one that takes it. If none does, the limits are no
    /// reason to pass a backend over, and the backend answers for itself. O(backends), once a
    /// request, asked only once a backend too small for the prompt is offered.
    #[cold]
    fn largest_taking(&mut self) -> u64 {
        if self.largest_taking != NOT_LOOKED {
            return self.largest_taking;
        }
        let t = self.topology;
        let largest = t
            .live
            .indexes()
            .filter(|&i| !self.is_passed_over(i))
            .map(|i| (i, &*t.member(i).load))
            .filter(|&(i, l)| !l.is_down(self.now_ms) && !self.too_long_for(i, l))
            .map(|(i, l)| self.limit_of(i, l))
            .max()
            .unwrap_or(0);
        // A limit of `NOT_LOOKED` tokens, were one given, reads as none.
        self.largest_taking = if largest == NOT_LOOKED {
            u64::MAX
        } else {
            largest
        };
        self.largest_taking
    }

    /// Whether backend `index` is to be passed over as too small for the prompt: it is, or
    /// its limit is no larger than one passed over as too small, and a backend up with a
    /// larger limit takes the prompt. Records the limit passed over.
    fn too_small_while_another_takes(&mut self, index: u32, load: &Load) -> bool {
        let too_long = self.too_long_for(index, load);
        if !too_long && self.passed_limit == 0 {
            return false;
        }
        let limit = self.limit_of(index, load);
        if !(too_long || limit <= self.passed_limit) || self.largest_taking() <= limit {
            return false;
        }
        self.passed_limit = self.passed_limit.max(limit);
        true
    }

    /// The most tokens one request can take on backend `index` (`u64::MAX`: no limit): its
    /// [request context](crate::Backend::request_context_tokens), or what it said it has when
    /// it refused the prompt, if less.
    fn limit_of(&self, index: u32, load: &Load) -> u64 {
        match (load.request_limit(), self.refused) {
            (limit, Some(r)) if r.backend == Some(index) => limit.min(r.context),
            (limit, _) => limit,
        }
    }

    /// Whether backend `index` is too small for the prompt: by a refusal's count of its tokens
    /// where the request carries one, else by its chain's estimate in the backend's tokens.
    fn too_long_for(&self, index: u32, load: &Load) -> bool {
        match self.refused {
            Some(r) => r.tokens >= self.limit_of(index, load),
            None => load.too_small_for(self.prompt_tokens),
        }
    }

    /// Whether `backend` is marked down (a failure's cooldown, a probe's mark): an offer of it
    /// would be passed over. A policy that orders backends by load can leave such backends
    /// out, or last; offering one is harmless. A backend of another view reads as down.
    ///
    /// ```
    /// use tower_affinity::placement::{Candidates, FleetView, Placement, PlacementRequest};
    ///
    /// /// The backend with the fewest requests in flight among those up.
    /// #[derive(Clone)]
    /// struct LeastLoaded;
    ///
    /// impl Placement for LeastLoaded {
    ///     fn place(&self, fleet: &FleetView<'_>, _: &PlacementRequest<'_>, c: &mut Candidates<'_>) {
    ///         let mut up: Vec<_> = fleet.backends().filter(|b| !c.is_down(*b)).collect();
    ///         up.sort_by_key(|b| b.in_flight());
    ///         for b in up {
    ///             if c.offer(b).is_break() {
    ///                 return;
    ///             }
    ///         }
    ///     }
    /// }
    /// ```
    pub fn is_down(&self, backend: BackendRef<'_>) -> bool {
        !backend.belongs_to(self.topology)
            || self
                .topology
                .member(backend.index)
                .load
                .is_down(self.now_ms)
    }

    /// Passes over `backend` from now on: offers of it return `Continue` and take nothing, as
    /// offers of a backend that is down do. A policy that wraps another calls it first, to
    /// keep the other's order within rules of its own. O(1) a call. A policy that passes over
    /// every backend that is up has none for the request, which fails at once with
    /// [`Error::NoBackends`](crate::Error::NoBackends) rather than waiting for a slot. Only
    /// this call passes a backend over: one the policy leaves out of its offers while it is
    /// up is not, and a request offered only backends down while it is up waits for them.
    ///
    /// The wrapped policy still sees the whole fleet: `NodeThenBackend`'s spreading bounds
    /// (its share of the fleet's slots, the fleet's average load) and
    /// [`FleetView::longest_prefix`] count the backends passed over too.
    ///
    /// ```
    /// use tower_affinity::key::SessionKey;
    /// use tower_affinity::placement::{
    ///     Candidates, FleetView, NodeThenBackend, Placement, PlacementRequest, Snapshot,
    /// };
    ///
    /// /// `NodeThenBackend`, never on node `gpu-spare` for sessions without a key.
    /// #[derive(Clone)]
    /// struct KeepOffSpare(NodeThenBackend);
    ///
    /// impl Placement for KeepOffSpare {
    ///     fn place(&self, fleet: &FleetView<'_>, req: &PlacementRequest<'_>, c: &mut Candidates<'_>) {
    ///         if req.key.is_none() {
    ///             for b in fleet.backends().filter(|b| b.node().id().as_str() == "gpu-spare") {
    ///                 c.pass_over(b);
    ///             }
    ///         }
    ///         self.0.place(fleet, req, c)
    ///     }
    /// }
    ///
    /// let fleet = Snapshot::new()
    ///     .backend("a", "gpu-main", 1)
    ///     .backend("s", "gpu-spare", 4);
    /// let policy = KeepOffSpare(NodeThenBackend::new());
    /// for _ in 0..10 {
    ///     assert_eq!(fleet.choose(&policy, None, None), Some("a".into()));
    /// }
    /// // A keyed session may still go there.
    /// let order = fleet.order(&policy, Some(SessionKey::from_bytes(b"s1")), None);
    /// assert_eq!(order.len(), 2);
    /// ```
    pub fn pass_over(&mut self, backend: BackendRef<'_>) {
        if backend.belongs_to(self.topology) {
            self.pass_over_index(backend.index);
        }
    }

    /// Passes over the backend of index `index` (see [`pass_over`](Self::pass_over)).
    fn pass_over_index(&mut self, index: u32) {
        let word = index as usize / 64;
        if self.passed_over.len() <= word {
            let words = self.topology.members.len().div_ceil(64).max(word + 1);
            self.passed_over.resize(words, 0);
        }
        self.passed_over[word] |= 1 << (index % 64);
    }

    /// Whether the policy passed over the backend of index `index`, or the service did, as
    /// too small for the request's prompt.
    pub(crate) fn is_passed_over(&self, index: u32) -> bool {
        passed(&self.passed_over, index)
    }

    /// Whether the policy passed over every live backend that is not down (none, when every
    /// one is down): it has no backend for the request, as an empty fleet has none. A policy
    /// that leaves the backends down out of its offers rather than offering them lands here
    /// when they all are. O(backends); asked only when nothing was offered.
    pub(crate) fn passed_over_every_backend_up(&self) -> bool {
        (0..self.topology.members.len() as u32).all(|i| {
            let m = self.topology.member(i);
            !m.live || self.is_passed_over(i) || m.load.is_down(self.now_ms)
        })
    }

    /// Counts only the backends of `node`.
    pub(crate) fn only_node(mut self, node: Option<u32>) -> Self {
        self.only_node = node;
        self
    }

    /// Counts only `backend`.
    pub(crate) fn only_backend(mut self, backend: Option<u32>) -> Self {
        self.only_backend = backend;
        self
    }

    /// Counts the prompt as a backend's refusal of it did, rather than by its estimate.
    pub(crate) fn count_as_refused(&mut self, refused: &'a Refused) {
        self.refused = Some(refused);
    }

    /// Passes over no backend as too small for the prompt.
    pub(crate) fn any_size(mut self) -> Self {
        self.sized = false;
        self
    }

    /// Whether a backend offered was passed over as too small for the prompt.
    pub(crate) fn passed_too_small(&self) -> bool {
        self.passed_limit > 0
    }

    /// The backend whose slot was taken, if any.
    pub(crate) fn chosen(&self) -> Option<u32> {
        self.chosen
    }

    /// The backend whose slot was taken, if any, now the caller's to release: the sink no
    /// longer gives it back when dropped. The tokens of its context the request took are
    /// [`context`](Self::context)'s.
    pub(crate) fn claim(&mut self) -> Option<u32> {
        match self.mode {
            Mode::Acquire => self.chosen.take(),
            _ => self.chosen,
        }
    }

    /// The tokens of context taken with the chosen backend's slot.
    pub(crate) fn context(&self) -> u32 {
        self.context
    }

    /// The first healthy backend offered, whether or not it had room.
    pub(crate) fn first(&self) -> Option<u32> {
        self.first
    }
}

/// Whether the bit of `index` is set in `bits`.
fn passed(bits: &[u64], index: u32) -> bool {
    bits.get(index as usize / 64)
        .is_some_and(|w| w >> (index % 64) & 1 == 1)
}

/// A slot taken for a request and not claimed by the service gives itself back: a policy that
/// panicked after its offer was taken loses the request, not the slot.
impl Drop for Candidates<'_> {
    fn drop(&mut self) {
        if let (Mode::Acquire, Some(index)) = (&self.mode, self.chosen) {
            // Released as any taken slot is: its guard, dropped at once.
            let member = self.topology.member(index);
            drop(SlotGuard::new(&member.load, index, self.now_ms).with_context(self.context));
        }
    }
}

impl fmt::Debug for Candidates<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Candidates")
            .field("first", &self.first)
            .field("chosen", &self.chosen)
            .finish_non_exhaustive()
    }
}

/// Offers two backends sampled with `random`, the one with more free slots first (power of
/// two choices), then, if neither had a free slot, every backend by [`most_free_slots`] with
/// ties by `random`'s rank. A fleet of two backends or fewer is not sampled: it goes by free
/// slots at once, so that equal backends share the requests whatever order they were
/// discovered in. O(1) while either sample has room, however large the fleet. Used for
/// keyless requests.
pub(crate) fn freer_of_two(
    fleet: &FleetView<'_>,
    random: u64,
    candidates: &mut Candidates<'_>,
) -> ControlFlow<()> {
    let n = fleet.len();
    if n > 2 {
        // Two distinct positions: `i`, and `j` at a non-zero distance from it.
        let i = (random % n as u64) as usize;
        let j = (i + 1 + ((random >> 32) % (n as u64 - 1)) as usize) % n;
        if let (Some(a), Some(b)) = (fleet.backend_at(i), fleet.backend_at(j)) {
            let (first, second) = if b.free_slots() > a.free_slots() {
                (b, a)
            } else {
                (a, b)
            };
            candidates.offer(first)?;
            candidates.offer(second)?;
        }
    }
    most_free_slots(fleet, Ties::Rank(random), candidates)
}

/// How [`most_free_slots`] orders backends with as many free slots.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Ties {
    /// The tied backend at this number, modulo how many tie, counted by position in the
    /// fleet: ties take turns evenly when the caller adds one to it on every call.
    Rotate(usize),
    /// By [`tie_rank`](rendezvous::tie_rank) of this number and each backend's id, highest
    /// first: the same on every router, whatever order it discovered the backends in.
    Rank(u64),
}

/// Offers the fleet's backends, most free slots first, ties as `ties` says. Used for keyless
/// requests by every policy.
pub(crate) fn most_free_slots(
    fleet: &FleetView<'_>,
    ties: Ties,
    candidates: &mut Candidates<'_>,
) -> ControlFlow<()> {
    let n = fleet.len();
    if n == 0 {
        return ControlFlow::Continue(());
    }
    let (start, tie) = match ties {
        Ties::Rotate(start) => (start, None),
        Ties::Rank(tie) => (0, Some(tie)),
    };
    // Higher is better: free slots, then the rank (none when rotating).
    let order = |b: &BackendRef<'_>| {
        let rank = tie.map_or(0, |t| rendezvous::tie_rank(t, b.member().digest));
        (b.free_slots(), rank)
    };
    // One pass for the best order and how many backends share it, a second for the tie
    // whose turn it is: ties rotate among the backends that tie, not over the whole fleet,
    // nor over those down or passed over, which take nothing. The first best stands in if
    // the loads changed between the passes.
    let open = |b: &BackendRef<'_>| !candidates.is_down(*b) && !candidates.is_passed_over(b.index);
    let mut best: Option<((u32, u64), usize, usize)> = None;
    for (i, b) in (0..n).filter_map(|i| Some((i, fleet.backend_at(i)?))) {
        if !open(&b) {
            continue;
        }
        let o = order(&b);
        match &mut best {
            Some((x, _, count)) if o == *x => *count += 1,
            Some((x, _, _)) if o < *x => {}
            _ => best = Some((o, i, 1)),
        }
    }
    let Some((best, first, count)) = best else {
        // Every backend down or passed over: none would take the request.
        return ControlFlow::Continue(());
    };
    let chosen = match start % count {
        0 => first,
        turn => (0..n)
            .filter(|&i| {
                fleet
                    .backend_at(i)
                    .is_some_and(|b| open(&b) && order(&b) == best)
            })
            .nth(turn)
            .unwrap_or(first),
    };
    if let Some(b) = fleet.backend_at(chosen) {
        candidates.offer(b)?;
    }
    // The full order only if the best was taken meanwhile, from the tie chosen on.
    let rotated = (0..n).filter_map(|i| fleet.backend_at((chosen + i) % n));
    let mut rest: Vec<((u32, u64), BackendRef<'_>)> = rotated.map(|b| (order(&b), b)).collect();
    // Stable: ties keep their order from the chosen one on.
    rest.sort_by_key(|&(o, _)| std::cmp::Reverse(o));
    for (_, b) in rest {
        candidates.offer(b)?;
    }
    ControlFlow::Continue(())
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;
    use std::sync::atomic::Ordering;

    use super::*;

    /// Backends `(limit, learned scale)` of one slot each on one node; 0 is no limit.
    fn topology(backends: &[(u64, Option<f64>)]) -> Topology {
        let mut t = Topology::default();
        for (i, &(limit, scale)) in backends.iter().enumerate() {
            let id = format!("b{i}");
            let index = t.insert(id.into(), &"n".into(), NonZeroU32::MIN, None, 1_000);
            let load = &t.member(index).load;
            load.request_context.store(limit, Ordering::Relaxed);
            if let Some(scale) = scale {
                load.learned.set_token_scale(scale);
            }
        }
        t
    }

    /// The backend a request of `prompt` tokens takes when offered every backend in order.
    fn taken(t: &Topology, prompt: u64) -> Option<u32> {
        let mut c = Candidates::acquire(t, 1, prompt);
        for i in 0..t.members.len() as u32 {
            if c.offer(BackendRef::new(t, i)).is_break() {
                break;
            }
        }
        c.claim()
    }

    #[test]
    fn between_backends_of_the_same_request_context_their_estimates_move_nothing() {
        // The first counts the prompt's 950 as 1,045, the second as 903: both take 1,000 a
        // request, so the first is not passed over for the second.
        let t = topology(&[(1_000, Some(1.1)), (1_000, Some(0.95))]);
        assert_eq!(taken(&t, 950), Some(0));
        // A larger limit that takes it is what a backend too small is passed over for.
        let t = topology(&[(1_000, Some(1.1)), (2_000, Some(0.95))]);
        assert_eq!(taken(&t, 950), Some(1));
        // As is a backend without a limit.
        let t = topology(&[(1_000, None), (0, None)]);
        assert_eq!(taken(&t, 1_500), Some(1));
        assert_eq!(taken(&t, 900), Some(0));
    }

    #[test]
    fn a_backend_too_small_is_passed_over_for_a_larger_one_not_for_one_of_its_own_limit() {
        // b0 counts 950 as 1,045 of its 1,000; b1, of the same 1,000, as 903; b2 takes
        // 2,000: b1 would refuse the prompt as b0 would, and it goes to b2.
        let t = topology(&[(1_000, Some(1.1)), (1_000, Some(0.95)), (2_000, None)]);
        assert_eq!(taken(&t, 950), Some(2));
    }

    #[test]
    fn a_backend_too_small_is_not_passed_over_for_a_larger_one_that_is_down() {
        // b1 would take the prompt, but it is down: no backend up takes it, and b0, too
        // small, answers for itself.
        let t = topology(&[(1_000, None), (2_000, None)]);
        let _ = t.member(1).load.mark_down(u64::MAX, 0);
        assert_eq!(taken(&t, 1_500), Some(0));
    }

    #[test]
    fn a_backend_too_small_is_not_passed_over_for_a_larger_one_the_policy_passed_over() {
        let t = topology(&[(1_000, None), (2_000, None)]);
        let mut c = Candidates::acquire(&t, 1, 1_500);
        c.pass_over(BackendRef::new(&t, 1));
        for i in 0..2 {
            if c.offer(BackendRef::new(&t, i)).is_break() {
                break;
            }
        }
        assert_eq!(c.claim(), Some(0));
    }

    #[test]
    fn a_slot_promised_to_a_woken_waiter_is_not_free() {
        // b0 has one request in flight and two slots promised to waiters woken for them: one
        // free slot of four. b1 has two in flight: two free. A request without a key or prompt
        // goes to the freer.
        let mut t = Topology::default();
        let four = NonZeroU32::new(4).unwrap();
        for id in ["b0", "b1"] {
            t.insert(id.into(), &"n".into(), four, None, 1_000);
        }
        let (b0, b1) = (&t.member(0).load, &t.member(1).load);
        assert!(b0.try_acquire());
        b0.reserved.store(2, Ordering::Relaxed);
        assert!(b1.try_acquire() && b1.try_acquire());
        let free = |i| BackendRef::new(&t, i).free_slots();
        assert_eq!((free(0), free(1)), (1, 2));
        let extensions = http::Extensions::new();
        let req = PlacementRequest::new(None, None, &extensions);
        let mut c = Candidates::probe(&t, 1);
        crate::placement::NodeThenBackend::new().place(&FleetView::at(&t, 0), &req, &mut c);
        assert_eq!(c.chosen(), Some(1));
    }

    #[test]
    fn a_new_keyless_conversation_passes_over_the_least_loaded_backend_if_its_slots_are_promised() {
        // x is idle and homes nothing, but both its slots are promised to waiters woken for
        // them: it has no free slot. Of the backends with one, y is the least loaded (nothing
        // in flight), though w has more free slots. The new conversation goes to y, not to the
        // freest backend as it would had x been offered first and found full.
        let mut t = Topology::default();
        for (id, slots) in [("x", 2), ("y", 2), ("w", 8)] {
            let slots = NonZeroU32::new(slots).unwrap();
            t.insert(id.into(), &"n".into(), slots, None, 100_000);
        }
        t.member(0).load.reserved.store(2, Ordering::Relaxed);
        let held = crate::PromptChain::from_blocks([(7, 100)]);
        t.member(1).cache.record_from(held.links(), 0, 0);
        assert!(t.member(2).load.try_acquire());
        let prompt = crate::PromptChain::from_blocks([(1, 2_000), (2, 100)]);
        let extensions = http::Extensions::new();
        let req = PlacementRequest::new(None, None, &extensions).chain(Some(&prompt));
        let mut c = Candidates::probe(&t, 1);
        crate::placement::NodeThenBackend::new().place(&FleetView::at(&t, 0), &req, &mut c);
        assert_eq!(c.chosen(), Some(1));
    }

    #[test]
    fn a_prompt_refused_at_exactly_its_context_passes_over_backends_of_that_limit() {
        // b0 refused the prompt, counting it 1,000 tokens against a context of 1,000: a
        // prompt as long as the context does not fit. b1, of the same limit, would refuse it
        // too, and it goes to b2, which takes 2,000.
        let t = topology(&[(1_000, None), (1_000, None), (2_000, None)]);
        let refused = Refused {
            tokens: 1_000,
            backend: Some(0),
            context: 1_000,
        };
        let mut c = Candidates::acquire(&t, 1, 900);
        c.count_as_refused(&refused);
        for i in 1..3 {
            if c.offer(BackendRef::new(&t, i)).is_break() {
                break;
            }
        }
        assert_eq!(c.claim(), Some(2));
    }

    #[test]
    fn the_backends_after_the_freest_are_offered_when_it_does_not_take_the_request() {
        // b0 and b1 tie on free slots and b0 takes its turn first, but it is too small for
        // the prompt of 1,500 tokens: b1, offered after it, takes the request.
        let t = topology(&[(1_000, None), (2_000, None)]);
        let mut c = Candidates::acquire(&t, 1, 1_500);
        let _ = most_free_slots(&FleetView::at(&t, 0), Ties::Rotate(0), &mut c);
        assert_eq!(c.claim(), Some(1));
    }

    #[test]
    fn most_free_slots_offers_every_backend_freest_first_ties_from_the_chosen_one_on() {
        // One slot each; b2's is taken. b0, b1 and b3 tie, and turn 1 of them is b1; then the
        // rest, counted on from b1, freest first: b3, b0, and b2 last.
        let t = topology(&[(0, None); 4]);
        assert!(t.member(2).load.try_acquire());
        let mut seen = Vec::new();
        let mut c = Candidates::collect(&t, 1, &mut seen);
        let _ = most_free_slots(&FleetView::at(&t, 0), Ties::Rotate(1), &mut c);
        drop(c);
        assert_eq!(seen, [1, 3, 0, 2]);
    }

    #[test]
    fn a_backend_that_refused_the_prompt_is_held_to_the_context_it_said_it_has() {
        // b0 is declared to take 4,000 tokens a request but refused the prompt as 2,500
        // tokens against the 2,000 it said it has: it is passed over for b1, which takes
        // 3,000.
        let t = topology(&[(4_000, None), (3_000, None)]);
        let refused = Refused {
            tokens: 2_500,
            backend: Some(0),
            context: 2_000,
        };
        let mut c = Candidates::acquire(&t, 1, 2_000);
        c.count_as_refused(&refused);
        for i in 0..2 {
            if c.offer(BackendRef::new(&t, i)).is_break() {
                break;
            }
        }
        assert_eq!(c.claim(), Some(1));
    }

    #[test]
    fn two_samples_of_equal_free_slots_are_offered_from_the_random_numbers_low_then_high_bits() {
        // Four backends, one free slot each. The first sample is at the low bits' position
        // (5 % 4 = 1), the second at the high bits' distance past it (1 + 1 + 1 % 3 = 3);
        // of two as free, the first sample goes first.
        let t = topology(&[(0, None); 4]);
        let mut seen = Vec::new();
        let mut c = Candidates::collect(&t, 1, &mut seen);
        let _ = freer_of_two(&FleetView::at(&t, 0), (1 << 32) | 5, &mut c);
        drop(c);
        assert_eq!(seen[..2], [1, 3]);
    }
}
