//! [`run`](super::run) under an MPI launcher: this process is one rank of
//! an [`MpiGroup`].

use std::panic::{self, AssertUnwindSafe};
use std::sync::Arc;

use super::launcher::Launcher;
use super::report::{self, RankPanicHook};
use super::{LaunchError, RankContext};
use crate::comm::{Failure, FailureCause, GroupOptions, MpiGroup, ProcessGroup};
use crate::util::panic_message::panic_message;

/// Runs `f` on this process's rank and returns its result, or the failure
/// that stopped it (see [`run`](super::run)), printed as a
/// [`report`] too.
pub(super) fn run<T, F>(options: GroupOptions, f: F) -> Result<T, LaunchError>
where
    F: Fn(RankContext) -> anyhow::Result<T>,
{
    let pg = MpiGroup::init(options)?;
    let rank = pg.rank();
    let ctx = RankContext {
        rank,
        world_size: pg.world_size(),
        pg: Arc::clone(&pg) as Arc<dyn ProcessGroup>,
        restart: crate::process_env::Backend::restart(),
    };
    let panic_hook = RankPanicHook::install(rank);
    // Unwind safety: after a panic only the group's failure state is used.
    let outcome = panic::catch_unwind(AssertUnwindSafe(|| f(ctx)));
    drop(panic_hook);
    let first_failure_is_own = pg.failure().is_none_or(|f| f.rank == rank);
    // Say what went wrong here before telling the others: once one of them
    // exits, mpirun may end this process before it has printed anything.
    let own_report = match &outcome {
        Ok(Ok(_)) => None,
        Ok(Err(source)) if first_failure_is_own => Some(format!("rank {rank} failed: {source:#}")),
        Err(payload) if first_failure_is_own => Some(format!(
            "rank {rank} panicked: {}",
            panic_message(payload.as_ref())
        )),
        _ => None,
    };
    if let Some(report) = &own_report {
        report::eprint_from_run(report);
    }
    // Tell the other ranks (a no-op if another rank failed first), so that
    // they stop waiting for this one.
    match &outcome {
        Ok(Ok(_)) => {}
        Ok(Err(error)) => pg.abort(&format!("{error:#}")),
        Err(payload) => pg.abort(&format!("panicked: {}", panic_message(payload.as_ref()))),
    }
    let failure = pg.failure();
    // Leaves even if the value holds a handle; finalizes MPI when healthy.
    pg.leave();
    let timed_out = matches!(
        failure,
        Some(Failure {
            cause: FailureCause::TimedOut { .. },
            ..
        })
    );
    let result = outcome_of(rank, outcome, failure);
    if let Err(error) = &result {
        let text = report::one_line(error);
        if own_report.as_ref() != Some(&text) {
            report::eprint_from_run(&text);
        }
    }
    // A timeout may be a machine gone from the network, which Open MPI's
    // launcher never notices: end it, so that nothing outlives the job.
    if let (true, Some(launcher)) = (timed_out, Launcher::parent()) {
        report::eprint_report(&format!(
            "rank {rank} ends its {}: the group timed out, and Open MPI's launcher does not end a job whose machines it cannot reach",
            launcher.name()
        ));
        launcher.end();
    }
    result
}

/// What [`run`] returns on `rank`, from its closure's outcome and the
/// group's first failure (`failure`).
fn outcome_of<T>(
    rank: usize,
    outcome: std::thread::Result<anyhow::Result<T>>,
    failure: Option<Failure>,
) -> Result<T, LaunchError> {
    let failure_of_another = failure.clone().filter(|f| f.rank != rank);
    match (outcome, failure_of_another) {
        (Ok(Ok(value)), None) => match failure {
            // This rank failed the group (an abort, a timeout) although its
            // function returned a value: the job did not succeed.
            Some(own) => Err(LaunchError::Aborted {
                rank,
                reason: own.cause.to_string(),
            }),
            None => Ok(value),
        },
        (Ok(Ok(_)), Some(failure)) => Err(LaunchError::PeerFailed {
            rank,
            failure,
            source: anyhow::anyhow!("its own work had finished"),
        }),
        (Ok(Err(source)), Some(failure)) => Err(LaunchError::PeerFailed {
            rank,
            failure,
            source,
        }),
        (Ok(Err(source)), None) => Err(LaunchError::Failed { rank, source }),
        (Err(payload), _) => Err(LaunchError::Panicked {
            rank,
            message: panic_message(payload.as_ref()),
        }),
    }
}
