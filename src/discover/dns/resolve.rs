//! One resolution of a [`DnsTarget`]: its addresses and the shortest TTL among the records
//! that gave them.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use hickory_resolver::config::{LookupIpStrategy, ResolverConfig};
use hickory_resolver::net::NetError;
use hickory_resolver::proto::rr::{Name, RData, RecordType};
use hickory_resolver::TokioResolver;
use tokio::task::JoinSet;

use super::endpoint::DnsEndpoint;
use super::error::{DnsError, DnsErrorKind};
use super::target::{dns_name, DnsTarget, TargetKind};

/// The TTL of a literal address, as hickory gives it: a day, so the ceiling.
const LITERAL_TTL: u32 = 86_400;

/// A resolver, the domains a name is searched under, and the nameservers it asks as its
/// errors name them.
#[derive(Clone)]
pub(crate) struct Resolver {
    inner: TokioResolver,
    /// The domains a name without a trailing dot is tried under, in order (see
    /// [`Resolver::candidates`]).
    search: Arc<[Name]>,
    /// The nameservers asked, as errors name them (`nameserver 127.0.0.1:5353`,
    /// `nameservers 10.0.0.1:53, 10.0.0.2:53`); empty if none is known.
    asked: Arc<str>,
}

impl Resolver {
    /// `inner`, which asks `nameservers`, and searches names under `search` (see
    /// [`search_domains`]).
    pub(crate) fn new(inner: TokioResolver, nameservers: &[SocketAddr], search: Vec<Name>) -> Self {
        let list = nameservers
            .iter()
            .map(SocketAddr::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        let asked = match nameservers.len() {
            0 => String::new(),
            1 => format!("nameserver {list}"),
            _ => format!("nameservers {list}"),
        };
        Resolver {
            inner,
            search: search.into(),
            asked: asked.into(),
        }
    }

    /// The full names `name` is asked as, in order: as it is if it has a trailing dot;
    /// else under each search domain, and as it is first if it has more dots than
    /// `ndots` (or is under `localhost.`), last otherwise. The order hickory's own search
    /// follows.
    fn candidates(&self, name: &Name) -> Vec<Name> {
        if name.is_fqdn() {
            return vec![name.clone()];
        }
        let mut as_is = name.clone();
        as_is.set_fqdn(true);
        let as_is_first =
            usize::from(name.num_labels()) > self.inner.options().ndots || name.is_localhost();
        let mut out = Vec::with_capacity(self.search.len() + 1);
        if as_is_first {
            out.push(as_is.clone());
        }
        for domain in self.search.iter() {
            if let Ok(under) = name.clone().append_domain(domain) {
                if !out.contains(&under) {
                    out.push(under);
                }
            }
        }
        if !out.contains(&as_is) {
            out.push(as_is);
        }
        out
    }

    /// A resolver error about `what` (the name and record type asked).
    fn error(&self, what: &str, e: &NetError) -> DnsError {
        DnsError::resolve(what, e, &self.asked)
    }
}

/// The nameservers `config` asks: each one's address on each port its connections use, in
/// order, once each.
pub(crate) fn nameservers(config: &ResolverConfig) -> Vec<SocketAddr> {
    let mut out = Vec::new();
    for ns in config.name_servers() {
        for connection in &ns.connections {
            let addr = SocketAddr::new(ns.ip, connection.port);
            if !out.contains(&addr) {
                out.push(addr);
            }
        }
    }
    out
}

/// The domains `config` searches a name under, in the order hickory asks them: its domain,
/// then its search list, once each.
pub(crate) fn search_domains(config: &ResolverConfig) -> Vec<Name> {
    let mut out: Vec<Name> = Vec::new();
    for domain in config.domain().into_iter().chain(config.search()) {
        if !out.contains(domain) {
            out.push(domain.clone());
        }
    }
    out
}

/// What one resolution found.
#[derive(Debug)]
pub(crate) struct Resolution {
    pub(crate) endpoints: BTreeMap<SocketAddr, DnsEndpoint>,
    /// The shortest TTL, in seconds, of the records used.
    pub(crate) ttl: u32,
}

/// Resolves `target` once. An answer with no address is an error: DNS never empties the fleet.
pub(crate) async fn resolve(
    resolver: &Resolver,
    target: &DnsTarget,
) -> Result<Resolution, DnsError> {
    // Every resolution asks the server: the TTL is honoured here, by when the next one runs.
    resolver.inner.clear_cache();
    let resolution = match target.kind {
        TargetKind::Host(port) => host(resolver, &target.name, port).await?,
        TargetKind::Srv => srv(resolver, &target.name).await?,
    };
    if resolution.endpoints.is_empty() {
        return Err(DnsError::new(
            DnsErrorKind::NoRecords,
            format!("{target}: no addresses"),
        ));
    }
    Ok(resolution)
}

async fn host(resolver: &Resolver, name: &str, port: u16) -> Result<Resolution, DnsError> {
    let (ips, ttl) = addresses(resolver, name).await?;
    let endpoints = ips
        .into_iter()
        .map(|ip| {
            let addr = SocketAddr::new(ip, port);
            (addr, DnsEndpoint::new(addr))
        })
        .collect();
    Ok(Resolution {
        endpoints,
        ttl: ttl.unwrap_or(0),
    })
}

/// `name`'s addresses as the resolver's [`IpStrategy`](super::IpStrategy) says, and the
/// shortest TTL of the records that gave them.
///
/// One record type's query failing (a timeout, SERVFAIL) while the other answers fails the
/// whole: only a name that has none of a type (NXDOMAIN, or no records) lets the other type
/// stand alone. hickory's own `lookup_ip` takes any failure of the first type for "none" and
/// answers with the second alone, or with the type that answered alone of the two asked
/// together: a transient failure would swap a dual-stack fleet's backends for their other
/// addresses.
///
/// A name without a trailing dot is asked under each search domain in turn (see
/// [`Resolver::candidates`]), every type asked under one full name before the next full
/// name. hickory searches each type on its own, and goes on to the next domain after a
/// failed query as after "no such name": an A query that timed out under the domain where
/// the name exists, followed by "no such name" under the next domain, reads as "no A
/// records", and the AAAA records found under the first stand alone. Here a full name under
/// which a query failed and none answered is passed over as a system resolver passes it
/// over, and if no later one has an address, the resolution fails with that failure.
async fn addresses(
    resolver: &Resolver,
    name: &str,
) -> Result<(Vec<IpAddr>, Option<u32>), DnsError> {
    if let Ok(ip) = name.parse::<IpAddr>() {
        // A literal address resolves to itself, without a query. Not through hickory's
        // `lookup_ip`: under an `ndots` over 4 (Kubernetes gives pods 5) it looks an IPv4
        // address up against each search domain first, waits out a nameserver that does not
        // answer, and takes what one that does answers for it.
        return Ok((vec![ip], Some(LITERAL_TTL)));
    }
    let (mut failed, mut none) = (None, Vec::new());
    for candidate in resolver.candidates(&parsed(name)?) {
        match addresses_of(resolver, &candidate).await? {
            Found::Addresses(ips, ttl) => return Ok((ips, ttl)),
            Found::None(e) => none = e,
            Found::Failed(e) => {
                failed.get_or_insert(e);
            }
        }
    }
    if let Some(e) = failed {
        return Err(e);
    }
    // No address under any name asked: what each type's query said under the last, as
    // hickory reports a search, of the first's kind.
    let Some((first, rest)) = none.split_first() else {
        return Err(DnsError::new(
            DnsErrorKind::NoRecords,
            format!("{name}: no addresses"),
        ));
    };
    let message = rest
        .iter()
        .fold(first.to_string(), |message, e| format!("{message}; {e}"));
    Err(DnsError::new(first.kind(), message))
}

/// What the record types asked under one full name gave.
enum Found {
    /// Addresses, and the shortest TTL of their records.
    Addresses(Vec<IpAddr>, Option<u32>),
    /// None of any type asked: what each type's query said.
    None(Vec<DnsError>),
    /// A query failed, and no other type asked has an address.
    Failed(DnsError),
}

/// The addresses of the full name `name`, as [`addresses`] says; an error if a type's query
/// failed while another type has addresses.
async fn addresses_of(resolver: &Resolver, name: &Name) -> Result<Found, DnsError> {
    use RecordType::{A, AAAA};
    // The first type, the second if any, and whether both are asked together.
    let (first, second, together) = match resolver.inner.options().ip_strategy {
        LookupIpStrategy::Ipv4Only => (A, None, false),
        LookupIpStrategy::Ipv6Only => (AAAA, None, false),
        LookupIpStrategy::Ipv4thenIpv6 => (A, Some(AAAA), false),
        LookupIpStrategy::Ipv6thenIpv4 => (AAAA, Some(A), false),
        LookupIpStrategy::Ipv4AndIpv6 => (A, Some(AAAA), true),
        LookupIpStrategy::Ipv6AndIpv4 => (AAAA, Some(A), true),
    };
    let families = match second {
        None => vec![family(resolver, name, first).await],
        Some(second) if together => {
            let (first, second) = futures_util::future::join(
                family(resolver, name, first),
                family(resolver, name, second),
            )
            .await;
            vec![first, second]
        }
        // The second only if the name has none of the first.
        Some(second) => match family(resolver, name, first).await {
            Ok(Err(none)) => vec![Ok(Err(none)), family(resolver, name, second).await],
            other => vec![other],
        },
    };
    let (mut failed, mut none) = (None, Vec::new());
    let (mut ips, mut ttl) = (Vec::new(), None::<u32>);
    for family in families {
        match family {
            Ok(Ok((found, t))) => {
                ips.extend(found);
                ttl = match (ttl, t) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
            }
            Ok(Err(e)) => none.push(e),
            Err(e) => {
                failed.get_or_insert(e);
            }
        }
    }
    Ok(match (failed, ips.is_empty()) {
        // One type failed, another answered: not "none of the first".
        (Some(e), false) => return Err(e),
        (Some(e), true) => Found::Failed(e),
        (None, true) => Found::None(none),
        (None, false) => Found::Addresses(ips, ttl),
    })
}

/// `name`'s addresses of one record type and their shortest TTL; `Ok(Err(..))` if it has none
/// (no such name, or no records of the type); an error if the query failed.
async fn family(
    resolver: &Resolver,
    name: &Name,
    rtype: RecordType,
) -> Result<Result<(Vec<IpAddr>, Option<u32>), DnsError>, DnsError> {
    let what = format!("{name} {rtype}");
    let lookup = match resolver.inner.lookup(name.clone(), rtype).await {
        Ok(lookup) => lookup,
        Err(e) => {
            let e = resolver.error(&what, &e);
            return match e.kind() {
                DnsErrorKind::NoSuchName | DnsErrorKind::NoRecords => Ok(Err(e)),
                _ => Err(e),
            };
        }
    };
    let answers = lookup.answers();
    let ips: Vec<IpAddr> = answers
        .iter()
        .filter_map(|r| r.data.ip_addr())
        .filter(|ip| ip.is_ipv4() == (rtype == RecordType::A))
        .collect();
    if ips.is_empty() {
        return Ok(Err(DnsError::new(
            DnsErrorKind::NoRecords,
            format!("{what}: no records"),
        )));
    }
    Ok(Ok((ips, answers.iter().map(|r| r.ttl).min())))
}

/// `name` as asked for (see [`dns_name`]); a target's was checked when it was made, an SRV
/// record's target came as a name.
fn parsed(name: &str) -> Result<Name, DnsError> {
    dns_name(name).map_err(|e| {
        DnsError::new(
            DnsErrorKind::InvalidTarget,
            format!("invalid DNS name {name:?}: {e}"),
        )
    })
}

/// How many of an SRV answer's targets are looked up at a time. Each lookup is one or two
/// queries (A, AAAA) on a socket of its own: an answer with hundreds of targets would
/// otherwise send hundreds of queries at once, more than a local forwarder such as dnsmasq
/// (150 by default) takes, and open as many sockets.
const SRV_LOOKUPS: usize = 8;

/// One SRV record's target and what it said.
struct SrvRecord {
    target: String,
    port: u16,
    priority: u16,
    weight: u16,
}

async fn srv(resolver: &Resolver, name: &str) -> Result<Resolution, DnsError> {
    let lookup = resolver
        .inner
        .srv_lookup(parsed(name)?)
        .await
        .map_err(|e| resolver.error(&format!("{name} SRV"), &e))?;
    let mut ttl = u32::MAX;
    let mut records = Vec::new();
    // Records that name no server: port 0, or the target ".".
    let mut unserved = 0usize;
    for record in lookup.answers() {
        let RData::SRV(srv) = &record.data else {
            continue;
        };
        // A target of "." says the service is not offered there (RFC 2782); port 0 names
        // no server to connect to (Consul answers so for a service registered without one).
        if srv.target.is_root() || srv.port == 0 {
            unserved += 1;
            continue;
        }
        ttl = ttl.min(record.ttl);
        records.push(SrvRecord {
            target: srv.target.to_ascii(),
            port: srv.port,
            priority: srv.priority,
            weight: srv.weight,
        });
    }

    // Each target host once, `SRV_LOOKUPS` at a time.
    let hosts: BTreeSet<String> = records.iter().map(|r| r.target.clone()).collect();
    let mut hosts = hosts.into_iter();
    let mut lookups = JoinSet::new();
    let look_up = |lookups: &mut JoinSet<_>, host: String| {
        let resolver = resolver.clone();
        lookups.spawn(async move {
            let found = addresses(&resolver, host.as_str()).await;
            (host, found)
        });
    };
    for host in hosts.by_ref().take(SRV_LOOKUPS) {
        look_up(&mut lookups, host);
    }
    let mut targets: BTreeMap<String, Vec<IpAddr>> = BTreeMap::new();
    // The targets without an address, and what their lookups said.
    let mut unresolved: BTreeMap<String, DnsError> = BTreeMap::new();
    while let Some(done) = lookups.join_next().await {
        let Ok((host, found)) = done else {
            return Err(DnsError::new(
                DnsErrorKind::Other,
                format!("{name} SRV: a target's lookup was cancelled"),
            ));
        };
        match found {
            Ok((ips, t)) => {
                if let Some(t) = t {
                    ttl = ttl.min(t);
                }
                targets.insert(host, ips);
            }
            Err(e) => match e.kind() {
                // A target that is gone is not a backend; the others still are.
                DnsErrorKind::NoSuchName | DnsErrorKind::NoRecords => {
                    tracing::debug!(error = %e, srv = name, "SRV target has no address; left out");
                    unresolved.insert(host, e);
                }
                // A target not resolved now may still be there: keep the last fleet.
                _ => {
                    return Err(DnsError::new(
                        e.kind(),
                        format!("{e} (SRV target of {name})"),
                    ))
                }
            },
        }
        if let Some(host) = hosts.next() {
            look_up(&mut lookups, host);
        }
    }

    let mut endpoints = BTreeMap::new();
    let unresolved_records = records
        .iter()
        .filter(|r| unresolved.contains_key(&r.target))
        .count();
    for r in records {
        let host = r.target.strip_suffix('.').unwrap_or(&r.target);
        for &ip in targets.get(&r.target).into_iter().flatten() {
            let addr = SocketAddr::new(ip, r.port);
            endpoints.entry(addr).or_insert_with(|| {
                DnsEndpoint::from_srv(addr, host.to_string(), r.priority, r.weight)
            });
        }
    }
    if endpoints.is_empty() {
        return Err(no_addresses(
            name,
            unserved,
            unresolved_records,
            &unresolved,
        ));
    }
    Ok(Resolution {
        endpoints,
        ttl: if ttl == u32::MAX { 0 } else { ttl },
    })
}

/// The error of an SRV answer that gave no address: how many records named no server, how
/// many had targets without an address, and what the first such target's lookup said.
fn no_addresses(
    name: &str,
    unserved: usize,
    unresolved_records: usize,
    unresolved: &BTreeMap<String, DnsError>,
) -> DnsError {
    let records = |n: usize| match n {
        1 => "1 record".to_string(),
        n => format!("{n} records"),
    };
    let mut why = Vec::new();
    if let Some((_, first)) = unresolved.first_key_value() {
        let more = match unresolved.len() - 1 {
            0 => String::new(),
            1 => "; and 1 more target".to_string(),
            n => format!("; and {n} more targets"),
        };
        why.push(format!(
            "{} whose target has none ({first}{more})",
            records(unresolved_records)
        ));
    }
    if unserved > 0 {
        why.push(format!(
            "{} on port 0 or with the target \".\"",
            records(unserved)
        ));
    }
    let message = match why.is_empty() {
        true => format!("SRV {name}: no addresses"),
        false => format!("SRV {name}: no addresses: {}", why.join(", ")),
    };
    DnsError::new(DnsErrorKind::NoRecords, message)
}

// The DNS server of `tests/dns`, for resolutions under search domains, which the builder does
// not set.
#[cfg(test)]
#[path = "../../../tests/dns/server.rs"]
#[allow(dead_code)]
mod test_server;

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use hickory_resolver::config::{ConnectionConfig, NameServerConfig, ResolverConfig};
    use hickory_resolver::net::runtime::TokioRuntimeProvider;
    use hickory_resolver::proto::rr::Name;

    use super::*;

    use super::test_server as server;

    /// A resolver that asks `dns` under the search domains `search` with `ndots:1`.
    fn searching(dns: &server::Dns, search: &[&str], strategy: LookupIpStrategy) -> Resolver {
        let (mut udp, mut tcp) = (ConnectionConfig::udp(), ConnectionConfig::tcp());
        udp.port = dns.addr.port();
        tcp.port = dns.addr.port();
        let ns = NameServerConfig::new(dns.addr.ip(), true, vec![udp, tcp]);
        let search = search
            .iter()
            .map(|s| Name::from_ascii(s).unwrap())
            .collect();
        let config = ResolverConfig::from_parts(None, search, vec![ns]);
        let search = search_domains(&config);
        let mut builder =
            TokioResolver::builder_with_config(config, TokioRuntimeProvider::default());
        let options = builder.options_mut();
        options.ndots = 1;
        options.timeout = Duration::from_secs(1);
        options.attempts = 1;
        options.cache_size = 0;
        options.ip_strategy = strategy;
        options.use_hosts_file = hickory_resolver::config::ResolveHosts::Never;
        Resolver::new(builder.build().unwrap(), &[dns.addr], search)
    }

    /// Under search domains as under a full name, a record type whose query fails (a
    /// timeout, SERVFAIL) under the domain where the name exists fails the resolution, while
    /// the other type answers: it is not taken for "none of that type", which would swap a
    /// dual-stack fleet's backends for their other addresses.
    #[tokio::test(start_paused = true)]
    async fn a_record_type_that_fails_under_a_search_domain_fails_the_resolution() {
        use hickory_resolver::proto::rr::RecordType::A;

        let dns = server::Dns::start().await;
        dns.set_ips("llm.prod.fleet.test.", 30, &["10.0.0.1", "fd00::1"])
            .await;
        // `llm.prod` reaches `ndots:1`: asked as it is first (refused: outside the zone),
        // then under each search domain; it exists under the first, not the second.
        let target = DnsTarget::host("llm.prod", 8080).unwrap();
        let addrs =
            |r: &Resolution| -> Vec<String> { r.endpoints.keys().map(|a| a.to_string()).collect() };
        for (strategy, want) in [
            (LookupIpStrategy::Ipv4thenIpv6, vec!["10.0.0.1:8080"]),
            (
                LookupIpStrategy::Ipv4AndIpv6,
                vec!["10.0.0.1:8080", "[fd00::1]:8080"],
            ),
        ] {
            let resolver = searching(&dns, &["fleet.test.", "other.fleet.test."], strategy);
            let found = resolve(&resolver, &target).await.unwrap();
            assert_eq!(addrs(&found), want, "{strategy:?}");

            // The name asked as it is was refused first (outside the server's zone): the
            // error is the first failure, which is not "no such name".
            for servfail in [false, true] {
                match servfail {
                    true => dns.servfail("llm.prod.fleet.test.", A, true),
                    false => dns.silent("llm.prod.fleet.test.", A, true),
                }
                let found = resolve(&resolver, &target).await;
                dns.servfail("llm.prod.fleet.test.", A, false);
                match found {
                    Ok(found) => panic!("{strategy:?}: resolved to {:?}", addrs(&found)),
                    Err(e) => assert!(
                        !matches!(e.kind(), DnsErrorKind::NoSuchName | DnsErrorKind::NoRecords),
                        "{strategy:?}: {e}"
                    ),
                }
            }
        }
    }

    /// The system configuration's nameservers are named once each, on the port they are
    /// asked on: hickory gives each a UDP and a TCP connection.
    #[cfg(all(unix, not(any(target_os = "android", target_vendor = "apple"))))]
    #[test]
    fn the_system_configuration_s_nameservers_are_named_once_each() {
        use hickory_resolver::system_conf::parse_resolv_conf;

        let (config, _) = parse_resolv_conf("nameserver 10.0.0.1\nnameserver fd00::1\n").unwrap();
        let found = nameservers(&config);
        let want: Vec<SocketAddr> = vec![
            "10.0.0.1:53".parse().unwrap(),
            "[fd00::1]:53".parse().unwrap(),
        ];
        assert_eq!(found, want);
        let resolver = Resolver::new(
            TokioResolver::builder_with_config(config, TokioRuntimeProvider::default())
                .build()
                .unwrap(),
            &found,
            Vec::new(),
        );
        assert_eq!(&*resolver.asked, "nameservers 10.0.0.1:53, [fd00::1]:53");
    }

    /// A literal address resolves to itself without a query, even under a configuration
    /// whose `ndots` it does not reach (Kubernetes gives pods `ndots:5`, under which hickory
    /// tries `10.0.0.1` against each search domain first, and would take whatever those
    /// answer for it).
    #[tokio::test(start_paused = true)]
    async fn a_literal_address_is_not_looked_up_under_search_domains() {
        // A nameserver that receives and never answers.
        let server = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let port = server.local_addr().unwrap().port();
        let mut udp = ConnectionConfig::udp();
        udp.port = port;
        let ns = NameServerConfig::new("127.0.0.1".parse().unwrap(), true, vec![udp]);
        let search = vec![Name::from_ascii("default.svc.cluster.local.").unwrap()];
        let config = ResolverConfig::from_parts(None, search, vec![ns]);
        let search = search_domains(&config);
        let mut builder =
            TokioResolver::builder_with_config(config, TokioRuntimeProvider::default());
        builder.options_mut().ndots = 5;
        builder.options_mut().timeout = Duration::from_secs(1);
        builder.options_mut().attempts = 1;
        let resolver = Resolver::new(
            builder.build().unwrap(),
            &[server.local_addr().unwrap()],
            search,
        );

        let start = tokio::time::Instant::now();
        for (target, want) in [("10.0.0.1", "10.0.0.1:8080"), ("::1", "[::1]:8080")] {
            let found = resolve(&resolver, &DnsTarget::host(target, 8080).unwrap())
                .await
                .unwrap();
            let addrs: Vec<String> = found.endpoints.keys().map(|a| a.to_string()).collect();
            assert_eq!(addrs, [want]);
        }
        assert_eq!(start.elapsed(), Duration::ZERO, "waited for a nameserver");
        let mut buf = [0u8; 512];
        assert!(
            server.try_recv(&mut buf).is_err(),
            "a literal address was sent to the nameserver"
        );
    }
}
