//! Policies a user might write, through the public API only, each tested on fleets
//! built by hand.

use std::cmp::Reverse;
use std::time::Duration;

use tower_affinity::key::SessionKey;
use tower_affinity::placement::{
    BackendRef, Candidates, FleetView, HomeCache, Placement, PlacementRequest, Snapshot,
};
use tower_affinity::{BackendId, PromptChain};

fn key(s: &str) -> Option<SessionKey> {
    Some(SessionKey::from_bytes(s.as_bytes()))
}

fn ids(v: &[&str]) -> Vec<BackendId> {
    v.iter().map(|&s| BackendId::from(s)).collect()
}

/// Offers `backends` in order until one is taken.
fn offer_all<'a>(backends: impl IntoIterator<Item = BackendRef<'a>>, c: &mut Candidates<'_>) {
    for b in backends {
        if c.offer(b).is_break() {
            return;
        }
    }
}

/// The backend that would reuse most of the request's prompt, ties by fewest requests in
/// flight; never a backend that is down.
#[derive(Clone)]
struct LongestReuse;

impl Placement for LongestReuse {
    fn place(&self, fleet: &FleetView<'_>, req: &PlacementRequest<'_>, c: &mut Candidates<'_>) {
        let reuse = |b: &BackendRef<'_>| req.chain.map_or(0, |chain| b.cached_tokens(chain));
        let mut up: Vec<_> = fleet.backends().filter(|b| !c.is_down(*b)).collect();
        up.sort_by_key(|b| (Reverse(reuse(b)), b.in_flight()));
        offer_all(up, c);
    }
}

/// Keyed sessions to their home, and only there (full, they wait for it, or under
/// `Overflow::Overcommit` queue there) unless more than `max_queued` requests queue for it;
/// then to the least loaded backend of the home's node, never another node. Requests without
/// a home go to the least loaded backend of the fleet.
///
/// A backend's queue is the requests the service holds waiting for a slot there
/// (`BackendRef::waiting`, under `Overflow::Wait`) and those sent beyond its slots (its
/// in-flight count past its slots, under `Overflow::Overcommit`).
#[derive(Clone)]
struct NodePinned {
    max_queued: u32,
}

impl Placement for NodePinned {
    fn place(&self, fleet: &FleetView<'_>, req: &PlacementRequest<'_>, c: &mut Candidates<'_>) {
        let queued = |b: &BackendRef<'_>| b.in_flight().saturating_sub(b.slots()) + b.waiting();
        let Some(home) = req.home.filter(|_| req.key.is_some()) else {
            let mut all: Vec<_> = fleet.backends().collect();
            all.sort_by_key(|b| b.in_flight());
            return offer_all(all, c);
        };
        if let Some(b) = home.backend.filter(|b| queued(b) <= self.max_queued) {
            let _ = c.offer(b);
            return;
        }
        let mut node: Vec<_> = home
            .node
            .backends()
            .filter(|b| Some(*b) != home.backend)
            .collect();
        node.sort_by_key(|b| b.in_flight());
        offer_all(node, c);
    }
}

/// A session with a home goes there; a new one (or one without a key) to the backend with the
/// largest share of its slots free, then the others by that share.
#[derive(Clone)]
struct FreestShare;

impl Placement for FreestShare {
    fn place(&self, fleet: &FleetView<'_>, req: &PlacementRequest<'_>, c: &mut Candidates<'_>) {
        if let Some(b) = req.home.and_then(|h| h.backend) {
            if c.offer(b).is_break() {
                return;
            }
        }
        let mut all: Vec<_> = fleet.backends().collect();
        // free / slots, highest first, compared without division: a/b > c/d iff ad > cb.
        all.sort_by(|x, y| {
            let (fx, sx) = (u64::from(x.free_slots()), u64::from(x.slots()));
            let (fy, sy) = (u64::from(y.free_slots()), u64::from(y.slots()));
            (fy * sx).cmp(&(fx * sy))
        });
        offer_all(all, c);
    }
}

/// The backend with the largest prompt-cache budget first; those without one last, in the
/// fleet's order.
#[derive(Clone)]
struct LargestPromptCache;

impl Placement for LargestPromptCache {
    fn place(&self, fleet: &FleetView<'_>, _: &PlacementRequest<'_>, c: &mut Candidates<'_>) {
        let mut all: Vec<_> = fleet.backends().collect();
        all.sort_by_key(|b| Reverse(b.prompt_cache_bytes()));
        offer_all(all, c);
    }
}

/// The backend that would read the part of the prompt it lacks soonest, by its learned
/// prefill rate; those that have not learned one last, in the fleet's order.
#[derive(Clone)]
struct SoonestRead;

impl Placement for SoonestRead {
    fn place(&self, fleet: &FleetView<'_>, req: &PlacementRequest<'_>, c: &mut Candidates<'_>) {
        let Some(chain) = req.chain else {
            return offer_all(fleet.backends(), c);
        };
        let lacks = |b: &BackendRef<'_>| chain.tokens() - b.cached_tokens(chain);
        let mut all: Vec<_> = fleet.backends().collect();
        all.sort_by_key(|b| b.time_to_read(lacks(b)).map_or((1, None), |t| (0, Some(t))));
        offer_all(all, c);
    }
}

#[test]
fn longest_reuse_goes_where_most_of_the_prompt_is_held_ties_by_fewest_in_flight() {
    let opening = PromptChain::from_blocks([(1, 1_000)]);
    let turn1 = PromptChain::from_blocks([(1, 1_000), (2, 400)]);
    let turn2 = PromptChain::from_blocks([(1, 1_000), (2, 400), (3, 50)]);
    let fleet = Snapshot::new()
        .backend("a", "n1", 2)
        .backend("b", "n1", 2)
        .backend("c", "n2", 2)
        .backend("d", "n2", 2)
        .holds("a", &opening)
        .holds("b", &turn1)
        .holds("c", &opening)
        .in_flight("a", 1)
        .prompt(turn2);
    // b reuses 1,400 tokens; a and c 1,000, c with fewer in flight; d nothing.
    assert_eq!(
        fleet.order(&LongestReuse, None, None),
        ids(&["b", "c", "a", "d"])
    );
    // b full: c, the freer of the two that reuse 1,000.
    let full = fleet.in_flight("b", 2);
    assert_eq!(full.choose(&LongestReuse, None, None), Some("c".into()));
    // b down: never offered, though it holds the most.
    let down = full.in_flight("b", 0).down("b");
    assert_eq!(
        down.order(&LongestReuse, key("s"), Some("b")),
        ids(&["c", "a", "d"])
    );
    // Without a prompt, the least loaded; an empty fleet has nothing to offer.
    let plain = Snapshot::new()
        .backend("a", "n", 2)
        .backend("b", "n", 2)
        .in_flight("a", 1);
    assert_eq!(plain.order(&LongestReuse, None, None), ids(&["b", "a"]));
    assert!(Snapshot::new().order(&LongestReuse, None, None).is_empty());
    assert_eq!(Snapshot::new().choose(&LongestReuse, None, None), None);
}

#[test]
fn node_pinned_sessions_leave_a_queued_home_for_its_least_loaded_neighbour_only() {
    let policy = NodePinned { max_queued: 2 };
    let fleet = || {
        Snapshot::new()
            .backend("a1", "node-a", 2)
            .backend("a2", "node-a", 2)
            .backend("a3", "node-a", 2)
            .backend("b1", "node-b", 8)
            .in_flight("a2", 1)
            .home_cache(HomeCache::Holds)
    };
    let s = key("s");
    // Home within its queue: home alone, even full (two beyond its two slots).
    assert_eq!(fleet().order(&policy, s, Some("a1")), ids(&["a1"]));
    let queued = fleet().in_flight("a1", 4);
    assert_eq!(queued.choose(&policy, s, Some("a1")), None);
    assert_eq!(queued.order(&policy, s, Some("a1")), ids(&["a1"]));
    // Three beyond its two slots: the home is left out, the node's least loaded first, never
    // node b.
    let over = fleet().in_flight("a1", 5);
    assert_eq!(over.order(&policy, s, Some("a1")), ids(&["a3", "a2"]));
    assert_eq!(over.choose(&policy, s, Some("a1")), Some("a3".into()));
    // Two beyond its slots and one waiting for a slot there: over its queue too.
    let waiting = fleet().in_flight("a1", 4).waiting("a1", 1);
    assert_eq!(waiting.order(&policy, s, Some("a1")), ids(&["a3", "a2"]));
    // The home removed: its node is still where the session goes.
    let gone = fleet().remove("a1");
    assert_eq!(gone.order(&policy, s, Some("a1")), ids(&["a3", "a2"]));
    // The home over its queue and its node full: nothing on node b, the request waits.
    let full = fleet()
        .in_flight("a1", 5)
        .in_flight("a2", 2)
        .in_flight("a3", 2);
    assert_eq!(full.choose(&policy, s, Some("a1")), None);
    // A new session: the fleet's least loaded.
    assert_eq!(fleet().choose(&policy, s, None), Some("a1".into()));
    assert_eq!(
        fleet()
            .in_flight("a1", 1)
            .in_flight("a3", 1)
            .choose(&policy, s, None),
        Some("b1".into())
    );
}

#[test]
fn freest_share_sends_a_new_session_to_the_backend_with_most_of_its_slots_free() {
    let fleet = Snapshot::new()
        .backend("small", "n1", 2)
        .backend("big", "n1", 8)
        .backend("mid", "n2", 4)
        .in_flight("big", 3)
        .in_flight("mid", 1);
    // small 2/2, mid 3/4, big 5/8: share first, though big has the most free slots.
    assert_eq!(
        fleet.order(&FreestShare, key("new"), None),
        ids(&["small", "mid", "big"])
    );
    let fleet = fleet.in_flight("small", 1);
    // small 1/2 now: mid 3/4, big 5/8, small.
    assert_eq!(
        fleet.order(&FreestShare, key("new"), None),
        ids(&["mid", "big", "small"])
    );
    // A session with a home goes home first.
    assert_eq!(
        fleet.order(&FreestShare, key("old"), Some("small")),
        ids(&["small", "mid", "big"])
    );
    // Slots promised to woken waiters are not free.
    let promised = fleet.promised("mid", 2);
    assert_eq!(
        promised.choose(&FreestShare, key("new"), None),
        Some("big".into())
    );
}

#[test]
fn a_policy_reads_the_prompt_cache_budget_a_snapshot_sets() {
    let fleet = Snapshot::new()
        .backend("none", "n1", 1)
        .backend("small", "n1", 1)
        .backend("big", "n2", 1)
        .prompt_cache_bytes("small", 8 << 30)
        .prompt_cache_bytes("big", 32 << 30)
        .prompt_cache_bytes("unknown", 64 << 30);
    assert_eq!(
        fleet.order(&LargestPromptCache, None, None),
        ids(&["big", "small", "none"])
    );
    // Set again, it replaces the first; the backend announced again has none.
    let fleet = fleet.prompt_cache_bytes("none", 64 << 30);
    assert_eq!(
        fleet.order(&LargestPromptCache, None, None),
        ids(&["none", "big", "small"])
    );
    let fleet = fleet.backend("none", "n1", 1);
    assert_eq!(
        fleet.order(&LargestPromptCache, None, None),
        ids(&["big", "small", "none"])
    );
}

#[test]
fn a_policy_reads_the_prefill_rate_a_snapshot_sets() {
    let held = PromptChain::from_blocks([(1, 8_000)]);
    let prompt = PromptChain::from_blocks([(1, 8_000), (2, 2_000)]);
    let fleet = Snapshot::new()
        .backend("warm", "n1", 1)
        .backend("cold", "n1", 1)
        .backend("new", "n2", 1)
        .holds("warm", &held)
        .prefill_rate("warm", 100)
        .prefill_rate("cold", 10_000)
        .prefill_rate("unknown", 1)
        .prompt(prompt.clone());
    // warm reads the 2,000 tokens it lacks in 20 s, cold all 10,000 in 1 s; new has no rate.
    let view = fleet.view();
    let time = |id: &str, tokens| view.backend(&id.into()).unwrap().time_to_read(tokens);
    assert_eq!(time("warm", 2_000), Some(Duration::from_secs(20)));
    assert_eq!(time("cold", 10_000), Some(Duration::from_secs(1)));
    assert_eq!(time("new", 10_000), None);
    assert_eq!(
        fleet.order(&SoonestRead, None, None),
        ids(&["cold", "warm", "new"])
    );
    // At 200 tokens a second cold takes 50 s: warm first. At 0, cold has no rate.
    let slower = fleet.prefill_rate("cold", 200);
    assert_eq!(
        slower.order(&SoonestRead, None, None),
        ids(&["warm", "cold", "new"])
    );
    let unlearned = slower.prefill_rate("cold", 0);
    assert_eq!(
        unlearned.order(&SoonestRead, None, None),
        ids(&["warm", "cold", "new"])
    );
    assert_eq!(
        unlearned
            .view()
            .backend(&"cold".into())
            .unwrap()
            .time_to_read(1),
        None
    );
}
