//! Collective communication between the ranks of a data-parallel group.
//!
//! The model is PyTorch's `torch.distributed`: every rank runs the same
//! program and calls the same collectives in the same order, each with its own
//! tensor; a collective returns once every rank has contributed. A
//! [`ProcessGroup`] is one rank's view of such a group. [`ThreadGroup`] is the
//! in-process implementation, one rank per thread; [`crate::launch::spawn`]
//! runs a closure on every rank of a fresh `ThreadGroup` and tears the group
//! down when one rank fails.
//!
//! Three promises hold for every implementation:
//!
//! - **Determinism.** A reduction combines the ranks' values in an order that
//!   depends only on the world size and the buffer size (see
//!   [`ThreadGroup`] for the exact order), never on thread timing, so every
//!   rank gets bitwise the same result, run after run.
//! - **Agreement on errors.** Ranks that call different collectives, or pass
//!   tensors of different dtypes or shapes, all get the same error naming the
//!   ranks that differ; the group stays usable afterwards.
//! - **Nothing hangs.** Once a rank fails ([`ProcessGroup::abort`], a panic
//!   that drops its handle, a timed-out wait) or leaves while others still
//!   need it, every pending and every later collective of the group returns a
//!   [`CommError::GroupFailed`] naming that rank. A timeout set with
//!   [`ProcessGroup::set_timeout`] bounds every wait.

mod buffer;
mod combine;
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
mod device_call;
mod membership;
mod mesh;
#[cfg(feature = "mpi")]
mod mpi_group;
#[cfg(feature = "nccl")]
mod nccl_group;
mod op;
mod protocol;
mod ring;
mod shard_groups;
mod shards;
mod shared_output;
mod split;
mod thread_group;
mod timeout;

use std::fmt;
use std::time::Duration;

use candle_core::Tensor;
use serde::de::DeserializeOwned;
use serde::Serialize;

pub use membership::Membership;
pub use mesh::{DeviceMesh, MeshError};
#[cfg(feature = "mpi")]
pub use mpi_group::{MpiGroup, MpiInitError};
#[cfg(feature = "nccl")]
pub use nccl_group::NcclGroup;
pub use shard_groups::ShardGroups;
pub use split::{Color, SubGroup};
pub use thread_group::{GroupOptions, ThreadGroup, ThreadRank, DEFAULT_RING_THRESHOLD_BYTES};
pub use timeout::{parse_timeout, DEFAULT_TIMEOUT, TIMEOUT_VARIABLE};

/// How [`ProcessGroup::all_reduce`] and [`ProcessGroup::reduce`] combine the
/// ranks' values, element by element.
///
/// Floating-point `Max` and `Min` propagate NaN. On integer dtypes `Sum`
/// wraps on overflow and `Avg` is that sum divided by the world size,
/// truncated toward zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum ReduceOp {
    /// The sum over the ranks.
    Sum,
    /// The sum over the ranks, then divided by the world size (in the
    /// tensor's dtype), as PyTorch's `ReduceOp.AVG`.
    Avg,
    /// The largest value.
    Max,
    /// The smallest value.
    Min,
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        })
    }
}

/// Why a group can no longer communicate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FailureCause {
    /// The rank called [`ProcessGroup::abort`] (under
    /// [`spawn`](crate::launch::spawn): its closure returned an error or
    /// panicked).
    Aborted(String),
    /// The rank's handle was dropped while its thread was panicking.
    Panicked,
    /// The rank's handle was dropped while another rank still waited for it.
    Left,
    /// The rank gave up waiting in a collective after its timeout.
    TimedOut {
        /// The collective it was in.
        op: &'static str,
        /// The ranks it was waiting for.
        missing: Vec<usize>,
    },
}

impl fmt::Display for FailureCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FailureCause::Aborted(reason) => write!(f, "failed: {reason}"),
            FailureCause::Panicked => f.write_str("panicked"),
            FailureCause::Left => f.write_str("left the group (its handle was dropped)"),
            FailureCause::TimedOut { op, missing } => {
                write!(f, "timed out in {op} waiting for rank(s) {missing:?}")
            }
        }
    }
}

/// The first failure of a group: which rank, and why. Later failures are
/// consequences and are not recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// The rank that failed.
    pub rank: usize,
    /// What happened to it.
    pub cause: FailureCause,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {} {}", self.rank, self.cause)
    }
}

/// Errors of collective operations. Every message starts with the rank that
/// reports it and names the rank(s) at fault.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// The group has failed (see [`Failure`]); no collective can complete.
    #[error("rank {rank}: {op} failed because rank {} {}", failure.rank, failure.cause)]
    GroupFailed {
        /// The rank reporting the error.
        rank: usize,
        /// The collective that was called.
        op: &'static str,
        /// The group's first failure.
        failure: Failure,
    },

    /// This rank waited longer than its timeout. The group is failed from
    /// then on, since the other ranks can no longer complete the collective.
    #[error("rank {rank}: {op} timed out after {timeout:?}; rank(s) {missing:?} did not arrive")]
    Timeout {
        /// The rank reporting the error.
        rank: usize,
        /// The collective that timed out.
        op: &'static str,
        /// The timeout that expired.
        timeout: Duration,
        /// The ranks that had not entered this collective (or, when all had,
        /// the rank whose message was awaited).
        missing: Vec<usize>,
    },

    /// The ranks called different collectives (or the same one with
    /// different roots or reduce ops).
    #[error("rank {rank}: {op}: the ranks called different collectives: {detail}")]
    OpMismatch {
        /// The rank reporting the error.
        rank: usize,
        /// The collective this rank called.
        op: &'static str,
        /// The ranks whose call differs from rank 0's.
        ranks: Vec<usize>,
        /// Who called what.
        detail: String,
    },

    /// The ranks passed tensors of different dtypes or shapes.
    #[error("rank {rank}: {op}: the ranks' tensors differ: {detail}")]
    TensorMismatch {
        /// The rank reporting the error.
        rank: usize,
        /// The collective.
        op: &'static str,
        /// The ranks whose tensor differs from rank 0's.
        ranks: Vec<usize>,
        /// Which rank passed which dtype and shape.
        detail: String,
    },

    /// A rank passed input the collective cannot use (a root out of range, a
    /// dtype collectives do not support, a wrong number of scatter tensors).
    /// Every rank reports it.
    #[error("rank {rank}: {op}: invalid input on rank {culprit}: {reason}")]
    InvalidInput {
        /// The rank reporting the error.
        rank: usize,
        /// The collective.
        op: &'static str,
        /// The rank whose input is invalid.
        culprit: usize,
        /// What is wrong with it.
        reason: String,
    },

    /// A message did not fit the collective in progress: the ranks' calls
    /// are out of step. The group is failed from then on.
    #[error("rank {rank}: {op}: unexpected message from rank {peer}: {detail}")]
    Protocol {
        /// The rank reporting the error.
        rank: usize,
        /// The collective.
        op: &'static str,
        /// The rank that sent the message.
        peer: usize,
        /// What was wrong with it.
        detail: String,
    },

    /// Building the result tensor failed on this rank (after the
    /// communication completed, so the group is unaffected).
    #[error("rank {rank}: {op}: {source}")]
    Tensor {
        /// The rank reporting the error.
        rank: usize,
        /// The collective.
        op: &'static str,
        /// candle's error.
        source: candle_core::Error,
    },

    /// The group does not implement this call (a group type that has no
    /// sub-groups or point-to-point yet); the group is unaffected.
    #[error("rank {rank}: {op} is not supported by {group}")]
    Unsupported {
        /// The rank reporting the error.
        rank: usize,
        /// The call.
        op: &'static str,
        /// The group's type.
        group: &'static str,
    },

    /// [`all_gather_object`] received bytes it cannot decode as the
    /// requested type.
    #[error(
        "rank {rank}: all_gather_object: cannot decode the object of rank {culprit}: {source}"
    )]
    Decode {
        /// The rank reporting the error.
        rank: usize,
        /// The rank whose object does not decode.
        culprit: usize,
        /// The decoder's error.
        source: rmp_serde::decode::Error,
    },
}

/// `Result` with [`CommError`].
pub type Result<T> = std::result::Result<T, CommError>;

/// One rank's view of a group of ranks that run collectives together.
///
/// Every rank must call the same collectives in the same order. Results
/// have the input's shape, dtype and device, and never share storage with
/// the inputs. Calls on one handle are serialized. The trait is
/// object-safe: `Arc<dyn ProcessGroup>` works.
///
/// # Errors
///
/// Every collective returns [`CommError::GroupFailed`] once the group has
/// failed and [`CommError::Timeout`] when this rank's timeout expires. Calls
/// that do not fit together ([`CommError::OpMismatch`],
/// [`CommError::TensorMismatch`]) or input a collective cannot use
/// ([`CommError::InvalidInput`]) give every rank the same error, and the
/// group stays usable.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_dp::comm::{ProcessGroup, ReduceOp};
/// use candle_dp::launch::spawn;
///
/// let sums = spawn(3, |ctx| {
///     let x = Tensor::new(&[ctx.rank as f32, 1.0], &Device::Cpu)?;
///     let sum = ctx.pg.all_reduce(&x, ReduceOp::Sum)?;
///     Ok(sum.to_vec1::<f32>()?)
/// })?;
/// assert_eq!(sums, vec![vec![3.0, 3.0]; 3]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub trait ProcessGroup: Send + Sync + fmt::Debug {
    /// This rank's place in the group and its timeout, which the four
    /// accessors below read (a wrapper around another group returns the
    /// inner group's).
    fn membership(&self) -> &Membership;

    /// This rank's index, in `0..world_size()`.
    fn rank(&self) -> usize {
        self.membership().rank()
    }

    /// The number of ranks in the group.
    fn world_size(&self) -> usize {
        self.membership().world_size()
    }

    /// Bounds every later wait of this rank: a collective that has not
    /// completed `timeout` after it was called returns
    /// [`CommError::Timeout`] and fails the group. `None` waits forever (a
    /// failed or departed rank still ends the wait).
    fn set_timeout(&self, timeout: Option<Duration>) {
        self.membership().set_timeout(timeout)
    }

    /// The timeout set by [`set_timeout`](ProcessGroup::set_timeout) or the
    /// group's options.
    fn timeout(&self) -> Option<Duration> {
        self.membership().timeout()
    }

    /// Whether this group reduces GPU tensors on the GPUs (an `NcclGroup`),
    /// so that DDP keeps its buckets there and exchanges the gradients'
    /// presence flags on the host once per step instead of inside every
    /// bucket. Default: `false` (buckets carry their flags, as the
    /// host groups' bitwise guarantees are stated).
    fn reduces_on_device(&self) -> bool {
        false
    }

    /// Returns once the collectives this rank queued on its device have
    /// completed, or with the group's failure: for a group whose
    /// collectives run asynchronously on a GPU (an `NcclGroup` with a
    /// timeout), so that DDP hands gradients to the optimizer only from a
    /// collective that completed. Default: nothing queued, `Ok` at once.
    fn wait_for_device(&self) -> Result<()> {
        Ok(())
    }

    /// Combines `tensor` across all ranks with `op`; every rank gets the
    /// (bitwise identical) result.
    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor>;

    /// Combines the concatenation of `tensors` (each flattened; all of one
    /// dtype and device) across all ranks with `op`, and returns it as one
    /// 1-D tensor: bitwise [`all_reduce`](ProcessGroup::all_reduce) of
    /// `Tensor::cat` of the flattened tensors, which is what this default
    /// does. [`ThreadGroup`] reads the tensors where they are instead of
    /// copying them into one buffer first (DDP's buckets use this).
    ///
    /// If this rank's tensors cannot be concatenated (none, or differing
    /// dtypes), the group is failed with the reason, so the other ranks do
    /// not wait for this one.
    ///
    /// ```
    /// use candle_core::{Device, Tensor};
    /// use candle_dp::comm::{ProcessGroup, ReduceOp, ThreadGroup};
    ///
    /// let pg = ThreadGroup::new(1).remove(0);
    /// let a = Tensor::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu)?;
    /// let b = Tensor::new(&[5f32], &Device::Cpu)?;
    /// let sum = pg.all_reduce_concat(&[a, b], ReduceOp::Sum)?;
    /// assert_eq!(sum.to_vec1::<f32>()?, [1., 2., 3., 4., 5.]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    fn all_reduce_concat(&self, tensors: &[Tensor], op: ReduceOp) -> Result<Tensor> {
        all_reduce_concat_copied(self, tensors, op)
    }

    /// Returns a copy of `root`'s tensor on every rank. Every rank passes a
    /// tensor of the same dtype and shape (only `root`'s values are used).
    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Tensor>;

    /// Returns every rank's tensor, in rank order, on every rank.
    fn all_gather(&self, tensor: &Tensor) -> Result<Vec<Tensor>>;

    /// Reduces `tensor` (flattened) across ranks with `op` and gives rank
    /// `r` only its piece: the `counts[r]` elements after the first
    /// `counts[..r]` (MPI's `MPI_Reduce_scatter`, PyTorch's
    /// `reduce_scatter_tensor` with pieces of any size). Every rank passes
    /// the same `counts`, one per rank, adding up to the tensor's size.
    ///
    /// **Bitwise:** each rank's piece equals the same slice of
    /// [`all_reduce`](ProcessGroup::all_reduce)'s result for the same
    /// tensors, on every group; this default computes that all-reduce and
    /// keeps the piece (a group may do less work, never give other bytes).
    /// ZeRO relies on it to train to DDP's very weights.
    ///
    /// Counts that are not one per rank, do not add up, or differ between
    /// ranks give every rank [`CommError::InvalidInput`] naming the rank.
    ///
    /// ```
    /// use candle_core::{Device, Tensor};
    /// use candle_dp::comm::{ProcessGroup, ReduceOp};
    /// use candle_dp::launch::spawn;
    ///
    /// let pieces = spawn(2, |ctx| {
    ///     let x = Tensor::new(&[1f32, 2., 3.], &Device::Cpu)?;
    ///     Ok(ctx.pg.reduce_scatter(&x, ReduceOp::Sum, &[2, 1])?.to_vec1::<f32>()?)
    /// })?;
    /// assert_eq!(pieces, vec![vec![2., 4.], vec![6.]]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    fn reduce_scatter(&self, tensor: &Tensor, op: ReduceOp, counts: &[usize]) -> Result<Tensor> {
        shards::reduce_scatter_by_all_reduce(self, tensor, op, counts)
    }

    /// Every rank's tensor (the same dtype and shape on every rank),
    /// flattened and concatenated in rank order into one 1-D tensor, on
    /// every rank: the all-gather into one flat buffer that ZeRO uses to
    /// share the parameters each rank updated.
    ///
    /// ```
    /// use candle_core::{Device, Tensor};
    /// use candle_dp::comm::ProcessGroup;
    /// use candle_dp::launch::spawn;
    ///
    /// let all = spawn(2, |ctx| {
    ///     let x = Tensor::new(&[ctx.rank as f32; 2], &Device::Cpu)?;
    ///     Ok(ctx.pg.all_gather_into(&x)?.to_vec1::<f32>()?)
    /// })?;
    /// assert_eq!(all[1], [0., 0., 1., 1.]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    fn all_gather_into(&self, tensor: &Tensor) -> Result<Tensor> {
        shards::all_gather_into_by_all_gather(self, tensor)
    }

    /// Returns every rank's tensor, in rank order, on `root` (`Some`); the
    /// other ranks get `None`.
    fn gather(&self, tensor: &Tensor, root: usize) -> Result<Option<Vec<Tensor>>>;

    /// `root` passes one tensor per rank; rank `i` gets a copy of the `i`-th,
    /// on that tensor's device. The other ranks' `tensors` are ignored.
    fn scatter(&self, tensors: Option<&[Tensor]>, root: usize) -> Result<Tensor>;

    /// Like [`all_reduce`](ProcessGroup::all_reduce) (bitwise the same
    /// result), but only `root` gets it (`Some`).
    fn reduce(&self, tensor: &Tensor, root: usize, op: ReduceOp) -> Result<Option<Tensor>>;

    /// Returns once every rank has called `barrier`.
    fn barrier(&self) -> Result<()>;

    /// Returns every rank's bytes, in rank order, on every rank. Lengths may
    /// differ between ranks.
    fn all_gather_bytes(&self, bytes: Vec<u8>) -> Result<Vec<Vec<u8>>>;

    /// Marks this rank failed with `reason`: every pending and later
    /// collective of the group, on every rank, returns
    /// [`CommError::GroupFailed`]. Only the group's first failure is kept.
    fn abort(&self, reason: &str);

    /// The group's first failure, if any.
    fn failure(&self) -> Option<Failure>;

    /// Splits the group into sub-groups, MPI's `MPI_Comm_split`: a
    /// collective of this group, which every rank calls (in the same order
    /// as its other collectives). The ranks that pass the same
    /// [`Color`] form one new group, ranked by `key` (ties: by their rank
    /// here); [`Color::NONE`] joins none and gets `None`.
    ///
    /// A sub-group shares its parent's failures, both ways: a rank that
    /// fails, times out or aborts in any group of the family fails every
    /// group of it, so that no rank waits in one group for a rank that
    /// died in another. The [`Failure`] then names the rank by its rank in
    /// the family's first group (the world), since it may not be a member
    /// of the group that reports it. Each sub-group starts with this rank's
    /// timeout.
    ///
    /// Default: [`CommError::Unsupported`].
    ///
    /// ```
    /// use candle_core::{Device, Tensor};
    /// use candle_dp::comm::{Color, ProcessGroup, ReduceOp};
    /// use candle_dp::launch::spawn;
    ///
    /// // Ranks 0, 2 and 1, 3: two groups of two, by the rank's parity.
    /// let sums = spawn(4, |ctx| {
    ///     let half = ctx.pg.split(Color::new(ctx.rank as u32 % 2), 0)?.expect("a member");
    ///     let x = Tensor::new(&[ctx.rank as f32], &Device::Cpu)?;
    ///     Ok((half.rank(), half.all_reduce(&x, ReduceOp::Sum)?.to_vec1::<f32>()?))
    /// })?;
    /// assert_eq!(sums, [(0, vec![2.]), (0, vec![4.]), (1, vec![2.]), (1, vec![4.])]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    fn split(&self, color: Color, key: i64) -> Result<Option<SubGroup>> {
        let _ = (color, key);
        Err(unsupported(self, "split"))
    }

    /// The group of `ranks` (ranks of this group, in their order there),
    /// PyTorch's `new_group`: a collective every rank of this group calls
    /// with the same list, members or not; the members get `Some`. A rank
    /// out of range, a repeated rank, or lists that differ between the
    /// ranks give every rank [`CommError::InvalidInput`].
    ///
    /// ```
    /// use candle_dp::comm::ProcessGroup;
    /// use candle_dp::launch::spawn;
    ///
    /// let sizes = spawn(3, |ctx| {
    ///     let pair = ctx.pg.new_group(&[2, 0])?;
    ///     Ok(pair.map(|g| (g.rank(), g.world_size())))
    /// })?;
    /// assert_eq!(sizes, [Some((1, 2)), None, Some((0, 2))]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    fn new_group(&self, ranks: &[usize]) -> Result<Option<SubGroup>> {
        split::new_group_by_split(self, ranks)
    }

    /// Sends a copy of `tensor` to rank `dst` (PyTorch's `send`). Messages
    /// from one rank to another arrive in the order they were sent. The
    /// call returns once the tensor is on its way: a group may buffer it,
    /// so a send does not wait for the matching
    /// [`recv`](ProcessGroup::recv) (thread ranks never do).
    ///
    /// Default: [`CommError::Unsupported`].
    fn send(&self, tensor: &Tensor, dst: usize) -> Result<()> {
        let _ = (tensor, dst);
        Err(unsupported(self, "send"))
    }

    /// The next tensor rank `src` sent to this rank, with `like`'s dtype,
    /// shape and device (PyTorch's `recv` into `like`). A message of
    /// another dtype or shape means the two ranks are out of step: the
    /// group fails and the error names both shapes. The wait ends with an
    /// error when the timeout expires or the group fails.
    ///
    /// ```
    /// use candle_core::{Device, Tensor};
    /// use candle_dp::comm::ProcessGroup;
    /// use candle_dp::launch::spawn;
    ///
    /// let got = spawn(2, |ctx| {
    ///     let x = Tensor::new(&[7f32, 8.], &Device::Cpu)?;
    ///     if ctx.rank == 0 {
    ///         ctx.pg.send(&x, 1)?;
    ///         return Ok(vec![]);
    ///     }
    ///     Ok(ctx.pg.recv(&x.zeros_like()?, 0)?.to_vec1::<f32>()?)
    /// })?;
    /// assert_eq!(got[1], [7., 8.]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// Default: [`CommError::Unsupported`].
    fn recv(&self, like: &Tensor, src: usize) -> Result<Tensor> {
        let _ = (like, src);
        Err(unsupported(self, "recv"))
    }
}

/// The error of a call `pg` does not implement.
fn unsupported<P: ProcessGroup + ?Sized>(pg: &P, op: &'static str) -> CommError {
    CommError::Unsupported {
        rank: pg.rank(),
        op,
        group: std::any::type_name::<P>(),
    }
}

/// [`ProcessGroup::all_reduce_concat`] by concatenating the tensors into one
/// first.
pub(crate) fn all_reduce_concat_copied<P: ProcessGroup + ?Sized>(
    pg: &P,
    tensors: &[Tensor],
    op: ReduceOp,
) -> Result<Tensor> {
    pg.all_reduce(&concat_flat(pg, tensors)?, op)
}

/// The tensors flattened and concatenated into one 1-D tensor; if they
/// cannot be (none, or differing dtypes), the group is failed with the
/// reason, so that the other ranks do not wait for this one.
pub(crate) fn concat_flat<P: ProcessGroup + ?Sized>(pg: &P, tensors: &[Tensor]) -> Result<Tensor> {
    let flat = tensors
        .iter()
        .map(Tensor::flatten_all)
        .collect::<candle_core::Result<Vec<_>>>()
        .and_then(|flat| Tensor::cat(&flat, 0));
    match flat {
        Ok(flat) => Ok(flat),
        Err(e) => {
            let reason = format!("all_reduce_concat: cannot concatenate the tensors: {e}");
            pg.abort(&reason);
            Err(CommError::InvalidInput {
                rank: pg.rank(),
                op: "all_reduce_concat",
                culprit: pg.rank(),
                reason,
            })
        }
    }
}

/// Gathers a serde-serializable value from every rank, in rank order, on
/// every rank (PyTorch's `all_gather_object`), through
/// [`ProcessGroup::all_gather_bytes`] and MessagePack. Like PyTorch's
/// pickle, the encoding keeps every value exactly: a NaN loss gathered
/// for logging arrives as the same NaN, bit for bit.
///
/// A value that fails to serialize on one rank makes every rank return
/// [`CommError::InvalidInput`] naming it.
///
/// ```
/// use candle_dp::comm::all_gather_object;
/// use candle_dp::launch::spawn;
///
/// let names = spawn(2, |ctx| {
///     Ok(all_gather_object(ctx.pg.as_ref(), &format!("worker-{}", ctx.rank))?)
/// })?;
/// assert_eq!(names[1], vec!["worker-0".to_string(), "worker-1".to_string()]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn all_gather_object<T: Serialize + DeserializeOwned, P: ProcessGroup + ?Sized>(
    pg: &P,
    value: &T,
) -> Result<Vec<T>> {
    // Each rank's bytes start with a tag, so that a rank whose value does
    // not serialize still takes part and every rank can report it, instead
    // of that rank returning early and the others waiting for it.
    const OK: u8 = 0;
    const FAILED: u8 = 1;
    // MessagePack, with field names (so `skip_serializing_if` and the like
    // decode): every f32 and f64 travels bit for bit, NaN and infinities
    // included, where JSON would write `null`.
    let bytes = match rmp_serde::to_vec_named(value) {
        Ok(encoded) => [vec![OK], encoded].concat(),
        Err(e) => [vec![FAILED], e.to_string().into_bytes()].concat(),
    };
    let gathered = pg.all_gather_bytes(bytes)?;
    let rank = pg.rank();
    gathered
        .iter()
        .enumerate()
        .map(|(culprit, bytes)| match bytes.split_first() {
            Some((&OK, encoded)) => {
                rmp_serde::from_slice(encoded).map_err(|source| CommError::Decode {
                    rank,
                    culprit,
                    source,
                })
            }
            Some((_, message)) => Err(CommError::InvalidInput {
                rank,
                op: "all_gather_object",
                culprit,
                reason: format!(
                    "cannot serialize its object: {}",
                    String::from_utf8_lossy(message)
                ),
            }),
            None => Err(CommError::InvalidInput {
                rank,
                op: "all_gather_object",
                culprit,
                reason: "sent no bytes".to_string(),
            }),
        })
        .collect()
}
