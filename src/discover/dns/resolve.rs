//! One resolution of a [`DnsTarget`]: its addresses and the shortest TTL among the records
//! that gave them.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

use hickory_resolver::proto::rr::RData;
use hickory_resolver::TokioResolver;
use tokio::task::JoinSet;

use super::endpoint::DnsEndpoint;
use super::error::{DnsError, DnsErrorKind};
use super::target::{DnsTarget, TargetKind};

/// What one resolution found.
#[derive(Debug)]
pub(crate) struct Resolution {
    pub(crate) endpoints: BTreeMap<SocketAddr, DnsEndpoint>,
    /// The shortest TTL, in seconds, of the records used.
    pub(crate) ttl: u32,
}

/// Resolves `target` once. An answer with no address is an error: DNS never empties the fleet.
pub(crate) async fn resolve(
    resolver: &TokioResolver,
    target: &DnsTarget,
) -> Result<Resolution, DnsError> {
    // Every resolution asks the server: the TTL is honoured here, by when the next one runs.
    resolver.clear_cache();
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

async fn host(resolver: &TokioResolver, name: &str, port: u16) -> Result<Resolution, DnsError> {
    let lookup = resolver
        .lookup_ip(name)
        .await
        .map_err(|e| DnsError::resolve(&format!("{name} A/AAAA"), &e))?;
    let ttl = lookup.as_lookup().answers().iter().map(|r| r.ttl).min();
    let endpoints = lookup
        .iter()
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

/// One SRV record's target and what it said.
struct SrvRecord {
    target: String,
    port: u16,
    priority: u16,
    weight: u16,
}

async fn srv(resolver: &TokioResolver, name: &str) -> Result<Resolution, DnsError> {
    let lookup = resolver
        .srv_lookup(name)
        .await
        .map_err(|e| DnsError::resolve(&format!("{name} SRV"), &e))?;
    let mut ttl = u32::MAX;
    let mut records = Vec::new();
    for record in lookup.answers() {
        let RData::SRV(srv) = &record.data else {
            continue;
        };
        // A target of "." says the service is not offered there (RFC 2782).
        if srv.target.is_root() {
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

    // Each target host once, all at the same time.
    let hosts: BTreeSet<String> = records.iter().map(|r| r.target.clone()).collect();
    let mut lookups = JoinSet::new();
    for host in hosts {
        let resolver = resolver.clone();
        lookups.spawn(async move {
            let found = resolver.lookup_ip(host.as_str()).await;
            (host, found)
        });
    }
    let mut addresses: BTreeMap<String, Vec<std::net::IpAddr>> = BTreeMap::new();
    while let Some(done) = lookups.join_next().await {
        let Ok((host, found)) = done else {
            return Err(DnsError::new(
                DnsErrorKind::Other,
                format!("{name} SRV: a target's lookup was cancelled"),
            ));
        };
        match found {
            Ok(ips) => {
                if let Some(t) = ips.as_lookup().answers().iter().map(|r| r.ttl).min() {
                    ttl = ttl.min(t);
                }
                addresses.insert(host, ips.iter().collect());
            }
            Err(e) => {
                let e = DnsError::resolve(&format!("{host} A/AAAA (SRV target of {name})"), &e);
                match e.kind() {
                    // A target that is gone is not a backend; the others still are.
                    DnsErrorKind::NoSuchName | DnsErrorKind::NoRecords => {
                        tracing::debug!(error = %e, "SRV target has no address; left out");
                    }
                    // A target not resolved now may still be there: keep the last fleet.
                    _ => return Err(e),
                }
            }
        }
    }

    let mut endpoints = BTreeMap::new();
    for r in records {
        let host = r.target.strip_suffix('.').unwrap_or(&r.target);
        for &ip in addresses.get(&r.target).into_iter().flatten() {
            let addr = SocketAddr::new(ip, r.port);
            endpoints.entry(addr).or_insert_with(|| {
                DnsEndpoint::from_srv(addr, host.to_string(), r.priority, r.weight)
            });
        }
    }
    Ok(Resolution {
        endpoints,
        ttl: if ttl == u32::MAX { 0 } else { ttl },
    })
}
