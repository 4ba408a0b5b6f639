//! Mixed precision: the forward and backward in bf16 or f16, the master
//! weights, the gradients the optimizer sees and its state in f32.
//!
//! The policy is FSDP2's `MixedPrecisionPolicy`: a compute dtype for the
//! parameters ([`MixedPrecision::param_dtype`]) and a dtype for the
//! gradient reduction ([`MixedPrecision::reduce_dtype`]). The model is
//! built once from the user's factory over copies of the master variables
//! in the compute dtype, tied to them as `DataParallel`'s replicas are: a
//! copy's autograd op leads back to its master, so `backward` gives f32
//! gradients of the master variables (the low-precision gradient widened,
//! which is exact), and before every forward the copies are refreshed from
//! the masters (one conversion per parameter).
//!
//! Where it applies:
//! - one device: [`MixedPrecisionModel`];
//! - [`DataParallel`](crate::DataParallel):
//!   [`DataParallelBuilder::mixed_precision`](crate::DataParallelBuilder::mixed_precision)
//!   (the replicas compute in the low dtype; the gradients are summed in
//!   the master's dtype);
//! - [`DistributedDataParallel`](crate::DistributedDataParallel) on every
//!   process group, and ZeRO through it:
//!   [`DdpBuilder::mixed_precision`](crate::DdpBuilder::mixed_precision)
//!   (the buckets travel in the reduce dtype).
//!
//! **What stays in f32.** Variables named by
//! [`keep_full_precision`](MixedPrecision::keep_full_precision) (norms,
//! typically) are not copied: the model uses the master itself, so its
//! code must give such a layer an f32 input and cast back (this crate does
//! not rewrite the model's ops as PyTorch's autocast does). The loss is the
//! model code's too: cast the logits to f32 before it, as autocast's
//! `cross_entropy` does, which is also what a [`GradScaler`] needs (its
//! scale, 65536, is past f16's largest value). Buffers (BatchNorm
//! statistics) are private copies in the compute dtype, refreshed before
//! each forward and written back to the masters after it.
//!
//! [`GradScaler`]: crate::optim::GradScaler
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use candle_dp::optim::{AdamW, AdamWConfig};
//! use candle_dp::precision::{MixedPrecision, MixedPrecisionModel};
//! use candle_nn::{linear, loss, Optimizer, VarMap};
//!
//! # fn main() -> anyhow::Result<()> {
//! let varmap = VarMap::new();
//! let model = MixedPrecisionModel::new(&varmap, DType::F32, &Device::Cpu,
//!     MixedPrecision::bf16(), |vb| linear(4, 3, vb))?;
//! let mut opt = AdamW::from_varmap(&varmap, AdamWConfig::default())?; // f32 state
//!
//! let x = Tensor::ones((2, 4), DType::F32, &Device::Cpu)?;
//! let logits = model.forward(&x)?; // computed in bf16
//! assert_eq!(logits.dtype(), DType::BF16);
//! let y = Tensor::new(&[0u32, 2], &Device::Cpu)?;
//! let loss = loss::cross_entropy(&logits.to_dtype(DType::F32)?, &y)?;
//! opt.backward_step(&loss)?; // f32 gradients of the f32 masters
//! assert_eq!(varmap.all_vars()[0].dtype(), DType::F32);
//! # Ok(())
//! # }
//! ```

mod model;
mod named;

use std::fmt;
use std::sync::Arc;

use candle_core::DType;

use crate::buffers::BufferPredicate;
use crate::error::{Error, Result};

pub use model::MixedPrecisionModel;
pub(crate) use model::{build_in_precision, cast_input};
pub(crate) use named::output_for_loss;
pub use named::Precision;

/// In which dtype a model computes and its gradients travel; see the
/// [module](self) documentation.
#[derive(Clone)]
pub struct MixedPrecision {
    /// The dtype of the forward and backward (bf16 or f16 usually).
    pub param_dtype: DType,
    /// The dtype gradients are reduced in across ranks (DDP's buckets);
    /// `None`: `param_dtype`, as FSDP2's default.
    pub reduce_dtype: Option<DType>,
    /// Variables that stay in the master's dtype (default none).
    pub keep_full_precision: Option<BufferPredicate>,
}

impl MixedPrecision {
    /// Compute in `param_dtype`, reduce in it too.
    pub fn new(param_dtype: DType) -> Self {
        Self {
            param_dtype,
            reduce_dtype: None,
            keep_full_precision: None,
        }
    }

    /// Compute in bf16 (f32's range, 8 bits of mantissa: no loss scaling
    /// needed), reduce in f32.
    pub fn bf16() -> Self {
        Self::new(DType::BF16).reduce_dtype(DType::F32)
    }

    /// Compute in f16 (pair it with a [`GradScaler`](crate::optim::GradScaler)),
    /// reduce in f32.
    pub fn f16() -> Self {
        Self::new(DType::F16).reduce_dtype(DType::F32)
    }

    /// Reduces gradients across ranks in `dtype`.
    pub fn reduce_dtype(mut self, dtype: DType) -> Self {
        self.reduce_dtype = Some(dtype);
        self
    }

    /// Keeps the variables `keep` names in the master's dtype (norms).
    pub fn keep_full_precision(
        mut self,
        keep: impl Fn(&str) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.keep_full_precision = Some(Arc::new(keep));
        self
    }

    /// The dtype the gradients of variable `name`, kept in `master` dtype,
    /// are reduced in.
    pub(crate) fn reduce_dtype_of(&self, name: &str, master: DType) -> DType {
        if self.keeps(name) {
            master
        } else {
            self.reduce_dtype.unwrap_or(self.param_dtype)
        }
    }

    pub(crate) fn keeps(&self, name: &str) -> bool {
        self.keep_full_precision.as_ref().is_some_and(|k| k(name))
    }

    /// The policy's dtypes must be floating point.
    pub(crate) fn check(&self) -> Result<()> {
        for (what, dtype) in [
            ("param_dtype", Some(self.param_dtype)),
            ("reduce_dtype", self.reduce_dtype),
        ] {
            if let Some(dtype) = dtype {
                if !dtype.is_float() {
                    return Err(Error::MixedPrecision(format!(
                        "{what} {dtype:?} is not a floating-point dtype"
                    )));
                }
            }
        }
        Ok(())
    }
}

impl fmt::Debug for MixedPrecision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MixedPrecision")
            .field("param_dtype", &self.param_dtype)
            .field("reduce_dtype", &self.reduce_dtype)
            .field("keep_full_precision", &self.keep_full_precision.is_some())
            .finish()
    }
}
