//! What an [`MpiGroup`] does beyond the collectives: sub-groups, each an
//! MPI communicator of its own (`MPI_Comm_split`) that shares the
//! process's failures, and point-to-point messages.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use candle_core::Tensor;
use crossbeam::channel;

use super::engine::{Control, Kind, Reply};
use super::{signature, too_large, wire, MpiGroup, ENGINE_GRACE, MAX_MESSAGE_BYTES};
use crate::comm::buffer::Buffer;
use crate::comm::op::Op;
use crate::comm::protocol::{self, OpSig, TensorMeta};
use crate::comm::split::{members, Color, SubGroup};
use crate::comm::{all_gather_object, CommError, FailureCause, Membership, ProcessGroup, Result};

impl MpiGroup {
    /// [`ProcessGroup::split`]: the colours and keys are gathered first
    /// (a collective with this group's timeout and failure rules, through
    /// which every rank arrives), then the engine splits the communicator,
    /// which MPI cannot interrupt but which now has every rank.
    pub(super) fn split_off(&self, color: Color, key: i64) -> Result<Option<SubGroup>> {
        let choices: Vec<(Color, i64)> = all_gather_object(self, &(color, key))?;
        let members = members(&choices, color);
        // MPI's colours and keys are small non-negative `int`s: the colour's
        // place among the colours given, and the rank's place in its group
        // (the order `members` already settled, MPI's own rule).
        let mut colours: Vec<u32> = choices.iter().filter_map(|(c, _)| c.value()).collect();
        colours.sort_unstable();
        colours.dedup();
        let compact = color
            .value()
            .and_then(|c| colours.iter().position(|&x| x == c))
            .map(|i| i as u32);
        let position = members.iter().position(|&r| r == self.rank());
        let world_members: Vec<usize> = members.iter().map(|&r| self.world_ranks[r]).collect();
        let (reply, answer) = channel::bounded(1);
        let split = Control::Split {
            comm: self.comm,
            color: compact,
            key: position.unwrap_or(0) as i64,
            members: world_members.clone(),
            reply,
        };
        if self.control.send(split).is_err() {
            return Err(self.engine_gone("split"));
        }
        // The engine's MPI_Comm_split cannot be interrupted: past the
        // timeout (and the engine's grace) the group fails, and this rank
        // stops waiting for it.
        let limit = self
            .timeout()
            .and_then(|t| Instant::now().checked_add(t + ENGINE_GRACE));
        let made = match limit {
            Some(limit) => answer.recv_deadline(limit).map_err(|e| e.is_timeout()),
            None => answer.recv().map_err(|_| false),
        };
        let made = match made {
            Ok(made) => made,
            Err(true) => {
                let others: Vec<usize> = (0..self.world_size())
                    .filter(|&r| r != self.rank())
                    .collect();
                self.fail(FailureCause::TimedOut {
                    op: "split",
                    missing: others.iter().map(|&r| self.world_ranks[r]).collect(),
                });
                return Err(CommError::Timeout {
                    rank: self.rank(),
                    op: "split",
                    timeout: self.timeout().unwrap_or_default(),
                    missing: others,
                });
            }
            Err(false) => return Err(self.engine_gone("split")),
        };
        let (Some(comm), Some(rank)) = (made?, position) else {
            return Ok(None);
        };
        Ok(Some(Arc::new(MpiGroup {
            membership: Membership::new(rank, world_members.len(), self.timeout()),
            shared: Arc::clone(&self.shared),
            calls: Mutex::new(0),
            control: self.control.clone(),
            engine: Mutex::new(None),
            left: AtomicBool::new(false),
            comm,
            world_ranks: Arc::new(world_members),
        })))
    }

    fn peer_error(&self, op: Op, peer: usize) -> Result<()> {
        protocol::check_peer(op, peer, self.rank(), self.world_size())
    }

    /// [`ProcessGroup::send`]: the tensor's host copy, with its dtype and
    /// shape, in one message. MPI may hold a large send until the receiver
    /// takes it (its rendezvous protocol).
    pub(super) fn send_to(&self, tensor: &Tensor, dst: usize) -> Result<()> {
        self.peer_error(Op::Send, dst)?;
        let meta = TensorMeta::of(tensor);
        let bytes = meta.dims.iter().product::<usize>() * meta.dtype.size_in_bytes();
        let data = if bytes > MAX_MESSAGE_BYTES {
            Err(too_large(bytes))
        } else {
            Buffer::from_tensor(tensor)
        };
        let data = data.map_err(|reason| CommError::InvalidInput {
            rank: self.rank(),
            op: Op::Send.as_str(),
            culprit: self.rank(),
            reason,
        })?;
        let sig = signature(OpSig::Send, Some(meta.clone()), None);
        let message = wire::encode_header(0, &sig, Some((&data, Some(&meta.dims))), None);
        self.call(sig, Kind::Send { dst, message }).map(drop)
    }

    /// [`ProcessGroup::recv`]: the next message from `src`, checked
    /// against `like`.
    pub(super) fn recv_from(&self, like: &Tensor, src: usize) -> Result<Tensor> {
        self.peer_error(Op::Recv, src)?;
        let sig = signature(OpSig::Recv, None, None);
        let Reply::One(buffer, dims) = self.call(sig, Kind::Recv { src })? else {
            return Err(self.wrong_reply(Op::Recv));
        };
        let sent = TensorMeta {
            dtype: buffer.dtype(),
            dims: dims.clone(),
        };
        let wanted = TensorMeta::of(like);
        if sent != wanted {
            let detail = protocol::message_mismatch(src, &sent, self.rank(), &wanted);
            self.fail(FailureCause::Aborted(format!(
                "recv from rank {src}: {detail}"
            )));
            return Err(CommError::TensorMismatch {
                rank: self.rank(),
                op: Op::Recv.as_str(),
                ranks: vec![src],
                detail,
            });
        }
        buffer
            .into_tensor(&dims, like.device())
            .map_err(|e| self.tensor_error(Op::Recv, e))
    }
}
