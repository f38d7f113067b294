use std::fmt;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::cache;
use crate::fleet::{Member, NodeEntry, Topology};
use crate::key::SessionKey;
use crate::{BackendId, NodeId, PromptChain};

use super::rendezvous::{self, RankSet};

/// A read-only view of the fleet, handed to a [`Placement`](super::Placement).
///
/// Slot counts and in-flight counts are read live: another request may take a slot between
/// the moment a policy reads a count and the moment the service tries the candidate, which is
/// why the service, not the policy, takes the slot.
///
/// The view lists the backends in the fleet, down or up. Which are down (a failure's
/// cooldown, a probe's mark) is read from the sink the policy offers to,
/// [`Candidates::is_down`](super::Candidates::is_down), at the time of the placement. A policy
/// that goes where the cache model says most of the request's prompt is held, ties by fewest
/// requests in flight, and never offers a backend that is down:
///
/// ```
/// use std::cmp::Reverse;
///
/// use tower_affinity::placement::{Candidates, FleetView, Placement, PlacementRequest, Snapshot};
/// use tower_affinity::PromptChain;
///
/// #[derive(Clone)]
/// struct LongestReuse;
///
/// impl Placement for LongestReuse {
///     fn place(&self, fleet: &FleetView<'_>, req: &PlacementRequest<'_>, c: &mut Candidates<'_>) {
///         let reuse = |b: &tower_affinity::placement::BackendRef<'_>| {
///             req.chain.map_or(0, |chain| b.cached_tokens(chain))
///         };
///         let mut up: Vec<_> = fleet.backends().filter(|b| !c.is_down(*b)).collect();
///         up.sort_by_key(|b| (Reverse(reuse(b)), b.in_flight()));
///         for b in up {
///             if c.offer(b).is_break() {
///                 return;
///             }
///         }
///     }
/// }
///
/// let opening = PromptChain::from_blocks([(1, 1_000)]);
/// let turn = PromptChain::from_blocks([(1, 1_000), (2, 400)]);
/// let fleet = Snapshot::new()
///     .backend("a", "n", 2)
///     .backend("b", "n", 2)
///     .backend("c", "n", 2)
///     .holds("a", &opening)
///     .holds("b", &opening)
///     .in_flight("a", 1)
///     .prompt(turn);
/// // a and b reuse 1,000 tokens, b with fewer in flight; c reuses none.
/// assert_eq!(fleet.order(&LongestReuse, None, None), ["b", "a", "c"]);
/// let fleet = fleet.down("b");
/// assert_eq!(fleet.order(&LongestReuse, None, None), ["a", "c"]);
/// ```
#[derive(Clone, Copy)]
pub struct FleetView<'a> {
    pub(crate) topology: &'a Topology,
    /// Now, on the fleet's clock (0 in a [`Snapshot`](super::Snapshot)).
    pub(crate) now_ms: u64,
}

impl<'a> FleetView<'a> {
    /// A view of `topology` at `now_ms` on the fleet's clock (0: none, as a
    /// [`Snapshot`](super::Snapshot)'s).
    pub(crate) fn at(topology: &'a Topology, now_ms: u64) -> Self {
        FleetView { topology, now_ms }
    }

    /// The live backends (those in the fleet, down or up: see
    /// [`Candidates::is_down`](super::Candidates::is_down)), in the order they were discovered
    /// or last updated (an update, such as a new slot count, moves a backend to the end).
    pub fn backends(&self) -> impl ExactSizeIterator<Item = BackendRef<'a>> + Clone + 'a {
        let t = self.topology;
        t.live.indexes().map(move |i| BackendRef::new(t, i))
    }

    /// The live backend at `position` in [`FleetView::backends`] order.
    pub fn backend_at(&self, position: usize) -> Option<BackendRef<'a>> {
        let i = self.topology.live.index_at(position)?;
        Some(BackendRef::new(self.topology, i))
    }

    /// The live backend named `id`.
    pub fn backend(&self, id: &BackendId) -> Option<BackendRef<'a>> {
        let i = self.topology.index_of(id.as_str())?;
        Some(BackendRef::new(self.topology, i))
    }

    /// The nodes that have at least one live backend.
    pub fn nodes(&self) -> impl ExactSizeIterator<Item = NodeRef<'a>> + Clone + 'a {
        let t = self.topology;
        t.live_nodes.indexes().map(move |i| NodeRef::new(t, i))
    }

    /// How many live backends there are.
    pub fn len(&self) -> usize {
        self.topology.live.len()
    }

    /// Whether the fleet has no live backend.
    pub fn is_empty(&self) -> bool {
        self.topology.live.is_empty()
    }

    /// Requests in flight on the live backends, as [`backends`](Self::backends) lists them:
    /// a removed backend's last requests, still streaming, take none of the slots the view
    /// counts. O(backends): it sums their counters.
    pub fn in_flight(&self) -> usize {
        self.backends().map(|b| b.in_flight() as usize).sum()
    }

    /// Conversations the cache model says the live backends home, in all. O(backends).
    pub fn conversations(&self) -> u64 {
        self.backends().map(|b| u64::from(b.conversations())).sum()
    }

    /// The live backend that the cache model says holds the longest prefix of `chain`, if any
    /// holds some of it, and whether that prefix is the conversation's own.
    ///
    /// The prefix is *own* when exactly one backend holds it that far, no other prompt
    /// continues it on that backend, and either the chain goes on past it (the request adds to
    /// what was served: it is where a turn this request extends ended) or it is the whole
    /// prompt, sent whole once before (a turn sent again: a retry, a second answer). Either way
    /// it identifies one conversation. A system prompt every conversation starts with is held
    /// on many backends, or continued by other conversations, and is not; nor is a prompt
    /// sent whole more than once, as agents that all open with the same prompt send it.
    /// O(backends x log links): the backends are asked in turn.
    ///
    /// ```
    /// use tower_affinity::placement::Snapshot;
    /// use tower_affinity::PromptChain;
    ///
    /// let turn1 = PromptChain::from_blocks([(1, 2_000), (2, 300)]);
    /// let turn2 = PromptChain::from_blocks([(1, 2_000), (2, 300), (3, 50), (4, 80)]);
    /// let fleet = Snapshot::new()
    ///     .backend("a", "n", 1)
    ///     .backend("b", "n", 1)
    ///     .holds("b", &turn1);
    /// let prefix = fleet.view().longest_prefix(&turn2).unwrap();
    /// assert_eq!(prefix.backend.id().as_str(), "b");
    /// assert_eq!((prefix.links, prefix.tokens, prefix.own, prefix.only), (2, 2_300, true, true));
    ///
    /// // Turn 1 sent again whole (a retry) is its conversation's own; sent whole by more than
    /// // one request before, it is an opening that several conversations share.
    /// let again = fleet.view().longest_prefix(&turn1).unwrap();
    /// assert!(again.whole && again.own);
    /// let fleet = fleet.holds("b", &turn1);
    /// assert!(!fleet.view().longest_prefix(&turn1).unwrap().own);
    /// ```
    pub fn longest_prefix(&self, chain: &PromptChain) -> Option<Prefix<'a>> {
        let mut best: Option<(BackendRef<'a>, usize)> = None;
        let mut ties = 0;
        let mut none_likely = true;
        for b in self.backends() {
            let links = b.cached_links_guessing(chain, none_likely);
            none_likely = links == 0;
            match best {
                Some((_, n)) if links < n => {}
                Some((_, n)) if links == n => ties += 1,
                _ if links == 0 => {}
                _ => {
                    best = Some((b, links));
                    ties = 0;
                }
            }
        }
        let (backend, links) = best?;
        let tip = chain.links()[links - 1].digest;
        let whole = links == chain.len();
        let own = ties == 0 && {
            let model = backend.member().cache.lock();
            model.continuations(tip) == 0 && (!whole || !model.resent(tip))
        };
        Some(Prefix {
            backend,
            links,
            tokens: chain.tokens_at(links),
            own,
            only: ties == 0,
            whole,
        })
    }
}

impl fmt::Debug for FleetView<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.backends()).finish()
    }
}

/// One live backend, as a policy sees it: one in the fleet, down or up (whether it is down is
/// [`Candidates::is_down`](super::Candidates::is_down)'s to say).
#[derive(Clone, Copy)]
pub struct BackendRef<'a> {
    topology: &'a Topology,
    pub(crate) index: u32,
}

impl<'a> BackendRef<'a> {
    pub(crate) fn new(topology: &'a Topology, index: u32) -> Self {
        BackendRef { topology, index }
    }

    pub(crate) fn member(&self) -> &'a Member {
        self.topology.member(self.index)
    }

    /// The backend's id.
    pub fn id(&self) -> &'a BackendId {
        &self.member().id
    }

    /// The backend's node.
    pub fn node(&self) -> NodeRef<'a> {
        NodeRef::new(self.topology, self.member().node)
    }

    /// How many requests it serves at once.
    pub fn slots(&self) -> u32 {
        self.member().load.slots.load(Ordering::Relaxed)
    }

    /// Requests dispatched to it whose response has not ended.
    pub fn in_flight(&self) -> u32 {
        self.member().load.in_flight()
    }

    /// Slots not taken right now, nor promised to a waiting request woken for one.
    pub fn free_slots(&self) -> u32 {
        let promised = self.member().load.reserved.load(Ordering::Relaxed);
        self.slots()
            .saturating_sub(self.in_flight())
            .saturating_sub(promised)
    }

    /// Requests waiting for a slot (with [`Overflow::Wait`](crate::Overflow::Wait), the
    /// default) whose cache is on this backend: sessions homed here, and prompts whose longest
    /// prefix is held here. A slot freed here goes to them before any other, so together with
    /// [`in_flight`](Self::in_flight) it is this backend's queue, which `in_flight` alone
    /// never shows past its slots. A request placed again as it waits counts itself. Waiters
    /// whose cache is nowhere are not counted on any backend.
    ///
    /// It reads the wait queue (a lock, and a walk of the waiters, only when any wait), so a
    /// policy that asks it for every backend on every placement pays for that under overload.
    ///
    /// ```
    /// use tower_affinity::placement::{
    ///     Candidates, FleetView, LeastLoaded, Placement, PlacementRequest, Snapshot,
    /// };
    ///
    /// /// A session's home unless more than `max` requests wait for it; then the least loaded.
    /// #[derive(Clone)]
    /// struct HomeUnlessQueued {
    ///     max: u32,
    /// }
    ///
    /// impl Placement for HomeUnlessQueued {
    ///     fn place(&self, fleet: &FleetView<'_>, req: &PlacementRequest<'_>, c: &mut Candidates<'_>) {
    ///         let home = req.home.and_then(|h| h.backend);
    ///         if let Some(home) = home.filter(|b| b.waiting() <= self.max) {
    ///             if c.offer(home).is_break() {
    ///                 return;
    ///             }
    ///         }
    ///         LeastLoaded::new().place(fleet, req, c);
    ///     }
    /// }
    ///
    /// let fleet = Snapshot::new()
    ///     .backend("a", "n", 1)
    ///     .backend("b", "n", 1)
    ///     .in_flight("a", 1)
    ///     .waiting("a", 3);
    /// assert_eq!(fleet.view().backend(&"a".into()).unwrap().waiting(), 3);
    /// let policy = HomeUnlessQueued { max: 2 };
    /// assert_eq!(fleet.order(&policy, None, Some("a")), ["b", "a"]);
    /// let fleet = fleet.waiting("a", 2);
    /// assert_eq!(fleet.order(&policy, None, Some("a"))[0], "a");
    /// ```
    pub fn waiting(&self) -> u32 {
        self.topology.capacity.waiting_for(self.index, None)
    }

    /// The backend's prompt-cache budget in bytes, if discovery gave one
    /// ([`Backend::prompt_cache_bytes`](crate::Backend::prompt_cache_bytes); in a test fleet,
    /// [`Snapshot::prompt_cache_bytes`](super::Snapshot::prompt_cache_bytes)).
    pub fn prompt_cache_bytes(&self) -> Option<u64> {
        self.member().prompt_cache_bytes
    }

    /// The values discovery attached to the backend
    /// ([`Backend::extension`](crate::Backend::extension)): a tenant, a GPU, a region, for
    /// a policy of your own to place by.
    ///
    /// ```
    /// use tower_affinity::placement::{
    ///     Candidates, FleetView, NodeThenBackend, Placement, PlacementRequest, Snapshot,
    /// };
    ///
    /// /// Which tenant a backend serves, and which a request comes from.
    /// #[derive(Clone, PartialEq)]
    /// struct Tenant(&'static str);
    ///
    /// /// `NodeThenBackend` over the request's tenant's backends only.
    /// #[derive(Clone)]
    /// struct OwnBackends(NodeThenBackend);
    ///
    /// impl Placement for OwnBackends {
    ///     fn place(&self, fleet: &FleetView<'_>, req: &PlacementRequest<'_>, c: &mut Candidates<'_>) {
    ///         let tenant = req.extensions.get::<Tenant>();
    ///         for b in fleet.backends().filter(|b| b.extensions().get::<Tenant>() != tenant) {
    ///             c.pass_over(b);
    ///         }
    ///         self.0.place(fleet, req, c)
    ///     }
    /// }
    ///
    /// let fleet = Snapshot::new()
    ///     .backend("a1", "n1", 1)
    ///     .backend_extension("a1", Tenant("acme"))
    ///     .backend("g1", "n1", 4)
    ///     .backend_extension("g1", Tenant("globex"))
    ///     .extension(Tenant("acme"));
    /// let policy = OwnBackends(NodeThenBackend::new());
    /// assert_eq!(fleet.order(&policy, None, None), ["a1"]);
    /// ```
    pub fn extensions(&self) -> &'a http::Extensions {
        &self.member().extensions
    }

    /// How many leading links of `chain` the cache model says this backend holds.
    /// O(log links).
    pub fn cached_links(&self, chain: &PromptChain) -> usize {
        self.member()
            .cache
            .lock()
            .held_guessing(chain.links(), true)
    }

    /// [`cached_links`](Self::cached_links), for a scan of the fleet: `none_likely` when the
    /// backend scanned before held none of the chain, so that this one looks at the chain's
    /// first link first (see `CacheModel::held_guessing`).
    pub(crate) fn cached_links_guessing(&self, chain: &PromptChain, none_likely: bool) -> usize {
        self.member()
            .cache
            .lock()
            .held_guessing(chain.links(), none_likely)
    }

    /// How many leading links of `chain` the cache model says this backend holds, and how
    /// many held prompts continue the last of them: the conversations here that share that
    /// prefix and branch from it where this request would. One lock, O(log links);
    /// `none_likely` as for [`cached_links_guessing`](Self::cached_links_guessing).
    pub(crate) fn cached_links_and_branches(
        &self,
        chain: &PromptChain,
        none_likely: bool,
    ) -> (usize, u32) {
        let model = self.member().cache.lock();
        match model.held_guessing(chain.links(), none_likely) {
            0 => (0, 0),
            n => (n, model.continuations(chain.links()[n - 1].digest)),
        }
    }

    /// How many of `chain`'s tokens the cache model says this backend would reuse: those of
    /// the longest prefix it holds. O(log links).
    ///
    /// ```
    /// use tower_affinity::placement::Snapshot;
    /// use tower_affinity::PromptChain;
    ///
    /// let served = PromptChain::from_blocks([(1, 1_000), (2, 500)]);
    /// let next = PromptChain::from_blocks([(1, 1_000), (2, 500), (3, 20)]);
    /// let fleet = Snapshot::new().backend("a", "n", 1).holds("a", &served);
    /// assert_eq!(fleet.view().backend(&"a".into()).unwrap().cached_tokens(&next), 1_500);
    /// ```
    pub fn cached_tokens(&self, chain: &PromptChain) -> u64 {
        cache::reuse(&self.member().cache.lock(), chain).1
    }

    /// How long this backend would take to read `tokens` of prompt (in the chain's estimate,
    /// as [`cached_tokens`](Self::cached_tokens) counts them; scaled to the backend's own
    /// count as its answers showed it), by the rate its answers taught, after the prompts it
    /// has been sent and not yet answered: the time to first
    /// token a request lacking `tokens` of its prompt here can expect. `None` until the
    /// backend's prefill rate is learned from its answers (see
    /// [`wait_versus_move`](crate::SessionAffinityLayer::wait_versus_move)); in a test fleet,
    /// until [`Snapshot::prefill_rate`](super::Snapshot::prefill_rate) sets it.
    pub fn time_to_read(&self, tokens: u64) -> Option<Duration> {
        self.member().load.learned.time_to_read(tokens)
    }

    /// Conversations the cache model says this backend homes: the tips of the prompts it
    /// holds.
    pub fn conversations(&self) -> u32 {
        self.member().cache.lock().conversations()
    }

    /// [`conversations`](Self::conversations) with a turn since `since_ms` on the fleet's
    /// clock (0: all of them).
    pub(crate) fn conversations_since(&self, since_ms: u64) -> u32 {
        self.member().cache.lock().live_conversations(since_ms)
    }

    /// Tokens of prompt the cache model says this backend holds, over all conversations.
    pub fn held_tokens(&self) -> u64 {
        self.member().cache.lock().tokens()
    }

    /// This backend's rendezvous score for `key`, weighted by its slots: the higher, the more
    /// the key prefers it. Every router process computes the same score.
    pub fn rendezvous_score(&self, key: SessionKey) -> f64 {
        let m = self.member();
        rendezvous::score(key, m.digest, m.load.slots.load(Ordering::Relaxed))
    }

    pub(crate) fn belongs_to(&self, topology: &Topology) -> bool {
        std::ptr::eq(self.topology, topology)
    }
}

/// The same backend of the same view.
impl PartialEq for BackendRef<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.index == other.index && std::ptr::eq(self.topology, other.topology)
    }
}

impl Eq for BackendRef<'_> {}

impl fmt::Debug for BackendRef<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Backend")
            .field("id", self.id())
            .field("node", self.node().id())
            .field("slots", &self.slots())
            .field("in_flight", &self.in_flight())
            .finish()
    }
}

/// One node, as a policy sees it: its backends and their slots, summed.
///
/// A policy that fills the node with the most free slots first, and within it the backend
/// with the most:
///
/// ```
/// use tower_affinity::placement::{Candidates, FleetView, Placement, PlacementRequest, Snapshot};
///
/// struct EmptiestNode;
///
/// impl Placement for EmptiestNode {
///     fn place(&self, fleet: &FleetView<'_>, _req: &PlacementRequest<'_>, c: &mut Candidates<'_>) {
///         let free = |n: &tower_affinity::placement::NodeRef<'_>| -> u32 {
///             n.backends().map(|b| b.free_slots()).sum()
///         };
///         let Some(node) = fleet.nodes().max_by_key(free) else { return };
///         let mut backends: Vec<_> = node.backends().collect();
///         backends.sort_by_key(|b| std::cmp::Reverse(b.free_slots()));
///         for b in backends {
///             if c.offer(b).is_break() {
///                 return;
///             }
///         }
///     }
/// }
///
/// let fleet = Snapshot::new()
///     .backend("a1", "a", 2)
///     .backend("a2", "a", 2)
///     .backend("b1", "b", 2)
///     .in_flight("a1", 1);
/// let view = fleet.view();
/// let a = view.nodes().find(|n| n.id().as_str() == "a").unwrap();
/// assert_eq!((a.slots(), a.backends().len()), (4, 2));
/// // Node a has 3 free slots to b's 2; within it, a2 has 2 to a1's 1.
/// assert_eq!(fleet.order(&EmptiestNode, None, None), ["a2", "a1"]);
/// ```
#[derive(Clone, Copy)]
pub struct NodeRef<'a> {
    topology: &'a Topology,
    pub(crate) index: u32,
}

impl<'a> NodeRef<'a> {
    pub(crate) fn new(topology: &'a Topology, index: u32) -> Self {
        NodeRef { topology, index }
    }

    fn entry(&self) -> &'a NodeEntry {
        self.topology.node(self.index)
    }

    /// The node's id.
    pub fn id(&self) -> &'a NodeId {
        &self.entry().id
    }

    /// Its live backends.
    pub fn backends(&self) -> impl ExactSizeIterator<Item = BackendRef<'a>> + Clone + 'a {
        let t = self.topology;
        self.entry()
            .backends
            .indexes()
            .map(move |i| BackendRef::new(t, i))
    }

    /// The backend at internal index `index`, which must come from this view.
    pub(crate) fn backend(&self, index: u32) -> BackendRef<'a> {
        BackendRef::new(self.topology, index)
    }

    /// The sum of its live backends' slots.
    pub fn slots(&self) -> u32 {
        self.entry().slots
    }

    /// This node's rendezvous score for `key`, weighted by its slots.
    pub fn rendezvous_score(&self, key: SessionKey) -> f64 {
        let e = self.entry();
        rendezvous::score(key, e.digest, e.slots)
    }

    /// Its live backends, with their rendezvous inputs.
    pub(crate) fn ranks(&self) -> &'a RankSet {
        &self.entry().backends
    }
}

/// The same node of the same view.
impl PartialEq for NodeRef<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.index == other.index && std::ptr::eq(self.topology, other.topology)
    }
}

impl Eq for NodeRef<'_> {}

impl fmt::Debug for NodeRef<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Node")
            .field("id", self.id())
            .field("backends", &self.entry().backends.len())
            .finish()
    }
}

/// Where a session was served last.
///
/// Its backend is gone once discovery removed it; its node stays, so a policy can keep the
/// session on the node that served it. What the backend still holds of the request's prompt
/// is [`cache`](Self::cache): a policy that goes home only while home is warm, and else to
/// the backend of the home's node with the most free slots:
///
/// ```
/// use tower_affinity::key::SessionKey;
/// use tower_affinity::placement::{
///     Candidates, FleetView, HomeCache, Placement, PlacementRequest, Snapshot,
/// };
///
/// struct HomeWhileWarm;
///
/// impl Placement for HomeWhileWarm {
///     fn place(&self, fleet: &FleetView<'_>, req: &PlacementRequest<'_>, c: &mut Candidates<'_>) {
///         let Some(home) = req.home else {
///             // No home: any backend, in the fleet's order.
///             for b in fleet.backends() {
///                 if c.offer(b).is_break() {
///                     return;
///                 }
///             }
///             return;
///         };
///         if let (Some(b), HomeCache::Holds | HomeCache::Unknown) = (home.backend, home.cache) {
///             if c.offer(b).is_break() {
///                 return;
///             }
///         }
///         let mut others: Vec<_> = home.node.backends().collect();
///         others.sort_by_key(|b| std::cmp::Reverse(b.free_slots()));
///         for b in others {
///             if c.offer(b).is_break() {
///                 return;
///             }
///         }
///     }
/// }
///
/// let key = Some(SessionKey::from_bytes(b"s"));
/// let fleet = Snapshot::new()
///     .backend("a1", "a", 2)
///     .backend("a2", "a", 4)
///     .backend("b1", "b", 8);
/// // Warm: home first, then its node's other backend.
/// let warm = fleet.home_cache(HomeCache::Holds);
/// assert_eq!(warm.order(&HomeWhileWarm, key, Some("a1")), ["a1", "a2"]);
/// // Evicted: the node's backend with the most free slots first.
/// let cold = warm.home_cache(HomeCache::Evicted);
/// assert_eq!(cold.order(&HomeWhileWarm, key, Some("a1")), ["a2", "a1"]);
/// // Removed: its node is still its home.
/// let gone = cold.remove("a1");
/// assert_eq!(gone.order(&HomeWhileWarm, key, Some("a1")), ["a2"]);
/// ```
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct Home<'a> {
    /// The backend, or `None` if it has been removed since.
    pub backend: Option<BackendRef<'a>>,
    /// The backend's node. It may have no live backend left.
    pub node: NodeRef<'a>,
    /// What the cache model says the home holds of this request's prompt.
    pub cache: HomeCache,
}

impl<'a> Home<'a> {
    /// A home whose cache is [`HomeCache::Unknown`].
    pub fn new(backend: Option<BackendRef<'a>>, node: NodeRef<'a>) -> Self {
        Home {
            backend,
            node,
            cache: HomeCache::Unknown,
        }
    }

    /// Sets what the home holds.
    pub fn cache(mut self, cache: HomeCache) -> Self {
        self.cache = cache;
        self
    }
}

/// What the cache model says a session's home holds of the session's prompt.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum HomeCache {
    /// Nothing to go by: this turn or the last carried no prompt chain, or the home is gone.
    #[default]
    Unknown,
    /// The home probably still holds the prompt of the session's last turn.
    Holds,
    /// The home probably evicted it (*cold home*): going back there buys nothing.
    Evicted,
    /// This turn does not extend the key's last one (its leading messages changed, or it
    /// shrank): the client compacted its history, or the key carries another conversation
    /// beside it (a sub-agent, a title or side request sent under the same session). The
    /// request's [`prefix`](PlacementRequest::prefix) tells them apart: a prefix of the
    /// conversation's own, held somewhere, is that conversation's last turn.
    Compacted,
}

impl HomeCache {
    /// What `home` holds of `chain`, for a session whose last turn ended at `tip` and was
    /// recorded there with stamp `mark`, and how many leading links of the chain it is then
    /// known to hold. A session recorded after the home's last eviction is held whole, which
    /// needs no look into the model (see [`ModelCell`](crate::cache::ModelCell)); the
    /// record that follows checks the position found.
    pub(crate) fn of(
        home: Option<BackendRef<'_>>,
        tip: u16,
        mark: u32,
        chain: Option<&PromptChain>,
    ) -> (Self, usize) {
        let (Some(chain), Some(home)) = (chain.filter(|c| !c.is_empty()), home) else {
            return (HomeCache::Unknown, 0);
        };
        if tip == 0 {
            return (HomeCache::Unknown, 0);
        }
        let cell = &home.member().cache;
        // The last turn was not taken (too long for the backend's context, say): the next one
        // goes on from the turn before, which the session's entry no longer names. Not a
        // compaction: the home holds what it held, and is as good as any.
        let compacted = || {
            if cell.lock().was_refused(mark) {
                (HomeCache::Unknown, 0)
            } else {
                (HomeCache::Compacted, 0)
            }
        };
        if cell.kept_since(mark) {
            // Searched from the end, where a new link sharing the fingerprint would come
            // first; the record catches that (one in 65,536 a new link).
            return match chain.tip_positions(tip).next() {
                Some(at) => (HomeCache::Holds, at + 1),
                None => compacted(),
            };
        }
        // The fingerprint is 16 bits: a link new in this turn may share it. The last turn
        // ended at a link the home holds, if it holds the session at all.
        let model = cell.lock();
        let mut found = false;
        for at in chain.tip_positions(tip) {
            if model.holds(chain.links()[at].digest) {
                return (HomeCache::Holds, at + 1);
            }
            found = true;
        }
        if found {
            (HomeCache::Evicted, 0)
        } else {
            drop(model);
            compacted()
        }
    }
}

/// The longest prefix of a request's prompt that one backend holds, by the cache model: see
/// [`FleetView::longest_prefix`].
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct Prefix<'a> {
    /// The backend that holds it.
    pub backend: BackendRef<'a>,
    /// How many leading links of the chain it holds.
    pub links: usize,
    /// Their tokens: what the backend would reuse.
    pub tokens: u64,
    /// Whether the prefix is the conversation's own, not one many conversations share. In a
    /// [`PlacementRequest`] with a key, never a prompt held whole: the key says whose
    /// conversation it is.
    pub own: bool,
    /// Whether no other backend holds as much of the chain. A request without a key may wait
    /// for this backend when it is full (see
    /// [`wait_versus_move`](crate::SessionAffinityLayer::wait_versus_move)), own prefix or not.
    pub only: bool,
    /// Whether it is the whole prompt: the backend was sent this very prompt before.
    pub whole: bool,
}

/// What a policy knows about the request it places.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct PlacementRequest<'a> {
    /// The session key, if the request has one.
    pub key: Option<SessionKey>,
    /// Where the session was served last, if the session table knows it.
    pub home: Option<Home<'a>>,
    /// The request's extensions: a layer in front may have put prompt facts there.
    pub extensions: &'a http::Extensions,
    /// A random number drawn for this placement, for policies that sample (a keyless request
    /// samples two backends). The service draws a new one for every attempt; a
    /// [`Snapshot`](super::Snapshot) draws from a fixed sequence, so tests repeat.
    pub random: u64,
    /// The request's prompt chain, if a layer in front read one
    /// ([`PromptFacts`](crate::key::PromptFacts)).
    pub chain: Option<&'a PromptChain>,
    /// The longest prefix of the chain that one backend holds, looked up by the service when
    /// it matters: for requests without a key, new sessions, and sessions whose home is cold
    /// or whose prompt does not extend their last one ([`HomeCache::Compacted`]).
    /// `None` otherwise, or when no backend holds any of it.
    pub prefix: Option<Prefix<'a>>,
}

impl<'a> PlacementRequest<'a> {
    /// A request with the given key and home, and 0 as its random number.
    pub fn new(
        key: Option<SessionKey>,
        home: Option<Home<'a>>,
        extensions: &'a http::Extensions,
    ) -> Self {
        PlacementRequest {
            key,
            home,
            extensions,
            random: 0,
            chain: None,
            prefix: None,
        }
    }

    /// Sets the request's prompt chain.
    pub fn chain(mut self, chain: Option<&'a PromptChain>) -> Self {
        self.chain = chain;
        self
    }

    /// Sets the longest prefix held.
    pub fn prefix(mut self, prefix: Option<Prefix<'a>>) -> Self {
        self.prefix = prefix;
        self
    }

    /// Sets the request's random number.
    pub fn random(mut self, random: u64) -> Self {
        self.random = random;
        self
    }
}

/// The prefix the service gives a request's placement: the longest prefix of its chain when it
/// has no key, no home, a home that evicted it, or a prompt that does not extend the key's last
/// one (a compaction, or another conversation under the same key). A keyed request's key says
/// whose conversation it is, so a prompt held whole elsewhere was another's that opened alike:
/// not its own.
pub(crate) fn request_prefix<'a>(
    view: &FleetView<'a>,
    key: Option<SessionKey>,
    home: Option<Home<'_>>,
    chain: Option<&PromptChain>,
) -> Option<Prefix<'a>> {
    // A keyed request looks for its prefix when its home is no guide: gone, cold, or left
    // behind by a prompt that does not extend the key's last one.
    let wanted = key.is_none()
        || home.is_none_or(|h| matches!(h.cache, HomeCache::Evicted | HomeCache::Compacted));
    let mut prefix = chain
        .filter(|_| wanted)
        .and_then(|c| view.longest_prefix(c))?;
    prefix.own &= key.is_none() || !prefix.whole;
    Some(prefix)
}
