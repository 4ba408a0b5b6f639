//! Tensor parallelism around any strategy: the strategy runs over the
//! ranks that hold the same pieces (its group in [`EngineSetup`]), and
//! this engine adds what the tensor-parallel ranks share: the gradient
//! norm taken over them, and the whole model joined from their pieces.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use candle_nn::VarMap;

use super::{Engine, EngineStep, FoundState, LossFn, StateStore, Trainables};
use crate::error::{Error, Result};
use crate::fabric::memory::Memory;
use crate::optim::{Clipped, StatefulOptimizer};
use crate::saving::training_state::TrainingState;
use crate::tensor_parallel::{TensorParallel, TpPlan};
use crate::util::lock::lock;
use crate::util::vars::sorted_vars;

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

    fn holds_whole(&self) -> bool {
        false
    }

    /// The state whole, as one device's: every rank gives its pieces,
    /// rank 0 writes them joined, so that the state loads on any mesh (and
    /// on one device) as it is. For a strategy that holds its model whole
    /// on each rank (single, DDP); a sharding one's pieces of pieces are
    /// not joined yet.
    fn save(&self, store: &StateStore<'_>, mut state: TrainingState) -> Result<()> {
        if !self.inner.holds_whole() {
            return self.not_yet(&format!("saving the state of strategy {}", self.name()));
        }
        let trainables = self.inner.trainables();
        let mut values = HashMap::new();
        for (name, var) in sorted_vars(trainables.varmap()) {
            let whole = self.join(&name, var.as_tensor())?;
            values.insert(name, whole);
        }
        let mut optimizer = trainables.optimizer().state()?;
        let pieces = std::mem::take(&mut optimizer.tensors);
        for (key, tensor) in pieces {
            let whole = match self.placement_of_state(&key, &tensor, trainables) {
                Some(_) => self.join(parameter_of(&key), &tensor)?,
                None => tensor,
            };
            optimizer.tensors.insert(key, whole);
        }
        if store.pg.rank() == 0 {
            state.optimizer = Some(optimizer);
            store.checkpoints.save(&super::varmap_of(values)?, &state)?;
        }
        Ok(store.pg.barrier()?)
    }

    fn find_state(&self, store: &StateStore<'_>) -> Result<Option<FoundState>> {
        super::states::find_whole(store)
    }

    /// Each rank cuts its pieces from a whole state (saved on any mesh, or
    /// on one device); all or nothing.
    fn load_state(&mut self, found: FoundState) -> Result<()> {
        if !self.inner.holds_whole() {
            return self.not_yet(&format!("loading a state into strategy {}", self.name()));
        }
        let (rank, tp) = (self.tp.rank(), self.tp.size());
        let local = sorted_vars(self.inner.trainables().varmap());
        // The whole model's shapes, read strictly from the state.
        let whole = VarMap::new();
        for (name, var) in &local {
            let shape = self.plan.placement(name).whole_shape(var.shape(), tp);
            let zeros = Var::zeros(shape, var.dtype(), var.device())?;
            lock(whole.data()).insert(name.clone(), zeros);
        }
        found.saved.restore::<O>(&whole, None)?;
        let whole = lock(whole.data()).clone();
        let mut pieces = Vec::with_capacity(local.len());
        for (name, var) in &local {
            let value = whole[name].as_tensor();
            let piece = self.plan.placement(name).piece(value, rank, tp, name)?;
            pieces.push((var.clone(), piece));
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
            let placement = self.plan.placement(parameter_of(&key));
            let is_piece = whole
                .get(parameter_of(&key))
                .is_some_and(|param| param.dims() == tensor.dims());
            let tensor = match is_piece && placement.is_sharded() {
                true => placement.piece(&tensor, rank, tp, &key)?,
                false => tensor,
            };
            optimizer.tensors.insert(key, tensor);
        }
        let trainables = self.inner.trainables_mut();
        let before = trainables.optimizer().state()?;
        trainables.optimizer_mut().load_state(&optimizer)?;
        for (var, piece) in &pieces {
            if let Err(e) = var.set(&piece.to_dtype(var.dtype())?) {
                trainables.optimizer_mut().load_state(&before)?;
                return Err(e.into());
            }
        }
        Ok(())
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

    /// The placement of the optimizer's state `key` (`<parameter>.<slot>`)
    /// when it is a split parameter's piece (a moment), `None` for a
    /// replicated one or a slot of another shape (a step count).
    fn placement_of_state(
        &self,
        key: &str,
        tensor: &Tensor,
        trainables: &Trainables<O>,
    ) -> Option<crate::tensor_parallel::Placement> {
        let param = parameter_of(key);
        let placement = self.plan.placement(param);
        let shape = lock(trainables.varmap().data())
            .get(param)
            .map(|v| v.dims().to_vec());
        (placement.is_sharded() && shape.as_deref() == Some(tensor.dims())).then_some(placement)
    }
}

/// The parameter an optimizer state's key (`<parameter>.<slot>`) is of.
fn parameter_of(key: &str) -> &str {
    key.rsplit_once('.').map_or(key, |(param, _)| param)
}
