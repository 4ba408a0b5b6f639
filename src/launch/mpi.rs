//! [`run`](super::run) under an MPI launcher: this process is one rank of
//! an [`MpiGroup`].

use std::panic::{self, AssertUnwindSafe};
use std::sync::Arc;

use super::{LaunchError, RankContext};
use crate::comm::{GroupOptions, MpiGroup, ProcessGroup};
use crate::panic_message::panic_message;

/// Runs `f` on this process's rank and returns its result, or the failure
/// that stopped it (see [`run`](super::run)).
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
    };
    // Unwind safety: after a panic only the group's failure state is used.
    let outcome = panic::catch_unwind(AssertUnwindSafe(|| f(ctx)));
    // Tell the other ranks first (a no-op if another rank failed first),
    // so that they stop waiting for this one.
    match &outcome {
        Ok(Ok(_)) => {}
        Ok(Err(error)) => pg.abort(&format!("{error:#}")),
        Err(payload) => pg.abort(&format!("panicked: {}", panic_message(payload.as_ref()))),
    }
    let failure = pg.failure();
    // Leaves even if the value holds a handle; finalizes MPI when healthy.
    pg.leave();
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
