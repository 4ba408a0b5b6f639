//! The order in which each device runs the forwards and backwards of the
//! micro-batches through the stages it holds: GPipe, 1F1B or interleaved
//! 1F1B.
//!
//! Every schedule is one rule: a device runs its forwards in a fixed order
//! and its backwards in a fixed order, `warmup` forwards first, then one
//! forward and one backward in turn, then the backwards left. The
//! schedules differ only in the warm-up (every forward for GPipe) and, when
//! interleaved, in which stage each forward and backward belongs to.

use std::ops::Range;

/// How the micro-batches of a step flow through the stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Schedule {
    /// Every forward, then every backward (GPipe; PyTorch's
    /// `ScheduleGPipe`): each stage holds the activations of all
    /// micro-batches at once.
    #[serde(rename = "gpipe")]
    GPipe,
    /// One forward, one backward (PyTorch's `Schedule1F1B`): stage `s` of
    /// `S` runs `min(chunks, S - s)` forwards ahead, then alternates, so it
    /// holds at most that many micro-batches of activations. Unlike
    /// PyTorch's, any number of micro-batches works.
    #[default]
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// Interleaved 1F1B (Megatron-LM's virtual stages; PyTorch's
    /// `ScheduleInterleaved1F1B`): the layers are split into
    /// `devices × stages_per_device` stages and stage `k` runs on device
    /// `k % devices`, so each device holds `stages_per_device` chunks of the
    /// model (non-adjacent with 2 devices or more). A micro-batch crosses every device
    /// `stages_per_device` times, each time doing a smaller share of the
    /// work, so the idle bubble falls from `(S-1)/(m+S-1)` to
    /// `(S-1)/(v·m+S-1)` (`S` devices, `m` micro-batches, `v` stages per
    /// device; reached once `m >= S`), at the price of more messages and
    /// of more activations held: device `d` runs
    /// `2(S-1-d) + (v-1)·r` forwards ahead, at most all `v·m` (`r`: the
    /// micro-batches of a round, `S` to `2S-1` once `m >= S`). Micro-batches go in rounds of at least `S` (fewer
    /// only when `m < S`), as PyTorch's do, but any `m` works, where
    /// PyTorch needs `m` to be a multiple of its number of rounds
    /// (`m / S` rounded down: 13 micro-batches on 4 devices fail); with 2
    /// or more stages per device, where PyTorch accepts `m`, each device
    /// runs PyTorch's order, task for task. With `stages_per_device: 1` it
    /// is [`Schedule::OneFOneB`] (whose warm-up is half PyTorch's
    /// interleaved one).
    #[serde(rename = "interleaved")]
    Interleaved1F1B {
        /// Stages per device (Megatron's `v`, PyTorch's local stages).
        stages_per_device: usize,
    },
}

/// One unit of work of a stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Op {
    /// The forward of micro-batch `m`.
    Forward(usize),
    /// The backward of micro-batch `m`.
    Backward(usize),
}

/// One unit of work of a device: `op` of its stage `stage` (the
/// pipeline's numbering).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Task {
    pub(crate) stage: usize,
    pub(crate) op: Op,
}

impl Schedule {
    /// Stages per device: 1 unless interleaved.
    pub fn stages_per_device(self) -> usize {
        match self {
            Schedule::GPipe | Schedule::OneFOneB => 1,
            Schedule::Interleaved1F1B { stages_per_device } => stages_per_device,
        }
    }

    /// What device `device` of `devices` runs, in order, in a training step
    /// of `chunks` micro-batches. Each stage runs its forwards and its
    /// backwards in micro-batch order, so every schedule accumulates a
    /// stage's gradients in the same order: bitwise equal.
    pub(crate) fn tasks(self, device: usize, devices: usize, chunks: usize) -> Vec<Task> {
        let per_device = self.stages_per_device().max(1);
        let rounds = rounds(chunks, devices);
        let forwards = order(device, devices, per_device, &rounds, false);
        let downstream = devices.saturating_sub(device + 1);
        let warmup = match self {
            Schedule::GPipe => forwards.len(),
            // Megatron's count: a device waits for its first backward
            // while the first micro-batch crosses the devices after it and
            // comes back (2 per device), and while every earlier chunk of
            // the model runs a round. It is the least that works: one
            // fewer deadlocks (simulated: 4 devices, 8 micro-batches, v = 2).
            Schedule::Interleaved1F1B { .. } if per_device > 1 => {
                let round = rounds.first().map_or(0, Range::len);
                2 * downstream + (per_device - 1) * round
            }
            _ => downstream,
        };
        one_forward_one_backward(
            forwards,
            order(device, devices, per_device, &rounds, true),
            warmup,
        )
    }

    /// What device `device` of `devices` runs in a step of forwards only
    /// (the drop-in path): its forwards in the training order.
    pub(crate) fn forward_tasks(self, device: usize, devices: usize, chunks: usize) -> Vec<Task> {
        let per_device = self.stages_per_device().max(1);
        order(device, devices, per_device, &rounds(chunks, devices), false)
    }
}

/// The micro-batches in rounds: as many as whole groups of `devices` fit
/// (at least one), as equal as can be, the first ones larger. A round is
/// what a device runs through one of its stages before the next: with at
/// least `devices` micro-batches, the first one is back from the other
/// devices when the round ends, and no device waits.
fn rounds(chunks: usize, devices: usize) -> Vec<Range<usize>> {
    let count = (chunks / devices.max(1)).max(1);
    let (base, extra) = (chunks / count, chunks % count);
    let mut start = 0;
    (0..count)
        .map(|i| {
            let size = base + usize::from(i < extra);
            start += size;
            start - size..start
        })
        .collect()
}

/// A device's forwards, or its backwards: round by round, its stages in
/// model order (in reverse for the backwards), the round's micro-batches
/// in order.
fn order(
    device: usize,
    devices: usize,
    per_device: usize,
    rounds: &[Range<usize>],
    backwards: bool,
) -> Vec<Task> {
    let mut tasks = Vec::new();
    for round in rounds {
        for step in 0..per_device {
            let chunk = if backwards {
                per_device - 1 - step
            } else {
                step
            };
            let stage = chunk * devices + device;
            tasks.extend(round.clone().map(|m| Task {
                stage,
                op: if backwards {
                    Op::Backward(m)
                } else {
                    Op::Forward(m)
                },
            }));
        }
    }
    tasks
}

/// `warmup` forwards, then a forward and a backward in turn while
/// forwards are left, then the remaining backwards.
fn one_forward_one_backward(forwards: Vec<Task>, backwards: Vec<Task>, warmup: usize) -> Vec<Task> {
    let warmup = warmup.min(forwards.len());
    let mut tasks = Vec::with_capacity(forwards.len() + backwards.len());
    let mut backwards = backwards.into_iter();
    let mut forwards = forwards.into_iter();
    tasks.extend(forwards.by_ref().take(warmup));
    for forward in forwards {
        tasks.push(forward);
        tasks.extend(backwards.next());
    }
    tasks.extend(backwards);
    tasks
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::ops::RangeInclusive;
    use Op::{Backward as B, Forward as F};

    fn ops(schedule: Schedule, device: usize, devices: usize, chunks: usize) -> Vec<Op> {
        schedule
            .tasks(device, devices, chunks)
            .into_iter()
            .map(|t| t.op)
            .collect()
    }

    /// The most micro-batches (of any of its stages) whose activations a
    /// device holds at once.
    fn peak_in_flight(tasks: &[Task]) -> usize {
        let (mut live, mut peak) = (0usize, 0usize);
        for task in tasks {
            match task.op {
                F(_) => {
                    live += 1;
                    peak = peak.max(live);
                }
                B(_) => live = live.saturating_sub(1),
            }
        }
        peak
    }

    /// Every `(devices, chunks, v, interleaved schedule)` of the ranges.
    fn grid(
        devices: RangeInclusive<usize>,
        chunks: RangeInclusive<usize>,
        per_device: RangeInclusive<usize>,
    ) -> impl Iterator<Item = (usize, usize, usize, Schedule)> {
        devices.flat_map(move |d| {
            let per_device = per_device.clone();
            chunks.clone().flat_map(move |m| {
                per_device.clone().map(move |v| {
                    let schedule = Schedule::Interleaved1F1B {
                        stages_per_device: v,
                    };
                    (d, m, v, schedule)
                })
            })
        })
    }

    /// Runs every device's tasks in their order, each as soon as what it
    /// needs is done (a forward: the previous stage's forward; a backward:
    /// the stage's forward and the next stage's backward), a forward
    /// taking `forward` time units and a backward `backward`. `None` when
    /// the devices deadlock (each waits for another); else the bubble:
    /// the idle fraction of the devices' time.
    fn simulate(
        schedule: Schedule,
        devices: usize,
        chunks: usize,
        forward: u64,
        backward: u64,
    ) -> Option<f64> {
        let stages = devices * schedule.stages_per_device();
        let orders: Vec<Vec<Task>> = (0..devices)
            .map(|d| schedule.tasks(d, devices, chunks))
            .collect();
        let mut done: HashMap<Task, u64> = HashMap::new();
        let (mut next, mut clock) = (vec![0usize; devices], vec![0u64; devices]);
        let mut busy = 0u64;
        let mut progress = true;
        while progress {
            progress = false;
            for d in 0..devices {
                while let Some(&task) = orders[d].get(next[d]) {
                    let Task { stage, op } = task;
                    let needs = match op {
                        F(m) => (stage > 0).then(|| Task {
                            stage: stage - 1,
                            op: F(m),
                        }),
                        B(m) => (stage + 1 < stages).then(|| Task {
                            stage: stage + 1,
                            op: B(m),
                        }),
                    };
                    let own_forward = match op {
                        F(_) => None,
                        B(m) => Some(Task { stage, op: F(m) }),
                    };
                    let ready = [needs, own_forward]
                        .into_iter()
                        .flatten()
                        .map(|t| done.get(&t).copied())
                        .try_fold(clock[d], |at, t| t.map(|t| at.max(t)));
                    let Some(start) = ready else { break };
                    let cost = if matches!(op, F(_)) {
                        forward
                    } else {
                        backward
                    };
                    clock[d] = start + cost;
                    busy += cost;
                    done.insert(task, clock[d]);
                    next[d] += 1;
                    progress = true;
                }
            }
        }
        if (0..devices).any(|d| next[d] < orders[d].len()) {
            return None;
        }
        let end = clock.iter().copied().max().unwrap_or(0);
        Some(1.0 - busy as f64 / (devices as u64 * end).max(1) as f64)
    }

    #[test]
    fn gpipe_runs_every_forward_then_every_backward_in_order() {
        assert_eq!(
            ops(Schedule::GPipe, 0, 2, 3),
            vec![F(0), F(1), F(2), B(0), B(1), B(2)]
        );
    }

    #[test]
    fn one_f_one_b_warms_up_stages_minus_stage_forwards() {
        assert_eq!(
            ops(Schedule::OneFOneB, 0, 3, 5),
            vec![F(0), F(1), F(2), B(0), F(3), B(1), F(4), B(2), B(3), B(4)]
        );
        assert_eq!(
            ops(Schedule::OneFOneB, 2, 3, 3),
            vec![F(0), B(0), F(1), B(1), F(2), B(2)]
        );
    }

    #[test]
    fn one_f_one_b_holds_at_most_stages_minus_stage_micro_batches() {
        for stages in 1..=4 {
            for chunks in 1..=13 {
                for stage in 0..stages {
                    let tasks = Schedule::OneFOneB.tasks(stage, stages, chunks);
                    assert_eq!(peak_in_flight(&tasks), chunks.min(stages - stage));
                    let gpipe = Schedule::GPipe.tasks(stage, stages, chunks);
                    assert_eq!(peak_in_flight(&gpipe), chunks);
                }
            }
        }
    }

    #[test]
    fn interleaving_two_devices_alternates_their_stages_round_by_round() {
        let two = Schedule::Interleaved1F1B {
            stages_per_device: 2,
        };
        let task = |stage, op| Task { stage, op };
        // Device 0 holds stages 0 and 2 of 4; 4 micro-batches, rounds of 2.
        assert_eq!(
            two.tasks(0, 2, 4),
            vec![
                task(0, F(0)),
                task(0, F(1)),
                task(2, F(0)),
                task(2, F(1)),
                task(0, F(2)),
                task(2, B(0)),
                task(0, F(3)),
                task(2, B(1)),
                task(2, F(2)),
                task(0, B(0)),
                task(2, F(3)),
                task(0, B(1)),
                task(2, B(2)),
                task(2, B(3)),
                task(0, B(2)),
                task(0, B(3)),
            ]
        );
    }

    #[test]
    fn every_schedule_runs_each_stage_in_micro_batch_order_without_deadlock() {
        for (devices, chunks, per_device, interleaved) in grid(1..=4, 1..=13, 1..=3) {
            let mut schedules = vec![interleaved];
            if per_device == 1 {
                schedules.extend([Schedule::GPipe, Schedule::OneFOneB]);
            }
            for schedule in schedules {
                let what = format!("{schedule:?}, {devices} devices, {chunks} chunks");
                for device in 0..devices {
                    let tasks = schedule.tasks(device, devices, chunks);
                    assert_eq!(tasks.len(), 2 * chunks * per_device, "{what}");
                    for chunk in 0..per_device {
                        let stage = chunk * devices + device;
                        let of_stage = |forward: bool| -> Vec<usize> {
                            tasks
                                .iter()
                                .filter(|t| t.stage == stage)
                                .filter_map(|t| match (t.op, forward) {
                                    (F(m), true) | (B(m), false) => Some(m),
                                    _ => None,
                                })
                                .collect()
                        };
                        // Backwards in order: the same gradient sums as
                        // every other schedule, bit for bit.
                        assert_eq!(of_stage(true), (0..chunks).collect::<Vec<_>>());
                        assert_eq!(of_stage(false), (0..chunks).collect::<Vec<_>>());
                    }
                    let forwards = schedule.forward_tasks(device, devices, chunks);
                    let in_training: Vec<Task> = tasks
                        .iter()
                        .copied()
                        .filter(|t| matches!(t.op, F(_)))
                        .collect();
                    assert_eq!(forwards, in_training, "{what}");
                }
                for backward in [1, 2] {
                    let done = simulate(schedule, devices, chunks, 1, backward);
                    assert!(done.is_some(), "{what}");
                }
            }
        }
    }

    #[test]
    fn no_interleaved_order_deadlocks_up_to_8_devices_32_micro_batches_and_4_stages_per_device() {
        for (devices, chunks, v, schedule) in grid(1..=8, 1..=32, 1..=4) {
            assert!(
                simulate(schedule, devices, chunks, 1, 2).is_some(),
                "{devices} devices, {chunks} chunks, v = {v}"
            );
        }
    }

    /// PyTorch's `ScheduleInterleaved1F1B` order for one rank, restated
    /// from its formulas (`_calculate_single_rank_operations`, its no-op
    /// padding left out): `None` where PyTorch refuses `chunks`.
    fn pytorch_interleaved(
        device: usize,
        devices: usize,
        v: usize,
        chunks: usize,
    ) -> Option<Vec<Task>> {
        let rounds = (chunks / devices).max(1);
        if !chunks.is_multiple_of(rounds) {
            return None;
        }
        let per_round = chunks / rounds;
        let warmup = ((v - 1) * per_round + 2 * (devices - 1 - device)).min(chunks * v);
        let both = chunks * v - warmup;
        let forward_stage = |op: usize| ((op / per_round) % v) * devices + device;
        let backward_stage =
            |op: usize| (v - 1 - ((op - warmup) / per_round) % v) * devices + device;
        let (mut forwards, mut backwards) = (HashMap::new(), HashMap::new());
        let next = |counts: &mut HashMap<usize, usize>, stage: usize| {
            let m = counts.entry(stage).or_insert(0);
            *m += 1;
            *m - 1
        };
        let mut tasks = Vec::new();
        for op in 0..warmup + both + warmup {
            if op < warmup + both {
                let stage = forward_stage(op);
                let m = next(&mut forwards, stage);
                tasks.push(Task { stage, op: F(m) });
            }
            if op >= warmup {
                let stage = backward_stage(op);
                let m = next(&mut backwards, stage);
                tasks.push(Task { stage, op: B(m) });
            }
        }
        Some(tasks)
    }

    #[test]
    fn interleaving_is_pytorchs_order_whenever_pytorch_accepts_the_micro_batches() {
        let mut compared = 0;
        for (devices, chunks, v, schedule) in grid(1..=4, 1..=13, 2..=3) {
            for device in 0..devices {
                let Some(want) = pytorch_interleaved(device, devices, v, chunks) else {
                    continue;
                };
                assert_eq!(
                    schedule.tasks(device, devices, chunks),
                    want,
                    "device {device} of {devices}, {chunks} chunks, v = {v}"
                );
                compared += 1;
            }
        }
        // Of the grid's 260 device orders, PyTorch refuses 68 (13
        // micro-batches on 4 devices among them).
        assert_eq!(compared, 192);
        assert!(pytorch_interleaved(0, 4, 2, 13).is_none());
    }

    #[test]
    fn interleaving_one_stage_per_device_is_one_f_one_b() {
        for devices in 1..=4 {
            for chunks in 1..=13 {
                for device in 0..devices {
                    assert_eq!(
                        Schedule::Interleaved1F1B {
                            stages_per_device: 1
                        }
                        .tasks(device, devices, chunks),
                        Schedule::OneFOneB.tasks(device, devices, chunks)
                    );
                }
            }
        }
    }

    #[test]
    fn interleaving_reaches_the_bubble_of_the_formula_once_there_are_as_many_micro_batches_as_devices(
    ) {
        for (devices, chunks, v, schedule) in grid(1..=4, 1..=13, 1..=3) {
            if chunks < devices {
                continue;
            }
            // A backward costs twice a forward (Megatron's assumption),
            // communication is free.
            let bubble = simulate(schedule, devices, chunks, 1, 2).unwrap_or(1.0);
            let formula = (devices - 1) as f64 / (v * chunks + devices - 1) as f64;
            assert!(
                (bubble - formula).abs() < 1e-12,
                "{devices} devices, {chunks} chunks, v = {v}: {bubble} vs {formula}"
            );
        }
    }

    #[test]
    fn interleaving_holds_at_most_its_warm_up_plus_one_micro_batch_stages() {
        for (devices, chunks, v, schedule) in grid(1..=4, 1..=13, 2..=3) {
            let round = rounds(chunks, devices)[0].len();
            for device in 0..devices {
                let warmup = 2 * (devices - 1 - device) + (v - 1) * round;
                let peak = peak_in_flight(&schedule.tasks(device, devices, chunks));
                assert_eq!(peak, (warmup + 1).min(chunks * v));
            }
        }
    }

    #[test]
    fn rounds_hold_at_least_as_many_micro_batches_as_devices_unless_there_are_fewer() {
        assert_eq!(rounds(13, 4), vec![0..5, 5..9, 9..13]);
        assert_eq!(rounds(8, 4), vec![0..4, 4..8]);
        assert_eq!(rounds(3, 4), vec![0..3]);
        for devices in 1..=4 {
            for chunks in 1..=13 {
                let r = rounds(chunks, devices);
                assert_eq!(r.first().map(|r| r.start), Some(0));
                assert_eq!(r.last().map(|r| r.end), Some(chunks));
                assert!(r.windows(2).all(|w| w[0].end == w[1].start));
                assert!(r.iter().all(|r| r.len() >= devices.min(chunks)));
            }
        }
    }
}
