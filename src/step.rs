//! What a training step gives back, shared by every engine (DataParallel,
//! DistributedDataParallel, the pipeline): the loss and the gradients
//! ([`Step`]), and how per-part losses combine into the step's loss
//! ([`LossReduction`]).

use candle_core::backprop::GradStore;
use candle_core::Tensor;

/// How a loss computed on each part of the batch (a replica's rows, a
/// rank's, a micro-batch's) combines into the global loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LossReduction {
    /// The replica's loss is a mean over its rows: it is weighted by its
    /// share of the batch (`rows_i / rows`), so the sum over replicas is the
    /// mean over the whole batch and the gradients equal single-device
    /// training on the full batch.
    #[default]
    Mean,
    /// The replica's loss is a sum over its rows: replica losses add up.
    Sum,
}

/// Gradients of the master variables and the loss they came from.
#[derive(Debug)]
pub struct Step {
    /// The global loss (detached), on the output device.
    pub loss: Tensor,
    /// Gradients keyed by the master variables: pass to any candle
    /// `Optimizer::step`.
    pub grads: GradStore,
    pub(crate) without_grad: Vec<String>,
}

impl Step {
    /// The master parameters (buffers excluded) that received no gradient
    /// in this step, sorted: they are not trained. PyTorch's DDP names such
    /// parameters; a common cause in candle is a layer whose kernel has no
    /// backward, such as candle-nn 0.11's fused `LayerNorm` (use
    /// `candle_nn::ops::layer_norm_slow` in training). The first step with
    /// any also logs a `tracing` warning.
    pub fn vars_without_grad(&self) -> &[String] {
        &self.without_grad
    }
}
