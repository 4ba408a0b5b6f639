//! Save and load the master's variables as safetensors.
//!
//! PyTorch's `nn.DataParallel` prefixes every state-dict key with `module.`,
//! and checkpoints saved with and without it do not load into each other.
//! Here saving takes a [`Prefix`] and loading accepts both forms, reporting
//! what was missing, unexpected or of the wrong shape.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use candle_core::{Device, Tensor};
use candle_nn::VarMap;

use crate::error::{Error, Result};
use crate::replicate::sorted_vars;

/// The prefix PyTorch's `DataParallel` adds to state-dict keys.
pub const MODULE_PREFIX: &str = "module.";

/// How names are written by [`save`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Prefix {
    /// Plain names, as the model's own `VarMap` has them (`l1.weight`).
    #[default]
    None,
    /// PyTorch `DataParallel` names (`module.l1.weight`).
    Module,
}

/// What [`load`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Variables set from the checkpoint (model names, sorted).
    pub loaded: Vec<String>,
    /// Model variables the checkpoint does not have (left unchanged).
    pub missing: Vec<String>,
    /// Checkpoint entries the model does not have (checkpoint names).
    pub unexpected: Vec<String>,
    /// Variables whose shapes differ: (name, checkpoint shape, model shape).
    pub mismatched: Vec<(String, Vec<usize>, Vec<usize>)>,
}

impl LoadReport {
    /// Whether every variable was loaded and nothing was left over.
    pub fn is_exact(&self) -> bool {
        self.missing.is_empty() && self.unexpected.is_empty() && self.mismatched.is_empty()
    }
}

/// Writes every variable of `varmap` to a safetensors file.
///
/// ```
/// use candle_core::{DType, Device};
/// use candle_nn::{linear, VarBuilder, VarMap};
/// use candle_dp::checkpoint::{self, Prefix};
///
/// # fn main() -> anyhow::Result<()> {
/// let varmap = VarMap::new();
/// linear(3, 2, VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?;
/// let path = std::env::temp_dir().join("candle_dp_doc_ckpt.safetensors");
/// checkpoint::save(&varmap, &path, Prefix::Module)?; // keys "module.weight", "module.bias"
///
/// let fresh = VarMap::new();
/// linear(3, 2, VarBuilder::from_varmap(&fresh, DType::F32, &Device::Cpu))?;
/// let report = checkpoint::load(&fresh, &path, true)?; // accepts the prefix
/// assert!(report.is_exact());
/// # Ok(())
/// # }
/// ```
pub fn save(varmap: &VarMap, path: impl AsRef<Path>, prefix: Prefix) -> Result<()> {
    let prefix = match prefix {
        Prefix::None => "",
        Prefix::Module => MODULE_PREFIX,
    };
    let tensors: HashMap<String, Tensor> = sorted_vars(varmap)
        .into_iter()
        .map(|(name, var)| (format!("{prefix}{name}"), var.as_detached_tensor()))
        .collect();
    candle_core::safetensors::save(&tensors, path)?;
    Ok(())
}

/// Loads a safetensors file into the variables of `varmap`, in place (the
/// variables keep their identity, so optimizers and `DataParallel` replicas
/// see the new values). Names may carry the `module.` prefix or not.
///
/// With `strict`, anything missing, unexpected or of the wrong shape is an
/// [`Error::Checkpoint`] listing every such name, and nothing is changed.
/// Without it, the matching variables are loaded and the rest reported.
pub fn load(varmap: &VarMap, path: impl AsRef<Path>, strict: bool) -> Result<LoadReport> {
    let path = path.as_ref();
    let file = candle_core::safetensors::load(path, &Device::Cpu)?;
    let mut by_name: BTreeMap<String, (String, Tensor)> = BTreeMap::new();
    for (key, tensor) in file {
        let name = key.strip_prefix(MODULE_PREFIX).unwrap_or(&key).to_string();
        if let Some((other, _)) = by_name.insert(name.clone(), (key.clone(), tensor)) {
            return Err(Error::Checkpoint(format!(
                "{}: `{other}` and `{key}` both name the variable `{name}`",
                path.display()
            )));
        }
    }
    let mut report = LoadReport::default();
    let mut updates = Vec::new();
    for (name, var) in sorted_vars(varmap) {
        match by_name.remove(&name) {
            None => report.missing.push(name),
            Some((_, tensor)) if tensor.dims() != var.dims() => {
                report
                    .mismatched
                    .push((name, tensor.dims().to_vec(), var.dims().to_vec()))
            }
            Some((_, tensor)) => updates.push((name, var, tensor)),
        }
    }
    report.unexpected = by_name.into_values().map(|(key, _)| key).collect();
    if strict && !report.is_exact() {
        return Err(Error::Checkpoint(format!(
            "{}: missing {:?}, unexpected {:?}, wrong shape (name, checkpoint, model) {:?}",
            path.display(),
            report.missing,
            report.unexpected,
            report.mismatched
        )));
    }
    for (name, var, tensor) in updates {
        let value = tensor.to_dtype(var.dtype())?.to_device(var.device())?;
        var.set(&value)?;
        report.loaded.push(name);
    }
    Ok(report)
}
