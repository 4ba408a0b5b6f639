//! Activation checkpointing (re-materialisation, as GPipe and torchgpipe
//! do): a stage keeps a micro-batch's input only, and runs its forward
//! again just before that micro-batch's backward, instead of keeping the
//! forward's activations from the forward phase to the backward.

use std::time::{Duration, Instant};

use candle_core::{CpuStorage, DType, Device, Storage, Tensor};

use super::stage_var::StageVar;

/// Which micro-batches a stage recomputes in
/// [`Pipeline::forward_backward`](super::Pipeline::forward_backward)
/// (torchgpipe's `checkpoint` argument). Gradients, losses and BatchNorm
/// statistics are bitwise those of [`Checkpoint::Never`]: every recomputed
/// micro-batch is checked, layer by layer, against its first forward (a
/// CRC-32 of each layer's output, kept from that forward), and a layer
/// that draws random numbers (Dropout) fails the step naming the layer and
/// micro-batch, never a silently wrong gradient. What no comparison of
/// values can see: randomness that leaves every layer's output bit for
/// bit the same (Dropout over exact zeros, whose backward would still
/// differ), and a CRC collision (about 1 in 4 billion per layer); keep
/// random layers out of checkpointed stages. Cost: one CRC pass over each
/// layer's output in the first forward and in the recomputation of each
/// checkpointed micro-batch (on a GPU, after a copy to the host), measured
/// in [`PipelineTimings::checking`](super::PipelineTimings::checking).
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_dp::pipeline::{layer, Checkpoint, Pipeline};
/// use candle_dp::{cpu_devices, LossReduction};
/// use candle_nn::{linear, Activation, VarMap};
///
/// let varmap = VarMap::new();
/// let layers = vec![
///     layer(|vb| linear(4, 16, vb.pp("a"))),
///     layer(|_| Ok(Activation::Relu)),
///     layer(|vb| linear(16, 2, vb.pp("b"))),
/// ];
/// let pipe = Pipeline::builder(&varmap, DType::F32, &cpu_devices(2))
///     .checkpoint(Checkpoint::ExceptLast)
///     .build(layers)?;
/// let x = Tensor::ones((8, 4), DType::F32, &Device::Cpu)?;
/// let y = Tensor::zeros(8, DType::U32, &Device::Cpu)?;
/// let step = pipe.forward_backward(&x, &y, LossReduction::Mean, |out, y| {
///     candle_nn::loss::cross_entropy(out, y)
/// })?;
/// # Ok::<(), candle_dp::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Checkpoint {
    /// Keep every micro-batch's activations (the default here; torchgpipe
    /// defaults to `ExceptLast`).
    #[default]
    Never,
    /// Recompute every micro-batch but the last, whose backward follows
    /// its forward soonest (torchgpipe's default).
    ExceptLast,
    /// Recompute every micro-batch: the least memory.
    Always,
}

impl Checkpoint {
    /// Whether micro-batch `m` of `chunks` is recomputed.
    pub(crate) fn applies(self, m: usize, chunks: usize) -> bool {
        match self {
            Checkpoint::Never => false,
            Checkpoint::ExceptLast => m + 1 < chunks,
            Checkpoint::Always => true,
        }
    }
}

/// The stage's buffers (BatchNorm statistics) as they are, to be put back
/// after a recomputation: the forward already made its updates (or
/// recorded its statistics for the deferred one), and a second one would
/// count the micro-batch twice.
pub(crate) fn save_buffers(buffers: &[StageVar]) -> candle_core::Result<Vec<Tensor>> {
    buffers.iter().map(|b| b.local.as_tensor().copy()).collect()
}

/// Puts back what [`save_buffers`] saved.
pub(crate) fn restore_buffers(buffers: &[StageVar], saved: &[Tensor]) -> candle_core::Result<()> {
    for (b, value) in buffers.iter().zip(saved) {
        b.local.set(value)?;
    }
    Ok(())
}

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

/// The fingerprints of one forward of a micro-batch, layer by layer, and
/// the time taking them cost.
#[derive(Debug, Default)]
pub(crate) struct Fingerprints {
    pub(crate) prints: Vec<Fingerprint>,
    pub(crate) time: Duration,
}

impl Fingerprints {
    /// Adds `t`'s fingerprint.
    pub(crate) fn record(&mut self, t: &Tensor) -> candle_core::Result<()> {
        let start = Instant::now();
        self.prints.push(fingerprint(t)?);
        self.time += start.elapsed();
        Ok(())
    }
}

/// Why a recomputation was refused, if it was: the first of its
/// fingerprints (one per layer of the stage, whose first layer has global
/// index `first`, then the weighted loss on the last stage) that differs
/// from the first forward's. The layer before it gave the same output, so
/// this layer ran on the same input: it is the culprit.
pub(crate) fn mismatch(
    first_forward: &[Fingerprint],
    recomputed: &[Fingerprint],
    first: usize,
    layers: usize,
) -> Option<String> {
    let k = first_forward
        .iter()
        .zip(recomputed)
        .position(|(a, b)| a != b)
        .or_else(|| (first_forward.len() != recomputed.len()).then_some(0))?;
    Some(if k < layers {
        format!(
            "layer {} gives another output each time it runs on the same input (it draws \
             random numbers, as Dropout does, or reads state that changes between runs)",
            first + k
        )
    } else {
        "the loss function gives another value each time it runs on the same output".into()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn except_last_recomputes_all_but_the_last_micro_batch() {
        let applies = |c: Checkpoint| (0..4).map(|m| c.applies(m, 4)).collect::<Vec<_>>();
        assert_eq!(applies(Checkpoint::Never), [false; 4]);
        assert_eq!(applies(Checkpoint::ExceptLast), [true, true, true, false]);
        assert_eq!(applies(Checkpoint::Always), [true; 4]);
        assert!(
            !Checkpoint::ExceptLast.applies(0, 1),
            "one micro-batch: nothing to gain"
        );
    }
}
