//! The group and its ranks: [`ThreadGroup`] creates the ranks' handles and
//! channels, [`ThreadRank`] is one rank's handle, and the state its ranks
//! share records the group's first failure.

use std::collections::HashMap;
use std::convert::Infallible;
use std::fmt;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use candle_core::Tensor;
use crossbeam::channel::{self, Receiver, Sender};

use crate::comm::protocol::Envelope;
use crate::comm::{Failure, FailureCause, Membership, ProcessGroup};
use crate::util::lock::lock;

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
        let world_ranks = (0..world_size).collect();
        Self::in_family(Family::new(), world_ranks, &options)
    }

    /// The handles of a group whose rank `r` is rank `world_ranks[r]` of
    /// `family`'s first group, sharing its failures.
    pub(super) fn in_family(
        family: Arc<Family>,
        world_ranks: Vec<usize>,
        options: &GroupOptions,
    ) -> Vec<ThreadRank> {
        let world_size = world_ranks.len();
        let shared = Arc::new(Shared {
            ring_threshold_bytes: options.ring_threshold_bytes,
            family,
            world_ranks,
            entered: (0..world_size).map(|_| AtomicU64::new(0)).collect(),
            splits: Mutex::new(HashMap::new()),
        });
        let (to, from) = channel_grid(world_size);
        let (p2p_to, p2p_from) = channel_grid(world_size);
        to.into_iter()
            .zip(from)
            .zip(p2p_to.into_iter().zip(p2p_from))
            .enumerate()
            .map(|(rank, ((to, from), (p2p_to, p2p_from)))| ThreadRank {
                membership: Membership::new(rank, world_size, options.timeout),
                alarm: shared.family.alarm_rx.clone(),
                shared: Arc::clone(&shared),
                links: Mutex::new(Links {
                    seq: 0,
                    to,
                    from,
                    left: false,
                }),
                p2p: Mutex::new(PointToPoint {
                    to: p2p_to,
                    from: p2p_from,
                }),
                splits: AtomicU64::new(0),
            })
            .collect()
    }
}

/// One channel per ordered pair of `world_size` ranks: `to[src][dst]` and
/// `from[dst][src]` are its two ends.
#[allow(clippy::type_complexity)]
fn channel_grid<T>(world_size: usize) -> (Vec<Vec<Sender<T>>>, Vec<Vec<Receiver<T>>>) {
    let mut to: Vec<Vec<Sender<T>>> = (0..world_size).map(|_| Vec::new()).collect();
    let mut from: Vec<Vec<Receiver<T>>> = (0..world_size).map(|_| Vec::new()).collect();
    for senders in to.iter_mut() {
        for receivers in from.iter_mut() {
            let (tx, rx) = channel::unbounded();
            senders.push(tx);
            receivers.push(rx);
        }
    }
    (to, from)
}

/// What a group and every sub-group split from it share: the first
/// failure of any of them, with the failed rank numbered in the first
/// group (the world), and the alarm that wakes every wait of all of them.
pub(super) struct Family {
    failure: OnceLock<Failure>,
    /// Never carries a message: dropping it at the first failure disconnects
    /// every rank's `alarm` receiver, which wakes every wait at once.
    alarm: Mutex<Option<Sender<Infallible>>>,
    alarm_rx: Receiver<Infallible>,
}

impl Family {
    fn new() -> Arc<Family> {
        let (alarm, alarm_rx) = channel::bounded(0);
        Arc::new(Family {
            failure: OnceLock::new(),
            alarm: Mutex::new(Some(alarm)),
            alarm_rx,
        })
    }
}

/// The handles of a sub-group being made by a split, which its members
/// take one each.
type Rendezvous = Vec<Option<ThreadRank>>;

/// State shared by all ranks of a group.
pub(super) struct Shared {
    pub(super) ring_threshold_bytes: usize,
    pub(super) family: Arc<Family>,
    /// `world_ranks[r]`: rank `r`'s rank in the family's first group.
    pub(super) world_ranks: Vec<usize>,
    /// How many collectives each rank has entered, to name the ranks a
    /// timed-out wait is missing.
    pub(super) entered: Vec<AtomicU64>,
    /// The sub-groups being split off, by the split's number and colour.
    pub(super) splits: Mutex<HashMap<(u64, u32), Rendezvous>>,
}

impl Shared {
    /// Records `failure` (with `rank` and any missing ranks numbered in
    /// this group) unless the family already failed, and wakes every wait.
    /// The failure is stored before the alarm sounds, so a woken wait
    /// always finds it.
    pub(super) fn fail(&self, failure: Failure) {
        let world = |r: usize| self.world_ranks.get(r).copied().unwrap_or(r);
        let cause = match failure.cause {
            FailureCause::TimedOut { op, missing } => FailureCause::TimedOut {
                op,
                missing: missing.into_iter().map(world).collect(),
            },
            cause => cause,
        };
        let _first = self.family.failure.set(Failure {
            rank: world(failure.rank),
            cause,
        });
        lock(&self.family.alarm).take();
    }

    /// The family's first failure (ranks numbered in the world).
    pub(super) fn failure(&self) -> Option<Failure> {
        self.family.failure.get().cloned()
    }

    pub(super) fn has_failed(&self) -> bool {
        self.family.failure.get().is_some()
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

/// A rank's point-to-point channels, apart from the collectives' so that a
/// message sent ahead never meets a collective's header.
pub(super) struct PointToPoint {
    /// `to[dst]`: this rank's channel to `dst`.
    pub(super) to: Vec<Sender<Tensor>>,
    /// `from[src]`: the channel from `src` to this rank.
    pub(super) from: Vec<Receiver<Tensor>>,
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
    pub(super) p2p: Mutex<PointToPoint>,
    /// How many splits this rank has made: every rank of a group splits in
    /// the same order, so the count names a split across the ranks.
    pub(super) splits: AtomicU64,
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
        let mut p2p = lock(&self.p2p);
        p2p.to.clear();
        p2p.from.clear();
    }
}
