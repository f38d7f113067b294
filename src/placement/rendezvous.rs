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
pub(crate) fn best_first(a: &(u64, u32), b: &(u64, u32)) -> Ordering {
    b.0.cmp(&a.0).then(a.1.cmp(&b.1))
}

/// Visits `items` best score first. The best is found in one pass without allocating; the rest
/// are sorted only if the visitor asks for more.
pub(crate) fn visit_ranked<I>(
    items: I,
    mut visit: impl FnMut(u32) -> ControlFlow<()>,
) -> ControlFlow<()>
where
    I: Iterator<Item = (u64, u32)> + Clone,
{
    let Some(best) = items.clone().min_by(best_first) else {
        return ControlFlow::Continue(());
    };
    visit(best.1)?;
    let mut rest: Vec<(u64, u32)> = items.filter(|&(_, i)| i != best.1).collect();
    rest.sort_unstable_by(best_first);
    for (_, i) in rest {
        visit(i)?;
    }
    ControlFlow::Continue(())
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

    #[test]
    fn ranked_visit_goes_best_first_and_stops_on_break() {
        let items = [(5, 0), (20, 1), (10, 2)];
        let mut seen = vec![];
        let _ = visit_ranked(items.iter().copied(), |i| {
            seen.push(i);
            ControlFlow::Continue(())
        });
        assert_eq!(seen, vec![1, 2, 0]);
        let mut seen = vec![];
        let _ = visit_ranked(items.iter().copied(), |i| {
            seen.push(i);
            ControlFlow::Break(())
        });
        assert_eq!(seen, vec![1]);
    }
}
