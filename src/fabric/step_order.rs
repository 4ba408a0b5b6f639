//! What happens around each optimizer step, in PyTorch's order: scale the
//! loss, backward, unscale, clip, step (unless an inf or NaN), update the
//! scale, step the schedule. One place for every strategy: the gradients
//! come replicated (every rank the same) or sharded (each rank its pieces,
//! so the checks and the norm span every rank).

use candle_core::backprop::GradStore;
use candle_core::Var;

use crate::comm::ProcessGroup;
use crate::error::{Error, Result};
use crate::optim::{
    GradScaler, GradScalerConfig, GradScalerState, LrScheduler, LrSchedulerState, StatefulOptimizer,
};

/// The loss scaler (f16) and the learning-rate schedule of one run, and
/// how many steps the scaler skipped.
#[derive(Debug)]
pub(crate) struct StepOrder {
    scaler: Option<GradScaler>,
    schedule: Option<LrScheduler>,
    skipped: u64,
}

impl StepOrder {
    /// A scaler with PyTorch's defaults but its first scale `init_scale`
    /// when `scales_loss`, no schedule.
    pub(crate) fn new(scales_loss: bool, init_scale: f64) -> Result<Self> {
        let scaler = match scales_loss {
            true => Some(GradScaler::new(GradScalerConfig {
                init_scale,
                ..GradScalerConfig::default()
            })?),
            false => None,
        };
        Ok(Self {
            scaler,
            schedule: None,
            skipped: 0,
        })
    }

    /// Steps the rates with `schedule`, made over the optimizer's groups
    /// of rates `group_rates` where it sets one group (each group's rate
    /// from its own base, as PyTorch's schedules over `param_groups`).
    pub(crate) fn set_schedule(
        &mut self,
        schedule: LrScheduler,
        group_rates: &[f64],
    ) -> Result<()> {
        let schedule = match (schedule.groups(), group_rates.len()) {
            (1, n) if n > 1 => schedule.with_group_rates(group_rates)?,
            (a, b) if a != b => {
                return Err(Error::Fabric(format!(
                    "a schedule over {a} parameter group(s) for an optimizer of {b}"
                )))
            }
            _ => schedule,
        };
        self.schedule = Some(schedule);
        Ok(())
    }

    /// The factor the loss is multiplied by before the backward (1 without
    /// a scaler).
    pub(crate) fn loss_factor(&self) -> f64 {
        self.scaler
            .as_ref()
            .map_or(1.0, |s| f64::from(s.scale_factor()))
    }

    /// Divides the gradients by the loss scale (and notes any inf or NaN);
    /// with `pg`, the gradients are this rank's pieces and the finding is
    /// shared by every rank.
    pub(crate) fn unscale(
        &mut self,
        grads: &mut GradStore,
        params: &[Var],
        pg: Option<&dyn ProcessGroup>,
    ) -> Result<()> {
        if let Some(scaler) = &mut self.scaler {
            match pg {
                Some(pg) => scaler.unscale_across(grads, params, pg)?,
                None => scaler.unscale(grads, params)?,
            };
        }
        Ok(())
    }

    /// Sets the optimizer's rates for the coming step from the schedule,
    /// each group's its own.
    pub(crate) fn apply_rate<O: StatefulOptimizer>(&self, opt: &mut O) -> Result<()> {
        match &self.schedule {
            Some(schedule) => opt.set_group_learning_rates(&schedule.group_lrs()),
            None => Ok(()),
        }
    }

    /// Steps through `apply` unless the scaler found an inf or NaN, updates
    /// the scale, steps the schedule. Whether the optimizer stepped.
    pub(crate) fn step(
        &mut self,
        grads: &mut GradStore,
        params: &[Var],
        apply: impl FnOnce(&GradStore) -> Result<()>,
    ) -> Result<bool> {
        let stepped = match &mut self.scaler {
            Some(scaler) => {
                // A failed optimizer step leaves the scaler as before the
                // step (its scale, and ready for the next one).
                let before = scaler.state();
                let stepped = match scaler.step(grads, params, apply) {
                    Ok(stepped) => stepped,
                    Err(e) => {
                        scaler.load_state(&before)?;
                        return Err(e);
                    }
                };
                scaler.update()?;
                stepped
            }
            None => {
                apply(grads)?;
                true
            }
        };
        if !stepped {
            self.skipped += 1;
        }
        if let Some(schedule) = &mut self.schedule {
            schedule.step()?;
        }
        Ok(stepped)
    }

    /// Steps the scaler skipped so far (an inf or NaN in f16).
    pub(crate) fn skipped(&self) -> u64 {
        self.skipped
    }

    /// What a training state keeps of it.
    pub(crate) fn state(&self) -> (Option<LrSchedulerState>, Option<GradScalerState>) {
        (
            self.schedule.as_ref().map(LrScheduler::state),
            self.scaler.as_ref().map(GradScaler::state),
        )
    }

    /// Whether [`resume`](Self::resume) would take a saved schedule and
    /// scale, checked on copies: an error says why, and nothing changed.
    pub(crate) fn check_resume(
        &self,
        schedule: Option<&LrSchedulerState>,
        scale: Option<&GradScalerState>,
    ) -> Result<()> {
        let mut copy = StepOrder {
            scaler: self.scaler.clone(),
            schedule: self.schedule.clone(),
            skipped: self.skipped,
        };
        copy.resume(schedule, scale)
    }

    /// Continues from a saved schedule and scale, which must be there
    /// exactly when this run has them.
    pub(crate) fn resume(
        &mut self,
        schedule: Option<&LrSchedulerState>,
        scale: Option<&GradScalerState>,
    ) -> Result<()> {
        let refuse = |why: &str| Err(Error::Fabric(format!("cannot resume: {why}")));
        match (&mut self.schedule, schedule) {
            (Some(mine), Some(saved)) => mine.load_state(saved)?,
            (Some(_), None) => return refuse("the saved state has no learning-rate schedule"),
            (None, Some(saved)) => {
                return refuse(&format!(
                    "the saved state has a {} learning-rate schedule and this run none",
                    saved.kind
                ))
            }
            (None, None) => {}
        }
        match (&mut self.scaler, scale) {
            (Some(mine), Some(saved)) => mine.load_state(saved)?,
            (Some(_), None) => {
                return refuse("the saved state has no loss scale: it was not a 16-mixed run")
            }
            (None, Some(_)) => {
                return refuse("the saved state is of a 16-mixed run: resume with that precision")
            }
            (None, None) => {}
        }
        Ok(())
    }
}
