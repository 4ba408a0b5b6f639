//! The model as a [`Fabric`](super::Fabric) takes it: a plain module, or
//! the same model as units for the strategies that work unit by unit.

use std::fmt;

use candle_core::ModuleT;
use candle_nn::VarBuilder;

use super::config::Strategy;
use crate::error::{Error, Result};
use crate::tensor_parallel::TpPlan;
use crate::units::{unit, UnitFactory, Units};

/// A model's recipe: how to build it from a `VarBuilder`, as one module or
/// as [`Units`] (each unit its own factory). Every strategy builds it as
/// it needs: once, once per replica, once per rank, or a stage per device.
///
/// A plain module serves `single`, `dp`, `ddp`, `zero1` and `zero2`; the
/// strategies that gather, reduce or place the model unit by unit
/// (`ddp-overlap`, `fsdp`, `pipeline`, `pipeline-ddp`) need units, and
/// refuse a plain module naming themselves.
///
/// ```
/// use candle_dp::fabric::ModelRecipe;
/// use candle_dp::pipeline::unit;
/// use candle_nn::{linear, Activation};
///
/// let plain = ModelRecipe::module(|vb| linear(4, 2, vb.pp("fc")));
/// let units = ModelRecipe::units(vec![
///     unit(|vb| linear(4, 8, vb.pp("l1"))),
///     unit(|_| Ok(Activation::Relu)),
///     unit(|vb| linear(8, 2, vb.pp("l2"))),
/// ]);
/// assert!(!plain.is_units() && units.is_units());
/// ```
#[derive(Clone)]
pub struct ModelRecipe {
    parts: Vec<UnitFactory>,
    units: bool,
    plan: Option<TpPlan>,
}

impl ModelRecipe {
    /// A plain module from its factory.
    pub fn module<L, F>(factory: F) -> Self
    where
        L: ModuleT + 'static,
        F: Fn(VarBuilder) -> candle_core::Result<L> + Send + Sync + 'static,
    {
        Self {
            parts: vec![unit(factory)],
            units: false,
            plan: None,
        }
    }

    /// A model as units, in order (see [`crate::units`]); it serves every
    /// strategy.
    pub fn units(parts: Vec<UnitFactory>) -> Self {
        Self {
            parts,
            units: true,
            plan: None,
        }
    }

    /// This model with its tensor-parallel plan: its factories build each
    /// rank's pieces (with the [`TensorParallel`](crate::tensor_parallel::TensorParallel)
    /// of [`Fabric::tensor_parallel`](super::Fabric::tensor_parallel)),
    /// and `plan` says how each parameter lies, so that the pieces are
    /// cut from one device's initial weights and joined back for the
    /// whole model. A mesh with `tp` above 1 needs it.
    pub fn with_tp_plan(mut self, plan: TpPlan) -> Self {
        self.plan = Some(plan);
        self
    }

    /// Its tensor-parallel plan, if it has one.
    pub fn tp_plan(&self) -> Option<&TpPlan> {
        self.plan.as_ref()
    }

    /// Whether it was given as units.
    pub fn is_units(&self) -> bool {
        self.units
    }

    /// The factories (one for a plain module).
    pub fn parts(&self) -> &[UnitFactory] {
        &self.parts
    }

    /// The whole model as [`Units`] from `vb`: what a strategy of one's
    /// own ([`Fabric::setup_engine`](super::Fabric::setup_engine)) builds
    /// once, per replica or per rank.
    ///
    /// # Errors
    ///
    /// A unit's factory's.
    pub fn build(&self, vb: VarBuilder) -> Result<Units> {
        Units::build(vb, &self.parts)
    }

    /// Whether `strategy` can build it: an error naming both when not.
    pub(crate) fn check_serves(&self, strategy: Strategy, overlaps: bool) -> Result<()> {
        if (strategy.needs_units() || overlaps) && !self.units {
            return Err(Error::Strategy {
                strategy: strategy.name().into(),
                reason: format!(
                    "it works on the model unit by unit, and a plain module (ModelRecipe::module) \
                     has no units: give the model as ModelRecipe::units, or use {}",
                    strategy.for_a_plain_module()
                ),
            });
        }
        if self.parts.is_empty() {
            return Err(Error::Strategy {
                strategy: strategy.name().into(),
                reason: "the model has no units".into(),
            });
        }
        Ok(())
    }

    /// A factory of the whole model as [`Units`], for the engines that
    /// build one module (once, per replica or per rank).
    pub(crate) fn whole(
        &self,
    ) -> impl Fn(VarBuilder) -> candle_core::Result<Units> + Clone + Send + Sync + 'static {
        let parts = self.parts.clone();
        move |vb| Units::build(vb, &parts).map_err(candle_core::Error::wrap)
    }
}

impl fmt::Debug for ModelRecipe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ModelRecipe")
            .field("parts", &self.parts.len())
            .field("units", &self.units)
            .field("tp_plan", &self.plan)
            .finish()
    }
}
