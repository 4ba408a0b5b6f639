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
        self.announce(&Notice::failed(&failure));
    }

    pub(super) fn announce(&self, notice: &Notice) {
        let bytes = notice.encode();
        for dst in self.world_others() {
            // A notice is far below MPI's eager limit (see `wire`): the
            // send returns without waiting for the receiver.
            self.notices
                .process_at_rank(dst as i32)
                .send_with_tag(&bytes[..], TAG_NOTICE);
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
