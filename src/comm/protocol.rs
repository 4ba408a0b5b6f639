//! The messages ranks exchange, and the check that makes every rank agree on
//! whether a collective can go ahead.
//!
//! Every collective starts with a header exchange: each rank sends every
//! other rank a [`Header`] saying which collective it called, with what
//! dtype and shape, and whether its input is usable. Every rank then holds
//! the same set of signatures and [`check`] computes the same verdict from
//! them, so a mismatch gives the same error on every rank instead of a hang
//! or a garbled result. Small payloads ride along with the header, so a
//! small collective costs one message per pair of ranks.

use std::fmt;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use super::buffer::{Buffer, Input};
use super::op::Op;
use super::{CommError, ReduceOp, Result};

/// Which collective a rank called, with the arguments all ranks must agree on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) enum OpSig {
    AllReduce(ReduceOp),
    Broadcast {
        root: usize,
    },
    AllGather,
    Gather {
        root: usize,
    },
    Scatter {
        root: usize,
    },
    Reduce {
        root: usize,
        op: ReduceOp,
    },
    Barrier,
    AllGatherBytes,
    /// Not a collective: a point-to-point message's signature.
    Send,
    /// Not a collective: the signature of a wait for one.
    Recv,
}

impl OpSig {
    /// The collective called.
    pub(crate) fn op(self) -> Op {
        match self {
            OpSig::AllReduce(_) => Op::AllReduce,
            OpSig::Broadcast { .. } => Op::Broadcast,
            OpSig::AllGather => Op::AllGather,
            OpSig::Gather { .. } => Op::Gather,
            OpSig::Scatter { .. } => Op::Scatter,
            OpSig::Reduce { .. } => Op::Reduce,
            OpSig::Barrier => Op::Barrier,
            OpSig::AllGatherBytes => Op::AllGatherBytes,
            OpSig::Send => Op::Send,
            OpSig::Recv => Op::Recv,
        }
    }

    /// The collective's name, as in error messages.
    pub(crate) fn name(self) -> &'static str {
        self.op().as_str()
    }

    /// The name of the collective called `name` as a `&'static str` (for
    /// failures received from another process); an unknown name gives
    /// "a collective".
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn static_name(name: &str) -> &'static str {
        Op::from_name(name).map_or("a collective", Op::as_str)
    }

    fn root(self) -> Option<usize> {
        match self {
            OpSig::Broadcast { root }
            | OpSig::Gather { root }
            | OpSig::Scatter { root }
            | OpSig::Reduce { root, .. } => Some(root),
            _ => None,
        }
    }
}

impl fmt::Display for OpSig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OpSig::AllReduce(op) => write!(f, "all_reduce({op})"),
            OpSig::Reduce { root, op } => write!(f, "reduce({op}, root={root})"),
            other => match other.root() {
                Some(root) => write!(f, "{}(root={root})", other.name()),
                None => write!(f, "{}", other.name()),
            },
        }
    }
}

/// The dtype and shape of a rank's input tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TensorMeta {
    pub(crate) dtype: DType,
    pub(crate) dims: Vec<usize>,
}

impl TensorMeta {
    /// `tensor`'s dtype and shape.
    pub(crate) fn of(tensor: &Tensor) -> TensorMeta {
        TensorMeta {
            dtype: tensor.dtype(),
            dims: tensor.dims().to_vec(),
        }
    }
}

impl fmt::Display for TensorMeta {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {:?}", self.dtype.as_str(), self.dims)
    }
}

/// What a rank tells every other rank about its call; identical for every
/// destination.
#[derive(Debug, Clone)]
pub(crate) struct Signature {
    pub(crate) op: OpSig,
    /// The input tensor's dtype and shape, for collectives whose tensors
    /// must match across ranks; `None` otherwise.
    pub(crate) meta: Option<TensorMeta>,
    /// Why this rank's input cannot be used, if it cannot.
    pub(crate) invalid: Option<String>,
}

/// Tensor data sent along with a header.
#[derive(Debug, Clone)]
pub(crate) struct Piece {
    /// Shared, not copied, when the same data goes to several ranks.
    pub(crate) data: Arc<Buffer>,
    pub(crate) dims: Vec<usize>,
    /// Where the receiver should put it, for scatter.
    pub(crate) device: Device,
}

/// The first message of every collective.
#[derive(Debug)]
pub(crate) struct Header {
    pub(crate) sig: Signature,
    /// The data this destination needs from the sender, if the collective
    /// sends it in one step.
    pub(crate) payload: Option<Piece>,
    /// The sender's input to a large reduction, which every rank reads.
    pub(crate) input: Option<Input>,
}

/// A message, tagged with the sender's collective count so that a message
/// from another collective is detected, never misused.
#[derive(Debug)]
pub(crate) struct Envelope {
    pub(crate) seq: u64,
    pub(crate) body: Body,
}

#[derive(Debug)]
pub(crate) enum Body {
    Header(Box<Header>),
    /// A large reduction's second message (see [`ring`](super::ring)):
    /// the sender's reduced chunk, or `None` when the receiver gets none.
    Data(Option<Arc<Buffer>>),
}

/// Whether a reduction of `bytes` bytes takes the ring path. It depends
/// only on the size and group-wide settings, so all ranks agree once their
/// shapes and dtypes do.
pub(crate) fn takes_ring(bytes: usize, world_size: usize, ring_threshold_bytes: usize) -> bool {
    world_size > 1 && bytes >= ring_threshold_bytes
}

/// The bytes of `tensor`'s elements.
pub(crate) fn tensor_bytes(tensor: &Tensor) -> usize {
    tensor
        .elem_count()
        .saturating_mul(tensor.dtype().size_in_bytes())
}

/// Why `root` cannot be used in a group of `world_size` ranks, if it cannot.
pub(crate) fn root_error(root: usize, world_size: usize) -> Option<String> {
    (root >= world_size).then(|| format!("root {root} is out of range for world size {world_size}"))
}

/// Refuses `peer` as the other end of `rank`'s message (`op`) in a group
/// of `world_size`: outside the group, or itself.
pub(crate) fn check_peer(op: Op, peer: usize, rank: usize, world_size: usize) -> Result<()> {
    let reason = if peer >= world_size {
        format!("rank {peer} is not in a group of {world_size}")
    } else if peer == rank {
        "a rank cannot send to or receive from itself".to_string()
    } else {
        return Ok(());
    };
    Err(CommError::InvalidInput {
        rank,
        op: op.as_str(),
        culprit: rank,
        reason,
    })
}

/// The message of a `recv` that got another dtype or shape than it
/// expected: the two ranks are out of step.
pub(crate) fn message_mismatch(
    src: usize,
    sent: &TensorMeta,
    rank: usize,
    wanted: &TensorMeta,
) -> String {
    format!(
        "rank {src} sent {} {:?}, rank {rank} expected {} {:?}",
        sent.dtype.as_str(),
        sent.dims,
        wanted.dtype.as_str(),
        wanted.dims
    )
}

/// The parts `rank` scatters from `root` (none unless it is the root), each
/// made from its tensor by `part`, or why the root's argument cannot be
/// used.
pub(crate) fn scatter_parts<P>(
    tensors: Option<&[Tensor]>,
    rank: usize,
    root: usize,
    world_size: usize,
    mut part: impl FnMut(&Tensor) -> std::result::Result<P, String>,
) -> std::result::Result<Vec<P>, String> {
    scatter_tensors(tensors, rank, root, world_size).and_then(|tensors| {
        tensors
            .iter()
            .enumerate()
            .map(|(i, t)| part(t).map_err(|e| format!("tensor {i}: {e}")))
            .collect()
    })
}

/// The tensors `rank` scatters from `root` (none unless it is the root), or
/// why the root's argument cannot be used.
fn scatter_tensors(
    tensors: Option<&[Tensor]>,
    rank: usize,
    root: usize,
    world_size: usize,
) -> std::result::Result<&[Tensor], String> {
    match tensors {
        _ if rank != root => Ok(&[]),
        None => Err("the root passed no tensors".into()),
        Some(tensors) if tensors.len() != world_size => Err(format!(
            "the root passed {} tensors for {world_size} ranks",
            tensors.len()
        )),
        Some(tensors) => Ok(tensors),
    }
}

/// The verdict on a collective, computed identically on every rank from
/// every rank's signature (`sigs[r]` is rank `r`'s), so that all ranks
/// return the same error or all go ahead. `rank` is the rank computing it,
/// for the error message.
pub(crate) fn check(sigs: &[&Signature], rank: usize, op: &'static str) -> Result<()> {
    let (ranks, detail) = differing(sigs.iter().map(|s| s.op));
    if !ranks.is_empty() {
        return Err(CommError::OpMismatch {
            rank,
            op,
            ranks,
            detail,
        });
    }
    if let Some((culprit, reason)) = sigs
        .iter()
        .enumerate()
        .find_map(|(r, s)| s.invalid.as_ref().map(|reason| (r, reason.clone())))
    {
        return Err(CommError::InvalidInput {
            rank,
            op,
            culprit,
            reason,
        });
    }
    let (ranks, detail) = differing(sigs.iter().map(|s| MetaLabel(s.meta.as_ref())));
    if !ranks.is_empty() {
        return Err(CommError::TensorMismatch {
            rank,
            op,
            ranks,
            detail,
        });
    }
    Ok(())
}

/// The ranks whose value differs from rank 0's, and a description of who has
/// what: `rank(s) [0, 1]: f32 [3]; rank(s) [2]: f32 [4]`.
fn differing<T: PartialEq + fmt::Display>(values: impl Iterator<Item = T>) -> (Vec<usize>, String) {
    let mut groups: Vec<(T, Vec<usize>)> = Vec::new();
    for (rank, value) in values.enumerate() {
        match groups.iter_mut().find(|(v, _)| *v == value) {
            Some((_, ranks)) => ranks.push(rank),
            None => groups.push((value, vec![rank])),
        }
    }
    if groups.len() <= 1 {
        return (Vec::new(), String::new());
    }
    let ranks = groups[1..]
        .iter()
        .flat_map(|(_, r)| r.iter().copied())
        .collect();
    let detail = groups
        .iter()
        .map(|(value, ranks)| format!("rank(s) {ranks:?}: {value}"))
        .collect::<Vec<_>>()
        .join("; ");
    (ranks, detail)
}

#[derive(PartialEq)]
struct MetaLabel<'a>(Option<&'a TensorMeta>);

impl fmt::Display for MetaLabel<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(meta) => meta.fmt(f),
            None => f.write_str("no tensor"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sig(op: OpSig, dims: &[usize], invalid: Option<&str>) -> Signature {
        Signature {
            op,
            meta: Some(TensorMeta {
                dtype: DType::F32,
                dims: dims.to_vec(),
            }),
            invalid: invalid.map(str::to_string),
        }
    }

    #[test]
    fn check_names_the_ranks_whose_shape_differs_from_rank_0() {
        let a = sig(OpSig::AllGather, &[3], None);
        let b = sig(OpSig::AllGather, &[4], None);
        let err = check(&[&a, &a, &b], 1, "all_gather").unwrap_err();
        match err {
            CommError::TensorMismatch {
                rank,
                ranks,
                detail,
                ..
            } => {
                assert_eq!(rank, 1);
                assert_eq!(ranks, vec![2]);
                assert_eq!(detail, "rank(s) [0, 1]: f32 [3]; rank(s) [2]: f32 [4]");
            }
            other => panic!("unexpected {other}"),
        }
    }

    #[test]
    fn check_reports_a_different_collective_before_invalid_input() {
        let a = sig(OpSig::Broadcast { root: 0 }, &[1], Some("bad"));
        let b = sig(OpSig::Broadcast { root: 1 }, &[1], None);
        let err = check(&[&a, &b], 0, "broadcast").unwrap_err().to_string();
        assert_eq!(
            err,
            "rank 0: broadcast: the ranks called different collectives: \
             rank(s) [0]: broadcast(root=0); rank(s) [1]: broadcast(root=1)"
        );
    }

    #[test]
    fn check_reports_the_lowest_rank_with_invalid_input() {
        let ok = sig(OpSig::Barrier, &[1], None);
        let bad = sig(OpSig::Barrier, &[1], Some("root 9 is out of range"));
        let err = check(&[&ok, &bad, &bad], 0, "barrier").unwrap_err();
        assert!(matches!(err, CommError::InvalidInput { culprit: 1, .. }));
    }
}
