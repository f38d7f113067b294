//! The session table: key digest -> home backend, node and last-seen time.
//!
//! Bounded in entries (CLOCK eviction, an approximation of least-recently-used) and in idle
//! age (an entry idle longer than the timeout is treated as absent and is the first to be
//! reused), and sharded by the key's digest so concurrent requests rarely meet on one lock.
//!
//! Each shard stores its entries once, in a vector that doubles as the CLOCK ring, and an
//! index from key hash to position. Keys are digests already, so the index hashes nothing: it
//! takes 64 bits of the digest as they are. An entry is 40 bytes; with the index and the
//! vectors' spare room a tracked session costs about 50-60 bytes (see `BENCHMARKS.md`).
//!
//! The service talks to the table through [`SessionStore`], a small interface that a shared
//! store (one table for several router processes) can implement later.

use std::time::Duration;

use hashbrown::HashTable;
use parking_lot::Mutex;
use tokio::time::Instant;

use crate::key::SessionKey;

/// Bounds of the session table.
///
/// ```
/// use std::time::Duration;
/// use tower_affinity::Sessions;
///
/// let s = Sessions::new().max_entries(1_000_000).idle_timeout(Duration::from_secs(6 * 3600));
/// assert_eq!(s.entries(), 1_000_000);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sessions {
    max_entries: usize,
    idle_timeout: Duration,
}

impl Sessions {
    /// 100,000 sessions, forgotten after an hour without a request.
    pub const fn new() -> Self {
        Sessions {
            max_entries: 100_000,
            idle_timeout: Duration::from_secs(3600),
        }
    }

    /// The most sessions remembered at once (at least 1). When full, the least recently used
    /// session (approximately) is forgotten; its next turn is placed as a new session.
    pub const fn max_entries(mut self, n: usize) -> Self {
        self.max_entries = if n == 0 { 1 } else { n };
        self
    }

    /// How long a session is remembered without a request.
    pub const fn idle_timeout(mut self, idle: Duration) -> Self {
        self.idle_timeout = idle;
        self
    }

    /// The configured entry bound.
    pub const fn entries(&self) -> usize {
        self.max_entries
    }

    /// The configured idle timeout.
    pub const fn idle(&self) -> Duration {
        self.idle_timeout
    }
}

impl Default for Sessions {
    fn default() -> Self {
        Sessions::new()
    }
}

/// Where a session was served last, by internal backend index and generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct HomeEntry {
    pub(crate) backend: u32,
    pub(crate) generation: u32,
    pub(crate) node: u32,
}

/// What the service needs from a session store.
pub(crate) trait SessionStore: Send + Sync {
    /// The session's home, if it is known and not idle past the timeout; marks it used.
    fn get(&self, key: SessionKey, now: Instant) -> Option<HomeEntry>;
    /// Records the session's home.
    fn put(&self, key: SessionKey, home: HomeEntry, now: Instant);
    /// Sessions held.
    fn len(&self) -> usize;
    /// Bytes of memory held.
    fn memory_bytes(&self) -> usize;
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    key: [u64; 2],
    home: HomeEntry,
    /// Seconds since the table was made.
    stamp: u32,
    referenced: bool,
}

#[derive(Debug)]
struct Shard {
    index: HashTable<u32>,
    ring: Vec<Entry>,
    hand: usize,
    capacity: usize,
}

/// The in-process session table.
#[derive(Debug)]
pub(crate) struct SessionTable {
    shards: Box<[Mutex<Shard>]>,
    shard_mask: u64,
    start: Instant,
    idle_secs: u32,
}

fn words(key: SessionKey) -> [u64; 2] {
    [key.hi64(), key.lo64()]
}

impl SessionTable {
    pub(crate) fn new(config: Sessions) -> Self {
        // About a thousand entries a shard, at most 64 shards; small tables get one shard so
        // that their bound is exact.
        let shards = (config.max_entries / 1024)
            .clamp(1, 64)
            .next_power_of_two()
            .min(64);
        let shards = if shards * 1024 > config.max_entries {
            (shards / 2).max(1)
        } else {
            shards
        };
        let per_shard = config.max_entries / shards;
        SessionTable {
            shards: (0..shards)
                .map(|_| {
                    Mutex::new(Shard {
                        index: HashTable::new(),
                        ring: Vec::new(),
                        hand: 0,
                        capacity: per_shard,
                    })
                })
                .collect(),
            shard_mask: shards as u64 - 1,
            start: Instant::now(),
            idle_secs: u32::try_from(config.idle_timeout.as_secs()).unwrap_or(u32::MAX),
        }
    }

    fn stamp(&self, now: Instant) -> u32 {
        u32::try_from(now.saturating_duration_since(self.start).as_secs()).unwrap_or(u32::MAX)
    }

    fn shard(&self, key: SessionKey) -> &Mutex<Shard> {
        // The index hashes with the low word; shards take the high word so the two are
        // independent.
        &self.shards[(key.hi64() & self.shard_mask) as usize]
    }

    fn expired(&self, stamp: u32, now: u32) -> bool {
        now.saturating_sub(stamp) > self.idle_secs
    }
}

impl SessionStore for SessionTable {
    fn get(&self, key: SessionKey, now: Instant) -> Option<HomeEntry> {
        let now = self.stamp(now);
        let w = words(key);
        let mut shard = self.shard(key).lock();
        let shard = &mut *shard;
        let &pos = shard
            .index
            .find(key.lo64(), |&p| shard.ring[p as usize].key == w)?;
        let e = &mut shard.ring[pos as usize];
        if self.expired(e.stamp, now) {
            return None;
        }
        e.stamp = now;
        e.referenced = true;
        Some(e.home)
    }

    fn put(&self, key: SessionKey, home: HomeEntry, now: Instant) {
        let now = self.stamp(now);
        let w = words(key);
        let entry = Entry {
            key: w,
            home,
            stamp: now,
            referenced: true,
        };
        let mut shard = self.shard(key).lock();
        let shard = &mut *shard;
        let ring = &shard.ring;
        if let Some(&pos) = shard.index.find(key.lo64(), |&p| ring[p as usize].key == w) {
            shard.ring[pos as usize] = entry;
            return;
        }
        if shard.ring.len() < shard.capacity {
            let pos = shard.ring.len() as u32;
            shard.ring.push(entry);
            let ring = &shard.ring;
            shard
                .index
                .insert_unique(key.lo64(), pos, |&p| ring[p as usize].key[1]);
            return;
        }
        // CLOCK: pass over recently used entries once, clearing their mark; take the first
        // entry that is unmarked or idle past the timeout. Ends within two turns of the ring.
        let len = shard.ring.len();
        let victim = loop {
            let hand = shard.hand;
            shard.hand = (hand + 1) % len;
            let e = &mut shard.ring[hand];
            if e.referenced && !self.expired(e.stamp, now) {
                e.referenced = false;
            } else {
                break hand;
            }
        };
        let old = shard.ring[victim].key;
        if let Ok(slot) = shard.index.find_entry(old[1], |&p| p as usize == victim) {
            slot.remove();
        }
        shard.ring[victim] = entry;
        let ring = &shard.ring;
        shard
            .index
            .insert_unique(key.lo64(), victim as u32, |&p| ring[p as usize].key[1]);
    }

    fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().ring.len()).sum()
    }

    fn memory_bytes(&self) -> usize {
        self.shards
            .iter()
            .map(|s| {
                let s = s.lock();
                s.index.allocation_size() + s.ring.capacity() * std::mem::size_of::<Entry>()
            })
            .sum::<usize>()
            + std::mem::size_of::<Self>()
            + self.shards.len() * std::mem::size_of::<Mutex<Shard>>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u64) -> SessionKey {
        SessionKey::from_bytes(&n.to_le_bytes())
    }

    fn home(b: u32) -> HomeEntry {
        HomeEntry {
            backend: b,
            generation: 0,
            node: 0,
        }
    }

    #[test]
    fn an_entry_is_found_after_put() {
        let t = SessionTable::new(Sessions::new().max_entries(10));
        let now = Instant::now();
        assert_eq!(t.get(key(1), now), None);
        t.put(key(1), home(3), now);
        assert_eq!(t.get(key(1), now), Some(home(3)));
        t.put(key(1), home(4), now);
        assert_eq!(t.get(key(1), now), Some(home(4)));
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn table_never_holds_more_than_max_entries() {
        let t = SessionTable::new(Sessions::new().max_entries(5000));
        let now = Instant::now();
        for n in 0..50_000 {
            t.put(key(n), home(0), now);
        }
        assert!(t.len() <= 5000, "{}", t.len());
        assert!(t.len() >= 4096);
    }

    #[test]
    fn recently_used_entries_survive_eviction() {
        let t = SessionTable::new(Sessions::new().max_entries(4));
        let now = Instant::now();
        for n in 0..4 {
            t.put(key(n), home(n as u32), now);
        }
        // One pass of the hand clears every mark; touching 0 and 1 marks them again.
        t.put(key(10), home(10), now);
        assert_eq!(t.get(key(0), now), None, "first unmarked entry is evicted");
        t.get(key(1), now);
        t.get(key(2), now);
        t.put(key(11), home(11), now);
        assert!(t.get(key(1), now).is_some());
        assert!(t.get(key(2), now).is_some());
        assert_eq!(
            t.get(key(3), now),
            None,
            "the one entry not used since is evicted"
        );
        assert_eq!(t.len(), 4);
    }

    #[test]
    fn idle_entries_are_forgotten() {
        let t = SessionTable::new(Sessions::new().idle_timeout(Duration::from_secs(60)));
        let now = Instant::now();
        t.put(key(1), home(1), now);
        assert!(t.get(key(1), now + Duration::from_secs(60)).is_some());
        assert_eq!(t.get(key(1), now + Duration::from_secs(122)), None);
    }

    #[test]
    fn a_full_table_costs_under_100_bytes_a_session() {
        let n = 200_000;
        let t = SessionTable::new(Sessions::new().max_entries(n));
        let now = Instant::now();
        for k in 0..2 * n as u64 {
            t.put(
                SessionKey::from_u128(
                    u128::from(k).wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835),
                ),
                home(0),
                now,
            );
        }
        let per = t.memory_bytes() as f64 / t.len() as f64;
        assert!(t.len() > n * 9 / 10, "{}", t.len());
        assert!(per <= 100.0, "{per} bytes a session");
    }

    #[test]
    fn entry_is_at_most_40_bytes() {
        assert!(std::mem::size_of::<Entry>() <= 40);
    }
}
