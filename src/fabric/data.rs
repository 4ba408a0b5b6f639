//! A data loader sharded for the strategy: each rank its share, in the
//! order PyTorch's tools give it. Two ways, because the two tools differ:
//!
//! - [`Sharding::Distributed`]: a `DistributedSampler` under the loader
//!   (Fabric's `setup_dataloaders`, `torchrun`, `mp.spawn`): the samples
//!   are dealt to the ranks one by one (20 samples, 2 ranks: rank 0 gets
//!   0, 2, 4, ...), then each rank batches its own.
//! - [`Sharding::BatchWise`]: Accelerate's `prepare`: the loader's batches
//!   are dealt to the ranks whole, in turn (batch 10: rank 0 gets 0..9,
//!   rank 1 gets 10..19), or each batch cut into one part per rank
//!   (`split_batches`); `even_batches` completes the last round by cycling
//!   from the start so that every rank has as many batches.

use std::sync::Arc;

use candle_core::Device;

use crate::error::{Error, Result};
use crate::loader::{Batch, Dataset, Loader, LoaderIter};
use crate::sampler::{randperm, DistributedSampler};

/// Each epoch's global order of the samples.
type Order = Arc<dyn Fn(u64) -> Vec<usize> + Send + Sync>;

/// How a loader's samples are shared between the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharding {
    /// Sample by sample, `DistributedSampler`'s order (Fabric, `torchrun`).
    Distributed,
    /// Whole batches in turn (Accelerate's `BatchSamplerShard`).
    BatchWise {
        /// Cut each batch into one part per rank instead (the batch size
        /// must divide by the number of ranks).
        split_batches: bool,
        /// Complete the last round by cycling from the start, so every
        /// rank yields as many batches (Accelerate's default, true).
        even_batches: bool,
    },
}

impl Sharding {
    /// Accelerate's defaults: whole batches, even.
    pub fn accelerate() -> Self {
        Sharding::BatchWise {
            split_batches: false,
            even_batches: true,
        }
    }

    /// Each global batch cut into one consecutive part per rank, even
    /// (Accelerate's `split_batches=True`): what deterministic training
    /// ([`FabricConfig::deterministic`](super::FabricConfig::deterministic))
    /// takes, the batch size being the global batch's.
    pub fn split_batches() -> Self {
        Sharding::BatchWise {
            split_batches: true,
            even_batches: true,
        }
    }
}

/// The loader's settings, as a PyTorch `DataLoader` takes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataOptions {
    /// Shuffle every epoch (`randperm(n)` seeded with `seed + epoch`, as
    /// `DistributedSampler`), default false.
    pub shuffle: bool,
    /// Drop the last, short batch (default false).
    pub drop_last: bool,
    /// How the ranks share the samples (default [`Sharding::Distributed`]).
    pub sharding: Sharding,
    /// Batches prepared ahead on a thread (default 0).
    pub prefetch: usize,
    /// Move every batch to the rank's device, as Fabric's
    /// `setup_dataloaders(move_to_device=True)` and Accelerate's `prepare`
    /// do (default true); false yields the dataset's tensors where they are.
    pub move_to_device: bool,
}

impl Default for DataOptions {
    fn default() -> Self {
        Self {
            shuffle: false,
            drop_last: false,
            sharding: Sharding::Distributed,
            prefetch: 0,
            move_to_device: true,
        }
    }
}

/// This rank's loader: made by [`Fabric::setup_dataloader`](super::Fabric::setup_dataloader).
pub struct FabricLoader {
    dataset: Arc<dyn Dataset>,
    /// The original loader's sampler: each epoch's global order.
    order: Option<Order>,
    batch_size: usize,
    options: DataOptions,
    rank: usize,
    world_size: usize,
    seed: u64,
    epoch: u64,
    skip: usize,
    /// Where the batches go (with `move_to_device`).
    device: Device,
}

impl std::fmt::Debug for FabricLoader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FabricLoader")
            .field("samples", &self.dataset.len())
            .field("own_order", &self.order.is_some())
            .field("batch_size", &self.batch_size)
            .field("options", &self.options)
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("epoch", &self.epoch)
            .field("device", &self.device)
            .finish()
    }
}

impl FabricLoader {
    /// Rank `rank`'s loader of `world_size` over `dataset`, shuffled with
    /// `seed` (what [`Fabric::setup_dataloader`](super::Fabric::setup_dataloader)
    /// makes from the run's rank and seed).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use candle_core::{Device, Tensor};
    /// use candle_dp::fabric::{DataOptions, FabricLoader, Sharding};
    /// use candle_dp::loader::TensorDataset;
    ///
    /// let numbers = Tensor::arange(0u32, 20, &Device::Cpu)?;
    /// let data = Arc::new(TensorDataset::new(vec![numbers])?);
    /// let accelerate = DataOptions { sharding: Sharding::accelerate(), ..DataOptions::default() };
    /// let rank1 = FabricLoader::for_rank(data.clone(), 10, accelerate, 1, 2, 0)?;
    /// assert_eq!(rank1.batch_indices()?, vec![(10..20).collect::<Vec<_>>()]);
    /// let fabric = FabricLoader::for_rank(data, 10, DataOptions::default(), 1, 2, 0)?;
    /// assert_eq!(fabric.batch_indices()?, vec![(1..20).step_by(2).collect::<Vec<_>>()]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// A batch size of 0; `split_batches` with a batch size that the ranks
    /// do not divide; a rank outside the world.
    pub fn for_rank(
        dataset: Arc<dyn Dataset>,
        batch_size: usize,
        options: DataOptions,
        rank: usize,
        world_size: usize,
        seed: u64,
    ) -> Result<Self> {
        if batch_size == 0 {
            return Err(crate::loader::LoaderError::ZeroBatchSize.into());
        }
        // The sampler's own check: a rank outside the world is named.
        DistributedSampler::new(dataset.len(), world_size, rank)?;
        if let Sharding::BatchWise {
            split_batches: true,
            ..
        } = options.sharding
        {
            if !batch_size.is_multiple_of(world_size) {
                return Err(Error::Config(format!(
                    "split_batches cuts each batch of {batch_size} into {world_size} parts (one \
                     per rank): the batch size must be a multiple of the number of ranks"
                )));
            }
        }
        Ok(Self {
            dataset,
            order: None,
            batch_size,
            options,
            rank,
            world_size,
            seed,
            epoch: 0,
            skip: 0,
            device: Device::Cpu,
        })
    }

    /// Where the batches go when `move_to_device` is set (default the CPU;
    /// [`Fabric::setup_dataloader`](super::Fabric::setup_dataloader) gives
    /// the rank's device).
    pub fn on_device(mut self, device: Device) -> Self {
        self.device = device;
        self
    }

    /// Gives the loader its own sampler: `order(epoch)` is the global order
    /// of the samples in that epoch (every index below the dataset's
    /// length), which the ranks then share as [`Sharding`] says (dealt as
    /// `DistributedSampler` deals its shuffled order, padded by repeating
    /// from the start; or batch-wise, as Accelerate wraps a loader's own
    /// sampler). It replaces `shuffle`.
    pub fn with_order(mut self, order: impl Fn(u64) -> Vec<usize> + Send + Sync + 'static) -> Self {
        self.order = Some(Arc::new(order));
        self
    }

    /// Sets the epoch, which seeds the shuffling (call it at the start of
    /// every epoch, as `DistributedSampler.set_epoch`); the epoch starts at
    /// its first batch.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
        self.skip = 0;
    }

    /// Starts this epoch's pass at batch `k` (a run resumed mid-epoch,
    /// Accelerate's `skip_first_batches`); the next
    /// [`set_epoch`](Self::set_epoch) starts from the first batch again.
    pub fn skip_batches(&mut self, k: usize) {
        self.skip = k;
    }

    /// This rank's batches of the current epoch, as sample indices.
    pub fn batch_indices(&self) -> Result<Vec<Vec<usize>>> {
        let n = self.dataset.len();
        let given = match &self.order {
            Some(order) => {
                let order = order(self.epoch);
                if let Some(&bad) = order.iter().find(|&&i| i >= n) {
                    return Err(Error::Config(format!(
                        "the loader's order for epoch {} holds index {bad}, past the dataset's \
                         {n} samples",
                        self.epoch
                    )));
                }
                Some(order)
            }
            None => None,
        };
        match self.options.sharding {
            Sharding::Distributed => {
                let mine = match given {
                    Some(order) => deal(&order, self.world_size, self.rank),
                    None => {
                        let mut sampler = DistributedSampler::new(n, self.world_size, self.rank)?
                            .shuffle(self.options.shuffle)
                            .seed(self.seed);
                        sampler.set_epoch(self.epoch);
                        sampler.indices()
                    }
                };
                let mut batches: Vec<Vec<usize>> = mine
                    .chunks(self.batch_size)
                    .map(<[usize]>::to_vec)
                    .collect();
                if self.options.drop_last
                    && batches.last().is_some_and(|b| b.len() < self.batch_size)
                {
                    batches.pop();
                }
                Ok(batches)
            }
            Sharding::BatchWise {
                split_batches,
                even_batches,
            } => {
                let order = match (given, self.options.shuffle) {
                    (Some(order), _) => order,
                    (None, true) => randperm(n, self.seed.wrapping_add(self.epoch)),
                    (None, false) => (0..n).collect(),
                };
                Ok(batch_wise(
                    &order,
                    self.batch_size,
                    self.world_size,
                    self.rank,
                    BatchWiseOptions {
                        split_batches,
                        even_batches,
                        drop_last: self.options.drop_last,
                    },
                ))
            }
        }
    }

    /// The number of batches a pass gives this rank.
    pub fn len(&self) -> Result<usize> {
        Ok(self.batch_indices()?.len().saturating_sub(self.skip))
    }

    /// Whether a pass gives this rank no batch.
    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    /// The batches of this epoch, each the dataset's tensors stacked.
    pub fn iter(&self) -> Result<FabricBatches> {
        let batches = self.batch_indices()?;
        // Every batch but the last is full, so one index list cut at the
        // batch size gives the same batches back.
        let size = batches.first().map_or(self.batch_size, Vec::len);
        let indices: Vec<usize> = batches.into_iter().flatten().collect();
        let loader = Loader::new(self.dataset.clone(), size.max(1))?
            .indices(indices)
            .prefetch(self.options.prefetch)
            .skip_batches(self.skip);
        Ok(FabricBatches {
            inner: loader.iter(),
            device: self.options.move_to_device.then(|| self.device.clone()),
            failed: false,
        })
    }
}

/// One epoch of a [`FabricLoader`]: its batches, on the rank's device
/// unless `move_to_device` is off. Stops after the first error.
#[derive(Debug)]
pub struct FabricBatches {
    inner: LoaderIter,
    device: Option<Device>,
    failed: bool,
}

impl Iterator for FabricBatches {
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        let moved = self
            .inner
            .next()?
            .map_err(Error::from)
            .and_then(|batch| match &self.device {
                Some(device) => batch
                    .iter()
                    .map(|t| t.to_device(device).map_err(Error::from))
                    .collect(),
                None => Ok(batch),
            });
        self.failed = moved.is_err();
        Some(moved)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.inner.size_hint()
    }
}

/// Rank `rank`'s positions `rank, rank + world, ...` of `order` padded to
/// a multiple of `world` by repeating it from the start, as
/// `DistributedSampler` deals its order.
fn deal(order: &[usize], world: usize, rank: usize) -> Vec<usize> {
    if order.is_empty() {
        return Vec::new();
    }
    let total = order.len().div_ceil(world) * world;
    (rank..total)
        .step_by(world)
        .map(|p| order[p % order.len()])
        .collect()
}

/// Settings of [`batch_wise`].
#[derive(Debug, Clone, Copy)]
struct BatchWiseOptions {
    split_batches: bool,
    even_batches: bool,
    drop_last: bool,
}

/// Rank `rank`'s batches of `order` cut into batches of `batch_size` and
/// dealt to `world` ranks as Accelerate's `BatchSamplerShard` does.
fn batch_wise(
    order: &[usize],
    batch_size: usize,
    world: usize,
    rank: usize,
    options: BatchWiseOptions,
) -> Vec<Vec<usize>> {
    let mut batches: Vec<Vec<usize>> = order.chunks(batch_size).map(<[usize]>::to_vec).collect();
    if options.drop_last && batches.last().is_some_and(|b| b.len() < batch_size) {
        batches.pop();
    }
    if options.split_batches {
        return split_each(&batches, batch_size, world, rank, options);
    }
    let full = |b: &Vec<usize>| b.len() == batch_size;
    // The batches every rank gets in full rounds: a round is yielded only
    // when its last batch is full.
    let rounds = batches.len() / world;
    let complete = match rounds {
        0 => 0,
        _ if full(&batches[rounds * world - 1]) => rounds,
        _ => rounds - 1,
    };
    let mut mine: Vec<Vec<usize>> = (0..complete)
        .map(|round| batches[round * world + rank].clone())
        .collect();
    let rest = &batches[complete * world..];
    if options.drop_last || order.is_empty() {
        return mine;
    }
    if !options.even_batches {
        if let Some(b) = rest.get(rank) {
            mine.push(b.clone());
        }
        return mine;
    }
    if rest.is_empty() {
        return mine;
    }
    // Complete the last round: the full batches as they are, then the
    // short one and the missing ones filled from the start of the order.
    let mut initial: Vec<usize> = batches.iter().take(world).flatten().copied().collect();
    while initial.len() < world * batch_size {
        initial.extend_from_within(..);
    }
    let mut cycle = 0;
    for slot in 0..world {
        let mut batch = rest.get(slot).cloned().unwrap_or_default();
        if batch.len() < batch_size {
            let need = batch_size - batch.len();
            batch.extend_from_slice(&initial[cycle..cycle + need]);
            cycle += need;
        }
        if slot == rank {
            mine.push(batch);
        }
    }
    mine
}

/// `split_batches`: every full batch cut into `world` parts; a short last
/// batch completed from the start (`even_batches`) or cut as it is.
fn split_each(
    batches: &[Vec<usize>],
    batch_size: usize,
    world: usize,
    rank: usize,
    options: BatchWiseOptions,
) -> Vec<Vec<usize>> {
    let part = batch_size / world;
    let piece =
        |b: &[usize]| -> Vec<usize> { b.iter().skip(part * rank).take(part).copied().collect() };
    let mut mine: Vec<Vec<usize>> = batches
        .iter()
        .filter(|b| b.len() == batch_size)
        .map(|b| piece(b))
        .collect();
    let Some(last) = batches.last().filter(|b| b.len() < batch_size) else {
        return mine;
    };
    if options.drop_last {
        return mine;
    }
    if options.even_batches {
        let mut initial: Vec<usize> = batches.first().cloned().unwrap_or_default();
        while !initial.is_empty() && initial.len() < batch_size {
            initial.extend_from_within(..);
        }
        let mut completed = last.clone();
        completed.extend_from_slice(&initial);
        mine.push(piece(&completed));
    } else if last.len() > part * rank {
        mine.push(piece(last));
    }
    mine
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deal(
        n: usize,
        batch: usize,
        world: usize,
        split: bool,
        even: bool,
        drop: bool,
    ) -> Vec<Vec<Vec<usize>>> {
        let order: Vec<usize> = (0..n).collect();
        (0..world)
            .map(|rank| {
                batch_wise(
                    &order,
                    batch,
                    world,
                    rank,
                    BatchWiseOptions {
                        split_batches: split,
                        even_batches: even,
                        drop_last: drop,
                    },
                )
            })
            .collect()
    }

    #[test]
    fn batch_wise_gives_whole_batches_in_turn() {
        let ranks = deal(20, 10, 2, false, true, false);
        assert_eq!(ranks[0], vec![(0..10).collect::<Vec<_>>()]);
        assert_eq!(ranks[1], vec![(10..20).collect::<Vec<_>>()]);
    }

    #[test]
    fn even_batches_complete_the_last_round_from_the_start() {
        // 7 samples, batch 2, 2 ranks: batches [0,1] [2,3] [4,5] [6];
        // the second round is [4,5] and [6] completed with 0.
        let ranks = deal(7, 2, 2, false, true, false);
        assert_eq!(ranks[0], vec![vec![0, 1], vec![4, 5]]);
        assert_eq!(ranks[1], vec![vec![2, 3], vec![6, 0]]);
    }
}
