//! [`DnsHandle`]: a running [`DnsFleet`](super::DnsFleet)'s counters, last error, and a way to
//! re-resolve at once.

use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::{watch, Notify};

use super::error::DnsError;
use super::target::DnsTarget;

/// A handle on a [`DnsFleet`](super::DnsFleet): what its resolutions did, and
/// [`refresh`](DnsHandle::refresh) to resolve again now. Cheap to clone; it outlives the
/// stream.
#[derive(Clone)]
pub struct DnsHandle {
    shared: Arc<Shared>,
}

/// A snapshot of a [`DnsFleet`](super::DnsFleet)'s counters.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct DnsStats {
    /// Resolutions completed, successful or not.
    pub resolutions: u64,
    /// Resolutions that failed; each kept the fleet as it was.
    pub failures: u64,
    /// Failures since the last success: 0 while the name resolves.
    pub consecutive_failures: u64,
    /// Backends in the fleet the stream has announced, those that answers have left out but
    /// that are within their [removal grace](super::DnsFleetBuilder::removal_grace) included.
    pub backends: usize,
    /// The last failure's error, kept after the name resolves again.
    pub last_error: Option<DnsError>,
}

pub(crate) struct Shared {
    target: DnsTarget,
    resolutions: AtomicU64,
    failures: AtomicU64,
    consecutive_failures: AtomicU64,
    backends: AtomicUsize,
    last_error: Mutex<Option<DnsError>>,
    pub(crate) refresh: Notify,
    /// Resolutions completed, and whether the resolving task is gone: what waiters watch.
    progress: watch::Sender<(u64, bool)>,
}

impl DnsHandle {
    pub(crate) fn new(target: DnsTarget) -> Self {
        DnsHandle {
            shared: Arc::new(Shared {
                target,
                resolutions: AtomicU64::new(0),
                failures: AtomicU64::new(0),
                consecutive_failures: AtomicU64::new(0),
                backends: AtomicUsize::new(0),
                last_error: Mutex::new(None),
                refresh: Notify::new(),
                progress: watch::Sender::new((0, false)),
            }),
        }
    }

    pub(crate) fn shared(&self) -> &Shared {
        &self.shared
    }

    /// The target being resolved.
    pub fn target(&self) -> &DnsTarget {
        &self.shared.target
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> DnsStats {
        let s = &self.shared;
        DnsStats {
            resolutions: s.resolutions.load(Ordering::Acquire),
            failures: s.failures.load(Ordering::Relaxed),
            consecutive_failures: s.consecutive_failures.load(Ordering::Relaxed),
            backends: s.backends.load(Ordering::Relaxed),
            last_error: s.last_error.lock().clone(),
        }
    }

    /// Resolutions completed, successful or not.
    pub fn resolutions(&self) -> u64 {
        self.shared.resolutions.load(Ordering::Acquire)
    }

    /// Resolutions that failed.
    pub fn failures(&self) -> u64 {
        self.shared.failures.load(Ordering::Relaxed)
    }

    /// The last failure's error, if any resolution failed.
    pub fn last_error(&self) -> Option<DnsError> {
        self.shared.last_error.lock().clone()
    }

    /// Resolves again now instead of at the next scheduled time. A refresh asked while a
    /// resolution is under way starts another once it ends.
    pub fn refresh(&self) {
        self.shared.refresh.notify_one();
    }

    /// Waits until at least `n` resolutions have completed (successful or not), or the stream
    /// or its resolving task is gone (as when a service or node function panicked).
    /// `resolved(1)` waits for the first, for a proxy that serves only once its fleet is
    /// known. Returns the number completed.
    pub async fn resolved(&self, n: u64) -> u64 {
        let mut rx = self.shared.progress.subscribe();
        let done = match rx.wait_for(|&(done, gone)| done >= n || gone).await {
            Ok(progress) => progress.0,
            Err(_) => self.resolutions(),
        };
        done
    }
}

impl Shared {
    /// Whether the last resolution failed.
    pub(crate) fn failing(&self) -> bool {
        self.consecutive_failures.load(Ordering::Relaxed) > 0
    }

    /// Records a successful resolution that left `backends` in the fleet.
    pub(crate) fn succeeded(&self, backends: usize) {
        self.backends.store(backends, Ordering::Relaxed);
        self.consecutive_failures.store(0, Ordering::Relaxed);
        self.completed();
    }

    /// Records a failed resolution; returns the failures in a row, this one included.
    pub(crate) fn failed(&self, e: DnsError) -> u64 {
        *self.last_error.lock() = Some(e);
        self.failures.fetch_add(1, Ordering::Relaxed);
        let run = self.consecutive_failures.fetch_add(1, Ordering::Relaxed) + 1;
        self.completed();
        run
    }

    fn completed(&self) {
        let n = self.resolutions.fetch_add(1, Ordering::AcqRel) + 1;
        self.progress.send_modify(|p| p.0 = n);
    }

    /// The resolving task is gone: wake every waiter.
    pub(crate) fn closed(&self) {
        self.progress.send_modify(|p| p.1 = true);
    }
}

impl fmt::Debug for DnsHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DnsHandle")
            .field("target", &self.shared.target)
            .field("stats", &self.stats())
            .finish()
    }
}
