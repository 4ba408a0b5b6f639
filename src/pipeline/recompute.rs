//! Activation checkpointing (re-materialisation, as GPipe and torchgpipe
//! do): a stage keeps a micro-batch's input only, and runs its forward
//! again just before that micro-batch's backward, instead of keeping the
//! forward's activations from the forward phase to the backward.

use candle_core::{DType, ModuleT, Tensor};

use super::stage_var::StageVar;

/// Which micro-batches a stage recomputes in
/// [`Pipeline::forward_backward`](super::Pipeline::forward_backward)
/// (torchgpipe's `checkpoint` argument). Gradients, losses and BatchNorm
/// statistics are bitwise those of [`Checkpoint::Never`]: the recomputed
/// forward is checked against the first, and a layer that draws random
/// numbers (Dropout) fails the step naming the layer, never a silently
/// wrong gradient.
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

/// Whether `a` and `b` hold the same values, bit for bit.
pub(crate) fn same_bits(a: &Tensor, b: &Tensor) -> candle_core::Result<bool> {
    if a.dims() != b.dims() {
        return Ok(false);
    }
    // f64 holds every f32, f16 and bf16 value exactly.
    let bits = |t: &Tensor| -> candle_core::Result<Vec<u64>> {
        Ok(t.flatten_all()?
            .to_dtype(DType::F64)?
            .to_vec1::<f64>()?
            .into_iter()
            .map(f64::to_bits)
            .collect())
    };
    Ok(bits(a)? == bits(b)?)
}

/// The first of `layers` whose output differs when it runs twice on the
/// same input (with the buffers put back in between), following the
/// forward from `x`: the layer that makes a recomputation differ.
pub(crate) fn first_unrepeatable_layer(
    layers: &[Box<dyn ModuleT>],
    buffers: &[StageVar],
    x: &Tensor,
    train: bool,
) -> candle_core::Result<Option<usize>> {
    let saved = save_buffers(buffers)?;
    let mut h = x.clone();
    for (k, layer) in layers.iter().enumerate() {
        let first = layer.forward_t(&h, train)?;
        restore_buffers(buffers, &saved)?;
        let second = layer.forward_t(&h, train)?;
        restore_buffers(buffers, &saved)?;
        if !same_bits(&first, &second)? {
            return Ok(Some(k));
        }
        h = first;
    }
    Ok(None)
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
