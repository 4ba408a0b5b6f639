//! Model parallelism: a model split into stages across devices, pipelined
//! over micro-batches.
//!
//! The model is an ordered list of layers, each built by its own factory
//! from a `VarBuilder` on its stage's device, so the whole model never
//! exists on one device. The layers are split into contiguous stages by a
//! [`Balance`]: one per device, or several with
//! [`Schedule::Interleaved1F1B`] (stage `k` on device `k % devices`). Each
//! device's stages live on its persistent worker (the crate's worker pool,
//! as `DataParallel`'s replicas do). A step splits the batch into `chunks`
//! micro-batches (`torch.chunk` sizes) that flow through the stages in a
//! [`Schedule`] (GPipe, 1F1B or interleaved 1F1B).
//!
//! Two ways to train, as with [`DataParallel`](crate::DataParallel):
//! - **drop-in**: [`Pipeline::forward`] returns the output with its graph
//!   spanning every stage; `loss.backward()` (or `opt.backward_step`) walks
//!   it, serially, on the calling thread;
//! - **fast**: [`Pipeline::forward_backward`] computes the loss of each
//!   micro-batch on the last stage and runs each stage's backward on its
//!   device's worker, overlapping the devices. The gradients, accumulated in
//!   micro-batch order, come back in one `GradStore` for any candle
//!   optimizer. With [`LossReduction::Mean`] each micro-batch's loss is
//!   weighted by its share of the rows, so the gradients equal the full
//!   batch's for any split (PyTorch divides by the number of micro-batches,
//!   exact only when they are equal).
//!
//! ```
//! use std::sync::Arc;
//! use candle_core::{DType, Device, Tensor};
//! use candle_nn::{linear, loss, Activation, Optimizer, VarMap, SGD};
//! use candle_dp::pipeline::{unit, Pipeline, Schedule};
//! use candle_dp::{cpu_devices, LossReduction};
//!
//! # fn main() -> anyhow::Result<()> {
//! let layers = vec![
//!     unit(|vb| linear(8, 16, vb.pp("l1"))),
//!     unit(|_| Ok(Activation::Relu)),
//!     unit(|vb| linear(16, 4, vb.pp("l2"))),
//! ];
//! let varmap = VarMap::new();
//! let pipe = Pipeline::builder(&varmap, DType::F32, &cpu_devices(2))
//!     .chunks(4)
//!     .schedule(Schedule::OneFOneB)
//!     .build(layers)?;
//! assert_eq!(pipe.balance(), &[2, 1]);
//! let mut sgd = SGD::new(varmap.all_vars(), 0.1)?;
//! let x = Tensor::randn(0f32, 1., (12, 8), &Device::Cpu)?;
//! let y = Tensor::new(&[0u32, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3], &Device::Cpu)?;
//! let step = pipe.forward_backward(&x, &y, LossReduction::Mean, |logits, y| {
//!     loss::cross_entropy(logits, y)
//! })?;
//! sgd.step(&step.grads)?;
//! # Ok(())
//! # }
//! ```
//!
//! Layers whose forward couples the rows of a batch (BatchNorm in training)
//! see one micro-batch at a time, as in every pipeline. BatchNorm running
//! statistics, though, are those of the whole batch (deferred: see
//! `deferred_norm`), as on one device, with no change to the model, and
//! they reach the `VarMap` only when the whole step succeeds. Variables
//! shared by layers of different stages (tied weights) get the sum of
//! their gradients, on any devices: a stage whose device is not the
//! variable's uses a copy refreshed at every step.

mod balance;
mod builder;
mod deferred_norm;
mod device_work;
mod distributed;
mod link;
mod on_ranks;
mod piece_groups;
mod rank_batches;
mod rank_state;
mod recompute;
mod replica_shards;
mod replicas;
mod schedule;
mod stage;
mod stage_build;
mod stage_var;
mod tied;
mod timings;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;
use crossbeam::channel;

#[allow(deprecated)]
pub use crate::units::{layer, LayerFactory};
/// A pipeline's layers are units: their factories are the units'.
pub use crate::units::{unit, UnitFactory};
pub use balance::Balance;
pub use builder::PipelineBuilder;
pub use on_ranks::{RankPipeline, RankPipelineConfig, RankStep};
pub use recompute::Checkpoint;
pub use schedule::Schedule;
pub use timings::PipelineTimings;

use crate::data_parallel::scatter_gather::chunk_sizes;
use crate::error::{Error, Result};
use crate::no_grad::NoGradCheck;
use crate::step::{LossReduction, Step};
use crate::units::build_layer;
use crate::util::device_label::device_label;
use crate::util::lock::lock;
use crate::worker_pool::{Failure, NoAnswer, WorkerFailure, WorkerPool};
use device_work::{DeviceFailure, DeviceOutput, DeviceWork};
use link::{Inbox, Outbox};
use stage::{Board, Doing, Links, LossFn, Stage, StageOutput, StageWork, TrainLoss};

/// A model split into stages across devices, pipelined over micro-batches.
/// See the [module docs](self).
pub struct Pipeline {
    /// One worker per device, holding that device's stages.
    pool: WorkerPool<Vec<Stage>>,
    devices: Vec<Device>,
    /// Layers per stage; stage `k` runs on device `k % devices.len()`.
    balance: Vec<usize>,
    stage_vars: Vec<Vec<(String, Var)>>,
    /// Trainable variables a stage uses through a copy (they live on
    /// another device): `(stage, name, device)`.
    copied_vars: Vec<(usize, String, String)>,
    params: Vec<(String, Var)>,
    chunks: usize,
    schedule: Schedule,
    checkpoint: Checkpoint,
    timeout: Option<Duration>,
    no_grad: NoGradCheck,
    timings: Mutex<PipelineTimings>,
    /// One step at a time: the stages' channels belong to one step.
    step: Mutex<()>,
    /// With mixed precision, the dtype the stages compute in.
    compute_dtype: Option<DType>,
}

impl std::fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let devices: Vec<String> = self.devices.iter().map(device_label).collect();
        f.debug_struct("Pipeline")
            .field("devices", &devices)
            .field("balance", &self.balance)
            .field("chunks", &self.chunks)
            .field("schedule", &self.schedule)
            .field("checkpoint", &self.checkpoint)
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// A step whose stages all succeeded, not yet committed, holding the
/// pipeline's step lock until it is: the next step must read the buffers
/// this one commits.
struct Uncommitted<'a> {
    ran: RanStep,
    _step: std::sync::MutexGuard<'a, ()>,
}

impl Uncommitted<'_> {
    /// The step, its lock let go: for a caller that holds the pipeline
    /// exclusively until it commits (DDP's `&mut self`), so that no other
    /// step can come between.
    fn into_exclusive(self) -> RanStep {
        self.ran
    }
}

/// A step whose stages all succeeded, not yet committed.
struct RanStep {
    /// Each stage's results, in stage order.
    outputs: Vec<StageOutput>,
    /// Per device, the time it computed and its peak of saved activations.
    busy: Vec<Duration>,
    checking: Vec<Duration>,
    peak_saved_bytes: Vec<usize>,
    /// From the start of the step to the end of its last stage.
    time: Duration,
}

impl Pipeline {
    /// Starts configuring a pipeline over `devices`, with its variables in
    /// `varmap`: stage `k` runs on `devices[k % devices.len()]` (one stage
    /// per device unless the schedule is interleaved).
    pub fn builder(varmap: &VarMap, dtype: DType, devices: &[Device]) -> PipelineBuilder {
        PipelineBuilder {
            varmap: varmap.clone(),
            dtype,
            devices: devices.to_vec(),
            balance: Balance::Uniform,
            chunks: None,
            schedule: Schedule::default(),
            checkpoint: Checkpoint::default(),
            timeout: None,
            threads_per_stage: None,
            mixed_precision: None,
        }
    }

    /// The pipeline's devices.
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// The number of layers of each stage, in stage order.
    pub fn balance(&self) -> &[usize] {
        &self.balance
    }

    /// The number of micro-batches a batch is split into (fewer when the
    /// batch has fewer rows, as `torch.chunk` does).
    pub fn chunks(&self) -> usize {
        self.chunks
    }

    /// The schedule of the fast path.
    pub fn schedule(&self) -> Schedule {
        self.schedule
    }

    /// The names of the variables of each stage (a tied variable appears
    /// in every stage that uses it).
    pub fn stage_vars(&self) -> Vec<Vec<String>> {
        self.stage_vars
            .iter()
            .map(|vars| vars.iter().map(|(n, _)| n.clone()).collect())
            .collect()
    }

    /// Where the time and activation memory of the latest successful step
    /// went, device by device.
    pub fn last_timings(&self) -> PipelineTimings {
        lock(&self.timings).clone()
    }

    /// The drop-in forward in training mode: see [`forward_t`](Self::forward_t).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_t(x, true)
    }

    /// Runs the micro-batches of `x` through the stages (each stage on its
    /// worker, the stages overlapping) and returns the concatenated output,
    /// on the last stage's device, with its graph spanning every stage:
    /// `loss.backward()` gives the gradients of every variable. Training
    /// (`train`) is refused with [`Error::DropInWithCopiedVar`] when a
    /// stage uses a variable that lives on another device (tied weights
    /// across devices): only [`forward_backward`](Self::forward_backward)
    /// routes that stage's gradient back.
    pub fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        if train && self.compute_dtype.is_some() {
            return Err(Error::MixedPrecision(
                "the drop-in forward in training: the stages compute on low-precision copies \
                 whose gradients only forward_backward carries to the f32 variables"
                    .into(),
            ));
        }
        if let (true, Some((stage, var, device))) = (train, self.copied_vars.first()) {
            return Err(Error::DropInWithCopiedVar {
                stage: *stage,
                var: var.clone(),
                device: device.clone(),
            });
        }
        let _step = lock(&self.step);
        let inputs = self.micro_batches(&self.input(x)?)?;
        let count = inputs.len();
        let step = self.run_step(inputs, None, train)?;
        let last = step
            .outputs
            .last()
            .map(|o| o.outputs.as_slice())
            .unwrap_or_default();
        if last.len() != count {
            return Err(Error::Candle(candle_core::Error::Msg(format!(
                "the last stage returned {} outputs for {count} micro-batches",
                last.len()
            ))));
        }
        let output = match last {
            [only] => only.clone(),
            _ => Tensor::cat(last, 0)?,
        };
        self.commit(&step)?;
        Ok(output)
    }

    /// The fast path: splits `x` and `y` into micro-batches, computes
    /// `loss_fn(output, targets)` of each on the last stage and runs each
    /// stage's backward on its device's worker, in the configured schedule.
    /// Returns the loss (the sum of the weighted micro-batch losses, on the
    /// last stage's device) and the gradients of every variable.
    pub fn forward_backward<F>(
        &self,
        x: &Tensor,
        y: &Tensor,
        reduction: LossReduction,
        loss_fn: F,
    ) -> Result<Step>
    where
        F: Fn(&Tensor, &Tensor) -> candle_core::Result<Tensor> + Send + Sync + 'static,
    {
        let (step, ran) = self.forward_backward_uncommitted(x, y, reduction, loss_fn)?;
        self.commit_step(ran)?;
        Ok(step)
    }

    /// [`forward_backward`](Self::forward_backward) but for the commit of
    /// the stages' buffers, which the caller makes with
    /// [`commit_step`](Self::commit_step) once the rest of its step (DDP's
    /// all-reduce) has succeeded too: a failed step changes nothing. The
    /// step lock is held until then (dropping the step uncommitted lets it
    /// go), so that concurrent steps each read the buffers the one before
    /// committed.
    fn forward_backward_uncommitted<F>(
        &self,
        x: &Tensor,
        y: &Tensor,
        reduction: LossReduction,
        loss_fn: F,
    ) -> Result<(Step, Uncommitted<'_>)>
    where
        F: Fn(&Tensor, &Tensor) -> candle_core::Result<Tensor> + Send + Sync + 'static,
    {
        let step_lock = lock(&self.step);
        let inputs = self.micro_batches(&self.input(x)?)?;
        let targets = self.micro_batches(y)?;
        if targets
            .iter()
            .map(|t| t.dim(0).ok())
            .ne(inputs.iter().map(|t| t.dim(0).ok()))
        {
            return Err(Error::ScatterSizeMismatch {
                dim: 0,
                expected: x.dims().first().copied().unwrap_or(0),
                leaf: 1,
                found: y.dims().first().copied().unwrap_or(0),
                shape: y.dims().to_vec(),
            });
        }
        let rows = x.dim(0)? as f64;
        let shares = inputs
            .iter()
            .map(|t| match reduction {
                LossReduction::Mean => Ok(t.dim(0)? as f64 / rows),
                LossReduction::Sum => Ok(1.0),
            })
            .collect::<candle_core::Result<Vec<f64>>>()?;
        let loss = TrainLoss {
            loss_fn: Arc::new(loss_fn) as Arc<LossFn>,
            targets,
            shares,
        };
        let step = self.run_step(inputs, Some(loss), true)?;
        let outputs = &step.outputs;
        let mut grads = GradStore::default();
        for (vars, output) in self.stage_vars.iter().zip(outputs) {
            for ((_, var), grad) in vars.iter().zip(&output.grads) {
                let Some(grad) = grad else { continue };
                // A variable of several stages (tied) gets the sum.
                let sum = match grads.get(var.as_tensor()) {
                    Some(earlier) => (earlier + grad)?,
                    None => grad.clone(),
                };
                grads.insert(var.as_tensor(), sum);
            }
        }
        let losses = outputs.last().map(|o| o.losses.clone()).unwrap_or_default();
        let mut loss = match losses.first() {
            Some(first) => first.clone(),
            None => Tensor::zeros((), DType::F32, self.last_device())?,
        };
        for l in losses.iter().skip(1) {
            loss = (loss + l)?;
        }
        let without_grad = self.no_grad.check("Pipeline", &self.params, &grads);
        let done = Step {
            loss,
            grads,
            without_grad,
        };
        let uncommitted = Uncommitted {
            ran: step,
            _step: step_lock,
        };
        Ok((done, uncommitted))
    }

    fn last_device(&self) -> &Device {
        self.devices.last().unwrap_or(&Device::Cpu)
    }

    /// `x` in `torch.chunk` micro-batches along dim 0.
    /// With mixed precision, a floating-point input in the compute dtype.
    fn input(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match self.compute_dtype {
            Some(dtype) => crate::precision::cast_input(x, dtype)?,
            None => x.clone(),
        })
    }

    fn micro_batches(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        let rows = x
            .dims()
            .first()
            .copied()
            .ok_or(Error::ScatterDimOutOfRange {
                dim: 0,
                leaf: 0,
                rank: 0,
                shape: Vec::new(),
            })?;
        if rows == 0 {
            return Err(Error::Candle(candle_core::Error::Msg(
                "a pipeline step needs at least one row".into(),
            )));
        }
        let mut start = 0;
        chunk_sizes(rows, self.chunks)
            .into_iter()
            .map(|n| {
                let part = x.narrow(0, start, n)?;
                start += n;
                Ok(part)
            })
            .collect()
    }

    /// One step on every stage: their channels, their work, their results.
    /// The stages' buffers are not committed here: see [`commit`](Self::commit).
    fn run_step(
        &self,
        inputs: Vec<Tensor>,
        loss: Option<TrainLoss>,
        train: bool,
    ) -> Result<RanStep> {
        let devices = self.devices.len();
        let stages = self.balance.len();
        let chunks = inputs.len();
        let board: Board = Arc::new((0..stages).map(|_| Mutex::new(Doing::NotStarted)).collect());
        let mut links: Vec<Links> = (0..stages).map(|_| Links::default()).collect();
        for s in 1..stages {
            let (act_tx, act_rx) = channel::unbounded();
            let (grad_tx, grad_rx) = channel::unbounded();
            links[s - 1].to_next = Some(Outbox::Channel(act_tx));
            links[s].from_prev = Some(Inbox::Channel(act_rx));
            if loss.is_some() {
                links[s].grad_to_prev = Some(Outbox::Channel(grad_tx));
                links[s - 1].grad_from_next = Some(Inbox::Channel(grad_rx));
            }
        }
        // Each taken once, by its stage's work.
        let mut links: Vec<Option<Links>> = links.into_iter().map(Some).collect();
        let started = std::time::Instant::now();
        let mut inputs = Some(inputs);
        let mut loss = loss;
        let training = loss.is_some();
        let mut stage_work = |index: usize| StageWork {
            index,
            chunks,
            device: self.devices[index % devices].clone(),
            inputs: if index == 0 {
                inputs.take().unwrap_or_default()
            } else {
                Vec::new()
            },
            links: links
                .get_mut(index)
                .and_then(Option::take)
                .unwrap_or_default(),
            board: Arc::clone(&board),
            training,
            // Only the last stage computes the loss.
            loss: if index + 1 == stages {
                loss.take()
            } else {
                None
            },
            train: training || train,
            checkpoint: self.checkpoint,
            computing_since: std::cell::Cell::new(None),
            busy: std::cell::Cell::new(Duration::ZERO),
            checking: std::cell::Cell::new(Duration::ZERO),
        };
        let jobs: Vec<_> = (0..devices)
            .map(|device| {
                let work = DeviceWork {
                    stages: device_work::stages_of(device, devices, stages)
                        .map(&mut stage_work)
                        .collect(),
                    tasks: if training {
                        self.schedule.tasks(device, devices, chunks)
                    } else {
                        self.schedule.forward_tasks(device, devices, chunks)
                    },
                };
                move |held: &mut Vec<Stage>, cancel: &crate::worker_pool::Cancel| {
                    work.run(held, cancel)
                }
            })
            .collect();
        let per_device: Vec<DeviceOutput> = self
            .pool
            .run(jobs, self.timeout)
            .map_err(|failure| self.stage_error(failure, &board))?;
        let busy = per_device.iter().map(|d| d.busy).collect();
        let checking = per_device.iter().map(|d| d.checking).collect();
        let peak_saved_bytes = per_device.iter().map(|d| d.peak_saved_bytes).collect();
        let outputs = device_work::in_stage_order(
            per_device.into_iter().map(|d| d.stages).collect(),
            stages,
        )?;
        Ok(RanStep {
            outputs,
            busy,
            checking,
            peak_saved_bytes,
            time: started.elapsed(),
        })
    }

    /// [`commit`](Self::commit) of a step run by
    /// [`forward_backward_uncommitted`](Self::forward_backward_uncommitted),
    /// then its step lock let go.
    fn commit_step(&self, step: Uncommitted<'_>) -> Result<()> {
        self.commit(&step.ran)
    }

    /// The end of a step that succeeded as a whole (its caller's work on
    /// the stages' results included): the buffers' new values go into the
    /// `VarMap` (all converted first, so that none changes unless all can),
    /// and the step's timings are recorded.
    fn commit(&self, step: &RanStep) -> Result<()> {
        let mut updates = Vec::new();
        for output in &step.outputs {
            for (var, value) in &output.buffers {
                // A mixed-precision stage's buffers are in the compute dtype.
                let value = crate::device_copy::to_device(value, var.device())?;
                updates.push((var, value.to_dtype(var.dtype())?));
            }
        }
        for (var, value) in updates {
            var.set(&value)?;
        }
        *lock(&self.timings) = PipelineTimings {
            step: step.time,
            busy: step.busy.clone(),
            checking: step.checking.clone(),
            peak_saved_bytes: step.peak_saved_bytes.clone(),
        };
        Ok(())
    }

    /// The error naming the stage that failed, or that held the step up.
    fn stage_error(&self, failure: WorkerFailure<DeviceFailure>, board: &Board) -> Error {
        let doing = |stage: usize| board.get(stage).map(|slot| *lock(slot));
        let computing = |stage: usize| match doing(stage) {
            Some(Doing::Computing {
                phase,
                micro_batch,
                since,
            }) => Some((phase, micro_batch, since)),
            _ => None,
        };
        let stage_error = |stage: usize, source: candle_core::Error| {
            let (phase, micro_batch) =
                computing(stage).map_or((stage::Phase::Forward, 0), |(phase, m, _)| (phase, m));
            Error::Stage {
                stage,
                device: self.label(stage),
                micro_batch,
                phase: phase.name(),
                source: Box::new(source),
            }
        };
        match failure.failure {
            Failure::Error(DeviceFailure { stage, failure: f }) => Error::Stage {
                stage,
                device: failure.device,
                micro_batch: f.micro_batch,
                phase: f.phase.name(),
                source: Box::new(f.source),
            },
            Failure::Panic(message) => stage_error(
                self.stage_computing_on(failure.worker, board),
                candle_core::Error::Msg(format!("panicked: {message}")),
            ),
            Failure::NoAnswer(NoAnswer::Timeout(timeout)) => {
                // A stage whose worker is still stuck in an earlier step
                // has held this one up from its start; else the stage
                // computing for the longest, not the ones waiting for it.
                let stages = 0..self.balance.len();
                let longest = stages
                    .clone()
                    .filter_map(|s| computing(s).map(|(_, _, since)| (s, since)))
                    .min_by_key(|&(_, since)| since)
                    .map(|(s, _)| s);
                let stuck = stages
                    .clone()
                    .find(|&s| doing(s) == Some(Doing::NotStarted));
                let stage = stuck.or(longest).unwrap_or(failure.worker);
                let what = match doing(stage) {
                    Some(Doing::Computing {
                        phase, micro_batch, ..
                    }) => format!(", in the {} of micro-batch {micro_batch}", phase.name()),
                    Some(Doing::NotStarted) => {
                        ", its worker still busy with an earlier step that did not finish".into()
                    }
                    _ => String::new(),
                };
                Error::StageTimeout {
                    stage,
                    device: self.label(stage),
                    doing: what,
                    timeout,
                }
            }
            Failure::NoAnswer(why) => stage_error(
                self.stage_computing_on(failure.worker, board),
                candle_core::Error::Msg(format!("its worker did not answer: {why:?}")),
            ),
        }
    }

    /// The stage of device `device` that was computing (its first stage
    /// when none was).
    fn stage_computing_on(&self, device: usize, board: &Board) -> usize {
        (device..self.balance.len())
            .step_by(self.devices.len().max(1))
            .find(|&s| {
                board
                    .get(s)
                    .is_some_and(|slot| matches!(*lock(slot), Doing::Computing { .. }))
            })
            .unwrap_or(device)
    }

    /// The label of the device of `stage`.
    fn label(&self, stage: usize) -> String {
        self.devices
            .get(stage % self.devices.len().max(1))
            .map_or_else(|| "?".into(), device_label)
    }
}
