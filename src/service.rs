//! [`SessionAffinity`]: discovery, placement and dispatch.

use std::cell::Cell;
use std::collections::hash_map::RandomState;
use std::fmt;
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use tokio::time::Instant;
use tower::discover::{Change, Discover};
use tower::Service;

use crate::body::Watch;
use crate::cache::{reuse, Record};
use crate::error::BoxError;
use crate::fleet::{Capacity, Fleet, Member, SlotGuard, Topology};
use crate::future::{Finish, ResponseFuture};
use crate::key::{KeyExtractor, PromptFacts, SessionKey};
use crate::learn::{Learned, Prior};
use crate::placement::{
    request_prefix, BackendRef, Candidates, FleetView, Home, HomeCache, NodeRef, Placement,
    PlacementRequest, Refused,
};
use crate::stats::{Decision, Outcome, Stats};
use crate::store::{HomeStore, Homes, StoreAnswer, StoreState, StoreStats};
use crate::table::{HomeEntry, SessionStore, SessionTable, Sessions};
use crate::wait::{Look, Scope, WaitHome};
use crate::{
    Backend, BackendId, BackendStatus, ContextRefusal, Error, Overflow, PromptChain, ResponseBody,
};

/// The most discovery changes applied in one readiness poll, so a stream that never stops
/// yielding cannot hold a caller forever.
const DRAIN_LIMIT: usize = 256;

/// A load-balancing service that keeps each session close to the cache that served it last.
///
/// Built by [`SessionAffinityLayer`](crate::SessionAffinityLayer) over a discovery stream `D`,
/// with key extractor `K` and placement policy `P`. Cheap to clone: clones share the fleet, the
/// session table and the counters.
///
/// `poll_ready` applies pending discovery changes without blocking and is otherwise always
/// ready: the key is only known in `call`, so no single backend's readiness means anything.
/// It looks at the discovery stream only after the stream has signalled a change, so with a
/// quiet stream it writes nothing that the clones share. A change also wakes the requests
/// waiting for a slot, which apply it themselves: a backend announced while every slot is
/// taken serves them without waiting for another request to arrive. One poll applies at most
/// 256 changes, so that a stream that never stops yielding cannot hold its caller; the rest
/// wait for the next poll. A fleet announced in more changes at once than that (a
/// [`StaticFleet`](crate::discover::StaticFleet) of 600 backends) is complete after a few
/// requests, or at once after [`apply_discovery`](Self::apply_discovery).
/// `call` places the request and takes a slot on the chosen backend; if that backend is ready
/// (it is polled once, with a waker that does nothing), `call` calls it at once, and the
/// response future drives the backend's own future. Otherwise the response future waits for the
/// backend's readiness, or for a slot if the [`Overflow`] policy says so.
///
/// So backpressure is the [`Overflow`] policy's, not readiness: behind a `tower::buffer::Buffer`
/// requests wait in their response futures (or are refused), not in the buffer. A `call` that
/// no `poll_ready` preceded, as tower's contract asks, is still served, but without the
/// discovery changes not yet applied: a service that was never polled has no backends.
///
/// Clones share the backend services: the service and its futures are `Send` when each
/// backend service is `Send + Sync`. tower's `BoxCloneService` is not `Sync`; box backends as
/// `BoxCloneSyncService`.
///
/// `K` and `P` default to the layer's defaults, [`HeaderKey`] and [`NodeThenBackend`], so
/// that the type a field or axum's `State` holds names only what was changed:
///
/// ```
/// use bytes::Bytes;
/// use http_body_util::Full;
/// use tower::util::BoxCloneSyncService;
/// use tower::Layer;
/// use tower_affinity::discover::StaticFleet;
/// use tower_affinity::key::{ExtensionKey, FirstOf, HeaderKey};
/// use tower_affinity::{Backend, SessionAffinity, SessionAffinityLayer};
///
/// type Http = BoxCloneSyncService<
///     http::Request<Full<Bytes>>,
///     http::Response<String>,
///     std::convert::Infallible,
/// >;
/// // The default key and placement.
/// type Plain = SessionAffinity<StaticFleet<Http>>;
/// // The key read from headers, else from the body.
/// type Keyed = SessionAffinity<StaticFleet<Http>, FirstOf<HeaderKey, ExtensionKey>>;
///
/// # fn backend() -> Http { unimplemented!() }
/// # fn doc() {
/// let fleet = || StaticFleet::new([("gpu-0", Backend::new("host-a", backend()))]);
/// let plain: Plain = SessionAffinityLayer::new().layer(fleet());
/// let keyed: Keyed = SessionAffinityLayer::new()
///     .key(FirstOf::new(HeaderKey::default(), ExtensionKey))
///     .layer(fleet());
/// # let _ = (plain, keyed);
/// # }
/// ```
///
/// [`HeaderKey`]: crate::key::HeaderKey
/// [`NodeThenBackend`]: crate::placement::NodeThenBackend
pub struct SessionAffinity<
    D: Discover,
    K = crate::key::HeaderKey,
    P = crate::placement::NodeThenBackend,
> {
    /// Holds the discovery stream too, behind [`Drain`]: response futures waiting for a slot
    /// drain it as readiness does.
    shared: Arc<Shared<D::Service, P>>,
    key: K,
    _discover: PhantomData<fn() -> D>,
}

/// The discovery stream, shared by every clone of the service.
///
/// The stream is polled with a waker of its own, which counts its wake-ups. Readiness, and a
/// request waiting for a slot, drain the stream only when it has been woken since the last
/// drain began, so requests on a quiet stream read two counters and write nothing shared.
struct Discovery<D> {
    /// `None` once the stream has ended.
    stream: Mutex<Option<Pin<Box<D>>>>,
    signal: Arc<Signal>,
    /// Wakes `signal`: the waker the stream is polled with.
    waker: Waker,
}

/// The discovery stream's wake-ups, and how many of them the last complete drain had seen.
struct Signal {
    woken: AtomicU64,
    drained: AtomicU64,
    /// The fleet's counters: a wake-up also wakes the requests waiting for a slot, which drain
    /// the stream themselves (a new backend may have room for them).
    capacity: Arc<Capacity>,
}

impl Signal {
    /// Whether the stream may have changes that no drain has looked for yet.
    fn due(&self) -> bool {
        self.drained.load(Ordering::Acquire) != self.woken.load(Ordering::Acquire)
    }
}

impl Wake for Signal {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.fetch_add(1, Ordering::AcqRel);
        self.capacity.wake_all();
    }
}

/// Applying the discovery changes that are ready to the fleet: by readiness, and by requests
/// waiting for a slot, which know the service's state but not its discovery stream's type.
pub(crate) trait Drain<B, P>: Send + Sync {
    /// Applies the changes that are ready to `shared`'s fleet, without blocking.
    fn drain(&self, shared: &Shared<B, P>, cx: &mut Context<'_>);

    /// Whether the stream may have changes that no drain has applied yet: it signalled
    /// since the last complete drain, or a drain stopped at its limit with more ready.
    fn due(&self) -> bool;
}

/// State shared by every clone of the service and by its response futures.
pub(crate) struct Shared<B, P> {
    /// The current fleet, replaced whole on discovery changes: reading it takes no lock.
    pub(crate) fleet: ArcSwap<Fleet<B>>,
    pub(crate) table: SessionTable,
    /// The shared store of homes, if the replicas share one.
    pub(crate) store: Option<Arc<Homes>>,
    placement: P,
    pub(crate) overflow: Overflow,
    /// The fleet's counters (the same `Arc` every backend's slot counter holds).
    pub(crate) capacity: Arc<Capacity>,
    /// What a response future needs once its backend is chosen.
    pub(crate) finish: Finish,
    /// How long a session waits for its home node before spilling (under `Overflow::Wait`).
    pub(crate) node_patience: Duration,
    /// Whether a request may wait for the full backend holding its prefix (under
    /// `Overflow::Wait`, without node patience).
    wait_versus_move: bool,
    /// Whether answers are read for the usage they report.
    observe: bool,
    /// The next draw of a seeded sequence of random numbers; `None` draws from the thread's
    /// own generator.
    seeded: Option<AtomicU64>,
    /// The discovery stream, for requests waiting for a slot.
    discovery: Arc<dyn Drain<B, P>>,
}

/// What a request no backend can take is refused with ([`Error::NoBackends`]):
/// `retry_after` is when the first backend the request may go to, down for a failure
/// cooldown, comes back; the fleet had `backends`, `up` of them up (and passed over).
#[derive(Clone, Copy, Debug)]
pub(crate) struct NoBackend {
    pub(crate) retry_after: Option<Duration>,
    pub(crate) backends: usize,
    pub(crate) up: usize,
}

/// The result of one placement attempt.
pub(crate) enum Placed<S> {
    /// A slot was taken on a backend.
    Dispatch {
        service: S,
        guard: SlotGuard,
        decision: Decision,
        /// What the response body learns from, when answers are observed.
        watch: Option<Watch>,
        /// The request's chain, owed to the chosen backend's cache model.
        record: Option<Record>,
    },
    /// No candidate had a free slot, or waiting for `home` was ruled cheaper than a slot
    /// taken elsewhere, which was given back.
    Full { home: WaitHome },
    /// The fleet is empty, or every backend is marked down, or the policy passed over every
    /// backend up.
    Empty(NoBackend),
    /// A retried refusal that no other backend takes: the refusal answers.
    Answered(Box<crate::retry::FirstAnswer>),
}

/// Settings the layer hands to the service.
#[derive(Clone, Debug)]
pub(crate) struct Config {
    pub(crate) overflow: Overflow,
    pub(crate) sessions: Sessions,
    pub(crate) decision_headers: bool,
    pub(crate) decision_extension: bool,
    pub(crate) failure_cooldown: Duration,
    pub(crate) ready_timeout: Option<Duration>,
    pub(crate) node_patience: Duration,
    pub(crate) wait_versus_move: bool,
    pub(crate) observe_usage: bool,
    pub(crate) replicas: std::num::NonZeroU32,
    pub(crate) store: Option<Arc<dyn HomeStore>>,
    pub(crate) store_deadline: Duration,
    pub(crate) random_seed: Option<u64>,
    /// What [`metrics_labels`](crate::SessionAffinityLayer::metrics_labels) gave.
    #[cfg(feature = "metrics")]
    pub(crate) metrics_labels: Vec<(String, String)>,
}

impl<D, K, P, S> SessionAffinity<D, K, P>
where
    D: Discover<Key = BackendId, Service = Backend<S>> + Send + 'static,
    D::Error: Into<BoxError>,
    S: Clone,
{
    pub(crate) fn new(discover: D, key: K, placement: P, config: Config) -> Self {
        #[cfg(feature = "metrics")]
        let labels = crate::metrics::Labels::new(&config.metrics_labels);
        #[cfg(not(feature = "metrics"))]
        let labels = crate::metrics::Labels::default();
        let fleet = Fleet::new(config.replicas.get(), labels);
        let capacity = fleet.topology.capacity.clone();
        // A wait of no time, or with no room for anyone, is none: as under `Reject`, a
        // request is never held out for one place (its home's node, the full backend holding
        // its prefix), which it could not wait for, and is placed in one look.
        let waits = matches!(
            config.overflow,
            Overflow::Wait { max_wait, max_queued } if !max_wait.is_zero() && max_queued > 0
        );
        // Woken once already: the first readiness drains.
        let signal = Arc::new(Signal {
            woken: AtomicU64::new(1),
            drained: AtomicU64::new(0),
            capacity: capacity.clone(),
        });
        let discover = Arc::new(Discovery {
            stream: Mutex::new(Some(Box::pin(discover))),
            waker: Waker::from(signal.clone()),
            signal,
        });
        SessionAffinity {
            shared: Arc::new(Shared {
                capacity,
                fleet: ArcSwap::from_pointee(fleet),
                table: SessionTable::new(config.sessions),
                store: config.store.map(|store| {
                    let (ttl, bound) = (config.sessions.idle(), config.sessions.entries());
                    Arc::new(Homes::new(store, config.store_deadline, ttl, bound))
                }),
                placement,
                overflow: config.overflow,
                finish: Finish {
                    decision_headers: config.decision_headers,
                    decision_extension: config.decision_extension,
                    failure_cooldown: config.failure_cooldown,
                    ready_timeout: config.ready_timeout,
                },
                node_patience: match waits {
                    true => config.node_patience,
                    false => Duration::ZERO,
                },
                wait_versus_move: waits
                    && config.node_patience.is_zero()
                    && config.wait_versus_move,
                observe: config.observe_usage,
                seeded: config.random_seed.map(AtomicU64::new),
                discovery: discover,
            }),
            key,
            _discover: PhantomData,
        }
    }
}

impl<D, K, P, S> SessionAffinity<D, K, P>
where
    D: Discover<Key = BackendId, Service = Backend<S>>,
{
    /// A snapshot of the decision counters and gauges.
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use tower::{service_fn, Layer, ServiceExt};
    /// use tower_affinity::{discover::StaticFleet, Backend, SessionAffinityLayer};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let backend = service_fn(|_: http::Request<String>| async {
    ///     Ok::<_, Infallible>(http::Response::new(String::new()))
    /// });
    /// let svc = SessionAffinityLayer::new()
    ///     .layer(StaticFleet::new([("gpu-0", Backend::new("host-a", backend))]));
    /// let turn = || {
    ///     let req = http::Request::post("/v1/chat/completions").header("x-session-id", "agent-1");
    ///     req.body(String::new()).unwrap()
    /// };
    /// for _ in 0..3 {
    ///     svc.clone().oneshot(turn()).await.unwrap();
    /// }
    /// let stats = svc.stats();
    /// assert_eq!((stats.new_sessions, stats.home_hits), (1, 2));
    /// assert_eq!((stats.sessions, stats.in_flight), (1, 0));
    /// # }
    /// ```
    pub fn stats(&self) -> Stats {
        let s = &self.shared;
        Stats {
            sessions: s.table.len(),
            session_table_bytes: s.table.memory_bytes(),
            cache_model_bytes: s.fleet.load().topology.cache_model_bytes(),
            in_flight: s.fleet.load().topology.in_flight(),
            waiting: s.capacity.waiting.load(Ordering::Relaxed),
            ..s.capacity.counters.snapshot()
        }
    }

    /// Sets the level gauges of the [`metrics`](crate::metrics) facade (in flight, waiting,
    /// sessions, and per backend its slots, health, in flight, cached tokens, conversations
    /// and prefill rate) from the service as it is now, and with a shared store its state and
    /// counters ([`store_stats`](Self::store_stats)). Call it before rendering a scrape;
    /// events (decisions, waits, failures, reported tokens) are recorded as they happen.
    ///
    /// ```
    /// # fn doc<D: tower::discover::Discover<Key = tower_affinity::BackendId, Service = tower_affinity::Backend<S>>, S, K, P>(
    /// #     svc: &tower_affinity::SessionAffinity<D, K, P>) {
    /// svc.publish_metrics();
    /// // then render the application's exporter
    /// # }
    /// ```
    #[cfg(feature = "metrics")]
    #[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
    pub fn publish_metrics(&self) {
        let labels = &self.shared.capacity.counters.labels;
        crate::metrics::publish(labels, &self.stats());
        let now = self.shared.capacity.now_ms(Instant::now());
        self.shared.fleet.load().topology.publish_levels(now);
        if let Some(store) = self.store_stats() {
            crate::metrics::publish_store(labels, &store);
        }
    }

    /// The shared store's counters and state, if the service has one
    /// ([`SessionAffinityLayer::home_store`](crate::SessionAffinityLayer::home_store)).
    pub fn store_stats(&self) -> Option<StoreStats> {
        self.shared.store.as_ref().map(|h| h.stats())
    }

    /// Reads the shared store once, bounded by its deadline, and records what it found as the
    /// store's state, as a request's read would (a change logged and counted): `None` without
    /// a store ([`SessionAffinityLayer::home_store`](crate::SessionAffinityLayer::home_store)).
    ///
    /// Until a read is made the store counts as up, so a balancer that has had no traffic
    /// says its store is up whatever it is, and the first requests after an outage began
    /// each wait the deadline out. A check now and then (a
    /// [`HealthProbe`](crate::health::HealthProbe) makes one each round) finds it down first:
    /// requests then use the local table at once. The check reads a key no session has; it
    /// counts as a read in [`StoreStats`], not as a miss.
    ///
    /// ```
    /// # async fn f<D, K, P>(balancer: tower_affinity::SessionAffinity<D, K, P>)
    /// # where D: tower::discover::Discover<Key = tower_affinity::BackendId, Service = tower_affinity::Backend<()>> {
    /// use tower_affinity::store::StoreState;
    ///
    /// if balancer.check_store().await == Some(StoreState::Down) {
    ///     eprintln!("the shared store does not answer: placing by this router's table");
    /// }
    /// # }
    /// ```
    pub fn check_store(&self) -> impl Future<Output = Option<StoreState>> + Send + 'static {
        let check = self.shared.store.as_ref().map(|h| h.check());
        async move {
            match check {
                Some(check) => Some(check.await),
                None => None,
            }
        }
    }

    /// The live backends with their slots, in-flight counts and health.
    ///
    /// Discovery changes are applied when the service is polled for readiness (every request
    /// is), so a service that has served no request yet lists none of the backends its
    /// stream announced: call [`apply_discovery`](Self::apply_discovery) first.
    pub fn backends(&self) -> Vec<BackendStatus> {
        let now = self.shared.capacity.now_ms(Instant::now());
        self.shared.fleet.load().topology.status(now)
    }

    /// Marks backend `id` down: placement passes it over for `cooldown`, or until
    /// [`mark_up`](Self::mark_up) if `None`. Requests already on it finish; requests waiting
    /// for it (held for its node, or for the prefix it holds) look again, and take a slot
    /// elsewhere or wait for any. Returns `false` if
    /// there is no such backend, which includes one that discovery announced but that no
    /// readiness poll (nor [`apply_discovery`](Self::apply_discovery)) has applied yet. For
    /// health probes; a backend whose service fails is marked down on its own (see
    /// [`SessionAffinityLayer::failure_cooldown`]).
    ///
    /// A mark replaces the one before, longer or shorter: a cooldown of zero brings the
    /// backend back at once. Any other is counted on a clock of whole milliseconds, and ends
    /// in the one its time falls in, but never the one it began in.
    ///
    /// [`SessionAffinityLayer::failure_cooldown`]: crate::SessionAffinityLayer::failure_cooldown
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use tower::{service_fn, Layer, ServiceExt};
    /// use tower_affinity::{discover::StaticFleet, Backend, Error, SessionAffinityLayer};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let backend = service_fn(|_: http::Request<String>| async {
    ///     Ok::<_, Infallible>(http::Response::new(String::new()))
    /// });
    /// let svc = SessionAffinityLayer::new()
    ///     .layer(StaticFleet::new([("gpu-0", Backend::new("host-a", backend))]));
    /// // Not applied from discovery yet: no such backend.
    /// assert!(!svc.mark_down("gpu-0", None));
    /// svc.apply_discovery();
    /// assert!(svc.mark_down("gpu-0", None));
    /// assert!(!svc.backends()[0].healthy);
    /// // Every backend down: no backend for the request.
    /// let req = || http::Request::new(String::new());
    /// let err = svc.clone().oneshot(req()).await.unwrap_err();
    /// assert!(matches!(err, Error::NoBackends { .. }));
    /// assert!(svc.mark_up("gpu-0"));
    /// assert!(svc.clone().oneshot(req()).await.is_ok());
    /// // Down for a minute, then that mark replaced by one of no time: up again.
    /// svc.mark_down("gpu-0", Some(std::time::Duration::from_secs(60)));
    /// svc.mark_down("gpu-0", Some(std::time::Duration::ZERO));
    /// assert!(svc.backends()[0].healthy);
    /// # }
    /// ```
    pub fn mark_down(&self, id: &str, cooldown: Option<Duration>) -> bool {
        let fleet = self.shared.fleet.load();
        let Some(i) = fleet.topology.index_of(id) else {
            return false;
        };
        let now = Instant::now();
        let until = self.shared.capacity.down_until(now, cooldown);
        let now_ms = self.shared.capacity.now_ms(now);
        let look_again = fleet.topology.member(i).load.mark_down(until, now_ms);
        // At debug level: the caller (a health probe) knows why, and says so in its own log.
        tracing::debug!(backend = id, ?cooldown, "backend marked down");
        drop(fleet);
        if look_again {
            // Up until now: requests held for it (its sessions' node patience, a wait for the
            // prefix it holds) look again, as a slot elsewhere will do now. Down already, and
            // back sooner than its last mark said: the waiters set their timers for its new
            // return, as the slots freed on it while down woke none of them.
            self.shared.capacity.wake_all();
        }
        true
    }

    /// Applies the discovery changes that are ready now, without waiting for a request to
    /// poll the service for readiness: for code that changed the fleet (a health probe that
    /// learned a slot count, say) and wants the change in place at once, or that announced
    /// more backends at once than one readiness poll applies (256). It applies up to 16,384
    /// changes.
    pub fn apply_discovery(&self) {
        // The drain wakes its caller when it stopped with more changes ready: come back.
        struct Again(std::sync::atomic::AtomicBool);
        impl Wake for Again {
            fn wake(self: Arc<Self>) {
                self.0.store(true, Ordering::Relaxed);
            }
        }
        for _ in 0..64 {
            let again = Arc::new(Again(std::sync::atomic::AtomicBool::new(false)));
            let waker = Waker::from(again.clone());
            self.shared
                .drain_discovery(&mut Context::from_waker(&waker));
            if !again.0.load(Ordering::Relaxed) {
                break;
            }
        }
    }

    /// Marks backend `id` up again. Returns `false` if there is no such backend (as for
    /// [`mark_down`](Self::mark_down), one not applied from discovery yet).
    pub fn mark_up(&self, id: &str) -> bool {
        let fleet = self.shared.fleet.load();
        let Some(i) = fleet.topology.index_of(id) else {
            return false;
        };
        let load = &fleet.topology.member(i).load;
        // Sequentially consistent: see `SlotGuard`'s drop.
        if load.down_until.swap(0, Ordering::SeqCst) != 0 {
            tracing::debug!(backend = id, "backend marked up");
            drop(fleet);
            self.shared.capacity.wake_all();
        }
        true
    }
}

impl<D, S, P> Drain<Backend<S>, P> for Discovery<D>
where
    D: Discover<Key = BackendId, Service = Backend<S>> + Send,
    D::Error: Into<BoxError>,
    S: Clone,
{
    /// Applies the discovery changes that are ready, without blocking.
    ///
    /// The changes ready at once are applied to one copy of the fleet, which then replaces the
    /// current one; requests keep reading the fleet they started with. A discovery error is
    /// logged and counted, and the fleet stays as it was; a stream that ends leaves the last
    /// fleet in place.
    fn drain(&self, shared: &Shared<Backend<S>, P>, cx: &mut Context<'_>) {
        let discovery = self;
        if !discovery.signal.due() {
            return;
        }
        // If another clone is draining right now, wait for it (a drain is short and never
        // blocks), so that no caller goes on with a fleet older than the changes that were
        // ready when it asked: at start-up, concurrent first requests would otherwise find the
        // fleet still empty. (The drain in progress marks the stream drained only when it is
        // done, so a caller that finds it due waits here.) Holding the stream's lock also makes
        // this the fleet's only writer.
        let mut slot = discovery.stream.lock();
        if !discovery.signal.due() {
            return;
        }
        // Wake-ups from here on are for changes this drain may not see.
        let seen = discovery.signal.woken.load(Ordering::Acquire);
        let mut own = Context::from_waker(&discovery.waker);
        let mut next: Option<Fleet<Backend<S>>> = None;
        let mut changed = false;
        let mut more = true;
        for _ in 0..DRAIN_LIMIT {
            let Some(d) = slot.as_mut() else {
                more = false;
                break;
            };
            // Outside tokio's cooperative budget: a caller whose task has spent its budget
            // would otherwise be told "pending" by a stream that has a change ready, and go on
            // with the fleet as it was. DRAIN_LIMIT bounds this loop instead.
            let next_change = tokio::task::coop::unconstrained(std::future::poll_fn(|cx| {
                d.as_mut().poll_discover(cx)
            }));
            match std::pin::pin!(next_change).poll(&mut own) {
                Poll::Ready(Some(Ok(change))) => {
                    let fleet = next.get_or_insert_with(|| Fleet::clone(&shared.fleet.load()));
                    changed |= apply(fleet, change);
                }
                Poll::Ready(Some(Err(e))) => {
                    let e: BoxError = e.into();
                    shared.capacity.counters.count_discovery_error();
                    tracing::warn!(error = %e, "discovery error; keeping the current fleet");
                }
                Poll::Ready(None) => {
                    tracing::debug!("discovery stream ended; keeping the current fleet");
                    *slot = None;
                }
                Poll::Pending => {
                    more = false;
                    break;
                }
            }
        }
        if let Some(fleet) = next {
            shared.fleet.store(Arc::new(fleet));
            if changed {
                // Waiting requests look again, on the new fleet: a backend inserted may have
                // room for them; one removed may be the one they wait for (placed on the
                // fleet before this drain, after the stream's wake-up that woke the waiters
                // then), whose slots, freed, wake none of them now.
                shared.capacity.wake_all();
            }
        }
        if more {
            // More may be ready: the stream stays due, and this caller is woken to come back.
            cx.waker().wake_by_ref();
        } else {
            discovery.signal.drained.store(seen, Ordering::Release);
        }
    }

    fn due(&self) -> bool {
        self.signal.due()
    }
}

/// Applies one discovery change to `fleet`; returns whether it changed the fleet (a backend
/// inserted, or one removed that was in it).
fn apply<S>(fleet: &mut Fleet<Backend<S>>, change: Change<BackendId, Backend<S>>) -> bool {
    match change {
        Change::Insert(id, backend) => {
            tracing::debug!(backend = %id, node = %backend.node(), slots = backend.slot_count(), "backend inserted");
            fleet.insert(id, backend);
            true
        }
        Change::Remove(id) => {
            let removed = fleet.remove(&id);
            if removed {
                tracing::debug!(backend = %id, "backend removed");
            }
            removed
        }
    }
}

impl<B, P> Shared<B, P> {
    /// Applies the discovery changes that are ready, without blocking.
    pub(crate) fn drain_discovery(&self, cx: &mut Context<'_>) {
        self.discovery.drain(self, cx);
    }

    /// Whether the discovery stream may have changes not applied yet (see [`Drain::due`]).
    pub(crate) fn discovery_due(&self) -> bool {
        self.discovery.due()
    }

    /// Whether a request could join the wait queue now: fewer than `max_queued` wait.
    fn queue_has_room(&self) -> bool {
        match self.overflow {
            Overflow::Wait { max_queued, .. } => {
                self.capacity.waiting.load(Ordering::Relaxed) < max_queued
            }
            _ => false,
        }
    }

    pub(crate) fn retry_after(&self) -> Duration {
        Overflow::RETRY_AFTER
    }

    /// The refusal of a request no backend can take ([`Placed::Empty`]), counted.
    #[cold]
    #[inline(never)]
    pub(crate) fn no_backends(&self, none: NoBackend) -> Error {
        self.capacity.counters.count_no_backends();
        Error::no_backends_of(none.retry_after, none.backends, none.up)
    }

    /// When the first failure cooldown still running on a backend `home` waits for ends, if
    /// one does before `by`: a backend coming back from one frees its slots without a request
    /// ending, so a waiting request looks again then. A backend a held request may not take
    /// (off its home node, or not the one holding its prefix) does not wake it: its hold ends
    /// by `by`.
    pub(crate) fn next_recovery(
        &self,
        now: Instant,
        by: Instant,
        home: &WaitHome,
    ) -> Option<Instant> {
        let now_ms = self.capacity.now_ms(now);
        let fleet = self.fleet.load();
        let until = fleet
            .topology
            .members
            .iter()
            .enumerate()
            .filter(|(i, m)| m.live && home.accepts(*i as u32, m.node))
            .map(|(_, m)| m.load.down_until.load(Ordering::Relaxed))
            // `u64::MAX` is down until further notice (a probe brings it back, through
            // discovery, which wakes the waiters itself).
            .filter(|&u| u > now_ms && u < u64::MAX)
            .min()?;
        Some(self.capacity.instant_at(until)).filter(|&t| t < by)
    }
}

/// How long until the first backend the request may go to (one the policy did not pass over),
/// down for a failure cooldown, comes back: the `Retry-After` of its refusal. A backend the
/// policy passed over coming back does not serve it, and one down until a probe says
/// otherwise (`u64::MAX`) gives no time.
#[cold]
fn first_back(t: &Topology, now_ms: u64, candidates: &Candidates<'_>) -> Option<Duration> {
    let until = (0..t.members.len() as u32)
        .filter(|&i| t.member(i).live && !candidates.is_passed_over(i))
        .map(|i| t.member(i).load.down_until.load(Ordering::Relaxed))
        .filter(|&u| u > now_ms && u < u64::MAX)
        .min()?;
    Some(Duration::from_millis(until - now_ms))
}

/// How many backends the fleet has, and how many of them are up (not marked down).
#[cold]
fn count_up(t: &Topology, now_ms: u64) -> (usize, usize) {
    let live = || {
        (0..t.members.len() as u32)
            .map(|i| t.member(i))
            .filter(|m| m.live)
    };
    let up = live().filter(|m| !m.load.is_down(now_ms)).count();
    (live().count(), up)
}

/// Offers a request that continues a stored response the one backend that stores it: the
/// candidates, unless that backend is down.
#[cold]
fn offer_pinned(
    t: &Topology,
    now_ms: u64,
    backend: u32,
    prompt_tokens: u64,
) -> Option<(u32, Candidates<'_>)> {
    // Too small for the prompt or not, the backend storing the response answers it.
    let mut c = Candidates::acquire(t, now_ms, prompt_tokens)
        .only_backend(Some(backend))
        .any_size();
    let _ = c.offer(BackendRef::new(t, backend));
    (c.chosen().is_some() || c.first().is_some()).then_some((backend, c))
}

impl<S: Clone, P: Placement> Shared<Backend<S>, P> {
    /// Places a request: looks up its home, runs the policy, takes a slot, records the
    /// decision. With `overcommit`, a request finding no free slot takes the first candidate
    /// anyway. The look's scope is what a waiting request holds out for: its home node (node
    /// patience) or the backend holding its prefix, as long as that is healthy.
    ///
    /// A look that would move the request away from the full backend holding its prefix,
    /// while any slot will do and the look may hold it (it has not held out for one place
    /// yet) and the request is queued or the queue has room for it, may wait for that
    /// backend instead, when the answers learned so far say waiting is cheaper (see
    /// [`learn`](crate::learn)). So a request that found the whole fleet full is judged when
    /// a slot elsewhere frees, as one finding that slot at once would be.
    pub(crate) fn place(
        &self,
        key: Option<SessionKey>,
        extensions: &http::Extensions,
        overcommit: bool,
        look: &Look,
    ) -> Placed<S> {
        let &Look { waited, scope, .. } = look;
        let now_ms = self.capacity.now_ms(Instant::now());
        let known = key.and_then(|k| self.table.get(k, now_ms));
        let fleet = self.fleet.load();
        let t = &fleet.topology;
        // A retry of a prompt a backend refused as too long: counted once, at its first look,
        // however that look ends (an empty fleet too).
        let refusal = extensions.get::<ContextRefusal>();
        if refusal.is_some() && look.first {
            self.capacity.counters.count_refusal(false);
        }
        if t.live.is_empty() {
            return Placed::Empty(NoBackend {
                retry_after: None,
                backends: 0,
                up: 0,
            });
        }
        let home_backend = known.and_then(|h| t.resolve(h.backend, h.generation));
        // A backend can move to another node (discovery updated it): its node now is the home
        // node. A removed backend leaves the node it had, while the node is known.
        let home_node = known.and_then(|h| match home_backend {
            Some(b) => Some(t.member(b).node),
            None => t.resolve_node(h.node),
        });
        let facts = extensions.get::<PromptFacts>();
        let chain = facts.map(|f| &f.chain).filter(|c| !c.is_empty());
        // The backend storing the response this request continues, if it is in the fleet:
        // the request goes there or nowhere, while it is up.
        let pinned = facts
            .and_then(|f| f.stored_on.as_ref())
            .and_then(|id| t.index_of(id.as_str()));
        // What the home holds, and how many of the chain's links it is known to hold.
        let mut home_links = 0;
        let home = home_node.map(|node| {
            let backend = home_backend.map(|i| BackendRef::new(t, i));
            let (tip, mark) = known.map_or((0, 0), |h| (h.tip, h.mark));
            let (cache, links) = HomeCache::of(backend, tip, mark, chain);
            home_links = links;
            Home::new(backend, NodeRef::new(t, node)).cache(cache)
        });
        let view = FleetView::at(t, now_ms);
        let prefix = request_prefix(&view, key, home, chain);
        let request = PlacementRequest::new(key, home, extensions)
            .random(self.draw())
            .chain(chain)
            .prefix(prefix);
        // Where the request's cache is: its home if that still holds it, else the backend
        // holding its own prefix (for a keyless request, the one backend holding the most of
        // its prompt). A waiter is woken first by a slot there.
        let home_cache = home.map_or(HomeCache::Unknown, |h| h.cache);
        let own_prefix = prefix.filter(|p| p.own).map(|p| p.backend.index);
        let (mut cache_backend, mut cache_node) = match home_cache {
            HomeCache::Holds | HomeCache::Unknown if home_node.is_some() => {
                (home_backend, home_node)
            }
            // A prompt that does not extend the key's last one but one of its own held
            // elsewhere is another conversation under the key, whose cache is there.
            HomeCache::Compacted if own_prefix.is_none() && home_node.is_some() => {
                (home_backend, home_node)
            }
            _ => {
                // Own or not: a keyless request's prefix may be one another conversation
                // continued too (a branch, or a text prompt's last block, which the next turn
                // grows). Waiting is priced by what it would read again elsewhere, so a prefix
                // that other backends hold as well draws no wait. A prompt held whole draws one
                // only as a turn sent again (its own prefix), as in placement.
                let held = match key {
                    None => prefix
                        .filter(|p| p.only && (!p.whole || p.own))
                        .map(|p| p.backend.index),
                    Some(_) => own_prefix,
                };
                (held, held.map(|b| t.member(b).node).or(home_node))
            }
        };
        // A pinned backend that is down is placed around as any request would be.
        let prompt_tokens = chain.map_or(0, PromptChain::tokens);
        // A retry of a prompt a backend refused as too long counts it as that backend did.
        // A refusal that does not say the context holds the refuser to fewer tokens than the
        // prompt's, as its answer showed.
        let refused = refusal.map(|r| Refused {
            tokens: r.prompt_tokens,
            backend: r.backend.as_ref().and_then(|id| t.index_of(id.as_str())),
            context: match r.context_tokens {
                0 => r.prompt_tokens.max(1),
                n => n,
            },
        });
        if let (Some(r), Some(refused)) = (refusal, &refused) {
            // The refusing backend's word for its limit stands where none is known, for the
            // requests after this one too.
            if let Some(b) = refused.backend {
                t.member(b).load.learn_request_limit(r.context_tokens);
            }
            // Where no other backend takes the prompt, or the request continues a response
            // stored where it was refused, the refusal as it came is the answer.
            let goes_back = pinned.is_some() && pinned == refused.backend;
            let except = r.backend.as_ref().map(BackendId::as_str);
            if goes_back || !t.takes_elsewhere(r.prompt_tokens, except, now_ms) {
                let kept = extensions.get::<crate::retry::Kept<crate::retry::FirstAnswer>>();
                if let Some(first) = kept.and_then(crate::retry::Kept::take) {
                    tracing::debug!(
                        backend = ?r.backend,
                        "a prompt refused as too long fits no other backend: the refusal answers"
                    );
                    self.capacity.counters.count_refusal(true);
                    return Placed::Answered(Box::new(first));
                }
            }
        }
        let pinned = pinned.and_then(|b| offer_pinned(t, now_ms, b, prompt_tokens));
        if let Some((b, _)) = &pinned {
            (cache_backend, cache_node) = (Some(*b), Some(t.member(*b).node));
        }
        let is_pinned = pinned.is_some();
        let mut only_node = home_node.filter(|_| scope == Scope::Node);
        let mut only_backend = cache_backend.filter(|_| scope == Scope::Backend);
        let mut any_size = false;
        let mut candidates = match pinned.map(|(_, c)| c) {
            Some(c) => c,
            None => loop {
                let mut c = Candidates::acquire(t, now_ms, prompt_tokens)
                    .only_node(only_node)
                    .only_backend(only_backend);
                if let Some(r) = &refused {
                    c.count_as_refused(r);
                }
                if any_size {
                    c = c.any_size();
                }
                self.placement.place(&view, &request, &mut c);
                if c.chosen().is_none() && c.first().is_none() {
                    // Nothing healthy left where it waits: nothing to wait for there.
                    if only_node.is_some() || only_backend.is_some() {
                        only_node = None;
                        only_backend = None;
                        continue;
                    }
                    // The policy offered no backend up that takes the prompt (it left out,
                    // or passed over, those that do): placed as if no backend had a limit.
                    if c.passed_too_small() && !any_size {
                        any_size = true;
                        continue;
                    }
                }
                break c;
            },
        };
        let wait_home = |scope, hold| WaitHome {
            backend: cache_backend,
            node: cache_node,
            scope,
            hold,
        };
        let full = || Placed::Full {
            home: match (only_node, only_backend) {
                // Waits for it to the end: no other backend can answer it.
                _ if is_pinned => wait_home(Scope::Backend, Duration::MAX),
                // Held for its home's node, whatever node its cache is on.
                (Some(node), _) => WaitHome {
                    node: Some(node),
                    ..wait_home(Scope::Node, self.node_patience)
                },
                (_, Some(_)) => wait_home(Scope::Backend, Duration::ZERO),
                _ => wait_home(Scope::Any, Duration::ZERO),
            },
        };
        let mut context = 0;
        let (index, overcommitted) = match (candidates.claim(), candidates.first()) {
            (Some(i), _) => (i, false),
            (None, Some(i)) if overcommit && t.member(i).load.force_acquire() => {
                let load = &t.member(i).load;
                context = load.force_context(load.context_need(prompt_tokens));
                (i, true)
            }
            // Nothing healthy offered. Only a fleet with no backend up the policy left open
            // has none for the request: a policy that offered backends down (or nothing)
            // while one it neither offered nor passed over is up finds no free slot, and
            // waits for what it offered to come back.
            (None, None) if candidates.passed_over_every_backend_up() => {
                let retry_after = first_back(t, now_ms, &candidates);
                let (backends, up) = count_up(t, now_ms);
                return Placed::Empty(NoBackend {
                    retry_after,
                    backends,
                    up,
                });
            }
            _ => return full(),
        };
        // A backend the policy passed over is no home to wait for, nor one to be judged by;
        // nor is one it did not offer first (`NodeThenBackend`'s busy holder of a new
        // conversation's opening that homes its share of the conversations it drew).
        let cache_passed_over = cache_backend
            .is_some_and(|b| candidates.is_passed_over(b) || candidates.first() != Some(b));
        let own_prefix = own_prefix.filter(|&p| !candidates.is_passed_over(p));
        if !overcommitted {
            context = candidates.context();
        }
        drop(candidates);
        let m = t.member(index);
        let mut guard = SlotGuard::new(&m.load, index, now_ms).with_context(context);
        if let (Some(chain), Some(target)) = (chain, cache_backend) {
            let judged = look.may_hold && scope == Scope::Any && !overcommitted;
            // A request not queued yet holds out only if the queue has room for it: the slot
            // it gives back is freed anew, and may be promised to a waiter that will not take
            // it before the request's look for any slot, which would then find none.
            if self.wait_versus_move
                && judged
                && target != index
                && !cache_passed_over
                && (look.queued.is_some() || self.queue_has_room())
            {
                if let Some(hold) = worth_waiting(t, target, index, chain, look.queued, now_ms) {
                    // The slot that woke it goes back as it came, to be passed on with the
                    // waiters that declined it (see `wait`); any other is freed anew.
                    if look.woken_for == Some(index) {
                        guard.give_back_unannounced();
                    } else {
                        drop(guard);
                    }
                    return Placed::Full {
                        home: wait_home(Scope::Backend, hold),
                    };
                }
            }
        }
        let Some(service) = fleet.service(index).cloned() else {
            // Unreachable: within one fleet a live member always has its service.
            return full();
        };
        // Placed by its own prefix: the backend holding it is its home.
        let by_prefix = |p: u32| match p {
            _ if p == index => Outcome::PrefixHit,
            _ if t.member(p).node == m.node => Outcome::SameNodeSpill,
            _ => Outcome::CrossNodeSpill,
        };
        let outcome = match (key, home_node) {
            (None, _) => own_prefix.map_or(Outcome::Keyless, by_prefix),
            // Its home and the home's node both gone.
            (Some(_), None) if known.is_some() => Outcome::Replaced,
            (Some(_), None) => Outcome::NewSession,
            (Some(_), Some(node)) => match (home_cache, home_backend) {
                (_, None) => Outcome::Replaced,
                (HomeCache::Evicted, _) => Outcome::ColdHome,
                (HomeCache::Compacted, _) => own_prefix.map_or(Outcome::Compaction, by_prefix),
                (_, Some(b)) if b == index => Outcome::HomeHit,
                (_, Some(_)) if m.node == node => Outcome::SameNodeSpill,
                (_, Some(_)) => Outcome::CrossNodeSpill,
            },
        };
        let decision = Decision {
            backend: m.id.clone(),
            node: t.node(m.node).id.clone(),
            outcome,
            waited,
            overcommitted,
        };
        // The stamp of this turn's record: kept with the session's home, so that its next
        // turn can tell that home still holds it without a look into the model.
        let mark = chain.map_or(0, |_| m.cache.reserve());
        if mark != 0 {
            guard.begin(mark);
        }
        let new_home = HomeEntry {
            backend: index,
            generation: m.generation,
            tip: chain.map_or(0, |c| c.tip()),
            node: t.node_mark(m.node),
            mark,
        };
        let watch = self.observe.then(|| Watch {
            waited,
            ..Watch::new(outcome)
        });
        // The chain goes into the chosen backend's model once the request is on its way (see
        // `Record`), knowing what that backend held already: all of the last turn on a home
        // hit, the prefix found on the backend that holds it.
        let record = chain.map(|chain| {
            let known = match outcome {
                Outcome::HomeHit => home_links,
                _ => prefix
                    .filter(|p| p.backend.index == index)
                    .map_or(0, |p| p.links),
            };
            Record::new(m.cache.clone(), chain.clone(), known, mark, now_ms)
        });
        drop(fleet);
        if let Some(k) = key {
            if known != Some(new_home) {
                self.table.put(k, new_home, now_ms);
            }
            if let Some(store) = &self.store {
                let tip = chain.and_then(PromptChain::tip_digest);
                store.placed(k, extensions.get::<StoreAnswer>(), &decision, tip);
            }
        } else if let (Some(store), Some(chain)) = (&self.store, chain) {
            store.placed_prompt(chain, &decision);
        }
        self.capacity.counters.record(&decision);
        Placed::Dispatch {
            service,
            guard,
            decision,
            watch,
            record,
        }
    }
}

/// Whether a request should wait for `target`, the full backend holding its prefix, rather
/// than go to `chosen`, which has room; if so, for how long at most: what moving would cost
/// more than staying, the move's read counted for the requests it delays there too (see
/// [`learn`](crate::learn)). `None` (move) unless the figures are learned: a backend's own,
/// or for a backend that has not taught its own yet, the fleet's mean.
fn worth_waiting(
    t: &Topology,
    target: u32,
    chosen: u32,
    chain: &PromptChain,
    queued: Option<u64>,
    now_ms: u64,
) -> Option<Duration> {
    let (stay, go) = (t.member(target), t.member(chosen));
    let load = &stay.load;
    let prompt = chain.tokens();
    let room = load.has_free_slot() && load.has_context_for(load.context_need(prompt));
    // A backend too small for the prompt would refuse it, where the chosen one takes it.
    let too_small = load.smaller_than(&go.load, prompt);
    if load.health(now_ms).0 || room || too_small {
        return None;
    }
    let lacks = |m: &Member| prompt.saturating_sub(reuse(&m.cache.lock(), chain).1);
    // A backend that has not taught its own figures yet reads as the others do.
    let unlearned = |l: &Learned| l.prefill_rate().is_none() || !l.knows_scale();
    let prior = if unlearned(&load.learned) || unlearned(&go.load.learned) {
        Prior::of(t.members.iter().filter(|m| m.live).map(|m| &m.load.learned))
    } else {
        Prior::default()
    };
    let stay_read = match lacks(stay) {
        0 => Duration::ZERO,
        n => load.learned.read_time_or(n, &prior)?,
    };
    let go_load = &go.load.learned;
    let go_behind = go_load.read_time_or(go_load.backlog(), &prior)?;
    let go_read = go_load.read_time_or(lacks(go), &prior)?;
    // Its requests in flight with this one, whose slot there is taken already.
    let go_in_flight = go.load.in_flight();
    let go_cost = go_behind.saturating_add(go_load.read_cost(go_read, go_in_flight));
    let saving = go_cost.checked_sub(stay_read)?;
    let in_flight = load.in_flight();
    // The requests waiting for it already (those queued before this one, if it waits too)
    // take its next slots first.
    let ahead = t.capacity.waiting_for(target, queued);
    // Its free slots promised to waiters that have not run yet are theirs: taken now.
    let promised = load.reserved.load(Ordering::Relaxed);
    let wait = load
        .learned
        .wait_estimate(in_flight, promised, ahead, now_ms)?;
    (wait < saving).then_some(saving)
}

impl<B, P> Shared<B, P> {
    /// The random number of a placement: the next of the seeded sequence if there is one,
    /// else one from this thread's generator.
    fn draw(&self) -> u64 {
        match &self.seeded {
            Some(next) => splitmix64(next.fetch_add(1, Ordering::Relaxed)),
            None => random(),
        }
    }
}

/// Asks the backend for an answer without a content coding when the client accepts one:
/// answers are read as they pass (their usage; `BodyKeyLayer` reads a stored response's id),
/// which a compressed answer cannot be. Compressing towards the client is the proxy's to do.
///
/// A `GET` or `HEAD` sends no prompt, and its answer reports no usage: it keeps the client's
/// `Accept-Encoding`. llama-server serves its web UI (`GET /`) only gzip-compressed, and
/// answers `415` to a request that does not accept gzip.
#[inline]
fn ask_for_identity<B>(req: &mut http::Request<B>) {
    use http::header::ACCEPT_ENCODING;
    if *req.method() == http::Method::GET || *req.method() == http::Method::HEAD {
        return;
    }
    let headers = req.headers_mut();
    if headers.contains_key(ACCEPT_ENCODING) {
        headers.insert(ACCEPT_ENCODING, http::HeaderValue::from_static("identity"));
    }
}

/// SplitMix64's output function: a well-mixed number for each count.
fn splitmix64(n: u64) -> u64 {
    let mut z = n.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A random number from this thread's generator (xorshift64*, seeded once per thread from the
/// standard library's randomly keyed hasher): cheap, unshared, and not for secrets.
fn random() -> u64 {
    thread_local! {
        static STATE: Cell<u64> = Cell::new(
            // Never 0, which xorshift would keep forever.
            RandomState::new().build_hasher().finish() | 1,
        );
    }
    STATE.with(|s| {
        let mut x = s.get();
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        s.set(x);
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    })
}

impl<D, K, P, S, ReqB, ResB> Service<http::Request<ReqB>> for SessionAffinity<D, K, P>
where
    D: Discover<Key = BackendId, Service = Backend<S>>,
    D::Error: Into<BoxError>,
    K: KeyExtractor<http::Request<ReqB>>,
    P: Placement,
    S: Service<http::Request<ReqB>, Response = http::Response<ResB>> + Clone,
    S::Error: Into<BoxError>,
{
    type Response = http::Response<ResponseBody<ResB>>;
    type Error = crate::Error;
    type Future = ResponseFuture<S, P, ReqB>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.shared.drain_discovery(cx);
        Poll::Ready(Ok(()))
    }

    #[inline]
    fn call(&mut self, mut req: http::Request<ReqB>) -> Self::Future {
        if crate::api::reads_no_prompt(req.uri().path()) {
            return ResponseFuture::aside(&self.shared, req);
        }
        let key = self.key.extract(&req);
        if self.shared.observe {
            ask_for_identity(&mut req);
        }
        ResponseFuture::new(&self.shared, key, req)
    }
}

impl<D: Discover, K: Clone, P> Clone for SessionAffinity<D, K, P> {
    fn clone(&self) -> Self {
        SessionAffinity {
            shared: self.shared.clone(),
            key: self.key.clone(),
            _discover: PhantomData,
        }
    }
}

impl<D: Discover, K: fmt::Debug, P: fmt::Debug> fmt::Debug for SessionAffinity<D, K, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SessionAffinity")
            .field("key", &self.key)
            .field("placement", &self.shared.placement)
            .field("overflow", &self.shared.overflow)
            .finish_non_exhaustive()
    }
}
