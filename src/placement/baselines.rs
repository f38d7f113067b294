//! Baseline policies: free routing and stateless hashing, for comparison.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::{
    freer_of_two, most_free_slots, Candidates, FleetView, Placement, PlacementRequest, Ties,
};

/// Every request to the next backend in turn, ignoring sessions.
///
/// ```
/// use tower_affinity::placement::{RoundRobin, Snapshot};
///
/// let fleet = Snapshot::new().backend("a", "n", 1).backend("b", "n", 1);
/// let rr = RoundRobin::new();
/// let first = fleet.choose(&rr, None, None).unwrap();
/// let second = fleet.choose(&rr, None, None).unwrap();
/// assert_ne!(first, second);
/// ```
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl RoundRobin {
    /// A round robin starting at the first backend.
    pub const fn new() -> Self {
        RoundRobin {
            next: AtomicUsize::new(0),
        }
    }
}

impl Clone for RoundRobin {
    fn clone(&self) -> Self {
        RoundRobin {
            next: AtomicUsize::new(self.next.load(Ordering::Relaxed)),
        }
    }
}

impl Placement for RoundRobin {
    fn place(&self, fleet: &FleetView<'_>, _: &PlacementRequest<'_>, c: &mut Candidates<'_>) {
        let n = fleet.len();
        if n == 0 {
            return;
        }
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        for i in 0..n {
            if let Some(b) = fleet.backend_at((start + i) % n) {
                if c.offer(b).is_break() {
                    return;
                }
            }
        }
    }
}

/// Every request to the backend with the most free slots, ignoring sessions: the default
/// routing of the measured study. Backends that tie take turns: each call takes the next of
/// the tied backends in fleet order, so ties share the requests evenly whatever positions the
/// other backends hold; a backend down takes no turn. O(backends) a call.
///
/// ```
/// use tower_affinity::placement::{LeastLoaded, Snapshot};
///
/// let fleet = Snapshot::new().backend("a", "n", 2).backend("b", "n", 2).in_flight("a", 1);
/// assert_eq!(fleet.choose(&LeastLoaded::new(), None, None), Some("b".into()));
/// ```
#[derive(Debug, Default)]
pub struct LeastLoaded {
    next: AtomicUsize,
}

impl LeastLoaded {
    /// The policy.
    pub const fn new() -> Self {
        LeastLoaded {
            next: AtomicUsize::new(0),
        }
    }
}

impl Clone for LeastLoaded {
    fn clone(&self) -> Self {
        LeastLoaded {
            next: AtomicUsize::new(self.next.load(Ordering::Relaxed)),
        }
    }
}

impl Placement for LeastLoaded {
    fn place(&self, fleet: &FleetView<'_>, _: &PlacementRequest<'_>, c: &mut Candidates<'_>) {
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let _ = most_free_slots(fleet, Ties::Rotate(start), c);
    }
}

/// Stateless hashing: always the key's rendezvous winner among backends with a free slot,
/// whatever served the session last. This is how a purely hashed router behaves: after a spill,
/// the next turn goes back to the first choice even though the cache now sits elsewhere.
///
/// Keyless requests go to the freer of two backends sampled at random, as with
/// [`NodeThenBackend`](super::NodeThenBackend).
///
/// ```
/// use tower_affinity::key::SessionKey;
/// use tower_affinity::placement::{Rendezvous, Snapshot};
///
/// let fleet = Snapshot::new().backend("a", "n", 1).backend("b", "m", 1);
/// let key = Some(SessionKey::from_bytes(b"s"));
/// let first = fleet.choose(&Rendezvous, key, None).unwrap();
/// // The home is ignored: the key's winner is chosen again.
/// let other = if first.as_str() == "a" { "b" } else { "a" };
/// assert_eq!(fleet.choose(&Rendezvous, key, Some(other)), Some(first));
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct Rendezvous;

impl Placement for Rendezvous {
    fn place(&self, fleet: &FleetView<'_>, req: &PlacementRequest<'_>, c: &mut Candidates<'_>) {
        let Some(key) = req.key else {
            let _ = freer_of_two(fleet, req.random, c);
            return;
        };
        let t = fleet.topology;
        let _ = t
            .live
            .visit(key, |_| true, |i| c.offer(super::BackendRef::new(t, i)));
    }
}
