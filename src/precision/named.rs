//! [`Precision`]: the named precisions of the Fabric (`32-true`,
//! `bf16-mixed`, `16-mixed`, and Accelerate's names): each one's policy,
//! compute dtype, loss scaling, the check that a device has its kernels,
//! and the dtype a loss sees. A configuration only names one.

use std::fmt;
use std::str::FromStr;

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

use super::MixedPrecision;
use crate::error::{Error, Result};

/// The dtype of the forward and backward (Fabric's `precision`); the
/// master weights, the gradients the optimizer sees and its state stay in
/// f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum Precision {
    /// Everything in f32 (`32-true`).
    #[default]
    #[serde(rename = "32-true", alias = "32", alias = "no", alias = "f32")]
    F32,
    /// bf16 compute over f32 masters, gradients reduced in f32
    /// (`bf16-mixed`); no loss scaling needed.
    #[serde(rename = "bf16-mixed", alias = "bf16")]
    Bf16Mixed,
    /// f16 compute over f32 masters, gradients reduced in f32, with
    /// PyTorch's dynamic loss scaling (`16-mixed`).
    #[serde(rename = "16-mixed", alias = "16", alias = "fp16", alias = "f16")]
    F16Mixed,
}

impl Precision {
    /// Its name as Fabric writes it.
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "32-true",
            Precision::Bf16Mixed => "bf16-mixed",
            Precision::F16Mixed => "16-mixed",
        }
    }

    /// The mixed-precision policy (`None` for f32: the model computes on
    /// the masters themselves).
    pub fn policy(self) -> Option<MixedPrecision> {
        match self {
            Precision::F32 => None,
            Precision::Bf16Mixed => Some(MixedPrecision::bf16()),
            Precision::F16Mixed => Some(MixedPrecision::f16()),
        }
    }

    /// The dtype the model computes in.
    pub fn compute_dtype(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::Bf16Mixed => DType::BF16,
            Precision::F16Mixed => DType::F16,
        }
    }

    /// Whether the loss is scaled (f16's narrow range).
    pub fn scales_loss(self) -> bool {
        self == Precision::F16Mixed
    }

    /// The whole policy in words, as a training state records it: the
    /// name, the compute and reduce dtypes, the masters' dtype and the
    /// variables kept in it, and whether the loss is scaled.
    ///
    /// ```
    /// use candle_dp::fabric::Precision;
    /// assert_eq!(
    ///     Precision::Bf16Mixed.policy_description(),
    ///     "bf16-mixed: compute bf16, gradients reduced in f32, f32 masters, none kept in f32, loss not scaled"
    /// );
    /// ```
    pub fn policy_description(self) -> String {
        let (compute, reduce, kept) = match self.policy() {
            None => (DType::F32, DType::F32, "all"),
            Some(policy) => (
                policy.param_dtype,
                policy.reduce_dtype.unwrap_or(policy.param_dtype),
                match policy.keep_full_precision {
                    Some(_) => "some",
                    None => "none",
                },
            ),
        };
        format!(
            "{}: compute {}, gradients reduced in {}, f32 masters, {kept} kept in f32, loss {}",
            self.name(),
            compute.as_str(),
            reduce.as_str(),
            if self.scales_loss() {
                "scaled"
            } else {
                "not scaled"
            }
        )
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Precision {
    type Err = Error;

    /// Fabric's names (`32-true`, `bf16-mixed`, `16-mixed`, and `32`,
    /// `bf16`, `16`) and Accelerate's (`no`, `bf16`, `fp16`).
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "32-true" | "32" | "no" | "f32" | "fp32" => Ok(Precision::F32),
            "bf16-mixed" | "bf16" => Ok(Precision::Bf16Mixed),
            "16-mixed" | "16" | "fp16" | "f16" => Ok(Precision::F16Mixed),
            _ => Err(Error::Config(format!(
                "unknown precision `{s}`: one of 32-true, bf16-mixed, 16-mixed"
            ))),
        }
    }
}

impl Precision {
    /// Tries this precision's kernels on `device` (a product and an
    /// exponential), so that a device without them is refused before a
    /// run: the error says which dtype failed and why.
    pub(crate) fn check_on(self, device: &Device) -> std::result::Result<(), String> {
        let dtype = self.compute_dtype();
        let tried = Tensor::ones((2, 2), dtype, device)
            .and_then(|a| a.matmul(&a))
            .and_then(|a| a.exp())
            .and_then(|a| a.sum_all())
            .and_then(|a| a.to_dtype(DType::F32));
        tried.map(|_| ()).map_err(|e| {
            format!(
                "precision {self} computes in {dtype:?}, which {} cannot: {e}",
                crate::util::device_label::device_label(device)
            )
        })
    }
}

/// A model's output as its loss sees it: in f32 whatever the precision, as
/// a loss under `autocast`.
pub(crate) fn output_for_loss(t: &Tensor) -> candle_core::Result<Tensor> {
    match t.dtype() {
        DType::BF16 | DType::F16 => t.to_dtype(DType::F32),
        _ => Ok(t.clone()),
    }
}
