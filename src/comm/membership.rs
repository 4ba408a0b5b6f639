//! A rank's place in its group and its timeout: the state behind
//! [`ProcessGroup`](super::ProcessGroup)'s accessors, which every
//! implementation would otherwise write out again.

use std::sync::Mutex;
use std::time::Duration;

use crate::util::lock::lock;

/// Which rank a group handle is, of how many, and how long its collectives
/// may wait. An implementation of [`ProcessGroup`](super::ProcessGroup)
/// holds one and returns it from
/// [`membership`](super::ProcessGroup::membership); the trait's `rank`,
/// `world_size`, `timeout` and `set_timeout` read it.
///
/// ```
/// use std::time::Duration;
/// use candle_dp::comm::Membership;
///
/// let m = Membership::new(1, 4, None);
/// assert_eq!((m.rank(), m.world_size(), m.timeout()), (1, 4, None));
/// m.set_timeout(Some(Duration::from_secs(5)));
/// assert_eq!(m.timeout(), Some(Duration::from_secs(5)));
/// ```
#[derive(Debug)]
pub struct Membership {
    rank: usize,
    world_size: usize,
    // Behind a lock because `set_timeout` takes `&self`: a handle is shared
    // (`Arc`) between the code that trains and the code that tunes it.
    timeout: Mutex<Option<Duration>>,
}

impl Membership {
    /// `rank` of `world_size` ranks, with the initial `timeout` (`None`:
    /// waits end only when the collective completes or the group fails).
    pub fn new(rank: usize, world_size: usize, timeout: Option<Duration>) -> Self {
        Membership {
            rank,
            world_size,
            timeout: Mutex::new(timeout),
        }
    }

    /// This rank's index, in `0..world_size()`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks in the group.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The current timeout.
    pub fn timeout(&self) -> Option<Duration> {
        *lock(&self.timeout)
    }

    /// Replaces the timeout; calls that start afterwards use it.
    pub fn set_timeout(&self, timeout: Option<Duration>) {
        *lock(&self.timeout) = timeout;
    }
}
