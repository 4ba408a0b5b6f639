//! [`FabricModel::save`] and [`FabricModel::load`]: the whole training
//! state (weights, optimizer, schedule, loss scale, where the run is), in
//! one folder, sharded where the strategy shards and resharded on load to
//! any world size, so that a killed run resumes to the same bytes.

use std::path::{Path, PathBuf};

use candle_nn::VarMap;

use super::config::Strategy;
use super::model::FabricModel;
use super::strategies::StateStore;
use crate::error::{Error, Result};
use crate::optim::StatefulOptimizer;
use crate::saving::checkpoint::Prefix;
use crate::saving::sharded::Checkpoints;
use crate::saving::training_state::{check_ranks_agree, Progress, SamplerState, TrainingState};

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

/// The metadata key naming the strategy that saved a state.
const STRATEGY: &str = "fabric.strategy";
/// The precision policy in words ([`Precision::policy_description`]).
const PRECISION: &str = "fabric.precision";
/// The state's layout (whole, ZeRO's or FSDP's shards, a pipeline's
/// stages), which a strategy beside tensor parallelism does not tell.
const LAYOUT: &str = "fabric.layout";

impl<O: StatefulOptimizer> FabricModel<O> {
    /// How this run's states lie: the engine's say, or its strategy's.
    fn state_layout(&self) -> &'static str {
        self.engine
            .state_layout()
            .unwrap_or_else(|| self.strategy.state_layout())
    }

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
        state
            .metadata
            .insert(LAYOUT.into(), self.state_layout().into());
        let store = StateStore {
            checkpoints: &checkpoints,
            pg: self.pg.as_ref(),
        };
        self.engine.save(&store, state)
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
        let store = StateStore {
            checkpoints: &checkpoints,
            pg: self.pg.as_ref(),
        };
        let found = self.engine.find_state(&store)?;
        let step = found.as_ref().map(|found| found.saved.state.progress.step);
        check_ranks_agree(self.pg.as_ref(), step)?;
        let Some(found) = found else {
            return Ok(None);
        };
        check_layout(self, &found.saved.state, &found.saved.path)?;
        // The schedule and the scale first, on copies: a state of another
        // precision or schedule changes nothing.
        self.order.check_resume(
            found.saved.state.lr_scheduler.as_ref(),
            found.saved.state.grad_scaler.as_ref(),
        )?;
        let (state, path) = (found.saved.state.clone(), found.saved.path.clone());
        self.engine.load_state(found)?;
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
            crate::saving::checkpoint::save(&whole, path, Prefix::None)?;
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
        super::strategies::varmap_of(self.full_state()?)
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
fn check_layout<O: StatefulOptimizer>(
    model: &FabricModel<O>,
    state: &TrainingState,
    path: &Path,
) -> Result<()> {
    let (strategy, seed) = (model.strategy, model.seed);
    if let Some(saved) = state.metadata.get(STRATEGY) {
        let saved: Strategy = saved.parse()?;
        // States written before the layout was recorded: the strategy's.
        let layout = state
            .metadata
            .get(LAYOUT)
            .map_or(saved.state_layout(), String::as_str);
        let ours = model.state_layout();
        if layout != ours {
            return Err(Error::Checkpoint(format!(
                "{}: saved by strategy {saved} ({layout}), which strategy {strategy} ({ours}) \
                 cannot load: resume with {saved}, or export it with save_full and start from \
                 its weights",
                path.display(),
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
