//! A schedule over an optimizer's parameter groups: each group's rate
//! from the schedule's formula over the group's own base rate, as
//! PyTorch's schedules over `param_groups` compute it
//! ([`LrScheduler::with_group_rates`], [`LrScheduler::per_group`]).

use super::lr_schedule::{
    check_finite, check_rate, invalid, Group, Kind, LrScheduler, LrSchedulerState, Scheduler,
};
use crate::error::Result;

impl LrScheduler {
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
    /// [`Error::LrSchedule`](crate::Error::LrSchedule) when the schedule has stepped already or has
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
    /// [`Error::LrSchedule`](crate::Error::LrSchedule) for no schedule, or one of several groups
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

    /// Sets each parameter group's rate ([`group_lrs`](Self::group_lrs))
    /// on `optimizer`.
    ///
    /// # Errors
    ///
    /// An optimizer of another number of groups than the schedule's
    /// ([`Error::OptimizerState`](crate::Error::OptimizerState)); nothing changes then.
    pub fn apply_to_groups<O: crate::optim::StatefulOptimizer>(
        &self,
        optimizer: &mut O,
    ) -> Result<()> {
        optimizer.set_group_learning_rates(&self.group_lrs())
    }

    /// A state saved before the groups had schedules of their own (one
    /// group's) into a schedule over several: group 0 from the state, the
    /// others made again over their bases and stepped to its step (their
    /// rates from here on are the formula's for each group).
    pub(super) fn load_one_group_state(&mut self, state: &LrSchedulerState) -> Result<()> {
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
}

impl Scheduler {
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
                // Each schedule made over the group, then SequentialLR's
                // constructor.
                let made = children
                    .iter()
                    .map(|child| Ok(child.rebuilt(base_lr)?.0))
                    .collect::<Result<Vec<_>>>()?;
                Scheduler::sequential_of(made, milestones.clone(), base_lr)
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
