//! Dynamic loss scaling for f16 training: PyTorch's `torch.amp.GradScaler`.
//!
//! f16 gradients underflow to zero below 6e-8; multiplying the loss by a
//! large scale before the backward keeps them representable. The scaler
//! divides the gradients by the scale before the optimizer steps, skips the
//! step when any gradient came out infinite or NaN (the scale was too
//! large), and adapts the scale: halved after a skipped step, doubled after
//! `growth_interval` good steps in a row.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use serde::{Deserialize, Serialize};

use crate::comm::{ProcessGroup, ReduceOp};
use crate::error::{Error, Result};

/// Settings of a [`GradScaler`]; the defaults are PyTorch's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradScalerConfig {
    /// The first scale (default 2^16).
    pub init_scale: f64,
    /// What the scale is multiplied by after `growth_interval` steps in a
    /// row without an inf or NaN (default 2).
    pub growth_factor: f64,
    /// What the scale is multiplied by after a step with one (default 0.5).
    pub backoff_factor: f64,
    /// Good steps in a row before the scale grows (default 2000).
    pub growth_interval: u64,
    /// Off, the scaler is a pass-through: scale 1, no checks, every step
    /// taken (PyTorch's `enabled=False`, for one code path in f32 and f16).
    pub enabled: bool,
}

impl Default for GradScalerConfig {
    fn default() -> Self {
        Self {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            enabled: true,
        }
    }
}

/// What a [`GradScaler`] needs to continue exactly: PyTorch's
/// `state_dict()` (`scale`, `growth_factor`, `backoff_factor`,
/// `growth_interval`, `_growth_tracker`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GradScalerState {
    /// The current scale.
    pub scale: f32,
    /// See [`GradScalerConfig::growth_factor`].
    pub growth_factor: f64,
    /// See [`GradScalerConfig::backoff_factor`].
    pub backoff_factor: f64,
    /// See [`GradScalerConfig::growth_interval`].
    pub growth_interval: u64,
    /// Good steps in a row since the scale last changed.
    pub growth_tracker: u64,
}

/// Where the scaler is within a step (PyTorch's `OptState`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Since the last `update`, nothing.
    Ready,
    /// The gradients were unscaled; `found_inf` says what was seen.
    Unscaled { found_inf: bool },
    /// The step was taken or skipped.
    Stepped { found_inf: bool },
}

/// PyTorch's `GradScaler`, step for step: the same scale after every
/// update, the same steps skipped, the same unscaled gradients (the
/// inverse scale computed in f64 and rounded to f32, each gradient
/// multiplied by it).
///
/// The recipe, as in PyTorch: `scale` the loss, back-propagate, optionally
/// [`unscale`](Self::unscale) to clip, then [`step`](Self::step) (which
/// unscales if that was not done) and [`update`](Self::update).
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_dp::optim::{GradScaler, GradScalerConfig, Sgd, SgdConfig};
/// use candle_nn::{linear, Module, Optimizer, VarBuilder, VarMap};
///
/// # fn main() -> anyhow::Result<()> {
/// let varmap = VarMap::new();
/// let model = linear(4, 1, VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?;
/// let mut opt = Sgd::from_varmap(&varmap, SgdConfig { lr: 0.1, ..Default::default() })?;
/// let params = varmap.all_vars();
/// let mut scaler = GradScaler::new(GradScalerConfig::default())?;
///
/// let x = Tensor::ones((2, 4), DType::F32, &Device::Cpu)?;
/// let loss = model.forward(&x)?.sqr()?.mean_all()?;
/// let mut grads = scaler.scale(&loss)?.backward()?; // gradients times 65536
/// let stepped = scaler.step(&mut grads, &params, |g| opt.step(g))?;
/// scaler.update()?;
/// assert!(stepped && scaler.scale_factor() == 65536.0);
/// # Ok(())
/// # }
/// ```
///
/// **Across ranks.** After DDP's all-reduce every rank holds the same
/// gradients, so every rank finds the same inf and skips alike. Where ranks
/// hold different gradients (ZeRO stage 2, a pipeline's stages, FSDP
/// shards), use [`unscale_across`](Self::unscale_across): one all-reduce of
/// one number, so that an inf on any rank skips the step on every rank.
#[derive(Debug, Clone)]
pub struct GradScaler {
    scale: f32,
    growth_factor: f64,
    backoff_factor: f64,
    growth_interval: u64,
    growth_tracker: u64,
    enabled: bool,
    stage: Stage,
}

impl GradScaler {
    /// A scaler with these settings.
    ///
    /// # Errors
    ///
    /// [`Error::GradScaler`] for an `init_scale` that is not a positive
    /// finite f32, a `growth_factor` not above 1, a `backoff_factor` not
    /// in (0, 1), or a `growth_interval` of 0 (PyTorch's checks).
    pub fn new(config: GradScalerConfig) -> Result<Self> {
        check_settings(
            config.growth_factor,
            config.backoff_factor,
            config.growth_interval,
        )?;
        let scale = config.init_scale as f32;
        if !(scale.is_finite() && scale > 0.0) {
            return Err(Error::GradScaler(format!(
                "init_scale {} is not a positive finite f32",
                config.init_scale
            )));
        }
        Ok(Self {
            scale,
            growth_factor: config.growth_factor,
            backoff_factor: config.backoff_factor,
            growth_interval: config.growth_interval,
            growth_tracker: 0,
            enabled: config.enabled,
            stage: Stage::Ready,
        })
    }

    /// The current scale (1 when disabled).
    pub fn scale_factor(&self) -> f32 {
        if self.enabled {
            self.scale
        } else {
            1.0
        }
    }

    /// Whether the scaler scales and checks at all.
    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    /// `loss` times the scale, in the loss's dtype, to back-propagate.
    ///
    /// # Errors
    ///
    /// [`Error::GradScaler`] when the scale does not fit the loss's dtype
    /// (65536 is past f16's largest value): compute the loss in f32, as
    /// autocast does.
    pub fn scale(&self, loss: &Tensor) -> Result<Tensor> {
        if !self.enabled {
            return Ok(loss.clone());
        }
        let scale = Tensor::new(self.scale, loss.device())?.to_dtype(loss.dtype())?;
        let fits = scale.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        if !fits.is_finite() {
            return Err(Error::GradScaler(format!(
                "the scale {} does not fit a {:?} loss: compute the loss in f32",
                self.scale,
                loss.dtype()
            )));
        }
        Ok(loss.broadcast_mul(&scale)?)
    }

    /// Divides the gradients of `params` in `grads` by the scale, in place,
    /// and records whether any is infinite or NaN (returned). At most once
    /// per step, before [`step`](Self::step); call it to clip the true
    /// gradients. The gradients are divided even when one is not finite,
    /// as in PyTorch; the step will be skipped.
    ///
    /// # Errors
    ///
    /// [`Error::GradScaler`] when called twice in a step or after `step`,
    /// or for an f16 gradient (PyTorch refuses to unscale those: keep
    /// master gradients in f32); the gradients are then unchanged.
    pub fn unscale(&mut self, grads: &mut GradStore, params: &[Var]) -> Result<bool> {
        self.unscale_with(grads, params, None)
    }

    /// [`unscale`](Self::unscale) where each rank holds some of the
    /// gradients: every rank learns whether any rank found an inf or NaN
    /// (one all-reduce of one number), so every rank skips the same steps
    /// and keeps the same scale. Every rank of `pg` must call it.
    ///
    /// # Errors
    ///
    /// As `unscale`; the collective's error.
    pub fn unscale_across(
        &mut self,
        grads: &mut GradStore,
        params: &[Var],
        pg: &dyn ProcessGroup,
    ) -> Result<bool> {
        self.unscale_with(grads, params, Some(pg))
    }

    fn unscale_with(
        &mut self,
        grads: &mut GradStore,
        params: &[Var],
        pg: Option<&dyn ProcessGroup>,
    ) -> Result<bool> {
        match self.stage {
            Stage::Ready => {}
            Stage::Unscaled { .. } => {
                return Err(Error::GradScaler(
                    "unscale was already called since the last update".into(),
                ))
            }
            Stage::Stepped { .. } => {
                return Err(Error::GradScaler(
                    "unscale after step: call update first".into(),
                ))
            }
        }
        if !self.enabled {
            self.stage = Stage::Unscaled { found_inf: false };
            return Ok(false);
        }
        let present: Vec<(&Var, Tensor)> = params
            .iter()
            .filter_map(|p| grads.get(p.as_tensor()).map(|g| (p, g.clone())))
            .collect();
        if let Some(i) = present.iter().position(|(_, g)| g.dtype() == DType::F16) {
            return Err(Error::GradScaler(format!(
                "the gradient of parameter {i} is f16: unscale f32 master gradients (a mixed-\
                 precision model's gradients reach the optimizer in its parameters' dtype)"
            )));
        }
        // PyTorch: `self._scale.double().reciprocal().float()`.
        let inv_scale = (1.0 / self.scale as f64) as f32;
        let mut found_inf = false;
        let mut unscaled = Vec::with_capacity(present.len());
        for (p, g) in &present {
            // inf - inf and NaN - NaN are NaN; finite x - x is 0: the sum is
            // NaN exactly when some element is not finite.
            let probe = g
                .sub(g)?
                .sum_all()?
                .to_dtype(DType::F64)?
                .to_scalar::<f64>()?;
            found_inf |= probe.is_nan();
            let inv = Tensor::new(inv_scale, g.device())?.to_dtype(g.dtype())?;
            // A multiplication, not `affine`, which adds 0 and so turns
            // -0.0 into 0.0.
            unscaled.push((*p, g.broadcast_mul(&inv)?));
        }
        if let Some(pg) = pg {
            let flag = Tensor::new(&[if found_inf { 1f32 } else { 0. }], &Device::Cpu)?;
            let any = pg.all_reduce(&flag, ReduceOp::Max)?.to_vec1::<f32>()?;
            found_inf = any.first().is_some_and(|&f| f != 0.0);
        }
        for (p, g) in unscaled {
            grads.insert(p.as_tensor(), g);
        }
        self.stage = Stage::Unscaled { found_inf };
        Ok(found_inf)
    }

    /// Unscales the gradients (unless [`unscale`](Self::unscale) already
    /// did this step), then runs `apply` (the optimizer's step) only if no
    /// gradient was infinite or NaN. Returns whether it stepped. `apply`
    /// is any optimizer's step: `|g| opt.step(g)` for a candle `Optimizer`,
    /// `|g| zero.step(g)` for a [`ZeroOptimizer`](crate::zero::ZeroOptimizer).
    ///
    /// # Errors
    ///
    /// [`Error::GradScaler`] when called twice before
    /// [`update`](Self::update); `unscale`'s and `apply`'s errors.
    pub fn step<E: Into<Error>>(
        &mut self,
        grads: &mut GradStore,
        params: &[Var],
        apply: impl FnOnce(&GradStore) -> std::result::Result<(), E>,
    ) -> Result<bool> {
        if let Stage::Stepped { .. } = self.stage {
            return Err(Error::GradScaler(
                "step was already called since the last update".into(),
            ));
        }
        if self.stage == Stage::Ready {
            self.unscale(grads, params)?;
        }
        let found_inf = matches!(self.stage, Stage::Unscaled { found_inf: true });
        if !found_inf {
            apply(grads).map_err(Into::into)?;
        }
        self.stage = Stage::Stepped { found_inf };
        Ok(!found_inf)
    }

    /// Adapts the scale to the step just taken or skipped, as PyTorch's
    /// `_amp_update_scale_`: after an inf or NaN, times `backoff_factor`
    /// and the tracker back to 0; otherwise one more good step, and at
    /// `growth_interval` of them, times `growth_factor` (kept only if
    /// finite) and the tracker back to 0. Each product is computed in f64
    /// and rounded to f32, as PyTorch's CPU kernel does.
    ///
    /// # Errors
    ///
    /// [`Error::GradScaler`] when no gradients were checked since the last
    /// update (PyTorch: "No inf checks were recorded prior to update").
    pub fn update(&mut self) -> Result<()> {
        let found_inf = match self.stage {
            Stage::Ready => {
                return Err(Error::GradScaler(
                    "update without a step or unscale since the last one".into(),
                ))
            }
            Stage::Unscaled { found_inf } | Stage::Stepped { found_inf } => found_inf,
        };
        self.stage = Stage::Ready;
        if !self.enabled {
            return Ok(());
        }
        if found_inf {
            self.scale = (self.scale as f64 * self.backoff_factor) as f32;
            self.growth_tracker = 0;
        } else {
            let successful = self.growth_tracker + 1;
            if successful == self.growth_interval {
                let grown = (self.scale as f64 * self.growth_factor) as f32;
                if grown.is_finite() {
                    self.scale = grown;
                }
                self.growth_tracker = 0;
            } else {
                self.growth_tracker = successful;
            }
        }
        Ok(())
    }

    /// Good steps in a row since the scale last changed.
    pub fn growth_tracker(&self) -> u64 {
        self.growth_tracker
    }

    /// What to save to continue exactly.
    pub fn state(&self) -> GradScalerState {
        GradScalerState {
            scale: self.scale,
            growth_factor: self.growth_factor,
            backoff_factor: self.backoff_factor,
            growth_interval: self.growth_interval,
            growth_tracker: self.growth_tracker,
        }
    }

    /// Continues from a saved state (its settings replace this scaler's).
    ///
    /// # Errors
    ///
    /// [`Error::GradScaler`] for a state whose values [`new`](Self::new)
    /// would refuse, or whose tracker is not below its interval; nothing
    /// changes then.
    pub fn load_state(&mut self, state: &GradScalerState) -> Result<()> {
        check_settings(
            state.growth_factor,
            state.backoff_factor,
            state.growth_interval,
        )?;
        if !(state.scale.is_finite() && state.scale > 0.0) {
            return Err(Error::GradScaler(format!(
                "the saved scale {} is not a positive finite number",
                state.scale
            )));
        }
        if state.growth_tracker >= state.growth_interval {
            return Err(Error::GradScaler(format!(
                "the saved growth tracker {} is not below its interval {}",
                state.growth_tracker, state.growth_interval
            )));
        }
        self.scale = state.scale;
        self.growth_factor = state.growth_factor;
        self.backoff_factor = state.backoff_factor;
        self.growth_interval = state.growth_interval;
        self.growth_tracker = state.growth_tracker;
        self.stage = Stage::Ready;
        Ok(())
    }
}

fn check_settings(growth_factor: f64, backoff_factor: f64, growth_interval: u64) -> Result<()> {
    if !(growth_factor.is_finite() && growth_factor > 1.0) {
        return Err(Error::GradScaler(format!(
            "growth_factor {growth_factor} must be a finite number above 1"
        )));
    }
    if !(backoff_factor > 0.0 && backoff_factor < 1.0) {
        return Err(Error::GradScaler(format!(
            "backoff_factor {backoff_factor} must lie between 0 and 1"
        )));
    }
    if growth_interval == 0 {
        return Err(Error::GradScaler(
            "growth_interval must be at least 1".into(),
        ));
    }
    Ok(())
}
