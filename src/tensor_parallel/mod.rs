//! Tensor parallelism (Megatron-LM; PyTorch's `parallelize_module`): the
//! matrices of a layer split over the ranks of a group, each rank
//! computing with its piece, the collectives inside the autograd graph.
//!
//! - [`TensorParallel`]: one rank's group, and whether the activations
//!   between the layers are split along the sequence (sequence
//!   parallelism);
//! - [`collectives`]: Megatron's `f` and `g` and their sequence-parallel
//!   forms, differentiable;
//! - the layers: [`ColumnLinear`] (PyTorch's `ColwiseParallel`),
//!   [`RowLinear`] (`RowwiseParallel`), [`VocabEmbedding`] (`RowwiseParallel`
//!   on an embedding) and [`vocab_parallel_cross_entropy`]
//!   (`loss_parallel`), which never gathers the logits;
//! - [`Placement`] and [`TpPlan`]: how each parameter lies over the ranks,
//!   to draw the same initial weights as one device and to join the
//!   pieces back.
//!
//! Every rank of a tensor-parallel group sees the same batch; the layers
//! are written with their pieces' sizes (a column-parallel layer of `n`
//! outputs holds `n / tp` of them). See `docs/tensor_parallel.md`.

pub mod collectives;
mod layers;
mod loss;
mod placement;
mod plan;

use std::fmt;
use std::sync::Arc;

use candle_core::Tensor;

use crate::comm::{Color, ProcessGroup};
use crate::error::{Error, Result};

pub use layers::{ColumnLinear, RowLinear, VocabEmbedding};
pub use loss::vocab_parallel_cross_entropy;
pub use placement::Placement;
pub use plan::TpPlan;

/// One rank's tensor parallelism: its group (the ranks that split each
/// matrix) and whether sequence parallelism splits the activations
/// between the layers along the sequence (dimension 1 of batch x time x
/// width).
#[derive(Clone)]
pub struct TensorParallel {
    group: Arc<dyn ProcessGroup>,
    sequence_parallel: bool,
}

impl fmt::Debug for TensorParallel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TensorParallel")
            .field("rank", &self.rank())
            .field("size", &self.size())
            .field("sequence_parallel", &self.sequence_parallel)
            .finish()
    }
}

impl TensorParallel {
    /// Splits `world` into groups of `tp` neighbouring ranks that split
    /// each matrix (the innermost dimension of the mesh: one machine),
    /// and returns this rank's tensor parallelism with the group of the
    /// ranks at its place in every other group (which the data-parallel
    /// strategy runs over). A collective of `world`.
    ///
    /// ```
    /// use candle_dp::launch::spawn;
    /// use candle_dp::tensor_parallel::TensorParallel;
    ///
    /// let seen = spawn(4, |ctx| {
    ///     let (tp, data) = TensorParallel::split(&ctx.process_group(), 2, false)?;
    ///     Ok((tp.rank(), data.rank()))
    /// })?;
    /// // Ranks 0 and 1 split the matrices; ranks 0 and 2 hold the same pieces.
    /// assert_eq!(seen, [(0, 0), (1, 0), (0, 1), (1, 1)]);
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::TensorParallel`] when `tp` does not divide the world; a
    /// collective's.
    pub fn split(
        world: &Arc<dyn ProcessGroup>,
        tp: usize,
        sequence_parallel: bool,
    ) -> Result<(Self, Arc<dyn ProcessGroup>)> {
        let (rank, size) = (world.rank(), world.world_size());
        if tp == 0 || !size.is_multiple_of(tp) {
            return Err(Error::TensorParallel(format!(
                "tp = {tp} does not divide the {size} ranks"
            )));
        }
        let missing = || Error::TensorParallel(format!("rank {rank} was left out of a group"));
        let group = world
            .split(Color::new((rank / tp) as u32), rank as i64)?
            .ok_or_else(missing)?;
        let data = world
            .split(Color::new((rank % tp) as u32), rank as i64)?
            .ok_or_else(missing)?;
        Ok((Self::new(group, sequence_parallel), data))
    }

    /// Tensor parallelism over `group`.
    pub fn new(group: Arc<dyn ProcessGroup>, sequence_parallel: bool) -> Self {
        Self {
            group,
            sequence_parallel,
        }
    }

    /// The group.
    pub fn group(&self) -> &Arc<dyn ProcessGroup> {
        &self.group
    }

    /// This rank's place in the group.
    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    /// The ranks that split each matrix (`tp`).
    pub fn size(&self) -> usize {
        self.group.world_size()
    }

    /// Whether the activations between layers are split along the
    /// sequence.
    pub fn sequence_parallel(&self) -> bool {
        self.sequence_parallel
    }

    /// `count` (of heads, features, rows) over the ranks: each rank's
    /// share.
    ///
    /// # Errors
    ///
    /// [`Error::TensorParallel`] naming `what` when it does not divide.
    pub fn share(&self, count: usize, what: &str) -> Result<usize> {
        let tp = self.size();
        if !count.is_multiple_of(tp) {
            return Err(Error::TensorParallel(format!(
                "{what} ({count}) does not divide among tp = {tp} ranks"
            )));
        }
        Ok(count / tp)
    }

    /// A replicated parameter as a layer should use it: itself, or with
    /// sequence parallelism (where each rank sees only its part of the
    /// sequence, so that its gradient is partial) through
    /// [`collectives::copy_to`], whose backward sums the ranks' parts.
    ///
    /// # Errors
    ///
    /// The op's.
    pub fn replicated(&self, param: &Tensor) -> candle_core::Result<Tensor> {
        match self.sequence_parallel {
            true => collectives::copy_to(param, &self.group),
            false => Ok(param.clone()),
        }
    }

    /// The input of a column-parallel layer: the whole input, its
    /// gradient summed over the ranks; with sequence parallelism the
    /// sequence gathered first.
    ///
    /// # Errors
    ///
    /// The op's, a collective's.
    pub fn enter(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self.sequence_parallel {
            true => collectives::gather_along(x, 1, &self.group),
            false => collectives::copy_to(x, &self.group),
        }
    }

    /// The output of a row-parallel layer (partial sums): summed over the
    /// ranks; with sequence parallelism summed and split along the
    /// sequence.
    ///
    /// # Errors
    ///
    /// The collective's.
    pub fn leave(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self.sequence_parallel {
            true => collectives::reduce_scatter_along(x, 1, &self.group),
            false => collectives::reduce_from(x, &self.group),
        }
    }
}
