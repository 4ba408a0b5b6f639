//! [`ThreadGroup`]: a process group whose ranks are threads of one process,
//! talking through crossbeam channels.

use std::convert::Infallible;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use candle_core::Tensor;
use crossbeam::channel::{self, Receiver, Sender, TryRecvError};
use crossbeam::select;

use super::buffer::{reduce_in_rank_order, Buffer, Input};
use super::protocol::{self, Body, Envelope, Header, OpSig, Piece, Signature, TensorMeta};
use super::ring::{self, Link};
use super::{CommError, Failure, FailureCause, ProcessGroup, ReduceOp, Result};
use crate::lock::lock;

/// The default of [`GroupOptions::ring_threshold_bytes`]: 64 KiB.
pub const DEFAULT_RING_THRESHOLD_BYTES: usize = 64 * 1024;

/// Settings shared by all ranks of a [`ThreadGroup`].
///
/// ```
/// use std::time::Duration;
/// use candle_dp::comm::GroupOptions;
///
/// let options = GroupOptions {
///     timeout: Some(Duration::from_secs(10)),
///     ..GroupOptions::default()
/// };
/// assert_eq!(options.ring_threshold_bytes, 64 * 1024);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupOptions {
    /// The initial timeout of every rank (see [`ProcessGroup::set_timeout`]).
    /// Default: none.
    pub timeout: Option<Duration>,
    /// Reductions of buffers at least this large (in bytes) use the ring
    /// algorithm; smaller ones are sent to every rank in one step and reduced
    /// in rank order. See [`ThreadGroup`]. Default:
    /// [`DEFAULT_RING_THRESHOLD_BYTES`].
    pub ring_threshold_bytes: usize,
}

impl Default for GroupOptions {
    fn default() -> Self {
        GroupOptions {
            timeout: None,
            ring_threshold_bytes: DEFAULT_RING_THRESHOLD_BYTES,
        }
    }
}

/// How long a rank polls for a message before it blocks (see
/// [`Call::poll`]).
const SPIN: Duration = Duration::from_micros(50);

/// The in-process [`ProcessGroup`]: one [`ThreadRank`] handle per rank, each
/// meant to be moved to its own thread.
///
/// Every pair of ranks has its own channel, and every collective starts by
/// exchanging a small header with every other rank, through which the ranks
/// agree on the call (or on the error) before any data moves.
///
/// **Reduction order** (so results are reproducible bit for bit). With `W`
/// ranks and `x_r` rank `r`'s value of an element, `⊕` the op:
/// - buffers smaller than [`GroupOptions::ring_threshold_bytes`] (and all
///   buffers when `W == 1`) are reduced in rank order,
///   `((x_0 ⊕ x_1) ⊕ x_2) ⊕ … ⊕ x_{W-1}`;
/// - larger ones use the ring algorithm's order: the buffer is split into
///   `W` contiguous chunks of near-equal size (the first `n % W` one element
///   longer) and an element of chunk `c` is reduced as
///   `((x_{c+1} ⊕ x_{c+2}) ⊕ …) ⊕ x_c`, indices mod `W`.
///
/// Large reductions move no partial results between ranks: the ranks read
/// each other's inputs where they are (a contiguous CPU tensor in place,
/// any other tensor from one host copy) and write straight into their
/// results. With two ranks each rank reduces the whole buffer, which costs
/// about one memcpy of it; with more, each reduces one chunk and copies the
/// others' chunks.
///
/// Each step rounds to the tensor's dtype (f16 and bf16 sums are not
/// accumulated in f32). `Avg` divides that sum by `W`, in the dtype, as the
/// last step. [`ProcessGroup::reduce`] gives bitwise the result of
/// [`ProcessGroup::all_reduce`].
///
/// ```
/// use std::thread;
/// use candle_core::{Device, Tensor};
/// use candle_dp::comm::{ProcessGroup, ReduceOp, ThreadGroup};
///
/// let results: Vec<Vec<f64>> = thread::scope(|s| {
///     let handles: Vec<_> = ThreadGroup::new(4)
///         .into_iter()
///         .map(|pg| {
///             s.spawn(move || {
///                 let x = Tensor::new(&[pg.rank() as f64], &Device::Cpu).unwrap();
///                 let max = pg.all_reduce(&x, ReduceOp::Max).unwrap();
///                 max.to_vec1::<f64>().unwrap()
///             })
///         })
///         .collect();
///     handles.into_iter().map(|h| h.join().unwrap()).collect()
/// });
/// assert_eq!(results, vec![vec![3.0]; 4]);
/// ```
#[derive(Debug)]
pub enum ThreadGroup {}

impl ThreadGroup {
    /// The handles of a new group of `world_size` ranks, in rank order, with
    /// default [`GroupOptions`]. `world_size == 0` gives no handles.
    // A group exists only as its ranks' handles, so `new` returns those.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(world_size: usize) -> Vec<ThreadRank> {
        Self::with_options(world_size, GroupOptions::default())
    }

    /// The handles of a new group of `world_size` ranks, in rank order.
    pub fn with_options(world_size: usize, options: GroupOptions) -> Vec<ThreadRank> {
        let (alarm_tx, alarm_rx) = channel::bounded(0);
        let shared = Arc::new(Shared {
            ring_threshold_bytes: options.ring_threshold_bytes,
            failure: OnceLock::new(),
            alarm: Mutex::new(Some(alarm_tx)),
            entered: (0..world_size).map(|_| AtomicU64::new(0)).collect(),
        });
        // One channel per ordered pair: `to[src][dst]` and `from[dst][src]`.
        let mut to: Vec<Vec<Sender<Envelope>>> = (0..world_size).map(|_| Vec::new()).collect();
        let mut from: Vec<Vec<Receiver<Envelope>>> = (0..world_size).map(|_| Vec::new()).collect();
        for senders in to.iter_mut() {
            for receivers in from.iter_mut() {
                let (tx, rx) = channel::unbounded();
                senders.push(tx);
                receivers.push(rx);
            }
        }
        to.into_iter()
            .zip(from)
            .enumerate()
            .map(|(rank, (to, from))| ThreadRank {
                rank,
                world_size,
                shared: Arc::clone(&shared),
                alarm: alarm_rx.clone(),
                timeout: Mutex::new(options.timeout),
                links: Mutex::new(Links {
                    seq: 0,
                    to,
                    from,
                    left: false,
                }),
            })
            .collect()
    }
}

/// State shared by all ranks of a group.
struct Shared {
    ring_threshold_bytes: usize,
    /// The group's first failure.
    failure: OnceLock<Failure>,
    /// Never carries a message: dropping it at the first failure disconnects
    /// every rank's `alarm` receiver, which wakes every wait at once.
    alarm: Mutex<Option<Sender<Infallible>>>,
    /// How many collectives each rank has entered, to name the ranks a
    /// timed-out wait is missing.
    entered: Vec<AtomicU64>,
}

impl Shared {
    /// Records `failure` unless the group already failed, and wakes every
    /// wait. The failure is stored before the alarm sounds, so a woken wait
    /// always finds it.
    fn fail(&self, failure: Failure) {
        let _first = self.failure.set(failure);
        lock(&self.alarm).take();
    }

    fn failure(&self) -> Option<Failure> {
        self.failure.get().cloned()
    }
}

/// A shared handle on a group's failure state, for
/// [`spawn`](crate::launch::spawn), which must watch and fail the group
/// without holding a rank's handle (holding one would stop that rank from
/// ever leaving).
#[derive(Clone)]
pub(crate) struct GroupWatch(Arc<Shared>);

impl GroupWatch {
    pub(crate) fn failure(&self) -> Option<Failure> {
        self.0.failure()
    }

    pub(crate) fn fail(&self, failure: Failure) {
        self.0.fail(failure);
    }
}

/// The channels of one rank, behind a lock that serializes its collectives.
struct Links {
    /// How many collectives this rank has entered; tags its messages.
    seq: u64,
    /// `to[dst]`: this rank's channel to `dst`.
    to: Vec<Sender<Envelope>>,
    /// `from[src]`: the channel from `src` to this rank.
    from: Vec<Receiver<Envelope>>,
    /// Whether this rank has left (see [`ThreadRank::leave`]).
    left: bool,
}

/// One rank's handle on a [`ThreadGroup`]; implements [`ProcessGroup`].
///
/// Dropping the handle leaves the group: collectives that still need this
/// rank fail with [`FailureCause::Left`] naming it (after using whatever it
/// sent before leaving). Dropping it while the thread panics fails the group
/// with [`FailureCause::Panicked`].
pub struct ThreadRank {
    rank: usize,
    world_size: usize,
    shared: Arc<Shared>,
    alarm: Receiver<Infallible>,
    timeout: Mutex<Option<Duration>>,
    links: Mutex<Links>,
}

impl fmt::Debug for ThreadRank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ThreadRank")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("failure", &self.shared.failure())
            .finish_non_exhaustive()
    }
}

impl Drop for ThreadRank {
    fn drop(&mut self) {
        // A rank that finishes normally just leaves: only collectives that
        // still need it fail, when its channels disconnect. Recording that
        // here would also wake waits that are about to succeed.
        if std::thread::panicking() {
            self.shared.fail(Failure {
                rank: self.rank,
                cause: FailureCause::Panicked,
            });
        }
    }
}

impl ThreadRank {
    pub(crate) fn watch(&self) -> GroupWatch {
        GroupWatch(Arc::clone(&self.shared))
    }

    /// Leaves the group now, as dropping the handle would, although clones
    /// of it may live on (in a value the rank's closure returned, say):
    /// collectives that still need this rank fail naming it, and later
    /// calls on this handle fail.
    pub(crate) fn leave(&self) {
        let mut links = lock(&self.links);
        links.to.clear();
        links.from.clear();
        links.left = true;
    }

    /// Starts a collective: fails at once if the group has failed, else
    /// takes this rank's channels for the duration of the call.
    fn begin(&self, op: &'static str) -> Result<Call<'_>> {
        let mut links = lock(&self.links);
        if let Some(failure) = self.shared.failure() {
            return Err(CommError::GroupFailed {
                rank: self.rank,
                op,
                failure,
            });
        }
        if links.left {
            return Err(CommError::GroupFailed {
                rank: self.rank,
                op,
                failure: Failure {
                    rank: self.rank,
                    cause: FailureCause::Left,
                },
            });
        }
        links.seq += 1;
        let seq = links.seq;
        self.shared.entered[self.rank].store(seq, Ordering::SeqCst);
        let timeout = *lock(&self.timeout);
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

    /// Whether a reduction of `tensor` takes the ring path. It depends only
    /// on the tensor's size and group-wide settings, so all ranks agree once
    /// their shapes and dtypes do.
    fn uses_ring(&self, tensor: &Tensor) -> bool {
        let bytes = tensor
            .elem_count()
            .saturating_mul(tensor.dtype().size_in_bytes());
        self.world_size > 1 && bytes >= self.shared.ring_threshold_bytes
    }

    fn root_error(&self, root: usize) -> Option<String> {
        (root >= self.world_size).then(|| {
            format!(
                "root {root} is out of range for world size {}",
                self.world_size
            )
        })
    }

    /// The first half of `gather` and `reduce`: every rank sends its copy of
    /// `tensor` to `root` with the call's header. The root gets every
    /// rank's header back, the other ranks `None` (they are done).
    fn send_to_root(
        &self,
        call: &Call<'_>,
        op: OpSig,
        tensor: &Tensor,
        root: usize,
    ) -> Result<Option<Vec<Header>>> {
        let local = local_copy(tensor);
        let sig = Signature {
            op,
            meta: meta(tensor),
            invalid: self.root_error(root).or(local.as_ref().err().cloned()),
        };
        let headers = call.exchange(sig, |dst| match &local {
            Ok(data) if dst == root => Some(piece(data, tensor)),
            _ => None,
        })?;
        Ok((self.rank == root).then_some(headers))
    }
}

/// A tensor's host copy, shared between the messages that carry it; the
/// error says why the tensor cannot be sent.
type Local = std::result::Result<Arc<Buffer>, String>;

fn local_copy(tensor: &Tensor) -> Local {
    Buffer::from_tensor(tensor).map(Arc::new)
}

fn meta(tensor: &Tensor) -> Option<TensorMeta> {
    Some(TensorMeta {
        dtype: tensor.dtype(),
        dims: tensor.dims().to_vec(),
    })
}

fn piece(data: &Arc<Buffer>, tensor: &Tensor) -> Piece {
    Piece {
        data: Arc::clone(data),
        dims: tensor.dims().to_vec(),
        device: tensor.device().clone(),
    }
}

/// One collective in progress on one rank.
struct Call<'a> {
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
                    if start.elapsed() < SPIN && self.pg.shared.failure.get().is_none() =>
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
    fn exchange(
        &self,
        sig: Signature,
        payload_for: impl FnMut(usize) -> Option<Piece>,
    ) -> Result<Vec<Header>> {
        self.exchange_with_input(sig, payload_for, None)
    }

    /// The [`exchange`](Call::exchange) of a large reduction of `tensor`:
    /// every header carries the sender's [`Input`], which every rank reads
    /// (see [`ring`]). `invalid` says why the call's other arguments are.
    fn exchange_inputs(
        &self,
        tensor: &Tensor,
        op: OpSig,
        invalid: Option<String>,
    ) -> Result<Vec<Header>> {
        let input = Input::new(tensor);
        let sig = Signature {
            op,
            meta: meta(tensor),
            invalid: invalid.or_else(|| input.as_ref().err().cloned()),
        };
        self.exchange_with_input(sig, |_| None, input.as_ref().ok())
    }

    fn exchange_with_input(
        &self,
        sig: Signature,
        mut payload_for: impl FnMut(usize) -> Option<Piece>,
        input: Option<&Input>,
    ) -> Result<Vec<Header>> {
        let me = self.pg.rank;
        let world = self.pg.world_size;
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
    fn payload<'h>(&self, headers: &'h [Header], src: usize) -> Result<&'h Piece> {
        headers[src]
            .payload
            .as_ref()
            .ok_or_else(|| self.unexpected(src, "its header carries no data".into()))
    }

    /// Every rank's payload, in rank order.
    fn payloads<'h>(&self, headers: &'h [Header]) -> Result<Vec<&'h Buffer>> {
        (0..headers.len())
            .map(|src| self.payload(headers, src).map(|p| p.data.as_ref()))
            .collect()
    }

    /// Every rank's input to a large reduction, in rank order.
    fn inputs<'h>(&self, headers: &'h [Header]) -> Result<Vec<&'h Input>> {
        (0..headers.len())
            .map(|src| {
                headers[src]
                    .input
                    .as_ref()
                    .ok_or_else(|| self.unexpected(src, "its header carries no input".into()))
            })
            .collect()
    }

    fn tensor_error(&self, source: candle_core::Error) -> CommError {
        CommError::Tensor {
            rank: self.pg.rank,
            op: self.op,
            source,
        }
    }

    fn group_failed(&self) -> CommError {
        // `Shared::fail` stores the failure before waking anyone, so it is
        // there; the fallback only keeps this free of panics.
        let failure = self.pg.shared.failure().unwrap_or(Failure {
            rank: self.pg.rank,
            cause: FailureCause::Aborted("woken without a recorded failure".into()),
        });
        CommError::GroupFailed {
            rank: self.pg.rank,
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
        let mut missing: Vec<usize> = (0..self.pg.world_size)
            .filter(|&r| self.pg.shared.entered[r].load(Ordering::SeqCst) < self.seq)
            .collect();
        if missing.is_empty() {
            // Everyone arrived; the rank this wait depends on is stuck.
            missing.push(src);
        }
        // The other ranks' part of this collective can no longer complete.
        self.pg.shared.fail(Failure {
            rank: self.pg.rank,
            cause: FailureCause::TimedOut {
                op: self.op,
                missing: missing.clone(),
            },
        });
        CommError::Timeout {
            rank: self.pg.rank,
            op: self.op,
            timeout: self.timeout.unwrap_or_default(),
            missing,
        }
    }
}

impl Link for Call<'_> {
    fn rank(&self) -> usize {
        self.pg.rank
    }

    fn world_size(&self) -> usize {
        self.pg.world_size
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
            rank: self.pg.rank,
            cause: FailureCause::Aborted(format!(
                "received an unexpected message from rank {src} in {}",
                self.op
            )),
        });
        CommError::Protocol {
            rank: self.pg.rank,
            op: self.op,
            peer: src,
            detail,
        }
    }
}

impl ProcessGroup for ThreadRank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn set_timeout(&self, timeout: Option<Duration>) {
        *lock(&self.timeout) = timeout;
    }

    fn timeout(&self) -> Option<Duration> {
        *lock(&self.timeout)
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let call = self.begin("all_reduce")?;
        if self.uses_ring(tensor) {
            let headers = call.exchange_inputs(tensor, OpSig::AllReduce(op), None)?;
            let inputs = call.inputs(&headers)?;
            return ring::all_reduce(&inputs, tensor.dtype(), op, &call)?
                .into_tensor(tensor.dims(), tensor.device())
                .map_err(|e| call.tensor_error(e));
        }
        // Small buffers go to every rank with the header.
        let local = local_copy(tensor);
        let sig = Signature {
            op: OpSig::AllReduce(op),
            meta: meta(tensor),
            invalid: local.as_ref().err().cloned(),
        };
        let headers = call.exchange(sig, |_| local.as_ref().ok().map(|d| piece(d, tensor)))?;
        reduce_in_rank_order(&call.payloads(&headers)?, op)
            .ok_or_else(|| call.unexpected(0, "buffers of different types".into()))?
            .into_tensor(tensor.dims(), tensor.device())
            .map_err(|e| call.tensor_error(e))
    }

    fn all_reduce_concat(&self, tensors: &[Tensor], op: ReduceOp) -> Result<Tensor> {
        let Some(first) = tensors.first() else {
            return super::all_reduce_concat_copied(self, tensors, op);
        };
        let len: usize = tensors.iter().map(Tensor::elem_count).sum();
        let bytes = len.saturating_mul(first.dtype().size_in_bytes());
        if self.world_size == 1 || bytes < self.shared.ring_threshold_bytes {
            return super::all_reduce_concat_copied(self, tensors, op);
        }
        // The ring, as `all_reduce` runs it on the concatenation, reading
        // every part in place.
        let call = self.begin("all_reduce")?;
        let input = Input::concat(tensors, first.dtype());
        let sig = Signature {
            op: OpSig::AllReduce(op),
            meta: Some(TensorMeta {
                dtype: first.dtype(),
                dims: vec![len],
            }),
            invalid: input.as_ref().err().cloned(),
        };
        let headers = call.exchange_with_input(sig, |_| None, input.as_ref().ok())?;
        let inputs = call.inputs(&headers)?;
        ring::all_reduce(&inputs, first.dtype(), op, &call)?
            .into_tensor(&[len], first.device())
            .map_err(|e| call.tensor_error(e))
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Tensor> {
        let call = self.begin("broadcast")?;
        let local = (self.rank == root).then(|| local_copy(tensor));
        let sig = Signature {
            op: OpSig::Broadcast { root },
            meta: meta(tensor),
            invalid: self
                .root_error(root)
                .or_else(|| local.as_ref().and_then(|l| l.as_ref().err().cloned())),
        };
        let headers = call.exchange(sig, |_| match &local {
            Some(Ok(data)) => Some(piece(data, tensor)),
            _ => None,
        })?;
        call.payload(&headers, root)?
            .data
            .to_tensor(tensor.dims(), tensor.device())
            .map_err(|e| call.tensor_error(e))
    }

    fn all_gather(&self, tensor: &Tensor) -> Result<Vec<Tensor>> {
        let call = self.begin("all_gather")?;
        let local = local_copy(tensor);
        let sig = Signature {
            op: OpSig::AllGather,
            meta: meta(tensor),
            invalid: local.as_ref().err().cloned(),
        };
        let headers = call.exchange(sig, |_| local.as_ref().ok().map(|d| piece(d, tensor)))?;
        call.payloads(&headers)?
            .into_iter()
            .map(|data| data.to_tensor(tensor.dims(), tensor.device()))
            .collect::<candle_core::Result<_>>()
            .map_err(|e| call.tensor_error(e))
    }

    fn gather(&self, tensor: &Tensor, root: usize) -> Result<Option<Vec<Tensor>>> {
        let call = self.begin("gather")?;
        let Some(headers) = self.send_to_root(&call, OpSig::Gather { root }, tensor, root)? else {
            return Ok(None);
        };
        call.payloads(&headers)?
            .into_iter()
            .map(|data| data.to_tensor(tensor.dims(), tensor.device()))
            .collect::<candle_core::Result<_>>()
            .map(Some)
            .map_err(|e| call.tensor_error(e))
    }

    fn scatter(&self, tensors: Option<&[Tensor]>, root: usize) -> Result<Tensor> {
        let call = self.begin("scatter")?;
        let pieces: std::result::Result<Vec<Piece>, String> =
            protocol::scatter_tensors(tensors, self.rank, root, self.world_size).and_then(
                |tensors| {
                    tensors
                        .iter()
                        .enumerate()
                        .map(|(i, t)| {
                            let data = local_copy(t).map_err(|e| format!("tensor {i}: {e}"))?;
                            Ok(piece(&data, t))
                        })
                        .collect()
                },
            );
        let sig = Signature {
            op: OpSig::Scatter { root },
            meta: None,
            invalid: self.root_error(root).or(pieces.as_ref().err().cloned()),
        };
        let headers = call.exchange(sig, |dst| {
            pieces.as_ref().ok().and_then(|p| p.get(dst)).cloned()
        })?;
        let piece = call.payload(&headers, root)?;
        piece
            .data
            .to_tensor(&piece.dims, &piece.device)
            .map_err(|e| call.tensor_error(e))
    }

    fn reduce(&self, tensor: &Tensor, root: usize, op: ReduceOp) -> Result<Option<Tensor>> {
        let call = self.begin("reduce")?;
        if self.uses_ring(tensor) {
            let sig = OpSig::Reduce { root, op };
            let headers = call.exchange_inputs(tensor, sig, self.root_error(root))?;
            let inputs = call.inputs(&headers)?;
            return ring::reduce(&inputs, tensor.dtype(), op, root, &call)?
                .map(|r| r.into_tensor(tensor.dims(), tensor.device()))
                .transpose()
                .map_err(|e| call.tensor_error(e));
        }
        let Some(headers) = self.send_to_root(&call, OpSig::Reduce { root, op }, tensor, root)?
        else {
            return Ok(None);
        };
        reduce_in_rank_order(&call.payloads(&headers)?, op)
            .ok_or_else(|| call.unexpected(0, "buffers of different types".into()))?
            .into_tensor(tensor.dims(), tensor.device())
            .map(Some)
            .map_err(|e| call.tensor_error(e))
    }

    fn barrier(&self) -> Result<()> {
        let call = self.begin("barrier")?;
        let sig = Signature {
            op: OpSig::Barrier,
            meta: None,
            invalid: None,
        };
        call.exchange(sig, |_| None).map(drop)
    }

    fn all_gather_bytes(&self, bytes: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        let call = self.begin("all_gather_bytes")?;
        let len = bytes.len();
        let data = Piece {
            data: Arc::new(Buffer::U8(bytes)),
            dims: vec![len],
            device: candle_core::Device::Cpu,
        };
        let sig = Signature {
            op: OpSig::AllGatherBytes,
            meta: None,
            invalid: None,
        };
        let headers = call.exchange(sig, |_| Some(data.clone()))?;
        (0..self.world_size)
            .map(|src| {
                let piece = call.payload(&headers, src)?;
                piece
                    .data
                    .as_bytes()
                    .map(<[u8]>::to_vec)
                    .ok_or_else(|| call.unexpected(src, "its data are not bytes".into()))
            })
            .collect()
    }

    fn abort(&self, reason: &str) {
        self.shared.fail(Failure {
            rank: self.rank,
            cause: FailureCause::Aborted(reason.to_string()),
        });
    }

    fn failure(&self) -> Option<Failure> {
        self.shared.failure()
    }
}
