//! Save and load the master's variables as safetensors.
//!
//! PyTorch's `nn.DataParallel` prefixes every state-dict key with `module.`,
//! and checkpoints saved with and without it do not load into each other.
//! Here saving takes a [`Prefix`] and records it in the file's metadata,
//! and loading accepts both forms, reporting what was missing, unexpected
//! or of the wrong shape.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::{File, OpenOptions};
use std::io::Read;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{Device, Tensor};
use candle_nn::VarMap;

use crate::error::{Error, Result};
use crate::util::vars::sorted_vars;

/// The prefix PyTorch's `DataParallel` adds to state-dict keys.
pub const MODULE_PREFIX: &str = "module.";

/// The metadata entry in which [`save`] records the prefix it added, so
/// that [`load`] strips exactly that, whatever the variables are called.
const PREFIX_METADATA: &str = "candle_dp.prefix";

/// The key safetensors reserves for its metadata: no tensor can be called so.
const RESERVED_KEY: &str = "__metadata__";

/// The longest part of the target's file name kept in the temporary name:
/// any name the file system accepts (255 bytes on most) must still save.
const TEMPORARY_STEM_BYTES: usize = 64;

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

/// Writes every variable of `varmap` to a safetensors file, recording the
/// prefix in its metadata (entry `candle_dp.prefix`).
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
/// [`Error::Checkpoint`] naming the path when it cannot be written, or
/// naming the variable when the format cannot hold its name
/// (`__metadata__`); then the file at `path` is not touched.
pub fn save(varmap: &VarMap, path: impl AsRef<Path>, prefix: Prefix) -> Result<()> {
    let path = path.as_ref();
    let prefix = match prefix {
        Prefix::None => "",
        Prefix::Module => MODULE_PREFIX,
    };
    let failed = |what: &str, e: &dyn std::fmt::Display| {
        Error::Checkpoint(format!("{}: {what}: {e}", path.display()))
    };
    let tensors: HashMap<String, Tensor> = sorted_vars(varmap)
        .into_iter()
        .map(|(name, var)| (format!("{prefix}{name}"), var.as_detached_tensor()))
        .collect();
    if tensors.contains_key(RESERVED_KEY) {
        return Err(failed(
            "not saved",
            &format!("a variable would be stored as `{RESERVED_KEY}`, the key safetensors reserves for metadata; rename it"),
        ));
    }
    let metadata = HashMap::from([(PREFIX_METADATA.to_string(), prefix.to_string())]);
    let file_name = path
        .file_name()
        .ok_or_else(|| failed("not a file path", &"it has no file name"))?;
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    // Unique per process and per call: thread ranks of one process may
    // save to the same path at once. Hidden, and no longer than the file
    // system allows whatever the target's name.
    static SAVES: AtomicU64 = AtomicU64::new(0);
    let temporary = dir.join(format!(
        ".{}.tmp-{}-{}",
        name_stem(&file_name.to_string_lossy(), TEMPORARY_STEM_BYTES),
        std::process::id(),
        SAVES.fetch_add(1, Ordering::Relaxed)
    ));
    let write = || -> Result<()> {
        safetensors::tensor::serialize_to_file(&tensors, Some(metadata), &temporary)
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

/// The first `max` bytes of `name` at most, cut on a character boundary.
fn name_stem(name: &str, max: usize) -> &str {
    let mut end = name.len().min(max);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    &name[..end]
}

/// Loads a safetensors file into the variables of `varmap`, in place (the
/// variables keep their identity, so optimizers and `DataParallel` replicas
/// see the new values).
///
/// Names: a file written by [`save`] has its prefix stripped, exactly the
/// one recorded, so every set of names round-trips (`w` and `module.w`
/// included). A file from elsewhere (PyTorch) has `module.` stripped when
/// every key carries it (PyTorch's `consume_prefix_in_state_dict_if_present`),
/// unless the keys as they are name more of the model's variables.
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
    let unreadable = |e: &dyn std::fmt::Display| {
        Error::Checkpoint(format!("{}: cannot read it: {e}", path.display()))
    };
    let saved_prefix = saved_prefix(path).map_err(|e| unreadable(&e))?;
    let file = candle_core::safetensors::load(path, &Device::Cpu).map_err(|e| unreadable(&e))?;
    let vars = sorted_vars(varmap);
    let names: BTreeSet<&str> = vars.iter().map(|(name, _)| name.as_str()).collect();
    let keys: Vec<&str> = file.keys().map(String::as_str).collect();
    let prefix = saved_prefix.unwrap_or_else(|| foreign_prefix(&keys, &names).to_string());
    let mut by_name: BTreeMap<String, (String, Tensor)> = BTreeMap::new();
    let mut unexpected = Vec::new();
    for (key, tensor) in file {
        // Stripping one prefix from every key cannot make two keys equal.
        match key.strip_prefix(prefix.as_str()) {
            Some(name) if names.contains(name) => {
                by_name.insert(name.to_string(), (key.clone(), tensor));
            }
            _ => unexpected.push(key),
        }
    }
    // Sorted, so that the report does not depend on the file's order.
    unexpected.sort();
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

/// The prefix [`save`] recorded in the file's metadata, if it wrote the
/// file. Reads the header only.
fn saved_prefix(path: &Path) -> std::io::Result<Option<String>> {
    // safetensors' own limit on the header, so that a corrupt length cannot
    // make this allocate without bound.
    const MAX_HEADER: u64 = 100_000_000;
    let invalid = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what);
    let mut file = File::open(path)?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len)
        .map_err(|_| invalid("shorter than a safetensors header"))?;
    let len = u64::from_le_bytes(len);
    if len > MAX_HEADER {
        return Err(invalid(
            "its header length is not that of a safetensors file",
        ));
    }
    let mut header = Vec::new();
    file.take(len).read_to_end(&mut header)?;
    // A header that does not parse is left for the full load to report.
    let Ok(header) = serde_json::from_slice::<serde_json::Value>(&header) else {
        return Ok(None);
    };
    Ok(header
        .get(RESERVED_KEY)
        .and_then(|metadata| metadata.get(PREFIX_METADATA))
        .and_then(|prefix| prefix.as_str())
        .map(str::to_string))
}

/// The prefix to strip from a file [`save`] did not write: `module.` when
/// every key carries it and stripping it names at least as many of the
/// model's variables as the keys do as they are.
fn foreign_prefix(keys: &[&str], names: &BTreeSet<&str>) -> &'static str {
    let all_prefixed = !keys.is_empty() && keys.iter().all(|k| k.starts_with(MODULE_PREFIX));
    let matches = |strip: &str| {
        keys.iter()
            .filter(|k| k.strip_prefix(strip).is_some_and(|n| names.contains(n)))
            .count()
    };
    if all_prefixed && matches(MODULE_PREFIX) >= matches("") {
        MODULE_PREFIX
    } else {
        ""
    }
}
