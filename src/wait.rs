//! The queue of requests waiting for a slot, and who gets woken when one frees.
//!
//! A freed slot wakes one waiter, not all of them: the oldest whose home is the freed backend,
//! else the oldest whose home is on the freed backend's node, else the oldest. The woken
//! request is placed again in its own preference order; matching the slot to the waiter it
//! suits best keeps sessions on their own backend or node under overload, where a free-for-all
//! would hand the slot to whichever waiter happened to run first.
//!
//! A waiter held back waits for one place only, until its hold runs out: its home node (node
//! patience), or the backend holding its prefix (when waiting for it was estimated cheaper
//! than moving). Slots elsewhere do not wake it meanwhile.
//!
//! A waiter leaves the queue when it is woken. If it does not use the wake (it was dropped, or
//! timed out, or found a slot elsewhere), it passes the wake on to the oldest waiter, so a
//! freed slot is never left with a waiter that could use it asleep.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::Waker;
use std::time::Duration;

use crate::fleet::Capacity;

/// Which slots a request waits for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Scope {
    /// Any slot its placement offers it.
    #[default]
    Any,
    /// A slot on its home node (node patience).
    Node,
    /// A slot on the backend its [`WaitHome::backend`] names: the one holding its prefix.
    Backend,
}

/// Where a waiting request's cache is, by internal index, and what it waits for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct WaitHome {
    pub(crate) backend: Option<u32>,
    pub(crate) node: Option<u32>,
    pub(crate) scope: Scope,
    /// How long the scope holds before any slot will do.
    pub(crate) hold: Duration,
}

impl WaitHome {
    /// Whether a slot freed on `backend` of `node` can serve this waiter.
    fn accepts(&self, backend: u32, node: u32) -> bool {
        match self.scope {
            Scope::Any => true,
            Scope::Node => self.node == Some(node),
            Scope::Backend => self.backend == Some(backend),
        }
    }
}

#[derive(Debug)]
struct Waiter {
    seq: u64,
    home: WaitHome,
    waker: Waker,
}

/// Waiters in arrival order.
#[derive(Debug, Default)]
pub(crate) struct WaitList {
    next_seq: u64,
    queue: VecDeque<Waiter>,
}

impl WaitList {
    fn insert(&mut self, waiter: Waiter) {
        // Keep arrival order when a woken waiter comes back.
        let at = self.queue.partition_point(|w| w.seq < waiter.seq);
        self.queue.insert(at, waiter);
    }

    fn take(&mut self, at: Option<usize>) -> Option<Waker> {
        at.and_then(|i| self.queue.remove(i)).map(|w| w.waker)
    }
}

impl Capacity {
    /// A slot on `backend` (of `node`) has freed: wake the waiter it suits best.
    pub(crate) fn slot_freed(&self, backend: u32, node: u32) {
        if self.waiting.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut list = self.waiters.lock();
        let q = &list.queue;
        let at = q
            .iter()
            .position(|w| w.home.backend == Some(backend))
            .or_else(|| {
                q.iter()
                    .position(|w| w.home.node == Some(node) && w.home.accepts(backend, node))
            })
            .or_else(|| q.iter().position(|w| w.home.accepts(backend, node)));
        let waker = list.take(at);
        drop(list);
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// Wakes the oldest waiter that takes a slot anywhere, to pass on a wake that was not used.
    fn wake_oldest(&self) {
        let mut list = self.waiters.lock();
        let at = list.queue.iter().position(|w| w.home.scope == Scope::Any);
        let waker = list.take(at);
        drop(list);
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// Wakes every waiter: the fleet has changed (a backend came or came back).
    pub(crate) fn wake_all(&self) {
        if self.waiting.load(Ordering::Acquire) == 0 {
            return;
        }
        let woken: Vec<Waiter> = self.waiters.lock().queue.drain(..).collect();
        for w in woken {
            w.waker.wake();
        }
    }
}

/// A request's place in the wait queue, held for as long as it waits, however the wait ends.
#[derive(Debug)]
pub(crate) struct WaitTicket {
    capacity: Arc<Capacity>,
    seq: u64,
    home: WaitHome,
    /// Whether the request's wait has ended in a placement or a refusal; a ticket dropped
    /// before is one its caller gave up on.
    settled: bool,
}

impl WaitTicket {
    /// Joins the queue, or returns `None` if `max_queued` requests wait already.
    ///
    /// The ticket is queued at once, before the caller looks for a slot one last time, so that
    /// a slot freed in between wakes it.
    pub(crate) fn take(
        capacity: &Arc<Capacity>,
        home: WaitHome,
        max_queued: usize,
    ) -> Option<Self> {
        let queued = capacity.waiting.fetch_add(1, Ordering::AcqRel);
        if queued >= max_queued {
            capacity.waiting.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        let mut list = capacity.waiters.lock();
        let seq = list.next_seq;
        list.next_seq += 1;
        // No task yet: the first poll finds the ticket either queued (and registers its
        // waker) or woken (and looks for a slot).
        list.insert(Waiter {
            seq,
            home,
            waker: Waker::noop().clone(),
        });
        drop(list);
        Some(WaitTicket {
            capacity: capacity.clone(),
            seq,
            home,
            settled: false,
        })
    }

    /// Whether the ticket is still queued; if so, `waker` is the one to wake.
    pub(crate) fn still_queued(&self, waker: &Waker) -> bool {
        let mut list = self.capacity.waiters.lock();
        match list.queue.iter_mut().find(|w| w.seq == self.seq) {
            Some(w) => {
                w.waker.clone_from(waker);
                true
            }
            None => false,
        }
    }

    /// The wait has ended in a placement or a refusal: dropping the ticket now is not giving
    /// up on it.
    pub(crate) fn settle(&mut self) {
        self.settled = true;
    }

    /// Stops holding out for one place: from now on a slot anywhere will do.
    pub(crate) fn widen(&mut self) {
        self.home.scope = Scope::Any;
        let mut list = self.capacity.waiters.lock();
        if let Some(w) = list.queue.iter_mut().find(|w| w.seq == self.seq) {
            w.home.scope = Scope::Any;
        }
    }

    /// Which slots the ticket waits for.
    pub(crate) fn scope(&self) -> Scope {
        self.home.scope
    }

    /// Queues the ticket again after a wake, keeping its place in arrival order.
    pub(crate) fn requeue(&self, waker: &Waker) {
        self.capacity.waiters.lock().insert(Waiter {
            seq: self.seq,
            home: self.home,
            waker: waker.clone(),
        });
    }
}

impl Drop for WaitTicket {
    fn drop(&mut self) {
        if !self.settled {
            self.capacity.counters.count_abandoned();
        }
        let mut list = self.capacity.waiters.lock();
        let at = list.queue.iter().position(|w| w.seq == self.seq);
        let was_queued = list.take(at).is_some();
        drop(list);
        self.capacity.waiting.fetch_sub(1, Ordering::AcqRel);
        if !was_queued {
            // Woken but leaving without the slot it was woken for: pass the wake on.
            self.capacity.wake_oldest();
        }
    }
}
