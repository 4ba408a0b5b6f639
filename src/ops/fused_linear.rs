//! A linear layer and its activation as one op: the matrix product, then
//! the bias and the activation in the same pass over its output; backward,
//! the activation's gradient and the bias's column sums, then the two
//! products, each gradient made in the layout of its variable.
//!
//! What it saves over candle-nn's `Linear` and `relu` (the MLP's layers):
//! the bias add and the ReLU are a pass each way and a tensor each
//! (candle's ReLU backward is three passes: a comparison, a cast and a
//! product); the weight's gradient comes out of candle's product for the
//! transposed weight and is transposed again into the weight's
//! accumulator, a strided copy of the whole matrix; and the input's
//! gradient is computed even where no variable needs it (the first layer,
//! whose input is the data: a third of that layer's backward).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor};

use super::kernel::{each_item, map2, per_float, Float, BLOCK_ROWS};
use super::linear::ColumnSum;

/// The activation fused into [`fused_linear`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// None: `x W^T + b`.
    Identity,
    /// `max(x W^T + b, 0)`; its gradient is 0 where the output is 0, as
    /// PyTorch's (`threshold_backward`).
    Relu,
}

/// `act(x W^T + b)` over the last dimension of `x` (PyTorch's `nn.Linear`
/// layout: `weight` is out x in; every leading dimension folded into the
/// rows of one product), fused on CPU tensors of f32 and f64 (see the
/// module's note for what it saves); elsewhere candle's product, bias add
/// and activation.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_dp::ops::{fused_linear, Activation};
/// let x = Tensor::new(&[[1f32, -2.0], [3.0, 4.0]], &Device::Cpu)?;
/// let w = Tensor::new(&[[1f32, 1.0]], &Device::Cpu)?;
/// let b = Tensor::new(&[0.5f32], &Device::Cpu)?;
/// let y = fused_linear(&x, &w, Some(&b), Activation::Relu)?;
/// assert_eq!(y.to_vec2::<f32>()?, vec![vec![0.0], vec![7.5]]);
/// # Ok::<(), candle_core::Error>(())
/// ```
///
/// # Errors
///
/// A weight that is not 2-D, whose input width is not `x`'s last
/// dimension, a bias that is not as long as the weight's rows, or dtypes
/// that differ.
pub fn fused_linear(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    act: Activation,
) -> candle_core::Result<Tensor> {
    let (out_features, in_features) = weight.dims2()?;
    let mut dims = x.dims().to_vec();
    let Some(last) = dims.last_mut() else {
        candle_core::bail!("fused linear: a scalar input");
    };
    if *last != in_features {
        candle_core::bail!(
            "fused linear: an input of width {last} (shape {:?}) for a weight of {out_features} \
             x {in_features}",
            x.dims()
        );
    }
    *last = out_features;
    if let Some(bias) = bias {
        if bias.dims() != [out_features] {
            candle_core::bail!(
                "fused linear: a bias of shape {:?} for a weight of {out_features} x \
                 {in_features}",
                bias.dims()
            );
        }
    }
    let dtypes = [Some(x), Some(weight), bias].map(|t| t.map(Tensor::dtype));
    if dtypes.iter().flatten().any(|&d| d != x.dtype()) {
        candle_core::bail!("fused linear: dtypes differ (input, weight, bias): {dtypes:?}");
    }
    let rows = x.elem_count() / in_features.max(1);
    let x = x.reshape((rows, in_features))?;
    let fused = x.device().is_cpu() && matches!(x.dtype(), DType::F32 | DType::F64);
    let y = if fused {
        let zeros;
        let bias = match bias {
            Some(bias) => bias,
            None => {
                zeros = Tensor::zeros(out_features, x.dtype(), x.device())?;
                &zeros
            }
        };
        x.contiguous()?
            .apply_op3(&weight.contiguous()?, &bias.contiguous()?, FusedLinear(act))?
    } else {
        let y = x.matmul(&weight.t()?)?;
        let y = match bias {
            Some(bias) => y.broadcast_add(bias)?,
            None => y,
        };
        match act {
            Activation::Identity => y,
            Activation::Relu => y.relu()?,
        }
    };
    y.reshape(dims)
}

struct FusedLinear(Activation);

/// The activation's backward: the output's gradient where the output is
/// above 0, else 0 (the identity's is the gradient itself).
struct ReluGrad;

/// Adds `bias` to every row of `z` (rows x `bias.len()`) and applies
/// `act`, in place.
fn bias_and_act<T: Float>(z: &mut [T], bias: &[T], act: Activation) {
    let width = bias.len().max(1);
    let len = z.len();
    let items: Vec<_> = z.chunks_mut(BLOCK_ROWS * width).collect();
    each_item(items, len, |block| {
        for row in block.chunks_mut(width) {
            for (v, &b) in row.iter_mut().zip(bias) {
                let s = *v + b;
                // `<`, not `max`: a NaN stays NaN, as in PyTorch.
                *v = match act {
                    Activation::Relu if s < T::of(0.0) => T::of(0.0),
                    _ => s,
                };
            }
        }
    });
}

impl CustomOp3 for FusedLinear {
    fn name(&self) -> &'static str {
        "candle-dp-fused-linear"
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
        let op = "fused linear";
        let (rows, inner) = x_layout.shape().dims2()?;
        let (out, _) = w_layout.shape().dims2()?;
        // candle's own product (gemm, on its pool) for x W^T, into a
        // buffer this op then owns and finishes in place.
        let z = x.matmul(
            w,
            (1, rows, out, inner),
            x_layout,
            &w_layout.transpose(0, 1)?,
        )?;
        let y = per_float!(x.dtype(), op, T => {
            let mut z = T::into_values(z, op)?;
            bias_and_act(&mut z, T::slice(b, b_layout, op)?, self.0);
            T::storage(z)
        });
        Ok((y, Shape::from((rows, out))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let grad = grad_res.contiguous()?;
        let grad = match self.0 {
            Activation::Identity => grad,
            Activation::Relu => grad.apply_op2_no_bwd(res, &ReluGrad)?,
        };
        // Data (no variable behind it, as a first layer's input) needs no
        // gradient.
        let x_needs_grad = x.track_op();
        // The products below are gradients, not part of any graph.
        let (x, weight) = (x.detach(), weight.detach());
        let grad_x = x_needs_grad.then(|| grad.matmul(&weight)).transpose()?;
        // out x in, the weight's own layout: no transposed copy after.
        let grad_w = grad.t()?.matmul(&x)?;
        let grad_b = bias
            .track_op()
            .then(|| grad.apply_op1_no_bwd(&ColumnSum))
            .transpose()?;
        Ok((grad_x, Some(grad_w), grad_b))
    }
}

impl CustomOp2 for ReluGrad {
    fn name(&self) -> &'static str {
        "candle-dp-relu-grad"
    }

    fn cpu_fwd(
        &self,
        grad: &CpuStorage,
        grad_layout: &Layout,
        y: &CpuStorage,
        y_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let op = "fused linear backward";
        let out = per_float!(grad.dtype(), op, T => {
            let (g, y) = (T::slice(grad, grad_layout, op)?, T::slice(y, y_layout, op)?);
            // PyTorch's threshold_backward: 0 where the output is <= 0.
            T::storage(map2(g, y, |g, y| if y <= T::of(0.0) { T::of(0.0) } else { g }))
        });
        Ok((out, grad_layout.shape().clone()))
    }
}
