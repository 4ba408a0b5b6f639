//! PyTorch's schedules as [`LrScheduler`]'s constructors (`LambdaLR`,
//! `StepLR`, `ExponentialLR`, `LinearLR`, `CosineAnnealingLR`,
//! `OneCycleLR`, `SequentialLR`), each refusing what PyTorch refuses.

use super::lr_schedule::{
    check_finite, check_rate, invalid, Group, Kind, LrLambda, LrScheduler, OneCycleConfig, Phase,
    Scheduler,
};
use crate::error::Result;

impl LrScheduler {
    /// Builds a schedule of `kind` from the optimizer's rate `base_lr` and
    /// takes its constructor's step, as PyTorch's constructors do.
    pub(super) fn start(kind: Kind, base_lr: f64, momentum: Option<f64>) -> Result<Self> {
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
    /// [`Error::LrSchedule`](crate::Error::LrSchedule) for a `step_size` of 0 or a `gamma` that is
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
    /// [`Error::LrSchedule`](crate::Error::LrSchedule) for a `gamma` that is not a finite number.
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
    /// [`Error::LrSchedule`](crate::Error::LrSchedule) as PyTorch: `start_factor` outside (0, 1],
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
    /// [`Error::LrSchedule`](crate::Error::LrSchedule) for a `t_max` of 0 or an `eta_min` that is not
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
    /// [`Error::LrSchedule`](crate::Error::LrSchedule) for 0 steps, a `pct_start` outside [0, 1], a
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
    /// [`Error::LrSchedule`](crate::Error::LrSchedule) when there is no schedule, the milestones
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
        let children: Vec<Scheduler> = schedules.into_iter().map(|s| s.scheduler).collect();
        let (scheduler, group) = Scheduler::sequential_of(children, milestones, base_lr)?;
        check_finite(&scheduler, &group)?;
        Ok(Self {
            scheduler,
            group,
            others: Vec::new(),
        })
    }
}
