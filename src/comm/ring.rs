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
//! **Who reduces what.** In an all-reduce, rank `r` reduces chunk `r` into
//! one result buffer that all ranks fill together and then share
//! ([`SharedOutput`](super::shared_output::SharedOutput)): the data is read and written once in all. In a
//! reduce to one root, with two ranks the root reduces every chunk itself,
//! straight into its result (reading both inputs and writing once, where
//! splitting the work would add a copy of half the buffer); with more, rank
//! `r` reduces chunk `r` only and hands it (shared, not copied) to the
//! root, which copies it into its result: reading all `W` inputs for every
//! chunk would cost the root `W` reads of the buffer.
//!
//! **Lifetime.** A rank returns only once every other rank has sent it a
//! message after its last read of the inputs, so an input is never read
//! after its owner's call returned (and its owner could change it).
//!
//! The code is written against [`Link`], so it does not care how messages
//! travel; it needs every rank's input readable in its own process.

use std::mem::MaybeUninit;
use std::ops::Range;
use std::sync::Arc;

use candle_core::DType;

use super::buffer::{chunk_range, match_dtype, read_inputs, Buffer, Element, Input};
use super::combine::{
    combine_into, extend_combined, fill_combined, fill_combined_finished, finish,
};
use super::shared_output::{fill_copy, Complete, Filled};
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
/// the same `dtype` and length): each rank reduces its own chunk into one
/// result that they all share.
pub(crate) fn all_reduce(
    inputs: &[&Input],
    dtype: DType,
    op: ReduceOp,
    link: &impl Link,
) -> Result<Box<dyn Filled>> {
    match_dtype!(dtype, T => all_reduce_shared::<T>(inputs, op, link), _ => {
        Err(unsupported(dtype, link))
    })
}

fn all_reduce_shared<T: Element>(
    inputs: &[&Input],
    op: ReduceOp,
    link: &impl Link,
) -> Result<Box<dyn Filled>> {
    let (rank, world) = (link.rank(), link.world_size());
    let len = inputs[rank].len();
    // Rank 0's input is the same object on every rank, so is this.
    let output = inputs[0]
        .shared_output::<T>(len)
        .ok_or_else(|| link.unexpected(0, "a shared result of another type or length".into()))?;
    let range = chunk_range(len, world, rank);
    // SAFETY: each rank writes its own chunk; the chunks do not overlap.
    let chunk = unsafe { output.chunk_mut(range.clone()) };
    let mut written = 0;
    reduce_chunk(
        inputs,
        rank,
        link,
        write_into(op, world, chunk, &mut written),
    )?;
    if written != range.len() {
        let detail = format!("its chunk has {written} of {} elements", range.len());
        return Err(link.unexpected(rank, detail));
    }
    // Written and done reading: tell every other rank, and wait for theirs.
    done_reading(link, |_| None, false)?;
    // SAFETY: every rank wrote its chunk (the chunks tile the buffer) before
    // it sent its message, and has received all of them.
    Ok(Box::new(unsafe { Complete::new(output) }))
}

/// Reduce-scatter: this rank's `piece` (a range of the elements) of
/// [`all_reduce`]'s result, bitwise: each element reduced in the order of
/// the ring chunk it lies in. Each rank reads only its piece of every
/// input, so the ranks together read the buffer once per rank instead of
/// reducing it all.
pub(crate) fn reduce_scatter(
    inputs: &[&Input],
    dtype: DType,
    op: ReduceOp,
    piece: Range<usize>,
    link: &impl Link,
) -> Result<Buffer> {
    match_dtype!(dtype, T => reduce_piece::<T>(inputs, op, piece, link).map(T::into_buffer), _ => {
        Err(unsupported(dtype, link))
    })
}

fn reduce_piece<T: Element>(
    inputs: &[&Input],
    op: ReduceOp,
    piece: Range<usize>,
    link: &impl Link,
) -> Result<Vec<T>> {
    let (rank, world) = (link.rank(), link.world_size());
    let len = inputs[rank].len();
    if piece.end > len {
        let detail = format!("its piece {piece:?} lies beyond its {len} elements");
        return Err(link.unexpected(rank, detail));
    }
    let mut out = Vec::with_capacity(piece.len());
    for chunk in 0..world {
        let range = chunk_range(len, world, chunk);
        let at = piece.start.max(range.start)..piece.end.min(range.end);
        if !at.is_empty() {
            reduce_range(inputs, chunk, at, link, append_to(op, world, &mut out))?;
        }
    }
    // Done reading: no input may change before every rank is.
    done_reading(link, |_| None, false)?;
    Ok(out)
}

/// Reduce to `root`: bitwise the result of [`all_reduce`], on `root` only.
pub(crate) fn reduce(
    inputs: &[&Input],
    dtype: DType,
    op: ReduceOp,
    root: usize,
    link: &impl Link,
) -> Result<Option<Buffer>> {
    let reduced = match_dtype!(dtype, T => reduce_to_root::<T>(inputs, op, root, link)?.map(T::into_buffer), _ => {
        return Err(unsupported(dtype, link))
    });
    Ok(reduced)
}

/// The ranks agreed on the call, so their inputs were all valid.
fn unsupported(dtype: DType, link: &impl Link) -> CommError {
    link.unexpected(link.rank(), format!("unsupported dtype {}", dtype.as_str()))
}

/// The reduction, on `root` only (`Some` there).
fn reduce_to_root<T: Element>(
    inputs: &[&Input],
    op: ReduceOp,
    root: usize,
    link: &impl Link,
) -> Result<Option<Vec<T>>> {
    let (rank, world) = (link.rank(), link.world_size());
    let len = inputs[rank].len();

    // Everything that reads the inputs comes first.
    let reduce_all = world <= REDUCE_ALL_MAX_WORLD;
    let mut out = Vec::new();
    let mut mine = None;
    if reduce_all {
        if rank == root {
            out.reserve_exact(len);
            for chunk in 0..world {
                reduce_chunk(inputs, chunk, link, append_to(op, world, &mut out))?;
            }
        }
    } else {
        let mut values = Vec::with_capacity(chunk_range(len, world, rank).len());
        reduce_chunk(inputs, rank, link, append_to(op, world, &mut values))?;
        mine = Some(Arc::new(T::into_buffer(values)));
    }

    let send = |dst| mine.clone().filter(|_| dst == root);
    let mut chunks = done_reading(link, send, !reduce_all && rank == root)?;
    if rank != root {
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

/// Tells every other rank that this one is done with the inputs, handing
/// `dst` the chunk `data_for(dst)`, then waits for the same message from
/// each of them: carrying a chunk if `expects_chunks`, none otherwise.
/// Returns the chunks received, by sender.
fn done_reading(
    link: &impl Link,
    data_for: impl Fn(usize) -> Option<Arc<Buffer>>,
    expects_chunks: bool,
) -> Result<Vec<Option<Arc<Buffer>>>> {
    let (rank, world) = (link.rank(), link.world_size());
    let others = || (0..world).filter(move |&r| r != rank);
    for dst in others() {
        link.send(dst, data_for(dst))?;
    }
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
    Ok(chunks)
}

/// Reduces chunk `chunk` over every rank's input in the ring's order,
/// handing `emit` the inputs' elements block by block, in order (each block
/// one slice per rank, in reduction order). `emit` returns `false` if the
/// block does not fit where it goes, an error here.
fn reduce_chunk<T: Element>(
    inputs: &[&Input],
    chunk: usize,
    link: &impl Link,
    emit: impl FnMut(&[&[T]]) -> bool,
) -> Result<()> {
    let range = chunk_range(inputs[link.rank()].len(), inputs.len(), chunk);
    reduce_range(inputs, chunk, range, link, emit)
}

/// [`reduce_chunk`] of the elements `range` only, which lie in chunk
/// `chunk` (whose order they take).
fn reduce_range<T: Element>(
    inputs: &[&Input],
    chunk: usize,
    range: Range<usize>,
    link: &impl Link,
    mut emit: impl FnMut(&[&[T]]) -> bool,
) -> Result<()> {
    let world = inputs.len();
    // Ranks c+1, c+2, …, c.
    let order: Vec<&Input> = (1..=world).map(|k| inputs[(chunk + k) % world]).collect();
    let mut fits = true;
    read_inputs(&order, range, |xs: &[&[T]]| {
        let len = xs.first().map_or(0, |x| x.len());
        let mut blocks: Vec<&[T]> = Vec::with_capacity(xs.len());
        for start in (0..len).step_by(BLOCK) {
            let block = start..(start + BLOCK).min(len);
            blocks.clear();
            blocks.extend(xs.iter().map(|x| &x[block.clone()]));
            fits &= emit(&blocks);
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
    })?;
    if fits {
        Ok(())
    } else {
        Err(link.unexpected(
            link.rank(),
            "a reduced block does not fit its result".into(),
        ))
    }
}

/// An `emit` for [`reduce_chunk`] that appends each block, reduced, to `out`.
fn append_to<'a, T: Element>(
    op: ReduceOp,
    world: usize,
    out: &'a mut Vec<T>,
) -> impl FnMut(&[&[T]]) -> bool + 'a {
    move |xs| {
        let at = out.len();
        match xs {
            [first, second, rest @ ..] => {
                extend_combined(op, out, first, second);
                for x in rest {
                    combine_into(op, &mut out[at..], x);
                }
            }
            [only] => out.extend_from_slice(only),
            [] => {}
        }
        finish(op, &mut out[at..], world);
        true
    }
}

/// An `emit` for [`reduce_chunk`] that writes each block, reduced, into
/// `out` from its start on, counting the elements in `written`.
fn write_into<'a, T: Element>(
    op: ReduceOp,
    world: usize,
    out: &'a mut [MaybeUninit<T>],
    written: &'a mut usize,
) -> impl FnMut(&[&[T]]) -> bool + 'a {
    move |xs| {
        let len = xs.first().map_or(0, |x| x.len());
        let Some(dst) = out.get_mut(*written..*written + len) else {
            return false;
        };
        let (values, finished) = match xs {
            // Two ranks: the division in the same pass (the same operations).
            [first, second] if op == ReduceOp::Avg => {
                (fill_combined_finished(dst, first, second, world), true)
            }
            [first, second, ..] => (fill_combined(op, dst, first, second), false),
            [only] => (fill_copy(dst, only), false),
            [] => (Some(&mut [][..]), false),
        };
        let Some(values) = values else {
            return false;
        };
        for x in xs.iter().skip(2) {
            combine_into(op, values, x);
        }
        if !finished {
            finish(op, values, world);
        }
        *written += len;
        true
    }
}
