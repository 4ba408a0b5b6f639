//! Save and load the master's variables as safetensors.
//!
//! PyTorch's `nn.DataParallel` prefixes every state-dict key with `module.`,
//! and checkpoints saved with and without it do not load into each other.
//! Here saving takes a [`Prefix`] and loading accepts both forms, reporting
//! what was missing, unexpected or of the wrong shape.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::{File, OpenOptions};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{Device, Tensor};
use candle_nn::VarMap;

use crate::error::{Error, Result};
use crate::vars::sorted_vars;

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
/// **Crash safety**: the file is written under a temporary name in the same
/// directory, flushed to disk, then renamed over `path` (and the directory
/// flushed), so a crash at any point leaves either the previous file or the
/// new one at `path`, never a partial file (a stray `*.tmp-*` file may be
/// left behind). A `VarMap` whose lock was poisoned by a crashed thread is
/// still saved: this is the emergency save after a crash.
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
///
/// # Errors
///
/// [`Error::Checkpoint`] naming the path when it cannot be written.
pub fn save(varmap: &VarMap, path: impl AsRef<Path>, prefix: Prefix) -> Result<()> {
    let path = path.as_ref();
    let prefix = match prefix {
        Prefix::None => "",
        Prefix::Module => MODULE_PREFIX,
    };
    let tensors: HashMap<String, Tensor> = sorted_vars(varmap)
        .into_iter()
        .map(|(name, var)| (format!("{prefix}{name}"), var.as_detached_tensor()))
        .collect();
    let failed = |what: &str, e: &dyn std::fmt::Display| {
        Error::Checkpoint(format!("{}: {what}: {e}", path.display()))
    };
    let file_name = path
        .file_name()
        .ok_or_else(|| failed("not a file path", &"it has no file name"))?;
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    // Unique per process and per call: thread ranks of one process may
    // save to the same path at once.
    static SAVES: AtomicU64 = AtomicU64::new(0);
    let mut temporary_name = file_name.to_os_string();
    temporary_name.push(format!(
        ".tmp-{}-{}",
        std::process::id(),
        SAVES.fetch_add(1, Ordering::Relaxed)
    ));
    let temporary = dir.join(temporary_name);
    let write = || -> Result<()> {
        candle_core::safetensors::save(&tensors, &temporary)
            .map_err(|e| failed("cannot write it", &e))?;
        // Write access: some platforms refuse to flush a read-only handle.
        OpenOptions::new()
            .write(true)
            .open(&temporary)
            .and_then(|file| file.sync_all())
            .map_err(|e| failed("cannot flush it to disk", &e))?;
        std::fs::rename(&temporary, path).map_err(|e| failed("cannot move it into place", &e))
    };
    if let Err(error) = write() {
        let _ = std::fs::remove_file(&temporary);
        return Err(error);
    }
    // The rename itself is durable once the directory is flushed; not every
    // platform can open a directory, and the file is complete either way.
    if let Ok(dir) = File::open(dir) {
        let _ = dir.sync_all();
    }
    Ok(())
}

/// Loads a safetensors file into the variables of `varmap`, in place (the
/// variables keep their identity, so optimizers and `DataParallel` replicas
/// see the new values). A key names the variable of the same name, or,
/// when there is none, the variable it names without the `module.` prefix
/// (so checkpoints of PyTorch's `DataParallel` load, and so do variables
/// whose own names begin with `module.`).
///
/// With `strict`, anything missing, unexpected or of the wrong shape is an
/// [`Error::Checkpoint`] listing every such name, and nothing is changed.
/// Without it, the matching variables are loaded and the rest reported.
/// Either way the load is all or nothing: every tensor is converted to its
/// variable's dtype and device before the first variable is changed.
///
/// # Errors
///
/// [`Error::Checkpoint`] naming the path when the file cannot be read or
/// does not fit (strict), or a tensor cannot be converted.
pub fn load(varmap: &VarMap, path: impl AsRef<Path>, strict: bool) -> Result<LoadReport> {
    let path = path.as_ref();
    let file = candle_core::safetensors::load(path, &Device::Cpu)
        .map_err(|e| Error::Checkpoint(format!("{}: cannot read it: {e}", path.display())))?;
    let vars = sorted_vars(varmap);
    let names: BTreeSet<&str> = vars.iter().map(|(name, _)| name.as_str()).collect();
    let mut by_name: BTreeMap<String, (String, Tensor)> = BTreeMap::new();
    let mut unexpected = Vec::new();
    // Sorted keys, so that the outcome does not depend on the file's order.
    let mut entries: Vec<(String, Tensor)> = file.into_iter().collect();
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    for (key, tensor) in entries {
        let name = if names.contains(key.as_str()) {
            key.clone()
        } else {
            match key.strip_prefix(MODULE_PREFIX) {
                Some(stripped) if names.contains(stripped) => stripped.to_string(),
                _ => {
                    unexpected.push(key);
                    continue;
                }
            }
        };
        if let Some((other, _)) = by_name.insert(name.clone(), (key.clone(), tensor)) {
            return Err(Error::Checkpoint(format!(
                "{}: `{other}` and `{key}` both name the variable `{name}`",
                path.display()
            )));
        }
    }
    let mut report = LoadReport {
        unexpected,
        ..LoadReport::default()
    };
    let mut updates = Vec::new();
    for (name, var) in vars {
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
    if strict && !report.is_exact() {
        return Err(Error::Checkpoint(format!(
            "{}: missing {:?}, unexpected {:?}, wrong shape (name, checkpoint, model) {:?}",
            path.display(),
            report.missing,
            report.unexpected,
            report.mismatched
        )));
    }
    // Every conversion first, so that a failing one changes nothing.
    let converted = updates
        .into_iter()
        .map(|(name, var, tensor)| {
            let value = tensor
                .to_dtype(var.dtype())
                .and_then(|t| t.to_device(var.device()))
                .map_err(|e| {
                    Error::Checkpoint(format!(
                        "{}: `{name}` cannot become {:?} on {:?}: {e}",
                        path.display(),
                        var.dtype(),
                        var.device()
                    ))
                })?;
            Ok((name, var, value))
        })
        .collect::<Result<Vec<_>>>()?;
    for (name, var, value) in converted {
        var.set(&value)?;
        report.loaded.push(name);
    }
    Ok(report)
}
