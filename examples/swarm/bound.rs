//! What idealised caches, of whole sessions or of blocks, could have done with a run's turns.
//!
//! A run's turns are replayed, in the order they were sent, against idealised stores that each
//! hold whole conversation states: a conversation's state is its last prompt, shared system
//! prompt included, as llama-server keeps one in a slot or a RAM entry. A turn hits, as in the
//! tables, when the store it meets holds at least [`HIT_SHARE`] of its previous prompt; a
//! compaction makes every older state of its conversation useless. Three replays separate
//! what bounds a run's hit rate:
//!
//! - **pooled, furthest ahead**: one store as large as the whole fleet's KV and RAM, evicting
//!   the state whose conversation comes back last. What the fleet's capacity allows with
//!   perfect foresight (the classic bound for caches of equal-sized items; with states of
//!   different sizes it is the usual heuristic, not a proof).
//! - **pooled, least recently used**: the same store, evicting as the backends do. What the
//!   capacity allows without foresight.
//! - **per backend, least recently used**: each backend its own store of its KV and RAM, each
//!   turn meeting the store of the backend the policy sent it to. What the placement leaves
//!   the backends: the gap to the run's own hit rate is what the backends' rules cost beyond a
//!   plain store (slots taken by another prompt, states dropped unsaved, whole prompts saved
//!   again in RAM). A backend that holds a shared prefix once and evicts block by block
//!   (`--slot-policy paged`) can do better than this replay.
//!
//! [`block_reuse`] replays a trace's requests against caches of blocks instead, as a backend
//! with a paged prefix cache keeps them: a prefix many prompts share is held once, and a
//! prompt's blocks are evicted least recently used first, its tail before its prefix. Pooled
//! over the fleet, it gives what the fleet's capacity allows any placement without foresight;
//! per backend, what the policy's placement leaves backends that cache blocks.
//!
//! [`crowding`] looks at the same turns from the slots' side: a llama-server backend homing more
//! conversations than it has slots must give one's slot to another between their turns, saving
//! the state it held to RAM only if the new prompt keeps less than half of it.

use std::collections::{BTreeMap, HashMap};

use tower_affinity::BackendId;

use crate::cache::Block;
use crate::report::{TurnRecord, HIT_SHARE};

/// Which held state makes room first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Evict {
    /// The state used longest ago.
    LeastRecentlyUsed,
    /// The state whose conversation sends its next turn last (never, first).
    FurthestAhead,
}

/// The stores the turns meet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stores {
    /// One store of the fleet's whole capacity.
    Pooled,
    /// One store per backend, of that backend's capacity.
    PerBackend,
}

struct Held {
    tokens: u64,
    /// The position of the turn that left it.
    last: usize,
    /// The position of its conversation's next turn; `usize::MAX` if none.
    next: usize,
}

#[derive(Default)]
struct Store {
    capacity: u64,
    used: u64,
    held: HashMap<u32, Held>,
}

impl Store {
    fn put(&mut self, conversation: u32, held: Held) {
        self.used += held.tokens;
        if let Some(old) = self.held.insert(conversation, held) {
            self.used -= old.tokens;
        }
    }

    fn forget(&mut self, conversation: u32) {
        if let Some(old) = self.held.remove(&conversation) {
            self.used -= old.tokens;
        }
    }

    fn make_room(&mut self, evict: Evict) {
        while self.used > self.capacity {
            // Ties (states never used again) go to the lowest conversation, so that a seed
            // gives the same figures every time.
            let victim = match evict {
                Evict::LeastRecentlyUsed => self.held.iter().min_by_key(|(&c, h)| (h.last, c)),
                Evict::FurthestAhead => self
                    .held
                    .iter()
                    .max_by_key(|(&c, h)| (h.next, std::cmp::Reverse(c))),
            };
            let Some((&c, _)) = victim else { return };
            self.forget(c);
        }
    }
}

/// The share of eligible turns (those with a previous turn, compactions excepted) that the
/// stores would have served warm; `None` without an eligible turn. `capacity` gives each
/// backend's tokens (its KV and RAM); a backend it does not name holds nothing.
pub(crate) fn hit_rate(
    records: &[TurnRecord],
    capacity: &HashMap<BackendId, u64>,
    stores: Stores,
    evict: Evict,
) -> Option<f64> {
    let mut order: Vec<&TurnRecord> = records.iter().collect();
    order.sort_by_key(|t| (t.sent, t.conversation));
    // A state's next use is its conversation's next turn, unless that turn is a compaction,
    // which rewrites the history: then the state is never used again.
    let mut next = vec![usize::MAX; order.len()];
    let mut seen: HashMap<u32, usize> = HashMap::new();
    for (i, t) in order.iter().enumerate().rev() {
        if let Some(j) = seen.insert(t.conversation, i) {
            if !order[j].compaction {
                next[i] = j;
            }
        }
    }
    let mut by_backend: HashMap<BackendId, usize> = HashMap::new();
    let mut all: Vec<Store> = Vec::new();
    match stores {
        Stores::Pooled => all.push(Store {
            capacity: capacity.values().sum(),
            ..Store::default()
        }),
        Stores::PerBackend => {
            for (b, &tokens) in capacity {
                by_backend.insert(b.clone(), all.len());
                all.push(Store {
                    capacity: tokens,
                    ..Store::default()
                });
            }
        }
    }
    let (mut eligible, mut hits) = (0usize, 0usize);
    for (i, t) in order.iter().enumerate() {
        let store = match stores {
            Stores::Pooled => Some(0),
            Stores::PerBackend => by_backend.get(&t.backend).copied(),
        };
        if t.eligible() {
            eligible += 1;
            let held = store
                .and_then(|s| all[s].held.get(&t.conversation))
                .map_or(0, |h| h.tokens);
            let prev = t.prev_prompt.unwrap_or(0);
            if held as f64 >= HIT_SHARE * prev as f64 {
                hits += 1;
            }
        }
        if t.compaction {
            all.iter_mut().for_each(|s| s.forget(t.conversation));
        }
        if let Some(s) = store {
            let held = Held {
                tokens: t.prompt,
                last: i,
                next: next[i],
            };
            all[s].put(t.conversation, held);
            all[s].make_room(evict);
        }
    }
    (eligible > 0).then(|| hits as f64 / eligible as f64)
}

/// A cache of blocks of `capacity` tokens, evicting the least recently used block first.
#[derive(Default)]
struct BlockStore {
    capacity: u64,
    used: u64,
    clock: u64,
    /// Each held block's last use and tokens.
    held: HashMap<u64, (u64, u32)>,
    /// Held blocks by last use, oldest first.
    by_use: BTreeMap<u64, u64>,
}

impl BlockStore {
    /// Tokens of the longest prefix of `blocks` held.
    fn reuse(&self, blocks: &[Block]) -> u64 {
        blocks
            .iter()
            .take_while(|b| self.held.contains_key(&b.id))
            .map(|b| u64::from(b.tokens))
            .sum()
    }

    /// Holds `blocks` as used now, the prefix most recently (so a prompt's tail goes before
    /// the prefix it shares), and makes room.
    fn put(&mut self, blocks: &[Block]) {
        for b in blocks.iter().rev() {
            self.clock += 1;
            let clock = self.clock;
            match self.held.get_mut(&b.id) {
                Some((last, _)) => {
                    self.by_use.remove(last);
                    *last = clock;
                }
                None => {
                    self.held.insert(b.id, (clock, b.tokens));
                    self.used += u64::from(b.tokens);
                }
            }
            self.by_use.insert(clock, b.id);
        }
        while self.used > self.capacity {
            let Some((_, id)) = self.by_use.pop_first() else {
                return;
            };
            if let Some((_, tokens)) = self.held.remove(&id) {
                self.used -= u64::from(tokens);
            }
        }
    }
}

/// The prompt tokens caches of blocks would have reused, as a share of the ideal (what one
/// infinite cache would have); `None` when the ideal is nothing. `requests` are each
/// request's record and prompt blocks, in any order (they are replayed in the order sent).
/// `capacity` gives each backend's tokens; a backend it does not name holds nothing.
pub(crate) fn block_reuse(
    requests: &[(&TurnRecord, &[Block])],
    capacity: &HashMap<BackendId, u64>,
    stores: Stores,
) -> Option<f64> {
    let mut order: Vec<&(&TurnRecord, &[Block])> = requests.iter().collect();
    order.sort_by_key(|(t, _)| (t.sent, t.conversation));
    let mut all: HashMap<Option<&BackendId>, BlockStore> = match stores {
        Stores::Pooled => [(
            None,
            BlockStore {
                capacity: capacity.values().sum(),
                ..BlockStore::default()
            },
        )]
        .into(),
        Stores::PerBackend => capacity
            .iter()
            .map(|(b, &capacity)| {
                let store = BlockStore {
                    capacity,
                    ..BlockStore::default()
                };
                (Some(b), store)
            })
            .collect(),
    };
    let (mut reused, mut ideal) = (0u64, 0u64);
    for (t, blocks) in order {
        ideal += t.ideal;
        let at = match stores {
            Stores::Pooled => None,
            Stores::PerBackend => Some(&t.backend),
        };
        if let Some(store) = all.get_mut(&at) {
            // A store holds no block the ideal has not seen; the cap only evens out how the
            // ideal counts a partial last block.
            let n = store.reuse(blocks);
            reused += n.min(t.ideal);
            store.put(blocks);
        }
    }
    (ideal > 0).then(|| reused as f64 / ideal as f64)
}

/// Eligible turns and their hits, on backends homing more conversations than they have slots
/// and on the rest, and how often the fleet was crowded no more than it had to be.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Crowding {
    /// Eligible turns served by a backend that then homed more conversations than its slots,
    /// and how many of them hit.
    pub(crate) crowded: (usize, usize),
    /// The other eligible turns, and their hits.
    pub(crate) roomy: (usize, usize),
    /// Turns sent while the conversations homed beyond the backends' slots were as few as the
    /// conversations and slots allow (the conversations begun so far less the fleet's slots),
    /// of all turns.
    pub(crate) fewest: (usize, usize),
}

/// Replays a run's turns in the order they were sent, each conversation homed where its
/// latest turn went, and counts turns by whether the backend serving them then homed more
/// conversations than `slots` gives it. A backend `slots` does not name has none.
pub(crate) fn crowding(records: &[TurnRecord], slots: &HashMap<BackendId, u32>) -> Crowding {
    let mut order: Vec<&TurnRecord> = records.iter().collect();
    order.sort_by_key(|t| (t.sent, t.conversation));
    let total_slots: u64 = slots.values().map(|&n| u64::from(n)).sum();
    let mut home: HashMap<u32, &BackendId> = HashMap::new();
    let mut homed: HashMap<&BackendId, u64> = HashMap::new();
    let mut c = Crowding::default();
    for t in order {
        if let Some(old) = home.insert(t.conversation, &t.backend) {
            *homed.entry(old).or_default() -= 1;
        }
        *homed.entry(&t.backend).or_default() += 1;
        let room = |b: &BackendId| slots.get(b).map_or(0, |&n| u64::from(n));
        let over: u64 = homed.iter().map(|(b, &n)| n.saturating_sub(room(b))).sum();
        c.fewest.1 += 1;
        if over <= (home.len() as u64).saturating_sub(total_slots) {
            c.fewest.0 += 1;
        }
        if t.eligible() {
            let side = if homed[&t.backend] > room(&t.backend) {
                &mut c.crowded
            } else {
                &mut c.roomy
            };
            side.0 += 1;
            side.1 += usize::from(t.hit());
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::time::Instant;
    use tower_affinity::Outcome;

    use super::*;
    use crate::cache::Source;

    /// Conversations sending turns of `tokens` each in the order given, one a second.
    fn turns(order: &[(u32, &str)], tokens: u64) -> Vec<TurnRecord> {
        let t0 = Instant::now();
        let mut seen = std::collections::HashSet::new();
        order
            .iter()
            .enumerate()
            .map(|(i, &(c, backend))| TurnRecord {
                conversation: c,
                sent: t0 + Duration::from_secs(i as u64),
                prompt: tokens,
                backend: backend.into(),
                outcome: Outcome::HomeHit,
                prev_prompt: (!seen.insert(c)).then_some(tokens),
                compaction: false,
                reused: 0,
                ideal: 0,
                source: Source::Slot,
                moved_node: false,
                moved_backend: false,
                ttft: Duration::from_secs(1),
            })
            .collect()
    }

    fn rate(records: &[TurnRecord], only: &[(&str, u64)], stores: Stores, e: Evict) -> f64 {
        let capacity = only.iter().map(|&(b, n)| (b.into(), n)).collect();
        hit_rate(records, &capacity, stores, e).expect("a later turn")
    }

    #[test]
    fn a_store_that_holds_every_state_serves_every_later_turn_warm() {
        let order: Vec<(u32, &str)> = (0..4).flat_map(|_| (0..3).map(|c| (c, "a"))).collect();
        let r = turns(&order, 100);
        for e in [Evict::LeastRecentlyUsed, Evict::FurthestAhead] {
            assert_eq!(rate(&r, &[("a", 300)], Stores::Pooled, e), 1.0);
        }
    }

    #[test]
    fn least_recently_used_misses_every_turn_of_a_cycle_one_state_too_large() {
        // Three conversations in turn, room for two: each comes back just after it was
        // evicted. Evicting the one needed furthest ahead (the one just served, when it comes
        // back last) keeps the other two warm.
        let order: Vec<(u32, &str)> = (0..6).flat_map(|_| (0..3).map(|c| (c, "a"))).collect();
        let r = turns(&order, 100);
        let lru = rate(&r, &[("a", 200)], Stores::Pooled, Evict::LeastRecentlyUsed);
        let furthest = rate(&r, &[("a", 200)], Stores::Pooled, Evict::FurthestAhead);
        assert_eq!(lru, 0.0);
        assert!((furthest - 2.0 / 3.0).abs() < 1e-9, "{furthest}");
    }

    #[test]
    fn per_backend_stores_pool_nothing_across_backends() {
        // Two conversations on one backend with room for one, a second backend empty: pooled,
        // both stay warm; per backend, they take turns evicting each other.
        let order: Vec<(u32, &str)> = (0..4).flat_map(|_| [(0, "a"), (1, "a")]).collect();
        let r = turns(&order, 100);
        let cap = [("a", 100), ("b", 100)];
        let e = Evict::LeastRecentlyUsed;
        assert_eq!(rate(&r, &cap, Stores::Pooled, e), 1.0);
        assert_eq!(rate(&r, &cap, Stores::PerBackend, e), 0.0);
    }

    #[test]
    fn a_turn_sent_elsewhere_finds_only_what_that_backend_kept() {
        // Conversation 0 moves from a to b: its state on a does not serve it on b.
        let r = turns(&[(0, "a"), (0, "b"), (0, "b")], 100);
        let cap = [("a", 1_000), ("b", 1_000)];
        let e = Evict::LeastRecentlyUsed;
        assert_eq!(rate(&r, &cap, Stores::PerBackend, e), 0.5);
    }

    /// Requests of one-token blocks with the given ids, one a second, each on its backend;
    /// the ideal of each is the longest prefix of ids an earlier request had.
    fn block_requests(order: &[(&[u64], &str)]) -> Vec<(TurnRecord, Vec<Block>)> {
        let backends: Vec<(u32, &str)> = (0..).zip(order.iter().map(|&(_, b)| b)).collect();
        let mut records = turns(&backends, 0);
        let mut seen = std::collections::HashSet::new();
        order
            .iter()
            .zip(records.iter_mut())
            .map(|(&(ids, _), t)| {
                t.ideal = ids.iter().take_while(|id| seen.contains(*id)).count() as u64;
                seen.extend(ids.iter().copied());
                let blocks = ids.iter().map(|&id| Block { id, tokens: 1 }).collect();
                (t.clone(), blocks)
            })
            .collect()
    }

    fn reuse(requests: &[(TurnRecord, Vec<Block>)], cap: &[(&str, u64)], stores: Stores) -> f64 {
        let requests: Vec<(&TurnRecord, &[Block])> =
            requests.iter().map(|(t, b)| (t, &b[..])).collect();
        let capacity = cap.iter().map(|&(b, n)| (b.into(), n)).collect();
        block_reuse(&requests, &capacity, stores).expect("an ideal to share")
    }

    #[test]
    fn pooled_blocks_serve_a_shared_prefix_wherever_it_was_read() {
        // B shares A's first two blocks but is read on another backend; C continues A on a.
        let r = block_requests(&[(&[1, 2, 3], "a"), (&[1, 2, 4], "b"), (&[1, 2, 3, 5], "a")]);
        let cap = [("a", 100), ("b", 100)];
        // Ideal: B 2 blocks, C 3. Pooled, both; per backend, C's 3 only.
        assert_eq!(reuse(&r, &cap, Stores::Pooled), 1.0);
        assert!((reuse(&r, &cap, Stores::PerBackend) - 0.6).abs() < 1e-9);
    }

    #[test]
    fn a_full_block_store_evicts_a_prompts_tail_before_its_prefix() {
        // Room for three blocks: D's block evicts A's last, so C finds A's first two.
        let r = block_requests(&[(&[1, 2, 3], "a"), (&[4], "a"), (&[1, 2, 3, 5], "a")]);
        assert!((reuse(&r, &[("a", 3)], Stores::Pooled) - 2.0 / 3.0).abs() < 1e-9);
        // With room for all four, C finds all three it shares.
        assert_eq!(reuse(&r, &[("a", 4)], Stores::Pooled), 1.0);
    }

    #[test]
    fn crowding_counts_turns_on_backends_homing_more_conversations_than_slots() {
        // a has one slot, b two. Conversations 0 and 1 on a, then 1 moves to b: a's turns are
        // crowded until the move, and the fleet (three slots, two conversations) needed no
        // crowding at all.
        let mut r = turns(
            &[(0, "a"), (1, "a"), (0, "a"), (1, "b"), (0, "a"), (1, "b")],
            100,
        );
        r[2].reused = 100; // a hit while crowded
        r[4].reused = 100;
        r[5].reused = 100;
        let slots = [("a", 1), ("b", 2)]
            .into_iter()
            .map(|(b, n)| (b.into(), n))
            .collect();
        let c = crowding(&r, &slots);
        // Eligible: turns 2 to 5. Crowded: turn 2 (0 and 1 both homed on a).
        assert_eq!(c.crowded, (1, 1));
        assert_eq!(c.roomy, (3, 2));
        // Turns 1 and 2 were sent with a crowded and b empty.
        assert_eq!(c.fewest, (4, 6));
    }

    #[test]
    fn crowding_forced_by_more_conversations_than_slots_is_the_fewest_possible() {
        // Two conversations on one backend of one slot: one too many, but no fewer possible.
        let r = turns(&[(0, "a"), (1, "a"), (0, "a"), (1, "a")], 100);
        let slots = [("a".into(), 1)].into_iter().collect();
        let c = crowding(&r, &slots);
        assert_eq!(c.fewest, (4, 4));
        assert_eq!(c.crowded.0, 2);
        assert_eq!(c.roomy.0, 0);
    }

    #[test]
    fn furthest_ahead_evicts_first_a_state_whose_next_turn_is_a_compaction() {
        // Room for one state. Conversation 1's state is needed at turn 3; conversation 0's
        // next turn (2) compacts, so its state is never used again: evicting it keeps 1 warm.
        let mut r = turns(&[(1, "a"), (0, "a"), (0, "a"), (1, "a")], 100);
        r[2].compaction = true;
        let rate = rate(&r, &[("a", 100)], Stores::Pooled, Evict::FurthestAhead);
        assert_eq!(rate, 1.0);
    }

    #[test]
    fn a_compaction_leaves_no_older_state_to_hit() {
        // Conversation 0 compacts on b, then comes back to a: what a kept is the history the
        // compaction rewrote.
        let mut r = turns(&[(0, "a"), (0, "b"), (0, "a")], 100);
        let cap = [("a", 1_000), ("b", 1_000)];
        let e = Evict::LeastRecentlyUsed;
        // Without it, the turn back on a finds the state a kept (the one on b missed).
        assert_eq!(rate(&r, &cap, Stores::PerBackend, e), 0.5);
        r[1].compaction = true;
        assert_eq!(rate(&r, &cap, Stores::PerBackend, e), 0.0);
    }
}
