//! The service's side of a shared store: the read deadline, the writes in their own tasks, the
//! store's up/down state and its counters.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use parking_lot::Mutex;
use tokio::runtime::Handle;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use super::{HomeStore, Lookup, StoredHome};
use crate::chain::tip_of;
use crate::key::SessionKey;
use crate::service::Shared;
use crate::stats::{bump, Decision, Outcome};
use crate::table::{HomeEntry, SessionStore};
use crate::{BackendId, PromptChain};

/// How long a write may take before it counts as failed.
const WRITE_TIMEOUT: Duration = Duration::from_secs(1);

/// The most writes in flight at once; more are dropped (a store that slows down or goes away
/// must not make the router hold an unbounded number of tasks). A write made while the store
/// is down is still sent: it lands if the store comes back within the write's second.
const MAX_WRITES_IN_FLIGHT: usize = 1024;

/// The most failed writes kept to be written again when the store comes back.
const MAX_FAILED: usize = 4096;

/// What [`Homes::check`] reads: the digest of these bytes is the key of no session a client
/// sends (two keys alike in 96 bits are one in 2^96).
const CHECK_KEY: &[u8] = b"tower-affinity: a check of the shared store";

/// Whether the service can reach its shared store, as its reads last found it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StoreState {
    /// The last read answered in time (or none has been made yet: see
    /// [`SessionAffinity::check_store`](crate::SessionAffinity::check_store)).
    Up,
    /// The last read failed or timed out: requests use the local table at once, and one read
    /// at a time, which no request waits for, probes the store ([`check_store`]'s reads go
    /// beside it).
    ///
    /// [`check_store`]: crate::SessionAffinity::check_store
    Down,
}

/// A snapshot of a shared store's counters and state, from
/// [`SessionAffinity::store_stats`](crate::SessionAffinity::store_stats). Counters only grow.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoreStats {
    /// Reads sent to the store, [`check_store`](crate::SessionAffinity::check_store)'s too.
    /// The outcomes below may add up to fewer: a read whose request was dropped before it was
    /// answered, and a home that the probe read of an outage found (no request waits for
    /// it, so it is not looked up in the fleet), count here only.
    pub reads: u64,
    /// Reads that found a home naming a live backend, in time.
    pub hits: u64,
    /// Reads that found no home, in time.
    pub misses: u64,
    /// Reads still unanswered at the deadline: a request's (the local table answered it), a
    /// check's, or, while the store is down, the probe's, which no request waits for (those
    /// requests are counted in `skipped`).
    pub timeouts: u64,
    /// Reads that failed: a request's (the local table answered), a check's, or, while the
    /// store is down, the probe's.
    pub errors: u64,
    /// Reads that found something that is not a home (another format, another key type);
    /// ignored. A keyless request's read, of several links, counts once by what it found:
    /// here if no link held a home and one held something else.
    pub garbage: u64,
    /// Homes found on a backend this replica does not know: one removed from the fleet (a
    /// scale-down, a backend renamed), or not yet discovered here. Ignored, as no home: a
    /// fleet that changes counts some, and nothing is wrong with the store. A keyless
    /// request's read counts here once if every home it found is on such a backend.
    pub unknown_backends: u64,
    /// Requests that did not wait for the store because it was down (one of them at a time
    /// sends a probe read, counted in `reads`, that no request waits for).
    pub skipped: u64,
    /// Writes sent to the store.
    pub writes: u64,
    /// Writes that failed or took longer than a second.
    pub write_errors: u64,
    /// Writes not sent: too many writes were in flight (or no Tokio runtime to run them).
    pub writes_dropped: u64,
    /// Times the store went from up to down.
    pub outages: u64,
    /// Times it came back up.
    pub recoveries: u64,
    /// Of the reads, those of keyless requests, by the digests of their prompts.
    pub prompt_reads: u64,
    /// Of the hits, those of keyless requests: a backend that served the conversation's
    /// latest turn, which the cache model then knows to hold the prompt up to there.
    pub prompt_hits: u64,
    /// Of the prompt hits, those that found the backend this replica itself wrote for that
    /// prompt: the conversation's latest turn came through this replica, whose own cache
    /// model, not the store's answer, then says what that backend still holds.
    pub prompt_own: u64,
    /// Of the writes, those of keyless requests' prompts.
    pub prompt_writes: u64,
    /// Gauge: the store's state now.
    pub state: StoreState,
}

impl StoreStats {
    /// The counters, each with its field's name and a line of help, in the order of the
    /// fields: for an exporter of your own. (With the `metrics` feature,
    /// [`publish_metrics`](crate::SessionAffinity::publish_metrics) publishes each as
    /// `tower_affinity_store_<name>_total`.)
    ///
    /// ```
    /// # fn doc(stats: tower_affinity::store::StoreStats) {
    /// for (name, help, value) in stats.counters() {
    ///     println!("# HELP tower_affinity_store_{name}_total {help}");
    ///     println!("tower_affinity_store_{name}_total {value}");
    /// }
    /// # }
    /// ```
    pub fn counters(&self) -> impl Iterator<Item = (&'static str, &'static str, u64)> {
        [
            ("reads", "Reads sent to the store", self.reads),
            (
                "hits",
                "Reads that found a home on a live backend in time",
                self.hits,
            ),
            ("misses", "Reads that found no home in time", self.misses),
            (
                "timeouts",
                "Reads unanswered at the deadline",
                self.timeouts,
            ),
            ("errors", "Reads that failed", self.errors),
            ("garbage", "Values that are not a home", self.garbage),
            (
                "unknown_backends",
                "Homes found on a backend this replica does not know (removed, or not yet discovered)",
                self.unknown_backends,
            ),
            (
                "skipped",
                "Requests that did not wait for the store because it was down",
                self.skipped,
            ),
            ("writes", "Writes sent to the store", self.writes),
            (
                "write_errors",
                "Writes that failed or took longer than a second",
                self.write_errors,
            ),
            (
                "writes_dropped",
                "Writes not sent: too many in flight",
                self.writes_dropped,
            ),
            (
                "outages",
                "Times the store went from up to down",
                self.outages,
            ),
            ("recoveries", "Times it came back up", self.recoveries),
            (
                "prompt_reads",
                "Of the reads, those of keyless requests",
                self.prompt_reads,
            ),
            (
                "prompt_hits",
                "Of the hits, those of keyless requests",
                self.prompt_hits,
            ),
            (
                "prompt_own",
                "Of the prompt hits, homes this replica wrote itself",
                self.prompt_own,
            ),
            (
                "prompt_writes",
                "Of the writes, those of keyless requests",
                self.prompt_writes,
            ),
        ]
        .into_iter()
    }
}

#[derive(Debug, Default)]
struct Counters {
    reads: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    timeouts: AtomicU64,
    errors: AtomicU64,
    garbage: AtomicU64,
    unknown_backends: AtomicU64,
    skipped: AtomicU64,
    writes: AtomicU64,
    write_errors: AtomicU64,
    writes_dropped: AtomicU64,
    outages: AtomicU64,
    recoveries: AtomicU64,
    prompt_reads: AtomicU64,
    prompt_hits: AtomicU64,
    prompt_own: AtomicU64,
    prompt_writes: AtomicU64,
}

/// Homes whose last write failed, and when the store last went down.
#[derive(Debug, Default)]
struct Failed {
    /// The latest home of each session whose write failed, when it failed, and the number
    /// of that write: a write sent before it that lands later does not make it needless.
    homes: HashMap<SessionKey, (StoredHome, Instant, u64)>,
    down_since: Option<Instant>,
    /// The number of the newest write of each session with a write in flight (as many
    /// entries as writes in flight at most): a write that fails after a newer one of its
    /// session was sent is not kept, whether that one lands or fails (and is kept) later.
    newest: HashMap<SessionKey, u64>,
    /// Writes sent so far, which numbers them.
    sent: u64,
    /// Times the store came back up: a write sent before a recovery that fails after it
    /// failed with the outage.
    recovered: u64,
}

/// Whether a write is a placement's own, or one sent again after an outage.
#[derive(Clone, Copy, Debug)]
enum Attempt {
    /// Written over whatever the store holds: the last write wins.
    First,
    /// Written only over a home placed before it ([`HomeStore::rewrite`]).
    Again,
}

/// A shared store as the service uses it.
#[derive(Debug)]
pub(crate) struct Homes {
    store: Arc<dyn HomeStore>,
    deadline: Duration,
    /// How long the store keeps a home without a read: the session table's idle timeout.
    ttl: Duration,
    up: AtomicBool,
    /// Whether a read is probing a store that is down.
    probing: AtomicBool,
    /// Places among the writes in flight, [`MAX_WRITES_IN_FLIGHT`] of them; a write holds
    /// one until it ends.
    room: Arc<Semaphore>,
    /// Homes whose last write failed, the latest for each session: written again when the
    /// store answers again.
    failed: Mutex<Failed>,
    /// Whether writes were logged as failing while the store answered reads, and none has
    /// landed since: each change is logged once.
    writes_failing: AtomicBool,
    /// The keyless prompts' tips this replica wrote, with the backend it wrote for each.
    written: Mutex<Written>,
    counters: Counters,
}

/// The tips of keyless prompts a replica wrote to the store, and the backend it wrote for
/// each: a read that finds one of them as this replica wrote it knows that this replica
/// served the conversation's latest turn itself, so its own cache model already knows what
/// that backend holds (see "Keyless conversations" in the [module docs](super)).
///
/// Bounded: two generations of at most `half` tips each; when the newer fills, the older
/// is dropped and the newer takes its place. A tip is needed only until its conversation's
/// next turn, so only long-idle conversations lose theirs, and those are read as another
/// replica's (the store's answer is then taken as it is).
#[derive(Debug)]
struct Written {
    newer: HashMap<u64, BackendId>,
    older: HashMap<u64, BackendId>,
    half: usize,
}

impl Written {
    /// At most `bound` tips (and at least 2).
    fn new(bound: usize) -> Self {
        Written {
            newer: HashMap::new(),
            older: HashMap::new(),
            half: (bound / 2).max(1),
        }
    }

    fn insert(&mut self, tip: u64, backend: BackendId) {
        if self.newer.len() >= self.half && !self.newer.contains_key(&tip) {
            self.older = std::mem::take(&mut self.newer);
        }
        self.newer.insert(tip, backend);
    }

    /// Whether this replica wrote `tip` with `backend`, as the latest it wrote for that tip.
    fn wrote(&self, tip: u64, backend: &BackendId) -> bool {
        self.newer
            .get(&tip)
            .or_else(|| self.older.get(&tip))
            .is_some_and(|b| b == backend)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.newer.len() + self.older.len()
    }
}

/// What the store said about a request's session, carried in the request's extensions from
/// the read to the placement (which may come later, after a wait for a slot). Absent when the
/// store did not answer in time.
#[derive(Clone, Debug)]
pub(crate) enum StoreAnswer {
    /// A home on this live backend, and whether the store has it as it should stay: its tip
    /// is where the request's own prompt ends (or the request has none), so that writing the
    /// same home again would add nothing.
    Home(BackendId, bool),
    /// No home this replica can use: none, or garbage.
    Nothing,
}

/// The most links of a keyless request's prompt whose homes are read: its tip and the links
/// before it. Enough for the previous turn's tip to be among them when a turn adds an answer
/// and a tool's output of a few blocks.
pub(crate) const PROMPT_LINKS: usize = 8;

/// What a read found, once its deadline is over.
pub(crate) enum Read {
    Found(StoredHome),
    /// A keyless request's prompt: the homes found for its links, by position in the chain,
    /// the longest first.
    Prompt(Vec<(usize, StoredHome)>),
    Nothing,
    /// No answer in time, or a failed read.
    Silent,
}

/// The read future the response future drives before placing.
pub(crate) type PendingRead = Pin<Box<dyn Future<Output = Read> + Send + 'static>>;

/// Clears the probing flag when the probe ends, answered or dropped.
struct Probe(Option<Arc<Homes>>);

impl Drop for Probe {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            h.probing.store(false, Ordering::Release);
        }
    }
}

impl Homes {
    /// `sessions` bounds the keyless prompts' tips remembered as written by this replica.
    pub(crate) fn new(
        store: Arc<dyn HomeStore>,
        deadline: Duration,
        ttl: Duration,
        sessions: usize,
    ) -> Self {
        Homes {
            store,
            deadline,
            ttl,
            up: AtomicBool::new(true),
            probing: AtomicBool::new(false),
            room: Arc::new(Semaphore::new(MAX_WRITES_IN_FLIGHT)),
            failed: Mutex::default(),
            writes_failing: AtomicBool::new(false),
            // Two tips a keyless turn (its tip and its last link).
            written: Mutex::new(Written::new(sessions.saturating_mul(2))),
            counters: Counters::default(),
        }
    }

    pub(crate) fn stats(&self) -> StoreStats {
        let c = &self.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        // The state and its changes' counts as of one moment: changed together, under this
        // lock (see `mark`), so that a snapshot never shows an outage without its count, or a
        // recovery counted before the outage it ends.
        let failed = self.failed.lock();
        let (outages, recoveries, up) = (
            l(&c.outages),
            l(&c.recoveries),
            self.up.load(Ordering::Relaxed),
        );
        drop(failed);
        StoreStats {
            reads: l(&c.reads),
            hits: l(&c.hits),
            misses: l(&c.misses),
            timeouts: l(&c.timeouts),
            errors: l(&c.errors),
            garbage: l(&c.garbage),
            unknown_backends: l(&c.unknown_backends),
            skipped: l(&c.skipped),
            writes: l(&c.writes),
            write_errors: l(&c.write_errors),
            writes_dropped: l(&c.writes_dropped),
            outages,
            recoveries,
            prompt_reads: l(&c.prompt_reads),
            prompt_hits: l(&c.prompt_hits),
            prompt_own: l(&c.prompt_own),
            prompt_writes: l(&c.prompt_writes),
            state: if up { StoreState::Up } else { StoreState::Down },
        }
    }

    /// Records the store's state as a read found it: a change is logged once and counted.
    /// Changes are made and counted under the failed homes' lock, so that a recovery never
    /// runs between an outage's start and its time being noted, and a snapshot of the state
    /// ([`stats`](Self::stats)) agrees with the counts of its changes.
    fn mark(self: &Arc<Self>, up: bool, why: &dyn std::fmt::Display) {
        if self.up.load(Ordering::Acquire) == up {
            return;
        }
        let mut failed = self.failed.lock();
        if self.up.swap(up, Ordering::AcqRel) == up {
            return;
        }
        if up {
            bump(&self.counters.recoveries);
            failed.recovered += 1;
            let since = failed.down_since.take();
            // Homes that moved while it could not be written to, so that it does not send
            // their sessions back to where they were before. Only those that failed with the
            // outage (or as it began): one that failed while the store answered reads
            // (refusing writes, say) may have been written over by another replica since.
            failed
                .homes
                .retain(|_, (_, at, _)| since.is_none_or(|s| *at + WRITE_TIMEOUT >= s));
            let keys: Vec<SessionKey> = failed.homes.keys().copied().collect();
            drop(failed);
            tracing::info!(
                store = ?self.store,
                rewrites = keys.len(),
                "shared session store answers again; reading homes from it"
            );
            self.rewrite(keys);
        } else {
            failed.down_since = Some(Instant::now());
            bump(&self.counters.outages);
            drop(failed);
            tracing::warn!(
                store = ?self.store,
                error = %why,
                deadline = ?self.deadline,
                "shared session store unavailable; placing by the local session table"
            );
        }
    }

    /// Starts reading `key`'s home, bounded by the deadline. `None` while the store is down:
    /// the request goes on with the local table at once, and this read, if no other is
    /// probing the store already, goes on in a task of its own as the probe that finds the
    /// store up again.
    pub(crate) fn read(self: &Arc<Self>, key: SessionKey) -> Option<PendingRead> {
        self.begin(|this, probe| {
            let read = this.store.read(key, this.ttl);
            this.bounded(read, probe, |c, found| match found {
                // Counted as a hit or an unknown backend once resolved against the fleet.
                Lookup::Home(home) => Read::Found(home),
                Lookup::Missing => {
                    bump(&c.misses);
                    Read::Nothing
                }
                Lookup::Garbage => {
                    bump(&c.garbage);
                    Read::Nothing
                }
            })
        })
    }

    /// Starts reading the homes of a keyless request's prompt: of its tip and the links
    /// before it, up to [`PROMPT_LINKS`], in one read, bounded by the deadline as a
    /// session's read is (and `None` in the same cases). A link found names the backend
    /// that served a prompt this one continues: the conversation's latest turn.
    pub(crate) fn read_prompt(self: &Arc<Self>, chain: &PromptChain) -> Option<PendingRead> {
        let tip = chain.tip_position()?;
        let positions: Vec<usize> = (0..=tip).rev().take(PROMPT_LINKS).collect();
        let digests: Vec<u64> = positions.iter().map(|&i| chain.links()[i].digest).collect();
        self.begin(move |this, probe| {
            bump(&this.counters.prompt_reads);
            let read = this.store.read_prompts(&digests, this.ttl);
            this.bounded(read, probe, move |c, found: Vec<Lookup>| {
                // One read, counted once: as a hit or an unknown backend once resolved
                // against the fleet if it found a home, else as garbage if a link held some,
                // else as a miss.
                let mut homes = Vec::new();
                let mut garbage = false;
                for (&at, lookup) in positions.iter().zip(found) {
                    match lookup {
                        Lookup::Home(home) => homes.push((at, home)),
                        Lookup::Missing => {}
                        Lookup::Garbage => garbage = true,
                    }
                }
                if homes.is_empty() {
                    bump(if garbage { &c.garbage } else { &c.misses });
                    return Read::Nothing;
                }
                Read::Prompt(homes)
            })
        })
    }

    /// Reads the store once, as a request would, and records what that found as the store's
    /// state: so that a balancer without traffic knows it, and an outage is found before a
    /// request pays the deadline for it. It reads a key no session has (the digest of
    /// [`CHECK_KEY`]), counted as a read, not as a miss.
    pub(crate) fn check(self: &Arc<Self>) -> impl Future<Output = StoreState> + Send + 'static {
        let read = self.store.read(SessionKey::from_bytes(CHECK_KEY), self.ttl);
        let read = self.bounded(read, Probe(None), |_, _| Read::Nothing);
        let this = self.clone();
        async move {
            read.await;
            this.stats().state
        }
    }

    /// A read while the store is up; while it is down, the read as a probe in a task of its
    /// own (if none is probing yet), and `None`.
    fn begin(
        self: &Arc<Self>,
        start: impl FnOnce(&Arc<Self>, Probe) -> PendingRead,
    ) -> Option<PendingRead> {
        if self.up.load(Ordering::Acquire) {
            return Some(start(self, Probe(None)));
        }
        bump(&self.counters.skipped);
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return None;
        };
        if !self.probing.swap(true, Ordering::AcqRel) {
            let probe = start(self, Probe(Some(self.clone())));
            runtime.spawn(probe);
        }
        None
    }

    /// `read` within the deadline: an answer marks the store up and is taken by `found`; an
    /// error or no answer in time marks it down.
    fn bounded<T, F>(
        self: &Arc<Self>,
        read: Pin<Box<dyn Future<Output = Result<T, crate::BoxError>> + Send + 'static>>,
        probe: Probe,
        found: F,
    ) -> PendingRead
    where
        T: Send + 'static,
        F: FnOnce(&Counters, T) -> Read + Send + 'static,
    {
        bump(&self.counters.reads);
        let this = self.clone();
        Box::pin(async move {
            let _probe = probe;
            let c = &this.counters;
            match tokio::time::timeout(this.deadline, read).await {
                Ok(Ok(answer)) => {
                    this.mark(true, &"answered");
                    found(c, answer)
                }
                Ok(Err(e)) => {
                    bump(&c.errors);
                    this.mark(false, &e);
                    Read::Silent
                }
                Err(_) => {
                    bump(&c.timeouts);
                    this.mark(false, &"no answer within the deadline");
                    Read::Silent
                }
            }
        })
    }

    /// After a placement: writes the session's new home unless the store already holds it.
    /// `answer` is what the store said, if it answered in time; without an answer, the home is
    /// written only if the placement moved the session.
    ///
    /// The home carries `tip`, the digest where the request's prompt ended (if it has one);
    /// a home the store holds already is written again with this turn's tip, so that another
    /// replica serving the session next can tell that a later turn than its own went home
    /// (see [`adopt`](Shared::adopt)), and after a compaction finds a tip in its prompt.
    pub(crate) fn placed(
        self: &Arc<Self>,
        key: SessionKey,
        answer: Option<&StoreAnswer>,
        decision: &Decision,
        tip: Option<u64>,
    ) {
        let write = match answer {
            Some(StoreAnswer::Home(b, current)) => *b != decision.backend || !current,
            Some(StoreAnswer::Nothing) => true,
            None => decision.outcome != Outcome::HomeHit,
        };
        if write {
            let home = StoredHome {
                backend: decision.backend.clone(),
                node: decision.node.clone(),
                tip,
                placed: None,
            }
            .with_placed(SystemTime::now());
            self.write(key, home);
        }
    }

    /// After a keyless request with a prompt is placed: its backend as the home of the
    /// prompt's tip, so that the conversation's next turn, which contains it, finds where it
    /// was served, whichever replica it enters.
    ///
    /// Written at the tip (the next-to-last link, which the next turn contains even when it
    /// rewrites a partial last block) and at the last link too: a first turn's tip is often
    /// the system prompt every conversation opens with, whose key each overwrites, while its
    /// last link (the first message) is its own, and the next turn contains it.
    pub(crate) fn placed_prompt(self: &Arc<Self>, chain: &PromptChain, decision: &Decision) {
        let Some(tip) = chain.tip_position() else {
            return;
        };
        let links = chain.links();
        let last = links.len() - 1;
        let home = StoredHome::new(decision.backend.clone(), decision.node.clone())
            .with_placed(SystemTime::now());
        if let Some((runtime, room)) = self.admit_write() {
            let mut written = self.written.lock();
            for at in [tip, last] {
                written.insert(links[at].digest, decision.backend.clone());
            }
            drop(written);
            let last_write = (last != tip).then(|| {
                self.store
                    .write_prompt(links[last].digest, home.clone(), self.ttl)
            });
            let tip_write = self.store.write_prompt(links[tip].digest, home, self.ttl);
            bump(&self.counters.prompt_writes);
            let this = self.clone();
            // Not written again after an outage, as a session's home is: the conversation's
            // next turn writes a tip of its own.
            runtime.spawn(async move {
                let _room = room;
                let both = async {
                    tip_write.await?;
                    match last_write {
                        Some(w) => w.await,
                        None => Ok(()),
                    }
                };
                let error = match tokio::time::timeout(WRITE_TIMEOUT, both).await {
                    Ok(Ok(())) => None,
                    Ok(Err(e)) => Some(e.to_string()),
                    Err(_) => Some(format!("no answer within {WRITE_TIMEOUT:?}")),
                };
                if error.is_some() {
                    bump(&this.counters.write_errors);
                }
                this.wrote(error);
            });
        }
    }

    /// A write ended, failing with `error` or not. Writes failing while reads succeed (a
    /// store out of memory refuses writes and answers reads) mark no outage, so the change is
    /// logged here, once each way: the homes placed meanwhile are not shared. A write that
    /// fails while the store is down is its outage's, which is logged as such: it is not
    /// logged here, nor is the first write that lands after it.
    fn wrote(&self, error: Option<String>) {
        match error {
            // The store is down: its outage was logged, and its recovery will be.
            Some(_) if !self.up.load(Ordering::Acquire) => {}
            Some(error) => {
                if !self.writes_failing.swap(true, Ordering::AcqRel) {
                    tracing::warn!(
                        store = ?self.store,
                        %error,
                        "writes to the shared session store fail (its reads last answered); homes placed now are not shared"
                    );
                }
            }
            None => {
                if self.writes_failing.swap(false, Ordering::AcqRel) {
                    tracing::info!(store = ?self.store, "shared session store takes writes again");
                }
            }
        }
    }

    /// A place among the writes in flight, and the runtime to run one on; `None` (counted as
    /// dropped) if there is neither.
    fn admit_write(&self) -> Option<(Handle, OwnedSemaphorePermit)> {
        let c = &self.counters;
        let Ok(runtime) = Handle::try_current() else {
            bump(&c.writes_dropped);
            return None;
        };
        let Ok(room) = self.room.clone().try_acquire_owned() else {
            bump(&c.writes_dropped);
            return None;
        };
        bump(&c.writes);
        Some((runtime, room))
    }

    fn write(self: &Arc<Self>, key: SessionKey, home: StoredHome) {
        if let Some((runtime, room)) = self.admit_write() {
            self.send(&runtime, room, key, home, Attempt::First);
        }
    }

    /// Writes again, in a task of their own, the homes of `keys` that failed: each as a
    /// place among the writes in flight frees (there may be more of them than places), and
    /// as it is by then (a newer write of the session may have replaced or written it).
    fn rewrite(self: &Arc<Self>, keys: Vec<SessionKey>) {
        if keys.is_empty() {
            return;
        }
        let Ok(runtime) = Handle::try_current() else {
            return;
        };
        let this = self.clone();
        runtime.clone().spawn(async move {
            for key in keys {
                let Ok(room) = this.room.clone().acquire_owned().await else {
                    return;
                };
                let mut failed = this.failed.lock();
                let Some((home, _, _)) = failed.homes.remove(&key) else {
                    continue;
                };
                // A newer home of the session is being written (held up, say, while the
                // store reconnected): sent now, this one would be numbered after it and
                // could land after it. That one is kept in its place if it fails.
                if failed.newest.contains_key(&key) {
                    continue;
                }
                drop(failed);
                bump(&this.counters.writes);
                this.send(&runtime, room, key, home, Attempt::Again);
            }
        });
    }

    /// Sends a write admitted to `room`, in a task of its own.
    fn send(
        self: &Arc<Self>,
        runtime: &Handle,
        room: OwnedSemaphorePermit,
        key: SessionKey,
        home: StoredHome,
        attempt: Attempt,
    ) {
        let write = match attempt {
            Attempt::First => self.store.write(key, home.clone(), self.ttl),
            Attempt::Again => self.store.rewrite(key, home.clone(), self.ttl),
        };
        let mut failed = self.failed.lock();
        failed.sent += 1;
        let number = failed.sent;
        failed.newest.insert(key, number);
        let recovered = failed.recovered;
        drop(failed);
        let this = self.clone();
        runtime.spawn(async move {
            let _room = room;
            let result = tokio::time::timeout(WRITE_TIMEOUT, write).await;
            let mut failed = this.failed.lock();
            let newest = failed.newest.get(&key) == Some(&number);
            if newest {
                failed.newest.remove(&key);
            }
            let error = match result {
                Ok(Ok(())) => {
                    // An older home that failed must not overwrite this one later. A newer
                    // one that failed is still to be written: this one, sent before it,
                    // landed after it failed.
                    if failed.homes.get(&key).is_some_and(|f| f.2 < number) {
                        failed.homes.remove(&key);
                    }
                    None
                }
                Ok(Err(e)) => Some(e.to_string()),
                Err(_) => Some(format!("no answer within {WRITE_TIMEOUT:?}")),
            };
            if error.is_some() {
                bump(&this.counters.write_errors);
            }
            // A newer write of the session was sent since: its home, not this one, is kept
            // if it fails.
            if error.is_some() && newest {
                let now = Instant::now();
                if failed.homes.len() >= MAX_FAILED {
                    // A home that failed more than a write's time before the outage began (or
                    // before now, while the store is up) will never be written again (see
                    // `mark`): room for those that will.
                    let since = failed.down_since.unwrap_or(now);
                    failed
                        .homes
                        .retain(|_, (_, at, _)| *at + WRITE_TIMEOUT >= since);
                }
                if failed.homes.len() < MAX_FAILED || failed.homes.contains_key(&key) {
                    failed.homes.insert(key, (home, now, number));
                }
            }
            // Sent before the store came back and failed after it (hung until its second
            // was over): it failed with the outage, whose recovery wrote again only the homes
            // that had failed by then. Written again now; one that fails again is kept as
            // failed while the store answered.
            let again = error.is_some()
                && recovered != failed.recovered
                && this.up.load(Ordering::Acquire)
                && failed.homes.get(&key).is_some_and(|f| f.2 == number);
            drop(failed);
            if again {
                // The outage's failure, which the log told: not a write the store refuses.
                this.rewrite(vec![key]);
            } else {
                this.wrote(error);
            }
        });
    }
}

impl<B, P> Shared<B, P> {
    /// Takes what the store read: a home on a live backend becomes the session's home in the
    /// local table (where placement looks it up); a home on a backend this replica does not
    /// know is counted and ignored. A home's tip found in the request's prompt `chain` is what the home
    /// holds: it goes into the cache model, as it would had this replica placed the turn
    /// that ended there; a tip not found is a compaction, as for a session of this replica's
    /// own.
    ///
    /// When the local table has the same home, the store's tip decides whose word counts. A
    /// tip deeper in the prompt than where this replica's own last turn ended is a later
    /// turn that another replica placed there: the backend has used the session since, which
    /// this replica's model cannot know, so the home is taken as holding the session up to
    /// that tip. Otherwise this replica placed the latest turn, and its own model says
    /// whether the home still holds it. Returns what placement needs to know of the answer.
    pub(crate) fn adopt(
        &self,
        homes: &Homes,
        key: SessionKey,
        read: Read,
        chain: Option<&PromptChain>,
    ) -> Option<StoreAnswer> {
        let home = match read {
            Read::Silent => return None,
            Read::Nothing | Read::Prompt(_) => return Some(StoreAnswer::Nothing),
            Read::Found(home) => home,
        };
        let fleet = self.fleet.load();
        let t = &fleet.topology;
        let Some(index) = t.index_of(home.backend.as_str()) else {
            bump(&homes.counters.unknown_backends);
            return Some(StoreAnswer::Nothing);
        };
        bump(&homes.counters.hits);
        let m = t.member(index);
        let chain = chain.filter(|c| !c.is_empty());
        let at = home.tip.zip(chain).and_then(|(tip, c)| c.position_of(tip));
        let now_ms = self.capacity.now_ms(Instant::now());
        let local = self.table.get(key, now_ms);
        let here = local.filter(|h| (h.backend, h.generation) == (index, m.generation));
        // This replica's own last turn of the session went to another live backend and
        // ended deeper in the prompt than the stored home's turn: the store is behind (that
        // turn's write was lost, or the store was restored from an older copy). Its home
        // is not taken, and this placement writes over it.
        let elsewhere =
            local.filter(|h| here.is_none() && t.resolve(h.backend, h.generation).is_some());
        let behind = elsewhere
            .zip(at)
            .zip(chain)
            .is_some_and(|((h, at), c)| c.tip_positions(h.tip).next().is_some_and(|own| own > at));
        if behind {
            return Some(StoreAnswer::Nothing);
        }
        // Where this replica's own last turn of the session ended, if it placed it at this
        // home: a stored tip deeper in the prompt is a later turn.
        let own = here.and_then(|h| chain.and_then(|c| c.tip_positions(h.tip).next()));
        let ahead = at.is_some() && (own.is_none() || at > own);
        if ahead || here.is_none() {
            // Recorded here and now, so the entry below carries the record's stamp.
            let mark = match (at, chain) {
                (Some(at), Some(chain)) if ahead => {
                    m.cache.record_from(&chain.links()[..=at], 0, now_ms)
                }
                _ => 0,
            };
            // Without a tip (a value written without one), where the session's last prompt
            // ended is not known (tip 0), and the cache model does not call the home cold.
            let entry = HomeEntry {
                backend: index,
                generation: m.generation,
                tip: home.tip.map_or(0, tip_of),
                node: t.node_mark(m.node),
                mark,
            };
            self.table.put(key, entry, now_ms);
        }
        // The store has what this request would write only if it holds this prompt's tip.
        let current = match (home.tip, chain) {
            (_, None) => true,
            (tip, Some(c)) => tip.is_some() && c.tip_digest() == tip,
        };
        Some(StoreAnswer::Home(home.backend, current))
    }

    /// Takes what the store read for a keyless request's prompt: the longest link found on a
    /// live backend is recorded in that backend's cache model as held, up to that link, as if
    /// this replica had served the conversation's latest turn there itself. Unless it did:
    /// a link whose home is the one this replica wrote for it is left to its own model, which
    /// saw that turn and everything the backend was sent since (through this replica), and
    /// may know that the backend has evicted it since. Placement then goes on as for any
    /// keyless request (the longest prefix that is the conversation's own, wait versus move),
    /// with no rule of its own for the store's answer.
    pub(crate) fn adopt_prompt(&self, homes: &Homes, chain: &PromptChain, read: Read) {
        let Read::Prompt(found) = read else {
            return;
        };
        let fleet = self.fleet.load();
        let t = &fleet.topology;
        for (at, home) in found {
            let Some(index) = t.index_of(home.backend.as_str()) else {
                continue;
            };
            bump(&homes.counters.hits);
            bump(&homes.counters.prompt_hits);
            if homes
                .written
                .lock()
                .wrote(chain.links()[at].digest, &home.backend)
            {
                bump(&homes.counters.prompt_own);
                return;
            }
            let held = &chain.links()[..=at];
            let now_ms = self.capacity.now_ms(Instant::now());
            t.member(index).cache.record_from(held, 0, now_ms);
            return;
        }
        // Every home found is on a backend this replica does not know: one read, counted once.
        bump(&homes.counters.unknown_backends);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{ReadHome, WriteHome};

    #[test]
    fn every_counter_is_exported_once_under_its_fields_name() {
        let stats = StoreStats {
            reads: 1,
            hits: 2,
            misses: 3,
            timeouts: 4,
            errors: 5,
            garbage: 6,
            unknown_backends: 7,
            skipped: 8,
            writes: 9,
            write_errors: 10,
            writes_dropped: 11,
            outages: 12,
            recoveries: 13,
            prompt_reads: 14,
            prompt_hits: 15,
            prompt_own: 16,
            prompt_writes: 17,
            state: StoreState::Up,
        };
        let counters: Vec<_> = stats.counters().collect();
        let values: Vec<u64> = counters.iter().map(|c| c.2).collect();
        assert_eq!(values, (1..=17).collect::<Vec<_>>());
        let names: Vec<&str> = counters.iter().map(|c| c.0).collect();
        assert_eq!(names[0], "reads");
        assert_eq!(names[15], "prompt_own");
        let unique: std::collections::HashSet<_> = names.iter().collect();
        assert_eq!(unique.len(), names.len());
        assert!(counters.iter().all(|c| !c.1.is_empty()));
    }

    /// A store that answers nothing, named by its `Debug` as a store of a model's fleet is.
    #[derive(Debug)]
    struct Named;

    impl HomeStore for Named {
        fn read(&self, _: SessionKey, _: Duration) -> ReadHome {
            Box::pin(std::future::pending())
        }

        fn write(&self, _: SessionKey, _: StoredHome, _: Duration) -> WriteHome {
            Box::pin(std::future::pending())
        }
    }

    /// What `run` logs, at any level.
    fn logs_of(run: impl FnOnce()) -> String {
        #[derive(Clone, Default)]
        struct Buffer(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Buffer {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buffer = Buffer::default();
        let writer = buffer.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, run);
        let logs = String::from_utf8(buffer.0.lock().clone()).unwrap();
        logs
    }

    fn named() -> Arc<Homes> {
        Arc::new(Homes::new(
            Arc::new(Named),
            Duration::from_millis(5),
            Duration::ZERO,
            10,
        ))
    }

    /// Several balancers may each have a store (a fleet for each model): what one logs
    /// names it.
    #[test]
    fn what_the_store_logs_names_the_store() {
        let homes = named();
        let logs = logs_of(|| {
            homes.wrote(Some("refused".into()));
            homes.wrote(None);
        });
        assert_eq!(logs.lines().count(), 2, "{logs}");
        assert!(logs.lines().all(|l| l.contains("store=Named")), "{logs}");
    }

    /// Writes that fail while the store is down are its outage's, which the log has told:
    /// the first write that lands after it is no news, and a write the store refuses once it
    /// answers again (at `maxmemory`, say) is.
    #[test]
    fn the_log_says_writes_land_again_only_after_it_said_they_fail() {
        let homes = named();
        let logs = logs_of(|| {
            homes.mark(false, &"connection refused");
            homes.wrote(Some("connection refused".into()));
            homes.mark(true, &"answered");
            homes.wrote(None);
            homes.mark(false, &"connection refused");
            homes.wrote(Some("connection refused".into()));
            homes.mark(true, &"answered");
            homes.wrote(Some("OOM command not allowed".into()));
            homes.wrote(None);
        });
        let said: Vec<&str> = logs
            .lines()
            .map(|l| {
                [
                    "unavailable",
                    "answers again",
                    "writes to",
                    "takes writes again",
                ]
                .into_iter()
                .find(|m| l.contains(m))
                .unwrap_or(l)
            })
            .collect();
        let outage = ["unavailable", "answers again"];
        let refused = ["writes to", "takes writes again"];
        assert_eq!(said, [outage, outage, refused].concat(), "{logs}");
    }

    #[test]
    fn written_tips_are_bounded_and_the_newest_are_kept() {
        let mut w = Written::new(100);
        let a = BackendId::from("a");
        for tip in 0..1_000 {
            w.insert(tip, a.clone());
            assert!(w.len() <= 100, "{} tips at {tip}", w.len());
        }
        // The last 50 are in the newer generation, the 50 before them in the older.
        assert!((900..1_000).all(|tip| w.wrote(tip, &a)));
        assert!(!w.wrote(899, &a));
        // Writing a tip again does not turn a generation over.
        let before = w.len();
        w.insert(999, a.clone());
        assert_eq!(w.len(), before);
    }

    #[test]
    fn a_tip_is_this_replicas_only_with_the_backend_it_wrote_last() {
        let mut w = Written::new(16);
        let (a, b) = (BackendId::from("a"), BackendId::from("b"));
        w.insert(7, a.clone());
        assert!(w.wrote(7, &a));
        // Another replica wrote the same prompt's tip with another backend since.
        assert!(!w.wrote(7, &b));
        // This replica served it again elsewhere: only the latest counts.
        w.insert(7, b.clone());
        assert!(w.wrote(7, &b) && !w.wrote(7, &a));
        assert!(!w.wrote(8, &a));
        // A bound below two still keeps the latest tip.
        let mut one = Written::new(0);
        one.insert(1, a.clone());
        one.insert(2, a.clone());
        assert!(one.wrote(2, &a) && one.wrote(1, &a) && one.len() == 2);
    }
}
