//! Shared session stores: session homes that several router replicas agree on.
//!
//! Each replica keeps its own in-memory session table. Rendezvous hashing makes replicas agree
//! on a session's *first* placement, but after a spill they disagree: replica A moved the
//! session to a new backend, and replica B still sends the next turn to the old home, which is
//! full or cold. A [`HomeStore`] shared by the replicas (the `redis` feature's
//! `RedisStore`, or your own) closes that gap:
//!
//! - **Reads.** Every request with a session key first reads the session's home from the store,
//!   within a deadline ([`SessionAffinityLayer::store_deadline`], default 5 ms). An answer in
//!   time that names a live backend becomes the session's home in the local table; then the
//!   request is placed as usual. When the deadline passes, or the store fails, the local table
//!   answers (and rendezvous for a session it does not know): a store outage never fails a
//!   request, and no request waits past the deadline for it.
//! - **Writes.** A placement whose home is not what the store said (a new session, a spill, a
//!   store that had no home, garbage or a stale one) is written at once, in a task of its own:
//!   the request does not wait for it; so is every turn with a prompt chain, with its tip
//!   (below). A placement made without the store's answer (it was late or down) is written if
//!   it moved the session off the local table's home. The write
//!   asks the store to keep the home for the session table's idle timeout
//!   ([`Sessions::idle`]); a read asks it to keep the home that long again, since the session
//!   is in use.
//! - **Faults.** A read that fails or times out marks the store *down*: one warning in the
//!   log, and [`StoreStats::outages`] grows. While it is down, requests use the local table at
//!   once, without waiting, and one read at a time goes to the store as a probe that no
//!   request waits for. The first read answered in time marks it up again (one line in the
//!   log, [`StoreStats::recoveries`]). Writes are sent whatever the state, each bounded by a
//!   second and at most 1,024 at once (more are dropped and counted,
//!   [`StoreStats::writes_dropped`]); the homes whose write failed (the latest of each
//!   session, up to 4,096) are written again when the store comes back (a write sent before
//!   it came back that fails after, as it fails), each as a place
//!   among the writes in flight frees (none of them dropped, but none whose session has a
//!   newer write in flight), so that it does not send their sessions back to where they were
//!   before the outage; each replaces only a home placed before it (see "Which write wins"
//!   below). A value that is not a
//!   home (a key holding something else) is ignored and counted ([`StoreStats::garbage`]),
//!   and so is a home on a backend this replica does not know (removed from the fleet, or
//!   not yet discovered: [`StoreStats::unknown_backends`]); the request is placed as if the
//!   store had none, and its placement writes a home over it.
//!
//! **Keyless conversations.** A request without a session key is known by its prompt: its [`PromptChain`] (from
//! [`PromptFacts`], which [`BodyKeyLayer`] attaches) has a digest at each message boundary
//! that covers the whole prompt up to there, and a conversation's next turn repeats its last
//! turn's prompt and goes on. So the prompt's tip (where the turn ended, as the next turn
//! contains it) names the conversation's latest turn:
//!
//! - **Writes.** After a keyless request with a prompt is placed, the digests of its tip and
//!   of its last link are written with the backend that serves it
//!   ([`HomeStore::write_prompt`], twice), in a task of its own and kept for the idle
//!   timeout, as a session's home is. The last link names a first turn, whose tip is often a
//!   system prompt that every conversation opens with and overwrites.
//! - **Reads.** A keyless request reads the digests of its tip and of the links before it, up
//!   to 8, the longest first, in one read ([`HomeStore::read_prompts`]) within the same
//!   deadline, with the same fallback. The longest link found on a live backend is what it is:
//!   that backend holds the prompt up to there. It goes into the replica's cache model as
//!   such, and the request is then placed as every keyless request is (the longest prefix
//!   that is the conversation's own; wait versus move). A prefix that many conversations
//!   share (a common system prompt) is held by many backends, and placement treats it as
//!   shared, as it does without a store.
//! - **A replica's own writes.** Each replica remembers the tips it wrote and the backend it
//!   wrote for each (twice as many as its session table holds sessions,
//!   [`Sessions::max_entries`], two a keyless turn; at the default of 100,000, at most about
//!   6.6 MB). A read that finds the home this
//!   replica wrote itself ([`StoreStats::prompt_own`]) adds nothing to its model: the replica
//!   served that turn, and its model, which has seen what it sent the backend since, is left
//!   to say whether the backend still holds it, as a keyed session's is (below). Taken as a
//!   fresh sign, the replica's own old write would keep conversations on backends that
//!   have evicted them: with two replicas entered at random in the swarm's overload
//!   scenario at 8 GiB, keyless conversations through the store reached 82.6% of turns warm
//!   over seeds 1 to 16 with this rule, 71.4% without it, when it came in (84.5% now). On
//!   the swarm's replay of a Mooncake trace, where conversations are short and share long
//!   prefixes, the rule costs 2 to 5 points of the ideal reuse (README, "Router
//!   replicas").
//!
//! A conversation's first turn finds nothing (no earlier turn was written); its second finds
//! the first's last link, its first message. One whose whole first prompt is the same as
//! other conversations' is known from its third turn on: its second continues a prompt they
//! all share, its third one that holds an answer of its own.
//!
//! **What the store sees:** the session's digest ([`SessionKey`], 128 bits of the SHA-256 of
//! its raw key), the 64-bit digests of keyless prompts at their tips and last links
//! ([`PromptChain`]'s links), and the [`StoredHome`] (backend and node names, and the digest of the link where
//! the prompt of the turn that placed the home ended): never a raw key, a header or a prompt.
//!
//! **A home's tip.** That digest lets a replica that reads a home judge it as the one that
//! placed it does: found in the request's prompt, it is what the home holds, and goes into
//! the reader's cache model (so that its predictions of reuse there are right); not found,
//! the client compacted its history ([`Outcome::Compaction`](crate::Outcome::Compaction)), and
//! the home is written again with the new tip. A value written without a tip reads as a
//! home whose cache is not known, and is written again with one.
//!
//! Every turn with a prompt chain writes its tip, home hits too, so the store always says
//! where the session's latest turn ended. A replica whose own last turn of the session, at
//! the same home, ended earlier in the prompt than that tip knows another replica served the
//! session there since: the backend has used it, though this replica's cache model, which
//! sees only its own turns, may have let it age out. It then takes the home as holding the
//! session up to the stored tip, and does not call it cold. A replica that served the latest
//! turn itself goes by its own model. With two replicas entered at random, in the swarm's
//! overload scenario at 8 GiB over seeds 1 to 16, this took the cold homes from 2,219 to 632
//! (see `BENCHMARKS.md`). A replica whose own last turn of the session went to another
//! backend and ended deeper in the prompt than the stored tip knows the store is behind
//! (that turn's write was lost, or Redis came back from an older snapshot): it keeps its own
//! home, as if the store had none, and writes it over the stale one.
//!
//! **Which write wins.** The last one, unless the store holds a home placed after it. Two
//! replicas that place the same session at the same moment both write, and the store keeps
//! the home of the turn placed last (of the write that arrives last, for homes placed in the
//! same millisecond); every replica then reads that one. Either is a good home: both backends
//! served the same turn and hold its prompt. In the common case (one turn after another) the
//! latest turn's home is where the newest cache is, so it is also what keeps the store right
//! after a replica placed a turn on its local table while the store was slow. A
//! compare-and-set ("write only if the home is still the one I read") would refuse exactly
//! those writes and leave the store on a home that no longer holds the session.
//!
//! Every home carries when its turn was placed ([`StoredHome::placed`], by the writing
//! replica's clock), and a write does not replace a home placed after it: a write that lands
//! late (held up on the way, or in a store that stalled, after the replica gave up on it) must
//! not send the session back to where an earlier turn was. A write sent again after an
//! outage ([`HomeStore::rewrite`]) is old by then: while the store was down, another replica
//! may have placed a later turn of the session and written it once the store came back. It
//! replaces only a home placed before it, and keeps one that does not say when
//! (`RedisStore` sets a home only if the key does not hold a later one, in one script, or
//! reads the key and sets the home only if the key still holds what it read). Two replicas'
//! clocks need only agree to well within the time between a session's turns.
//!
//! Counters and the store's state: [`SessionAffinity::store_stats`].
//!
//! ```
//! use std::time::Duration;
//! use tower_affinity::key::SessionKey;
//! use tower_affinity::store::{HomeStore, Lookup, ReadHome, StoredHome, WriteHome};
//!
//! /// A store that knows nothing: every session is new to it.
//! #[derive(Debug)]
//! struct Forgetful;
//!
//! impl HomeStore for Forgetful {
//!     fn read(&self, _session: SessionKey, _ttl: Duration) -> ReadHome {
//!         Box::pin(async { Ok(Lookup::Missing) })
//!     }
//!     fn write(&self, _session: SessionKey, _home: StoredHome, _ttl: Duration) -> WriteHome {
//!         Box::pin(async { Ok(()) })
//!     }
//! }
//!
//! let layer = tower_affinity::SessionAffinityLayer::new().home_store(Forgetful);
//! # let _ = layer;
//! ```
//!
//! [`SessionAffinityLayer::store_deadline`]: crate::SessionAffinityLayer::store_deadline
//! [`PromptChain`]: crate::PromptChain
//! [`PromptFacts`]: crate::key::PromptFacts
//! [`BodyKeyLayer`]: crate::key::BodyKeyLayer
//! [`Sessions::idle`]: crate::Sessions::idle
//! [`Sessions::max_entries`]: crate::Sessions::max_entries
//! [`SessionAffinity::store_stats`]: crate::SessionAffinity::store_stats

mod home;
#[cfg(feature = "redis")]
mod redis;
mod shared;

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use crate::key::SessionKey;
use crate::BoxError;

pub use home::StoredHome;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use redis::{RedisOpenError, RedisStore, RedisStoreBuilder};
pub(crate) use shared::{Homes, PendingRead, StoreAnswer};
pub use shared::{StoreState, StoreStats};

/// What a read of the store found.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Lookup {
    /// The session's home.
    Home(StoredHome),
    /// The store holds no home for the session.
    Missing,
    /// The store holds something for the session that is not a home (a value of another
    /// format, a key of another type). The service ignores it and counts it.
    Garbage,
}

/// The future of a [`HomeStore::read`].
pub type ReadHome = Pin<Box<dyn Future<Output = Result<Lookup, BoxError>> + Send + 'static>>;

/// The future of a [`HomeStore::write`] (and of a [`HomeStore::rewrite`] and a
/// [`HomeStore::write_prompt`]).
pub type WriteHome = Pin<Box<dyn Future<Output = Result<(), BoxError>> + Send + 'static>>;

/// The future of a [`HomeStore::read_prompts`]: what the store holds for each digest asked, in
/// the order asked.
pub type ReadPrompts =
    Pin<Box<dyn Future<Output = Result<Vec<Lookup>, BoxError>> + Send + 'static>>;

/// A store of session homes shared by router replicas.
///
/// The service reads a session's home before placing its request and writes it when a
/// placement changes it; see the [module docs](self) for when, with which deadline, and what
/// happens when the store fails. Every method returns at once with a future; the service
/// drives the reads within its deadline (dropping them when the deadline passes) and the
/// writes in tasks of their own, so none may rely on being polled to completion. They run on
/// a Tokio runtime.
///
/// Keys are [`SessionKey`] digests; the store never sees a raw session key.
pub trait HomeStore: fmt::Debug + Send + Sync + 'static {
    /// Reads the home of `session`. A store that expires homes should keep this one for at
    /// least `ttl` more: the session is in use.
    fn read(&self, session: SessionKey, ttl: Duration) -> ReadHome;

    /// Records `home` as the home of `session`, replacing any earlier value, to be forgotten
    /// after `ttl` without a read. A store that can compare and set keeps a home held whose
    /// [`placed`](StoredHome::placed) is later than this one's (a write that landed late must
    /// not replace a later turn's home), as `RedisStore` does.
    fn write(&self, session: SessionKey, home: StoredHome, ttl: Duration) -> WriteHome;

    /// Records `home` as the home of `session`, as [`write`](Self::write) does, unless the
    /// store holds a home placed after it: a write that failed while the store was down,
    /// sent again once it answers. Another replica may have placed a later turn of the
    /// session meanwhile and written that; its home, where the newest cache is, must stay.
    ///
    /// `home.placed` is when the home was placed ([`StoredHome::placed`]). A store that can
    /// compare and set keeps the held home when it is a home whose `placed` is later than
    /// this one's, or that has none (a writer that does not say when; its home may be the
    /// later); it writes over no home, garbage, and earlier homes. The default writes it as
    /// `write` does: the last write wins, and a store without a compare may send a session
    /// back to where it was before an outage.
    fn rewrite(&self, session: SessionKey, home: StoredHome, ttl: Duration) -> WriteHome {
        self.write(session, home, ttl)
    }

    /// Reads the homes of keyless conversations by the digests of their prompts (see
    /// "Keyless conversations" in the [module docs](self)): for each digest in `prompts`,
    /// in that order, the home written for it by [`write_prompt`](Self::write_prompt). The
    /// service asks for a few digests at once, the longest prompt first, and waits for them
    /// within the same deadline as a session's read, so a store should answer them in one
    /// round trip. Keep the digests apart from session keys: they are other identities.
    ///
    /// The default knows none (every answer [`Lookup::Missing`]): a store written before
    /// this method existed shares keyed sessions only.
    fn read_prompts(&self, prompts: &[u64], ttl: Duration) -> ReadPrompts {
        let _ = ttl;
        let none = vec![Lookup::Missing; prompts.len()];
        Box::pin(std::future::ready(Ok(none)))
    }

    /// Records `home` as the backend that served the prompt whose digest is `prompt` (a
    /// keyless conversation's latest turn), replacing any earlier value, to be forgotten after
    /// `ttl`. The default drops it.
    fn write_prompt(&self, prompt: u64, home: StoredHome, ttl: Duration) -> WriteHome {
        let _ = (prompt, home, ttl);
        Box::pin(std::future::ready(Ok(())))
    }
}

impl<T: HomeStore + ?Sized> HomeStore for std::sync::Arc<T> {
    fn read(&self, session: SessionKey, ttl: Duration) -> ReadHome {
        (**self).read(session, ttl)
    }

    fn write(&self, session: SessionKey, home: StoredHome, ttl: Duration) -> WriteHome {
        (**self).write(session, home, ttl)
    }

    fn rewrite(&self, session: SessionKey, home: StoredHome, ttl: Duration) -> WriteHome {
        (**self).rewrite(session, home, ttl)
    }

    fn read_prompts(&self, prompts: &[u64], ttl: Duration) -> ReadPrompts {
        (**self).read_prompts(prompts, ttl)
    }

    fn write_prompt(&self, prompt: u64, home: StoredHome, ttl: Duration) -> WriteHome {
        (**self).write_prompt(prompt, home, ttl)
    }
}

impl<T: HomeStore + ?Sized> HomeStore for Box<T> {
    fn read(&self, session: SessionKey, ttl: Duration) -> ReadHome {
        (**self).read(session, ttl)
    }

    fn write(&self, session: SessionKey, home: StoredHome, ttl: Duration) -> WriteHome {
        (**self).write(session, home, ttl)
    }

    fn rewrite(&self, session: SessionKey, home: StoredHome, ttl: Duration) -> WriteHome {
        (**self).rewrite(session, home, ttl)
    }

    fn read_prompts(&self, prompts: &[u64], ttl: Duration) -> ReadPrompts {
        (**self).read_prompts(prompts, ttl)
    }

    fn write_prompt(&self, prompt: u64, home: StoredHome, ttl: Duration) -> WriteHome {
        (**self).write_prompt(prompt, home, ttl)
    }
}
