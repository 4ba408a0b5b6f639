//! One collective in progress on one rank ([`Call`]): the header exchange
//! through which the ranks agree on the call, the messages after it, and
//! the errors that end it (a peer gone, the group failed, the timeout).

use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::Tensor;
use crossbeam::channel::{self, Receiver, TryRecvError};
use crossbeam::select;

use super::group::{Links, ThreadRank};
use crate::comm::buffer::{Buffer, Input};
use crate::comm::op::Op;
use crate::comm::protocol::{self, Body, Envelope, Header, OpSig, Piece, Signature, TensorMeta};
use crate::comm::ring::Link;
use crate::comm::{CommError, Failure, FailureCause, ProcessGroup, Result};
use crate::util::lock::lock;

/// How long a rank polls for a message before it blocks (see
/// [`Call::poll`]).
const SPIN: Duration = Duration::from_micros(50);

impl ThreadRank {
    /// Starts a collective: fails at once if the group has failed, else
    /// takes this rank's channels for the duration of the call.
    pub(super) fn begin(&self, op: Op) -> Result<Call<'_>> {
        let op = op.as_str();
        let mut links = lock(&self.links);
        if let Some(failure) = self.shared.failure() {
            return Err(CommError::GroupFailed {
                rank: self.rank(),
                op,
                failure,
            });
        }
        if links.left {
            return Err(CommError::GroupFailed {
                rank: self.rank(),
                op,
                failure: Failure {
                    rank: self.shared.world_ranks[self.rank()],
                    cause: FailureCause::Left,
                },
            });
        }
        links.seq += 1;
        let seq = links.seq;
        self.shared.entered[self.rank()].store(seq, Ordering::SeqCst);
        let timeout = self.timeout();
        // A timeout too large for `Instant` is as good as none.
        let deadline = timeout
            .and_then(|t| Instant::now().checked_add(t))
            .map_or_else(channel::never, channel::at);
        Ok(Call {
            pg: self,
            links,
            op,
            seq,
            timeout,
            deadline,
        })
    }
}

/// One collective in progress on one rank.
pub(super) struct Call<'a> {
    pg: &'a ThreadRank,
    links: MutexGuard<'a, Links>,
    op: &'static str,
    seq: u64,
    timeout: Option<Duration>,
    /// Fires once the timeout has expired; never without a timeout.
    deadline: Receiver<Instant>,
}

impl Call<'_> {
    fn send_body(&self, dst: usize, body: Body) -> Result<()> {
        let envelope = Envelope {
            seq: self.seq,
            body,
        };
        self.links.to[dst]
            .send(envelope)
            .map_err(|_| self.peer_left(dst))
    }

    /// The next message on `from` if it comes within [`SPIN`]: the ranks
    /// of a collective usually arrive within microseconds of each other,
    /// and waking a blocked thread costs tens of them. The spin yields the
    /// CPU to other threads, and stops at once when the group fails.
    fn poll(&self, from: &Receiver<Envelope>) -> std::result::Result<Envelope, TryRecvError> {
        let start = Instant::now();
        loop {
            match from.try_recv() {
                Err(TryRecvError::Empty)
                    if start.elapsed() < SPIN && !self.pg.shared.has_failed() =>
                {
                    std::thread::yield_now()
                }
                other => return other,
            }
        }
    }

    /// The next message from `src`, or an error once it cannot come.
    fn recv_body(&self, src: usize) -> Result<Body> {
        let from = &self.links.from[src];
        let envelope = match self.poll(from) {
            Ok(envelope) => envelope,
            Err(TryRecvError::Disconnected) => return Err(self.peer_left(src)),
            Err(TryRecvError::Empty) => select! {
                recv(from) -> envelope => envelope.map_err(|_| self.peer_left(src))?,
                // The sender may have sent this message just before the
                // failure or the deadline: use it if it is there.
                recv(self.pg.alarm) -> _ => from.try_recv().map_err(|_| self.group_failed())?,
                recv(self.deadline) -> _ => from.try_recv().map_err(|_| self.timed_out(src))?,
            },
        };
        if envelope.seq != self.seq {
            return Err(self.unexpected(
                src,
                format!(
                    "it belongs to its collective #{}, this rank is in #{}",
                    envelope.seq, self.seq
                ),
            ));
        }
        Ok(envelope.body)
    }

    /// Sends this rank's header to every other rank and receives theirs.
    /// Returns every rank's header in rank order (this rank's included, with
    /// `payload_for(rank)`) once the ranks agree the call can go ahead.
    pub(super) fn exchange(
        &self,
        sig: Signature,
        payload_for: impl FnMut(usize) -> Option<Piece>,
    ) -> Result<Vec<Header>> {
        self.exchange_with_input(sig, payload_for, None)
    }

    /// The [`exchange`](Call::exchange) of a large reduction of `tensor`:
    /// every header carries the sender's [`Input`], which every rank reads
    /// (see [`ring`](crate::comm::ring)). `invalid` says why the call's other arguments are.
    pub(super) fn exchange_inputs(
        &self,
        tensor: &Tensor,
        op: OpSig,
        invalid: Option<String>,
    ) -> Result<Vec<Header>> {
        let input = Input::new(tensor);
        let sig = Signature {
            op,
            meta: Some(TensorMeta::of(tensor)),
            invalid: invalid.or_else(|| input.as_ref().err().cloned()),
        };
        self.exchange_with_input(sig, |_| None, input.as_ref().ok())
    }

    pub(super) fn exchange_with_input(
        &self,
        sig: Signature,
        mut payload_for: impl FnMut(usize) -> Option<Piece>,
        input: Option<&Input>,
    ) -> Result<Vec<Header>> {
        let me = self.pg.rank();
        let world = self.pg.world_size();
        for dst in (0..world).filter(|&dst| dst != me) {
            let header = Header {
                sig: sig.clone(),
                payload: payload_for(dst),
                input: input.cloned(),
            };
            self.send_body(dst, Body::Header(Box::new(header)))?;
        }
        let mut headers = Vec::with_capacity(world);
        for src in 0..world {
            if src == me {
                headers.push(Header {
                    sig: sig.clone(),
                    payload: payload_for(me),
                    input: input.cloned(),
                });
                continue;
            }
            match self.recv_body(src)? {
                Body::Header(header) => headers.push(*header),
                Body::Data(_) => {
                    return Err(self.unexpected(src, "data instead of a header".into()))
                }
            }
        }
        let sigs: Vec<&Signature> = headers.iter().map(|h| &h.sig).collect();
        protocol::check(&sigs, me, self.op)?;
        Ok(headers)
    }

    /// The payload `src` sent with its header.
    pub(super) fn payload<'h>(&self, headers: &'h [Header], src: usize) -> Result<&'h Piece> {
        headers[src]
            .payload
            .as_ref()
            .ok_or_else(|| self.unexpected(src, "its header carries no data".into()))
    }

    /// Every rank's payload, in rank order.
    pub(super) fn payloads<'h>(&self, headers: &'h [Header]) -> Result<Vec<&'h Buffer>> {
        (0..headers.len())
            .map(|src| self.payload(headers, src).map(|p| p.data.as_ref()))
            .collect()
    }

    /// Every rank's input to a large reduction, in rank order.
    pub(super) fn inputs<'h>(&self, headers: &'h [Header]) -> Result<Vec<&'h Input>> {
        (0..headers.len())
            .map(|src| {
                headers[src]
                    .input
                    .as_ref()
                    .ok_or_else(|| self.unexpected(src, "its header carries no input".into()))
            })
            .collect()
    }

    pub(super) fn tensor_error(&self, source: candle_core::Error) -> CommError {
        CommError::Tensor {
            rank: self.pg.rank(),
            op: self.op,
            source,
        }
    }

    fn group_failed(&self) -> CommError {
        // `Shared::fail` stores the failure before waking anyone, so it is
        // there; the fallback only keeps this free of panics.
        let failure = self.pg.shared.failure().unwrap_or(Failure {
            rank: self.pg.rank(),
            cause: FailureCause::Aborted("woken without a recorded failure".into()),
        });
        CommError::GroupFailed {
            rank: self.pg.rank(),
            op: self.op,
            failure,
        }
    }

    /// `peer` dropped its handle while this collective still needs it: a
    /// failure of the group, recorded so that ranks waiting on someone else
    /// hear of it too (the error reports the group's first failure, which
    /// may be an earlier one that made `peer` leave).
    fn peer_left(&self, peer: usize) -> CommError {
        self.pg.shared.fail(Failure {
            rank: peer,
            cause: FailureCause::Left,
        });
        self.group_failed()
    }

    fn timed_out(&self, src: usize) -> CommError {
        if self.pg.shared.failure().is_some() {
            return self.group_failed();
        }
        let mut missing: Vec<usize> = (0..self.pg.world_size())
            .filter(|&r| self.pg.shared.entered[r].load(Ordering::SeqCst) < self.seq)
            .collect();
        if missing.is_empty() {
            // Everyone arrived; the rank this wait depends on is stuck.
            missing.push(src);
        }
        // The other ranks' part of this collective can no longer complete.
        self.pg.shared.fail(Failure {
            rank: self.pg.rank(),
            cause: FailureCause::TimedOut {
                op: self.op,
                missing: missing.clone(),
            },
        });
        CommError::Timeout {
            rank: self.pg.rank(),
            op: self.op,
            timeout: self.timeout.unwrap_or_default(),
            missing,
        }
    }
}

impl Link for Call<'_> {
    fn rank(&self) -> usize {
        self.pg.rank()
    }

    fn world_size(&self) -> usize {
        self.pg.world_size()
    }

    fn send(&self, dst: usize, data: Option<Arc<Buffer>>) -> Result<()> {
        self.send_body(dst, Body::Data(data))
    }

    fn recv(&self, src: usize) -> Result<Option<Arc<Buffer>>> {
        match self.recv_body(src)? {
            Body::Data(data) => Ok(data),
            Body::Header(_) => Err(self.unexpected(src, "a header instead of data".into())),
        }
    }

    fn unexpected(&self, src: usize, detail: String) -> CommError {
        // The ranks are out of step; nothing later can be trusted.
        self.pg.shared.fail(Failure {
            rank: self.pg.rank(),
            cause: FailureCause::Aborted(format!(
                "received an unexpected message from rank {src} in {}",
                self.op
            )),
        });
        CommError::Protocol {
            rank: self.pg.rank(),
            op: self.op,
            peer: src,
            detail,
        }
    }
}
