//! The agreement a group that reduces on the GPU (an `NcclGroup`, feature
//! `nccl`) reaches over its host group before every collective: what each
//! rank called, with which tensor, and whether the call can run on the
//! device.
//!
//! NCCL itself checks nothing: ranks that call different collectives, or
//! pass tensors of different sizes, deadlock or read garbage. So every rank
//! first sends a [`DeviceCall`] over the host group (a few hundred bytes on
//! the CPU, no device synchronisation) and [`agree`] computes the same
//! verdict on every rank from all of them: the same error everywhere, or
//! where the collective runs ([`Route`]).

use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

use super::protocol::{self, OpSig, Signature, TensorMeta};
use super::{CommError, ReduceOp, Result};

/// What one rank tells the others about its call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct DeviceCall {
    pub(crate) op: OpSig,
    /// dtype name and shape of the rank's tensor, for collectives whose
    /// tensors must match.
    pub(crate) meta: Option<(String, Vec<usize>)>,
    /// Why the rank's input cannot be used, if it cannot.
    pub(crate) invalid: Option<String>,
    /// Whether this rank's tensor can take the device path: on its GPU, in
    /// a dtype the device library reduces, for a collective it runs.
    pub(crate) on_device: bool,
}

impl DeviceCall {
    /// `op` on `tensor` (`None` for collectives without one); `on_device`
    /// says whether this rank could run it on the GPU.
    pub(crate) fn new(
        op: OpSig,
        tensor: Option<&Tensor>,
        invalid: Option<String>,
        on_device: bool,
    ) -> Self {
        Self {
            op,
            meta: tensor.map(|t| (t.dtype().as_str().to_string(), t.dims().to_vec())),
            invalid,
            on_device,
        }
    }

    fn signature(&self) -> Signature {
        let parsed = self
            .meta
            .as_ref()
            .map(|(dtype, dims)| match dtype.parse::<DType>() {
                Ok(dtype) => Ok(TensorMeta {
                    dtype,
                    dims: dims.clone(),
                }),
                Err(_) => Err(format!("unknown dtype {dtype:?}")),
            })
            .transpose();
        let (meta, unknown) = match parsed {
            Ok(meta) => (meta, None),
            Err(why) => (None, Some(why)),
        };
        Signature {
            op: self.op,
            meta,
            invalid: self.invalid.clone().or(unknown),
        }
    }
}

/// Where an agreed collective runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// On the GPUs, through the device library, in stream order.
    Device,
    /// Through the host group (CPU tensors, dtypes or reductions the
    /// device library lacks), as that group does it.
    Host,
}

/// The verdict on a collective, identical on every rank: `calls[r]` is rank
/// `r`'s call, `rank` the rank computing it (for the message). Mismatched
/// calls and invalid input give the host groups' errors; tensors on the GPU
/// on some ranks and not on others are an error naming the first rank
/// that differs from rank 0.
pub(crate) fn agree(calls: &[DeviceCall], rank: usize, op: &'static str) -> Result<Route> {
    let sigs: Vec<Signature> = calls.iter().map(DeviceCall::signature).collect();
    protocol::check(&sigs.iter().collect::<Vec<_>>(), rank, op)?;
    let first = calls.first().is_some_and(|c| c.on_device);
    match calls.iter().position(|c| c.on_device != first) {
        None if first => Ok(Route::Device),
        None => Ok(Route::Host),
        Some(culprit) => Err(CommError::InvalidInput {
            rank,
            op,
            culprit,
            reason: format!(
                "its tensor {} the GPU path and rank 0's {}: every rank's tensor must be on \
                 its GPU in a dtype NCCL reduces, or every rank's elsewhere",
                if first { "cannot take" } else { "can take" },
                if first { "can" } else { "cannot" },
            ),
        }),
    }
}

/// Whether NCCL takes `dtype` with `op`. Integer averages are left to the
/// host groups, which truncate the exact sum: NCCL's `ncclAvg` scales each
/// value before summing. NCCL has no 16-bit integers.
pub(crate) fn device_reduces(dtype: DType, op: Option<ReduceOp>) -> bool {
    let float = matches!(dtype, DType::F16 | DType::BF16 | DType::F32 | DType::F64);
    let int = matches!(dtype, DType::U8 | DType::U32 | DType::I32 | DType::I64);
    float || (int && op != Some(ReduceOp::Avg))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(op: OpSig, dims: &[usize], on_device: bool) -> DeviceCall {
        DeviceCall {
            op,
            meta: Some(("f32".into(), dims.to_vec())),
            invalid: None,
            on_device,
        }
    }

    #[test]
    fn ranks_that_all_hold_gpu_tensors_take_the_device_path() {
        let c = call(OpSig::AllReduce(ReduceOp::Sum), &[4], true);
        assert_eq!(
            agree(&[c.clone(), c], 1, "all_reduce").unwrap(),
            Route::Device
        );
    }

    #[test]
    fn ranks_that_all_hold_host_tensors_take_the_host_path() {
        let c = call(OpSig::AllGather, &[4], false);
        assert_eq!(
            agree(&[c.clone(), c], 0, "all_gather").unwrap(),
            Route::Host
        );
    }

    #[test]
    fn a_rank_whose_tensor_is_elsewhere_is_named_on_every_rank() {
        let gpu = call(OpSig::AllReduce(ReduceOp::Sum), &[4], true);
        let cpu = call(OpSig::AllReduce(ReduceOp::Sum), &[4], false);
        let calls = [gpu.clone(), gpu, cpu];
        for rank in 0..3 {
            match agree(&calls, rank, "all_reduce").unwrap_err() {
                CommError::InvalidInput {
                    rank: r, culprit, ..
                } => assert_eq!((r, culprit), (rank, 2)),
                other => panic!("{other}"),
            }
        }
    }

    #[test]
    fn a_shape_mismatch_is_reported_before_the_route() {
        let a = call(OpSig::Broadcast { root: 0 }, &[4], true);
        let b = call(OpSig::Broadcast { root: 0 }, &[5], false);
        let err = agree(&[a, b], 0, "broadcast").unwrap_err();
        assert!(
            matches!(err, CommError::TensorMismatch { ref ranks, .. } if ranks == &[1]),
            "{err}"
        );
    }

    #[test]
    fn calls_survive_the_trip_through_the_host_group() {
        let c = DeviceCall::new(
            OpSig::Reduce {
                root: 1,
                op: ReduceOp::Max,
            },
            Some(&Tensor::zeros((2, 3), DType::BF16, &candle_core::Device::Cpu).unwrap()),
            Some("why".into()),
            true,
        );
        let bytes = rmp_serde::to_vec_named(&c).unwrap();
        let back: DeviceCall = rmp_serde::from_slice(&bytes).unwrap();
        assert_eq!(back, c);
        assert_eq!(back.signature().meta.unwrap().dtype, DType::BF16);
    }

    #[test]
    fn integer_averages_stay_on_the_host() {
        assert!(device_reduces(DType::F32, Some(ReduceOp::Avg)));
        assert!(device_reduces(DType::I64, Some(ReduceOp::Sum)));
        assert!(!device_reduces(DType::I64, Some(ReduceOp::Avg)));
        assert!(
            !device_reduces(DType::I16, None),
            "NCCL has no 16-bit integers"
        );
    }
}
