//! The cache model: which prompt-chain links a backend probably still holds.
//!
//! Every dispatched request's [`PromptChain`] is recorded on the backend it went to, once the
//! request is on its way there (a [`Record`], settled by its response future). The links
//! form a tree (a link's parent is the link before it in its chain, since a digest covers its
//! whole prefix); the model keeps the tree within the backend's declared budget of tokens
//! (its slots' KV plus its host-memory prompt cache), evicting the least recently used *leaf*
//! first, as llama.cpp drops whole least recently used prompt states. Evicting leaves only
//! keeps what a backend holds closed under prefixes: if it holds a link it holds every link
//! before it, so the longest prefix held is found by binary search.
//!
//! The leaves are the tips of the conversations the backend served: their count is how many
//! conversations it homes, which is what new conversations are spread by. A link with more than
//! one child is a prefix several conversations share.
//!
//! Memory: a tracked link costs its 32-byte node, the 4-byte stamp of the record that first
//! recorded it, and its index entry: 71 to 76 bytes as measured with the index's load (see
//! `BENCHMARKS.md`), 69 at the bound. A backend tracks at most one link per 16 tokens of the
//! budget its model keeps to (at least 1,024): the declared one, grown up to twice it while the
//! backend's answers show it holds more (see [`CacheModel::correct`]). So the model of a
//! backend with the default budget stays under 770 KB at its 8,192 links (565 KB measured at
//! the bound), and under 1.1 MB at 16,384 once its answers have grown its budget to twice the
//! declared one (1,057 KB measured). A backend that has evicted also keeps its last 256
//! evictions, 8 KiB, to put back what a prompt it refused evicted, and counts its leaves by when
//! they were last recorded (792 bytes), so that the conversations still going on can be told
//! from those long ended.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};

use crate::chain::{Link, PromptChain};
use crate::learn::Prediction;

const NONE: u32 = u32::MAX;
/// The bits of [`Node::tokens`] that count its tokens; the top bit is [`RESENT`].
const TOKENS: u32 = u32::MAX >> 1;
/// Set in [`Node::tokens`] on a tip recorded again whole: a prompt sent whole more than once.
const RESENT: u32 = !TOKENS;

/// One tracked link.
#[derive(Clone, Copy, Debug)]
struct Node {
    digest: u64,
    /// Tokens of this link alone (its chain's tokens up to it, less its parent's), in the
    /// bits of [`TOKENS`]; the top bit, [`RESENT`], marks a tip on which a prompt was recorded
    /// whole a second time. Sharing the field keeps a node at 32 bytes.
    tokens: u32,
    parent: u32,
    children: u32,
    /// The leaf list, most recently used first (only while `children == 0`).
    prev: u32,
    next: u32,
    /// When a chain through this link last ended here or below (the stamp of that record,
    /// see [`ModelCell::reserve`]): set on the links a record adds or passes from its
    /// deepest known link down, never lowered.
    stamp: u32,
}

/// Where each tracked link's node is: open addressing with linear probing over (digest, node)
/// pairs. Digests are uniformly random already, so they are used as they are. A removal shifts
/// the entries after it back, so that no tombstones build up: a steady churn of links recorded
/// and evicted never rehashes, where a general-purpose map would every so often.
#[derive(Debug)]
struct Index {
    slots: Vec<Slot>,
    len: usize,
}

/// 12 bytes: packed to four-byte alignment, so that the index costs 16 to 32 bytes a link.
#[derive(Clone, Copy)]
#[repr(C, packed(4))]
struct Slot {
    /// The digest, never 0 (0 marks an empty slot).
    key: u64,
    node: u32,
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (key, node) = (self.key, self.node);
        f.debug_struct("Slot")
            .field("key", &key)
            .field("node", &node)
            .finish()
    }
}

const EMPTY: Slot = Slot { key: 0, node: 0 };

/// A digest as the index keys it: 0 is taken as 1, a collision that costs at most one
/// mispredicted link.
fn key_of(digest: u64) -> u64 {
    digest.max(1)
}

impl Index {
    fn new() -> Self {
        Index {
            slots: vec![EMPTY; 16],
            len: 0,
        }
    }

    /// An empty index that takes `n` entries without growing: at most three quarters full.
    fn with_room_for(n: usize) -> Self {
        let slots = (n.saturating_mul(4) / 3 + 1).next_power_of_two().max(16);
        Index {
            slots: vec![EMPTY; slots],
            len: 0,
        }
    }

    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    fn start(&self, key: u64) -> usize {
        (key ^ (key >> 32)) as usize & self.mask()
    }

    fn find(&self, digest: u64) -> Result<usize, usize> {
        let key = key_of(digest);
        let mut i = self.start(key);
        loop {
            let k = self.slots[i].key;
            match k {
                _ if k == key => return Ok(i),
                0 => return Err(i),
                _ => i = (i + 1) & self.mask(),
            }
        }
    }

    fn get(&self, digest: u64) -> Option<u32> {
        self.find(digest).ok().map(|i| self.slots[i].node)
    }

    fn contains(&self, digest: u64) -> bool {
        self.find(digest).is_ok()
    }

    /// The node of `digest`, or the slot to put it in (one probe for both).
    fn entry(&mut self, digest: u64) -> Result<u32, usize> {
        // At most three quarters full, so probes stay short.
        if (self.len + 1) * 4 > self.slots.len() * 3 {
            self.grow();
        }
        self.find(digest).map(|i| self.slots[i].node)
    }

    /// Puts `digest` in the empty slot [`entry`](Self::entry) gave.
    fn fill(&mut self, slot: usize, digest: u64, node: u32) {
        self.slots[slot] = Slot {
            key: key_of(digest),
            node,
        };
        self.len += 1;
    }

    #[cfg(test)]
    fn insert(&mut self, digest: u64, node: u32) {
        if let Err(slot) = self.entry(digest) {
            self.fill(slot, digest, node);
        }
    }

    fn remove(&mut self, digest: u64) {
        let Ok(mut hole) = self.find(digest) else {
            return;
        };
        let mask = self.mask();
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let slot = self.slots[j];
            if slot.key == 0 {
                break;
            }
            // An entry moves back into the hole unless its probe starts after the hole and
            // at or before where it stands (cyclically).
            let home = self.start(slot.key);
            let stays = if hole <= j {
                hole < home && home <= j
            } else {
                hole < home || home <= j
            };
            if !stays {
                self.slots[hole] = slot;
                hole = j;
            }
        }
        self.slots[hole] = EMPTY;
        self.len -= 1;
    }

    fn grow(&mut self) {
        let doubled = vec![EMPTY; self.slots.len() * 2];
        let old = std::mem::replace(&mut self.slots, doubled);
        self.len = 0;
        for slot in old.into_iter().filter(|s| s.key != 0) {
            let Err(i) = self.find(slot.key) else {
                continue;
            };
            self.slots[i] = slot;
            self.len += 1;
        }
    }

    fn len(&self) -> usize {
        self.len
    }

    fn memory_bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<Slot>()
    }
}

/// A link the model evicted, as [`CacheModel::refused`] needs it to put it back: 32 bytes.
#[derive(Clone, Copy, Debug)]
struct Evicted {
    digest: u64,
    /// The link before it, or its own digest for a link that starts a chain (no link is
    /// held under a link with its own digest: [`CacheModel::add`] goes on from the one held).
    parent: u64,
    /// [`Node::tokens`], with its mark.
    tokens: u32,
    stamp: u32,
    /// The stamp of the record that first recorded it (see [`CacheModel::born`]).
    born: u32,
    /// The stamp of the record whose room it made.
    by: u32,
}

/// The last [`LEN`](Self::LEN) links evicted to make room for records, oldest overwritten
/// first.
#[derive(Debug, Default)]
struct EvictionLog {
    entries: Vec<Evicted>,
    /// Where the next entry goes, once the log is full.
    next: usize,
}

impl EvictionLog {
    /// Entries kept: a refused prompt puts back at most this many links it evicted.
    const LEN: usize = 256;

    fn push(&mut self, e: Evicted) {
        if self.entries.len() < Self::LEN {
            if self.entries.is_empty() {
                self.entries.reserve_exact(Self::LEN);
            }
            self.entries.push(e);
        } else {
            self.entries[self.next] = e;
            self.next = (self.next + 1) % Self::LEN;
        }
    }

    /// The entries made for the record stamped `by`, newest first, taken out of the log.
    fn take_by(&mut self, by: u32) -> Vec<Evicted> {
        let n = self.entries.len();
        let mut taken = Vec::new();
        for k in (0..n).rev() {
            let e = &mut self.entries[(self.next + k) % n];
            if e.by == by {
                taken.push(*e);
                // Taken: no stamp is 0.
                e.by = 0;
            }
        }
        taken
    }

    fn memory_bytes(&self) -> usize {
        self.entries.capacity() * std::mem::size_of::<Evicted>()
    }
}

/// One backend's model.
#[derive(Debug)]
pub(crate) struct CacheModel {
    index: Index,
    nodes: Vec<Node>,
    /// The stamp of the record that first recorded each node, or of one stamped earlier
    /// that sent it too and was recorded after (see [`touch`](Self::touch)), by node, as
    /// `nodes`: apart, so that a node stays at 32 bytes, and read once a request (see
    /// [`Known::born`]).
    born: Vec<u32>,
    free: Vec<u32>,
    /// Most and least recently used leaf.
    head: u32,
    tail: u32,
    leaves: u32,
    tokens: u64,
    /// The budget the model keeps to: the declared one, or more where the backend's answers
    /// showed it holding more (see [`correct`](Self::correct)).
    budget: u64,
    /// The backend's declared budget.
    declared: u64,
    max_blocks: usize,
    /// The links evicted last, and by which record: what a record the backend refused puts
    /// back (see [`refused`](Self::refused)). Allocated at the first eviction.
    log: EvictionLog,
    evicted: u64,
    /// The latest stamp recorded.
    clock: u32,
    /// The latest stamp of a link evicted (0 before any): nothing recorded later has gone.
    evicted_through: u32,
    /// The stamps of the latest records the backend did not take (0: none), so that the
    /// next turn of a session whose last turn was refused is not taken for a compaction.
    refusals: [u32; REFUSALS],
    /// How many leaves were last recorded when: the conversations with a turn lately.
    recent: Recent,
}

/// The leaves counted by when they were last recorded, in buckets of [`Recent::GRAIN_S`]
/// seconds on the fleet's clock, the latest [`Recent::LEN`] of them (at least ten minutes),
/// 792 bytes. A bucket begins at a record's stamp and time, the stamp later than any recorded
/// before; a leaf counts in the bucket its stamp falls in, and leaves it when it gains a
/// child, is recorded again or is evicted. A leaf older than the oldest bucket counts in
/// none: its conversation had no turn for ten minutes. The buckets from the one a count last
/// started at are kept added up as leaves come and go, so that a count moves on from the
/// last one: O(1) a change and, amortized, a count.
#[derive(Debug)]
struct Recent {
    /// Bucket `n` of those begun is at `n % LEN` while it is one of the latest `LEN`.
    buckets: [Bucket; Recent::LEN],
    /// Buckets begun so far.
    begun: u64,
    /// The bucket the last count started at, never older than the oldest kept.
    from: u64,
    /// The leaves of that bucket and of those after it.
    counted: u32,
}

#[derive(Clone, Copy, Debug, Default)]
struct Bucket {
    /// Seconds of the fleet's clock it began at.
    secs: u32,
    /// The stamp of the record that began it: leaves stamped from it on (to the next
    /// bucket's) count here.
    first: u32,
    leaves: u32,
}

impl Default for Recent {
    fn default() -> Self {
        Recent {
            buckets: [Bucket::default(); Recent::LEN],
            begun: 0,
            from: 0,
            counted: 0,
        }
    }
}

impl Recent {
    const LEN: usize = 64;
    const GRAIN_S: u32 = 10;

    fn bucket(&self, n: u64) -> &Bucket {
        &self.buckets[(n % Self::LEN as u64) as usize]
    }

    fn bucket_mut(&mut self, n: u64) -> &mut Bucket {
        &mut self.buckets[(n % Self::LEN as u64) as usize]
    }

    /// The oldest bucket kept.
    fn oldest(&self) -> u64 {
        self.begun.saturating_sub(Self::LEN as u64)
    }

    /// A record stamped `stamp` sent at `now_ms`, on a model whose latest stamp recorded is
    /// `clock` (0: none): begins a bucket if the newest is [`GRAIN_S`](Self::GRAIN_S) old and
    /// `stamp` is later than `clock`, in the place of the oldest. A bucket so begun holds no
    /// leaf yet, so a leaf stays in the bucket it was counted in. A record stamped before the
    /// newest bucket began counts in an older one, by its stamp.
    fn note(&mut self, now_ms: u64, stamp: u32, clock: u32) {
        if clock != 0 && !later(stamp, clock) {
            return;
        }
        let secs = u32::try_from(now_ms / 1_000).unwrap_or(u32::MAX);
        if self.begun > 0 {
            let newest = self.bucket(self.begun - 1);
            if secs < newest.secs.saturating_add(Self::GRAIN_S) || !later(stamp, newest.first) {
                return;
            }
        }
        if self.begun >= Self::LEN as u64 {
            let gone = self.begun - Self::LEN as u64;
            if self.from == gone {
                self.counted = self.counted.saturating_sub(self.bucket(gone).leaves);
                self.from = gone + 1;
            }
        }
        let n = self.begun;
        *self.bucket_mut(n) = Bucket {
            secs,
            first: stamp,
            leaves: 0,
        };
        self.begun += 1;
    }

    /// The bucket a leaf stamped `stamp` counts in, if any: the newest first, where a leaf
    /// just recorded counts; then the oldest, where the least recently used leaves, which
    /// evictions take, count, if they count at all; else by binary search, the buckets
    /// beginning at stamps in order.
    #[inline]
    fn find(&self, stamp: u32) -> Option<u64> {
        if self.begun == 0 {
            return None;
        }
        let newest = self.begun - 1;
        if !later(self.bucket(newest).first, stamp) {
            return Some(newest);
        }
        let oldest = self.oldest();
        if later(self.bucket(oldest).first, stamp) {
            return None;
        }
        // The first of bucket `lo` is at or before `stamp`, that of `hi` after it.
        let (mut lo, mut hi) = (oldest, newest);
        if later(self.bucket(lo + 1).first, stamp) {
            return Some(lo);
        }
        lo += 1;
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if later(self.bucket(mid).first, stamp) {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        Some(lo)
    }

    #[inline]
    fn add(&mut self, stamp: u32) {
        if let Some(n) = self.find(stamp) {
            self.bucket_mut(n).leaves += 1;
            if n >= self.from {
                self.counted += 1;
            }
        }
    }

    #[inline]
    fn remove(&mut self, stamp: u32) {
        if let Some(n) = self.find(stamp) {
            let b = self.bucket_mut(n);
            if b.leaves > 0 {
                b.leaves -= 1;
                if n >= self.from {
                    self.counted -= 1;
                }
            }
        }
    }

    /// Leaves recorded since about `since_ms` (those of the buckets that end after it), or
    /// `None` if no record's time is known. Moves on from the last count's first bucket; a
    /// count from further back adds the buckets up again.
    fn since(&mut self, since_ms: u64) -> Option<u32> {
        if self.begun == 0 {
            return None;
        }
        let ends_after =
            |b: &Bucket| (u64::from(b.secs) + u64::from(Self::GRAIN_S)) * 1_000 > since_ms;
        if self.from > self.oldest() && ends_after(self.bucket(self.from - 1)) {
            self.from = self.oldest();
            self.counted = (self.from..self.begun).map(|n| self.bucket(n).leaves).sum();
        }
        while self.from < self.begun && !ends_after(self.bucket(self.from)) {
            self.counted -= self.bucket(self.from).leaves;
            self.from += 1;
        }
        Some(self.counted)
    }
}

/// What a model holds of a chain: see [`CacheModel::known_from`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Known {
    /// Leading links held.
    pub(crate) links: usize,
    /// When the deepest of them was last used.
    pub(crate) last_used: u32,
    /// The record that first recorded it. While that request is in flight, its backend may
    /// still be reading it: another request cannot reuse it yet.
    pub(crate) born: u32,
}

/// How many refused records a model remembers.
const REFUSALS: usize = 8;

impl CacheModel {
    /// A model of a cache of `budget` tokens.
    pub(crate) fn new(budget: u64) -> Self {
        CacheModel {
            index: Index::new(),
            nodes: Vec::new(),
            born: Vec::new(),
            free: Vec::new(),
            head: NONE,
            tail: NONE,
            leaves: 0,
            tokens: 0,
            budget,
            declared: budget,
            max_blocks: Self::max_blocks(budget),
            log: EvictionLog::default(),
            evicted: 0,
            clock: 0,
            evicted_through: 0,
            refusals: [0; REFUSALS],
            recent: Recent::default(),
        }
    }

    /// Notes that the record stamped `stamp` is sent at `now_ms` on the fleet's clock: before
    /// it is recorded, so that its tip counts from this time.
    pub(crate) fn note_sent(&mut self, now_ms: u64, stamp: u32) {
        self.recent.note(now_ms, stamp, self.clock);
    }

    /// Conversations with a turn sent since about `since_ms` on the fleet's clock (to
    /// [`Recent::GRAIN_S`], and no further back than the buckets kept, ten minutes at least):
    /// the leaves recorded since. All of them for 0, or when no record's time is known. O(1),
    /// amortized.
    pub(crate) fn live_conversations(&mut self, since_ms: u64) -> u32 {
        match since_ms {
            0 => self.leaves,
            _ => self.recent.since(since_ms).unwrap_or(self.leaves),
        }
    }

    /// Remembers that the record with `stamp` was not taken.
    pub(crate) fn note_refused(&mut self, stamp: u32) {
        if stamp != 0 {
            self.refusals.rotate_right(1);
            self.refusals[0] = stamp;
        }
    }

    /// Whether the record with `stamp` is one of the latest the backend did not take: its
    /// session's next turn need not extend it.
    pub(crate) fn was_refused(&self, stamp: u32) -> bool {
        stamp != 0 && self.refusals.contains(&stamp)
    }

    /// The most links a model of `budget` tokens tracks: one per
    /// [`TOKENS_PER_LINK`](crate::chain::TOKENS_PER_LINK) tokens of budget, at least 1,024. A
    /// chain read from a body has no more links than that for its tokens (past its first 64),
    /// so a prompt of tiny messages does not fill the model before the token budget would.
    pub(crate) fn max_blocks(budget: u64) -> usize {
        usize::try_from(budget / crate::chain::TOKENS_PER_LINK)
            .unwrap_or(usize::MAX)
            .max(1024)
    }

    /// Changes the budget (discovery updated the backend); evicts down to it. The same budget
    /// declared again (the backend announced again for another reason: its slot count
    /// learned, say) keeps what its answers grew it to.
    ///
    /// A lower budget gives back the memory its links took beyond the new bound on links, so
    /// that the model costs what a model built with that budget would.
    pub(crate) fn set_budget(&mut self, budget: u64) {
        if budget == self.declared {
            return;
        }
        self.budget = budget;
        self.declared = budget;
        self.max_blocks = Self::max_blocks(budget);
        self.evict();
        if self.nodes.capacity() > self.max_blocks.saturating_add(1) {
            self.compact();
        }
    }

    /// Moves the links held to the front of fresh storage of their own size, and the index
    /// to one as small as their number allows: what evictions freed is given back. O(links
    /// held, and storage before). What each link is (its digest, tokens, mark, stamps, and
    /// place in the tree and in the leaf list) is kept; only where it is stored changes, and
    /// no node index lives beyond the lock.
    fn compact(&mut self) {
        let held = self.index.len();
        let mut moved_to = vec![NONE; self.nodes.len()];
        let mut nodes = Vec::with_capacity(held);
        let mut born = Vec::with_capacity(held);
        let mut index = Index::with_room_for(held);
        for slot in self.index.slots.iter().filter(|s| s.key != 0) {
            let (key, old) = (slot.key, slot.node);
            let new = nodes.len() as u32;
            moved_to[old as usize] = new;
            nodes.push(self.nodes[old as usize]);
            born.push(self.born[old as usize]);
            // Sized for every link held, so it never grows: `find` rather than `entry`.
            if let Err(at) = index.find(key) {
                index.fill(at, key, new);
            }
        }
        let to = |i: u32| {
            if i == NONE {
                NONE
            } else {
                moved_to[i as usize]
            }
        };
        for n in &mut nodes {
            (n.parent, n.prev, n.next) = (to(n.parent), to(n.prev), to(n.next));
        }
        self.head = to(self.head);
        self.tail = to(self.tail);
        self.nodes = nodes;
        self.born = born;
        self.index = index;
        self.free = Vec::new();
    }

    fn node(&self, digest: u64) -> Option<u32> {
        self.index.get(digest)
    }

    /// Whether the link with `digest` is held.
    pub(crate) fn holds(&self, digest: u64) -> bool {
        self.index.contains(digest)
    }

    /// How many leading links of `chain` are held. Holdings are closed under prefixes, so
    /// this is a binary search: O(log links) lookups.
    pub(crate) fn held(&self, chain: &[Link]) -> usize {
        self.held_from(chain, 0)
    }

    /// [`held`](Self::held), looking first at the chain's first link when `none_likely`:
    /// a backend that does not hold even that (one serving other conversations) answers in
    /// one lookup rather than O(log links), at one lookup more for one that does. A scan of
    /// the fleet guesses from the backend before.
    pub(crate) fn held_guessing(&self, chain: &[Link], none_likely: bool) -> usize {
        if !none_likely {
            return self.held(chain);
        }
        match chain.first() {
            Some(first) if self.holds(first.digest) => self.held_from(chain, 1),
            _ => 0,
        }
    }

    /// [`held`](Self::held), the first `lo` links known held.
    fn held_from(&self, chain: &[Link], lo: usize) -> usize {
        let (mut lo, mut hi) = (lo, chain.len());
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if self.holds(chain[mid].digest) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// How many other chains continue the link with `digest`: 0 for a conversation's tip.
    pub(crate) fn continuations(&self, digest: u64) -> u32 {
        self.node(digest)
            .map_or(0, |i| self.nodes[i as usize].children)
    }

    /// Whether the link with `digest` is a tip that more than one request sent whole.
    pub(crate) fn resent(&self, digest: u64) -> bool {
        self.node(digest)
            .is_some_and(|i| self.nodes[i as usize].tokens & RESENT != 0)
    }

    /// Conversations homed here: the tips of the chains it holds.
    pub(crate) fn conversations(&self) -> u32 {
        self.leaves
    }

    /// Tokens held.
    pub(crate) fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Links held.
    pub(crate) fn blocks(&self) -> usize {
        self.index.len()
    }

    /// Links evicted so far.
    pub(crate) fn evicted(&self) -> u64 {
        self.evicted
    }

    /// Bytes of memory held.
    pub(crate) fn memory_bytes(&self) -> usize {
        self.nodes.capacity() * std::mem::size_of::<Node>()
            + self.born.capacity() * 4
            + self.index.memory_bytes()
            + self.free.capacity() * 4
            + self.log.memory_bytes()
    }

    /// Records `chain` as held, knowing that at least `at_least` of its leading links are
    /// (0 if nothing is known), and evicts down to the budget; see
    /// [`known_from`](Self::known_from) and [`record`](Self::record).
    ///
    /// Returns how many leading links were held before, and when the deepest of them was last
    /// used (0 if none was held).
    pub(crate) fn record_from(
        &mut self,
        chain: &[Link],
        at_least: usize,
        stamp: u32,
    ) -> (usize, u32) {
        let known = self.known_from(chain, at_least);
        self.record(chain, known.links, stamp);
        (known.links, known.last_used)
    }

    /// How many leading links of `chain` are held, knowing that at least `at_least` are (0 if
    /// nothing is known): from there it looks link by link, which on a home hit is the one or
    /// two links the last turn ended with; with nothing known, a binary search. Also when the
    /// deepest of them was last used, and by which record it was first recorded (0 if none is
    /// held).
    ///
    /// `at_least` is checked: if its last link is not held (a turn placed before the one
    /// that recorded it had settled, or a fingerprint shared by a new link), the search
    /// starts from nothing.
    pub(crate) fn known_from(&self, chain: &[Link], at_least: usize) -> Known {
        let at_least = match at_least.min(chain.len()) {
            n if n > 0 && !self.holds(chain[n - 1].digest) => 0,
            n => n,
        };
        let known = if at_least == 0 {
            self.held(chain)
        } else {
            let mut n = at_least;
            while n < chain.len() && self.holds(chain[n].digest) {
                n += 1;
            }
            n
        };
        let deepest = known
            .checked_sub(1)
            .and_then(|n| self.node(chain[n].digest));
        Known {
            links: known,
            last_used: deepest.map_or(0, |i| self.nodes[i as usize].stamp),
            born: deepest.map_or(0, |i| self.born[i as usize]),
        }
    }

    /// Records `chain` as held, `known` of its leading links being held already (from
    /// [`held`](Self::held), or a cheaper check), makes its tip the most recently used, and
    /// evicts down to the budget. The links it passes from its deepest known one down take
    /// `stamp`, unless they carry a later one (records settle in any order; a stamp never goes
    /// back).
    pub(crate) fn record(&mut self, chain: &[Link], known: usize, stamp: u32) {
        self.add(chain, known, stamp, 0);
        self.evict();
    }

    /// Records `chain` as sent to the backend, as [`record`](Self::record) does (the backend
    /// makes room for a prompt when it takes it, before it answers), and logs what it evicts
    /// so that [`refused`](Self::refused) can put it back if the backend does not take the
    /// prompt after all.
    pub(crate) fn record_sent(&mut self, chain: &[Link], known: usize, stamp: u32) {
        self.add(chain, known, stamp, stamp);
        self.evict_for(stamp);
    }

    /// The backend did not take a chain [recorded as sent](Self::record_sent) with `stamp`,
    /// `known` of its leading links held before: the links it added are taken back, from its
    /// tip, as long as no other record has used them or gone on from them (one recorded after
    /// it, whatever its stamp), and the links it
    /// evicted are put back, least recently used again, as far as the log still has them
    /// (its last [`EvictionLog::LEN`] evictions) and nothing held has taken their place.
    ///
    /// The session recorded with `stamp` still reads as held whole where its home is
    /// concerned ([`ModelCell::kept_since`]): its home holds what it held before the refused
    /// turn, which is as much as any backend holds of it (a backend that refused a turn for
    /// a passing reason, busy or restarting, is still the place for the next). The record
    /// of its next turn finds what is really held.
    pub(crate) fn refused(&mut self, chain: &[Link], known: usize, stamp: u32) {
        self.note_refused(stamp);
        for link in chain.get(known..).unwrap_or_default().iter().rev() {
            let Some(i) = self.node(link.digest) else {
                // Evicted already; the link before it may be a leaf now.
                continue;
            };
            let n = self.nodes[i as usize];
            // Last used and first recorded by this record alone: no other went on from it,
            // used it since, or sent it before.
            if n.children != 0 || n.stamp != stamp || self.born[i as usize] != stamp {
                break;
            }
            self.remove_leaf(i, false);
        }
        // Newest first: a link was evicted after its children, so its parent comes back
        // before it, and the least recently used of them ends up last again.
        for e in self.log.take_by(stamp) {
            if self.holds(e.digest) {
                continue;
            }
            let parent = if e.parent == e.digest {
                NONE
            } else {
                match self.node(e.parent) {
                    Some(i) => i,
                    None => continue,
                }
            };
            let i = self.insert(e.digest, e.tokens & TOKENS, parent, e.stamp);
            // Its mark too, and the record that first recorded it: a refusal of a record
            // stamped `e.stamp` takes back only links it first recorded.
            self.nodes[i as usize].tokens = e.tokens;
            self.born[i as usize] = e.born;
            self.push_back(i);
            self.evicted -= 1;
        }
        self.evict();
    }

    /// Adds `chain`'s links after its first `known` (see [`record`](Self::record)), making
    /// room as it goes for the record stamped `by` (0: none; see [`evict_for`](Self::evict_for)),
    /// so that the model never tracks more than one link past its bound. Evicting as it goes
    /// evicts what evicting once the chain is in would: the links the chain passes have a
    /// child each, or are not listed yet, so only other leaves go, least recently used first.
    /// Once no other is left and a link still does not fit, it and the links after it are
    /// the chain's own tail, which the eviction after drops: the links after it are counted
    /// as evicted, and not added.
    fn add(&mut self, chain: &[Link], known: usize, stamp: u32, by: u32) {
        if chain.is_empty() {
            return;
        }
        let known = known.min(chain.len());
        self.clock = latest(self.clock, stamp);
        let mut parent = match known {
            0 => NONE,
            n => self.node(chain[n - 1].digest).unwrap_or(NONE),
        };
        if parent != NONE {
            self.touch(parent, stamp);
        }
        let mut tip = parent;
        let mut added = false;
        for (i, link) in chain.iter().enumerate().skip(known) {
            let before = if i == 0 { 0 } else { chain[i - 1].tokens };
            let tokens =
                u32::try_from(link.tokens.saturating_sub(before)).map_or(TOKENS, |t| t.min(TOKENS));
            let links = self.index.len();
            tip = self.insert(link.digest, tokens, parent, stamp);
            let new = self.index.len() > links;
            // A digest held already under another link (a 64-bit collision, chance or
            // crafted): the chain goes on from that link, and the one before it, left without
            // a child, is a leaf like any other, or it would never be evicted.
            if parent != NONE
                && tip != parent
                && self.nodes[parent as usize].children == 0
                && !self.listed(parent)
            {
                self.push_front(parent);
            }
            self.touch(tip, stamp);
            parent = tip;
            if new {
                added = true;
                self.evict_for(by);
                if self.tokens > self.budget || self.index.len() > self.max_blocks {
                    let rest = chain.len() - i - 1;
                    self.evicted += rest as u64;
                    if rest > 0 {
                        self.evicted_through = latest(self.evicted_through, stamp);
                    }
                    break;
                }
            }
        }
        // The tip is the most recently used leaf; the links before it have a child each.
        if tip != NONE && self.nodes[tip as usize].children == 0 {
            // Nothing added: this very prompt was sent whole before.
            if !added {
                self.nodes[tip as usize].tokens |= RESENT;
            }
            if self.listed(tip) {
                self.unlink(tip);
            }
            self.push_front(tip);
        }
    }

    /// Stamps link `i` with `stamp`, unless it carries a later one. A link first recorded by
    /// a record stamped later (placed after this one, sent before it) takes this record's
    /// stamp as its first: this record sent it too, so that a refusal of the later one
    /// ([`refused`](Self::refused)) does not take it back.
    #[inline]
    fn touch(&mut self, i: u32, stamp: u32) {
        let was = self.nodes[i as usize].stamp;
        let now = latest(was, stamp);
        // A leaf used again leaves the leaf list, and its bucket, by its old stamp: the record
        // touching it goes on from it (it gains a child) or ends there (it is listed again as
        // the most recently used, in the bucket of its new stamp).
        if now != was && self.listed(i) {
            self.unlink(i);
        }
        self.nodes[i as usize].stamp = now;
        let born = &mut self.born[i as usize];
        if later(*born, stamp) {
            *born = stamp;
        }
    }

    /// Whether leaf `i` is in the leaf list.
    fn listed(&self, i: u32) -> bool {
        let n = &self.nodes[i as usize];
        n.prev != NONE || n.next != NONE || self.head == i
    }

    /// Adds a link under `parent` (or finds it); returns its index. A new link is not put in
    /// the leaf list: it has a child next, or is the tip [`record`](Self::record) lists.
    fn insert(&mut self, digest: u64, tokens: u32, parent: u32, stamp: u32) -> u32 {
        let slot = match self.index.entry(digest) {
            Ok(i) => return i,
            Err(slot) => slot,
        };
        let node = Node {
            digest,
            tokens,
            parent,
            children: 0,
            prev: NONE,
            next: NONE,
            stamp,
        };
        let i = match self.free.pop() {
            Some(i) => {
                self.nodes[i as usize] = node;
                self.born[i as usize] = stamp;
                i
            }
            None => {
                self.reserve_node();
                self.nodes.push(node);
                self.born.push(stamp);
                (self.nodes.len() - 1) as u32
            }
        };
        self.index.fill(slot, digest, i);
        self.tokens += u64::from(tokens);
        if parent != NONE {
            self.nodes[parent as usize].children += 1;
            if self.nodes[parent as usize].children == 1 && self.listed(parent) {
                self.unlink(parent);
            }
        }
        i
    }

    /// Room for one more node: by doubling, up to one past the bound on links (a record adds
    /// a link before it evicts one), not to twice the bound. Past it (a late refusal puts back
    /// what it evicted before evicting again), by as many as it puts back at most.
    fn reserve_node(&mut self) {
        let len = self.nodes.len();
        if len < self.nodes.capacity() {
            return;
        }
        let bound = self.max_blocks.saturating_add(1);
        let target = if len < bound {
            len.saturating_mul(2).max(16).min(bound)
        } else {
            len + EvictionLog::LEN
        };
        self.nodes.reserve_exact(target - len);
        self.born.reserve_exact(target - self.born.len());
    }

    #[inline]
    fn push_front(&mut self, i: u32) {
        let old = self.head;
        {
            let n = &mut self.nodes[i as usize];
            n.prev = NONE;
            n.next = old;
        }
        if old != NONE {
            self.nodes[old as usize].prev = i;
        } else {
            self.tail = i;
        }
        self.head = i;
        self.leaves += 1;
        self.recent.add(self.nodes[i as usize].stamp);
    }

    #[inline]
    fn push_back(&mut self, i: u32) {
        let old = self.tail;
        {
            let n = &mut self.nodes[i as usize];
            n.next = NONE;
            n.prev = old;
        }
        if old != NONE {
            self.nodes[old as usize].next = i;
        } else {
            self.head = i;
        }
        self.tail = i;
        self.leaves += 1;
        self.recent.add(self.nodes[i as usize].stamp);
    }

    /// Takes leaf `i` out of the leaf list.
    #[inline]
    fn unlink(&mut self, i: u32) {
        let Node { prev, next, .. } = self.nodes[i as usize];
        if prev != NONE {
            self.nodes[prev as usize].next = next;
        } else {
            self.head = next;
        }
        if next != NONE {
            self.nodes[next as usize].prev = prev;
        } else {
            self.tail = prev;
        }
        let n = &mut self.nodes[i as usize];
        n.prev = NONE;
        n.next = NONE;
        self.leaves -= 1;
        let stamp = n.stamp;
        self.recent.remove(stamp);
    }

    /// Drops least recently used leaves until the model fits its budget.
    fn evict(&mut self) {
        self.evict_for(0);
    }

    /// [`evict`](Self::evict), making room for the record stamped `by` (0: none): each link
    /// evicted but the record's own (a chain longer than the budget evicts its own tail,
    /// which is no one else's) is logged for [`refused`](Self::refused).
    fn evict_for(&mut self, by: u32) {
        while self.over_budget() {
            let tail = self.nodes[self.tail as usize];
            if by != 0 && tail.stamp != by {
                self.log.push(Evicted {
                    digest: tail.digest,
                    parent: match tail.parent {
                        NONE => tail.digest,
                        p => self.nodes[p as usize].digest,
                    },
                    tokens: tail.tokens,
                    stamp: tail.stamp,
                    born: self.born[self.tail as usize],
                    by,
                });
            }
            self.evict_tail();
        }
    }

    /// Whether the model holds more than its budget of tokens or its bound of links (and has
    /// a leaf to evict).
    fn over_budget(&self) -> bool {
        (self.tokens > self.budget || self.index.len() > self.max_blocks) && self.tail != NONE
    }

    /// Takes in what an answer showed about the model's prediction for a prompt whose
    /// deepest predicted link was last used at `stamp`:
    ///
    /// - the backend reused far less: it evicted that prefix, and (evicting the least recently
    ///   used first) everything used no later; see [`forget_until`](Self::forget_until);
    /// - it reused far more: it keeps more than it declared (llama.cpp's slots keep their last
    ///   prompt beyond `--cache-ram`), so the budget grows by a sixteenth of the declared one,
    ///   up to twice it.
    pub(crate) fn correct(&mut self, verdict: Verdict, stamp: u32, shortfall: u64) {
        match verdict {
            Verdict::Fine => {}
            Verdict::HeldLess => {
                self.forget_until(stamp, shortfall);
            }
            Verdict::HeldMore => {
                // Saturating: a budget declared near the top of the range (say `u64::MAX`
                // for no bound) stays there rather than wrapping round to a small one.
                let most = self.declared.saturating_mul(2);
                self.budget = self.budget.saturating_add(self.declared / 16).min(most);
                self.max_blocks = Self::max_blocks(self.budget);
            }
        }
    }

    /// The budget the model keeps to now.
    pub(crate) fn budget(&self) -> u64 {
        self.budget
    }

    /// The backend answered that it no longer held a prefix last used at `stamp`, and held
    /// `shortfall` fewer tokens of it than predicted: as it evicts the least recently used
    /// first, it holds that much less of what was used no later. Drops those leaves, oldest
    /// first, until `shortfall` tokens are gone or none that old is left; returns how many
    /// links went.
    pub(crate) fn forget_until(&mut self, stamp: u32, shortfall: u64) -> u64 {
        let before = (self.evicted, self.tokens);
        // Wrapping comparison: the clock may have wrapped since.
        while self.tail != NONE
            && before.1 - self.tokens < shortfall
            && (stamp.wrapping_sub(self.nodes[self.tail as usize].stamp) as i32) >= 0
        {
            self.evict_tail();
        }
        self.evicted - before.0
    }

    /// Drops the least recently used leaf.
    fn evict_tail(&mut self) {
        self.remove_leaf(self.tail, true);
    }

    /// Removes leaf `i`: evicted as the least recently used, or taken back (its parent, used
    /// by the same record, goes first). The parent of a leaf evicted, if it becomes a leaf, was
    /// used no later and goes last, unless a prompt ended at it later (a turn sent again from
    /// further back): then it goes after the leaves used before that prompt.
    fn remove_leaf(&mut self, i: u32, evicted: bool) {
        self.unlink(i);
        let node = self.nodes[i as usize];
        self.index.remove(node.digest);
        self.tokens -= u64::from(node.tokens & TOKENS);
        self.free.push(i);
        if evicted {
            self.evicted += 1;
            self.evicted_through = latest(self.evicted_through, node.stamp);
        }
        if node.parent != NONE {
            let p = &mut self.nodes[node.parent as usize];
            p.children -= 1;
            if p.children == 0 {
                if !evicted {
                    self.push_front(node.parent);
                } else if later(p.stamp, node.stamp) {
                    self.place_by_stamp(node.parent);
                } else {
                    self.push_back(node.parent);
                }
            }
        }
    }

    /// Lists leaf `i` after the leaves, from the least recently used on, whose stamps are
    /// earlier than its own. O(those leaves).
    fn place_by_stamp(&mut self, i: u32) {
        let stamp = self.nodes[i as usize].stamp;
        // The leaf it goes after, on the tail's side of it.
        let mut older = NONE;
        let mut at = self.tail;
        while at != NONE && later(stamp, self.nodes[at as usize].stamp) {
            older = at;
            at = self.nodes[at as usize].prev;
        }
        if older == NONE {
            self.push_back(i);
            return;
        }
        let newer = self.nodes[older as usize].prev;
        {
            let n = &mut self.nodes[i as usize];
            n.prev = newer;
            n.next = older;
        }
        self.nodes[older as usize].prev = i;
        if newer != NONE {
            self.nodes[newer as usize].next = i;
        } else {
            self.head = i;
        }
        self.leaves += 1;
        self.recent.add(stamp);
    }

    #[cfg(test)]
    fn check(&self) {
        // Every held link's parent is held, the leaf list holds exactly the childless links,
        // and the token count adds up.
        let mut leaves = 0;
        let mut tokens = 0;
        for slot in self.index.slots.iter().filter(|s| s.key != 0) {
            let (key, node) = (slot.key, slot.node);
            let n = self.nodes[node as usize];
            assert_eq!(key_of(n.digest), key);
            tokens += u64::from(n.tokens & TOKENS);
            if n.parent != NONE {
                assert!(self.holds(self.nodes[n.parent as usize].digest));
            }
            if n.children == 0 {
                leaves += 1;
            }
        }
        assert_eq!(leaves, self.leaves);
        assert_eq!(tokens, self.tokens);
        let mut walked = 0;
        let r = &self.recent;
        let mut bucketed = [0u32; Recent::LEN];
        let mut i = self.head;
        while i != NONE {
            walked += 1;
            if let Some(n) = r.find(self.nodes[i as usize].stamp) {
                bucketed[(n % Recent::LEN as u64) as usize] += 1;
            }
            i = self.nodes[i as usize].next;
        }
        assert_eq!(walked, self.leaves);
        // Each leaf counts in the bucket its stamp falls in, if any, and the count from the
        // last one started at is the sum of its buckets'.
        for n in r.oldest()..r.begun {
            let at = (n % Recent::LEN as u64) as usize;
            assert_eq!(r.bucket(n).leaves, bucketed[at], "bucket {n}");
        }
        let counted: u32 = (r.from..r.begun).map(|n| r.bucket(n).leaves).sum();
        assert!(r.from >= r.oldest());
        assert_eq!(r.counted, counted);
    }
}

/// How an answer's reported reuse compared with the model's prediction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Close enough.
    Fine,
    /// The backend reused far less than predicted.
    HeldLess,
    /// The backend reused far more than predicted.
    HeldMore,
}

/// What the model predicts for one chain on one backend.
pub(crate) fn reuse(model: &CacheModel, chain: &PromptChain) -> (usize, u64) {
    let held = model.held(chain.links());
    (held, chain.tokens_at(held))
}

/// Whether stamp `a` is later than `b`, on a clock that wraps: within 2^31 of each other.
fn later(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) > 0
}

/// The later of two stamps; 0 (no stamp) is earlier than any.
fn latest(a: u32, b: u32) -> u32 {
    if a == 0 || later(b, a) {
        b
    } else {
        a
    }
}

/// A backend's cache model, with the two figures placement reads of it without its lock.
///
/// Every record on the model takes a *stamp* from [`reserve`](Self::reserve): one count a
/// record, never 0, reserved when the request is placed (before it is recorded), so that the
/// session table can keep it with the session's home. The model notes the latest stamp of
/// any link it evicts. A session whose stamp is later than that was recorded after the last
/// eviction, so all of it is still held: on a home hit, [`kept_since`](Self::kept_since)
/// says so from two numbers in memory that placement reads anyway, where a look into the
/// model's index would be a memory miss or two on a large fleet. Only an older session's
/// home is looked up in the model.
#[derive(Debug)]
pub(crate) struct ModelCell {
    /// The next stamp to reserve.
    next: AtomicU32,
    /// The model's latest evicted stamp, as of its last unlock.
    evicted: AtomicU32,
    model: Mutex<CacheModel>,
}

impl ModelCell {
    /// A model of a cache of `budget` tokens.
    pub(crate) fn new(budget: u64) -> Self {
        ModelCell {
            next: AtomicU32::new(1),
            evicted: AtomicU32::new(0),
            model: Mutex::new(CacheModel::new(budget)),
        }
    }

    /// A model of a cache of `budget` tokens in place of `before`, whose stamps it goes on
    /// from: the requests recorded on `before` that are still in flight keep their stamps in
    /// their backend's ring of stamps in flight (see [`Load`](crate::fleet::Load)), where a
    /// request of the new model reserving one of them again would read as ended when the old
    /// one ends.
    pub(crate) fn after(before: &ModelCell, budget: u64) -> Self {
        let cell = ModelCell::new(budget);
        let next = before.next.load(Ordering::Relaxed);
        cell.next.store(next, Ordering::Relaxed);
        cell
    }

    /// The model, locked. Whatever it evicts meanwhile is published when the guard drops.
    pub(crate) fn lock(&self) -> ModelGuard<'_> {
        ModelGuard {
            model: self.model.lock(),
            evicted: &self.evicted,
        }
    }

    /// A stamp for a record on this model: later than every stamp reserved before it (until
    /// the count wraps, after 2^32 records), never 0.
    pub(crate) fn reserve(&self) -> u32 {
        loop {
            let stamp = self.next.fetch_add(1, Ordering::Relaxed);
            if stamp != 0 {
                return stamp;
            }
        }
    }

    /// Whether a record stamped `stamp`, once recorded, is still held whole: nothing recorded
    /// that late or later has been evicted. False for stamp 0 (none known), and for a stamp
    /// as old as the latest evicted one, which may or may not be held.
    pub(crate) fn kept_since(&self, stamp: u32) -> bool {
        let evicted = self.evicted.load(Ordering::Acquire);
        stamp != 0 && (evicted == 0 || later(stamp, evicted))
    }

    /// Records `chain` as held with a stamp of its own (see [`CacheModel::record_from`]),
    /// learned at `now_ms` on the fleet's clock (0: no clock; the live count then takes it as
    /// of the newest bucket), and returns the stamp, for the session entry that will point
    /// here.
    pub(crate) fn record_from(&self, chain: &[Link], at_least: usize, now_ms: u64) -> u32 {
        let stamp = self.reserve();
        let mut m = self.lock();
        if now_ms > 0 {
            m.note_sent(now_ms, stamp);
        }
        m.record_from(chain, at_least, stamp);
        stamp
    }
}

/// A locked [`ModelCell`]'s model.
#[derive(Debug)]
pub(crate) struct ModelGuard<'a> {
    model: MutexGuard<'a, CacheModel>,
    evicted: &'a AtomicU32,
}

impl std::ops::Deref for ModelGuard<'_> {
    type Target = CacheModel;

    fn deref(&self) -> &CacheModel {
        &self.model
    }
}

impl std::ops::DerefMut for ModelGuard<'_> {
    fn deref_mut(&mut self) -> &mut CacheModel {
        &mut self.model
    }
}

impl Drop for ModelGuard<'_> {
    fn drop(&mut self) {
        // Before the lock goes, so no later holder publishes an older figure after this one.
        let through = self.model.evicted_through;
        if self.evicted.load(Ordering::Relaxed) != through {
            self.evicted.store(through, Ordering::Release);
        }
    }
}

/// A request's chain, owed to the model of the backend it was placed on.
///
/// Placement reads the models; recording waits until the request is on its way: the response
/// future settles the record right after it first polls the backend's own future, so the
/// model's update (finding the chain's new links, inserting them, evicting down to the budget)
/// runs while the backend reads the prompt, not before the request reaches it. If the backend
/// then does not take the prompt (it answers other than with a success, or fails), the record
/// is taken back: the links it added go, and those it evicted come back (see
/// [`CacheModel::refused`]). A record dropped unsettled (its response future dropped before
/// its first poll) settles itself: no placed chain is lost to the model.
#[derive(Debug)]
pub(crate) struct Record {
    owed: Option<Owed>,
}

#[derive(Debug)]
struct Owed {
    cache: Arc<ModelCell>,
    chain: PromptChain,
    /// Leading links of the chain the backend was known to hold: at placement, and once
    /// settled, when it was recorded.
    known: usize,
    /// The stamp reserved for it at placement.
    stamp: u32,
    /// When it was placed, on the fleet's clock.
    at_ms: u64,
    settled: bool,
}

impl Record {
    /// `chain` owed to `cache`, whose backend was known to hold its first `known` links, with
    /// the `stamp` reserved for it when it was placed, at `at_ms` on the fleet's clock.
    pub(crate) fn new(
        cache: Arc<ModelCell>,
        chain: PromptChain,
        known: usize,
        stamp: u32,
        at_ms: u64,
    ) -> Self {
        Record {
            owed: Some(Owed {
                cache,
                chain,
                known,
                stamp,
                at_ms,
                settled: false,
            }),
        }
    }

    /// Records the chain on its model as sent, once, and returns the prediction its answer
    /// is checked against: `None` if it was settled already.
    pub(crate) fn settle(&mut self) -> Option<Prediction> {
        let owed = self.owed.as_mut().filter(|o| !o.settled)?;
        let links = owed.chain.links();
        let mut model = owed.cache.lock();
        let known = model.known_from(links, owed.known);
        model.note_sent(owed.at_ms, owed.stamp);
        model.record_sent(links, known.links, owed.stamp);
        drop(model);
        let held = known.links;
        owed.known = held;
        owed.settled = true;
        Some(Prediction {
            prompt_tokens: owed.chain.tokens(),
            held_tokens: owed.chain.tokens_at(held),
            stamp: known.last_used,
            born: known.born,
            // Whether that record had ended is its slot's to say: see `Dispatched::settle`.
            pending: false,
        })
    }

    /// The backend answered (`taken`: with a success), or failed (not `taken`): the record
    /// stands, or is taken back. An unsettled record is recorded if `taken`, and forgotten
    /// if not. Returns the model, for the answer's figures to correct.
    pub(crate) fn answer(mut self, taken: bool) -> Option<Arc<ModelCell>> {
        let owed = self.owed.take()?;
        owed.answer(taken);
        Some(owed.cache)
    }
}

impl Owed {
    fn answer(&self, taken: bool) {
        let links = self.chain.links();
        match (self.settled, taken) {
            (true, true) => {}
            // Never sent, but its session's entry points at it all the same.
            (false, false) => self.cache.lock().note_refused(self.stamp),
            (true, false) => self.cache.lock().refused(links, self.known, self.stamp),
            (false, true) => {
                let mut model = self.cache.lock();
                model.note_sent(self.at_ms, self.stamp);
                model.record_from(links, self.known, self.stamp);
            }
        }
    }
}

impl Drop for Record {
    fn drop(&mut self) {
        // Dropped unanswered: the backend may have taken it.
        if let Some(owed) = self.owed.take() {
            owed.answer(true);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl CacheModel {
        /// Records with the next stamp, as one model's records in a row would have.
        fn record_next(&mut self, chain: &[Link], known: usize) {
            let stamp = self.clock.wrapping_add(1).max(1);
            self.record(chain, known, stamp);
        }

        fn record_from_next(&mut self, chain: &[Link], at_least: usize) -> (usize, u32) {
            let stamp = self.clock.wrapping_add(1).max(1);
            self.record_from(chain, at_least, stamp)
        }
    }

    fn chain(ids: &[u64]) -> PromptChain {
        PromptChain::from_blocks(ids.iter().map(|&id| (id, 100)))
    }

    /// A turn sent at `at_ms` with the chain of `ids`, of which the first `known` links are
    /// held: noted as sent, then recorded, with the model's next stamp.
    fn turn_at(m: &mut CacheModel, at_ms: u64, ids: &[u64], known: usize) {
        let stamp = m.clock.wrapping_add(1).max(1);
        m.note_sent(at_ms, stamp);
        m.record(chain(ids).links(), known, stamp);
    }

    /// A model of 1M tokens that a hundred conversations of one turn each were sent to, the
    /// first at `first_ms`, each `gap_ms` after the one before.
    fn hundred_conversations(first_ms: u64, gap_ms: u64) -> CacheModel {
        let mut m = CacheModel::new(1 << 20);
        for i in 0..100u64 {
            turn_at(&mut m, first_ms + i * gap_ms, &[1_000 + i], 0);
        }
        m
    }

    #[test]
    fn a_recorded_chain_is_held_and_its_extensions_are_found() {
        let mut m = CacheModel::new(10_000);
        let first = chain(&[1, 2, 3]);
        m.record_next(first.links(), 0);
        let next = chain(&[1, 2, 3, 4, 5]);
        assert_eq!(reuse(&m, &next), (3, 300));
        assert_eq!(m.conversations(), 1);
        m.record_next(next.links(), 3);
        assert_eq!(m.conversations(), 1);
        assert_eq!(m.tokens(), 500);
        m.check();
    }

    #[test]
    fn conversations_with_no_turn_since_a_time_are_not_live() {
        let mut m = CacheModel::new(100_000);
        let send = |m: &mut CacheModel, secs: u64, ids: &[u64]| {
            let c = chain(ids);
            let stamp = m.clock.wrapping_add(1).max(1);
            m.note_sent(secs * 1_000, stamp);
            let known = m.held(c.links());
            m.record(c.links(), known, stamp);
        };
        send(&mut m, 0, &[1, 2]);
        send(&mut m, 100, &[3, 4]);
        send(&mut m, 400, &[5, 6]);
        assert_eq!(m.conversations(), 3);
        assert_eq!(m.live_conversations(300_000), 1);
        assert_eq!(m.live_conversations(50_000), 2);
        assert_eq!(m.live_conversations(0), 3);
        // The first conversation's next turn: live again, and counted once.
        send(&mut m, 500, &[1, 2, 7]);
        assert_eq!((m.conversations(), m.live_conversations(300_000)), (3, 2));
        // The second's prompt sent again whole moves it to its new time.
        send(&mut m, 600, &[3, 4]);
        assert_eq!(m.live_conversations(550_000), 1);
        m.check();
        // Ten minutes on: only the new conversation had a turn in the last five; all are
        // held.
        send(&mut m, 1_300, &[8]);
        assert_eq!((m.conversations(), m.live_conversations(1_000_000)), (4, 1));
        assert_eq!(m.live_conversations(390_000), 4);
        m.check();
    }

    #[test]
    fn a_bucket_of_the_live_count_begins_only_later_than_every_stamp_recorded() {
        let cell = ModelCell::new(100_000);
        let send = |cell: &ModelCell, at_ms: u64, stamp: u32, ids: &[u64]| {
            let c = chain(ids);
            let mut m = cell.lock();
            m.note_sent(at_ms, stamp);
            let known = m.known_from(c.links(), 0).links;
            m.record_sent(c.links(), known, stamp);
        };
        // A prompt placed; before it is sent, a conversation learned from elsewhere is
        // recorded with a later stamp and no time.
        let placed = cell.reserve();
        cell.record_from(chain(&[9, 1]).links(), 0, 0);
        send(&cell, 1_000, placed, &[1, 2]);
        // Both conversations have their next turns.
        send(&cell, 5_000, cell.reserve(), &[9, 1, 3]);
        send(&cell, 6_000, cell.reserve(), &[1, 2, 4]);
        let mut m = cell.lock();
        assert_eq!((m.conversations(), m.live_conversations(1)), (2, 2));
        m.check();
    }

    #[test]
    fn a_conversation_learned_from_elsewhere_counts_as_live_from_when_it_was_learned() {
        let cell = ModelCell::new(100_000);
        let placed = cell.reserve();
        {
            let mut m = cell.lock();
            m.note_sent(1_000, placed);
            m.record_sent(chain(&[1]).links(), 0, placed);
        }
        // Learned 700 s later (another replica served its latest turn): a turn of late.
        cell.record_from(chain(&[2]).links(), 0, 700_000);
        let mut m = cell.lock();
        assert_eq!((m.conversations(), m.live_conversations(400_000)), (2, 1));
        m.check();
    }

    #[test]
    fn the_live_count_keeps_its_latest_buckets_and_counts_from_any_start() {
        // A hundred conversations of one turn, one every ten seconds: a bucket each.
        let mut m = CacheModel::new(1 << 20);
        for i in 0..100u64 {
            turn_at(&mut m, i * 10_000, &[1_000 + i], 0);
            m.check();
        }
        assert_eq!(m.conversations(), 100);
        // The last five minutes: the conversations from 690 s on.
        assert_eq!(m.live_conversations(690_000), 31);
        // Only the latest 64 buckets are kept.
        assert_eq!(m.live_conversations(1), 64);
        m.check();
        assert_eq!(m.live_conversations(690_000), 31);
        // Back to an earlier start: counted again.
        assert_eq!(m.live_conversations(500_000), 50);
        m.check();
        // A conversation of 400 s has its next turn: it counts in the latest bucket.
        turn_at(&mut m, 1_000_000, &[1_040, 7], 1);
        assert_eq!(m.live_conversations(690_000), 32);
        m.check();
    }

    #[test]
    fn a_prompt_recorded_again_whole_is_marked_resent_and_counted_once() {
        let tip = |c: &PromptChain| c.links().last().unwrap().digest;
        let (turn, next) = (chain(&[1, 2, 3]), chain(&[1, 2, 3, 4]));
        let mut m = CacheModel::new(10_000);
        m.record_next(turn.links(), 0);
        assert!(!m.resent(tip(&turn)));
        // Extended, then the extension sent again from a shorter known prefix: only the
        // extension's tip is marked, and no token is counted twice.
        m.record_next(next.links(), 3);
        assert!(!m.resent(tip(&next)));
        m.record_next(next.links(), 1);
        assert!(m.resent(tip(&next)));
        assert!(!m.resent(tip(&turn)), "continued, not sent whole again");
        assert_eq!(m.tokens(), 400);
        m.check();
        // A link of the most tokens a node counts is still counted whole.
        let mut m = CacheModel::new(u64::MAX);
        let big = PromptChain::from_blocks([(7, TOKENS)]);
        m.record_next(big.links(), 0);
        m.record_next(big.links(), 0);
        assert!(m.resent(tip(&big)));
        assert_eq!(m.tokens(), u64::from(TOKENS));
        m.check();
    }

    #[test]
    fn least_recently_used_conversations_are_evicted_first() {
        // Room for 1,000 tokens: two conversations of 400 and a third pushes out the oldest.
        let mut m = CacheModel::new(1_000);
        let a = chain(&[1, 2, 3, 4]);
        let b = chain(&[10, 11, 12, 13]);
        let c = chain(&[20, 21, 22, 23]);
        m.record_next(a.links(), 0);
        m.record_next(b.links(), 0);
        // `a` is used again: `b` is now the oldest.
        m.record_next(a.links(), m.held(a.links()));
        m.record_next(c.links(), 0);
        assert_eq!(m.held(a.links()), 4);
        assert_eq!(m.held(c.links()), 4);
        // `b` lost its tail first: what is left of it is a prefix.
        assert!(m.held(b.links()) < 4);
        assert!(m.tokens() <= 1_000);
        m.check();
    }

    #[test]
    fn a_shared_prefix_outlives_the_conversations_that_branch_from_it() {
        let mut m = CacheModel::new(600);
        // A system prompt (1, 2) continued by three conversations.
        for tail in [[3, 4], [5, 6], [7, 8]] {
            m.record_next(chain(&[1, 2, tail[0], tail[1]]).links(), 0);
        }
        assert_eq!(m.continuations(chain(&[1, 2]).links()[1].digest), 2);
        assert_eq!(m.held(chain(&[1, 2, 9]).links()), 2);
        assert_eq!(m.conversations(), 2);
        m.check();
    }

    #[test]
    fn the_model_never_exceeds_its_bounds() {
        let mut m = CacheModel::new(2_000);
        for s in 0..200u64 {
            let ids: Vec<u64> = (0..(s % 13 + 1)).map(|i| s * 100 + i).collect();
            let c = chain(&ids);
            let known = m.held(c.links());
            m.record_next(c.links(), known);
            assert!(m.tokens() <= 2_000);
            assert!(m.blocks() <= CacheModel::max_blocks(2_000));
        }
        m.check();
    }

    #[test]
    fn held_less_forgets_what_was_used_no_later_up_to_the_shortfall() {
        let mut m = CacheModel::new(100_000);
        for c in [&[1, 2][..], &[3, 4], &[5, 6], &[7, 8]] {
            m.record_next(chain(c).links(), 0);
        }
        // [5, 6] is predicted held; its turn reports nothing reused.
        let next = chain(&[5, 6, 9]);
        let (held, stamp) = m.record_from_next(next.links(), 0);
        assert_eq!(held, 2);
        // 300 tokens over-predicted: the oldest conversations go, [1, 2] then [3, 4]'s leaf.
        m.correct(Verdict::HeldLess, stamp, 300);
        m.check();
        assert_eq!(reuse(&m, &chain(&[1, 2])).0, 0);
        assert_eq!(
            reuse(&m, &chain(&[3, 4])).0,
            1,
            "the shortfall is made up: no more goes"
        );
        assert_eq!(reuse(&m, &next).0, 3, "the turn just read is held");
        assert_eq!(
            reuse(&m, &chain(&[7, 8])).0,
            2,
            "used later than the miss: kept"
        );
    }

    #[test]
    fn forgetting_returns_how_many_links_went_this_time() {
        let mut m = CacheModel::new(400);
        for c in [&[1, 2][..], &[3, 4], &[5, 6]] {
            m.record_next(chain(c).links(), 0);
        }
        // [1, 2] made room for [5, 6].
        assert_eq!(m.evicted(), 2);
        let stamp = m.clock;
        assert_eq!(m.forget_until(stamp, 300), 3);
        assert_eq!(m.evicted(), 5);
        m.check();
    }

    #[test]
    fn held_more_grows_the_budget_up_to_twice_the_declared() {
        let mut m = CacheModel::new(16_000);
        for _ in 0..40 {
            m.correct(Verdict::HeldMore, 0, 0);
        }
        assert_eq!(m.budget(), 32_000);
        m.set_budget(8_000);
        assert_eq!(m.budget(), 8_000, "a new declaration starts over");
    }

    #[test]
    fn a_lowered_budget_gives_back_the_memory_beyond_its_bound() {
        // 3,000 conversations of 20 links, 60,000 links in all, on a budget of 2^20 tokens
        // (65,536 links at most): several megabytes.
        let mut m = CacheModel::new(1 << 20);
        let conversation =
            |c: u64| PromptChain::from_blocks((0..20).map(move |i| ((c << 20) | i, 16)));
        for c in 0..3_000 {
            m.record_next(conversation(c).links(), 0);
        }
        assert_eq!(m.blocks(), 60_000);
        let before = m.memory_bytes();
        // Announced again with the default budget: the bound of that budget, as a model built
        // with it keeps to (under 770 KB).
        m.set_budget(crate::Backend::<()>::DEFAULT_CACHE_TOKENS);
        m.check();
        assert_eq!(m.blocks(), 8_192);
        assert!(
            m.memory_bytes() < 770_000,
            "{} of {before} bytes",
            m.memory_bytes()
        );
        // What it keeps is the most recently used, as before: the latest conversations whole,
        // the oldest of those kept cut to a prefix.
        assert_eq!(m.held(conversation(2_999).links()), 20);
        assert_eq!(m.held(conversation(2_591).links()), 20);
        assert_eq!(m.held(conversation(2_590).links()), 12);
        assert_eq!(m.held(conversation(2_589).links()), 0);
        assert_eq!(m.conversations(), 410);
        // It goes on as any model: a conversation used again outlives those before it.
        m.record_next(conversation(2_591).links(), 20);
        for c in 3_000..3_400 {
            m.record_next(conversation(c).links(), 0);
        }
        m.check();
        assert_eq!(m.blocks(), 8_192);
        assert_eq!(m.held(conversation(2_591).links()), 20);
        assert_eq!(m.held(conversation(2_590).links()), 0);
        assert_eq!(m.held(conversation(2_592).links()), 0);
        assert!(m.memory_bytes() < 770_000, "{} bytes", m.memory_bytes());
        // Raised again, it grows again.
        m.set_budget(1 << 20);
        for c in 3_400..4_000 {
            m.record_next(conversation(c).links(), 0);
        }
        m.check();
        assert_eq!(m.held(conversation(2_591).links()), 20);
        assert_eq!(m.blocks(), 8_192 + 12_000);
    }

    #[test]
    fn held_more_on_a_budget_near_the_top_of_the_range_never_wraps() {
        for declared in [u64::MAX, u64::MAX - 15, 1 << 63, u64::MAX / 3 * 2] {
            let mut m = CacheModel::new(declared);
            for _ in 0..40 {
                m.correct(Verdict::HeldMore, 0, 0);
                assert!(m.budget() >= declared, "{declared}: {}", m.budget());
            }
        }
    }

    #[test]
    fn a_refused_prompt_leaves_what_a_record_placed_before_it_and_settled_after_it_used() {
        // Two requests placed in turn, sent the other way round (the later one's future
        // polled first): the later goes on from the earlier's prompt, or sends it whole.
        for longer in [chain(&[1, 2, 3, 4]), chain(&[1, 2, 3])] {
            let cell = ModelCell::new(10_000);
            let turn = chain(&[1, 2, 3]);
            let (first, second) = (cell.reserve(), cell.reserve());
            let mut m = cell.lock();
            let known_second = m.known_from(longer.links(), 0).links;
            m.record_sent(longer.links(), known_second, second);
            let known_first = m.known_from(turn.links(), 0).links;
            m.record_sent(turn.links(), known_first, first);
            // The second is refused, the first taken: the backend holds the first's prompt.
            m.refused(longer.links(), known_second, second);
            assert_eq!(m.held(turn.links()), 3, "taken back from under the first");
            assert_eq!(m.held(longer.links()), 3);
            m.check();
        }
    }

    #[test]
    fn a_prompt_the_backend_refused_is_taken_back_and_what_it_evicted_put_back() {
        // Room for two conversations of 400 tokens; a third is sent, then refused.
        let cell = ModelCell::new(800);
        let (a, b, c) = (
            chain(&[1, 2, 3, 4]),
            chain(&[5, 6, 7, 8]),
            chain(&[9, 10, 11, 12]),
        );
        for x in [&a, &b] {
            cell.lock().record_from(x.links(), 0, cell.reserve());
        }
        let stamp = cell.reserve();
        cell.lock().record_sent(c.links(), 0, stamp);
        {
            let m = cell.lock();
            assert_eq!(
                m.held(a.links()),
                0,
                "the oldest made room as the prompt was sent"
            );
            assert_eq!((m.held(b.links()), m.held(c.links())), (4, 4));
        }
        cell.lock().refused(c.links(), 0, stamp);
        let m = cell.lock();
        assert_eq!(m.held(c.links()), 0, "taken back");
        assert_eq!((m.held(a.links()), m.held(b.links())), (4, 4), "put back");
        assert_eq!((m.tokens(), m.evicted(), m.conversations()), (800, 0, 2));
        m.check();
        drop(m);
        // And it is the least recently used again: the next conversation evicts it first.
        cell.lock()
            .record_from(chain(&[20, 21, 22, 23]).links(), 0, cell.reserve());
        let m = cell.lock();
        assert_eq!((m.held(a.links()), m.held(b.links())), (0, 4));
        m.check();
    }

    #[test]
    fn a_prompt_larger_than_the_budget_refused_leaves_the_model_as_it_was() {
        let cell = ModelCell::new(800);
        let a = chain(&[1, 2, 3, 4]);
        let a_mark = cell.reserve();
        cell.lock().record_from(a.links(), 0, a_mark);
        // Another turn of `a` goes on from it, and a prompt far larger than the budget comes
        // (a backend refuses it: longer than its context); both are sent at once.
        let next = chain(&[1, 2, 3, 4, 5, 6]);
        let next_mark = cell.reserve();
        cell.lock().record_sent(next.links(), 4, next_mark);
        let huge: Vec<u64> = (100..120).collect();
        let huge = chain(&huge);
        let huge_mark = cell.reserve();
        cell.lock().record_sent(huge.links(), 0, huge_mark);
        cell.lock().refused(huge.links(), 0, huge_mark);
        {
            let m = cell.lock();
            assert_eq!(m.held(huge.links()), 0, "taken back");
            assert_eq!(m.held(next.links()), 6, "put back");
            // Still counted as evicted: the huge prompt's own tail, which did not fit (what
            // it evicted of the other turn is back).
            assert_eq!((m.tokens(), m.evicted()), (600, 12));
            m.check();
        }
        // The other turn is refused too: its two links go, what `a` held before stays.
        cell.lock().refused(next.links(), 4, next_mark);
        let m = cell.lock();
        assert_eq!((m.held(next.links()), m.tokens()), (4, 400));
        assert_eq!(m.conversations(), 1);
        m.check();
    }

    #[test]
    fn a_prompt_whose_first_link_is_larger_than_the_budget_refused_leaves_the_model_as_it_was() {
        // Its one link evicts every other conversation and then itself: the refusal puts back
        // what it evicted of the others, and nothing of its own.
        let cell = ModelCell::new(800);
        let a = chain(&[1, 2, 3, 4]);
        cell.lock().record_from(a.links(), 0, cell.reserve());
        let huge = PromptChain::from_blocks([(100, 5_000)]);
        let stamp = cell.reserve();
        cell.lock().record_sent(huge.links(), 0, stamp);
        assert_eq!(cell.lock().held(a.links()), 0, "evicted to make room");
        cell.lock().refused(huge.links(), 0, stamp);
        let m = cell.lock();
        assert_eq!(m.held(huge.links()), 0, "taken back");
        assert_eq!((m.held(a.links()), m.tokens()), (4, 400), "put back");
        m.check();
    }

    #[test]
    fn a_refused_prompt_puts_back_only_the_last_links_the_log_keeps() {
        // More conversations evicted by one prompt than the log keeps: the refusal puts back
        // the most recently used of them, as many as the log holds.
        let count = EvictionLog::LEN as u64 + 44;
        let cell = ModelCell::new(count * 100);
        let one = |c: u64| chain(&[1_000 + c]);
        for c in 0..count {
            cell.lock().record_from(one(c).links(), 0, cell.reserve());
        }
        let ids: Vec<u64> = (0..count).map(|i| 10_000 + i).collect();
        let huge = chain(&ids);
        let stamp = cell.reserve();
        cell.lock().record_sent(huge.links(), 0, stamp);
        assert_eq!(cell.lock().evicted(), count, "every conversation made room");
        cell.lock().refused(huge.links(), 0, stamp);
        let m = cell.lock();
        let back: Vec<u64> = (0..count)
            .filter(|&c| m.held(one(c).links()) == 1)
            .collect();
        let newest: Vec<u64> = (count - EvictionLog::LEN as u64..count).collect();
        assert_eq!(back, newest);
        assert_eq!(m.evicted(), count - EvictionLog::LEN as u64);
        m.check();
    }

    #[test]
    fn a_refused_prompt_puts_back_what_it_evicted_across_the_end_of_the_log() {
        let one = |id: u64| PromptChain::from_blocks([(id, 30)]);
        let mut m = CacheModel::new(30);
        // Each prompt evicts the one before: 510 evictions logged, the log full and its next
        // entry one before its last slot.
        for s in 1..=511u32 {
            m.record_sent(one(u64::from(s)).links(), 0, s);
        }
        let pair = PromptChain::from_blocks([(1_000, 15), (1_001, 15)]);
        m.record_sent(pair.links(), 0, 512);
        // Evicts the pair, its tip logged in the log's last slot and its head in the first.
        let refused = one(2_000);
        m.record_sent(refused.links(), 0, 513);
        assert_eq!(m.held(pair.links()), 0);
        m.refused(refused.links(), 0, 513);
        assert_eq!(m.held(pair.links()), 2, "the head put back before its tip");
        assert_eq!(m.held(refused.links()), 0);
        m.check();
    }

    #[test]
    fn evictions_made_by_no_sent_prompt_leave_the_log_to_those_that_were() {
        // Room for one more conversation than there are: `a`, then as many others as the
        // log keeps, and a prompt sent that pushes `a` out.
        let others = EvictionLog::LEN as u64;
        let cell = ModelCell::new((others + 1) * 100);
        let one = |c: u64| chain(&[1_000 + c]);
        for c in 0..=others {
            cell.lock().record_from(one(c).links(), 0, cell.reserve());
        }
        let sent = chain(&[5]);
        let stamp = cell.reserve();
        cell.lock().record_sent(sent.links(), 0, stamp);
        assert_eq!(cell.lock().held(one(0).links()), 0);
        // Records not sent (recorded as taken) push every other out meanwhile.
        for c in 0..others {
            cell.lock()
                .record_from(chain(&[9_000 + c]).links(), 0, cell.reserve());
        }
        cell.lock().refused(sent.links(), 0, stamp);
        let m = cell.lock();
        assert_eq!(m.held(sent.links()), 0, "taken back");
        assert_eq!(m.held(one(0).links()), 1, "put back");
        m.check();
    }

    #[test]
    fn a_link_put_back_keeps_the_record_that_first_recorded_it() {
        // As in the test above: a prompt placed second and sent first, and the first's turn,
        // which it goes on from, sent after it. Room for 600 tokens.
        let cell = ModelCell::new(600);
        let (turn, longer) = (chain(&[1, 2, 3]), chain(&[1, 2, 3, 4]));
        let (first, second) = (cell.reserve(), cell.reserve());
        {
            let mut m = cell.lock();
            let known = m.known_from(longer.links(), 0).links;
            m.record_sent(longer.links(), known, second);
            let known = m.known_from(turn.links(), 0).links;
            m.record_sent(turn.links(), known, first);
        }
        let born = cell.lock().known_from(turn.links(), 0).born;
        assert_eq!(born, first);
        // A third prompt evicts both turns' links, and is refused: they are put back as
        // they were, first recorded by the first turn.
        let other = chain(&[10, 11, 12, 13, 14]);
        let stamp = cell.reserve();
        cell.lock().record_sent(other.links(), 0, stamp);
        assert!(cell.lock().held(turn.links()) < 3, "evicted");
        cell.lock().refused(other.links(), 0, stamp);
        assert_eq!(cell.lock().known_from(turn.links(), 0).born, born);
        // The second is refused, the first taken: the backend holds the first's prompt.
        cell.lock().refused(longer.links(), 0, second);
        let m = cell.lock();
        assert_eq!(m.held(turn.links()), 3, "taken back from under the first");
        m.check();
    }

    #[test]
    fn a_refused_prompt_leaves_the_links_a_later_prompt_went_on_from() {
        let cell = ModelCell::new(10_000);
        let (turn, later) = (chain(&[1, 2, 3]), chain(&[1, 2, 3, 4]));
        let turn_mark = cell.reserve();
        cell.lock().record_sent(turn.links(), 0, turn_mark);
        // A later prompt continues it before its answer comes.
        let later_mark = cell.reserve();
        cell.lock().record_sent(later.links(), 3, later_mark);
        cell.lock().refused(turn.links(), 0, turn_mark);
        let m = cell.lock();
        assert_eq!(
            m.held(later.links()),
            4,
            "the later prompt still needs them"
        );
        m.check();
    }

    #[test]
    fn the_latest_refused_records_are_remembered_and_older_ones_forgotten() {
        let cell = ModelCell::new(10_000);
        let turn = chain(&[1, 2, 3]);
        let stamp = cell.reserve();
        cell.lock().record_sent(turn.links(), 0, stamp);
        cell.lock().refused(turn.links(), 0, stamp);
        let mut m = cell.lock();
        assert!(m.was_refused(stamp));
        assert!(!m.was_refused(stamp + 1), "not refused");
        m.note_refused(0);
        assert!(!m.was_refused(0), "no stamp, nothing refused");
        assert!(m.was_refused(stamp), "stamp 0 takes no place");
        for later in 1..=REFUSALS as u32 {
            m.note_refused(stamp + later);
        }
        assert!(!m.was_refused(stamp), "pushed out by as many later ones");
        assert!(m.was_refused(stamp + 1));
    }

    #[test]
    fn a_link_whose_digest_is_held_under_another_leaves_the_link_before_it_evictable() {
        // Room for five conversations of two links.
        let mut m = CacheModel::new(1_000);
        let other = chain(&[9, 8]);
        m.record_next(other.links(), 0);
        // A prompt whose second link's digest is the other's first (a 64-bit collision).
        let mut links = chain(&[1, 2, 3]).links().to_vec();
        links[1].digest = other.links()[0].digest;
        m.record_next(&links, 0);
        m.check();
        // Many conversations later, the first link has gone as the least recently used.
        for s in 3..200u64 {
            m.record_next(chain(&[s * 10, s * 10 + 1]).links(), 0);
            m.check();
            assert!(m.tokens() <= 1_000);
        }
        assert!(!m.holds(links[0].digest));
    }

    #[test]
    fn a_prefix_sent_again_outlives_the_conversations_used_before_it() {
        // Room for ten links of 100 tokens.
        let mut m = CacheModel::new(1_000);
        let (long, other, prefix) = (chain(&[1, 2, 3, 4]), chain(&[10, 11]), chain(&[1, 2]));
        m.record_next(long.links(), 0);
        m.record_next(other.links(), 0);
        // The first two links of `long` sent again (a turn regenerated): the latest use.
        m.record_next(prefix.links(), 2);
        // Six new links evict what `long` held past the prefix.
        m.record_next(chain(&[20, 21, 22, 23, 24, 25]).links(), 0);
        assert_eq!((m.held(long.links()), m.held(other.links())), (2, 2));
        // One more link: `other`, used before the prefix, goes first.
        m.record_next(chain(&[30]).links(), 0);
        assert_eq!(m.held(prefix.links()), 2);
        assert_eq!(m.held(other.links()), 1);
        m.check();
    }

    #[test]
    fn a_chain_larger_than_the_budget_keeps_what_fits() {
        let mut m = CacheModel::new(250);
        let c = chain(&[1, 2, 3, 4, 5]);
        m.record_next(c.links(), 0);
        assert_eq!(m.held(c.links()), 2);
        m.check();
    }

    #[test]
    fn a_model_at_its_bound_stays_within_its_memory_bound_whatever_the_chains() {
        // The default budget: at most 8,192 links, under 770 KB; grown to twice it by
        // answers that showed the backend holding more, 16,384 links, under 1.1 MB.
        // Conversations past the bound, then prompts of as many new links as a chain has,
        // sent and refused.
        let blocks = |from: u64, n: u64, tokens: u32| {
            PromptChain::from_blocks((from..from + n).map(|id| (id, tokens)))
        };
        for (grown, links, bound) in [(false, 8_192, 770_000), (true, 16_384, 1_100_000)] {
            let cell = ModelCell::new(crate::Backend::<()>::DEFAULT_CACHE_TOKENS);
            while grown && cell.lock().budget() < 2 * crate::Backend::<()>::DEFAULT_CACHE_TOKENS {
                cell.lock().correct(Verdict::HeldMore, 0, 0);
            }
            let conversations = links / 20;
            for c in 0..conversations {
                cell.record_from(blocks(c << 20, 41, 16).links(), 0, 0);
            }
            let huge = blocks(1 << 40, PromptChain::MAX_LINKS as u64, 16);
            for _ in 0..3 {
                let stamp = cell.reserve();
                cell.lock().record_sent(huge.links(), 0, stamp);
                cell.lock().refused(huge.links(), 0, stamp);
            }
            for c in conversations..2 * conversations {
                cell.record_from(blocks(c << 20, 41, 16).links(), 0, 0);
            }
            let m = cell.lock();
            assert_eq!(m.blocks(), links as usize);
            // The figures the module's docs and BENCHMARKS.md give (`--nocapture`).
            eprintln!("{} bytes for {} links", m.memory_bytes(), m.blocks());
            assert!(m.memory_bytes() < bound, "{} bytes", m.memory_bytes());
            m.check();
        }
        // A budget of nothing, and links of no tokens: 1,024 links at most, at the bound's
        // cost a link.
        let mut m = CacheModel::new(0);
        m.record_next(blocks(1 << 40, PromptChain::MAX_LINKS as u64, 0).links(), 0);
        assert_eq!(m.blocks(), 1_024);
        assert!(m.memory_bytes() < 1_024 * 94, "{} bytes", m.memory_bytes());
        m.check();
    }

    /// A model of a large budget holding `n` conversations of 50 links each, none shared.
    fn sessions_of_fifty_links(n: u64) -> CacheModel {
        let mut m = CacheModel::new(1 << 30);
        for s in 0..n {
            let ids: Vec<u64> = (0..50).map(|i| s * 1_000 + i).collect();
            m.record_next(chain(&ids).links(), 0);
        }
        m
    }

    #[test]
    fn a_tracked_link_costs_under_80_bytes() {
        let m = sessions_of_fifty_links(1_000);
        assert_eq!(m.blocks(), 50_000);
        let per_block = m.memory_bytes() / m.blocks();
        assert!(per_block < 80, "{per_block} bytes a link");
        assert_eq!(std::mem::size_of::<Node>(), 32);
        assert_eq!(std::mem::size_of::<Evicted>(), 32);
    }

    /// The model as a plain map, evicting the least recently used leaf by scanning: what the
    /// model must agree with, link for link.
    #[derive(Default)]
    struct Reference {
        links: std::collections::HashMap<u64, RefLink>,
        tokens: u64,
        clock: u32,
    }

    struct RefLink {
        parent: Option<u64>,
        tokens: u64,
        children: usize,
        /// The last record that passed through it or ended at it: the least recently used
        /// leaf is the one with the earliest.
        used: u32,
        /// As the model stamps it: the records that add it or end at or pass from it.
        stamp: u32,
    }

    impl Reference {
        fn held(&self, chain: &[Link]) -> usize {
            chain
                .iter()
                .take_while(|l| self.links.contains_key(&l.digest))
                .count()
        }

        fn leaves(&self) -> usize {
            self.links.values().filter(|l| l.children == 0).count()
        }

        fn record(&mut self, chain: &[Link], budget: u64, max_blocks: usize) {
            if chain.is_empty() {
                return;
            }
            self.clock += 1;
            let known = self.held(chain);
            for link in &chain[..known] {
                self.links.get_mut(&link.digest).unwrap().used = self.clock;
            }
            let mut parent = known.checked_sub(1).map(|i| chain[i].digest);
            if let Some(p) = parent {
                self.links.get_mut(&p).unwrap().stamp = self.clock;
            }
            for (i, link) in chain.iter().enumerate().skip(known) {
                let before = if i == 0 { 0 } else { chain[i - 1].tokens };
                if let Some(p) = parent {
                    self.links.get_mut(&p).unwrap().children += 1;
                }
                self.links.insert(
                    link.digest,
                    RefLink {
                        parent,
                        tokens: link.tokens - before,
                        children: 0,
                        used: self.clock,
                        stamp: self.clock,
                    },
                );
                self.tokens += link.tokens - before;
                parent = Some(link.digest);
            }
            while self.tokens > budget || self.links.len() > max_blocks {
                if !self.evict_oldest(u32::MAX) {
                    break;
                }
            }
        }

        /// Evicts the least recently used leaf if it was used no later than `stamp`.
        fn evict_oldest(&mut self, stamp: u32) -> bool {
            let Some((&digest, oldest)) = self
                .links
                .iter()
                .filter(|(_, l)| l.children == 0)
                .min_by_key(|(_, l)| l.used)
            else {
                return false;
            };
            if oldest.stamp > stamp {
                return false;
            }
            let gone = self.links.remove(&digest).unwrap();
            self.tokens -= gone.tokens;
            if let Some(p) = gone.parent {
                let p = self.links.get_mut(&p).unwrap();
                p.children -= 1;
            }
            true
        }
    }

    /// Conversation `c`'s chain of `len` links: even conversations share a three-link head,
    /// and conversations 6 and 7 branch from conversation 0's first five links.
    fn conversation(c: u64, len: usize) -> PromptChain {
        PromptChain::from_blocks((0..len as u64).map(|i| {
            let id = match c {
                _ if c.is_multiple_of(2) && i < 3 => i,
                6 | 7 if i < 5 => i,
                _ => c * 1_000 + i,
            };
            (id, 10 + (id % 7) as u32 * 15)
        }))
    }

    #[derive(Clone, Debug)]
    enum Op {
        Record(u64, usize),
        Forget(u32, u64),
        Budget(u64),
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            7 => (0u64..8, 1usize..16).prop_map(|(c, n)| Op::Record(c, n)),
            // Longer than the bound on links the models are given below.
            1 => (0u64..8, 16usize..48).prop_map(|(c, n)| Op::Record(c, n)),
            1 => (0u32..6, 0u64..400).prop_map(|(back, tokens)| Op::Forget(back, tokens)),
            1 => (200u64..3_000).prop_map(Op::Budget),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(500))]

        #[test]
        fn the_model_evicts_exactly_as_a_plain_least_recently_used_map(
            budget in 300u64..3_000,
            ops in proptest::collection::vec(op(), 1..80),
        ) {
            let mut m = CacheModel::new(budget);
            // Few links, so the bound on links is reached as well as the one on tokens.
            m.max_blocks = 40;
            let mut r = Reference::default();
            let mut budget = budget;
            for op in ops {
                match op {
                    Op::Record(c, n) => {
                        let chain = conversation(c, n);
                        m.record_from_next(chain.links(), 0);
                        r.record(chain.links(), budget, 40);
                    }
                    Op::Forget(back, shortfall) => {
                        let stamp = m.clock.saturating_sub(back);
                        m.forget_until(stamp, shortfall);
                        let before = r.tokens;
                        while before - r.tokens < shortfall && r.evict_oldest(stamp) {}
                    }
                    Op::Budget(b) => {
                        budget = b;
                        m.set_budget(b);
                        m.max_blocks = 40;
                        m.evict();
                        // Moved to storage of its own size, as a lowered bound on links
                        // does: the same model, link for link and leaf for leaf.
                        m.compact();
                        while r.tokens > budget || r.links.len() > 40 {
                            r.evict_oldest(u32::MAX);
                        }
                    }
                }
                m.check();
                proptest::prop_assert_eq!(m.tokens(), r.tokens);
                proptest::prop_assert_eq!(m.blocks(), r.links.len());
                proptest::prop_assert_eq!(m.conversations() as usize, r.leaves());
                for c in 0..8 {
                    let chain = conversation(c, 48);
                    proptest::prop_assert_eq!(m.held(chain.links()), r.held(chain.links()));
                }
            }
        }
    }

    #[derive(Clone, Debug)]
    enum Sent {
        /// Conversation `c`'s first `n` links placed: a stamp reserved, and the fleet's clock
        /// read `step` milliseconds after the last placement's reading (before it, when
        /// negative: another thread read it before that one reserved its stamp).
        Place(u64, usize, i64),
        /// The `i`th prompt placed and not sent yet (modulo how many) sent.
        Send(usize),
        /// The `i`th prompt still waiting (modulo how many wait) answered, or refused.
        Answer(usize, bool),
        /// Conversation `c`'s first `n` links learned from elsewhere: recorded at the last
        /// placement's time (`c` even) or with no time.
        Learn(u64, usize),
    }

    fn sent() -> impl proptest::strategy::Strategy<Value = Sent> {
        use proptest::prelude::*;
        // Steps of a few seconds, so that a bucket of the live count begins now and then,
        // some back, and gaps longer than the buckets kept reach.
        let step = prop_oneof![
            6 => -3_000i64..30_000,
            1 => 600_000i64..2_000_000,
        ];
        prop_oneof![
            3 => (0u64..8, 1usize..16, step).prop_map(|(c, n, s)| Sent::Place(c, n, s)),
            3 => (0usize..8).prop_map(Sent::Send),
            3 => (0usize..8, any::<bool>()).prop_map(|(i, ok)| Sent::Answer(i, ok)),
            1 => (0u64..8, 1usize..16).prop_map(|(c, n)| Sent::Learn(c, n)),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(500))]

        /// Prompts placed, sent, answered and refused in any order, at times that need not
        /// follow their stamps, with prompts learned from elsewhere between them: the model
        /// stays whole and within its bounds, and each leaf counts in the bucket of the live
        /// count its stamp falls in.
        #[test]
        fn prompts_answered_or_refused_in_any_order_keep_the_model_whole(
            budget in 300u64..3_000,
            ops in proptest::collection::vec(sent(), 1..80),
        ) {
            let cell = ModelCell::new(budget);
            cell.lock().max_blocks = 40;
            let mut placed: Vec<(PromptChain, u32, u64)> = Vec::new();
            let mut waiting: Vec<(PromptChain, usize, u32)> = Vec::new();
            let mut now = 0u64;
            let drain = (0..80).flat_map(|_| [Sent::Send(0), Sent::Answer(0, true)]);
            for op in ops.into_iter().chain(drain) {
                match op {
                    Sent::Place(c, n, step) => {
                        now = now.saturating_add_signed(step);
                        placed.push((conversation(c, n), cell.reserve(), now));
                    }
                    Sent::Send(_) if placed.is_empty() => {}
                    Sent::Send(i) => {
                        let (chain, stamp, at) = placed.remove(i % placed.len());
                        let mut m = cell.lock();
                        m.note_sent(at, stamp);
                        let known = m.known_from(chain.links(), 0).links;
                        m.record_sent(chain.links(), known, stamp);
                        drop(m);
                        waiting.push((chain, known, stamp));
                    }
                    Sent::Answer(_, _) if waiting.is_empty() => {}
                    Sent::Answer(i, ok) => {
                        let (chain, known, stamp) = waiting.remove(i % waiting.len());
                        if !ok {
                            cell.lock().refused(chain.links(), known, stamp);
                        }
                    }
                    Sent::Learn(c, n) => {
                        // Learned now, or with no time (a fleet without a clock).
                        let at = if c % 2 == 0 { now } else { 0 };
                        cell.record_from(conversation(c, n).links(), 0, at);
                    }
                }
                let mut m = cell.lock();
                m.check();
                proptest::prop_assert!(m.blocks() <= 40);
                proptest::prop_assert!(m.tokens() <= budget);
                // Counts over a minute and over five, in turn: each moves on from the other's.
                let minute = m.live_conversations(now.saturating_sub(60_000).max(1));
                let five = m.live_conversations(now.saturating_sub(300_000).max(1));
                proptest::prop_assert!(minute <= five && five <= m.conversations());
                m.check();
            }
        }

        /// A prompt refused as soon as it was sent leaves every conversation held as it was.
        #[test]
        fn a_prompt_refused_at_once_leaves_every_conversation_as_it_was(
            budget in 300u64..3_000,
            before in proptest::collection::vec((0u64..8, 1usize..16), 0..20),
            refused in (0u64..8, 1usize..16),
            compacted in proptest::bool::ANY,
        ) {
            let cell = ModelCell::new(budget);
            for (c, n) in before {
                cell.lock().record_from(conversation(c, n).links(), 0, cell.reserve());
            }
            let held = |cell: &ModelCell| -> Vec<usize> {
                let m = cell.lock();
                (0..8).map(|c| m.held(conversation(c, 16).links())).collect()
            };
            let was = held(&cell);
            let tokens = cell.lock().tokens();
            let chain = conversation(refused.0, refused.1);
            let stamp = cell.reserve();
            let mut m = cell.lock();
            let known = m.known_from(chain.links(), 0).links;
            m.record_sent(chain.links(), known, stamp);
            if compacted {
                // Moved to storage of its own size while the prompt was on its way (its
                // backend announced again with a lower budget): nothing changes.
                m.compact();
            }
            m.refused(chain.links(), known, stamp);
            m.check();
            proptest::prop_assert_eq!(m.tokens(), tokens);
            drop(m);
            proptest::prop_assert_eq!(held(&cell), was);
        }
    }

    #[derive(Clone, Debug)]
    enum Turn {
        /// Conversation `c`'s first `n` links placed: a stamp reserved.
        Place(u64, usize),
        /// The `i`th prompt placed and not sent yet (modulo how many) sent.
        Send(usize),
        /// The `i`th prompt sent and not answered yet answered, or refused.
        Answer(usize, bool),
    }

    fn turn() -> impl proptest::strategy::Strategy<Value = Turn> {
        use proptest::prelude::*;
        prop_oneof![
            (0u64..8, 1usize..16).prop_map(|(c, n)| Turn::Place(c, n)),
            (0usize..8).prop_map(Turn::Send),
            (0usize..8, any::<bool>()).prop_map(|(i, ok)| Turn::Answer(i, ok)),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(500))]

        /// With room for every prompt, a prompt the backend took stays held whole, whatever
        /// order the prompts are placed, sent, answered and refused in.
        #[test]
        fn with_room_for_all_a_prompt_taken_stays_held_whatever_the_order(
            ops in proptest::collection::vec(turn(), 1..80),
        ) {
            let cell = ModelCell::new(1 << 40);
            let mut placed: Vec<(PromptChain, u32)> = Vec::new();
            let mut sent: Vec<(PromptChain, usize, u32)> = Vec::new();
            let mut taken: Vec<PromptChain> = Vec::new();
            for op in ops {
                match op {
                    Turn::Place(c, n) => placed.push((conversation(c, n), cell.reserve())),
                    Turn::Send(_) if placed.is_empty() => {}
                    Turn::Send(i) => {
                        let (chain, stamp) = placed.remove(i % placed.len());
                        let mut m = cell.lock();
                        let known = m.known_from(chain.links(), 0).links;
                        m.record_sent(chain.links(), known, stamp);
                        sent.push((chain, known, stamp));
                    }
                    Turn::Answer(_, _) if sent.is_empty() => {}
                    Turn::Answer(i, ok) => {
                        let (chain, known, stamp) = sent.remove(i % sent.len());
                        if ok {
                            taken.push(chain);
                        } else {
                            cell.lock().refused(chain.links(), known, stamp);
                        }
                    }
                }
                let m = cell.lock();
                m.check();
                for chain in &taken {
                    proptest::prop_assert_eq!(m.held(chain.links()), chain.len());
                }
            }
        }
    }

    #[test]
    fn a_known_prefix_the_model_lacks_is_searched_for_instead() {
        let mut m = CacheModel::new(10_000);
        m.record_next(chain(&[1, 2]).links(), 0);
        // Told that five links are held where two are (a turn placed before its last one
        // settled, or a fingerprint shared by a new link): the record finds the two.
        let (held, _) = m.record_from_next(chain(&[1, 2, 3, 4, 5, 6]).links(), 5);
        assert_eq!(held, 2);
        assert_eq!(m.held(chain(&[1, 2, 3, 4, 5, 6]).links()), 6);
        m.check();
    }

    #[test]
    fn a_known_prefix_is_followed_to_the_last_link_held_after_it() {
        let mut m = CacheModel::new(10_000);
        let held = chain(&[1, 2, 3, 4, 5]);
        m.record(held.links(), 0, 7);
        // Told that two links are held where five are: the three after them are found too.
        let longer = chain(&[1, 2, 3, 4, 5, 6]);
        let known = m.known_from(longer.links(), 2);
        assert_eq!((known.links, known.last_used, known.born), (5, 7, 7));
        assert_eq!(m.record_from(longer.links(), 2, 8), (5, 7));
        assert_eq!(m.tokens(), 600);
        m.check();
    }

    #[test]
    fn a_known_prefix_is_followed_to_the_tip_of_a_chain_held_whole() {
        let mut m = CacheModel::new(10_000);
        let turn = chain(&[1, 2, 3, 4]);
        m.record(turn.links(), 0, 7);
        // The same prompt sent again, two links known: every link is found, its tip too.
        let known = m.known_from(turn.links(), 2);
        assert_eq!((known.links, known.last_used, known.born), (4, 7, 7));
        assert_eq!(m.record_from(turn.links(), 2, 8), (4, 7));
        assert!(m.resent(turn.links()[3].digest));
        m.check();
    }

    #[test]
    fn a_guess_that_none_is_held_still_finds_every_link_held() {
        let mut m = CacheModel::new(10_000);
        m.record_next(chain(&[1, 2, 3]).links(), 0);
        // Held whole, held in part, and not held at all: the same with either guess.
        for (ids, held) in [
            (&[1, 2, 3][..], 3),
            (&[1, 2, 3, 4, 5][..], 3),
            (&[1, 2, 7][..], 2),
            (&[1, 9][..], 1),
            (&[8, 9, 10][..], 0),
            (&[8][..], 0),
            (&[][..], 0),
        ] {
            let c = chain(ids);
            assert_eq!(m.held(c.links()), held, "{ids:?}");
            for none_likely in [false, true] {
                assert_eq!(
                    m.held_guessing(c.links(), none_likely),
                    held,
                    "{ids:?}, none likely: {none_likely}"
                );
            }
        }
    }

    #[test]
    fn no_stamp_is_earlier_than_any_stamp_past_half_the_clock_too() {
        for stamp in [1, 7, 1 << 31, (1 << 31) + 1, u32::MAX] {
            assert_eq!(latest(0, stamp), stamp);
        }
        // A model whose stamps are past half the clock notes its evictions all the same.
        let mut m = CacheModel::new(100);
        let start = u32::MAX - 10;
        m.record(chain(&[1]).links(), 0, start);
        m.record(chain(&[2]).links(), 0, start + 1);
        assert_eq!(m.held(chain(&[1]).links()), 0);
        assert_eq!(m.evicted_through, start);
    }

    #[test]
    fn a_session_recorded_after_the_last_eviction_is_kept_and_an_older_one_is_looked_up() {
        // Room for two conversations of 300 tokens.
        let cell = ModelCell::new(600);
        let (a, b, c) = (chain(&[1, 2, 3]), chain(&[4, 5, 6]), chain(&[7, 8, 9]));
        let mark_a = cell.reserve();
        cell.lock().record_from(a.links(), 0, mark_a);
        let mark_b = cell.reserve();
        cell.lock().record_from(b.links(), 0, mark_b);
        assert!(
            cell.kept_since(mark_a) && cell.kept_since(mark_b),
            "nothing evicted yet"
        );
        assert!(!cell.kept_since(0), "no stamp, nothing known");
        // c pushes a out.
        let mark_c = cell.reserve();
        cell.lock().record_from(c.links(), 0, mark_c);
        assert!(!cell.kept_since(mark_a));
        assert_eq!(cell.lock().held(a.links()), 0);
        assert!(cell.kept_since(mark_b) && cell.kept_since(mark_c));
        // Records settling out of order: the later stamp is recorded first, and a link never
        // takes an earlier stamp than it has.
        let (early, late) = (cell.reserve(), cell.reserve());
        cell.lock().record_from(b.links(), 3, late);
        cell.lock()
            .record_from(chain(&[4, 5, 6, 10]).links(), 3, early);
        assert!(cell.kept_since(late));
        assert_eq!(cell.lock().known_from(b.links(), 0).last_used, late);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(300))]

        /// What placement trusts without a look into the model: a conversation whose last
        /// record's stamp is later than the last eviction is held whole, whatever order the
        /// records settle in.
        #[test]
        fn a_record_later_than_every_eviction_is_held_whole(
            budget in 300u64..3_000,
            ops in proptest::collection::vec((op(), proptest::bool::ANY), 1..80),
        ) {
            let cell = ModelCell::new(budget);
            // Each conversation's last recorded chain and its stamp.
            let mut last: Vec<Option<(PromptChain, u32)>> = vec![None; 8];
            // A record reserved and not settled yet, settled after the next one.
            let mut pending: Option<(u64, PromptChain, u32)> = None;
            for (op, hold_back) in ops {
                match op {
                    Op::Record(c, n) => {
                        let chain = conversation(c, n);
                        let stamp = cell.reserve();
                        let settled = match pending.take() {
                            None if hold_back => {
                                pending = Some((c, chain, stamp));
                                None
                            }
                            earlier => {
                                cell.lock().record_from(chain.links(), 0, stamp);
                                last[c as usize] = Some((chain, stamp));
                                earlier
                            }
                        };
                        if let Some((c, chain, stamp)) = settled {
                            cell.lock().record_from(chain.links(), 0, stamp);
                            last[c as usize] = Some((chain, stamp));
                        }
                    }
                    Op::Forget(back, shortfall) => {
                        let mut m = cell.lock();
                        let stamp = m.clock.saturating_sub(back);
                        m.forget_until(stamp, shortfall);
                    }
                    Op::Budget(b) => cell.lock().set_budget(b),
                }
                for (chain, stamp) in last.iter().flatten() {
                    if cell.kept_since(*stamp) {
                        proptest::prop_assert_eq!(cell.lock().held(chain.links()), chain.len());
                    }
                }
            }
        }
    }

    #[test]
    fn the_index_agrees_with_a_map_through_inserts_and_removals() {
        use std::collections::HashMap;
        let mut index = Index::new();
        let mut reference: HashMap<u64, u32> = HashMap::new();
        // Keys that collide on their first slot often: small values, mixed with spread ones.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for step in 0..20_000u32 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let key = if step % 3 == 0 { x % 64 } else { x };
            if x % 5 < 2 {
                index.remove(key);
                reference.remove(&key_of(key));
            } else if !index.contains(key) {
                index.insert(key, step);
                reference.insert(key_of(key), step);
            }
            if step % 997 == 0 {
                for (&k, &v) in &reference {
                    assert_eq!(index.get(k), Some(v));
                }
                assert_eq!(index.len(), reference.len());
            }
        }
        for (&k, &v) in &reference {
            assert_eq!(index.get(k), Some(v));
        }
    }

    #[test]
    fn every_turn_sent_within_a_bucket_s_ten_seconds_counts_in_that_bucket() {
        // More conversations than there are buckets, all sent within one bucket's time: none
        // begins a bucket of its own, so none falls out of the count.
        let mut m = hundred_conversations(1_000_000, 90);
        assert_eq!(m.recent.begun, 1);
        assert_eq!(m.live_conversations(1), 100);
        m.check();
    }

    #[test]
    fn a_live_count_from_time_zero_counts_every_conversation_held() {
        // A conversation a bucket, more than are kept: those older than the oldest bucket
        // count too.
        let mut m = hundred_conversations(0, 10_000);
        assert_eq!(m.live_conversations(1), 64);
        assert_eq!(m.live_conversations(0), 100);
        m.check();
    }

    #[test]
    fn a_conversation_learned_with_no_clock_counts_as_live_while_no_time_is_known() {
        let cell = ModelCell::new(100_000);
        cell.record_from(chain(&[1, 2]).links(), 0, 0);
        let mut m = cell.lock();
        assert_eq!(m.live_conversations(60_000), 1);
        m.check();
    }

    #[test]
    fn the_index_s_memory_is_twelve_bytes_a_slot_and_counts_in_the_model_s() {
        let m = sessions_of_fifty_links(100);
        assert_eq!(m.blocks(), 5_000);
        let slots = m.index.slots.capacity();
        assert!(slots >= 5_000);
        assert_eq!(m.index.memory_bytes(), slots * 12);
        assert!(m.memory_bytes() >= slots * 12 + m.nodes.capacity() * 32);
    }

    #[test]
    fn a_count_after_every_bucket_ended_is_zero_and_the_next_count_goes_back() {
        // A conversation a bucket, more than are kept. A count later than every bucket's end
        // passes them all; the next count, from within the newest, counts that one again.
        let mut m = hundred_conversations(0, 10_000);
        assert_eq!(m.live_conversations(10_000_000), 0);
        m.check();
        assert_eq!(m.live_conversations(995_000), 1);
        assert_eq!(m.live_conversations(1), 64);
        m.check();
    }

    #[test]
    fn a_leaf_removed_from_a_bucket_that_does_not_count_it_leaves_the_counts_at_zero() {
        // A leaf counts in no bucket when recorded before the oldest began, yet a bucket begun
        // 2^31 stamps later takes it for its own: its removal finds a bucket without it.
        let mut r = Recent::default();
        r.note(0, 10, 0);
        r.remove(10);
        assert_eq!(r.bucket(0).leaves, 0);
        assert_eq!(r.since(0), Some(0));
        r.add(10);
        assert_eq!(r.since(0), Some(1));
    }
}
