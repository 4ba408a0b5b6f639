//! Large reductions between the thread ranks of one process: the ring
//! algorithm's chunks and reduction order (NCCL's), computed in shared
//! memory.
//!
//! The buffer is split into `W` chunks, chunk `c` holding the elements
//! [`chunk_range`]`(n, W, c)`. On a network, a ring passes each chunk's
//! partial result from rank to rank; in one process, every rank can read
//! every rank's input directly (tensors in place, see [`Input`]), so the
//! partial results need not travel, and the ring's reduction order is kept
//! without its copies.
//!
//! **Reduction order.** An element of chunk `c` is reduced as
//! `((x_{c+1} ⊕ x_{c+2}) ⊕ …) ⊕ x_c` (indices mod `W`), the order in which a
//! ring would visit the ranks, then divided by `W` for `Avg`. The order
//! depends only on `W`, `n` and the element's index, never on timing or on
//! which rank computes it, so all ranks get bitwise the same result.
//!
//! **Who reduces what.** With two ranks, each rank that wants the result
//! reduces every chunk itself, straight into its result: that reads both
//! inputs and writes the result once, about the cost of a memcpy, where
//! splitting the work would add a copy of half the buffer. With more ranks,
//! rank `r` reduces chunk `r` only and hands it (shared, not copied) to the
//! ranks that want it, which copy it into their result: reading all `W`
//! inputs for every chunk would cost each rank `W` reads of the buffer.
//!
//! **Lifetime.** A rank returns only once every other rank has sent it a
//! message after its last read of the inputs, so an input is never read
//! after its owner's call returned (and its owner could change it).
//!
//! The code is written against [`Link`], so it does not care how messages
//! travel; it needs every rank's input readable in its own process.

use std::sync::Arc;

use candle_core::DType;

use super::buffer::{
    chunk_range, combine_into, extend_combined, finish, match_dtype, read_inputs, Buffer, Element,
    Input,
};
use super::{CommError, ReduceOp, Result};

/// Up to this many ranks, each rank reduces every chunk it wants itself.
const REDUCE_ALL_MAX_WORLD: usize = 2;

/// Elements reduced at a time, so that with more than two ranks the partial
/// results stay in cache between ranks.
const BLOCK: usize = 4096;

/// Messaging between the ranks of one collective call.
pub(crate) trait Link {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Tells `dst` that this rank is done reading the inputs, handing it
    /// this rank's reduced chunk if it wants it.
    fn send(&self, dst: usize, chunk: Option<Arc<Buffer>>) -> Result<()>;
    /// The message [`send`](Link::send) sent from `src` to this rank.
    fn recv(&self, src: usize) -> Result<Option<Arc<Buffer>>>;
    /// The error for data from `src` that does not fit the algorithm (the
    /// ranks are out of step); the group is failed.
    fn unexpected(&self, src: usize, detail: String) -> CommError;
}

/// All-reduce of every rank's input (`inputs[r]` is rank `r`'s; all have
/// the same `dtype` and length).
pub(crate) fn all_reduce(
    inputs: &[&Input],
    dtype: DType,
    op: ReduceOp,
    link: &impl Link,
) -> Result<Buffer> {
    let all = |_| true;
    let reduced = match_dtype!(dtype, T => reduce_for::<T>(inputs, op, all, link)?.map(T::into_buffer), _ => {
        return Err(unsupported(dtype, link))
    });
    reduced.ok_or_else(|| link.unexpected(link.rank(), "no result".into()))
}

/// Reduce to `root`: bitwise the result of [`all_reduce`], on `root` only.
pub(crate) fn reduce(
    inputs: &[&Input],
    dtype: DType,
    op: ReduceOp,
    root: usize,
    link: &impl Link,
) -> Result<Option<Buffer>> {
    let root_only = |rank| rank == root;
    let reduced = match_dtype!(dtype, T => reduce_for::<T>(inputs, op, root_only, link)?.map(T::into_buffer), _ => {
        return Err(unsupported(dtype, link))
    });
    Ok(reduced)
}

/// The ranks agreed on the call, so their inputs were all valid.
fn unsupported(dtype: DType, link: &impl Link) -> CommError {
    link.unexpected(link.rank(), format!("unsupported dtype {}", dtype.as_str()))
}

/// The reduction, for the ranks `wants` the result on (`Some` on those).
fn reduce_for<T: Element>(
    inputs: &[&Input],
    op: ReduceOp,
    wants: impl Fn(usize) -> bool,
    link: &impl Link,
) -> Result<Option<Vec<T>>> {
    let (rank, world) = (link.rank(), link.world_size());
    let len = inputs[rank].len();
    let others = || (0..world).filter(move |&r| r != rank);

    // Everything that reads the inputs comes first.
    let reduce_all = world <= REDUCE_ALL_MAX_WORLD;
    let mut out = Vec::new();
    let mut mine = None;
    if reduce_all {
        if wants(rank) {
            out.reserve_exact(len);
            for chunk in 0..world {
                reduce_chunk(inputs, chunk, op, &mut out, link)?;
            }
        }
    } else {
        let mut values = Vec::with_capacity(chunk_range(len, world, rank).len());
        reduce_chunk(inputs, rank, op, &mut values, link)?;
        mine = Some(Arc::new(T::into_buffer(values)));
    }

    // Then every rank tells every other one that it is done reading.
    for dst in others() {
        link.send(dst, mine.clone().filter(|_| wants(dst)))?;
    }
    let expects_chunks = !reduce_all && wants(rank);
    let mut chunks: Vec<Option<Arc<Buffer>>> = vec![None; world];
    for src in others() {
        let chunk = link.recv(src)?;
        if chunk.is_some() != expects_chunks {
            let detail = if expects_chunks {
                "no data where its chunk was expected"
            } else {
                "data where none was expected"
            };
            return Err(link.unexpected(src, detail.into()));
        }
        chunks[src] = chunk;
    }
    if !wants(rank) {
        return Ok(None);
    }
    if reduce_all {
        return Ok(Some(out));
    }

    // Each chunk from its owner, copied once, into the result.
    chunks[rank] = mine;
    out.reserve_exact(len);
    for (chunk, data) in chunks.iter().enumerate() {
        let expected = chunk_range(len, world, chunk).len();
        let values = data
            .as_deref()
            .and_then(T::slice_of)
            .filter(|values| values.len() == expected)
            .ok_or_else(|| {
                let detail = format!(
                    "its chunk {chunk} is not {expected} {} elements",
                    T::DTYPE.as_str()
                );
                link.unexpected(chunk, detail)
            })?;
        out.extend_from_slice(values);
    }
    Ok(Some(out))
}

/// Appends chunk `chunk`, reduced over every rank's input in the ring's
/// order, to `out`.
fn reduce_chunk<T: Element>(
    inputs: &[&Input],
    chunk: usize,
    op: ReduceOp,
    out: &mut Vec<T>,
    link: &impl Link,
) -> Result<()> {
    let world = inputs.len();
    // Ranks c+1, c+2, …, c.
    let order: Vec<&Input> = (1..=world).map(|k| inputs[(chunk + k) % world]).collect();
    let range = chunk_range(inputs[link.rank()].len(), world, chunk);
    read_inputs(&order, range, |xs: &[&[T]]| {
        let len = xs.first().map_or(0, |x| x.len());
        for start in (0..len).step_by(BLOCK) {
            let block = start..(start + BLOCK).min(len);
            let at = out.len();
            match xs {
                [first, second, rest @ ..] => {
                    extend_combined(op, out, &first[block.clone()], &second[block.clone()]);
                    for x in rest {
                        combine_into(op, &mut out[at..], &x[block.clone()]);
                    }
                }
                [only] => out.extend_from_slice(&only[block]),
                [] => {}
            }
            finish(op, &mut out[at..], world);
        }
    })
    .map_err(|i| {
        let src = (chunk + 1 + i) % world;
        let detail = format!(
            "its input is not {} {} elements",
            inputs[link.rank()].len(),
            T::DTYPE.as_str()
        );
        link.unexpected(src, detail)
    })
}
