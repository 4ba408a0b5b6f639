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
use crate::saving::training_state::{TrainingState, MODEL_FILE};
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

    /// The tensor-parallel ranks hold different pieces of the split
    /// gradients: an inf or NaN one of them finds (f16's loss scaling) is
    /// told to every rank, so that all skip the step together.
    fn shards(&self) -> bool {
        true
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
        sorted(self.inner.full_state()?)
            .into_iter()
            .map(|(name, piece)| {
                let whole = self.join(&name, &piece)?;
                Ok((name, whole))
            })
            .collect()
    }

    /// Saved whole, its pieces joined, whatever the strategy beside.
    fn state_layout(&self) -> Option<&'static str> {
        Some("whole")
    }

    /// A rank holds its pieces, never the whole model.
    fn holds_whole(&self) -> bool {
        false
    }

    fn memory(&self) -> Result<Memory> {
        self.inner.memory()
    }

    /// The state whole, as one device's: the strategy puts its pieces
    /// together ([`Engine::whole_state`]), the tensor-parallel ranks join
    /// theirs, rank 0 writes them, so that the state loads on any mesh
    /// (and on one device) as it is.
    fn save(&self, store: &StateStore<'_>, mut state: TrainingState) -> Result<()> {
        // Every rank of a tensor-parallel group sits at the same place of
        // the strategy's ranks: all of them have the state, or none.
        // The pieces are put together on the first tensor-parallel rank
        // only, one tensor at a time (the others hold no whole copy).
        if let Some((values, mut optimizer)) = self.inner.whole_state()? {
            let mut whole = HashMap::new();
            for (name, value) in sorted(values.clone()) {
                if let Some(joined) = self.join_on_first(&name, &value)? {
                    whole.insert(name, joined);
                }
            }
            let pieces = std::mem::take(&mut optimizer.tensors);
            for (key, tensor) in pieces {
                let joined = match self.is_piece_of_state(&key, &tensor, &values) {
                    true => self.join_on_first(parameter_of(&key), &tensor)?,
                    false => Some(tensor),
                };
                if let Some(joined) = joined {
                    optimizer.tensors.insert(key, joined);
                }
            }
            if store.pg.rank() == 0 {
                state.optimizer = Some(optimizer);
                store.checkpoints.save(&super::varmap_of(whole)?, &state)?;
            }
        }
        Ok(store.pg.barrier()?)
    }

    fn find_state(&self, store: &StateStore<'_>) -> Result<Option<FoundState>> {
        super::states::find_whole(store)
    }

    /// Each rank cuts its pieces from a whole state (saved on any mesh, or
    /// on one device) and gives them to the strategy, which takes its
    /// part; all or nothing.
    fn load_state(&mut self, found: FoundState) -> Result<()> {
        let (rank, tp) = (self.tp.rank(), self.tp.size());
        let file = found.path().join(MODEL_FILE);
        let whole = candle_core::safetensors::load(&file, &candle_core::Device::Cpu)
            .map_err(|e| Error::Checkpoint(format!("{}: {e}", file.display())))?;
        let mut values = HashMap::with_capacity(whole.len());
        for (name, value) in &whole {
            let piece = self.plan.placement(name).piece(value, rank, tp, name)?;
            values.insert(name.clone(), piece);
        }
        let saved = found.state().optimizer.clone().ok_or_else(|| {
            Error::Checkpoint(format!(
                "{}: the state has no optimizer state to restore",
                found.path().display()
            ))
        })?;
        let mut optimizer = saved.clone();
        optimizer.tensors.clear();
        for (key, tensor) in saved.tensors {
            let tensor = match self.is_piece_of_state(&key, &tensor, &whole) {
                true => self
                    .plan
                    .placement(parameter_of(&key))
                    .piece(&tensor, rank, tp, &key)?,
                false => tensor,
            };
            optimizer.tensors.insert(key, tensor);
        }
        self.inner.load_whole_state(&values, &optimizer)
    }
}

impl<O: StatefulOptimizer> TensorParallelEngine<O> {
    /// The whole of `piece` of parameter `name` (or of its state), joined
    /// from every tensor-parallel rank's; itself when replicated.
    fn join(&self, name: &str, piece: &Tensor) -> Result<Tensor> {
        let placement = self.plan.placement(name);
        if !placement.is_sharded() {
            return Ok(piece.clone());
        }
        let pieces = self.tp.group().all_gather(&piece.contiguous()?)?;
        placement.join(&pieces, name)
    }

    /// [`join`](Self::join) on the first tensor-parallel rank only
    /// (`None` on the others, which send their pieces): a save's, so that
    /// no other rank holds the whole model. Every rank of the group calls
    /// it, in one order.
    fn join_on_first(&self, name: &str, piece: &Tensor) -> Result<Option<Tensor>> {
        let placement = self.plan.placement(name);
        if !placement.is_sharded() {
            return Ok(Some(piece.clone()));
        }
        match self.tp.group().gather(&piece.contiguous()?, 0)? {
            Some(pieces) => Ok(Some(placement.join(&pieces, name)?)),
            None => Ok(None),
        }
    }

    /// Whether the optimizer's state `key` (`<parameter>.<slot>`) is a
    /// split parameter's (a moment, shaped as the parameter's value in
    /// `values`), not a step count.
    fn is_piece_of_state(
        &self,
        key: &str,
        tensor: &Tensor,
        values: &HashMap<String, Tensor>,
    ) -> bool {
        let param = parameter_of(key);
        self.plan.placement(param).is_sharded()
            && values.get(param).is_some_and(|v| v.dims() == tensor.dims())
    }
}

/// `values` in name order (every rank joins them in one order).
fn sorted(values: HashMap<String, Tensor>) -> Vec<(String, Tensor)> {
    let mut values: Vec<_> = values.into_iter().collect();
    values.sort_by(|a, b| a.0.cmp(&b.0));
    values
}

/// The parameter an optimizer state's key (`<parameter>.<slot>`) is of.
fn parameter_of(key: &str) -> &str {
    key.rsplit_once('.').map_or(key, |(param, _)| param)
}
