//! One device's part of a step: the stages it holds (one, or several when
//! the schedule is interleaved), run task by task in the schedule's order
//! on the device's worker.

use std::time::Duration;

use super::schedule::Task;
use super::stage::{Stage, StageFailure, StageOutput, StageWork};
use crate::worker_pool::Cancel;

/// What one device runs in a step.
pub(crate) struct DeviceWork {
    /// Its stages' parts, in the order of the stages it holds.
    pub(crate) stages: Vec<StageWork>,
    /// Its tasks, in the schedule's order.
    pub(crate) tasks: Vec<Task>,
}

/// What a device hands back at the end of a step.
pub(crate) struct DeviceOutput {
    /// Each of its stages' results, in the order of `DeviceWork::stages`.
    pub(crate) stages: Vec<StageOutput>,
    /// Time spent computing (not waiting for a neighbour).
    pub(crate) busy: Duration,
    /// The part of `busy` spent checking recomputations (fingerprints).
    pub(crate) checking: Duration,
    /// The most bytes of micro-batch activations its stages held for the
    /// backward at once (see `PipelineTimings::peak_saved_bytes`).
    pub(crate) peak_saved_bytes: usize,
}

/// A stage that failed, with why.
#[derive(Debug)]
pub(crate) struct DeviceFailure {
    /// The pipeline's number of the stage.
    pub(crate) stage: usize,
    pub(crate) failure: StageFailure,
}

impl DeviceWork {
    /// Runs the device's tasks on `held`, the stages its worker built
    /// (in the order of `self.stages`).
    pub(crate) fn run(
        self,
        held: &[Stage],
        cancel: &Cancel,
    ) -> Result<DeviceOutput, DeviceFailure> {
        let at = |work: &StageWork| {
            let stage = work.index;
            move |failure| DeviceFailure { stage, failure }
        };
        if held.len() != self.stages.len() {
            let stage = self.stages.first().map_or(0, |w| w.index);
            return Err(DeviceFailure {
                stage,
                failure: StageFailure {
                    micro_batch: 0,
                    phase: super::stage::Phase::Forward,
                    source: candle_core::Error::Msg(format!(
                        "the device's worker holds {} stages, the step has work for {}",
                        held.len(),
                        self.stages.len()
                    )),
                },
            });
        }
        // The device's job has begun for all its stages at once: a timeout
        // while the first one starts must not call the others stuck in an
        // earlier step.
        for work in &self.stages {
            work.set(None);
        }
        let mut runs = Vec::with_capacity(self.stages.len());
        for (work, stage) in self.stages.iter().zip(held) {
            runs.push(work.start(stage).map_err(at(work))?);
        }
        let mut peak = 0usize;
        for task in &self.tasks {
            let Some(local) = self.stages.iter().position(|w| w.index == task.stage) else {
                return Err(DeviceFailure {
                    stage: task.stage,
                    failure: StageFailure {
                        micro_batch: 0,
                        phase: super::stage::Phase::Forward,
                        source: candle_core::Error::Msg(
                            "the schedule gave this device a stage it does not hold".into(),
                        ),
                    },
                });
            };
            let (work, stage) = (&self.stages[local], &held[local]);
            // What the device's other stages hold meanwhile.
            let others: usize = runs
                .iter()
                .enumerate()
                .filter(|&(i, _)| i != local)
                .map(|(_, r)| r.saved_bytes)
                .sum();
            let during = work
                .run_op(stage, &mut runs[local], task.op, cancel)
                .map_err(at(work))?;
            peak = peak.max(others + during);
        }
        let mut stages = Vec::with_capacity(runs.len());
        for ((work, stage), run) in self.stages.iter().zip(held).zip(runs) {
            stages.push(work.finish(stage, run).map_err(at(work))?);
        }
        Ok(DeviceOutput {
            stages,
            busy: self.stages.iter().map(StageWork::busy).sum(),
            checking: self.stages.iter().map(StageWork::checking).sum(),
            peak_saved_bytes: peak,
        })
    }
}

/// The stages of device `device` of `devices`, in a pipeline of `stages`:
/// `device`, `device + devices`, ...
pub(crate) fn stages_of(
    device: usize,
    devices: usize,
    stages: usize,
) -> impl Iterator<Item = usize> {
    (device..stages).step_by(devices.max(1))
}

/// Per-device lists (each in the order of [`stages_of`]) put back in the
/// pipeline's stage order; an error naming the device whose list is short.
pub(crate) fn in_stage_order<T>(
    per_device: Vec<Vec<T>>,
    stages: usize,
) -> crate::error::Result<Vec<T>> {
    let devices = per_device.len();
    let mut lists: Vec<_> = per_device.into_iter().map(Vec::into_iter).collect();
    (0..stages)
        .map(|k| {
            lists
                .get_mut(k % devices.max(1))
                .and_then(Iterator::next)
                .ok_or_else(|| {
                    crate::error::Error::Candle(candle_core::Error::Msg(format!(
                        "device {} gave no result for pipeline stage {k}",
                        k % devices.max(1)
                    )))
                })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_device_lists_go_back_in_stage_order_and_a_short_one_is_named() {
        let per_device = vec![vec![0, 2, 4], vec![1, 3, 5]];
        assert_eq!(
            in_stage_order(per_device, 6).ok(),
            Some(vec![0, 1, 2, 3, 4, 5])
        );
        assert_eq!(stages_of(1, 2, 6).collect::<Vec<_>>(), vec![1, 3, 5]);
        let err = in_stage_order(vec![vec![0, 2], vec![1]], 4).unwrap_err();
        assert!(err.to_string().contains("device 1"), "{err}");
    }
}
