//! Learning-rate schedules: PyTorch's `torch.optim.lr_scheduler`, the same
//! learning rate before every optimizer step, computed with PyTorch's
//! formulas in PyTorch's order of floating-point operations (most of its
//! schedulers are chainable: each step multiplies the rate the optimizer
//! holds, and the closed forms agree only to about 1e-13).
//!
//! An [`LrScheduler`] holds the rate of the next optimizer step
//! ([`lr`](LrScheduler::lr)); [`apply`](LrScheduler::apply) sets it on any
//! candle [`Optimizer`](candle_nn::Optimizer) (the crate's and candle's),
//! and [`step`](LrScheduler::step), called after each optimizer step,
//! moves to the next one, as `scheduler.step()` does in PyTorch. Its
//! position is an [`LrSchedulerState`] to save with a training state.
//!
//! ```
//! use candle_dp::optim::LrScheduler;
//!
//! # fn main() -> candle_dp::Result<()> {
//! // Warm-up over 4 steps from a tenth of the rate, then a cosine over 6.
//! let warm_up = LrScheduler::linear(1.0, 0.1, 1.0, 4)?;
//! let cosine = LrScheduler::cosine_annealing(1.0, 6, 0.0)?;
//! let mut schedule = LrScheduler::sequential(1.0, vec![warm_up, cosine], vec![4])?;
//! let mut rates = Vec::new();
//! for _ in 0..7 {
//!     rates.push(schedule.lr()); // schedule.apply(&mut optimizer), then optimizer.step(..)
//!     schedule.step()?;
//! }
//! assert_eq!(&rates[..3], &[0.1, 0.325, 0.55]);
//! assert_eq!(rates[4], 1.0); // the cosine starts from the base rate at its milestone
//! # Ok(())
//! # }
//! ```

use std::f64::consts::PI;
use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// How [`LrScheduler::one_cycle`] anneals between its rates (PyTorch's
/// `anneal_strategy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Anneal {
    /// Half a cosine (the default).
    #[default]
    Cos,
    /// A straight line.
    Linear,
}

/// [`LrScheduler::one_cycle`]'s settings beyond the peak rate and the
/// number of steps; the defaults are PyTorch's `OneCycleLR`'s.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OneCycleConfig {
    /// The share of the steps spent rising (default 0.3).
    pub pct_start: f64,
    /// How the rate moves between its ends (default cosine).
    pub anneal: Anneal,
    /// The first rate is `max_lr / div_factor` (default 25).
    pub div_factor: f64,
    /// The last rate is the first divided by this (default 1e4).
    pub final_div_factor: f64,
    /// Rise, fall back to the first rate, then fall to the last (default
    /// off: rise, then fall to the last).
    pub three_phase: bool,
    /// Cycle the momentum (SGD's momentum, Adam's beta1) against the rate
    /// between `max_momentum` and `base_momentum` (default on). The value
    /// is [`LrScheduler::momentum`]: set it on the optimizer yourself.
    pub cycle_momentum: bool,
    /// The momentum at the peak rate (default 0.85).
    pub base_momentum: f64,
    /// The momentum at the ends (default 0.95).
    pub max_momentum: f64,
}

impl Default for OneCycleConfig {
    fn default() -> Self {
        Self {
            pct_start: 0.3,
            anneal: Anneal::Cos,
            div_factor: 25.0,
            final_div_factor: 1e4,
            three_phase: false,
            cycle_momentum: true,
            base_momentum: 0.85,
            max_momentum: 0.95,
        }
    }
}

/// A factor of the base rate for each step, as PyTorch's `LambdaLR` takes.
pub type LrLambda = Arc<dyn Fn(u64) -> f64 + Send + Sync>;

/// One phase of a one-cycle schedule: where it ends and between which
/// rates and momenta it moves.
#[derive(Debug, Clone, Copy)]
pub(super) struct Phase {
    pub(super) end_step: f64,
    pub(super) start_lr: f64,
    pub(super) end_lr: f64,
    pub(super) start_momentum: f64,
    pub(super) end_momentum: f64,
}

#[derive(Clone)]
pub(super) enum Kind {
    Lambda(LrLambda),
    Step {
        step_size: u64,
        gamma: f64,
    },
    Exponential {
        gamma: f64,
    },
    Linear {
        start_factor: f64,
        end_factor: f64,
        total_iters: u64,
    },
    Cosine {
        t_max: u64,
        eta_min: f64,
    },
    OneCycle {
        total_steps: u64,
        phases: Vec<Phase>,
        anneal: Anneal,
        cycle_momentum: bool,
    },
    Sequential {
        children: Vec<Scheduler>,
        milestones: Vec<u64>,
    },
}

impl Kind {
    pub(super) fn name(&self) -> &'static str {
        match self {
            Kind::Lambda(_) => "lambda",
            Kind::Step { .. } => "step",
            Kind::Exponential { .. } => "exponential",
            Kind::Linear { .. } => "linear",
            Kind::Cosine { .. } => "cosine_annealing",
            Kind::OneCycle { .. } => "one_cycle",
            Kind::Sequential { .. } => "sequential",
        }
    }
}

/// What the optimizer's parameter group holds, which the chainable
/// schedules read and write.
#[derive(Debug, Clone, Copy)]
pub(super) struct Group {
    pub(super) lr: f64,
    pub(super) momentum: Option<f64>,
}

/// One schedule's position (PyTorch's `last_epoch`, `_step_count` and
/// `base_lrs`).
#[derive(Clone)]
pub(super) struct Scheduler {
    pub(super) kind: Kind,
    pub(super) base_lr: f64,
    pub(super) last_epoch: i64,
    pub(super) step_count: u64,
}

impl Scheduler {
    pub(super) fn new(kind: Kind, base_lr: f64) -> Self {
        Self {
            kind,
            base_lr,
            last_epoch: -1,
            step_count: 0,
        }
    }

    /// PyTorch's `SequentialLR` constructor over `children` (each made
    /// over the group already): the rate back to the base, every schedule
    /// one epoch back, then the first one's constructor step again.
    pub(super) fn sequential_of(
        mut children: Vec<Scheduler>,
        milestones: Vec<u64>,
        base_lr: f64,
    ) -> Result<(Scheduler, Group)> {
        let mut group = Group {
            lr: base_lr,
            momentum: None,
        };
        children.iter_mut().for_each(Scheduler::undo);
        if let Some(first) = children.first_mut() {
            first.initial_step(&mut group)?;
        }
        let scheduler = Scheduler {
            kind: Kind::Sequential {
                children,
                milestones,
            },
            base_lr,
            last_epoch: 0,
            step_count: 0,
        };
        Ok((scheduler, group))
    }

    /// PyTorch's `_initial_step`: the step that a constructor takes.
    pub(super) fn initial_step(&mut self, group: &mut Group) -> Result<()> {
        self.step_count = 0;
        self.step(group, true)
    }

    pub(super) fn step(&mut self, group: &mut Group, initial: bool) -> Result<()> {
        if let Kind::Sequential {
            children,
            milestones,
        } = &mut self.kind
        {
            self.last_epoch += 1;
            let epoch = u64::try_from(self.last_epoch).unwrap_or(0);
            let index = milestones.partition_point(|&m| m <= epoch);
            let child = children
                .get_mut(index)
                .ok_or_else(|| invalid("a sequential schedule without a schedule to step"))?;
            return if index > 0 && milestones[index - 1] == epoch {
                child.update(group, Some(0), false)
            } else {
                child.step(group, false)
            };
        }
        self.step_count += 1;
        self.update(group, None, initial)
    }

    /// PyTorch's `_update_lr`: the next epoch (or `epoch`, through the
    /// closed form where there is one) and its rate into the group.
    fn update(&mut self, group: &mut Group, epoch: Option<i64>, initial: bool) -> Result<()> {
        match epoch {
            None => self.last_epoch += 1,
            Some(e) => self.last_epoch = e,
        }
        let lr = match epoch.and_then(|_| self.closed_form()) {
            Some(lr) => lr,
            None => self.chained(group, initial)?,
        };
        group.lr = lr;
        Ok(())
    }

    /// PyTorch's `_get_closed_form_lr`, for the schedules that have one.
    fn closed_form(&self) -> Option<f64> {
        let (n, base) = (self.last_epoch as f64, self.base_lr);
        match &self.kind {
            Kind::Step { step_size, gamma } => {
                // In i128: a step size above i64::MAX must not wrap.
                let k = i128::from(self.last_epoch).div_euclid(i128::from(*step_size)) as f64;
                Some(base * gamma.powf(k))
            }
            Kind::Exponential { gamma } => Some(base * gamma.powf(n)),
            Kind::Linear {
                start_factor: s,
                end_factor: e,
                total_iters: t,
            } => {
                let t = *t as f64;
                Some(base * (s + (e - s) * n.min(t) / t))
            }
            Kind::Cosine { t_max, eta_min: m } => {
                Some(m + (base - m) * (1.0 + (PI * n / *t_max as f64).cos()) / 2.0)
            }
            _ => None,
        }
    }

    /// PyTorch's `get_lr`: the chainable form, from the group's rate.
    fn chained(&self, group: &mut Group, initial: bool) -> Result<f64> {
        let (lr, base, n) = (group.lr, self.base_lr, self.last_epoch);
        let nf = n as f64;
        Ok(match &self.kind {
            Kind::Lambda(f) => base * f(u64::try_from(n).unwrap_or(0)),
            Kind::Step { step_size, gamma } => {
                if n == 0 || i128::from(n).rem_euclid(i128::from(*step_size)) != 0 {
                    lr
                } else {
                    lr * gamma
                }
            }
            Kind::Exponential { gamma } => {
                if initial {
                    lr
                } else {
                    lr * gamma
                }
            }
            Kind::Linear {
                start_factor: s,
                end_factor: e,
                total_iters,
            } => {
                if n == 0 {
                    lr * s
                } else if initial || i128::from(n) > i128::from(*total_iters) {
                    lr
                } else {
                    let t = *total_iters as f64;
                    lr * (1.0 + (e - s) / (t * s + (nf - 1.0) * (e - s)))
                }
            }
            Kind::Cosine { t_max, eta_min: m } => {
                let t = *t_max as f64;
                if initial {
                    lr
                } else if self.step_count == 1 && n > 0 {
                    m + (base - m) * (1.0 + (nf * PI / t).cos()) / 2.0
                } else if (i128::from(n) - 1 - i128::from(*t_max))
                    .rem_euclid(2 * i128::from(*t_max))
                    == 0
                {
                    lr + (base - m) * (1.0 - (PI / t).cos()) / 2.0
                } else {
                    (1.0 + (PI * nf / t).cos()) / (1.0 + (PI * (nf - 1.0) / t).cos()) * (lr - m) + m
                }
            }
            Kind::OneCycle {
                total_steps,
                phases,
                anneal,
                cycle_momentum,
            } => {
                if i128::from(n) > i128::from(*total_steps) {
                    return Err(invalid(format!(
                        "stepped {n} times; the one-cycle schedule has {total_steps} steps"
                    )));
                }
                let mut start = 0.0;
                let mut out = lr;
                for (i, phase) in phases.iter().enumerate() {
                    if nf <= phase.end_step || i + 1 == phases.len() {
                        let pct = (nf - start) / (phase.end_step - start);
                        out = anneal.apply(phase.start_lr, phase.end_lr, pct);
                        if *cycle_momentum {
                            group.momentum =
                                Some(anneal.apply(phase.start_momentum, phase.end_momentum, pct));
                        }
                        break;
                    }
                    start = phase.end_step;
                }
                out
            }
            Kind::Sequential { .. } => lr,
        })
    }

    /// PyTorch's `recursive_undo` in `SequentialLR`: each schedule inside
    /// goes back one epoch.
    pub(super) fn undo(&mut self) {
        match &mut self.kind {
            Kind::Sequential { children, .. } => children.iter_mut().for_each(Scheduler::undo),
            _ => self.last_epoch -= 1,
        }
    }

    pub(super) fn state(&self) -> LrSchedulerState {
        LrSchedulerState {
            kind: self.kind.name().into(),
            base_lr: self.base_lr,
            last_epoch: self.last_epoch,
            step_count: self.step_count,
            lr: 0.0,
            momentum: None,
            children: match &self.kind {
                Kind::Sequential { children, .. } => children.iter().map(Self::state).collect(),
                _ => Vec::new(),
            },
            groups: Vec::new(),
        }
    }

    /// Checks that `state` is of this schedule's kind and shape, and all
    /// its numbers usable.
    fn check(&self, state: &LrSchedulerState, path: &str) -> Result<()> {
        if state.kind != self.kind.name() {
            return Err(invalid(format!(
                "{path}: the state is of a `{}` schedule, this one is `{}`",
                state.kind,
                self.kind.name()
            )));
        }
        if !state.base_lr.is_finite() || state.last_epoch < -1 {
            return Err(invalid(format!(
                "{path}: base rate {} and epoch {} are not a schedule's",
                state.base_lr, state.last_epoch
            )));
        }
        let children: &[Scheduler] = match &self.kind {
            Kind::Sequential { children, .. } => children,
            _ => &[],
        };
        if children.len() != state.children.len() {
            return Err(invalid(format!(
                "{path}: the state has {} schedules inside, this one {}",
                state.children.len(),
                children.len()
            )));
        }
        for (k, (child, saved)) in children.iter().zip(&state.children).enumerate() {
            child.check(saved, &format!("{path}.{k}"))?;
        }
        Ok(())
    }

    fn load(&mut self, state: &LrSchedulerState) {
        self.base_lr = state.base_lr;
        self.last_epoch = state.last_epoch;
        self.step_count = state.step_count;
        if let Kind::Sequential { children, .. } = &mut self.kind {
            for (child, saved) in children.iter_mut().zip(&state.children) {
                child.load(saved);
            }
        }
    }
}

impl Anneal {
    /// PyTorch's `_annealing_cos` / `_annealing_linear` from `start` to
    /// `end` at `pct` of the way.
    fn apply(self, start: f64, end: f64, pct: f64) -> f64 {
        match self {
            Anneal::Cos => {
                let cos_out = (PI * pct).cos() + 1.0;
                end + (start - end) / 2.0 * cos_out
            }
            Anneal::Linear => (end - start) * pct + start,
        }
    }
}

/// A learning-rate schedule (see [`candle_dp::optim`](crate::optim)): build it with
/// the optimizer's rate, [`apply`](Self::apply) its [`lr`](Self::lr)
/// before each optimizer step, [`step`](Self::step) it after.
#[derive(Clone)]
pub struct LrScheduler {
    pub(super) scheduler: Scheduler,
    pub(super) group: Group,
    /// The optimizer's parameter groups after the first, each with the
    /// schedule over its own base rate, stepped alongside (PyTorch's
    /// per-group `base_lrs`): see [`with_group_rates`](Self::with_group_rates).
    pub(super) others: Vec<(Scheduler, Group)>,
}

/// Where an [`LrScheduler`] is: PyTorch's `last_epoch`, `_step_count` and
/// base rate, the rate (and momentum) it set, and the same of each schedule
/// inside a sequential one. Load it into a scheduler built the same way.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LrSchedulerState {
    /// The schedule's kind (`"cosine_annealing"`, `"sequential"`, ...).
    pub kind: String,
    /// The base rate (PyTorch's `base_lrs`).
    pub base_lr: f64,
    /// The steps taken (PyTorch's `last_epoch`: 0 after construction).
    pub last_epoch: i64,
    /// PyTorch's `_step_count`.
    pub step_count: u64,
    /// The rate for the next optimizer step (the outermost schedule's).
    pub lr: f64,
    /// The momentum for the next step, where the schedule cycles it.
    pub momentum: Option<f64>,
    /// The states of the schedules inside a sequential one, in order.
    pub children: Vec<LrSchedulerState>,
    /// The same for each parameter group after the first (none for a
    /// schedule of one group, and in states saved before groups had
    /// schedules of their own).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<LrSchedulerState>,
}

impl fmt::Debug for LrScheduler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LrScheduler")
            .field("kind", &self.scheduler.kind.name())
            .field("last_epoch", &self.scheduler.last_epoch)
            .field("lr", &self.group.lr)
            .field("momentum", &self.group.momentum)
            .field("group_lrs", &self.group_lrs())
            .finish()
    }
}

/// A rate that overflowed (a growing exponential) or a lambda's NaN would
/// train silently on NaN weights, and no state could be saved with it: the
/// schedule refuses to reach it.
pub(super) fn check_finite(scheduler: &Scheduler, group: &Group) -> Result<()> {
    if group.lr.is_finite() && group.momentum.is_none_or(f64::is_finite) {
        return Ok(());
    }
    Err(invalid(format!(
        "the `{}` schedule gives the rate {} (momentum {:?}) at step {}, not a finite number",
        scheduler.kind.name(),
        group.lr,
        group.momentum,
        scheduler.last_epoch
    )))
}

pub(super) fn invalid(reason: impl Into<String>) -> Error {
    Error::LrSchedule(reason.into())
}

pub(super) fn check_rate(name: &str, value: f64) -> Result<()> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(invalid(format!(
            "{name} is {value}: it must be a finite number, at least 0"
        )))
    }
}

impl LrScheduler {
    /// The learning rate of the next optimizer step.
    pub fn lr(&self) -> f64 {
        self.group.lr
    }

    /// The momentum of the next step, for a one-cycle schedule that cycles
    /// it (SGD's `momentum`, Adam's `beta1`); `None` otherwise.
    pub fn momentum(&self) -> Option<f64> {
        self.group.momentum
    }

    /// Sets [`lr`](Self::lr) on `optimizer` (any candle optimizer): group
    /// 0's rate, which the crate's optimizers of several groups scale the
    /// others' by. For a schedule over the groups use
    /// [`apply_to_groups`](Self::apply_to_groups).
    pub fn apply<O: candle_nn::Optimizer>(&self, optimizer: &mut O) {
        optimizer.set_learning_rate(self.group.lr);
    }

    /// Moves to the next step's rate: call it after each optimizer step
    /// (PyTorch's `scheduler.step()`). All or nothing: on an error the
    /// schedule is where it was.
    ///
    /// # Errors
    ///
    /// [`Error::LrSchedule`] when a one-cycle schedule steps past its
    /// steps, or the next rate or momentum is not a finite number (an
    /// exponential that overflowed, a lambda's NaN).
    pub fn step(&mut self) -> Result<()> {
        let mut scheduler = self.scheduler.clone();
        let mut group = self.group;
        scheduler.step(&mut group, false)?;
        check_finite(&scheduler, &group)?;
        let mut others = self.others.clone();
        for (scheduler, group) in &mut others {
            scheduler.step(group, false)?;
            check_finite(scheduler, group)?;
        }
        self.scheduler = scheduler;
        self.group = group;
        self.others = others;
        Ok(())
    }

    /// The steps taken since construction.
    pub fn steps(&self) -> u64 {
        u64::try_from(self.scheduler.last_epoch).unwrap_or(0)
    }

    /// Where the schedule is, to save.
    pub fn state(&self) -> LrSchedulerState {
        let of = |scheduler: &Scheduler, group: &Group| LrSchedulerState {
            lr: group.lr,
            momentum: group.momentum,
            ..scheduler.state()
        };
        LrSchedulerState {
            groups: self.others.iter().map(|(s, g)| of(s, g)).collect(),
            ..of(&self.scheduler, &self.group)
        }
    }

    /// Puts the schedule where `state` says, all or nothing: build it as
    /// the saved one was built, then load.
    ///
    /// # Errors
    ///
    /// [`Error::LrSchedule`] naming the schedule (`sequential.1`) whose
    /// kind or number of schedules inside differs, a state of another
    /// number of groups, or a rate that is not a finite number. A state of
    /// one group (saved before groups had schedules of their own) loads
    /// into a schedule over several: group 0 from it, the others stepped to
    /// its step over their own bases.
    pub fn load_state(&mut self, state: &LrSchedulerState) -> Result<()> {
        if state.groups.is_empty() && !self.others.is_empty() {
            return self.load_one_group_state(state);
        }
        if state.groups.len() != self.others.len() {
            return Err(invalid(format!(
                "the state sets {} parameter group(s), this schedule {}: build it over the \
                 groups of the run that saved it",
                1 + state.groups.len(),
                self.groups()
            )));
        }
        let saved = std::iter::once(state).chain(&state.groups);
        let mine = std::iter::once(&self.scheduler).chain(self.others.iter().map(|(s, _)| s));
        for (g, (scheduler, state)) in mine.zip(saved.clone()).enumerate() {
            let path = match g {
                0 => scheduler.kind.name().to_string(),
                g => format!("group {g}: {}", scheduler.kind.name()),
            };
            scheduler.check(state, &path)?;
            if !state.lr.is_finite() || state.momentum.is_some_and(|m| !m.is_finite()) {
                return Err(invalid(format!(
                    "{path}: the saved rate {} (momentum {:?}) is not a finite number",
                    state.lr, state.momentum
                )));
            }
        }
        let mine = std::iter::once((&mut self.scheduler, &mut self.group))
            .chain(self.others.iter_mut().map(|(s, g)| (s, g)));
        for ((scheduler, group), state) in mine.zip(saved) {
            scheduler.load(state);
            *group = Group {
                lr: state.lr,
                momentum: state.momentum,
            };
        }
        Ok(())
    }
}
