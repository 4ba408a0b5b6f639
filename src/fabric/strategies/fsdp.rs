//! `fsdp` and `hsdp`: each rank keeps its pieces of every unit's
//! parameters, gradients and optimizer state, gathering a unit for its
//! forward and backward ([`FullyShardedDataParallel`]); HSDP within shard
//! groups, replicated across them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use candle_nn::VarMap;

use super::states::{self, not_this_layout};
use super::{
    from_step, scaled, Engine, EngineSetup, EngineStep, FoundState, LossFn, Memory, Shards,
    StateStore, Trainables, WholeState,
};
use crate::comm::ProcessGroup;
use crate::error::Result;
use crate::fabric::Strategy;
use crate::fsdp::{FsdpConfig, FullyShardedDataParallel};
use crate::optim::clip::AlsoAcross;
use crate::optim::{Clipped, OptimizerState, StatefulOptimizer};
use crate::saving::training_state::TrainingState;
use crate::util::lock::lock;
use crate::util::vars::store_of;

/// The engine of `fsdp` and `hsdp`.
pub(super) struct Fsdp<O> {
    fsdp: Box<FullyShardedDataParallel>,
    name: &'static str,
    trainables: Trainables<O>,
}

impl<O: StatefulOptimizer> Fsdp<O> {
    pub(super) fn build<F>(setup: &EngineSetup<'_>, strategy: Strategy, make: F) -> Result<Self>
    where
        F: FnOnce(Vec<(String, Var)>) -> candle_core::Result<O>,
    {
        let config = setup.config;
        let fsdp_config = FsdpConfig {
            reshard_after_forward: config.reshard_after_forward,
            recompute_activations: config.recompute_activations,
            // The prefetch gathers on a thread of its own while the unit's
            // tensor-parallel collectives run: an MPI process makes its
            // calls one at a time, so the two could run in different
            // orders on different ranks and wait for each other.
            prefetch: config.prefetch && setup.tensor_parallel.is_none(),
            mixed_precision: config.precision.policy(),
            ..FsdpConfig::default()
        };
        let parts = setup.module.parts().to_vec();
        let fsdp = match strategy {
            Strategy::Hsdp => {
                let mesh = setup.mesh.sub_mesh(&["dp_replicate", "dp_shard"])?;
                FullyShardedDataParallel::from_units_on_mesh(
                    &mesh,
                    setup.varmap,
                    DType::F32,
                    setup.device(),
                    parts,
                    fsdp_config,
                )?
            }
            _ => FullyShardedDataParallel::from_units(
                setup.pg.clone(),
                setup.varmap,
                DType::F32,
                setup.device(),
                parts,
                fsdp_config,
            )?,
        };
        // FSDP's pieces are the variables: any optimizer steps them.
        let trainables = Trainables::build(setup.varmap.clone(), fsdp.shards().to_vec(), make)?;
        Ok(Self {
            fsdp: Box::new(fsdp),
            name: strategy.name(),
            trainables,
        })
    }
}

impl<O: StatefulOptimizer + 'static> Engine<O> for Fsdp<O> {
    fn name(&self) -> &str {
        self.name
    }

    fn forward_backward(
        &mut self,
        x: &Tensor,
        y: &Tensor,
        factor: f64,
        sync: bool,
        loss_fn: &LossFn,
    ) -> Result<EngineStep> {
        let scaled = scaled(loss_fn, factor);
        let run = |fsdp: &mut FullyShardedDataParallel| fsdp.forward_backward(x, y, scaled);
        let step = match sync {
            true => run(&mut self.fsdp),
            false => self.fsdp.no_sync(run),
        }?;
        from_step(step, factor, sync)
    }

    fn local_forward_backward(
        &mut self,
        x: &Tensor,
        y: &Tensor,
        factor: f64,
        loss_fn: &LossFn,
    ) -> Result<EngineStep> {
        // The loss as the loss function gave it (one device's bits), and
        // its scaled copy for the backward.
        let seen = Arc::new(Mutex::new(None));
        let (keep, loss_fn) = (Arc::clone(&seen), loss_fn.clone());
        let scaled = move |out: &Tensor, y: &Tensor| {
            let loss = loss_fn(&crate::precision::output_for_loss(out)?, y)?;
            *lock(&keep) = Some(loss.detach());
            loss.affine(factor, 0.0)
        };
        // Without the reduce-scatter FSDP holds this chunk's whole
        // gradients: they are keyed by the pieces, whole.
        self.fsdp
            .no_sync(|fsdp| fsdp.forward_backward(x, y, scaled))?;
        let whole = self.fsdp.take_accumulated();
        let loss = lock(&seen).take().ok_or_else(|| {
            crate::error::Error::Fabric("FSDP's step did not call the loss function".into())
        })?;
        Ok(EngineStep {
            loss,
            grads: Some(store_of(self.fsdp.shards(), whole)),
        })
    }

    fn local_grad_dims(&self) -> Vec<Vec<usize>> {
        self.fsdp.whole_dims()
    }

    fn step(&mut self, grads: &GradStore) -> Result<()> {
        let pieces = self.fsdp.pieces_of_whole(grads)?;
        self.trainables.step(&pieces)
    }

    fn forward(&mut self, x: &Tensor) -> Result<Tensor> {
        self.fsdp.forward_t(x, false)
    }

    fn trainables(&self) -> &Trainables<O> {
        &self.trainables
    }

    fn trainables_mut(&mut self) -> &mut Trainables<O> {
        &mut self.trainables
    }

    fn accumulates_itself(&self) -> bool {
        true
    }

    fn shards(&self) -> bool {
        true
    }

    fn clip(&self, grads: &mut GradStore, max_norm: f64) -> Result<Clipped> {
        self.fsdp.clip_grad_norm(grads, max_norm, 2.0, false)
    }

    fn clip_tensor_parallel(
        &self,
        grads: &mut GradStore,
        max_norm: f64,
        tp: &dyn ProcessGroup,
        counted: &dyn Fn(&str) -> bool,
    ) -> Result<Clipped> {
        let also = AlsoAcross { group: tp, counted };
        self.fsdp
            .clip_grad_norm_also(grads, max_norm, 2.0, false, Some(also))
    }

    fn full_state(&self) -> Result<HashMap<String, Tensor>> {
        self.fsdp.full_state()
    }

    fn whole_state(&self) -> Result<Option<WholeState>> {
        let (values, state) = self.fsdp.whole_state(self.trainables.optimizer())?;
        Ok(state.map(|state| (values, state)))
    }

    fn load_whole_state(
        &mut self,
        values: &HashMap<String, Tensor>,
        optimizer: &OptimizerState,
    ) -> Result<()> {
        self.fsdp
            .load_whole(values, optimizer, self.trainables.optimizer_mut())
    }

    fn memory(&self) -> Result<Memory> {
        let m = self.fsdp.last_memory();
        Ok(Memory {
            parameters: m.shard_bytes,
            peak_gathered: Some(m.peak_gathered_bytes),
            whole_model: Some(m.full_bytes),
            ..self.trainables.memory()?
        })
    }

    fn save(&self, store: &StateStore<'_>, state: TrainingState) -> Result<()> {
        // Under HSDP every replica holds the same pieces: the first
        // replica's ranks write them (numbered in their shard group).
        store.checkpoints.save_sharded(
            store.pg,
            &VarMap::new(),
            &super::varmap_of(self.fsdp.pieces()?)?,
            self.fsdp.shard_state(self.trainables.optimizer())?,
            state,
            (self.fsdp.replica_rank() == 0).then(|| self.fsdp.shard_rank()),
        )
    }

    fn find_state(&self, store: &StateStore<'_>) -> Result<Option<FoundState>> {
        states::find_fsdp_layout(store)
    }

    fn load_state(&mut self, found: FoundState) -> Result<()> {
        let Shards::Fsdp(saves) = found.shards else {
            return Err(not_this_layout());
        };
        let (pieces, states): (Vec<_>, Vec<_>) = saves.into_iter().unzip();
        let optimizer = self.trainables.optimizer_mut();
        self.fsdp.load_resharded(&pieces, &states, optimizer)
    }
}
