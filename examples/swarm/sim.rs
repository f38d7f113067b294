//! The driver shared by every scenario: the real `SessionAffinity` service over simulated
//! backends, one policy at a time, on a paused virtual clock.

use std::future::Future;
use std::num::{NonZeroU32, NonZeroU64};
use std::sync::Arc;
use std::time::Duration;

use http_body_util::BodyExt;
use tokio::time::Instant;
use tower::{Layer, ServiceExt};
use tower_affinity::discover::StaticFleet;
use tower_affinity::key::{HeaderKey, PromptFacts};
use tower_affinity::placement::{
    BackendRef, Candidates, FleetView, LeastLoaded, NodeThenBackend, Placement, PlacementRequest,
    Rendezvous, RoundRobin,
};
use tower_affinity::{
    Backend, BackendId, Decision, NodeId, Overflow, PromptChain, SessionAffinityLayer, Sessions,
};

use crate::backend::{Prompt, Served, SimBackend};
use crate::cache::Blocks;
use crate::fleet::BackendSpec;
use crate::report::TurnRecord;
use crate::routers::{self, Router, SharedHomes};

/// The policies compared, all through the same service.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Policy {
    RoundRobin,
    LeastLoaded,
    Rendezvous,
    NodeThenBackend,
    /// `NodeThenBackend` with node patience: a session whose node is full waits up to
    /// [`PATIENCE`] for it before spilling to another node.
    Patient,
    /// `NodeThenBackend` told what the simulated caches really hold (`--oracle`): the bound
    /// of a perfect cache model under the same rules.
    Oracle,
}

/// The node patience of [`Policy::Patient`]: about one answer's decode time, far less than a
/// cross-node move costs.
pub(crate) const PATIENCE: Duration = Duration::from_secs(30);

impl Policy {
    pub(crate) const ALL: [Policy; 5] = [
        Policy::RoundRobin,
        Policy::LeastLoaded,
        Policy::Rendezvous,
        Policy::NodeThenBackend,
        Policy::Patient,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Policy::RoundRobin => "RoundRobin",
            Policy::LeastLoaded => "LeastLoaded",
            Policy::Rendezvous => "Rendezvous",
            Policy::NodeThenBackend => "NodeThenBackend",
            Policy::Patient => "NTB+patience",
            Policy::Oracle => "NTB+oracle",
        }
    }

    fn placement(self, sims: &[(BackendId, SimBackend)]) -> Arc<dyn Placement> {
        match self {
            Policy::Oracle => Arc::new(Oracle {
                sims: sims.to_vec(),
            }),
            Policy::RoundRobin => Arc::new(RoundRobin::new()),
            Policy::LeastLoaded => Arc::new(LeastLoaded::new()),
            Policy::Rendezvous => Arc::new(Rendezvous),
            Policy::NodeThenBackend | Policy::Patient => Arc::new(node_then_backend()),
        }
    }
}

/// `NodeThenBackend` with the live window of [`set_live_window`].
fn node_then_backend() -> NodeThenBackend {
    match LIVE_WINDOW.with(std::cell::Cell::get) {
        Some(w) => NodeThenBackend::new().live_window(w),
        None => NodeThenBackend::new(),
    }
}

pub(crate) type Svc = Router;

/// The blocks of a turn's prompt, as a request extension: what [`Oracle`] compares with the
/// simulated caches.
#[derive(Clone)]
pub(crate) struct SeenBlocks(pub(crate) Blocks);

/// `NodeThenBackend`'s rules with the truth in place of the cache model: a backend that alone
/// holds the longest prefix of the prompt, by the simulated caches themselves, is offered
/// first (a home that really holds the session, or the one backend holding more of it than
/// any other), then the backends of its node; the rest is `NodeThenBackend`'s.
struct Oracle {
    sims: Vec<(BackendId, SimBackend)>,
}

impl Placement for Oracle {
    fn place(&self, fleet: &FleetView<'_>, req: &PlacementRequest<'_>, c: &mut Candidates<'_>) {
        if let Some(SeenBlocks(blocks)) = req.extensions.get::<SeenBlocks>() {
            let held = |b: &BackendRef<'_>| {
                self.sims
                    .iter()
                    .find(|(id, _)| id == b.id())
                    .map_or(0, |(_, sim)| sim.holds(blocks))
            };
            let mut best: Option<(u64, BackendRef<'_>)> = None;
            let mut ties = 0;
            for b in fleet.backends() {
                let n = held(&b);
                match best {
                    Some((m, _)) if n < m => {}
                    Some((m, _)) if n == m => ties += 1,
                    _ if n == 0 => {}
                    _ => {
                        best = Some((n, b));
                        ties = 0;
                    }
                }
            }
            if let (Some((_, b)), 0) = (best, ties) {
                if c.offer(b).is_break() {
                    return;
                }
                for other in b.node().backends() {
                    if c.offer(other).is_break() {
                        return;
                    }
                }
            }
        }
        node_then_backend().place(fleet, req, c)
    }
}

thread_local! {
    static ROUTER_CONTEXT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static ASSIGN_SLOTS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static LIVE_WINDOW: std::cell::Cell<Option<Duration>> = const { std::cell::Cell::new(None) };
}

/// The live window of the `NodeThenBackend` routers built on this thread from now on
/// (`--live-window`, [`NodeThenBackend::live_window`]); `None`: its default.
pub(crate) fn set_live_window(window: Option<Duration>) {
    LIVE_WINDOW.with(|c| c.set(window));
}

/// Whether the routers built on this thread from now on assign each backend's slots
/// (`--assign-slots`, [`Backend::assign_slots`]).
pub(crate) fn set_assign_slots(on: bool) {
    ASSIGN_SLOTS.with(|c| c.set(on));
}

/// Whether the routers built on this thread from now on give each backend its VRAM's tokens
/// as the context its running requests share (`--router-context`,
/// [`Backend::context_tokens`]).
pub(crate) fn set_router_context(on: bool) {
    ROUTER_CONTEXT.with(|c| c.set(on));
}

/// The service for `policy` over a fresh fleet, and the fleet's backends: one router, or the
/// replicas [`routers::get`] says, each modelling its share of every backend's cache.
pub(crate) fn build(policy: Policy, fleet: &[BackendSpec]) -> (Svc, Vec<SimBackend>) {
    let sims: Vec<SimBackend> = fleet.iter().map(|s| SimBackend::new(s.model)).collect();
    let named: Vec<(BackendId, SimBackend)> = fleet
        .iter()
        .zip(&sims)
        .map(|(s, sim)| (BackendId::from(s.id.as_str()), sim.clone()))
        .collect();
    let replicas = routers::get();
    let shared = replicas.shared_store.then(SharedHomes::default);
    let services = (0..replicas.routers.max(1))
        .map(|i| {
            let discovery = StaticFleet::new(fleet.iter().zip(&sims).map(|(s, sim)| {
                let slots = if replicas.slot_shares {
                    s.model.slots.div_ceil(replicas.routers.max(1) as u32)
                } else {
                    s.model.slots
                };
                let slots = NonZeroU32::new(slots).unwrap_or(NonZeroU32::MIN);
                let b = Backend::new(s.node.as_str(), sim.clone())
                    .slots(slots)
                    .prompt_cache_bytes(s.model.ram_bytes)
                    .cache_tokens(s.model.cache_tokens());
                let b = match NonZeroU64::new(s.model.vram_tokens) {
                    Some(vram) if ROUTER_CONTEXT.with(std::cell::Cell::get) => {
                        b.context_tokens(vram)
                    }
                    _ => b,
                };
                let b = match ASSIGN_SLOTS.with(std::cell::Cell::get) {
                    true => b.assign_slots(),
                    false => b,
                };
                (s.id.as_str(), b)
            }));
            let mut layer = SessionAffinityLayer::new()
                .key(HeaderKey::default())
                // Each replica models its share of every backend's cache.
                .replicas(NonZeroU32::new(replicas.routers as u32).unwrap_or(NonZeroU32::MIN))
                .placement(policy.placement(&named))
                // Agents wait as long as it takes: a refused turn would only be retried.
                .overflow(Overflow::wait(Duration::from_secs(24 * 3600), 1 << 20))
                .node_patience(if policy == Policy::Patient {
                    PATIENCE
                } else {
                    Duration::ZERO
                })
                // The baselines stand for routers that place and forget: no waiting for a cache.
                .wait_versus_move(matches!(policy, Policy::NodeThenBackend | Policy::Oracle))
                // The same run, the same table.
                .random_seed(0x5eed + i as u64)
                .sessions(
                    Sessions::new()
                        .max_entries(1 << 20)
                        .idle_timeout(Duration::from_secs(24 * 3600)),
                );
            if let Some(store) = &shared {
                layer = layer.home_store(store.clone());
            }
            layer.layer(discovery)
        })
        .collect();
    (Router::new(services, replicas.entry, 0x5eed), sims)
}

/// Runs `f` on a current-thread runtime whose clock is paused: time advances only when every
/// task waits, straight to the next timer, so hours of fleet time take milliseconds and the
/// order of events depends on nothing but the inputs. Agents are local tasks (`spawn_local`):
/// one thread runs everything, so nothing needs to be `Send`.
pub(crate) fn block_on<F: Future>(f: F) -> F::Output {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a current-thread runtime");
    tokio::task::LocalSet::new().block_on(&rt, f)
}

/// Where a session's previous turn ran.
#[derive(Clone, Debug)]
pub(crate) struct Position {
    backend: BackendId,
    node: NodeId,
}

/// What a turn needs besides its prompt.
pub(crate) struct TurnInput<'a> {
    /// Which conversation this is, whether or not the agent sends a key.
    pub(crate) conversation: u32,
    /// The session's key, sent as `X-Session-Id`; `None` when the agents send no key.
    pub(crate) session: Option<&'a str>,
    pub(crate) prompt: Prompt,
    pub(crate) prev_prompt: Option<u64>,
    pub(crate) compaction: bool,
    pub(crate) ideal: u64,
    /// The chain a body-reading layer would attach; `None`: one link per block of `prompt`.
    pub(crate) chain: Option<PromptChain>,
}

/// Sends one turn, reads its answer to the end, and records it.
pub(crate) async fn turn(
    svc: &Svc,
    input: TurnInput<'_>,
    prev: &mut Option<Position>,
) -> TurnRecord {
    let t0 = Instant::now();
    // What a body-reading layer would attach: the chain of the prompt's blocks.
    let facts = PromptFacts::from_chain(input.chain.clone().unwrap_or_else(|| {
        PromptChain::from_blocks(input.prompt.blocks.iter().map(|b| (b.id, b.tokens)))
    }));
    let res = loop {
        let mut req = http::Request::post("/v1/chat/completions");
        if let Some(session) = input.session {
            req = req.header("x-session-id", session);
        }
        let mut req = req.body(input.prompt.clone()).expect("a valid request");
        req.extensions_mut().insert(facts.clone());
        req.extensions_mut()
            .insert(SeenBlocks(input.prompt.blocks.clone()));
        match svc.clone().oneshot(req).await {
            Ok(res) => break res,
            Err(e) => match e.retry_after() {
                Some(after) => tokio::time::sleep(after).await,
                None => panic!("simulated backends do not fail: {e}"),
            },
        }
    };
    let ttft = t0.elapsed();
    let decision = res
        .extensions()
        .get::<Decision>()
        .cloned()
        .expect("every response carries a Decision");
    let served = *res
        .extensions()
        .get::<Served>()
        .expect("the simulated backend reports what it reused");
    // Reading the answer to its end is what keeps the slot busy while it streams.
    let _ = res.into_body().collect().await;
    let (moved_node, moved_backend) = match prev.as_ref() {
        None => (false, false),
        Some(p) if p.node != decision.node => (true, false),
        Some(p) => (false, p.backend != decision.backend),
    };
    *prev = Some(Position {
        backend: decision.backend.clone(),
        node: decision.node,
    });
    TurnRecord {
        conversation: input.conversation,
        sent: t0,
        prompt: crate::cache::tokens(&input.prompt.blocks),
        backend: decision.backend,
        outcome: decision.outcome,
        prev_prompt: input.prev_prompt,
        compaction: input.compaction,
        reused: served.reused,
        ideal: input.ideal,
        source: served.source,
        moved_node,
        moved_backend,
        ttft,
    }
}
