//! The collectives of a [`ThreadRank`]: [`ProcessGroup`] on the call layer
//! ([`Call`]), the ring for large reductions.

use std::sync::Arc;

use candle_core::Tensor;

use super::call::Call;
use super::group::ThreadRank;
use crate::comm::buffer::{Buffer, Input};
use crate::comm::combine::reduce_in_rank_order;
use crate::comm::op::Op;
use crate::comm::protocol::{self, Header, OpSig, Piece, Signature, TensorMeta};
use crate::comm::ring::{self, Link};
use crate::comm::{
    all_reduce_concat_copied, concat_flat, shards, Color, CommError, Failure, FailureCause,
    Membership, ProcessGroup, ReduceOp, Result, SubGroup,
};

impl ThreadRank {
    /// Whether a reduction of `tensor` takes the ring path.
    fn uses_ring(&self, tensor: &Tensor) -> bool {
        protocol::takes_ring(
            protocol::tensor_bytes(tensor),
            self.world_size(),
            self.shared.ring_threshold_bytes,
        )
    }

    fn root_error(&self, root: usize) -> Option<String> {
        protocol::root_error(root, self.world_size())
    }

    /// The first half of `gather` and `reduce`: every rank sends its copy of
    /// `tensor` to `root` with the call's header. The root gets every
    /// rank's header back, the other ranks `None` (they are done).
    fn send_to_root(
        &self,
        call: &Call<'_>,
        op: OpSig,
        tensor: &Tensor,
        root: usize,
    ) -> Result<Option<Vec<Header>>> {
        let local = local_copy(tensor);
        let sig = Signature {
            op,
            meta: meta(tensor),
            invalid: self.root_error(root).or(local.as_ref().err().cloned()),
        };
        let headers = call.exchange(sig, |dst| match &local {
            Ok(data) if dst == root => Some(piece(data, tensor)),
            _ => None,
        })?;
        Ok((self.rank() == root).then_some(headers))
    }
}

impl ThreadRank {
    /// A collective of a group of one rank: its result is this rank's own
    /// values (an average divides by one), copied where they lie, so that
    /// a tensor on a GPU never passes through host memory. The barrier
    /// reports a failed group as the collective would.
    fn alone(&self, op: &'static str, tensor: &Tensor) -> Result<Tensor> {
        self.barrier()?;
        tensor
            .copy()
            .map(|t| t.detach())
            .map_err(|source| CommError::Tensor {
                rank: self.rank(),
                op,
                source,
            })
    }
}

/// A tensor's host copy, shared between the messages that carry it; the
/// error says why the tensor cannot be sent.
type Local = std::result::Result<Arc<Buffer>, String>;

fn local_copy(tensor: &Tensor) -> Local {
    Buffer::from_tensor(tensor).map(Arc::new)
}

fn meta(tensor: &Tensor) -> Option<TensorMeta> {
    Some(TensorMeta::of(tensor))
}

fn piece(data: &Arc<Buffer>, tensor: &Tensor) -> Piece {
    Piece {
        data: Arc::clone(data),
        dims: tensor.dims().to_vec(),
        device: tensor.device().clone(),
    }
}

impl ProcessGroup for ThreadRank {
    fn membership(&self) -> &Membership {
        &self.membership
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
        if self.world_size() == 1 {
            return self.alone("all_reduce", tensor);
        }
        let call = self.begin(Op::AllReduce)?;
        if self.uses_ring(tensor) {
            let headers = call.exchange_inputs(tensor, OpSig::AllReduce(op), None)?;
            let inputs = call.inputs(&headers)?;
            return ring::all_reduce(&inputs, tensor.dtype(), op, &call)?
                .to_tensor(tensor.dims(), tensor.device())
                .map_err(|e| call.tensor_error(e));
        }
        // Small buffers go to every rank with the header.
        let local = local_copy(tensor);
        let sig = Signature {
            op: OpSig::AllReduce(op),
            meta: meta(tensor),
            invalid: local.as_ref().err().cloned(),
        };
        let headers = call.exchange(sig, |_| local.as_ref().ok().map(|d| piece(d, tensor)))?;
        reduce_in_rank_order(&call.payloads(&headers)?, op)
            .ok_or_else(|| call.unexpected(0, "buffers of different types".into()))?
            .into_tensor(tensor.dims(), tensor.device())
            .map_err(|e| call.tensor_error(e))
    }

    fn all_reduce_concat(&self, tensors: &[Tensor], op: ReduceOp) -> Result<Tensor> {
        let Some(first) = tensors.first() else {
            return all_reduce_concat_copied(self, tensors, op);
        };
        if self.world_size() == 1 {
            let flat = concat_flat(self, tensors)?;
            return match tensors.len() {
                // `cat` of one tensor is that tensor: `alone` copies it.
                1 => self.alone("all_reduce_concat", &flat),
                // A fresh concatenation already.
                _ => self.barrier().map(|()| flat.detach()),
            };
        }
        let len: usize = tensors.iter().map(Tensor::elem_count).sum();
        let bytes = len.saturating_mul(first.dtype().size_in_bytes());
        if bytes < self.shared.ring_threshold_bytes {
            return all_reduce_concat_copied(self, tensors, op);
        }
        // The ring, as `all_reduce` runs it on the concatenation, reading
        // every part in place.
        let call = self.begin(Op::AllReduce)?;
        let input = Input::concat(tensors, first.dtype());
        let sig = Signature {
            op: OpSig::AllReduce(op),
            meta: Some(TensorMeta {
                dtype: first.dtype(),
                dims: vec![len],
            }),
            invalid: input.as_ref().err().cloned(),
        };
        let headers = call.exchange_with_input(sig, |_| None, input.as_ref().ok())?;
        let inputs = call.inputs(&headers)?;
        ring::all_reduce(&inputs, first.dtype(), op, &call)?
            .to_tensor(&[len], first.device())
            .map_err(|e| call.tensor_error(e))
    }

    /// Below the ring threshold, the all-reduce (its rank order). Above
    /// it, each rank reduces only its piece, read from every rank's input
    /// in the ring's order: the same bytes as the all-reduce's slice, for
    /// `1/W` of its work.
    fn reduce_scatter(&self, tensor: &Tensor, op: ReduceOp, counts: &[usize]) -> Result<Tensor> {
        if !self.uses_ring(tensor) {
            return shards::reduce_scatter_by_all_reduce(self, tensor, op, counts);
        }
        let piece = shards::agree_on_split(self, tensor, counts)?;
        // Flat, as the MPI group's: ranks agree on the elements, not a shape.
        let tensor = &tensor.flatten_all().map_err(|source| CommError::Tensor {
            rank: self.rank(),
            op: "reduce_scatter",
            source,
        })?;
        let call = self.begin(Op::AllReduce)?;
        let headers = call.exchange_inputs(tensor, OpSig::AllReduce(op), None)?;
        let inputs = call.inputs(&headers)?;
        let len = piece.len();
        ring::reduce_scatter(&inputs, tensor.dtype(), op, piece, &call)?
            .into_tensor(&[len], tensor.device())
            .map_err(|e| call.tensor_error(e))
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Tensor> {
        if self.world_size() == 1 && root == 0 {
            return self.alone("broadcast", tensor);
        }
        let call = self.begin(Op::Broadcast)?;
        let local = (self.rank() == root).then(|| local_copy(tensor));
        let sig = Signature {
            op: OpSig::Broadcast { root },
            meta: meta(tensor),
            invalid: self
                .root_error(root)
                .or_else(|| local.as_ref().and_then(|l| l.as_ref().err().cloned())),
        };
        let headers = call.exchange(sig, |_| match &local {
            Some(Ok(data)) => Some(piece(data, tensor)),
            _ => None,
        })?;
        call.payload(&headers, root)?
            .data
            .to_tensor(tensor.dims(), tensor.device())
            .map_err(|e| call.tensor_error(e))
    }

    fn all_gather(&self, tensor: &Tensor) -> Result<Vec<Tensor>> {
        if self.world_size() == 1 {
            return Ok(vec![self.alone("all_gather", tensor)?]);
        }
        let call = self.begin(Op::AllGather)?;
        let local = local_copy(tensor);
        let sig = Signature {
            op: OpSig::AllGather,
            meta: meta(tensor),
            invalid: local.as_ref().err().cloned(),
        };
        let headers = call.exchange(sig, |_| local.as_ref().ok().map(|d| piece(d, tensor)))?;
        call.payloads(&headers)?
            .into_iter()
            .map(|data| data.to_tensor(tensor.dims(), tensor.device()))
            .collect::<candle_core::Result<_>>()
            .map_err(|e| call.tensor_error(e))
    }

    fn gather(&self, tensor: &Tensor, root: usize) -> Result<Option<Vec<Tensor>>> {
        let call = self.begin(Op::Gather)?;
        let Some(headers) = self.send_to_root(&call, OpSig::Gather { root }, tensor, root)? else {
            return Ok(None);
        };
        call.payloads(&headers)?
            .into_iter()
            .map(|data| data.to_tensor(tensor.dims(), tensor.device()))
            .collect::<candle_core::Result<_>>()
            .map(Some)
            .map_err(|e| call.tensor_error(e))
    }

    fn scatter(&self, tensors: Option<&[Tensor]>, root: usize) -> Result<Tensor> {
        let call = self.begin(Op::Scatter)?;
        let pieces = protocol::scatter_parts(tensors, self.rank(), root, self.world_size(), |t| {
            local_copy(t).map(|data| piece(&data, t))
        });
        let sig = Signature {
            op: OpSig::Scatter { root },
            meta: None,
            invalid: self.root_error(root).or(pieces.as_ref().err().cloned()),
        };
        let headers = call.exchange(sig, |dst| {
            pieces.as_ref().ok().and_then(|p| p.get(dst)).cloned()
        })?;
        let piece = call.payload(&headers, root)?;
        piece
            .data
            .to_tensor(&piece.dims, &piece.device)
            .map_err(|e| call.tensor_error(e))
    }

    fn reduce(&self, tensor: &Tensor, root: usize, op: ReduceOp) -> Result<Option<Tensor>> {
        let call = self.begin(Op::Reduce)?;
        if self.uses_ring(tensor) {
            let sig = OpSig::Reduce { root, op };
            let headers = call.exchange_inputs(tensor, sig, self.root_error(root))?;
            let inputs = call.inputs(&headers)?;
            return ring::reduce(&inputs, tensor.dtype(), op, root, &call)?
                .map(|r| r.into_tensor(tensor.dims(), tensor.device()))
                .transpose()
                .map_err(|e| call.tensor_error(e));
        }
        let Some(headers) = self.send_to_root(&call, OpSig::Reduce { root, op }, tensor, root)?
        else {
            return Ok(None);
        };
        reduce_in_rank_order(&call.payloads(&headers)?, op)
            .ok_or_else(|| call.unexpected(0, "buffers of different types".into()))?
            .into_tensor(tensor.dims(), tensor.device())
            .map(Some)
            .map_err(|e| call.tensor_error(e))
    }

    fn barrier(&self) -> Result<()> {
        let call = self.begin(Op::Barrier)?;
        let sig = Signature {
            op: OpSig::Barrier,
            meta: None,
            invalid: None,
        };
        call.exchange(sig, |_| None).map(drop)
    }

    fn all_gather_bytes(&self, bytes: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        let call = self.begin(Op::AllGatherBytes)?;
        let len = bytes.len();
        let data = Piece {
            data: Arc::new(Buffer::U8(bytes)),
            dims: vec![len],
            device: candle_core::Device::Cpu,
        };
        let sig = Signature {
            op: OpSig::AllGatherBytes,
            meta: None,
            invalid: None,
        };
        let headers = call.exchange(sig, |_| Some(data.clone()))?;
        (0..self.world_size())
            .map(|src| {
                let piece = call.payload(&headers, src)?;
                piece
                    .data
                    .as_bytes()
                    .map(<[u8]>::to_vec)
                    .ok_or_else(|| call.unexpected(src, "its data are not bytes".into()))
            })
            .collect()
    }

    fn abort(&self, reason: &str) {
        self.shared.fail(Failure {
            rank: self.rank(),
            cause: FailureCause::Aborted(reason.to_string()),
        });
    }

    fn failure(&self) -> Option<Failure> {
        self.shared.failure()
    }

    fn split(&self, color: Color, key: i64) -> Result<Option<SubGroup>> {
        self.split_off(color, key)
    }

    fn send(&self, tensor: &Tensor, dst: usize) -> Result<()> {
        self.send_to(tensor, dst)
    }

    fn recv(&self, like: &Tensor, src: usize) -> Result<Tensor> {
        self.recv_from(like, src)
    }
}
