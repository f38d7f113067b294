use std::fmt;
use std::sync::atomic::Ordering;

use crate::fleet::{Member, NodeEntry, Topology};
use crate::key::SessionKey;
use crate::{BackendId, NodeId};

use super::rendezvous::{self, RankSet};

/// A read-only view of the fleet, handed to a [`Placement`](super::Placement).
///
/// Slot counts and in-flight counts are read live: another request may take a slot between
/// the moment a policy reads a count and the moment the service tries the candidate, which is
/// why the service, not the policy, takes the slot.
#[derive(Clone, Copy)]
pub struct FleetView<'a> {
    pub(crate) topology: &'a Topology,
}

impl<'a> FleetView<'a> {
    /// The live backends, in the order they were discovered.
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

    /// Requests in flight over the whole fleet. O(backends): it sums their counters.
    pub fn in_flight(&self) -> usize {
        self.topology.in_flight()
    }
}

impl fmt::Debug for FleetView<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.backends()).finish()
    }
}

/// One live backend, as a policy sees it.
#[derive(Clone, Copy)]
pub struct BackendRef<'a> {
    topology: &'a Topology,
    pub(crate) index: u32,
}

impl<'a> BackendRef<'a> {
    pub(crate) fn new(topology: &'a Topology, index: u32) -> Self {
        BackendRef { topology, index }
    }

    fn member(&self) -> &'a Member {
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
        self.member().load.in_flight.load(Ordering::Relaxed)
    }

    /// Slots not taken right now.
    pub fn free_slots(&self) -> u32 {
        self.slots().saturating_sub(self.in_flight())
    }

    /// The backend's prompt-cache budget in bytes, if discovery gave one.
    pub fn prompt_cache_bytes(&self) -> Option<u64> {
        self.member().prompt_cache_bytes
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

/// One node, as a policy sees it.
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

impl fmt::Debug for NodeRef<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Node")
            .field("id", self.id())
            .field("backends", &self.entry().backends.len())
            .finish()
    }
}

/// Where a session was served last.
#[derive(Clone, Copy, Debug)]
pub struct Home<'a> {
    /// The backend, or `None` if it has been removed since.
    pub backend: Option<BackendRef<'a>>,
    /// The backend's node. It may have no live backend left.
    pub node: NodeRef<'a>,
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
        }
    }

    /// Sets the request's random number.
    pub fn random(mut self, random: u64) -> Self {
        self.random = random;
        self
    }
}
