//! `ddp`, `zero1` and `zero2` (a module reduced after its backward) and
//! `ddp-overlap` (units reduced during it): one model per rank, the
//! gradients all-reduced (or reduce-scattered, ZeRO-2), the optimizer
//! whole or (ZeRO) each rank's pieces.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use candle_nn::VarMap;

use super::states::{self, not_this_layout};
use super::trainables::Stepper;
use super::{
    bytes_of, from_step, scaled, Engine, EngineSetup, EngineStep, FoundState, LossFn, Memory,
    Shards, StateStore, Trainables, WholeState,
};
use crate::comm::ProcessGroup;
use crate::ddp::{DistributedDataParallel, ZeroStage};
use crate::error::Result;
use crate::fabric::Strategy;
use crate::optim::clip::AlsoAcross;
use crate::optim::{clip_grad_norm, Clipped, OptimizerState, StatefulOptimizer};
use crate::precision::output_for_loss;
use crate::saving::training_state::TrainingState;
use crate::units::Units;
use crate::zero::ZeroOptimizer;

/// The engine of `ddp`, `ddp-overlap`, `zero1` and `zero2`.
pub(super) struct Ddp<O> {
    ddp: Box<DistributedDataParallel<Units>>,
    overlapped: bool,
    name: &'static str,
    trainables: Trainables<O>,
}

impl<O: StatefulOptimizer> Ddp<O> {
    pub(super) fn build<F>(setup: &EngineSetup<'_>, strategy: Strategy, make: F) -> Result<Self>
    where
        F: FnOnce(Vec<(String, Var)>) -> candle_core::Result<O>,
    {
        let config = setup.config;
        let mut builder = DistributedDataParallel::builder(
            setup.pg.clone(),
            setup.varmap,
            DType::F32,
            setup.device(),
        );
        if let Some(policy) = config.precision.policy() {
            builder = builder.mixed_precision(policy);
        }
        let stage = match strategy {
            Strategy::Zero1 => Some(ZeroStage::One),
            Strategy::Zero2 => Some(ZeroStage::Two),
            _ => None,
        };
        if let Some(stage) = stage {
            // With a shard size, ZeRO on a mesh: the pieces split within
            // each shard group, replicated across them.
            builder = match config.shard_size {
                Some(_) => {
                    let mesh = setup.mesh.sub_mesh(&["dp_replicate", "dp_shard"])?;
                    builder.zero_on_mesh(stage, &mesh)?
                }
                None => builder.zero(stage),
            };
        }
        let overlapped = config.overlaps();
        let ddp = match overlapped {
            true => builder.build_units(setup.module.parts().to_vec())?,
            false => builder.build(setup.module.whole())?,
        };
        let varmap = setup.varmap.clone();
        let trainables = match ddp.zero_stage() {
            Some(_) => Trainables::zero(varmap, ZeroOptimizer::new(&ddp, make)?),
            None => Trainables::over_all(varmap, make)?,
        };
        Ok(Self {
            ddp: Box::new(ddp),
            overlapped,
            name: strategy.name(),
            trainables,
        })
    }
}

impl<O: StatefulOptimizer + 'static> Engine<O> for Ddp<O> {
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
        let overlapped = self.overlapped;
        let run = |ddp: &mut DistributedDataParallel<Units>| -> Result<EngineStep> {
            if overlapped {
                let step = ddp.forward_backward(x, y, scaled(loss_fn, factor))?;
                return from_step(step, factor, true);
            }
            let loss = loss_fn(&output_for_loss(&ddp.forward_t(x, true)?)?, y)?;
            let grads = ddp.backward(&loss.affine(factor, 0.0)?)?;
            Ok(EngineStep {
                loss: loss.detach(),
                grads: Some(grads),
            })
        };
        let step = match sync {
            true => run(&mut self.ddp),
            false => self.ddp.no_sync(run),
        }?;
        Ok(EngineStep {
            loss: step.loss,
            grads: step.grads.filter(|_| sync),
        })
    }

    fn local_forward_backward(
        &mut self,
        x: &Tensor,
        y: &Tensor,
        factor: f64,
        loss_fn: &LossFn,
    ) -> Result<EngineStep> {
        // The model's own backward, without DDP's reduction: the gradients
        // are keyed by the master parameters, as DDP's.
        let loss = loss_fn(&output_for_loss(&self.ddp.forward_t(x, true)?)?, y)?;
        let grads = loss.affine(factor, 0.0)?.backward()?;
        Ok(EngineStep {
            loss: loss.detach(),
            grads: Some(grads),
        })
    }

    fn forward(&mut self, x: &Tensor) -> Result<Tensor> {
        self.ddp.forward_t(x, false)
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
        matches!(self.trainables.stepper, Stepper::Zero(_))
    }

    fn clip(&self, grads: &mut GradStore, max_norm: f64) -> Result<Clipped> {
        match &self.trainables.stepper {
            Stepper::Zero(zero) => zero.clip_grad_norm(grads, max_norm, 2.0, false),
            Stepper::Whole(_) => {
                clip_grad_norm(grads, self.trainables.vars(), max_norm, 2.0, false)
            }
        }
    }

    fn clip_tensor_parallel(
        &self,
        grads: &mut GradStore,
        max_norm: f64,
        tp: &dyn ProcessGroup,
        counted: &dyn Fn(&str) -> bool,
    ) -> Result<Clipped> {
        match &self.trainables.stepper {
            Stepper::Zero(zero) => {
                let also = AlsoAcross { group: tp, counted };
                zero.clip_grad_norm_also(grads, max_norm, 2.0, false, Some(also))
            }
            Stepper::Whole(_) => super::clip_across(&self.trainables, grads, max_norm, tp, counted),
        }
    }

    /// ZeRO's whole state on the first rank of its shard group.
    fn whole_state(&self) -> Result<Option<WholeState>> {
        let values = super::values_of(&self.trainables)?;
        Ok(match &self.trainables.stepper {
            Stepper::Whole(opt) => Some((values, opt.state()?)),
            Stepper::Zero(zero) => zero.whole_state_on_first()?.map(|state| (values, state)),
        })
    }

    fn load_whole_state(
        &mut self,
        values: &HashMap<String, Tensor>,
        optimizer: &OptimizerState,
    ) -> Result<()> {
        let fitted = super::fitting(&self.trainables, values)?;
        match &mut self.trainables.stepper {
            Stepper::Whole(opt) => opt.load_state(optimizer)?,
            Stepper::Zero(zero) => zero.load_whole_state(optimizer)?,
        }
        super::set_all(&fitted)
    }

    fn memory(&self) -> Result<Memory> {
        Ok(Memory {
            parameters: bytes_of(self.ddp.params()),
            ..self.trainables.memory()?
        })
    }

    fn save(&self, store: &StateStore<'_>, state: TrainingState) -> Result<()> {
        let varmap = self.trainables.varmap();
        match &self.trainables.stepper {
            Stepper::Whole(opt) => states::save_whole(store, varmap, opt, state),
            // On a mesh every replica holds the same pieces: the first
            // replica's ranks write them (numbered in their shard group).
            Stepper::Zero(zero) => store.checkpoints.save_sharded(
                store.pg,
                varmap,
                &VarMap::new(),
                zero.shard_state()?,
                state,
                (zero.replica_rank() == 0).then(|| zero.shard_rank()),
            ),
        }
    }

    fn find_state(&self, store: &StateStore<'_>) -> Result<Option<FoundState>> {
        match &self.trainables.stepper {
            Stepper::Whole(_) => states::find_whole(store),
            Stepper::Zero(_) => {
                Ok(store
                    .checkpoints
                    .latest_zero()?
                    .map(|(saved, shards)| FoundState {
                        saved,
                        shards: Shards::Zero(shards),
                    }))
            }
        }
    }

    fn load_state(&mut self, found: FoundState) -> Result<()> {
        let varmap = self.trainables.varmap.clone();
        match (&mut self.trainables.stepper, found.shards) {
            (Stepper::Whole(opt), shards @ Shards::None) => states::load_whole(
                FoundState {
                    saved: found.saved,
                    shards,
                },
                &varmap,
                opt,
            ),
            (Stepper::Zero(zero), Shards::Zero(shards)) => {
                // The weights first (all or nothing), put back if the
                // shards do not fit.
                let before = snapshot(&varmap)?;
                found.saved.restore(&varmap, None::<&mut O>)?;
                if let Err(e) = zero.load_shards(&shards) {
                    put_back(&before)?;
                    return Err(e);
                }
                Ok(())
            }
            _ => Err(not_this_layout()),
        }
    }
}

/// Copies of `varmap`'s values.
fn snapshot(varmap: &VarMap) -> Result<Vec<(Var, Tensor)>> {
    crate::util::lock::lock(varmap.data())
        .values()
        .map(|var| Ok((var.clone(), var.as_tensor().copy()?)))
        .collect()
}

/// Sets the variables back to `values`.
fn put_back(values: &[(Var, Tensor)]) -> Result<()> {
    for (var, value) in values {
        var.set(value)?;
    }
    Ok(())
}
