//! World-size-invariant training: the same bits on any number of ranks.
//!
//! One device adds a batch's gradient in one order, two ranks in another,
//! so a run on 8 ranks, its debugging run on one device and a job resumed
//! on the machines that survived a failure end at different weights. With
//! [`FabricConfig::deterministic`](crate::fabric::FabricConfig::deterministic)
//! set to `C` chunks the result depends only on the global batch, the seed
//! and the model:
//!
//! - each global batch is cut into `C` chunks of consecutive rows (the
//!   loader hands each rank its consecutive share: `Sharding::BatchWise`
//!   with `split_batches`), each chunk's loss and gradient computed alone,
//!   the same computation on whichever rank it falls;
//! - the chunks' gradients and losses are summed exactly
//!   (`exact_sum.rs`): rounded onto one grid whose integers add without
//!   error in any order, so 1, 2, 4 or 8 ranks reach the same sum;
//! - the reported loss is the global batch's, the mean of the chunks'.
//!
//! What it excludes, refused before a step runs: batch statistics
//! (BatchNorm's running means, which each chunk would update in turn),
//! tensor parallelism (the split changes the sums inside each layer), and
//! the pipelines, which reduce inside their schedules; `single`, `dp`,
//! the DDP family, ZeRO, FSDP and HSDP keep it. A model that draws random numbers (dropout) breaks the
//! promise unless it keys them by the sample. What it costs is measured in
//! `docs/determinism.md`.
//!
//! ```no_run
//! use candle_dp::fabric::{DataOptions, Fabric, FabricConfig, ModelRecipe, Sharding, Strategy};
//!
//! // 8 chunks a batch: 1, 2, 4 or 8 ranks train to the same bits.
//! let config = FabricConfig { deterministic: Some(8), ..FabricConfig::new(Strategy::Ddp, 4) };
//! let options = DataOptions {
//!     sharding: Sharding::BatchWise { split_batches: true, even_batches: true },
//!     ..DataOptions::default()
//! };
//! # let _ = (config, options);
//! ```

pub(crate) mod exact_sum;

use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};

use crate::comm::ProcessGroup;
use crate::error::{Error, Result};
use exact_sum::{exact_sums, Terms};

/// A step cut into chunks whose sums are the same on any number of ranks.
#[derive(Clone)]
pub(crate) struct ChunkedStep {
    /// The chunks of a global batch.
    chunks: usize,
    /// The ranks that share them (the strategy's data-parallel group).
    pg: Arc<dyn ProcessGroup>,
}

impl ChunkedStep {
    pub(crate) fn new(chunks: usize, pg: Arc<dyn ProcessGroup>) -> Self {
        Self { chunks, pg }
    }

    /// The chunks of a global batch.
    pub(crate) fn chunks(&self) -> usize {
        self.chunks
    }

    /// The index of this rank's first chunk in the global batch.
    pub(crate) fn first_chunk(&self) -> usize {
        self.pg.rank() * (self.chunks / self.pg.world_size())
    }

    /// This rank's chunks of a share of `rows` rows: how many, and the
    /// rows of each.
    ///
    /// # Errors
    ///
    /// [`Error::Fabric`] naming the rows and chunks when they do not cut
    /// evenly.
    pub(crate) fn cut(&self, rows: usize) -> Result<(usize, usize)> {
        let ranks = self.pg.world_size();
        if !self.chunks.is_multiple_of(ranks) {
            return Err(Error::Fabric(format!(
                "deterministic training: {} chunks a batch do not split over {ranks} ranks",
                self.chunks
            )));
        }
        let mine = self.chunks / ranks;
        if rows == 0 || !rows.is_multiple_of(mine) {
            return Err(Error::Fabric(format!(
                "deterministic training: rank {}'s batch of {rows} rows does not cut into its {mine} \
                 of the {} chunks: give a global batch the chunks divide ({} rows for {} ranks)",
                self.pg.rank(),
                self.chunks,
                rows * ranks,
                ranks
            )));
        }
        Ok((mine, rows / mine))
    }

    /// The exact sums over every rank's chunks of each parameter's
    /// gradient (`grads`: this rank's chunks' stores, keyed by `params`,
    /// each gradient of the shape `dims` gives, the same on every rank)
    /// and of the chunks' `losses`: the summed gradients, and the mean
    /// loss of the global batch. Every rank calls it; one whose chunks
    /// `failed` (its grads and losses empty) makes every rank fail.
    ///
    /// # Errors
    ///
    /// A collective's; [`Error::Fabric`] naming a rank that failed.
    pub(crate) fn reduce(
        &self,
        params: &[Var],
        dims: &[Vec<usize>],
        grads: &[GradStore],
        losses: &[Tensor],
        failed: bool,
    ) -> Result<(GradStore, Tensor)> {
        let loss_dims: Vec<usize> = Vec::new();
        let (loss_dtype, loss_device) = losses.first().map_or((DType::F32, Device::Cpu), |l| {
            (l.dtype(), l.device().clone())
        });
        let mut quantities: Vec<Terms<'_>> = params
            .iter()
            .zip(dims)
            .map(|(p, dims)| Terms {
                mine: grads.iter().map(|g| g.get(p)).collect(),
                dims,
                dtype: p.dtype(),
                device: p.device(),
            })
            .collect();
        quantities.push(Terms {
            mine: losses.iter().map(Some).collect(),
            dims: &loss_dims,
            dtype: loss_dtype,
            device: &loss_device,
        });
        let mut sums = exact_sums(self.pg.as_ref(), &quantities, self.chunks, failed)?;
        let loss = sums
            .pop()
            .flatten()
            .ok_or_else(|| Error::Fabric("deterministic training: no loss was summed".into()))?;
        let mut store = GradStore::default();
        for (p, sum) in params.iter().zip(sums) {
            if let Some(sum) = sum {
                store.insert(p.as_tensor(), sum);
            }
        }
        let mean = loss.affine(1.0 / self.chunks as f64, 0.0)?;
        Ok((store, mean))
    }
}

impl std::fmt::Debug for ChunkedStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkedStep")
            .field("chunks", &self.chunks)
            .field("ranks", &self.pg.world_size())
            .finish()
    }
}
