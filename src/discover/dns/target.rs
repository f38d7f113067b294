//! [`DnsTarget`]: the name to resolve, and how its answer becomes addresses.

use std::fmt;
use std::str::FromStr;

use hickory_resolver::proto::rr::Name;
use hickory_resolver::proto::ProtoError;

use super::error::{DnsError, DnsErrorKind};

/// What a [`DnsFleet`](super::DnsFleet) resolves.
///
/// - [`DnsTarget::host`]: the name's A/AAAA records, each address with the given port: what a
///   Kubernetes headless service or a docker compose service name gives.
/// - [`DnsTarget::srv`]: the name's SRV records, each target host resolved to its addresses,
///   with the record's port: what Consul DNS or a Kubernetes named port gives.
///
/// Parsed from a string: `NAME:PORT` is a host, a name whose first label starts with `_` (as
/// `_http._tcp.llm.service.consul`) is SRV.
///
/// ```
/// use tower_affinity::discover::dns::DnsTarget;
///
/// let host: DnsTarget = "llm.default.svc.cluster.local:8080".parse().unwrap();
/// assert_eq!(host, DnsTarget::host("llm.default.svc.cluster.local", 8080).unwrap());
///
/// let srv: DnsTarget = "_http._tcp.llm.service.consul".parse().unwrap();
/// assert_eq!(srv, DnsTarget::srv("_http._tcp.llm.service.consul").unwrap());
///
/// assert!("llm.internal".parse::<DnsTarget>().is_err()); // neither a port nor SRV
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct DnsTarget {
    pub(crate) name: String,
    pub(crate) kind: TargetKind,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum TargetKind {
    /// A/AAAA, with this port.
    Host(u16),
    /// SRV: the port comes from each record.
    Srv,
}

impl DnsTarget {
    /// The A/AAAA records of `name`, each address with `port` (not 0). A literal IP address
    /// (also `[::1]`) is accepted and resolves to itself.
    pub fn host(name: &str, port: u16) -> Result<Self, DnsError> {
        if port == 0 {
            return Err(invalid(name, "the port is 0"));
        }
        let name = name
            .strip_prefix('[')
            .and_then(|n| n.strip_suffix(']'))
            .unwrap_or(name);
        Ok(DnsTarget {
            name: checked(name)?,
            kind: TargetKind::Host(port),
        })
    }

    /// The SRV records of `name`, as `_http._tcp.llm.service.consul`.
    pub fn srv(name: &str) -> Result<Self, DnsError> {
        Ok(DnsTarget {
            name: checked(name)?,
            kind: TargetKind::Srv,
        })
    }

    /// The name as given.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The port for a host target; `None` for SRV, whose records carry their ports.
    pub fn port(&self) -> Option<u16> {
        match self.kind {
            TargetKind::Host(port) => Some(port),
            TargetKind::Srv => None,
        }
    }

    /// Whether this is an SRV target.
    pub fn is_srv(&self) -> bool {
        self.kind == TargetKind::Srv
    }
}

/// A name that hickory takes (IDNA and all), or a literal IP address; kept as written.
fn checked(name: &str) -> Result<String, DnsError> {
    if name.is_empty() {
        return Err(invalid(name, "the name is empty"));
    }
    if name.parse::<std::net::IpAddr>().is_err() {
        dns_name(name).map_err(|e| invalid(name, &e.to_string()))?;
    }
    Ok(name.to_string())
}

/// `name` as the name asked for. An ASCII name is taken as it is written, underscores
/// included (`llama_server`, a docker compose service; hickory's own reading of a string,
/// by IDNA's rules for host names, refuses one anywhere but at a label's start); any other
/// goes through IDNA.
pub(crate) fn dns_name(name: &str) -> Result<Name, ProtoError> {
    if name.is_ascii() {
        Name::from_ascii(name)
    } else {
        Name::from_utf8(name)
    }
}

fn invalid(name: &str, why: &str) -> DnsError {
    DnsError::new(
        DnsErrorKind::InvalidTarget,
        format!("invalid DNS target {name:?}: {why}"),
    )
}

impl FromStr for DnsTarget {
    type Err = DnsError;

    /// `NAME:PORT` (also `[IPV6]:PORT`) for A/AAAA, `_SERVICE._PROTO.NAME` for SRV.
    fn from_str(s: &str) -> Result<Self, DnsError> {
        if s.starts_with('_') {
            return DnsTarget::srv(s);
        }
        // `http://llm.internal:8080`, as a backend's URL is written: read as a name and a
        // port, it would be refused for a reason that misleads (an IPv6 address's brackets).
        if let Some((scheme, _)) = s.split_once("://") {
            return Err(invalid(
                s,
                &format!("a DNS target is NAME:PORT, not a URL: leave out {scheme}://"),
            ));
        }
        let Some((name, port)) = s.rsplit_once(':') else {
            return Err(invalid(
                s,
                "expected NAME:PORT for A/AAAA records, or _SERVICE._PROTO.NAME for SRV",
            ));
        };
        // `fd00::1:8080` reads as an address and a port, and as an address without one: the
        // port then would be a guess. An IPv6 address with a port takes brackets.
        if name.contains(':') && !(name.starts_with('[') && name.ends_with(']')) {
            return Err(invalid(
                s,
                "an IPv6 address and its port are written [ADDRESS]:PORT",
            ));
        }
        // `u16`'s parse takes a sign (`+8080`): a port is digits alone.
        let digits = port.bytes().all(|b| b.is_ascii_digit());
        let port = port.parse::<u16>().ok().filter(|_| digits).ok_or_else(|| {
            invalid(
                s,
                &format!("the port {port:?} is not a number from 1 to 65535"),
            )
        })?;
        DnsTarget::host(name, port)
    }
}

impl fmt::Display for DnsTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            TargetKind::Host(port) if self.name.contains(':') => {
                write!(f, "[{}]:{port}", self.name)
            }
            TargetKind::Host(port) => write!(f, "{}:{port}", self.name),
            TargetKind::Srv => write!(f, "SRV {}", self.name),
        }
    }
}

impl fmt::Debug for DnsTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DnsTarget({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_hosts_ips_and_srv() {
        let t: DnsTarget = "backends.test:8080".parse().unwrap();
        assert_eq!(
            (t.name(), t.port(), t.is_srv()),
            ("backends.test", Some(8080), false)
        );
        let t: DnsTarget = "[::1]:9000".parse().unwrap();
        assert_eq!((t.name(), t.port()), ("::1", Some(9000)));
        assert_eq!(t.to_string(), "[::1]:9000");
        let t: DnsTarget = "10.0.0.1:80".parse().unwrap();
        assert_eq!(t.to_string(), "10.0.0.1:80");
        // A docker compose service's name may have an underscore.
        let t: DnsTarget = "llama_server:8080".parse().unwrap();
        assert_eq!((t.name(), t.port()), ("llama_server", Some(8080)));
        let t: DnsTarget = "_llm._tcp.backends.test.".parse().unwrap();
        assert_eq!(
            (t.name(), t.port(), t.is_srv()),
            ("_llm._tcp.backends.test.", None, true)
        );
    }

    /// `u16`'s parse takes a sign (`+8080`); a port is digits alone.
    #[test]
    fn a_port_with_a_sign_is_not_a_number() {
        for bad in ["backends.test:+8080", "[::1]:+80", "backends.test:-80"] {
            let e = bad.parse::<DnsTarget>().unwrap_err();
            assert_eq!(e.kind(), DnsErrorKind::InvalidTarget, "{bad}");
            assert!(e.to_string().contains("not a number"), "{bad}: {e}");
        }
        let t: DnsTarget = "backends.test:08080".parse().unwrap();
        assert_eq!(t.port(), Some(8080));
    }

    #[test]
    fn rejects_bad_targets_with_the_reason() {
        for (bad, why) in [
            ("backends.test", "expected NAME:PORT"),
            ("backends.test:http", "not a number"),
            ("backends.test:70000", "not a number"),
            ("backends.test:0", "the port is 0"),
            (":80", "empty"),
            ("a..b:80", "invalid DNS target"),
            // An address and a port, or an address alone: brackets say which.
            ("fd00::1:8080", "[ADDRESS]:PORT"),
            ("fd00::7", "[ADDRESS]:PORT"),
            ("[fd00::1:8080", "[ADDRESS]:PORT"),
            // A URL, as a backend's is written: the scheme is what is wrong.
            ("http://backends.test:8080", "not a URL: leave out http://"),
            ("http://backends.test", "not a URL: leave out http://"),
            ("http://[fd00::1]:8080", "not a URL: leave out http://"),
        ] {
            let e = bad.parse::<DnsTarget>().unwrap_err();
            assert_eq!(e.kind(), DnsErrorKind::InvalidTarget, "{bad}");
            assert!(e.to_string().contains(why), "{bad}: {e}");
        }
    }
}
