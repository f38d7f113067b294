//! The resolving task: resolve, announce the differences, wait as the TTL says, again.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::pin::pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use hickory_resolver::TokioResolver;
use tokio::sync::mpsc::UnboundedSender;
use tower::discover::Change;

use super::endpoint::DnsEndpoint;
use super::handle::DnsHandle;
use super::resolve::resolve;
use crate::{Backend, BackendId, BoxError, NodeId};

/// Builds a backend's service from its endpoint, or says why not.
pub(crate) type MakeService<S> = Arc<dyn Fn(&DnsEndpoint) -> Result<S, BoxError> + Send + Sync>;
/// Names a backend's node from its endpoint.
pub(crate) type NodeOf = Arc<dyn Fn(&DnsEndpoint) -> NodeId + Send + Sync>;

/// When to resolve again.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Schedule {
    /// The floor under the TTL.
    pub(crate) min: Duration,
    /// The ceiling over it.
    pub(crate) max: Duration,
    /// After a failure.
    pub(crate) retry: Duration,
}

impl Schedule {
    /// The wait after a successful resolution whose shortest TTL was `ttl` seconds.
    pub(crate) fn after(&self, ttl: u32) -> Duration {
        Duration::from_secs(u64::from(ttl)).clamp(self.min, self.max.max(self.min))
    }
}

/// How each backend is made.
pub(crate) struct Make<S> {
    pub(crate) service: MakeService<S>,
    pub(crate) node: NodeOf,
    pub(crate) slots: Option<NonZeroU32>,
    pub(crate) cache_tokens: u64,
    pub(crate) extensions: http::Extensions,
}

impl<S> Make<S> {
    fn backend(&self, ep: &DnsEndpoint) -> Result<Backend<S>, BoxError> {
        let mut backend = Backend::new((self.node)(ep), (self.service)(ep)?);
        backend.extensions_mut().extend(self.extensions.clone());
        let backend = match self.slots {
            Some(slots) => backend.slots(slots),
            None => backend,
        };
        Ok(backend.cache_tokens(self.cache_tokens))
    }
}

/// Resolves until the stream is dropped (which aborts this task) or stops listening.
pub(crate) async fn run<S>(
    resolver: TokioResolver,
    handle: DnsHandle,
    schedule: Schedule,
    make: Make<S>,
    tx: UnboundedSender<Change<BackendId, Backend<S>>>,
) {
    // However the task ends, its end is seen: a panic in the service or node function (or
    // anywhere here) would otherwise leave `DnsHandle::resolved` waiting for good.
    let _closed = ClosedOnDrop(handle.clone());
    let target = handle.target().clone();
    let shared = handle.shared();
    let mut current: BTreeMap<SocketAddr, BackendId> = BTreeMap::new();
    // Addresses whose service could not be made: left out, tried again each resolution, and
    // logged once until they are made or gone.
    let mut unmade: BTreeSet<SocketAddr> = BTreeSet::new();
    loop {
        let wait = match resolve(&resolver, &target).await {
            Ok(found) => {
                let (mut added, mut removed) = (0usize, 0usize);
                current.retain(|addr, id| {
                    let keep = found.endpoints.contains_key(addr);
                    if !keep {
                        removed += 1;
                        tracing::debug!(dns = %target, backend = %id, "DNS: backend gone");
                        let _ = tx.send(Change::Remove(id.clone()));
                    }
                    keep
                });
                unmade.retain(|addr| found.endpoints.contains_key(addr));
                for (addr, ep) in &found.endpoints {
                    if current.contains_key(addr) {
                        continue;
                    }
                    let id = ep.id();
                    let backend = match make.backend(ep) {
                        Ok(backend) => backend,
                        Err(e) => {
                            if unmade.insert(*addr) {
                                tracing::warn!(
                                    dns = %target,
                                    backend = %id,
                                    error = %e,
                                    "DNS: could not make the backend's service; left out"
                                );
                            }
                            continue;
                        }
                    };
                    unmade.remove(addr);
                    added += 1;
                    tracing::debug!(dns = %target, backend = %id, "DNS: backend found");
                    let _ = tx.send(Change::Insert(id.clone(), backend));
                    current.insert(*addr, id);
                }
                if added + removed > 0 {
                    tracing::info!(
                        dns = %target,
                        added,
                        removed,
                        backends = current.len(),
                        "DNS fleet changed"
                    );
                }
                if shared.failing() {
                    tracing::info!(dns = %target, backends = current.len(), "DNS resolution recovered");
                }
                shared.succeeded(current.len());
                schedule.after(found.ttl)
            }
            Err(e) => {
                let run = shared.failed(e.clone());
                if run == 1 {
                    tracing::warn!(
                        dns = %target,
                        error = %e,
                        backends = current.len(),
                        "DNS resolution failed; keeping the last fleet"
                    );
                } else {
                    tracing::debug!(dns = %target, error = %e, failures = run, "DNS resolution still failing");
                }
                schedule.retry
            }
        };
        if tx.is_closed() {
            return;
        }
        sleep_or_refresh(wait, &handle).await;
    }
}

/// Marks the resolving task gone when dropped: at its end, its abort, or a panic in it.
struct ClosedOnDrop(DnsHandle);

impl Drop for ClosedOnDrop {
    fn drop(&mut self) {
        self.0.shared().closed();
    }
}

/// Sleeps `wait`, or less if a refresh is asked.
async fn sleep_or_refresh(wait: Duration, handle: &DnsHandle) {
    let mut sleep = pin!(tokio::time::sleep(wait));
    let mut refresh = pin!(handle.shared().refresh.notified());
    std::future::poll_fn(|cx| {
        if refresh.as_mut().poll(cx).is_ready() || sleep.as_mut().poll(cx).is_ready() {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ttl_is_clamped_between_floor_and_ceiling() {
        let s = Schedule {
            min: Duration::from_secs(5),
            max: Duration::from_secs(60),
            retry: Duration::from_secs(2),
        };
        assert_eq!(s.after(0), Duration::from_secs(5));
        assert_eq!(s.after(30), Duration::from_secs(30));
        assert_eq!(s.after(86_400), Duration::from_secs(60));
        // A ceiling under the floor is the floor, not a panic.
        let s = Schedule {
            max: Duration::from_secs(1),
            ..s
        };
        assert_eq!(s.after(30), Duration::from_secs(5));
    }
}
