//! A linear layer over any number of leading dimensions as one matrix
//! product, and a bias add whose backward is one column sum.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor};

use super::column_sum::ColumnSum;
use super::fused_linear::{fused_linear, Activation};
use super::kernel::{each_item, per_float, Float, BLOCK_ROWS};

/// `x W^T + b` over the last dimension of `x` (PyTorch's `nn.Linear`
/// layout: `weight` is out x in), every leading dimension folded into the
/// rows of one matrix product.
///
/// candle-nn's `Linear` on a 3-D input broadcasts the weight over the
/// batch: its backward makes one weight gradient per batch entry and sums
/// them, and sums the bias's gradient over two dimensions with candle's
/// strided reduction. Here it is [`fused_linear`] without an activation:
/// the weight's gradient one product in the weight's own layout, the
/// bias's one pass.
///
/// ```
/// use candle_core::{Device, Tensor};
/// let x = Tensor::ones((2, 3, 4), candle_core::DType::F32, &Device::Cpu)?;
/// let w = Tensor::ones((5, 4), candle_core::DType::F32, &Device::Cpu)?;
/// let b = Tensor::zeros(5, candle_core::DType::F32, &Device::Cpu)?;
/// let y = candle_dp::ops::linear(&x, &w, Some(&b))?;
/// assert_eq!(y.dims(), &[2, 3, 5]);
/// assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, vec![4.0; 30]);
/// # Ok::<(), candle_core::Error>(())
/// ```
///
/// # Errors
///
/// A weight that is not 2-D, whose input width is not `x`'s last
/// dimension, or a bias that is not as long as the weight's rows.
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> candle_core::Result<Tensor> {
    let (out_features, in_features) = weight.dims2()?;
    match x.dims().last() {
        None => candle_core::bail!("linear: a scalar input"),
        Some(&last) if last != in_features => candle_core::bail!(
            "linear: an input of width {last} (shape {:?}) for a weight of {out_features} x \
             {in_features}",
            x.dims()
        ),
        Some(_) => {}
    }
    // One product and the bias in its output's pass, the weight's
    // gradient in its own layout ([`fused_linear`]).
    fused_linear(x, weight, bias, Activation::Identity)
}

/// `x + b`, `b` added to every row of `x`'s last dimension; its backward
/// passes the gradient through to `x` and gives `b` the gradient's column
/// sums in one pass. Fused on CPU f32/f64, candle's `broadcast_add`
/// elsewhere.
///
/// # Errors
///
/// A bias that is not 1-D or not as long as `x`'s last dimension.
pub fn bias_add(x: &Tensor, bias: &Tensor) -> candle_core::Result<Tensor> {
    let width = x.dims().last().copied().unwrap_or(1);
    if bias.dims() != [width] {
        candle_core::bail!(
            "bias add: a bias of shape {:?} for rows of width {width} (input {:?})",
            bias.dims(),
            x.dims()
        );
    }
    match (x.device().is_cpu(), x.dtype(), bias.dtype()) {
        (true, DType::F32, DType::F32) | (true, DType::F64, DType::F64) => {
            x.contiguous()?.apply_op2(&bias.contiguous()?, BiasAdd)
        }
        _ => x.broadcast_add(bias),
    }
}

struct BiasAdd;

fn add_rows<T: Float>(x: &[T], bias: &[T]) -> Vec<T> {
    let width = bias.len().max(1);
    let mut out = vec![T::of(0.0); x.len()];
    let items: Vec<_> = out
        .chunks_mut(BLOCK_ROWS * width)
        .zip(x.chunks(BLOCK_ROWS * width))
        .collect();
    each_item(items, x.len(), |(outs, rows)| {
        for (out, row) in outs.chunks_mut(width).zip(rows.chunks(width)) {
            for ((o, &v), &b) in out.iter_mut().zip(row).zip(bias) {
                *o = v + b;
            }
        }
    });
    out
}

impl CustomOp2 for BiasAdd {
    fn name(&self) -> &'static str {
        "candle-dp-bias-add"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        b: &CpuStorage,
        b_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let op = "bias add";
        let out = per_float!(x.dtype(), op, T => T::storage(add_rows(
            T::slice(x, x_layout, op)?,
            T::slice(b, b_layout, op)?,
        )));
        Ok((out, x_layout.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        bias: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad_res.contiguous()?;
        let grad_bias = grad.apply_op1_no_bwd(&ColumnSum)?.reshape(bias.shape())?;
        Ok((Some(grad), Some(grad_bias)))
    }
}
