//! Whole-run checkpoints: everything a killed run needs to continue to the
//! same bytes, saved in one call and found again after a crash.
//!
//! A [`TrainingState`] is the model's variables (buffers included), the
//! optimizer's [`OptimizerState`], where the run is ([`Progress`]: epoch,
//! batch within it, global step), the sampler's seed and epoch, the
//! learning-rate schedule's and the loss scaler's positions, and metadata
//! of your own. [`StateDir::save`] writes one into a directory of
//! states; [`StateDir::latest`] finds the newest complete one.
//!
//! **Crash safety.** A state is written into a hidden temporary folder,
//! every file flushed to disk; a manifest with each file's size and CRC-32
//! is written last; then the folder is renamed into place
//! (`state-<step>-<n>`, where `n` counts the saves in the directory) and
//! the directory flushed. **Newest means most recently saved**, whatever
//! its step: a run rolled back to an earlier step, or restarted in the same
//! directory, saves states that are newer than the ones of higher steps it
//! left behind. Loading walks the states newest first and takes the first
//! whose manifest and files check out; a damaged or partial one is skipped
//! with a warning naming it. The newest `keep` states are kept (3 by
//! default), older ones removed only after a new one is in place, and the
//! state a save has just written is never among them: once a state has
//! been written, a kill at any moment of a later save leaves a loadable
//! one.
//!
//! ```
//! use candle_core::{DType, Device};
//! use candle_dp::optim::{AdamW, AdamWConfig, StatefulOptimizer};
//! use candle_dp::training_state::{Progress, StateDir, TrainingState};
//! use candle_nn::{linear, VarBuilder, VarMap};
//!
//! # fn main() -> anyhow::Result<()> {
//! # let dir = std::env::temp_dir().join(format!("candle_dp_doc_states_{}", std::process::id()));
//! let varmap = VarMap::new();
//! linear(4, 2, VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?;
//! let opt = AdamW::from_varmap(&varmap, AdamWConfig::default())?;
//! let states = StateDir::new(&dir)?;
//! let state = TrainingState {
//!     progress: Progress { epoch: 2, batch: 5, step: 45 },
//!     optimizer: Some(opt.state()?),
//!     ..Default::default()
//! };
//! states.save(&varmap, &state)?;
//!
//! // After a restart: the same model and optimizer, then the newest state.
//! let mut resumed = AdamW::from_varmap(&varmap, AdamWConfig::default())?;
//! let saved = states.latest()?.expect("a state was saved");
//! saved.restore(&varmap, Some(&mut resumed))?;
//! assert_eq!(saved.state.progress.step, 45);
//! # std::fs::remove_dir_all(&dir)?;
//! # Ok(())
//! # }
//! ```

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use candle_core::{Device, Tensor};
use candle_nn::VarMap;
use serde::{Deserialize, Serialize};

use crate::comm::{all_gather_object, ProcessGroup};
use crate::error::{Error, Result};
use crate::optim::{GradScalerState, LrSchedulerState};
use crate::optim::{OptimizerState, ShardOf, StatefulOptimizer};
use crate::sampler::DistributedSampler;
use crate::saving::checkpoint::{self, Prefix};
use crate::util::lock::lock;

/// Where a run is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Progress {
    /// The epoch in progress (from 0).
    pub epoch: u64,
    /// How many batches of that epoch were trained: the next one to run.
    pub batch: u64,
    /// Optimizer steps taken since the start of the run.
    pub step: u64,
}

impl Progress {
    /// After the step that left the run here (`batches` in its epoch): the
    /// progress to save if a state is due (every `every` steps, or at each
    /// epoch's end, which continues with the next epoch).
    /// ```
    /// use candle_dp::training_state::Progress;
    /// let end = Progress { epoch: 0, batch: 10, step: 10 };
    /// assert_eq!(end.due(10, None), Some(Progress { epoch: 1, batch: 0, step: 10 }));
    /// assert_eq!(Progress { batch: 3, ..end }.due(10, None), None);
    /// ```
    pub fn due(self, batches: u64, every: Option<u64>) -> Option<Progress> {
        let end_of_epoch = self.batch >= batches;
        let due = match every {
            Some(n) => n > 0 && self.step.is_multiple_of(n),
            None => end_of_epoch,
        };
        let next = Progress {
            epoch: self.epoch + 1,
            batch: 0,
            ..self
        };
        due.then_some(if end_of_epoch { next } else { self })
    }
}

/// A [`DistributedSampler`]'s position: its base seed and epoch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerState {
    /// The base seed.
    pub seed: u64,
    /// The epoch set last.
    pub epoch: u64,
}

impl From<&DistributedSampler> for SamplerState {
    fn from(sampler: &DistributedSampler) -> Self {
        Self {
            seed: sampler.base_seed(),
            epoch: sampler.epoch(),
        }
    }
}

impl SamplerState {
    /// Sets `sampler`'s epoch to the saved one.
    ///
    /// # Errors
    ///
    /// [`Error::Checkpoint`] when `sampler` was built with another seed: it
    /// would not give the saved run's order.
    pub fn apply_to(&self, sampler: &mut DistributedSampler) -> Result<()> {
        if sampler.base_seed() != self.seed {
            return Err(Error::Checkpoint(format!(
                "the state was saved with sampler seed {}, this sampler has seed {}: it would not give the saved run's order",
                self.seed,
                sampler.base_seed()
            )));
        }
        sampler.set_epoch(self.epoch);
        Ok(())
    }
}

/// Everything but the model's variables, which [`StateDir::save`] takes
/// from the `VarMap`.
#[derive(Debug, Clone, Default)]
pub struct TrainingState {
    /// Where the run is.
    pub progress: Progress,
    /// The optimizer's state, if the run has one to save.
    pub optimizer: Option<OptimizerState>,
    /// The sampler's position, if the run uses one.
    pub sampler: Option<SamplerState>,
    /// The learning-rate schedule's position, if the run has one.
    pub lr_scheduler: Option<LrSchedulerState>,
    /// The loss scaler's scale and growth tracker, if the run has one.
    pub grad_scaler: Option<GradScalerState>,
    /// Anything else the run wants back (strings by name).
    pub metadata: BTreeMap<String, String>,
}

/// A complete state found in a [`StateDir`].
#[derive(Debug, Clone)]
pub struct SavedState {
    /// Its folder.
    pub path: PathBuf,
    /// What it holds besides the model's variables.
    pub state: TrainingState,
}

impl SavedState {
    /// Puts the state back: the optimizer's (when given and saved), then
    /// the model's variables (every one of them, strictly). All or nothing:
    /// if the variables do not fit, the optimizer gets its own state back.
    ///
    /// # Errors
    ///
    /// [`Error::OptimizerState`] or [`Error::Checkpoint`] naming what does
    /// not fit; [`Error::Checkpoint`] when an optimizer is given but the
    /// state has none.
    pub fn restore<O: StatefulOptimizer>(
        &self,
        varmap: &VarMap,
        optimizer: Option<&mut O>,
    ) -> Result<()> {
        let model = self.path.join(MODEL_FILE);
        let Some(optimizer) = optimizer else {
            return checkpoint::load(varmap, &model, true).map(|_| ());
        };
        let saved = self.state.optimizer.as_ref().ok_or_else(|| {
            Error::Checkpoint(format!(
                "{}: the state has no optimizer state to restore",
                self.path.display()
            ))
        })?;
        let before = optimizer.state()?;
        optimizer.load_state(saved)?;
        if let Err(error) = checkpoint::load(varmap, &model, true) {
            optimizer.load_state(&before)?;
            return Err(error);
        }
        Ok(())
    }
}

/// A directory of training states (see the [module docs](self)).
#[derive(Debug, Clone)]
pub struct StateDir {
    dir: PathBuf,
    keep: usize,
}

pub(crate) const MODEL_FILE: &str = "model.safetensors";
const OPTIMIZER_FILE: &str = "optimizer.safetensors";
const STATE_FILE: &str = "state.json";
const MANIFEST_FILE: &str = "MANIFEST.json";
const STATE_PREFIX: &str = "state-";
const TEMPORARY_PREFIX: &str = ".tmp-state-";
/// The layout of a state folder; a newer one is skipped with a warning.
const FORMAT: u32 = 1;

/// What the manifest says of one file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct FileCheck {
    bytes: u64,
    crc32: u32,
}

/// The manifest: written last, its presence marks a complete state.
#[derive(Debug, Serialize, Deserialize)]
struct Manifest {
    format: u32,
    step: u64,
    files: BTreeMap<String, FileCheck>,
}

/// `state.json`: the state's small parts.
#[derive(Debug, Serialize, Deserialize)]
struct Small {
    progress: Progress,
    sampler: Option<SamplerState>,
    /// Absent from states saved before schedules and scalers were kept.
    #[serde(default)]
    lr_scheduler: Option<LrSchedulerState>,
    #[serde(default)]
    grad_scaler: Option<GradScalerState>,
    metadata: BTreeMap<String, String>,
    /// The optimizer's kind, steps and settings (its tensors are in
    /// `optimizer.safetensors`).
    optimizer: Option<OptimizerHeader>,
}

#[derive(Debug, Serialize, Deserialize)]
struct OptimizerHeader {
    kind: String,
    steps: u64,
    settings: BTreeMap<String, f64>,
    /// A sharded optimizer's rank and world size (absent in states saved
    /// before it was recorded: such a shard is refused by `load_shards`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    shard: Option<ShardOf>,
}

impl StateDir {
    /// The states in `dir`, created if missing; the newest 3 are kept.
    ///
    /// # Errors
    ///
    /// [`Error::Checkpoint`] when the directory cannot be created.
    pub fn new(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        std::fs::create_dir_all(&dir).map_err(|e| {
            Error::Checkpoint(format!(
                "{}: cannot create the directory: {e}",
                dir.display()
            ))
        })?;
        Ok(Self { dir, keep: 3 })
    }

    /// Keeps the `keep` most recently saved states (at least 1), the one
    /// just saved always among them.
    pub fn keep(mut self, keep: usize) -> Self {
        self.keep = keep.max(1);
        self
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Saves `varmap`'s variables and `state` as a new state, the newest
    /// in the directory whatever its step, then removes the states saved
    /// before the newest `keep` and what crashed saves left. Returns the
    /// new state's folder, which the pruning never removes. Under DDP one
    /// rank saves (the state is the same on every rank).
    ///
    /// # Errors
    ///
    /// [`Error::Checkpoint`] naming the path that could not be written,
    /// or the field that holds a number that is not finite (a schedule's
    /// rate that overflowed, an optimizer setting, the loss scale: JSON
    /// has no such number, and a resume would refuse it), before anything
    /// is written; the states already there are untouched.
    pub fn save(&self, varmap: &VarMap, state: &TrainingState) -> Result<PathBuf> {
        check_storable(state)?;
        static SAVES: AtomicU64 = AtomicU64::new(0);
        let n = SAVES.fetch_add(1, Ordering::Relaxed);
        let unique = format!("{}-{}", std::process::id(), n);
        let step = state.progress.step;
        let temporary = self
            .dir
            .join(format!("{TEMPORARY_PREFIX}{step:012}-{unique}"));
        let _writing = InProgress::mark(&temporary);
        let result = self.write(&temporary, varmap, state);
        // This process's saves take turns from numbering the state to the
        // end of its pruning: two saves must not take one number, nor
        // prune each other's new state.
        let _turn = lock(&PLACING);
        let written = result.and_then(|()| {
            let index = self.next_index()?;
            let target = self.dir.join(format!("{STATE_PREFIX}{step:012}-{index}"));
            std::fs::rename(&temporary, &target)
                .map_err(|e| failed(&target, "cannot move it into place", &e))?;
            sync_dir(&self.dir);
            Ok((target, index))
        });
        match written {
            Ok((target, index)) => {
                self.prune(index);
                Ok(target)
            }
            Err(error) => {
                let _ = std::fs::remove_dir_all(&temporary);
                Err(error)
            }
        }
    }

    /// The most recently saved complete state (not the one of the highest
    /// step: see the [module docs](self)), read but not applied (see
    /// [`SavedState::restore`]); `None` when there is none. A damaged or
    /// partial state is skipped with a `tracing` warning naming it.
    ///
    /// # Errors
    ///
    /// [`Error::Checkpoint`] when the directory cannot be listed.
    pub fn latest(&self) -> Result<Option<SavedState>> {
        for (_, _, path) in self.states()?.into_iter().rev() {
            match read_state(&path) {
                Ok(state) => return Ok(Some(SavedState { path, state })),
                Err(reason) => tracing::warn!(
                    "skipping the training state {}: {reason}; trying the one before it",
                    path.display()
                ),
            }
        }
        Ok(None)
    }

    /// The steps of the states in the directory, most recently saved
    /// first (a step saved twice appears twice).
    ///
    /// # Errors
    ///
    /// [`Error::Checkpoint`] when the directory cannot be listed.
    pub fn steps(&self) -> Result<Vec<u64>> {
        Ok(self
            .states()?
            .into_iter()
            .rev()
            .map(|(step, _, _)| step)
            .collect())
    }

    /// Removes the states whose step `keep` rejects: for shards saved
    /// beside the states that name them, which must live exactly as long
    /// as those (prune them to the steps of the states kept there, rather
    /// than by count: kills between the shards and their state would push
    /// the needed shards out). Returns how many were removed.
    ///
    /// # Errors
    ///
    /// [`Error::Checkpoint`] when the directory cannot be listed or a state
    /// cannot be removed, naming it.
    pub fn retain_steps(&self, mut keep: impl FnMut(u64) -> bool) -> Result<usize> {
        let _placing = lock(&PLACING);
        let mut removed = 0;
        for (step, _, path) in self.states()? {
            if !keep(step) {
                std::fs::remove_dir_all(&path)
                    .map_err(|e| failed(&path, "cannot remove the state", &e))?;
                removed += 1;
            }
        }
        sync_dir(&self.dir);
        Ok(removed)
    }

    /// The most recently saved complete state that `accept` takes, if any
    /// (damaged ones skipped, as by [`latest`](Self::latest)): for a state
    /// that is only whole with others saved elsewhere, such as each rank's
    /// shard of a sharded optimizer's state, where a kill between the
    /// shards and the state that names them can leave the newest state
    /// without its shards.
    ///
    /// # Errors
    ///
    /// [`Error::Checkpoint`] when the directory cannot be listed.
    pub fn latest_where(
        &self,
        mut accept: impl FnMut(&SavedState) -> bool,
    ) -> Result<Option<SavedState>> {
        for (_, _, path) in self.states()?.into_iter().rev() {
            match read_state(&path) {
                Ok(state) => {
                    let saved = SavedState { path, state };
                    if accept(&saved) {
                        return Ok(Some(saved));
                    }
                }
                Err(reason) => tracing::warn!(
                    "skipping the training state {}: {reason}; trying the one before it",
                    path.display()
                ),
            }
        }
        Ok(None)
    }

    /// The most recently saved complete state of `step`, if any (a damaged one is
    /// skipped, as by [`latest`](Self::latest)): for states saved in
    /// several directories that must be read at one step, such as each
    /// rank's shard of a sharded optimizer's state.
    ///
    /// # Errors
    ///
    /// [`Error::Checkpoint`] when the directory cannot be listed.
    pub fn at_step(&self, step: u64) -> Result<Option<SavedState>> {
        for (_, _, path) in self
            .states()?
            .into_iter()
            .rev()
            .filter(|(s, _, _)| *s == step)
        {
            match read_state(&path) {
                Ok(state) => return Ok(Some(SavedState { path, state })),
                Err(reason) => {
                    tracing::warn!("skipping the training state {}: {reason}", path.display())
                }
            }
        }
        Ok(None)
    }

    /// The complete-looking states (named `state-<step>-<n>`) in the order
    /// they were saved, oldest first (by `n`, the save's number in the
    /// directory): (step, n, path).
    fn states(&self) -> Result<Vec<(u64, u64, PathBuf)>> {
        let entries = std::fs::read_dir(&self.dir)
            .map_err(|e| failed(&self.dir, "cannot list the directory", &e))?;
        let mut states: Vec<(u64, u64, PathBuf)> = entries
            .filter_map(|entry| {
                let entry = entry.ok()?;
                let name = entry.file_name().into_string().ok()?;
                let (step, n) = name.strip_prefix(STATE_PREFIX)?.split_once('-')?;
                Some((step.parse().ok()?, n.parse().ok()?, entry.path()))
            })
            .collect();
        states.sort_by_key(|(step, n, _)| (*n, *step));
        Ok(states)
    }

    /// One more than the largest index used in the directory.
    fn next_index(&self) -> Result<u64> {
        Ok(self
            .states()?
            .iter()
            .map(|(_, n, _)| n + 1)
            .max()
            .unwrap_or(0))
    }

    /// Writes every file of a state into `folder`, the manifest last.
    fn write(&self, folder: &Path, varmap: &VarMap, state: &TrainingState) -> Result<()> {
        std::fs::create_dir_all(folder).map_err(|e| failed(folder, "cannot create it", &e))?;
        checkpoint::save(varmap, folder.join(MODEL_FILE), Prefix::None)?;
        let mut files = vec![MODEL_FILE];
        let header = match &state.optimizer {
            Some(optimizer) => {
                let path = folder.join(OPTIMIZER_FILE);
                let tensors: HashMap<&str, &Tensor> = optimizer
                    .tensors
                    .iter()
                    .map(|(k, t)| (k.as_str(), t))
                    .collect();
                safetensors::tensor::serialize_to_file(tensors, None, &path)
                    .map_err(|e| failed(&path, "cannot write it", &e))?;
                sync_file(&path)?;
                files.push(OPTIMIZER_FILE);
                Some(OptimizerHeader {
                    kind: optimizer.kind.clone(),
                    steps: optimizer.steps,
                    settings: optimizer.settings.clone(),
                    shard: optimizer.shard,
                })
            }
            None => None,
        };
        let small = Small {
            progress: state.progress,
            sampler: state.sampler,
            lr_scheduler: state.lr_scheduler.clone(),
            grad_scaler: state.grad_scaler,
            metadata: state.metadata.clone(),
            optimizer: header,
        };
        write_json(&folder.join(STATE_FILE), &small)?;
        files.push(STATE_FILE);
        let mut checks = BTreeMap::new();
        for file in files {
            checks.insert(file.to_string(), check_of(&folder.join(file))?);
        }
        let manifest = Manifest {
            format: FORMAT,
            step: state.progress.step,
            files: checks,
        };
        write_json(&folder.join(MANIFEST_FILE), &manifest)?;
        sync_dir(folder);
        Ok(())
    }

    /// Removes the states saved before the newest `keep`, only ever ones
    /// saved before `current` (the number of the state just saved, which
    /// stays), and the temporary folders of saves that crashed (a live
    /// process's save in progress is left alone). A failure to remove is
    /// only warned about: the new state is in place.
    fn prune(&self, current: u64) {
        let Ok(states) = self.states() else { return };
        let older: Vec<PathBuf> = states
            .into_iter()
            .filter(|(_, n, _)| *n < current)
            .map(|(_, _, path)| path)
            .collect();
        let excess = older.len().saturating_sub(self.keep.saturating_sub(1));
        for path in older.into_iter().take(excess) {
            if let Err(e) = std::fs::remove_dir_all(&path) {
                tracing::warn!(
                    "could not remove the old training state {}: {e}",
                    path.display()
                );
            }
        }
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for entry in entries.flatten() {
            let stale = entry.file_name().to_str().is_some_and(|name| {
                name.starts_with(TEMPORARY_PREFIX) && !writer_may_be_saving(name)
            });
            if stale {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
        sync_dir(&self.dir);
    }
}

/// The names of the temporary folders this process is writing now
/// (unique: they hold the process id and a count of its saves): another
/// thread's save into the same directory, however it spells the
/// directory's path, must not prune them.
static WRITING: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());

/// Held from numbering a state to the end of its pruning (see `save`).
static PLACING: Mutex<()> = Mutex::new(());

/// Marks a temporary folder as being written, until dropped.
struct InProgress(String);

impl InProgress {
    fn mark(folder: &Path) -> Self {
        let name = folder
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        lock(&WRITING).insert(name.clone());
        Self(name)
    }
}

impl Drop for InProgress {
    fn drop(&mut self) {
        lock(&WRITING).remove(&self.0);
    }
}

/// Whether the save that made the temporary folder `name`
/// (`.tmp-state-<step>-<pid>-<n>`) may still be running: one of this
/// process's saves in progress, or, on Linux, another process that is
/// alive (`/proc` tells; a crashed save whose process id was reused stays
/// until that process ends). Elsewhere another process's folder counts as
/// left by a crash, as it did before: one process saves into a directory.
fn writer_may_be_saving(name: &str) -> bool {
    let pid = name
        .strip_prefix(TEMPORARY_PREFIX)
        .and_then(|rest| rest.split('-').nth(1))
        .and_then(|p| p.parse::<u32>().ok());
    let Some(pid) = pid else {
        return false;
    };
    if pid == std::process::id() {
        return lock(&WRITING).contains(name);
    }
    cfg!(target_os = "linux") && Path::new("/proc").join(pid.to_string()).exists()
}

/// Checks that every rank found the same state to resume from (the step it
/// resumes at, `None` for a fresh start): under DDP each rank reads the
/// directory itself, and a rank that found another state (a directory
/// that is not shared, a save that reached one machine only) must not
/// train on.
///
/// # Errors
///
/// [`Error::ResumeMismatch`] naming the first rank whose step differs from
/// rank 0's, on every rank; a collective's error.
pub fn check_ranks_agree(pg: &dyn ProcessGroup, step: Option<u64>) -> Result<()> {
    let steps = all_gather_object(pg, &step)?;
    let rank0 = steps.first().copied().flatten();
    match steps.iter().enumerate().find(|(_, s)| **s != rank0) {
        Some((rank, other)) => Err(Error::ResumeMismatch {
            rank,
            step: *other,
            rank0_step: rank0,
        }),
        None => Ok(()),
    }
}

/// Reads and checks the state in `folder`, or says why it cannot be used.
fn read_state(folder: &Path) -> std::result::Result<TrainingState, String> {
    let manifest: Manifest = read_json(&folder.join(MANIFEST_FILE))
        .map_err(|e| format!("no readable manifest ({e}): the save did not finish"))?;
    if manifest.format > FORMAT {
        return Err(format!(
            "it has format {}, this candle-dp reads up to {FORMAT}",
            manifest.format
        ));
    }
    for file in [MODEL_FILE, STATE_FILE] {
        if !manifest.files.contains_key(file) {
            return Err(format!("its manifest does not list {file}"));
        }
    }
    for (file, want) in &manifest.files {
        let got = check_of(&folder.join(file)).map_err(|e| e.to_string())?;
        if &got != want {
            return Err(format!(
                "{file} has {} bytes and CRC-32 {:08x}, the manifest says {} bytes and {:08x}: it is damaged",
                got.bytes, got.crc32, want.bytes, want.crc32
            ));
        }
    }
    let small: Small = read_json(&folder.join(STATE_FILE)).map_err(|e| e.to_string())?;
    let optimizer = match small.optimizer {
        Some(header) => {
            let path = folder.join(OPTIMIZER_FILE);
            let tensors = if manifest.files.contains_key(OPTIMIZER_FILE) {
                candle_core::safetensors::load(&path, &Device::Cpu)
                    .map_err(|e| format!("{}: {e}", path.display()))?
            } else {
                return Err(format!("its manifest does not list {OPTIMIZER_FILE}"));
            };
            Some(OptimizerState {
                kind: header.kind,
                steps: header.steps,
                settings: header.settings,
                tensors: tensors.into_iter().collect(),
                shard: header.shard,
            })
        }
        None => None,
    };
    Ok(TrainingState {
        progress: small.progress,
        optimizer,
        sampler: small.sampler,
        lr_scheduler: small.lr_scheduler,
        grad_scaler: small.grad_scaler,
        metadata: small.metadata,
    })
}

/// Checks that every number of `state` that goes to `state.json` is
/// finite, naming the first field that is not: JSON has no NaN nor
/// infinity (serde writes `null`, which would not load back), and a
/// resume refuses such a rate, setting or scale anyway, so the save fails
/// instead of writing a state that a resume would skip.
fn check_storable(state: &TrainingState) -> Result<()> {
    let refuse = |field: String, value: f64| {
        Err(Error::Checkpoint(format!(
            "cannot save the training state: {field} is {value}, not a finite number (JSON has \
             none, and a resume would refuse it); nothing was written"
        )))
    };
    if let Some(optimizer) = &state.optimizer {
        for (name, &value) in &optimizer.settings {
            if !value.is_finite() {
                return refuse(format!("the optimizer's setting `{name}`"), value);
            }
        }
    }
    if let Some(scheduler) = &state.lr_scheduler {
        if let Some((field, value)) = nonfinite_in_schedule(scheduler, "lr_scheduler") {
            return refuse(format!("the schedule's `{field}`"), value);
        }
    }
    if let Some(scaler) = &state.grad_scaler {
        for (field, value) in [
            ("scale", f64::from(scaler.scale)),
            ("growth_factor", scaler.growth_factor),
            ("backoff_factor", scaler.backoff_factor),
        ] {
            if !value.is_finite() {
                return refuse(format!("the loss scaler's `{field}`"), value);
            }
        }
    }
    Ok(())
}

/// The first number of `state` (or of a schedule inside it, or of a group's) that is not finite, with its path from `path`.
fn nonfinite_in_schedule(state: &LrSchedulerState, path: &str) -> Option<(String, f64)> {
    let own = [
        ("base_lr", Some(state.base_lr)),
        ("lr", Some(state.lr)),
        ("momentum", state.momentum),
    ];
    for (field, value) in own {
        if let Some(value) = value.filter(|v| !v.is_finite()) {
            return Some((format!("{path}.{field}"), value));
        }
    }
    [("children", &state.children), ("groups", &state.groups)]
        .into_iter()
        .flat_map(|(field, states)| {
            (states.iter().enumerate()).map(move |(k, s)| (format!("{path}.{field}[{k}]"), s))
        })
        .find_map(|(path, inner)| nonfinite_in_schedule(inner, &path))
}

fn failed(path: &Path, what: &str, error: &dyn std::fmt::Display) -> Error {
    Error::Checkpoint(format!("{}: {what}: {error}", path.display()))
}

/// The size and CRC-32 of the file at `path`.
fn check_of(path: &Path) -> Result<FileCheck> {
    let bytes = std::fs::read(path).map_err(|e| failed(path, "cannot read it", &e))?;
    Ok(FileCheck {
        bytes: bytes.len() as u64,
        crc32: crc32fast::hash(&bytes),
    })
}

fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    let text =
        serde_json::to_vec_pretty(value).map_err(|e| failed(path, "cannot encode it", &e))?;
    let mut file = File::create(path).map_err(|e| failed(path, "cannot create it", &e))?;
    file.write_all(&text)
        .and_then(|()| file.sync_all())
        .map_err(|e| failed(path, "cannot write it", &e))
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T> {
    let text = std::fs::read(path).map_err(|e| failed(path, "cannot read it", &e))?;
    serde_json::from_slice(&text).map_err(|e| failed(path, "cannot decode it", &e))
}

fn sync_file(path: &Path) -> Result<()> {
    OpenOptions::new()
        .write(true)
        .open(path)
        .and_then(|file| file.sync_all())
        .map_err(|e| failed(path, "cannot flush it to disk", &e))
}

/// Flushes a directory's entries (a rename is durable once it is); not
/// every platform can open a directory, so a failure is ignored.
fn sync_dir(dir: &Path) {
    if let Ok(dir) = File::open(dir) {
        let _ = dir.sync_all();
    }
}
