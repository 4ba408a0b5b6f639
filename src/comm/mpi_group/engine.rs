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
use crate::comm::buffer::{
    chunk_range, combine_into, combine_into_finished, combine_over, combine_over_finished,
    match_dtype, part_lens, read_parts, reduce_in_rank_order, Buffer, Input,
};
use crate::comm::protocol::{self, Signature};
use crate::comm::{CommError, Failure, FailureCause, ReduceOp};

const TAG_HEADER: i32 = 1;
const TAG_DATA: i32 = 2;
const TAG_NOTICE: i32 = 3;

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

/// What a handle asks of the engine.
pub(super) enum Control {
    /// Run a collective.
    Call(Job),
    /// This rank has failed (recorded in [`Shared`]): tell the others.
    Abort,
    /// The last handle is gone: leave the group and finalize MPI, then
    /// answer on the channel.
    Shutdown(Sender<()>),
}

/// Which collective call of this rank, and its time limit.
#[derive(Clone, Copy)]
pub(super) struct Ticket {
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
        data: world.duplicate(),
        notices: world.duplicate(),
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
    let ack = engine.shutdown.take();
    // A failure a peer already announced must not be finalized over.
    engine.receive_notices();
    if engine.shared.failure().is_none() {
        engine.announce(&Notice::Left {
            seq: engine.completed,
        });
        drop(engine);
        drop(world);
        // `MPI_Finalize`, which waits for the other ranks to finalize.
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
    rank: usize,
    world_size: usize,
    /// Headers and data.
    data: SimpleCommunicator,
    /// Failure and departure notices, apart so they never match data.
    notices: SimpleCommunicator,
    shared: Arc<Shared>,
    control: Receiver<Control>,
    /// For each rank that left the group: how many collectives it completed.
    left: Vec<Option<u64>>,
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
                Ok(Control::Abort) => self.announce_own_failure(),
                Ok(Control::Shutdown(ack)) => self.shutdown = Some(ack),
                Err(RecvTimeoutError::Timeout) => self.receive_notices(),
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
        self.current = Some(Current {
            ticket,
            reply: Some(reply),
            waiting_for: Vec::new(),
        });
        match self.collective(sig, kind) {
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

    fn others(&self) -> impl Iterator<Item = usize> {
        let me = self.rank;
        (0..self.world_size).filter(move |&r| r != me)
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
            } => data.len().saturating_mul(data.dtype().size_in_bytes()),
            Kind::ReduceParts { input, dtype, .. } => {
                input.len().saturating_mul(dtype.size_in_bytes())
            }
            _ => return false,
        };
        protocol::takes_ring(bytes, self.world_size, self.shared.ring_threshold_bytes)
    }

    /// Sends this rank's header (with what payload each destination needs)
    /// to every other rank and receives theirs: `headers[src]`, `None` for
    /// this rank.
    fn exchange_headers(
        &mut self,
        sig: &Signature,
        kind: &Kind,
        ring: bool,
        parts: Option<&[usize]>,
    ) -> Result<Vec<Option<wire::Header>>, Stop> {
        let me = self.rank;
        let seq = self.seq();
        // What `dst` gets with the header.
        let payload_for = |dst: usize| -> Option<(&Buffer, Option<&[usize]>)> {
            match kind {
                Kind::Reduce { data, root, .. } if !ring && root.is_none_or(|r| r == dst) => {
                    data.as_ref().map(|d| (d, None))
                }
                Kind::Broadcast { root, data } if *root == me => data.as_ref().map(|d| (d, None)),
                Kind::AllGather { data } => data.as_ref().map(|d| (d, None)),
                Kind::Gather { root, data } if *root == dst => data.as_ref().map(|d| (d, None)),
                Kind::Scatter { root, parts } if *root == me => {
                    parts.get(dst).map(|(b, dims)| (b, Some(dims.as_slice())))
                }
                _ => None,
            }
        };
        // Destinations that get the same payload share one message.
        let same_for_all = !matches!(kind, Kind::Scatter { .. } | Kind::Gather { .. })
            && !matches!(kind, Kind::Reduce { root: Some(_), .. });
        let messages: Vec<(usize, Vec<u8>)> = if same_for_all {
            let message = self
                .others()
                .next()
                .map(|dst| wire::encode_header(seq, sig, payload_for(dst), parts))
                .unwrap_or_default();
            vec![(usize::MAX, message)]
        } else {
            self.others()
                .map(|dst| (dst, wire::encode_header(seq, sig, payload_for(dst), parts)))
                .collect()
        };
        let message_for = |dst: usize| -> &[u8] {
            messages
                .iter()
                .find(|(d, _)| *d == dst || *d == usize::MAX)
                .map_or(&[][..], |(_, m)| m.as_slice())
        };
        let mut headers: Vec<Option<wire::Header>> = (0..self.world_size).map(|_| None).collect();
        let mut missing: Vec<usize> = self.others().collect();
        mpi::request::scope(|scope| {
            let sends: Vec<_> = self
                .others()
                .map(|dst| {
                    self.data
                        .process_at_rank(dst as i32)
                        .immediate_send_with_tag(scope, message_for(dst), TAG_HEADER)
                })
                .map(sending)
                .collect();
            self.wait(sends, |engine| {
                engine.receive_headers(&mut missing, &mut headers)?;
                Ok(missing.is_empty())
            })
        })?;
        Ok(headers)
    }

    /// Receives the headers that have arrived from the ranks in `missing`.
    fn receive_headers(
        &mut self,
        missing: &mut Vec<usize>,
        headers: &mut [Option<wire::Header>],
    ) -> Result<(), CommError> {
        let mut still = Vec::with_capacity(missing.len());
        for &src in missing.iter() {
            let probed = self
                .data
                .process_at_rank(src as i32)
                .immediate_matched_probe_with_tag(TAG_HEADER);
            let Some(matched) = probed else {
                still.push(src);
                continue;
            };
            let (message, _) = matched.matched_receive_vec::<u8>();
            let header =
                wire::decode_header(&message).map_err(|detail| self.unexpected(src, detail))?;
            if header.seq != self.seq() {
                return Err(self.unexpected(
                    src,
                    format!(
                        "it belongs to its collective #{}, this rank is in #{}",
                        header.seq,
                        self.seq()
                    ),
                ));
            }
            headers[src] = Some(header);
        }
        *missing = still;
        if let Some(current) = self.current.as_mut() {
            current.waiting_for.clone_from(missing);
        }
        Ok(())
    }

    /// A reduction by the ring algorithm: `Some(result)` on every rank
    /// (`root: None`) or on the root only. It works in `data` itself: the
    /// reduced chunks and the chunks received in the all-gather overwrite
    /// this rank's input, so the result costs no allocation or copy.
    fn ring_reduce(
        &mut self,
        data: Buffer,
        op: ReduceOp,
        root: Option<usize>,
    ) -> Result<Option<Buffer>, Stop> {
        fn typed<T: Wire>(
            engine: &mut Engine,
            data: Buffer,
            op: ReduceOp,
            root: Option<usize>,
        ) -> Result<Option<Buffer>, Stop> {
            let mut x = T::vec_of(data)
                .map_err(|_| engine.unexpected(engine.rank, "a buffer of another type".into()))?;
            engine.reduce_scatter(&mut x, op)?;
            let whole = match root {
                None => {
                    // SAFETY: only MPI writes through it, whole received bytes.
                    engine.ring_all_gather(unsafe { as_receivable(&mut x) })?;
                    true
                }
                Some(root) => engine.gather_chunks(&mut x, root)?,
            };
            Ok(whole.then(|| T::into_buffer(x)))
        }
        match_dtype!(data.dtype(), T => typed::<T>(self, data, op, root), _ => {
            Err(self.unexpected(self.rank, format!("unsupported dtype {}", data.dtype().as_str())).into())
        })
    }

    /// The ring on this rank's tensors where they lie (`Kind::ReduceParts`;
    /// every rank's parts have the lengths `lens`): the reduce-scatter
    /// sends its first chunk straight from the tensors and adds each
    /// received partial result to the tensors' elements into the result,
    /// then the all-gather runs as in [`ring_reduce`](Engine::ring_reduce).
    /// Same messages' contents and reduction order as on the concatenation.
    fn ring_reduce_parts(
        &mut self,
        input: &Input,
        dtype: DType,
        lens: &[usize],
        op: ReduceOp,
    ) -> Result<Option<Buffer>, Stop> {
        fn typed<T: Wire>(
            engine: &mut Engine,
            input: &Input,
            lens: &[usize],
            op: ReduceOp,
        ) -> Result<Option<Buffer>, Stop> {
            // A ring of one rank would leave the result unwritten; no path
            // takes the ring then (`protocol::takes_ring`), and this keeps
            // the `set_len` below from depending on it.
            if engine.world_size < 2 {
                let detail = "a ring of a single rank".into();
                return Err(engine.unexpected(engine.rank, detail).into());
            }
            // Every element is received before it is read, so the result
            // is not zero-filled first (see `message_bytes`).
            let len = lens.iter().sum();
            let mut x: Vec<T> = Vec::with_capacity(len);
            let result = &mut x.spare_capacity_mut()[..len];
            let scattered = read_parts::<T, _>(input, |parts| {
                engine.reduce_scatter_parts(parts, lens, result, op)
            });
            match scattered {
                Ok(done) => done?,
                Err(part) => {
                    let detail = format!("its part {part} holds no {} elements", T::DTYPE.as_str());
                    return Err(engine.unexpected(engine.rank, detail).into());
                }
            }
            engine.ring_all_gather(result)?;
            // SAFETY: the chunks tile the buffer; chunk `rank` was received
            // (its last step) and reduced, every other chunk received by
            // the all-gather, whose receives have completed.
            unsafe { x.set_len(len) };
            Ok(Some(T::into_buffer(x)))
        }
        match_dtype!(dtype, T => typed::<T>(self, input, lens, op), _ => {
            Err(self.unexpected(self.rank, format!("unsupported dtype {}", dtype.as_str())).into())
        })
    }

    /// [`reduce_scatter`](Engine::reduce_scatter) with this rank's data in
    /// `parts` (lengths `lens`, the same on every rank) instead of in `x`:
    /// leaves chunk `rank` of `x` reduced and finished. The first step's
    /// chunk travels as one message per part it overlaps, later steps'
    /// partial results as one.
    fn reduce_scatter_parts<T: Wire>(
        &mut self,
        parts: &[&[T]],
        lens: &[usize],
        x: &mut [MaybeUninit<T>],
        op: ReduceOp,
    ) -> Result<(), Stop> {
        let (r, w) = (self.rank, self.world_size);
        let (next, prev) = ((r + 1) % w, (r + w - 1) % w);
        let len = x.len();
        let chunk = |c: usize| chunk_range(len, w, c);
        for step in 0..w - 1 {
            let send_chunk = (r + 2 * w - 1 - step) % w;
            let recv_chunk = (r + 2 * w - 2 - step) % w;
            let cuts_in = cuts(lens, chunk(recv_chunk));
            {
                let mut chunks = split_chunks(x, w);
                let (partial, recv) = pair(&mut chunks, send_chunk, recv_chunk);
                let sends: Vec<&[MessageByte]> = if step == 0 {
                    cuts(lens, chunk(send_chunk))
                        .into_iter()
                        .map(|(part, local, _)| sent(&parts[part][local]))
                        .collect()
                } else {
                    // SAFETY: received in the step before, and reduced.
                    vec![sent(unsafe { assume_received_ref(partial) })]
                };
                // `prev` cuts its first chunk as this rank cuts the same chunk.
                let recv_at = chunk(recv_chunk).start;
                let receives: Vec<&mut [MessageByte]> = if step == 0 && cuts_in.is_empty() {
                    Vec::new()
                } else if step == 0 {
                    split_at_cuts(recv, cuts_in.iter().map(|(_, _, at)| at.start - recv_at))
                        .into_iter()
                        .map(received)
                        .collect()
                } else {
                    vec![received(recv)]
                };
                self.step_many(&sends, next, receives, prev)?;
            }
            // The last step's chunk is this rank's: finished in the same pass.
            let last = step == w - 2;
            for (part, local, at) in cuts_in {
                // SAFETY: the step's receives, which covered the chunk, completed.
                let partial = unsafe { assume_received(&mut x[at]) };
                if last {
                    combine_into_finished(op, partial, &parts[part][local], w);
                } else {
                    combine_into(op, partial, &parts[part][local]);
                }
            }
        }
        Ok(())
    }

    /// The ring's reduce-scatter, in place: leaves chunk `rank` of `x`
    /// reduced over every rank as `((x_{c+1} ⊕ x_{c+2}) ⊕ …) ⊕ x_c` (the
    /// thread group's order), finished (`Avg` divided). The other chunks
    /// hold partial sums afterwards.
    fn reduce_scatter<T: Wire>(&mut self, x: &mut [T], op: ReduceOp) -> Result<(), Stop> {
        let (r, w) = (self.rank, self.world_size);
        let (next, prev) = ((r + 1) % w, (r + w - 1) % w);
        let len = x.len();
        let chunk = |c: usize| chunk_range(len, w, c);
        // Kept from call to call: fresh memory would cost a page fault per
        // page on every call (about as much as the copy into it).
        let mut scratch = std::mem::take(&mut self.scratch);
        for step in 0..w - 1 {
            // Chunk c starts at rank c+1 and ends, fully reduced, at rank c;
            // the chunk sent is the one reduced in the step before.
            let send_chunk = (r + 2 * w - 1 - step) % w;
            let recv_chunk = (r + 2 * w - 2 - step) % w;
            let received = typed_scratch::<T>(&mut scratch, chunk(recv_chunk).len());
            let stepped = self.step(&x[chunk(send_chunk)], next, received, prev);
            if let Err(stop) = stepped {
                self.scratch = scratch;
                return Err(stop);
            }
            // The last step's chunk is this rank's: finished in the same pass.
            if step == w - 2 {
                combine_over_finished(op, received, &mut x[chunk(recv_chunk)], w);
            } else {
                combine_over(op, received, &mut x[chunk(recv_chunk)]);
            }
        }
        self.scratch = scratch;
        Ok(())
    }

    /// The ring's all-gather, in place: every rank's reduced chunk into
    /// `x`, whose chunk `rank` is this rank's (the only one that needs to
    /// be initialised).
    fn ring_all_gather<T: Wire>(&mut self, x: &mut [MaybeUninit<T>]) -> Result<(), Stop> {
        let (r, w) = (self.rank, self.world_size);
        let (next, prev) = ((r + 1) % w, (r + w - 1) % w);
        let mut chunks = split_chunks(x, w);
        for step in 0..w - 1 {
            let send_chunk = (r + w - step) % w;
            let recv_chunk = (r + 2 * w - 1 - step) % w;
            let (send, recv) = pair(&mut chunks, send_chunk, recv_chunk);
            // SAFETY: this rank's chunk, or the one received in the step
            // before.
            let send = sent(unsafe { assume_received_ref(send) });
            self.step_many(&[send], next, vec![received(recv)], prev)?;
        }
        Ok(())
    }

    /// Every rank's reduced chunk to `root`, into its `x`; returns whether
    /// `x` now holds the whole result (on `root` only).
    fn gather_chunks<T: Wire>(&mut self, x: &mut [T], root: usize) -> Result<bool, Stop> {
        let w = self.world_size;
        if self.rank != root {
            let mine = &x[chunk_range(x.len(), w, self.rank)];
            mpi::request::scope(|scope| {
                let send = self
                    .data
                    .process_at_rank(root as i32)
                    .immediate_send_with_tag(scope, bytemuck::cast_slice::<T, u8>(mine), TAG_DATA);
                self.set_waiting_for(vec![root]);
                self.wait(vec![sending(send)], |_| Ok(true))
            })?;
            return Ok(false);
        }
        let mut chunks = split_chunks(x, w);
        let others: Vec<usize> = self.others().collect();
        mpi::request::scope(|scope| {
            let receives: Vec<_> = chunks
                .iter_mut()
                .enumerate()
                .filter(|(src, _)| *src != root)
                .map(|(src, chunk)| {
                    let bytes = bytemuck::cast_slice_mut::<T, u8>(chunk);
                    let len = bytes.len();
                    let request = self
                        .data
                        .process_at_rank(src as i32)
                        .immediate_receive_into_with_tag(scope, bytes, TAG_DATA);
                    receiving(request, src, len)
                })
                .collect();
            self.set_waiting_for(others);
            self.wait(receives, |_| Ok(true))
        })?;
        Ok(true)
    }

    /// One ring step: sends `send` to `to` while receiving `recv` from
    /// `from`.
    fn step<T: Wire>(
        &mut self,
        send: &[T],
        to: usize,
        recv: &mut [T],
        from: usize,
    ) -> Result<(), Stop> {
        // SAFETY: only MPI writes through it, whole received bytes.
        let recv = received(unsafe { as_receivable(recv) });
        self.step_many(&[sent(send)], to, vec![recv], from)
    }

    /// One ring step in several messages: sends each of `sends` to `to`,
    /// in order, while receiving `from`'s messages, in order, into
    /// `receives` (MPI keeps the order of messages between two ranks).
    fn step_many(
        &mut self,
        sends: &[&[MessageByte]],
        to: usize,
        receives: Vec<&mut [MessageByte]>,
        from: usize,
    ) -> Result<(), Stop> {
        self.set_waiting_for(vec![from]);
        mpi::request::scope(|scope| {
            let mut requests = Vec::with_capacity(sends.len() + receives.len());
            for &send in sends {
                requests.push(sending(
                    self.data
                        .process_at_rank(to as i32)
                        .immediate_send_with_tag(scope, send, TAG_DATA),
                ));
            }
            for recv in receives {
                let len = recv.len();
                let request = self
                    .data
                    .process_at_rank(from as i32)
                    .immediate_receive_into_with_tag(scope, recv, TAG_DATA);
                requests.push(receiving(request, from, len));
            }
            self.wait(requests, |_| Ok(true))
        })
    }

    fn set_waiting_for(&mut self, ranks: Vec<usize>) {
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
    fn wait<'a, D: ?Sized, S: Scope<'a>>(
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
    fn abandon<'a, D: ?Sized, S: Scope<'a>>(
        &mut self,
        error: CommError,
        mut pending: Vec<InFlight<'a, D, S>>,
    ) -> Stop {
        if self.shared.failure().is_none() {
            // Only a failed group may leave a collective half done.
            self.fail(Failure {
                rank: self.rank,
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
                Ok(Control::Abort) => self.announce_own_failure(),
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
    fn interruption(&mut self) -> Option<CommError> {
        self.receive_notices();
        if let Some(failure) = self.shared.failure() {
            if failure.rank == self.rank {
                self.announce_own_failure();
            }
            return Some(self.group_failed_for(self.op()));
        }
        let seq = self.seq();
        if let Some(gone) = (0..self.world_size).find(|&r| self.left[r].is_some_and(|s| s < seq)) {
            // It finished before entering this collective: it never will.
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
                rank: self.rank,
                cause: FailureCause::TimedOut {
                    op,
                    missing: missing.clone(),
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

    /// Records `failure` (unless the group already failed) and, if it is
    /// this rank's, tells the others.
    fn fail(&mut self, failure: Failure) {
        self.shared.fail(failure);
        self.announce_own_failure();
    }

    fn group_failed_for(&self, op: &'static str) -> CommError {
        let failure = self.shared.failure().unwrap_or(Failure {
            rank: self.rank,
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
    fn unexpected(&self, src: usize, detail: String) -> CommError {
        let op = self.op();
        self.shared.fail(Failure {
            rank: self.rank,
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
    fn announce_own_failure(&mut self) {
        let Some(failure) = self.shared.failure() else {
            return;
        };
        if self.announced || failure.rank != self.rank {
            return;
        }
        self.announced = true;
        self.announce(&Notice::failed(&failure));
    }

    fn announce(&self, notice: &Notice) {
        let bytes = notice.encode();
        for dst in self.others() {
            // A notice is far below MPI's eager limit (see `wire`): the
            // send returns without waiting for the receiver.
            self.notices
                .process_at_rank(dst as i32)
                .send_with_tag(&bytes[..], TAG_NOTICE);
        }
    }

    /// Takes in every notice that has arrived.
    fn receive_notices(&mut self) {
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
                        *slot = Some(seq);
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

/// A request in flight and, for a receive, what it must bring: MPI
/// completes the receive of a shorter message without an error and leaves
/// the rest of the buffer unwritten.
type InFlight<'a, D, S> = (Request<'a, D, S>, Option<Expected>);

/// A receive's source and the bytes it must bring.
#[derive(Debug, Clone, Copy)]
struct Expected {
    from: usize,
    bytes: usize,
}

/// A send: nothing to check on completion.
fn sending<'a, D: ?Sized, S: Scope<'a>>(request: Request<'a, D, S>) -> InFlight<'a, D, S> {
    (request, None)
}

/// A receive of exactly `bytes` bytes from rank `from`.
fn receiving<'a, D: ?Sized, S: Scope<'a>>(
    request: Request<'a, D, S>,
    from: usize,
    bytes: usize,
) -> InFlight<'a, D, S> {
    (request, Some(Expected { from, bytes }))
}

/// A completed receive that brought fewer bytes than expected.
#[derive(Debug, Clone, Copy)]
struct Short {
    expected: Expected,
    got: usize,
}

/// The requests still in flight, and the first completed receive that
/// came up short.
fn test_all<'a, D: ?Sized, S: Scope<'a>>(
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

/// Where `range` of a concatenation of parts of lengths `lens` lies: for
/// each part it overlaps (empty overlaps left out), the part, the range
/// within the part, and the range within the concatenation.
fn cuts(lens: &[usize], range: Range<usize>) -> Vec<(usize, Range<usize>, Range<usize>)> {
    let mut out = Vec::new();
    let mut start = 0;
    for (part, &n) in lens.iter().enumerate() {
        let at = range.start.max(start)..range.end.min(start + n);
        if !at.is_empty() {
            out.push((part, at.start - start..at.end - start, at));
        }
        start += n;
    }
    out
}

/// `values` cut at the offsets `starts` (ascending, the first 0) into
/// consecutive pieces; the last runs to the end.
fn split_at_cuts<T>(values: &mut [T], starts: impl Iterator<Item = usize>) -> Vec<&mut [T]> {
    let mut pieces = Vec::new();
    let mut rest = values;
    let mut consumed = 0;
    for start in starts.skip(1) {
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(start - consumed);
        pieces.push(head);
        rest = tail;
        consumed = start;
    }
    pieces.push(rest);
    pieces
}

/// `values` cut into the ring's `chunks` contiguous chunks.
fn split_chunks<T>(values: &mut [T], chunks: usize) -> Vec<&mut [T]> {
    let len = values.len();
    let mut rest = values;
    let mut out = Vec::with_capacity(chunks);
    for c in 0..chunks {
        let (head, tail) =
            std::mem::take(&mut rest).split_at_mut(chunk_range(len, chunks, c).len());
        out.push(head);
        rest = tail;
    }
    out
}

/// Chunk `a` to read and chunk `b` to write, `a != b`.
fn pair<'s, T>(chunks: &'s mut [&mut [T]], a: usize, b: usize) -> (&'s [T], &'s mut [T]) {
    if a < b {
        let (low, high) = chunks.split_at_mut(b);
        (&*low[a], &mut *high[0])
    } else {
        let (low, high) = chunks.split_at_mut(a);
        (&*high[0], &mut *low[b])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_tile_the_buffer_in_ring_order() {
        let mut values: Vec<u32> = (0..7).collect();
        let chunks = split_chunks(&mut values, 3);
        let lens: Vec<usize> = chunks.iter().map(|c| c.len()).collect();
        assert_eq!(lens, vec![3, 2, 2]);
        assert_eq!(chunks[2], &[5, 6]);
    }

    #[test]
    fn cuts_follow_the_parts_a_range_overlaps_and_skip_empty_ones() {
        // Parts [0, 3), [3, 3) (empty), [3, 7), [7, 9).
        let lens = [3, 0, 4, 2];
        assert_eq!(
            cuts(&lens, 2..8),
            vec![(0, 2..3, 2..3), (2, 0..4, 3..7), (3, 0..1, 7..8)]
        );
        assert_eq!(cuts(&lens, 4..6), vec![(2, 1..3, 4..6)]);
        assert!(cuts(&lens, 5..5).is_empty());
    }

    #[test]
    fn split_at_cuts_gives_consecutive_pieces_covering_the_slice() {
        let mut values: Vec<u32> = (0..6).collect();
        let pieces = split_at_cuts(&mut values, [0, 1, 4].into_iter());
        let pieces: Vec<Vec<u32>> = pieces.into_iter().map(|p| p.to_vec()).collect();
        assert_eq!(pieces, vec![vec![0], vec![1, 2, 3], vec![4, 5]]);
    }

    #[test]
    fn pair_gives_the_two_chunks_asked_for_in_either_order() {
        let mut values: Vec<u32> = (0..6).collect();
        let mut chunks = split_chunks(&mut values, 3);
        let (read, write) = pair(&mut chunks, 2, 0);
        assert_eq!(read, &[4, 5]);
        write.copy_from_slice(&[9, 9]);
        let (read, _) = pair(&mut chunks, 0, 1);
        assert_eq!(read, &[9, 9]);
    }
}
