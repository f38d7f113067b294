//! The rules of placement, one test each, on fleets built by hand (no runtime).

use tower_affinity::key::SessionKey;
use tower_affinity::placement::{
    LeastLoaded, NodeThenBackend, Placement, Rendezvous, RoundRobin, Snapshot,
};
use tower_affinity::BackendId;

use proptest::prelude::*;

fn key(s: &str) -> Option<SessionKey> {
    Some(SessionKey::from_bytes(s.as_bytes()))
}

fn ids(v: &[&str]) -> Vec<BackendId> {
    v.iter().map(|&s| BackendId::from(s)).collect()
}

/// Two nodes of two backends, one slot each.
fn two_by_two() -> Snapshot {
    Snapshot::new()
        .backend("a1", "node-a", 1)
        .backend("a2", "node-a", 1)
        .backend("b1", "node-b", 1)
        .backend("b2", "node-b", 1)
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
    let p = NodeThenBackend::new();
    let n = 8000;
    let big = (0..n)
        .filter(|i| {
            fleet
                .choose(&p, key(&format!("k{i}")), None)
                .unwrap()
                .as_str()
                == "big-1"
        })
        .count();
    let share = big as f64 / n as f64;
    assert!((share - 0.75).abs() < 0.03, "share {share}");
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

#[test]
fn load_bound_keeps_new_sessions_off_busy_backends() {
    // The key's first choice is busy well above the fleet's average: with a bound, a new
    // session goes elsewhere; without, it does not.
    let base = || {
        Snapshot::new()
            .backend("a1", "a", 4)
            .backend("b1", "b", 4)
            .backend("c1", "c", 4)
            .backend("d1", "d", 4)
    };
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
fn an_empty_fleet_offers_nothing() {
    let empty = Snapshot::new();
    assert!(empty
        .order(&NodeThenBackend::new(), key("s"), None)
        .is_empty());
    assert!(empty.order(&RoundRobin::new(), None, None).is_empty());
    assert!(empty.order(&LeastLoaded::new(), None, None).is_empty());
    assert!(empty.order(&Rendezvous, key("s"), None).is_empty());
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
