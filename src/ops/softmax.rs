//! Attention's causal, scaled softmax, fused: scale, mask and softmax in
//! one pass over the scores, the backward in one pass.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Shape, Tensor, D};

use super::kernel::{each_item, per_float, Float, BLOCK_ROWS};

/// `softmax(scale * scores + mask)` over the last dimension, where `mask`
/// is 0 on and below the diagonal of each `T x T` matrix of the last two
/// dimensions and -inf above it (no query sees a later key), as attention
/// in a decoder (PyTorch's `scaled_dot_product_attention(is_causal=True)`
/// computes the same weights).
///
/// Fused on CPU f32/f64: the masked positions are never exponentiated and
/// come out 0; the backward, `scale * y * (dy - sum(dy * y))` per row, is
/// one pass over the output and its gradient. Elsewhere it is candle's ops
/// (the scale, a mask tensor added, `softmax_last_dim`).
///
/// ```
/// use candle_core::{Device, Tensor};
/// let scores = Tensor::zeros((1, 3, 3), candle_core::DType::F32, &Device::Cpu)?;
/// let w = candle_dp::ops::causal_softmax(&scores, 0.5)?;
/// let last = w.get(0)?.get(2)?.to_vec1::<f32>()?;
/// assert!(last.iter().all(|&v| (v - 1.0 / 3.0).abs() < 1e-6));
/// assert_eq!(w.get(0)?.get(0)?.to_vec1::<f32>()?, vec![1.0, 0.0, 0.0]);
/// # Ok::<(), candle_core::Error>(())
/// ```
///
/// # Errors
///
/// Scores whose last two dimensions are not one square matrix.
pub fn causal_softmax(scores: &Tensor, scale: f64) -> candle_core::Result<Tensor> {
    let dims = scores.dims();
    let square = dims.len() >= 2 && dims[dims.len() - 1] == dims[dims.len() - 2];
    if !square {
        candle_core::bail!(
            "causal softmax: scores of shape {dims:?}, not T x T in the last two dimensions"
        );
    }
    let t = dims[dims.len() - 1];
    match (scores.device().is_cpu(), scores.dtype()) {
        (true, DType::F32 | DType::F64) => scores.contiguous()?.apply_op1(CausalSoftmax { scale }),
        _ => {
            let masked = (scores * scale)?.broadcast_add(&causal_mask(t, scores)?)?;
            candle_nn::ops::softmax(&masked, D::Minus1)
        }
    }
}

/// The additive causal mask of `t` positions, in `like`'s dtype and on
/// its device: 0 on and below the diagonal, -inf above it (row `i` sees
/// positions `0..=i`). What [`causal_softmax`] applies, for a composite
/// form of it.
///
/// # Errors
///
/// candle's, for a dtype or device it cannot make the mask in.
pub fn causal_mask(t: usize, like: &Tensor) -> candle_core::Result<Tensor> {
    let mask: Vec<f32> = (0..t * t)
        .map(|i| {
            if i % t > i / t {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    Tensor::from_vec(mask, (t, t), like.device())?.to_dtype(like.dtype())
}

struct CausalSoftmax {
    scale: f64,
}

/// The backward: `(y, dy) -> dx`.
struct CausalSoftmaxGrad {
    scale: f64,
}

/// Row `r` of the scores is query `r % t`: it sees keys `0..=r % t`.
fn forward<T: Float>(x: &[T], t: usize, scale: f64) -> Vec<T> {
    let scale = T::of(scale);
    let mut out = vec![T::of(0.0); x.len()];
    let items: Vec<_> = x
        .chunks(BLOCK_ROWS * t)
        .zip(out.chunks_mut(BLOCK_ROWS * t))
        .enumerate()
        .collect();
    each_item(items, x.len(), |(block, (rows, outs))| {
        for (i, (row, out)) in rows.chunks(t).zip(outs.chunks_mut(t)).enumerate() {
            let seen = (block * BLOCK_ROWS + i) % t + 1;
            let (row, out) = (&row[..seen], &mut out[..seen]);
            let max = row.iter().fold(T::NEG_INFINITY, |m, &v| m.max(scale * v));
            for (o, &v) in out.iter_mut().zip(row) {
                *o = (scale * v - max).exp();
            }
            let sum = out.iter().copied().sum::<T>();
            out.iter_mut().for_each(|o| *o = *o / sum);
        }
    });
    out
}

fn backward<T: Float>(y: &[T], dy: &[T], t: usize, scale: f64) -> Vec<T> {
    let scale = T::of(scale);
    let mut out = vec![T::of(0.0); y.len()];
    let items: Vec<_> = y
        .chunks(BLOCK_ROWS * t)
        .zip(dy.chunks(BLOCK_ROWS * t))
        .zip(out.chunks_mut(BLOCK_ROWS * t))
        .enumerate()
        .collect();
    each_item(items, y.len(), |(block, ((ys, dys), outs))| {
        for (i, ((y, dy), dx)) in ys
            .chunks(t)
            .zip(dys.chunks(t))
            .zip(outs.chunks_mut(t))
            .enumerate()
        {
            let seen = (block * BLOCK_ROWS + i) % t + 1;
            let dot = (0..seen).map(|j| y[j] * dy[j]).sum::<T>();
            for j in 0..seen {
                dx[j] = scale * y[j] * (dy[j] - dot);
            }
        }
    });
    out
}

/// The last dimension of a layout (its rows' length).
fn row_len(layout: &Layout) -> usize {
    layout.dims().last().copied().unwrap_or(1).max(1)
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "candle-dp-causal-softmax"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (op, t) = ("causal softmax", row_len(layout));
        let out = per_float!(storage.dtype(), op, T => {
            T::storage(forward(T::slice(storage, layout, op)?, t, self.scale))
        });
        Ok((out, layout.shape().clone()))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let grad = res.apply_op2_no_bwd(
            &grad_res.contiguous()?,
            &CausalSoftmaxGrad { scale: self.scale },
        )?;
        Ok(Some(grad))
    }
}

impl CustomOp2 for CausalSoftmaxGrad {
    fn name(&self) -> &'static str {
        "candle-dp-causal-softmax-grad"
    }

    fn cpu_fwd(
        &self,
        y: &CpuStorage,
        y_layout: &Layout,
        dy: &CpuStorage,
        dy_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let op = "causal softmax backward";
        if y_layout.shape() != dy_layout.shape() {
            candle_core::bail!(
                "{op}: a gradient of shape {:?} for an output of shape {:?}",
                dy_layout.shape(),
                y_layout.shape()
            );
        }
        let t = row_len(y_layout);
        let out = per_float!(y.dtype(), op, T => T::storage(backward(
            T::slice(y, y_layout, op)?,
            T::slice(dy, dy_layout, op)?,
            t,
            self.scale,
        )));
        Ok((out, y_layout.shape().clone()))
    }
}
