//! The two collectives of sharded training, each step written once:
//! whole gradients reduce-scattered to each rank's pieces (ZeRO-2's
//! buckets, FSDP's units), and every rank's pieces all-gathered (ZeRO's
//! updated pieces written back into the whole parameters, FSDP's units
//! gathered whole, a pipeline stage's FSDP variables put together).

use std::collections::BTreeSet;

use candle_core::{DType, Device, Tensor, Var};

use super::layout::{pack_by_rank, unpack_section, ShardLayout};
use crate::comm::ProcessGroup;
use crate::error::Result;

/// Reduces whole gradients across the ranks to this rank's pieces: each
/// of `grads` (one per parameter, split by `layouts`; a missing one counts
/// as zeros, made on `device`) in `dtype`, laid out rank by rank
/// ([`pack_by_rank`]), with one presence flag per parameter after each
/// rank's pieces unless `presence` already holds the flags summed on the
/// host; `collective(table, section)` reduces the table and returns this
/// rank's section (`section` elements). Returns each parameter's piece in
/// `piece_dtypes[k]`, or `None` where no rank had its gradient. Every rank
/// calls it with the same parameters, in the same order.
#[allow(clippy::too_many_arguments)]
pub(crate) fn reduce_scatter_grads(
    grads: &[Option<Tensor>],
    layouts: &[&ShardLayout],
    dtype: DType,
    device: &Device,
    piece_dtypes: &[DType],
    presence: Option<&[f64]>,
    world: usize,
    collective: impl FnOnce(&Tensor, usize) -> Result<Tensor>,
) -> Result<Vec<Option<Tensor>>> {
    // Alone, this rank's flags are the sum: none need ride in the table
    // and be read back (a device-to-host copy per call on a GPU).
    let local: Vec<f64>;
    let presence = match (presence, world) {
        (None, 1) => {
            local = grads
                .iter()
                .map(|g| f64::from(u8::from(g.is_some())))
                .collect();
            Some(local.as_slice())
        }
        (presence, _) => presence,
    };
    let mut wholes = Vec::with_capacity(grads.len());
    for (grad, layout) in grads.iter().zip(layouts) {
        wholes.push(match grad {
            Some(g) => g.to_dtype(dtype)?,
            None => Tensor::zeros(layout.dims.as_slice(), dtype, device)?,
        });
    }
    let flags = match presence {
        Some(_) => None,
        None => {
            let mine: Vec<f32> = grads
                .iter()
                .map(|g| if g.is_some() { 1. } else { 0. })
                .collect();
            Some(Tensor::new(mine, device)?.to_dtype(dtype)?)
        }
    };
    let table = pack_by_rank(&wholes, layouts, flags.as_ref(), world)?;
    let section = table.elem_count() / world;
    let mine = collective(&table, section)?;
    let flags = match presence {
        Some(flags) => flags.to_vec(),
        None => {
            let n = grads.len();
            mine.narrow(0, mine.elem_count() - n, n)?
                .to_dtype(DType::F64)?
                .to_vec1::<f64>()?
        }
    };
    Ok(unpack_section(&mine, layouts, &flags, piece_dtypes)?)
}

/// Every rank's pieces of some parameters, in one all-gather: `mine` are
/// this rank's pieces (each of its layout's piece size, any shape), and
/// the result holds, per parameter, every rank's piece flattened, in rank
/// order. Every rank calls it with the same parameters, in the same
/// order.
pub(crate) fn all_gather_pieces(
    pg: &dyn ProcessGroup,
    mine: &[Tensor],
    layouts: &[&ShardLayout],
) -> Result<Vec<Vec<Tensor>>> {
    if mine.is_empty() {
        return Ok(Vec::new());
    }
    // Each rank's buffer as it came (`all_gather_into` would copy them all
    // into one first).
    let all = pg.all_gather(&flat_pieces(mine)?)?;
    split_pieces(&all, layouts)
}

/// [`all_gather_pieces`], with only `root` receiving them (`Some`).
fn gather_pieces(
    pg: &dyn ProcessGroup,
    mine: &[Tensor],
    layouts: &[&ShardLayout],
    root: usize,
) -> Result<Option<Vec<Vec<Tensor>>>> {
    if mine.is_empty() {
        return Ok((pg.rank() == root).then(Vec::new));
    }
    match pg.gather(&flat_pieces(mine)?, root)? {
        Some(all) => split_pieces(&all, layouts).map(Some),
        None => Ok(None),
    }
}

/// This rank's pieces flattened into one buffer, in order.
fn flat_pieces(mine: &[Tensor]) -> Result<Tensor> {
    let flat = mine
        .iter()
        .map(Tensor::flatten_all)
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok(Tensor::cat(&flat, 0)?)
}

/// Every rank's buffer (`all`, in rank order) cut into each parameter's
/// pieces: per parameter, every rank's piece.
fn split_pieces(all: &[Tensor], layouts: &[&ShardLayout]) -> Result<Vec<Vec<Tensor>>> {
    let mut offset = 0;
    let mut out = Vec::with_capacity(layouts.len());
    for layout in layouts {
        let n = layout.shard_elems();
        out.push(
            all.iter()
                .map(|buffer| buffer.narrow(0, offset, n))
                .collect::<candle_core::Result<Vec<_>>>()?,
        );
        offset += n;
    }
    Ok(out)
}

/// The whole variables of `pieces` (this rank's, each split by its
/// layout), put together from every rank's: all-gathered (one collective
/// per dtype, in the order the dtypes sort), or with a `root` gathered to
/// it alone (`None` elsewhere). Each rank's real rows are written into a
/// fresh whole variable in place: one copy of the whole. Every rank calls
/// it with the same parameters, in the same order.
pub(crate) fn gather_whole_vars(
    pg: &dyn ProcessGroup,
    pieces: &[&Var],
    layouts: &[&ShardLayout],
    root: Option<usize>,
) -> Result<Option<Vec<Var>>> {
    let mut wholes: Vec<Option<Var>> = vec![None; pieces.len()];
    let dtypes: BTreeSet<&str> = pieces.iter().map(|v| v.dtype().as_str()).collect();
    for dtype in dtypes {
        let members: Vec<usize> = (0..pieces.len())
            .filter(|&i| pieces[i].dtype().as_str() == dtype)
            .collect();
        let mine: Vec<Tensor> = members
            .iter()
            .map(|&i| pieces[i].as_detached_tensor())
            .collect();
        let group_layouts: Vec<&ShardLayout> = members.iter().map(|&i| layouts[i]).collect();
        let gathered = match root {
            None => all_gather_pieces(pg, &mine, &group_layouts)?,
            Some(root) => match gather_pieces(pg, &mine, &group_layouts, root)? {
                Some(gathered) => gathered,
                // Not the root: nothing to put together here.
                None => continue,
            },
        };
        pg.wait_for_device()?;
        for ((&i, layout), rank_pieces) in members.iter().zip(&group_layouts).zip(gathered) {
            let piece = pieces[i];
            let whole = Var::zeros(layout.dims.as_slice(), piece.dtype(), piece.device())?;
            for (rank, rank_piece) in rank_pieces.iter().enumerate() {
                layout.write_rows(&whole, rank_piece, rank)?;
            }
            wholes[i] = Some(whole);
        }
    }
    if root.is_some_and(|root| root != pg.rank()) {
        return Ok(None);
    }
    Ok(Some(wholes.into_iter().flatten().collect()))
}
