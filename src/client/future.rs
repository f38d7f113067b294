//! [`ResponseFuture`], the response future of [`HttpBackend`](super::HttpBackend).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use pin_project_lite::pin_project;

use super::backend_body::BackendBody;
use super::body::Sending;
use super::error::{FailureKind, HttpBackendError};
use super::hop_by_hop::strip;

/// `res` as it goes back to the client (see
/// [`HttpBackend::finish_response`](super::HttpBackend::finish_response)).
pub(crate) fn finish_response<T>(res: &mut http::Response<T>) -> Result<(), HttpBackendError> {
    // The proxy asked for no upgrade (`Upgrade` is not forwarded), and a body in another
    // coding than chunked would reach the client unmarked.
    if res.status() == http::StatusCode::SWITCHING_PROTOCOLS {
        return Err(HttpBackendError::bad_answer(
            "the backend switched protocols unasked",
        ));
    }
    // 600 to 999 parse as a status, but HTTP has none (RFC 9110, section 15): a malformed
    // answer, to be taken as a server error, and no client can be handed it as it is.
    if res.status().as_u16() > 599 {
        return Err(HttpBackendError::bad_answer(
            "the status is out of range (past 599)",
        ));
    }
    if !strip(res.headers_mut()) {
        return Err(HttpBackendError::bad_answer(
            "the answer is in a transfer coding other than chunked",
        ));
    }
    // The proxy answers in its own version (RFC 9110, section 6.2), as the request went on in
    // the backend's: an HTTP/1.0 answer of no declared length, ended by the close, would go on
    // so framed, where a cut is not told from the end.
    if res.version() < http::Version::HTTP_11 {
        *res.version_mut() = http::Version::HTTP_11;
    }
    Ok(())
}

/// Sends a copy of the request once more: the client's future, and what its body does.
pub(crate) type Again =
    Box<dyn FnOnce() -> (hyper_util::client::legacy::ResponseFuture, Arc<Sending>) + Send>;

pin_project! {
    /// The response future of [`HttpBackend`](super::HttpBackend): the client's, with a
    /// deadline for the response headers if one is set, errors classified, hop-by-hop
    /// headers dropped from the response, and its body a [`BackendBody`].
    pub struct ResponseFuture {
        #[pin]
        state: State,
    }
}

pin_project! {
    #[project = StateProj]
    enum State {
        Sending {
            fut: hyper_util::client::legacy::ResponseFuture,
            #[pin]
            deadline: Option<tokio::time::Sleep>,
            after: Duration,
            // The idle timeout between the frames of the answer's body.
            idle: Option<Duration>,
            sending: Arc<Sending>,
            // The request once more, if its connection closes before any answer.
            again: Option<Again>,
            // Whether it was sent once more: its answer is marked `SentAgain`.
            sent_again: bool,
        },
        Failed { error: Option<HttpBackendError> },
    }
}

impl ResponseFuture {
    pub(crate) fn new(
        fut: hyper_util::client::legacy::ResponseFuture,
        timeout: Option<Duration>,
        idle: Option<Duration>,
        sending: Arc<Sending>,
        again: Option<Again>,
    ) -> Self {
        ResponseFuture {
            state: State::Sending {
                fut,
                deadline: timeout.map(tokio::time::sleep),
                after: timeout.unwrap_or_default(),
                idle,
                sending,
                again,
                sent_again: false,
            },
        }
    }

    pub(crate) fn failed(error: HttpBackendError) -> Self {
        ResponseFuture {
            state: State::Failed { error: Some(error) },
        }
    }
}

impl fmt::Debug for ResponseFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl Future for ResponseFuture {
    type Output = Result<http::Response<BackendBody>, HttpBackendError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Sending {
                fut,
                deadline,
                after,
                idle,
                sending,
                again,
                sent_again,
            } => {
                while let Poll::Ready(res) = Pin::new(&mut *fut).poll(cx) {
                    let e = match res {
                        Ok(mut res) => {
                            if *sent_again {
                                res.extensions_mut().insert(crate::SentAgain);
                            }
                            let idle = *idle;
                            return Poll::Ready(
                                finish_response(&mut res)
                                    .map(|()| res.map(|b| BackendBody::new(b, idle))),
                            );
                        }
                        Err(e) if sending.failed() => HttpBackendError::request_body(e.into()),
                        Err(e) => HttpBackendError::classify(e.into()),
                    };
                    // Its connection closed before any answer: the backend never read it
                    // (see `Builder::resend_on_close`). Sent once more, on another.
                    match again.take() {
                        Some(send) if e.kind() == FailureKind::Reset => {
                            tracing::debug!(error = %e, "connection closed before any answer; the request sent again");
                            (*fut, *sending) = send();
                            *sent_again = true;
                        }
                        _ => return Poll::Ready(Err(e)),
                    }
                }
                if let Some(deadline) = deadline.as_pin_mut() {
                    ready!(deadline.poll(cx));
                    // A body still awaited from the client holds the request up, not the
                    // backend: a client that sends too slowly must not pass it over.
                    return Poll::Ready(Err(if sending.waiting() {
                        HttpBackendError::request_body_late(*after)
                    } else {
                        HttpBackendError::response_timeout(*after)
                    }));
                }
                Poll::Pending
            }
            StateProj::Failed { error } => Poll::Ready(Err(error.take().unwrap_or_else(|| {
                HttpBackendError::classify("ResponseFuture polled after completion".into())
            }))),
        }
    }
}
