//! [`MpiGroup`]: a process group whose ranks are MPI processes, on one
//! machine or many (feature `mpi`).
//!
//! MPI (Open MPI or any other implementation of the standard, through the
//! `mpi` crate) starts the processes and moves the bytes; this module adds
//! what [`ProcessGroup`] promises on top: the thread group's exact
//! reduction order (so results are bitwise those of [`ThreadGroup`] for the
//! same inputs), agreement on errors, every dtype collectives support
//! (f16 and bf16 included, which MPI has no type for), timeouts, and no
//! hang when a rank fails.
//!
//! [`ThreadGroup`]: crate::comm::ThreadGroup

mod engine;
mod message_bytes;
mod subgroups;
mod wire;

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use crossbeam::channel::{self, Receiver, Sender};

use self::engine::{Control, Job, Kind, Reply, Ticket};
use super::buffer::{Buffer, Input};
use super::op::Op;
use super::protocol::{self, OpSig, Signature, TensorMeta};
use super::{
    Color, CommError, Failure, FailureCause, GroupOptions, Membership, ProcessGroup, ReduceOp,
    Result, SubGroup,
};
use crate::util::lock::lock;

/// The most bytes one message carries: MPI counts are `int`s, and a header
/// travels with the data.
const MAX_MESSAGE_BYTES: usize = i32::MAX as usize - 64 * 1024;

fn too_large(bytes: usize) -> String {
    format!(
        "{bytes} bytes is more than MPI moves in one message ({MAX_MESSAGE_BYTES}); split the tensor"
    )
}

/// How long a call waits for the engine past its own timeout before it
/// concludes the engine is stuck inside MPI.
const ENGINE_GRACE: Duration = Duration::from_secs(5);

/// How long leaving a failed group waits for the engine to send this
/// rank's failure to the others (the process usually exits right after).
const NOTICE_GRACE: Duration = Duration::from_secs(2);

/// Why [`MpiGroup::init`] failed.
#[derive(Debug, thiserror::Error)]
pub enum MpiInitError {
    /// MPI can be initialized once per process, and this process already
    /// did (through an earlier [`MpiGroup::init`] or other code).
    #[error("MPI is already initialized in this process: one MpiGroup per process")]
    AlreadyInitialized,
    /// MPI did not start.
    #[error("MPI did not start: {0}")]
    Failed(String),
}

/// State shared by a process's handle and its MPI engine thread.
pub(crate) struct Shared {
    /// The first failure this process knows of (its own, or one that
    /// another rank announced).
    failure: OnceLock<Failure>,
    ring_threshold_bytes: usize,
}

impl Shared {
    fn fail(&self, failure: Failure) {
        let _first = self.failure.set(failure);
    }

    fn failure(&self) -> Option<Failure> {
        self.failure.get().cloned()
    }
}

/// This process's rank of the MPI job (`MPI_COMM_WORLD`); implements
/// [`ProcessGroup`], so [`DistributedDataParallel`](crate::DistributedDataParallel)
/// and every collective work across processes and machines unchanged.
///
/// Start the processes with `mpirun` (or `srun`); [`crate::launch::run`]
/// creates the group when the program runs under it, so one program works
/// with thread ranks and with processes. Create at most one per process:
/// MPI is initialized by the first [`MpiGroup::init`] and finalized by
/// [`MpiGroup::leave`] or when the last clone of the `Arc` is dropped
/// (which waits for the other ranks to finish too, as `MPI_Finalize` does).
/// Payloads travel in the machine's byte order: every machine of a job
/// must share it (all current x86-64 and ARM64 clusters do).
///
/// **What matches [`ThreadGroup`](crate::comm::ThreadGroup)**: the
/// reduction order (rank order below
/// [`GroupOptions::ring_threshold_bytes`], the ring's order above it), so
/// the results are bitwise identical for the same inputs; the errors for
/// calls that do not fit together; the timeout.
///
/// **What differs**:
/// - Tensors travel through host memory (a CUDA tensor is copied to the
///   host and back); results of `scatter` on ranks other than the root are
///   on the CPU, since the root's device does not exist in other processes.
/// - Small payloads travel with the header that opens each collective, so
///   `broadcast`, `all_gather` and `gather` send the data directly to each
///   rank (fine for a few ranks; large reductions use the ring).
/// - **Failures**: when a rank fails (its code calls
///   [`abort`](ProcessGroup::abort), panics with a handle alive, or times
///   out), it sends every other rank a notice, and their pending and later
///   collectives return [`CommError::GroupFailed`] naming it. A rank that
///   dropped its group after `n` collectives makes a later collective of
///   the others fail naming it. A process that dies (killed, crashed
///   outside Rust) is MPI's to handle: `mpirun` ends the whole job and
///   names the rank. After a failure the group is unusable and MPI is not
///   finalized, so `mpirun` reports the job as failed.
/// - Large reductions read the tensors where they lie, under their storage's
///   read lock, until MPI has sent them. If a peer fails mid-collective,
///   MPI may never complete those sends: the tensors passed to the failed
///   call stay read-locked (reading them still works; writing them, e.g.
///   `Var::set`, would block). End the process after a group failure, as
///   `mpirun` expects anyway.
///
/// ```no_run
/// use candle_core::{Device, Tensor};
/// use candle_dp::comm::{GroupOptions, MpiGroup, ProcessGroup, ReduceOp};
///
/// // mpirun -np 2 target/release/examples/...
/// let pg = MpiGroup::init(GroupOptions::default())?;
/// let x = Tensor::new(&[pg.rank() as f32], &Device::Cpu)?;
/// let sum = pg.all_reduce(&x, ReduceOp::Sum)?;
/// assert_eq!(sum.to_vec1::<f32>()?, vec![(0..pg.world_size()).sum::<usize>() as f32]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct MpiGroup {
    membership: Membership,
    shared: Arc<Shared>,
    /// The number of collectives this rank has entered; its lock
    /// serializes the calls of this handle.
    calls: Mutex<u64>,
    control: Sender<Control>,
    engine: Mutex<Option<JoinHandle<()>>>,
    /// Whether this rank has left (see [`MpiGroup::leave`]).
    left: AtomicBool,
    /// The engine's communicator: 0 for `MPI_COMM_WORLD`, else a
    /// sub-group's (see [`ProcessGroup::split`]).
    comm: usize,
    /// This group's ranks as world ranks, which failures name.
    world_ranks: Arc<Vec<usize>>,
}

impl fmt::Debug for MpiGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MpiGroup")
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .field("failure", &self.shared.failure())
            .finish_non_exhaustive()
    }
}

impl MpiGroup {
    /// Initializes MPI (on a thread of its own, which makes every MPI call
    /// of the process) and returns this process's handle on
    /// `MPI_COMM_WORLD`. `options` must be the same on every rank.
    ///
    /// # Errors
    ///
    /// [`MpiInitError::AlreadyInitialized`] on a second call in one
    /// process; [`MpiInitError::Failed`] when MPI does not start.
    pub fn init(options: GroupOptions) -> std::result::Result<Arc<MpiGroup>, MpiInitError> {
        static STARTED: OnceLock<()> = OnceLock::new();
        if STARTED.set(()).is_err() {
            return Err(MpiInitError::AlreadyInitialized);
        }
        let shared = Arc::new(Shared {
            failure: OnceLock::new(),
            ring_threshold_bytes: options.ring_threshold_bytes,
        });
        let (control, requests): (Sender<Control>, Receiver<Control>) = channel::unbounded();
        let (started_tx, started_rx) = channel::bounded(1);
        let engine_shared = Arc::clone(&shared);
        let engine = thread::Builder::new()
            .name("candle-dp-mpi".into())
            .spawn(move || engine::run(engine_shared, requests, started_tx))
            .map_err(|e| MpiInitError::Failed(format!("could not start its thread: {e}")))?;
        let (rank, world_size) = match started_rx.recv() {
            Ok(Ok(started)) => started,
            Ok(Err(reason)) if reason.contains("already") => {
                return Err(MpiInitError::AlreadyInitialized)
            }
            Ok(Err(reason)) => return Err(MpiInitError::Failed(reason)),
            Err(_) => {
                return Err(MpiInitError::Failed(
                    "its thread stopped while initializing".into(),
                ))
            }
        };
        Ok(Arc::new(MpiGroup {
            membership: Membership::new(rank, world_size, options.timeout),
            shared,
            calls: Mutex::new(0),
            control,
            engine: Mutex::new(Some(engine)),
            left: AtomicBool::new(false),
            comm: 0,
            world_ranks: Arc::new((0..world_size).collect()),
        }))
    }

    /// This rank as a world rank.
    fn world_rank(&self) -> usize {
        self.world_ranks
            .get(self.rank())
            .copied()
            .unwrap_or(self.rank())
    }

    /// Leaves the group now, as dropping the last handle would, even if
    /// clones of the handle live on (in a trained model returned by the
    /// rank's function, say): the other ranks' later collectives fail
    /// naming this rank instead of waiting for it, MPI is finalized if the
    /// group is healthy (which waits for the other ranks to finish), and
    /// later calls on this handle fail. [`crate::launch::run`] calls it when
    /// the rank's function returns.
    pub fn leave(&self) {
        if self.left.swap(true, Ordering::SeqCst) {
            return;
        }
        if self.comm != 0 {
            // A sub-group's handle: the process stays in the job, and the
            // communicator goes (after a shutdown nobody reads this).
            if thread::panicking() {
                self.fail(FailureCause::Panicked);
            }
            let _ = self.control.send(Control::Free(self.comm));
            return;
        }
        if thread::panicking() {
            self.fail(FailureCause::Panicked);
        }
        let (ack, done) = channel::bounded(1);
        let _ = self.control.send(Control::Shutdown(ack));
        if self.shared.failure().is_none() {
            // A healthy group finalizes MPI, which waits for every rank.
            let _ = done.recv();
            if let Some(engine) = lock(&self.engine).take() {
                let _ = engine.join();
            }
        } else {
            // A failed one may have left its engine waiting on a dead peer:
            // only the notices are waited for, briefly.
            let _ = done.recv_timeout(NOTICE_GRACE);
        }
    }

    /// Runs one collective on the engine and waits for its result.
    fn call(&self, sig: Signature, kind: Kind) -> Result<Reply> {
        let op = sig.op.name();
        let mut calls = lock(&self.calls);
        if let Some(failure) = self.shared.failure() {
            return Err(self.group_failed(op, failure));
        }
        if self.left.load(Ordering::SeqCst) {
            let failure = Failure {
                rank: self.world_rank(),
                cause: FailureCause::Left,
            };
            return Err(self.group_failed(op, failure));
        }
        // Point-to-point calls are not collectives: they do not count in
        // the sequence every rank's collectives share.
        if !matches!(kind, Kind::Send { .. } | Kind::Recv { .. }) {
            *calls += 1;
        }
        let timeout = self.timeout();
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        let (reply, result) = channel::bounded(1);
        let ticket = Ticket {
            comm: self.comm,
            seq: *calls,
            op,
            deadline,
            timeout,
        };
        let job = Job {
            ticket,
            sig,
            kind,
            reply,
        };
        if self.control.send(Control::Call(job)).is_err() {
            return Err(self.engine_gone(op));
        }
        let answer = match deadline.and_then(|d| d.checked_add(ENGINE_GRACE)) {
            Some(limit) => result.recv_deadline(limit).map_err(|e| e.is_timeout()),
            None => result.recv().map_err(|_| false),
        };
        match answer {
            Ok(answer) => answer,
            Err(true) => {
                let missing: Vec<usize> = (0..self.world_size())
                    .filter(|&r| r != self.rank())
                    .collect();
                self.fail(FailureCause::TimedOut {
                    op,
                    missing: missing.iter().map(|&r| self.world_ranks[r]).collect(),
                });
                Err(CommError::Timeout {
                    rank: self.rank(),
                    op,
                    timeout: timeout.unwrap_or_default(),
                    missing,
                })
            }
            Err(false) => Err(self.engine_gone(op)),
        }
    }

    fn fail(&self, cause: FailureCause) {
        self.shared.fail(Failure {
            rank: self.world_rank(),
            cause,
        });
        let _ = self.control.send(Control::Abort);
    }

    fn group_failed(&self, op: &'static str, failure: Failure) -> CommError {
        CommError::GroupFailed {
            rank: self.rank(),
            op,
            failure,
        }
    }

    fn engine_gone(&self, op: &'static str) -> CommError {
        self.fail(FailureCause::Aborted(
            "its MPI engine thread stopped".into(),
        ));
        let failure = self.shared.failure().unwrap_or(Failure {
            rank: self.world_rank(),
            cause: FailureCause::Aborted("its MPI engine thread stopped".into()),
        });
        self.group_failed(op, failure)
    }

    /// Into how many messages a reduction of `tensor` splits: the ring's
    /// chunks (as the engine decides, from the size and the threshold), or
    /// one.
    fn reduction_parts(&self, tensor: &Tensor) -> usize {
        self.reduction_parts_of(protocol::tensor_bytes(tensor))
    }

    /// Into how many parts a reduction of `bytes` is cut (the ring's
    /// chunks), so that each message stays within MPI's counts.
    fn reduction_parts_of(&self, bytes: usize) -> usize {
        if protocol::takes_ring(bytes, self.world_size(), self.shared.ring_threshold_bytes) {
            self.world_size()
        } else {
            1
        }
    }

    /// An all-reduce of data described by `meta`: at or above the ring
    /// threshold the engine reads `input()` where its tensors lie (see
    /// `Kind::ReduceParts`); below it, `copy()` travels with the header.
    fn all_reduce_of(
        &self,
        op: ReduceOp,
        meta: TensorMeta,
        input: impl FnOnce() -> std::result::Result<Input, String>,
        copy: impl FnOnce() -> std::result::Result<Buffer, String>,
    ) -> Result<Buffer> {
        let elem = meta.dtype.size_in_bytes();
        let bytes = meta.dims.iter().product::<usize>().saturating_mul(elem);
        let parts = self.reduction_parts_of(bytes);
        let checked = checked_size(&meta, parts);
        let (kind, invalid) = if parts > 1 {
            match checked.and_then(|()| input()) {
                Ok(input) => {
                    let dtype = meta.dtype;
                    (Kind::ReduceParts { op, input, dtype }, None)
                }
                Err(e) => (
                    Kind::Reduce {
                        op,
                        root: None,
                        data: None,
                    },
                    Some(e),
                ),
            }
        } else {
            let data = checked.and_then(|()| copy());
            let invalid = data.as_ref().err().cloned();
            let kind = Kind::Reduce {
                op,
                root: None,
                data: data.ok(),
            };
            (kind, invalid)
        };
        let sig = signature(OpSig::AllReduce(op), Some(meta), invalid);
        match self.call(sig, kind)? {
            Reply::One(buffer, _) => Ok(buffer),
            _ => Err(self.wrong_reply(Op::AllReduce)),
        }
    }

    fn root_error(&self, root: usize) -> Option<String> {
        protocol::root_error(root, self.world_size())
    }

    fn tensor_error(&self, op: Op, source: candle_core::Error) -> CommError {
        CommError::Tensor {
            rank: self.rank(),
            op: op.as_str(),
            source,
        }
    }

    /// The collective's result as a tensor shaped like `like`.
    fn one(&self, op: Op, reply: Reply, like: &Tensor) -> Result<Tensor> {
        match reply {
            Reply::One(buffer, _) => buffer
                .into_tensor(like.dims(), like.device())
                .map_err(|e| self.tensor_error(op, e)),
            _ => Err(self.wrong_reply(op)),
        }
    }

    fn many(&self, op: Op, reply: Reply, like: &Tensor) -> Result<Vec<Tensor>> {
        match reply {
            Reply::Many(buffers) => buffers
                .into_iter()
                .map(|b| b.into_tensor(like.dims(), like.device()))
                .collect::<candle_core::Result<_>>()
                .map_err(|e| self.tensor_error(op, e)),
            _ => Err(self.wrong_reply(op)),
        }
    }

    fn wrong_reply(&self, op: Op) -> CommError {
        CommError::Protocol {
            rank: self.rank(),
            op: op.as_str(),
            peer: self.rank(),
            detail: "the engine answered with the wrong kind of result".into(),
        }
    }
}

/// A tensor's host copy and its signature, or why it cannot be sent in
/// messages of at most `1 / parts` of it (the ring's chunks).
fn host_copy_in(
    tensor: &Tensor,
    parts: usize,
) -> (Option<TensorMeta>, std::result::Result<Buffer, String>) {
    let meta = TensorMeta::of(tensor);
    let data = checked_size(&meta, parts).and_then(|()| Buffer::from_tensor(tensor));
    (Some(meta), data)
}

/// Refuses data of `meta` whose largest message, sent in `parts` parts,
/// would not fit MPI's counts.
fn checked_size(meta: &TensorMeta, parts: usize) -> std::result::Result<(), String> {
    let elem = meta.dtype.size_in_bytes();
    let bytes = meta.dims.iter().product::<usize>().saturating_mul(elem);
    let largest_message = bytes.div_ceil(parts.max(1)) + elem;
    if largest_message > MAX_MESSAGE_BYTES {
        Err(too_large(bytes))
    } else {
        Ok(())
    }
}

/// [`host_copy_in`] for data that travels whole.
fn host_copy(tensor: &Tensor) -> (Option<TensorMeta>, std::result::Result<Buffer, String>) {
    host_copy_in(tensor, 1)
}

fn signature(op: OpSig, meta: Option<TensorMeta>, invalid: Option<String>) -> Signature {
    Signature { op, meta, invalid }
}

impl ProcessGroup for MpiGroup {
    fn membership(&self) -> &Membership {
        &self.membership
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let meta = TensorMeta::of(tensor);
        let reduced = self.all_reduce_of(
            op,
            meta,
            || Input::new(tensor),
            || Buffer::from_tensor(tensor),
        )?;
        reduced
            .into_tensor(tensor.dims(), tensor.device())
            .map_err(|e| self.tensor_error(Op::AllReduce, e))
    }

    fn all_reduce_concat(&self, tensors: &[Tensor], op: ReduceOp) -> Result<Tensor> {
        let Some(first) = tensors.first() else {
            return super::all_reduce_concat_copied(self, tensors, op);
        };
        let dtype = first.dtype();
        let len = tensors.iter().map(Tensor::elem_count).sum();
        let meta = TensorMeta {
            dtype,
            dims: vec![len],
        };
        let reduced = self.all_reduce_of(
            op,
            meta,
            || Input::concat(tensors, dtype),
            || Buffer::concat(tensors, dtype),
        )?;
        reduced
            .into_tensor(&[len], first.device())
            .map_err(|e| self.tensor_error(Op::AllReduce, e))
    }

    /// Below the ring threshold, the all-reduce (its rank order). Above
    /// it, the ring's reduce-scatter, after which each rank sends every
    /// other only the part of its reduced chunk in that rank's piece:
    /// about half the bytes of the all-reduce, the same bytes as its
    /// slice.
    fn reduce_scatter(&self, tensor: &Tensor, op: ReduceOp, counts: &[usize]) -> Result<Tensor> {
        let bytes = protocol::tensor_bytes(tensor);
        if !protocol::takes_ring(bytes, self.world_size(), self.shared.ring_threshold_bytes) {
            return super::shards::reduce_scatter_by_all_reduce(self, tensor, op, counts);
        }
        let piece = super::shards::agree_on_split(self, tensor, counts)?;
        let meta = TensorMeta {
            dtype: tensor.dtype(),
            dims: vec![tensor.elem_count()],
        };
        // The ring's messages are its chunks, as the all-reduce's.
        let data =
            checked_size(&meta, self.world_size()).and_then(|()| Buffer::from_tensor(tensor));
        let invalid = data.as_ref().err().cloned();
        let kind = Kind::ReduceScatter {
            op,
            data: data.ok(),
            counts: counts.to_vec(),
        };
        let sig = signature(OpSig::AllReduce(op), Some(meta), invalid);
        match self.call(sig, kind)? {
            Reply::One(buffer, _) => buffer
                .into_tensor(&[piece.len()], tensor.device())
                .map_err(|e| self.tensor_error(Op::AllReduce, e)),
            _ => Err(self.wrong_reply(Op::AllReduce)),
        }
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Tensor> {
        let (meta, data) = if self.rank() == root {
            host_copy(tensor)
        } else {
            (Some(TensorMeta::of(tensor)), Err(String::new()))
        };
        let invalid = self.root_error(root).or_else(|| {
            (self.rank() == root)
                .then(|| data.as_ref().err().cloned())
                .flatten()
        });
        let sig = signature(OpSig::Broadcast { root }, meta, invalid);
        let reply = self.call(
            sig,
            Kind::Broadcast {
                root,
                data: data.ok(),
            },
        )?;
        self.one(Op::Broadcast, reply, tensor)
    }

    fn all_gather(&self, tensor: &Tensor) -> Result<Vec<Tensor>> {
        let (meta, data) = host_copy(tensor);
        let sig = signature(OpSig::AllGather, meta, data.as_ref().err().cloned());
        let reply = self.call(sig, Kind::AllGather { data: data.ok() })?;
        self.many(Op::AllGather, reply, tensor)
    }

    fn gather(&self, tensor: &Tensor, root: usize) -> Result<Option<Vec<Tensor>>> {
        let (meta, data) = host_copy(tensor);
        let invalid = self.root_error(root).or(data.as_ref().err().cloned());
        let sig = signature(OpSig::Gather { root }, meta, invalid);
        match self.call(
            sig,
            Kind::Gather {
                root,
                data: data.ok(),
            },
        )? {
            Reply::Nothing => Ok(None),
            reply => self.many(Op::Gather, reply, tensor).map(Some),
        }
    }

    fn scatter(&self, tensors: Option<&[Tensor]>, root: usize) -> Result<Tensor> {
        let parts = protocol::scatter_parts(tensors, self.rank(), root, self.world_size(), |t| {
            let (_, data) = host_copy(t);
            data.map(|d| (d, t.dims().to_vec()))
        });
        let invalid = self.root_error(root).or(parts.as_ref().err().cloned());
        let sig = signature(OpSig::Scatter { root }, None, invalid);
        let reply = self.call(
            sig,
            Kind::Scatter {
                root,
                parts: parts.unwrap_or_default(),
            },
        )?;
        let Reply::One(buffer, dims) = reply else {
            return Err(self.wrong_reply(Op::Scatter));
        };
        // The root's own part stays on its tensor's device; the others' on
        // the CPU, as other processes cannot name the root's device.
        let device = match tensors {
            Some(tensors) if self.rank() == root => tensors
                .get(root)
                .map_or(Device::Cpu, |t| t.device().clone()),
            _ => Device::Cpu,
        };
        buffer
            .into_tensor(&dims, &device)
            .map_err(|e| self.tensor_error(Op::Scatter, e))
    }

    fn reduce(&self, tensor: &Tensor, root: usize, op: ReduceOp) -> Result<Option<Tensor>> {
        let (meta, data) = host_copy_in(tensor, self.reduction_parts(tensor));
        let invalid = self.root_error(root).or(data.as_ref().err().cloned());
        let sig = signature(OpSig::Reduce { root, op }, meta, invalid);
        let kind = Kind::Reduce {
            op,
            root: Some(root),
            data: data.ok(),
        };
        match self.call(sig, kind)? {
            Reply::Nothing => Ok(None),
            reply => self.one(Op::Reduce, reply, tensor).map(Some),
        }
    }

    fn barrier(&self) -> Result<()> {
        self.call(signature(OpSig::Barrier, None, None), Kind::Barrier)
            .map(drop)
    }

    fn all_gather_bytes(&self, bytes: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        let invalid = (bytes.len() > MAX_MESSAGE_BYTES).then(|| too_large(bytes.len()));
        let data = invalid.is_none().then_some(Buffer::U8(bytes));
        let sig = signature(OpSig::AllGatherBytes, None, invalid);
        let reply = self.call(sig, Kind::AllGather { data })?;
        let Reply::Many(buffers) = reply else {
            return Err(self.wrong_reply(Op::AllGatherBytes));
        };
        buffers
            .into_iter()
            .enumerate()
            .map(|(src, buffer)| match buffer {
                Buffer::U8(bytes) => Ok(bytes),
                _ => Err(CommError::Protocol {
                    rank: self.rank(),
                    op: Op::AllGatherBytes.as_str(),
                    peer: src,
                    detail: "its data are not bytes".into(),
                }),
            })
            .collect()
    }

    fn abort(&self, reason: &str) {
        self.fail(FailureCause::Aborted(reason.to_string()));
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

    fn failure(&self) -> Option<Failure> {
        self.shared.failure()
    }
}

impl Drop for MpiGroup {
    fn drop(&mut self) {
        self.leave();
    }
}
