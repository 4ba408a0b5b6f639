//! Activation checkpointing (re-materialisation, as GPipe and torchgpipe
//! do): a stage keeps a micro-batch's input only, and runs its forward
//! again just before that micro-batch's backward, instead of keeping the
//! forward's activations from the forward phase to the backward.

use std::time::{Duration, Instant};

use candle_core::Tensor;

use super::stage_var::StageVar;
use crate::units::{fingerprint, Fingerprint};

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
/// use candle_dp::pipeline::{unit, Checkpoint, Pipeline};
/// use candle_dp::{cpu_devices, LossReduction};
/// use candle_nn::{linear, Activation, VarMap};
///
/// let varmap = VarMap::new();
/// let layers = vec![
///     unit(|vb| linear(4, 16, vb.pp("a"))),
///     unit(|_| Ok(Activation::Relu)),
///     unit(|vb| linear(16, 2, vb.pp("b"))),
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
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
