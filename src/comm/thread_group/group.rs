//! The group and its ranks: [`ThreadGroup`] creates the ranks' handles and
//! channels, [`ThreadRank`] is one rank's handle, and the state its ranks
//! share records the group's first failure.

use std::convert::Infallible;
use std::fmt;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use crossbeam::channel::{self, Receiver, Sender};

use crate::comm::protocol::Envelope;
use crate::comm::{Failure, FailureCause, Membership, ProcessGroup};
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
    /// The initial timeout of every rank (see [`ProcessGroup::set_timeout`]);
    /// `None`: no limit. Default: [`DEFAULT_TIMEOUT`](crate::comm::DEFAULT_TIMEOUT),
    /// 30 minutes as in PyTorch, or what the environment variable
    /// [`CANDLE_DP_TIMEOUT`](crate::comm::TIMEOUT_VARIABLE) says.
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
            timeout: crate::comm::timeout::timeout_from_env(),
            ring_threshold_bytes: DEFAULT_RING_THRESHOLD_BYTES,
        }
    }
}

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
/// any other tensor from one host copy). In a large all-reduce, each rank
/// reduces its chunk straight into one result that all ranks then share:
/// **every rank gets the same CPU tensor** (one storage; on another device,
/// a copy of it). candle tensors are immutable, so this only shows if a
/// rank writes into the result in place (`Tensor::slice_set`), which the
/// others would see. In a large `reduce`, the root reduces the whole buffer
/// (two ranks) or copies the others' chunks (more).
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
                membership: Membership::new(rank, world_size, options.timeout),
                shared: Arc::clone(&shared),
                alarm: alarm_rx.clone(),
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
pub(super) struct Shared {
    pub(super) ring_threshold_bytes: usize,
    /// The group's first failure.
    pub(super) failure: OnceLock<Failure>,
    /// Never carries a message: dropping it at the first failure disconnects
    /// every rank's `alarm` receiver, which wakes every wait at once.
    alarm: Mutex<Option<Sender<Infallible>>>,
    /// How many collectives each rank has entered, to name the ranks a
    /// timed-out wait is missing.
    pub(super) entered: Vec<AtomicU64>,
}

impl Shared {
    /// Records `failure` unless the group already failed, and wakes every
    /// wait. The failure is stored before the alarm sounds, so a woken wait
    /// always finds it.
    pub(super) fn fail(&self, failure: Failure) {
        let _first = self.failure.set(failure);
        lock(&self.alarm).take();
    }

    pub(super) fn failure(&self) -> Option<Failure> {
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
pub(super) struct Links {
    /// How many collectives this rank has entered; tags its messages.
    pub(super) seq: u64,
    /// `to[dst]`: this rank's channel to `dst`.
    pub(super) to: Vec<Sender<Envelope>>,
    /// `from[src]`: the channel from `src` to this rank.
    pub(super) from: Vec<Receiver<Envelope>>,
    /// Whether this rank has left (see [`ThreadRank::leave`]).
    pub(super) left: bool,
}

/// One rank's handle on a [`ThreadGroup`]; implements [`ProcessGroup`].
///
/// Dropping the handle leaves the group: collectives that still need this
/// rank fail with [`FailureCause::Left`] naming it (after using whatever it
/// sent before leaving). Dropping it while the thread panics fails the group
/// with [`FailureCause::Panicked`].
pub struct ThreadRank {
    pub(super) membership: Membership,
    pub(super) shared: Arc<Shared>,
    pub(super) alarm: Receiver<Infallible>,
    pub(super) links: Mutex<Links>,
}

impl fmt::Debug for ThreadRank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ThreadRank")
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
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
                rank: self.rank(),
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
}
