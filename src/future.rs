//! [`ResponseFuture`]: waiting for a slot, then driving the chosen backend.
//!
//! Most requests never wait: their slot is taken in `call`, and the chosen backend, when it is
//! ready at once (as a connection pool or a plain service is), is called right there. The
//! future then holds only the backend's own future, the slot and the decision, and the prompt
//! chain the request owes the backend's cache model: that is recorded right after the first
//! poll of the backend's future, once the request is on its way, so that updating the model
//! adds nothing to the path a request takes to its backend, and stands once the backend
//! answers with a success (see [`Record`]). The rarer paths
//! (a backend not ready yet, a request waiting for a slot) keep what they need in one heap
//! allocation of their own, so that they do not make every response future larger.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll, Waker};
use std::time::Duration;

use http::HeaderValue;
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};
use tower::Service;

use crate::api::Api;
use crate::body::{Observe, Watch};
use crate::cache::Record;
use crate::error::BoxError;
use crate::fleet::SlotGuard;
use crate::key::{PromptFacts, SessionKey};
use crate::placement::Placement;
use crate::retry::FirstAnswer;
use crate::service::{Placed, Shared};
use crate::slots::NamedSlot;
use crate::stats::Decision;
use crate::store::PendingRead;
use crate::wait::{Look, Scope, WaitTicket, Woken};
use crate::{Backend, Error, Overflow, ResponseBody};

type SharedOf<S, P> = Arc<Shared<Backend<S>, P>>;

/// A placed request: its backend's service, its slot, its decision, what its answer is
/// watched for, and the chain it owes the backend's cache model.
type Chosen<S> = (S, SlotGuard, Decision, Option<Watch>, Option<Record>);

pin_project! {
    /// The response future of [`SessionAffinity`](crate::SessionAffinity).
    ///
    /// Dropped, it gives back the slot its request holds, polled or not. A request `call`
    /// placed stays counted as placed, and its session's home stays where it was placed. One
    /// whose backend was ready in `call` was handed to that backend's service there: dropped
    /// before its first poll, its prompt's chain still goes into the backend's cache model
    /// (and into the slot the router assigned it), as a service that does its work in `call`
    /// may have sent it. A service that sends only once its future is polled, as
    /// [`HttpBackend`](crate::client::HttpBackend) does, has sent nothing. A request whose
    /// backend was not ready is taken back from the model and from its assigned slot; one
    /// waiting for a slot or for the shared store is counted as abandoned.
    pub struct ResponseFuture<S, P, ReqB>
    where
        S: Service<http::Request<ReqB>>,
    {
        #[pin]
        state: State<S, P, ReqB>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, P, ReqB>
    where
        S: Service<http::Request<ReqB>>,
    {
        // The backend has been called.
        Call {
            #[pin]
            fut: S::Future,
            dispatched: Option<Dispatched>,
        },
        // A slot is taken, but the backend was not ready when the request was placed.
        NotReady {
            backend: Option<Box<(S, http::Request<ReqB>)>>,
            dispatched: Unsent,
            // Set by the first poll that finds the backend not ready, if readiness has a
            // timeout: the wait counts from there.
            deadline: Option<Pin<Box<tokio::time::Sleep>>>,
        },
        // No free slot yet.
        Wait {
            waiting: Pin<Box<Waiting<S, P, ReqB>>>,
        },
        // Reading the session's home from the shared store, before placing.
        Read {
            reading: Box<Reading<S, P, ReqB>>,
        },
        // A retried refusal answered with the refusal as it came.
        Answered {
            first: Option<Box<FirstAnswer>>,
        },
        Done {
            error: Option<Error>,
        },
    }
}

pin_project! {
    /// A request waiting for a slot.
    struct Waiting<S, P, ReqB> {
        req: Option<http::Request<ReqB>>,
        key: Option<SessionKey>,
        shared: SharedOf<S, P>,
        // When the wait (or its hold for one place) ends, or a backend's failure cooldown
        // does before it (it may have room then), whichever comes first.
        #[pin]
        deadline: Sleep,
        // When this phase of the wait ends: at `give_up`, or earlier, when the hold ends.
        until: Instant,
        give_up: Instant,
        since: Instant,
        ticket: WaitTicket,
    }
}

/// A request whose session's home (or, keyless, its prompt's) is being read from the shared
/// store.
struct Reading<S, P, ReqB> {
    read: PendingRead,
    req: Option<http::Request<ReqB>>,
    key: Option<SessionKey>,
    shared: SharedOf<S, P>,
}

impl<S, P, ReqB> Drop for Reading<S, P, ReqB> {
    fn drop(&mut self) {
        // Dropped before the store answered: the caller gave up on it, as on a waiting one.
        // A retry of a refused prompt is counted as one too, as its first look would have.
        if let Some(req) = &self.req {
            let counters = &self.shared.capacity.counters;
            if req.extensions().get::<crate::ContextRefusal>().is_some() {
                counters.count_refusal(false);
            }
            counters.count_abandoned();
        }
    }
}

/// What a response future needs once its backend is chosen: copied out of the service's
/// shared state, so that a dispatched request holds no reference to it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Finish {
    pub(crate) decision_headers: bool,
    pub(crate) decision_extension: bool,
    pub(crate) failure_cooldown: Duration,
    pub(crate) ready_timeout: Option<Duration>,
}

/// A request on its way to a backend: the slot it holds and the decision that sent it there.
struct Dispatched {
    guard: SlotGuard,
    decision: Decision,
    finish: Finish,
    watch: Option<Watch>,
    record: Option<Record>,
    /// The API the request speaks, told by its path while the request is at hand: what its
    /// answer is read as.
    api: Api,
}

/// A request placed on a backend that was not ready, and not yet sent to it: dropped so (its
/// caller gave up), the chain it owes the backend's cache model is taken back, and the slot
/// assigned to it holds what it held, for the backend never saw it.
struct Unsent(Option<Dispatched>);

impl Drop for Unsent {
    fn drop(&mut self) {
        if let Some(d) = self.0.as_mut() {
            d.guard.put_back_assigned_slot();
            if let Some(record) = d.record.take() {
                record.answer(false);
            }
        }
    }
}

impl Dispatched {
    /// The backend's future has been polled: the request is on its way, and its chain goes
    /// into the backend's cache model now. What the model found counts in the backend's
    /// backlog, and is what the answer is checked against. Once; later calls do nothing.
    fn settle(&mut self) {
        let Some(mut p) = self.record.as_mut().and_then(Record::settle) else {
            return;
        };
        p.pending = !self.guard.has_ended(p.born);
        // A prefix another request is still reading is not there to reuse yet: this one reads
        // all of it.
        let held = if p.pending { 0 } else { p.held_tokens };
        self.guard.reading(p.prompt_tokens.saturating_sub(held));
        if let Some(w) = self.watch.as_mut() {
            w.prediction = Some(p);
        }
    }

    /// The backend's response with the decision attached, its body holding the slot. The
    /// chain recorded for it stands if the backend answered with a success, and is taken
    /// back if not: a backend that refused the prompt (too long for its context, say) did
    /// not take it into its cache, nor into the slot the router assigned it, which is free
    /// at once and holds what it held. A backend that answered 503 serves nothing now (llama-server
    /// while it loads its model): it is passed over for the failure cooldown.
    fn respond<B>(mut self, res: http::Response<B>) -> http::Response<ResponseBody<B>> {
        let status = res.status();
        let cooldown = self.finish.failure_cooldown;
        if status == http::StatusCode::SERVICE_UNAVAILABLE {
            // Counted as a failure, so that a backend passed over says why.
            self.guard.count_failure();
            if !cooldown.is_zero() {
                tracing::warn!(backend = %self.decision.backend, ?cooldown, "backend answered 503; marked down");
                self.guard.mark_down(cooldown);
            }
        }
        let taken = status.is_success();
        if !taken {
            self.guard.put_back_assigned_slot();
        }
        let cache = self.record.take().and_then(|r| r.answer(taken));
        if let Some(w) = self.watch.as_mut() {
            w.cache = cache;
            w.success = taken;
            w.api = self.api;
        }
        respond(res, self.guard, self.decision, self.finish, self.watch)
    }

    /// The backend failed (in readiness or in the call): counted, and the backend is passed
    /// over for the failure cooldown; unless it was the request's own body that failed on its
    /// way to an `HttpBackend`, which is no fault of the backend's.
    fn fail(self, e: BoxError) -> Error {
        let Dispatched {
            mut guard,
            decision,
            finish,
            watch: _,
            record,
            api: _,
        } = self;
        // The backend failed before answering: what it was sent is taken back, from its
        // cache model and from the slot assigned to it.
        guard.put_back_assigned_slot();
        if let Some(r) = record {
            r.answer(false);
        }
        // The request's own fault (its body failed on its way, or it is not one a proxy
        // forwards): the backend is not at fault.
        if crate::error::request_at_fault(&*e) {
            drop(guard);
            return Error::Backend {
                backend: decision.backend,
                source: e,
            };
        }
        guard.count_failure();
        let cooldown = finish.failure_cooldown;
        if cooldown.is_zero() {
            drop(guard);
        } else {
            tracing::warn!(backend = %decision.backend, error = %e, ?cooldown, "backend failed; marked down");
            guard.fail(cooldown);
        }
        Error::Backend {
            backend: decision.backend,
            source: e,
        }
    }
}

impl<S, P, ReqB> State<S, P, ReqB>
where
    S: Service<http::Request<ReqB>>,
    S::Error: Into<BoxError>,
{
    /// Sends the request to its backend: called at once if the backend is ready now (polled
    /// with a waker that does nothing, which is enough to learn that), else readied later
    /// with the response future's own waker. Inlined: out of line, the moves of what it
    /// is handed cost more than all it does.
    #[inline(always)]
    fn call(placed: Chosen<S>, mut req: http::Request<ReqB>, finish: Finish) -> Self {
        let (mut service, guard, decision, watch, record) = placed;
        let mut dispatched = Dispatched {
            guard,
            decision,
            finish,
            watch,
            record,
            api: Api::of(req.uri().path()),
        };
        // A backend whose slots the router assigns gets the slot of a request it runs in the
        // slot it names.
        if dispatched.guard.assigns_slots() {
            assign_slot(&mut dispatched.guard, &mut req);
        }
        match service.poll_ready(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(Ok(())) => State::Call {
                fut: service.call(req),
                dispatched: Some(dispatched),
            },
            Poll::Ready(Err(e)) => State::fail(dispatched.fail(e.into())),
            Poll::Pending => State::NotReady {
                backend: Some(Box::new((service, req))),
                dispatched: Unsent(Some(dispatched)),
                deadline: None,
            },
        }
    }

    fn fail(error: Error) -> Self {
        State::Done { error: Some(error) }
    }
}

/// Assigns `req` one of its backend's slots, which the router assigns, and puts it in the
/// request's extensions, if the backend runs it in the slot it names (a token count takes
/// none, and an embedding is placed by llama-server whatever it names: either would make the
/// router forget what the slot holds). A request whose body names its own slot (a top-level
/// `id_slot`, which `client::IdSlot` leaves as it is) is assigned that slot or none, never
/// another. Out of line: the other requests' path does not carry it.
#[cold]
#[inline(never)]
fn assign_slot<B>(guard: &mut SlotGuard, req: &mut http::Request<B>) {
    // A body in a content coding is one `IdSlot` cannot write the slot into: llama-server
    // chooses, so the router assigns none and keeps what it knows of each slot.
    if !crate::slots::takes_a_slot(req.uri().path()) || crate::slots::is_coded(req.headers()) {
        return;
    }
    let facts = req.extensions().get::<PromptFacts>();
    let chain = facts.map(|f| &f.chain).filter(|c| !c.is_empty());
    let named = facts.map_or(NamedSlot::Absent, |f| f.named_slot);
    if let Some(slot) = guard.assign_slot(chain, named) {
        req.extensions_mut().insert(slot);
    }
}

/// A backend not ready `after` its request was placed there: a timeout, so 504.
fn not_ready_within(after: Duration) -> BoxError {
    let message = format!("backend not ready within {after:?}");
    std::io::Error::new(std::io::ErrorKind::TimedOut, message).into()
}

impl<S, P, ReqB> ResponseFuture<S, P, ReqB>
where
    S: Service<http::Request<ReqB>> + Clone,
    S::Error: Into<BoxError>,
    P: Placement,
{
    pub(crate) fn new(
        shared: &SharedOf<S, P>,
        key: Option<SessionKey>,
        req: http::Request<ReqB>,
    ) -> Self {
        if shared.store.is_some() {
            return Self::read_first(shared, key, req);
        }
        ResponseFuture {
            state: Self::place(shared, key, req),
        }
    }

    /// A request that reads no prompt into a cache (a token count: see
    /// [`reads_no_prompt`](crate::api::reads_no_prompt)): placed as a keyless request without
    /// a chain, on a free slot or else beyond the first candidate's slots, its answer not
    /// watched. Its session's home, the cache models and the shared store are left as they
    /// were. The policy still sees its other extensions (a tenant a layer in front named):
    /// only its prompt facts are kept from placement, and put back for the backend.
    #[cold]
    #[inline(never)]
    pub(crate) fn aside(shared: &SharedOf<S, P>, mut req: http::Request<ReqB>) -> Self {
        let facts = req.extensions_mut().remove::<PromptFacts>();
        let placed = shared.place(None, req.extensions(), true, &Look::first(Scope::Any));
        if let Some(facts) = facts {
            req.extensions_mut().insert(facts);
        }
        let state = match placed {
            Placed::Dispatch {
                service,
                guard,
                decision,
                record,
                ..
            } => State::call((service, guard, decision, None, record), req, shared.finish),
            Placed::Empty(none) => State::fail(shared.no_backends(none)),
            Placed::Answered(first) => State::Answered { first: Some(first) },
            Placed::Full { .. } => {
                shared.capacity.counters.count_rejected();
                State::fail(Error::Saturated {
                    retry_after: shared.retry_after(),
                })
            }
        };
        ResponseFuture { state }
    }

    /// With a shared store: reads the session's home (or a keyless request's, by its prompt)
    /// before placing, unless the store is down. Out of line, so that the path without a
    /// store stays as it was.
    #[cold]
    #[inline(never)]
    fn read_first(
        shared: &SharedOf<S, P>,
        key: Option<SessionKey>,
        req: http::Request<ReqB>,
    ) -> Self {
        let read = shared.store.as_ref().and_then(|store| match key {
            Some(k) => store.read(k),
            None => {
                let facts = req.extensions().get::<PromptFacts>()?;
                store.read_prompt(&facts.chain)
            }
        });
        let state = match read {
            Some(read) => State::Read {
                reading: Box::new(Reading {
                    read,
                    req: Some(req),
                    key,
                    shared: shared.clone(),
                }),
            },
            None => Self::place(shared, key, req),
        };
        ResponseFuture { state }
    }

    /// Places the request, and calls its backend or waits for a slot. (Out of line, as the
    /// whole of `new` was before the store's read came in front of it: `call` stays small
    /// enough to be inlined, and a request without a read costs what it did.)
    #[inline(never)]
    fn place(
        shared: &SharedOf<S, P>,
        key: Option<SessionKey>,
        req: http::Request<ReqB>,
    ) -> State<S, P, ReqB> {
        let overflow = shared.overflow;
        let overcommit = matches!(overflow, Overflow::Overcommit);
        let scope = if shared.node_patience.is_zero() {
            Scope::Any
        } else {
            Scope::Node
        };
        let mut look = Look::first(scope);
        loop {
            return match shared.place(key, req.extensions(), overcommit, &look) {
                Placed::Dispatch {
                    service,
                    guard,
                    decision,
                    watch,
                    record,
                } => State::call(
                    (service, guard, decision, watch, record),
                    req,
                    shared.finish,
                ),
                Placed::Empty(none) => State::fail(shared.no_backends(none)),
                Placed::Answered(first) => State::Answered { first: Some(first) },
                Placed::Full { home } => {
                    if let Overflow::Wait {
                        max_wait,
                        max_queued,
                    } = overflow
                    {
                        // A wait of no time is none: refused here, as with no room in the
                        // queue, without a place in it or a timer (which needs tokio's time
                        // driver).
                        let ticket = (!max_wait.is_zero())
                            .then(|| WaitTicket::take(&shared.capacity, home, max_queued))
                            .flatten();
                        match ticket {
                            Some(ticket) => return Self::wait(shared, key, req, ticket, max_wait),
                            // No room in the queue: a request that held out for one place
                            // (its home node, the full backend holding its prefix) looks once
                            // more for a slot anywhere, as it would if it could not wait.
                            None if home.scope != Scope::Any && look.first => {
                                look = Look::no_room_to_wait();
                                continue;
                            }
                            None => {}
                        }
                    }
                    shared.capacity.counters.count_rejected();
                    State::fail(Error::Saturated {
                        retry_after: shared.retry_after(),
                    })
                }
            };
        }
    }

    /// Waits for a slot, in the queue `ticket` has joined.
    fn wait(
        shared: &SharedOf<S, P>,
        key: Option<SessionKey>,
        req: http::Request<ReqB>,
        mut ticket: WaitTicket,
        max_wait: Duration,
    ) -> State<S, P, ReqB> {
        // A slot may have freed between the first attempt and joining the queue.
        match shared.place(key, req.extensions(), false, &ticket.look(None, false)) {
            Placed::Dispatch {
                service,
                guard,
                decision,
                watch,
                record,
            } => {
                ticket.settle();
                drop(ticket);
                State::call(
                    (service, guard, decision, watch, record),
                    req,
                    shared.finish,
                )
            }
            Placed::Empty(none) => {
                ticket.settle();
                State::fail(shared.no_backends(none))
            }
            Placed::Answered(first) => {
                ticket.settle();
                State::Answered { first: Some(first) }
            }
            // This look sees the fleet as it is now, and may wait for other slots than the
            // first: for the full backend holding its prefix, rather than for a slot freed
            // since, which it rules against (that slot, freed again by the ruling, may have
            // woken this very ticket: passed on); or for any slot, when nothing healthy is
            // left where it held out.
            Placed::Full { home } => {
                ticket.hold_for(home);
                let home = ticket.home();
                let since = Instant::now();
                // A wait too long to represent is as good as a wait of thirty years.
                let far = || since + Duration::from_secs(30 * 365 * 86_400);
                let give_up = since.checked_add(max_wait).unwrap_or_else(far);
                // Held out for one place (node patience, or a full backend holding the
                // prefix) until the hold ends; then any slot will do.
                let deadline = match home.scope {
                    Scope::Any => give_up,
                    _ => hold_ends(since, home.hold, give_up),
                };
                let wake = shared
                    .next_recovery(since, deadline, &home)
                    .unwrap_or(deadline);
                State::Wait {
                    waiting: Box::pin(Waiting {
                        req: Some(req),
                        key,
                        deadline: tokio::time::sleep_until(wake),
                        until: deadline,
                        give_up,
                        since,
                        ticket,
                        shared: shared.clone(),
                    }),
                }
            }
        }
    }
}

/// When a hold of `hold` from `from` ends: at the end of the wait at the latest.
fn hold_ends(from: Instant, hold: Duration, give_up: Instant) -> Instant {
    from.checked_add(hold).map_or(give_up, |t| t.min(give_up))
}

impl<S, P, ReqB, ResB> Future for ResponseFuture<S, P, ReqB>
where
    S: Service<http::Request<ReqB>, Response = http::Response<ResB>> + Clone,
    S::Error: Into<BoxError>,
    P: Placement,
{
    type Output = Result<http::Response<ResponseBody<ResB>>, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        const POLLED_AFTER_COMPLETION: &str = "ResponseFuture polled after completion";
        let mut state = self.project().state;
        // Whether this poll has applied the discovery stream's changes: once a poll at most.
        let mut drained = false;
        loop {
            match state.as_mut().project() {
                StateProj::Call { fut, dispatched } => {
                    let polled = fut.poll(cx);
                    if let Some(d) = dispatched.as_mut() {
                        d.settle();
                    }
                    let result = ready!(polled);
                    let d = dispatched.take().expect(POLLED_AFTER_COMPLETION);
                    return Poll::Ready(match result {
                        Ok(res) => Ok(d.respond(res)),
                        Err(e) => Err(d.fail(e.into())),
                    });
                }
                StateProj::NotReady {
                    backend,
                    dispatched,
                    deadline,
                } => {
                    let (service, _) = &mut **backend.as_mut().expect(POLLED_AFTER_COMPLETION);
                    let ready: Result<(), BoxError> = match service.poll_ready(cx) {
                        Poll::Ready(ready) => ready.map_err(Into::into),
                        Poll::Pending => {
                            let timeout =
                                dispatched.0.as_ref().and_then(|d| d.finish.ready_timeout);
                            let Some(after) = timeout else {
                                return Poll::Pending;
                            };
                            let deadline =
                                deadline.get_or_insert_with(|| Box::pin(tokio::time::sleep(after)));
                            ready!(deadline.as_mut().poll(cx));
                            Err(not_ready_within(after))
                        }
                    };
                    let (mut service, req) = *backend.take().expect(POLLED_AFTER_COMPLETION);
                    let d = dispatched.0.take().expect(POLLED_AFTER_COMPLETION);
                    match ready {
                        Ok(()) => state.set(State::Call {
                            fut: service.call(req),
                            dispatched: Some(d),
                        }),
                        Err(e) => return Poll::Ready(Err(d.fail(e))),
                    }
                }
                StateProj::Wait { waiting } => {
                    let w = waiting.as_mut().project();
                    let mut attempt = false;
                    // Woken: it stays queued, so no wake is missed while it looks.
                    let woken = w.ticket.woken(cx.waker());
                    if !matches!(woken, Woken::No) {
                        attempt = true;
                    }
                    // Fleet changes not applied yet: a drain that stopped at its limit with
                    // more ready woke this task to come back for them.
                    if !drained && w.shared.discovery_due() {
                        attempt = true;
                    }
                    let mut deadline = w.deadline;
                    // The wait is over: one last look before the request is refused.
                    let mut last = false;
                    if deadline.as_mut().poll(cx).is_ready() {
                        attempt = true;
                        if Instant::now() < *w.until {
                            // A failure cooldown ended: that backend may have room.
                        } else if w.ticket.scope() == Scope::Any {
                            last = true;
                        } else {
                            // The hold is over: a slot anywhere will do now.
                            w.ticket.widen();
                            *w.until = *w.give_up;
                        }
                    }
                    if !attempt {
                        return Poll::Pending;
                    }
                    // Woken by a freed slot, by the deadline, by a cooldown's end, or by the
                    // discovery stream (a backend may have come): the changes that are ready
                    // go in first. Once a poll, as in readiness, so that a stream that never
                    // stops yielding cannot hold it: a drain that changes the fleet wakes
                    // every waiter, this one too, which would look again in this same poll.
                    if !drained {
                        drained = true;
                        w.shared.drain_discovery(cx);
                    }
                    let r = w.req.take().expect(POLLED_AFTER_COMPLETION);
                    let waited = Some(w.since.elapsed());
                    // No hold from a look at the end of the wait, which would refuse it, nor
                    // from one woken by a slot past that end before its timer fired: the
                    // hold would end at once.
                    let look = Look {
                        woken_for: match &woken {
                            Woken::For(slot) => slot.backend(),
                            _ => None,
                        },
                        ..w.ticket.look(waited, last || Instant::now() >= *w.give_up)
                    };
                    // Woken by a lifted mark, it must see the slots freed on that backend
                    // while marked, which woke nobody: see `SlotGuard`'s drop.
                    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
                    let placed = w.shared.place(*w.key, r.extensions(), false, &look);
                    if !matches!(placed, Placed::Full { .. }) || last {
                        w.ticket.settle();
                    }
                    // Woken for a slot it could not take (its policy does not offer it, or
                    // another request was quicker), or took and gave back unannounced to hold
                    // out for its own backend: another waiter may take it.
                    let woken = match (&placed, woken) {
                        (Placed::Full { .. }, Woken::For(slot)) => {
                            drop(slot);
                            Woken::No
                        }
                        (_, woken) => woken,
                    };
                    match placed {
                        Placed::Dispatch {
                            service,
                            guard,
                            decision,
                            watch,
                            record,
                        } => {
                            // Woken for a slot it did not take: passed on once it has left
                            // the queue (or as the call unwinds, if the backend's service
                            // panics), to the waiter that slot suits.
                            let unused = match woken {
                                Woken::For(slot) if slot.backend() == Some(guard.backend()) => {
                                    slot.taken();
                                    guard.pass_room_on();
                                    None
                                }
                                Woken::For(slot) => Some(slot),
                                _ => None,
                            };
                            let finish = w.shared.finish;
                            let placed = (service, guard, decision, watch, record);
                            state.set(State::call(placed, r, finish));
                            drop(unused);
                        }
                        Placed::Empty(none) => {
                            let error = w.shared.no_backends(none);
                            state.set(State::fail(error));
                        }
                        Placed::Answered(first) => {
                            state.set(State::Answered { first: Some(first) });
                        }
                        Placed::Full { .. } if last => {
                            w.shared.capacity.counters.count_rejected();
                            let retry_after = w.shared.retry_after();
                            state.set(State::fail(Error::Saturated { retry_after }));
                        }
                        // Still queued, with this task's waker, until the deadline, looked
                        // at again. A look that found its hold over (nothing healthy left
                        // where it held out) waits for any slot from now on; one that holds
                        // it out for one place for the first time, for its hold from now.
                        Placed::Full { home } => {
                            if home.scope == Scope::Any && w.ticket.scope() != Scope::Any {
                                w.ticket.widen();
                                *w.until = *w.give_up;
                            } else if home.scope != Scope::Any && look.may_hold {
                                w.ticket.hold_for(home);
                                *w.until = hold_ends(Instant::now(), home.hold, *w.give_up);
                            } else if home.scope != Scope::Any
                                && home.scope == w.ticket.scope()
                                && home.backend.is_some()
                                && home.backend == w.ticket.home().backend
                            {
                                // Held as it was, for where its home is now: a backend
                                // announced again on another node takes its sessions'
                                // holds along. Its hold ends when it did. (Only that: a
                                // request that waits for any slot, or for a home that is
                                // another backend now, waits as the look that held it
                                // chose.)
                                w.ticket.hold_for(home);
                            }
                            let until = *w.until;
                            let wake = w
                                .shared
                                .next_recovery(Instant::now(), until, &w.ticket.home())
                                .unwrap_or(until);
                            if deadline.deadline() != wake {
                                deadline.as_mut().reset(wake);
                            }
                            *w.req = Some(r);
                        }
                    }
                }
                StateProj::Read { reading } => {
                    let r = &mut **reading;
                    let read = ready!(r.read.as_mut().poll(cx));
                    let mut req = r.req.take().expect(POLLED_AFTER_COMPLETION);
                    let (shared, key) = (r.shared.clone(), r.key);
                    match (&shared.store, key) {
                        // The answer rides in the request's extensions (a type private to
                        // the crate) to the placement, which may come after a wait for a slot.
                        (Some(store), Some(key)) => {
                            let chain = req.extensions().get::<PromptFacts>().map(|f| &f.chain);
                            if let Some(answer) = shared.adopt(store, key, read, chain) {
                                req.extensions_mut().insert(answer);
                            }
                        }
                        // Keyless: what the store knows goes into the cache model.
                        (Some(store), None) => {
                            if let Some(facts) = req.extensions().get::<PromptFacts>() {
                                shared.adopt_prompt(store, &facts.chain, read);
                            }
                        }
                        (None, _) => {}
                    }
                    state.set(Self::place(&shared, key, req));
                }
                StateProj::Answered { first } => {
                    let first = first.take().expect(POLLED_AFTER_COMPLETION);
                    return Poll::Ready(Ok(first.into_response()));
                }
                StateProj::Done { error } => {
                    let e = error.take().expect(POLLED_AFTER_COMPLETION);
                    return Poll::Ready(Err(e));
                }
            }
        }
    }
}

/// The backend's response with the decision attached, its body holding the slot. The decision
/// goes into the response's extensions, or with `decision_extension(false)` into the body.
fn respond<B>(
    res: http::Response<B>,
    guard: SlotGuard,
    decision: Decision,
    finish: Finish,
    watch: Option<Watch>,
) -> http::Response<ResponseBody<B>> {
    let (mut parts, body) = res.into_parts();
    if parts.extensions.get::<crate::SentAgain>().is_some() {
        guard.count_sent_again();
    }
    let observe = watch.and_then(|w| Observe::new(&parts.headers, w));
    if finish.decision_headers {
        let h = &mut parts.headers;
        // Values kept by the backend: no copy of its names for each response.
        let kept = guard.headers();
        // An id that is no header value is left out, and so is the backend's own field of
        // that name: the headers say what the router did, or nothing.
        match kept.backend() {
            Some(v) => h.insert(Decision::BACKEND_HEADER, v),
            None => h.remove(Decision::BACKEND_HEADER),
        };
        match kept.node(&decision.node) {
            Some(v) => h.insert(Decision::NODE_HEADER, v),
            None => h.remove(Decision::NODE_HEADER),
        };
        h.insert(
            Decision::OUTCOME_HEADER,
            HeaderValue::from_static(decision.outcome.as_str()),
        );
    }
    let decision = if finish.decision_extension {
        parts.extensions.insert(decision);
        None
    } else {
        // A 503 is dropped by `RetryOnce`, decision and body, and given back as its backend's
        // failure where the retry finds no backend up: that failure names the backend by this.
        if parts.status == http::StatusCode::SERVICE_UNAVAILABLE {
            parts.extensions.insert(decision.backend.clone());
        }
        Some(decision)
    };
    http::Response::from_parts(
        parts,
        ResponseBody::new(body, guard, decision, observe, finish.failure_cooldown),
    )
}

impl<S, P, ReqB> fmt::Debug for ResponseFuture<S, P, ReqB>
where
    S: Service<http::Request<ReqB>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Call { .. } => "calling",
            State::NotReady { .. } => "waiting for its backend to be ready",
            State::Wait { .. } => "waiting for a slot",
            State::Read { .. } => "reading its session's home",
            State::Answered { .. } | State::Done { .. } => "done",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish()
    }
}
