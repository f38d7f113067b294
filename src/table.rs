//! The session table: key digest -> home backend (with its generation), node, the last
//! prompt's tip and cache-model mark, and last-seen time.
//!
//! Bounded in entries (sampled least-recently-used eviction, among the entries next to where
//! the new key goes) and in idle age (an entry idle longer than the timeout is treated as
//! absent; an eviction takes it before any other entry it looks at, but one elsewhere in the
//! shard stays, and is counted, until a key placed near it takes its slot), and sharded by the
//! key's digest so concurrent requests rarely meet on one lock.
//!
//! Each shard is an open-addressing table (linear probing) whose slots hold the 32-byte entries
//! themselves, so a lookup in a table far larger than the CPU's caches costs one memory access,
//! not one for an index and another for the entry. Keys are digests already, so no hash runs
//! over them: an entry keeps the top 96 bits of the key times an odd number, which every bit of
//! the key moves, and the probe starts where those bits, mixed by one more multiplication,
//! point (keys built from numbers need not be random). An eviction looks only at the few
//! entries around that point, which the lookup has just brought into cache. A shard grows by
//! doubling up to its bound at three quarters' load, so a full table costs about 43 bytes a
//! session (see `BENCHMARKS.md`).
//!
//! The service talks to the table through [`SessionStore`], a small interface. Homes shared
//! by several router processes do not replace the table: a
//! [`HomeStore`](crate::store::HomeStore) is read first, and a home it names in time on a live
//! backend becomes the session's entry here (see [`store`](crate::store)).

use std::time::Duration;

use parking_lot::Mutex;

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
    /// session (approximately) is forgotten; its next turn is placed as a new session. With a
    /// [shared store](crate::store), it also bounds the keyless prompts a replica remembers
    /// writing there.
    pub const fn max_entries(mut self, n: usize) -> Self {
        self.max_entries = if n == 0 { 1 } else { n };
        self
    }

    /// How long a session is remembered without a request, counted in whole seconds (a
    /// timeout under a second forgets a session within the second after its last request).
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

/// Where a session was served last, by internal backend index and generation, and where its
/// last prompt ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct HomeEntry {
    pub(crate) backend: u32,
    pub(crate) generation: u16,
    /// A fingerprint of the last link of the last turn's prompt chain; 0 if it had none.
    pub(crate) tip: u16,
    /// Its node, as [`Topology::node_mark`](crate::fleet::Topology::node_mark) records it.
    pub(crate) node: u32,
    /// The stamp of the last turn's record on the home's cache model (see
    /// [`ModelCell`](crate::cache::ModelCell)); 0 if none is known.
    pub(crate) mark: u32,
}

/// What the service needs from a session store.
pub(crate) trait SessionStore: Send + Sync {
    /// The session's home, if it is known and not idle past the timeout; marks it used.
    /// `now_ms` is the fleet's clock (milliseconds since it started).
    fn get(&self, key: SessionKey, now_ms: u64) -> Option<HomeEntry>;
    /// Records the session's home.
    fn put(&self, key: SessionKey, home: HomeEntry, now_ms: u64);
    /// Sessions held.
    fn len(&self) -> usize;
    /// Bytes of memory held.
    fn memory_bytes(&self) -> usize;
}

/// One session: 32 bytes, two to a cache line. Aligned to its size, so that no entry straddles
/// two cache lines: a lookup that finds its key in the first slot it reads touches one line.
#[derive(Clone, Copy, Debug)]
#[repr(align(32))]
struct Entry {
    /// 96 bits of the key's digest times an odd number (see [`words`]; two keys alike in
    /// those are one in 2^96); all zero marks an empty slot.
    key: Words,
    /// Seconds on the fleet's clock when last used, in the low 31 bits; the top bit is "used
    /// again since it came in".
    stamp: u32,
    home: HomeEntry,
}

/// The part of a key's digest an entry keeps.
type Words = [u32; 3];

const EMPTY: Words = [0, 0, 0];
const REFERENCED: u32 = 1 << 31;

impl Entry {
    const VACANT: Entry = Entry {
        key: EMPTY,
        home: HomeEntry {
            backend: 0,
            generation: 0,
            tip: 0,
            node: 0,
            mark: 0,
        },
        stamp: 0,
    };

    fn seconds(&self) -> u32 {
        self.stamp & !REFERENCED
    }
}

/// One shard: an open-addressing table with linear probing whose slots hold the entries
/// themselves, so a lookup touches one or two cache lines and nothing else, and so does an
/// eviction. Deletion shifts later entries back, so no tombstones build up.
#[derive(Debug)]
struct Shard {
    slots: Vec<Entry>,
    len: usize,
    /// The most entries this shard holds.
    bound: usize,
    /// The most slots it grows to: the bound at a load of three quarters.
    max_slots: usize,
}

/// How many entries an eviction looks at, next to where the new key goes: four cache lines.
const SAMPLE: usize = 8;

impl Shard {
    fn new(bound: usize) -> Self {
        let max_slots = bound + bound.div_ceil(3) + 1;
        let n = max_slots.min(16);
        Shard {
            slots: vec![Entry::VACANT; n],
            len: 0,
            bound,
            max_slots,
        }
    }

    /// Where the probe for a key starts. Digests are random, but a key built with
    /// `SessionKey::from_u128` need not be: both words are mixed first, so keys with a pattern
    /// do not pile into one run of slots. The mixed value is scaled to the table (no modulo).
    fn start(&self, key: Words) -> usize {
        let hi = u64::from(key[0]) << 32 | u64::from(key[1]);
        let x = (u64::from(key[2]) ^ hi.rotate_left(29)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let x = x ^ (x >> 29);
        ((u128::from(x) * self.slots.len() as u128) >> 64) as usize
    }

    fn find(&self, key: Words) -> Option<usize> {
        let n = self.slots.len();
        let mut i = self.start(key);
        loop {
            let k = self.slots[i].key;
            if k == key {
                return Some(i);
            }
            if k == EMPTY {
                return None;
            }
            i = if i + 1 == n { 0 } else { i + 1 };
        }
    }

    /// Places an entry whose key is absent; there is always a free slot.
    fn place(&mut self, entry: Entry) {
        let n = self.slots.len();
        let mut i = self.start(entry.key);
        while self.slots[i].key != EMPTY {
            i = if i + 1 == n { 0 } else { i + 1 };
        }
        self.slots[i] = entry;
        self.len += 1;
    }

    /// The entry to forget so that `key` can come in: the first idle past the timeout, else
    /// the least recently used, among the first [`SAMPLE`] entries from where `key`'s probe
    /// starts (the cache lines its lookup has just read); within one second, an entry never
    /// used since it came in goes before one that was. Sampled least-recently-used: no hand
    /// walks to slots far from anything in cache.
    fn victim_near(&mut self, key: Words, expired: impl Fn(&Entry) -> bool) -> usize {
        let n = self.slots.len();
        let mut i = self.start(key);
        let mut oldest: Option<(u32, usize)> = None;
        let mut seen = 0;
        for _ in 0..n {
            let e = &self.slots[i];
            if e.key != EMPTY {
                if expired(e) {
                    return i;
                }
                // Least recently used first; within one second, a session never used since it
                // came in before one that was.
                let age = e.seconds() << 1 | u32::from(e.stamp & REFERENCED != 0);
                if oldest.is_none_or(|(a, _)| age < a) {
                    oldest = Some((age, i));
                }
                seen += 1;
                if seen == SAMPLE {
                    break;
                }
            }
            i = if i + 1 == n { 0 } else { i + 1 };
        }
        // A full shard holds at least one entry, so the loop saw one.
        oldest.map_or(i, |(_, at)| at)
    }

    /// Removes the entry at `i`, shifting back the entries after it that may move.
    fn remove_at(&mut self, i: usize) {
        let n = self.slots.len();
        let mut hole = i;
        let mut j = i;
        loop {
            j = if j + 1 == n { 0 } else { j + 1 };
            let key = self.slots[j].key;
            if key == EMPTY {
                break;
            }
            let home = self.start(key);
            // The entry at j stays only if its home lies cyclically in (hole, j].
            let stays = if hole <= j {
                hole < home && home <= j
            } else {
                hole < home || home <= j
            };
            if !stays {
                self.slots[hole] = self.slots[j];
                hole = j;
            }
        }
        self.slots[hole] = Entry::VACANT;
        self.len -= 1;
    }

    /// Makes room for one more entry below three quarters' load, up to `max_slots`.
    fn grow_for_one_more(&mut self) {
        let n = self.slots.len();
        if (self.len + 1) * 4 <= n * 3 || n >= self.max_slots {
            return;
        }
        let old = std::mem::replace(
            &mut self.slots,
            vec![Entry::VACANT; (n * 2).min(self.max_slots)],
        );
        self.len = 0;
        for e in old.into_iter().filter(|e| e.key != EMPTY) {
            self.place(e);
        }
    }
}

/// The in-process session table.
#[derive(Debug)]
pub(crate) struct SessionTable {
    shards: Box<[Mutex<Shard>]>,
    shard_mask: u64,
    idle_secs: u32,
}

fn words(key: SessionKey) -> Words {
    // The key times an odd number (no two keys give one product), of which the top 96 bits
    // are kept: every bit of the key moves them, so two keys alike in those bits have
    // differences no key built from numbers with a pattern has (one pair in 2^96, as for
    // digests). A key whose words kept are all zero (the number 0, among others) would read
    // as an empty slot: it stands in as words no number with a pattern gives.
    let x = key.to_u128().wrapping_mul(MIX);
    match [(x >> 96) as u32, (x >> 64) as u32, (x >> 32) as u32] {
        EMPTY => STAND_IN,
        w => w,
    }
}

/// The odd number a key is multiplied by before its top 96 bits are kept: digits with no
/// pattern.
const MIX: u128 = 0x2360_ed05_1fc6_5da4_4385_df64_9fcc_f645;

/// The words kept for a key whose words are all zero: digits with no pattern, so that no key
/// built from a small number shares them.
const STAND_IN: Words = [0x85eb_ca6b, 0xc2b2_ae35, 0x27d4_eb2f];

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
                .map(|_| Mutex::new(Shard::new(per_shard)))
                .collect(),
            shard_mask: shards as u64 - 1,
            idle_secs: u32::try_from(config.idle_timeout.as_secs()).unwrap_or(u32::MAX),
        }
    }

    fn stamp(now_ms: u64) -> u32 {
        u32::try_from(now_ms / 1000)
            .unwrap_or(u32::MAX)
            .min(REFERENCED - 1)
    }

    fn shard(&self, key: SessionKey) -> &Mutex<Shard> {
        // Digests are random, but a key built with `SessionKey::from_u128` need not be: both
        // words are mixed (otherwise than for the slot, see `Shard::start`), so that keys with
        // a pattern spread over every shard instead of filling one while the others stay empty.
        let x = key.hi64() ^ key.lo64().rotate_left(32);
        let x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        let x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        &self.shards[((x >> 58) & self.shard_mask) as usize]
    }

    fn expired(&self, e: &Entry, now: u32) -> bool {
        now.saturating_sub(e.seconds()) > self.idle_secs
    }
}

impl SessionStore for SessionTable {
    fn get(&self, key: SessionKey, now_ms: u64) -> Option<HomeEntry> {
        let now = Self::stamp(now_ms);
        let w = words(key);
        let mut shard = self.shard(key).lock();
        let i = shard.find(w)?;
        let e = &mut shard.slots[i];
        if self.expired(e, now) {
            return None;
        }
        e.stamp = now | REFERENCED;
        Some(e.home)
    }

    fn put(&self, key: SessionKey, home: HomeEntry, now_ms: u64) {
        let now = Self::stamp(now_ms);
        let mut entry = Entry {
            key: words(key),
            home,
            stamp: now,
        };
        let mut shard = self.shard(key).lock();
        let shard = &mut *shard;
        if let Some(i) = shard.find(entry.key) {
            // A session placed again is in use.
            entry.stamp |= REFERENCED;
            shard.slots[i] = entry;
            return;
        }
        if shard.len >= shard.bound {
            let victim = shard.victim_near(entry.key, |e| self.expired(e, now));
            shard.remove_at(victim);
        }
        shard.grow_for_one_more();
        shard.place(entry);
    }

    fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len).sum()
    }

    fn memory_bytes(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().slots.capacity() * std::mem::size_of::<Entry>())
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
            tip: 0,
            node: 0,
            mark: 0,
        }
    }

    #[test]
    fn an_entry_is_found_after_put() {
        let t = SessionTable::new(Sessions::new().max_entries(10));
        let now = 1_000u64;
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
        let now = 1_000u64;
        for n in 0..50_000 {
            t.put(key(n), home(0), now);
        }
        assert!(t.len() <= 5000, "{}", t.len());
        assert!(t.len() >= 4096);
    }

    impl SessionTable {
        /// Whether the table holds `key`, without marking it used.
        fn holds(&self, key: SessionKey) -> bool {
            self.shard(key).lock().find(words(key)).is_some()
        }
    }

    #[test]
    fn recently_used_entries_survive_eviction() {
        let t = SessionTable::new(Sessions::new().max_entries(4));
        for n in 0..4 {
            t.put(key(n), home(n as u32), 1_000);
        }
        // Full: the search sees all four (the whole shard), and one of them goes.
        t.put(key(10), home(10), 2_000);
        let survivors: Vec<u64> = (0..4).filter(|&n| t.holds(key(n))).collect();
        assert_eq!(survivors.len(), 3);
        // Use two of the three; the third is now the least recently used.
        let (a, b, c) = (survivors[0], survivors[1], survivors[2]);
        t.get(key(a), 3_000);
        t.get(key(b), 3_000);
        t.put(key(11), home(11), 3_000);
        assert!(t.holds(key(a)) && t.holds(key(b)));
        assert!(t.holds(key(10)) && t.holds(key(11)));
        assert!(!t.holds(key(c)), "the least recently used entry is evicted");
        assert_eq!(t.len(), 4);
    }

    #[test]
    fn sessions_in_use_outlive_a_stream_of_one_off_keys() {
        // 200 sessions take a turn every round; between two rounds 300 one-off keys pass
        // through a table of 1,000. A least-recently-used table keeps every session in use;
        // the sampled one must keep nearly all of them, with rounds a second apart and with
        // every round in the same second.
        for step_ms in [1_000u64, 0] {
            let t = SessionTable::new(Sessions::new().max_entries(1000));
            let mut now = 1_000u64;
            let mut one_off = 1u64 << 32;
            for _ in 0..100 {
                for s in 0..200 {
                    if t.get(key(s), now).is_none() {
                        t.put(key(s), home(0), now);
                    }
                }
                for _ in 0..300 {
                    t.put(key(one_off), home(1), now);
                    one_off += 1;
                }
                now += step_ms;
            }
            let kept = (0..200).filter(|&s| t.holds(key(s))).count();
            assert!(
                kept >= 196,
                "kept {kept} of 200 sessions in use ({step_ms} ms a round)"
            );
            assert!(t.len() <= 1000);
        }
    }

    #[test]
    fn idle_entries_are_forgotten() {
        let t = SessionTable::new(Sessions::new().idle_timeout(Duration::from_secs(60)));
        let now = 1_000u64;
        t.put(key(1), home(1), now);
        assert!(t.get(key(1), now + 60_000).is_some());
        assert_eq!(t.get(key(1), now + 122_000), None);
    }

    #[test]
    fn keys_from_small_numbers_are_sessions_of_their_own() {
        // The entry keeps 96 bits of a key; keys that differ only in their low word are not
        // one session.
        let t = SessionTable::new(Sessions::new());
        let now = 1_000u64;
        for k in 1..=500u32 {
            t.put(SessionKey::from_u128(u128::from(k)), home(k), now);
        }
        assert_eq!(t.len(), 500);
        for k in 1..=500u32 {
            let got = t
                .get(SessionKey::from_u128(u128::from(k)), now)
                .map(|h| h.backend);
            assert_eq!(got, Some(k));
        }
    }

    #[test]
    fn the_key_zero_is_no_other_small_numbers_session() {
        // The key 0 keeps all-zero words, which mark an empty slot; the words it stands in as
        // must not be those of another key built from a small number (2^32 keeps [0, 0, 1]).
        let t = SessionTable::new(Sessions::new().max_entries(10));
        let now = 1_000u64;
        t.put(SessionKey::from_u128(0), home(1), now);
        assert_eq!(t.get(SessionKey::from_u128(1 << 32), now), None);
        t.put(SessionKey::from_u128(1 << 32), home(2), now);
        assert_eq!(t.get(SessionKey::from_u128(0), now), Some(home(1)));
        assert_eq!(t.get(SessionKey::from_u128(1 << 32), now), Some(home(2)));
        assert_eq!(t.len(), 2);
    }

    #[test]
    fn a_small_number_in_the_top_word_is_not_the_same_number_in_the_low_word() {
        // Keys laid out as a number in the top 32 bits and another in the low 32 bits
        // (`a << 96 | b`) are sessions of their own: 1 << 96 is not 1, nor (1 << 96) | 1 the key 0.
        let t = SessionTable::new(Sessions::new().max_entries(10));
        let now = 1_000u64;
        let keys = [0u128, 1, 1 << 96, (1 << 96) | 1, 2 << 96, (2 << 96) | 3];
        for (i, &k) in keys.iter().enumerate() {
            t.put(SessionKey::from_u128(k), home(i as u32), now);
        }
        assert_eq!(t.len(), 6);
        for (i, &k) in keys.iter().enumerate() {
            assert_eq!(
                t.get(SessionKey::from_u128(k), now),
                Some(home(i as u32)),
                "{k:#x}"
            );
        }
    }

    #[test]
    fn keys_of_two_numbers_are_sessions_of_their_own_whatever_the_numbers() {
        // Keys laid out as `a << 96 | b` whose kept words would be alike if the low word were
        // folded into the top one by a fixed map (175 against `11_547 << 96 | 50_724`, for
        // one): each is a session of its own, in a table of one shard.
        let t = SessionTable::new(Sessions::new().max_entries(100));
        let now = 1_000u64;
        let pairs: [(u128, u128); 4] = [
            (175, 11_547 << 96 | 50_724),
            (875, 11_547 << 96 | 51_424),
            (203, 11_547 << 96 | 50_752),
            (7 << 96 | 591, (7 ^ 11_547) << 96 | 51_140),
        ];
        let keys: Vec<u128> = pairs.iter().flat_map(|&(a, b)| [a, b]).collect();
        for (i, &k) in keys.iter().enumerate() {
            t.put(SessionKey::from_u128(k), home(i as u32), now);
        }
        assert_eq!(t.len(), keys.len());
        for (i, &k) in keys.iter().enumerate() {
            assert_eq!(
                t.get(SessionKey::from_u128(k), now),
                Some(home(i as u32)),
                "{k:#x}"
            );
        }
    }

    #[test]
    fn keys_from_small_numbers_spread_over_every_shard() {
        // A table of 100,000 has many shards, each bounded; keys with a pattern must not all
        // land in one of them, where the shard's bound would forget most of them.
        let t = SessionTable::new(Sessions::new().max_entries(100_000));
        assert!(t.shards.len() > 1);
        for k in 1..=45_000u32 {
            t.put(SessionKey::from_u128(u128::from(k)), home(k), 1_000);
            t.put(SessionKey::from_u128(u128::from(k) << 64), home(k), 1_000);
        }
        assert_eq!(t.len(), 90_000);
    }

    #[test]
    fn a_full_table_costs_under_100_bytes_a_session() {
        let n = 200_000;
        let t = SessionTable::new(Sessions::new().max_entries(n));
        let now = 1_000u64;
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
    fn entry_is_32_bytes() {
        assert_eq!(std::mem::size_of::<Entry>(), 32);
    }

    #[test]
    fn removal_keeps_every_other_entry_findable() {
        // A tiny shard forces long probe runs that wrap around the end.
        let mut shard = Shard::new(12);
        let keys: Vec<Words> = (1..=12u32)
            .map(|k| [k, k.wrapping_mul(0x9e37_79b9), 7])
            .collect();
        for (i, &k) in keys.iter().enumerate() {
            shard.grow_for_one_more();
            shard.place(Entry {
                key: k,
                home: home(i as u32),
                stamp: 0,
            });
        }
        for victim in [3usize, 0, 11, 6] {
            let at = shard.find(keys[victim]).unwrap();
            shard.remove_at(at);
            assert_eq!(shard.find(keys[victim]), None);
        }
        for (i, &k) in keys.iter().enumerate() {
            if ![3usize, 0, 11, 6].contains(&i) {
                let at = shard.find(k).unwrap_or_else(|| panic!("lost key {i}"));
                assert_eq!(shard.slots[at].home, home(i as u32));
            }
        }
        assert_eq!(shard.len, 8);
    }

    #[test]
    fn sessions_placed_again_within_a_second_outlive_a_stream_of_one_off_keys() {
        // Every turn of a session in use looks its home up and records where it went, as the
        // service does, all within one second: the record keeps it marked in use.
        let t = SessionTable::new(Sessions::new().max_entries(1000));
        let now = 1_000u64;
        let mut one_off = 1u64 << 32;
        for _ in 0..100 {
            for s in 0..200 {
                let _ = t.get(key(s), now);
                t.put(key(s), home(0), now);
            }
            for _ in 0..300 {
                t.put(key(one_off), home(1), now);
                one_off += 1;
            }
        }
        let kept = (0..200).filter(|&s| t.holds(key(s))).count();
        assert!(kept >= 196, "kept {kept} of 200 sessions in use");
    }

    #[test]
    fn every_word_a_key_keeps_moves_where_its_probe_starts() {
        // Keys with a pattern must not share one run of slots: a change in any one of the
        // three words an entry keeps moves where its probe starts, whatever the other two hold.
        let mut shard = Shard::new(1 << 16);
        shard.slots = vec![Entry::VACANT; 1 << 12];
        for others in [0u32, u32::MAX] {
            for word in 0..3 {
                let starts: std::collections::HashSet<usize> = (1..=64u32)
                    .map(|v| {
                        let mut w = [others; 3];
                        w[word] = v;
                        shard.start(w)
                    })
                    .collect();
                assert!(
                    starts.len() >= 48,
                    "word {word} among {others:#x}: {} starts for 64 keys",
                    starts.len()
                );
            }
        }
    }

    /// Places session `k` (its key `k` as a number, its home `home(k)`) in `shard`, last used
    /// at `stamp`, growing the shard first as the table does.
    fn place_numbered(shard: &mut Shard, k: u32, stamp: u32) {
        shard.grow_for_one_more();
        shard.place(Entry {
            key: words(SessionKey::from_u128(u128::from(k))),
            home: home(k),
            stamp,
        });
    }

    /// A shard of 40 entries, all last used at second 100, and a key to place in it with the
    /// slots held from where its probe starts, in probe order.
    fn shard_of_forty() -> (Shard, Words, Vec<usize>) {
        let mut shard = Shard::new(64);
        for k in 1..=40 {
            place_numbered(&mut shard, k, 100);
        }
        let new = words(SessionKey::from_u128(1_000));
        let n = shard.slots.len();
        let held: Vec<usize> = (0..n)
            .map(|d| (shard.start(new) + d) % n)
            .filter(|&i| shard.slots[i].key != EMPTY)
            .collect();
        assert!(held.len() > SAMPLE);
        (shard, new, held)
    }

    #[test]
    fn an_eviction_looks_only_at_the_entries_next_to_where_the_key_goes() {
        // The least recently used entry of the shard lies past the sample: it stays, and the
        // oldest entry among the first eight from the new key's start goes.
        let (mut shard, new, held) = shard_of_forty();
        let (in_sample, past_it) = (held[SAMPLE - 1], held[SAMPLE]);
        shard.slots[in_sample].stamp = 50;
        shard.slots[past_it].stamp = 1;
        assert_eq!(shard.victim_near(new, |_| false), in_sample);
    }

    #[test]
    fn an_entry_used_again_a_second_earlier_goes_before_one_never_used_again() {
        // The "used again" bit orders entries only within one second.
        let (mut shard, new, held) = shard_of_forty();
        shard.slots[held[0]].stamp = 101;
        shard.slots[held[1]].stamp = 100 | REFERENCED;
        for &i in &held[2..SAMPLE] {
            shard.slots[i].stamp = 200;
        }
        assert_eq!(shard.victim_near(new, |_| false), held[1]);
    }

    #[test]
    fn a_shard_doubles_only_when_it_would_pass_three_quarters_load() {
        let mut shard = Shard::new(10_000);
        for k in 1..=5_000 {
            place_numbered(&mut shard, k, 0);
            let n = shard.slots.len();
            assert!(shard.len * 4 <= n * 3, "{} entries in {n} slots", shard.len);
            assert!(
                n == 16 || shard.len * 8 > n * 3,
                "{} entries in {n} slots",
                shard.len
            );
        }
    }

    #[test]
    fn the_table_counts_its_slots_at_32_bytes_each_and_its_own_parts() {
        let t = SessionTable::new(Sessions::new().max_entries(100_000));
        for n in 0..5_000 {
            t.put(key(n), home(0), 1_000);
        }
        let slots: usize = t.shards.iter().map(|s| s.lock().slots.len()).sum();
        assert_eq!(
            t.memory_bytes(),
            slots * 32
                + std::mem::size_of::<SessionTable>()
                + t.shards.len() * std::mem::size_of::<Mutex<Shard>>()
        );
    }

    #[test]
    fn a_session_put_at_the_end_of_the_clock_is_found_then() {
        // Seconds past 2^31 - 1 stay at 2^31 - 1: they do not reach the "used again" bit.
        let t = SessionTable::new(
            Sessions::new()
                .max_entries(10)
                .idle_timeout(Duration::from_secs(60)),
        );
        t.put(key(1), home(1), u64::MAX);
        assert_eq!(t.get(key(1), u64::MAX), Some(home(1)));
    }

    #[test]
    fn keys_whose_products_differ_only_in_the_second_or_third_word_kept_are_two_sessions() {
        // All 96 bits kept count: keys whose products with the mixing number are alike but in
        // bit 64, or in bit 32, are sessions of their own.
        let mut inverse = MIX;
        for _ in 0..7 {
            inverse = inverse.wrapping_mul(2u128.wrapping_sub(MIX.wrapping_mul(inverse)));
        }
        assert_eq!(MIX.wrapping_mul(inverse), 1);
        let t = SessionTable::new(Sessions::new().max_entries(10));
        let now = 1_000u64;
        let keys = [
            1u128,
            1u128.wrapping_add((1u128 << 64).wrapping_mul(inverse)),
            1u128.wrapping_add((1u128 << 32).wrapping_mul(inverse)),
        ];
        for (i, &k) in keys.iter().enumerate() {
            t.put(SessionKey::from_u128(k), home(i as u32), now);
        }
        for (i, &k) in keys.iter().enumerate() {
            assert_eq!(t.get(SessionKey::from_u128(k), now), Some(home(i as u32)));
        }
    }

    mod model {
        use std::collections::HashMap;

        use proptest::prelude::*;

        use super::*;

        /// Keys a table meets: digests, and numbers given to `SessionKey::from_u128`.
        fn keys() -> Vec<SessionKey> {
            let mut k: Vec<SessionKey> = (0..6u64).map(key).collect();
            k.extend(
                [
                    0u128,
                    1,
                    2,
                    1 << 32,
                    1 << 64,
                    1 << 96,
                    (1 << 96) | 1,
                    u128::MAX,
                ]
                .map(SessionKey::from_u128),
            );
            k
        }

        #[derive(Clone, Debug)]
        enum Op {
            Put(usize, u32),
            Get(usize),
            Advance(u64),
        }

        fn op(n: usize) -> impl Strategy<Value = Op> {
            prop_oneof![
                3 => (0..n, 0..4u32).prop_map(|(k, b)| Op::Put(k, b)),
                3 => (0..n).prop_map(Op::Get),
                1 => prop_oneof![Just(0u64), Just(1), Just(999), Just(1_000), Just(1_001), 0..5_000u64]
                    .prop_map(Op::Advance),
            ]
        }

        fn timeout() -> impl Strategy<Value = Duration> {
            prop_oneof![
                Just(Duration::ZERO),
                Just(Duration::from_millis(500)),
                Just(Duration::from_secs(1)),
                Just(Duration::from_secs(2)),
                Just(Duration::MAX),
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

            /// Against a map of key to home and time last used: the table answers a home only
            /// if it is the key's own last one, used no longer ago than the timeout in whole
            /// seconds; with room for every key it forgets nothing else; a home just recorded
            /// is found; it never holds more than its bound.
            #[test]
            fn the_table_answers_what_a_map_with_times_answers(
                bound in prop_oneof![Just(1usize), Just(2), Just(3), Just(7), Just(14), Just(1_000), Just(5_000)],
                idle in timeout(),
                start_ms in prop_oneof![Just(0u64), Just(1), Just(999), 0..10_000u64],
                ops in proptest::collection::vec(op(14), 1..120),
            ) {
                let keys = keys();
                let t = SessionTable::new(Sessions::new().max_entries(bound).idle_timeout(idle));
                let idle_secs = idle.as_secs();
                let mut model: HashMap<usize, (HomeEntry, u64)> = HashMap::new();
                let mut now = start_ms;
                let live = |then: u64, now: u64| now / 1000 - then / 1000 <= idle_secs;
                for op in ops {
                    match op {
                        Op::Put(k, b) => {
                            t.put(keys[k], home(b), now);
                            model.insert(k, (home(b), now));
                            prop_assert_eq!(t.get(keys[k], now), Some(home(b)));
                        }
                        Op::Get(k) => {
                            let want = model
                                .get(&k)
                                .filter(|&&(_, then)| live(then, now))
                                .map(|&(h, _)| h);
                            let got = t.get(keys[k], now);
                            if bound >= keys.len() {
                                prop_assert_eq!(got, want, "key {}", k);
                            } else if got.is_some() {
                                prop_assert_eq!(got, want, "key {}", k);
                            }
                            match got {
                                Some(h) => model.insert(k, (h, now)),
                                None => model.remove(&k),
                            };
                        }
                        Op::Advance(ms) => now += ms,
                    }
                    prop_assert!(t.len() <= bound, "{} entries, bound {}", t.len(), bound);
                }
            }
        }

        #[derive(Clone, Debug)]
        enum ShardOp {
            /// Places the key (evicting one near it if the shard is full), or uses it again.
            Put(u32, u32),
            /// Removes the key if it is held.
            Remove(u32),
        }

        fn shard_op() -> impl Strategy<Value = ShardOp> {
            prop_oneof![
                3 => (1..40u32, 0..1_000u32).prop_map(|(k, s)| ShardOp::Put(k, s)),
                1 => (1..40u32).prop_map(ShardOp::Remove),
            ]
        }

        /// Words of a key: small numbers, so that their probes start anywhere.
        fn shard_key(k: u32) -> Words {
            words(SessionKey::from_u128(u128::from(k)))
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

            /// Against a map, through puts, evictions and removals in a small shard whose
            /// probe runs are long and wrap around its end: every key held is found with its
            /// own entry, no key taken out is, the count is the number of entries held, and
            /// every entry lies in an unbroken run from where its probe starts.
            #[test]
            fn a_shard_finds_every_key_it_holds_after_evictions_and_removals(
                bound in 1usize..=24,
                ops in proptest::collection::vec(shard_op(), 1..200),
            ) {
                let mut shard = Shard::new(bound);
                let mut model: HashMap<u32, u32> = HashMap::new();
                for op in ops {
                    match op {
                        ShardOp::Put(k, s) => {
                            let w = shard_key(k);
                            let entry = Entry { key: w, home: home(k), stamp: s };
                            if let Some(i) = shard.find(w) {
                                shard.slots[i] = entry;
                            } else {
                                if shard.len >= shard.bound {
                                    let at = shard.victim_near(w, |_| false);
                                    let gone = shard.slots[at].key;
                                    let (&g, _) = model
                                        .iter()
                                        .find(|&(&m, _)| shard_key(m) == gone)
                                        .expect("the victim is a key held");
                                    model.remove(&g);
                                    shard.remove_at(at);
                                }
                                shard.grow_for_one_more();
                                shard.place(entry);
                            }
                            model.insert(k, s);
                        }
                        ShardOp::Remove(k) => {
                            if let Some(i) = shard.find(shard_key(k)) {
                                shard.remove_at(i);
                            }
                            model.remove(&k);
                        }
                    }
                    prop_assert!(shard.len <= bound);
                    prop_assert_eq!(shard.len, model.len());
                    let held = shard.slots.iter().filter(|e| e.key != EMPTY).count();
                    prop_assert_eq!(held, shard.len);
                    for k in 1..40u32 {
                        let got = shard.find(shard_key(k)).map(|i| shard.slots[i]);
                        match model.get(&k) {
                            Some(&s) => {
                                let e = got.expect("a key held is found");
                                prop_assert_eq!(e.home, home(k));
                                prop_assert_eq!(e.stamp, s);
                            }
                            None => prop_assert!(got.is_none(), "key {} was taken out", k),
                        }
                    }
                    let n = shard.slots.len();
                    for (i, e) in shard.slots.iter().enumerate() {
                        if e.key == EMPTY {
                            continue;
                        }
                        let mut j = shard.start(e.key);
                        while j != i {
                            prop_assert!(shard.slots[j].key != EMPTY, "a gap before slot {}", i);
                            j = if j + 1 == n { 0 } else { j + 1 };
                        }
                    }
                }
            }
        }
    }
}
