//! Gradient clipping by the total norm: PyTorch's
//! `torch.nn.utils.clip_grad_norm_`, on a candle `GradStore`.
//!
//! [`clip_grad_norm`] takes whole gradients: one device's, `DataParallel`'s,
//! DDP's after its all-reduce (every rank holds the same, so every rank
//! clips alike), a pipeline step's (`Step::grads` gathers every stage's).
//! Where each rank holds some of them (ZeRO stage 2),
//! [`ZeroOptimizer::clip_grad_norm`](crate::zero::ZeroOptimizer::clip_grad_norm)
//! adds one all-reduce of one number.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};

use crate::comm::{ProcessGroup, ReduceOp};
use crate::error::{Error, Result};

/// What [`clip_grad_norm`] did: the total norm of the gradients before
/// clipping (PyTorch's return value) and the factor they were multiplied
/// by.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Clipped {
    /// The norm of all the gradients together, as if concatenated into one
    /// vector (in the gradients' dtype, then widened).
    pub total_norm: f64,
    /// `min(max_norm / (total_norm + 1e-6), 1)`, by which every gradient
    /// was multiplied (1 when there was none).
    pub factor: f64,
}

/// Clips the gradients of `params` in `grads` to a total `norm_type`-norm
/// of at most `max_norm`, in place, as PyTorch's `clip_grad_norm_` does:
/// each gradient's norm, then the norm of those norms, then every gradient
/// times `min(max_norm / (total + 1e-6), 1)`, all in the gradients' dtype
/// (so the squares of f32 gradients of 1e-30 underflow to a norm of 0, as
/// in PyTorch). Gradients of several dtypes (bf16 beside f32) each get
/// their norm in their own dtype, and the total is taken in the promoted
/// dtype (f32 there), whatever the parameters' order, as PyTorch's.
/// `norm_type` is any p > 0 or `f64::INFINITY` (the largest magnitude).
/// Parameters without a gradient are left out.
///
/// With a [`GradScaler`]-style loss scale, unscale first.
///
/// ```
/// use candle_core::{DType, Device, Tensor, Var};
/// use candle_dp::optim::clip_grad_norm;
///
/// # fn main() -> candle_dp::Result<()> {
/// let w = Var::zeros(2, DType::F32, &Device::Cpu)?;
/// let mut grads = (w.as_tensor() * 1.0)?.sum_all()?.backward()?;
/// grads.insert(w.as_tensor(), Tensor::new(&[3f32, 4.], &Device::Cpu)?);
/// let clipped = clip_grad_norm(&mut grads, &[w.clone()], 1.0, 2.0, false)?;
/// assert!((clipped.total_norm - 5.0).abs() < 1e-6);
/// let g = grads.get(w.as_tensor()).unwrap().to_vec1::<f32>()?;
/// assert!((g[0] - 0.6).abs() < 1e-6 && (g[1] - 0.8).abs() < 1e-6);
/// # Ok(())
/// # }
/// ```
///
/// [`GradScaler`]: https://pytorch.org/docs/stable/amp.html#gradient-scaling
///
/// # Errors
///
/// [`Error::Clip`] for a `norm_type` that is not a p > 0 or infinity, a
/// `max_norm` that is not a finite number, or, with
/// `error_if_nonfinite`, a total norm that is NaN or infinite (naming the
/// parameters whose gradients are not finite); the gradients are then
/// unchanged.
pub fn clip_grad_norm(
    grads: &mut GradStore,
    params: &[Var],
    max_norm: f64,
    norm_type: f64,
    error_if_nonfinite: bool,
) -> Result<Clipped> {
    check_arguments(max_norm, norm_type)?;
    let local = LocalNorms::of(grads, params, norm_type)?;
    if local.norms.is_empty() {
        return Ok(Clipped {
            total_norm: 0.0,
            factor: 1.0,
        });
    }
    let total = vector_norm(&Tensor::stack(&local.for_total()?, 0)?, norm_type)?;
    finish(
        grads,
        params,
        &local,
        total,
        max_norm,
        norm_type,
        error_if_nonfinite,
    )
}

/// Ranks beyond a strategy's own that a gradient norm spans: the
/// tensor-parallel ranks, across which each parameter counts where
/// `counted(name)` says (a split one on every rank, a replicated one on
/// one).
#[derive(Clone, Copy)]
pub(crate) struct AlsoAcross<'a> {
    /// The further ranks.
    pub group: &'a dyn ProcessGroup,
    /// Whether this rank counts the parameter named so.
    pub counted: &'a dyn Fn(&str) -> bool,
}

impl AlsoAcross<'_> {
    /// The ids of the variables of `named` this rank counts.
    pub(crate) fn counted_ids(
        &self,
        named: &[(String, Var)],
    ) -> std::collections::HashSet<candle_core::TensorId> {
        named
            .iter()
            .filter(|(name, _)| (self.counted)(name))
            .map(|(_, var)| var.as_tensor().id())
            .collect()
    }
}

/// Which of a strategy's variables this rank counts for `also`: all of
/// them without further ranks. Made once per clip, asked per variable.
pub(crate) struct AlsoCounted(Option<std::collections::HashSet<candle_core::TensorId>>);

impl AlsoCounted {
    /// Those of `named` that `also` counts on this rank.
    pub(crate) fn of(also: Option<AlsoAcross<'_>>, named: &[(String, Var)]) -> Self {
        Self(also.map(|a| a.counted_ids(named)))
    }

    /// Whether `var` counts.
    pub(crate) fn counts(&self, var: &Var) -> bool {
        self.0
            .as_ref()
            .is_none_or(|ids| ids.contains(&var.as_tensor().id()))
    }
}

/// The groups a norm sums over: a strategy's own, then `also`'s.
pub(crate) fn groups<'a>(
    own: Option<&'a dyn ProcessGroup>,
    also: Option<AlsoAcross<'a>>,
) -> Vec<&'a dyn ProcessGroup> {
    own.into_iter().chain(also.map(|a| a.group)).collect()
}

/// [`clip_grad_norm`] where each rank holds the gradients of some of the
/// parameters (ZeRO stage 2, FSDP): the total norm comes from every
/// rank's gradients through one all-reduce of one number (each rank's sum
/// of its gradients' norms to the power p, or their largest for
/// infinity), so every rank clips by the same factor; it agrees with the
/// one-device clip to rounding (the per-tensor norms are summed in f64
/// across ranks instead of stacked), not bit for bit. Some gradients may
/// be held by several
/// ranks (a weight tied across a pipeline's ranks): only those `counted`
/// on this rank enter the total, so each counts once; every gradient of
/// `params` is clipped. The total sums over each of `groups` in turn (a
/// strategy's ranks, then the tensor-parallel ones).
pub(crate) fn clip_grad_norm_across_counting(
    groups: &[&dyn ProcessGroup],
    grads: &mut GradStore,
    params: &[Var],
    counted: &dyn Fn(&Var) -> bool,
    max_norm: f64,
    norm_type: f64,
    error_if_nonfinite: bool,
) -> Result<Clipped> {
    check_arguments(max_norm, norm_type)?;
    let local = LocalNorms::of(grads, params, norm_type)?;
    let mut mine = 0f64;
    let counts = local.present.iter().map(|(i, _)| counted(&params[*i]));
    for (n, _) in local.norms.iter().zip(counts).filter(|(_, c)| *c) {
        let n = n.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        mine = if norm_type.is_infinite() {
            mine.max(n)
        } else {
            mine + n.powf(norm_type)
        };
    }
    let op = if norm_type.is_infinite() {
        ReduceOp::Max
    } else {
        ReduceOp::Sum
    };
    let mut all = mine;
    for pg in groups {
        let sum = pg.all_reduce(&Tensor::new(&[all], &Device::Cpu)?, op)?;
        all = sum.to_vec1::<f64>()?.first().copied().unwrap_or(0.0);
    }
    let total_norm = if norm_type.is_infinite() {
        all
    } else {
        all.powf(1.0 / norm_type)
    };
    let Some(first) = local.norms.first() else {
        if error_if_nonfinite && !total_norm.is_finite() {
            return Err(nonfinite(norm_type, total_norm, "another rank's"));
        }
        return Ok(Clipped {
            total_norm,
            factor: 1.0,
        });
    };
    let total = Tensor::new(total_norm, first.device())?.to_dtype(local.total_dtype())?;
    finish(
        grads,
        params,
        &local,
        total,
        max_norm,
        norm_type,
        error_if_nonfinite,
    )
}

fn check_arguments(max_norm: f64, norm_type: f64) -> Result<()> {
    if norm_type.is_nan() || norm_type <= 0.0 {
        return Err(Error::Clip(format!(
            "norm type {norm_type}: it must be a p greater than 0, or infinity"
        )));
    }
    if !max_norm.is_finite() {
        return Err(Error::Clip(format!("max_norm is {max_norm}")));
    }
    Ok(())
}

fn nonfinite(norm_type: f64, total_norm: f64, culprits: &str) -> Error {
    Error::Clip(format!(
        "the total norm of order {norm_type} of the gradients is {total_norm}, so they cannot \
         be clipped: not finite in {culprits}"
    ))
}

/// The gradients of the parameters that have one, and each one's norm,
/// in that gradient's dtype (as PyTorch computes them), on the first
/// one's device.
struct LocalNorms {
    present: Vec<(usize, Tensor)>,
    norms: Vec<Tensor>,
}

impl LocalNorms {
    fn of(grads: &GradStore, params: &[Var], norm_type: f64) -> Result<Self> {
        let present: Vec<(usize, Tensor)> = params
            .iter()
            .enumerate()
            .filter_map(|(i, p)| grads.get(p.as_tensor()).map(|g| (i, g.clone())))
            .collect();
        let Some((_, first)) = present.first() else {
            return Ok(Self {
                present,
                norms: Vec::new(),
            });
        };
        let device = first.device().clone();
        let norms = present
            .iter()
            .map(|(_, g)| vector_norm(&g.flatten_all()?, norm_type)?.to_device(&device))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Self { present, norms })
    }

    /// The dtype of the total norm: the norms' dtypes promoted as
    /// `torch.stack` promotes them (one dtype stays itself; bf16 with f16
    /// or f32 is f32; anything with f64 is f64), so the total does not
    /// depend on which parameter comes first.
    fn total_dtype(&self) -> DType {
        let mut dtypes = self.norms.iter().map(Tensor::dtype);
        let Some(first) = dtypes.next() else {
            return DType::F32;
        };
        dtypes.fold(first, |a, b| match (a, b) {
            (a, b) if a == b => a,
            (DType::F64, _) | (_, DType::F64) => DType::F64,
            _ => DType::F32,
        })
    }

    /// The norms in the order PyTorch stacks them (grouped by dtype, the
    /// groups in the order their dtype first appears, each in the
    /// parameters' order), in [`total_dtype`](Self::total_dtype).
    fn for_total(&self) -> candle_core::Result<Vec<Tensor>> {
        let dtype = self.total_dtype();
        let mut groups: Vec<DType> = Vec::new();
        for norm in &self.norms {
            if !groups.contains(&norm.dtype()) {
                groups.push(norm.dtype());
            }
        }
        groups
            .iter()
            .flat_map(|&group| self.norms.iter().filter(move |n| n.dtype() == group))
            .map(|n| n.to_dtype(dtype))
            .collect()
    }
}

/// Checks the total norm, then multiplies every gradient by PyTorch's
/// factor `min(max_norm / (total + 1e-6), 1)`, computed in the total's
/// dtype; nothing changes on an error.
fn finish(
    grads: &mut GradStore,
    params: &[Var],
    local: &LocalNorms,
    total: Tensor,
    max_norm: f64,
    norm_type: f64,
    error_if_nonfinite: bool,
) -> Result<Clipped> {
    let total_norm = total.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    if error_if_nonfinite && !total_norm.is_finite() {
        let culprits: Vec<String> = local
            .present
            .iter()
            .zip(&local.norms)
            .filter(|(_, n)| {
                n.to_dtype(DType::F64)
                    .and_then(|n| n.to_scalar::<f64>())
                    .map_or(true, |n| !n.is_finite())
            })
            .map(|((i, _), _)| format!("parameter {i}"))
            .collect();
        let culprits = if culprits.is_empty() {
            "another rank's".to_string()
        } else {
            culprits.join(", ")
        };
        return Err(nonfinite(norm_type, total_norm, &culprits));
    }
    let (dtype, device) = (total.dtype(), total.device().clone());
    let eps = Tensor::full(1e-6, (), &device)?.to_dtype(dtype)?;
    let max = Tensor::full(max_norm, (), &device)?.to_dtype(dtype)?;
    let factor = max.div(&(total + eps)?)?;
    let factor = factor.minimum(&Tensor::ones((), dtype, &device)?)?;
    let mut clipped = Vec::with_capacity(local.present.len());
    for (i, g) in &local.present {
        let g = match g.dtype() {
            // PyTorch multiplies a bf16 or f16 gradient by the factor in
            // f32 and rounds once; the factor rounded to the gradient's
            // dtype first could move it by an ulp.
            DType::BF16 | DType::F16 => {
                let f = factor.to_dtype(DType::F32)?.to_device(g.device())?;
                g.to_dtype(DType::F32)?
                    .broadcast_mul(&f)?
                    .to_dtype(g.dtype())?
            }
            _ => g.broadcast_mul(&factor.to_dtype(g.dtype())?.to_device(g.device())?)?,
        };
        clipped.push((*i, g));
    }
    for (i, g) in clipped {
        grads.insert(params[i].as_tensor(), g);
    }
    Ok(Clipped {
        total_norm,
        factor: factor.to_dtype(DType::F64)?.to_scalar::<f64>()?,
    })
}

/// `torch.linalg.vector_norm(x, p)` of a 1-D tensor, in its dtype (0 for
/// no elements); a bf16 or f16 one accumulated in f32 and rounded once,
/// as PyTorch's reductions of those dtypes are.
fn vector_norm(x: &Tensor, p: f64) -> candle_core::Result<Tensor> {
    if x.elem_count() == 0 {
        return Tensor::zeros((), x.dtype(), x.device());
    }
    if matches!(x.dtype(), DType::BF16 | DType::F16) {
        return vector_norm(&x.to_dtype(DType::F32)?, p)?.to_dtype(x.dtype());
    }
    let a = x.abs()?;
    if p.is_infinite() {
        a.max(0)
    } else if p == 1.0 {
        a.sum_all()
    } else if p == 2.0 {
        a.sqr()?.sum_all()?.sqrt()
    } else {
        a.powf(p)?.sum_all()?.powf(1.0 / p)
    }
}
