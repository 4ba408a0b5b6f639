//! Where the time and the activation memory of a pipeline step went.

use std::time::Duration;

/// The latest successful step of a [`Pipeline`](super::Pipeline), device by
/// device (one stage each, unless the schedule is interleaved): the figures
/// behind the pipeline's benchmark.
///
/// ```
/// use std::time::Duration;
/// use candle_dp::pipeline::PipelineTimings;
///
/// let t = PipelineTimings {
///     step: Duration::from_millis(100),
///     busy: vec![Duration::from_millis(80), Duration::from_millis(60)],
///     checking: vec![Duration::ZERO; 2],
///     peak_saved_bytes: vec![4096, 2048],
/// };
/// assert!((t.bubble() - 0.3).abs() < 1e-9);
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PipelineTimings {
    /// Wall time of the step on the devices: from the start of their work
    /// to the last device's answer.
    pub step: Duration,
    /// Per device, the time spent computing (forwards, losses, backwards of
    /// its stages), not waiting for a neighbour.
    pub busy: Vec<Duration>,
    /// Per device, the part of `busy` spent checking activation
    /// checkpointing's recomputations ([`Checkpoint`](super::Checkpoint)):
    /// a CRC-32 of each layer's output, in the first forward of every
    /// recomputed micro-batch and in its recomputation. Zero without
    /// checkpointing.
    pub checking: Vec<Duration>,
    /// Per device, the most bytes of micro-batch activations its stages
    /// held at once for the backward: per saved micro-batch, the stage's
    /// input and the
    /// storage of the autograd graph behind its output (each storage
    /// once: views and the weights add nothing); with
    /// [`Checkpoint`](super::Checkpoint), a recomputed micro-batch's input
    /// until its backward, then its recomputed graph during it. GPipe holds
    /// every micro-batch, 1F1B at most `min(chunks, devices - device)`.
    pub peak_saved_bytes: Vec<usize>,
}

impl PipelineTimings {
    /// The measured bubble: the fraction of the devices' time spent idle,
    /// `1 - sum(busy) / (devices * step)`, at least 0 (0 for a step of no
    /// time). With stages of equal work and
    /// free communication it is `(S - 1) / (v * m + S - 1)` for `S`
    /// devices, `m` micro-batches and `v` stages per device (1 unless
    /// interleaved), once `m >= S`.
    pub fn bubble(&self) -> f64 {
        let total = self.step.as_secs_f64() * self.busy.len() as f64;
        if total <= 0.0 {
            return 0.0;
        }
        let busy: f64 = self.busy.iter().map(Duration::as_secs_f64).sum();
        (1.0 - busy / total).max(0.0)
    }
}
