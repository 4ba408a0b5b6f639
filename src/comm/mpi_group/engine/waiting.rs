//! Waiting for requests: every wait polls them and, between polls, the
//! ways it can end early (a notice, this rank's failure, the deadline); a
//! wait given up leaves its buffers alive with the engine.

use super::*;

impl Engine {
    pub(super) fn set_waiting_for(&mut self, ranks: Vec<usize>) {
        if let Some(current) = self.current.as_mut() {
            current.waiting_for = ranks;
        }
    }

    /// Waits until every request in `pending` has completed and `progress`
    /// (called between polls) returns `Ok(true)`.
    ///
    /// If the wait must end early (a failure, a notice, the deadline, an
    /// error from `progress`, or a receive that brought fewer bytes than
    /// its buffer holds, which MPI does not count as an error), the error
    /// is reported to the caller at once, but this returns only once the
    /// requests have completed, since MPI owns their buffers until then:
    /// possibly never, when a peer is gone. The group is failed by then,
    /// so nothing waits for the engine.
    pub(super) fn wait<'a, D: ?Sized, S: Scope<'a>>(
        &mut self,
        mut pending: Vec<InFlight<'a, D, S>>,
        mut progress: impl FnMut(&mut Self) -> Result<bool, CommError>,
    ) -> Result<(), Stop> {
        let start = Instant::now();
        let mut done = false;
        loop {
            let short;
            (pending, short) = test_all(pending);
            if let Some(Short { expected, got }) = short {
                let detail = format!(
                    "a message of {got} bytes where {} were expected",
                    expected.bytes
                );
                let error = self.unexpected(expected.from, detail);
                return Err(self.abandon(error, pending));
            }
            if !done {
                match progress(self) {
                    Ok(finished) => done = finished,
                    Err(error) => return Err(self.abandon(error, pending)),
                }
            }
            if done && pending.is_empty() {
                return Ok(());
            }
            if let Some(error) = self.interruption() {
                return Err(self.abandon(error, pending));
            }
            if start.elapsed() < SPIN {
                thread::yield_now();
            } else {
                thread::sleep(NAP);
            }
        }
    }

    /// Reports `error`, then stays with `pending` until it completes (see
    /// [`wait`](Engine::wait)), still answering the handles.
    pub(super) fn abandon<'a, D: ?Sized, S: Scope<'a>>(
        &mut self,
        error: CommError,
        mut pending: Vec<InFlight<'a, D, S>>,
    ) -> Stop {
        if self.shared.failure().is_none() {
            // Only a failed group may leave a collective half done.
            self.fail(Failure {
                rank: self.world_rank,
                cause: FailureCause::Aborted(format!("gave up {}: {error}", self.op())),
            });
        }
        self.announce_own_failure();
        self.report(Err(error));
        loop {
            pending = test_all(pending).0;
            if pending.is_empty() {
                return Stop::Reported;
            }
            self.receive_notices();
            match self.control.try_recv() {
                Ok(Control::Call(job)) => {
                    let error = self.group_failed_for(job.ticket.op);
                    let _ = job.reply.send(Err(error));
                }
                Ok(Control::Split { reply, .. }) => {
                    let _ = reply.send(Err(self.group_failed_for("split")));
                }
                Ok(Control::Abort) => self.announce_own_failure(),
                // A failed group's requests may still be on a sub-group's
                // communicator: it stays until the engine ends.
                Ok(Control::Free(_)) => {}
                // The requests may never complete: MPI is not finalized,
                // and the handle need not wait for more than the notices.
                Ok(Control::Shutdown(ack)) => {
                    self.announce_own_failure();
                    let _ = ack.send(());
                }
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => {}
            }
            thread::sleep(IDLE_POLL);
        }
    }

    /// Why the current wait must end now, if it must.
    pub(super) fn interruption(&mut self) -> Option<CommError> {
        self.sends.progress();
        self.receive_notices();
        if let Some(failure) = self.shared.failure() {
            if failure.rank == self.world_rank {
                self.announce_own_failure();
            }
            return Some(self.group_failed_for(self.op()));
        }
        if let Some(gone) = self.departed() {
            self.shared.fail(Failure {
                rank: gone,
                cause: FailureCause::Left,
            });
            return Some(self.group_failed_for(self.op()));
        }
        let current = self.current.as_ref()?;
        if current.ticket.deadline.is_some_and(|d| Instant::now() >= d) {
            let missing = if current.waiting_for.is_empty() {
                self.others().collect()
            } else {
                current.waiting_for.clone()
            };
            let ticket = current.ticket;
            let (op, timeout) = (ticket.op, ticket.timeout.unwrap_or_default());
            self.fail(Failure {
                rank: self.world_rank,
                cause: FailureCause::TimedOut {
                    op,
                    missing: missing.iter().map(|&r| self.world_rank_of(r)).collect(),
                },
            });
            return Some(CommError::Timeout {
                rank: self.rank,
                op,
                timeout,
                missing,
            });
        }
        None
    }
}

/// A request in flight and, for a receive, what it must bring: MPI
/// completes the receive of a shorter message without an error and leaves
/// the rest of the buffer unwritten.
pub(super) type InFlight<'a, D, S> = (Request<'a, D, S>, Option<Expected>);

/// A receive's source and the bytes it must bring.
#[derive(Debug, Clone, Copy)]
pub(super) struct Expected {
    pub(super) from: usize,
    pub(super) bytes: usize,
}

/// A send: nothing to check on completion.
pub(super) fn sending<'a, D: ?Sized, S: Scope<'a>>(
    request: Request<'a, D, S>,
) -> InFlight<'a, D, S> {
    (request, None)
}

/// A receive of exactly `bytes` bytes from rank `from`.
pub(super) fn receiving<'a, D: ?Sized, S: Scope<'a>>(
    request: Request<'a, D, S>,
    from: usize,
    bytes: usize,
) -> InFlight<'a, D, S> {
    (request, Some(Expected { from, bytes }))
}

/// A completed receive that brought fewer bytes than expected.
#[derive(Debug, Clone, Copy)]
pub(super) struct Short {
    pub(super) expected: Expected,
    pub(super) got: usize,
}

/// The requests still in flight, and the first completed receive that
/// came up short.
pub(super) fn test_all<'a, D: ?Sized, S: Scope<'a>>(
    pending: Vec<InFlight<'a, D, S>>,
) -> (Vec<InFlight<'a, D, S>>, Option<Short>) {
    let mut short = None;
    let still = pending
        .into_iter()
        .filter_map(|(request, expected)| match request.test() {
            Err(request) => Some((request, expected)),
            Ok(status) => {
                // Messages are capped below `i32::MAX` bytes
                // (`MAX_MESSAGE_BYTES`), so the count is defined.
                let got = usize::try_from(status.count(u8::equivalent_datatype())).unwrap_or(0);
                if let Some(expected) = expected.filter(|e| e.bytes != got) {
                    short.get_or_insert(Short { expected, got });
                }
                None
            }
        })
        .collect();
    (still, short)
}
