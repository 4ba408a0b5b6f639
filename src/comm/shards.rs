//! The collectives of sharded training (ZeRO, FSDP), on any group:
//! [`ProcessGroup::reduce_scatter`] through the group's all-reduce (the
//! default; the thread and MPI groups run their own, reading or sending
//! only each rank's piece, with the same bytes), and
//! [`ProcessGroup::all_gather_into`] through its all-gather. Each rank's
//! piece is bitwise the same slice of the all-reduce's result, which is
//! what lets ZeRO and FSDP train to DDP's very bytes.

use std::ops::Range;

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use super::{all_gather_object, CommError, ProcessGroup, ReduceOp, Result};

const REDUCE_SCATTER: &str = "reduce_scatter";

/// [`ProcessGroup::reduce_scatter`] as an all-reduce of the whole tensor,
/// of which this rank keeps its piece (a copy, so the whole result is
/// freed at once).
pub(crate) fn reduce_scatter_by_all_reduce<P: ProcessGroup + ?Sized>(
    pg: &P,
    tensor: &Tensor,
    op: ReduceOp,
    counts: &[usize],
) -> Result<Tensor> {
    let rank = pg.rank();
    let piece = agree_on_split(pg, tensor, counts)?;
    let flat = tensor
        .flatten_all()
        .map_err(|source| tensor_error(rank, REDUCE_SCATTER, source))?;
    let reduced = pg.all_reduce(&flat, op)?;
    reduced
        .narrow(0, piece.start, piece.len())
        // Just the piece (`copy` would clone the whole result).
        .and_then(|piece| piece.force_contiguous())
        .map_err(|source| tensor_error(rank, REDUCE_SCATTER, source))
}

/// Checks a reduce-scatter's split on every rank from every rank's counts
/// and returns this rank's piece (a range of the flattened tensor). Every
/// rank must split the result the same way (a rank whose counts differ
/// would silently keep another slice), into pieces that add up to its
/// tensor; all ranks give the same error otherwise, and the group stays
/// usable.
pub(crate) fn agree_on_split<P: ProcessGroup + ?Sized>(
    pg: &P,
    tensor: &Tensor,
    counts: &[usize],
) -> Result<Range<usize>> {
    let rank = pg.rank();
    let mine = Split {
        elements: tensor.elem_count() as u64,
        counts: counts.iter().map(|&c| c as u64).collect(),
    };
    let splits = all_gather_object(pg, &mine)?;
    if let Some((culprit, reason)) = first_bad_split(&splits) {
        return Err(CommError::InvalidInput {
            rank,
            op: REDUCE_SCATTER,
            culprit,
            reason,
        });
    }
    let start: usize = counts[..rank].iter().sum();
    Ok(start..start + counts[rank])
}

/// One rank's request of a reduce-scatter.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Split {
    elements: u64,
    counts: Vec<u64>,
}

/// The first rank whose split cannot be used, and why.
fn first_bad_split(splits: &[Split]) -> Option<(usize, String)> {
    let world = splits.len();
    splits.iter().enumerate().find_map(|(r, split)| {
        let sum = split
            .counts
            .iter()
            .try_fold(0u64, |sum, &count| sum.checked_add(count));
        if split.counts.len() != world {
            Some(format!(
                "{} counts for a world of {world}",
                split.counts.len()
            ))
        } else if sum.is_none() {
            Some(format!(
                "the counts {:?} add up to more than any tensor can hold",
                split.counts
            ))
        } else if sum != Some(split.elements) {
            Some(format!(
                "the counts sum to {} but the tensor has {} elements",
                sum.unwrap_or(0),
                split.elements
            ))
        } else if split.counts != splits[0].counts {
            Some(format!(
                "counts {:?}, where rank 0 passes {:?}",
                split.counts, splits[0].counts
            ))
        } else {
            None
        }
        .map(|reason| (r, reason))
    })
}

/// [`ProcessGroup::all_gather_into`] as an all-gather, concatenated.
pub(crate) fn all_gather_into_by_all_gather<P: ProcessGroup + ?Sized>(
    pg: &P,
    tensor: &Tensor,
) -> Result<Tensor> {
    let rank = pg.rank();
    let pieces = pg.all_gather(tensor)?;
    pieces
        .iter()
        .map(Tensor::flatten_all)
        .collect::<candle_core::Result<Vec<_>>>()
        .and_then(|flat| Tensor::cat(&flat, 0))
        .map_err(|source| tensor_error(rank, "all_gather_into", source))
}

fn tensor_error(rank: usize, op: &'static str, source: candle_core::Error) -> CommError {
    CommError::Tensor { rank, op, source }
}
