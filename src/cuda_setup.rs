//! What a set of CUDA devices needs before several threads drive them: one
//! stream per GPU, and direct (peer) access between GPUs.
//!
//! **Streams.** `Device::new_cuda(i)` sends work to CUDA's *per-thread*
//! default stream: which stream runs a kernel depends on the thread that
//! launched it, and per-thread streams are not ordered with each other. A
//! [`DataParallel`](crate::DataParallel) or a
//! [`Pipeline`](crate::pipeline::Pipeline) drives the master device from
//! the caller's thread (scatter, optimizer) and from a worker thread
//! (replica 0, the gradients' reduce), so with per-thread streams the
//! optimizer's update of a weight and the next forward's read of it could
//! run in either order. `Device::new_cuda_with_stream(i)` gives the device
//! one stream of its own: every thread's work on it runs in the order the
//! threads issued it (the crate's channels order the threads).
//!
//! Two such devices on one GPU are two streams of one CUDA context, and
//! nothing orders them: cudarc makes a stream wait only for a buffer's
//! recorded write, and candle's kernels record none on their outputs, so a
//! copy from one stream to the other could read a tensor before the kernel
//! producing it ran. Between two GPUs cudarc's copy waits for everything
//! queued on the source's stream, which is enough. So the policy, correct by
//! construction: per-thread and legacy-default-stream devices are refused,
//! and so are two different devices on one GPU (give the same `Device`
//! twice for two replicas on one GPU: they share its stream).
//!
//! **Peer access.** Between two GPUs a copy is a `cuMemcpyPeerAsync`; with
//! peer access enabled it goes over NVLink or PCIe directly, without it the
//! driver stages it through host memory (correct, slower). Access is
//! enabled for every pair of distinct GPUs the hardware allows, with a
//! warning (`tracing`) for the pairs it does not.

use candle_core::Device;

use crate::cuda_stream::implicit_stream_ordinal;
use crate::error::{Error, Result};

/// One device of a DataParallel or a pipeline, as errors name it: its role
/// ("replica", "output device", "stage"), its index, the device.
pub(crate) type Role<'a> = (&'static str, usize, &'a Device);

/// Checks the `devices` of a DataParallel or a pipeline against the stream
/// policy above, then enables peer access between their distinct GPUs.
/// Nothing to do without the `cuda` feature or without CUDA devices.
pub(crate) fn prepare(devices: &[Role]) -> Result<()> {
    for &(role, index, device) in devices {
        if let Some(ordinal) = implicit_stream_ordinal(device) {
            return Err(Error::ImplicitCudaStream {
                role,
                index,
                ordinal,
            });
        }
    }
    for (k, &(role, index, device)) in devices.iter().enumerate() {
        let earlier = devices[..k].iter().find(|(_, _, other)| {
            other.location() == device.location() && !other.same_device(device)
        });
        if let (Some(&(first_role, first_index, _)), candle_core::DeviceLocation::Cuda { gpu_id }) =
            (earlier, device.location())
        {
            return Err(Error::TwoStreamsOfOneGpu {
                first: format!("{first_role} {first_index}"),
                second: format!("{role} {index}"),
                ordinal: gpu_id,
            });
        }
    }
    let all: Vec<Device> = devices.iter().map(|(_, _, d)| (*d).clone()).collect();
    cuda::enable_peer_access(&all);
    Ok(())
}

#[cfg(not(feature = "cuda"))]
mod cuda {
    use candle_core::Device;

    pub(super) fn enable_peer_access(_: &[Device]) {}
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use candle_core::cuda_backend::cudarc::driver::{sys, CudaContext};
    use candle_core::Device;

    /// Enables peer access both ways between every two distinct GPUs among
    /// `devices`, warning where the hardware or the driver refuses.
    pub(super) fn enable_peer_access(devices: &[Device]) {
        let contexts: BTreeMap<usize, Arc<CudaContext>> = devices
            .iter()
            .filter_map(|d| match d {
                Device::Cuda(cuda) => {
                    let ctx = cuda.cuda_stream().context().clone();
                    Some((ctx.ordinal(), ctx))
                }
                _ => None,
            })
            .collect();
        for (from, from_ctx) in &contexts {
            for (to, to_ctx) in &contexts {
                if from == to {
                    continue;
                }
                if let Err(why) = enable(from_ctx, to_ctx) {
                    tracing::warn!(
                        "no peer access from cuda:{from} to cuda:{to} ({why}): copies between \
                         them are staged through host memory by the driver"
                    );
                }
            }
        }
    }

    /// Lets `from`'s context read and write `to`'s memory directly.
    fn enable(from: &Arc<CudaContext>, to: &Arc<CudaContext>) -> Result<(), String> {
        let mut can_access = 0;
        // SAFETY: plain driver queries on live contexts (both `Arc`s are
        // held for the call); cudarc has no safe wrapper for peer access,
        // and candle 0.11 enables none (candle issue #3524). The calling
        // thread is bound to `from`'s context first, as
        // cuCtxEnablePeerAccess requires.
        unsafe {
            sys::cuDeviceCanAccessPeer(&mut can_access, from.cu_device(), to.cu_device())
                .result()
                .map_err(|e| e.to_string())?;
            if can_access == 0 {
                return Err("the hardware does not allow it".into());
            }
            from.bind_to_thread().map_err(|e| e.to_string())?;
            match sys::cuCtxEnablePeerAccess(to.cu_ctx(), 0) {
                sys::CUresult::CUDA_SUCCESS
                | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
                other => Err(format!("{other:?}")),
            }
        }
    }
}
