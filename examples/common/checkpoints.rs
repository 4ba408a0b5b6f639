//! Whole-run checkpoints for the examples: when to save a training state,
//! and where a resumed run continues.

use anyhow::Result;
use candle_dp::optim::StatefulOptimizer;
use candle_dp::training_state::{Progress, SamplerState, StateDir, TrainingState};
use candle_nn::VarMap;

/// Where the states of the run go, and when.
pub struct Checkpoints {
    states: StateDir,
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
            every,
            resume,
        }))
    }

    /// Restores the newest state into `varmap` and `opt` when resuming, and
    /// says where the run continues (the start for a fresh run).
    /// `None`: a fresh start.
    pub fn resume<O: StatefulOptimizer>(
        &self,
        varmap: &VarMap,
        opt: &mut O,
        speaks: bool,
    ) -> Result<Option<(Progress, Option<SamplerState>)>> {
        if !self.resume {
            return Ok(None);
        }
        let Some(saved) = self.states.latest()? else {
            if speaks {
                eprintln!(
                    "no complete training state in {}: starting from scratch",
                    self.states.path().display()
                );
            }
            return Ok(None);
        };
        saved.restore(varmap, Some(opt))?;
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
        Ok(Some((p, saved.state.sampler)))
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
    ) -> Result<()> {
        let end_of_epoch = progress.batch >= batches;
        let due = match self.every {
            Some(n) => progress.step.is_multiple_of(n),
            None => end_of_epoch,
        };
        if !due {
            return Ok(());
        }
        // A state at the end of an epoch continues with the next one.
        let progress = if end_of_epoch {
            Progress {
                epoch: progress.epoch + 1,
                batch: 0,
                step: progress.step,
            }
        } else {
            progress
        };
        let state = TrainingState {
            progress,
            optimizer: Some(opt.state()?),
            sampler,
            ..Default::default()
        };
        self.states.save(varmap, &state)?;
        Ok(())
    }
}
