//! One device's model computing in a low dtype over f32 master variables.

use candle_core::{DType, Device, Module, ModuleT, Tensor};
use candle_nn::{VarBuilder, VarMap};

use crate::buffers::{is_batch_norm_buffer, BufferPredicate};
use crate::error::Result;
use crate::replicate::{build_replica, CopyOptions, ReplicaVars};

use super::MixedPrecision;

/// The user's model built over copies of the master variables in the
/// policy's compute dtype (see the [module](super) documentation): the
/// single-device form of mixed precision. The optimizer works on the
/// `VarMap`'s master variables, as without mixed precision.
pub struct MixedPrecisionModel<M> {
    module: M,
    copies: ReplicaVars,
    policy: MixedPrecision,
}

impl<M> MixedPrecisionModel<M> {
    /// Builds the model from `factory`: variables missing from `varmap` are
    /// created there in `master_dtype` on `device` (from the factory's
    /// initialisers), and the model computes on copies of them in
    /// `policy.param_dtype` (those `keep_full_precision` names excepted).
    /// Buffers are candle-nn's BatchNorm statistics.
    ///
    /// # Errors
    ///
    /// [`Error::MixedPrecision`](crate::Error::MixedPrecision) for a dtype
    /// that is not floating point; the factory's error.
    pub fn new(
        varmap: &VarMap,
        master_dtype: DType,
        device: &Device,
        policy: MixedPrecision,
        factory: impl FnOnce(VarBuilder) -> candle_core::Result<M>,
    ) -> Result<Self> {
        let (module, copies) = build_in_precision(
            0,
            varmap,
            master_dtype,
            device,
            &policy,
            std::sync::Arc::new(is_batch_norm_buffer),
            factory,
        )?;
        Ok(Self {
            module,
            copies,
            policy,
        })
    }

    /// The model (its parameters are the low-precision copies, as of the
    /// last refresh).
    pub fn module(&self) -> &M {
        &self.module
    }

    /// The policy.
    pub fn policy(&self) -> &MixedPrecision {
        &self.policy
    }

    /// Copies the masters' current values into the model's copies (what
    /// [`forward`](Self::forward) does first).
    pub fn refresh(&self) -> Result<()> {
        Ok(self.copies.refresh()?)
    }

    /// Refreshes the copies, runs the model on `x` (a floating-point input
    /// converted to the compute dtype; others, such as token ids, as they
    /// are), and writes its buffers back to the masters. The output stays
    /// in the compute dtype.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor>
    where
        M: Module,
    {
        self.refresh()?;
        let out = self.module.forward(&self.input(x)?)?;
        self.copies.commit_buffers()?;
        Ok(out)
    }

    /// [`forward`](Self::forward) with a train / eval flag; buffers are
    /// written back only in training.
    pub fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor>
    where
        M: ModuleT,
    {
        self.refresh()?;
        let out = self.module.forward_t(&self.input(x)?, train)?;
        if train {
            self.copies.commit_buffers()?;
        }
        Ok(out)
    }

    fn input(&self, x: &Tensor) -> Result<Tensor> {
        Ok(cast_input(x, self.policy.param_dtype)?)
    }
}

/// `x` in `dtype` when it is floating point (FSDP2's
/// `cast_forward_inputs`); integer inputs unchanged.
pub(crate) fn cast_input(x: &Tensor, dtype: DType) -> candle_core::Result<Tensor> {
    if x.dtype().is_float() {
        x.to_dtype(dtype)
    } else {
        Ok(x.clone())
    }
}

/// Builds `factory`'s model over copies of `varmap`'s variables in the
/// policy's compute dtype (creating missing masters in `master_dtype`):
/// what [`MixedPrecisionModel`] and DDP's mixed precision share. `index`
/// names the model in errors (DDP: the rank).
pub(crate) fn build_in_precision<M>(
    index: usize,
    varmap: &VarMap,
    master_dtype: DType,
    device: &Device,
    policy: &MixedPrecision,
    is_buffer: BufferPredicate,
    factory: impl FnOnce(VarBuilder) -> candle_core::Result<M>,
) -> Result<(M, ReplicaVars)> {
    policy.check()?;
    let options = CopyOptions {
        keep_master_dtype: policy.keep_full_precision.clone(),
        create_in: Some(master_dtype),
    };
    build_replica(
        index,
        varmap,
        policy.param_dtype,
        device,
        is_buffer,
        options,
        factory,
    )
}

impl<M> std::fmt::Debug for MixedPrecisionModel<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MixedPrecisionModel")
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}
