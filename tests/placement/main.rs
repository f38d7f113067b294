//! The rules of placement, one test each, on fleets built by hand (no runtime).

use tower_affinity::key::SessionKey;
use tower_affinity::placement::{
    HomeCache, LeastLoaded, NodeThenBackend, Placement, Rendezvous, RoundRobin, Snapshot,
};
use tower_affinity::{BackendId, PromptChain};

use proptest::prelude::*;

mod own_policies;

fn key(s: &str) -> Option<SessionKey> {
    Some(SessionKey::from_bytes(s.as_bytes()))
}

fn ids(v: &[&str]) -> Vec<BackendId> {
    v.iter().map(|&s| BackendId::from(s)).collect()
}

/// Two nodes of two backends, one slot each.
fn two_by_two() -> Snapshot {
    two_by_two_with(1)
}

/// Two nodes of two backends, `slots` each.
fn two_by_two_with(slots: u32) -> Snapshot {
    Snapshot::new()
        .backend("a1", "node-a", slots)
        .backend("a2", "node-a", slots)
        .backend("b1", "node-b", slots)
        .backend("b2", "node-b", slots)
}

/// A policy of one's own sees which backends are down, and which are the same, before it
/// offers any.
#[test]
fn a_policy_sees_which_backends_are_down_before_it_offers_them() {
    use parking_lot::Mutex;
    use std::sync::Arc;
    use tower_affinity::placement::{Candidates, FleetView, PlacementRequest};

    /// The least loaded backend that is up; records what it saw.
    #[derive(Clone, Default)]
    struct UpFirst(Arc<Mutex<Vec<(String, bool)>>>);

    impl Placement for UpFirst {
        fn place(&self, fleet: &FleetView<'_>, _: &PlacementRequest<'_>, c: &mut Candidates<'_>) {
            let mut seen = self.0.lock();
            seen.clear();
            for b in fleet.backends() {
                seen.push((b.id().to_string(), c.is_down(b)));
                assert_eq!(fleet.backend(b.id()), Some(b));
                assert_eq!(b.node(), fleet.backend(b.id()).unwrap().node());
            }
            let mut up: Vec<_> = fleet.backends().filter(|b| !c.is_down(*b)).collect();
            up.sort_by_key(|b| b.in_flight());
            for b in up {
                if c.offer(b).is_break() {
                    return;
                }
            }
        }
    }

    let fleet = two_by_two_with(2)
        .in_flight("a2", 1)
        .in_flight("b1", 1)
        .in_flight("b2", 1)
        .down("a1");
    let p = UpFirst::default();
    assert_eq!(fleet.order(&p, None, None), ids(&["a2", "b1", "b2"]));
    let seen = p.0.lock().clone();
    let down: Vec<bool> = seen.iter().map(|(_, d)| *d).collect();
    assert_eq!(down, [true, false, false, false], "{seen:?}");
    // A backend of another view is not one of these.
    let other = two_by_two();
    let (a, b) = (fleet.view(), other.view());
    assert_ne!(a.backend_at(0), b.backend_at(0));
    assert_eq!(a.backend_at(0), a.backend_at(0));
    assert_ne!(a.nodes().next(), b.nodes().next());
}

#[test]
fn spill_order_is_home_then_its_node_then_other_nodes() {
    let fleet = two_by_two();
    let p = NodeThenBackend::new();
    for home in ["a1", "a2", "b1", "b2"] {
        let order = fleet.order(&p, key("s"), Some(home));
        assert_eq!(order.len(), 4, "{order:?}");
        assert_eq!(order[0].as_str(), home);
        let node = &home[..1];
        assert!(order[1].as_str().starts_with(node), "{order:?}");
        assert!(!order[2].as_str().starts_with(node), "{order:?}");
        assert!(!order[3].as_str().starts_with(node), "{order:?}");
    }
}

#[test]
fn spill_takes_the_first_candidate_with_a_free_slot() {
    let p = NodeThenBackend::new();
    let k = key("s");
    assert_eq!(two_by_two().choose(&p, k, Some("a1")), Some("a1".into()));
    let home_full = two_by_two().in_flight("a1", 1);
    assert_eq!(home_full.choose(&p, k, Some("a1")), Some("a2".into()));
    let node_full = two_by_two().in_flight("a1", 1).in_flight("a2", 1);
    let other = node_full.choose(&p, k, Some("a1")).unwrap();
    assert!(other.as_str().starts_with('b'));
    let all_full = node_full.in_flight("b1", 1).in_flight("b2", 1);
    assert_eq!(all_full.choose(&p, k, Some("a1")), None);
}

#[test]
fn other_nodes_and_their_backends_follow_the_keys_rendezvous_order() {
    // Across many keys the order after the home's node differs: it is the key's, not fixed.
    let fleet = Snapshot::new()
        .backend("a1", "a", 1)
        .backend("b1", "b", 1)
        .backend("c1", "c", 1)
        .backend("d1", "d", 1);
    let p = NodeThenBackend::new();
    let mut seconds = std::collections::HashSet::new();
    for i in 0..64 {
        let k = key(&format!("s{i}"));
        let order = fleet.order(&p, k, Some("a1"));
        assert_eq!(order[0].as_str(), "a1");
        // A new session with the same key ranks the other nodes in the same relative order.
        let fresh: Vec<_> = fleet
            .order(&p, k, None)
            .into_iter()
            .filter(|b| b.as_str() != "a1")
            .collect();
        assert_eq!(order[1..], fresh[..]);
        seconds.insert(order[1].clone());
    }
    assert_eq!(
        seconds.len(),
        3,
        "every other node comes second for some key"
    );
}

#[test]
fn new_session_takes_the_rendezvous_winner_and_is_stable() {
    let fleet = two_by_two();
    let p = NodeThenBackend::new();
    let k = key("new");
    let first = fleet.order(&p, k, None);
    assert_eq!(first.len(), 4);
    // Within the winning node, both backends come before the other node's.
    assert_eq!(first[0].as_str()[..1], first[1].as_str()[..1]);
    assert_eq!(fleet.order(&p, k, None), first, "same fleet, same order");
    // A fleet built in another order (another router process) agrees.
    let other = Snapshot::new()
        .backend("b2", "node-b", 1)
        .backend("a2", "node-a", 1)
        .backend("b1", "node-b", 1)
        .backend("a1", "node-a", 1);
    assert_eq!(other.order(&p, k, None), first);
}

#[test]
fn new_sessions_spread_over_nodes_in_proportion_to_slots() {
    let fleet = Snapshot::new()
        .backend("big-1", "big", 6)
        .backend("small-1", "small", 2);
    let share = new_sessions_share(&fleet, "big-1");
    assert!((share - 0.75).abs() < 0.03, "share {share}");
}

/// The share of 8,000 new sessions (keys `k0`, `k1`, ...) that `NodeThenBackend` places on
/// `id`.
fn new_sessions_share(fleet: &Snapshot, id: &str) -> f64 {
    let p = NodeThenBackend::new();
    let n = 8000;
    let on = (0..n)
        .filter(|i| {
            fleet
                .choose(&p, key(&format!("k{i}")), None)
                .unwrap()
                .as_str()
                == id
        })
        .count();
    on as f64 / n as f64
}

#[test]
fn removing_a_backend_changes_no_first_choice_outside_its_node() {
    // Sessions with a home never move when another backend goes (the session table keeps
    // them; see the service tests). For new sessions, removal lowers the node's weight, so only
    // keys whose first choice was on that node can change.
    let build = || {
        (0..4).fold(Snapshot::new(), |s, n| {
            (0..2).fold(s, |s, b| {
                s.backend(&format!("n{n}-b{b}"), &format!("n{n}"), 1)
            })
        })
    };
    let before = build();
    let after = build().remove("n2-b1");
    let p = NodeThenBackend::new();
    let mut moved = 0;
    for i in 0..2000 {
        let k = key(&format!("k{i}"));
        let was = before.choose(&p, k, None).unwrap();
        let now = after.choose(&p, k, None).unwrap();
        if was.as_str() == "n2-b1" {
            moved += 1;
            assert_ne!(now, was);
        } else if !was.as_str().starts_with("n2-") {
            assert_eq!(
                was, now,
                "key {i} moved although its node kept all its backends"
            );
        }
    }
    assert!(moved > 100, "{moved}");
}

#[test]
fn a_removed_home_sends_the_session_to_its_node_first() {
    let fleet = two_by_two().remove("a1");
    let order = fleet.order(&NodeThenBackend::new(), key("s"), Some("a1"));
    assert_eq!(order[0].as_str(), "a2");
    assert_eq!(order.len(), 3);
}

#[test]
fn a_removed_home_is_no_cold_home_and_its_node_still_comes_first() {
    // What the model said of the home went with it: the session's node is where it was
    // served last, and comes first, whatever the home held before it was removed.
    let p = NodeThenBackend::new();
    let fleet = two_by_two().home_cache(HomeCache::Evicted).remove("a1");
    for i in 0..16 {
        let k = key(&format!("s{i}"));
        assert_eq!(fleet.order(&p, k, Some("a1"))[0].as_str(), "a2", "key {i}");
    }
}

#[test]
fn a_backend_marked_down_is_passed_over() {
    let fleet = two_by_two().down("a1");
    let p = NodeThenBackend::new();
    assert_eq!(fleet.choose(&p, key("s"), Some("a1")), Some("a2".into()));
    assert!(!fleet.order(&p, key("s"), Some("a1")).contains(&"a1".into()));
}

#[test]
fn keyless_request_goes_to_the_freer_of_two_sampled_backends() {
    // Free slots: a1 3, a2 1, b1 2. Every pair of samples has a freer member, and a2 is the
    // freer of none, so it is never chosen; a1 wins both pairs it is in (two of three).
    let fleet = Snapshot::new()
        .backend("a1", "a", 4)
        .backend("a2", "a", 4)
        .backend("b1", "b", 4)
        .in_flight("a1", 1)
        .in_flight("a2", 3)
        .in_flight("b1", 2);
    for policy in [&NodeThenBackend::new() as &dyn Placement, &Rendezvous] {
        let mut chosen = std::collections::HashMap::new();
        for _ in 0..300 {
            let id = fleet.choose(policy, None, None).unwrap();
            *chosen.entry(id.to_string()).or_insert(0) += 1;
        }
        assert_eq!(chosen.get("a2"), None, "{chosen:?}");
        let (a1, b1) = (chosen["a1"], chosen["b1"]);
        assert!((170..=230).contains(&a1) && a1 + b1 == 300, "{chosen:?}");
    }
}

#[test]
fn keyless_request_finds_the_one_free_slot_when_both_samples_are_full() {
    let mut fleet = Snapshot::new();
    for i in 0..16 {
        fleet = fleet
            .backend(&format!("b{i}"), "n", 2)
            .in_flight(&format!("b{i}"), 2);
    }
    let fleet = fleet.in_flight("b11", 1);
    for _ in 0..50 {
        assert_eq!(
            fleet.choose(&NodeThenBackend::new(), None, None),
            Some("b11".into())
        );
    }
}

/// Four nodes of one backend, four slots each.
fn four_nodes_of_four_slots() -> Snapshot {
    Snapshot::new()
        .backend("a1", "a", 4)
        .backend("b1", "b", 4)
        .backend("c1", "c", 4)
        .backend("d1", "d", 4)
}

#[test]
fn load_bound_keeps_new_sessions_off_busy_backends() {
    // The key's first choice is busy well above the fleet's average: with a bound, a new
    // session goes elsewhere; without, it does not.
    let base = four_nodes_of_four_slots;
    let k = key("hot");
    let winner = base().choose(&NodeThenBackend::new(), k, None).unwrap();
    let busy = base().in_flight(winner.as_str(), 3);
    assert_eq!(
        busy.choose(&NodeThenBackend::new(), k, None),
        Some(winner.clone())
    );
    let bounded = NodeThenBackend::new().load_bound(0.25);
    assert_ne!(busy.choose(&bounded, k, None), Some(winner.clone()));
    // A bound is a preference: when every other backend is full, the busy one still serves.
    let others_full = ["a1", "b1", "c1", "d1"]
        .into_iter()
        .filter(|&b| b != winner.as_str())
        .fold(busy, |s, b| s.in_flight(b, 4));
    assert_eq!(others_full.choose(&bounded, k, None), Some(winner));
}

#[test]
fn load_bound_does_not_apply_to_a_session_with_a_home() {
    let fleet = Snapshot::new()
        .backend("a1", "a", 4)
        .backend("b1", "b", 4)
        .in_flight("a1", 3);
    let bounded = NodeThenBackend::new().load_bound(0.0);
    assert_eq!(
        fleet.choose(&bounded, key("s"), Some("a1")),
        Some("a1".into())
    );
}

#[test]
fn rendezvous_ignores_the_home() {
    let fleet = two_by_two();
    let k = key("s");
    let winner = fleet.choose(&Rendezvous, k, None).unwrap();
    for home in ["a1", "a2", "b1", "b2"] {
        assert_eq!(
            fleet.choose(&Rendezvous, k, Some(home)),
            Some(winner.clone())
        );
    }
    // It spills to the next rendezvous choice, which may be on another node.
    let full = two_by_two().in_flight(winner.as_str(), 1);
    assert_ne!(full.choose(&Rendezvous, k, None), Some(winner));
}

#[test]
fn round_robin_visits_every_backend_in_turn() {
    let fleet = two_by_two();
    let rr = RoundRobin::new();
    let picks: Vec<_> = (0..8)
        .map(|_| fleet.choose(&rr, key("s"), Some("a1")).unwrap())
        .collect();
    assert_eq!(picks[..4], picks[4..]);
    let mut first_four = picks[..4].to_vec();
    first_four.sort();
    assert_eq!(first_four, ids(&["a1", "a2", "b1", "b2"]));
}

#[test]
fn least_loaded_rotates_among_ties() {
    let fleet = two_by_two();
    let ll = LeastLoaded::new();
    let picks: std::collections::HashSet<_> = (0..4)
        .map(|_| fleet.choose(&ll, key("s"), Some("a1")).unwrap())
        .collect();
    assert_eq!(picks.len(), 4);
}

#[test]
fn least_loaded_rotates_evenly_among_only_the_backends_that_tie() {
    // a2 and b1 have two free slots, a1 and b2 one: the requests alternate between a2 and
    // b1, whatever positions the others hold in the fleet.
    let fleet = two_by_two_with(2).in_flight("a1", 1).in_flight("b2", 1);
    let ll = LeastLoaded::new();
    let picks: Vec<_> = (0..8)
        .map(|_| fleet.choose(&ll, None, None).unwrap())
        .collect();
    assert_eq!(picks.iter().filter(|p| p.as_str() == "a2").count(), 4);
    assert_eq!(picks.iter().filter(|p| p.as_str() == "b1").count(), 4);
    for pair in picks.windows(2) {
        assert_ne!(pair[0], pair[1], "{picks:?}");
    }
}

#[test]
fn least_loaded_rotates_evenly_among_the_tied_backends_that_are_up() {
    // a2, b1 and b2 have two free slots, a1 one; b1 is down. The requests alternate between
    // a2 and b2: b1's turns are not all handed to the tie after it.
    let fleet = two_by_two_with(2).in_flight("a1", 1).down("b1");
    let ll = LeastLoaded::new();
    let picks: Vec<_> = (0..8)
        .map(|_| fleet.choose(&ll, None, None).unwrap())
        .collect();
    assert_eq!(
        picks.iter().filter(|p| p.as_str() == "a2").count(),
        4,
        "{picks:?}"
    );
    assert_eq!(
        picks.iter().filter(|p| p.as_str() == "b2").count(),
        4,
        "{picks:?}"
    );
}

#[test]
fn an_empty_fleet_offers_nothing() {
    let empty = Snapshot::new();
    assert!(empty
        .order(&NodeThenBackend::new(), key("s"), None)
        .is_empty());
    assert!(empty.order(&RoundRobin::new(), None, None).is_empty());
    assert!(empty.order(&LeastLoaded::new(), None, None).is_empty());
    assert!(empty.order(&Rendezvous, key("s"), None).is_empty());
}

#[test]
fn a_fleet_view_is_empty_only_when_no_backend_is_live() {
    assert!(Snapshot::new().view().is_empty());
    let fleet = two_by_two();
    assert!(!fleet.view().is_empty());
    assert_eq!(fleet.view().len(), 4);
    let gone = ["a1", "a2", "b1"]
        .into_iter()
        .fold(fleet, |s, b| s.remove(b));
    assert!(!gone.view().is_empty());
    assert!(gone.remove("b2").view().is_empty());
}

// The rules that use the cache model. A chain is built from blocks: `SYS` is a system prompt
// of 2,000 tokens, every other id a message of 100.

const SYS: u64 = 1;

fn chain(ids: &[u64]) -> PromptChain {
    PromptChain::from_blocks(
        ids.iter()
            .map(|&id| (id, if id == SYS { 2_000 } else { 100 })),
    )
}

/// The first key (`k0`, `k1`, ...) whose new-session rendezvous winner is not `avoid`: a key
/// that would go elsewhere if the rule under test did not send it to `avoid`.
/// How many keys the searches for a key drawn to a backend try: rendezvous draws about one
/// in the fleet's size to each, so a search that runs out says the scores are broken.
const KEYS_TRIED: u32 = 10_000;

fn key_not_drawn_to(fleet: &Snapshot, avoid: impl Fn(&str) -> bool) -> SessionKey {
    (0..KEYS_TRIED)
        .map(|i| SessionKey::from_bytes(format!("k{i}").as_bytes()))
        .find(|&k| !avoid(order_from_scores(fleet, k)[0].as_str()))
        .expect("no key of those tried is drawn elsewhere: are the scores all alike?")
}

fn conversations(fleet: &Snapshot, id: &str) -> u32 {
    fleet.view().backend(&id.into()).unwrap().conversations()
}

#[test]
fn a_home_that_holds_the_session_is_offered_first() {
    let turn1 = chain(&[SYS, 11, 12]);
    let turn2 = chain(&[SYS, 11, 12, 13, 14]);
    // Another backend holds more of the prompt than the home (a copy of the session's history
    // sent keyless, say): the home still comes first, then its node.
    let fleet = two_by_two()
        .holds("b2", &turn1)
        .holds("a1", &chain(&[SYS, 11, 12, 13]));
    let k = Some(key_not_drawn_to(&fleet, |b| b == "b2"));
    let fleet = fleet.prompt(turn2).home_cache(HomeCache::Holds);
    let p = NodeThenBackend::new();
    let order = fleet.order(&p, k, Some("b2"));
    assert_eq!(order[..2], ids(&["b2", "b1"]), "{order:?}");
    assert_eq!(fleet.choose(&p, k, Some("b2")), Some("b2".into()));
}

#[test]
fn a_cold_home_prefers_the_backend_holding_the_longest_own_prefix() {
    // The session was homed on a1, which evicted it; b2 still holds its first turn, and a2
    // holds the system prompt of another conversation.
    let turn1 = chain(&[SYS, 11, 12]);
    let turn2 = chain(&[SYS, 11, 12, 13, 14]);
    let fleet = two_by_two()
        .holds("b2", &turn1)
        .holds("a2", &chain(&[SYS, 21]));
    // A key that, placed as a plain new session, would stay on the home's node.
    let k = Some(key_not_drawn_to(&fleet, |b| b.starts_with('b')));
    let fleet = fleet.prompt(turn2.clone()).home_cache(HomeCache::Evicted);
    let prefix = fleet.view().longest_prefix(&turn2).unwrap();
    assert_eq!(
        (prefix.backend.id().as_str(), prefix.links, prefix.own),
        ("b2", 3, true)
    );
    let p = NodeThenBackend::new();
    let order = fleet.order(&p, k, Some("a1"));
    assert_eq!(order[..2], ids(&["b2", "b1"]), "{order:?}");
    assert_eq!(fleet.choose(&p, k, Some("a1")), Some("b2".into()));
    // The holder full: its node, where its host-memory cache may still hold the prefix.
    let full = fleet.in_flight("b2", 1);
    assert_eq!(full.choose(&p, k, Some("a1")), Some("b1".into()));
}

#[test]
fn a_cold_home_comes_after_the_other_backends_holding_as_much() {
    // a1 evicted the session; it and b2 each still hold the system prompt the session shares
    // with another conversation there. The key ranks a1 first: a new session with this prompt
    // would go to a1, but a1 could not keep this conversation, so b2 takes it.
    let turn2 = chain(&[SYS, 11, 12, 13]);
    let fleet = || {
        two_by_two_of_two()
            .holds("a1", &chain(&[SYS, 21]))
            .holds("b2", &chain(&[SYS, 31]))
    };
    let k = Some(key_not_drawn_to(&fleet(), |b| b != "a1"));
    let p = NodeThenBackend::new();
    let new = fleet().prompt(turn2.clone());
    assert_eq!(new.order(&p, k, None)[..2], ids(&["a1", "b2"]));
    let cold = fleet().prompt(turn2).home_cache(HomeCache::Evicted);
    let order = cold.order(&p, k, Some("a1"));
    assert_eq!(order[..2], ids(&["b2", "a1"]), "{order:?}");
    assert_eq!(cold.choose(&p, k, Some("a1")), Some("b2".into()));
    // The home holding more of the prompt than the others is still the first choice.
    let longer = cold.holds("a1", &chain(&[SYS, 11, 41]));
    assert_eq!(longer.choose(&p, k, Some("a1")), Some("a1".into()));
}

#[test]
fn a_cold_home_with_no_prefix_anywhere_is_placed_like_a_new_session() {
    let turn2 = chain(&[SYS, 11, 12, 13, 14]);
    let fleet = two_by_two();
    // A key whose rendezvous order starts on the other node than the home's.
    let k = key_not_drawn_to(&fleet, |b| b.starts_with('a'));
    let fleet = fleet.prompt(turn2).home_cache(HomeCache::Evicted);
    let p = NodeThenBackend::new();
    let order = fleet.order(&p, Some(k), Some("a1"));
    assert_eq!(order, order_from_scores(&fleet, k));
    assert_eq!(order, fleet.order(&p, Some(k), None));
    assert!(order[0].as_str().starts_with('b'), "{order:?}");
}

#[test]
fn a_compacted_session_stays_home_when_there_is_room() {
    // The client replaced its history with a summary and kept its system prompt, which other
    // conversations share on node b. No cache holds the new prompt: home is as good as any.
    let compacted = chain(&[SYS, 99]);
    let fleet = two_by_two()
        .holds("b1", &chain(&[SYS, 31, 32]))
        .holds("b2", &chain(&[SYS, 41]));
    let k = Some(key_not_drawn_to(&fleet, |b| b.starts_with('a')));
    let fleet = fleet.prompt(compacted).home_cache(HomeCache::Compacted);
    let p = NodeThenBackend::new();
    assert_eq!(fleet.choose(&p, k, Some("a1")), Some("a1".into()));
    let order = fleet.order(&p, k, Some("a1"));
    assert_eq!(order[..2], ids(&["a1", "a2"]), "{order:?}");
    // The home full: its node, as for any session with a home.
    let full = fleet.in_flight("a1", 1);
    assert_eq!(full.choose(&p, k, Some("a1")), Some("a2".into()));
}

#[test]
fn a_prompt_extending_its_own_prefix_but_not_its_keys_last_goes_where_that_prefix_is() {
    // Two conversations under one key: the main one's last turn is on a2, and a side request
    // of the key went to b1 since. The main one's next turn does not extend the key's last
    // prompt (the side request's), so its home reads it as a compaction; but a2 holds a prefix
    // of it that is its own.
    let fleet = two_by_two_of_two()
        .holds("a2", &chain(&[SYS, 11, 12]))
        .holds("b1", &chain(&[71, 72]))
        .prompt(chain(&[SYS, 11, 12, 13]))
        .home_cache(HomeCache::Compacted);
    let k = key("agent");
    let p = NodeThenBackend::new();
    assert_eq!(fleet.choose(&p, k, Some("b1")), Some("a2".into()));
    let order = fleet.order(&p, k, Some("b1"));
    assert_eq!(order[..3], ids(&["a2", "a1", "b1"]), "{order:?}");
    // Full there: its node, before the key's home.
    let full = fleet.in_flight("a2", 2);
    assert_eq!(full.choose(&p, k, Some("b1")), Some("a1".into()));
    // A prefix many conversations share is no conversation's own: a compaction stays home.
    let shared = two_by_two_of_two()
        .holds("a2", &chain(&[SYS, 11]))
        .holds("a2", &chain(&[SYS, 21]))
        .holds("b1", &chain(&[71, 72]))
        .prompt(chain(&[SYS, 99]))
        .home_cache(HomeCache::Compacted);
    assert_eq!(shared.choose(&p, k, Some("b1")), Some("b1".into()));
}

/// Two nodes of two backends, two slots each.
fn two_by_two_of_two() -> Snapshot {
    two_by_two_with(2)
}

#[test]
fn a_keyless_request_goes_where_its_own_prefix_is() {
    // b2 served the conversation's first turn. It homes the only conversation, so by load or
    // by conversations it would be the last choice.
    let fleet = two_by_two_of_two()
        .holds("b2", &chain(&[SYS, 11, 12]))
        .prompt(chain(&[SYS, 11, 12, 13, 14]));
    let p = NodeThenBackend::new();
    for _ in 0..20 {
        assert_eq!(fleet.choose(&p, None, None), Some("b2".into()));
    }
    assert_eq!(fleet.order(&p, None, None)[..2], ids(&["b2", "b1"]));
}

#[test]
fn a_keyless_request_goes_where_its_own_prefix_is_then_to_that_backends_node() {
    // b2 holds the prefix and is full; b1 homes two other conversations, so by conversations
    // a backend of node a would come first.
    let fleet = two_by_two_of_two()
        .holds("b2", &chain(&[SYS, 11, 12]))
        .holds("b1", &chain(&[77]))
        .holds("b1", &chain(&[78]))
        .in_flight("b2", 2)
        .prompt(chain(&[SYS, 11, 12, 13, 14]));
    let p = NodeThenBackend::new();
    for _ in 0..20 {
        assert_eq!(fleet.choose(&p, None, None), Some("b1".into()));
    }
}

#[test]
fn a_keyless_request_whose_prefix_is_on_a_full_backend_goes_to_the_freest_backend_of_its_node() {
    // b2 holds the conversation's prefix and is full; of the other backends on its node, b3
    // has four free slots and b1 one.
    let fleet = Snapshot::new()
        .backend("a1", "node-a", 4)
        .backend("b1", "node-b", 4)
        .backend("b2", "node-b", 2)
        .backend("b3", "node-b", 4)
        .holds("b2", &chain(&[SYS, 11, 12]))
        .in_flight("b1", 3)
        .in_flight("b2", 2)
        .prompt(chain(&[SYS, 11, 12, 13, 14]));
    let p = NodeThenBackend::new();
    assert_eq!(fleet.order(&p, None, None)[..3], ids(&["b2", "b3", "b1"]));
    for _ in 0..20 {
        assert_eq!(fleet.choose(&p, None, None), Some("b3".into()));
    }
}

#[test]
fn a_prefix_continued_by_several_conversations_is_not_own() {
    let next = chain(&[SYS, 24]);
    // Three conversations start with the same system prompt on b2.
    let shared = two_by_two()
        .holds("b2", &chain(&[SYS, 21]))
        .holds("b2", &chain(&[SYS, 22]))
        .holds("b2", &chain(&[SYS, 23]));
    let prefix = shared.view().longest_prefix(&next).unwrap();
    assert_eq!((prefix.backend.id().as_str(), prefix.links), ("b2", 1));
    assert!(!prefix.own, "a system prompt three conversations continue");
    assert!(prefix.only, "held there and nowhere else");
    let shared = shared.prompt(next.clone());
    let p = NodeThenBackend::new();
    for _ in 0..20 {
        assert_ne!(shared.choose(&p, None, None), Some("b2".into()));
    }
    // Continued by one other prompt, it is not own either: that is a second conversation
    // sharing the system prompt with the first. Continued by none, it is where a turn ended.
    let once = two_by_two().holds("b2", &chain(&[SYS, 21]));
    assert!(!once.view().longest_prefix(&next).unwrap().own);
    let tip = two_by_two().holds("b2", &chain(&[SYS]));
    assert!(tip.view().longest_prefix(&next).unwrap().own);
}

#[test]
fn a_prefix_held_on_several_backends_is_not_own() {
    let fleet = two_by_two()
        .holds("a1", &chain(&[SYS, 21]))
        .holds("b2", &chain(&[SYS, 22]));
    let prefix = fleet.view().longest_prefix(&chain(&[SYS, 23])).unwrap();
    assert_eq!(prefix.links, 1);
    assert!(!prefix.own);
    assert!(!prefix.only);
    // One of the two holds more of this prompt: that one is own.
    let prefix = fleet.view().longest_prefix(&chain(&[SYS, 22, 5])).unwrap();
    assert_eq!((prefix.backend.id().as_str(), prefix.own), ("b2", true));
}

#[test]
fn the_longest_prefix_is_found_wherever_the_backends_holding_less_come() {
    // a1 holds three links of the prompt, b2 only the system prompt: scanned before b2 or
    // after it, a1 is the backend holding the longest prefix.
    let prompt = chain(&[SYS, 11, 12, 13]);
    for fleet in [
        two_by_two(),
        Snapshot::new()
            .backend("b2", "node-b", 1)
            .backend("a1", "node-a", 1),
    ] {
        let fleet = fleet
            .holds("a1", &chain(&[SYS, 11, 12]))
            .holds("b2", &chain(&[SYS, 21]));
        let prefix = fleet.view().longest_prefix(&prompt).unwrap();
        assert_eq!(
            (prefix.backend.id().as_str(), prefix.links, prefix.only),
            ("a1", 3, true)
        );
    }
}

#[test]
fn a_backend_tells_how_much_of_a_prompt_its_cache_holds() {
    let fleet = two_by_two()
        .holds("a1", &chain(&[SYS, 11, 12]))
        .holds("a1", &chain(&[SYS, 21]));
    let view = fleet.view();
    let (a1, b1) = (
        view.backend(&"a1".into()).unwrap(),
        view.backend(&"b1".into()).unwrap(),
    );
    let next = chain(&[SYS, 11, 12, 13]);
    assert_eq!(
        (a1.cached_links(&next), a1.cached_tokens(&next)),
        (3, 2_200)
    );
    assert_eq!((b1.cached_links(&next), b1.cached_tokens(&next)), (0, 0));
    // Two conversations, their system prompt held once.
    assert_eq!((a1.conversations(), a1.held_tokens()), (2, 2_300));
    assert_eq!((b1.conversations(), b1.held_tokens()), (0, 0));
}

#[test]
fn the_fleet_counts_the_conversations_of_all_its_live_backends() {
    // a1 homes two conversations, b1 one: three in all, their shared system prompt no more.
    let fleet = two_by_two()
        .holds("a1", &chain(&[SYS, 11, 12]))
        .holds("a1", &chain(&[SYS, 21]))
        .holds("b1", &chain(&[SYS, 31]));
    assert_eq!(fleet.view().conversations(), 3);
    // A removed backend's conversations leave the count.
    assert_eq!(fleet.remove("a1").view().conversations(), 1);
}

#[test]
fn a_fleet_view_debugs_as_its_backends_with_their_nodes_and_load() {
    let fleet = Snapshot::new()
        .backend("a1", "node-a", 2)
        .backend("b1", "node-b", 1)
        .in_flight("a1", 1);
    let view = fleet.view();
    let a1 = r#"Backend { id: "a1", node: "node-a", slots: 2, in_flight: 1 }"#;
    assert_eq!(format!("{:?}", view.backend(&"a1".into()).unwrap()), a1);
    let b1 = r#"Backend { id: "b1", node: "node-b", slots: 1, in_flight: 0 }"#;
    assert_eq!(format!("{view:?}"), format!("[{a1}, {b1}]"));
}

#[test]
fn a_node_debugs_as_its_id_and_how_many_live_backends_it_has() {
    let fleet = Snapshot::new()
        .backend("a1", "node-a", 2)
        .backend("a2", "node-a", 1)
        .backend("b1", "node-b", 1);
    let view = fleet.view();
    let node = view.backend(&"a1".into()).unwrap().node();
    assert_eq!(format!("{node:?}"), r#"Node { id: "node-a", backends: 2 }"#);
    // A removed backend leaves the count.
    let fleet = fleet.remove("a2");
    let view = fleet.view();
    let node = view.backend(&"a1".into()).unwrap().node();
    assert_eq!(format!("{node:?}"), r#"Node { id: "node-a", backends: 1 }"#);
}

#[test]
fn a_keyless_request_with_no_prefix_goes_to_the_fewest_conversations_per_slot() {
    // Conversations for slots: a1 2 for 4, a2 0 for 1, b1 1 for 2, b2 2 for 2. Counting this
    // one, a1 is the least loaded per slot (3/4), though a2 homes none (1/1).
    let fleet = || {
        Snapshot::new()
            .backend("a1", "node-a", 4)
            .backend("a2", "node-a", 1)
            .backend("b1", "node-b", 2)
            .backend("b2", "node-b", 2)
            .holds("a1", &chain(&[501]))
            .holds("a1", &chain(&[502]))
            .holds("b1", &chain(&[503]))
            .holds("b2", &chain(&[504]))
            .holds("b2", &chain(&[505]))
    };
    assert_eq!(conversations(&fleet(), "a1"), 2);
    let p = NodeThenBackend::new();
    // Ties are broken by the prompt: different prompts, the same answer.
    for i in 0..20 {
        let fleet = fleet().prompt(chain(&[SYS, 1_000 + i]));
        assert_eq!(
            fleet.choose(&p, None, None),
            Some("a1".into()),
            "prompt {i}"
        );
    }
    // A full backend is passed over: the next per slot is a2 or b1.
    let full = fleet().in_flight("a1", 4).prompt(chain(&[SYS, 999]));
    let got = full.choose(&p, None, None).unwrap();
    assert!(["a2", "b1"].contains(&got.as_str()), "{got}");
}

#[test]
fn a_new_keyless_conversation_goes_where_fewest_requests_are_in_flight_then_fewest_conversations() {
    // a1 homes no conversation but reads two prompts now; b1 and b2 home one each, b2 with a
    // request in flight; a2 homes two. The least busy by requests in flight for its slots
    // wins (a2, b1: none), and between those the one homing fewer conversations (b1).
    let fleet = || {
        two_by_two_with(4)
            .in_flight("a1", 2)
            .in_flight("b2", 1)
            .holds("a2", &chain(&[701]))
            .holds("a2", &chain(&[702]))
            .holds("b1", &chain(&[703]))
            .holds("b2", &chain(&[704]))
    };
    for i in 0..20 {
        let fleet = fleet().prompt(chain(&[SYS, 2_000 + i]));
        assert_eq!(
            fleet.choose(&NodeThenBackend::new(), None, None),
            Some("b1".into()),
            "prompt {i}"
        );
    }
    // With nothing in flight anywhere, the conversations decide: a1.
    let idle = two_by_two_with(4)
        .holds("a2", &chain(&[701]))
        .holds("b1", &chain(&[703]))
        .holds("b2", &chain(&[704]))
        .prompt(chain(&[SYS, 3_000]));
    assert_eq!(
        idle.choose(&NodeThenBackend::new(), None, None),
        Some("a1".into())
    );
}

#[test]
fn a_new_keyless_conversation_weighs_each_backends_load_by_its_slots() {
    let p = NodeThenBackend::new();
    let place = |fleet: &dyn Fn() -> Snapshot| {
        (0..20)
            .map(|i| {
                fleet()
                    .prompt(chain(&[SYS, 4_000 + i]))
                    .choose(&p, None, None)
                    .unwrap()
            })
            .collect::<std::collections::HashSet<_>>()
    };
    let big_and_small = || {
        Snapshot::new()
            .backend("big", "n", 8)
            .backend("small", "n", 2)
    };
    let big = std::collections::HashSet::from([BackendId::from("big")]);
    // Requests in flight: a quarter of big's slots, half of small's.
    let in_flight = || big_and_small().in_flight("big", 2).in_flight("small", 1);
    assert_eq!(place(&in_flight), big);
    // Conversations homed, this one counted: 7 for big's 8 slots, 2 for small's 2.
    let homed = || {
        (0..6)
            .fold(big_and_small(), |s, i| s.holds("big", &chain(&[800 + i])))
            .holds("small", &chain(&[810]))
    };
    assert_eq!(place(&homed), big);
    // As many conversations per slot on each, this one counted (3 for 3, 2 for 2): tokens
    // held decide, 200 on either, for 3 slots and for 2.
    let tokens = || {
        Snapshot::new()
            .backend("big", "n", 3)
            .backend("small", "n", 2)
            .holds("big", &chain(&[820]))
            .holds("big", &chain(&[821]))
            .holds("small", &chain(&[830, 831]))
    };
    assert_eq!(place(&tokens), big);
}

#[test]
fn between_backends_homing_as_many_conversations_a_new_keyless_conversation_takes_the_one_holding_fewer_tokens_for_its_slots(
) {
    // Idle, and homing as many conversations for their slots, this one counted (3 for 3, 2
    // for 2): big holds 500 tokens for its 3 slots, small 100 for its 2. The tokens decide,
    // though big has more free slots.
    let p = NodeThenBackend::new();
    let fleet = || {
        Snapshot::new()
            .backend("big", "n", 3)
            .backend("small", "n", 2)
            .holds("big", &chain(&[840, 841, 842, 843]))
            .holds("big", &chain(&[844]))
            .holds("small", &chain(&[850]))
    };
    assert_eq!(
        (
            conversations(&fleet(), "big"),
            conversations(&fleet(), "small")
        ),
        (2, 1)
    );
    for i in 0..20 {
        let fleet = fleet().prompt(chain(&[SYS, 4_100 + i]));
        assert_eq!(
            fleet.choose(&p, None, None),
            Some("small".into()),
            "prompt {i}"
        );
    }
}

#[test]
fn between_equally_loaded_backends_a_new_keyless_conversation_takes_the_one_with_more_free_slots() {
    // Idle and homing nothing, x (3 slots) and y (4) weigh the same by conversations for
    // their slots as the policy scales them to whole numbers (the fleet's 8 slots over 3, and
    // over 4, are both 2): y has more free slots. z is full.
    let p = NodeThenBackend::new();
    for i in 0..20 {
        let fleet = Snapshot::new()
            .backend("x", "n", 3)
            .backend("y", "n", 4)
            .backend("z", "n", 1)
            .in_flight("z", 1)
            .prompt(chain(&[SYS, 5_000 + i]));
        assert_eq!(fleet.choose(&p, None, None), Some("y".into()), "prompt {i}");
    }
}

#[test]
fn a_new_keyless_conversation_is_placed_by_its_prompt_between_equal_backends() {
    // Four idle backends alike: whatever the random number each placement draws, the same
    // prompt goes to the same one (as a replay, or another router, would send it: see the
    // next test), and different prompts spread.
    let p = NodeThenBackend::new();
    let mut firsts = std::collections::HashSet::new();
    for i in 0..16 {
        let fleet = two_by_two_of_two().prompt(chain(&[SYS, 1_000 + i]));
        let first = fleet.choose(&p, None, None).unwrap();
        for _ in 0..8 {
            assert_eq!(
                fleet.choose(&p, None, None),
                Some(first.clone()),
                "prompt {i}"
            );
        }
        firsts.insert(first);
    }
    assert!(firsts.len() > 1, "every prompt went to {firsts:?}");
}

#[test]
fn a_new_keyless_conversations_backend_between_equals_is_the_same_in_every_version() {
    // Routers of different versions side by side (a rolling upgrade) must agree on where a new
    // keyless conversation goes when the backends are alike, as they agree on a new session's
    // order: the prompt breaks the tie the same way in each. These were computed once; a
    // change to the tie's digest, its mixing or the way it is ranked fails here.
    let p = NodeThenBackend::new();
    let firsts: Vec<String> = (0..12)
        .map(|i| {
            let fleet = two_by_two_of_two().prompt(chain(&[SYS, 1_000 + i]));
            fleet.choose(&p, None, None).unwrap().to_string()
        })
        .collect();
    let pinned = [
        "b1", "a1", "b2", "b2", "a2", "b2", "a1", "b1", "a2", "a2", "b2", "b1",
    ];
    assert_eq!(firsts, pinned);
}

/// Places `n` new keyless conversations, the `i`th with `prompt(i)`, on two routers' views of
/// one fleet that discovered its backends in different orders (`here`, `there`). Each goes
/// to the same backend on both; the backends they went to.
fn placed_alike_whatever_the_discovery_order(
    n: u64,
    here: impl Fn() -> Snapshot,
    there: impl Fn() -> Snapshot,
    prompt: impl Fn(u64) -> PromptChain,
) -> std::collections::HashSet<BackendId> {
    let p = NodeThenBackend::new();
    let mut firsts = std::collections::HashSet::new();
    for i in 0..n {
        let first = here().prompt(prompt(i)).choose(&p, None, None).unwrap();
        assert_eq!(
            there().prompt(prompt(i)).choose(&p, None, None),
            Some(first.clone()),
            "prompt {i}"
        );
        firsts.insert(first);
    }
    firsts
}

#[test]
fn a_new_keyless_conversation_goes_where_another_router_discovering_backends_otherwise_sends_it() {
    // The same four idle backends, discovered in opposite orders by two routers: each prompt
    // goes to the same backend on both, and different prompts still spread.
    let reversed = || {
        Snapshot::new()
            .backend("b2", "node-b", 2)
            .backend("b1", "node-b", 2)
            .backend("a2", "node-a", 2)
            .backend("a1", "node-a", 2)
    };
    let firsts = placed_alike_whatever_the_discovery_order(32, two_by_two_of_two, reversed, |i| {
        chain(&[SYS, 2_000 + i])
    });
    assert_eq!(firsts.len(), 4, "32 prompts went to {firsts:?}");
}

#[test]
fn a_keyless_prompt_sent_whole_once_before_goes_where_it_was_sent() {
    // A turn sent again (a retry, a second answer): b2 served it, and homes the only
    // conversation, so by load or by conversations it would be the last choice.
    let turn1 = chain(&[SYS, 11, 12]);
    let fleet = two_by_two_of_two().holds("b2", &turn1);
    let prefix = fleet.view().longest_prefix(&turn1).unwrap();
    assert_eq!(
        (prefix.backend.id().as_str(), prefix.whole, prefix.own),
        ("b2", true, true)
    );
    let fleet = fleet.prompt(turn1);
    let p = NodeThenBackend::new();
    for _ in 0..20 {
        assert_eq!(fleet.choose(&p, None, None), Some("b2".into()));
    }
    assert_eq!(fleet.order(&p, None, None)[..2], ids(&["b2", "b1"]));
}

#[test]
fn a_prompt_sent_whole_more_than_once_draws_nothing() {
    // Agents that open with the same prompt all send it whole: after two, it says nothing of
    // whose it is.
    let opening = chain(&[SYS, 11, 12]);
    let fleet = two_by_two_of_two()
        .holds("b2", &opening)
        .holds("b2", &opening);
    let prefix = fleet.view().longest_prefix(&opening).unwrap();
    assert_eq!((prefix.backend.id().as_str(), prefix.own), ("b2", false));
    let fleet = fleet.prompt(opening);
    let p = NodeThenBackend::new();
    for _ in 0..20 {
        assert_ne!(fleet.choose(&p, None, None), Some("b2".into()));
    }
}

#[test]
fn a_keyed_new_session_is_not_drawn_to_a_prompt_held_whole() {
    // The key says whose conversation it is: the same prompt held elsewhere was another's that
    // opened alike, even sent only once.
    let opening = chain(&[SYS, 11, 12]);
    let fleet = two_by_two_of_two().holds("b2", &opening);
    let k = key_not_drawn_to(&fleet, |b| b == "b2");
    let fleet = fleet.prompt(opening);
    let p = NodeThenBackend::new();
    assert_eq!(fleet.order(&p, Some(k), None), order_from_scores(&fleet, k));
}

/// Two nodes of two backends, four slots each; b1 homes two conversations that share `SYS`.
fn sys_on_b1() -> Snapshot {
    Snapshot::new()
        .backend("a1", "node-a", 4)
        .backend("a2", "node-a", 4)
        .backend("b1", "node-b", 4)
        .backend("b2", "node-b", 4)
        .holds("b1", &chain(&[SYS, 21]))
        .holds("b1", &chain(&[SYS, 22]))
}

#[test]
fn new_conversations_are_drawn_to_holders_only_up_to_the_conversation_bound() {
    let p = NodeThenBackend::new();
    let mut fleet = sys_on_b1();
    assert!(
        !fleet
            .view()
            .longest_prefix(&chain(&[SYS, 100]))
            .unwrap()
            .own
    );
    let mut placed = vec![];
    for i in 0..40u64 {
        let k = key_not_drawn_to(&fleet, |b| b == "b1");
        let c = chain(&[SYS, 100 + i]);
        fleet = fleet.prompt(c.clone());
        let id = fleet.choose(&p, Some(k), None).unwrap();
        fleet = fleet.holds(id.as_str(), &c);
        // The bound after this placement: at most 1.25 times a backend's share of the
        // conversations by slots (rounded up), and never fewer than its slots.
        let total: u32 = ["a1", "a2", "b1", "b2"]
            .iter()
            .map(|b| conversations(&fleet, b))
            .sum();
        let bound = (1.25 * f64::from(total) * 4.0 / 16.0).ceil().max(4.0) as u32;
        assert!(
            conversations(&fleet, id.as_str()) <= bound,
            "conversation {i} took {id} past {bound}"
        );
        placed.push(id.to_string());
    }
    // The holder draws the first two new conversations (up to its 4 slots), though their keys
    // prefer other backends; the third goes by its key.
    assert_eq!(placed[..2], ["b1", "b1"]);
    assert_ne!(placed[2], "b1");
    // The prefix spreads with them: every backend took some.
    for b in ["a1", "a2", "b1", "b2"] {
        assert!(placed.iter().any(|p| p == b), "{b} took none: {placed:?}");
    }
}

#[test]
fn a_second_keyed_conversation_sharing_only_the_system_prompt_is_held_to_the_conversation_bound() {
    // The first conversation went to b1 (one slot). The second shares its system prompt and
    // nothing more, and its key prefers another backend: b1 homing both would be over the
    // bound (1.25 x 2 x 1/4, rounded up, is 1, and b1 has 1 slot).
    let fleet = two_by_two().holds("b1", &chain(&[SYS, 10_000]));
    let k = key_not_drawn_to(&fleet, |b| b == "b1");
    let fleet = fleet.prompt(chain(&[SYS, 10_001]));
    let got = fleet
        .choose(&NodeThenBackend::new(), Some(k), None)
        .unwrap();
    assert_eq!(got, order_from_scores(&fleet, k)[0]);
}

#[test]
fn a_second_keyless_conversation_sharing_only_the_system_prompt_goes_to_the_fewest_conversations() {
    let fleet = two_by_two()
        .holds("b1", &chain(&[SYS, 10_000]))
        .prompt(chain(&[SYS, 10_001]));
    for _ in 0..20 {
        assert_ne!(
            fleet.choose(&NodeThenBackend::new(), None, None),
            Some("b1".into())
        );
    }
}

/// Two nodes of two backends, two slots each. b1 homes six conversations of their own, over
/// its share of the seven (1.25 x 8 x 2/8, rounded up, is 3), and one whose last turn ended
/// inside a block: its next turn keeps the blocks before that one (`31, 32, 33`).
fn ragged_turn_on_a_busy_b1() -> Snapshot {
    (0..6)
        .fold(two_by_two_of_two(), |s, i| s.holds("b1", &chain(&[50 + i])))
        .holds("b1", &chain(&[31, 32, 33, 34]))
}

#[test]
fn the_conversation_bound_counts_against_a_holder_only_the_conversations_sharing_its_prefix() {
    // The prefix branches once on b1 (the last turn's ragged end): it draws the next turn
    // there, though b1 homes more than its share of other conversations. Keyless, the fewest
    // conversations would send it anywhere but b1; keyed, its key prefers another backend.
    let next = chain(&[31, 32, 33, 35, 36]);
    let fleet = ragged_turn_on_a_busy_b1();
    let prefix = fleet.view().longest_prefix(&next).unwrap();
    assert_eq!((prefix.backend.id().as_str(), prefix.links), ("b1", 3));
    assert!(!prefix.own, "continued by the last turn's ragged end");
    let k = key_not_drawn_to(&fleet, |b| b == "b1");
    let fleet = fleet.prompt(next);
    let p = NodeThenBackend::new();
    for _ in 0..20 {
        assert_eq!(fleet.choose(&p, None, None), Some("b1".into()));
    }
    assert_eq!(fleet.choose(&p, Some(k), None), Some("b1".into()));
    // Once as many conversations as its share branch from the prefix there, it draws no more.
    let shared = [37, 38, 39]
        .into_iter()
        .fold(ragged_turn_on_a_busy_b1(), |s, id| {
            s.holds("b1", &chain(&[31, 32, 33, id]))
        })
        .prompt(chain(&[31, 32, 33, 40]));
    for _ in 0..20 {
        assert_ne!(shared.choose(&p, None, None), Some("b1".into()));
    }
    assert_ne!(shared.choose(&p, Some(k), None), Some("b1".into()));
}

/// Two nodes of two backends, two slots each, whose models remember 32 conversations of
/// their own, eight a backend (conversations of earlier hours, long ended); then a system
/// prompt read first on b1, where two conversations now branch from it.
fn new_system_prompt_on_b1_of_a_fleet_with_a_past() -> Snapshot {
    let past = (0..32u64).fold(two_by_two_of_two(), |s, i| {
        s.holds(["a1", "a2", "b1", "b2"][i as usize % 4], &chain(&[500 + i]))
    });
    past.holds("b1", &chain(&[SYS, 21]))
        .holds("b1", &chain(&[SYS, 22]))
}

#[test]
fn a_holder_with_every_slot_taken_draws_only_its_share_of_the_conversations_its_prefix_drew() {
    // Four agents start at once on a new system prompt: two run on b1, whose two slots they
    // take. Against the 34 conversations the fleet remembers, b1 homing a third would be far
    // within its share (1.25 x 35 x 2/8, rounded up: 11), and it would wait there, a third
    // conversation on two slots; but the system prompt drew two, and b1 homes both, its
    // share of them and more (1.25 x 3 x 2/8, rounded up, is 1; its slots, 2). It is not
    // the first offered (which a request waits for when reading the prefix elsewhere costs
    // more than the wait): keyless, a backend with room is; keyed, the one its key prefers.
    let busy = new_system_prompt_on_b1_of_a_fleet_with_a_past()
        .in_flight("b1", 2)
        .prompt(chain(&[SYS, 23]));
    let p = NodeThenBackend::new();
    assert_ne!(busy.order(&p, None, None)[0].as_str(), "b1");
    let k = key_not_drawn_to(&busy, |b| b == "b1");
    assert_eq!(
        busy.order(&p, Some(k), None)[0],
        order_from_scores(&busy, k)[0]
    );
    // With a slot free there, the bound counts every conversation the fleet remembers: b1
    // draws the third, which its prefix saves reading.
    let free = new_system_prompt_on_b1_of_a_fleet_with_a_past()
        .in_flight("b1", 1)
        .prompt(chain(&[SYS, 23]));
    assert_eq!(free.order(&p, None, None)[0].as_str(), "b1");
    assert_eq!(free.order(&p, Some(k), None)[0].as_str(), "b1");
}

#[test]
fn a_holder_whose_free_slot_is_promised_to_a_waiting_request_draws_only_its_share_of_the_conversations_its_prefix_drew(
) {
    // As above, b1 homes the two conversations the new system prompt drew; one of its two
    // slots is taken, and the other promised to a request woken to take it. No slot is free
    // there, so the bound is its share of what the prefix drew, and b1 is not offered first.
    let promised = new_system_prompt_on_b1_of_a_fleet_with_a_past()
        .in_flight("b1", 1)
        .promised("b1", 1)
        .prompt(chain(&[SYS, 23]));
    let p = NodeThenBackend::new();
    assert_ne!(promised.order(&p, None, None)[0].as_str(), "b1");
    let k = key_not_drawn_to(&promised, |b| b == "b1");
    assert_eq!(
        promised.order(&p, Some(k), None)[0],
        order_from_scores(&promised, k)[0]
    );
}

#[test]
fn a_holder_with_every_slot_taken_is_offered_first_within_its_share_of_the_conversations_its_prefix_drew(
) {
    // a holds the system prompt, which six conversations continue there, and its five slots
    // are taken; b, of one slot, holds nothing. Its share of the seven conversations the
    // prefix drew with this one is 1.25 x 7 x 5/6, rounded up: 8, more than its slots. So a
    // is offered first, keyless and keyed, though a key would prefer b.
    let mut busy = Snapshot::new()
        .backend("a", "node-a", 5)
        .backend("b", "node-b", 1)
        .in_flight("a", 5)
        .prompt(chain(&[SYS, 30]));
    for c in 11..17 {
        busy = busy.holds("a", &chain(&[SYS, c]));
    }
    let p = NodeThenBackend::new();
    assert_eq!(busy.order(&p, None, None)[0].as_str(), "a");
    let k = key_not_drawn_to(&busy, |b| b == "a");
    assert_eq!(busy.order(&p, Some(k), None)[0].as_str(), "a");
}

#[test]
fn a_replica_homes_on_a_backend_its_share_of_the_slots_not_all_of_them() {
    // b1 (two slots) homes one conversation; a new one shares its system prompt and prefers
    // b1 by its key too. Few conversations: the bound is a backend's slots.
    let fleet = |replicas| {
        two_by_two_with(2)
            .replicas(replicas)
            .holds("b1", &chain(&[SYS, 10]))
            .prompt(chain(&[SYS, 11]))
    };
    let k = key_drawn_to(&fleet(1), "b1");
    let p = NodeThenBackend::new();
    // A lone router lets b1 home as many as its slots.
    assert_eq!(fleet(1).choose(&p, Some(k), None), Some("b1".into()));
    // One of two replicas homes its share of them, one: the other replica places as many
    // there, and together they stay within b1's slots.
    let got = fleet(2).choose(&p, Some(k), None).unwrap();
    assert_ne!(got.as_str(), "b1");
    assert_eq!(got, order_from_scores(&fleet(2), k)[1]);
}

#[test]
fn a_replica_may_home_its_share_of_the_slots_rounded_up() {
    // b1 (three slots) homes one conversation; a new one shares its system prompt. One of two
    // replicas may home 1.5 of b1's slots, rounded up: a second conversation there is
    // within it, though the new one's key prefers another backend.
    let fleet = Snapshot::new()
        .backend("a1", "node-a", 3)
        .backend("a2", "node-a", 3)
        .backend("b1", "node-b", 3)
        .backend("b2", "node-b", 3)
        .replicas(2)
        .holds("b1", &chain(&[SYS, 10]));
    let k = key_not_drawn_to(&fleet, |b| b == "b1");
    let fleet = fleet.prompt(chain(&[SYS, 11]));
    assert_eq!(
        fleet.choose(&NodeThenBackend::new(), Some(k), None),
        Some("b1".into())
    );
}

#[test]
fn no_conversation_bound_keeps_the_rendezvous_order() {
    let unbounded = NodeThenBackend::new().no_conversation_bound();
    let bounded = NodeThenBackend::new();
    // A prefix many conversations share draws no one.
    let fleet = sys_on_b1();
    let k = key_not_drawn_to(&fleet, |b| b == "b1");
    let fleet = fleet.prompt(chain(&[SYS, 100]));
    assert_eq!(fleet.order(&bounded, Some(k), None)[0].as_str(), "b1");
    assert_eq!(
        fleet.order(&unbounded, Some(k), None),
        order_from_scores(&fleet, k)
    );
    // A backend homing many conversations is not passed over.
    let fleet = two_by_two_of_two();
    let winner = order_from_scores(&fleet, k)[0].clone();
    let fleet = (0..6)
        .fold(fleet, |f, i| f.holds(winner.as_str(), &chain(&[600 + i])))
        .prompt(chain(&[SYS, 100]));
    assert_ne!(fleet.order(&bounded, Some(k), None)[0], winner);
    assert_eq!(
        fleet.order(&unbounded, Some(k), None),
        order_from_scores(&fleet, k)
    );
}

#[test]
fn a_keyless_request_without_a_prompt_goes_to_the_freer_of_two_whatever_the_caches_hold() {
    // The fleet of `keyless_request_goes_to_the_freer_of_two_sampled_backends`, with a1 homing
    // three conversations: without a chain, only free slots count.
    let fleet = Snapshot::new()
        .backend("a1", "a", 4)
        .backend("a2", "a", 4)
        .backend("b1", "b", 4)
        .in_flight("a1", 1)
        .in_flight("a2", 3)
        .in_flight("b1", 2)
        .holds("a1", &chain(&[SYS, 11]))
        .holds("a1", &chain(&[SYS, 12]))
        .holds("a1", &chain(&[13]));
    let mut chosen = std::collections::HashMap::new();
    for _ in 0..300 {
        let id = fleet.choose(&NodeThenBackend::new(), None, None).unwrap();
        *chosen.entry(id.to_string()).or_insert(0) += 1;
    }
    assert_eq!(chosen.get("a2"), None, "{chosen:?}");
    let (a1, b1) = (chosen["a1"], chosen["b1"]);
    assert!((170..=230).contains(&a1) && a1 + b1 == 300, "{chosen:?}");
}

/// A weighted fleet: nodes of 4, 5 and 4 slots; the middle node's backends differ in slots.
fn weighted() -> Snapshot {
    Snapshot::new()
        .backend("g0a", "gpu-0", 2)
        .backend("g0b", "gpu-0", 2)
        .backend("g1a", "gpu-1", 1)
        .backend("g1b", "gpu-1", 3)
        .backend("g1c", "gpu-1", 1)
        .backend("g2a", "gpu-2", 4)
}

/// New sessions' orders for eight keys, under both rendezvous policies, on both fleets.
fn new_session_orders() -> Vec<String> {
    let mut out = vec![];
    for (name, fleet) in [("2x2", two_by_two()), ("weighted", weighted())] {
        for i in 0..8 {
            let k = key(&format!("session-{i}"));
            for (policy, order) in [
                ("ntb", fleet.order(&NodeThenBackend::new(), k, None)),
                ("rdv", fleet.order(&Rendezvous, k, None)),
            ] {
                let order: Vec<&str> = order.iter().map(BackendId::as_str).collect();
                out.push(format!("{name} {i} {policy}: {}", order.join(" ")));
            }
        }
    }
    out
}

#[test]
fn new_session_order_is_the_same_in_every_version() {
    // Routers of different versions side by side (a rolling upgrade) must agree on where a new
    // session goes. These orders were computed once; a change to the digests, the mixing, the
    // weighting or the tie-break fails here.
    let pinned = [
        "2x2 0 ntb: b1 b2 a2 a1",
        "2x2 0 rdv: a2 b1 a1 b2",
        "2x2 1 ntb: b1 b2 a2 a1",
        "2x2 1 rdv: b1 a2 b2 a1",
        "2x2 2 ntb: a2 a1 b1 b2",
        "2x2 2 rdv: a2 b1 b2 a1",
        "2x2 3 ntb: b2 b1 a1 a2",
        "2x2 3 rdv: b2 b1 a1 a2",
        "2x2 4 ntb: a1 a2 b1 b2",
        "2x2 4 rdv: a1 b1 a2 b2",
        "2x2 5 ntb: b2 b1 a2 a1",
        "2x2 5 rdv: a2 b2 b1 a1",
        "2x2 6 ntb: b1 b2 a1 a2",
        "2x2 6 rdv: a1 a2 b1 b2",
        "2x2 7 ntb: b1 b2 a2 a1",
        "2x2 7 rdv: a2 b1 b2 a1",
        "weighted 0 ntb: g1b g1a g1c g0a g0b g2a",
        "weighted 0 rdv: g2a g1b g1a g0a g0b g1c",
        "weighted 1 ntb: g2a g1b g1c g1a g0b g0a",
        "weighted 1 rdv: g0b g1b g2a g0a g1c g1a",
        "weighted 2 ntb: g2a g1c g1b g1a g0b g0a",
        "weighted 2 rdv: g1c g2a g1b g0b g0a g1a",
        "weighted 3 ntb: g1b g1c g1a g2a g0b g0a",
        "weighted 3 rdv: g1b g1c g2a g0b g0a g1a",
        "weighted 4 ntb: g2a g1b g1c g1a g0a g0b",
        "weighted 4 rdv: g1b g2a g0a g1c g0b g1a",
        "weighted 5 ntb: g2a g0a g0b g1a g1b g1c",
        "weighted 5 rdv: g2a g1a g0a g0b g1b g1c",
        "weighted 6 ntb: g1b g1c g1a g2a g0b g0a",
        "weighted 6 rdv: g1b g2a g0b g0a g1c g1a",
        "weighted 7 ntb: g0b g0a g2a g1b g1a g1c",
        "weighted 7 rdv: g2a g0b g0a g1b g1a g1c",
    ];
    assert_eq!(new_session_orders(), pinned);
}

#[test]
fn a_node_counts_the_slots_of_its_live_backends() {
    let slots = |fleet: &Snapshot| {
        let mut v: Vec<(String, u32)> = fleet
            .view()
            .nodes()
            .map(|n| (n.id().as_str().to_string(), n.slots()))
            .collect();
        v.sort();
        v
    };
    let fleet = weighted();
    assert_eq!(
        slots(&fleet),
        [
            ("gpu-0".into(), 4),
            ("gpu-1".into(), 5),
            ("gpu-2".into(), 4)
        ]
    );
    assert_eq!(
        slots(&fleet.remove("g1b")),
        [
            ("gpu-0".into(), 4),
            ("gpu-1".into(), 2),
            ("gpu-2".into(), 4)
        ]
    );
}

/// One change to a fleet: add or update `b{id}` on `n{node}` with `slots`, or remove `b{id}`.
#[derive(Clone, Debug)]
enum Change {
    Put { id: u8, node: u8, slots: u32 },
    Remove { id: u8 },
}

fn change() -> impl Strategy<Value = Change> {
    prop_oneof![
        3 => (0..24u8, 0..6u8, 1..5u32).prop_map(|(id, node, slots)| Change::Put { id, node, slots }),
        1 => (0..24u8).prop_map(|id| Change::Remove { id }),
    ]
}

/// A new session's order computed from the public scores alone: nodes by their rendezvous
/// score, best first, and within each node its backends by theirs.
fn order_from_scores(fleet: &Snapshot, key: SessionKey) -> Vec<BackendId> {
    let view = fleet.view();
    let mut nodes: Vec<_> = view.nodes().collect();
    nodes.sort_by(|a, b| b.rendezvous_score(key).total_cmp(&a.rendezvous_score(key)));
    let mut order = vec![];
    for node in nodes {
        let mut backends: Vec<_> = node.backends().collect();
        backends.sort_by(|a, b| b.rendezvous_score(key).total_cmp(&a.rendezvous_score(key)));
        order.extend(backends.iter().map(|b| b.id().clone()));
    }
    order
}

proptest! {
    /// Whatever discovery did to the fleet (backends added, moved between nodes, resized,
    /// removed), a new session's order is the one the rendezvous scores give.
    #[test]
    fn new_session_order_follows_the_scores_after_any_changes(
        changes in proptest::collection::vec(change(), 1..40),
        keys in proptest::collection::vec(any::<u128>(), 1..8),
    ) {
        let mut fleet = Snapshot::new();
        for c in changes {
            fleet = match c {
                Change::Put { id, node, slots } => {
                    fleet.backend(&format!("b{id}"), &format!("n{node}"), slots)
                }
                Change::Remove { id } => fleet.remove(&format!("b{id}")),
            };
        }
        for k in keys {
            let key = SessionKey::from_u128(k);
            let got = fleet.order(&NodeThenBackend::new(), Some(key), None);
            prop_assert_eq!(&got, &order_from_scores(&fleet, key));
            // Stateless rendezvous: every backend by its own score.
            let mut all: Vec<_> = fleet.view().backends().collect();
            all.sort_by(|a, b| b.rendezvous_score(key).total_cmp(&a.rendezvous_score(key)));
            let by_score: Vec<BackendId> = all.iter().map(|b| b.id().clone()).collect();
            prop_assert_eq!(fleet.order(&Rendezvous, Some(key), None), by_score);
        }
    }
}

/// `NodeThenBackend`, after passing over the backends `rules_out` picks (each twice: passing
/// over is idempotent).
struct PassingOver<F>(F);

impl<F> Placement for PassingOver<F>
where
    F: Fn(&tower_affinity::placement::BackendRef<'_>) -> bool + Send + Sync + 'static,
{
    fn place(
        &self,
        fleet: &tower_affinity::placement::FleetView<'_>,
        req: &tower_affinity::placement::PlacementRequest<'_>,
        c: &mut tower_affinity::placement::Candidates<'_>,
    ) {
        for b in fleet.backends().filter(|b| (self.0)(b)) {
            c.pass_over(b);
            c.pass_over(b);
        }
        NodeThenBackend::new().place(fleet, req, c)
    }
}

#[test]
fn a_policy_wrapping_another_passes_over_the_backends_it_rules_out() {
    let fleet = two_by_two();
    let not_on_node_b = PassingOver(|b: &tower_affinity::placement::BackendRef<'_>| {
        b.node().id().as_str() == "node-b"
    });
    for i in 0..20 {
        let k = SessionKey::from_bytes(format!("k{i}").as_bytes());
        let order = fleet.order(&not_on_node_b, Some(k), Some("b1"));
        assert!(
            order.iter().all(|b| b.as_str().starts_with('a')),
            "{order:?}"
        );
        assert_eq!(order.len(), 2);
    }
    // With node-a full, nothing is taken: the request waits rather than goes to node-b.
    let full = fleet.in_flight("a1", 1).in_flight("a2", 1);
    assert_eq!(full.choose(&not_on_node_b, None, None), None);
}

#[test]
fn a_policy_wrapping_another_passes_over_any_number_of_backends() {
    let mut fleet = Snapshot::new();
    for i in 0..200 {
        fleet = fleet.backend(&format!("b{i:03}"), &format!("n{}", i / 8), 1);
    }
    for keep in ["b000", "b063", "b064", "b130", "b199"] {
        let policy = PassingOver(move |b: &tower_affinity::placement::BackendRef<'_>| {
            b.id().as_str() != keep
        });
        for i in 0..8 {
            let k = SessionKey::from_bytes(format!("k{i}").as_bytes());
            assert_eq!(fleet.order(&policy, Some(k), None), [BackendId::from(keep)]);
        }
        assert_eq!(fleet.order(&policy, None, None), [BackendId::from(keep)]);
    }
}

/// Passes over and offers the backends of another fleet, then offers the backends of the
/// fleet it places on.
struct MixesUpFleets(std::sync::Arc<Snapshot>);

impl Placement for MixesUpFleets {
    fn place(
        &self,
        fleet: &tower_affinity::placement::FleetView<'_>,
        _: &tower_affinity::placement::PlacementRequest<'_>,
        c: &mut tower_affinity::placement::Candidates<'_>,
    ) {
        let other = self.0.view();
        for b in other.backends() {
            c.pass_over(b);
        }
        for b in other.backends().chain(fleet.backends()) {
            if c.offer(b).is_break() {
                return;
            }
        }
    }
}

#[test]
fn a_backend_from_another_fleet_is_neither_offered_nor_passed_over() {
    let other = Snapshot::new().backend("x1", "x", 1).backend("x2", "x", 1);
    let policy = MixesUpFleets(std::sync::Arc::new(other));
    let fleet = two_by_two();
    assert_eq!(
        fleet.order(&policy, None, None),
        ids(&["a1", "a2", "b1", "b2"])
    );
    assert_eq!(fleet.choose(&policy, None, None), Some("a1".into()));
}

#[test]
fn load_bound_offers_the_backends_it_skips_last() {
    let fleet = Snapshot::new()
        .backend("a1", "a", 4)
        .backend("b1", "b", 4)
        .backend("c1", "c", 4)
        .backend("d1", "d", 4);
    let k = key("hot");
    let winner = fleet.choose(&NodeThenBackend::new(), k, None).unwrap();
    let busy = fleet.in_flight(winner.as_str(), 3);
    let order = busy.order(&NodeThenBackend::new().load_bound(0.25), k, None);
    assert_eq!(order.len(), 4, "{order:?}");
    assert_eq!(order.last(), Some(&winner), "{order:?}");
}

#[test]
fn a_larger_load_bound_lets_new_sessions_onto_busier_backends() {
    // The key's first choice has 3 of 4 slots taken and every other backend 2. With this
    // session the fleet's average is 10 of 16 slots; the first choice would be at 4 of 4, 1.6
    // times that, any other at 3 of 4, 1.2 times.
    let base = four_nodes_of_four_slots;
    let k = key("hot");
    let winner = base().choose(&NodeThenBackend::new(), k, None).unwrap();
    let busy = ["a1", "b1", "c1", "d1"].into_iter().fold(base(), |s, b| {
        s.in_flight(b, if b == winner.as_str() { 3 } else { 2 })
    });
    let choose = |epsilon: f64| busy.choose(&NodeThenBackend::new().load_bound(epsilon), k, None);
    assert_eq!(choose(1.0), Some(winner.clone()), "1.6 is within 2");
    assert_ne!(
        choose(0.25),
        Some(winner.clone()),
        "1.6 is past 1.25, 1.2 is not"
    );
    // With no margin every backend would go past the average: none is admitted on the first
    // pass, and the key's order stands.
    assert_eq!(choose(0.0), Some(winner));
}

#[test]
fn at_low_load_the_load_bound_passes_no_backend_over() {
    // The key's first choice has 2 of 4 slots taken, the others none: four times the fleet's
    // average. With this session the average is 3 of 16 slots; any other backend would be at
    // 1 of 4, 1.33 times it, past 1.25: none stays within the bound, and the key's order
    // stands (README, "How it places a request").
    let base = four_nodes_of_four_slots;
    let k = key("hot");
    let winner = base().choose(&NodeThenBackend::new(), k, None).unwrap();
    let busy = base().in_flight(winner.as_str(), 2);
    let bounded = NodeThenBackend::new().load_bound(0.25);
    assert_eq!(busy.choose(&bounded, k, None), Some(winner));
}

#[test]
fn the_load_bound_admits_a_backend_at_exactly_its_bound() {
    // The key's first choice has 1 of 4 slots taken, the others none. With this session the
    // fleet's average is 2 of 16 slots; with a margin of 1 the bound is twice that, 1 of 4,
    // which any other backend would be at exactly: not past it, so it is admitted.
    let base = four_nodes_of_four_slots;
    let k = key("hot");
    let winner = base().choose(&NodeThenBackend::new(), k, None).unwrap();
    let busy = base().in_flight(winner.as_str(), 1);
    let got = busy.choose(&NodeThenBackend::new().load_bound(1.0), k, None);
    assert_eq!(got.as_ref(), Some(&order_from_scores(&busy, k.unwrap())[1]));
}

#[test]
fn a_negative_or_non_finite_load_bound_is_read_as_zero() {
    // The key's first choice has 3 of 4 slots taken, its second none, the others 2. With
    // this session the fleet's average is 8 of 16 slots: with no margin only the second
    // choice (1 of 4) stays within it. A negative margin would admit none, an infinite one
    // every backend: either way the first choice.
    let base = four_nodes_of_four_slots;
    let k = key("hot");
    let order = order_from_scores(&base(), k.unwrap());
    let busy = order
        .iter()
        .enumerate()
        .fold(base(), |s, (i, b)| s.in_flight(b.as_str(), [3, 0, 2, 2][i]));
    let choose = |epsilon: f64| busy.choose(&NodeThenBackend::new().load_bound(epsilon), k, None);
    assert_eq!(choose(0.0).as_ref(), Some(&order[1]));
    for epsilon in [-1.0, f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        assert_eq!(choose(epsilon), choose(0.0), "{epsilon}");
    }
}

/// The first key whose rendezvous order puts `first` first.
fn key_drawn_to(fleet: &Snapshot, first: &str) -> SessionKey {
    (0..KEYS_TRIED)
        .map(|i| SessionKey::from_bytes(format!("k{i}").as_bytes()))
        .find(|&k| order_from_scores(fleet, k)[0].as_str() == first)
        .unwrap_or_else(|| panic!("no key of those tried is drawn to {first}"))
}

/// b1 homes a conversation (one slot each): a second there would pass its conversation bound.
fn b1_at_its_bound() -> Snapshot {
    two_by_two().holds("b1", &chain(&[SYS, 10_000]))
}

#[test]
fn the_conversation_bound_offers_the_backends_it_skips_last() {
    let fleet = b1_at_its_bound();
    let k = key_drawn_to(&fleet, "b1");
    // A new conversation that shares nothing with b1's, whose key prefers b1.
    let fleet = fleet.prompt(chain(&[20_000]));
    let order = fleet.order(&NodeThenBackend::new(), Some(k), None);
    assert_eq!(order.len(), 4, "{order:?}");
    assert_eq!(order.last().map(BackendId::as_str), Some("b1"), "{order:?}");
    let unbounded = NodeThenBackend::new().no_conversation_bound();
    assert_eq!(fleet.order(&unbounded, Some(k), None)[0].as_str(), "b1");
}

#[test]
fn a_larger_conversation_bound_lets_a_backend_home_more_than_its_share() {
    // b1 (one slot of four) homes the fleet's one conversation. With a second, its share is
    // half a conversation: it may home two once 1 + epsilon times that, rounded up, is 2.
    let fleet = b1_at_its_bound();
    let k = key_drawn_to(&fleet, "b1");
    let fleet = fleet.prompt(chain(&[20_000]));
    let first = |epsilon: f64| {
        let p = NodeThenBackend::new().conversation_bound(epsilon);
        fleet.order(&p, Some(k), None)[0].clone()
    };
    assert_ne!(first(0.0).as_str(), "b1");
    assert_ne!(first(1.0).as_str(), "b1");
    assert_eq!(first(1.5).as_str(), "b1");
}

/// The default conversation bound is the one the docs state, `1 + 0.25` times a backend's
/// share: four backends of four slots, 19 conversations homed and a 20th coming, so a
/// backend's share is 5 and it may home 6.25, rounded up 7. b1, the new key's first choice,
/// takes a 7th conversation, not an 8th (with an epsilon of 0.2 or less it would take no 7th;
/// above 0.4, an 8th).
#[test]
fn the_default_conversation_bound_is_a_quarter_over_a_backends_share() {
    assert_eq!(NodeThenBackend::DEFAULT_CONVERSATION_BOUND, 0.25);
    let homing = |b1: u64| {
        let others = 19 - b1;
        let mut fleet = two_by_two_with(4);
        for c in 0..19 {
            let b = match c {
                c if c < b1 => "b1",
                c if c < b1 + others / 3 => "a1",
                c if c < b1 + 2 * (others / 3) => "a2",
                _ => "b2",
            };
            fleet = fleet.holds(b, &chain(&[30_000 + c]));
        }
        assert_eq!(conversations(&fleet, "b1"), b1 as u32);
        fleet.prompt(chain(&[40_000]))
    };
    for (b1, takes) in [(6, true), (7, false)] {
        let fleet = homing(b1);
        let k = key_drawn_to(&fleet, "b1");
        let first = fleet
            .choose(&NodeThenBackend::new(), Some(k), None)
            .unwrap();
        assert_eq!(first.as_str() == "b1", takes, "b1 homing {b1}: {first}");
        let stated = NodeThenBackend::new().conversation_bound(0.25);
        assert_eq!(fleet.choose(&stated, Some(k), None), Some(first));
    }
}

#[test]
fn a_request_without_a_chain_takes_its_rendezvous_order_unbounded() {
    let fleet = b1_at_its_bound();
    let k = key_drawn_to(&fleet, "b1");
    // No chain: the cache model cannot tell what it is, so the bound does not apply.
    let order = fleet.order(&NodeThenBackend::new(), Some(k), None);
    assert_eq!(order, order_from_scores(&fleet, k));
}

#[test]
fn among_equal_prefixes_a_keyed_conversation_takes_its_rendezvous_order() {
    // a1 and b1 each hold a conversation on the shared system prompt, with room to spare
    // (four slots each): a new one holds as long a prefix on both.
    let fleet = two_by_two_with(4)
        .holds("a1", &chain(&[SYS, 10]))
        .holds("b1", &chain(&[SYS, 11]))
        .prompt(chain(&[SYS, 12]));
    let p = NodeThenBackend::new();
    let mut firsts = std::collections::HashSet::new();
    for i in 0..32 {
        let k = SessionKey::from_bytes(format!("s{i}").as_bytes());
        let order = fleet.order(&p, Some(k), None);
        // The holders by their own rendezvous scores, the higher first.
        let score = |id: &str| {
            fleet
                .view()
                .backend(&id.into())
                .unwrap()
                .rendezvous_score(k)
        };
        let mut holders = ids(&["a1", "b1"]);
        holders.sort_by(|a, b| score(b.as_str()).total_cmp(&score(a.as_str())));
        assert_eq!(order[..2], holders[..], "key s{i}");
        firsts.insert(order[0].clone());
    }
    assert_eq!(firsts.len(), 2, "the keys decide, not a fixed order");
}

#[test]
fn new_sessions_spread_over_the_backends_of_a_node_in_proportion_to_slots() {
    let fleet = Snapshot::new()
        .backend("big", "n", 6)
        .backend("small", "n", 2);
    let share = new_sessions_share(&fleet, "big");
    assert!((share - 0.75).abs() < 0.03, "share {share}");
}

#[test]
fn a_new_keyless_conversation_left_off_a_backend_goes_to_the_next_fewest_conversations() {
    // a and c home none, b ten, and every backend has as many free slots. With a down, or
    // passed over by a policy wrapping this one, a new conversation goes to c, whichever way
    // its prompt breaks the tie between a and c: not to b, as it would by free slots alone.
    let fleet = |prompt: u64| {
        (0..10)
            .fold(
                Snapshot::new()
                    .backend("a", "n", 4)
                    .backend("b", "n", 4)
                    .backend("c", "n", 4),
                |s, i| s.holds("b", &chain(&[600 + i])),
            )
            .prompt(chain(&[SYS, prompt]))
    };
    for i in 0..20 {
        let down = fleet(6_000 + i).down("a");
        let got = down.choose(&NodeThenBackend::new(), None, None);
        assert_eq!(got, Some("c".into()), "down, prompt {i}");
        let keep_off_a =
            PassingOver(|b: &tower_affinity::placement::BackendRef<'_>| b.id().as_str() == "a");
        let got = fleet(6_000 + i).choose(&keep_off_a, None, None);
        assert_eq!(got, Some("c".into()), "passed over, prompt {i}");
    }
}

#[test]
fn with_a_load_bound_a_new_session_still_keeps_within_the_conversation_bound() {
    // The key prefers a1, which homes five conversations: a sixth would pass its bound (4,
    // its slots). a1 and the key's second choice are idle, the other two have 2 of 4 slots
    // taken: both idle backends are within a load bound of 0.25, and only the second choice
    // within both bounds.
    let base = (0..5).fold(four_nodes_of_four_slots(), |s, i| {
        s.holds("a1", &chain(&[900 + i]))
    });
    let k = key_drawn_to(&base, "a1");
    let order = order_from_scores(&base, k);
    let fleet = order[2..]
        .iter()
        .fold(base, |s, b| s.in_flight(b.as_str(), 2))
        .prompt(chain(&[20_000]));
    let conversations_only = NodeThenBackend::new();
    assert_eq!(
        fleet.choose(&conversations_only, Some(k), None),
        Some(order[1].clone())
    );
    let both = NodeThenBackend::new().load_bound(0.25);
    assert_eq!(fleet.choose(&both, Some(k), None), Some(order[1].clone()));
    // Within the load bound only a1 is idle: the load bound comes first, and a1 takes it.
    let busy = fleet.in_flight(order[1].as_str(), 2);
    assert_eq!(busy.choose(&both, Some(k), None), Some(order[0].clone()));
}

// Rules whose regressions no test above would see: each test fails on a small change to the
// rule it is named after.

#[test]
fn a_new_keyless_conversation_whose_least_loaded_backend_is_down_goes_to_the_next_freest() {
    // a1 is idle but down; b1 has three slots free, b2 one. Past the down backend, the freest
    // takes the conversation, not the first with any slot free.
    let fleet = || {
        Snapshot::new()
            .backend("a1", "node-a", 4)
            .backend("b1", "node-b", 4)
            .backend("b2", "node-b", 4)
            .in_flight("b1", 1)
            .in_flight("b2", 3)
            .down("a1")
    };
    for i in 0..20 {
        let fleet = fleet().prompt(chain(&[SYS, 4_000 + i]));
        assert_eq!(
            fleet.choose(&NodeThenBackend::new(), None, None),
            Some("b1".into()),
            "prompt {i}"
        );
    }
    assert_eq!(
        fleet().choose(&LeastLoaded::new(), None, None),
        Some("b1".into()),
        "the least loaded baseline"
    );
}

#[test]
fn a_prefix_two_backends_hold_as_far_is_not_own_though_neither_continues_it() {
    // The same opening, sent once to a1 and once to b2 (two conversations that start alike):
    // a tip on each, continued on neither. It identifies no one conversation.
    let fleet = || {
        two_by_two_with(4)
            .holds("a1", &chain(&[SYS, 21]))
            .holds("b2", &chain(&[SYS, 21]))
    };
    let tied = fleet();
    let prefix = tied.view().longest_prefix(&chain(&[SYS, 21, 23])).unwrap();
    assert_eq!(prefix.links, 2);
    assert!(!prefix.own);
    assert!(!prefix.only);
    // So a new keyless conversation opening so is not drawn to the first holder scanned: of
    // the two holders, the one with fewer requests in flight takes it.
    let busy_a1 = fleet().in_flight("a1", 2).prompt(chain(&[SYS, 21, 23]));
    assert_eq!(
        busy_a1.choose(&NodeThenBackend::new(), None, None),
        Some("b2".into())
    );
}

#[test]
fn a_new_keyless_conversation_drawn_to_a_shared_prefix_goes_where_another_router_discovering_backends_otherwise_sends_it(
) {
    // x and y each hold the system prompt and one conversation continuing it, and are alike
    // in every count the policy reads. Two routers discovered them in opposite orders: a new
    // keyless prompt sharing the system prompt goes to the same one of the two on both, and
    // different prompts still spread over both.
    let fleet = |order: [&str; 2]| {
        order
            .iter()
            .fold(Snapshot::new(), |s, id| s.backend(id, "n", 2))
            .holds("x", &chain(&[SYS, 11]))
            .holds("y", &chain(&[SYS, 12]))
    };
    let firsts = placed_alike_whatever_the_discovery_order(
        16,
        || fleet(["x", "y"]),
        || fleet(["y", "x"]),
        |i| chain(&[SYS, 2_000 + i]),
    );
    assert_eq!(firsts.len(), 2, "16 prompts went to {firsts:?}");
}

#[test]
fn a_new_keyless_conversation_finding_every_backend_full_waits_where_another_router_discovering_backends_otherwise_sends_it(
) {
    // Every slot is taken: the backends are offered by free slots, all alike. Two routers that
    // discovered them in opposite orders offer each prompt's backends in the same order, and
    // different prompts go first to different backends.
    let p = NodeThenBackend::new();
    let full = |s: Snapshot| {
        ["a1", "a2", "b1", "b2"]
            .iter()
            .fold(s, |s, id| s.in_flight(id, 2))
    };
    let reversed = || {
        Snapshot::new()
            .backend("b2", "node-b", 2)
            .backend("b1", "node-b", 2)
            .backend("a2", "node-a", 2)
            .backend("a1", "node-a", 2)
    };
    let mut firsts = std::collections::HashSet::new();
    for i in 0..32 {
        let prompt = chain(&[SYS, 2_000 + i]);
        let here = full(two_by_two_of_two()).prompt(prompt.clone());
        let there = full(reversed()).prompt(prompt);
        let order = here.order(&p, None, None);
        assert_eq!(there.order(&p, None, None), order, "prompt {i}");
        firsts.insert(order[0].clone());
    }
    assert_eq!(firsts.len(), 4, "32 prompts went first to {firsts:?}");
}

#[test]
fn a_keyless_request_without_a_prompt_between_two_equal_backends_goes_by_its_random_number_not_by_discovery_order(
) {
    // Two backends alike, discovered in opposite orders by two routers drawing the same random
    // numbers: each draw picks the same backend on both, and the draws spread over both.
    let p = NodeThenBackend::new();
    let here = Snapshot::new().backend("x", "n", 2).backend("y", "n", 2);
    let there = Snapshot::new().backend("y", "n", 2).backend("x", "n", 2);
    let mut firsts = std::collections::HashSet::new();
    for i in 0..16 {
        let first = here.choose(&p, None, None).unwrap();
        assert_eq!(
            there.choose(&p, None, None),
            Some(first.clone()),
            "draw {i}"
        );
        firsts.insert(first);
    }
    assert_eq!(firsts.len(), 2, "16 draws went to {firsts:?}");
}

#[test]
fn a_keyless_request_whose_prefix_is_on_a_full_backend_takes_the_node_mate_another_router_discovering_backends_otherwise_takes(
) {
    // a1 holds the conversation's prefix and is full; a2 and a3, on its node, have as many
    // free slots. Two routers discovered the backends in opposite orders: each prompt goes to
    // the same node-mate on both, and different prompts spread over both.
    let fleet = |order: [(&str, &str); 4]| {
        order
            .iter()
            .fold(Snapshot::new(), |s, (id, node)| s.backend(id, node, 2))
            .holds("a1", &chain(&[SYS, 11, 12]))
            .in_flight("a1", 2)
    };
    let forth = [
        ("a1", "node-a"),
        ("a2", "node-a"),
        ("a3", "node-a"),
        ("b1", "node-b"),
    ];
    let back = [
        ("b1", "node-b"),
        ("a3", "node-a"),
        ("a2", "node-a"),
        ("a1", "node-a"),
    ];
    let firsts = placed_alike_whatever_the_discovery_order(
        16,
        || fleet(forth),
        || fleet(back),
        |i| chain(&[SYS, 11, 12, 2_000 + i]),
    );
    assert_eq!(
        firsts,
        ["a2", "a3"].into_iter().map(BackendId::from).collect(),
        "16 prompts"
    );
}
