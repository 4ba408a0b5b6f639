//! The order in which one stage runs the forwards and backwards of the
//! micro-batches: GPipe or 1F1B.

/// How the micro-batches of a step flow through the stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Schedule {
    /// Every forward, then every backward (GPipe; PyTorch's
    /// `ScheduleGPipe`): each stage holds the activations of all
    /// micro-batches at once.
    GPipe,
    /// One forward, one backward (PyTorch's `Schedule1F1B`): stage `s` of
    /// `S` runs `min(chunks, S - s)` forwards ahead, then alternates, so it
    /// holds at most that many micro-batches of activations. Unlike
    /// PyTorch's, any number of micro-batches works.
    #[default]
    OneFOneB,
}

/// One unit of work of a stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    /// The forward of micro-batch `m`.
    Forward(usize),
    /// The backward of micro-batch `m`.
    Backward(usize),
}

impl Schedule {
    /// What stage `stage` of `stages` runs, in order, for `chunks`
    /// micro-batches. Backwards always come in micro-batch order, so both
    /// schedules accumulate gradients in the same order: bitwise equal.
    pub(crate) fn ops(self, stage: usize, stages: usize, chunks: usize) -> Vec<Op> {
        let ahead = match self {
            Schedule::GPipe => chunks,
            Schedule::OneFOneB => chunks.min(stages.saturating_sub(stage)).max(1),
        };
        let mut ops: Vec<Op> = (0..ahead.min(chunks)).map(Op::Forward).collect();
        for m in 0..chunks {
            ops.push(Op::Backward(m));
            if m + ahead < chunks {
                ops.push(Op::Forward(m + ahead));
            }
        }
        ops
    }
}

/// The most micro-batches whose activations `ops` holds at once.
#[cfg(test)]
pub(crate) fn peak_in_flight(ops: &[Op]) -> usize {
    let (mut live, mut peak) = (0usize, 0usize);
    for op in ops {
        match op {
            Op::Forward(_) => {
                live += 1;
                peak = peak.max(live);
            }
            Op::Backward(_) => live = live.saturating_sub(1),
        }
    }
    peak
}

#[cfg(test)]
mod tests {
    use super::*;
    use Op::{Backward as B, Forward as F};

    #[test]
    fn gpipe_runs_every_forward_then_every_backward_in_order() {
        assert_eq!(
            Schedule::GPipe.ops(0, 2, 3),
            vec![F(0), F(1), F(2), B(0), B(1), B(2)]
        );
    }

    #[test]
    fn one_f_one_b_warms_up_stages_minus_stage_forwards() {
        assert_eq!(
            Schedule::OneFOneB.ops(0, 3, 5),
            vec![F(0), F(1), F(2), B(0), F(3), B(1), F(4), B(2), B(3), B(4)]
        );
        assert_eq!(
            Schedule::OneFOneB.ops(2, 3, 3),
            vec![F(0), B(0), F(1), B(1), F(2), B(2)]
        );
    }

    #[test]
    fn one_f_one_b_holds_at_most_stages_minus_stage_micro_batches() {
        for stages in 1..=4 {
            for chunks in 1..=13 {
                for stage in 0..stages {
                    let ops = Schedule::OneFOneB.ops(stage, stages, chunks);
                    assert_eq!(peak_in_flight(&ops), chunks.min(stages - stage));
                    let gpipe = Schedule::GPipe.ops(stage, stages, chunks);
                    assert_eq!(peak_in_flight(&gpipe), chunks);
                    // Every micro-batch once forward, once backward, backward in order.
                    for schedule in [ops, gpipe] {
                        let backs: Vec<usize> = schedule
                            .iter()
                            .filter_map(|op| match op {
                                B(m) => Some(*m),
                                F(_) => None,
                            })
                            .collect();
                        assert_eq!(backs, (0..chunks).collect::<Vec<_>>());
                        assert_eq!(schedule.len(), 2 * chunks);
                    }
                }
            }
        }
    }
}
