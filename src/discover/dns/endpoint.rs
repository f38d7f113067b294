//! [`DnsEndpoint`]: one address a resolution gave, as the service and node functions see it.

use std::net::{IpAddr, SocketAddr};

use http::uri::Authority;

use crate::BackendId;

/// One backend address from a resolution: what a [`DnsFleet`](super::DnsFleet) hands the
/// functions that build a backend's service and name its node.
///
/// ```
/// use std::net::SocketAddr;
/// use tower_affinity::discover::dns::DnsEndpoint;
///
/// let ep = DnsEndpoint::new("[fd00::7]:8080".parse::<SocketAddr>().unwrap());
/// assert_eq!(ep.authority().as_str(), "[fd00::7]:8080");
/// assert_eq!(ep.id().as_str(), "[fd00::7]:8080");
/// assert_eq!(ep.ip().to_string(), "fd00::7");
/// ```
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DnsEndpoint {
    addr: SocketAddr,
    srv: Option<Srv>,
}

/// What the SRV record that led to an address said.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct Srv {
    host: String,
    priority: u16,
    weight: u16,
}

impl DnsEndpoint {
    /// An endpoint at `addr`, as an A/AAAA answer gives it.
    pub fn new(addr: SocketAddr) -> Self {
        DnsEndpoint { addr, srv: None }
    }

    /// An endpoint from an SRV record's target `host` (without its trailing dot).
    pub(crate) fn from_srv(addr: SocketAddr, host: String, priority: u16, weight: u16) -> Self {
        DnsEndpoint {
            addr,
            srv: Some(Srv {
                host,
                priority,
                weight,
            }),
        }
    }

    /// The address and port.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The address.
    pub fn ip(&self) -> IpAddr {
        self.addr.ip()
    }

    /// The port: the target's for A/AAAA, the record's for SRV.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// `IP:PORT` (`[IPV6]:PORT`) as a URI authority, for building a client to the backend.
    pub fn authority(&self) -> Authority {
        // A socket address always formats as a valid authority; the fallback is never taken.
        Authority::try_from(self.addr.to_string())
            .unwrap_or_else(|_| Authority::from_static("invalid"))
    }

    /// The backend's id: `IP:PORT`, stable across resolutions.
    pub fn id(&self) -> BackendId {
        BackendId::from(self.addr.to_string())
    }

    /// For SRV: the record's target host name, without its trailing dot.
    pub fn srv_host(&self) -> Option<&str> {
        self.srv.as_ref().map(|s| s.host.as_str())
    }

    /// For SRV: the record's priority. Every target is a backend whatever its priority.
    pub fn srv_priority(&self) -> Option<u16> {
        self.srv.as_ref().map(|s| s.priority)
    }

    /// For SRV: the record's weight.
    pub fn srv_weight(&self) -> Option<u16> {
        self.srv.as_ref().map(|s| s.weight)
    }
}
