//! `pipeline-ranks`: a pipeline whose stages live on ranks
//! ([`RankPipeline`]), replicated over the rest of a `dp` x `pp` mesh,
//! its replicas plain data-parallel, ZeRO (1, 2) or FSDP (3) across them.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use candle_nn::VarMap;

use super::states::{self, not_this_layout};
use super::trainables::Stepper;
use super::{
    varmap_of, Engine, EngineSetup, EngineStep, FoundState, LossFn, Memory, Shards, StateStore,
    Trainables,
};
use crate::comm::ProcessGroup;
use crate::ddp::ZeroStage;
use crate::error::Result;
use crate::fabric::mesh_aliases::DATA_DIMS;
use crate::optim::clip::AlsoAcross;
use crate::optim::{Clipped, StatefulOptimizer};
use crate::pipeline::{RankPipeline, RankPipelineConfig};
use crate::saving::training_state::TrainingState;
use crate::step::LossReduction;

/// `pipeline-ranks`' engine: this rank's stages.
pub(super) struct PipelineRanks<O> {
    pipe: Box<RankPipeline>,
    /// This rank's stages' variables and buffers (the others, built only
    /// to draw the seeded initial values, are dropped).
    trainables: Trainables<O>,
}

impl<O: StatefulOptimizer> PipelineRanks<O> {
    pub(super) fn build<F>(setup: &EngineSetup<'_>, make: F) -> Result<Self>
    where
        F: FnOnce(Vec<(String, Var)>) -> candle_core::Result<O>,
    {
        let config = setup.config;
        // Pipelines of consecutive ranks (a machine's, when the launcher
        // numbers them so), their replicas (HSDP's two dimensions, for
        // FSDP in groups of them) one dimension across them.
        let mesh = setup
            .mesh
            .sub_mesh(&DATA_DIMS)?
            .flatten(&["dp_replicate", "dp_shard"], "dp")?;
        let pipe_config = RankPipelineConfig {
            chunks: config.chunks,
            schedule: config.pipeline_schedule,
            checkpoint: config.activation_checkpoint,
            mixed_precision: config.precision.policy(),
            zero: match config.zero {
                Some(1) => Some(ZeroStage::One),
                Some(2 | 3) => Some(ZeroStage::Two),
                _ => None,
            },
            fsdp: config.zero == Some(3),
            // HSDP across the replicas: FSDP within groups of them.
            shard_size: config.shard_size.filter(|_| config.zero == Some(3)),
            ..RankPipelineConfig::default()
        };
        let pipe = RankPipeline::on_mesh(
            &mesh,
            ("pp", "dp"),
            setup.varmap,
            DType::F32,
            setup.device(),
            setup.module.parts().to_vec(),
            pipe_config,
        )?;
        let varmap = VarMap::new();
        {
            let mut data = crate::util::lock::lock(varmap.data());
            for (name, var) in pipe.variables().iter().chain(pipe.buffers()) {
                data.insert(name.clone(), var.clone());
            }
        }
        // FSDP's pieces are the variables: any optimizer steps them.
        let trainables = match pipe.zero_stage().is_some() && !pipe.is_fsdp() {
            true => Trainables::zero(varmap, pipe.zero_optimizer(make)?),
            false => Trainables::build(varmap, pipe.variables().to_vec(), make)?,
        };
        Ok(Self {
            pipe: Box::new(pipe),
            trainables,
        })
    }
}

impl<O: StatefulOptimizer + 'static> Engine<O> for PipelineRanks<O> {
    fn name(&self) -> &str {
        "pipeline-ranks"
    }

    fn forward_backward(
        &mut self,
        x: &Tensor,
        y: &Tensor,
        factor: f64,
        _sync: bool,
        loss_fn: &LossFn,
    ) -> Result<EngineStep> {
        // Every rank of a pipeline has the batch; the first stage reads
        // the input, the last the targets. The loss (the replicas' mean on
        // a mesh) then goes to every rank.
        let scaled = super::scaled(loss_fn, factor);
        let step = self
            .pipe
            .forward_backward(Some(x), Some(y), LossReduction::Mean, scaled)?;
        let loss = self.pipe.from_last_stage(step.loss.as_ref())?;
        Ok(EngineStep {
            loss: loss.affine(1.0 / factor, 0.0)?,
            grads: Some(step.grads),
        })
    }

    fn forward(&mut self, x: &Tensor) -> Result<Tensor> {
        let out = self.pipe.forward_t(Some(x), false)?;
        self.pipe.from_last_stage(out.as_ref())
    }

    fn trainables(&self) -> &Trainables<O> {
        &self.trainables
    }

    fn trainables_mut(&mut self) -> &mut Trainables<O> {
        &mut self.trainables
    }

    fn shards(&self) -> bool {
        true
    }

    fn clip(&self, grads: &mut GradStore, max_norm: f64) -> Result<Clipped> {
        match &self.trainables.stepper {
            Stepper::Zero(zero) => zero.clip_grad_norm(grads, max_norm, 2.0, false),
            Stepper::Whole(_) => self.pipe.clip_grad_norm(grads, max_norm, 2.0, false),
        }
    }

    fn clip_tensor_parallel(
        &self,
        grads: &mut GradStore,
        max_norm: f64,
        tp: &dyn ProcessGroup,
        counted: &dyn Fn(&str) -> bool,
    ) -> Result<Clipped> {
        let also = Some(AlsoAcross { group: tp, counted });
        match &self.trainables.stepper {
            Stepper::Zero(zero) => zero.clip_grad_norm_also(grads, max_norm, 2.0, false, also),
            Stepper::Whole(_) => self
                .pipe
                .clip_grad_norm_also(grads, max_norm, 2.0, false, also),
        }
    }

    fn full_state(&self) -> Result<HashMap<String, Tensor>> {
        self.pipe.full_state()
    }

    fn memory(&self) -> Result<Memory> {
        Ok(Memory {
            peak_gathered: self.pipe.is_fsdp().then(|| self.pipe.stage_bytes()),
            ..self.trainables.memory()?
        })
    }

    fn save(&self, store: &StateStore<'_>, state: TrainingState) -> Result<()> {
        // Each rank of the first pipeline writes its stages, numbered in
        // its pipeline; with ZeRO across the replicas, its stages' state
        // put together from every replica's pieces first.
        let pipe = &self.pipe;
        let first = pipe.replica_rank() == 0;
        let mine = match &self.trainables.stepper {
            Stepper::Whole(opt) if pipe.is_fsdp() => pipe.fsdp_stage_state(opt)?,
            Stepper::Whole(opt) => first.then(|| pipe.stage_state(opt)).transpose()?,
            Stepper::Zero(zero) => pipe.zero_stage_state(zero)?,
        };
        // The other replicas write nothing.
        let (values, stage_state) = mine.unwrap_or_default();
        store.checkpoints.save_sharded(
            store.pg,
            &VarMap::new(),
            &varmap_of(values)?,
            stage_state,
            state,
            first.then(|| pipe.group().rank()),
        )
    }

    fn find_state(&self, store: &StateStore<'_>) -> Result<Option<FoundState>> {
        states::find_fsdp_layout(store)
    }

    fn load_state(&mut self, found: FoundState) -> Result<()> {
        let Shards::Fsdp(saves) = found.shards else {
            return Err(not_this_layout());
        };
        let (values, states): (Vec<_>, Vec<_>) = saves.into_iter().unzip();
        let pipe = &mut self.pipe;
        match &mut self.trainables.stepper {
            Stepper::Whole(opt) if pipe.is_fsdp() => pipe.load_fsdp_stages(&values, &states, opt),
            Stepper::Whole(opt) => pipe.load_stages(&values, &states, opt),
            Stepper::Zero(zero) => pipe.load_zero_stages(&values, &states, zero),
        }
    }
}
