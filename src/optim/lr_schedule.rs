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
struct Phase {
    end_step: f64,
    start_lr: f64,
    end_lr: f64,
    start_momentum: f64,
    end_momentum: f64,
}

#[derive(Clone)]
enum Kind {
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
    fn name(&self) -> &'static str {
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
struct Group {
    lr: f64,
    momentum: Option<f64>,
}

/// One schedule's position (PyTorch's `last_epoch`, `_step_count` and
/// `base_lrs`).
#[derive(Clone)]
struct Scheduler {
    kind: Kind,
    base_lr: f64,
    last_epoch: i64,
    step_count: u64,
}

impl Scheduler {
    fn new(kind: Kind, base_lr: f64) -> Self {
        Self {
            kind,
            base_lr,
            last_epoch: -1,
            step_count: 0,
        }
    }

    /// The schedule `self` is, made again over another base rate as its
    /// constructor made it (PyTorch's constructors over an optimizer's
    /// group of that rate), at step 0: the scheduler and the group's rate
    /// (and momentum). A one-cycle schedule's rates are its own (PyTorch's
    /// scalar `max_lr` gives every group the same), whatever `base_lr`.
    fn rebuilt(&self, base_lr: f64) -> Result<(Scheduler, Group)> {
        match &self.kind {
            Kind::Sequential {
                children,
                milestones,
            } => {
                // PyTorch's SequentialLR constructor: each schedule made
                // over the group, the rate back to the base, every schedule
                // one epoch back, then the first one's constructor step.
                let mut made = children
                    .iter()
                    .map(|child| Ok(child.rebuilt(base_lr)?.0))
                    .collect::<Result<Vec<_>>>()?;
                let mut group = Group {
                    lr: base_lr,
                    momentum: None,
                };
                made.iter_mut().for_each(Scheduler::undo);
                if let Some(first) = made.first_mut() {
                    first.initial_step(&mut group)?;
                }
                let scheduler = Scheduler {
                    kind: Kind::Sequential {
                        children: made,
                        milestones: milestones.clone(),
                    },
                    base_lr,
                    last_epoch: 0,
                    step_count: 0,
                };
                Ok((scheduler, group))
            }
            kind => {
                let (base_lr, momentum) = match kind {
                    Kind::OneCycle {
                        phases,
                        cycle_momentum,
                        ..
                    } => {
                        let first = phases
                            .first()
                            .ok_or_else(|| invalid("a one-cycle schedule without phases"))?;
                        (
                            first.start_lr,
                            cycle_momentum.then_some(first.start_momentum),
                        )
                    }
                    _ => (base_lr, None),
                };
                let mut scheduler = Scheduler::new(kind.clone(), base_lr);
                let mut group = Group {
                    lr: base_lr,
                    momentum,
                };
                scheduler.initial_step(&mut group)?;
                Ok((scheduler, group))
            }
        }
    }

    /// PyTorch's `_initial_step`: the step that a constructor takes.
    fn initial_step(&mut self, group: &mut Group) -> Result<()> {
        self.step_count = 0;
        self.step(group, true)
    }

    fn step(&mut self, group: &mut Group, initial: bool) -> Result<()> {
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
    fn undo(&mut self) {
        match &mut self.kind {
            Kind::Sequential { children, .. } => children.iter_mut().for_each(Scheduler::undo),
            _ => self.last_epoch -= 1,
        }
    }

    fn state(&self) -> LrSchedulerState {
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
    scheduler: Scheduler,
    group: Group,
    /// The optimizer's parameter groups after the first, each with the
    /// schedule over its own base rate, stepped alongside (PyTorch's
    /// per-group `base_lrs`): see [`with_group_rates`](Self::with_group_rates).
    others: Vec<(Scheduler, Group)>,
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
fn check_finite(scheduler: &Scheduler, group: &Group) -> Result<()> {
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

/// Whether two states are of schedules of the same kinds, nested alike.
fn same_shape(a: &LrSchedulerState, b: &LrSchedulerState) -> bool {
    a.kind == b.kind
        && a.children.len() == b.children.len()
        && a.children
            .iter()
            .zip(&b.children)
            .all(|(a, b)| same_shape(a, b))
}

fn invalid(reason: impl Into<String>) -> Error {
    Error::LrSchedule(reason.into())
}

fn check_rate(name: &str, value: f64) -> Result<()> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(invalid(format!(
            "{name} is {value}: it must be a finite number, at least 0"
        )))
    }
}

impl LrScheduler {
    /// Builds a schedule of `kind` from the optimizer's rate `base_lr` and
    /// takes its constructor's step, as PyTorch's constructors do.
    fn start(kind: Kind, base_lr: f64, momentum: Option<f64>) -> Result<Self> {
        check_rate("the base learning rate", base_lr)?;
        let mut scheduler = Scheduler::new(kind, base_lr);
        let mut group = Group {
            lr: base_lr,
            momentum,
        };
        scheduler.initial_step(&mut group)?;
        check_finite(&scheduler, &group)?;
        Ok(Self {
            scheduler,
            group,
            others: Vec::new(),
        })
    }

    /// `LambdaLR`: `base_lr * factor(step)`.
    pub fn lambda(base_lr: f64, factor: LrLambda) -> Result<Self> {
        Self::start(Kind::Lambda(factor), base_lr, None)
    }

    /// `StepLR`: the rate times `gamma` every `step_size` steps.
    ///
    /// # Errors
    ///
    /// [`Error::LrSchedule`] for a `step_size` of 0 or a `gamma` that is
    /// not a finite number.
    pub fn step_lr(base_lr: f64, step_size: u64, gamma: f64) -> Result<Self> {
        if step_size == 0 || !gamma.is_finite() {
            return Err(invalid(format!(
                "StepLR with step size {step_size} and gamma {gamma}: the step size must be at \
                 least 1 and gamma a finite number"
            )));
        }
        Self::start(Kind::Step { step_size, gamma }, base_lr, None)
    }

    /// `ExponentialLR`: the rate times `gamma` every step.
    ///
    /// # Errors
    ///
    /// [`Error::LrSchedule`] for a `gamma` that is not a finite number.
    pub fn exponential(base_lr: f64, gamma: f64) -> Result<Self> {
        if !gamma.is_finite() {
            return Err(invalid(format!("ExponentialLR's gamma is {gamma}")));
        }
        Self::start(Kind::Exponential { gamma }, base_lr, None)
    }

    /// `LinearLR`: from `start_factor` times the rate to `end_factor`
    /// times it over `total_iters` steps, then constant (PyTorch's
    /// defaults: 1/3, 1.0, 5).
    ///
    /// # Errors
    ///
    /// [`Error::LrSchedule`] as PyTorch: `start_factor` outside (0, 1],
    /// `end_factor` outside [0, 1]; and `total_iters` of 0.
    pub fn linear(
        base_lr: f64,
        start_factor: f64,
        end_factor: f64,
        total_iters: u64,
    ) -> Result<Self> {
        if !(start_factor > 0.0 && start_factor <= 1.0) {
            return Err(invalid(format!(
                "LinearLR's start factor is {start_factor}: it must be greater than 0 and at most 1"
            )));
        }
        if !(0.0..=1.0).contains(&end_factor) {
            return Err(invalid(format!(
                "LinearLR's end factor is {end_factor}: it must be between 0 and 1"
            )));
        }
        if total_iters == 0 {
            return Err(invalid("LinearLR over 0 steps"));
        }
        Self::start(
            Kind::Linear {
                start_factor,
                end_factor,
                total_iters,
            },
            base_lr,
            None,
        )
    }

    /// `CosineAnnealingLR`: half a cosine from the rate down to `eta_min`
    /// over `t_max` steps; past `t_max` it rises again, as PyTorch's does.
    ///
    /// # Errors
    ///
    /// [`Error::LrSchedule`] for a `t_max` of 0 or an `eta_min` that is not
    /// a finite number.
    pub fn cosine_annealing(base_lr: f64, t_max: u64, eta_min: f64) -> Result<Self> {
        if t_max == 0 || !eta_min.is_finite() {
            return Err(invalid(format!(
                "CosineAnnealingLR with T_max {t_max} and eta_min {eta_min}: T_max must be at \
                 least 1 and eta_min a finite number"
            )));
        }
        Self::start(Kind::Cosine { t_max, eta_min }, base_lr, None)
    }

    /// `OneCycleLR`: from `max_lr / div_factor` up to `max_lr` and down to
    /// a ten-thousandth of the start over `total_steps` steps (PyTorch's
    /// defaults in [`OneCycleConfig::default`]). It replaces the
    /// optimizer's rate from the first step, as PyTorch's does; stepping
    /// past `total_steps` is an error.
    ///
    /// # Errors
    ///
    /// [`Error::LrSchedule`] for 0 steps, a `pct_start` outside [0, 1], a
    /// rising phase that ends at step 0 (`pct_start * total_steps == 1`,
    /// where PyTorch divides 0 by 0), or a rate or momentum that is not a
    /// finite number.
    pub fn one_cycle(max_lr: f64, total_steps: u64, config: OneCycleConfig) -> Result<Self> {
        check_rate("OneCycleLR's max_lr", max_lr)?;
        if total_steps == 0 {
            return Err(invalid("OneCycleLR over 0 steps"));
        }
        if !(0.0..=1.0).contains(&config.pct_start) {
            return Err(invalid(format!(
                "OneCycleLR's pct_start is {}: it must be between 0 and 1",
                config.pct_start
            )));
        }
        for (name, value) in [
            ("div_factor", config.div_factor),
            ("final_div_factor", config.final_div_factor),
            ("base_momentum", config.base_momentum),
            ("max_momentum", config.max_momentum),
        ] {
            if !value.is_finite() {
                return Err(invalid(format!("OneCycleLR's {name} is {value}")));
            }
        }
        let initial_lr = max_lr / config.div_factor;
        let min_lr = initial_lr / config.final_div_factor;
        let (n, pct) = (total_steps as f64, config.pct_start);
        // The rising phase runs from step 0 to step `pct * n - 1`; ending
        // at 0 it has no length, and step 0's place in it is 0/0 (a NaN
        // rate and momentum from the first step; PyTorch raises
        // ZeroDivisionError there). A later phase is only entered past its
        // start, so only the first can divide 0 by 0.
        if pct * n - 1.0 == 0.0 {
            return Err(invalid(format!(
                "OneCycleLR with pct_start {pct} of {total_steps} steps: the rising phase would \
                 end at step 0, under one step, and give no rate (0/0); raise pct_start or the \
                 number of steps"
            )));
        }
        let (base_m, max_m) = (config.base_momentum, config.max_momentum);
        let phase = |end_step, start_lr, end_lr, start_momentum, end_momentum| Phase {
            end_step,
            start_lr,
            end_lr,
            start_momentum,
            end_momentum,
        };
        let phases = if config.three_phase {
            vec![
                phase(pct * n - 1.0, initial_lr, max_lr, max_m, base_m),
                phase(2.0 * pct * n - 2.0, max_lr, initial_lr, base_m, max_m),
                phase(n - 1.0, initial_lr, min_lr, max_m, max_m),
            ]
        } else {
            vec![
                phase(pct * n - 1.0, initial_lr, max_lr, max_m, base_m),
                phase(n - 1.0, max_lr, min_lr, base_m, max_m),
            ]
        };
        let kind = Kind::OneCycle {
            total_steps,
            phases,
            anneal: config.anneal,
            cycle_momentum: config.cycle_momentum,
        };
        Self::start(kind, initial_lr, config.cycle_momentum.then_some(max_m))
    }

    /// `SequentialLR`: `schedules[k]` runs from milestone `k - 1` (each
    /// counting its steps from 0 there), the first from the start. Build
    /// each with the same `base_lr`. As in PyTorch, a schedule that starts
    /// at a milestone starts from its closed form at step 0 where it has
    /// one (a cosine starts from the base rate), not from the rate the one
    /// before it reached.
    ///
    /// # Errors
    ///
    /// [`Error::LrSchedule`] when there is no schedule, the milestones
    /// are not one fewer than the schedules, or do not increase (naming
    /// them).
    pub fn sequential(
        base_lr: f64,
        schedules: Vec<LrScheduler>,
        milestones: Vec<u64>,
    ) -> Result<Self> {
        if schedules.is_empty() || milestones.len() + 1 != schedules.len() {
            return Err(invalid(format!(
                "SequentialLR of {} schedules with {} milestones: it needs one schedule or more, \
                 and one milestone fewer than schedules",
                schedules.len(),
                milestones.len()
            )));
        }
        check_rate("the base learning rate", base_lr)?;
        if let Some(pair) = milestones.windows(2).find(|pair| pair[0] >= pair[1]) {
            return Err(invalid(format!(
                "SequentialLR's milestones {milestones:?} do not increase ({} then {}): each \
                 schedule must start after the one before it",
                pair[0], pair[1]
            )));
        }
        if let Some((k, schedule)) = schedules.iter().enumerate().find(|(_, s)| s.groups() > 1) {
            return Err(invalid(format!(
                "SequentialLR: schedule {k} sets {} parameter groups: build the sequence of \
                 one-group schedules, then give it the groups' rates (with_group_rates)",
                schedule.groups()
            )));
        }
        let mut children: Vec<Scheduler> = schedules.into_iter().map(|s| s.scheduler).collect();
        // PyTorch's constructor: the rate back to the base, every schedule
        // one epoch back, then the first one's constructor step again.
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
        check_finite(&scheduler, &group)?;
        Ok(Self {
            scheduler,
            group,
            others: Vec::new(),
        })
    }

    /// The schedule over an optimizer's parameter groups of base rates
    /// `base_lrs` (each group's rate when the schedule starts: PyTorch's
    /// `base_lrs`, read from the optimizer): group `g` gets the rate the
    /// schedule's formula gives from its own base, as PyTorch's schedules
    /// compute each group's (a cosine's floor `eta_min` is every group's
    /// floor, not a share of it). Group 0 is this schedule itself (build it
    /// with group 0's rate: built with another, every group's base is its
    /// rate times the schedule's base over group 0's); a one-cycle schedule gives every group its
    /// rates, as PyTorch's scalar `max_lr` does ([`per_group`](Self::per_group)
    /// takes one schedule per group, for PyTorch's lists of `max_lr`).
    /// [`FabricModel::set_schedule`](crate::fabric::FabricModel::set_schedule)
    /// calls it with the optimizer's rates.
    ///
    /// ```
    /// use candle_dp::optim::LrScheduler;
    ///
    /// # fn main() -> candle_dp::Result<()> {
    /// let mut schedule = LrScheduler::cosine_annealing(0.1, 10, 1e-3)?.with_group_rates(&[0.1, 0.01])?;
    /// for _ in 0..10 {
    ///     schedule.step()?;
    /// }
    /// // Both groups end on the floor, as in PyTorch.
    /// assert!(schedule.group_lrs().iter().all(|lr| (lr - 1e-3).abs() < 1e-15));
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::LrSchedule`] when the schedule has stepped already or has
    /// its groups already, `base_lrs` is empty, or a rate is not a finite
    /// number of at least 0 (naming the group).
    pub fn with_group_rates(mut self, base_lrs: &[f64]) -> Result<Self> {
        if self.scheduler.last_epoch > 0 || !self.others.is_empty() {
            return Err(invalid(format!(
                "with_group_rates on a schedule that has stepped ({} steps) or has its groups \
                 ({}): give the groups' rates before the first step",
                self.steps(),
                self.groups()
            )));
        }
        if base_lrs.is_empty() {
            return Err(invalid("with_group_rates of no parameter group"));
        }
        // Built with another rate than group 0's, the schedule's base is
        // group 0's, and each other group keeps its ratio to group 0 (what
        // scaling every group by group 0's factor gave).
        check_rate("parameter group 0's rate", base_lrs[0])?;
        let scale = match base_lrs[0] {
            b if b > 0.0 && b != self.scheduler.base_lr => self.scheduler.base_lr / b,
            _ => 1.0,
        };
        self.others = base_lrs[1..]
            .iter()
            .enumerate()
            .map(|(g, &rate)| {
                check_rate(&format!("parameter group {}'s rate", g + 1), rate)?;
                let base = if scale == 1.0 { rate } else { rate * scale };
                let (scheduler, group) = self.scheduler.rebuilt(base)?;
                check_finite(&scheduler, &group)?;
                Ok((scheduler, group))
            })
            .collect::<Result<_>>()?;
        Ok(self)
    }

    /// One schedule per parameter group, in group order, stepped together:
    /// PyTorch's schedules that take a list per group (`OneCycleLR`'s
    /// `max_lr`, a floor per group). Each must be a schedule of one group,
    /// of the same kind and steps.
    ///
    /// # Errors
    ///
    /// [`Error::LrSchedule`] for no schedule, or one of several groups
    /// already, of another kind, or at another step (naming it).
    pub fn per_group(schedules: Vec<LrScheduler>) -> Result<Self> {
        let mut schedules = schedules.into_iter();
        let Some(mut first) = schedules.next() else {
            return Err(invalid("per_group of no schedule"));
        };
        if !first.others.is_empty() {
            return Err(invalid(format!(
                "per_group: group 0's schedule sets {} groups already: give one schedule of one \
                 group per group",
                first.groups()
            )));
        }
        for (g, schedule) in schedules.enumerate().map(|(g, s)| (g + 1, s)) {
            let (mine, theirs) = (first.scheduler.state(), schedule.scheduler.state());
            if !schedule.others.is_empty()
                || !same_shape(&mine, &theirs)
                || theirs.last_epoch != mine.last_epoch
            {
                return Err(invalid(format!(
                    "per_group: group {g}'s schedule (`{}` at step {}, {} group(s)) is not one \
                     group of group 0's kind (`{}` at step {})",
                    theirs.kind,
                    theirs.last_epoch,
                    schedule.groups(),
                    mine.kind,
                    mine.last_epoch
                )));
            }
            first.others.push((schedule.scheduler, schedule.group));
        }
        Ok(first)
    }

    /// The number of parameter groups the schedule sets (1 unless
    /// [`with_group_rates`](Self::with_group_rates) or
    /// [`per_group`](Self::per_group) made it for more).
    pub fn groups(&self) -> usize {
        1 + self.others.len()
    }

    /// Each parameter group's rate for the next optimizer step.
    pub fn group_lrs(&self) -> Vec<f64> {
        std::iter::once(self.group.lr)
            .chain(self.others.iter().map(|(_, g)| g.lr))
            .collect()
    }

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

    /// Sets each parameter group's rate ([`group_lrs`](Self::group_lrs))
    /// on `optimizer`.
    ///
    /// # Errors
    ///
    /// An optimizer of another number of groups than the schedule's
    /// ([`Error::OptimizerState`]); nothing changes then.
    pub fn apply_to_groups<O: crate::optim::StatefulOptimizer>(
        &self,
        optimizer: &mut O,
    ) -> Result<()> {
        optimizer.set_group_learning_rates(&self.group_lrs())
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

    /// A state saved before the groups had schedules of their own (one
    /// group's) into a schedule over several: group 0 from the state, the
    /// others made again over their bases and stepped to its step (their
    /// rates from here on are the formula's for each group).
    fn load_one_group_state(&mut self, state: &LrSchedulerState) -> Result<()> {
        let mut group0 = self.clone();
        group0.others.clear();
        group0.load_state(state)?;
        let steps = u64::try_from(state.last_epoch).unwrap_or(0);
        let others = self
            .others
            .iter()
            .map(|(scheduler, _)| {
                let (mut scheduler, mut group) = scheduler.rebuilt(scheduler.base_lr)?;
                for _ in 0..steps {
                    scheduler.step(&mut group, false)?;
                }
                check_finite(&scheduler, &group)?;
                Ok((scheduler, group))
            })
            .collect::<Result<Vec<_>>>()?;
        self.scheduler = group0.scheduler;
        self.group = group0.group;
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
