//! The MPI engine: the one thread of a process that makes MPI calls.
//!
//! Every [`MpiGroup`](super::MpiGroup) call is sent here as a [`Job`] and
//! answered on its own channel. Keeping MPI on one thread gives three
//! things: MPI needs only `MPI_THREAD_FUNNELED`; the handle is `Send +
//! Sync` although rsmpi's communicators are not; and a collective that can
//! never complete (a peer failed, or the timeout expired) can be given up
//! by the caller while its buffers stay alive here, because MPI may still
//! write into them (there is no way to cancel a started collective).
//!
//! Every wait polls its requests (`MPI_Test`) and, between polls, the three
//! ways it can end early: a notice from another rank (it failed, or it
//! left), a failure of this rank (`abort`, a panic), and the deadline. A
//! rank that fails or times out tells every other rank with a small notice
//! on a communicator of its own, so their waits end with an error naming
//! it instead of hanging.
//!
//! **The collectives**, on a duplicate of `MPI_COMM_WORLD`:
//! - every collective starts with a header exchange: each rank sends every
//!   other rank its [`Signature`] (point to point, so that a timeout can
//!   name the ranks whose header never came), and the ranks agree with
//!   [`protocol::check`] before any data moves, as the thread group does;
//! - small payloads travel with the header (all_reduce below the ring
//!   threshold, broadcast, all_gather, gather, scatter, all_gather_bytes)
//!   and are reduced in rank order;
//! - large reductions run the ring algorithm (reduce-scatter, then
//!   all-gather or gather to the root), in the thread group's exact
//!   reduction order, so every result is bitwise the thread group's;
//!   DDP's buckets (`all_reduce_concat`) are read where the gradients lie,
//!   one message per gradient in the first step, instead of being copied
//!   into one buffer first, and the result is received into memory that
//!   is not zero-filled first (see `message_bytes`).

// The engine's work by concern: the header exchange, the ring, waiting
// for requests, failures and notices, the sub-groups' communicators and
// point-to-point messages; this file holds the engine's types, its loop
// and the collectives' dispatch.
mod comms;
mod failures;
mod headers;
mod ring;
mod send_queue;
mod waiting;

use waiting::{receiving, sending};

use std::mem::MaybeUninit;
use std::ops::Range;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use candle_core::DType;
use crossbeam::channel::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use mpi::point_to_point::MatchedReceiveVec;
use mpi::request::{Request, Scope};
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use mpi::Threading;

use super::message_bytes::{
    as_receivable, assume_received, assume_received_ref, received, sent, MessageByte,
};
use super::wire::{self, Notice, Wire};
use super::Shared;
use crate::comm::buffer::{chunk_range, match_dtype, part_lens, read_parts, Buffer, Input};
use crate::comm::combine::{
    combine_into, combine_into_finished, combine_over, combine_over_finished, reduce_in_rank_order,
};
use crate::comm::protocol::{self, Signature};
use crate::comm::{CommError, Failure, FailureCause, ReduceOp};

const TAG_HEADER: i32 = 1;
const TAG_DATA: i32 = 2;
const TAG_NOTICE: i32 = 3;
const TAG_POINT_TO_POINT: i32 = 4;

/// How often an idle engine looks for notices, so that
/// [`ProcessGroup::failure`](crate::comm::ProcessGroup::failure) sees a
/// peer's failure between collectives too.
const IDLE_POLL: Duration = Duration::from_millis(10);

/// How long a wait polls without pause before it sleeps between polls.
/// The ranks of a collective usually arrive close together and large
/// transfers progress only inside MPI calls; a peer that is still
/// computing should not have to share its core with a spinning poller.
const SPIN: Duration = Duration::from_millis(2);

/// The pause between polls after [`SPIN`].
const NAP: Duration = Duration::from_micros(50);

/// How long a notice to the other ranks may take to leave before the peer
/// it is for counts as gone (a notice leaves at once to a live peer).
const NOTICE_DEADLINE: Duration = Duration::from_secs(5);

/// How long a rank leaving a healthy group waits for the others to say
/// they left before it finalizes MPI anyway.
const LEAVE_WAIT: Duration = Duration::from_secs(30);

/// What a handle asks of the engine.
pub(super) enum Control {
    /// Run a collective.
    Call(Job),
    /// Split communicator `comm` (all its ranks call this, after a
    /// collective through which all arrived): `color` and `key` as
    /// `MPI_Comm_split`'s; `members` are the new group's world ranks, in
    /// order. Answers with the new communicator's number, `None` for no
    /// colour.
    Split {
        comm: usize,
        color: Option<u32>,
        key: i64,
        members: Vec<usize>,
        reply: Sender<Result<Option<usize>, CommError>>,
    },
    /// A sub-group's last handle is gone: free its communicator
    /// (`MPI_Comm_free`, which lets the sends still in flight on it
    /// complete), so that a program making groups in a loop does not run
    /// out of MPI's communicators.
    Free(usize),
    /// This rank has failed (recorded in [`Shared`]): tell the others.
    Abort,
    /// The last handle is gone: leave the group and finalize MPI, then
    /// answer on the channel.
    Shutdown(Sender<()>),
}

/// Which collective call of this rank, and its time limit.
#[derive(Clone, Copy)]
pub(super) struct Ticket {
    /// The communicator: 0 for the world, else a sub-group's.
    pub(super) comm: usize,
    pub(super) seq: u64,
    pub(super) op: &'static str,
    pub(super) deadline: Option<Instant>,
    pub(super) timeout: Option<Duration>,
}

/// One collective call of this rank.
pub(super) struct Job {
    pub(super) ticket: Ticket,
    pub(super) sig: Signature,
    pub(super) kind: Kind,
    pub(super) reply: Sender<Result<Reply, CommError>>,
}

/// The collective and this rank's data (`None` where the data is invalid,
/// which the signature says).
pub(super) enum Kind {
    /// all_reduce (`root: None`) or reduce.
    Reduce {
        op: ReduceOp,
        root: Option<usize>,
        data: Option<Buffer>,
    },
    /// An all_reduce of the concatenation of `input`'s tensors (of
    /// `dtype`), large enough for the ring, which reads them where they
    /// lie when every rank's tensors have the same lengths: a concatenated
    /// copy would cost a pass over the data and a fresh buffer, about a
    /// third of the reduction (README, "DDP on MPI processes"). Otherwise
    /// the engine concatenates them and runs [`Kind::Reduce`].
    ReduceParts {
        op: ReduceOp,
        input: Input,
        dtype: DType,
    },
    /// reduce_scatter, large enough for the ring: the ring's
    /// reduce-scatter, then each rank sends every other only the part of
    /// its reduced chunk that lies in that rank's piece (`counts`, the
    /// same on every rank, checked before).
    ReduceScatter {
        op: ReduceOp,
        data: Option<Buffer>,
        counts: Vec<usize>,
    },
    Broadcast {
        root: usize,
        data: Option<Buffer>,
    },
    /// all_gather and all_gather_bytes.
    AllGather {
        data: Option<Buffer>,
    },
    Gather {
        root: usize,
        data: Option<Buffer>,
    },
    Scatter {
        root: usize,
        parts: Vec<(Buffer, Vec<usize>)>,
    },
    Barrier,
    /// A point-to-point message to `dst`, encoded.
    Send {
        dst: usize,
        message: Vec<u8>,
    },
    /// The next point-to-point message from `src`.
    Recv {
        src: usize,
    },
}

/// A collective's result on this rank.
pub(super) enum Reply {
    Nothing,
    One(Buffer, Vec<usize>),
    Many(Vec<Buffer>),
}

/// Why a collective stopped without a result.
enum Stop {
    /// With this error, not yet reported; no request is pending.
    Error(CommError),
    /// The error was reported while requests were still pending, and the
    /// engine stayed with them until they completed.
    Reported,
}

impl From<CommError> for Stop {
    fn from(error: CommError) -> Stop {
        Stop::Error(error)
    }
}

/// The collective in progress.
struct Current {
    ticket: Ticket,
    reply: Option<Sender<Result<Reply, CommError>>>,
    /// The ranks the current wait depends on, for a timeout's message.
    waiting_for: Vec<usize>,
}

/// Starts MPI on this thread, reports `(rank, world_size)` (or why MPI
/// did not start) on `started`, then serves `control` until shutdown.
pub(super) fn run(
    shared: Arc<Shared>,
    control: Receiver<Control>,
    started: Sender<Result<(usize, usize), String>>,
) {
    let Some((universe, _)) = mpi::initialize_with_threading(Threading::Funneled) else {
        let _ = started.send(Err(
            "MPI is already initialized (or finalized) in this process".into(),
        ));
        return;
    };
    let world = universe.world();
    let (rank, world_size) = (world.rank() as usize, world.size() as usize);
    let mut engine = Engine {
        rank,
        world_size,
        world_rank: rank,
        world_total: world_size,
        world_ranks: (0..world_size).collect(),
        active: 0,
        comms: vec![None],
        data: world.duplicate(),
        notices: world.duplicate(),
        sends: send_queue::SendQueue::default(),
        shared,
        control,
        left: vec![None; world_size],
        announced: false,
        completed: 0,
        current: None,
        shutdown: None,
        scratch: Vec::new(),
    };
    let _ = started.send(Ok((rank, world_size)));
    engine.serve();
    // The world's count of completed collectives goes with the notice.
    let _world = engine.activate(0);
    let ack = engine.shutdown.take();
    engine.finish_sends();
    // A failure a peer already announced must not be finalized over.
    engine.receive_notices();
    let told = engine.shared.failure().is_none()
        && engine.announce(&Notice::Left {
            seq: engine.completed,
        });
    if told {
        // No rank ends its process while another may still send to it:
        // under `srun`, `MPI_Finalize` does not wait for the other ranks
        // (seen: rank 0 exited while rank 1 was sending its notice). Past
        // the wait, finalizing is what it was before.
        engine.await_everyone_left(LEAVE_WAIT);
    }
    // A peer's failure announced during the wait is not finalized over
    // either.
    if told && engine.shared.failure().is_none() {
        drop(engine);
        drop(world);
        // `MPI_Finalize`, which waits for the other ranks to finalize
        // under mpirun.
        drop(universe);
    } else {
        engine.announce_own_failure();
        // After a failure some ranks never finalize, and finalizing here
        // could wait for them forever: the process ends without it, and
        // mpirun reports the job as failed, as it must be.
        std::mem::forget(engine);
        std::mem::forget(world);
        std::mem::forget(universe);
    }
    if let Some(ack) = ack {
        let _ = ack.send(());
    }
}

struct Engine {
    /// This rank in the active communicator, and its size.
    rank: usize,
    world_size: usize,
    /// This rank in `MPI_COMM_WORLD`, and its size: failures and notices
    /// name world ranks.
    world_rank: usize,
    world_total: usize,
    /// The active communicator's ranks as world ranks.
    world_ranks: Vec<usize>,
    /// Which communicator is active (0: the world).
    active: usize,
    /// The communicators that are not active, by number (`None` at the
    /// active one's).
    comms: Vec<Option<comms::Comm>>,
    /// Headers and data, on the active communicator.
    data: SimpleCommunicator,
    /// Failure and departure notices, apart so they never match data.
    notices: SimpleCommunicator,
    /// Point-to-point sends still in flight.
    sends: send_queue::SendQueue,
    shared: Arc<Shared>,
    control: Receiver<Control>,
    /// For each world rank that left: how many of the world's collectives
    /// it completed, and when its notice came.
    left: Vec<Option<(u64, Instant)>>,
    /// Whether this rank's own failure has been sent to the others.
    announced: bool,
    /// The last collective this rank completed.
    completed: u64,
    current: Option<Current>,
    shutdown: Option<Sender<()>>,
    /// Where the ring's reduce-scatter receives, reused by every call: it
    /// keeps the size of the largest chunk received so far (half the
    /// largest all-reduce on 2 ranks). `u64` words keep it aligned for
    /// every element type.
    scratch: Vec<u64>,
}

/// The first `len` elements of `scratch` as `T`s, growing it if needed.
fn typed_scratch<T: Wire>(scratch: &mut Vec<u64>, len: usize) -> &mut [T] {
    let bytes = len * std::mem::size_of::<T>();
    let words = bytes.div_ceil(8);
    if scratch.len() < words {
        scratch.resize(words, 0);
    }
    let all: &mut [u8] = bytemuck::cast_slice_mut(&mut scratch[..words]);
    bytemuck::cast_slice_mut(&mut all[..bytes])
}

impl Engine {
    fn serve(&mut self) {
        while self.shutdown.is_none() {
            match self.control.recv_timeout(IDLE_POLL) {
                Ok(Control::Call(job)) => self.run_job(job),
                Ok(Control::Split {
                    comm,
                    color,
                    key,
                    members,
                    reply,
                }) => {
                    let _ = reply.send(self.split(comm, color, key, members));
                }
                Ok(Control::Free(comm)) => self.free(comm),
                Ok(Control::Abort) => self.announce_own_failure(),
                Ok(Control::Shutdown(ack)) => self.shutdown = Some(ack),
                Err(RecvTimeoutError::Timeout) => {
                    self.sends.progress();
                    self.receive_notices();
                }
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
    }

    fn run_job(&mut self, job: Job) {
        let Job {
            ticket,
            sig,
            kind,
            reply,
        } = job;
        let seq = ticket.seq;
        if let Err(error) = self.activate(ticket.comm) {
            let _ = reply.send(Err(error));
            return;
        }
        self.current = Some(Current {
            ticket,
            reply: Some(reply),
            waiting_for: Vec::new(),
        });
        let result = match kind {
            Kind::Send { dst, message } => self.send_message(dst, message),
            Kind::Recv { src } => self.recv_message(src),
            kind => self.collective(sig, kind),
        };
        match result {
            Ok(result) => {
                self.completed = seq;
                self.report(Ok(result));
            }
            Err(Stop::Error(error)) => {
                if self.shared.failure().is_none() {
                    // An error every rank agreed on: the collective is
                    // complete and the group still usable.
                    self.completed = seq;
                }
                self.report(Err(error));
            }
            Err(Stop::Reported) => {}
        }
        // A failure of this rank found on the way (an unexpected message,
        // say) reaches the others now.
        self.announce_own_failure();
        self.current = None;
    }

    /// Answers the current call, once.
    fn report(&mut self, result: Result<Reply, CommError>) {
        if let Some(reply) = self.current.as_mut().and_then(|c| c.reply.take()) {
            let _ = reply.send(result);
        }
    }

    fn op(&self) -> &'static str {
        self.current
            .as_ref()
            .map_or("a collective", |c| c.ticket.op)
    }

    fn seq(&self) -> u64 {
        self.current.as_ref().map_or(0, |c| c.ticket.seq)
    }

    /// The active communicator's other ranks.
    fn others(&self) -> impl Iterator<Item = usize> {
        let me = self.rank;
        (0..self.world_size).filter(move |&r| r != me)
    }

    /// The world's other ranks.
    fn world_others(&self) -> impl Iterator<Item = usize> {
        let me = self.world_rank;
        (0..self.world_total).filter(move |&r| r != me)
    }

    /// Rank `r` of the active communicator as a world rank.
    fn world_rank_of(&self, r: usize) -> usize {
        self.world_ranks.get(r).copied().unwrap_or(r)
    }

    fn collective(&mut self, sig: Signature, kind: Kind) -> Result<Reply, Stop> {
        if let Some(error) = self.interruption() {
            return Err(error.into());
        }
        let ring = self.uses_ring(&kind);
        let lens = match &kind {
            Kind::ReduceParts { input, .. } if ring => Some(part_lens(input)),
            _ => None,
        };
        let headers = self.exchange_headers(&sig, &kind, ring, lens.as_deref())?;
        let sigs: Vec<&Signature> = (0..self.world_size)
            .map(|r| headers[r].as_ref().map_or(&sig, |h| &h.sig))
            .collect();
        protocol::check(&sigs, self.rank, self.op())?;
        // Parts are read in place only if every rank cuts its data the same
        // way, so that each message of the first ring step is received whole.
        let lens = lens.filter(|mine| {
            headers
                .iter()
                .flatten()
                .all(|h| h.parts.as_ref() == Some(mine))
        });
        let mut payloads: Vec<Option<(Buffer, Vec<usize>)>> = headers
            .into_iter()
            .map(|h| h.and_then(|h| h.payload))
            .collect();
        let me = self.rank;
        match kind {
            Kind::Reduce { op, root, data } => {
                let data = self.own(data)?;
                let wants = root.is_none_or(|root| root == me);
                if ring {
                    return Ok(match self.ring_reduce(data, op, root)? {
                        Some(result) => Reply::One(result, Vec::new()),
                        None => Reply::Nothing,
                    });
                }
                if !wants {
                    return Ok(Reply::Nothing);
                }
                payloads[me] = Some((data, Vec::new()));
                let parts = self.all_payloads(&payloads)?;
                let reduced = reduce_in_rank_order(&parts, op)
                    .ok_or_else(|| self.unexpected(0, "buffers of different types".into()))?;
                Ok(Reply::One(reduced, Vec::new()))
            }
            Kind::ReduceParts { op, input, dtype } => {
                if !ring {
                    let detail = "a reduction of parts below the ring threshold".into();
                    return Err(self.unexpected(me, detail).into());
                }
                let reduced = match lens {
                    Some(lens) => self.ring_reduce_parts(&input, dtype, &lens, op)?,
                    None => {
                        let data = Buffer::of_input(&input, dtype)
                            .map_err(|detail| self.unexpected(me, detail))?;
                        self.ring_reduce(data, op, None)?
                    }
                };
                reduced
                    .map(|result| Reply::One(result, Vec::new()))
                    .ok_or_else(|| self.unexpected(me, "no result of its ring".into()).into())
            }
            Kind::ReduceScatter { op, data, counts } => {
                if !ring {
                    let detail = "a reduce-scatter below the ring threshold".into();
                    return Err(self.unexpected(me, detail).into());
                }
                let piece = self.ring_reduce_scatter(self.own(data)?, op, &counts)?;
                Ok(Reply::One(piece, Vec::new()))
            }
            Kind::Broadcast { root, data } => {
                let result = if root == me {
                    self.own(data)?
                } else {
                    self.payload(&mut payloads, root)?.0
                };
                Ok(Reply::One(result, Vec::new()))
            }
            Kind::AllGather { data } => {
                payloads[me] = Some((self.own(data)?, Vec::new()));
                let all = (0..self.world_size)
                    .map(|src| self.payload(&mut payloads, src).map(|p| p.0))
                    .collect::<Result<_, _>>()?;
                Ok(Reply::Many(all))
            }
            Kind::Gather { root, data } => {
                if root != me {
                    return Ok(Reply::Nothing);
                }
                payloads[me] = Some((self.own(data)?, Vec::new()));
                let all = (0..self.world_size)
                    .map(|src| self.payload(&mut payloads, src).map(|p| p.0))
                    .collect::<Result<_, _>>()?;
                Ok(Reply::Many(all))
            }
            Kind::Scatter { root, mut parts } => {
                let (buffer, dims) = if root == me {
                    if parts.len() <= me {
                        return Err(self.unexpected(me, "no part for this rank".into()).into());
                    }
                    parts.swap_remove(me)
                } else {
                    self.payload(&mut payloads, root)?
                };
                Ok(Reply::One(buffer, dims))
            }
            Kind::Barrier => Ok(Reply::Nothing),
            Kind::Send { .. } | Kind::Recv { .. } => {
                let detail = "a point-to-point message as a collective".into();
                Err(self.unexpected(me, detail).into())
            }
        }
    }

    /// This rank's data, which exists once the ranks agreed (its signature
    /// said it was valid).
    fn own(&self, data: Option<Buffer>) -> Result<Buffer, CommError> {
        data.ok_or_else(|| self.unexpected(self.rank, "no data of its own".into()))
    }

    fn payload(
        &self,
        payloads: &mut [Option<(Buffer, Vec<usize>)>],
        src: usize,
    ) -> Result<(Buffer, Vec<usize>), CommError> {
        payloads
            .get_mut(src)
            .and_then(Option::take)
            .ok_or_else(|| self.unexpected(src, "its header carries no data".into()))
    }

    fn all_payloads<'p>(
        &self,
        payloads: &'p [Option<(Buffer, Vec<usize>)>],
    ) -> Result<Vec<&'p Buffer>, CommError> {
        payloads
            .iter()
            .enumerate()
            .map(|(src, p)| {
                p.as_ref()
                    .map(|p| &p.0)
                    .ok_or_else(|| self.unexpected(src, "its header carries no data".into()))
            })
            .collect()
    }

    /// Whether a reduction takes the ring path: as in the thread group, by
    /// the buffer's size and the group-wide threshold only.
    fn uses_ring(&self, kind: &Kind) -> bool {
        let bytes = match kind {
            Kind::Reduce {
                data: Some(data), ..
            }
            | Kind::ReduceScatter {
                data: Some(data), ..
            } => data.len().saturating_mul(data.dtype().size_in_bytes()),
            Kind::ReduceParts { input, dtype, .. } => {
                input.len().saturating_mul(dtype.size_in_bytes())
            }
            _ => return false,
        };
        protocol::takes_ring(bytes, self.world_size, self.shared.ring_threshold_bytes)
    }
}
