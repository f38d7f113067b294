//! The resolving task: resolve, announce the differences, wait as the TTL says, again.

use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::net::SocketAddr;
use std::num::{NonZeroU32, NonZeroU64};
use std::pin::pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use tokio::time::Instant;
use tower::discover::Change;

use super::changes::Changes;
use super::endpoint::DnsEndpoint;
use super::handle::DnsHandle;
use super::resolve::{resolve, Resolver};
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
    /// How long an address that answers leave out stays in the fleet.
    pub(crate) grace: Duration,
}

impl Schedule {
    /// The wait after a successful resolution whose shortest TTL was `ttl` seconds.
    /// `grace_left` is the time until the first of the removal graces running ends, if any
    /// is: the wait is no longer, so that a long TTL does not put the removal off, but never
    /// under the floor.
    pub(crate) fn after(&self, ttl: u32, grace_left: Option<Duration>) -> Duration {
        let wait = Duration::from_secs(u64::from(ttl)).clamp(self.min, self.max.max(self.min));
        match grace_left {
            Some(left) => wait.min(left.max(self.min)),
            None => wait,
        }
    }

    /// When the removal grace of an address missing since `since` ends; `None` if never
    /// (a grace too long for the clock).
    fn grace_end(&self, since: Instant) -> Option<Instant> {
        since.checked_add(self.grace)
    }
}

/// How each backend is made.
pub(crate) struct Make<S> {
    pub(crate) service: MakeService<S>,
    pub(crate) node: NodeOf,
    pub(crate) slots: Option<NonZeroU32>,
    pub(crate) cache_tokens: u64,
    pub(crate) context: Option<NonZeroU64>,
    pub(crate) request_context: Option<NonZeroU64>,
    pub(crate) assign_slots: bool,
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
        let backend = match self.context {
            Some(tokens) => backend.context_tokens(tokens),
            None => backend,
        };
        let backend = match self.request_context {
            Some(tokens) => backend.request_context_tokens(tokens),
            None => backend,
        };
        let backend = match self.assign_slots {
            true => backend.assign_slots(),
            false => backend,
        };
        Ok(backend.cache_tokens(self.cache_tokens))
    }
}

/// Resolves until the stream is dropped (which aborts this task) or stops listening.
pub(crate) async fn run<S>(
    resolver: Resolver,
    handle: DnsHandle,
    schedule: Schedule,
    make: Make<S>,
    changes: Arc<Changes<S>>,
) {
    // However the task ends, its end is seen: a panic in the service or node function (or
    // anywhere here) would otherwise leave `DnsHandle::resolved` waiting for good, and the
    // stream open.
    let tx = ClosedOnDrop(handle.clone(), changes);
    let target = handle.target().clone();
    let shared = handle.shared();
    let mut current: BTreeMap<SocketAddr, BackendId> = BTreeMap::new();
    // Addresses whose service could not be made: left out, tried again each resolution, and
    // logged once until they are made or gone.
    let mut unmade: BTreeSet<SocketAddr> = BTreeSet::new();
    // Addresses in the fleet that the successful answers since have all left out, each with
    // the time of the first of them: removed once missing for the removal grace.
    let mut missing: BTreeMap<SocketAddr, Instant> = BTreeMap::new();
    // Whether the last answer's removals were held back because they would empty the fleet:
    // logged once when that starts.
    let mut holding = false;
    loop {
        let wait = match resolve(&resolver, &target).await {
            Ok(found) => {
                let now = Instant::now();
                let (mut added, mut removed) = (0usize, 0usize);
                unmade.retain(|addr| found.endpoints.contains_key(addr));
                // The new backends first, the gone ones after: a balancer that applies the
                // changes sent so far (on another thread, while a service below is made)
                // never finds its fleet empty where the answer only moved it (a one-backend
                // fleet whose pod came back at another address).
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
                    tx.1.send(Change::Insert(id.clone(), backend));
                    current.insert(*addr, id);
                }
                // No address of the answer in the fleet (their services all failed): the
                // removals would empty it, so the old backends stay, as on a failed
                // resolution, until one of the answer's is made.
                let held = !current.is_empty()
                    && !found
                        .endpoints
                        .keys()
                        .any(|addr| current.contains_key(addr));
                if held && !holding {
                    tracing::warn!(
                        dns = %target,
                        backends = current.len(),
                        "DNS: no backend of the answer could be made; keeping the last fleet"
                    );
                }
                holding = held;
                current.retain(|addr, id| {
                    if found.endpoints.contains_key(addr) {
                        if missing.remove(addr).is_some() {
                            tracing::debug!(
                                dns = %target,
                                backend = %id,
                                "DNS: backend back within its removal grace; kept"
                            );
                        }
                        return true;
                    }
                    let since = match missing.entry(*addr) {
                        Entry::Occupied(since) => *since.get(),
                        Entry::Vacant(since) => {
                            if !schedule.grace.is_zero() {
                                tracing::debug!(
                                    dns = %target,
                                    backend = %id,
                                    grace = ?schedule.grace,
                                    "DNS: backend missing from the answer; kept for its removal grace"
                                );
                            }
                            *since.insert(now)
                        }
                    };
                    if held || now.saturating_duration_since(since) < schedule.grace {
                        return true;
                    }
                    missing.remove(addr);
                    removed += 1;
                    tracing::debug!(dns = %target, backend = %id, "DNS: backend gone");
                    tx.1.send(Change::Remove(id.clone()));
                    false
                });
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
                let grace_left = missing
                    .values()
                    .filter_map(|since| schedule.grace_end(*since))
                    .min()
                    .map(|end| end.saturating_duration_since(Instant::now()));
                schedule.after(found.ttl, grace_left)
            }
            Err(e) => {
                let run = shared.failed(e.clone());
                if run == 1 && current.is_empty() {
                    // A name that never resolved has no fleet to keep.
                    tracing::warn!(
                        dns = %target,
                        error = %e,
                        "DNS resolution failed; no backend from this name yet"
                    );
                } else if run == 1 {
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
        // The stream gone (it aborts this task too): nobody to announce to.
        if Arc::strong_count(&tx.1) == 1 {
            return;
        }
        sleep_or_refresh(wait, &handle).await;
    }
}

/// Marks the resolving task gone when dropped, to the handle and to the stream: at its end,
/// its abort, or a panic in it.
struct ClosedOnDrop<S>(DnsHandle, Arc<Changes<S>>);

impl<S> Drop for ClosedOnDrop<S> {
    fn drop(&mut self) {
        self.1.close();
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
            grace: Duration::ZERO,
        };
        assert_eq!(s.after(0, None), Duration::from_secs(5));
        assert_eq!(s.after(30, None), Duration::from_secs(30));
        assert_eq!(s.after(86_400, None), Duration::from_secs(60));
        // A ceiling under the floor is the floor, not a panic.
        let s = Schedule {
            max: Duration::from_secs(1),
            ..s
        };
        assert_eq!(s.after(30, None), Duration::from_secs(5));
    }

    #[test]
    fn a_running_removal_grace_shortens_the_wait_down_to_the_floor() {
        let s = Schedule {
            min: Duration::from_secs(5),
            max: Duration::from_secs(60),
            retry: Duration::from_secs(2),
            grace: Duration::from_secs(30),
        };
        let secs = Duration::from_secs;
        // The grace ends before the TTL runs out: resolve when it ends.
        assert_eq!(s.after(30, Some(secs(12))), secs(12));
        // It ends after: the TTL as before.
        assert_eq!(s.after(30, Some(secs(40))), secs(30));
        // It ends under the floor, or has ended: the floor.
        assert_eq!(s.after(30, Some(secs(2))), secs(5));
        assert_eq!(s.after(30, Some(Duration::ZERO)), secs(5));
        // A grace too long for the clock has no end, and does not panic.
        let forever = Schedule {
            grace: Duration::MAX,
            ..s
        };
        assert_eq!(forever.grace_end(Instant::now()), None);
    }
}
