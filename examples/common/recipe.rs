//! How the examples train beyond the plain step: the precision, the loss
//! scaler f16 needs, gradient clipping and the learning-rate schedule, in
//! PyTorch's order (scale the loss, backward, unscale, clip, step, update
//! the scale, step the schedule).

use anyhow::{bail, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use candle_dp::comm::ProcessGroup;
use candle_dp::fsdp::FullyShardedDataParallel;
use candle_dp::optim::{
    clip_grad_norm, GradScaler, GradScalerConfig, GradScalerState, LrScheduler, LrSchedulerState,
};
use candle_dp::precision::MixedPrecision;
use candle_dp::training_state::TrainingState;
use candle_dp::zero::ZeroOptimizer;
use candle_nn::Optimizer;
use clap::ValueEnum;

/// The dtype of the forward and backward (master weights and optimizer
/// state stay in f32).
#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
pub enum Precision {
    /// Everything in f32.
    F32,
    /// bf16 compute, f32 reduction; no loss scaling needed.
    Bf16,
    /// f16 compute, f32 reduction, with dynamic loss scaling.
    F16,
}

impl Precision {
    /// The mixed-precision policy (f32: compute on the masters themselves).
    pub fn policy(self) -> MixedPrecision {
        match self {
            Precision::F32 => MixedPrecision::new(DType::F32),
            Precision::Bf16 => MixedPrecision::bf16(),
            Precision::F16 => MixedPrecision::f16(),
        }
    }

    /// The dtype the model computes in.
    pub fn dtype(self) -> DType {
        self.policy().param_dtype
    }
}

/// The learning rate over the run.
#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
pub enum Schedule {
    /// The `--lr` throughout.
    Constant,
    /// A linear warm-up from 1% of `--lr` over `--warmup-steps`, then a
    /// cosine decay to 0 at the last step (PyTorch's SequentialLR of
    /// LinearLR and CosineAnnealingLR).
    WarmupCosine,
}

/// What one run applies around each optimizer step.
#[derive(Debug)]
pub struct Recipe {
    scaler: Option<GradScaler>,
    clip: Option<f64>,
    schedule: Option<LrScheduler>,
    /// Steps skipped by the scaler so far.
    pub skipped: u64,
}

impl Recipe {
    /// The recipe of a run of `total_steps` steps at rate `lr`.
    pub fn new(
        precision: Precision,
        clip: Option<f64>,
        schedule: Schedule,
        lr: f64,
        warmup: u64,
        total_steps: u64,
    ) -> Result<Self> {
        let scaler = match precision {
            Precision::F16 => Some(GradScaler::new(GradScalerConfig::default())?),
            _ => None,
        };
        let schedule = match schedule {
            Schedule::Constant => None,
            Schedule::WarmupCosine => {
                if warmup >= total_steps {
                    bail!("--warmup-steps {warmup} leaves none of the run's {total_steps} steps to decay");
                }
                let rise = LrScheduler::linear(lr, 0.01, 1.0, warmup.max(1))?;
                let fall = LrScheduler::cosine_annealing(lr, total_steps - warmup, 0.0)?;
                Some(LrScheduler::sequential(lr, vec![rise, fall], vec![warmup])?)
            }
        };
        Ok(Self {
            scaler,
            clip,
            schedule,
            skipped: 0,
        })
    }

    /// Sets the optimizer's rate for the coming step.
    pub fn before_step<O: Optimizer>(&self, opt: &mut O) {
        if let Some(schedule) = &self.schedule {
            schedule.apply(opt);
        }
    }

    /// The loss to back-propagate.
    pub fn scale(&self, loss: &Tensor) -> Result<Tensor> {
        Ok(match &self.scaler {
            Some(scaler) => scaler.scale(loss)?,
            None => loss.clone(),
        })
    }

    /// The factor [`scale`](Self::scale) multiplies by, for losses computed
    /// inside a closure (DataParallel's).
    pub fn loss_factor(&self) -> f32 {
        self.scaler.as_ref().map_or(1.0, GradScaler::scale_factor)
    }

    /// Unscale, clip, step `opt` (unless an inf or NaN), update the scale,
    /// step the schedule. Whether the optimizer stepped.
    pub fn finish<O: Optimizer>(
        &mut self,
        grads: &mut GradStore,
        params: &[Var],
        opt: &mut O,
    ) -> Result<bool> {
        self.finish_with(grads, params, None, |g| Ok(opt.step(g)?))
    }

    /// [`finish`](Self::finish) for a ZeRO optimizer: the checks and the
    /// clipping over every rank's gradients (one all-reduce each).
    pub fn finish_zero<O: Optimizer>(
        &mut self,
        grads: &mut GradStore,
        zero: &mut ZeroOptimizer<O>,
        pg: &dyn ProcessGroup,
    ) -> Result<bool> {
        let mine = zero.grad_vars();
        let clip = self.clip;
        self.unscale(grads, &mine, Some(pg))?;
        if let Some(max_norm) = clip {
            zero.clip_grad_norm(grads, max_norm, 2.0, false)?;
        }
        self.step(grads, &mine, |g| Ok(zero.step(g)?))
    }

    /// [`finish`](Self::finish) for FSDP, whose optimizer steps this rank's
    /// pieces: the checks and the clipping over every rank's pieces (one
    /// all-reduce each).
    pub fn finish_fsdp<O: Optimizer>(
        &mut self,
        grads: &mut GradStore,
        fsdp: &FullyShardedDataParallel,
        opt: &mut O,
    ) -> Result<bool> {
        let pieces = fsdp.shard_vars();
        let clip = self.clip;
        self.unscale(grads, &pieces, Some(fsdp.process_group().as_ref()))?;
        if let Some(max_norm) = clip {
            fsdp.clip_grad_norm(grads, max_norm, 2.0, false)?;
        }
        self.step(grads, &pieces, |g| Ok(opt.step(g)?))
    }

    fn finish_with(
        &mut self,
        grads: &mut GradStore,
        params: &[Var],
        pg: Option<&dyn ProcessGroup>,
        apply: impl FnOnce(&GradStore) -> Result<()>,
    ) -> Result<bool> {
        self.unscale(grads, params, pg)?;
        if let Some(max_norm) = self.clip {
            clip_grad_norm(grads, params, max_norm, 2.0, false)?;
        }
        self.step(grads, params, apply)
    }

    fn unscale(
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

    fn step(
        &mut self,
        grads: &mut GradStore,
        params: &[Var],
        apply: impl FnOnce(&GradStore) -> Result<()>,
    ) -> Result<bool> {
        let stepped = match &mut self.scaler {
            Some(scaler) => {
                let mut failed = None;
                let stepped = scaler.step(grads, params, |g| {
                    apply(g).map_err(|e| {
                        let message = e.to_string();
                        failed = Some(e);
                        candle_core::Error::Msg(message)
                    })
                });
                if let Some(e) = failed {
                    return Err(e);
                }
                let stepped = stepped?;
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

    /// What a training state keeps of it.
    pub fn state(&self) -> (Option<LrSchedulerState>, Option<GradScalerState>) {
        (
            self.schedule.as_ref().map(LrScheduler::state),
            self.scaler.as_ref().map(GradScaler::state),
        )
    }

    /// Continues from a saved state: its schedule and scale, which must be
    /// there when this run has them.
    pub fn resume(&mut self, state: &TrainingState) -> Result<()> {
        match (&mut self.schedule, &state.lr_scheduler) {
            (Some(schedule), Some(saved)) => schedule.load_state(saved)?,
            (Some(_), None) => bail!(
                "the saved state has no learning-rate schedule: resume with the run's own \
                 --lr-schedule"
            ),
            (None, Some(saved)) => bail!(
                "the saved state has a {} learning-rate schedule: resume with --lr-schedule \
                 warmup-cosine",
                saved.kind
            ),
            (None, None) => {}
        }
        match (&mut self.scaler, &state.grad_scaler) {
            (Some(scaler), Some(saved)) => scaler.load_state(saved)?,
            (Some(_), None) => {
                bail!("the saved state has no loss scale: it was not an f16 run (--precision)")
            }
            (None, Some(_)) => {
                bail!("the saved state is of an f16 run: resume with --precision f16")
            }
            (None, None) => {}
        }
        Ok(())
    }
}
