//! [`DnsError`]: why a target was refused or a resolution failed.

use std::fmt;
use std::sync::Arc;

use hickory_resolver::net::{DnsError as HickoryDnsError, NetError};
use hickory_resolver::proto::op::ResponseCode;

/// Why a [`DnsTarget`](super::DnsTarget) was refused, a resolver could not be built, or a
/// resolution failed. Cheap to clone.
///
/// Its text names the name and record type asked; where no answer about the name came
/// ([`Timeout`](DnsErrorKind::Timeout), [`Connection`](DnsErrorKind::Connection),
/// [`ServerFailure`](DnsErrorKind::ServerFailure), [`Other`](DnsErrorKind::Other)), the
/// nameservers asked too: those given to
/// [`DnsFleetBuilder::nameserver`](super::DnsFleetBuilder::nameserver), else the system
/// configuration's.
///
/// ```
/// use tower_affinity::discover::dns::{DnsErrorKind, DnsTarget};
///
/// let e = "no-port.test".parse::<DnsTarget>().unwrap_err();
/// assert_eq!(e.kind(), DnsErrorKind::InvalidTarget);
/// ```
#[derive(Clone)]
pub struct DnsError {
    kind: DnsErrorKind,
    message: Arc<str>,
}

/// The kind of a [`DnsError`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DnsErrorKind {
    /// The target is not a valid name, or not of the form `NAME:PORT` or `_SERVICE._PROTO.NAME`.
    InvalidTarget,
    /// The resolver could not be set up (for example, no usable system configuration).
    Config,
    /// The name does not exist (NXDOMAIN).
    NoSuchName,
    /// The name exists but has no records of the type asked, or none that gave an address.
    NoRecords,
    /// No answer in time.
    Timeout,
    /// The server answered with an error: SERVFAIL, REFUSED and the like.
    ServerFailure,
    /// The connection to the server failed.
    Connection,
    /// Anything else the resolver reported.
    Other,
}

impl DnsError {
    pub(crate) fn new(kind: DnsErrorKind, message: impl Into<Arc<str>>) -> Self {
        DnsError {
            kind,
            message: message.into(),
        }
    }

    /// A resolver error about `what` (the name and record type asked). `asked` names the
    /// nameservers the resolver asks (`nameserver 127.0.0.1:5353`), or is empty if they are not
    /// known. Where no answer about the name came (a timeout, a failed connection, a server
    /// failure), the message ends with it, so that a wrong resolver address shows.
    pub(crate) fn resolve(what: &str, e: &NetError, asked: &str) -> Self {
        let kind = match e {
            NetError::Timeout => DnsErrorKind::Timeout,
            NetError::Io(_) | NetError::NoConnections | NetError::Busy => DnsErrorKind::Connection,
            NetError::Dns(HickoryDnsError::NoRecordsFound(no)) => match no.response_code {
                ResponseCode::NXDomain => DnsErrorKind::NoSuchName,
                ResponseCode::NoError => DnsErrorKind::NoRecords,
                _ => DnsErrorKind::ServerFailure,
            },
            NetError::Dns(HickoryDnsError::ResponseCode(_)) => DnsErrorKind::ServerFailure,
            _ => DnsErrorKind::Other,
        };
        let message = match kind {
            DnsErrorKind::NoSuchName => format!("{what}: no such name (NXDOMAIN)"),
            DnsErrorKind::NoRecords => format!("{what}: no records"),
            _ if asked.is_empty() => format!("{what}: {e}"),
            _ => format!("{what}: {e} ({asked})"),
        };
        DnsError::new(kind, message)
    }

    /// What kind of failure this is.
    pub fn kind(&self) -> DnsErrorKind {
        self.kind
    }
}

impl fmt::Display for DnsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl fmt::Debug for DnsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DnsError")
            .field("kind", &self.kind)
            .field("message", &&*self.message)
            .finish()
    }
}

impl std::error::Error for DnsError {}
