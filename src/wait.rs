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
//! than moving). Slots elsewhere do not wake it meanwhile. What it waits for is set by the look
//! it takes on joining the queue, which may differ from its first (a slot freed in between,
//! that it rules against), and widened to any slot when its hold runs out or a later look
//! finds nothing healthy left there (a backend marked down wakes every waiter to look). A
//! request that joined the queue waiting for any slot (the whole fleet was full) is judged
//! when a slot elsewhere wakes it while the backend holding its prefix is still full, as a
//! first look finding that slot would be, and may hold out from then. A request holds out
//! once, and never at the last look of its wait, which would refuse it instead; nor when the
//! queue has no room for it: one not queued yet is not held out for the backend holding its
//! prefix while the queue is full, and one held out for its home node (or that found the
//! queue filled meanwhile) looks once more for any slot before it is refused.
//!
//! A woken waiter stays in the queue, marked with the slot that woke it, until its task runs
//! and looks for a slot; a freed slot passes over the waiters already woken, and over those
//! that may not take it. Meanwhile the slot is promised to the woken waiter
//! (`Load::reserved`): a request arriving before it runs does not take it, or under sustained
//! load a waiter could be woken again and again for slots that later arrivals took, and be
//! refused at its deadline while they were served. The promise is taken back as the waiter
//! starts to look, so on a runtime of several threads a request arriving during that look
//! (placement: microseconds) can still take the slot; the waiter then passes the wake on, as
//! for any slot it does not take, and goes on waiting. A woken request whose caller neither polls
//! nor drops it keeps the slot promised until it does one or the other: a caller that stops
//! polling a response future should drop it. Waiters woken all at once (the fleet changed, a
//! backend went down) stay in the queue too, each with the slot promised to it if one was: a
//! slot that frees before they run is promised to one of them as any freed slot is, not left
//! to the first request to arrive.
//!
//! A woken waiter that does not take its slot passes it on as the freeing would have, to the
//! waiter it suits best, however that one is held: one dropped before its task ran (its client
//! went away), one that took a slot elsewhere, and one that found none it may take (it
//! declines that slot, which then never comes back to it). So a freed slot is never left
//! with a waiter that could use it asleep, and a slot no waiter takes wakes each at most once.
//! A waiter whose look takes the slot that woke it and gives it back, to hold out for its own
//! backend, gives it back unannounced and passes its wake on: a freeing announced as well
//! would promise one slot twice, and would not know who had declined it.
//!
//! A slot freed on a backend that is down wakes nobody, as nobody may take it. Nor does the
//! end of a request beyond its backend's slots (overcommitted, as a token count is, or in
//! flight as discovery lowered the count): it frees no slot, as the backend is as full as
//! before. The backend going down (a failure, a 503 answer, a probe) wakes every waiter to
//! look once; each then waits with its timer set for the backend's return.
//!
//! Joining the queue and freeing a slot each write one count and then read the other's
//! (`waiting`, a backend's requests in flight), sequentially consistent with a fence on the
//! joining side, so that at least one of them sees the other: either the slot is found free
//! by the waiter's look, or the waiter is found by the slot.

use std::collections::VecDeque;
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;
use std::task::Waker;
use std::time::Duration;

use tokio::time::Instant;

use crate::fleet::{Capacity, Load};

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

/// What a look for a slot knows of the request's wait so far.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Look {
    /// How long it has waited; `None` before it joined the queue.
    pub(crate) waited: Option<Duration>,
    /// What it holds out for.
    pub(crate) scope: Scope,
    /// Whether this look may hold it out for the full backend holding its prefix: not once
    /// it has held out for one place, nor on its last look, which would refuse it instead.
    pub(crate) may_hold: bool,
    /// Its place in the queue once it has one: only the waiters before it are ahead of it.
    pub(crate) queued: Option<u64>,
    /// The backend whose freed slot woke it for this look, if one did: a slot there that it
    /// takes and gives back, holding out, goes back unannounced, as the wake it holds is
    /// passed on.
    pub(crate) woken_for: Option<u32>,
    /// Whether this is the request's first look, where what it brings (a retried refusal)
    /// is counted.
    pub(crate) first: bool,
}

impl Look {
    /// The first look, before the request joins the queue.
    pub(crate) fn first(scope: Scope) -> Self {
        Look {
            waited: None,
            scope,
            may_hold: true,
            queued: None,
            woken_for: None,
            first: true,
        }
    }

    /// The look of a request that held out for one place (its home node, or the full
    /// backend holding its prefix) and found no room in the queue to wait there: any slot
    /// will do, as if it could not wait at all.
    pub(crate) fn no_room_to_wait() -> Self {
        Look {
            scope: Scope::Any,
            may_hold: false,
            first: false,
            ..Look::first(Scope::Any)
        }
    }
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
    pub(crate) fn accepts(&self, backend: u32, node: u32) -> bool {
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
    /// The slot that woke it, promised to it until its task runs.
    woken_for: Option<Slot>,
    /// Whether it was woken with every waiter since its task last looked (the fleet
    /// changed): it looks again, whatever it was promised.
    all: bool,
}

/// A freed slot: its backend's load (where the promise is counted), its backend and node.
#[derive(Clone, Debug)]
pub(crate) struct Slot {
    pub(crate) load: Arc<Load>,
    pub(crate) backend: u32,
    pub(crate) node: u32,
    /// The waiters (by arrival number, in order) that were woken for this slot and declined
    /// it. It is not offered to them again, so a slot that no waiter takes wakes each at most
    /// once.
    declined: Vec<u64>,
}

impl Slot {
    /// Takes back the promise of this slot to a waiter.
    fn unpromise(&self) {
        self.load.reserved.fetch_sub(1, Ordering::AcqRel);
    }

    /// This slot, declined by the waiter `seq` as well.
    fn declined_by(&self, seq: u64) -> Slot {
        let mut slot = self.clone();
        if let Err(at) = slot.declined.binary_search(&seq) {
            slot.declined.insert(at, seq);
        }
        slot
    }
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

    fn find(&mut self, seq: u64) -> Option<&mut Waiter> {
        self.queue.iter_mut().find(|w| w.seq == seq)
    }
}

impl Capacity {
    /// A slot on `backend` (of `node`, `load` its counts) has freed: wake the waiter it
    /// suits best, among those not woken already, and promise it the slot.
    pub(crate) fn slot_freed(&self, load: &Arc<Load>, backend: u32, node: u32) {
        // Read before the slot is built: most slots free with nobody waiting.
        if self.waiting.load(Ordering::SeqCst) == 0 {
            return;
        }
        // Its guard found the backend up.
        self.promise(Slot {
            load: load.clone(),
            backend,
            node,
            declined: Vec::new(),
        });
    }

    /// Passes on a slot a woken waiter did not take, as its freeing would have, to a waiter
    /// that has not declined it: unless its backend is down now, as a slot freed there wakes
    /// nobody (a promise can outlive the backend's going down, which woke every waiter to
    /// look; their timers bring them back when it comes back).
    pub(crate) fn pass_on(&self, slot: Slot) {
        if self.waiting.load(Ordering::SeqCst) == 0 {
            return;
        }
        // Sequentially consistent, as in a slot guard's drop: see there.
        let down_until = slot.load.down_until.load(Ordering::SeqCst);
        if down_until != 0 && self.now_ms(Instant::now()) < down_until {
            return;
        }
        self.promise(slot);
    }

    /// Promises `slot` to the waiter it suits best that has not declined it, and wakes it.
    fn promise(&self, slot: Slot) {
        let mut list = self.waiters.lock();
        let (backend, node) = (slot.backend, slot.node);
        // One pass: the oldest whose cache is on the backend, else the oldest on its node,
        // else the oldest.
        let mut best: Option<(u8, usize)> = None;
        for (i, w) in list.queue.iter().enumerate() {
            let rank = if w.home.backend == Some(backend) {
                0
            } else if w.home.node == Some(node) {
                1
            } else {
                2
            };
            if best.is_some_and(|(r, _)| r <= rank)
                || w.woken_for.is_some()
                || !w.home.accepts(backend, node)
                || slot.declined.binary_search(&w.seq).is_ok()
            {
                continue;
            }
            best = Some((rank, i));
            if rank == 0 {
                break;
            }
        }
        let Some(w) = best.map(|(_, i)| &mut list.queue[i]) else {
            return;
        };
        // Promised before the waiter can run: its task takes the promise back first.
        slot.load.reserved.fetch_add(1, Ordering::AcqRel);
        w.woken_for = Some(slot);
        let waker = w.waker.clone();
        drop(list);
        waker.wake();
    }

    /// How many waiting requests have their cache on `backend`, of those queued before the
    /// one at `before` if it is queued: a slot freed there goes to them before any other.
    pub(crate) fn waiting_for(&self, backend: u32, before: Option<u64>) -> u32 {
        if self.waiting.load(Ordering::Relaxed) == 0 {
            return 0;
        }
        let list = self.waiters.lock();
        let n = list
            .queue
            .iter()
            .take_while(|w| before.is_none_or(|seq| w.seq < seq))
            .filter(|w| w.home.backend == Some(backend))
            .count();
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    /// Wakes every waiter to look again: the fleet has changed (a backend came, came back,
    /// left or went down). Each stays queued, with the slot promised to it if one was, so
    /// that a slot freed before it runs is promised as any freed slot is: to the waiter it
    /// suits best, not to whichever request arrives first.
    pub(crate) fn wake_all(&self) {
        if self.waiting.load(Ordering::SeqCst) == 0 {
            return;
        }
        let mut list = self.waiters.lock();
        let wakers: Vec<Waker> = list
            .queue
            .iter_mut()
            .map(|w| {
                w.all = true;
                w.waker.clone()
            })
            .collect();
        drop(list);
        for waker in wakers {
            waker.wake();
        }
    }
}

/// What woke a waiting request since its task last looked.
#[derive(Debug)]
pub(crate) enum Woken {
    /// Nothing: its deadline, if anything.
    No,
    /// A slot freed (its promise now taken back: the request looks for a slot as any
    /// other does), with every waiter woken too or not. Unless the request takes it, it is
    /// passed on.
    For(Unclaimed),
    /// Every waiter was woken: the fleet changed.
    All,
}

/// A slot a woken waiter has taken the promise of back, to look for a slot: unless the waiter
/// takes it ([`taken`](Self::taken)), it goes on to the waiter it suits best among the others
/// when this is dropped, however the look ended: a slot taken elsewhere, none it may take, or
/// a panic (a policy's, or a backend service's as the request is sent), so that no waiter it
/// serves is left asleep beside it.
#[derive(Debug)]
pub(crate) struct Unclaimed {
    capacity: Arc<Capacity>,
    /// `None` once taken.
    slot: Option<Slot>,
    /// The waiter that declines it, if it does.
    seq: u64,
}

impl Unclaimed {
    /// The backend of the slot.
    pub(crate) fn backend(&self) -> Option<u32> {
        self.slot.as_ref().map(|s| s.backend)
    }

    /// The waiter took the slot: nothing to pass on.
    pub(crate) fn taken(mut self) {
        self.slot = None;
    }
}

impl Drop for Unclaimed {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            // Declined by this waiter, which may still be queued: it goes to another.
            self.capacity.pass_on(slot.declined_by(self.seq));
        }
    }
}

/// A request's place in the wait queue, held for as long as it waits, however the wait ends.
#[derive(Debug)]
pub(crate) struct WaitTicket {
    capacity: Arc<Capacity>,
    seq: u64,
    home: WaitHome,
    /// Whether it has held out for one place (its home node, or the backend holding its
    /// prefix): a request holds out once, and once its hold is over any slot will do.
    held_out: bool,
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
        // Counted only if there is room: a request refused is never counted, even for a
        // moment, or a request arriving then would find the queue fuller than it is.
        capacity
            .waiting
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < max_queued).then_some(n + 1)
            })
            .ok()?;
        // The caller's look for a slot comes after this: see the module's docs.
        fence(Ordering::SeqCst);
        let mut list = capacity.waiters.lock();
        let seq = list.next_seq;
        list.next_seq += 1;
        // No task yet: the first poll finds the ticket either queued (and registers its
        // waker) or woken (and looks for a slot).
        list.insert(Waiter {
            seq,
            home,
            waker: Waker::noop().clone(),
            woken_for: None,
            all: false,
        });
        drop(list);
        Some(WaitTicket {
            capacity: capacity.clone(),
            seq,
            home,
            held_out: home.scope != Scope::Any,
            settled: false,
        })
    }

    /// Whether the ticket has been woken since its task last looked, and by what. Either
    /// way it is queued, with `waker` the one to wake, so that no wake is missed while the
    /// task looks for a slot.
    pub(crate) fn woken(&self, waker: &Waker) -> Woken {
        let mut list = self.capacity.waiters.lock();
        match list.find(self.seq) {
            Some(w) => {
                w.waker.clone_from(waker);
                let all = std::mem::take(&mut w.all);
                match w.woken_for.take() {
                    Some(slot) => {
                        slot.unpromise();
                        Woken::For(Unclaimed {
                            capacity: self.capacity.clone(),
                            slot: Some(slot),
                            seq: self.seq,
                        })
                    }
                    None if all => Woken::All,
                    None => Woken::No,
                }
            }
            // Never so (a ticket is queued from its taking to its drop); were it, it would
            // go back in its place and look.
            None => {
                list.insert(Waiter {
                    seq: self.seq,
                    home: self.home,
                    waker: waker.clone(),
                    woken_for: None,
                    all: false,
                });
                Woken::All
            }
        }
    }

    /// The wait has ended in a placement or a refusal: dropping the ticket now is not giving
    /// up on it.
    pub(crate) fn settle(&mut self) {
        self.settled = true;
    }

    /// Stops holding out for one place: from now on a slot anywhere will do.
    pub(crate) fn widen(&mut self) {
        self.hold_for(WaitHome {
            scope: Scope::Any,
            ..self.home
        });
    }

    /// Waits for `home` from now on: what a later look at the fleet found (its cache moved,
    /// or worth waiting for; nothing healthy left where it held out), or any slot once a hold
    /// is over. With the scope it has, it keeps its hold. A slot promised to the ticket that
    /// `home` does not accept is declined and passed on.
    pub(crate) fn hold_for(&mut self, mut home: WaitHome) {
        if home.scope == self.home.scope {
            home.hold = self.home.hold;
        }
        self.held_out |= home.scope != Scope::Any;
        if home == self.home {
            return;
        }
        self.home = home;
        let mut list = self.capacity.waiters.lock();
        let Some(w) = list.find(self.seq) else {
            return;
        };
        w.home = home;
        let unusable = w
            .woken_for
            .take_if(|slot| !home.accepts(slot.backend, slot.node));
        drop(list);
        if let Some(slot) = unusable {
            slot.unpromise();
            self.capacity.pass_on(slot.declined_by(self.seq));
        }
    }

    /// What the ticket waits for.
    pub(crate) fn home(&self) -> WaitHome {
        self.home
    }

    /// Which slots the ticket waits for.
    pub(crate) fn scope(&self) -> Scope {
        self.home.scope
    }

    /// The look its request takes now, having waited `waited` (`None`: it has only joined
    /// the queue); `last` when its wait is over whatever the look finds.
    pub(crate) fn look(&self, waited: Option<Duration>, last: bool) -> Look {
        Look {
            waited,
            scope: self.home.scope,
            may_hold: !last && !self.held_out,
            queued: Some(self.seq),
            woken_for: None,
            first: false,
        }
    }
}

impl Drop for WaitTicket {
    fn drop(&mut self) {
        if !self.settled {
            self.capacity.counters.count_abandoned();
        }
        let mut list = self.capacity.waiters.lock();
        let at = list.queue.iter().position(|w| w.seq == self.seq);
        let unused = at
            .and_then(|i| list.queue.remove(i))
            .and_then(|w| w.woken_for);
        drop(list);
        self.capacity.waiting.fetch_sub(1, Ordering::AcqRel);
        if let Some(slot) = unused {
            // Woken, and leaving before it looked: the slot goes to whom it suits next.
            slot.unpromise();
            self.capacity.pass_on(slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use std::num::NonZeroU32;
    use std::task::{Wake, Waker};

    use super::{Scope, WaitHome, WaitTicket, Woken};
    use crate::fleet::{Capacity, SlotGuard, Topology};

    /// A waker that records that it was woken.
    #[derive(Default)]
    struct Flag(AtomicBool);

    impl Wake for Flag {
        fn wake(self: Arc<Self>) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    impl Flag {
        /// Whether it was woken since last asked.
        fn woken(&self) -> bool {
            self.0.swap(false, Ordering::SeqCst)
        }
    }

    /// Requests joining a full queue are refused without ever being counted as waiting: the
    /// count never reads more than `max_queued`, not even while a refused request is being
    /// turned away. (Counted for that moment, it would hide from a request arriving just
    /// after a waiter left the room that waiter left, and have it refused too.)
    #[test]
    fn a_refused_request_is_never_counted_waiting() {
        const MAX_QUEUED: usize = 2;
        let capacity = Arc::new(Capacity::default());
        let stop = Arc::new(AtomicBool::new(false));
        let until = Instant::now() + Duration::from_secs(1);
        // Two requests keep the queue full; two more keep arriving, refused.
        let threads: Vec<_> = (0..4)
            .map(|i| {
                let (capacity, stop) = (capacity.clone(), stop.clone());
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) && Instant::now() < until {
                        let ticket = WaitTicket::take(&capacity, WaitHome::default(), MAX_QUEUED);
                        if i < 2 {
                            for _ in 0..1_000 {
                                std::hint::spin_loop();
                            }
                        }
                        drop(ticket);
                    }
                })
            })
            .collect();
        let mut most = 0;
        while !threads.iter().all(|t| t.is_finished()) {
            most = most.max(capacity.waiting.load(Ordering::SeqCst));
            if most > MAX_QUEUED {
                stop.store(true, Ordering::Relaxed);
            }
        }
        for t in threads {
            t.join().unwrap();
        }
        assert!(
            most <= MAX_QUEUED,
            "{most} counted waiting; at most {MAX_QUEUED} may wait"
        );
        assert_eq!(capacity.waiting.load(Ordering::SeqCst), 0);
    }

    /// A request holds out once: a ticket that joined the queue holding out (for its node, or
    /// for the backend holding its prefix), or that was held out by a later look, is never
    /// held again; one waiting for any slot may be, except at the last look of its wait.
    #[test]
    fn a_ticket_holds_out_once() {
        let capacity = Arc::new(Capacity::default());
        let home = |scope| WaitHome {
            backend: Some(0),
            node: Some(0),
            scope,
            hold: Duration::from_secs(5),
        };
        let may_hold = |t: &WaitTicket, last| t.look(Some(Duration::ZERO), last).may_hold;
        for scope in [Scope::Node, Scope::Backend] {
            let held = WaitTicket::take(&capacity, home(scope), 8).unwrap();
            assert!(!may_hold(&held, false), "joined holding out for {scope:?}");
        }
        let mut any = WaitTicket::take(&capacity, home(Scope::Any), 8).unwrap();
        assert!(may_hold(&any, false));
        assert!(!may_hold(&any, true), "its last look");
        any.hold_for(home(Scope::Backend));
        any.widen();
        assert_eq!(any.scope(), Scope::Any);
        assert!(
            !may_hold(&any, false),
            "held out by a later look, its hold over"
        );
    }

    /// The requests waiting for a backend are those whose cache is on it, whatever they wait
    /// for: a slot freed there goes to them first, so they are ahead of a request that would
    /// wait for it too.
    #[test]
    fn the_requests_waiting_for_a_backend_are_those_whose_cache_is_on_it() {
        let capacity = Arc::new(Capacity::default());
        assert_eq!(capacity.waiting_for(0, None), 0);
        let on = |backend: Option<u32>, scope| WaitHome {
            backend,
            node: Some(0),
            scope,
            hold: Duration::ZERO,
        };
        let tickets: Vec<_> = [
            on(Some(0), Scope::Any),
            on(Some(0), Scope::Backend),
            on(Some(1), Scope::Node),
            on(None, Scope::Any),
        ]
        .into_iter()
        .map(|home| WaitTicket::take(&capacity, home, 8).unwrap())
        .collect();
        assert_eq!(
            [0, 1, 2].map(|b| capacity.waiting_for(b, None)),
            [2, 1, 0],
            "by backend"
        );
        // A waiter's own look counts those queued before it only.
        let ahead = |t: &WaitTicket, b| capacity.waiting_for(b, t.look(None, false).queued);
        assert_eq!(ahead(&tickets[0], 0), 0, "the first");
        assert_eq!(ahead(&tickets[1], 0), 1, "the second");
        assert_eq!(ahead(&tickets[3], 0), 2, "the last, whose cache is nowhere");
        drop(tickets);
        assert_eq!(capacity.waiting_for(0, None), 0);
    }

    /// A later look that waits for the same kind of place keeps the hold the ticket has: the
    /// hold runs from when the request first held out, not from each look.
    #[test]
    fn a_later_look_of_the_same_scope_keeps_the_hold() {
        let capacity = Arc::new(Capacity::default());
        let home = |scope, secs| WaitHome {
            backend: Some(0),
            node: Some(0),
            scope,
            hold: Duration::from_secs(secs),
        };
        let mut ticket = WaitTicket::take(&capacity, home(Scope::Backend, 5), 8).unwrap();
        ticket.hold_for(home(Scope::Backend, 9));
        assert_eq!(ticket.home().hold, Duration::from_secs(5));
        ticket.hold_for(home(Scope::Node, 9));
        assert_eq!(
            ticket.home(),
            home(Scope::Node, 9),
            "another scope, its own hold"
        );
    }

    /// A ticket that a look holds for one backend gives up at once a slot promised to it
    /// elsewhere, to a waiter that takes it. The path: woken with every waiter (no slot
    /// promised), its look takes the free slot on another backend and gives it back to wait
    /// for the backend holding its prefix; that slot, freed anew, is promised to the ticket
    /// itself, the oldest waiter for any slot, just before it holds out.
    #[test]
    fn a_held_ticket_passes_on_a_slot_promised_to_it_on_a_backend_it_does_not_wait_for() {
        let mut t = Topology::default();
        let one = NonZeroU32::MIN;
        let x = t.insert("x".into(), &"nx".into(), one, None, 1000);
        let y = t.insert("y".into(), &"ny".into(), one, None, 1000);
        let capacity = t.capacity.clone();
        let load_y = t.member(y).load.clone();
        let home = |scope| WaitHome {
            backend: Some(x),
            node: Some(t.member(x).node),
            scope,
            hold: Duration::from_secs(5),
        };
        let mut ticket = WaitTicket::take(&capacity, home(Scope::Any), 8).unwrap();
        let other = WaitTicket::take(&capacity, WaitHome::default(), 8).unwrap();
        let (mine, its) = (Arc::new(Flag::default()), Arc::new(Flag::default()));
        let (my_waker, its_waker) = (Waker::from(mine.clone()), Waker::from(its.clone()));
        assert!(matches!(ticket.woken(&my_waker), Woken::No));
        assert!(matches!(other.woken(&its_waker), Woken::No));
        // The fleet changed: every waiter looks. The ticket's task runs first.
        capacity.wake_all();
        assert!(its.woken());
        assert!(matches!(ticket.woken(&my_waker), Woken::All));
        // Its look takes the slot on Y and gives it back, to wait for X.
        assert!(load_y.try_acquire());
        drop(SlotGuard::new(&load_y, y, 1));
        assert!(mine.woken(), "Y promised to the ticket");
        assert!(!its.woken());
        ticket.hold_for(home(Scope::Backend));
        assert!(
            its.woken(),
            "the other waiter is woken for Y before the ticket looks again"
        );
        match other.woken(&its_waker) {
            Woken::For(slot) => assert_eq!(slot.backend(), Some(y)),
            woken => panic!("the other waiter was woken by {woken:?}, not for Y"),
        }
        assert!(matches!(ticket.woken(&my_waker), Woken::No));
    }
}
