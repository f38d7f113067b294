//! Several router replicas in front of one fleet (`--routers N --entry random|sticky`), with
//! their own session tables only or sharing one store of homes (`--shared-store`).
//!
//! Each replica is a `SessionAffinity` of its own over the same simulated backends: its own
//! session table, cache model and slot counters. It is told it is one of N
//! (`SessionAffinityLayer::replicas`), so its cache model keeps its share of every backend's
//! cache, as the README says to run replicas. It counts only its own requests in flight: with
//! every backend's slots each (the default), a backend queues what its slots cannot take at
//! once, as llama-server does; with `--replica-slots share`, each is given its share of every
//! backend's slots instead, rounded up, so that together they send a backend its slots at
//! most, and less than one more a replica where their number does not divide the slots.
//!
//! A turn enters at a replica chosen at random (an L4 balancer without affinity) or by its
//! session (consistent hashing at the ingress; a keyless turn still enters at random).

use std::cell::Cell;
use std::collections::HashMap;
use std::future::ready;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use parking_lot::Mutex;
use tower::Service;
use tower_affinity::discover::StaticFleet;
use tower_affinity::key::{HeaderKey, KeyExtractor, SessionKey};
use tower_affinity::placement::Placement;
use tower_affinity::store::{HomeStore, Lookup, ReadHome, ReadPrompts, StoredHome, WriteHome};
use tower_affinity::{ResponseBody, ResponseFuture, SessionAffinity, Stats};

use crate::backend::{Answer, Prompt, SimBackend};

/// How turns reach the replicas.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Entry {
    Random,
    Sticky,
}

/// The replicas' setting for this run.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Replicas {
    pub(crate) routers: usize,
    pub(crate) entry: Entry,
    pub(crate) shared_store: bool,
    /// Each replica is given its share of every backend's slots, not all of them.
    pub(crate) slot_shares: bool,
}

thread_local! {
    // Per thread: the whole run drives one thread (and each test its own).
    static REPLICAS: Cell<Option<Replicas>> = const { Cell::new(None) };
}

/// Sets the replicas of the runs on this thread (from the command line).
pub(crate) fn set(r: Replicas) {
    REPLICAS.with(|c| c.set(Some(r)));
}

/// The replicas of the runs on this thread: one router unless [`set`].
pub(crate) fn get() -> Replicas {
    REPLICAS.with(Cell::get).unwrap_or(Replicas {
        routers: 1,
        entry: Entry::Random,
        shared_store: false,
        slot_shares: false,
    })
}

impl Replicas {
    pub(crate) fn describe(&self) -> String {
        if self.routers <= 1 {
            return String::new();
        }
        let entry = match self.entry {
            Entry::Random => "random",
            Entry::Sticky => "sticky",
        };
        let store = if self.shared_store {
            "a shared store of homes"
        } else {
            "local tables only"
        };
        let slots = if self.slot_shares {
            ", a share of every backend's slots each"
        } else {
            ""
        };
        format!("; {} routers, {entry} entry, {store}{slots}", self.routers)
    }
}

/// A store of homes in memory, shared by the replicas: what Redis is to real ones, answering
/// at once. Sessions' homes by their keys, and keyless conversations' by their prompts' tips.
#[derive(Clone, Debug, Default)]
pub(crate) struct SharedHomes(Arc<Mutex<Homes>>);

#[derive(Debug, Default)]
struct Homes {
    sessions: HashMap<SessionKey, StoredHome>,
    prompts: HashMap<u64, StoredHome>,
}

impl HomeStore for SharedHomes {
    fn read(&self, session: SessionKey, _ttl: Duration) -> ReadHome {
        let found = self.0.lock().sessions.get(&session).cloned();
        Box::pin(ready(Ok(found.map_or(Lookup::Missing, Lookup::Home))))
    }

    fn write(&self, session: SessionKey, home: StoredHome, _ttl: Duration) -> WriteHome {
        self.0.lock().sessions.insert(session, home);
        Box::pin(ready(Ok(())))
    }

    fn read_prompts(&self, prompts: &[u64], _ttl: Duration) -> ReadPrompts {
        let homes = self.0.lock();
        let found = prompts
            .iter()
            .map(|p| {
                homes
                    .prompts
                    .get(p)
                    .cloned()
                    .map_or(Lookup::Missing, Lookup::Home)
            })
            .collect();
        Box::pin(ready(Ok(found)))
    }

    fn write_prompt(&self, prompt: u64, home: StoredHome, _ttl: Duration) -> WriteHome {
        self.0.lock().prompts.insert(prompt, home);
        Box::pin(ready(Ok(())))
    }
}

/// One replica.
pub(crate) type Replica = SessionAffinity<StaticFleet<SimBackend>, HeaderKey, Arc<dyn Placement>>;

/// The replicas, as one service: each turn enters at one of them.
#[derive(Clone)]
pub(crate) struct Router {
    replicas: Arc<[Replica]>,
    entry: Entry,
    draws: Arc<AtomicU64>,
}

impl Router {
    pub(crate) fn new(replicas: Vec<Replica>, entry: Entry, seed: u64) -> Self {
        Router {
            replicas: replicas.into(),
            entry,
            draws: Arc::new(AtomicU64::new(seed | 1)),
        }
    }

    /// A random draw (xorshift64*): the same sequence for the same seed.
    fn draw(&self) -> u64 {
        let mut x = self.draws.load(Ordering::Relaxed);
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.draws.store(x, Ordering::Relaxed);
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// With a shared store: its reads, their hits, and the hits that found the reading
    /// replica's own keyless write, summed over the replicas.
    pub(crate) fn store_counts(&self) -> Option<[u64; 3]> {
        self.replicas.iter().try_fold([0; 3], |[r, h, o], replica| {
            let s = replica.store_stats()?;
            Some([r + s.reads, h + s.hits, o + s.prompt_own])
        })
    }

    /// The replicas' counters, added up.
    pub(crate) fn stats(&self) -> Stats {
        let mut all = self.replicas[0].stats();
        for r in &self.replicas[1..] {
            let s = r.stats();
            all.usage_reports += s.usage_reports;
            all.prompt_tokens += s.prompt_tokens;
            all.reused_tokens += s.reused_tokens;
            all.unreported_prompt_tokens += s.unreported_prompt_tokens;
            all.corrections += s.corrections;
        }
        all
    }
}

impl Service<http::Request<Prompt>> for Router {
    type Response = http::Response<ResponseBody<Answer>>;
    type Error = tower_affinity::Error;
    type Future = ResponseFuture<SimBackend, Arc<dyn Placement>, Prompt>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Every replica is always ready; polling them applies their discovery.
        for r in self.replicas.iter() {
            let _ = Service::<http::Request<Prompt>>::poll_ready(&mut r.clone(), cx);
        }
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Prompt>) -> Self::Future {
        let n = self.replicas.len() as u64;
        let at = match (self.entry, HeaderKey::default().extract(&req)) {
            (Entry::Sticky, Some(key)) => {
                // SipHash with fixed keys: the same replica for a session in every run.
                let mut h = std::hash::DefaultHasher::new();
                key.hash(&mut h);
                h.finish() % n
            }
            _ => self.draw() % n,
        };
        self.replicas[at as usize].clone().call(req)
    }
}
