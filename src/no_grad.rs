//! Variables that received no gradient in a step.
//!
//! A trainable variable without a gradient is silently never updated.
//! PyTorch's DDP names such parameters; here both engines report them after
//! each parallel backward ([`Step::vars_without_grad`](crate::Step::vars_without_grad),
//! [`DistributedDataParallel::vars_without_grad`](crate::DistributedDataParallel::vars_without_grad))
//! and warn once, through `tracing`, the first time it happens.
//!
//! **The LayerNorm trap**: candle-nn 0.11's `LayerNorm` runs a fused kernel
//! (`candle_nn::ops::layer_norm`) on contiguous inputs, and that kernel has
//! no backward: every variable before it (and its own weight and bias) gets
//! no gradient, on one device as through data parallelism. Models such as
//! candle-transformers' BERT use it. The workaround is a layer norm built
//! from differentiable operations, `candle_nn::ops::layer_norm_slow(x,
//! weight, bias, eps)`, in your own module (same result, slower).

use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::backprop::GradStore;
use candle_core::Var;

/// Finds the variables without a gradient, and warns the first time.
#[derive(Debug, Default)]
pub(crate) struct NoGradCheck {
    warned: AtomicBool,
}

impl NoGradCheck {
    /// The names of `params` that have no gradient in `grads`. `engine`
    /// names the caller in the warning.
    pub(crate) fn check(
        &self,
        engine: &str,
        params: &[(String, Var)],
        grads: &GradStore,
    ) -> Vec<String> {
        let missing: Vec<String> = params
            .iter()
            .filter(|(_, var)| grads.get(var.as_tensor()).is_none())
            .map(|(name, _)| name.clone())
            .collect();
        if !missing.is_empty() && !self.warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                count = missing.len(),
                "{engine}: {} of {} variables received no gradient in this step and will not be trained: {missing:?} (is a layer without backward in the model, such as candle-nn's fused LayerNorm? see candle_dp's docs on vars_without_grad)",
                missing.len(),
                params.len()
            );
        }
        missing
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn names_the_variables_missing_from_the_store() {
        let a = Var::zeros(2, DType::F32, &Device::Cpu).unwrap();
        let b = Var::zeros(2, DType::F32, &Device::Cpu).unwrap();
        let grads = (a.as_tensor() * 2.)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let params = vec![("a".to_string(), a), ("b".to_string(), b)];
        let check = NoGradCheck::default();
        assert_eq!(check.check("test", &params, &grads), vec!["b".to_string()]);
        assert_eq!(check.check("test", &params, &grads), vec!["b".to_string()]);
    }
}
