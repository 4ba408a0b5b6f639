//! Launchers: run one training function on every rank, as threads of this
//! process ([`spawn`], the analogue of `torch.multiprocessing.spawn`) or as
//! the processes of an MPI job ([`run`] under `mpirun`, the analogue of
//! `torchrun`), failing fast in both cases.
//!
//! [`run`] is the one entry point for programs that should work both ways:
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use candle_dp::comm::{GroupOptions, ReduceOp};
//! use candle_dp::launch::run;
//!
//! // `cargo run`: 2 thread ranks; `mpirun -np 4 prog`: 4 processes, with
//! // the `mpi` feature (each process gets its own rank's result).
//! let results = run(2, GroupOptions::default(), |ctx| {
//!     let x = Tensor::new(&[1f32], &Device::Cpu)?;
//!     let n = ctx.pg.all_reduce(&x, ReduceOp::Sum)?.to_vec1::<f32>()?[0];
//!     Ok((ctx.rank, n as usize))
//! })?;
//! for (rank, world) in results {
//!     assert!(rank < world);
//! }
//! # Ok::<(), candle_dp::launch::LaunchError>(())
//! ```

mod elastic;
#[cfg(feature = "nccl")]
mod gpus;
#[cfg(feature = "mpi")]
mod launcher;
#[cfg(feature = "mpi")]
mod mpi;
pub mod report;
mod signal;
mod supervisor;
mod threads;

use std::sync::Arc;

use crate::comm::{Failure, GroupOptions, ProcessGroup};

pub use elastic::{Elastic, ElasticError, Restarted, RESTART_VARIABLE};
#[cfg(feature = "nccl")]
pub use gpus::run_on_gpus;
pub use supervisor::{Attempt, Host, JobFailed, JobLauncher, Mpirun, Srun, Supervised};
pub use threads::{spawn, spawn_with};

/// What the closure given to [`run`] or [`spawn`] gets on each rank.
#[derive(Debug, Clone)]
pub struct RankContext {
    /// This rank, in `0..world_size`.
    pub rank: usize,
    /// The number of ranks.
    pub world_size: usize,
    /// This rank's handle on the group: a
    /// [`ThreadRank`](crate::comm::ThreadRank) under [`spawn`], an
    /// `MpiGroup` (feature `mpi`) when [`run`] runs under `mpirun`.
    pub pg: Arc<dyn ProcessGroup>,
    /// Which start of an elastic job this is: 0 the first time, `k` after
    /// `k` restarts ([`Elastic`]; under a supervisor, read from
    /// [`RESTART_VARIABLE`]). A loop resumes from its newest state when it
    /// is not 0.
    pub restart: usize,
}

impl RankContext {
    /// The group handle as a trait object, for code written against
    /// [`ProcessGroup`].
    pub fn process_group(&self) -> Arc<dyn ProcessGroup> {
        self.pg.clone()
    }
}

/// Why [`run`] or [`spawn`] failed; every variant names the rank at the
/// root of it.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// `world_size` was 0.
    #[error("world_size must be at least 1, got 0")]
    EmptyWorld,

    /// The closure returned an error on `rank`.
    #[error("rank {rank} failed: {source:#}")]
    Failed {
        /// The failing rank.
        rank: usize,
        /// What its closure returned (downcast it to, e.g.,
        /// [`CommError`](crate::comm::CommError)).
        source: anyhow::Error,
    },

    /// The closure panicked on `rank`.
    #[error("rank {rank} panicked: {message}")]
    Panicked {
        /// The panicking rank.
        rank: usize,
        /// The panic message, when the payload was a string.
        message: String,
    },

    /// `rank` failed the group (called
    /// [`ProcessGroup::abort`], or timed out) but its closure returned `Ok`.
    #[error("rank {rank} aborted the group: {reason}")]
    Aborted {
        /// The rank that failed the group.
        rank: usize,
        /// Its reason.
        reason: String,
    },

    /// This process's rank stopped because another rank failed first (under
    /// MPI, where the failing rank's own error is printed by its process).
    #[error("rank {rank} stopped because rank {} {}: {source:#}", failure.rank, failure.cause)]
    PeerFailed {
        /// This process's rank.
        rank: usize,
        /// The failure that stopped it.
        failure: Failure,
        /// What its closure returned.
        source: anyhow::Error,
    },

    /// The program runs under an MPI launcher (the variable is set) but
    /// candle-dp was built without its `mpi` feature, so each process would
    /// train alone.
    #[error("this program runs under mpirun ({variable} is set) but candle-dp was built without its `mpi` feature: rebuild with `--features mpi`")]
    MpiNotEnabled {
        /// The environment variable that gave the launcher away.
        variable: String,
    },

    /// MPI did not start.
    #[cfg(feature = "mpi")]
    #[error(transparent)]
    Mpi(#[from] crate::comm::MpiInitError),

    /// The thread of `rank` could not be started.
    #[error("could not start the thread of rank {rank}: {source}")]
    Spawn {
        /// The rank whose thread did not start.
        rank: usize,
        /// The operating system's error.
        source: std::io::Error,
    },
}

pub use crate::process_env::Backend;

/// Runs `f` on every rank and returns the results of the ranks that ran
/// in this process, in rank order: under an MPI launcher (see
/// [`Backend::from_env`]), this process's rank of an
/// `MpiGroup` (feature `mpi`; one result; the world size is
/// `mpirun`'s, and `threads` is not used); otherwise `threads` thread
/// ranks, as [`spawn_with`].
///
/// Under MPI, when `f` fails or panics the other ranks are told at once
/// (their collectives fail naming this rank) and the error is returned;
/// make the process exit non-zero with it (for example with
/// [`report::exit_code`]) so that `mpirun` ends the job. A rank stopped by
/// another's failure returns [`LaunchError::PeerFailed`] naming that rank.
/// Every rank's failure is also printed to standard error by `run` itself,
/// as whole lines prefixed with the rank (see [`report`]): a failing rank's
/// before the others learn of it, so that `mpirun` cannot end it first; a
/// panic, while `f` runs, as one such report too (candle-dp's panic hook
/// is in force while `f` runs; the one you had is back when `run`
/// returns).
///
/// # Errors
///
/// As [`spawn_with`]; under MPI also [`LaunchError::PeerFailed`], and
/// [`LaunchError::MpiNotEnabled`] when the program runs under `mpirun`
/// but was built without the `mpi` feature.
pub fn run<T, F>(threads: usize, options: GroupOptions, f: F) -> Result<Vec<T>, LaunchError>
where
    T: Send,
    F: Fn(RankContext) -> anyhow::Result<T> + Sync,
{
    match Backend::from_env() {
        Backend::Threads => spawn_with(threads, options, f),
        #[cfg(feature = "mpi")]
        Backend::Mpi { .. } => {
            crate::cpu_threads::share_cpu_with_local_processes(Backend::local_processes());
            mpi::run(options, f).map(|result| vec![result])
        }
        #[cfg(not(feature = "mpi"))]
        Backend::Mpi { variable } => Err(LaunchError::MpiNotEnabled { variable }),
    }
}
