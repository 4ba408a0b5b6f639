//! A bit-exact port of `torch.utils.data.distributed.DistributedSampler`.
//!
//! [`DistributedSampler`] gives each of `num_replicas` processes (ranks) its
//! own slice of a dataset's indices, exactly as PyTorch does, shuffled with
//! exactly PyTorch's CPU `torch.randperm`: a candle process and a PyTorch
//! process configured alike see the same samples in the same order.
//!
//! ```
//! use candle_dp::sampler::DistributedSampler;
//!
//! # fn main() -> Result<(), candle_dp::sampler::SamplerError> {
//! // torch: DistributedSampler(range(10), num_replicas=3, rank=1, shuffle=False)
//! let sampler = DistributedSampler::new(10, 3, 1)?.shuffle(false);
//! assert_eq!(sampler.indices(), vec![1, 4, 7, 0]); // padded by wrapping around
//! assert_eq!(sampler.len(), 4);
//! assert_eq!(sampler.total_size(), 12);
//! # Ok(())
//! # }
//! ```

/// Errors from building a [`DistributedSampler`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SamplerError {
    /// The world has no replicas at all.
    #[error("invalid world size: num_replicas must be at least 1, got 0 (rank {rank})")]
    NoReplicas {
        /// The rank that was asked for.
        rank: usize,
    },

    /// The rank is not in `[0, num_replicas)`.
    #[error("invalid rank {rank}: rank should be in the interval [0, {}] for a world size (num_replicas) of {num_replicas}", num_replicas - 1)]
    InvalidRank {
        /// The rank that was asked for.
        rank: usize,
        /// The world size.
        num_replicas: usize,
    },

    /// The padded index list (`ceil(len / num_replicas) * num_replicas`
    /// entries) would not fit in `usize`.
    #[error("a dataset of {len} samples cannot be padded to a multiple of {num_replicas} replicas: the padded length exceeds usize::MAX")]
    TooLarge {
        /// The dataset length.
        len: usize,
        /// The world size.
        num_replicas: usize,
    },
}

/// PyTorch's `DistributedSampler`: the indices one rank reads in one epoch.
///
/// Built with [`DistributedSampler::new`] and configured with the
/// builder-style [`shuffle`](Self::shuffle), [`seed`](Self::seed) and
/// [`drop_last`](Self::drop_last); the defaults are PyTorch's
/// (`shuffle=True, seed=0, drop_last=False`, epoch 0).
///
/// For a dataset of `N` samples and `R` replicas:
/// * `num_samples` ([`len`](Self::len)) is `ceil(N / R)`, or `floor(N / R)`
///   with `drop_last` (PyTorch writes it `ceil((N - R) / R)` when `N % R != 0`);
///   [`total_size`](Self::total_size) is `num_samples * R`;
/// * the global order is `torch.randperm(N)` seeded with `seed + epoch` when
///   shuffling, else `0..N`;
/// * without `drop_last` it is padded to `total_size` by repeating it from the
///   start, as many times as needed (`N = 2, R = 5` gives `0, 1, 0, 1, 0`);
///   with `drop_last` it is truncated to `total_size`;
/// * rank `r` takes positions `r, r + R, r + 2R, ...` of that list.
///
/// Call [`set_epoch`](Self::set_epoch) at the start of every epoch, as in
/// PyTorch, or every epoch sees the same order.
///
/// ```
/// use candle_dp::sampler::DistributedSampler;
///
/// # fn main() -> Result<(), candle_dp::sampler::SamplerError> {
/// let mut sampler = DistributedSampler::new(10, 3, 0)?.seed(0);
/// sampler.set_epoch(1);
/// // Same as torch with g.manual_seed(0 + 1).
/// assert_eq!(sampler.indices(), vec![5, 2, 9, 4]);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistributedSampler {
    dataset_len: usize,
    num_replicas: usize,
    rank: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    epoch: u64,
}

impl DistributedSampler {
    /// A sampler over `len` samples for rank `rank` of `num_replicas`, with
    /// PyTorch's defaults: shuffled, seed 0, no `drop_last`, epoch 0.
    ///
    /// Fails if `num_replicas` is 0 or `rank >= num_replicas`.
    ///
    /// ```
    /// use candle_dp::sampler::DistributedSampler;
    ///
    /// let err = DistributedSampler::new(10, 2, 2).unwrap_err();
    /// assert!(err.to_string().contains("invalid rank 2"));
    /// ```
    pub fn new(len: usize, num_replicas: usize, rank: usize) -> Result<Self, SamplerError> {
        if num_replicas == 0 {
            return Err(SamplerError::NoReplicas { rank });
        }
        if rank >= num_replicas {
            return Err(SamplerError::InvalidRank { rank, num_replicas });
        }
        // `total_size` and every position of the padded list must fit.
        if len
            .div_ceil(num_replicas)
            .checked_mul(num_replicas)
            .is_none()
        {
            return Err(SamplerError::TooLarge { len, num_replicas });
        }
        Ok(Self {
            dataset_len: len,
            num_replicas,
            rank,
            shuffle: true,
            seed: 0,
            drop_last: false,
            epoch: 0,
        })
    }

    /// Whether to shuffle with `randperm` (default `true`).
    pub fn shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self
    }

    /// The base seed; the permutation of an epoch uses `seed + epoch`
    /// (default 0). As in PyTorch, only the low 32 bits of the sum reach the
    /// Mersenne Twister, so the addition wraps.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Drop the tail that does not divide evenly across the replicas instead
    /// of padding by wrapping around (default `false`).
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// Sets the epoch, which changes the shuffled order (PyTorch's
    /// `sampler.set_epoch(epoch)`).
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The base seed (see [`seed`](Self::seed)).
    pub fn base_seed(&self) -> u64 {
        self.seed
    }

    /// This sampler's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The world size.
    pub fn num_replicas(&self) -> usize {
        self.num_replicas
    }

    /// The length of the dataset being sampled.
    pub fn dataset_len(&self) -> usize {
        self.dataset_len
    }

    /// `num_samples`: how many indices this rank (and every other) reads per
    /// epoch.
    ///
    /// ```
    /// use candle_dp::sampler::DistributedSampler;
    ///
    /// # fn main() -> Result<(), candle_dp::sampler::SamplerError> {
    /// assert_eq!(DistributedSampler::new(10, 3, 0)?.len(), 4);
    /// assert_eq!(DistributedSampler::new(10, 3, 0)?.drop_last(true).len(), 3);
    /// # Ok(())
    /// # }
    /// ```
    pub fn len(&self) -> usize {
        let (n, r) = (self.dataset_len, self.num_replicas);
        if self.drop_last {
            // torch: ceil((N - R) / R) when N % R != 0, which is floor(N / R)
            // (0 when N < R); N / R exactly when N % R == 0.
            n / r
        } else {
            n.div_ceil(r)
        }
    }

    /// Whether this rank reads no index at all.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `num_samples * num_replicas`: the length of the padded (or truncated)
    /// global index list.
    pub fn total_size(&self) -> usize {
        self.len() * self.num_replicas
    }

    /// The global order of the epoch, before padding or truncation:
    /// `randperm(N)` with seed `seed + epoch`, or `0..N` without shuffling.
    pub fn global_order(&self) -> Vec<usize> {
        if self.shuffle {
            randperm(self.dataset_len, self.seed.wrapping_add(self.epoch))
        } else {
            (0..self.dataset_len).collect()
        }
    }

    /// This rank's indices for the current epoch, in order.
    pub fn indices(&self) -> Vec<usize> {
        let order = self.global_order();
        let n = order.len();
        // Position `p` of the padded list is `order[p % n]`; with drop_last,
        // total_size <= n so the modulo never wraps. When n == 0, len() == 0
        // and the map never runs.
        (0..self.len())
            .map(|j| order[(j * self.num_replicas + self.rank) % n])
            .collect()
    }

    /// Iterates over [`indices`](Self::indices).
    pub fn iter(&self) -> std::vec::IntoIter<usize> {
        self.indices().into_iter()
    }
}

impl IntoIterator for &DistributedSampler {
    type Item = usize;
    type IntoIter = std::vec::IntoIter<usize>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

/// `torch.randperm(n, generator=torch.Generator().manual_seed(seed))` on the
/// CPU, bit for bit.
///
/// ```
/// assert_eq!(candle_dp::sampler::randperm(10, 0), vec![4, 1, 7, 5, 3, 9, 0, 8, 6, 2]);
/// ```
///
/// Follows PyTorch's `randperm_cpu` in `aten/src/ATen/native/TensorFactories.cpp`:
/// for `n < u32::MAX / 20` it starts from `0..n` and for `i` in `0..n-1`
/// swaps element `i` with element `i + z`, where `z` is one 32-bit draw
/// (`CPUGeneratorImpl::random()`) modulo `n - i`. For larger `n` it runs the
/// "inside-out" Fisher-Yates shuffle, `z` being a 64-bit draw
/// (`random64()`: two 32-bit draws, the first one the high word) modulo
/// `i + 1`.
pub fn randperm(n: usize, seed: u64) -> Vec<usize> {
    let mut rng = Mt19937::new(seed);
    if (n as u64) < u64::from(u32::MAX / 20) {
        let mut perm: Vec<usize> = (0..n).collect();
        for i in 0..n.saturating_sub(1) {
            let z = (u64::from(rng.next_u32()) % (n - i) as u64) as usize;
            perm.swap(i, i + z);
        }
        perm
    } else {
        inside_out_shuffle(n, &mut rng)
    }
}

/// PyTorch's `randperm_cpu` branch for `n >= u32::MAX / 20`: the
/// "inside-out" Fisher-Yates shuffle, `z = random64() % (i + 1)`, then
/// `r[i] = r[z]; r[z] = i`.
fn inside_out_shuffle(n: usize, rng: &mut Mt19937) -> Vec<usize> {
    let mut perm = vec![0usize; n];
    for i in 0..n {
        let z = (rng.next_u64() % (i as u64 + 1)) as usize;
        perm[i] = perm[z];
        perm[z] = i;
    }
    perm
}

/// The 32-bit Mersenne Twister as PyTorch's CPU generator runs it.
///
/// Follows `aten/src/ATen/core/MT19937RNGEngine.h` and
/// `aten/src/ATen/CPUGeneratorImpl.cpp`: `manual_seed(s)` rebuilds the engine
/// with `init_genrand(s & 0xffffffff)` (Matsumoto and Nishimura's 2002
/// initialisation, multiplier 1812433253), the state is regenerated all at
/// once on the first draw and every 624 draws after, and outputs use the
/// standard MT19937 tempering. `random()` is one output; `random64()` is
/// `(first << 32) | second`.
struct Mt19937 {
    state: [u32; Self::N],
    next: usize,
}

impl Mt19937 {
    const N: usize = 624;
    const M: usize = 397;
    const MATRIX_A: u32 = 0x9908_b0df;
    const UPPER_MASK: u32 = 0x8000_0000;
    const LOWER_MASK: u32 = 0x7fff_ffff;

    fn new(seed: u64) -> Self {
        let mut state = [0u32; Self::N];
        // Only the low 32 bits of the seed are used.
        state[0] = (seed & 0xffff_ffff) as u32;
        for j in 1..Self::N {
            let prev = state[j - 1];
            state[j] = 1_812_433_253u32
                .wrapping_mul(prev ^ (prev >> 30))
                .wrapping_add(j as u32);
        }
        Self {
            state,
            next: Self::N,
        }
    }

    fn regenerate(&mut self) {
        for k in 0..Self::N {
            let y = (self.state[k] & Self::UPPER_MASK)
                | (self.state[(k + 1) % Self::N] & Self::LOWER_MASK);
            let mag = if y & 1 == 1 { Self::MATRIX_A } else { 0 };
            self.state[k] = self.state[(k + Self::M) % Self::N] ^ (y >> 1) ^ mag;
        }
        self.next = 0;
    }

    fn next_u32(&mut self) -> u32 {
        if self.next >= Self::N {
            self.regenerate();
        }
        let mut y = self.state[self.next];
        self.next += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^= y >> 18;
        y
    }

    fn next_u64(&mut self) -> u64 {
        let hi = u64::from(self.next_u32());
        let lo = u64::from(self.next_u32());
        (hi << 32) | lo
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mt19937_matches_the_reference_outputs() {
        // Reference values of the standard mt19937 (C++ std::mt19937).
        let mut rng = Mt19937::new(5489);
        assert_eq!(rng.next_u32(), 3_499_211_612);
        let mut rng = Mt19937::new(5489);
        for _ in 0..9999 {
            rng.next_u32();
        }
        assert_eq!(rng.next_u32(), 4_123_659_995);
    }

    #[test]
    fn mt19937_uses_only_the_low_32_bits_of_the_seed() {
        let mut a = Mt19937::new(7);
        let mut b = Mt19937::new((1 << 32) + 7);
        for _ in 0..1000 {
            assert_eq!(a.next_u32(), b.next_u32());
        }
    }

    #[test]
    fn the_large_n_branch_is_a_permutation() {
        for n in [0, 1, 2, 17, 1000] {
            let mut perm = inside_out_shuffle(n, &mut Mt19937::new(3));
            perm.sort_unstable();
            assert_eq!(perm, (0..n).collect::<Vec<_>>());
        }
    }

    #[test]
    fn random64_puts_the_first_draw_in_the_high_word() {
        let mut a = Mt19937::new(1);
        let mut b = Mt19937::new(1);
        let hi = u64::from(a.next_u32());
        let lo = u64::from(a.next_u32());
        assert_eq!(b.next_u64(), (hi << 32) | lo);
    }
}
