//! `DataParallel`: one master model, one replica per device, every step
//! scatter -> replicate -> parallel_apply -> gather, and gradients reduced
//! back onto the master. `torch.nn.DataParallel`'s semantics.
//!
//! - this file: the type and the forward pipeline;
//! - [`builder`]: [`DataParallelBuilder`], the master and the replicas built;
//! - [`replicas`]: the replicas on their worker threads
//!   ([`WorkerPool`](crate::worker_pool::WorkerPool)), refreshed and run;
//! - [`replicate`]: how a replica's variables follow the master's;
//! - [`backward`]: the parallel backward paths and the reduce onto the master;
//! - [`timings`]: where a step's time went.

mod backward;
mod builder;
mod gpu_turns;
mod part_keys;
pub mod reduce;
mod replicas;
pub(crate) mod scatter_gather;
mod timings;

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use candle_core::{Device, Tensor, TensorId, Var};
use candle_nn::{Module, ModuleT};

use crate::error::Result;
use crate::no_grad::NoGradCheck;
use crate::ops::dropout::with_sample_keys;
use crate::util::lock::lock;
use crate::worker_pool::Cancel;
use part_keys::part_keys;
use replicas::Replicas;
use scatter_gather::{gather, scatter, Gather, Scatter, ScatterPlan, Split};
use timings::StepRecorder;

pub use builder::DataParallelBuilder;
pub use timings::StepTimings;

/// PyTorch-style data parallelism over several devices in one process.
///
/// The master model's variables live in the caller's [`VarMap`](candle_nn::VarMap) on
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
///   on its own thread and reduce-add into a [`GradStore`](candle_core::backprop::GradStore) keyed by the
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
    replicas: Replicas<M>,
    devices: Vec<Device>,
    output_device: Device,
    dim: usize,
    master_vars: Arc<Vec<(String, Var)>>,
    last_forward: Mutex<Option<SavedForward>>,
    timings: StepRecorder,
    /// Held for a whole step: concurrent callers take turns, so a step's
    /// buffer refresh never meets another step's commit.
    step: Mutex<()>,
    /// The master variables that are trained (not buffers).
    params: Vec<(String, Var)>,
    no_grad: NoGradCheck,
    /// The parameters without a gradient in the latest parallel backward.
    without_grad: Mutex<Vec<String>>,
    /// With mixed precision, the replicas' dtype.
    compute_dtype: Option<candle_core::DType>,
}

/// What [`DataParallel::backward`] needs from the forward it differentiates.
struct SavedForward {
    gathered: TensorId,
    outputs: Vec<Tensor>,
}

impl<M: 'static> fmt::Debug for DataParallel<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DataParallel")
            .field("devices", &self.devices)
            .field("output_device", &self.output_device)
            .field("dim", &self.dim)
            .field("vars", &self.master_vars.len())
            .finish_non_exhaustive()
    }
}

impl<M: 'static> DataParallel<M> {
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
        let input = self.in_compute_dtype(input)?;
        self.forward_saved(input, |model: &M, x: Tensor| model.forward(&x))
    }

    /// With mixed precision, a floating-point input in the compute dtype.
    fn in_compute_dtype(&self, input: &Tensor) -> Result<Tensor> {
        Ok(match self.compute_dtype {
            Some(dtype) => crate::precision::cast_input(input, dtype)?,
            None => input.clone(),
        })
    }

    /// The dtype the replicas compute in, when it differs by a
    /// mixed-precision policy from the master's.
    pub fn compute_dtype(&self) -> Option<candle_core::DType> {
        self.compute_dtype
    }

    /// Like [`forward`](Self::forward) for a [`ModuleT`] (train / eval flag,
    /// e.g. BatchNorm, Dropout).
    pub fn forward_t(&self, input: &Tensor, train: bool) -> Result<Tensor>
    where
        M: ModuleT,
    {
        let input = self.in_compute_dtype(input)?;
        self.forward_saved(input, move |model: &M, x: Tensor| {
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
        self.timings.gathered(start.elapsed());
        self.replicas.commit_buffers()?;
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
        let gathered = self.gather(outputs)?;
        self.replicas.commit_buffers()?;
        Ok(gathered)
    }

    /// The pipeline shared by every forward: scatter, refresh the replicas
    /// from the master (replicate), run them in parallel (parallel_apply).
    /// The caller gathers, then commits replica 0's buffers
    /// ([`Replicas::commit_buffers`]) once the whole step has succeeded, so
    /// a failed step leaves the master untouched.
    fn scatter_apply<I, R, F>(&self, input: I, split: &Split, f: F) -> Result<Vec<R>>
    where
        I: Scatter + Send + 'static,
        R: Send + 'static,
        F: Fn(&M, I, &Cancel) -> candle_core::Result<R> + Send + Sync + 'static,
    {
        let start = Instant::now();
        let inputs = self.scatter(input, split)?;
        let keys = part_keys(&inputs, self.dim);
        let scattered = start.elapsed();
        let parts = inputs.into_iter().zip(keys).collect();
        let runs =
            self.replicas
                .replicate_apply(parts, move |model, (x, keys), cancel| match keys {
                    Some(keys) => with_sample_keys(keys, || f(model, x, cancel)),
                    None => f(model, x, cancel),
                })?;
        self.timings.begin(scattered, &runs, start.elapsed());
        Ok(runs.into_iter().map(|run| run.output).collect())
    }

    /// The input's parts, one per replica in use.
    fn scatter<I: Scatter>(&self, input: I, split: &Split) -> Result<Vec<I>> {
        match ScatterPlan::for_input(&input, self.dim, split, &self.devices)? {
            Some(plan) => scatter(&input, &plan),
            // Nothing to split: the model runs once, on the first device.
            None => Ok(vec![input]),
        }
    }

    fn gather<O: Gather>(&self, outputs: Vec<O>) -> Result<O> {
        gather(outputs, self.dim, &self.output_device)
    }

    /// Where the time of the latest step went (forward plus, for the
    /// parallel paths, backward and reduce).
    pub fn last_timings(&self) -> StepTimings {
        self.timings.last()
    }
}
