//! `single`: plain candle on one device, the step's buffers (BatchNorm
//! statistics) put back if it fails.

use candle_core::{DType, ModuleT, Tensor, Var};
use candle_nn::VarBuilder;

use super::{backward_of, Engine, EngineSetup, EngineStep, LossFn, Trainables};
use crate::buffers::{is_batch_norm_buffer, BufferSnapshot};
use crate::comm::ProcessGroup;
use crate::error::Result;
use crate::optim::Clipped;
use crate::optim::StatefulOptimizer;
use crate::precision::MixedPrecisionModel;
use crate::units::Units;
use crate::util::vars::sorted_vars;
use candle_core::backprop::GradStore;

/// The model itself, or (mixed precision) computing on low-precision
/// copies of it.
enum Plain {
    Units(Units),
    Mixed(MixedPrecisionModel<Units>),
}

impl Plain {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        Ok(match self {
            Plain::Units(units) => units.forward_t(x, train)?,
            Plain::Mixed(model) => model.forward_t(x, train)?,
        })
    }
}

/// `single`'s engine.
pub(super) struct Single<O> {
    model: Plain,
    buffers: Vec<(String, Var)>,
    trainables: Trainables<O>,
}

impl<O: StatefulOptimizer> Single<O> {
    pub(super) fn build<F>(setup: &EngineSetup<'_>, make: F) -> Result<Self>
    where
        F: FnOnce(Vec<(String, Var)>) -> candle_core::Result<O>,
    {
        let varmap = setup.varmap.clone();
        let model = match setup.config.precision.policy() {
            None => Plain::Units(setup.module.whole()(VarBuilder::from_varmap(
                &varmap,
                DType::F32,
                setup.device(),
            ))?),
            Some(policy) => Plain::Mixed(MixedPrecisionModel::new(
                &varmap,
                DType::F32,
                setup.device(),
                policy,
                setup.module.whole(),
            )?),
        };
        let buffers = sorted_vars(&varmap)
            .into_iter()
            .filter(|(name, _)| is_batch_norm_buffer(name))
            .collect();
        Ok(Self {
            model,
            buffers,
            trainables: Trainables::over_all(varmap, make)?,
        })
    }
}

impl<O: StatefulOptimizer + 'static> Engine<O> for Single<O> {
    fn name(&self) -> &str {
        "single"
    }

    fn forward_backward(
        &mut self,
        x: &Tensor,
        y: &Tensor,
        factor: f64,
        _sync: bool,
        loss_fn: &LossFn,
    ) -> Result<EngineStep> {
        let before = BufferSnapshot::take(&self.buffers)?;
        let run = || backward_of(&self.model.forward_t(x, true)?, y, factor, loss_fn);
        run().inspect_err(|e| before.restore_after(e))
    }

    fn local_forward_backward(
        &mut self,
        x: &Tensor,
        y: &Tensor,
        factor: f64,
        loss_fn: &LossFn,
    ) -> Result<EngineStep> {
        self.forward_backward(x, y, factor, true, loss_fn)
    }

    fn forward(&mut self, x: &Tensor) -> Result<Tensor> {
        self.model.forward_t(x, false)
    }

    fn clip_tensor_parallel(
        &self,
        grads: &mut GradStore,
        max_norm: f64,
        tp: &dyn ProcessGroup,
        counted: &dyn Fn(&str) -> bool,
    ) -> Result<Clipped> {
        super::clip_across(&self.trainables, grads, max_norm, tp, counted)
    }

    fn trainables(&self) -> &Trainables<O> {
        &self.trainables
    }

    fn trainables_mut(&mut self) -> &mut Trainables<O> {
        &mut self.trainables
    }
}
