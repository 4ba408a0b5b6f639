//! The ring algorithm for large reductions (the one NCCL uses): a
//! reduce-scatter followed by an all-gather, over `world_size` chunks.
//!
//! Each rank only talks to its ring neighbours, and each sends and receives
//! `2 (W-1)/W` of the buffer in total whatever the world size `W`, which
//! is the least any all-reduce can move (bandwidth-optimal), against `W-1`
//! whole buffers for a rank that receives everyone's data directly.
//!
//! **Reduction order.** Chunk `c` (elements [`chunk_range`]`(n, W, c)`)
//! starts on rank `c+1` and travels once around the ring, each rank
//! combining its own values into the partial result it received, so it ends
//! on rank `c`, its owner, as `((x_{c+1} ⊕ x_{c+2}) ⊕ …) ⊕ x_c` (indices mod
//! `W`). The order thus depends only on `W`, `n` and the element's index,
//! never on timing. The owner applies `Avg`'s division, then the all-gather
//! hands every rank the owner's bytes, so all ranks get bitwise the same
//! result.
//!
//! The code is written against [`Link`], so it does not care how messages
//! travel.

use std::sync::Arc;

use super::buffer::{chunk_range, combine_into, finish, Buffer, Element};
use super::{CommError, ReduceOp, Result};

/// Point-to-point messaging between the ranks of one collective call.
pub(crate) trait Link {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    fn send(&self, dst: usize, data: Arc<Buffer>) -> Result<()>;
    fn recv(&self, src: usize) -> Result<Arc<Buffer>>;
    /// The error for data from `src` that does not fit the algorithm (the
    /// ranks are out of step); the group is failed.
    fn unexpected(&self, src: usize, detail: String) -> CommError;
}

/// All-reduce of `own` (every rank's buffer has the same length).
pub(crate) fn all_reduce<T: Element>(own: &[T], op: ReduceOp, link: &impl Link) -> Result<Vec<T>> {
    let mine = reduce_scatter(own, op, link)?;
    all_gather(mine, own.len(), link)
}

/// Reduce of `own` to `root`: the same reduce-scatter as [`all_reduce`] (so
/// bitwise the same result), then each owner sends its chunk to `root`.
pub(crate) fn reduce<T: Element>(
    own: &[T],
    op: ReduceOp,
    root: usize,
    link: &impl Link,
) -> Result<Option<Vec<T>>> {
    let (rank, world) = (link.rank(), link.world_size());
    let mine = reduce_scatter(own, op, link)?;
    if rank != root {
        link.send(root, Arc::new(T::into_buffer(mine)))?;
        return Ok(None);
    }
    let mut out = Vec::with_capacity(own.len());
    for chunk in 0..world {
        if chunk == rank {
            out.extend_from_slice(&mine);
        } else {
            let len = chunk_range(own.len(), world, chunk).len();
            out.extend_from_slice(&recv_owned::<T>(link, chunk, chunk, len)?);
        }
    }
    Ok(Some(out))
}

/// Returns this rank's chunk, reduced over all ranks (and divided, for `Avg`).
fn reduce_scatter<T: Element>(own: &[T], op: ReduceOp, link: &impl Link) -> Result<Vec<T>> {
    let (rank, world) = (link.rank(), link.world_size());
    let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
    let range = |chunk| chunk_range(own.len(), world, chunk);
    // This rank starts the chunk of the rank before it, which then travels
    // W-1 hops and ends, complete, on that rank.
    let mut outgoing = own[range(prev)].to_vec();
    for step in 1..world {
        link.send(next, Arc::new(T::into_buffer(outgoing)))?;
        // The chunk `prev` started `step - 1` hops ago.
        let chunk = (rank + 2 * world - 1 - step) % world;
        let mut partial = recv_owned::<T>(link, prev, chunk, range(chunk).len())?;
        combine_into(op, &mut partial, &own[range(chunk)]);
        outgoing = partial;
    }
    // After W-1 steps the chunk received last is this rank's own.
    finish(op, &mut outgoing, world);
    Ok(outgoing)
}

/// Every rank's `mine` chunk, concatenated in chunk order.
fn all_gather<T: Element>(mine: Vec<T>, len: usize, link: &impl Link) -> Result<Vec<T>> {
    let (rank, world) = (link.rank(), link.world_size());
    let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
    // Chunks are forwarded as shared pointers: in-process, a hop costs no
    // copy, and each rank copies each chunk once, into its result.
    let mut chunks: Vec<Option<Arc<Buffer>>> = vec![None; world];
    let mut outgoing = Arc::new(T::into_buffer(mine));
    chunks[rank] = Some(Arc::clone(&outgoing));
    for step in 1..world {
        link.send(next, outgoing)?;
        let received = link.recv(prev)?;
        chunks[(rank + world - step) % world] = Some(Arc::clone(&received));
        outgoing = received;
    }
    let mut out = Vec::with_capacity(len);
    for (chunk, data) in chunks.iter().enumerate() {
        let expected = chunk_range(len, world, chunk).len();
        let values = data
            .as_deref()
            .and_then(T::slice_of)
            .filter(|values| values.len() == expected)
            .ok_or_else(|| link.unexpected(prev, wrong_data::<T>("all-gather", chunk, expected)))?;
        out.extend_from_slice(values);
    }
    Ok(out)
}

/// Receives a partial chunk to reduce into; it arrives unshared, so taking
/// it out of its `Arc` costs no copy.
fn recv_owned<T: Element>(
    link: &impl Link,
    src: usize,
    chunk: usize,
    expected: usize,
) -> Result<Vec<T>> {
    let shared = link.recv(src)?;
    let buffer = Arc::try_unwrap(shared).unwrap_or_else(|shared| (*shared).clone());
    T::from_buffer(buffer)
        .filter(|values| values.len() == expected)
        .ok_or_else(|| link.unexpected(src, wrong_data::<T>("reduce-scatter", chunk, expected)))
}

fn wrong_data<T: Element>(phase: &str, chunk: usize, expected: usize) -> String {
    format!(
        "{phase} data for chunk {chunk} is not {expected} {} elements",
        T::DTYPE.as_str()
    )
}
