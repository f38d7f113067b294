//! A small seeded generator (SplitMix64), so a run is a pure function of its seed.
//!
//! Written here rather than taken from a crate: the study needs a handful of draws (uniform,
//! log-normal), and a generator whose output can never change under a dependency update keeps
//! the README's table reproducible byte for byte.

/// SplitMix64: 64 bits of state, passes BigCrush, and any seed (even 0) is a good one.
#[derive(Clone, Debug)]
pub(crate) struct Rng(u64);

const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// An independent stream for `stream` (a session number, say): each session draws its own
    /// sizes, so its content is the same whichever policy is being measured.
    pub(crate) fn fork(&self, stream: u64) -> Rng {
        Rng(mix(self.0 ^ mix(stream.wrapping_add(GOLDEN))))
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN);
        mix(self.0)
    }

    /// Uniform in [0, 1).
    pub(crate) fn f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// A standard normal draw (Box-Muller).
    pub(crate) fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.f64();
        let u2 = self.f64();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// A log-normal draw with the given median and shape, clamped to `[lo, hi]`.
    pub(crate) fn lognormal(&mut self, median: f64, sigma: f64, lo: f64, hi: f64) -> f64 {
        (median * (sigma * self.normal()).exp()).clamp(lo, hi)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream_and_forks_differ() {
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        assert_eq!(a.next_u64(), b.next_u64());
        let (mut f1, mut f2) = (a.fork(1), a.fork(2));
        assert_ne!(f1.next_u64(), f2.next_u64());
        let x = Rng::new(3).lognormal(100.0, 1.0, 10.0, 1000.0);
        assert!((10.0..=1000.0).contains(&x));
    }
}
