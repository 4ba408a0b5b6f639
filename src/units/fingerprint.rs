//! A layer output's fingerprint: its shape, dtype and a CRC-32 of its
//! bytes, what a recomputed forward (the pipeline's activation
//! checkpointing, FSDP's resharded units) is checked against, instead of
//! keeping the output itself (which would cost the memory recomputation
//! saves).

use candle_core::{CpuStorage, DType, Device, Storage, Tensor};

/// What a recomputation is checked against: one layer output's shape,
/// dtype and a CRC-32 of its bytes. Kept from the first forward of every
/// recomputed micro-batch, per layer, instead of the outputs themselves
/// (which would cost the memory checkpointing saves).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Fingerprint {
    dims: Vec<usize>,
    dtype: DType,
    crc32: u32,
}

/// `t`'s fingerprint. A CPU tensor's bytes are read in place where they
/// are contiguous; a tensor on another device is copied to the host first.
pub(crate) fn fingerprint(t: &Tensor) -> candle_core::Result<Fingerprint> {
    let t = match t.device() {
        Device::Cpu => t.clone(),
        _ => t.to_device(&Device::Cpu)?,
    };
    let t = if t.is_contiguous() {
        t
    } else {
        t.contiguous()?
    };
    let crc32 = {
        let (storage, layout) = t.storage_and_layout();
        match (&*storage, layout.contiguous_offsets()) {
            (Storage::Cpu(cpu), Some((start, end))) => crc_of(cpu, start, end),
            _ => None,
        }
    };
    let crc32 = match crc32 {
        Some(crc) => crc,
        // A dtype without a plain byte layout here (the packed float8 and
        // smaller kinds): f64 holds each of their values exactly.
        None => {
            let wide = t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
            crc32fast::hash(bytemuck::cast_slice(&wide))
        }
    };
    Ok(Fingerprint {
        dims: t.dims().to_vec(),
        dtype: t.dtype(),
        crc32,
    })
}

/// The CRC-32 of elements `start..end` of `storage`, for the dtypes whose
/// elements are plain bytes.
fn crc_of(storage: &CpuStorage, start: usize, end: usize) -> Option<u32> {
    fn crc<T: bytemuck::Pod>(values: &[T], start: usize, end: usize) -> Option<u32> {
        values
            .get(start..end)
            .map(|v| crc32fast::hash(bytemuck::cast_slice(v)))
    }
    match storage {
        CpuStorage::U8(v) => crc(v, start, end),
        CpuStorage::U32(v) => crc(v, start, end),
        CpuStorage::I16(v) => crc(v, start, end),
        CpuStorage::I32(v) => crc(v, start, end),
        CpuStorage::I64(v) => crc(v, start, end),
        CpuStorage::BF16(v) => crc(v, start, end),
        CpuStorage::F16(v) => crc(v, start, end),
        CpuStorage::F32(v) => crc(v, start, end),
        CpuStorage::F64(v) => crc(v, start, end),
        _ => None,
    }
}
