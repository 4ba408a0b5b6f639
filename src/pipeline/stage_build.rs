//! Building one stage's layers on its worker, from the model's `VarMap`.
//!
//! A layer gets the `VarMap`'s own variable when it lives on the stage's
//! device. It gets a stage-local copy (a mirror, refreshed from the
//! `VarMap` at the start of every step) in two cases:
//! - the variable already lives on another stage's device (weights tied
//!   across devices): its gradient is moved back and summed with the other
//!   stages';
//! - it is a BatchNorm buffer: the layer updates the copy, and the
//!   `VarMap` gets the new value only when the whole step succeeds;
//! - under mixed precision, a variable the policy does not keep in f32: the
//!   mirror is in the compute dtype, its gradient widened on the way back.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_nn::{Init, VarBuilder, VarMap};

use super::deferred_norm::NormUse;
use super::stage::Stage;
use super::stage_var::StageVar;
use crate::buffers::is_batch_norm_buffer;
use crate::precision::MixedPrecision;
use crate::util::lock::lock;
use crate::util::shared_backend::SharedBackend;

/// A `VarBuilder` backend for one stage: the model's `VarMap` (variables
/// are created on the stage's device), handing out mirrors where needed and
/// recording which variables each layer uses.
struct StageBackend {
    varmap: VarMap,
    /// The dtype variables are created in (the layers' is the compute
    /// dtype under mixed precision).
    master_dtype: DType,
    /// Mixed precision: which dtype a variable's copy computes in.
    precision: Option<MixedPrecision>,
    /// Mirrors by name, so that every layer of the stage shares one.
    mirrors: Mutex<HashMap<String, Var>>,
    /// The names used by the layer being built.
    used: Mutex<Vec<String>>,
}

impl StageBackend {
    /// The tensor a layer of this stage uses for `name`, given the
    /// `VarMap`'s variable `tensor`.
    fn hand_out(&self, name: &str, tensor: Tensor, dev: &Device) -> candle_core::Result<Tensor> {
        lock(&self.used).push(name.to_string());
        let dtype = match &self.precision {
            Some(policy) if !policy.keeps(name) => policy.param_dtype,
            _ => tensor.dtype(),
        };
        if !is_batch_norm_buffer(name)
            && tensor.device().same_device(dev)
            && dtype == tensor.dtype()
        {
            return Ok(tensor);
        }
        let mut mirrors = lock(&self.mirrors);
        if let Some(mirror) = mirrors.get(name) {
            return Ok(mirror.as_tensor().clone());
        }
        // `detach` drops the variable mark, so `from_tensor` copies.
        let value = crate::device_copy::to_device(&tensor, dev)?.to_dtype(dtype)?;
        let mirror = Var::from_tensor(&value.detach())?;
        mirrors.insert(name.to_string(), mirror.clone());
        Ok(mirror.as_tensor().clone())
    }
}

impl candle_nn::var_builder::SimpleBackend for StageBackend {
    fn get(
        &self,
        shape: Shape,
        name: &str,
        init: Init,
        _: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let tensor = self.varmap.get(shape, name, init, self.master_dtype, dev)?;
        self.hand_out(name, tensor, dev)
    }

    fn get_unchecked(&self, name: &str, _: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let tensor = lock(self.varmap.data())
            .get(name)
            .map(|var| var.as_tensor().clone())
            .ok_or_else(|| candle_core::Error::Msg(format!("no variable `{name}`")))?;
        self.hand_out(name, tensor, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        lock(self.varmap.data()).contains_key(name)
    }
}

/// Builds `factories` (global indices from `first`) for one stage on `device`.
pub(crate) fn build_stage(
    varmap: &VarMap,
    dtype: DType,
    precision: Option<&MixedPrecision>,
    device: &Device,
    first: usize,
    factories: &[super::UnitFactory],
) -> crate::error::Result<Stage> {
    let backend = Arc::new(StageBackend {
        varmap: varmap.clone(),
        master_dtype: dtype,
        precision: precision.cloned(),
        mirrors: Mutex::new(HashMap::new()),
        used: Mutex::new(Vec::new()),
    });
    let mut layers = Vec::with_capacity(factories.len());
    let mut used_by_layer = Vec::with_capacity(factories.len());
    for (offset, factory) in factories.iter().enumerate() {
        let layer = first + offset;
        let vb = VarBuilder::from_backend(
            Box::new(SharedBackend(backend.clone())),
            precision.map_or(dtype, |p| p.param_dtype),
            device.clone(),
        );
        layers.push(super::build_layer(factory, layer, vb)?);
        used_by_layer.push(std::mem::take(&mut *lock(&backend.used)));
    }
    let mut names: Vec<String> = used_by_layer.iter().flatten().cloned().collect();
    names.sort();
    names.dedup();
    let mirrors = std::mem::take(&mut *lock(&backend.mirrors));
    let data = lock(varmap.data());
    let (mut vars, mut buffers) = (Vec::new(), Vec::new());
    for name in names {
        let Some(master) = data.get(&name).cloned() else {
            continue;
        };
        let local = mirrors
            .get(&name)
            .cloned()
            .unwrap_or_else(|| master.clone());
        let var = StageVar {
            name: name.clone(),
            local,
            master,
        };
        if is_batch_norm_buffer(&name) {
            buffers.push(var);
        } else {
            vars.push(var);
        }
    }
    let norms = NormUse::find(&used_by_layer, &buffers);
    Ok(Stage {
        layers,
        first,
        vars,
        buffers,
        norms,
    })
}
