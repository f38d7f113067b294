use std::ops::ControlFlow;
use std::time::Duration;

use crate::key::SessionKey;

use super::{
    freer_of_two, most_free_slots, rendezvous, BackendRef, Candidates, FleetView, HomeCache,
    NodeRef, Placement, PlacementRequest, Ties,
};

/// The default policy: keep a session close to the cache that served it last.
///
/// For a session with a home, the preference order is:
///
/// 1. the home backend;
/// 2. the other backends on the home's node (a move within a host was measured about five
///    times cheaper than one between hosts: a backend there may still hold an older state of
///    the session in its host-memory prompt cache, and the session's earlier moves stayed near);
/// 3. the other nodes, in the key's rendezvous order, and within each node its backends in the
///    key's rendezvous order.
///
/// A new session takes the same rendezvous order over all nodes, so two router processes with
/// the same fleet make the same first choice, and removing a backend moves only the sessions
/// homed there. With a [load bound](NodeThenBackend::load_bound) a new session first skips any
/// backend already more than `1 + epsilon` times as busy as the fleet on average, so one key
/// space cannot pile sessions onto one backend; the skipped backends are still offered last.
///
/// Its bounds only order the backends: in the end it offers every backend, and it
/// [passes over](Candidates::pass_over) none. A request it places is refused with
/// [`Error::NoBackends`](crate::Error::NoBackends) only when the fleet is empty or every
/// backend is down (its `up` is 0), never because the policy passed over the backends up:
/// while one is up, the request at worst finds no free slot.
///
/// # What the caches hold
///
/// When the request carries a [prompt chain](crate::PromptChain) (put there by
/// [`BodyKeyLayer`](crate::key::BodyKeyLayer)), the cache model decides with it:
///
/// - a session whose home still holds its last prompt goes home, as above;
/// - a session whose home evicted it (a *cold home*) is placed like a new session that prefers
///   the backend holding the longest prefix of its prompt, when that prefix is its own. Among
///   the backends holding as long a prefix (a system prompt many conversations share), the
///   home comes last: it could not keep this conversation, and taking it back would evict
///   another of those it homes;
/// - a session whose prompt no longer extends its last one (*compaction*) is counted apart and
///   stays where it was if there is room: no cache holds the rewritten prompt, so no backend is
///   better than its home. Unless a backend holds a prefix of it that is the conversation's
///   own: then the key carries more than one conversation (sub-agents, or a title or side
///   request sent under the same session, as Claude Code and OpenCode send them), another went
///   home in between, and this one goes first to the backend holding its own prefix, then to
///   that backend's node (a *prefix hit*, not a compaction);
/// - a request without a key goes to the backend holding the longest prefix of its prompt when
///   that prefix is the conversation's own (see [`FleetView::longest_prefix`]; a prompt sent
///   whole once before is a turn sent again, and goes where it was sent), then to the other
///   backends on that backend's node; otherwise it is placed by load;
/// - a new conversation, keyed or keyless, goes first to the backend holding the longest prefix
///   of its prompt, unless as many conversations as the backend's share (the
///   [conversation bound](NodeThenBackend::conversation_bound)) already branch from that
///   prefix there: a system prompt every conversation shares draws new ones only up to the
///   bound, while a long prefix few others continue (a conversation's last prompt that ended
///   inside a block, whose ragged end the next turn drops; a branch) draws the next turn to
///   where it is held, however many other conversations that backend homes. With no slot
///   of the holder free (each taken, or promised to a request woken to take it), its share is
///   of the conversations that branch from the prompt's prefixes anywhere, not of every
///   conversation the models remember: agents that open at once with a prompt first read
///   there are not all drawn to one backend's slots;
/// - new conversations, keyed or keyless, are spread by the conversations each backend homes
///   (the cache model's count of those with a turn within the
///   [live window](NodeThenBackend::live_window), five minutes by default), not only by
///   requests in flight: agents think between turns, so in flight is near zero when each sends
///   one turn at a time. A keyless one goes to the
///   backend with the fewest requests in flight for its slots, and among those (often all of
///   them) the fewest conversations for its slots: a busy backend reads a new prompt only
///   after those it has. A keyed one takes its rendezvous order, skipping any backend
///   that would home more than `1 + epsilon` times its share of slots (see
///   [`conversation_bound`](NodeThenBackend::conversation_bound); default
///   [`DEFAULT_CONVERSATION_BOUND`](NodeThenBackend::DEFAULT_CONVERSATION_BOUND)).
///
/// A request without a key or chain goes to the freer of two backends sampled at random (power
/// of two choices); if neither has a free slot, to the backend with the most free slots, ties
/// by a rank of the request's random number. Wherever a keyless request's backends have as
/// many free slots, the tie goes by a rank of its prompt (or random number) and each backend's
/// id, not by the order the backends were discovered in.
///
/// Placement is by rendezvous score weighted by slots, at the node level and then within the
/// node: a new session costs O(nodes + backends on the chosen node); a home hit costs one offer.
///
/// ```
/// use tower_affinity::key::SessionKey;
/// use tower_affinity::placement::{NodeThenBackend, Snapshot};
///
/// let fleet = Snapshot::new()
///     .backend("a1", "a", 1)
///     .backend("a2", "a", 1)
///     .backend("b1", "b", 1)
///     .in_flight("a1", 1);
/// let key = Some(SessionKey::from_bytes(b"s"));
/// // The home is full: the session spills to the other backend on the home's node.
/// assert_eq!(fleet.choose(&NodeThenBackend::new(), key, Some("a1")), Some("a2".into()));
/// ```
#[derive(Clone, Copy, Debug)]
pub struct NodeThenBackend {
    load_bound: Option<f64>,
    conversation_bound: Option<f64>,
    /// See [`live_window`](Self::live_window); 0: every conversation the models hold.
    live_window_ms: u64,
}

impl Default for NodeThenBackend {
    fn default() -> Self {
        Self::new()
    }
}

/// Negative or non-finite values are read as 0.
fn epsilon(e: f64) -> f64 {
    if e.is_finite() {
        e.max(0.0)
    } else {
        0.0
    }
}

impl NodeThenBackend {
    /// The default [conversation bound](Self::conversation_bound): a backend homes at most a
    /// quarter more than its share of the conversations (rounded up).
    pub const DEFAULT_CONVERSATION_BOUND: f64 = 0.25;

    /// The default [live window](Self::live_window): five minutes.
    pub const DEFAULT_LIVE_WINDOW: Duration = Duration::from_secs(300);

    /// The policy with the default conversation bound and live window, and no load bound.
    pub const fn new() -> Self {
        NodeThenBackend {
            load_bound: None,
            conversation_bound: Some(Self::DEFAULT_CONVERSATION_BOUND),
            live_window_ms: Self::DEFAULT_LIVE_WINDOW.as_millis() as u64,
        }
    }

    /// How recent a conversation's last turn must be for it to count where new conversations
    /// are spread (by the [conversation bound](Self::conversation_bound) and by load): a
    /// conversation with no turn for longer has probably ended. Its cache is still modelled,
    /// and its next turn, if it comes, still goes where that cache is.
    ///
    /// Agents that come in waves, each with a system prompt of its own, are what it is for:
    /// counted against every conversation the models remember, a backend's share is large,
    /// and a new system prompt's holder draws many of the new wave's conversations onto its
    /// slots while the other backends stand idle. In the swarm (`--sessions 102 --waves 3
    /// --turns 20 --wave-gap 1500 --keyless`), three waves of 34 keyless agents on 34 slots,
    /// 25 minutes apart, reuse 96.7%, 93.2% and 93.7% of their later turns counting every
    /// conversation, and 96.7%, 96.4% and 94.0% with the default window.
    ///
    /// Read to about ten seconds. Each backend keeps the times of its last 64 spans of ten
    /// seconds that had a record, at least ten minutes: a longer window reaches back no
    /// further. `Duration::ZERO` counts every conversation the models hold.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_affinity::placement::NodeThenBackend;
    ///
    /// let policy = NodeThenBackend::new().live_window(Duration::from_secs(120));
    /// # let _ = policy;
    /// ```
    pub fn live_window(mut self, window: Duration) -> Self {
        self.live_window_ms = u64::try_from(window.as_millis()).unwrap_or(u64::MAX);
        self
    }

    /// Conversations count from this time on the fleet's clock (0: all of them).
    fn live_since(&self, fleet: &FleetView<'_>) -> u64 {
        match (self.live_window_ms, fleet.now_ms) {
            (0, _) | (_, 0) => 0,
            (w, now) => now.saturating_sub(w),
        }
    }

    /// Bounds the load new sessions may add to one backend: a backend whose share of taken
    /// slots would exceed `1 + epsilon` times the fleet's is offered to new sessions only
    /// after the backends within the bound, so it takes one only when none of those does
    /// (they are full, or down). It is skipped, not [passed over](Candidates::pass_over): a
    /// request is never refused for the bound. At low load no backend may be within it (one
    /// request more is a large share of a backend of a few slots): the bound then skips no
    /// backend. Negative or non-finite values are read as 0.
    ///
    /// With the [conversation bound](Self::conversation_bound) (on by default), a new session
    /// takes the first backend in its rendezvous order within both bounds, then within the
    /// load bound alone, then within the conversation bound alone, then any.
    ///
    /// ```
    /// use tower_affinity::key::SessionKey;
    /// use tower_affinity::placement::{NodeThenBackend, Snapshot};
    ///
    /// let fleet = || Snapshot::new().backend("a", "a", 4).backend("b", "b", 4);
    /// let key = Some(SessionKey::from_bytes(b"s"));
    /// let first = fleet().choose(&NodeThenBackend::new(), key, None).unwrap();
    /// let other = if first.as_str() == "a" { "b" } else { "a" };
    /// // The key's first choice has 3 of its 4 slots taken, the other none: with this session,
    /// // 4 of the fleet's 8. The first choice would be at 4 of 4, past 1.25 times that.
    /// let busy = fleet().in_flight(first.as_str(), 3);
    /// assert_eq!(busy.choose(&NodeThenBackend::new(), key, None), Some(first));
    /// let bounded = NodeThenBackend::new().load_bound(0.25);
    /// assert_eq!(busy.choose(&bounded, key, None), Some(other.into()));
    /// ```
    pub fn load_bound(mut self, epsilon: f64) -> Self {
        self.load_bound = Some(self::epsilon(epsilon));
        self
    }

    /// Bounds the conversations one backend homes: a new keyed session skips a backend
    /// that would then home more than `1 + epsilon` times its share of the fleet's
    /// conversations by slots (those with a turn within the [live window](Self::live_window);
    /// rounded up, and never fewer than its slots: over the router
    /// replicas declared with [`replicas`](crate::SessionAffinityLayer::replicas), its share
    /// of them), while another has room below the bound; the skipped backends are still
    /// offered last. Negative or
    /// non-finite values are read as 0.
    ///
    /// A backend holding some of a new conversation's prompt is offered first unless the
    /// conversations that branch from that prefix there already reach the bound: those are what
    /// the prefix drew, and the conversations it homes besides came by other prefixes or by
    /// load. While no slot of it is free (each taken, or promised to a waiting request woken
    /// for it), the bound there is its share of the conversations that branch from the prompt's
    /// prefixes on any backend, not of all the fleet's: some of those may have ended within the
    /// live window, and agents that open at once with a prompt first read on one backend would
    /// otherwise all go to it (and wait for its slots, where reading the prompt elsewhere costs
    /// more), then share them. A prefix every conversation shares is branched from by all of
    /// them, so it draws new ones only up to the bound. What this leaves open: a backend may
    /// hold several prefixes that each draw up to the bound, so it may home more than its share
    /// when the conversations fall into groups sharing a long prefix each.
    ///
    /// The bound needs the cache model's counts, which come from prompt chains: a request
    /// without one (no body-reading layer in front) takes its rendezvous order unbounded.
    ///
    /// What it costs agreement: two router replicas place a new session alike as long as
    /// neither sees its first rendezvous choice at the bound. Each counts the conversations it
    /// placed itself, so near the bound they may choose differently; a shared session store
    /// then makes the first placement the one both follow. And each replica bounds only what
    /// it placed: `r` replicas that place new conversations at the same time may home up to
    /// `r` times one's bound on a backend, above all on the backends holding a system prompt
    /// every conversation shares, which draw new ones up to the bound in each replica.
    /// Declared as one of `r` replicas, each lets a backend home at least its share of the
    /// backend's slots (`slots / r`, rounded up) rather than all of them, so that together
    /// they fill a backend's slots, not `r` times them, before the bound spreads
    /// conversations.
    pub fn conversation_bound(mut self, epsilon: f64) -> Self {
        self.conversation_bound = Some(self::epsilon(epsilon));
        self
    }

    /// New sessions take their rendezvous order without regard to the conversations each
    /// backend homes.
    pub fn no_conversation_bound(mut self) -> Self {
        self.conversation_bound = None;
        self
    }
}

impl NodeThenBackend {
    /// The conversation bound over the fleet's conversations for a new conversation, if it
    /// applies (the bound is on and the request carries a chain). O(backends): read once a
    /// placement.
    fn new_session_bound(
        &self,
        fleet: &FleetView<'_>,
        req: &PlacementRequest<'_>,
    ) -> Option<Bound> {
        self.conversation_bound
            .filter(|_| req.chain.is_some())
            .map(|e| Bound::conversations(fleet, e, self.live_since(fleet)))
    }

    /// Offers the backends that hold some of a new conversation's prompt, the longest prefix
    /// first, skipping any where the conversations that share the prefix, branching
    /// from it there, already reach the backend's share of conversations: a prefix many
    /// conversations share draws new ones only up to the bound, and the bound is what spreads
    /// them. A prefix few others continue is not skipped for the conversations the
    /// backend homes besides: they did not come for this prefix, and a conversation whose
    /// turn ends inside a block (a text prompt, or a long message cut into blocks) leaves its
    /// ragged end behind as a conversation of its own at every turn, so a backend serving long
    /// conversations looks full of them. Among equal prefixes, a keyed conversation takes its
    /// rendezvous order (so router replicas with the same caches agree) and a keyless one the
    /// backend with the fewest requests in flight, then the fewest conversations, for its
    /// slots (ties as in [`least_loaded_for_new`], which every router breaks alike). A prompt
    /// already held whole draws nothing here: sent whole once before and without a key, it is
    /// a turn sent again, which its own prefix placed; otherwise it says nothing of which
    /// conversation it is. `cold`, a cold home, comes after the other
    /// backends holding as much. `all` is the conversation bound over the fleet's
    /// conversations ([`new_session_bound`](Self::new_session_bound)), which the caller's
    /// later passes use too. O(backends x log links).
    fn offer_holders(
        &self,
        fleet: &FleetView<'_>,
        req: &PlacementRequest<'_>,
        all: Option<Bound>,
        cold: Option<u32>,
        c: &mut Candidates<'_>,
    ) -> ControlFlow<()> {
        let (Some(chain), Some(all), Some(e)) = (req.chain, all, self.conversation_bound) else {
            return ControlFlow::Continue(());
        };
        // Each holder, with the conversations held there that branch from the longest prefix
        // it holds: what the prompt's prefixes drew there.
        let mut none_likely = true;
        let mut drawn = 0u64;
        let held: Vec<(usize, u32, BackendRef<'_>)> = fleet
            .backends()
            .filter_map(|b| {
                let (links, branches) = b.cached_links_and_branches(chain, none_likely);
                none_likely = links == 0;
                drawn += u64::from(branches);
                (links > 0 && links < chain.len()).then_some((links, branches, b))
            })
            .collect();
        // A holder draws new conversations within the bound over the conversations with a
        // turn within the live window, some ended among them. With no slot free (taken, or
        // promised to a woken waiter), only within its share of those the prompt's prefixes
        // drew: agents that open with a prompt first read there would otherwise all wait for
        // it, then share its slots.
        let busy = Bound::among(fleet, drawn, e, 0);
        // Ties between keyless holders go by a rank of the prompt that every router computes
        // alike, whatever order it discovered the backends in.
        let tie = chain.links().last().map_or(0, |l| l.digest);
        let mut holders: Vec<(usize, HolderOrder, BackendRef<'_>)> = held
            .into_iter()
            .filter(|(_, branches, b)| {
                let bound = if b.free_slots() > 0 { &all } else { &busy };
                bound.admits_homing(b, *branches)
            })
            .map(|(links, _, b)| {
                let order = match req.key {
                    // Higher scores first: ranks that sort ascending.
                    Some(key) => ((u64::MAX - b.rendezvous_score(key).to_bits(), 0, 0), 0, 0),
                    None => (
                        spread_load(fleet, &b, self.live_since(fleet)),
                        u32::MAX - b.free_slots(),
                        u64::MAX - rendezvous::tie_rank(tie, b.member().digest),
                    ),
                };
                (links, order, b)
            })
            .collect();
        holders.sort_by_key(|&(links, order, b)| {
            (std::cmp::Reverse(links), Some(b.index) == cold, order)
        });
        holders.into_iter().try_for_each(|(_, _, b)| c.offer(b))
    }
}

/// The order of holders of as long a prefix, lowest first: for a keyed conversation its
/// rendezvous rank; for a keyless one its [`spread_load`], then the most free slots, then the
/// highest [`tie_rank`](rendezvous::tie_rank) of the prompt.
type HolderOrder = ((u64, u64, u64), u32, u64);

/// How loaded a backend is for spreading new keyless conversations: its requests in flight
/// for its slots (a busy backend reads a new prompt only after those it has); between equals
/// (agents think between turns, so often every backend has none), the conversations it homes,
/// this one included, for its slots; then the tokens it holds for its slots (a conversation
/// that extended a prompt every backend holds adds no tip, but it adds tokens). Scaled to
/// integers.
fn spread_load(fleet: &FleetView<'_>, b: &BackendRef<'_>, since_ms: u64) -> (u64, u64, u64) {
    let total_slots = u64::from(fleet.topology.total_slots.max(1));
    let slots = u64::from(b.slots().max(1));
    let (conversations, tokens) = {
        let mut model = b.member().cache.lock();
        (
            u64::from(model.live_conversations(since_ms)),
            model.tokens(),
        )
    };
    (
        u64::from(b.in_flight()) * total_slots / slots,
        (conversations + 1) * total_slots / slots,
        tokens.saturating_mul(total_slots) / slots,
    )
}

impl Placement for NodeThenBackend {
    fn place(&self, fleet: &FleetView<'_>, req: &PlacementRequest<'_>, c: &mut Candidates<'_>) {
        let Some(key) = req.key else {
            // Ties are broken by the prompt itself, so a replay places alike every time, and so
            // does another router, whatever order it discovered the backends in.
            let tie = req
                .chain
                .and_then(|chain| chain.links().last())
                .map_or(req.random, |l| l.digest);
            if let Some(p) = req.prefix.filter(|p| p.own) {
                if offer_near(p.backend, tie, c).is_break() {
                    return;
                }
            }
            if req.chain.is_some() {
                let all = self.new_session_bound(fleet, req);
                if self.offer_holders(fleet, req, all, None, c).is_break() {
                    return;
                }
                let _ = least_loaded_for_new(fleet, tie, self.live_since(fleet), c);
            } else {
                let _ = freer_of_two(fleet, req.random, c);
            }
            return;
        };
        let _ = match req.home {
            // A compacted session goes home too: no cache holds its new prompt, so the home is
            // as good as any, and its node may hold the system prompt.
            Some(home) if home.cache != HomeCache::Evicted => {
                // A prompt that does not extend the key's last one, but extends a prompt of its
                // own held elsewhere: another conversation under the same key (a sub-agent, a
                // side request) went home in between. This one goes back to its own.
                if home.cache == HomeCache::Compacted {
                    if let Some(p) = req.prefix.filter(|p| p.own) {
                        if offer_own_prefix(p.backend, key, c).is_break() {
                            return;
                        }
                    }
                }
                // Home, then its node, then everywhere else.
                let skip = home.backend.map(|b| b.index);
                if let Some(b) = home.backend {
                    if c.offer(b).is_break() {
                        return;
                    }
                }
                if offer_node(home.node, key, skip, Bound::NONE, c).is_break() {
                    return;
                }
                offer_nodes(fleet, key, Some(home.node.index), Bound::NONE, c)
            }
            // A cold home, or a new session.
            _ => {
                // A cold home comes after the other backends that hold as much of the prompt:
                // it evicted this conversation.
                let cold = req
                    .home
                    .filter(|h| h.cache == HomeCache::Evicted)
                    .and_then(|h| h.backend)
                    .map(|b| b.index);
                if let Some(p) = req.prefix.filter(|p| p.own) {
                    if offer_own_prefix(p.backend, key, c).is_break() {
                        return;
                    }
                }
                let conversations = self.new_session_bound(fleet, req);
                if self
                    .offer_holders(fleet, req, conversations, cold, c)
                    .is_break()
                {
                    return;
                }
                if let Some(e) = self.load_bound {
                    let load = Bound::load(fleet, e);
                    // Within both bounds first: the load bound alone would take a backend
                    // homing more than its share of conversations while another is within
                    // both.
                    if let Some(both) = conversations.map(|b| load.and(b)) {
                        if offer_nodes(fleet, key, None, both, c).is_break() {
                            return;
                        }
                    }
                    if offer_nodes(fleet, key, None, load, c).is_break() {
                        return;
                    }
                }
                if let Some(bound) = conversations {
                    if offer_nodes(fleet, key, None, bound, c).is_break() {
                        return;
                    }
                }
                offer_nodes(fleet, key, None, Bound::NONE, c)
            }
        };
    }
}

/// Which backends a new session may take on a first pass: those within a load bound, a
/// conversation bound, both or neither (a bound left out is infinite).
///
/// One shape for every pass, not a variant for each: with a variant for both bounds, the
/// check was no longer inlined where a new session's passes make it, and a new session's
/// call path took about 200 instructions more (callgrind, 16x8).
#[derive(Clone, Copy)]
struct Bound {
    /// Utilisation after this request must stay within this, times the backend's slots.
    load: f64,
    /// Conversations homed, times the fleet's slots over the backend's, must stay within
    /// this; but a backend may always home its share of its slots, one in `replicas`.
    per_slot: f64,
    replicas: u32,
    /// Conversations count toward `per_slot` when they had a turn since this time on the
    /// fleet's clock (0: all of them).
    since_ms: u64,
}

impl Bound {
    /// No bound: every backend.
    const NONE: Bound = Bound {
        load: f64::INFINITY,
        per_slot: f64::INFINITY,
        replicas: 1,
        since_ms: 0,
    };

    fn load(fleet: &FleetView<'_>, epsilon: f64) -> Self {
        let slots = fleet.topology.total_slots.max(1);
        let avg = (fleet.in_flight() + 1) as f64 / f64::from(slots);
        Bound {
            load: (1.0 + epsilon) * avg,
            ..Bound::NONE
        }
    }

    /// The conversation bound over the conversations with a turn since `since_ms` (0: all).
    fn conversations(fleet: &FleetView<'_>, epsilon: f64, since_ms: u64) -> Self {
        let live = fleet
            .backends()
            .map(|b| u64::from(b.conversations_since(since_ms)))
            .sum();
        Self::among(fleet, live, epsilon, since_ms)
    }

    /// The conversation bound for a backend's share of `conversations`, by slots, counting
    /// each backend's conversations since `since_ms`.
    fn among(fleet: &FleetView<'_>, conversations: u64, epsilon: f64, since_ms: u64) -> Self {
        let slots = fleet.topology.total_slots.max(1);
        Bound {
            per_slot: (1.0 + epsilon) * (conversations + 1) as f64 / f64::from(slots),
            replicas: fleet.topology.replicas.max(1),
            since_ms,
            ..Bound::NONE
        }
    }

    /// This bound's load bound and `other`'s conversation bound, both.
    fn and(self, other: Bound) -> Self {
        Bound {
            load: self.load,
            ..other
        }
    }

    fn admits(&self, b: &BackendRef<'_>) -> bool {
        // The conversations are counted (a lock of the backend's model) only for a bound on
        // them.
        let homed = match self.per_slot {
            f64::INFINITY => 0,
            _ => b.conversations_since(self.since_ms),
        };
        self.admits_homing(b, homed)
    }

    /// [`admits`](Self::admits), counting `homed` conversations against a conversation bound
    /// in place of all that `b` homes.
    fn admits_homing(&self, b: &BackendRef<'_>, homed: u32) -> bool {
        let slots = f64::from(b.slots().max(1));
        let within_load =
            self.load == f64::INFINITY || f64::from(b.in_flight() + 1) / slots <= self.load;
        // A backend may always home as many conversations as it has slots, over the
        // replicas placing them.
        within_load
            && (self.per_slot == f64::INFINITY || {
                let floor = (slots / f64::from(self.replicas)).ceil();
                f64::from(homed.saturating_add(1)) <= (self.per_slot * slots).ceil().max(floor)
            })
    }
}

/// Offers the backends of `node` in the key's rendezvous order, skipping `skip`.
fn offer_node(
    node: NodeRef<'_>,
    key: SessionKey,
    skip: Option<u32>,
    bound: Bound,
    c: &mut Candidates<'_>,
) -> ControlFlow<()> {
    let admit = |i: u32| Some(i) != skip && bound.admits(&node.backend(i));
    node.ranks().visit(key, admit, |i| c.offer(node.backend(i)))
}

/// Offers every node except `skip`, in the key's rendezvous order.
fn offer_nodes(
    fleet: &FleetView<'_>,
    key: SessionKey,
    skip: Option<u32>,
    bound: Bound,
    c: &mut Candidates<'_>,
) -> ControlFlow<()> {
    let t = fleet.topology;
    t.live_nodes.visit(
        key,
        |n| Some(n) != skip,
        |n| offer_node(NodeRef::new(t, n), key, None, bound, c),
    )
}

/// Offers `backend`, holding a keyed conversation's own prefix, then the other backends on its
/// node in `key`'s rendezvous order (so that router replicas agree): where the conversation's
/// cache is, and the host-memory cache beside it.
fn offer_own_prefix(
    backend: BackendRef<'_>,
    key: SessionKey,
    c: &mut Candidates<'_>,
) -> ControlFlow<()> {
    c.offer(backend)?;
    offer_node(backend.node(), key, Some(backend.index), Bound::NONE, c)
}

/// Offers `backend`, then the other backends on its node, most free slots first (ties: the
/// highest [`tie_rank`](rendezvous::tie_rank) for `tie`, the same on every router): where a
/// keyless conversation's prefix is, and the host-memory cache beside it.
fn offer_near(backend: BackendRef<'_>, tie: u64, c: &mut Candidates<'_>) -> ControlFlow<()> {
    c.offer(backend)?;
    let mut rest: Vec<((u32, u64), BackendRef<'_>)> = backend
        .node()
        .backends()
        .filter(|b| b.index != backend.index)
        .map(|b| {
            let rank = rendezvous::tie_rank(tie, b.member().digest);
            ((b.free_slots(), rank), b)
        })
        .collect();
    rest.sort_unstable_by_key(|&(o, _)| std::cmp::Reverse(o));
    rest.into_iter().try_for_each(|(_, b)| c.offer(b))
}

/// Offers the least loaded backend with a free slot by [`spread_load`] (ties: the most free
/// slots, then the highest [`tie_rank`](rendezvous::tie_rank) for `tie`, which every router
/// computes alike whatever order it discovered the backends in), then every backend by free
/// slots, ties by the same rank. A backend down or passed over is left out of the look for
/// the least loaded: offered, it would take nothing, and the conversation would go by free
/// slots alone. O(backends).
fn least_loaded_for_new(
    fleet: &FleetView<'_>,
    tie: u64,
    since_ms: u64,
    c: &mut Candidates<'_>,
) -> ControlFlow<()> {
    let n = fleet.len();
    if n == 0 {
        return ControlFlow::Continue(());
    }
    let rank = |b: &BackendRef<'_>| rendezvous::tie_rank(tie, b.member().digest);
    let mut best: Option<((u64, u64, u64), u32, BackendRef<'_>)> = None;
    for b in (0..n).filter_map(|i| fleet.backend_at(i)) {
        if b.free_slots() == 0 || c.is_down(b) || c.is_passed_over(b.index) {
            continue;
        }
        let load = spread_load(fleet, &b, since_ms);
        let better = match &best {
            None => true,
            Some((l, free, x)) => {
                load < *l
                    || (load == *l
                        && (b.free_slots() > *free
                            || (b.free_slots() == *free && rank(&b) > rank(x))))
            }
        };
        if better {
            best = Some((load, b.free_slots(), b));
        }
    }
    if let Some((_, _, b)) = best {
        c.offer(b)?;
    }
    most_free_slots(fleet, Ties::Rank(tie), c)
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use super::*;
    use crate::fleet::Topology;
    use crate::placement::Candidates;

    #[test]
    fn a_removed_backends_last_requests_do_not_loosen_the_load_bound() {
        // a and b, four slots each, on nodes of their own; c, of eight, was removed with its
        // eight requests still streaming. With a session's key drawn to a, which serves three,
        // the live fleet has 4 of its 8 slots taken with this session: a would be at 4 of 4,
        // past 1.25 times that, and the session goes to b. Counting c's requests, the fleet
        // would read 12 of 8 taken, and the bound would pass no backend over.
        let four = NonZeroU32::new(4).unwrap();
        let mut t = Topology::default();
        let a = t.insert("a".into(), &"na".into(), four, None, 1_000);
        let b = t.insert("b".into(), &"nb".into(), four, None, 1_000);
        let c = t.insert(
            "c".into(),
            &"nc".into(),
            four.saturating_mul(four),
            None,
            1_000,
        );
        for _ in 0..8 {
            assert!(t.member(c).load.try_acquire());
        }
        t.remove(&"c".into());
        for _ in 0..3 {
            assert!(t.member(a).load.try_acquire());
        }
        let view = FleetView::at(&t, 1);
        assert_eq!(view.in_flight(), 3, "the live backends' requests");
        let extensions = http::Extensions::new();
        let placed = |policy: &NodeThenBackend, key: SessionKey| {
            let req = PlacementRequest::new(Some(key), None, &extensions);
            let mut c = Candidates::probe(&t, 1);
            policy.place(&view, &req, &mut c);
            c.chosen()
        };
        let unbounded = NodeThenBackend::new();
        let key = (0..1_000u32)
            .map(|i| SessionKey::from_bytes(format!("k{i}").as_bytes()))
            .find(|&k| placed(&unbounded, k) == Some(a))
            .expect("a key drawn to a");
        assert_eq!(placed(&unbounded.load_bound(0.25), key), Some(b));
    }

    #[test]
    fn the_conversation_bound_counts_a_backends_conversations_within_the_live_window_only() {
        // a and b, one slot each, on nodes of their own. a homes four conversations, the last
        // turn of each ten minutes ago: past the live window of five minutes, none counts, so
        // a new conversation drawn to a finds it within the bound (0 of at most 1). Counted all,
        // the four put a past the bound, and the conversation goes to b.
        let one = NonZeroU32::MIN;
        let mut t = Topology::default();
        let a = t.insert("a".into(), &"na".into(), one, None, 100_000);
        let b = t.insert("b".into(), &"nb".into(), one, None, 100_000);
        for c in 0..4u64 {
            let old = crate::PromptChain::from_blocks([(100 + c, 100), (200 + c, 100)]);
            t.member(a).cache.record_from(old.links(), 0, 1_000);
        }
        let now = 1_000 + 600_000;
        let view = FleetView::at(&t, now);
        let extensions = http::Extensions::new();
        let prompt = crate::PromptChain::from_blocks([(900, 100), (901, 100)]);
        let placed = |policy: &NodeThenBackend, key: SessionKey| {
            let req = PlacementRequest::new(Some(key), None, &extensions).chain(Some(&prompt));
            let mut c = Candidates::probe(&t, now);
            policy.place(&view, &req, &mut c);
            c.chosen()
        };
        let unbounded = NodeThenBackend::new().no_conversation_bound();
        let key = (0..1_000u32)
            .map(|i| SessionKey::from_bytes(format!("k{i}").as_bytes()))
            .find(|&k| placed(&unbounded, k) == Some(a))
            .expect("a key drawn to a");
        assert_eq!(placed(&NodeThenBackend::new(), key), Some(a));
        let all = NodeThenBackend::new().live_window(Duration::ZERO);
        assert_eq!(placed(&all, key), Some(b));
    }
}
