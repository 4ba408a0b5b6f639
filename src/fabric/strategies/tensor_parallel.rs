//! Tensor parallelism around any strategy: the strategy runs over the
//! ranks that hold the same pieces (its group in [`EngineSetup`]), and
//! this engine adds what the tensor-parallel ranks share: the gradient
//! norm taken over them, and the whole model joined from their pieces.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::Tensor;

use super::{Engine, EngineStep, FoundState, LossFn, StateStore, Trainables};
use crate::error::{Error, Result};
use crate::fabric::memory::Memory;
use crate::optim::{Clipped, StatefulOptimizer};
use crate::saving::training_state::TrainingState;
use crate::tensor_parallel::{TensorParallel, TpPlan};

/// A strategy's engine on one tensor-parallel rank.
pub(crate) struct TensorParallelEngine<O> {
    inner: Box<dyn Engine<O>>,
    tp: TensorParallel,
    plan: TpPlan,
}

impl<O> TensorParallelEngine<O> {
    pub(crate) fn around(inner: Box<dyn Engine<O>>, tp: TensorParallel, plan: TpPlan) -> Self {
        Self { inner, tp, plan }
    }

    fn not_yet<T>(&self, what: &str) -> Result<T> {
        Err(Error::TensorParallel(format!(
            "{what} of a tensor-parallel run (tp = {}) is not built yet",
            self.tp.size()
        )))
    }
}

impl<O: StatefulOptimizer + 'static> Engine<O> for TensorParallelEngine<O> {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn forward_backward(
        &mut self,
        x: &Tensor,
        y: &Tensor,
        factor: f64,
        sync: bool,
        loss_fn: &LossFn,
    ) -> Result<EngineStep> {
        self.inner.forward_backward(x, y, factor, sync, loss_fn)
    }

    fn forward(&mut self, x: &Tensor) -> Result<Tensor> {
        self.inner.forward(x)
    }

    fn trainables(&self) -> &Trainables<O> {
        self.inner.trainables()
    }

    fn trainables_mut(&mut self) -> &mut Trainables<O> {
        self.inner.trainables_mut()
    }

    fn accumulates_itself(&self) -> bool {
        self.inner.accumulates_itself()
    }

    fn shards(&self) -> bool {
        self.inner.shards()
    }

    fn step(&mut self, grads: &GradStore) -> Result<()> {
        self.inner.step(grads)
    }

    /// The norm over every rank's pieces: a parameter the ranks split
    /// counts on each, one they replicate (its gradient the same on
    /// each) on the first only.
    fn clip(&self, grads: &mut GradStore, max_norm: f64) -> Result<Clipped> {
        let first = self.tp.rank() == 0;
        let counted = |name: &str| first || self.plan.placement(name).is_sharded();
        self.inner
            .clip_tensor_parallel(grads, max_norm, self.tp.group().as_ref(), &counted)
    }

    /// The strategy's whole model of this rank's pieces, each split
    /// parameter joined from every tensor-parallel rank's.
    fn full_state(&self) -> Result<HashMap<String, Tensor>> {
        let mut names: Vec<(String, Tensor)> = self.inner.full_state()?.into_iter().collect();
        names.sort_by(|a, b| a.0.cmp(&b.0));
        let group = self.tp.group();
        names
            .into_iter()
            .map(|(name, piece)| {
                let placement = self.plan.placement(&name);
                if !placement.is_sharded() {
                    return Ok((name, piece));
                }
                let pieces = group.all_gather(&piece.contiguous()?)?;
                let whole = placement.join(&pieces, &name)?;
                Ok((name, whole))
            })
            .collect()
    }

    fn memory(&self) -> Result<Memory> {
        self.inner.memory()
    }

    fn save(&self, _: &StateStore<'_>, _: TrainingState) -> Result<()> {
        self.not_yet("saving the state")
    }

    fn find_state(&self, _: &StateStore<'_>) -> Result<Option<FoundState>> {
        self.not_yet("resuming")
    }

    fn load_state(&mut self, _: FoundState) -> Result<()> {
        self.not_yet("loading a state")
    }
}
