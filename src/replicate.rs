//! Replicas of the master model, built once per device from the user's own
//! model code, kept in step with the master every step: `DataParallel`'s
//! replicas, and mixed precision's low-precision copies of a model
//! ([`crate::precision`], on the master's own device, in another dtype).
//!
//! PyTorch re-creates its replicas every forward (`replicate.py`). Here each
//! replica is built once, by calling the user's factory with a [`VarBuilder`]
//! whose backend hands out tensors tied to the master's variables:
//!
//! - a **parameter** is `master.to_device(replica_device)`. On the master's
//!   own device (every CPU replica) that is the master tensor itself: no copy
//!   at all, and replicas always see the latest values. On another device it
//!   is a copy whose autograd op leads back to the master variable, so
//!   gradients flow home (the backward of a broadcast is a sum); its values
//!   are refreshed from the master at the start of every step.
//! - a **buffer** (a variable the forward pass itself updates, such as
//!   BatchNorm's `running_mean` / `running_var`) is a private copy per
//!   replica, refreshed from the master every step. After a successful step
//!   replica 0's copy is written back to the master, the others' updates are
//!   discarded: PyTorch's semantics, and a failed step leaves the master
//!   untouched.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_nn::{Init, VarBuilder, VarMap};

use crate::buffers::BufferPredicate;
use crate::device_copy::{self as copy, copy_into};
use crate::error::{Error, Result};
use crate::util::device_label::device_label;
use crate::util::lock::lock;
use crate::util::panic_message::panic_message;
use crate::util::shared_backend::SharedBackend;
use crate::util::vars::sorted_vars;

/// Builds the master model on `device`, creating (or reusing) the variables
/// in `varmap`, and checks that every variable lives on that device.
pub(crate) fn build_master<M>(
    varmap: &VarMap,
    dtype: DType,
    device: &Device,
    factory: &dyn Fn(VarBuilder) -> candle_core::Result<M>,
) -> Result<()> {
    let vb = VarBuilder::from_varmap(varmap, dtype, device);
    // A panic in the user's factory is an error here as on the replicas.
    let built = catch_unwind(AssertUnwindSafe(|| factory(vb))).unwrap_or_else(|payload| {
        Err(candle_core::Error::Msg(format!(
            "the model factory panicked while building the master: {}",
            panic_message(payload.as_ref())
        )))
    });
    built.map_err(|source| Error::ReplicaBuild {
        replica: 0,
        device: device_label(device),
        source,
    })?;
    for (name, var) in sorted_vars(varmap) {
        if !var.device().same_device(device) {
            return Err(Error::MasterVarOnWrongDevice {
                name,
                found: device_label(var.device()),
                expected: device_label(device),
            });
        }
    }
    Ok(())
}

/// The tensors of one replica that must follow the master.
#[derive(Default)]
pub(crate) struct ReplicaVars {
    /// Parameters copied to another device or dtype: (master, replica copy).
    copied_params: Vec<(Var, Tensor)>,
    /// Buffers: (master, private copy).
    buffers: Vec<(Var, Var)>,
}

impl ReplicaVars {
    /// Copies the master's current values into this replica: one device
    /// copy per parameter and buffer into the replica's own storage (after
    /// a conversion on the master's device when the replica runs in
    /// another dtype). Parameters on the master's device are shared and
    /// need nothing. Each copy keeps its autograd op (ToDevice of the
    /// master), so gradients keep flowing home.
    pub(crate) fn refresh(&self) -> candle_core::Result<()> {
        for (master, copy) in &self.copied_params {
            copy_into(copy, &in_dtype_of(master, copy)?)?;
        }
        for (master, copy) in &self.buffers {
            copy_into(copy.as_tensor(), &in_dtype_of(master, copy.as_tensor())?)?;
        }
        Ok(())
    }

    /// Writes this replica's buffers back into the master (replica 0 only).
    /// Every value is copied before the first is written, so a failing
    /// copy leaves the master as it was.
    pub(crate) fn commit_buffers(&self) -> candle_core::Result<()> {
        let values = self
            .buffers
            .iter()
            .map(|(master, copy)| converted(copy, master.as_tensor()))
            .collect::<candle_core::Result<Vec<_>>>()?;
        for ((master, _), value) in self.buffers.iter().zip(values) {
            master.set(&value)?;
        }
        Ok(())
    }
}

/// `from`'s value, detached, in the dtype of `like`, still on its own device.
fn in_dtype_of(from: &Var, like: &Tensor) -> candle_core::Result<Tensor> {
    from.as_detached_tensor().to_dtype(like.dtype())
}

/// `from`'s value in the dtype and on the device of `like`, detached: a
/// replica may run in another dtype or on another device than the master.
fn converted(from: &Var, like: &Tensor) -> candle_core::Result<Tensor> {
    crate::device_copy::to_device(
        &from.as_detached_tensor().to_dtype(like.dtype())?,
        like.device(),
    )
}

/// How a copy of the model differs from its master, beyond its device and
/// dtype.
#[derive(Clone, Default)]
pub(crate) struct CopyOptions {
    /// Variables that stay in the master's dtype (a mixed-precision
    /// policy's norms): shared with the master on its device.
    pub(crate) keep_master_dtype: Option<BufferPredicate>,
    /// Creates a variable the varmap lacks, in this dtype, from the
    /// factory's initialiser (a mixed-precision model built in one call);
    /// without it such a variable is an error.
    pub(crate) create_in: Option<DType>,
}

/// A `VarBuilder` backend that hands a replica the master's variables.
struct ReplicaBackend {
    replica: usize,
    varmap: VarMap,
    is_buffer: BufferPredicate,
    options: CopyOptions,
    vars: Mutex<ReplicaVars>,
}

impl ReplicaBackend {
    fn master_var(
        &self,
        name: &str,
        shape: Option<&Shape>,
        dev: &Device,
    ) -> candle_core::Result<Var> {
        let data = lock(self.varmap.data());
        let mismatch = |reason: String| {
            candle_core::Error::Msg(
                Error::ReplicaVarMismatch {
                    replica: self.replica,
                    device: device_label(dev),
                    name: name.to_string(),
                    shape: shape.map(|s| s.dims().to_vec()).unwrap_or_default(),
                    reason,
                }
                .to_string(),
            )
        };
        let var = data
            .get(name)
            .ok_or_else(|| mismatch("does not have".into()))?;
        if let Some(shape) = shape {
            if var.shape() != shape {
                return Err(mismatch(format!("has with shape {:?}", var.dims())));
            }
        }
        Ok(var.clone())
    }

    fn tensor_for(
        &self,
        master: Var,
        name: &str,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let dtype = match &self.options.keep_master_dtype {
            Some(keep) if keep(name) => master.dtype(),
            _ => dtype,
        };
        let mut vars = lock(&self.vars);
        if (self.is_buffer)(name) {
            // A detached source makes `Var::from_tensor` copy the storage.
            let value = copy::to_device(&master.as_detached_tensor().to_dtype(dtype)?, dev)?;
            let copy = Var::from_tensor(&value)?;
            let tensor = copy.as_tensor().clone();
            vars.buffers.push((master, copy));
            return Ok(tensor);
        }
        let tensor = copy::to_device(&master.as_tensor().to_dtype(dtype)?, dev)?;
        if tensor.id() != master.as_tensor().id() {
            vars.copied_params.push((master, tensor.clone()));
        }
        Ok(tensor)
    }
}

impl candle_nn::var_builder::SimpleBackend for ReplicaBackend {
    fn get(
        &self,
        s: Shape,
        name: &str,
        init: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        if let Some(master_dtype) = self.options.create_in {
            if !lock(self.varmap.data()).contains_key(name) {
                self.varmap.get(s.clone(), name, init, master_dtype, dev)?;
            }
        }
        let master = self.master_var(name, Some(&s), dev)?;
        self.tensor_for(master, name, dtype, dev)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let master = self.master_var(name, None, dev)?;
        self.tensor_for(master, name, dtype, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        lock(self.varmap.data()).contains_key(name)
    }
}

/// Builds replica `replica` of the model on `device` from the master vars.
pub(crate) fn build_replica<M>(
    replica: usize,
    varmap: &VarMap,
    dtype: DType,
    device: &Device,
    is_buffer: BufferPredicate,
    options: CopyOptions,
    factory: impl FnOnce(VarBuilder) -> candle_core::Result<M>,
) -> Result<(M, ReplicaVars)> {
    let backend = Arc::new(ReplicaBackend {
        replica,
        varmap: varmap.clone(),
        is_buffer,
        options,
        vars: Mutex::new(ReplicaVars::default()),
    });
    let vb = VarBuilder::from_backend(
        Box::new(SharedBackend(backend.clone())),
        dtype,
        device.clone(),
    );
    let model = factory(vb).map_err(|source| Error::ReplicaBuild {
        replica,
        device: device_label(device),
        source,
    })?;
    let vars = std::mem::take(&mut *lock(&backend.vars));
    Ok((model, vars))
}
