//! Whole-run checkpoints for the examples: when to save a training state,
//! and where a resumed run continues.

use std::path::PathBuf;

use anyhow::{Context, Result};
use candle_dp::comm::{all_gather_object, ProcessGroup};
use candle_dp::optim::{GradScalerState, LrSchedulerState, OptimizerState, StatefulOptimizer};
use candle_dp::training_state::{Progress, SamplerState, SavedState, StateDir, TrainingState};
use candle_dp::zero::ZeroOptimizer;
use candle_nn::VarMap;

/// The learning-rate schedule's and the loss scaler's positions, when the
/// run has them.
pub type Recipe = (Option<LrSchedulerState>, Option<GradScalerState>);

/// Where the states of the run go, and when.
pub struct Checkpoints {
    states: StateDir,
    keep: usize,
    every: Option<u64>,
    /// Whether the run continues from the newest state.
    pub resume: bool,
}

impl Checkpoints {
    /// The states in `dir` (if given), the newest `keep` kept, saved
    /// every `every` steps or at the end of every epoch.
    pub fn new(
        dir: Option<&std::path::Path>,
        every: Option<u64>,
        keep: usize,
        resume: bool,
    ) -> Result<Option<Checkpoints>> {
        let Some(dir) = dir else {
            return Ok(None);
        };
        Ok(Some(Checkpoints {
            states: StateDir::new(dir)?.keep(keep),
            keep,
            every,
            resume,
        }))
    }

    /// Restores the newest state into `varmap` and `opt` when resuming, and
    /// returns it (where the run continues, the sampler's position, the
    /// schedule's and the scaler's). `None`: a fresh start.
    pub fn resume<O: StatefulOptimizer>(
        &self,
        varmap: &VarMap,
        opt: &mut O,
        speaks: bool,
    ) -> Result<Option<TrainingState>> {
        self.resume_with(varmap, Some(opt), speaks)
    }

    /// [`resume`](Self::resume), the optimizer's state restored only when
    /// one is given (`None`: the model's variables only, as for a sharded
    /// optimizer whose state is restored from its shards).
    pub fn resume_with<O: StatefulOptimizer>(
        &self,
        varmap: &VarMap,
        opt: Option<&mut O>,
        speaks: bool,
    ) -> Result<Option<TrainingState>> {
        if !self.resume {
            return Ok(None);
        }
        let Some(saved) = self.states.latest()? else {
            self.say_fresh_start(speaks);
            return Ok(None);
        };
        saved.restore(varmap, opt)?;
        say_resuming(&saved, speaks);
        Ok(Some(saved.state))
    }

    #[allow(dead_code)] // for the ZeRO runs: the pipeline example does not use it
    /// Saves a ZeRO run's state at `progress` (every rank must call it):
    /// each rank its shard of the optimizer's state, then (after a
    /// barrier) rank 0 the state that names the step, then (after another)
    /// every rank prunes its shards to the steps the kept states name.
    #[allow(clippy::too_many_arguments)]
    pub fn save_zero<O: StatefulOptimizer>(
        &self,
        pg: &dyn ProcessGroup,
        varmap: &VarMap,
        zero: &ZeroOptimizer<O>,
        progress: Progress,
        sampler: Option<SamplerState>,
        recipe: Recipe,
    ) -> Result<()> {
        let shard = zero.shard_state()?;
        self.save_sharded(pg, varmap, &VarMap::new(), shard, progress, sampler, recipe)
    }

    #[allow(dead_code)] // for the sharded runs: the pipeline example does not use it
    /// Saves a sharded run's state at `progress` (every rank must call
    /// it): each rank its shard (`shard_vars`, its pieces of the model if
    /// any, and `shard`, its optimizer's state, which records its rank and
    /// the world size), then (after a barrier) rank 0 the state that names
    /// the step with `varmap`'s variables, then every rank prunes its
    /// shards to the steps the kept states name.
    #[allow(clippy::too_many_arguments)]
    pub fn save_sharded(
        &self,
        pg: &dyn ProcessGroup,
        varmap: &VarMap,
        shard_vars: &VarMap,
        shard: OptimizerState,
        progress: Progress,
        sampler: Option<SamplerState>,
        recipe: Recipe,
    ) -> Result<()> {
        let rank = pg.rank();
        let shard = TrainingState {
            progress,
            optimizer: Some(shard),
            ..Default::default()
        };
        self.zero_shard_states(rank)?.save(shard_vars, &shard)?;
        pg.barrier()?;
        // Rank 0 writes the state, then tells every rank which steps the
        // kept states name (from its own listing: another rank's view of
        // the folder may lag, as over NFS, or be another folder).
        let named = if rank == 0 {
            self.save(varmap, None, progress, sampler, recipe)?;
            self.states.steps()?
        } else {
            Vec::new()
        };
        let mut wanted = all_gather_object(pg, &named)?.swap_remove(0);
        wanted.push(progress.step);
        self.prune_zero_shards(rank, &wanted);
        Ok(())
    }

    #[allow(dead_code)] // for the FSDP runs
    /// For an FSDP run, when resuming: the newest state whose every rank's
    /// shard is there, with every rank's pieces and optimizer state (of
    /// any world size: `load_resharded` takes this rank's). `None`: a
    /// fresh start.
    ///
    /// # Errors
    ///
    /// States exist but none has its shards, as for ZeRO.
    pub fn resume_fsdp(&self, speaks: bool) -> Result<Option<(TrainingState, Vec<FsdpSave>)>> {
        if !self.resume {
            return Ok(None);
        }
        let Some((saved, shards)) =
            self.newest_with_shards("FSDP", speaks, |step| self.fsdp_shards_at(step))?
        else {
            return Ok(None);
        };
        say_resuming(&saved, speaks);
        Ok(Some((saved.state, shards)))
    }

    /// The newest state whose every rank's shard `shards_at` finds (a
    /// kill between the shards and the state that names them can leave the
    /// newest without some), with them. `None` (said): no state at all, a
    /// fresh start.
    ///
    /// # Errors
    ///
    /// States exist but none has its shards (`what`'s): the run would lose
    /// them all, so it is refused, naming the folder.
    fn newest_with_shards<T>(
        &self,
        what: &str,
        speaks: bool,
        shards_at: impl Fn(u64) -> Result<T>,
    ) -> Result<Option<(SavedState, T)>> {
        let mut shards = None;
        let chosen =
            self.states
                .latest_where(|saved| match shards_at(saved.state.progress.step) {
                    Ok(found) => {
                        shards = Some(found);
                        true
                    }
                    Err(why) => {
                        if speaks {
                            eprintln!(
                                "{}: {why}; trying the state before it",
                                saved.path.display()
                            );
                        }
                        false
                    }
                })?;
        let (Some(saved), Some(shards)) = (chosen, shards) else {
            if self.states.latest()?.is_some() {
                anyhow::bail!(
                    "{}: no training state has every rank's {what} shard; refusing to start over",
                    self.states.path().display()
                );
            }
            self.say_fresh_start(speaks);
            return Ok(None);
        };
        Ok(Some((saved, shards)))
    }

    /// Every rank's FSDP shard saved at `step`: its pieces and its
    /// optimizer's state, in rank order.
    fn fsdp_shards_at(&self, step: u64) -> Result<Vec<FsdpSave>> {
        let shard = |rank: usize| -> Result<FsdpSave> {
            let dir = self.zero_shard_dir(rank);
            let saved = StateDir::new(&dir)?.at_step(step)?.with_context(|| {
                format!("{}: no FSDP shard saved at step {step}", dir.display())
            })?;
            let pieces = candle_core::safetensors::load(
                saved.path.join("model.safetensors"),
                &candle_core::Device::Cpu,
            )?;
            let state = saved
                .state
                .optimizer
                .with_context(|| format!("{}: no optimizer state", saved.path.display()))?;
            Ok((pieces, state))
        };
        let first = shard(0)?;
        let world = first
            .1
            .shard
            .context("the FSDP shard of rank 0 does not record how many shards its step has")?
            .world_size;
        std::iter::once(Ok(first))
            .chain((1..world).map(shard))
            .collect()
    }

    #[allow(dead_code)] // for the ZeRO runs: the pipeline example does not use it
    /// Rank `rank`'s folder of ZeRO shards: never pruned by count, see
    /// [`prune_zero_shards`](Self::prune_zero_shards).
    pub fn zero_shard_states(&self, rank: usize) -> Result<StateDir> {
        Ok(StateDir::new(self.zero_shard_dir(rank))?.keep(usize::MAX))
    }

    /// Removes rank `rank`'s shards of steps other than `wanted` (the
    /// steps the kept states name, and the one just saved), so that no
    /// shard a kept state needs is ever lost. A failure only warns, as the
    /// pruning of states does: the save itself succeeded.
    fn prune_zero_shards(&self, rank: usize, wanted: &[u64]) {
        let pruned = self
            .zero_shard_states(rank)
            .and_then(|dir| Ok(dir.retain_steps(|step| wanted.contains(&step))?));
        if let Err(e) = pruned {
            eprintln!("rank {rank}: could not prune old ZeRO shards: {e}");
        }
    }

    #[allow(dead_code)] // for the ZeRO runs: the pipeline example does not use it
    /// For a ZeRO run, when resuming: the newest state whose every rank's
    /// shard is there (a kill between the shards and the state that names
    /// them can leave the newest state without some), its variables put
    /// into `varmap`, with the shards to load. `None`: a fresh start.
    ///
    /// # Errors
    ///
    /// States exist but none has its shards: the run would lose them all,
    /// so it is refused, naming the folder.
    pub fn resume_sharded(
        &self,
        varmap: &VarMap,
        speaks: bool,
    ) -> Result<Option<(TrainingState, Vec<OptimizerState>)>> {
        if !self.resume {
            return Ok(None);
        }
        let Some((saved, shards)) =
            self.newest_with_shards("ZeRO", speaks, |step| self.zero_shards_at(step))?
        else {
            return Ok(None);
        };
        saved.restore(varmap, None::<&mut candle_dp::optim::AdamW>)?;
        say_resuming(&saved, speaks);
        Ok(Some((saved.state, shards)))
    }

    fn say_fresh_start(&self, speaks: bool) {
        if speaks {
            eprintln!(
                "no complete training state in {}: starting from scratch",
                self.states.path().display()
            );
        }
    }

    /// After the step that left the run at `progress` (`batches` in its
    /// epoch): saves a state when one is due.
    pub fn after_step<O: StatefulOptimizer>(
        &self,
        varmap: &VarMap,
        opt: &O,
        progress: Progress,
        batches: u64,
        sampler: Option<SamplerState>,
        recipe: Recipe,
    ) -> Result<()> {
        if let Some(progress) = self.due(progress, batches) {
            self.save(varmap, Some(opt.state()?), progress, sampler, recipe)?;
        }
        Ok(())
    }

    /// Whether a state is due after the step that left the run at
    /// `progress`, and the progress to save then (a state at the end of
    /// an epoch continues with the next one).
    pub fn due(&self, progress: Progress, batches: u64) -> Option<Progress> {
        let end_of_epoch = progress.batch >= batches;
        let due = match self.every {
            Some(n) => progress.step.is_multiple_of(n),
            None => end_of_epoch,
        };
        if !due {
            return None;
        }
        Some(if end_of_epoch {
            Progress {
                epoch: progress.epoch + 1,
                batch: 0,
                step: progress.step,
            }
        } else {
            progress
        })
    }

    /// Saves a state of the run at `progress`.
    pub fn save(
        &self,
        varmap: &VarMap,
        optimizer: Option<OptimizerState>,
        progress: Progress,
        sampler: Option<SamplerState>,
        (lr_scheduler, grad_scaler): Recipe,
    ) -> Result<()> {
        let state = TrainingState {
            progress,
            optimizer,
            sampler,
            lr_scheduler,
            grad_scaler,
            ..Default::default()
        };
        self.states.save(varmap, &state)?;
        Ok(())
    }

    #[allow(dead_code)] // for the ZeRO runs: the pipeline example does not use it
    /// The folder of the states.
    pub fn path(&self) -> &std::path::Path {
        self.states.path()
    }

    #[allow(dead_code)] // for the ZeRO runs: the pipeline example does not use it
    /// Where rank `rank` of a ZeRO run keeps its shards of the optimizer's
    /// state, inside the checkpoint directory.
    pub fn zero_shard_dir(&self, rank: usize) -> PathBuf {
        self.path().join("zero-shards").join(format!("rank-{rank}"))
    }

    #[allow(dead_code)] // for the ZeRO runs: the pipeline example does not use it
    /// Every rank's shard saved at `step` (by however many ranks the run
    /// that saved them had: each shard records it), for
    /// `ZeroOptimizer::load_shards`, which checks that the set is complete.
    pub fn zero_shards_at(&self, step: u64) -> Result<Vec<OptimizerState>> {
        let shard = |rank: usize| -> Result<OptimizerState> {
            let dir = self.zero_shard_dir(rank);
            StateDir::new(&dir)?
                .at_step(step)?
                .and_then(|saved| saved.state.optimizer)
                .with_context(|| format!("{}: no ZeRO shard saved at step {step}", dir.display()))
        };
        let first = shard(0)?;
        let world = first
            .shard
            .context("the ZeRO shard of rank 0 does not record how many shards its step has")?
            .world_size;
        std::iter::once(Ok(first))
            .chain((1..world).map(shard))
            .collect()
    }

    #[allow(dead_code)] // for the ZeRO runs: the pipeline example does not use it
    /// How many states are kept.
    pub fn keep(&self) -> usize {
        self.keep
    }
}

/// One rank's FSDP save: its pieces of the model and its optimizer's state.
pub type FsdpSave = (
    std::collections::HashMap<String, candle_core::Tensor>,
    OptimizerState,
);

/// Where a resumed run continues, said once.
fn say_resuming(saved: &SavedState, speaks: bool) {
    let p = saved.state.progress;
    if speaks {
        eprintln!(
            "resuming from {}: epoch {}, batch {}, step {}",
            saved.path.display(),
            p.epoch + 1,
            p.batch,
            p.step
        );
    }
}
