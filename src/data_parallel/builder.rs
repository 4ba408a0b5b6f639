//! [`DataParallelBuilder`]: the settings of a [`DataParallel`], then the
//! master model and one replica per device built from the user's factory.

use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};

use super::replicas::Replicas;
use super::timings::StepRecorder;
use super::DataParallel;
use crate::buffers::{is_batch_norm_buffer, BufferPredicate};
use crate::error::{Error, Result};
use crate::no_grad::NoGradCheck;
use crate::precision::MixedPrecision;
use crate::replicate::{build_master, CopyOptions};
use crate::util::device_label::device_label;
use crate::util::vars::sorted_vars;

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
            mixed_precision: None,
        }
    }
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
    mixed_precision: Option<MixedPrecision>,
}

impl<M> fmt::Debug for DataParallelBuilder<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DataParallelBuilder")
            .field("dtype", &self.dtype)
            .field("devices", &self.devices)
            .field("output_device", &self.output_device)
            .field("dim", &self.dim)
            .field("threads_per_replica", &self.threads_per_replica)
            .field("timeout", &self.timeout)
            .field("mixed_precision", &self.mixed_precision)
            .finish_non_exhaustive()
    }
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
    /// [`Error::ReplicaTimeout`] (default: no limit). A timeout too large to
    /// represent as a point in time, such as `Duration::MAX`, is no limit.
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

    /// Mixed precision (see [`crate::precision`]): the master variables stay
    /// in the builder's dtype (f32), the replicas compute on copies in
    /// `policy.param_dtype`, and the gradients reach the master in its dtype,
    /// summed there. [`forward`](DataParallel::forward) converts a
    /// floating-point input to the compute dtype; with
    /// [`forward_backward`](DataParallel::forward_backward) the closure
    /// gets the scattered input as given (convert it there, and the model's
    /// output to f32 before the loss). `policy.reduce_dtype` does not apply:
    /// the replicas' gradients are summed in the master's dtype.
    pub fn mixed_precision(mut self, policy: MixedPrecision) -> Self {
        self.mixed_precision = Some(policy);
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
        let mut roles: Vec<crate::cuda_setup::Role> = self
            .devices
            .iter()
            .enumerate()
            .map(|(i, d)| ("replica", i, d))
            .collect();
        if let Some(output) = &self.output_device {
            roles.push(("output device", 0, output));
        }
        crate::cuda_setup::prepare(&roles)?;
        // Before the master's factory runs its first candle ops.
        crate::cpu_threads::share_cpu_between(self.devices.iter().filter(|d| d.is_cpu()).count());
        let factory = Arc::new(factory);
        self.build_master_bounded(&first, &factory)?;
        let (replica_dtype, options) = match &self.mixed_precision {
            Some(policy) => {
                policy.check()?;
                let options = CopyOptions {
                    keep_master_dtype: policy.keep_full_precision.clone(),
                    create_in: None,
                };
                (policy.param_dtype, options)
            }
            None => (self.dtype, CopyOptions::default()),
        };
        let replicas = Replicas::start(
            &self.varmap,
            (replica_dtype, options),
            &self.devices,
            self.threads(),
            self.timeout,
            Arc::clone(&self.is_buffer),
            factory,
        )?;
        Ok(DataParallel {
            replicas,
            output_device: self.output_device.unwrap_or(first),
            devices: self.devices,
            dim: self.dim,
            params: sorted_vars(&self.varmap)
                .into_iter()
                .filter(|(name, _)| !(self.is_buffer)(name))
                .collect(),
            no_grad: NoGradCheck::default(),
            without_grad: Mutex::new(Vec::new()),
            master_vars: Arc::new(sorted_vars(&self.varmap)),
            last_forward: Mutex::new(None),
            timings: StepRecorder::default(),
            step: Mutex::new(()),
            compute_dtype: self.mixed_precision.map(|p| p.param_dtype),
        })
    }

    /// Threads per replica: as set, or on CPU the cores shared between the
    /// replicas, on GPUs 1.
    fn threads(&self) -> usize {
        self.threads_per_replica.unwrap_or_else(|| {
            if self.devices.iter().all(Device::is_cpu) {
                crate::cpu_threads::threads_per_worker(self.devices.len())
            } else {
                1
            }
        })
    }
}
