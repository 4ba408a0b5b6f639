//! Writing a tensor's values into a tensor that already exists, possibly on
//! another device: how replicas and pipeline stages follow the master's
//! parameters every step.
//!
//! The plain way, `dst.set(&src.to_device(dst.device()))`, allocates a new
//! storage on the destination, copies into it, and copies again into `dst`:
//! two device copies and an allocation per parameter per step. Between two
//! CUDA devices [`copy_into`] issues a single device-to-device copy into
//! `dst`'s own storage, on `dst`'s stream: cudarc's `memcpy_dtod`, a
//! `cuMemcpyPeerAsync` between GPUs.
//!
//! `dst` keeps its identity and its autograd op, so a replica's copy of a
//! parameter (the `ToDevice` of the master variable) still sends its
//! gradients home.
//!
//! Every copy between two CUDA devices made here is ordered both ways: the
//! destination's stream waits for the work queued on the source's before
//! the copy, and the source's stream waits for the copy after it. cudarc
//! does the first for copies between GPUs, but not the second: it frees a
//! temporary source on the source's stream, whose memory could then be
//! reused while the copy on the destination's stream still reads it.
//! [`to_device`] is candle's `to_device` with that second wait added.

use candle_core::{Device, Tensor};

/// `tensor.to_device(device)` (differentiable, as candle's), with the
/// source's stream made to wait for the copy when both are CUDA devices
/// (see the module docs).
pub(crate) fn to_device(tensor: &Tensor, device: &Device) -> candle_core::Result<Tensor> {
    let moved = tensor.to_device(device)?;
    #[cfg(feature = "cuda")]
    cuda::source_waits_for_copy(tensor.device(), device)?;
    Ok(moved)
}

/// Copies `src`'s values into `dst`, which must have the same shape and
/// dtype. Between two CUDA devices: one device copy, no allocation. On one
/// device: one copy (`slice_set`). Between the host and a GPU: the transfer,
/// then a copy on the destination.
///
/// 0-dim tensors work: the copy goes through their flattened (1-element)
/// views, which share the storage.
pub(crate) fn copy_into(dst: &Tensor, src: &Tensor) -> candle_core::Result<()> {
    if !dst.is_contiguous() {
        // `flatten_all` would copy it, and the values would land in the copy.
        candle_core::bail!(
            "cannot copy into a non-contiguous tensor of shape {:?}",
            dst.dims()
        );
    }
    if dst.dims() != src.dims() || dst.dtype() != src.dtype() {
        candle_core::bail!(
            "cannot copy a {:?} tensor of shape {:?} into a {:?} tensor of shape {:?}",
            src.dtype(),
            src.dims(),
            dst.dtype(),
            dst.dims()
        );
    }
    #[cfg(feature = "cuda")]
    if dst.device().is_cuda() && src.device().is_cuda() && !dst.device().same_device(src.device()) {
        // Different devices are different storages, so holding `src`'s read
        // lock while `dst`'s write lock is taken cannot deadlock.
        return cuda::copy_between_devices(dst, src);
    }
    let src = if src.device().same_device(dst.device()) {
        src.clone()
    } else {
        to_device(src, dst.device())?
    };
    dst.flatten_all()?.slice_set(&src.flatten_all()?, 0, 0)
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::{BackendDevice, BackendStorage};
    use candle_core::cuda_backend::{CudaStorage, CudaStorageSlice};
    use candle_core::{CpuStorage, Device, Layout, Storage, Tensor};

    fn driver_error(
        e: candle_core::cuda_backend::cudarc::driver::DriverError,
    ) -> candle_core::Error {
        candle_core::Error::Cuda(Box::new(e))
    }

    /// Makes `from`'s stream wait for what `to`'s stream has queued (the
    /// copy just issued there), when both are CUDA devices and differ.
    pub(super) fn source_waits_for_copy(from: &Device, to: &Device) -> candle_core::Result<()> {
        match (from, to) {
            (Device::Cuda(from), Device::Cuda(to)) if !from.same_device(to) => from
                .cuda_stream()
                .join(&to.cuda_stream())
                .map_err(driver_error),
            _ => Ok(()),
        }
    }

    /// The source side of the copy, held (read-locked) while candle hands
    /// the op the destination's storage.
    struct CopyFrom<'a> {
        src: &'a CudaStorage,
        src_layout: &'a Layout,
    }

    pub(super) fn copy_between_devices(dst: &Tensor, src: &Tensor) -> candle_core::Result<()> {
        // A parameter is contiguous; anything else is made so on its own
        // device first (one more copy, on the source side).
        let src = if src.is_contiguous() {
            src.clone()
        } else {
            src.contiguous()?
        };
        let (storage, layout) = src.storage_and_layout();
        let Storage::Cuda(src_storage) = &*storage else {
            candle_core::bail!("a CUDA tensor without CUDA storage")
        };
        dst.inplace_op1(&CopyFrom {
            src: src_storage,
            src_layout: layout,
        })
    }

    impl candle_core::InplaceOp1 for CopyFrom<'_> {
        fn name(&self) -> &'static str {
            "candle-dp-copy-between-devices"
        }

        fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
            candle_core::bail!("{}: the destination is not a CUDA tensor", self.name())
        }

        fn cuda_fwd(&self, dst: &mut CudaStorage, dst_layout: &Layout) -> candle_core::Result<()> {
            let (Some((src_start, src_end)), Some((dst_start, dst_end))) = (
                self.src_layout.contiguous_offsets(),
                dst_layout.contiguous_offsets(),
            ) else {
                candle_core::bail!("{}: both sides must be contiguous", self.name())
            };
            // cudarc's memcpy_dtod asserts on a short destination; the
            // shapes were compared by the caller, this keeps it an error.
            if src_end - src_start != dst_end - dst_start {
                candle_core::bail!(
                    "{}: {} elements into {}",
                    self.name(),
                    src_end - src_start,
                    dst_end - dst_start
                )
            }
            let stream = dst.device().cuda_stream();
            let src_stream = self.src.device().cuda_stream();
            // Ordered both ways (module docs): the copy after the work that
            // produced the source, later source-side work after the copy.
            stream.join(&src_stream).map_err(driver_error)?;
            let copied = self.copy(&stream, (src_start, src_end), (dst_start, dst_end), dst);
            src_stream.join(&stream).map_err(driver_error)?;
            copied
        }
    }

    impl CopyFrom<'_> {
        fn copy(
            &self,
            stream: &std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
            (src_start, src_end): (usize, usize),
            (dst_start, dst_end): (usize, usize),
            dst: &mut CudaStorage,
        ) -> candle_core::Result<()> {
            macro_rules! copy {
                ($($variant:ident),*) => {
                    match (&self.src.slice, &mut dst.slice) {
                        $((CudaStorageSlice::$variant(s), CudaStorageSlice::$variant(d)) => {
                            let from = s.slice(src_start..src_end);
                            let mut to = d.slice_mut(dst_start..dst_end);
                            stream.memcpy_dtod(&from, &mut to).map_err(driver_error)
                        })*
                        _ => candle_core::bail!(
                            "{}: {:?} into {:?}",
                            candle_core::InplaceOp1::name(self),
                            self.src.dtype(),
                            dst.dtype()
                        ),
                    }
                };
            }
            copy!(U8, U32, I16, I32, I64, BF16, F16, F32, F64, F8E4M3, F6E2M3, F6E3M2, F4, F8E8M0)
        }
    }
}
