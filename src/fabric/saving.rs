//! [`FabricModel::save`] and [`FabricModel::load`]: the whole training
//! state (weights, optimizer, schedule, loss scale, where the run is), in
//! one folder, sharded where the strategy shards and resharded on load to
//! any world size, so that a killed run resumes to the same bytes.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Tensor, Var};
use candle_nn::VarMap;

use super::checkpoints::Checkpoints;
use super::config::Strategy;
use super::engine::Engine;
use super::model::{FabricModel, Stepper};
use crate::checkpoint::Prefix;
use crate::error::{Error, Result};
use crate::lock::lock;
use crate::optim::StatefulOptimizer;
use crate::training_state::{check_ranks_agree, Progress, SamplerState, TrainingState};

/// Where a loaded run continues, and the state it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resumed {
    /// Where the run is: its epoch, the batch within it, its step.
    pub progress: Progress,
    /// The state's folder.
    pub path: PathBuf,
}

impl std::fmt::Display for Resumed {
    /// `resuming from DIR: epoch E, batch B, step S` (the epoch counted
    /// from 1).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "resuming from {}: epoch {}, batch {}, step {}",
            self.path.display(),
            self.progress.epoch + 1,
            self.progress.batch,
            self.progress.step
        )
    }
}

/// Every rank's shards of a state, as its strategy saved them.
enum Shards {
    None,
    Zero(Vec<crate::optim::OptimizerState>),
    Fsdp(Vec<super::checkpoints::FsdpSave>),
}

/// The metadata key naming the strategy that saved a state.
const STRATEGY: &str = "fabric.strategy";
/// The precision policy in words ([`Precision::policy_description`]).
const PRECISION: &str = "fabric.precision";

/// How a strategy's states are laid out: states of one kind load into any
/// strategy of the same kind, on any number of ranks.
fn layout(strategy: Strategy) -> &'static str {
    match strategy {
        Strategy::Zero1 | Strategy::Zero2 => "ZeRO shards",
        Strategy::Fsdp | Strategy::Hsdp => "FSDP shards",
        Strategy::PipelineRanks => "pipeline stages",
        _ => "whole",
    }
}

impl<O: StatefulOptimizer> FabricModel<O> {
    /// Saves the whole training state at `progress` into the configured
    /// `checkpoint_dir` (atomically: a kill leaves the previous states
    /// whole), keeping the newest `keep`: each rank its shard where the
    /// strategy shards (its optimizer state, and FSDP's pieces of the
    /// weights), the rest once. Every rank must call it. Fabric's
    /// `save`, Accelerate's `save_state`.
    ///
    /// # Errors
    ///
    /// No `checkpoint_dir` configured; a call between a step's first
    /// backward and its step (those gradients cannot be saved); the
    /// write's (naming the file). An error on one rank ends the run on
    /// every rank (the launcher fails the group), as any rank's error does.
    pub fn save(&self, progress: Progress) -> Result<()> {
        self.between_steps("save")?;
        let checkpoints = self.checkpoints()?;
        let (lr_scheduler, grad_scaler) = self.order.state();
        let mut state = TrainingState {
            progress,
            sampler: Some(SamplerState {
                seed: self.seed,
                epoch: progress.epoch,
            }),
            lr_scheduler,
            grad_scaler,
            ..Default::default()
        };
        state
            .metadata
            .insert(STRATEGY.into(), self.strategy.name().into());
        state
            .metadata
            .insert(PRECISION.into(), self.precision.policy_description());
        match (&self.engine, &self.stepper) {
            // Each rank of the first pipeline writes its stages, numbered
            // in its pipeline; with ZeRO across the replicas, its stages'
            // state put together from every replica's pieces first.
            (Engine::RankPipeline(pipe), stepper) => {
                let first = pipe.replica_rank() == 0;
                let mine = match stepper {
                    Stepper::Whole(opt) if pipe.is_fsdp() => pipe.fsdp_stage_state(opt)?,
                    Stepper::Whole(opt) => first.then(|| pipe.stage_state(opt)).transpose()?,
                    Stepper::Zero(zero) => pipe.zero_stage_state(zero)?,
                };
                // The other replicas write nothing.
                let (values, stage_state) = mine.unwrap_or_default();
                checkpoints.save_sharded(
                    self.pg.as_ref(),
                    &VarMap::new(),
                    &varmap_of(values)?,
                    stage_state,
                    state,
                    first.then(|| pipe.group().rank()),
                )
            }
            // On a mesh every replica holds the same pieces: the first
            // replica's ranks write them (numbered in their shard group).
            (_, Stepper::Zero(zero)) => checkpoints.save_sharded(
                self.pg.as_ref(),
                &self.varmap,
                &VarMap::new(),
                zero.shard_state()?,
                state,
                (zero.replica_rank() == 0).then(|| zero.shard_rank()),
            ),
            // Under HSDP every replica holds the same pieces: the first
            // replica's ranks write them (numbered in their shard group).
            (Engine::Fsdp(fsdp), Stepper::Whole(opt)) => checkpoints.save_sharded(
                self.pg.as_ref(),
                &VarMap::new(),
                &varmap_of(fsdp.pieces()?)?,
                fsdp.shard_state(opt)?,
                state,
                (fsdp.replica_rank() == 0).then(|| fsdp.shard_rank()),
            ),
            (_, Stepper::Whole(opt)) => {
                // The state is the same on every rank: one writer, and no
                // rank goes on before it is written.
                if self.pg.rank() == 0 {
                    state.optimizer = Some(opt.state()?);
                    checkpoints.save(&self.varmap, &state)?;
                }
                Ok(self.pg.barrier()?)
            }
        }
    }

    /// Resumes from the newest complete state in `checkpoint_dir`: the
    /// weights, the optimizer's state (resharded to this run's ranks where
    /// the strategy shards), the schedule and the loss scale. Returns where
    /// the run continues and the state's folder, `None` when there is no
    /// state (a fresh start).
    /// Every rank must call it. Fabric's `load`, Accelerate's
    /// `load_state`.
    ///
    /// # Errors
    ///
    /// No `checkpoint_dir`; a call between a step's first backward and
    /// its step (the batches back-propagated so far are not in a state);
    /// a state of another layout (sharded by another
    /// strategy), seed, schedule or precision, naming both; states exist
    /// but none is complete; ranks that found different states
    /// ([`Error::ResumeMismatch`]). Nothing is loaded then.
    pub fn load(&mut self) -> Result<Option<Resumed>> {
        self.between_steps("load")?;
        let checkpoints = self.checkpoints()?;
        // The newest state names the strategy that wrote it: another
        // layout is named as such, not as missing shards.
        if let Some(newest) = checkpoints.latest()? {
            check_layout(self, &newest.state, &newest.path)?;
        }
        // What to load is found first, and every rank must have found the
        // same step before anything changes.
        let found = match (&self.engine, &self.stepper) {
            (Engine::Fsdp(_) | Engine::RankPipeline(_), _) => checkpoints
                .latest_fsdp()?
                .map(|(saved, saves)| (saved, Shards::Fsdp(saves))),
            (_, Stepper::Zero(_)) => checkpoints
                .latest_zero()?
                .map(|(saved, shards)| (saved, Shards::Zero(shards))),
            _ => checkpoints.latest()?.map(|saved| (saved, Shards::None)),
        };
        let step = found.as_ref().map(|(saved, _)| saved.state.progress.step);
        check_ranks_agree(self.pg.as_ref(), step)?;
        let Some((saved, shards)) = found else {
            return Ok(None);
        };
        check_layout(self, &saved.state, &saved.path)?;
        // The schedule and the scale first, on copies: a state of another
        // precision or schedule changes nothing.
        self.order.check_resume(
            saved.state.lr_scheduler.as_ref(),
            saved.state.grad_scaler.as_ref(),
        )?;
        match (&mut self.engine, &mut self.stepper, shards) {
            (_, Stepper::Zero(zero), Shards::Zero(shards)) => {
                // The weights first (all or nothing), put back if the
                // shards do not fit.
                let before = snapshot(&self.varmap)?;
                saved.restore(&self.varmap, None::<&mut O>)?;
                if let Err(e) = zero.load_shards(&shards) {
                    put_back(&before)?;
                    return Err(e);
                }
            }
            (Engine::Fsdp(fsdp), Stepper::Whole(opt), Shards::Fsdp(saves)) => {
                let (pieces, states): (Vec<_>, Vec<_>) = saves.into_iter().unzip();
                fsdp.load_resharded(&pieces, &states, opt)?;
            }
            (Engine::RankPipeline(pipe), stepper, Shards::Fsdp(saves)) => {
                let (values, states): (Vec<_>, Vec<_>) = saves.into_iter().unzip();
                match stepper {
                    Stepper::Whole(opt) if pipe.is_fsdp() => {
                        pipe.load_fsdp_stages(&values, &states, opt)?
                    }
                    Stepper::Whole(opt) => pipe.load_stages(&values, &states, opt)?,
                    Stepper::Zero(zero) => pipe.load_zero_stages(&values, &states, zero)?,
                }
            }
            (_, Stepper::Whole(opt), Shards::None) => saved.restore(&self.varmap, Some(opt))?,
            _ => {
                return Err(Error::Fabric(
                    "the state found does not fit this strategy's layout".into(),
                ))
            }
        }
        let (state, path) = (saved.state, saved.path);
        self.order
            .resume(state.lr_scheduler.as_ref(), state.grad_scaler.as_ref())?;
        self.steps = state.progress.step;
        Ok(Some(Resumed {
            progress: state.progress,
            path,
        }))
    }

    /// Writes the whole model's weights to one safetensors file at `path`
    /// on rank 0 (FSDP gathers them: every rank must call it), loadable
    /// with [`checkpoint::load`](crate::checkpoint::load) into any
    /// strategy's model or plain candle: Fabric's full state dict export.
    ///
    /// # Errors
    ///
    /// The gathering's, the write's (naming the file).
    pub fn save_full(&self, path: impl AsRef<Path>) -> Result<()> {
        let whole = self.full_varmap()?;
        if self.pg.rank() == 0 {
            crate::checkpoint::save(&whole, path, Prefix::None)?;
        }
        Ok(self.pg.barrier()?)
    }

    /// [`load`](Self::load) when `resume` is set (a fresh start
    /// otherwise), then says on rank 0, on standard error, where the run
    /// continues (`resuming from DIR: epoch E, batch B, step S`) or that
    /// there is no state (`no complete training state in DIR: starting
    /// from scratch`). Where the run starts. Every rank must call it.
    ///
    /// # Errors
    ///
    /// As [`load`](Self::load).
    pub fn resume(&mut self, resume: bool) -> Result<Progress> {
        if !resume {
            return Ok(Progress::default());
        }
        let resumed = self.load()?;
        if self.pg.rank() == 0 {
            match &resumed {
                Some(resumed) => eprintln!("{resumed}"),
                None => eprintln!(
                    "no complete training state in {}: starting from scratch",
                    self.checkpoints()?.path().display()
                ),
            }
        }
        Ok(resumed.map(|r| r.progress).unwrap_or_default())
    }

    /// The whole model's weights as a `VarMap` (FSDP gathers them: every
    /// rank must call it), to build a model over for evaluation or export.
    pub fn full_varmap(&self) -> Result<VarMap> {
        varmap_of(self.full_state()?)
    }

    fn checkpoints(&self) -> Result<Checkpoints> {
        let dir: &PathBuf = self.checkpoint_dir.as_ref().ok_or_else(|| {
            Error::Fabric(
                "no checkpoint_dir configured: set FabricConfig::checkpoint_dir \
                 (--checkpoint-dir) to save or load"
                    .into(),
            )
        })?;
        Checkpoints::new(dir, self.keep)
    }
}

/// Refuses a state another strategy's layout or another seed wrote.
fn check_layout<O>(model: &FabricModel<O>, state: &TrainingState, path: &Path) -> Result<()> {
    let (strategy, seed) = (model.strategy, model.seed);
    if let Some(saved) = state.metadata.get(STRATEGY) {
        let saved: Strategy = saved.parse()?;
        if layout(saved) != layout(strategy) {
            return Err(Error::Checkpoint(format!(
                "{}: saved by strategy {saved} ({}), which strategy {strategy} ({}) cannot load: \
                 resume with {saved}, or export it with save_full and start from its weights",
                path.display(),
                layout(saved),
                layout(strategy)
            )));
        }
    }
    if let Some(sampler) = state.sampler {
        if sampler.seed != seed {
            return Err(Error::Checkpoint(format!(
                "{}: saved by a run of seed {}, this run's is {seed}: its data order would differ",
                path.display(),
                sampler.seed
            )));
        }
    }
    // The masters are f32 under every precision, but the optimizer's
    // moments, the loss scale and the path of the weights so far belong
    // to the policy that wrote them: resuming under another is another run.
    // (States written before the policy was recorded have none to compare.)
    // The policy's name is compared (its words may be reworded); both
    // policies are named in full.
    let ours = model.precision.policy_description();
    if let Some(saved) = state.metadata.get(PRECISION) {
        let saved_name = saved.split(':').next().unwrap_or(saved);
        if saved_name != model.precision.name() {
            return Err(Error::Checkpoint(format!(
                "{}: saved under precision {saved}; this run's is {ours}: resume with precision \
                 {saved_name}, or export it with save_full and start from its weights",
                path.display(),
            )));
        }
    }
    Ok(())
}

/// Copies of `varmap`'s values.
fn snapshot(varmap: &VarMap) -> Result<Vec<(Var, Tensor)>> {
    lock(varmap.data())
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

/// A `VarMap` holding `tensors`.
fn varmap_of(tensors: HashMap<String, Tensor>) -> Result<VarMap> {
    let varmap = VarMap::new();
    {
        let mut data = lock(varmap.data());
        for (name, tensor) in tensors {
            data.insert(name, Var::from_tensor(&tensor)?);
        }
    }
    Ok(varmap)
}
