//! Weighted rendezvous (highest-random-weight) hashing.
//!
//! Every (key, name) pair gets a pseudo-random score from a stable digest of both; a key
//! prefers the names with the highest scores. Two routers with the same fleet therefore agree
//! on every key's order, and removing a name changes the order of no other pair: only the keys
//! whose first choice it was move. Scores are weighted by slots (`-w / ln(u)`), so a node with
//! twice the slots receives twice the new sessions.

use std::cmp::Ordering;
use std::ops::ControlFlow;

use crate::key::SessionKey;

/// A finaliser that spreads every input bit over the output (from MurmurHash3).
pub(crate) const fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^= x >> 33;
    x
}

/// A pseudo-random rank of the name with digest `digest` for a request's own number `tie`
/// (its prompt's digest, say): the same on every router, whatever order it discovered its
/// names in. Higher is better.
pub(crate) const fn tie_rank(tie: u64, digest: u64) -> u64 {
    mix(tie ^ mix(digest))
}

/// 53 pseudo-random bits for the pair (key, name).
fn bits(key: SessionKey, digest: u64) -> u64 {
    mix(key.lo64() ^ mix(digest ^ key.hi64())) >> 11
}

/// The weighted rendezvous score of `key` for a name with digest `digest` and weight `weight`.
pub(crate) fn score(key: SessionKey, digest: u64, weight: u32) -> f64 {
    if weight == 0 {
        return 0.0;
    }
    // A uniform number in (0, 1), never 0 or 1.
    let u = (bits(key, digest) as f64 + 0.5) * (1.0 / (1u64 << 53) as f64);
    -f64::from(weight) / u.ln()
}

/// An integer that ranks like [`score`]: higher is better.
///
/// When every weight is equal, `-w / ln(u)` increases with `u`, so the bits alone give the same
/// order without a logarithm. Otherwise the score itself: it is never negative, and the bits of
/// non-negative floats order like the floats. Ranks of one kind only are ever compared.
pub(crate) fn rank(key: SessionKey, digest: u64, weight: u32, uniform: bool) -> u64 {
    if uniform {
        bits(key, digest)
    } else {
        score(key, digest, weight).to_bits()
    }
}

/// Orders two (rank, index) pairs, best first; the index breaks ties so the order is total.
fn best_first(a: &(u64, u32), b: &(u64, u32)) -> Ordering {
    b.0.cmp(&a.0).then(a.1.cmp(&b.1))
}

/// One candidate of a rendezvous: a live node or backend, its name's digest and its weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Ranked {
    pub(crate) digest: u64,
    pub(crate) weight: u32,
    pub(crate) index: u32,
}

/// The candidates of one rendezvous (the live nodes, one node's live backends, or all live
/// backends) side by side, so that ranking them all for a new session is one pass over
/// consecutive memory. It is also the list of those candidates, in the order they came: the
/// topology keeps no other. Changed when discovery changes the fleet, never on the request
/// path.
#[derive(Clone, Debug)]
pub(crate) struct RankSet {
    items: Vec<Ranked>,
    /// Whether every weight is equal: the hash bits then rank alone, without a logarithm.
    uniform: bool,
}

impl RankSet {
    pub(crate) fn new(items: Vec<Ranked>) -> Self {
        let uniform = all_equal(&items);
        RankSet { items, uniform }
    }

    /// The candidates' indexes, in the order they were first put.
    pub(crate) fn indexes(&self) -> impl ExactSizeIterator<Item = u32> + Clone + '_ {
        self.items.iter().map(|r| r.index)
    }

    /// The index of the candidate at `position` in [`RankSet::indexes`] order.
    pub(crate) fn index_at(&self, position: usize) -> Option<u32> {
        self.items.get(position).map(|r| r.index)
    }

    pub(crate) fn len(&self) -> usize {
        self.items.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Adds `r` at the end, or replaces the candidate with the same index where it stands.
    pub(crate) fn put(&mut self, r: Ranked) {
        if let Some(x) = self.items.iter_mut().find(|x| x.index == r.index) {
            *x = r;
            self.uniform = all_equal(&self.items);
        } else {
            self.uniform &= self.items.first().is_none_or(|f| f.weight == r.weight);
            self.items.push(r);
        }
    }

    /// Removes the candidate with index `index`, if there is one.
    pub(crate) fn remove(&mut self, index: u32) {
        self.items.retain(|x| x.index != index);
        // Removing a candidate never makes equal weights unequal.
        if !self.uniform {
            self.uniform = all_equal(&self.items);
        }
    }

    fn rank(&self, key: SessionKey, r: &Ranked) -> u64 {
        rank(key, r.digest, r.weight, self.uniform)
    }

    /// The admitted candidate `key` prefers: the highest rank, the lowest index on a tie.
    /// Inlined, so that `admit` is too: it runs once a candidate.
    #[inline]
    pub(crate) fn best(&self, key: SessionKey, admit: impl Fn(u32) -> bool) -> Option<u32> {
        // The weight test is hoisted out of the loop: one tight loop per kind of rank.
        if self.uniform {
            best_by(&self.items, |r| bits(key, r.digest), admit)
        } else {
            best_by(
                &self.items,
                |r| score(key, r.digest, r.weight).to_bits(),
                admit,
            )
        }
    }

    /// Visits the admitted candidates best first. The best is found in one pass without
    /// allocating; the rest are ranked and sorted only if the visitor asks for more.
    #[inline]
    pub(crate) fn visit(
        &self,
        key: SessionKey,
        admit: impl Fn(u32) -> bool,
        mut visit: impl FnMut(u32) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        let Some(best) = self.best(key, &admit) else {
            return ControlFlow::Continue(());
        };
        visit(best)?;
        let mut rest: Vec<(u64, u32)> = self
            .items
            .iter()
            .filter(|r| r.index != best && admit(r.index))
            .map(|r| (self.rank(key, r), r.index))
            .collect();
        rest.sort_unstable_by(best_first);
        for (_, i) in rest {
            visit(i)?;
        }
        ControlFlow::Continue(())
    }
}

impl Default for RankSet {
    fn default() -> Self {
        RankSet::new(Vec::new())
    }
}

fn all_equal(items: &[Ranked]) -> bool {
    items.windows(2).all(|w| w[0].weight == w[1].weight)
}

#[inline]
fn best_by(
    items: &[Ranked],
    rank: impl Fn(&Ranked) -> u64,
    admit: impl Fn(u32) -> bool,
) -> Option<u32> {
    // `u32::MAX` is no candidate's index, so any admitted candidate beats the start.
    let mut best = (0u64, u32::MAX);
    for r in items {
        if !admit(r.index) {
            continue;
        }
        let k = rank(r);
        if k > best.0 || (k == best.0 && r.index < best.1) {
            best = (k, r.index);
        }
    }
    (best.1 != u32::MAX).then_some(best.1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heavier_names_win_proportionally_more_keys() {
        let (light, heavy) = (1, 3);
        let mut heavy_wins = 0;
        let n = 20_000;
        for k in 0..n {
            let key = SessionKey::from_u128(mix(k) as u128 | ((mix(k + 7) as u128) << 64));
            if score(key, 2, heavy) > score(key, 1, light) {
                heavy_wins += 1;
            }
        }
        let share = f64::from(heavy_wins) / n as f64;
        assert!((share - 0.75).abs() < 0.02, "share {share}");
    }

    #[test]
    fn rank_orders_like_score_when_weights_are_equal() {
        for k in 0..2_000u64 {
            let key = SessionKey::from_u128(u128::from(mix(k)) << 64 | u128::from(mix(!k)));
            let (a, b) = (mix(k + 1), mix(k + 2));
            assert_eq!(
                score(key, a, 3) > score(key, b, 3),
                rank(key, a, 3, true) > rank(key, b, 3, true)
            );
        }
    }

    #[test]
    fn rank_orders_like_score_when_weights_differ() {
        for k in 0..2_000u64 {
            let key = SessionKey::from_u128(u128::from(mix(k)) << 64 | u128::from(mix(!k)));
            let (a, b) = (mix(k + 1), mix(k + 2));
            assert_eq!(
                score(key, a, 1) > score(key, b, 3),
                rank(key, a, 1, false) > rank(key, b, 3, false)
            );
        }
    }

    const KEY: SessionKey = SessionKey::from_u128(0x0123_4567_89ab_cdef_fedc_ba98_7654_3210);

    /// Twelve candidates with indexes 0, 3, 6, ... and the given weight for each index.
    fn set(weight: impl Fn(u32) -> u32) -> RankSet {
        RankSet::new(
            (0..12u32)
                .map(|i| Ranked {
                    digest: mix(u64::from(i) + 100),
                    weight: weight(i * 3),
                    index: i * 3,
                })
                .collect(),
        )
    }

    /// Every admitted candidate, ranked one by one and sorted.
    fn sorted(s: &RankSet, admit: impl Fn(u32) -> bool) -> Vec<u32> {
        let mut all: Vec<(u64, u32)> = s
            .items
            .iter()
            .filter(|r| admit(r.index))
            .map(|r| (rank(KEY, r.digest, r.weight, s.uniform), r.index))
            .collect();
        all.sort_by(best_first);
        all.into_iter().map(|(_, i)| i).collect()
    }

    fn visited(s: &RankSet, admit: impl Fn(u32) -> bool, stop_after: usize) -> Vec<u32> {
        let mut seen = vec![];
        let _ = s.visit(KEY, admit, |i| {
            seen.push(i);
            if seen.len() == stop_after {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        });
        seen
    }

    #[test]
    fn ranked_visit_goes_best_first_and_stops_on_break() {
        let uniform = set(|_| 4);
        let weighted = set(|i| 1 + i % 5);
        assert!(uniform.uniform && !weighted.uniform);
        for s in [&uniform, &weighted] {
            assert_eq!(visited(s, |_| true, usize::MAX), sorted(s, |_| true));
            assert_eq!(visited(s, |_| true, 1), sorted(s, |_| true)[..1]);
            let even = |i: u32| i.is_multiple_of(2);
            assert_eq!(visited(s, even, usize::MAX), sorted(s, even));
            assert_eq!(s.best(KEY, even), sorted(s, even).first().copied());
            assert_eq!(s.best(KEY, |_| false), None);
            assert!(visited(s, |_| false, usize::MAX).is_empty());
        }
    }

    #[test]
    fn ranked_ties_go_to_the_lowest_index() {
        let same = |index| Ranked {
            digest: 42,
            weight: 1,
            index,
        };
        let s = RankSet::new(vec![same(9), same(2), same(5)]);
        assert_eq!(s.best(KEY, |_| true), Some(2));
        assert_eq!(visited(&s, |_| true, usize::MAX), vec![2, 5, 9]);
    }

    #[test]
    fn a_rank_set_follows_puts_and_removes() {
        let r = |index, weight| Ranked {
            digest: mix(u64::from(index)),
            weight,
            index,
        };
        let mut s = RankSet::default();
        s.put(r(1, 2));
        s.put(r(4, 2));
        assert!(s.uniform);
        s.put(r(4, 3));
        assert_eq!(
            s.items,
            vec![r(1, 2), r(4, 3)],
            "a put replaces the same index"
        );
        assert!(!s.uniform);
        s.put(r(7, 2));
        s.remove(4);
        assert_eq!(s.items, vec![r(1, 2), r(7, 2)]);
        assert!(s.uniform);
        s.remove(9);
        assert_eq!(visited(&s, |_| true, usize::MAX), sorted(&s, |_| true));
    }
}
