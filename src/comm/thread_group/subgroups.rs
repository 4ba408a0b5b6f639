//! What a [`ThreadRank`] does beyond the collectives: splitting off
//! sub-groups that share its failures, and sending tensors point to point.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use candle_core::Tensor;
use crossbeam::channel::{self, TryRecvError};
use crossbeam::select;

use super::group::{ThreadGroup, ThreadRank};
use crate::comm::op::Op;
use crate::comm::protocol::{self, TensorMeta};
use crate::comm::split::{members, Color, SubGroup};
use crate::comm::{
    all_gather_object, CommError, Failure, FailureCause, GroupOptions, ProcessGroup, Result,
};
use crate::util::lock::lock;

impl ThreadRank {
    /// [`ProcessGroup::split`]: the ranks' colours and keys are gathered
    /// (the split's collective), and the first member of each colour to
    /// arrive makes the sub-group's handles, in the family of this group,
    /// for every member to take its own.
    pub(super) fn split_off(&self, color: Color, key: i64) -> Result<Option<SubGroup>> {
        let choices: Vec<(Color, i64)> = all_gather_object(self, &(color, key))?;
        let number = self.splits.fetch_add(1, Ordering::SeqCst);
        let Some(value) = color.value() else {
            return Ok(None);
        };
        let members = members(&choices, color);
        let index = members.iter().position(|&r| r == self.rank());
        let handle = index.and_then(|index| {
            let mut splits = lock(&self.shared.splits);
            let handles = splits.entry((number, value)).or_insert_with(|| {
                let world_ranks = members
                    .iter()
                    .map(|&r| self.shared.world_ranks[r])
                    .collect();
                let options = GroupOptions {
                    timeout: self.timeout(),
                    ring_threshold_bytes: self.shared.ring_threshold_bytes,
                };
                let family = Arc::clone(&self.shared.family);
                ThreadGroup::in_family(family, world_ranks, &options)
                    .into_iter()
                    .map(Some)
                    .collect()
            });
            let handle = handles.get_mut(index).and_then(Option::take);
            if handles.iter().all(Option::is_none) {
                splits.remove(&(number, value));
            }
            handle
        });
        let handle = handle.ok_or_else(|| CommError::Protocol {
            rank: self.rank(),
            op: "split",
            peer: self.rank(),
            detail: "its sub-group has no handle left for it".into(),
        })?;
        // The rank's own timeout, which may have changed since the first
        // member made the handles.
        handle.set_timeout(self.timeout());
        Ok(Some(Arc::new(handle)))
    }

    /// Fails at once if the group has failed or this rank has left.
    fn usable(&self, op: Op) -> Result<()> {
        let failure = self.shared.failure().or_else(|| {
            lock(&self.links).left.then(|| Failure {
                rank: self.shared.world_ranks[self.rank()],
                cause: FailureCause::Left,
            })
        });
        match failure {
            Some(failure) => Err(CommError::GroupFailed {
                rank: self.rank(),
                op: op.as_str(),
                failure,
            }),
            None => Ok(()),
        }
    }

    /// Checks that `peer` is another rank of the group.
    fn peer_error(&self, op: Op, peer: usize) -> Result<()> {
        protocol::check_peer(op, peer, self.rank(), self.world_size())
    }

    /// `peer` is gone while this rank still needs it: the family fails.
    fn lost(&self, op: Op, peer: usize) -> CommError {
        self.shared.fail(Failure {
            rank: peer,
            cause: FailureCause::Left,
        });
        self.failed(op)
    }

    fn failed(&self, op: Op) -> CommError {
        let failure = self.shared.failure().unwrap_or(Failure {
            rank: self.rank(),
            cause: FailureCause::Aborted("woken without a recorded failure".into()),
        });
        CommError::GroupFailed {
            rank: self.rank(),
            op: op.as_str(),
            failure,
        }
    }

    /// [`ProcessGroup::send`]: a copy of the tensor (never its storage,
    /// which the sender may write again) goes down the pair's channel,
    /// which buffers it.
    pub(super) fn send_to(&self, tensor: &Tensor, dst: usize) -> Result<()> {
        self.usable(Op::Send)?;
        self.peer_error(Op::Send, dst)?;
        let copy = tensor
            .copy()
            .map(|t| t.detach())
            .map_err(|source| CommError::Tensor {
                rank: self.rank(),
                op: Op::Send.as_str(),
                source,
            })?;
        let to = lock(&self.p2p).to.get(dst).cloned();
        match to.map(|to| to.send(copy)) {
            Some(Ok(())) => Ok(()),
            _ => Err(self.lost(Op::Send, dst)),
        }
    }

    /// [`ProcessGroup::recv`]: waits for `src`'s next tensor, the group's
    /// failure or the timeout, whichever comes first.
    pub(super) fn recv_from(&self, like: &Tensor, src: usize) -> Result<Tensor> {
        let op = Op::Recv;
        self.usable(op)?;
        self.peer_error(op, src)?;
        // A clone of the receiver, so that this rank can send on another
        // thread while it waits here.
        let Some(from) = lock(&self.p2p).from.get(src).cloned() else {
            return Err(self.failed(op));
        };
        let timeout = self.timeout();
        let deadline = timeout
            .and_then(|t| Instant::now().checked_add(t))
            .map_or_else(channel::never, channel::at);
        let tensor = match from.try_recv() {
            Ok(tensor) => tensor,
            Err(TryRecvError::Disconnected) => return Err(self.lost(op, src)),
            Err(TryRecvError::Empty) => select! {
                recv(from) -> tensor => tensor.map_err(|_| self.lost(op, src))?,
                recv(self.alarm) -> _ => from.try_recv().map_err(|_| self.failed(op))?,
                recv(deadline) -> _ => match from.try_recv() {
                    Ok(tensor) => tensor,
                    Err(_) => {
                        self.shared.fail(Failure {
                            rank: self.rank(),
                            cause: FailureCause::TimedOut {
                                op: op.as_str(),
                                missing: vec![src],
                            },
                        });
                        return Err(CommError::Timeout {
                            rank: self.rank(),
                            op: op.as_str(),
                            timeout: timeout.unwrap_or_default(),
                            missing: vec![src],
                        });
                    }
                },
            },
        };
        let (sent, wanted) = (TensorMeta::of(&tensor), TensorMeta::of(like));
        if sent != wanted {
            // The two ranks are out of step: nothing they exchange later
            // can be trusted.
            let detail = protocol::message_mismatch(src, &sent, self.rank(), &wanted);
            self.shared.fail(Failure {
                rank: self.rank(),
                cause: FailureCause::Aborted(format!("recv from rank {src}: {detail}")),
            });
            return Err(CommError::TensorMismatch {
                rank: self.rank(),
                op: op.as_str(),
                ranks: vec![src],
                detail,
            });
        }
        tensor
            .to_device(like.device())
            .map_err(|source| CommError::Tensor {
                rank: self.rank(),
                op: op.as_str(),
                source,
            })
    }
}
