//! [`NcclGroup`]: a [`ProcessGroup`] whose collectives on GPU tensors run on
//! the GPUs through NCCL, in stream order, with no host round trip.
//!
//! It is built over a host group that already exists (a [`ThreadGroup`]
//! rank or an `MpiGroup`), which it keeps for everything NCCL cannot check
//! or do:
//!
//! - **Agreement.** Before every collective, each rank sends a small
//!   [`DeviceCall`] over the host group; every rank computes the same
//!   verdict ([`agree`]): the same error everywhere for calls that do not
//!   fit together, or the path. This is a host message per collective, but
//!   no device synchronisation: the NCCL kernel is then queued on the
//!   rank's stream behind the work that produced the tensor.
//! - **The host path.** CPU tensors, tensors on another GPU than the
//!   group's, dtypes NCCL lacks (16-bit integers), integer averages,
//!   `scatter`, `barrier` and `all_gather_bytes` go through the host group,
//!   as it does them.
//! - **Failures.** The host group's failure is the group's. Once a timeout
//!   is set, a watchdog thread follows each queued NCCL collective; one that
//!   has not completed within the timeout of the GPU reaching it (a rank
//!   died after agreeing), or a GPU error, fails the host group, naming the
//!   collective, and aborts the NCCL communicator, which ends the kernels
//!   still waiting for the lost rank. With a timeout, DDP also waits for its
//!   collectives before handing gradients to the optimizer
//!   ([`ProcessGroup::wait_for_device`], PyTorch's
//!   `TORCH_NCCL_BLOCKING_WAIT`), so a failed step changes no parameter.
//! - **Devices.** Only tensors on the `Device` given to [`NcclGroup::new`]
//!   (or a clone) take the NCCL path: another device of the same GPU is
//!   another stream, which NCCL's kernels would not be ordered with, so its
//!   tensors go through the host group, with a warning.
//!
//! Results are equal on every rank, but not bitwise those of a
//! [`ThreadGroup`]: NCCL sums in its own order, `ncclAvg` scales each value
//! before summing, and NCCL's max and min ignore NaN where the host groups
//! propagate it.
//!
//! [`ThreadGroup`]: super::ThreadGroup

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::backend::BackendDevice;
use candle_core::cuda_backend::cudarc::driver::{
    CudaEvent, CudaSlice, CudaStream, CudaView, DeviceRepr, ValidAsZeroBits,
};
use candle_core::cuda_backend::cudarc::nccl::{self, Comm, Id, NcclType};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{DType, Device, Storage, Tensor};
use crossbeam::channel::{Receiver, Sender};

use super::device_call::{agree, device_reduces, DeviceCall, Route};
use super::protocol::{root_error, OpSig};
use super::{
    all_gather_object, Color, CommError, Failure, Membership, ProcessGroup, ReduceOp, Result,
    SubGroup,
};
use crate::util::lock::lock;

/// The NCCL communicator of one rank.
struct DeviceComm(Comm);

// SAFETY: cudarc marks `Comm` neither Send nor Sync because it holds NCCL's
// raw handle. NCCL allows a communicator to be used from any thread as long
// as calls on it do not overlap; every use here is behind one `Mutex`
// (`CommSlot::comm`), and the handle's owner (this struct) is dropped once.
unsafe impl Send for DeviceComm {}

/// The communicator, shared with the watchdog, until it is aborted.
/// Dropping it aborts it (cudarc's `Comm` calls `ncclCommAbort`), which ends
/// kernels still waiting for a lost rank.
struct CommSlot {
    comm: Mutex<Option<DeviceComm>>,
    /// An abort asked for while a call held the communicator: done by that
    /// call when it returns, so that `abort` never waits on NCCL.
    abort_pending: AtomicBool,
}

impl CommSlot {
    /// Aborts the communicator now, or as soon as the call using it returns.
    fn abort(&self) {
        self.abort_pending.store(true, Ordering::SeqCst);
        if let Ok(mut comm) = self.comm.try_lock() {
            comm.take();
        }
    }

    /// Runs `f` on the communicator (`None` once aborted), then carries out
    /// an abort asked for meanwhile.
    fn with<R>(&self, f: impl FnOnce(Option<&Comm>) -> R) -> R {
        let mut comm = lock(&self.comm);
        let result = f(comm.as_ref().map(|c| &c.0));
        if self.abort_pending.load(Ordering::SeqCst) {
            comm.take();
        }
        result
    }

    fn is_aborted(&self) -> bool {
        self.abort_pending.load(Ordering::SeqCst)
    }
}

/// A [`ProcessGroup`] that runs collectives on GPU tensors through NCCL
/// (feature `nccl`), over a host group that carries the agreement, the
/// failures and everything NCCL does not do (see the module docs).
///
/// Every rank creates it collectively, with its own GPU (a device made
/// with `Device::new_cuda_with_stream`, so that collectives follow the
/// rank's own work in stream order):
///
/// ```no_run
/// use std::sync::Arc;
/// use candle_core::{Device, Tensor};
/// use candle_dp::comm::{NcclGroup, ProcessGroup, ReduceOp};
/// use candle_dp::launch::spawn;
///
/// // Two thread ranks, one GPU each.
/// let sums = spawn(2, |ctx| {
///     let gpu = Device::new_cuda_with_stream(ctx.rank)?;
///     let nccl = NcclGroup::new(ctx.pg.clone(), &gpu)?;
///     let x = Tensor::new(&[ctx.rank as f32, 1.0], &gpu)?;
///     Ok(nccl.all_reduce(&x, ReduceOp::Sum)?.to_vec1::<f32>()?)
/// })?;
/// assert_eq!(sums[0], [1.0, 2.0]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct NcclGroup {
    host: Arc<dyn ProcessGroup>,
    device: CudaDevice,
    comm: Arc<CommSlot>,
    /// Where queued collectives are sent to be watched (with a timeout).
    watchdog: Sender<Watch>,
    /// Whether a tensor on another device of this GPU was reported.
    warned_other_device: AtomicBool,
}

impl std::fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclGroup")
            .field("rank", &self.host.rank())
            .field("world_size", &self.host.world_size())
            .field("gpu", &self.device.cuda_stream().context().ordinal())
            .field("host", &self.host)
            .finish()
    }
}

/// What every rank sends while the group is created: whether its device
/// can take part, and (rank 0 only) the NCCL id.
type Setup = (
    std::result::Result<(), String>,
    std::result::Result<Vec<u8>, String>,
);

impl NcclGroup {
    /// Creates this rank's NCCL communicator over `host` (collective: every
    /// rank of `host` calls it, each with its own GPU). Rank 0's NCCL id
    /// travels over `host`. A rank whose device is not a CUDA device with
    /// a stream of its own is named on every rank.
    ///
    /// NCCL's initialisation itself is blocking: should it fail on one rank
    /// after the others started theirs (a driver error), those may wait in
    /// NCCL; the failing rank fails the host group first.
    pub fn new(host: Arc<dyn ProcessGroup>, device: &Device) -> Result<Self> {
        let rank = host.rank();
        let op = "nccl_init";
        let usable = match device {
            Device::Cuda(cuda) if crate::cuda_stream::has_own_stream(device) => Ok(cuda.clone()),
            Device::Cuda(_) => Err("its GPU uses the per-thread default stream: make it with \
                 Device::new_cuda_with_stream"
                .to_string()),
            other => Err(format!(
                "its device is {}, not a GPU",
                crate::util::device_label::device_label(other)
            )),
        };
        let id = match (&usable, rank) {
            (Ok(_), 0) => Id::new()
                .map(|id| id.internal().iter().map(|&c| c as u8).collect())
                .map_err(|e| format!("ncclGetUniqueId failed: {e:?}")),
            _ => Ok(Vec::new()),
        };
        let setup: Setup = (usable.as_ref().map(|_| ()).map_err(Clone::clone), id);
        let all: Vec<Setup> = all_gather_object(host.as_ref(), &setup)?;
        for (culprit, (ready, id)) in all.iter().enumerate() {
            if let Some(reason) = ready.as_ref().err().or(id.as_ref().err()) {
                return Err(CommError::InvalidInput {
                    rank,
                    op,
                    culprit,
                    reason: reason.clone(),
                });
            }
        }
        let mut internal = [0 as std::ffi::c_char; 128];
        let (Ok(device), Some((_, Ok(bytes)))) = (usable, all.first()) else {
            // Checked above on every rank; kept an error, never a panic.
            return Err(CommError::Protocol {
                rank,
                op,
                peer: 0,
                detail: "no NCCL id from rank 0".into(),
            });
        };
        if bytes.len() != internal.len() {
            return Err(CommError::Protocol {
                rank,
                op,
                peer: 0,
                detail: format!("an NCCL id of {} bytes", bytes.len()),
            });
        }
        for (slot, &byte) in internal.iter_mut().zip(bytes) {
            *slot = byte as std::ffi::c_char;
        }
        let stream = device.cuda_stream();
        let comm = stream
            .context()
            .bind_to_thread()
            .map_err(|e| format!("{e:?}"))
            .and_then(|()| {
                Comm::from_rank(
                    stream.clone(),
                    rank,
                    host.world_size(),
                    Id::uninit(internal),
                )
                .map_err(|e| format!("ncclCommInitRank failed: {e:?}"))
            });
        let comm = comm.map_err(|reason| fail_here(host.as_ref(), op, reason))?;
        let comm = Arc::new(CommSlot {
            comm: Mutex::new(Some(DeviceComm(comm))),
            abort_pending: AtomicBool::new(false),
        });
        let watchdog = Watchdog::start(Arc::clone(&host), Arc::clone(&comm)).map_err(|e| {
            let reason = format!("cannot start the NCCL watchdog thread: {e}");
            fail_here(host.as_ref(), op, reason)
        })?;
        Ok(Self {
            host,
            device,
            comm,
            watchdog,
            warned_other_device: AtomicBool::new(false),
        })
    }

    /// The host group this group agrees and falls back over.
    pub fn host(&self) -> &Arc<dyn ProcessGroup> {
        &self.host
    }

    /// Whether `tensor` can take the NCCL path for a reduction `op` (or
    /// none): on this group's GPU, in a dtype NCCL takes.
    fn on_device(&self, tensor: &Tensor, op: Option<ReduceOp>) -> bool {
        let Device::Cuda(cuda) = tensor.device() else {
            return false;
        };
        if !cuda.same_device(&self.device) {
            // Another device of this rank's GPU is another stream, which
            // NCCL's kernels would not be ordered with: the host path is
            // the safe one, and a slow one, so say it once.
            let same_gpu = cuda.cuda_stream().context().ordinal()
                == self.device.cuda_stream().context().ordinal();
            if same_gpu && !self.warned_other_device.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    "rank {}: a tensor on another Device of this rank's GPU goes through the \
                     host group; create it on the Device given to NcclGroup::new",
                    self.host.rank()
                );
            }
            return false;
        }
        device_reduces(tensor.dtype(), op)
    }

    /// The agreement over the host group (see [`agree`]).
    fn agree(
        &self,
        sig: OpSig,
        tensor: &Tensor,
        invalid: Option<String>,
        on_device: bool,
    ) -> Result<Route> {
        if self.comm.is_aborted() {
            return Err(self.failed(sig.name()));
        }
        let call = DeviceCall::new(sig, Some(tensor), invalid, on_device);
        let calls: Vec<DeviceCall> = match all_gather_object(self.host.as_ref(), &call) {
            Ok(calls) => calls,
            Err(e) => {
                // The group failed: collectives queued before can no longer
                // complete on this rank's stream.
                if self.host.failure().is_some() {
                    self.comm.abort();
                }
                return Err(e);
            }
        };
        agree(&calls, self.host.rank(), sig.name())
    }

    /// The error once the group has failed.
    fn failed(&self, op: &'static str) -> CommError {
        CommError::GroupFailed {
            rank: self.host.rank(),
            op,
            failure: self.host.failure().unwrap_or(Failure {
                rank: self.host.rank(),
                cause: super::FailureCause::Aborted("the NCCL communicator was aborted".into()),
            }),
        }
    }

    /// Queues `collective` on this rank's stream with `tensor` as input and
    /// a new buffer of `out_len` elements as output (none: this rank gets
    /// no result), and returns the output. The watchdog follows it when a
    /// timeout is set. The ranks have agreed to run it: if this rank cannot,
    /// it fails the group, so that the others' NCCL calls end.
    fn launch(
        &self,
        op: &'static str,
        tensor: &Tensor,
        out_len: Option<usize>,
        collective: Collective,
    ) -> Result<Option<CudaStorage>> {
        let stream = self.device.cuda_stream();
        let started = self
            .host
            .timeout()
            .and_then(|_| stream.record_event(None).ok());
        let launched = self.queue(tensor, out_len, collective, &stream);
        let output = launched.map_err(|reason| {
            self.comm.abort();
            fail_here(
                self.host.as_ref(),
                op,
                format!("NCCL {op} failed: {reason}"),
            )
        })?;
        if let (Some(timeout), Some(started)) = (self.host.timeout(), started) {
            if let Ok(done) = stream.record_event(None) {
                let _ = self.watchdog.send(Watch {
                    op,
                    started,
                    done,
                    timeout,
                });
            }
        }
        Ok(output)
    }

    /// The part of [`launch`](Self::launch) that can fail on this rank alone.
    fn queue(
        &self,
        tensor: &Tensor,
        out_len: Option<usize>,
        collective: Collective,
        stream: &Arc<CudaStream>,
    ) -> std::result::Result<Option<CudaStorage>, String> {
        let input = tensor.contiguous().map_err(|e| e.to_string())?;
        let (storage, layout) = input.storage_and_layout();
        let (Storage::Cuda(storage), Some((start, end))) = (&*storage, layout.contiguous_offsets())
        else {
            return Err("not a contiguous CUDA tensor".into());
        };
        self.comm.with(|comm| {
            let comm = comm.ok_or("the NCCL communicator was aborted")?;
            let run = Run {
                comm,
                stream,
                device: &self.device,
                range: start..end,
                out_len,
                collective,
            };
            match tensor.dtype() {
                DType::F32 => run.typed::<f32>(storage),
                DType::F64 => run.typed::<f64>(storage),
                DType::F16 => run.typed::<half::f16>(storage),
                DType::BF16 => run.typed::<half::bf16>(storage),
                DType::U8 => run.typed::<u8>(storage),
                DType::U32 => run.typed::<u32>(storage),
                DType::I32 => run.typed::<i32>(storage),
                DType::I64 => run.typed::<i64>(storage),
                other => Err(format!("NCCL has no {}", other.as_str())),
            }
        })
    }

    /// Waits, within the group's timeout and while the group stands, for
    /// this rank's stream to finish what it queued (its last collectives).
    fn wait_idle(&self) {
        let stream = self.device.cuda_stream();
        let Ok(event) = stream.record_event(None) else {
            return;
        };
        let deadline = self.host.timeout().map(|t| Instant::now() + t);
        while let Ok(false) = event.try_is_complete() {
            if self.host.failure().is_some() || deadline.is_some_and(|d| Instant::now() >= d) {
                return;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// A tensor of `dims` over `storage`, on this group's GPU.
    fn tensor(storage: CudaStorage, dims: &[usize]) -> Tensor {
        Tensor::from_storage(Storage::Cuda(storage), dims, BackpropOp::none(), false)
    }

    /// The tensor of a collective that gives this rank a result.
    fn result(&self, op: &'static str, out: Option<CudaStorage>, dims: &[usize]) -> Result<Tensor> {
        out.map(|out| Self::tensor(out, dims))
            .ok_or(CommError::Protocol {
                rank: self.rank(),
                op,
                peer: self.rank(),
                detail: "no output".into(),
            })
    }
}

/// Fails the group over `host` with `reason`, a failure of this rank alone
/// (the others have agreed and would wait for it), and returns this rank's
/// error.
fn fail_here(host: &dyn ProcessGroup, op: &'static str, reason: String) -> CommError {
    host.abort(&reason);
    CommError::InvalidInput {
        rank: host.rank(),
        op,
        culprit: host.rank(),
        reason,
    }
}

/// The collective a [`Run`] queues.
#[derive(Clone, Copy)]
enum Collective {
    AllReduce(ReduceOp),
    Broadcast { root: usize },
    AllGather,
    Reduce { root: usize, op: ReduceOp },
}

/// One collective about to be queued on one rank.
struct Run<'a> {
    comm: &'a Comm,
    stream: &'a Arc<CudaStream>,
    device: &'a CudaDevice,
    range: std::ops::Range<usize>,
    out_len: Option<usize>,
    collective: Collective,
}

impl Run<'_> {
    fn typed<T>(&self, storage: &CudaStorage) -> std::result::Result<Option<CudaStorage>, String>
    where
        T: NcclType + CudaDType + DeviceRepr + ValidAsZeroBits,
    {
        let slice = storage.as_cuda_slice::<T>().map_err(|e| e.to_string())?;
        let input: CudaView<T> = slice.slice(self.range.clone());
        let mut output: Option<CudaSlice<T>> = self
            .out_len
            .map(|n| self.stream.alloc_zeros(n))
            .transpose()
            .map_err(|e| format!("{e:?}"))?;
        let status = match (self.collective, output.as_mut()) {
            (Collective::AllReduce(op), Some(out)) => {
                self.comm.all_reduce(&input, out, &nccl_op(op))
            }
            (Collective::Broadcast { root }, Some(out)) => {
                self.comm.broadcast(Some(&input), out, root as i32)
            }
            (Collective::AllGather, Some(out)) => self.comm.all_gather(&input, out),
            (Collective::Reduce { root, op }, out) => {
                self.comm.reduce(&input, out, &nccl_op(op), root as i32)
            }
            (_, None) => return Err("no output buffer for a collective that needs one".into()),
        };
        status.map_err(|e| format!("{e:?}"))?;
        Ok(output.map(|out| CudaStorage::wrap_cuda_slice(out, self.device.clone())))
    }
}

fn nccl_op(op: ReduceOp) -> nccl::ReduceOp {
    match op {
        ReduceOp::Sum => nccl::ReduceOp::Sum,
        ReduceOp::Avg => nccl::ReduceOp::Avg,
        ReduceOp::Max => nccl::ReduceOp::Max,
        ReduceOp::Min => nccl::ReduceOp::Min,
    }
}

impl ProcessGroup for NcclGroup {
    fn membership(&self) -> &Membership {
        self.host.membership()
    }

    fn reduces_on_device(&self) -> bool {
        true
    }

    /// With a timeout set, waits (bounded by it, through the watchdog) for
    /// this rank's queued collectives, and fails if the group failed
    /// meanwhile: what `TORCH_NCCL_BLOCKING_WAIT` gives in PyTorch. Without
    /// a timeout, returns at once.
    fn wait_for_device(&self) -> Result<()> {
        if self.host.timeout().is_none() {
            return Ok(());
        }
        self.wait_idle();
        match self.host.failure() {
            Some(_) => Err(self.failed("wait_for_device")),
            None => Ok(()),
        }
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let on_device = self.on_device(tensor, Some(op));
        match self.agree(OpSig::AllReduce(op), tensor, None, on_device)? {
            Route::Host => self.host.all_reduce(tensor, op),
            Route::Device => {
                let n = tensor.elem_count();
                let out = self.launch("all_reduce", tensor, Some(n), Collective::AllReduce(op))?;
                self.result("all_reduce", out, tensor.dims())
            }
        }
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Tensor> {
        let invalid = root_error(root, self.world_size());
        let on_device = self.on_device(tensor, None);
        match self.agree(OpSig::Broadcast { root }, tensor, invalid, on_device)? {
            Route::Host => self.host.broadcast(tensor, root),
            Route::Device => {
                let n = tensor.elem_count();
                let out =
                    self.launch("broadcast", tensor, Some(n), Collective::Broadcast { root })?;
                self.result("broadcast", out, tensor.dims())
            }
        }
    }

    fn all_gather(&self, tensor: &Tensor) -> Result<Vec<Tensor>> {
        let on_device = self.on_device(tensor, None);
        match self.agree(OpSig::AllGather, tensor, None, on_device)? {
            Route::Host => self.host.all_gather(tensor),
            Route::Device => self.gathered("all_gather", tensor),
        }
    }

    fn gather(&self, tensor: &Tensor, root: usize) -> Result<Option<Vec<Tensor>>> {
        let invalid = root_error(root, self.world_size());
        let on_device = self.on_device(tensor, None);
        match self.agree(OpSig::Gather { root }, tensor, invalid, on_device)? {
            Route::Host => self.host.gather(tensor, root),
            // NCCL has no gather: an all-gather, kept on the root.
            Route::Device => {
                let all = self.gathered("gather", tensor)?;
                Ok((self.rank() == root).then_some(all))
            }
        }
    }

    fn scatter(&self, tensors: Option<&[Tensor]>, root: usize) -> Result<Tensor> {
        self.host.scatter(tensors, root)
    }

    fn reduce(&self, tensor: &Tensor, root: usize, op: ReduceOp) -> Result<Option<Tensor>> {
        let invalid = root_error(root, self.world_size());
        let on_device = self.on_device(tensor, Some(op));
        match self.agree(OpSig::Reduce { root, op }, tensor, invalid, on_device)? {
            Route::Host => self.host.reduce(tensor, root, op),
            Route::Device => {
                let mine = (self.rank() == root).then_some(tensor.elem_count());
                let out = self.launch("reduce", tensor, mine, Collective::Reduce { root, op })?;
                match out {
                    Some(out) => Ok(Some(Self::tensor(out, tensor.dims()))),
                    None => Ok(None),
                }
            }
        }
    }

    fn barrier(&self) -> Result<()> {
        self.host.barrier()
    }

    fn all_gather_bytes(&self, bytes: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        self.host.all_gather_bytes(bytes)
    }

    fn abort(&self, reason: &str) {
        self.host.abort(reason);
        self.comm.abort();
    }

    fn failure(&self) -> Option<Failure> {
        self.host.failure()
    }

    /// The host group's split, and an NCCL communicator over each
    /// sub-group (a fresh NCCL id sent over it, as [`NcclGroup::new`]
    /// does), on this group's GPU.
    fn split(&self, color: Color, key: i64) -> Result<Option<SubGroup>> {
        let Some(host) = self.host.split(color, key)? else {
            return Ok(None);
        };
        let device = Device::Cuda(self.device.clone());
        Ok(Some(Arc::new(NcclGroup::new(host, &device)?)))
    }

    /// Through the host group: the tensor travels through host memory
    /// (NCCL's own send and recv are not used yet).
    fn send(&self, tensor: &Tensor, dst: usize) -> Result<()> {
        self.host.send(tensor, dst)
    }

    /// Through the host group, as [`send`](ProcessGroup::send); the result
    /// is on `like`'s device.
    fn recv(&self, like: &Tensor, src: usize) -> Result<Tensor> {
        self.host.recv(like, src)
    }
}

impl Drop for NcclGroup {
    /// Lets this rank's last collectives finish before the communicator
    /// goes: cudarc's `Comm` aborts on drop, which would cut a collective
    /// the other ranks still need.
    fn drop(&mut self) {
        self.wait_idle();
        self.comm.abort();
    }
}

impl NcclGroup {
    /// An all-gather on the GPU, split into one tensor per rank.
    fn gathered(&self, op: &'static str, tensor: &Tensor) -> Result<Vec<Tensor>> {
        let world = self.world_size();
        let n = tensor.elem_count();
        let out = self.launch(op, tensor, Some(n * world), Collective::AllGather)?;
        let mut dims = vec![world];
        dims.extend_from_slice(tensor.dims());
        let all = self.result(op, out, &dims)?;
        (0..world)
            .map(|r| all.get(r))
            .collect::<candle_core::Result<Vec<_>>>()
            .map_err(|source| CommError::Tensor {
                rank: self.rank(),
                op,
                source,
            })
    }
}

/// A queued collective the watchdog waits for: events recorded on the
/// rank's stream just before and just after it.
struct Watch {
    op: &'static str,
    started: CudaEvent,
    done: CudaEvent,
    timeout: Duration,
}

/// The thread that fails the group when a queued collective outlives the
/// timeout (a rank lost after agreeing) or the GPU reports an error, and
/// aborts the communicator. The clock of a collective starts when the GPU
/// reaches it, not when it is queued behind a long backward.
struct Watchdog;

impl Watchdog {
    /// Starts the thread; it ends when the group (the sender) is dropped.
    fn start(host: Arc<dyn ProcessGroup>, comm: Arc<CommSlot>) -> std::io::Result<Sender<Watch>> {
        let (tx, rx) = crossbeam::channel::unbounded();
        std::thread::Builder::new()
            .name(format!("candle-dp-nccl-watchdog-{}", host.rank()))
            .spawn(move || Self::run(rx, host, comm))?;
        Ok(tx)
    }

    fn run(rx: Receiver<Watch>, host: Arc<dyn ProcessGroup>, comm: Arc<CommSlot>) {
        while let Ok(watch) = rx.recv() {
            if let Err(why) = Self::follow(&watch, &comm) {
                host.abort(&why);
                comm.abort();
                return;
            }
        }
    }

    /// Waits for `watch` to complete; the reason to fail the group if it
    /// does not.
    fn follow(watch: &Watch, comm: &CommSlot) -> std::result::Result<(), String> {
        let failed = |e| format!("the GPU reported {e:?} around its NCCL {}", watch.op);
        let mut deadline = None;
        loop {
            if comm.is_aborted() {
                return Ok(());
            }
            if watch.done.try_is_complete().map_err(failed)? {
                return Ok(());
            }
            match deadline {
                None if watch.started.try_is_complete().map_err(failed)? => {
                    deadline = Some(Instant::now() + watch.timeout);
                }
                Some(d) if Instant::now() >= d => {
                    return Err(format!(
                        "its NCCL {} did not complete within {:?} of starting on the GPU (a \
                         rank stopped after agreeing to it); the NCCL communicator was aborted",
                        watch.op, watch.timeout
                    ))
                }
                _ => {}
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}
