use std::ops::ControlFlow;

use crate::key::SessionKey;

use super::{
    freer_of_two, BackendRef, Candidates, FleetView, NodeRef, Placement, PlacementRequest,
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
/// A request without a key goes to the freer of two backends sampled at random (power of two
/// choices); if neither has a free slot, to the backend with the most free slots.
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
#[derive(Clone, Copy, Debug, Default)]
pub struct NodeThenBackend {
    load_bound: Option<f64>,
}

impl NodeThenBackend {
    /// The policy without a load bound.
    pub const fn new() -> Self {
        NodeThenBackend { load_bound: None }
    }

    /// Bounds the load new sessions may add to one backend: a backend whose share of taken
    /// slots would exceed `1 + epsilon` times the fleet's is passed over for new sessions while
    /// another has room below the bound. Negative or non-finite values are read as 0.
    pub fn load_bound(mut self, epsilon: f64) -> Self {
        let e = if epsilon.is_finite() {
            epsilon.max(0.0)
        } else {
            0.0
        };
        self.load_bound = Some(e);
        self
    }
}

impl Placement for NodeThenBackend {
    fn place(&self, fleet: &FleetView<'_>, req: &PlacementRequest<'_>, c: &mut Candidates<'_>) {
        let Some(key) = req.key else {
            let _ = freer_of_two(fleet, req.random, c);
            return;
        };
        let _ = match req.home {
            Some(home) => {
                // Home, then its node, then everywhere else.
                let skip = home.backend.map(|b| b.index);
                if let Some(b) = home.backend {
                    if c.offer(b).is_break() {
                        return;
                    }
                }
                if offer_node(home.node, key, skip, None, c).is_break() {
                    return;
                }
                offer_nodes(fleet, key, Some(home.node.index), None, c)
            }
            None => {
                if let Some(e) = self.load_bound {
                    let bound = Bound::new(fleet, e);
                    if offer_nodes(fleet, key, None, Some(&bound), c).is_break() {
                        return;
                    }
                }
                offer_nodes(fleet, key, None, None, c)
            }
        };
    }
}

/// The utilisation a backend may reach before new sessions pass it over.
struct Bound {
    /// Fleet utilisation after this request, times `1 + epsilon`.
    limit: f64,
}

impl Bound {
    fn new(fleet: &FleetView<'_>, epsilon: f64) -> Self {
        let slots = fleet.topology.total_slots.max(1);
        let avg = (fleet.in_flight() + 1) as f64 / f64::from(slots);
        Bound {
            limit: (1.0 + epsilon) * avg,
        }
    }

    fn admits(&self, b: &BackendRef<'_>) -> bool {
        f64::from(b.in_flight() + 1) / f64::from(b.slots().max(1)) <= self.limit
    }
}

/// Offers the backends of `node` in the key's rendezvous order, skipping `skip`.
fn offer_node(
    node: NodeRef<'_>,
    key: SessionKey,
    skip: Option<u32>,
    bound: Option<&Bound>,
    c: &mut Candidates<'_>,
) -> ControlFlow<()> {
    let admit = |i: u32| Some(i) != skip && bound.is_none_or(|l| l.admits(&node.backend(i)));
    node.ranks().visit(key, admit, |i| c.offer(node.backend(i)))
}

/// Offers every node except `skip`, in the key's rendezvous order.
fn offer_nodes(
    fleet: &FleetView<'_>,
    key: SessionKey,
    skip: Option<u32>,
    bound: Option<&Bound>,
    c: &mut Candidates<'_>,
) -> ControlFlow<()> {
    let t = fleet.topology;
    t.live_nodes.visit(
        key,
        |n| Some(n) != skip,
        |n| offer_node(NodeRef::new(t, n), key, None, bound, c),
    )
}
