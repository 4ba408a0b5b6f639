//! The loader: cuts a list of indices into batches and iterates over them,
//! inline or through the prefetch thread; and the helpers that keep ranks'
//! batch counts matched in distributed evaluation.

use std::fmt;
use std::sync::Arc;

use super::plan::{Indices, Plan};
use super::prefetch::Prefetcher;
use super::{Batch, Dataset, LoaderError};

/// Iterates over a [`Dataset`] in batches.
///
/// Options (builder style, all optional):
/// * [`drop_last`](Self::drop_last): drop the last short batch;
/// * [`indices`](Self::indices): the sample order (default `0..len`), e.g.
///   one rank's [`DistributedSampler::indices`](crate::sampler::DistributedSampler::indices);
/// * [`prefetch`](Self::prefetch): load up to `n` batches ahead on one
///   background thread;
/// * [`even_batches`](Self::even_batches) and
///   [`num_batches`](Self::num_batches): complete batches (and their number)
///   by cycling from the start of the index list.
///
/// Every call to [`iter`](Self::iter) is a new pass. An iterator yields
/// `Result<Batch, LoaderError>`; after the first error it yields nothing more.
/// Build a new `Loader` for every epoch (it is cheap: the dataset is shared).
#[derive(Clone)]
pub struct Loader {
    dataset: Arc<dyn Dataset>,
    batch_size: usize,
    drop_last: bool,
    even_batches: bool,
    num_batches: Option<usize>,
    indices: Option<Arc<[usize]>>,
    prefetch: usize,
    skip: usize,
}

impl fmt::Debug for Loader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Loader")
            .field("dataset_len", &self.dataset.len())
            .field("batch_size", &self.batch_size)
            .field("drop_last", &self.drop_last)
            .field("even_batches", &self.even_batches)
            .field("num_batches", &self.num_batches)
            .field("num_indices", &self.num_indices())
            .field("prefetch", &self.prefetch)
            .field("skip", &self.skip)
            .finish()
    }
}

impl Loader {
    /// A loader over `dataset` in batches of `batch_size`: all indices in
    /// order, last batch kept even if short, no prefetch. Fails if
    /// `batch_size` is 0.
    pub fn new(dataset: Arc<dyn Dataset>, batch_size: usize) -> Result<Self, LoaderError> {
        if batch_size == 0 {
            return Err(LoaderError::ZeroBatchSize);
        }
        Ok(Self {
            dataset,
            batch_size,
            drop_last: false,
            even_batches: false,
            num_batches: None,
            indices: None,
            prefetch: 0,
            skip: 0,
        })
    }

    /// Drop the last batch if it is short (default `false`). Ignored when
    /// [`num_batches`](Self::num_batches) is set.
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// The indices to load, in order (default `0..dataset.len()`). Indices
    /// out of range come back as [`LoaderError::IndexOutOfRange`] items.
    pub fn indices(mut self, indices: Vec<usize>) -> Self {
        self.indices = Some(indices.into());
        self
    }

    /// Load up to `n` batches ahead on one background thread, through a
    /// bounded channel of depth `n` (default 0: no thread, every batch is
    /// loaded by the caller inside `next()`). The thread stops when the
    /// iterator is dropped. A panic inside the dataset comes back as
    /// [`LoaderError::WorkerPanicked`] with prefetch, and unwinds through
    /// `next()` without.
    pub fn prefetch(mut self, n: usize) -> Self {
        self.prefetch = n;
        self
    }

    /// Accelerate's `even_batches` for the last batch: when `true`, a short
    /// last batch is completed by cycling from the start of the index list,
    /// so every batch has `batch_size` samples (default `false`).
    pub fn even_batches(mut self, even: bool) -> Self {
        self.even_batches = even;
        self
    }

    /// Produce exactly `k` batches of `batch_size` samples: the index list is
    /// cycled from its start for as long as needed (and cut if it is longer).
    /// Implies [`even_batches(true)`](Self::even_batches) and overrides
    /// [`drop_last`](Self::drop_last).
    ///
    /// In distributed evaluation give every rank the same `k`, e.g. from
    /// [`batches_per_rank`], so that collective operations stay matched;
    /// [`drop_padding`] then removes the repeated samples.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use candle_core::{Device, Tensor};
    /// use candle_dp::loader::{Loader, TensorDataset};
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let y = Tensor::arange(0u32, 10, &Device::Cpu)?;
    /// let dataset = Arc::new(TensorDataset::new(vec![y])?);
    /// let loader = Loader::new(dataset, 2)?.indices(vec![7, 8, 9]).num_batches(3);
    /// let ys: Vec<Vec<u32>> = loader
    ///     .iter()
    ///     .map(|b| Ok(b?[0].to_vec1::<u32>()?))
    ///     .collect::<Result<_, Box<dyn std::error::Error>>>()?;
    /// assert_eq!(ys, vec![vec![7, 8], vec![9, 7], vec![8, 9]]);
    /// # Ok(())
    /// # }
    /// ```
    pub fn num_batches(mut self, k: usize) -> Self {
        self.num_batches = Some(k);
        self
    }

    /// Starts every pass at batch `k`, skipping the batches before it
    /// without loading them (Accelerate's `skip_first_batches`): a run
    /// resumed in the middle of an epoch continues with the batch it had
    /// not trained on. The batches keep their contents and numbers; a
    /// pass yields `len() - k` of them (none when `k >= len()`).
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use candle_core::{Device, Tensor};
    /// # use candle_dp::loader::{Loader, TensorDataset};
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let y = Tensor::arange(0u32, 7, &Device::Cpu)?;
    /// let loader = Loader::new(Arc::new(TensorDataset::new(vec![y])?), 2)?.skip_batches(2);
    /// let ys: Vec<Vec<u32>> = loader
    ///     .iter()
    ///     .map(|b| Ok(b?[0].to_vec1::<u32>()?))
    ///     .collect::<Result<_, Box<dyn std::error::Error>>>()?;
    /// assert_eq!(ys, vec![vec![4, 5], vec![6]]);
    /// # Ok(())
    /// # }
    /// ```
    pub fn skip_batches(mut self, k: usize) -> Self {
        self.skip = k;
        self
    }

    /// The batch size.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// The number of batches a pass produces (fewer if an error ends it).
    pub fn len(&self) -> usize {
        let n = self.num_indices();
        match self.num_batches {
            Some(k) => k,
            None if self.drop_last => n / self.batch_size,
            None => n.div_ceil(self.batch_size),
        }
    }

    /// Whether a pass produces no batch.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A new pass over the batches. With [`prefetch`](Self::prefetch) > 0
    /// this starts the background thread.
    pub fn iter(&self) -> LoaderIter {
        let plan = Plan {
            dataset: Arc::clone(&self.dataset),
            indices: match &self.indices {
                Some(indices) => Indices::List(Arc::clone(indices)),
                None => Indices::Range(self.dataset.len()),
            },
            batch_size: self.batch_size,
            first: self.skip.min(self.len()),
            num_batches: self.len(),
            cycle: self.even_batches || self.num_batches.is_some(),
        };
        let state = if self.prefetch == 0 || plan.num_batches == plan.first {
            let next = plan.first;
            State::Inline { plan, next }
        } else {
            match Prefetcher::spawn(plan, self.prefetch) {
                Ok(prefetcher) => State::Prefetch(prefetcher),
                Err(err) => State::Failed(err),
            }
        };
        LoaderIter { state }
    }

    fn num_indices(&self) -> usize {
        match &self.indices {
            Some(indices) => indices.len(),
            None => self.dataset.len(),
        }
    }
}

impl IntoIterator for &Loader {
    type Item = Result<Batch, LoaderError>;
    type IntoIter = LoaderIter;

    fn into_iter(self) -> LoaderIter {
        self.iter()
    }
}

/// One pass of a [`Loader`]: yields `Result<Batch, LoaderError>` and stops
/// after the first error.
///
/// Dropping it stops the prefetch thread: the channel closes, so the thread
/// exits at its next send (or before its next batch). The drop waits a
/// bounded time for the batch being loaded, never forever.
pub struct LoaderIter {
    state: State,
}

enum State {
    Inline { plan: Plan, next: usize },
    Prefetch(Prefetcher),
    Failed(LoaderError),
    Done,
}

impl fmt::Debug for LoaderIter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Inline { .. } => "inline",
            State::Prefetch(_) => "prefetching",
            State::Failed(_) => "failed",
            State::Done => "done",
        };
        f.debug_struct("LoaderIter")
            .field("state", &state)
            .field("remaining", &self.size_hint().1)
            .finish()
    }
}

impl Iterator for LoaderIter {
    type Item = Result<Batch, LoaderError>;

    fn next(&mut self) -> Option<Self::Item> {
        let item = match &mut self.state {
            State::Done => return None,
            State::Failed(_) => {
                let State::Failed(err) = std::mem::replace(&mut self.state, State::Done) else {
                    return None;
                };
                return Some(Err(err));
            }
            State::Inline { plan, next } => {
                if *next >= plan.num_batches {
                    None
                } else {
                    *next += 1;
                    Some(plan.load(*next - 1))
                }
            }
            State::Prefetch(prefetcher) => prefetcher.next(),
        };
        // Fuse at the end and after an error; dropping the old state
        // shuts the prefetch thread down.
        if !matches!(item, Some(Ok(_))) {
            self.state = State::Done;
        }
        item
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let remaining = match &self.state {
            State::Inline { plan, next } => plan.num_batches - next,
            State::Prefetch(prefetcher) => prefetcher.remaining,
            State::Failed(_) => 1,
            State::Done => 0,
        };
        (0, Some(remaining))
    }
}

/// The number of batches every rank must produce for
/// [`Loader::num_batches`], given how many samples each rank has.
///
/// Without `drop_last` it is the largest `ceil(n / batch_size)` (ranks with
/// fewer batches pad by cycling, Accelerate's `even_batches`); with
/// `drop_last` it is the smallest `n / batch_size` (every rank has that many
/// full batches and nobody pads). 0 for an empty slice; fails if
/// `batch_size` is 0.
///
/// ```
/// use candle_dp::loader::batches_per_rank;
///
/// assert_eq!(batches_per_rank(&[5, 4, 4], 2, false).unwrap(), 3);
/// assert_eq!(batches_per_rank(&[5, 4, 3], 2, true).unwrap(), 1);
/// ```
pub fn batches_per_rank(
    num_samples_per_rank: &[usize],
    batch_size: usize,
    drop_last: bool,
) -> Result<usize, LoaderError> {
    if batch_size == 0 {
        return Err(LoaderError::ZeroBatchSize);
    }
    let per_rank = num_samples_per_rank.iter().map(|&n| {
        if drop_last {
            n / batch_size
        } else {
            n.div_ceil(batch_size)
        }
    });
    Ok(if drop_last {
        per_rank.min().unwrap_or(0)
    } else {
        per_rank.max().unwrap_or(0)
    })
}

/// Accelerate's `gather_for_metrics` de-duplication: puts what every rank
/// produced back in global order and drops the padding.
///
/// `per_rank[r][j]` must be the result for position `j * R + r` of the padded
/// global index list (`R = per_rank.len()`), which is what rank `r` produces
/// when it walks its [`DistributedSampler`](crate::sampler::DistributedSampler)
/// indices in order (padding added by [`Loader::num_batches`] included).
/// Positions `>= dataset_len` are the wrap-around duplicates and are dropped,
/// as are positions no rank produced; so every sample is counted exactly once.
/// With a `drop_last` sampler pass its
/// [`total_size`](crate::sampler::DistributedSampler::total_size) instead of
/// the dataset length: positions past it were never sampled.
///
/// ```
/// use candle_dp::loader::drop_padding;
/// use candle_dp::sampler::DistributedSampler;
///
/// # fn main() -> Result<(), candle_dp::sampler::SamplerError> {
/// // 10 samples on 3 ranks: 12 positions, the last two repeat samples 0 and 1.
/// let per_rank: Vec<Vec<usize>> = (0..3)
///     .map(|r| Ok(DistributedSampler::new(10, 3, r)?.shuffle(false).indices()))
///     .collect::<Result<_, candle_dp::sampler::SamplerError>>()?;
/// assert_eq!(drop_padding(&per_rank, 10), (0..10).collect::<Vec<_>>());
/// # Ok(())
/// # }
/// ```
pub fn drop_padding<T: Clone>(per_rank: &[Vec<T>], dataset_len: usize) -> Vec<T> {
    let replicas = per_rank.len();
    let longest = per_rank.iter().map(Vec::len).max().unwrap_or(0);
    let positions = dataset_len.min(replicas.saturating_mul(longest));
    (0..positions)
        .filter_map(|p| per_rank[p % replicas].get(p / replicas).cloned())
        .collect()
}
