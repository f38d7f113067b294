//! Why an [`HttpBackend`](super::HttpBackend) request failed, and why a URL was refused.

use std::error::Error as StdError;
use std::fmt;
use std::io;
use std::time::Duration;

use http::StatusCode;

use crate::BoxError;

/// What kind of failure an [`HttpBackendError`] is.
///
/// Each maps to the status a proxy answers with ([`FailureKind::status`]), the same that the
/// crate's [`Error::status`](crate::Error::status) gives for it: 504 for a timeout, 400 for
/// the request's own body failing on its way, 501 for a request not forwarded, 502 for the
/// rest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FailureKind {
    /// The backend refused the connection: nothing listens there.
    Refused,
    /// The connection was reset or closed before the response headers were complete; over
    /// HTTP/2, also the backend's `GOAWAY` before them, or its refusal of the stream
    /// (`REFUSED_STREAM`).
    Reset,
    /// No connection within the connect timeout, no response headers within the response
    /// timeout, or, as the error of an answer's body, no frame of it within the idle timeout
    /// between frames.
    Timeout,
    /// The connection could not be made for another reason (name resolution, say).
    Connect,
    /// Anything else: a protocol error, a request the client could not send.
    Other,
    /// The request's own body failed while it was being sent: the client went away or sent
    /// too slowly (the response timeout passed with the body still arriving from it), or a
    /// limit of the proxy's cut it short. The request's fault, not the backend's: 400, and
    /// the balancer does not pass the backend over for it.
    RequestBody,
    /// The request asks for what a proxy cannot forward as sent: a `CONNECT`, or a transfer
    /// coding other than `chunked` (RFC 9112, section 6.1), whose body would reach the
    /// backend still coded and unmarked. Not sent; the request's fault, not the backend's:
    /// 501, and the balancer does not pass the backend over for it.
    Unsupported,
}

impl FailureKind {
    /// The HTTP status a proxy answers with: 504 Gateway Timeout for [`Timeout`], 400 Bad
    /// Request for [`RequestBody`], 501 Not Implemented for [`Unsupported`], else 502 Bad
    /// Gateway.
    ///
    /// [`Timeout`]: FailureKind::Timeout
    /// [`RequestBody`]: FailureKind::RequestBody
    /// [`Unsupported`]: FailureKind::Unsupported
    pub fn status(self) -> StatusCode {
        match self {
            FailureKind::Timeout => StatusCode::GATEWAY_TIMEOUT,
            FailureKind::RequestBody => StatusCode::BAD_REQUEST,
            FailureKind::Unsupported => StatusCode::NOT_IMPLEMENTED,
            _ => StatusCode::BAD_GATEWAY,
        }
    }

    /// Whether the failure is the request's own, not the backend's ([`RequestBody`],
    /// [`Unsupported`]): the balancer neither passes the backend over for it nor retries it.
    ///
    /// [`RequestBody`]: FailureKind::RequestBody
    /// [`Unsupported`]: FailureKind::Unsupported
    pub fn is_request_fault(self) -> bool {
        matches!(self, FailureKind::RequestBody | FailureKind::Unsupported)
    }

    /// A short name: `refused`, `reset`, `timeout`, `connect`, `other`, `request-body`,
    /// `unsupported`.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureKind::Refused => "refused",
            FailureKind::Reset => "reset",
            FailureKind::Timeout => "timeout",
            FailureKind::Connect => "connect",
            FailureKind::Other => "other",
            FailureKind::RequestBody => "request-body",
            FailureKind::Unsupported => "unsupported",
        }
    }
}

impl fmt::Display for FailureKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A request that an [`HttpBackend`](super::HttpBackend) could not get a response for.
///
/// Its [`kind`](Self::kind) says what happened; its [source] is the client's own error. Inside
/// the balancer it becomes the source of [`Error::Backend`](crate::Error::Backend):
/// [`HttpBackendError::of`] finds it there.
///
/// A timeout has an [`io::Error`] of kind [`TimedOut`](io::ErrorKind::TimedOut) in its source
/// chain, which is what makes [`Error::status`](crate::Error::status) 504.
///
/// Its `Display` says the kind and the chain's root cause (`connection refused: Connection
/// refused (os error 111)`, `timed out connecting: deadline has elapsed`, `timed out: no
/// response headers within 300s`): hyper's own messages name only the step that failed.
///
/// [source]: std::error::Error::source
///
/// ```
/// use tower_affinity::client::{FailureKind, HttpBackendError};
///
/// let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
/// let e = HttpBackendError::classify(refused.into());
/// assert_eq!(e.kind(), FailureKind::Refused);
/// assert_eq!(e.status(), 502);
///
/// let e = tower_affinity::Error::backend("gpu-0", e);
/// assert_eq!(HttpBackendError::of(&e).map(|e| e.kind()), Some(FailureKind::Refused));
/// assert_eq!(e.status(), 502);
/// ```
#[derive(Debug)]
pub struct HttpBackendError {
    kind: FailureKind,
    source: BoxError,
}

impl HttpBackendError {
    /// Wraps an error of hyper-util's client, hyper or the socket, with its kind read from its
    /// source chain: a refused or reset connection (an [`io::Error`] of that kind, hyper's
    /// "connection closed before the message completed", or an HTTP/2 backend's `GOAWAY` or
    /// `REFUSED_STREAM`), a timeout (an `io::Error` of kind
    /// `TimedOut` or tokio's `Elapsed`), another connect failure, or something else.
    pub fn classify(source: BoxError) -> Self {
        let kind = kind_of(&*source);
        HttpBackendError { kind, source }
    }

    /// The request's own body failed while it was sent; `source` is the client's error.
    pub(crate) fn request_body(source: BoxError) -> Self {
        HttpBackendError {
            kind: FailureKind::RequestBody,
            source,
        }
    }

    /// The request cannot be forwarded as sent, for `why`.
    pub(crate) fn unsupported(why: &'static str) -> Self {
        HttpBackendError {
            kind: FailureKind::Unsupported,
            source: why.into(),
        }
    }

    /// The backend answered in a way no client of the proxy can be given, for `why`.
    pub(crate) fn bad_answer(why: &'static str) -> Self {
        HttpBackendError {
            kind: FailureKind::Other,
            source: why.into(),
        }
    }

    /// No response headers within `after`.
    pub fn response_timeout(after: Duration) -> Self {
        Self::timed_out(
            FailureKind::Timeout,
            format!("no response headers within {after:?}"),
        )
    }

    /// The backend's answer, begun, sent nothing for `after`, its idle timeout between frames.
    pub(crate) fn body_idle(after: Duration) -> Self {
        Self::timed_out(
            FailureKind::Timeout,
            format!("no frame of the body within {after:?} of the last"),
        )
    }

    /// The response timeout, `after`, passed with the request's own body still arriving from
    /// its sender.
    pub(crate) fn request_body_late(after: Duration) -> Self {
        Self::timed_out(
            FailureKind::RequestBody,
            format!("the body was still arriving after {after:?}, the response timeout"),
        )
    }

    /// A failure of `kind` whose source is an [`io::Error`] of kind
    /// [`TimedOut`](io::ErrorKind::TimedOut) saying `what`.
    fn timed_out(kind: FailureKind, what: String) -> Self {
        HttpBackendError {
            kind,
            source: io::Error::new(io::ErrorKind::TimedOut, what).into(),
        }
    }

    /// What kind of failure this is.
    pub fn kind(&self) -> FailureKind {
        self.kind
    }

    /// The status a proxy answers with ([`FailureKind::status`]).
    pub fn status(&self) -> StatusCode {
        self.kind.status()
    }

    /// The `HttpBackendError` behind a balancer error, if its backend is an
    /// [`HttpBackend`](super::HttpBackend) that failed.
    pub fn of(error: &crate::Error) -> Option<&HttpBackendError> {
        match error {
            crate::Error::Backend { source, .. } => source.downcast_ref(),
            _ => None,
        }
    }
}

impl fmt::Display for HttpBackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.kind {
            FailureKind::Refused => "connection refused",
            FailureKind::Reset => "connection reset before the response",
            // The root cause of a connect timeout says only that a deadline passed.
            FailureKind::Timeout if connecting(&*self.source) => "timed out connecting",
            FailureKind::Timeout => "timed out",
            FailureKind::Connect => "could not connect",
            FailureKind::Other => "request failed",
            FailureKind::RequestBody => "the request body failed",
            FailureKind::Unsupported => "not forwarded",
        };
        // The root cause: hyper's own messages ("client error (Connect)") name only the step.
        let mut root: &(dyn StdError + 'static) = &*self.source;
        while let Some(e) = root.source() {
            root = e;
        }
        write!(f, "{what}: {root}")?;
        Ok(())
    }
}

impl StdError for HttpBackendError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(&*self.source)
    }
}

/// Whether `e`'s chain has hyper-util's client failing to connect.
fn connecting(e: &(dyn StdError + 'static)) -> bool {
    let mut next = Some(e);
    while let Some(e) = next {
        if let Some(client) = e.downcast_ref::<hyper_util::client::legacy::Error>() {
            return client.is_connect();
        }
        next = e.source();
    }
    false
}

/// The kind of the first cause in `e`'s chain that tells one.
fn kind_of(e: &(dyn StdError + 'static)) -> FailureKind {
    let mut connect = false;
    let mut closed = false;
    let mut next = Some(e);
    while let Some(e) = next {
        if let Some(io) = e.downcast_ref::<io::Error>() {
            match io.kind() {
                io::ErrorKind::ConnectionRefused => return FailureKind::Refused,
                io::ErrorKind::TimedOut => return FailureKind::Timeout,
                io::ErrorKind::ConnectionReset
                | io::ErrorKind::ConnectionAborted
                | io::ErrorKind::BrokenPipe
                | io::ErrorKind::UnexpectedEof => return FailureKind::Reset,
                _ => {}
            }
        }
        if e.is::<tokio::time::error::Elapsed>() {
            return FailureKind::Timeout;
        }
        if let Some(client) = e.downcast_ref::<hyper_util::client::legacy::Error>() {
            connect |= client.is_connect();
        }
        // An HTTP/2 backend that closes the connection (`GOAWAY`) or refuses the stream
        // (`REFUSED_STREAM`, which says it was not processed) before any answer: a reset.
        if let Some(h2) = e.downcast_ref::<h2::Error>() {
            let refused = h2.is_go_away() || h2.reason() == Some(h2::Reason::REFUSED_STREAM);
            if h2.is_remote() && refused {
                return FailureKind::Reset;
            }
        }
        if let Some(h) = e.downcast_ref::<hyper::Error>() {
            if h.is_timeout() {
                return FailureKind::Timeout;
            }
            closed |= h.is_incomplete_message() || h.is_canceled() || h.is_closed();
        }
        next = e.source();
    }
    match (closed, connect) {
        (true, _) => FailureKind::Reset,
        (false, true) => FailureKind::Connect,
        (false, false) => FailureKind::Other,
    }
}

/// A backend URL that [`HttpBackend`](super::HttpBackend) cannot use.
#[derive(Debug)]
pub struct InvalidBackendUrl {
    url: String,
    why: &'static str,
}

impl InvalidBackendUrl {
    pub(crate) fn new(url: &str, why: &'static str) -> Self {
        InvalidBackendUrl {
            url: url.to_string(),
            why,
        }
    }
}

impl fmt::Display for InvalidBackendUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "backend URL {:?}: {}", self.url, self.why)
    }
}

impl StdError for InvalidBackendUrl {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_io_kind_has_its_failure_kind() {
        let of = |k: io::ErrorKind| HttpBackendError::classify(io::Error::from(k).into()).kind();
        assert_eq!(of(io::ErrorKind::ConnectionRefused), FailureKind::Refused);
        assert_eq!(of(io::ErrorKind::ConnectionReset), FailureKind::Reset);
        assert_eq!(of(io::ErrorKind::BrokenPipe), FailureKind::Reset);
        assert_eq!(of(io::ErrorKind::TimedOut), FailureKind::Timeout);
        assert_eq!(of(io::ErrorKind::Other), FailureKind::Other);
    }

    #[test]
    fn a_response_timeout_is_504_in_the_balancers_error_too() {
        let e = HttpBackendError::response_timeout(Duration::from_secs(1));
        assert_eq!(e.kind(), FailureKind::Timeout);
        assert_eq!(e.status(), 504);
        let e = crate::Error::backend("b", e);
        assert_eq!(e.status(), 504);
        let source = std::error::Error::source(&e).unwrap().to_string();
        assert!(source.contains("no response headers within 1s"), "{source}");
    }
}
