//! Run one closure on every rank of an in-process group (the thread
//! analogue of `torch.multiprocessing.spawn`), failing fast.
//!
//! When a rank's closure returns an error or panics, its group is failed at
//! once, so the other ranks' pending and later collectives return errors
//! instead of waiting for it, and [`spawn`] reports that first failure, not
//! the errors it caused on the other ranks.

use std::panic::{self, AssertUnwindSafe};
use std::sync::Arc;
use std::thread;

use super::{LaunchError, RankContext};
use crate::comm::{Failure, FailureCause, GroupOptions, ProcessGroup, ThreadGroup, ThreadRank};
use crate::cpu_threads;
use crate::util::panic_message::panic_message;

/// Runs `f` on `world_size` ranks of a new [`ThreadGroup`] (default
/// [`GroupOptions`]), each on its own thread, and returns their results in
/// rank order. See [`spawn_with`].
///
/// ```
/// use candle_dp::comm::ProcessGroup;
/// use candle_dp::launch::{spawn, LaunchError};
///
/// let ranks = spawn(4, |ctx| Ok(ctx.rank * 10))?;
/// assert_eq!(ranks, vec![0, 10, 20, 30]);
///
/// let err = spawn(2, |ctx| {
///     anyhow::ensure!(ctx.rank != 1, "out of data");
///     ctx.pg.barrier()?; // fails promptly on rank 0: rank 1 has failed
///     Ok(())
/// })
/// .unwrap_err();
/// assert!(matches!(err, LaunchError::Failed { rank: 1, .. }));
/// assert_eq!(err.to_string(), "rank 1 failed: out of data");
/// # Ok::<(), LaunchError>(())
/// ```
pub fn spawn<T, F>(world_size: usize, f: F) -> Result<Vec<T>, LaunchError>
where
    T: Send,
    F: Fn(RankContext) -> anyhow::Result<T> + Sync,
{
    spawn_with(world_size, GroupOptions::default(), f)
}

/// Runs `f` on `world_size` ranks of a new [`ThreadGroup`] built with
/// `options`, each on its own scoped thread (so `f` may borrow), and returns
/// their results in rank order.
///
/// If a rank's closure returns an error or panics, the group is failed right
/// away with that rank's error, so the other ranks' collectives return
/// [`CommError::GroupFailed`](crate::comm::CommError::GroupFailed) promptly
/// and they can finish. Once every thread has finished, the group's first
/// failure is returned: that rank's own error or panic, not the errors it
/// caused elsewhere. (Code that never calls a collective cannot be
/// interrupted; `spawn` waits for it.)
///
/// ```
/// use std::time::Duration;
/// use candle_dp::comm::GroupOptions;
/// use candle_dp::launch::spawn_with;
///
/// let options = GroupOptions { timeout: Some(Duration::from_secs(10)), ..Default::default() };
/// let out = spawn_with(2, options, |ctx| Ok(ctx.world_size))?;
/// assert_eq!(out, vec![2, 2]);
/// # Ok::<(), candle_dp::launch::LaunchError>(())
/// ```
pub fn spawn_with<T, F>(
    world_size: usize,
    options: GroupOptions,
    f: F,
) -> Result<Vec<T>, LaunchError>
where
    T: Send,
    F: Fn(RankContext) -> anyhow::Result<T> + Sync,
{
    spawn_attempt(world_size, options, 0, &f)
}

/// [`spawn_with`] as start number `restart` of an elastic job (the ranks'
/// [`RankContext::restart`]).
pub(super) fn spawn_attempt<T, F>(
    world_size: usize,
    options: GroupOptions,
    restart: usize,
    f: &F,
) -> Result<Vec<T>, LaunchError>
where
    T: Send,
    F: Fn(RankContext) -> anyhow::Result<T> + Sync,
{
    let ranks = ThreadGroup::with_options(world_size, options);
    let Some(watch) = ranks.first().map(ThreadRank::watch) else {
        return Err(LaunchError::EmptyWorld);
    };
    cpu_threads::share_cpu_between(world_size);
    let threads = cpu_threads::threads_per_worker(world_size);
    let (outcomes, start_error) = thread::scope(|scope| {
        let mut handles = Vec::with_capacity(world_size);
        let mut start_error = None;
        for pg in ranks {
            let rank = pg.rank();
            let started = thread::Builder::new()
                .name(format!("candle-dp-rank-{rank}"))
                .spawn_scoped(scope, move || run_rank(pg, threads, restart, f));
            match started {
                Ok(handle) => handles.push(handle),
                Err(source) => {
                    // The ranks already running must not wait for this one.
                    watch.fail(Failure {
                        rank,
                        cause: FailureCause::Aborted(format!("its thread did not start: {source}")),
                    });
                    start_error = Some(LaunchError::Spawn { rank, source });
                    break;
                }
            }
        }
        let outcomes: Vec<Outcome<T>> = handles
            .into_iter()
            .map(|handle| {
                // `run_rank` catches the closure's panics; this is for
                // completeness.
                handle
                    .join()
                    .unwrap_or_else(|payload| Outcome::Panicked(panic_message(payload.as_ref())))
            })
            .collect();
        (outcomes, start_error)
    });
    match start_error {
        Some(error) => Err(error),
        None => first_failure(outcomes, watch.failure()),
    }
}

/// How a rank's closure ended.
enum Outcome<T> {
    Done(T),
    Failed(anyhow::Error),
    Panicked(String),
}

/// Runs `f` for rank `pg` with its own rayon pool of `threads` threads (its
/// share of the cores, see [`cpu_threads`]), then tells the group how it
/// ended.
fn run_rank<T, F>(pg: ThreadRank, threads: usize, restart: usize, f: &F) -> Outcome<T>
where
    T: Send,
    F: Fn(RankContext) -> anyhow::Result<T> + Sync,
{
    // `spawn` keeps its own reference so that, after a failure, the group is
    // failed with this rank's error before the handle goes away (otherwise
    // the others could first see this rank "leave").
    let pg = Arc::new(pg);
    let ctx = RankContext {
        rank: pg.rank(),
        world_size: pg.world_size(),
        pg: Arc::clone(&pg) as Arc<dyn ProcessGroup>,
        restart,
    };
    // Unwind safety: after a panic only the group's failure state is used,
    // and it is built to be read after any failure.
    let rank = ctx.rank;
    let run = || match cpu_threads::worker_pool(format!("candle-dp-rank-{rank}"), threads) {
        Ok(pool) => pool.install(|| f(ctx)),
        Err(e) => Err(anyhow::anyhow!(
            "cannot start the thread pool of rank {rank}: {e}"
        )),
    };
    let outcome = match panic::catch_unwind(AssertUnwindSafe(run)) {
        Ok(Ok(value)) => Outcome::Done(value),
        Ok(Err(error)) => Outcome::Failed(error),
        Err(payload) => Outcome::Panicked(panic_message(payload.as_ref())),
    };
    match &outcome {
        // Finished, whatever still holds the handle (a returned DDP, a
        // clone of the group): the others must not wait for this rank.
        Outcome::Done(_) => pg.leave(),
        Outcome::Failed(error) => pg.abort(&format!("{error:#}")),
        Outcome::Panicked(message) => pg.abort(&format!("panicked: {message}")),
    }
    outcome
}

/// The results in rank order, or the root cause of the failure.
fn first_failure<T>(
    mut outcomes: Vec<Outcome<T>>,
    failure: Option<Failure>,
) -> Result<Vec<T>, LaunchError> {
    // The group's first recorded failure is the root cause; a rank leaving
    // is not one by itself (every rank leaves when it finishes), only when a
    // rank still needed it, and that rank's error then says so.
    if let Some(Failure { rank, cause }) = failure.filter(|f| f.cause != FailureCause::Left) {
        if rank < outcomes.len() {
            return Err(match outcomes.swap_remove(rank) {
                Outcome::Failed(source) => LaunchError::Failed { rank, source },
                Outcome::Panicked(message) => LaunchError::Panicked { rank, message },
                Outcome::Done(_) => LaunchError::Aborted {
                    rank,
                    reason: match cause {
                        FailureCause::Aborted(reason) => reason,
                        other => other.to_string(),
                    },
                },
            });
        }
    }
    outcomes
        .into_iter()
        .enumerate()
        .map(|(rank, outcome)| match outcome {
            Outcome::Done(value) => Ok(value),
            Outcome::Failed(source) => Err(LaunchError::Failed { rank, source }),
            Outcome::Panicked(message) => Err(LaunchError::Panicked { rank, message }),
        })
        .collect()
}
