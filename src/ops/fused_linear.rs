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
use std::sync::Mutex;

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor};

use super::column_sum::ColumnSum;
use super::gelu::{forward as gelu_forward, GeluGrad};
use super::kernel::{each_item, map2, per_float, Float, BLOCK_ROWS};
use super::transpose::transposed;
use crate::util::lock::lock;

/// Whether the forward's product reads a transposed copy of the weight
/// (`out` x `inner` elements of `elem` bytes) for an input of `rows` rows.
///
/// Only where gemm's packing of the weight as it lies would be slowest:
/// rows a multiple of 4 KiB long, so that the 64 rows gemm packs at once
/// fall into one cache set, and at least those 64 rows. There the copy
/// repays itself from 2 input rows on (f32 1024 x 1024: 1.4-2.4x on the
/// product at 2-256 rows, even at 1024 rows; `transpose`'s note).
/// Elsewhere the copy cost more than it saved (0.6-0.95x on the language
/// model's and the MLP's other layers). Products of at most 256 outputs
/// (one row among them) take gemm's dot-product kernels, which read the
/// weight as it lies and sum in another order: there the copy would buy
/// nothing and change the bytes.
fn transposes_weight(rows: usize, out: usize, inner: usize, elem: usize) -> bool {
    const CACHE_WAY_BYTES: usize = 4096;
    const GEMM_PANEL_ROWS: usize = 64;
    const GEMM_SMALL_OUTPUTS: usize = 16 * 16;
    let row_bytes = inner * elem;
    rows >= 2
        && rows * out > GEMM_SMALL_OUTPUTS
        && out >= GEMM_PANEL_ROWS
        && row_bytes > 0
        && row_bytes.is_multiple_of(CACHE_WAY_BYTES)
}

/// The activation fused into [`fused_linear`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// None: `x W^T + b`.
    Identity,
    /// `max(x W^T + b, 0)`; its gradient is 0 where the output is 0, as
    /// PyTorch's (`threshold_backward`).
    Relu,
    /// GELU with the tanh approximation of `x W^T + b`, the values and
    /// gradients of [`gelu`](super::gelu) (PyTorch's
    /// `gelu(approximate="tanh")`) without a tensor of its own in the graph:
    /// the pre-activation is kept by the op for its backward.
    Gelu,
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
    // The leading dimensions' product: rows even where the width is 0.
    let rows: usize = dims[..dims.len() - 1].iter().product();
    let x = x.reshape((rows, in_features))?;
    let fused = x.device().is_cpu() && matches!(x.dtype(), DType::F32 | DType::F64);
    let y = match (fused, bias) {
        (true, Some(bias)) => x.contiguous()?.apply_op3(
            &weight.contiguous()?,
            &bias.contiguous()?,
            FusedLinear::new(act),
        )?,
        (true, None) => x
            .contiguous()?
            .apply_op2(&weight.contiguous()?, FusedLinear::new(act))?,
        (false, _) => {
            let y = x.matmul(&weight.t()?)?;
            let y = match bias {
                Some(bias) => y.broadcast_add(bias)?,
                None => y,
            };
            match act {
                Activation::Identity => y,
                Activation::Relu => y.relu()?,
                Activation::Gelu => y.gelu()?,
            }
        }
    };
    y.reshape(dims)
}

/// The op, with a bias (three arguments) or without (two).
struct FusedLinear {
    act: Activation,
    /// GELU's input, `x W^T + b`, from the forward for the backward (the
    /// output does not determine it). Kept as long as the graph keeps the
    /// op, as the separate GELU's graph node kept it.
    pre_activation: Mutex<Option<Tensor>>,
}

impl FusedLinear {
    fn new(act: Activation) -> Self {
        FusedLinear {
            act,
            pre_activation: Mutex::new(None),
        }
    }
}

/// The activation's backward: the output's gradient where the output is
/// above 0, else 0 (the identity's is the gradient itself).
struct ReluGrad;

/// Adds `bias` (if any) to every row of `z` (rows x `width`) and applies
/// ReLU if `act` says, in place; nothing to do for neither (the GELU is
/// not applied here: its input is kept, see [`FusedLinear::forward`]).
fn bias_and_act<T: Float>(z: &mut [T], width: usize, bias: Option<&[T]>, act: Activation) {
    if bias.is_none() && act != Activation::Relu {
        return;
    }
    let width = width.max(1);
    let len = z.len();
    let items: Vec<_> = z.chunks_mut(BLOCK_ROWS * width).collect();
    each_item(items, len, |block| {
        for row in block.chunks_mut(width) {
            if let Some(bias) = bias {
                row.iter_mut().zip(bias).for_each(|(v, &b)| *v = *v + b);
            }
            if act == Activation::Relu {
                // `<`, not `max`: a NaN stays NaN, as in PyTorch.
                for v in row.iter_mut() {
                    if *v < T::of(0.0) {
                        *v = T::of(0.0);
                    }
                }
            }
        }
    });
}

impl FusedLinear {
    /// `act(x W^T + b)`: candle's own product (gemm, on its pool) for
    /// `x W^T`, into a buffer this op then owns and finishes in place.
    fn forward(
        &self,
        (x, x_layout): (&CpuStorage, &Layout),
        (w, w_layout): (&CpuStorage, &Layout),
        bias: Option<(&CpuStorage, &Layout)>,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let op = "fused linear";
        let (rows, inner) = x_layout.shape().dims2()?;
        let (out, _) = w_layout.shape().dims2()?;
        let bmnk = (1, rows, out, inner);
        let z = if transposes_weight(rows, out, inner, x.dtype().size_in_bytes()) {
            // The weight as gemm reads it fastest (see `transpose`): the
            // same products in the same order, so the same bytes.
            let wt = per_float!(w.dtype(), op, T => {
                T::storage(transposed(T::slice(w, w_layout, op)?, out, inner))
            });
            x.matmul(&wt, bmnk, x_layout, &Layout::contiguous((inner, out)))?
        } else {
            x.matmul(w, bmnk, x_layout, &w_layout.transpose(0, 1)?)?
        };
        let y = per_float!(x.dtype(), op, T => {
            let mut z = T::into_values(z, op)?;
            let bias = bias.map(|(b, l)| T::slice(b, l, op)).transpose()?;
            bias_and_act(&mut z, out, bias, self.act);
            match self.act {
                Activation::Gelu => {
                    let y = gelu_forward(&z);
                    let z = Tensor::from_vec(z, (rows, out), &candle_core::Device::Cpu)?;
                    *lock(&self.pre_activation) = Some(z);
                    T::storage(y)
                }
                Activation::Identity | Activation::Relu => T::storage(z),
            }
        });
        Ok((y, Shape::from((rows, out))))
    }

    /// The gradients of x, the weight and the bias (each only where a
    /// variable is behind it: data, such as a first layer's input, needs
    /// none), the weight's made in its own layout (out x in).
    fn backward(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<[Option<Tensor>; 3]> {
        let grad = grad_res.contiguous()?;
        let grad = match self.act {
            Activation::Identity => grad,
            Activation::Relu => grad.apply_op2_no_bwd(res, &ReluGrad)?,
            Activation::Gelu => {
                let Some(z) = lock(&self.pre_activation).clone() else {
                    candle_core::bail!("fused linear backward: the GELU's input was not kept");
                };
                z.apply_op2_no_bwd(&grad, &GeluGrad)?
            }
        };
        let (x_needs, w_needs) = (x.track_op(), weight.track_op());
        // The products below are gradients, not part of any graph.
        let (x, weight) = (x.detach(), weight.detach());
        let grad_x = x_needs.then(|| grad.matmul(&weight)).transpose()?;
        let grad_w = w_needs.then(|| grad.t()?.matmul(&x)).transpose()?;
        let grad_b = bias
            .filter(|b| b.track_op())
            .map(|_| grad.apply_op1_no_bwd(&ColumnSum))
            .transpose()?;
        Ok([grad_x, grad_w, grad_b])
    }
}

impl CustomOp2 for FusedLinear {
    fn name(&self) -> &'static str {
        "candle-dp-fused-linear"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        w: &CpuStorage,
        w_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.forward((x, x_layout), (w, w_layout), None)
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let [grad_x, grad_w, _] = self.backward(x, weight, None, res, grad_res)?;
        Ok((grad_x, grad_w))
    }
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
        self.forward((x, x_layout), (w, w_layout), Some((b, b_layout)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let [grad_x, grad_w, grad_b] = self.backward(x, weight, Some(bias), res, grad_res)?;
        Ok((grad_x, grad_w, grad_b))
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
