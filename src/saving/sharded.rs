//! Where a `FabricModel` saves its run, and from
//! which state it resumes: one [`StateDir`] for the states (written once,
//! by rank 0) and, for the strategies that shard, a folder per rank of its
//! shards (`zero-shards/rank-N`), the layout the examples have always
//! written. A state counts only when every rank's shard of its step is
//! there (a kill between the shards and the state can leave the newest
//! without some), and the shards of a run of any world size load
//! (resharded).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use candle_nn::VarMap;

use crate::comm::{all_gather_object, ProcessGroup};
use crate::error::{Error, Result};
use crate::optim::OptimizerState;
use crate::saving::training_state::{SavedState, StateDir, TrainingState};

/// One rank's FSDP save: its pieces of the model and its optimizer's state.
pub(crate) type FsdpSave = (HashMap<String, Tensor>, OptimizerState);

/// The states of a run in one folder.
#[derive(Debug, Clone)]
pub(crate) struct Checkpoints {
    states: StateDir,
}

impl Checkpoints {
    /// The states in `dir`, the newest `keep` kept.
    pub(crate) fn new(dir: &Path, keep: usize) -> Result<Self> {
        Ok(Self {
            states: StateDir::new(dir)?.keep(keep),
        })
    }

    /// The folder.
    pub(crate) fn path(&self) -> &Path {
        self.states.path()
    }

    /// Saves a replicated run's `state` with `varmap`'s variables (one
    /// writer: call it on rank 0).
    pub(crate) fn save(&self, varmap: &VarMap, state: &TrainingState) -> Result<PathBuf> {
        self.states.save(varmap, state)
    }

    /// The newest complete state, or `None`.
    pub(crate) fn latest(&self) -> Result<Option<SavedState>> {
        self.states.latest()
    }

    /// Saves a sharded run's state (every rank calls it): each rank that
    /// writes a shard (`writes_shard`: its number, `None` for a rank whose
    /// shard another rank writes, an HSDP or pipeline replica's) writes
    /// `pieces`, its part of the model if any, and `shard`, its optimizer's
    /// state recording that number and how many shards there are; then,
    /// after a barrier, rank 0 the state that names the step with
    /// `varmap`'s variables; then every rank prunes its shards to the steps
    /// the kept states name.
    pub(crate) fn save_sharded(
        &self,
        pg: &dyn ProcessGroup,
        varmap: &VarMap,
        pieces: &VarMap,
        shard: OptimizerState,
        state: TrainingState,
        writes_shard: Option<usize>,
    ) -> Result<()> {
        let rank = pg.rank();
        let step = state.progress.step;
        let shards = shard.shard.map(|s| s.world_size);
        let mine = TrainingState {
            progress: state.progress,
            optimizer: Some(shard),
            ..Default::default()
        };
        if let Some(number) = writes_shard {
            self.shard_states(number)?.save(pieces, &mine)?;
        }
        pg.barrier()?;
        // Rank 0 writes the state, then tells every rank which steps the
        // kept states name (from its own listing: another rank's view of
        // the folder may lag, as over NFS).
        let named = if rank == 0 {
            self.states.save(varmap, &state)?;
            self.states.steps()?
        } else {
            Vec::new()
        };
        let mut wanted = all_gather_object(pg, &named)?.swap_remove(0);
        wanted.push(step);
        // A failed pruning only costs disk: the save itself succeeded.
        if let Some(Ok(dir)) = writes_shard.map(|number| self.shard_states(number)) {
            if let Err(e) = dir.retain_steps(|s| wanted.contains(&s)) {
                tracing::warn!("rank {rank}: could not prune old shards: {e}");
            }
        }
        // The folders of shard numbers this run does not write (a run of
        // more ranks resumed on fewer): rank 0 prunes them alike, or they
        // would keep their steps for ever.
        if let (0, Some(shards)) = (rank, shards) {
            if let Err(e) = self.prune_numbers_from(shards, &wanted) {
                tracing::warn!("rank 0: could not prune the shards of earlier runs: {e}");
            }
        }
        Ok(())
    }

    /// Prunes the folders of shard numbers `from` and up to the steps in
    /// `wanted`, and removes those left empty.
    fn prune_numbers_from(&self, from: usize, wanted: &[u64]) -> Result<()> {
        let root = self.path().join("zero-shards");
        let Ok(entries) = std::fs::read_dir(&root) else {
            return Ok(());
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let number = name
                .to_str()
                .and_then(|n| n.strip_prefix("rank-"))
                .and_then(|n| n.parse::<usize>().ok());
            if number.is_none_or(|n| n < from) {
                continue;
            }
            // One folder that cannot be pruned does not stop the others.
            let pruned = StateDir::new(entry.path()).and_then(|dir| {
                let dir = dir.keep(usize::MAX);
                dir.retain_steps(|s| wanted.contains(&s))?;
                dir.steps()
            });
            match pruned {
                // Only an empty folder goes: anything else in it stays.
                Ok(left) if left.is_empty() => {
                    let _ = std::fs::remove_dir(entry.path());
                }
                Ok(_) => {}
                Err(e) => tracing::warn!("{}: {e}", entry.path().display()),
            }
        }
        Ok(())
    }

    /// Rank `rank`'s folder of shards (never pruned by count: by the steps
    /// the kept states name).
    fn shard_states(&self, rank: usize) -> Result<StateDir> {
        Ok(StateDir::new(self.shard_dir(rank))?.keep(usize::MAX))
    }

    fn shard_dir(&self, rank: usize) -> PathBuf {
        self.path().join("zero-shards").join(format!("rank-{rank}"))
    }

    /// The newest state whose every rank's ZeRO shard is there, with them.
    pub(crate) fn latest_zero(&self) -> Result<Option<(SavedState, Vec<OptimizerState>)>> {
        self.newest_with_shards("ZeRO", |step| {
            self.shards_at(step, |saved| {
                saved.state.optimizer.ok_or_else(|| missing(&saved.path))
            })
        })
    }

    /// The newest state whose every rank's FSDP shard is there, with
    /// every rank's pieces and optimizer state.
    pub(crate) fn latest_fsdp(&self) -> Result<Option<(SavedState, Vec<FsdpSave>)>> {
        self.newest_with_shards("FSDP", |step| {
            self.shards_at(step, |saved| {
                let pieces = candle_core::safetensors::load(
                    saved.path.join("model.safetensors"),
                    &Device::Cpu,
                )?;
                let state = saved.state.optimizer.ok_or_else(|| missing(&saved.path))?;
                Ok((pieces, state))
            })
        })
    }

    /// Every rank's shard saved at `step`, in rank order, as many as rank
    /// 0's records.
    fn shards_at<T>(&self, step: u64, read: impl Fn(SavedState) -> Result<T>) -> Result<Vec<T>> {
        let shard = |rank: usize| -> Result<(T, Option<usize>)> {
            let dir = self.shard_dir(rank);
            let saved = StateDir::new(&dir)?.at_step(step)?.ok_or_else(|| {
                Error::Checkpoint(format!("{}: no shard saved at step {step}", dir.display()))
            })?;
            let world = saved
                .state
                .optimizer
                .as_ref()
                .and_then(|o| o.shard)
                .map(|s| s.world_size);
            Ok((read(saved)?, world))
        };
        let (first, world) = shard(0)?;
        let world = world.ok_or_else(|| {
            Error::Checkpoint(format!(
                "{}: rank 0's shard of step {step} does not record how many shards it has",
                self.shard_dir(0).display()
            ))
        })?;
        std::iter::once(Ok(first))
            .chain((1..world).map(|r| shard(r).map(|(s, _)| s)))
            .collect()
    }

    /// The newest state whose shards `shards_at` finds (`None`: no state
    /// at all, a fresh start).
    ///
    /// # Errors
    ///
    /// States exist but none has its shards: resuming would lose them all,
    /// so it is refused, naming the folder.
    fn newest_with_shards<T>(
        &self,
        what: &str,
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
                        tracing::warn!(
                            "{}: {why}; trying the state before it",
                            saved.path.display()
                        );
                        false
                    }
                })?;
        match (chosen, shards) {
            (Some(saved), Some(shards)) => Ok(Some((saved, shards))),
            _ if self.states.latest()?.is_some() => Err(Error::Checkpoint(format!(
                "{}: no training state has every rank's {what} shard; refusing to start over",
                self.path().display()
            ))),
            _ => Ok(None),
        }
    }
}

fn missing(path: &Path) -> Error {
    Error::Checkpoint(format!(
        "{}: the shard has no optimizer state",
        path.display()
    ))
}
