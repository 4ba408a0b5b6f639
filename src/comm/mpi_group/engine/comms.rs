//! The communicators of the process's groups: the world's and every
//! sub-group's (`MPI_Comm_split`), one active at a time, and the
//! point-to-point messages sent on them.

use super::waiting::InFlight;
use super::*;
use crate::comm::op::Op;

/// How long after a peer's departure notice a sub-group's wait for it
/// gives up. The world's collectives count the departed rank's completed
/// calls instead; a sub-group's are not in that count, and a message the
/// peer sent before it left may still be on its way.
const LEFT_GRACE: Duration = Duration::from_secs(1);

/// A communicator while another is active.
pub(super) struct Comm {
    data: SimpleCommunicator,
    rank: usize,
    size: usize,
    world_ranks: Vec<usize>,
    completed: u64,
}

impl Engine {
    /// Makes communicator `id` the active one (the one `data`, `rank`,
    /// `world_size` and `completed` describe).
    pub(super) fn activate(&mut self, id: usize) -> Result<(), CommError> {
        if id == self.active {
            return Ok(());
        }
        let Some(next) = self.comms.get_mut(id).and_then(Option::take) else {
            return Err(CommError::Protocol {
                rank: self.rank,
                op: "a collective",
                peer: self.rank,
                detail: format!("the engine has no communicator #{id}"),
            });
        };
        let previous = Comm {
            data: std::mem::replace(&mut self.data, next.data),
            rank: std::mem::replace(&mut self.rank, next.rank),
            size: std::mem::replace(&mut self.world_size, next.size),
            world_ranks: std::mem::replace(&mut self.world_ranks, next.world_ranks),
            completed: std::mem::replace(&mut self.completed, next.completed),
        };
        self.comms[self.active] = Some(previous);
        self.active = id;
        Ok(())
    }

    /// `MPI_Comm_split` of communicator `comm`: the new communicator's
    /// number, or `None` for no colour. Every rank of `comm` calls it
    /// right after a collective of `comm` through which all arrived, so
    /// the split (which MPI cannot time out) completes.
    pub(super) fn split(
        &mut self,
        comm: usize,
        color: Option<u32>,
        key: i64,
        members: Vec<usize>,
    ) -> Result<Option<usize>, CommError> {
        self.activate(comm)?;
        // MPI's split cannot be given up: it starts only while every rank
        // is healthy (they all passed the gather just before).
        self.receive_notices();
        if self.shared.failure().is_some() {
            return Err(self.group_failed_for("split"));
        }
        let invalid = |detail: String| CommError::Protocol {
            rank: self.rank,
            op: "split",
            peer: self.rank,
            detail,
        };
        let mpi_color = match color.map(i32::try_from) {
            None => mpi::topology::Color::undefined(),
            Some(Ok(value)) => mpi::topology::Color::with_value(value),
            Some(Err(_)) => return Err(invalid(format!("colour {color:?} is beyond MPI's"))),
        };
        let key = i32::try_from(key).map_err(|_| invalid(format!("key {key} is beyond MPI's")))?;
        let split = self.data.split_by_color_with_key(mpi_color, key);
        let (Some(_), Some(data)) = (color, split) else {
            return Ok(None);
        };
        let (rank, size) = (data.rank() as usize, data.size() as usize);
        if members.len() != size || members.get(rank) != Some(&self.world_rank) {
            return Err(invalid(format!(
                "MPI made a group of {size} with this rank at {rank}, not the members {members:?}"
            )));
        }
        self.comms.push(Some(Comm {
            data,
            rank,
            size,
            world_ranks: members,
            completed: 0,
        }));
        Ok(Some(self.comms.len() - 1))
    }

    /// Frees sub-group communicator `id` (never the world's, 0): the world
    /// made active again if it was, the slot emptied, and the communicator
    /// dropped (`MPI_Comm_free`; MPI completes the operations still
    /// pending on it). No handle is left to use it.
    ///
    /// The standard calls `MPI_Comm_free` collective, but each rank frees
    /// when its own last handle goes: Open MPI's (and MPICH's) free is
    /// local, only marking the communicator for deallocation. A build whose
    /// collective component tore communicators down group-wide (UCC,
    /// HCOLL) could make this wait for the other ranks; none is used here.
    pub(super) fn free(&mut self, id: usize) {
        if id == 0 || self.activate(0).is_err() {
            return;
        }
        if let Some(slot) = self.comms.get_mut(id) {
            *slot = None;
        }
    }

    /// Before leaving: waits for the sends in flight to be received,
    /// however long the receivers take (a pipeline's previous stage may
    /// still be working through its backwards), while the job is healthy.
    /// Once every other rank has left and none took them, this rank fails
    /// naming the lost messages: MPI could not be finalized over them.
    pub(super) fn finish_sends(&mut self) {
        while !self.sends.progress() && self.shared.failure().is_none() {
            let everyone_left = self.world_others().all(|r| {
                self.left
                    .get(r)
                    .copied()
                    .flatten()
                    .is_some_and(|(_, at)| at.elapsed() >= LEFT_GRACE)
            });
            if everyone_left {
                self.fail(Failure {
                    rank: self.world_rank,
                    cause: FailureCause::Aborted(
                        "left with messages sent (send) that no rank received".into(),
                    ),
                });
                return;
            }
            self.receive_notices();
            thread::sleep(NAP);
        }
    }

    /// A rank the current call waits for that has left the job and will
    /// not take part in it, as a world rank.
    ///
    /// A world collective knows from the count of collectives the rank
    /// completed before it left. Elsewhere (a sub-group's collective, a
    /// `recv`) that count says nothing: only the ranks the call still
    /// waits for are looked at, once their notice is [`LEFT_GRACE`] old (a
    /// message they sent before leaving may still be on its way). A `send`
    /// waits for no one.
    pub(super) fn departed(&self) -> Option<usize> {
        let seq = self.seq();
        let op = self.op();
        let (send, recv) = (op == Op::Send.as_str(), op == Op::Recv.as_str());
        let gone = |w: usize| self.left.get(w).copied().flatten();
        if self.active == 0 && !send && !recv {
            // It finished before entering this collective: it never will.
            return (0..self.world_size).find(|&w| gone(w).is_some_and(|(done, _)| done < seq));
        }
        let waiting_for = self
            .current
            .as_ref()
            .map(|c| c.waiting_for.clone())
            .unwrap_or_default();
        waiting_for
            .into_iter()
            .filter(|_| !send)
            .map(|r| self.world_rank_of(r))
            .find(|&w| gone(w).is_some_and(|(_, at)| at.elapsed() >= LEFT_GRACE))
    }

    /// Starts sending `message` to `dst` of the active communicator; the
    /// engine completes it while it goes on (see `send_queue`).
    pub(super) fn send_message(&mut self, dst: usize, message: Vec<u8>) -> Result<Reply, Stop> {
        if let Some(error) = self.interruption() {
            return Err(error.into());
        }
        self.sends
            .start(&self.data, dst as i32, TAG_POINT_TO_POINT, message);
        Ok(Reply::Nothing)
    }

    /// The next message from `src` of the active communicator: its
    /// payload and shape.
    pub(super) fn recv_message(&mut self, src: usize) -> Result<Reply, Stop> {
        self.set_waiting_for(vec![src]);
        let mut message = None;
        // No request of its own: the wait polls the probe.
        let nothing: Vec<InFlight<'static, [u8], mpi::request::StaticScope>> = Vec::new();
        self.wait(nothing, |engine| {
            let probed = engine
                .data
                .process_at_rank(src as i32)
                .immediate_matched_probe_with_tag(TAG_POINT_TO_POINT);
            if let Some(matched) = probed {
                message = Some(matched.matched_receive_vec::<u8>().0);
            }
            Ok(message.is_some())
        })?;
        let message = message.unwrap_or_default();
        let header =
            wire::decode_header(&message).map_err(|detail| self.unexpected(src, detail))?;
        match header.payload {
            Some((buffer, dims)) => Ok(Reply::One(buffer, dims)),
            None => Err(self.unexpected(src, "a message without data".into()).into()),
        }
    }
}
