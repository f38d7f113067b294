//! [`ResponseFuture`]: waiting for a slot, then driving the chosen backend.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use http::{HeaderName, HeaderValue};
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};
use tower::util::Oneshot;
use tower::{Service, ServiceExt};

use crate::error::BoxError;
use crate::fleet::SlotGuard;
use crate::key::SessionKey;
use crate::placement::Placement;
use crate::service::{Placed, Shared};
use crate::stats::{bump, Decision};
use crate::wait::{WaitHome, WaitTicket};
use crate::{Backend, Error, Overflow, ResponseBody};

type SharedOf<S, P> = Arc<Shared<Backend<S>, P>>;

pin_project! {
    /// The response future of [`SessionAffinity`](crate::SessionAffinity).
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
        Call {
            #[pin]
            fut: Oneshot<S, http::Request<ReqB>>,
            guard: Option<SlotGuard>,
            decision: Option<Decision>,
            finish: Finish,
        },
        Wait {
            req: Option<http::Request<ReqB>>,
            key: Option<SessionKey>,
            shared: SharedOf<S, P>,
            // When the wait ends: at `give_up`, or earlier, when node patience runs out.
            deadline: Pin<Box<Sleep>>,
            give_up: Instant,
            since: Instant,
            ticket: WaitTicket,
        },
        Done {
            error: Option<Error>,
        },
    }
}

/// What a response future needs once its backend is chosen: copied out of the service's
/// shared state, so that a dispatched request holds no reference to it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Finish {
    pub(crate) decision_headers: bool,
    pub(crate) decision_extension: bool,
    pub(crate) failure_cooldown: Duration,
}

impl<S, P, ReqB> State<S, P, ReqB>
where
    S: Service<http::Request<ReqB>>,
{
    fn call(placed: (S, SlotGuard, Decision), req: http::Request<ReqB>, finish: Finish) -> Self {
        let (service, guard, decision) = placed;
        State::Call {
            fut: service.oneshot(req),
            guard: Some(guard),
            decision: Some(decision),
            finish,
        }
    }

    fn fail(error: Error) -> Self {
        State::Done { error: Some(error) }
    }
}

impl<S, P, ReqB> ResponseFuture<S, P, ReqB>
where
    S: Service<http::Request<ReqB>> + Clone,
    P: Placement,
{
    pub(crate) fn new(
        shared: &SharedOf<S, P>,
        key: Option<SessionKey>,
        req: http::Request<ReqB>,
    ) -> Self {
        let overflow = shared.overflow;
        let overcommit = matches!(overflow, Overflow::Overcommit);
        let patient = !shared.node_patience.is_zero();
        let state = match shared.place(key, req.extensions(), overcommit, None, patient) {
            Placed::Dispatch {
                service,
                guard,
                decision,
            } => State::call((service, guard, decision), req, shared.finish),
            Placed::Empty => {
                bump(&shared.capacity.counters.no_backends);
                State::fail(Error::NoBackends)
            }
            Placed::Full { home } => match overflow {
                Overflow::Wait {
                    max_wait,
                    max_queued,
                } => Self::wait(shared.clone(), key, req, home, max_wait, max_queued),
                Overflow::Overcommit | Overflow::Reject => {
                    bump(&shared.capacity.counters.rejected);
                    State::fail(Error::Saturated {
                        retry_after: shared.retry_after(),
                    })
                }
            },
        };
        ResponseFuture { state }
    }

    fn wait(
        shared: SharedOf<S, P>,
        key: Option<SessionKey>,
        req: http::Request<ReqB>,
        home: WaitHome,
        max_wait: Duration,
        max_queued: usize,
    ) -> State<S, P, ReqB> {
        let Some(ticket) = WaitTicket::take(&shared.capacity, home, max_queued) else {
            bump(&shared.capacity.counters.rejected);
            return State::fail(Error::Saturated {
                retry_after: shared.retry_after(),
            });
        };
        // A slot may have freed between the first attempt and joining the queue.
        match shared.place(key, req.extensions(), false, None, home.only_node) {
            Placed::Dispatch {
                service,
                guard,
                decision,
            } => {
                drop(ticket);
                State::call((service, guard, decision), req, shared.finish)
            }
            Placed::Empty => {
                bump(&shared.capacity.counters.no_backends);
                State::fail(Error::NoBackends)
            }
            Placed::Full { .. } => {
                let since = Instant::now();
                // A wait too long to represent is as good as a wait of thirty years.
                let far = || since + Duration::from_secs(30 * 365 * 86_400);
                let give_up = since.checked_add(max_wait).unwrap_or_else(far);
                let deadline = match since.checked_add(shared.node_patience) {
                    Some(t) if home.only_node => t.min(give_up),
                    _ => give_up,
                };
                State::Wait {
                    req: Some(req),
                    key,
                    deadline: Box::pin(tokio::time::sleep_until(deadline)),
                    give_up,
                    since,
                    ticket,
                    shared,
                }
            }
        }
    }
}

impl<S, P, ReqB, ResB> Future for ResponseFuture<S, P, ReqB>
where
    S: Service<http::Request<ReqB>, Response = http::Response<ResB>> + Clone,
    S::Error: Into<BoxError>,
    P: Placement,
{
    type Output = Result<http::Response<ResponseBody<ResB>>, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut state = self.project().state;
        loop {
            match state.as_mut().project() {
                StateProj::Call {
                    fut,
                    guard,
                    decision,
                    finish,
                } => {
                    let result = ready!(fut.poll(cx));
                    let (Some(guard), Some(decision)) = (guard.take(), decision.take()) else {
                        panic!("ResponseFuture polled after completion");
                    };
                    return Poll::Ready(match result {
                        Ok(res) => Ok(respond(res, guard, decision, *finish)),
                        Err(e) => {
                            let e: BoxError = e.into();
                            bump(&guard.capacity().counters.backend_errors);
                            let cooldown = finish.failure_cooldown;
                            if cooldown.is_zero() {
                                drop(guard);
                            } else {
                                tracing::warn!(backend = %decision.backend, error = %e, ?cooldown, "backend failed; marked down");
                                guard.fail(cooldown);
                            }
                            Err(Error::Backend {
                                backend: decision.backend,
                                source: e,
                            })
                        }
                    });
                }
                StateProj::Wait {
                    req,
                    key,
                    shared,
                    deadline,
                    give_up,
                    since,
                    ticket,
                } => {
                    let mut attempt = false;
                    if !ticket.still_queued(cx.waker()) {
                        // Woken: back in the queue first, so no wake is missed while it looks.
                        ticket.requeue(cx.waker());
                        attempt = true;
                    }
                    if deadline.as_mut().poll(cx).is_ready() {
                        if !ticket.home_node_only() {
                            bump(&shared.capacity.counters.rejected);
                            let retry_after = shared.retry_after();
                            state.set(State::fail(Error::Saturated { retry_after }));
                            continue;
                        }
                        // Node patience is over: a slot anywhere will do now.
                        ticket.widen();
                        deadline.as_mut().reset(*give_up);
                        attempt = true;
                    }
                    if !attempt {
                        return Poll::Pending;
                    }
                    let Some(r) = req.take() else {
                        panic!("ResponseFuture polled after completion");
                    };
                    let waited = Some(since.elapsed());
                    let only_node = ticket.home_node_only();
                    match shared.place(*key, r.extensions(), false, waited, only_node) {
                        Placed::Dispatch {
                            service,
                            guard,
                            decision,
                        } => {
                            let finish = shared.finish;
                            state.set(State::call((service, guard, decision), r, finish));
                        }
                        Placed::Empty => {
                            bump(&shared.capacity.counters.no_backends);
                            state.set(State::fail(Error::NoBackends));
                        }
                        // Still queued, with this task's waker: look at the deadline again.
                        Placed::Full { .. } => *req = Some(r),
                    }
                }
                StateProj::Done { error } => {
                    let Some(e) = error.take() else {
                        panic!("ResponseFuture polled after completion");
                    };
                    return Poll::Ready(Err(e));
                }
            }
        }
    }
}

// Built once, not parsed from a string on every response.
const BACKEND_HEADER: HeaderName = HeaderName::from_static("x-affinity-backend");
const NODE_HEADER: HeaderName = HeaderName::from_static("x-affinity-node");
const OUTCOME_HEADER: HeaderName = HeaderName::from_static("x-affinity-outcome");

/// The backend's response with the decision attached, its body holding the slot. The decision
/// goes into the response's extensions, or with `decision_extension(false)` into the body.
fn respond<B>(
    res: http::Response<B>,
    guard: SlotGuard,
    decision: Decision,
    finish: Finish,
) -> http::Response<ResponseBody<B>> {
    let (mut parts, body) = res.into_parts();
    if finish.decision_headers {
        let h = &mut parts.headers;
        if let Ok(v) = HeaderValue::from_str(decision.backend.as_str()) {
            h.insert(BACKEND_HEADER, v);
        }
        if let Ok(v) = HeaderValue::from_str(decision.node.as_str()) {
            h.insert(NODE_HEADER, v);
        }
        h.insert(
            OUTCOME_HEADER,
            HeaderValue::from_static(decision.outcome.as_str()),
        );
    }
    let decision = if finish.decision_extension {
        parts.extensions.insert(decision);
        None
    } else {
        Some(decision)
    };
    http::Response::from_parts(parts, ResponseBody::new(body, guard, decision))
}

impl<S, P, ReqB> fmt::Debug for ResponseFuture<S, P, ReqB>
where
    S: Service<http::Request<ReqB>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Call { .. } => "calling",
            State::Wait { .. } => "waiting for a slot",
            State::Done { .. } => "done",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish()
    }
}
