//! Cross-entropy from logits, fused: log-softmax and the negative
//! log-likelihood in one pass, the gradient `softmax - one_hot` in one
//! more, and no second vocabulary-sized tensor kept between them.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor};

use super::indices::indices_below;
use super::kernel::{add_blocks, each_item, elements, per_float, Float, BLOCK_ROWS};

/// The mean over rows of `-log softmax(logits)[target]`: `logits` is rows
/// x classes, `targets` one class index per row (u8, u32 or i64), as
/// PyTorch's `cross_entropy` and candle-nn's `loss::cross_entropy`.
///
/// Fused on CPU f32/f64 logits: the forward keeps nothing but the loss;
/// the backward recomputes each row's softmax from the logits and writes
/// `(softmax - one_hot) * grad / rows` straight into the gradient.
/// Elsewhere it is candle-nn's (log-softmax, gather, mean).
///
/// An empty batch (no rows) gives NaN on every device, as PyTorch's mean
/// over no rows does, so that it cannot pass for a finite loss; its
/// gradient is empty.
///
/// ```
/// use candle_core::{Device, Tensor};
/// let logits = Tensor::new(&[[0.0f32, 0.0], [10.0, -10.0]], &Device::Cpu)?;
/// let targets = Tensor::new(&[1u32, 0], &Device::Cpu)?;
/// let loss: f32 = candle_dp::ops::cross_entropy(&logits, &targets)?.to_scalar()?;
/// assert!((loss - std::f32::consts::LN_2 / 2.0).abs() < 1e-6);
/// # Ok::<(), candle_core::Error>(())
/// ```
///
/// # Errors
///
/// Logits that are not 2-D, targets not one per row, or a target that is
/// not a class (naming its row and value).
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
    let (rows, classes) = logits.dims2()?;
    if targets.dims() != [rows] {
        candle_core::bail!(
            "cross-entropy: targets of shape {:?} for {rows} rows of logits",
            targets.dims()
        );
    }
    let fused = logits.device().is_cpu()
        && matches!(logits.dtype(), DType::F32 | DType::F64)
        && matches!(targets.dtype(), DType::U8 | DType::U32 | DType::I64);
    if !fused {
        if rows == 0 {
            // candle-nn's max over no rows fails ("empty tensor for
            // reduce"); NaN as the fused path and PyTorch, through the
            // graph so that a backward still reaches the logits.
            return logits.sum_all()? * f64::NAN;
        }
        return candle_nn::loss::cross_entropy(logits, targets);
    }
    let targets = class_indices(targets, classes)?;
    logits.contiguous()?.apply_op2(&targets, CrossEntropy)
}

/// The targets as u32 on the CPU, each checked to be a class.
pub(crate) fn class_indices(targets: &Tensor, classes: usize) -> candle_core::Result<Tensor> {
    if let Err((row, value)) = indices_below(targets, classes)? {
        candle_core::bail!(
            "cross-entropy: target {value} at row {row} is not one of the {classes} classes"
        );
    }
    targets.to_dtype(DType::U32)
}

struct CrossEntropy;

/// The backward: `(logits, targets, grad)` to the logits' gradient.
struct CrossEntropyGrad;

/// Partial sums (and maxima) per lane: each row's reductions run as
/// [`LANES`] interleaved ones, added in lane order at the end, so that the
/// exponentials run as vector code (one sum in element order keeps every
/// `exp` scalar: it was a tenth of the language model's DDP step). PyTorch's
/// vectorised log-softmax sums in lanes too.
const LANES: usize = 8;

/// A row's largest value and `sum exp(v - max)`.
fn max_and_sum_exp<T: Float>(row: &[T]) -> (T, T) {
    let (chunks, rest) = (row.chunks_exact(LANES), row.chunks_exact(LANES).remainder());
    let mut maxima = [T::NEG_INFINITY; LANES];
    for chunk in chunks.clone() {
        for (m, &v) in maxima.iter_mut().zip(chunk) {
            *m = m.max(v);
        }
    }
    let max = rest
        .iter()
        .chain(&maxima)
        .fold(T::NEG_INFINITY, |m, &v| m.max(v));
    let mut sums = [T::of(0.0); LANES];
    for chunk in chunks {
        for (s, &v) in sums.iter_mut().zip(chunk) {
            *s = *s + (v - max).exp();
        }
    }
    let sum = rest
        .iter()
        .map(|&v| (v - max).exp())
        .chain(sums)
        .fold(T::of(0.0), |a, b| a + b);
    (max, sum)
}

fn forward<T: Float>(logits: &[T], targets: &[u32], classes: usize) -> T {
    let classes = classes.max(1);
    let blocks = logits.len().div_ceil(BLOCK_ROWS * classes);
    let mut partials = vec![T::of(0.0); blocks];
    let items: Vec<_> = logits
        .chunks(BLOCK_ROWS * classes)
        .zip(targets.chunks(BLOCK_ROWS))
        .zip(partials.iter_mut())
        .collect();
    each_item(items, logits.len(), |((rows, targets), partial)| {
        for (row, &target) in rows.chunks(classes).zip(targets) {
            // `-log_softmax[target]` in PyTorch's order: `(max - v) + ln sum`,
            // not `(max + ln sum) - v`, which rounds at the largest logit.
            let (max, sum) = max_and_sum_exp(row);
            *partial = *partial + ((max - row[target as usize]) + sum.ln());
        }
    });
    // No rows: 0 / 0, NaN, as PyTorch's mean over an empty batch.
    add_blocks(&partials, 1)[0] / T::of(targets.len() as f64)
}

fn backward<T: Float>(logits: &[T], targets: &[u32], classes: usize, grad: T) -> Vec<T> {
    let classes = classes.max(1);
    let factor = grad / T::of(targets.len() as f64);
    let mut out = vec![T::of(0.0); logits.len()];
    let items: Vec<_> = logits
        .chunks(BLOCK_ROWS * classes)
        .zip(targets.chunks(BLOCK_ROWS))
        .zip(out.chunks_mut(BLOCK_ROWS * classes))
        .collect();
    each_item(items, logits.len(), |((rows, targets), outs)| {
        for ((row, &target), out) in rows
            .chunks(classes)
            .zip(targets)
            .zip(outs.chunks_mut(classes))
        {
            // The softmax from the row's maximum, as the forward's sum:
            // `exp(v - lse)` would carry `lse`'s rounding, which is at the
            // scale of the largest logit (a relative 1e-6 at logits of 30,
            // 4e-5 at 1e4), into every probability.
            let (max, sum) = max_and_sum_exp(row);
            let scale = factor / sum;
            for (o, &v) in out.iter_mut().zip(row) {
                *o = (v - max).exp() * scale;
            }
            let t = target as usize;
            out[t] = out[t] - factor;
        }
    });
    out
}

fn targets_of<'a>(s: &'a CpuStorage, layout: &Layout, op: &str) -> candle_core::Result<&'a [u32]> {
    match s {
        CpuStorage::U32(t) => elements(t, layout, op),
        other => candle_core::bail!("{op}: targets of {:?}, not u32", other.dtype()),
    }
}

/// The incoming gradient of the (scalar) loss.
fn scalar<T: Copy>(grad: &[T], op: &str) -> candle_core::Result<T> {
    match grad {
        [g] => Ok(*g),
        _ => candle_core::bail!(
            "{op}: a gradient of {} values for a scalar loss",
            grad.len()
        ),
    }
}

impl CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        "candle-dp-cross-entropy"
    }

    fn cpu_fwd(
        &self,
        logits: &CpuStorage,
        logits_layout: &Layout,
        targets: &CpuStorage,
        targets_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let op = "cross-entropy";
        let classes = logits_layout.dims().last().copied().unwrap_or(1);
        let targets = targets_of(targets, targets_layout, op)?;
        let out = per_float!(logits.dtype(), op, T => {
            T::storage(vec![forward(T::slice(logits, logits_layout, op)?, targets, classes)])
        });
        Ok((out, Shape::from(())))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = logits.apply_op3_no_bwd(targets, &grad_res.contiguous()?, &CrossEntropyGrad)?;
        Ok((Some(grad), None))
    }
}

impl CustomOp3 for CrossEntropyGrad {
    fn name(&self) -> &'static str {
        "candle-dp-cross-entropy-grad"
    }

    fn cpu_fwd(
        &self,
        logits: &CpuStorage,
        logits_layout: &Layout,
        targets: &CpuStorage,
        targets_layout: &Layout,
        grad: &CpuStorage,
        grad_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let op = "cross-entropy backward";
        let classes = logits_layout.dims().last().copied().unwrap_or(1);
        let targets = targets_of(targets, targets_layout, op)?;
        let out = per_float!(logits.dtype(), op, T => T::storage(backward(
            T::slice(logits, logits_layout, op)?,
            targets,
            classes,
            scalar(T::slice(grad, grad_layout, op)?, op)?,
        )));
        Ok((out, logits_layout.shape().clone()))
    }
}
