//! GELU with the tanh approximation, fused: `0.5 x (1 + tanh(sqrt(2/pi)
//! (x + 0.044715 x^3)))` forward, PyTorch's exact derivative backward.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Shape, Tensor};

use super::kernel::{map1, map2, per_float, Float};

/// `sqrt(2 / pi)`.
const BETA: f64 = 0.797_884_560_802_865_4;
/// The cubic term's weight.
const KAPPA: f64 = 0.044_715;

/// GELU (tanh approximation) of `x`, fused on CPU f32/f64 tensors, candle's
/// `Tensor::gelu` elsewhere (see the [module docs](super)).
///
/// The forward is candle's formula, with a vectorised f32 `tanh` (within
/// 1.2e-7 of libm's: the values within 1e-6 of candle's); the backward is
/// PyTorch's (`gelu_backward(approximate="tanh")`) in one pass over the
/// input and the incoming gradient. A gradient of the gradient is not
/// available (the backward is not itself differentiable).
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// let x = Var::new(&[-1.0f32, 0.0, 2.0], &Device::Cpu)?;
/// let y = candle_dp::ops::gelu(x.as_tensor())?;
/// let fused = y.to_vec1::<f32>()?;
/// let candle = x.as_tensor().gelu()?.to_vec1::<f32>()?;
/// for (a, b) in fused.iter().zip(&candle) {
///     assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0));
/// }
/// let grads = y.sum_all()?.backward()?;
/// assert!(grads.get(x.as_tensor()).is_some());
/// # Ok::<(), candle_core::Error>(())
/// ```
///
/// # Errors
///
/// candle's, for a tensor it cannot read.
pub fn gelu(x: &Tensor) -> candle_core::Result<Tensor> {
    match (x.device().is_cpu(), x.dtype()) {
        (true, candle_core::DType::F32 | candle_core::DType::F64) => {
            x.contiguous()?.apply_op1(Gelu)
        }
        _ => x.gelu(),
    }
}

/// The forward op.
struct Gelu;

/// The backward: `(x, dy) -> dx`.
pub(super) struct GeluGrad;

/// candle's forward formula: `0.5 v (1 + tanh(sqrt(2/pi) v
/// (1 + 0.044715 v v)))`, in its order of operations.
pub(super) fn forward<T: Float>(x: &[T]) -> Vec<T> {
    let (half, one, beta, kappa) = (T::of(0.5), T::of(1.0), T::of(BETA), T::of(KAPPA));
    map1(x, move |v| {
        let inner = beta * v * (one + kappa * v * v);
        half * v * (one + inner.tanh())
    })
}

/// PyTorch's backward (ATen's `GeluBackwardKernel`, tanh): with `t =
/// tanh(beta (x + kappa x^3))`, `dx = dy (0.5 (1 + t) + 0.5 x (1 - t^2)
/// beta (1 + 3 kappa x^2))`, in ATen's order of operations (`1 - t^2`
/// without cancellation in f32, see `Float::tanh_and_sech2`).
fn backward<T: Float>(x: &[T], dy: &[T]) -> Vec<T> {
    let (half, one, beta, kappa) = (T::of(0.5), T::of(1.0), T::of(BETA), T::of(KAPPA));
    let three_kappa = T::of(3.0 * KAPPA);
    map2(x, dy, move |x, dy| {
        let x_sq = x * x;
        let x_cube = x_sq * x;
        let (t, sech2) = (beta * (x + kappa * x_cube)).tanh_and_sech2();
        let left = half * x;
        let right = one + t;
        let left_derivative = half * right;
        let right_derivative = left * sech2 * beta * (one + three_kappa * x_sq);
        dy * (left_derivative + right_derivative)
    })
}

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "candle-dp-gelu"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let out = per_float!(storage.dtype(), "gelu", T => {
            T::storage(forward(T::slice(storage, layout, "gelu")?))
        });
        Ok((out, layout.shape().clone()))
    }

    fn bwd(
        &self,
        arg: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let grad = arg.apply_op2_no_bwd(&grad_res.contiguous()?, &GeluGrad)?;
        Ok(Some(grad))
    }
}

impl CustomOp2 for GeluGrad {
    fn name(&self) -> &'static str {
        "candle-dp-gelu-grad"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        dy: &CpuStorage,
        dy_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        if x_layout.shape() != dy_layout.shape() {
            candle_core::bail!(
                "gelu backward: gradient of shape {:?} for an input of shape {:?}",
                dy_layout.shape(),
                x_layout.shape()
            );
        }
        let op = "gelu backward";
        let out = per_float!(x.dtype(), op, T => T::storage(backward(
            T::slice(x, x_layout, op)?,
            T::slice(dy, dy_layout, op)?,
        )));
        Ok((out, x_layout.shape().clone()))
    }
}
