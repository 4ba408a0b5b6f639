//! A model's variables by name, in a fixed order, and their gradients.

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use candle_nn::VarMap;

use crate::util::lock::lock;

/// The variables of `varmap`, sorted by name so that every ordering derived
/// from them (gradient reduction, buckets, checkpoints) is deterministic
/// (`VarMap` iterates in hash order).
pub(crate) fn sorted_vars(varmap: &VarMap) -> Vec<(String, Var)> {
    let data = lock(varmap.data());
    let mut vars: Vec<(String, Var)> = data.iter().map(|(n, v)| (n.clone(), v.clone())).collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    vars
}

/// The gradient of each of `vars` in `store`, in order (`None`: no gradient).
pub(crate) fn grads_of(store: &GradStore, vars: &[(String, Var)]) -> Vec<Option<Tensor>> {
    vars.iter()
        .map(|(_, var)| store.get(var.as_tensor()).cloned())
        .collect()
}

/// [`grads_of`]'s inverse: a store of `grads` (one optional gradient per
/// variable of `vars`, in order) keyed by those variables.
pub(crate) fn store_of(vars: &[(String, Var)], grads: Vec<Option<Tensor>>) -> GradStore {
    let mut store = GradStore::default();
    for ((_, var), grad) in vars.iter().zip(grads) {
        if let Some(grad) = grad {
            store.insert(var.as_tensor(), grad);
        }
    }
    store
}

/// A parameter's gradient of this backward plus what `no_sync`
/// accumulated for it (in that order of the sum, on every path).
pub(crate) fn with_accumulated(
    acc: Option<&Tensor>,
    grad: Option<Tensor>,
) -> candle_core::Result<Option<Tensor>> {
    Ok(match (acc, grad) {
        (Some(a), Some(g)) => Some((a + g)?),
        (a, g) => a.cloned().or(g),
    })
}
