//! A batching data loader with optional background prefetch.
//!
//! A [`Dataset`] hands out samples, one tensor per field (e.g. `(x, y)`);
//! a [`Loader`] walks a list of indices (all of them by default, or one
//! rank's share from a [`DistributedSampler`](crate::sampler::DistributedSampler)),
//! cuts it into batches and collates each batch by stacking every field along
//! a new dim 0. With [`Loader::prefetch`] one background thread loads the next
//! batches while the caller trains on the current one.
//!
//! For distributed evaluation, [`Loader::num_batches`] makes every rank
//! produce the same number of batches (Accelerate's `even_batches`), and
//! [`drop_padding`] removes the samples the sampler and the loader repeated so
//! that a metric counts every sample exactly once (Accelerate's
//! `gather_for_metrics`).
//!
//! ```
//! use std::sync::Arc;
//! use candle_core::{Device, Tensor};
//! use candle_dp::loader::{Loader, TensorDataset};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let x = Tensor::arange(0f32, 30., &Device::Cpu)?.reshape((10, 3))?;
//! let y = Tensor::arange(0u32, 10, &Device::Cpu)?;
//! let dataset = Arc::new(TensorDataset::new(vec![x, y])?);
//!
//! let loader = Loader::new(dataset, 4)?.prefetch(2);
//! let sizes: Vec<usize> = loader
//!     .iter()
//!     .map(|batch| batch.map(|b| b[0].dim(0).unwrap()))
//!     .collect::<Result<_, _>>()?;
//! assert_eq!(sizes, vec![4, 4, 2]); // the last batch is short
//! # Ok(())
//! # }
//! ```

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use candle_core::{Device, Tensor};
use crossbeam::channel::{self, Receiver, RecvTimeoutError, Sender};

use crate::panic_message::panic_message;

/// One sample: one tensor per field, e.g. `vec![x, y]`.
pub type Sample = Vec<Tensor>;

/// One collated batch: one tensor per field, each with the batch as dim 0.
pub type Batch = Vec<Tensor>;

/// How long dropping a prefetching iterator waits for its background thread
/// to finish the batch it is loading before leaving it to exit on its own.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Errors from building datasets and loaders and from loading batches.
#[derive(Debug, thiserror::Error)]
pub enum LoaderError {
    /// `batch_size` was 0.
    #[error("batch_size must be at least 1, got 0")]
    ZeroBatchSize,

    /// A [`TensorDataset`] was given no tensor.
    #[error("TensorDataset needs at least one tensor (field)")]
    NoFields,

    /// A [`TensorDataset`] field has no dim 0 to index.
    #[error("TensorDataset field {field} is a scalar (rank 0): every field needs the samples along dim 0")]
    ScalarField {
        /// Position of the field in the tensor list.
        field: usize,
    },

    /// [`TensorDataset`] fields disagree on the number of samples.
    #[error("TensorDataset fields disagree on dim 0: field 0 has {expected} samples, field {field} has {found}")]
    FieldSizeMismatch {
        /// The offending field.
        field: usize,
        /// Dim 0 of field 0.
        expected: usize,
        /// Dim 0 of the offending field.
        found: usize,
    },

    /// An index is not below the dataset's length.
    #[error("index {index} is out of range for a dataset of length {len}")]
    IndexOutOfRange {
        /// The index asked for.
        index: usize,
        /// The dataset's length.
        len: usize,
    },

    /// [`Dataset::get`] failed.
    #[error("loading sample {index} failed: {source}")]
    Sample {
        /// The dataset index of the sample.
        index: usize,
        /// What the dataset returned.
        source: candle_core::Error,
    },

    /// Samples of one batch have different numbers of fields.
    #[error("sample at position {position} of the batch has {found} fields, the first one has {expected}")]
    FieldCount {
        /// Position of the offending sample in the batch.
        position: usize,
        /// Number of fields of the first sample.
        expected: usize,
        /// Number of fields of the offending sample.
        found: usize,
    },

    /// Stacking (or gathering) one field of a batch failed, e.g. because the
    /// samples' shapes, dtypes or devices differ.
    #[error("collating field {field} of the batch failed: {source}")]
    Collate {
        /// The field.
        field: usize,
        /// The candle error.
        source: candle_core::Error,
    },

    /// [`collate`] was given no sample.
    #[error("cannot collate an empty batch")]
    EmptyBatch,

    /// A full batch of `batch_size` cycled indices (with
    /// [`Loader::even_batches`] or [`Loader::num_batches`]) cannot be held
    /// in memory.
    #[error("cannot build a full batch of {batch_size} indices (even_batches / num_batches): too large to allocate")]
    BatchTooLarge {
        /// The batch size.
        batch_size: usize,
    },

    /// [`Loader::num_batches`] or [`Loader::even_batches`] asked for batches
    /// but there is no index to cycle through.
    #[error("{num_batches} batches were asked for but the index list is empty: nothing to cycle through")]
    NothingToCycle {
        /// The number of batches asked for.
        num_batches: usize,
    },

    /// The background prefetch thread could not be started.
    #[error("failed to spawn the prefetch thread: {0}")]
    Spawn(#[source] std::io::Error),

    /// The background prefetch thread panicked (inside the dataset).
    #[error("the prefetch thread panicked: {message}")]
    WorkerPanicked {
        /// The panic message, when it was a string.
        message: String,
    },
}

/// A map-style dataset: `len()` samples, fetched by index.
///
/// Implement [`get`](Self::get); override [`get_batch`](Self::get_batch)
/// when a whole batch can be loaded faster than sample by sample (as
/// [`TensorDataset`] does).
///
/// ```
/// use candle_core::{Device, Result, Tensor};
/// use candle_dp::loader::{Dataset, Sample};
///
/// /// Sample i is (x = [i, i], y = i % 2).
/// struct Parity;
/// impl Dataset for Parity {
///     fn len(&self) -> usize { 6 }
///     fn get(&self, i: usize) -> Result<Sample> {
///         let x = Tensor::new(&[i as f32, i as f32], &Device::Cpu)?;
///         let y = Tensor::new(i as u32 % 2, &Device::Cpu)?;
///         Ok(vec![x, y])
///     }
/// }
///
/// # fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
/// let batch = Parity.get_batch(&[1, 4])?;
/// assert_eq!(batch[0].dims(), &[2, 2]);
/// assert_eq!(batch[1].to_vec1::<u32>()?, vec![1, 0]);
/// # Ok(())
/// # }
/// ```
pub trait Dataset: Send + Sync {
    /// Number of samples.
    fn len(&self) -> usize;

    /// Whether the dataset has no sample.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sample `index` (`index < len()`), one tensor per field.
    fn get(&self, index: usize) -> candle_core::Result<Sample>;

    /// The samples at `indices`, collated: by default every sample is
    /// fetched with [`get`](Self::get) and the fields are stacked with
    /// [`collate`].
    fn get_batch(&self, indices: &[usize]) -> Result<Batch, LoaderError> {
        let samples = indices
            .iter()
            .map(|&index| {
                self.get(index)
                    .map_err(|source| LoaderError::Sample { index, source })
            })
            .collect::<Result<Vec<_>, _>>()?;
        collate(&samples)
    }
}

/// Stacks the samples field by field along a new dim 0 (`Tensor::stack`).
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_dp::loader::collate;
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let s = |v: f32| -> candle_core::Result<Vec<Tensor>> {
///     Ok(vec![Tensor::new(&[v, v], &Device::Cpu)?, Tensor::new(v as u32, &Device::Cpu)?])
/// };
/// let batch = collate(&[s(1.)?, s(2.)?, s(3.)?])?;
/// assert_eq!(batch[0].dims(), &[3, 2]);
/// assert_eq!(batch[1].to_vec1::<u32>()?, vec![1, 2, 3]);
/// # Ok(())
/// # }
/// ```
pub fn collate(samples: &[Sample]) -> Result<Batch, LoaderError> {
    let first = samples.first().ok_or(LoaderError::EmptyBatch)?;
    let expected = first.len();
    if let Some((position, sample)) = samples
        .iter()
        .enumerate()
        .find(|(_, sample)| sample.len() != expected)
    {
        return Err(LoaderError::FieldCount {
            position,
            expected,
            found: sample.len(),
        });
    }
    (0..expected)
        .map(|field| {
            let column: Vec<&Tensor> = samples.iter().map(|sample| &sample[field]).collect();
            Tensor::stack(&column, 0).map_err(|source| LoaderError::Collate { field, source })
        })
        .collect()
}

/// A dataset over tensors that share dim 0: sample `i` is row `i` of every
/// tensor (PyTorch's `TensorDataset`).
///
/// Batches are gathered with one `index_select` per field instead of
/// stacking rows one by one.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_dp::loader::{Dataset, TensorDataset};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let x = Tensor::zeros((5, 3), candle_core::DType::F32, &Device::Cpu)?;
/// let y = Tensor::zeros(4, candle_core::DType::U32, &Device::Cpu)?;
/// let err = TensorDataset::new(vec![x, y]).unwrap_err();
/// assert!(err.to_string().contains("field 1 has 4"));
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct TensorDataset {
    tensors: Vec<Tensor>,
    len: usize,
}

impl TensorDataset {
    /// A dataset over `tensors` (one per field). Fails if the list is empty,
    /// a tensor is a scalar, or the tensors' dim 0 sizes differ.
    pub fn new(tensors: Vec<Tensor>) -> Result<Self, LoaderError> {
        if tensors.is_empty() {
            return Err(LoaderError::NoFields);
        }
        let mut sizes = Vec::with_capacity(tensors.len());
        for (field, tensor) in tensors.iter().enumerate() {
            match tensor.dims().first() {
                Some(&size) => sizes.push(size),
                None => return Err(LoaderError::ScalarField { field }),
            }
        }
        let expected = sizes[0];
        if let Some((field, &found)) = sizes.iter().enumerate().find(|(_, &s)| s != expected) {
            return Err(LoaderError::FieldSizeMismatch {
                field,
                expected,
                found,
            });
        }
        Ok(Self {
            tensors,
            len: expected,
        })
    }

    /// The tensors, one per field.
    pub fn tensors(&self) -> &[Tensor] {
        &self.tensors
    }
}

impl Dataset for TensorDataset {
    fn len(&self) -> usize {
        self.len
    }

    fn get(&self, index: usize) -> candle_core::Result<Sample> {
        if index >= self.len {
            return Err(candle_core::Error::Msg(format!(
                "index {index} is out of range for a TensorDataset of length {}",
                self.len
            )));
        }
        self.tensors.iter().map(|t| t.get(index)).collect()
    }

    fn get_batch(&self, indices: &[usize]) -> Result<Batch, LoaderError> {
        if indices.is_empty() {
            return Err(LoaderError::EmptyBatch);
        }
        if let Some(&index) = indices.iter().find(|&&i| i >= self.len) {
            return Err(LoaderError::IndexOutOfRange {
                index,
                len: self.len,
            });
        }
        self.tensors
            .iter()
            .enumerate()
            .map(|(field, tensor)| {
                index_tensor(indices, tensor.device())
                    .and_then(|ids| tensor.index_select(&ids, 0))
                    .map_err(|source| LoaderError::Collate { field, source })
            })
            .collect()
    }
}

/// The indices as a 1-D tensor for `index_select`: `u32` when they fit,
/// `i64` otherwise.
fn index_tensor(indices: &[usize], device: &Device) -> candle_core::Result<Tensor> {
    let ids: Option<Vec<u32>> = indices.iter().map(|&i| u32::try_from(i).ok()).collect();
    match ids {
        Some(ids) => Tensor::new(ids.as_slice(), device),
        None => {
            let ids: Vec<i64> = indices.iter().map(|&i| i as i64).collect();
            Tensor::new(ids.as_slice(), device)
        }
    }
}

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
                Some(indices) => Arc::clone(indices),
                None => (0..self.dataset.len()).collect(),
            },
            batch_size: self.batch_size,
            num_batches: self.len(),
            cycle: self.even_batches || self.num_batches.is_some(),
        };
        let state = if self.prefetch == 0 || plan.num_batches == 0 {
            State::Inline { plan, next: 0 }
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

/// What one pass loads: shared by the caller and the prefetch thread.
#[derive(Clone)]
struct Plan {
    dataset: Arc<dyn Dataset>,
    indices: Arc<[usize]>,
    batch_size: usize,
    num_batches: usize,
    /// Full batches, positions taken modulo the number of indices.
    cycle: bool,
}

impl Plan {
    fn batch_indices(&self, batch: usize) -> Result<Vec<usize>, LoaderError> {
        let n = self.indices.len();
        if self.cycle {
            if n == 0 {
                return Err(LoaderError::NothingToCycle {
                    num_batches: self.num_batches,
                });
            }
            // u128 so that no batch number can overflow the position.
            let start = batch as u128 * self.batch_size as u128;
            let mut indices = Vec::new();
            indices
                .try_reserve_exact(self.batch_size)
                .map_err(|_| LoaderError::BatchTooLarge {
                    batch_size: self.batch_size,
                })?;
            indices.extend(
                (0..self.batch_size as u128)
                    .map(|i| self.indices[((start + i) % n as u128) as usize]),
            );
            Ok(indices)
        } else {
            // Here batch < ceil(n / batch_size), so start < n.
            let start = batch * self.batch_size;
            let end = n.min(start + self.batch_size);
            Ok(self.indices[start..end].to_vec())
        }
    }

    fn load(&self, batch: usize) -> Result<Batch, LoaderError> {
        let indices = self.batch_indices(batch)?;
        let len = self.dataset.len();
        if let Some(&index) = indices.iter().find(|&&i| i >= len) {
            return Err(LoaderError::IndexOutOfRange { index, len });
        }
        self.dataset.get_batch(&indices)
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

/// The background thread of a prefetching pass and the caller's end of its
/// channel.
struct Prefetcher {
    /// Batches in order; `None` once shut down.
    batches: Option<Receiver<Result<Batch, LoaderError>>>,
    /// Disconnects (never receives) when the thread has exited.
    exited: Receiver<()>,
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
    remaining: usize,
}

impl Prefetcher {
    fn spawn(plan: Plan, depth: usize) -> Result<Self, LoaderError> {
        // A channel deeper than the pass is never used, and a huge depth
        // (`prefetch(usize::MAX)`) could not be allocated.
        let depth = depth.min(plan.num_batches).max(1);
        let (batch_tx, batch_rx) = channel::bounded(depth);
        let (exited_tx, exited_rx) = channel::bounded::<()>(0);
        let stop = Arc::new(AtomicBool::new(false));
        let remaining = plan.num_batches;
        let thread_stop = Arc::clone(&stop);
        let handle = std::thread::Builder::new()
            .name("candle-dp-prefetch".into())
            .spawn(move || prefetch_worker(plan, batch_tx, thread_stop, exited_tx))
            .map_err(LoaderError::Spawn)?;
        Ok(Self {
            batches: Some(batch_rx),
            exited: exited_rx,
            stop,
            handle: Some(handle),
            remaining,
        })
    }

    fn next(&mut self) -> Option<Result<Batch, LoaderError>> {
        if self.remaining == 0 {
            return None;
        }
        let batches = self.batches.as_ref()?;
        // The thread sends every batch it was asked for or exits (which
        // disconnects the channel), so this does not wait forever.
        match batches.recv() {
            Ok(item) => {
                self.remaining -= 1;
                Some(item)
            }
            Err(_) => {
                self.remaining = 0;
                let message = match self.handle.take().map(JoinHandle::join) {
                    Some(Err(payload)) => panic_message(payload.as_ref()),
                    _ => "the thread exited before sending every batch".to_string(),
                };
                Some(Err(LoaderError::WorkerPanicked { message }))
            }
        }
    }
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Closing the channel makes a pending or future send fail.
        self.batches = None;
        if let Some(handle) = self.handle.take() {
            // Give the thread a bounded time to finish the batch it is
            // loading; if the dataset is slower than that, leave it: it
            // exits as soon as that batch is loaded.
            if let Err(RecvTimeoutError::Disconnected) = self.exited.recv_timeout(SHUTDOWN_GRACE) {
                let _ = handle.join();
            }
        }
    }
}

/// Loads the plan's batches in order into `batches`; returns at the end,
/// after sending an error, when asked to stop or when the receiver is gone.
/// `_exited` is dropped when the thread exits, panicking or not.
fn prefetch_worker(
    plan: Plan,
    batches: Sender<Result<Batch, LoaderError>>,
    stop: Arc<AtomicBool>,
    _exited: Sender<()>,
) {
    for batch in 0..plan.num_batches {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let item = plan.load(batch);
        let failed = item.is_err();
        if batches.send(item).is_err() || failed {
            return;
        }
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
