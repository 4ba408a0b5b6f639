//! The settings of a [`Pipeline`], one at a time, and the build: the
//! balance of the layers into stages, the stages' variables, the workers.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use candle_core::{DType, Device};
use candle_nn::VarMap;

use super::balance::Balance;
use super::recompute::Checkpoint;
use super::schedule::Schedule;
use crate::units::UnitFactory;

use crate::error::{Error, Result};
use crate::no_grad::NoGradCheck;
use crate::precision::MixedPrecision;
use crate::util::device_label::device_label;
use crate::util::vars::sorted_vars;
use crate::worker_pool::{Failure, NoAnswer, WorkerPool};

use super::timings::PipelineTimings;
use super::{balance, device_work, stage_build, Pipeline};

/// Settings of a [`Pipeline`], one at a time; [`build`](Self::build) makes it.
pub struct PipelineBuilder {
    pub(super) varmap: VarMap,
    pub(super) dtype: DType,
    pub(super) devices: Vec<Device>,
    pub(super) balance: Balance,
    pub(super) chunks: Option<usize>,
    pub(super) schedule: Schedule,
    pub(super) checkpoint: Checkpoint,
    pub(super) timeout: Option<Duration>,
    pub(super) threads_per_stage: Option<usize>,
    pub(super) mixed_precision: Option<MixedPrecision>,
}

impl std::fmt::Debug for PipelineBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PipelineBuilder")
            .field("dtype", &self.dtype)
            .field(
                "devices",
                &self.devices.iter().map(device_label).collect::<Vec<_>>(),
            )
            .field("balance", &self.balance)
            .field("chunks", &self.chunks)
            .field("schedule", &self.schedule)
            .field("checkpoint", &self.checkpoint)
            .field("timeout", &self.timeout)
            .field("mixed_precision", &self.mixed_precision)
            .finish()
    }
}

impl PipelineBuilder {
    /// How the layers are split into stages (default [`Balance::Uniform`]).
    pub fn balance(mut self, balance: Balance) -> Self {
        self.balance = balance;
        self
    }

    /// Micro-batches per step (default: twice the number of devices, so
    /// the idle fraction (S-1)/(chunks+S-1) of `S` devices stays near a
    /// third or below; 1 is plain model parallelism, no overlap).
    pub fn chunks(mut self, chunks: usize) -> Self {
        self.chunks = Some(chunks);
        self
    }

    /// The schedule of [`Pipeline::forward_backward`] (default 1F1B).
    pub fn schedule(mut self, schedule: Schedule) -> Self {
        self.schedule = schedule;
        self
    }

    /// Mixed precision (see [`crate::precision`]): the variables stay in
    /// the builder's dtype (f32), each stage computes on its own copies in
    /// `policy.param_dtype` (refreshed at the start of every step), a
    /// floating-point input is converted to it, and the gradients come back
    /// in the variables' dtype, summed over the micro-batches there. The
    /// loss function gets the last stage's output in the compute dtype:
    /// convert it to f32 there. Training goes through
    /// [`Pipeline::forward_backward`] only.
    pub fn mixed_precision(mut self, policy: MixedPrecision) -> Self {
        self.mixed_precision = Some(policy);
        self
    }

    /// Which micro-batches [`Pipeline::forward_backward`] recomputes
    /// before their backward instead of keeping their activations (default
    /// [`Checkpoint::Never`]). The drop-in path keeps its graph whole: the
    /// caller's `backward` needs it.
    pub fn checkpoint(mut self, checkpoint: Checkpoint) -> Self {
        self.checkpoint = checkpoint;
        self
    }

    /// Longest time a step (and building each device's stages) may take before it
    /// fails with [`Error::StageTimeout`] naming the stage that was
    /// computing (default: no limit; `Duration::MAX` is no limit too).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Threads of each device's worker (its rayon pool; default: on CPU the
    /// cores shared between the CPU devices, on GPUs 1).
    pub fn threads_per_stage(mut self, threads: usize) -> Self {
        self.threads_per_stage = Some(threads.max(1));
        self
    }

    /// Splits `layers` into stages and builds each stage's layers on its
    /// worker, in order (variables created in `varmap` on the stage's
    /// device, or reused when they exist).
    pub fn build(self, layers: Vec<UnitFactory>) -> Result<Pipeline> {
        let devices = self.devices.len();
        let per_device = self.schedule.stages_per_device();
        if per_device == 0 {
            return Err(Error::InvalidBalance {
                layers: layers.len(),
                stages: 0,
                reason: format!("{:?} needs at least 1 stage per device", self.schedule),
            });
        }
        let stages = devices.saturating_mul(per_device);
        let first = self.devices.first().ok_or(Error::NoDevices)?.clone();
        let roles: Vec<crate::cuda_setup::Role> = self
            .devices
            .iter()
            .enumerate()
            .map(|(i, d)| ("stage", i, d))
            .collect();
        crate::cuda_setup::prepare(&roles)?;
        let chunks = self.chunks.unwrap_or(2 * devices);
        if chunks == 0 {
            return Err(Error::InvalidBalance {
                layers: layers.len(),
                stages,
                reason: "chunks must be at least 1".into(),
            });
        }
        let cpu_stages = self.devices.iter().filter(|d| d.is_cpu()).count();
        crate::cpu_threads::share_cpu_between(cpu_stages);
        let balance =
            balance::layers_per_stage(&self.balance, &layers, stages, self.dtype, &first)?;
        let threads = self.threads_per_stage.unwrap_or_else(|| {
            if cpu_stages == devices {
                crate::cpu_threads::threads_per_worker(devices)
            } else {
                1
            }
        });
        let starts: Vec<usize> = balance
            .iter()
            .scan(0, |start, n| {
                let s = *start;
                *start += n;
                Some(s)
            })
            .collect();
        let layers = Arc::new(layers);
        if let Some(policy) = &self.mixed_precision {
            policy.check()?;
        }
        let (varmap, dtype) = (self.varmap.clone(), self.dtype);
        let precision = self.mixed_precision.clone();
        let plan = Arc::new((balance.clone(), starts));
        // Per device, the stage it is building: what a failure names.
        let building: Arc<Vec<AtomicUsize>> =
            Arc::new((0..devices).map(AtomicUsize::new).collect());
        let now_building = Arc::clone(&building);
        let (pool, stage_lists) = WorkerPool::start(
            &self.devices,
            threads,
            self.timeout,
            move |index, device| {
                let (sizes, starts) = &*plan;
                let mut held = Vec::new();
                let mut lists = Vec::new();
                for k in device_work::stages_of(index, devices, sizes.len()) {
                    if let Some(slot) = now_building.get(index) {
                        slot.store(k, Ordering::Relaxed);
                    }
                    let range = starts[k]..starts[k] + sizes[k];
                    let stage = stage_build::build_stage(
                        &varmap,
                        dtype,
                        precision.as_ref(),
                        device,
                        range.start,
                        &layers[range],
                    )?;
                    let vars = stage
                        .vars
                        .iter()
                        .map(|v| (v.name.clone(), v.master.clone()))
                        .collect::<Vec<_>>();
                    let buffers = stage.buffers.iter().map(|b| b.name.clone()).collect();
                    let copied = stage
                        .vars
                        .iter()
                        .filter(|v| !v.master.device().same_device(device))
                        .map(|v| (v.name.clone(), device_label(v.master.device())))
                        .collect::<Vec<_>>();
                    held.push(stage);
                    lists.push((vars, buffers, copied));
                }
                Ok::<_, Error>((held, lists))
            },
        )
        .map_err(|failure| {
            let stage = building
                .get(failure.worker)
                .map_or(failure.worker, |slot| slot.load(Ordering::Relaxed));
            match failure.failure {
                Failure::Error(e) => e,
                Failure::Panic(message) => Error::Candle(candle_core::Error::Msg(format!(
                    "building pipeline stage {stage} on {} panicked: {message}",
                    failure.device
                ))),
                Failure::NoAnswer(NoAnswer::Timeout(timeout)) => Error::StageTimeout {
                    stage,
                    device: failure.device,
                    doing: ", building its layers".into(),
                    timeout,
                },
                Failure::NoAnswer(why) => Error::Candle(candle_core::Error::Msg(format!(
                    "pipeline stage {stage} on {} could not start: {why:?}",
                    failure.device
                ))),
            }
        })?;
        let mut stage_vars = Vec::with_capacity(stages);
        let mut stage_buffers: Vec<Vec<String>> = Vec::with_capacity(stages);
        let mut copied_vars = Vec::new();
        for (stage, (vars, buffers, copied)) in device_work::in_stage_order(stage_lists, stages)?
            .into_iter()
            .enumerate()
        {
            stage_vars.push(vars);
            stage_buffers.push(buffers);
            copied_vars.extend(copied.into_iter().map(|(var, device)| (stage, var, device)));
        }
        refuse_buffers_of_two_stages(&stage_buffers, balance.iter().sum(), &balance)?;
        // Buffers (BatchNorm's running statistics) get no gradient by
        // design: they are not parameters to report as untrained.
        let params = sorted_vars(&self.varmap)
            .into_iter()
            .filter(|(name, _)| !stage_buffers.iter().flatten().any(|b| b == name))
            .collect();
        Ok(Pipeline {
            pool,
            devices: self.devices,
            balance,
            stage_vars,
            copied_vars,
            params,
            chunks,
            schedule: self.schedule,
            checkpoint: self.checkpoint,
            timeout: self.timeout,
            no_grad: NoGradCheck::default(),
            timings: Mutex::new(PipelineTimings::default()),
            step: Mutex::new(()),
            compute_dtype: self.mixed_precision.map(|p| p.param_dtype),
        })
    }
}

/// A buffer updated on two stages would get two commits; refuse it.
fn refuse_buffers_of_two_stages(
    stage_buffers: &[Vec<String>],
    layers: usize,
    balance: &[usize],
) -> Result<()> {
    for (later, names) in stage_buffers.iter().enumerate() {
        for name in names {
            if let Some(earlier) = stage_buffers[..later].iter().position(|n| n.contains(name)) {
                return Err(Error::InvalidBalance {
                    layers,
                    stages: balance.len(),
                    reason: format!(
                        "the buffer `{name}` is used by stages {earlier} and {later} (balance {balance:?}); put the layers that share it in one stage"
                    ),
                });
            }
        }
    }
    Ok(())
}
