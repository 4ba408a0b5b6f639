//! Where a step's time went: [`StepTimings`], and the recorder the pipeline
//! reports its phases to, so that measuring stays out of its way.

use std::sync::Mutex;
use std::time::Duration;

use super::replicas::ReplicaRun;
use crate::util::lock::lock;

/// Where the time of the latest step went: the parallel phases count the
/// slowest replica (the critical path). For benchmarks and profiling.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTimings {
    /// Planning, splitting and moving the inputs.
    pub scatter: Duration,
    /// Refreshing replicas from the master (copies to other devices, buffers).
    pub replicate: Duration,
    /// Forward (and replica loss) on the slowest replica.
    pub forward: Duration,
    /// Backward on the slowest replica (parallel paths only).
    pub backward: Duration,
    /// Summing replica gradients onto the master.
    pub reduce: Duration,
    /// Concatenating outputs or summing losses on the output device.
    pub gather: Duration,
    /// Wall time of the calls that made up the step.
    pub total: Duration,
}

/// The longest of `durations`: the critical path of a parallel phase.
pub(super) fn slowest(durations: impl IntoIterator<Item = Duration>) -> Duration {
    durations.into_iter().max().unwrap_or_default()
}

/// The timings of the latest step, filled in phase by phase.
#[derive(Debug, Default)]
pub(super) struct StepRecorder(Mutex<StepTimings>);

impl StepRecorder {
    /// A new step: its scatter, then each replica's replicate and work
    /// (counted as forward; the slowest replica's), `total` so far.
    pub(super) fn begin<R>(&self, scatter: Duration, runs: &[ReplicaRun<R>], total: Duration) {
        *lock(&self.0) = StepTimings {
            scatter,
            replicate: slowest(runs.iter().map(|run| run.replicate)),
            forward: slowest(runs.iter().map(|run| run.work)),
            total,
            ..StepTimings::default()
        };
    }

    /// The outputs were gathered in `gather`.
    pub(super) fn gathered(&self, gather: Duration) {
        let mut t = lock(&self.0);
        t.gather = gather;
        t.total += gather;
    }

    /// A backward from the gathered output: the replicas' backward (the
    /// slowest), the reduce onto the master, and the call's wall time.
    pub(super) fn backward(&self, backward: Duration, reduce: Duration, total: Duration) {
        let mut t = lock(&self.0);
        t.backward = backward;
        t.reduce = reduce;
        t.total += total;
    }

    /// A fused forward and backward: the replicas' work time counted as
    /// forward in [`begin`](Self::begin) included their `backward`; then
    /// the losses were gathered, the gradients reduced, in `after` in all.
    pub(super) fn fused_backward(
        &self,
        backward: Duration,
        gather: Duration,
        reduce: Duration,
        after: Duration,
    ) {
        let mut t = lock(&self.0);
        t.forward = t.forward.saturating_sub(backward);
        t.backward = backward;
        t.gather = gather;
        t.reduce = reduce;
        t.total += after;
    }

    /// The latest step's timings.
    pub(super) fn last(&self) -> StepTimings {
        *lock(&self.0)
    }
}
