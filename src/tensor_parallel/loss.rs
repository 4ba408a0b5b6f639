//! The cross-entropy of logits split by the vocabulary over the
//! tensor-parallel ranks (PyTorch's `loss_parallel`), without gathering
//! them.

use candle_core::{DType, Tensor};

use super::collectives::reduce_from;
use super::layers::{ids_of, local_ids};
use super::TensorParallel;
use crate::comm::ReduceOp;

/// The mean over rows of `-log softmax(logits)[target]`, where each rank
/// holds its columns of the logits (rows x `vocab / tp`, rank `r` the
/// `r`-th): the rows' maximum, the sum of the exponentials and the
/// target's logit are each one all-reduce of one number per row, so that
/// no rank ever holds the whole logits. Every rank gets the same loss, and
/// the gradient of its own columns. Computed in f32.
///
/// # Errors
///
/// Logits that are not 2-D, targets not one per row, a target that is no
/// class, a collective's.
pub fn vocab_parallel_cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    tp: &TensorParallel,
) -> candle_core::Result<Tensor> {
    let (rows, local) = logits.dims2()?;
    if targets.dims() != [rows] {
        candle_core::bail!(
            "vocab-parallel cross-entropy: targets of shape {:?} for {rows} rows of logits",
            targets.dims()
        );
    }
    // Every class of the whole vocabulary, checked as the fused loss does.
    crate::ops::class_indices(targets, local * tp.size())?;
    let group = tp.group();
    let logits = logits.to_dtype(DType::F32)?;
    // The softmax does not change with the shift: the maximum is a
    // constant of the graph.
    let max = group
        .all_reduce(&logits.max_keepdim(1)?.detach(), ReduceOp::Max)
        .map_err(candle_core::Error::wrap)?;
    let shifted = logits.broadcast_sub(&max)?;
    let sum = reduce_from(&shifted.exp()?.sum_keepdim(1)?, group)?;
    let (index, mask) = local_ids(&ids_of(targets)?, tp.rank() * local, local, logits.device())?;
    let picked = shifted.gather(&index.unsqueeze(1)?, 1)?.mul(&mask)?;
    let picked = reduce_from(&picked, group)?;
    (sum.log()? - picked)?.mean_all()
}
