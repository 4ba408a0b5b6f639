//! `DataParallel`: one master model, one replica per device, every step
//! scatter -> replicate -> parallel_apply -> gather, and gradients reduced
//! back onto the master. `torch.nn.DataParallel`'s semantics.

use std::marker::PhantomData;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, TensorId, Var};
use candle_nn::{Module, ModuleT, VarBuilder, VarMap};

use crate::buffers::{is_batch_norm_buffer, BufferPredicate};
use crate::device_label::device_label;
use crate::error::{Error, Result};
use crate::lock::lock;
use crate::no_grad::NoGradCheck;
use crate::parallel_apply::{parallel_apply, Cancel, Replica, Worker};
use crate::reduce::{balanced_partition, sum_gradients};
use crate::replicate::{build_master, build_replica, ReplicaVars};
use crate::scatter_gather::{gather, scatter, Gather, Scatter, ScatterPlan, Split};
use crate::vars::{grads_of, sorted_vars};

/// How a loss computed on each replica combines into the global loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LossReduction {
    /// The replica's loss is a mean over its rows: it is weighted by its
    /// share of the batch (`rows_i / rows`), so the sum over replicas is the
    /// mean over the whole batch and the gradients equal single-device
    /// training on the full batch.
    #[default]
    Mean,
    /// The replica's loss is a sum over its rows: replica losses add up.
    Sum,
}

/// Where the time of the latest step went: the parallel phases count the
/// slowest replica (the critical path). For benchmarks and profiling.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTimings {
    /// Planning, splitting and moving the inputs.
    pub scatter: Duration,
    /// Refreshing replicas from the master (copies to other devices, buffers).
    pub replicate: Duration,
    /// Forward (and replica loss) on the slowest replica.
    pub forward: Duration,
    /// Backward on the slowest replica (parallel paths only).
    pub backward: Duration,
    /// Summing replica gradients onto the master.
    pub reduce: Duration,
    /// Concatenating outputs or summing losses on the output device.
    pub gather: Duration,
    /// Wall time of the calls that made up the step.
    pub total: Duration,
}

/// Gradients of the master variables and the loss they came from.
#[derive(Debug)]
pub struct Step {
    /// The global loss (detached), on the output device.
    pub loss: Tensor,
    /// Gradients keyed by the master variables: pass to any candle
    /// `Optimizer::step`.
    pub grads: GradStore,
    without_grad: Vec<String>,
}

impl Step {
    /// The master parameters (buffers excluded) that received no gradient
    /// in this step, sorted: they are not trained. PyTorch's DDP names such
    /// parameters; a common cause in candle is a layer whose kernel has no
    /// backward, such as candle-nn 0.11's fused `LayerNorm` (use
    /// `candle_nn::ops::layer_norm_slow` in training). The first step with
    /// any also logs a `tracing` warning.
    pub fn vars_without_grad(&self) -> &[String] {
        &self.without_grad
    }
}

/// PyTorch-style data parallelism over several devices in one process.
///
/// The master model's variables live in the caller's [`VarMap`] on
/// `devices[0]`; one replica per device is built once from the same model
/// code and kept in step with the master. Each forward splits the batch
/// along `dim` (torch.chunk sizes), runs the replicas in parallel on their
/// own persistent threads and concatenates the outputs on the output device.
///
/// Gradients reach the master in either of two ways, with equal results:
/// - **drop-in**: the gathered output is connected to the master variables,
///   so `loss.backward()` / `optimizer.backward_step(&loss)` just work;
/// - **parallel**: [`backward`](Self::backward),
///   [`backward_from_loss`](Self::backward_from_loss) or
///   [`forward_backward`](Self::forward_backward) run each replica's backward
///   on its own thread and reduce-add into a [`GradStore`] keyed by the
///   master variables, for any candle `Optimizer::step`.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_nn::{linear, loss, Linear, Module, Optimizer, VarMap, SGD};
/// use candle_dp::{cpu_devices, DataParallel};
///
/// # fn main() -> anyhow::Result<()> {
/// let varmap = VarMap::new();
/// let dp = DataParallel::new(&varmap, DType::F32, &cpu_devices(2), |vb| linear(4, 3, vb))?;
/// let mut sgd = SGD::new(varmap.all_vars(), 0.1)?;
///
/// let x = Tensor::randn(0f32, 1., (8, 4), &Device::Cpu)?;
/// let y = Tensor::new(&[0u32, 1, 2, 0, 1, 2, 0, 1], &Device::Cpu)?;
/// let logits = dp.forward(&x)?; // rows 0..4 on replica 0, 4..8 on replica 1
/// let loss = loss::cross_entropy(&logits, &y)?;
/// sgd.backward_step(&loss)?; // the master vars get the full-batch gradient
/// # Ok(())
/// # }
/// ```
pub struct DataParallel<M: 'static> {
    workers: Vec<Worker<M>>,
    replica_vars: Vec<Arc<ReplicaVars>>,
    devices: Vec<Device>,
    output_device: Device,
    dim: usize,
    timeout: Option<Duration>,
    master_vars: Arc<Vec<(String, Var)>>,
    last_forward: Mutex<Option<SavedForward>>,
    timings: Mutex<StepTimings>,
    /// Held for a whole step: concurrent callers take turns, so a step's
    /// buffer refresh never meets another step's commit.
    step: Mutex<()>,
    /// The master variables that are trained (not buffers).
    params: Vec<(String, Var)>,
    no_grad: NoGradCheck,
    /// The parameters without a gradient in the latest parallel backward.
    without_grad: Mutex<Vec<String>>,
}

/// What [`DataParallel::backward`] needs from the forward it differentiates.
struct SavedForward {
    gathered: TensorId,
    outputs: Vec<Tensor>,
}

/// Configures a [`DataParallel`]; made by [`DataParallel::builder`].
pub struct DataParallelBuilder<M> {
    model: PhantomData<fn() -> M>,
    varmap: VarMap,
    dtype: DType,
    devices: Vec<Device>,
    output_device: Option<Device>,
    dim: usize,
    threads_per_replica: Option<usize>,
    timeout: Option<Duration>,
    is_buffer: BufferPredicate,
}

impl<M: 'static> DataParallelBuilder<M> {
    /// The dimension batches are split and outputs concatenated along (default 0).
    pub fn dim(mut self, dim: usize) -> Self {
        self.dim = dim;
        self
    }

    /// Where outputs are gathered (default `devices[0]`).
    pub fn output_device(mut self, device: Device) -> Self {
        self.output_device = Some(device);
        self
    }

    /// Threads in each replica's rayon pool. Default: on CPU, the available
    /// cores divided by the number of replicas (at least 1), so replicas do
    /// not fight over cores; on GPUs, 1.
    pub fn threads_per_replica(mut self, threads: usize) -> Self {
        self.threads_per_replica = Some(threads.max(1));
        self
    }

    /// Longest time a step waits for its replicas, and [`build`](Self::build)
    /// for each model factory call, before failing with
    /// [`Error::ReplicaTimeout`] (default: no limit).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Which variables are buffers, updated by the forward pass itself
    /// (default: [`is_batch_norm_buffer`], candle-nn's BatchNorm statistics).
    /// Replicas work on private copies of buffers; replica 0's are written
    /// back to the master after each successful step.
    pub fn buffers(mut self, is_buffer: impl Fn(&str) -> bool + Send + Sync + 'static) -> Self {
        self.is_buffer = Arc::new(is_buffer);
        self
    }

    /// Builds the master model on `first` through [`build_master`]; with a
    /// [`timeout`](Self::timeout), on a thread of its own, so that a factory
    /// that never returns ends in [`Error::ReplicaTimeout`] (replica 0)
    /// instead of a hang. That thread is left behind: should the factory
    /// return later, it may still create variables in the `VarMap`.
    fn build_master_bounded<F>(&self, first: &Device, factory: &Arc<F>) -> Result<()>
    where
        F: Fn(VarBuilder) -> candle_core::Result<M> + Send + Sync + 'static,
    {
        let Some(timeout) = self.timeout else {
            return build_master(&self.varmap, self.dtype, first, &**factory);
        };
        let (done_tx, done) = crossbeam::channel::bounded(1);
        let (varmap, dtype, device, factory) = (
            self.varmap.clone(),
            self.dtype,
            first.clone(),
            Arc::clone(factory),
        );
        std::thread::Builder::new()
            .name("candle-dp-build-master".into())
            .spawn(move || {
                let _ = done_tx.send(build_master(&varmap, dtype, &device, &*factory));
            })
            .map_err(|e| {
                Error::Candle(candle_core::Error::Msg(format!(
                    "cannot start the thread that builds the master model: {e}"
                )))
            })?;
        match done.recv_timeout(timeout) {
            Ok(built) => built,
            Err(crossbeam::channel::RecvTimeoutError::Timeout) => Err(Error::ReplicaTimeout {
                replica: 0,
                device: device_label(first),
                timeout,
            }),
            Err(crossbeam::channel::RecvTimeoutError::Disconnected) => {
                Err(Error::Candle(candle_core::Error::Msg(
                    "the thread that builds the master model stopped without an answer".into(),
                )))
            }
        }
    }

    /// Builds the master model (creating its variables in the `VarMap` on
    /// `devices[0]` unless they exist) and one replica per device. With a
    /// [`timeout`](Self::timeout), each build must finish within it.
    pub fn build<F>(self, factory: F) -> Result<DataParallel<M>>
    where
        F: Fn(VarBuilder) -> candle_core::Result<M> + Send + Sync + 'static,
    {
        let first = self.devices.first().ok_or(Error::NoDevices)?.clone();
        // Before the master's factory runs its first candle ops.
        crate::cpu_threads::share_cpu_between(self.devices.iter().filter(|d| d.is_cpu()).count());
        let factory = Arc::new(factory);
        self.build_master_bounded(&first, &factory)?;
        let threads = self.threads_per_replica.unwrap_or_else(|| {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            if self.devices.iter().all(Device::is_cpu) {
                (cores / self.devices.len()).max(1)
            } else {
                1
            }
        });
        let mut workers = Vec::with_capacity(self.devices.len());
        let mut replica_vars = Vec::with_capacity(self.devices.len());
        for (index, device) in self.devices.iter().enumerate() {
            let (varmap, dtype, dev) = (self.varmap.clone(), self.dtype, device.clone());
            let (factory, is_buffer) = (factory.clone(), self.is_buffer.clone());
            let (worker, vars) = Worker::start(index, device, threads, self.timeout, move || {
                let (model, vars) =
                    build_replica(index, &varmap, dtype, &dev, is_buffer, &*factory)?;
                Ok(Replica {
                    model,
                    vars: Arc::new(vars),
                })
            })?;
            workers.push(worker);
            replica_vars.push(vars);
        }
        Ok(DataParallel {
            workers,
            replica_vars,
            output_device: self.output_device.unwrap_or(first),
            devices: self.devices,
            dim: self.dim,
            timeout: self.timeout,
            params: sorted_vars(&self.varmap)
                .into_iter()
                .filter(|(name, _)| !(self.is_buffer)(name))
                .collect(),
            no_grad: NoGradCheck::default(),
            without_grad: Mutex::new(Vec::new()),
            master_vars: Arc::new(sorted_vars(&self.varmap)),
            last_forward: Mutex::new(None),
            timings: Mutex::new(StepTimings::default()),
            step: Mutex::new(()),
        })
    }
}

impl<M: 'static> DataParallel<M> {
    /// A [`DataParallel`] with default settings: split along dim 0, gather on
    /// `devices[0]`. `factory` is the user's model code; it is called once
    /// for the master and once per replica.
    pub fn new<F>(varmap: &VarMap, dtype: DType, devices: &[Device], factory: F) -> Result<Self>
    where
        F: Fn(VarBuilder) -> candle_core::Result<M> + Send + Sync + 'static,
    {
        Self::builder(varmap, dtype, devices).build(factory)
    }

    /// Starts configuring a [`DataParallel`] (dim, output device, threads,
    /// timeout, buffers).
    pub fn builder(varmap: &VarMap, dtype: DType, devices: &[Device]) -> DataParallelBuilder<M> {
        DataParallelBuilder {
            model: PhantomData,
            varmap: varmap.clone(),
            dtype,
            devices: devices.to_vec(),
            output_device: None,
            dim: 0,
            threads_per_replica: None,
            timeout: None,
            is_buffer: Arc::new(is_batch_norm_buffer),
        }
    }

    /// The devices, one replica each; `devices()[0]` holds the master.
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// Where outputs are gathered.
    pub fn output_device(&self) -> &Device {
        &self.output_device
    }

    /// The scatter / gather dimension.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The master variables, sorted by name.
    pub fn vars(&self) -> &[(String, Var)] {
        &self.master_vars
    }

    /// Runs a [`Module`] on the batch: scatter, replicas in parallel, gather.
    /// The result is connected to the master variables (drop-in backward) and
    /// remembered for [`backward`](Self::backward).
    pub fn forward(&self, input: &Tensor) -> Result<Tensor>
    where
        M: Module,
    {
        self.forward_saved(input.clone(), |model: &M, x: Tensor| model.forward(&x))
    }

    /// Like [`forward`](Self::forward) for a [`ModuleT`] (train / eval flag,
    /// e.g. BatchNorm, Dropout).
    pub fn forward_t(&self, input: &Tensor, train: bool) -> Result<Tensor>
    where
        M: ModuleT,
    {
        self.forward_saved(input.clone(), move |model: &M, x: Tensor| {
            model.forward_t(&x, train)
        })
    }

    fn forward_saved<F>(&self, input: Tensor, f: F) -> Result<Tensor>
    where
        F: Fn(&M, Tensor) -> candle_core::Result<Tensor> + Send + Sync + 'static,
    {
        let _step = lock(&self.step);
        // Drop the previous step's graph before building the next one.
        *lock(&self.last_forward) = None;
        let outputs = self.scatter_apply(input, &Split::Even, move |model, x, _| f(model, x))?;
        let start = Instant::now();
        let gathered = self.gather(outputs.clone())?;
        self.record(|t| {
            t.gather = start.elapsed();
            t.total += t.gather;
        });
        self.commit_buffers()?;
        *lock(&self.last_forward) = Some(SavedForward {
            gathered: gathered.id(),
            outputs,
        });
        Ok(gathered)
    }

    /// Runs any function of the model on a nested input: every tensor in
    /// `input` is split along the dim (see [`Scatter`]), `f` runs on each
    /// replica with its part, and the outputs are gathered (see [`Gather`]).
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use candle_nn::{linear, Module, VarMap};
    /// use candle_dp::{cpu_devices, DataParallel, Split};
    ///
    /// # fn main() -> anyhow::Result<()> {
    /// let varmap = VarMap::new();
    /// let dp = DataParallel::new(&varmap, DType::F32, &cpu_devices(3), |vb| linear(2, 2, vb))?;
    /// let x = Tensor::zeros((7, 2), DType::F32, &Device::Cpu)?;
    /// let scale = 0.5f64; // not a tensor: every replica gets it
    /// let (y, rows) = dp.apply_split((x, scale), &Split::Sizes(vec![4, 3]), |m, (x, s)| {
    ///     let rows = Tensor::new(&[x.dim(0)? as u32], x.device())?;
    ///     Ok((m.forward(&x)?.affine(s, 0.)?, rows))
    /// })?;
    /// assert_eq!(y.dims(), &[7, 2]);
    /// assert_eq!(rows.to_vec1::<u32>()?, vec![4, 3]);
    /// # Ok(())
    /// # }
    /// ```
    pub fn apply<I, O, F>(&self, input: I, f: F) -> Result<O>
    where
        I: Scatter + Send + 'static,
        O: Gather + Send + 'static,
        F: Fn(&M, I) -> candle_core::Result<O> + Send + Sync + 'static,
    {
        self.apply_split(input, &Split::Even, f)
    }

    /// [`apply`](Self::apply) with an explicit [`Split`].
    pub fn apply_split<I, O, F>(&self, input: I, split: &Split, f: F) -> Result<O>
    where
        I: Scatter + Send + 'static,
        O: Gather + Send + 'static,
        F: Fn(&M, I) -> candle_core::Result<O> + Send + Sync + 'static,
    {
        let _step = lock(&self.step);
        let outputs = self.scatter_apply(input, split, move |model, x, _| f(model, x))?;
        let gathered = gather(outputs, self.dim, &self.output_device)?;
        self.commit_buffers()?;
        Ok(gathered)
    }

    /// The pipeline shared by every forward: scatter, refresh the replicas
    /// from the master, run them in parallel. The caller commits replica 0's
    /// buffers ([`commit_buffers`](Self::commit_buffers)) once the whole step
    /// has succeeded, so a failed step leaves the master untouched.
    fn scatter_apply<I, R, F>(&self, input: I, split: &Split, f: F) -> Result<Vec<R>>
    where
        I: Scatter + Send + 'static,
        R: Send + 'static,
        F: Fn(&M, I, &Cancel) -> candle_core::Result<R> + Send + Sync + 'static,
    {
        let start = Instant::now();
        let inputs = match ScatterPlan::for_input(&input, self.dim, split, &self.devices)? {
            Some(plan) => scatter(&input, &plan)?,
            // Nothing to split: the model runs once, on the first device.
            None => vec![input],
        };
        let scattered = Instant::now();
        let results = parallel_apply(
            &self.workers,
            inputs,
            self.timeout,
            move |replica, x, cancel| {
                let t0 = Instant::now();
                replica.vars.refresh()?;
                let t1 = Instant::now();
                let out = f(&replica.model, x, cancel)?;
                Ok((out, t1 - t0, t1.elapsed()))
            },
        )?;
        let slowest = |pick: fn(&(R, Duration, Duration)) -> Duration| {
            results.iter().map(pick).max().unwrap_or_default()
        };
        *lock(&self.timings) = StepTimings {
            scatter: scattered - start,
            replicate: slowest(|r| r.1),
            forward: slowest(|r| r.2),
            total: start.elapsed(),
            ..StepTimings::default()
        };
        Ok(results.into_iter().map(|r| r.0).collect())
    }

    /// The master parameters (buffers excluded) that received no gradient
    /// in the latest parallel backward ([`backward`](Self::backward),
    /// [`backward_from_loss`](Self::backward_from_loss),
    /// [`forward_backward`](Self::forward_backward)); see
    /// [`Step::vars_without_grad`].
    pub fn vars_without_grad(&self) -> Vec<String> {
        lock(&self.without_grad).clone()
    }

    fn record_without_grad(&self, grads: &GradStore) -> Vec<String> {
        let missing = self.no_grad.check("DataParallel", &self.params, grads);
        lock(&self.without_grad).clone_from(&missing);
        missing
    }

    /// Keeps replica 0's buffers (BatchNorm statistics), as PyTorch does:
    /// the last part of a successful step.
    fn commit_buffers(&self) -> Result<()> {
        Ok(self.replica_vars[0].commit_buffers()?)
    }

    /// Where the time of the latest step went (forward plus, for the
    /// parallel paths, backward and reduce).
    pub fn last_timings(&self) -> StepTimings {
        *lock(&self.timings)
    }

    fn record(&self, update: impl FnOnce(&mut StepTimings)) {
        update(&mut lock(&self.timings))
    }

    fn gather(&self, outputs: Vec<Tensor>) -> Result<Tensor> {
        gather(outputs, self.dim, &self.output_device)
    }

    /// Parallel backward from the gradient of the gathered output: each
    /// replica back-propagates its slice of `grad_output` on its own thread,
    /// and the gradients are summed into a store keyed by the master vars.
    ///
    /// `output` must be the result of this `DataParallel`'s most recent
    /// [`forward`](Self::forward) / [`forward_t`](Self::forward_t).
    pub fn backward(&self, output: &Tensor, grad_output: &Tensor) -> Result<GradStore> {
        self.backward_reporting(output, grad_output)
            .map(|(grads, _)| grads)
    }

    /// [`backward`](Self::backward), with the parameters that got no
    /// gradient in this very step (another thread's step may follow at once).
    fn backward_reporting(
        &self,
        output: &Tensor,
        grad_output: &Tensor,
    ) -> Result<(GradStore, Vec<String>)> {
        let _step = lock(&self.step);
        let start = Instant::now();
        // Checked before the saved forward is taken, so that a corrected
        // retry still finds it.
        if grad_output.dims() != output.dims() || grad_output.dtype() != output.dtype() {
            return Err(Error::NoMatchingForward(format!(
                "grad_output is {:?} {:?} but the output is {:?} {:?}",
                grad_output.dtype(),
                grad_output.dims(),
                output.dtype(),
                output.dims()
            )));
        }
        let saved = self.take_saved(output)?;
        let plan = self.output_plan(&saved.outputs)?;
        let grads = scatter(grad_output, &plan)?;
        let parts: Vec<(Tensor, Tensor)> = saved.outputs.into_iter().zip(grads).collect();
        let master = self.master_vars.clone();
        let results = parallel_apply(
            &self.workers,
            parts,
            self.timeout,
            move |_, (out, grad), _| {
                let t0 = Instant::now();
                // d/d(out) of sum(out * grad) is exactly `grad`.
                let seeded = (&out * grad.reshape(out.shape())?.detach())?.sum_all()?;
                Ok((grads_of(&seeded.backward()?, &master), t0.elapsed()))
            },
        )?;
        let backward = results.iter().map(|r| r.1).max().unwrap_or_default();
        let reduce_start = Instant::now();
        let grads = self.reduce_add(results.into_iter().map(|r| r.0).collect())?;
        let without_grad = self.record_without_grad(&grads);
        self.record(|t| {
            t.backward = backward;
            t.reduce = reduce_start.elapsed();
            t.total += start.elapsed();
        });
        Ok((grads, without_grad))
    }

    /// Computes `loss_fn` on the gathered output (on the output device) and
    /// runs the backward in parallel on the replicas: any loss, including
    /// ones that do not split over rows, with a parallel backward.
    /// Returns the loss and the master gradients.
    pub fn backward_from_loss<F>(&self, output: &Tensor, loss_fn: F) -> Result<Step>
    where
        F: FnOnce(&Tensor) -> candle_core::Result<Tensor>,
    {
        // A detached copy as a variable: the loss's backward stops there and
        // yields exactly the gradient of the gathered output.
        let leaf = Var::from_tensor(&output.detach())?;
        let loss = loss_fn(leaf.as_tensor())?;
        let grad_output = match loss.backward()?.remove(leaf.as_tensor()) {
            Some(grad) => grad,
            None => output.zeros_like()?,
        };
        let (grads, without_grad) = self.backward_reporting(output, &grad_output)?;
        Ok(Step {
            loss: loss.detach(),
            grads,
            without_grad,
        })
    }

    /// The fast path: each replica computes its output and its own loss on
    /// its part of `input` (e.g. `(x, y)`: targets are scattered with the
    /// inputs) and back-propagates on its own thread; nothing is gathered
    /// but the loss. With [`LossReduction::Mean`] each replica's loss is
    /// weighted by its share of the rows, so the result equals single-device
    /// training on the whole batch.
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use candle_nn::{linear, loss, Module, Optimizer, VarMap, SGD};
    /// use candle_dp::{cpu_devices, DataParallel, LossReduction};
    ///
    /// # fn main() -> anyhow::Result<()> {
    /// let varmap = VarMap::new();
    /// let dp = DataParallel::new(&varmap, DType::F32, &cpu_devices(2), |vb| linear(4, 3, vb))?;
    /// let mut sgd = SGD::new(varmap.all_vars(), 0.1)?;
    /// let x = Tensor::randn(0f32, 1., (6, 4), &Device::Cpu)?;
    /// let y = Tensor::new(&[0u32, 1, 2, 0, 1, 2], &Device::Cpu)?;
    /// let step = dp.forward_backward((x, y), LossReduction::Mean, |m, (x, y)| {
    ///     loss::cross_entropy(&m.forward(&x)?, &y)
    /// })?;
    /// sgd.step(&step.grads)?;
    /// println!("loss {}", step.loss.to_scalar::<f32>()?);
    /// # Ok(())
    /// # }
    /// ```
    pub fn forward_backward<I, F>(
        &self,
        input: I,
        reduction: LossReduction,
        loss_fn: F,
    ) -> Result<Step>
    where
        I: Scatter + Send + 'static,
        F: Fn(&M, I) -> candle_core::Result<Tensor> + Send + Sync + 'static,
    {
        let _step = lock(&self.step);
        let (dim, rows) = (self.dim, batch_rows(&input, self.dim));
        let master = self.master_vars.clone();
        let results = self.scatter_apply(input, &Split::Even, move |model, part, cancel| {
            let share = match (reduction, rows) {
                (LossReduction::Mean, Some(rows)) if rows > 0 => {
                    batch_rows(&part, dim).unwrap_or(rows) as f64 / rows as f64
                }
                _ => 1.0,
            };
            let loss = loss_fn(model, part)?;
            if loss.elem_count() != 1 {
                candle_core::bail!("the loss must be a scalar, got shape {:?}", loss.dims());
            }
            let weighted = loss.reshape(())?.affine(share, 0.)?;
            if cancel.is_cancelled() {
                candle_core::bail!("step abandoned: another replica failed");
            }
            let t0 = Instant::now();
            let grads = grads_of(&weighted.backward()?, &master);
            Ok((weighted.detach(), grads, t0.elapsed()))
        })?;
        let backward = results.iter().map(|r| r.2).max().unwrap_or_default();
        let gather_start = Instant::now();
        let mut loss = results[0].0.to_device(&self.output_device)?;
        for r in &results[1..] {
            loss = (loss + r.0.to_device(&self.output_device)?)?;
        }
        let reduce_start = Instant::now();
        let grads = self.reduce_add(results.into_iter().map(|r| r.1).collect())?;
        self.commit_buffers()?;
        self.record(|t| {
            // The replicas' work time included their backward.
            t.forward = t.forward.saturating_sub(backward);
            t.backward = backward;
            t.gather = reduce_start - gather_start;
            t.reduce = reduce_start.elapsed();
            t.total += gather_start.elapsed();
        });
        Ok(Step {
            loss,
            without_grad: self.record_without_grad(&grads),
            grads,
        })
    }

    fn take_saved(&self, output: &Tensor) -> Result<SavedForward> {
        let mut last = lock(&self.last_forward);
        match last.take() {
            Some(saved) if saved.gathered == output.id() => Ok(saved),
            Some(saved) => {
                *last = Some(saved);
                Err(Error::NoMatchingForward(
                    "this tensor is not the latest output (was it transformed, or from an older step?)".into(),
                ))
            }
            None => Err(Error::NoMatchingForward(
                "there is none (no forward yet, or its backward already ran)".into(),
            )),
        }
    }

    /// Rows of the gathered output that came from each replica.
    fn output_plan(&self, outputs: &[Tensor]) -> Result<ScatterPlan> {
        let sizes = outputs
            .iter()
            .map(|out| {
                if out.rank() == 0 {
                    Ok(1)
                } else {
                    out.dim(self.dim)
                }
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(ScatterPlan {
            dim: self.dim,
            devices: self.devices[..sizes.len()].to_vec(),
            sizes,
        })
    }

    /// Sums the replicas' gradients per master variable, in replica order
    /// (deterministic, see [`crate::reduce`]), into one store. The variables
    /// are split between the (now idle) replica workers, which reduce their
    /// share in parallel.
    fn reduce_add(&self, per_replica: Vec<Vec<Option<Tensor>>>) -> Result<GradStore> {
        let master = self.master_vars.clone();
        let sums: Vec<(usize, Option<Tensor>)> = if let [_] = per_replica.as_slice() {
            per_replica.into_iter().flatten().enumerate().collect()
        } else {
            let sizes: Vec<usize> = master.iter().map(|(_, v)| v.elem_count()).collect();
            let groups = balanced_partition(&sizes, per_replica.len());
            let per_replica = Arc::new(per_replica);
            let work_master = master.clone();
            parallel_apply(&self.workers, groups, self.timeout, move |_, vars, _| {
                vars.into_iter()
                    .map(|i| {
                        let parts: Vec<Option<Tensor>> =
                            per_replica.iter().map(|g| g[i].clone()).collect();
                        let sum =
                            sum_gradients(&parts, work_master[i].1.device()).map_err(|e| {
                                e.context(format!(
                                    "summing the gradients of `{}`",
                                    work_master[i].0
                                ))
                            })?;
                        Ok((i, sum))
                    })
                    .collect::<candle_core::Result<Vec<_>>>()
            })?
            .into_iter()
            .flatten()
            .collect()
        };
        let mut store = GradStore::default();
        for (i, sum) in sums {
            if let Some(sum) = sum {
                store.insert(master[i].1.as_tensor(), sum);
            }
        }
        Ok(store)
    }
}

/// Rows along `dim` of the first tensor leaf, if any.
fn batch_rows<I: Scatter>(input: &I, dim: usize) -> Option<usize> {
    let mut rows = None;
    input.for_each_tensor(&mut |t| {
        if rows.is_none() {
            rows = t.dim(dim).ok();
        }
    });
    rows
}
