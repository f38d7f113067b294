use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::fleet::Topology;
use crate::key::SessionKey;
use crate::wait::{WaitHome, WaitTicket};
use crate::{BackendId, PromptChain};

use super::rendezvous;
use super::view::request_prefix;
use super::{
    BackendRef, Candidates, FleetView, Home, HomeCache, NodeRef, Placement, PlacementRequest,
};

/// A fleet built by hand, for testing placement policies without a runtime or services.
///
/// ```
/// use tower_affinity::placement::{LeastLoaded, Snapshot};
///
/// let fleet = Snapshot::new()
///     .backend("a", "node-1", 2)
///     .backend("b", "node-1", 2)
///     .in_flight("a", 2);
/// assert_eq!(fleet.choose(&LeastLoaded::new(), None, None), Some("b".into()));
/// ```
#[derive(Debug, Default)]
pub struct Snapshot {
    topology: Topology,
    extensions: http::Extensions,
    chain: Option<PromptChain>,
    home_cache: HomeCache,
    /// How many placements have drawn a random number.
    draws: AtomicU64,
    /// Stand-ins for requests waiting for a slot, by the backend their cache is on.
    waiting: Vec<(u32, WaitTicket)>,
}

impl Snapshot {
    /// An empty fleet.
    pub fn new() -> Self {
        Snapshot::default()
    }

    /// Adds (or updates) backend `id` on `node` with `slots` slots (0 is read as 1).
    pub fn backend(mut self, id: &str, node: &str, slots: u32) -> Self {
        let slots = NonZeroU32::new(slots).unwrap_or(NonZeroU32::MIN);
        self.topology.insert(
            id.into(),
            &node.into(),
            slots,
            None,
            crate::Backend::<()>::DEFAULT_CACHE_TOKENS,
        );
        self
    }

    /// Attaches `value` to backend `id`, as [`Backend::extension`](crate::Backend::extension)
    /// does, for a policy to read ([`BackendRef::extensions`](super::BackendRef::extensions)).
    /// Unknown ids are ignored.
    pub fn backend_extension<T: Clone + Send + Sync + 'static>(
        mut self,
        id: &str,
        value: T,
    ) -> Self {
        if let Some(i) = self.topology.index_any(id) {
            self.topology.members[i as usize].extensions.insert(value);
        }
        self
    }

    /// Declares the view one of `n` router replicas sharing the fleet's traffic, as
    /// [`SessionAffinityLayer::replicas`](crate::SessionAffinityLayer::replicas) does (0 is
    /// read as 1): a replica homes its share of conversations.
    pub fn replicas(mut self, n: u32) -> Self {
        self.topology.replicas = n.max(1);
        self
    }

    /// Sets backend `id`'s cache budget in tokens (default
    /// [`Backend::DEFAULT_CACHE_TOKENS`](crate::Backend::DEFAULT_CACHE_TOKENS)), as
    /// [`Backend::cache_tokens`](crate::Backend::cache_tokens) declares it; what its model
    /// holds beyond the budget is evicted, least recently used first. Unknown ids are ignored.
    ///
    /// ```
    /// use tower_affinity::placement::Snapshot;
    /// use tower_affinity::PromptChain;
    ///
    /// let (first, second) = (
    ///     PromptChain::from_blocks([(1, 600), (2, 100)]),
    ///     PromptChain::from_blocks([(3, 600), (4, 100)]),
    /// );
    /// let fleet = Snapshot::new()
    ///     .backend("a", "n", 1)
    ///     .cache_tokens("a", 1_000)
    ///     .holds("a", &first)
    ///     .holds("a", &second);
    /// // 1,400 tokens do not fit in 1,000: the first conversation was evicted.
    /// let a = fleet.view().backend(&"a".into()).unwrap();
    /// assert_eq!(a.cached_tokens(&first), 0);
    /// assert_eq!(a.cached_tokens(&second), 700);
    /// ```
    pub fn cache_tokens(self, id: &str, tokens: u64) -> Self {
        if let Some(i) = self.topology.index_any(id) {
            self.topology.member(i).cache.lock().set_budget(tokens);
        }
        self
    }

    /// Records on backend `id`'s cache model that it served a prompt with `chain`, as the
    /// service does for every dispatched request. Unknown ids are ignored.
    pub fn holds(self, id: &str, chain: &PromptChain) -> Self {
        if let Some(i) = self.topology.index_any(id) {
            self.topology
                .member(i)
                .cache
                .record_from(chain.links(), 0, 0);
        }
        self
    }

    /// The prompt chain of the requests placed from now on: policies see it, and the longest
    /// prefix held is looked up for it as the service would.
    pub fn prompt(mut self, chain: PromptChain) -> Self {
        self.chain = Some(chain);
        self
    }

    /// Puts `value` in the extensions of the requests placed from now on, for a policy that
    /// reads something a layer in front put there.
    ///
    /// ```
    /// use tower_affinity::placement::{Candidates, FleetView, Placement, PlacementRequest, Snapshot};
    ///
    /// /// Sends requests marked `Pin` to the backend the mark names.
    /// #[derive(Clone)]
    /// struct Pinned;
    /// #[derive(Clone)]
    /// struct Pin(&'static str);
    ///
    /// impl Placement for Pinned {
    ///     fn place(&self, fleet: &FleetView<'_>, req: &PlacementRequest<'_>, c: &mut Candidates<'_>) {
    ///         let pin = req.extensions.get::<Pin>().map(|p| p.0);
    ///         for b in fleet.backends().filter(|b| pin.is_none_or(|p| b.id().as_str() == p)) {
    ///             if c.offer(b).is_break() {
    ///                 return;
    ///             }
    ///         }
    ///     }
    /// }
    ///
    /// let fleet = Snapshot::new().backend("a", "n", 1).backend("b", "n", 1);
    /// assert_eq!(fleet.choose(&Pinned, None, None), Some("a".into()));
    /// let fleet = fleet.extension(Pin("b"));
    /// assert_eq!(fleet.choose(&Pinned, None, None), Some("b".into()));
    /// ```
    pub fn extension<T: Clone + Send + Sync + 'static>(mut self, value: T) -> Self {
        self.extensions.insert(value);
        self
    }

    /// What the home of the requests placed from now on holds (default
    /// [`HomeCache::Unknown`]); the service works it out from the session's last turn.
    pub fn home_cache(mut self, cache: HomeCache) -> Self {
        self.home_cache = cache;
        self
    }

    /// Sets backend `id`'s prompt-cache budget in bytes, as
    /// [`Backend::prompt_cache_bytes`](crate::Backend::prompt_cache_bytes) records it, for a
    /// policy to read ([`BackendRef::prompt_cache_bytes`](super::BackendRef::prompt_cache_bytes)).
    /// The cache model and the built-in policies do not read it. [`backend`](Self::backend)
    /// called again for `id` clears it, as a backend announced again without a budget has
    /// none. Unknown ids are ignored.
    ///
    /// ```
    /// use tower_affinity::placement::Snapshot;
    ///
    /// let fleet = Snapshot::new()
    ///     .backend("a", "n", 1)
    ///     .backend("b", "n", 1)
    ///     .prompt_cache_bytes("a", 8 << 30);
    /// let view = fleet.view();
    /// assert_eq!(view.backend(&"a".into()).unwrap().prompt_cache_bytes(), Some(8 << 30));
    /// assert_eq!(view.backend(&"b".into()).unwrap().prompt_cache_bytes(), None);
    /// ```
    pub fn prompt_cache_bytes(mut self, id: &str, bytes: u64) -> Self {
        if let Some(i) = self.topology.index_of(id) {
            self.topology.members[i as usize].prompt_cache_bytes = Some(bytes);
        }
        self
    }

    /// Sets backend `id`'s prefill rate, the prompt tokens it reads a second, as its answers
    /// would teach it (0: not learned). A backend of a `Snapshot` counts a prompt's tokens as
    /// the chain estimates them and has no prompt left to read, so
    /// [`BackendRef::time_to_read(tokens)`](super::BackendRef::time_to_read) answers `tokens /
    /// tokens_per_second` seconds, and `None` until a rate other than 0 is set. Unknown ids
    /// are ignored.
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// use tower_affinity::placement::Snapshot;
    ///
    /// let fleet = Snapshot::new()
    ///     .backend("a", "n", 1)
    ///     .backend("b", "n", 1)
    ///     .prefill_rate("a", 400);
    /// let view = fleet.view();
    /// let a = view.backend(&"a".into()).unwrap();
    /// assert_eq!(a.time_to_read(2_000), Some(Duration::from_secs(5)));
    /// assert_eq!(a.time_to_read(100), Some(Duration::from_millis(250)));
    /// assert_eq!(view.backend(&"b".into()).unwrap().time_to_read(2_000), None);
    /// ```
    pub fn prefill_rate(self, id: &str, tokens_per_second: u32) -> Self {
        if let Some(i) = self.topology.index_of(id) {
            let load = &self.topology.member(i).load;
            load.learned.set_prefill_rate(tokens_per_second);
        }
        self
    }

    /// Sets how many requests backend `id` is serving. Unknown ids are ignored.
    pub fn in_flight(self, id: &str, in_flight: u32) -> Self {
        if let Some(i) = self.topology.index_of(id) {
            let load = &self.topology.member(i).load;
            load.in_flight.store(in_flight, Ordering::Relaxed);
        }
        self
    }

    /// Sets how many of backend `id`'s slots are promised to waiting requests woken for them:
    /// [`free_slots`](super::BackendRef::free_slots) leaves them out, as the service does
    /// until those requests take them. Unknown ids are ignored.
    ///
    /// ```
    /// use tower_affinity::placement::Snapshot;
    ///
    /// let fleet = Snapshot::new().backend("a", "n", 2).in_flight("a", 1).promised("a", 1);
    /// let view = fleet.view();
    /// let a = view.backend(&"a".into()).unwrap();
    /// assert_eq!((a.in_flight(), a.free_slots()), (1, 0));
    /// ```
    pub fn promised(self, id: &str, promised: u32) -> Self {
        if let Some(i) = self.topology.index_of(id) {
            let load = &self.topology.member(i).load;
            load.reserved.store(promised, Ordering::Relaxed);
        }
        self
    }

    /// Sets how many requests wait for a slot with their cache on backend `id` (sessions homed
    /// there, prompts whose longest prefix it holds):
    /// [`BackendRef::waiting`](super::BackendRef::waiting) counts them. Unknown ids are
    /// ignored.
    pub fn waiting(mut self, id: &str, waiting: u32) -> Self {
        let Some(i) = self.topology.index_of(id) else {
            return self;
        };
        self.waiting.retain(|(b, _)| *b != i);
        let home = WaitHome {
            backend: Some(i),
            node: Some(self.topology.member(i).node),
            ..WaitHome::default()
        };
        for _ in 0..waiting {
            if let Some(ticket) = WaitTicket::take(&self.topology.capacity, home, usize::MAX) {
                self.waiting.push((i, ticket));
            }
        }
        self
    }

    /// Marks backend `id` down: the service passes it over until it is marked up.
    pub fn down(self, id: &str) -> Self {
        if let Some(i) = self.topology.index_of(id) {
            let _ = self.topology.member(i).load.mark_down(u64::MAX, 0);
        }
        self
    }

    /// Removes backend `id`; a session homed there keeps the node as its home.
    pub fn remove(self, id: &str) -> Self {
        self.in_flight(id, 0).remove_idle(id)
    }

    fn remove_idle(mut self, id: &str) -> Self {
        self.topology.remove(&id.into());
        self
    }

    /// The view a policy would get.
    pub fn view(&self) -> FleetView<'_> {
        FleetView::at(&self.topology, 0)
    }

    /// The random number of the next placement: a fixed sequence, so tests repeat.
    fn draw(&self) -> u64 {
        rendezvous::mix(self.draws.fetch_add(1, Ordering::Relaxed).wrapping_add(1))
    }

    fn home(&self, id: &str) -> Option<Home<'_>> {
        let index = self.topology.index_any(id)?;
        let m = self.topology.member(index);
        let backend = m.live.then(|| BackendRef::new(&self.topology, index));
        let cache = if backend.is_some() {
            self.home_cache
        } else {
            HomeCache::Unknown
        };
        Some(Home::new(backend, NodeRef::new(&self.topology, m.node)).cache(cache))
    }

    /// The request a policy gets, with its prefix looked up as the service does.
    fn request(&self, key: Option<SessionKey>, home: Option<&str>) -> PlacementRequest<'_> {
        let home = home.and_then(|h| self.home(h));
        let view = self.view();
        let chain = self.chain.as_ref();
        let prefix = request_prefix(&view, key, home, chain);
        PlacementRequest::new(key, home, &self.extensions)
            .random(self.draw())
            .chain(chain)
            .prefix(prefix)
    }

    /// Every backend `policy` offers, in its order of preference, for a request with `key`
    /// whose session was last served by `home` (a backend id, possibly removed).
    pub fn order<P>(
        &self,
        policy: &P,
        key: Option<SessionKey>,
        home: Option<&str>,
    ) -> Vec<BackendId>
    where
        P: Placement + ?Sized,
    {
        let mut seen = Vec::new();
        {
            let view = self.view();
            let req = self.request(key, home);
            let mut c = Candidates::collect(&self.topology, 1, &mut seen);
            policy.place(&view, &req, &mut c);
        }
        seen.into_iter()
            .map(|i| self.topology.member(i).id.clone())
            .collect()
    }

    /// The backend the service would choose: the first in `policy`'s order with a free slot.
    /// Takes no slot and allocates nothing.
    pub fn choose<P>(
        &self,
        policy: &P,
        key: Option<SessionKey>,
        home: Option<&str>,
    ) -> Option<BackendId>
    where
        P: Placement + ?Sized,
    {
        let view = self.view();
        let req = self.request(key, home);
        let mut c = Candidates::probe(&self.topology, 1);
        policy.place(&view, &req, &mut c);
        c.chosen().map(|i| self.topology.member(i).id.clone())
    }
}
