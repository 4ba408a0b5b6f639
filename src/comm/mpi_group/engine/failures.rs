//! Failures: recording them, telling the other ranks with a notice, and
//! receiving theirs.

use super::*;

impl Engine {
    /// Records `failure` (unless the group already failed) and, if it is
    /// this rank's, tells the others.
    pub(super) fn fail(&mut self, failure: Failure) {
        self.shared.fail(failure);
        self.announce_own_failure();
    }

    pub(super) fn group_failed_for(&self, op: &'static str) -> CommError {
        let failure = self.shared.failure().unwrap_or(Failure {
            rank: self.world_rank,
            cause: FailureCause::Aborted("stopped without a recorded failure".into()),
        });
        CommError::GroupFailed {
            rank: self.rank,
            op,
            failure,
        }
    }

    /// The error for a message from `src` that does not fit the collective
    /// in progress: the ranks are out of step, so the group fails.
    pub(super) fn unexpected(&self, src: usize, detail: String) -> CommError {
        let op = self.op();
        self.shared.fail(Failure {
            rank: self.world_rank,
            cause: FailureCause::Aborted(format!(
                "received an unexpected message from rank {src} in {op}"
            )),
        });
        CommError::Protocol {
            rank: self.rank,
            op,
            peer: src,
            detail,
        }
    }

    /// Tells every other rank about this rank's failure, once.
    pub(super) fn announce_own_failure(&mut self) {
        let Some(failure) = self.shared.failure() else {
            return;
        };
        if self.announced || failure.rank != self.world_rank {
            return;
        }
        self.announced = true;
        // Best effort: a peer that cannot be told has failed too.
        let _ = self.announce(&Notice::failed(&failure));
    }

    /// Sends `notice` to every other rank; whether every copy left within
    /// [`NOTICE_DEADLINE`]. A notice is far below MPI's eager limit (see
    /// `wire`), so its send completes without waiting for the receiver,
    /// except to a peer whose process is gone: there Open MPI's blocking
    /// send waited forever (seen under `srun`, where a rank that finalized
    /// had already exited), so the copies are sent without blocking and
    /// one not sent by the deadline is given up.
    pub(super) fn announce(&self, notice: &Notice) -> bool {
        let bytes = notice.encode();
        let mut sends = send_queue::SendQueue::default();
        for dst in self.world_others() {
            sends.start(&self.notices, dst as i32, TAG_NOTICE, bytes.clone());
        }
        let deadline = Instant::now() + NOTICE_DEADLINE;
        loop {
            if sends.progress() {
                return true;
            }
            if Instant::now() >= deadline {
                // Dropping the queue leaves the unsent copies to the
                // process's end (see `SendQueue`'s `Drop`).
                return false;
            }
            thread::sleep(NAP);
        }
    }

    /// Waits until every other rank has said it left (its `Left` notice),
    /// a failure is recorded, or `limit` passes; whether every one did.
    pub(super) fn await_everyone_left(&mut self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            self.receive_notices();
            let all = self
                .world_others()
                .all(|r| self.left.get(r).copied().flatten().is_some());
            if all {
                return true;
            }
            if self.shared.failure().is_some() || Instant::now() >= deadline {
                return false;
            }
            thread::sleep(IDLE_POLL);
        }
    }

    /// Takes in every notice that has arrived.
    pub(super) fn receive_notices(&mut self) {
        while let Some(matched) = self
            .notices
            .any_process()
            .immediate_matched_probe_with_tag(TAG_NOTICE)
        {
            let (bytes, status) = matched.matched_receive_vec::<u8>();
            let src = status.source_rank() as usize;
            match Notice::decode(&bytes) {
                Ok(Notice::Failed { rank, cause }) => self.shared.fail(Failure {
                    rank,
                    cause: cause.into_cause(),
                }),
                Ok(Notice::Left { seq }) => {
                    if let Some(slot) = self.left.get_mut(src) {
                        *slot = Some((seq, Instant::now()));
                    }
                }
                Err(detail) => self.shared.fail(Failure {
                    rank: src,
                    cause: FailureCause::Aborted(format!("sent {detail}")),
                }),
            }
        }
    }
}
