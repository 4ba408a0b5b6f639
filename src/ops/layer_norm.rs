//! LayerNorm over the last dimension, fused: one pass per row forward, one
//! backward for the input, the weight and the bias together.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};

use super::kernel::{add_blocks, each_item, per_float, Float, BLOCK_ROWS};

/// LayerNorm of `x` over its last dimension with `weight` and `bias` (that
/// long) and `eps`: `(x - mean) / sqrt(var + eps) * weight + bias`, the
/// biased variance, as PyTorch's `layer_norm` and candle's
/// `layer_norm_slow`.
///
/// Fused on CPU f32/f64: the forward makes one output; the backward
/// recomputes each row's mean and deviation (nothing else is kept) and
/// gives the input's, the weight's and the bias's gradients in one pass
/// over the rows. Elsewhere (CUDA, bf16/f16) it is candle's
/// `layer_norm_slow`, which computes in f32.
///
/// ```
/// use candle_core::{Device, Tensor};
/// let x = Tensor::new(&[[1.0f32, 2.0, 3.0, 4.0]], &Device::Cpu)?;
/// let w = Tensor::ones(4, candle_core::DType::F32, &Device::Cpu)?;
/// let b = Tensor::zeros(4, candle_core::DType::F32, &Device::Cpu)?;
/// let y = candle_dp::ops::layer_norm(&x, &w, &b, 1e-5)?;
/// let mean: f32 = y.sum_all()?.to_scalar()?;
/// assert!(mean.abs() < 1e-6);
/// # Ok::<(), candle_core::Error>(())
/// ```
///
/// # Errors
///
/// A weight or bias not as long as `x`'s last dimension.
pub fn layer_norm(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
) -> candle_core::Result<Tensor> {
    let width = x.dims().last().copied().unwrap_or(1);
    for (what, t) in [("weight", weight), ("bias", bias)] {
        if t.dims() != [width] {
            candle_core::bail!(
                "layer norm: a {what} of shape {:?} for rows of width {width} (input {:?})",
                t.dims(),
                x.dims()
            );
        }
    }
    let fused = x.device().is_cpu()
        && matches!(x.dtype(), DType::F32 | DType::F64)
        && weight.dtype() == x.dtype()
        && bias.dtype() == x.dtype();
    if !fused {
        return candle_nn::ops::layer_norm_slow(x, weight, bias, eps as f32);
    }
    x.contiguous()?.apply_op3(
        &weight.contiguous()?,
        &bias.contiguous()?,
        LayerNorm { eps },
    )
}

struct LayerNorm {
    eps: f64,
}

/// The backward: `(x, weight, dy)` to the input's, the weight's and the
/// bias's gradients, packed one after the other in one vector.
struct LayerNormGrad {
    eps: f64,
}

/// A row's mean and `1 / sqrt(var + eps)` (the biased variance), in f64
/// whatever the element type (a near-constant f32 row, `7 + 1e-3 noise`,
/// loses a quarter of its deviations' digits to an f32 mean), the
/// variance from the deviations (two passes, as candle's composite);
/// inlined into the callers' AVX2 clones.
#[inline(always)]
fn moments<T: Float>(row: &[T], eps: f64) -> (f64, f64) {
    let n = row.len() as f64;
    let mean = lane_sum(row.len(), |j| row[j].to_f64()) / n;
    let var = lane_sum(row.len(), |j| {
        let d = row[j].to_f64() - mean;
        d * d
    }) / n;
    (mean, 1.0 / (var + eps).sqrt())
}

/// `f(0) + ... + f(n - 1)` in eight running sums (term `j` into sum `j %
/// 8`), added pairwise at the end: a fixed order, so the same bytes on any
/// machine or thread count, that the compiler keeps in vector registers.
/// One running sum is a chain of dependent additions, which made the
/// row sums most of the LayerNorm's time (4.4% of the language model's
/// step).
#[inline(always)]
fn lane_sum(n: usize, f: impl Fn(usize) -> f64) -> f64 {
    const LANES: usize = 8;
    let mut acc = [0f64; LANES];
    let whole = n - n % LANES;
    for base in (0..whole).step_by(LANES) {
        for (lane, a) in acc.iter_mut().enumerate() {
            *a += f(base + lane);
        }
    }
    for j in whole..n {
        acc[j % LANES] += f(j);
    }
    ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))
}

fn forward<T: Float>(x: &[T], w: &[T], b: &[T], eps: f64) -> Vec<T> {
    let width = w.len().max(1);
    let mut out = vec![T::of(0.0); x.len()];
    let items: Vec<_> = x
        .chunks(BLOCK_ROWS * width)
        .zip(out.chunks_mut(BLOCK_ROWS * width))
        .collect();
    each_item(items, x.len(), |(rows, outs)| {
        forward_rows(rows, outs, (w, b), eps)
    });
    out
}

/// [`forward`] on a block of rows. Compiled for AVX2 as well, picked at
/// run time (the same bits): as a closure inside [`each_item`] the
/// compiler kept it apart from the vector clone.
#[multiversion::multiversion(targets("x86_64+avx2"))]
fn forward_rows<T: Float>(rows: &[T], outs: &mut [T], (w, b): (&[T], &[T]), eps: f64) {
    let width = w.len().max(1);
    for (row, out) in rows.chunks(width).zip(outs.chunks_mut(width)) {
        let (mean, rstd) = moments(row, eps);
        for (j, o) in out.iter_mut().enumerate() {
            let xhat = (row[j].to_f64() - mean) * rstd;
            *o = T::of(xhat * w[j].to_f64() + b[j].to_f64());
        }
    }
}

/// With `xhat = (x - mean) / std` and `g = dy * w`: `dx = (g - mean(g) -
/// xhat mean(g xhat)) / std`, `dw = sum over rows of dy xhat`, `db = sum
/// over rows of dy`; in f64 inside (`1 / std` multiplied, the row sums in
/// [`lane_sum`]'s order), the sums over rows in blocks added in block
/// order.
fn backward<T: Float>(x: &[T], w: &[T], dy: &[T], eps: f64) -> Vec<T> {
    let width = w.len().max(1);
    // dx, then dw, then db, in one buffer (no copy to append the sums).
    let mut out = vec![T::of(0.0); x.len() + 2 * width];
    let (dx, sums) = out.split_at_mut(x.len());
    let blocks = x.len().div_ceil(BLOCK_ROWS * width);
    let mut partials = vec![0f64; blocks * 2 * width];
    let items: Vec<_> = x
        .chunks(BLOCK_ROWS * width)
        .zip(dy.chunks(BLOCK_ROWS * width))
        .zip(dx.chunks_mut(BLOCK_ROWS * width))
        .zip(partials.chunks_mut(2 * width))
        .collect();
    each_item(items, x.len(), |(((xs, dys), dxs), partial)| {
        backward_rows((xs, dys, w), dxs, partial, eps);
    });
    for (slot, sum) in sums.iter_mut().zip(add_blocks(&partials, 2 * width)) {
        *slot = T::of(sum);
    }
    out
}

/// [`backward`] on a block of rows: their `dx`, and their sums of `dw` and
/// `db` added into `partial` (`dw` then `db`). Compiled for AVX2 as well,
/// as [`forward_rows`].
#[multiversion::multiversion(targets("x86_64+avx2"))]
fn backward_rows<T: Float>(
    (xs, dys, w): (&[T], &[T], &[T]),
    dxs: &mut [T],
    partial: &mut [f64],
    eps: f64,
) {
    let width = w.len().max(1);
    let n = width as f64;
    let (dw, db) = partial.split_at_mut(width);
    for ((row, dy), dx) in xs
        .chunks(width)
        .zip(dys.chunks(width))
        .zip(dxs.chunks_mut(width))
    {
        let (mean, rstd) = moments(row, eps);
        let xhat = |j: usize| (row[j].to_f64() - mean) * rstd;
        let g = |j: usize| dy[j].to_f64() * w[j].to_f64();
        for j in 0..width {
            let dy = dy[j].to_f64();
            dw[j] += dy * xhat(j);
            db[j] += dy;
        }
        let mean_g = lane_sum(width, g) / n;
        let mean_g_xhat = lane_sum(width, |j| g(j) * xhat(j)) / n;
        for (j, dx) in dx.iter_mut().enumerate() {
            *dx = T::of((g(j) - mean_g - xhat(j) * mean_g_xhat) * rstd);
        }
    }
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "candle-dp-layer-norm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        w: &CpuStorage,
        w_layout: &Layout,
        b: &CpuStorage,
        b_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let op = "layer norm";
        let out = per_float!(x.dtype(), op, T => T::storage(forward(
            T::slice(x, x_layout, op)?,
            T::slice(w, w_layout, op)?,
            T::slice(b, b_layout, op)?,
            self.eps,
        )));
        Ok((out, x_layout.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        _bias: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let packed = x.apply_op3_no_bwd(
            weight,
            &grad_res.contiguous()?,
            &LayerNormGrad { eps: self.eps },
        )?;
        let (len, width) = (x.elem_count(), weight.elem_count());
        let dx = packed.narrow(0, 0, len)?.reshape(x.shape())?;
        let dw = packed.narrow(0, len, width)?;
        let db = packed.narrow(0, len + width, width)?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

impl CustomOp3 for LayerNormGrad {
    fn name(&self) -> &'static str {
        "candle-dp-layer-norm-grad"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        w: &CpuStorage,
        w_layout: &Layout,
        dy: &CpuStorage,
        dy_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let op = "layer norm backward";
        if x_layout.shape() != dy_layout.shape() {
            candle_core::bail!(
                "{op}: a gradient of shape {:?} for an input of shape {:?}",
                dy_layout.shape(),
                x_layout.shape()
            );
        }
        let out = per_float!(x.dtype(), op, T => T::storage(backward(
            T::slice(x, x_layout, op)?,
            T::slice(w, w_layout, op)?,
            T::slice(dy, dy_layout, op)?,
            self.eps,
        )));
        let len = x_layout.shape().elem_count() + 2 * w_layout.shape().elem_count();
        Ok((out, Shape::from(len)))
    }
}
