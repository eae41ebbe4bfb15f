//! The simulation's random numbers: xoshiro256++ seeded through splitmix64.
//!
//! Hand-written (30 lines) rather than a crate: the planner needs one fast,
//! seedable, portable generator whose stream never changes under it, so a
//! seed printed in a report reproduces the same numbers on any machine and
//! any future build. Each repetition gets its own stream derived from the
//! run's seed and the repetition's index, so results do not depend on how
//! repetitions are spread over threads.

/// splitmix64's step: turns any 64-bit seed into well-mixed state words.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// xoshiro256++ (Blackman and Vigna): fast, 256 bits of state, passes the
/// usual statistical batteries; more than enough for a Monte Carlo model.
#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    /// The stream of repetition `rep` of a run seeded with `seed`.
    pub fn for_rep(seed: u64, rep: u64) -> Self {
        let mut sm = seed ^ rep.wrapping_mul(0xD1B5_4A32_D192_ED03);
        let s = [
            splitmix64(&mut sm),
            splitmix64(&mut sm),
            splitmix64(&mut sm),
            splitmix64(&mut sm),
        ];
        Self { s }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[0]
            .wrapping_add(self.s[3])
            .rotate_left(23)
            .wrapping_add(self.s[0]);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1) with 53 bits of precision.
    pub fn uniform(&mut self) -> f64 {
        // The top 53 bits as an integer, scaled: exact in an f64.
        #[allow(clippy::cast_precision_loss)]
        let top = (self.next_u64() >> 11) as f64;
        top * (1.0 / 9_007_199_254_740_992.0)
    }

    /// An exponential variate with the given mean (inverse transform; 1 - u
    /// keeps the logarithm's argument in (0, 1]).
    pub fn exponential(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.uniform()).ln()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_reproducible_and_distinct() {
        let a: Vec<u64> = (0..4).map(|_| Rng::for_rep(7, 0).next_u64()).collect();
        assert!(a.windows(2).all(|w| w[0] == w[1]));
        let mut r0 = Rng::for_rep(7, 0);
        let mut r1 = Rng::for_rep(7, 1);
        assert_ne!(r0.next_u64(), r1.next_u64());
    }

    #[test]
    fn exponential_mean_is_right() {
        let mut r = Rng::for_rep(1, 0);
        let n = 200_000;
        let mean = (0..n).map(|_| r.exponential(3.0)).sum::<f64>() / f64::from(n);
        assert!((mean - 3.0).abs() < 0.03, "mean {mean}");
        let u: Vec<f64> = (0..1000).map(|_| r.uniform()).collect();
        assert!(u.iter().all(|x| (0.0..1.0).contains(x)));
    }
}
