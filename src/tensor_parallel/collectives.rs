//! The collectives tensor parallelism runs inside candle's autograd
//! (Megatron-LM's `f` and `g`, and their sequence-parallel forms): each
//! is a collective in the forward and its transpose in the backward.
//!
//! | function | forward | backward |
//! |---|---|---|
//! | [`copy_to`] (`f`) | identity | all-reduce |
//! | [`reduce_from`] (`g`) | all-reduce | identity |
//! | [`gather_along`] | all-gather along a dimension | reduce-scatter along it |
//! | [`reduce_scatter_along`] | reduce-scatter along a dimension | all-gather along it |
//!
//! Each is one custom op whose forward copies a value computed outside the
//! graph (by the group's own collective) and whose backward runs the
//! transposed collective on the incoming gradient, so it works on every
//! group (threads, MPI, NCCL) and every dtype the group reduces. Every
//! rank of the group must call them in the same order, as any collective;
//! the backward's collectives follow the graph, which every rank builds
//! alike.

use std::sync::Arc;

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};

use crate::comm::{ProcessGroup, ReduceOp};

/// What the backward of a tensor-parallel collective does to the gradient.
#[derive(Debug, Clone, Copy)]
enum Backward {
    AllReduce,
    Identity,
    ReduceScatter(usize),
    AllGather(usize),
}

/// The op: the forward is `value` (computed already), the backward
/// `backward` of the incoming gradient, given to the first argument.
struct Collective {
    group: Arc<dyn ProcessGroup>,
    backward: Backward,
}

/// A contiguous copy of `storage` as `layout` reads it, on its device.
fn copy_of<S>(storage: &S, layout: &Layout) -> candle_core::Result<S>
where
    S: BackendStorage,
    S::Device: BackendDevice<Storage = S>,
{
    let mut out = storage
        .device()
        .zeros_impl(layout.shape(), storage.dtype())?;
    storage.copy_strided_src(&mut out, 0, layout)?;
    Ok(out)
}

fn comm(e: crate::comm::CommError) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

impl CustomOp2 for Collective {
    fn name(&self) -> &'static str {
        "candle-dp-tensor-parallel-collective"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        value: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((copy_of(value, layout)?, layout.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        value: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        Ok((copy_of(value, layout)?, layout.shape().clone()))
    }

    fn bwd(
        &self,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let group = self.group.as_ref();
        let grad = match self.backward {
            Backward::AllReduce => group.all_reduce(grad, ReduceOp::Sum).map_err(comm)?,
            Backward::Identity => grad.clone(),
            Backward::ReduceScatter(dim) => reduce_scatter_dim(group, grad, dim)?,
            Backward::AllGather(dim) => all_gather_dim(group, grad, dim)?,
        };
        Ok((Some(grad), None))
    }
}

/// `value` in the forward, `backward` of the gradient into `x`.
fn attach(
    x: &Tensor,
    value: &Tensor,
    group: &Arc<dyn ProcessGroup>,
    backward: Backward,
) -> candle_core::Result<Tensor> {
    let op = Collective {
        group: Arc::clone(group),
        backward,
    };
    x.apply_op2(value, op)
}

/// Megatron's `f`: `x` itself in the forward; in the backward the sum of
/// every rank's gradient. Before a column-parallel layer (each rank's
/// piece of its output has a gradient for the whole input) and around a
/// replicated parameter whose gradient is partial on each rank (sequence
/// parallelism's LayerNorm weights).
///
/// # Errors
///
/// The op's; in the backward, the collective's.
pub fn copy_to(x: &Tensor, group: &Arc<dyn ProcessGroup>) -> candle_core::Result<Tensor> {
    attach(x, &x.detach(), group, Backward::AllReduce)
}

/// Megatron's `g`: the sum of every rank's `x` in the forward; the
/// gradient unchanged in the backward. After a row-parallel layer (each
/// rank holds a partial sum of its output).
///
/// # Errors
///
/// The collective's.
pub fn reduce_from(x: &Tensor, group: &Arc<dyn ProcessGroup>) -> candle_core::Result<Tensor> {
    let sum = group.all_reduce(&x.detach(), ReduceOp::Sum).map_err(comm)?;
    attach(x, &sum, group, Backward::Identity)
}

/// Every rank's `x` concatenated along `dim` (in rank order) in the
/// forward; in the backward the sum of the gradients, each rank keeping
/// its own piece along `dim`. Sequence parallelism's entry to a
/// column-parallel layer: the sequence gathered.
///
/// # Errors
///
/// The collective's; ranks whose pieces differ in shape.
pub fn gather_along(
    x: &Tensor,
    dim: usize,
    group: &Arc<dyn ProcessGroup>,
) -> candle_core::Result<Tensor> {
    let whole = all_gather_dim(group.as_ref(), &x.detach(), dim)?;
    attach(x, &whole, group, Backward::ReduceScatter(dim))
}

/// The sum of every rank's `x`, each rank keeping its piece along `dim`
/// (rank `r` the `r`-th of equal pieces), in the forward; the pieces
/// gathered in the backward. Sequence parallelism's exit from a
/// row-parallel layer: the partial sums reduced and the sequence split.
///
/// # Errors
///
/// The collective's; a size along `dim` that does not divide among the
/// ranks.
pub fn reduce_scatter_along(
    x: &Tensor,
    dim: usize,
    group: &Arc<dyn ProcessGroup>,
) -> candle_core::Result<Tensor> {
    let piece = reduce_scatter_dim(group.as_ref(), &x.detach(), dim)?;
    attach(x, &piece, group, Backward::AllGather(dim))
}

/// Every rank's `x` concatenated along `dim`, outside the graph.
pub(crate) fn all_gather_dim(
    group: &dyn ProcessGroup,
    x: &Tensor,
    dim: usize,
) -> candle_core::Result<Tensor> {
    let pieces = group.all_gather(&x.contiguous()?).map_err(comm)?;
    Tensor::cat(&pieces, dim)
}

/// The sum over the ranks of `x`, this rank's equal piece along `dim`,
/// outside the graph.
fn reduce_scatter_dim(
    group: &dyn ProcessGroup,
    x: &Tensor,
    dim: usize,
) -> candle_core::Result<Tensor> {
    let (n, size) = (group.world_size(), x.dim(dim)?);
    if !size.is_multiple_of(n) {
        candle_core::bail!(
            "tensor parallelism: a size of {size} along dimension {dim} of {:?} does not split \
             among {n} ranks",
            x.dims()
        );
    }
    // The dimension outermost, so that each rank's piece is contiguous.
    let front = x.transpose(0, dim)?.contiguous()?;
    let counts = vec![front.elem_count() / n; n];
    let flat = front.flatten_all()?;
    let piece = group
        .reduce_scatter(&flat, ReduceOp::Sum, &counts)
        .map_err(comm)?;
    let mut dims = front.dims().to_vec();
    dims[0] = size / n;
    piece.reshape(dims)?.transpose(0, dim)?.contiguous()
}
