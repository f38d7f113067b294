//! `--upstream per-client`: backend connections that belong to one client connection.
//!
//! With the pooled client (the default), every request is handed from the client connection's
//! task to a pooled backend connection's own task, and its response handed back. Here each
//! client connection opens its own backend connections, and its task drives them: a request
//! and its response stay in the task that read the request. That saves the hand-offs and the
//! pool's bookkeeping, at the price of more backend connections: one per client connection
//! and backend it uses (at most [`MAX_PER_BACKEND`]), open as long as the client connection
//! is. Suits backends that hold many idle connections at little cost; a backend that gives
//! each open connection a thread of its own, as `llama-server` does, is better served pooled.
//!
//! This applies to HTTP/1 client connections, which carry one request at a time. hyper serves
//! each HTTP/2 stream in a task of its own, outside its connection's task: those requests go
//! through the pooled client.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use futures_util::stream::{FuturesUnordered, StreamExt};
use http::{Response, Uri};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use parking_lot::Mutex;
use pin_project_lite::pin_project;
use tokio::time::Instant;
use tower::ServiceExt;
use tower_affinity::client::{BackendBody, FailureKind, HttpBackend, HttpBackendError};
use tower_affinity::SentAgain;

use crate::app::ReqBody;

/// The most backend connections one client connection opens to one backend. An HTTP/1 client
/// connection needs one: its next request comes once the previous response is sent, and by
/// then the backend connection is free again. A second one opens only if the backend
/// connection has not yet taken note that its response ended. Past the bound, requests go
/// through the pooled client.
pub(crate) const MAX_PER_BACKEND: usize = 4;

tokio::task_local! {
    /// The backend connections of the client connection whose task is running.
    static CONNS: Arc<ClientConns>;
}

/// A backend connection's own future: it reads and writes that connection.
type Driver = Pin<Box<dyn Future<Output = ()> + Send>>;

/// The backend connections of one client connection.
#[derive(Default)]
pub(crate) struct ClientConns {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Every open connection, free or busy, with the backend it goes to.
    senders: Vec<(Uri, SendRequest<ReqBody>)>,
    /// Connections opened since the task last looked, for it to drive.
    opened: Vec<Driver>,
    /// The task's waker, to have it drive a connection just opened.
    waker: Option<Waker>,
}

impl ClientConns {
    /// A connection to `backend` that is free for a request, taken out; or whether another
    /// may be opened (`Err(true)`) or the pooled client has to serve (`Err(false)`).
    fn take(&self, backend: &Uri) -> Result<SendRequest<ReqBody>, bool> {
        let mut state = self.state.lock();
        state.senders.retain(|(_, tx)| !tx.is_closed());
        let mut open = 0;
        for (i, (b, tx)) in state.senders.iter().enumerate() {
            if b == backend {
                if tx.is_ready() {
                    return Ok(state.senders.swap_remove(i).1);
                }
                open += 1;
            }
        }
        Err(open < MAX_PER_BACKEND)
    }

    /// Puts a connection back, busy or not: it takes the next request once it is free.
    fn put(&self, backend: Uri, tx: SendRequest<ReqBody>) {
        self.state.lock().senders.push((backend, tx));
    }

    /// Hands a new connection's future to the task, and wakes it to drive it.
    fn drive(&self, driver: Driver) {
        let mut state = self.state.lock();
        state.opened.push(driver);
        if let Some(w) = &state.waker {
            w.wake_by_ref();
        }
    }
}

/// The backend connections of the running client connection; `None` outside a client
/// connection's task (an HTTP/2 stream's, say), where the pooled client serves.
pub(crate) fn current() -> Option<Arc<ClientConns>> {
    CONNS.try_with(Arc::clone).ok()
}

/// Sends `req` on one of `conns`' connections to `http`'s backend, opening one if none is
/// free, or through the pooled client if `conns` has [`MAX_PER_BACKEND`] to it already. The
/// request is prepared, the response's hop-by-hop headers dropped and the response timeout
/// applied, and the body given the idle timeout between its frames, as [`HttpBackend`] does for
/// the pooled client.
pub(crate) fn send(
    conns: Arc<ClientConns>,
    http: &HttpBackend<ReqBody>,
    req: http::Request<ReqBody>,
) -> impl Future<Output = Result<Response<BackendBody>, HttpBackendError>> + Send + 'static {
    let http = http.clone();
    async move {
        // The request line carries the target in origin-form, as the pooled client writes it.
        // Prepared before a connection is taken: a request not forwarded (a `CONNECT`, a body
        // in a transfer coding other than `chunked`) would otherwise close a free connection,
        // or open one only to close it.
        // (The pooled client, past the bound, prepares it again, to the same effect.)
        let req = http.prepare(req, false)?;
        let again = http.resend_copy(&req);
        let mut sent_at = None;
        let (res, sent_again) = match (send_own(&conns, &http, req, &mut sent_at).await, again) {
            (Sent::Pooled(req), _) => return http.oneshot(req).await,
            // Its connection closed before any answer: llama-server closes its connection
            // after each streamed answer, unannounced, and the next request of this client
            // connection can go out on it before the close is seen. The backend never read
            // it: sent once more, on another connection, as the pooled client does
            // (`Builder::resend_on_close`), and its answer marked so for the balancer to count.
            (Sent::Own(Err(e)), Some(req)) if e.kind() == FailureKind::Reset => {
                tracing::debug!(backend = %http.base_uri(), error = %e, "connection closed before any answer; the request sent again");
                match send_own(&conns, &http, req, &mut sent_at).await {
                    Sent::Pooled(req) => {
                        return http.oneshot(req).await.map(|mut res| {
                            res.extensions_mut().insert(SentAgain);
                            res
                        })
                    }
                    Sent::Own(res) => (res, true),
                }
            }
            (Sent::Own(res), _) => (res, false),
        };
        let mut res = res?.map(|body| http.response_body(body));
        http.finish_response(&mut res)?;
        if sent_again {
            res.extensions_mut().insert(SentAgain);
        }
        Ok(res)
    }
}

/// What [`send_own`] did with a request.
enum Sent {
    /// Sent on a connection of the client connection's own: the answer's head, or why none.
    Own(Result<Response<Incoming>, HttpBackendError>),
    /// Not sent: the client connection has [`MAX_PER_BACKEND`] connections to the backend
    /// already, and the pooled client is to serve it.
    Pooled(http::Request<ReqBody>),
}

/// Sends `req`, prepared, on one of `conns`' connections to `http`'s backend, opening one if
/// none is free (one that closed is dropped). The response timeout counts from `sent_at`, the
/// first sending's instant, which it sets if it is not set yet.
async fn send_own(
    conns: &ClientConns,
    http: &HttpBackend<ReqBody>,
    req: http::Request<ReqBody>,
    sent_at: &mut Option<Instant>,
) -> Sent {
    let failed = |e: Box<dyn std::error::Error + Send + Sync>| HttpBackendError::classify(e);
    let base = http.base_uri().clone();
    let mut tx = match conns.take(&base) {
        Ok(tx) => tx,
        Err(true) => {
            let io = match http.connector().clone().oneshot(base.clone()).await {
                Ok(io) => io,
                Err(e) => return Sent::Own(Err(failed(e.into()))),
            };
            let (tx, conn) = match http1::handshake(io).await {
                Ok(handshake) => handshake,
                Err(e) => return Sent::Own(Err(failed(e.into()))),
            };
            conns.drive(Box::pin(async move {
                if let Err(e) = conn.await {
                    tracing::debug!(error = %e, "backend connection ended with an error");
                }
            }));
            tx
        }
        Err(false) => return Sent::Pooled(req),
    };
    let sent = tx.send_request(req);
    conns.put(base, tx);
    let sent_at = *sent_at.get_or_insert_with(Instant::now);
    Sent::Own(match http.response_timeout() {
        None => sent.await.map_err(|e| failed(e.into())),
        Some(after) => match tokio::time::timeout_at(sent_at + after, sent).await {
            Ok(res) => res.map_err(|e| failed(e.into())),
            Err(_) => Err(HttpBackendError::response_timeout(after)),
        },
    })
}

pin_project! {
    /// A client connection's future, driving the backend connections it opens.
    pub(crate) struct WithClientConns<F> {
        #[pin]
        inner: F,
        conns: Arc<ClientConns>,
        // Polls only the connections whose waker fired, not every one on every wake.
        drivers: FuturesUnordered<Driver>,
    }
}

impl<F> WithClientConns<F> {
    pub(crate) fn new(inner: F) -> Self {
        WithClientConns {
            inner,
            conns: Arc::default(),
            drivers: FuturesUnordered::new(),
        }
    }
}

impl<F: Future> Future for WithClientConns<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        drive(this.conns, this.drivers, cx);
        let out = CONNS.sync_scope(this.conns.clone(), || this.inner.poll(cx));
        // A request sent in that poll goes out now, not on the next wake.
        drive(this.conns, this.drivers, cx);
        out
    }
}

/// Polls the backend connections that were woken and those newly opened, and drops those
/// that ended; keeps the task's waker for [`ClientConns::drive`]. One lock a call.
fn drive(conns: &ClientConns, drivers: &mut FuturesUnordered<Driver>, cx: &mut Context<'_>) {
    {
        let mut state = conns.state.lock();
        if !state
            .waker
            .as_ref()
            .is_some_and(|w| w.will_wake(cx.waker()))
        {
            state.waker = Some(cx.waker().clone());
        }
        drivers.extend(state.opened.drain(..));
    }
    // `Ready(Some)`: a connection ended; `Ready(None)`: none left; `Pending`: all wait.
    while let Poll::Ready(Some(())) = drivers.poll_next_unpin(cx) {}
}
