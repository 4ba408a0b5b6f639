//! An optimizer's state as named tensors and settings, and the checks that
//! make loading it all-or-nothing.

use std::collections::{BTreeMap, HashMap};

use candle_core::{Tensor, Var};
use candle_nn::VarMap;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::util::vars::sorted_vars;

/// Everything an optimizer needs to continue exactly: its kind, the number
/// of steps taken, its settings and its per-parameter tensors.
#[derive(Debug, Clone, Default)]
pub struct OptimizerState {
    /// Which optimizer made it: `"sgd"`, `"adam"` or `"adamw"`.
    pub kind: String,
    /// The number of `step` calls so far.
    pub steps: u64,
    /// The settings by name (`lr`, `momentum`, `beta1`, `amsgrad` as 0 or
    /// 1, …), as PyTorch's `param_groups` holds them; loading restores
    /// them, as PyTorch's `load_state_dict` does.
    pub settings: BTreeMap<String, f64>,
    /// `"<parameter>.<slot>"` → tensor (`l1.weight.exp_avg`,
    /// `l1.weight.step`), for the parameters that have state: a parameter
    /// that never had a gradient has none, as in PyTorch.
    pub tensors: BTreeMap<String, Tensor>,
    /// `None` for a whole optimizer's state; for one rank's part of a
    /// sharded one ([`ZeroOptimizer::shard_state`](crate::zero::ZeroOptimizer::shard_state)),
    /// which rank of how many saved it, so that a resume can tell a
    /// complete set of shards from an incomplete or mixed one. A shard
    /// loads only through
    /// [`ZeroOptimizer::load_shards`](crate::zero::ZeroOptimizer::load_shards),
    /// with every other rank's.
    pub shard: Option<ShardOf>,
}

/// Which part of a sharded optimizer state an [`OptimizerState`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardOf {
    /// The rank that saved it.
    pub rank: usize,
    /// How many ranks (shards) the run that saved it had.
    pub world_size: usize,
}

/// An optimizer whose state can be taken and restored: a fresh optimizer
/// over the same variables that loads [`state`](Self::state) continues
/// exactly as the original would have.
pub trait StatefulOptimizer: candle_nn::Optimizer {
    /// A copy of the state (tensors on the CPU).
    ///
    /// # Errors
    ///
    /// A tensor that cannot be made (out of memory).
    fn state(&self) -> Result<OptimizerState>;

    /// Replaces the state with `state`; nothing changes unless all of it
    /// fits.
    ///
    /// # Errors
    ///
    /// [`Error::OptimizerState`] when `state` is another kind's, names a
    /// parameter or slot this optimizer does not have, has a tensor of the
    /// wrong shape, an unknown setting, a setting that is not a finite
    /// number or a flag that is neither 0 nor 1, or is one rank's shard of
    /// a sharded state ([`OptimizerState::shard`]: load every shard with
    /// [`ZeroOptimizer::load_shards`](crate::zero::ZeroOptimizer::load_shards)).
    fn load_state(&mut self, state: &OptimizerState) -> Result<()>;

    /// Each parameter group's rate, in group order (PyTorch's
    /// `[g["lr"] for g in opt.param_groups]`); one group by default.
    fn group_learning_rates(&self) -> Vec<f64> {
        vec![self.learning_rate()]
    }

    /// Sets each parameter group's rate, in group order (what a schedule
    /// over the groups gives: [`LrScheduler::group_lrs`](super::LrScheduler::group_lrs)).
    ///
    /// # Errors
    ///
    /// [`Error::OptimizerState`] when `lrs` has another number of rates
    /// than the optimizer has groups; nothing changes then.
    fn set_group_learning_rates(&mut self, lrs: &[f64]) -> Result<()> {
        match lrs {
            [lr] => {
                self.set_learning_rate(*lr);
                Ok(())
            }
            _ => Err(invalid(format!(
                "{} rates for an optimizer of one parameter group",
                lrs.len()
            ))),
        }
    }
}

/// The variables of `varmap`, named and sorted by name.
pub(crate) fn named_vars(varmap: &VarMap) -> Vec<(String, Var)> {
    sorted_vars(varmap)
}

/// `vars` named by position, as PyTorch numbers an optimizer's parameters.
pub(crate) fn by_position(vars: Vec<Var>) -> Vec<(String, Var)> {
    vars.into_iter()
        .enumerate()
        .map(|(i, var)| (i.to_string(), var))
        .collect()
}

/// The error of a state that does not fit.
pub(crate) fn invalid(reason: impl Into<String>) -> Error {
    Error::OptimizerState(reason.into())
}

/// The setting holding a state's number of parameter groups (absent: one).
pub(crate) const GROUPS: &str = "groups";
/// The prefix of the settings that put a parameter in a group other than
/// the first (`group_of.<parameter>`).
pub(crate) const GROUP_OF: &str = "group_of.";

/// Setting `name` of parameter group `g`: its own name for group 0 (a
/// one-group state reads as before groups existed), `group<g>.<name>`
/// for the others.
pub(crate) fn group_key(g: usize, name: &str) -> String {
    match g {
        0 => name.to_string(),
        _ => format!("group{g}.{name}"),
    }
}

/// Whether `key` is one of `settings`, for any group, or records the
/// groups ([`GROUPS`], [`GROUP_OF`]).
fn known_setting(key: &str, settings: &[&str]) -> bool {
    let of_a_group = || {
        let rest = key.strip_prefix("group")?;
        let (g, name) = rest.split_once('.')?;
        let g: usize = g.parse().ok()?;
        Some(g > 0 && settings.contains(&name))
    };
    settings.contains(&key)
        || key == GROUPS
        || key.starts_with(GROUP_OF)
        || of_a_group().unwrap_or(false)
}

/// Checks that `state` is of `kind` and sorts its tensors by parameter:
/// for each of `params`, its entries by slot. Every entry must name a
/// parameter and one of `slots` (`(slot, whether it is a scalar)`), with
/// the parameter's shape (a scalar slot: one value). Every setting must be
/// one of `settings` (of any parameter group), or say which group a
/// parameter is in.
pub(crate) fn sort_entries(
    state: &OptimizerState,
    kind: &str,
    params: &[(String, Var)],
    slots: &[(&str, bool)],
    settings: &[&str],
) -> Result<Vec<HashMap<String, Tensor>>> {
    if state.kind != kind {
        return Err(invalid(format!(
            "the state is of a `{}` optimizer, this one is `{kind}`",
            state.kind
        )));
    }
    if let Some(ShardOf { rank, world_size }) = state.shard {
        return Err(invalid(format!(
            "the state is rank {rank}'s shard of an optimizer state sharded over {world_size} \
             ranks: alone it would restart the other ranks' parameters from no state; load \
             every rank's shard with ZeroOptimizer::load_shards"
        )));
    }
    if let Some(unknown) = state.settings.keys().find(|k| !known_setting(k, settings)) {
        return Err(invalid(format!(
            "unknown setting `{unknown}` for `{kind}` (known: {settings:?})"
        )));
    }
    let index: HashMap<&str, usize> = params
        .iter()
        .enumerate()
        .map(|(i, (name, _))| (name.as_str(), i))
        .collect();
    let mut sorted = vec![HashMap::new(); params.len()];
    for (key, tensor) in &state.tensors {
        let found = slots.iter().find_map(|&(slot, scalar)| {
            let name = key.strip_suffix(slot)?.strip_suffix('.')?;
            Some((*index.get(name)?, slot, scalar))
        });
        let Some((i, slot, scalar)) = found else {
            return Err(invalid(format!(
                "`{key}` names no parameter and slot of this `{kind}` optimizer (parameters such as `{}`, slots {:?})",
                params.first().map_or("", |(n, _)| n.as_str()),
                slots.iter().map(|(s, _)| *s).collect::<Vec<_>>()
            )));
        };
        let (name, var) = &params[i];
        let fits = if scalar {
            tensor.elem_count() == 1
        } else {
            tensor.dims() == var.dims()
        };
        if !fits {
            return Err(invalid(format!(
                "the `{slot}` state of parameter `{name}` has shape {:?}, the parameter {:?}",
                tensor.dims(),
                var.dims()
            )));
        }
        sorted[i].insert(slot.to_string(), tensor.clone());
    }
    Ok(sorted)
}

/// A setting of `state`, or `current` when the state does not have it.
pub(crate) fn setting(state: &OptimizerState, name: &str, current: f64) -> f64 {
    state.settings.get(name).copied().unwrap_or(current)
}

/// A scalar state tensor's value.
pub(crate) fn scalar_value(tensor: &Tensor) -> Result<f64> {
    Ok(tensor
        .flatten_all()?
        .to_dtype(candle_core::DType::F64)?
        .to_vec1::<f64>()?
        .first()
        .copied()
        .unwrap_or(0.0))
}

/// A flag setting of `state` (saved as 0 or 1), or `current` when the
/// state does not have it.
///
/// # Errors
///
/// [`Error::OptimizerState`] naming the setting when its value is neither
/// 0 nor 1.
pub(crate) fn flag(state: &OptimizerState, name: &str, current: bool) -> Result<bool> {
    match state.settings.get(name) {
        None => Ok(current),
        Some(&0.0) => Ok(false),
        Some(&1.0) => Ok(true),
        Some(v) => Err(invalid(format!(
            "setting `{name}` is {v}: a flag must be 0 or 1"
        ))),
    }
}

/// Refuses two parameters of one name (the state would keep one entry for
/// both, and a resumed run would differ) and one variable given twice (it
/// would be updated twice a step), naming them.
pub(crate) fn check_unique(optimizer: &str, params: &[(String, Var)]) -> candle_core::Result<()> {
    let mut names = HashMap::new();
    let mut ids = HashMap::new();
    for (name, var) in params {
        if let Some(other) = names.insert(name.as_str(), name) {
            return Err(candle_core::Error::Msg(format!(
                "{optimizer}: two parameters are named `{other}`: their states would be saved \
                 under one name"
            )));
        }
        if let Some(other) = ids.insert(var.id(), name) {
            return Err(candle_core::Error::Msg(format!(
                "{optimizer}: parameters `{other}` and `{name}` are the same variable: it would \
                 be updated twice a step"
            )));
        }
    }
    Ok(())
}

/// Refuses a setting that is not a number (NaN, an infinity), naming it.
pub(crate) fn check_finite(optimizer: &str, settings: &[(&str, f64)]) -> candle_core::Result<()> {
    match settings.iter().find(|(_, v)| !v.is_finite()) {
        Some((name, value)) => Err(candle_core::Error::Msg(format!(
            "{optimizer}: invalid {name} {value}: it must be a finite number"
        ))),
        None => Ok(()),
    }
}

/// PyTorch's constructor check of settings that must not be negative: the
/// first that is (or is NaN), as `"{optimizer}: invalid {name} …"`.
pub(crate) fn check_non_negative(
    optimizer: &str,
    settings: &[(&str, f64)],
) -> candle_core::Result<()> {
    match settings.iter().find(|(_, v)| v.is_nan() || *v < 0.0) {
        Some((name, value)) => Err(candle_core::Error::Msg(format!(
            "{optimizer}: invalid {name} {value}: it must be at least 0"
        ))),
        None => Ok(()),
    }
}
