//! What a [`RankPipeline`]'s ranks share beyond the stages' messages: the
//! last stage's loss or output given to every rank, the whole model gathered
//! from the ranks that hold its stages, the gradients' norm clipped over
//! every rank (a weight tied across ranks counted once), and its
//! checkpoint: each rank saves its stages' variables whole with its
//! optimizer's state, and a load takes each variable from whichever rank
//! saved it, so a state resumes on another split of the stages too.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};

use super::on_ranks::RankPipeline;
use super::PipelineTimings;
use crate::comm::all_gather_object;
use crate::error::{Error, Result};
use crate::optim::clip::{clip_grad_norm_across_counting, groups, AlsoAcross, AlsoCounted};
use crate::optim::{Clipped, OptimizerState, ShardOf, StatefulOptimizer};
use crate::util::lock::lock;

/// The setting naming a parameter's group (`group_of.<parameter>`).
const GROUP_OF: &str = "group_of.";

impl RankPipeline {
    /// The value of `t`, a tensor held by the rank of the last stage (the
    /// loss, the output), on every rank of the pipeline: the others pass
    /// `None`. Every rank of the pipeline calls it.
    ///
    /// # Errors
    ///
    /// The last stage's rank passed `None`; a collective's.
    pub fn from_last_stage(&self, t: Option<&Tensor>) -> Result<Tensor> {
        let last_rank = self.owner(self.stages() - 1);
        let me = self.pg.rank();
        let mine = t.filter(|_| me == last_rank);
        let shape = mine.map(|t| (t.dims().to_vec(), t.dtype().as_str().to_string()));
        let shapes = all_gather_object(self.pg.as_ref(), &shape)?;
        let Some((dims, dtype)) = shapes[last_rank].clone() else {
            return Err(Error::Candle(candle_core::Error::Msg(format!(
                "rank {last_rank} holds the last stage but has no tensor to share"
            ))));
        };
        let tensor = match mine {
            Some(t) => t.clone(),
            None => Tensor::zeros(dims, parse_dtype(&dtype)?, &self.device)?,
        };
        Ok(self.pg.broadcast(&tensor, last_rank)?)
    }

    /// The latest successful step's timings on every rank of the pipeline,
    /// one entry per rank (its stages' time computing, checking, and
    /// activations held), the step's time the longest rank's: its
    /// [`bubble`](super::PipelineTimings::bubble) is the pipeline's, as
    /// [`Pipeline::last_timings`](super::Pipeline::last_timings) gives an
    /// in-process pipeline's. Every rank of the pipeline calls it.
    ///
    /// # Errors
    ///
    /// A collective's.
    pub fn gather_timings(&self) -> Result<PipelineTimings> {
        let mine = lock(&self.timings).clone();
        let secs = |d: &[std::time::Duration]| d.iter().map(|d| d.as_secs_f64()).sum::<f64>();
        let row = (
            mine.step.as_secs_f64(),
            secs(&mine.busy),
            secs(&mine.checking),
            mine.peak_saved_bytes.iter().sum::<usize>(),
        );
        let rows: Vec<(f64, f64, f64, usize)> = all_gather_object(self.pg.as_ref(), &row)?;
        let time = |s: f64| Duration::try_from_secs_f64(s).unwrap_or_default();
        Ok(PipelineTimings {
            step: time(rows.iter().map(|r| r.0).fold(0.0, f64::max)),
            busy: rows.iter().map(|r| time(r.1)).collect(),
            checking: rows.iter().map(|r| time(r.2)).collect(),
            peak_saved_bytes: rows.iter().map(|r| r.3).collect(),
        })
    }

    /// The whole model's variables and buffers by name, on the CPU,
    /// gathered from every rank of the pipeline (each rank's stages'
    /// variables, broadcast from it). Every rank of the pipeline calls it
    /// and every rank gets the whole model. With FSDP each variable is
    /// first gathered from the replicas' pieces, and every rank of the
    /// mesh calls it.
    ///
    /// # Errors
    ///
    /// A collective's; a dtype this rank cannot make.
    pub fn full_state(&self) -> Result<HashMap<String, Tensor>> {
        let me = self.pg.rank();
        let wholes = self.gather_wholes()?;
        let held: Vec<(&String, Tensor)> = self
            .own
            .iter()
            .zip(wholes)
            .map(|((name, _), whole)| (name, whole.as_tensor().clone()))
            .chain(self.buffers.iter().map(|(n, v)| (n, v.as_tensor().clone())))
            .collect();
        let mine: Vec<(String, Vec<usize>, String)> = held
            .iter()
            .map(|(name, value)| {
                let dtype = value.dtype().as_str().to_string();
                ((*name).clone(), value.dims().to_vec(), dtype)
            })
            .collect();
        let all = all_gather_object(self.pg.as_ref(), &mine)?;
        let mut state = HashMap::new();
        // Every rank walks the same list in the same order: the same
        // broadcasts. A tied weight comes from the lowest rank holding it.
        for (rank, vars) in all.iter().enumerate() {
            for (name, dims, dtype) in vars {
                if state.contains_key(name) {
                    continue;
                }
                let value = match held.iter().find(|(n, _)| *n == name) {
                    Some((_, value)) if rank == me => value.clone(),
                    _ => Tensor::zeros(dims.as_slice(), parse_dtype(dtype)?, &self.device)?,
                };
                let value = self.pg.broadcast(&value, rank)?;
                state.insert(name.clone(), value.to_device(&Device::Cpu)?);
            }
        }
        Ok(state)
    }

    /// Clips the step's gradients of this rank's variables to a total
    /// `norm_type`-norm of `max_norm` over the whole pipeline (one
    /// all-reduce of one number across its ranks), as
    /// [`clip_grad_norm`](crate::optim::clip_grad_norm) of the whole
    /// model would: a weight tied across ranks holds the same gradient on
    /// each and counts once. On a mesh the replicas hold the same
    /// gradients (averaged by the step) and clip alike; at ZeRO stage 2
    /// each rank holds its pieces and the sum runs over the whole mesh
    /// (every rank of it calls it). Every rank of the pipeline calls it.
    ///
    /// # Errors
    ///
    /// As [`clip_grad_norm`](crate::optim::clip_grad_norm); a collective's.
    pub fn clip_grad_norm(
        &self,
        grads: &mut GradStore,
        max_norm: f64,
        norm_type: f64,
        error_if_nonfinite: bool,
    ) -> Result<Clipped> {
        self.clip_grad_norm_also(grads, max_norm, norm_type, error_if_nonfinite, None)
    }

    /// [`clip_grad_norm`](Self::clip_grad_norm) whose total spans `also`'s
    /// ranks too (tensor parallelism).
    pub(crate) fn clip_grad_norm_also(
        &self,
        grads: &mut GradStore,
        max_norm: f64,
        norm_type: f64,
        error_if_nonfinite: bool,
        also: Option<AlsoAcross<'_>>,
    ) -> Result<Clipped> {
        let params: Vec<Var> = self.own.iter().map(|(_, v)| v.clone()).collect();
        let also_counts = AlsoCounted::of(also, &self.own);
        // Looked up per parameter: the set is made once per call.
        let uncounted: std::collections::HashSet<_> = self
            .own
            .iter()
            .filter(|(name, _)| !self.counts_in_norm(name))
            .map(|(_, var)| var.as_tensor().id())
            .collect();
        // With hybrid sharding each shard group holds the same pieces: the
        // first group's count, or the norm would count each R times.
        let first_copy = self.replicate_rank() == 0;
        let counted = |var: &Var| {
            let id = var.as_tensor().id();
            first_copy && !uncounted.contains(&id) && also_counts.counts(var)
        };
        clip_grad_norm_across_counting(
            &groups(Some(self.norm_group().as_ref()), also),
            grads,
            &params,
            &counted,
            max_norm,
            norm_type,
            error_if_nonfinite,
        )
    }

    /// Whether this rank counts variable `name` in the gradients' norm: a
    /// weight tied across ranks only on the lowest rank using it.
    pub(super) fn counts_in_norm(&self, name: &str) -> bool {
        !self
            .tied
            .iter()
            .any(|(tied, group)| tied == name && group.rank() != 0)
    }

    /// This rank's part of a checkpoint: its stages' variables and
    /// buffers (copies, whole), and `opt`'s state (an optimizer over
    /// [`variables`](Self::variables)) marked with this rank and the
    /// pipeline's ranks, so that a load can tell a complete set.
    ///
    /// # Errors
    ///
    /// A copy that cannot be made; [`Error::Zero`] on an FSDP pipeline
    /// (its ranks hold pieces: save it with
    /// [`fsdp_stage_state`](Self::fsdp_stage_state)).
    pub fn stage_state<O: StatefulOptimizer>(
        &self,
        opt: &O,
    ) -> Result<(HashMap<String, Tensor>, OptimizerState)> {
        self.refuse_fsdp("save it with fsdp_stage_state")?;
        self.stage_state_with(opt.state()?)
    }

    /// An error for a call that takes whole variables, on an FSDP pipeline.
    fn refuse_fsdp(&self, instead: &str) -> Result<()> {
        match self.is_fsdp() {
            true => Err(Error::Zero(format!(
                "this pipeline holds its variables as pieces (FSDP): {instead}"
            ))),
            false => Ok(()),
        }
    }

    /// [`stage_state`](Self::stage_state) with the optimizer's `state` over
    /// this rank's whole variables.
    pub(super) fn stage_state_with(
        &self,
        mut state: OptimizerState,
    ) -> Result<(HashMap<String, Tensor>, OptimizerState)> {
        let values = self
            .own
            .iter()
            .chain(&self.buffers)
            .map(|(name, var)| Ok((name.clone(), var.as_tensor().copy()?)))
            .collect::<Result<_>>()?;
        state.shard = Some(ShardOf {
            rank: self.pg.rank(),
            world_size: self.pg.world_size(),
        });
        Ok((values, state))
    }

    /// Restores a checkpoint saved by every rank of a pipeline
    /// ([`stage_state`](Self::stage_state)), split over any number of
    /// ranks: `values[r]` and `states[r]` are what old rank `r` saved.
    /// Each of this rank's variables and buffers is taken from the first
    /// old rank that saved it, and `opt` (over
    /// [`variables`](Self::variables)) gets their optimizer state; the
    /// optimizer's settings and step count are old rank 0's. No
    /// collective runs.
    ///
    /// # Errors
    ///
    /// [`Error::Checkpoint`] naming what does not fit (no saves, a
    /// variable no rank saved or saved with another shape, states of
    /// another optimizer or step), and then nothing has changed; the
    /// optimizer's own refusal ([`Error::OptimizerState`]), after which
    /// the variables are put back; [`Error::Zero`] on an FSDP pipeline
    /// (load with [`load_fsdp_stages`](Self::load_fsdp_stages)).
    pub fn load_stages<O: StatefulOptimizer>(
        &self,
        values: &[HashMap<String, Tensor>],
        states: &[OptimizerState],
        opt: &mut O,
    ) -> Result<()> {
        self.refuse_fsdp("load it with load_fsdp_stages")?;
        self.load_stages_with(values, states, |state| opt.load_state(state))
    }

    /// [`load_stages`](Self::load_stages) with `load` taking the optimizer
    /// state of this rank's whole variables.
    pub(super) fn load_stages_with(
        &self,
        values: &[HashMap<String, Tensor>],
        states: &[OptimizerState],
        load: impl FnOnce(&OptimizerState) -> Result<()>,
    ) -> Result<()> {
        let fail = |what: String| Error::Checkpoint(format!("a pipeline's checkpoint: {what}"));
        let Some(first) = states.first() else {
            return Err(fail("no rank's save".into()));
        };
        if values.len() != states.len() {
            return Err(fail(format!(
                "{} ranks' variables and {} optimizer states: every rank's save of one run is \
                 needed",
                values.len(),
                states.len()
            )));
        }
        if let Some((r, other)) = states
            .iter()
            .enumerate()
            .find(|(_, s)| s.kind != first.kind || s.steps != first.steps)
        {
            return Err(fail(format!(
                "rank {r} saved a {} state of step {}, rank 0 a {} state of step {}: the saves \
                 are of different runs",
                other.kind, other.steps, first.kind, first.steps
            )));
        }
        // Every value found and checked before anything changes.
        let mut found = Vec::new();
        for (i, (name, var)) in self.own.iter().chain(&self.buffers).enumerate() {
            let saved = values.iter().find_map(|v| v.get(name)).ok_or_else(|| {
                fail(format!(
                    "no rank saved `{name}`: the saves are of another model"
                ))
            })?;
            let dims = match i < self.own.len() {
                true => self.whole_dims(i),
                false => var.dims().to_vec(),
            };
            if saved.dims() != dims.as_slice() {
                return Err(fail(format!(
                    "`{name}` was saved with shape {:?}, the model's is {dims:?}",
                    saved.dims(),
                )));
            }
            let value = saved.to_dtype(var.dtype())?.to_device(var.device())?;
            let value = match i < self.own.len() {
                true => self.held_part(i, &value)?,
                false => value,
            };
            found.push((var.clone(), value));
        }
        let own: Vec<&str> = self.own.iter().map(|(n, _)| n.as_str()).collect();
        let mut state = OptimizerState {
            kind: first.kind.clone(),
            steps: first.steps,
            settings: first
                .settings
                .iter()
                .filter(|(key, _)| !key.starts_with(GROUP_OF))
                .map(|(k, v)| (k.clone(), *v))
                .collect(),
            tensors: BTreeMap::new(),
            shard: None,
        };
        for saved in states {
            for (key, value) in &saved.settings {
                let of_mine = key.strip_prefix(GROUP_OF).is_some_and(|p| own.contains(&p));
                if of_mine {
                    state.settings.insert(key.clone(), *value);
                }
            }
            for (key, tensor) in &saved.tensors {
                // `<parameter>.<slot>`: the slot has no dot.
                let param = key.rsplit_once('.').map_or("", |(p, _)| p);
                if own.contains(&param) {
                    state
                        .tensors
                        .entry(key.clone())
                        .or_insert_with(|| tensor.clone());
                }
            }
        }
        let before = found
            .iter()
            .map(|(var, _)| Ok((var.clone(), var.as_tensor().copy()?)))
            .collect::<Result<Vec<_>>>()?;
        for (var, value) in &found {
            var.set(value)?;
        }
        if let Err(e) = load(&state) {
            for (var, value) in &before {
                var.set(value)?;
            }
            return Err(e);
        }
        Ok(())
    }
}

/// A dtype by its name.
fn parse_dtype(name: &str) -> Result<DType> {
    name.parse()
        .map_err(|_| Error::Candle(candle_core::Error::Msg(format!("unknown dtype `{name}`"))))
}
