//! Where the time of a DDP step went, activity by activity: what
//! [`DdpTimings::timeline`](crate::DdpTimings::timeline) holds for a model
//! given as [`Units`](crate::units::Units), whose buckets are reduced while
//! the backward of earlier units computes.

use std::time::Duration;

/// One activity of a step, on the rank's compute thread or its
/// communication thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activity {
    /// The forward of every unit and the loss.
    Forward,
    /// The backward of one unit (its index; the last unit runs first).
    Backward {
        /// The unit.
        unit: usize,
    },
    /// The all-reduce of one bucket (its index, in reduction order), on
    /// the communication thread.
    Reduce {
        /// The bucket.
        bucket: usize,
    },
    /// The compute thread waiting, after the last unit's backward, for the
    /// reductions still running: the communication not hidden.
    Wait,
}

/// One activity and when it ran, from the start of the step's forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// What ran.
    pub activity: Activity,
    /// When it started.
    pub start: Duration,
    /// When it ended.
    pub end: Duration,
}

impl Span {
    /// How long it ran.
    pub fn duration(&self) -> Duration {
        self.end.saturating_sub(self.start)
    }
}

/// The share of `timeline`'s reduction time that ran while the backward
/// still computed: 1 when the compute thread never waited for a
/// reduction, 0 when every reduction ran after the backward (a timeline
/// without reductions counts as 1).
pub(crate) fn hidden_fraction(timeline: &[Span]) -> f64 {
    let busy: Duration = timeline
        .iter()
        .filter(|s| matches!(s.activity, Activity::Reduce { .. }))
        .map(Span::duration)
        .sum();
    let waited: Duration = timeline
        .iter()
        .filter(|s| s.activity == Activity::Wait)
        .map(Span::duration)
        .sum();
    if busy.is_zero() {
        return 1.0;
    }
    (1.0 - waited.as_secs_f64() / busy.as_secs_f64()).clamp(0.0, 1.0)
}
