//! Which stream a CUDA device sends its work to: one of its own (made with
//! `Device::new_cuda_with_stream`), or an implicit one (per-thread or the
//! legacy default), which `cuda_setup.rs` refuses for
//! several threads and the NCCL group refuses for its ranks. Without the
//! `cuda` feature there is no CUDA device, and no implicit stream.

use candle_core::Device;

/// Whether `device` is a CUDA device with a stream of its own (made with
/// `Device::new_cuda_with_stream`).
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
pub(crate) fn has_own_stream(device: &Device) -> bool {
    device.is_cuda() && implicit_stream_ordinal(device).is_none()
}

/// The GPU ordinal of a CUDA device whose work goes to an implicit stream
/// (per-thread or legacy default), `None` for any other device.
#[cfg(not(feature = "cuda"))]
pub(crate) fn implicit_stream_ordinal(_: &Device) -> Option<usize> {
    None
}

/// CUDA's handle for the calling thread's default stream
/// (`CU_STREAM_PER_THREAD`), which cudarc's `per_thread_stream` uses.
#[cfg(feature = "cuda")]
const PER_THREAD_STREAM: usize = 0x2;

/// The GPU ordinal of a CUDA device whose work goes to an implicit stream
/// (per-thread or legacy default), `None` for any other device.
#[cfg(feature = "cuda")]
pub(crate) fn implicit_stream_ordinal(device: &Device) -> Option<usize> {
    let Device::Cuda(cuda) = device else {
        return None;
    };
    let stream = cuda.cuda_stream();
    let handle = stream.cu_stream() as usize;
    (handle == 0 || handle == PER_THREAD_STREAM).then(|| stream.context().ordinal())
}
