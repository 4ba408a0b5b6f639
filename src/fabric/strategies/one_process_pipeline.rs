//! `pipeline`: a [`Pipeline`] over this process's devices, one stage each,
//! and the pipeline's builder as the other pipeline strategies share it.

use candle_core::{DType, Device, Tensor, Var};

use super::{from_step, scaled, Engine, EngineSetup, EngineStep, LossFn, Trainables};
use crate::error::Result;
use crate::optim::StatefulOptimizer;
use crate::pipeline::Pipeline;
use crate::step::LossReduction;

/// `pipeline`'s engine.
pub(super) struct OneProcessPipeline<O> {
    pipe: Pipeline,
    trainables: Trainables<O>,
}

/// A pipeline of `setup`'s model over `devices`, as configured.
pub(super) fn pipeline_over(setup: &EngineSetup<'_>, devices: &[Device]) -> Result<Pipeline> {
    let config = setup.config;
    let mut builder = Pipeline::builder(setup.varmap, DType::F32, devices)
        .schedule(config.pipeline_schedule)
        .checkpoint(config.activation_checkpoint);
    if let Some(chunks) = config.chunks {
        builder = builder.chunks(chunks);
    }
    if let Some(policy) = config.precision.policy() {
        builder = builder.mixed_precision(policy);
    }
    if let Some(Some(timeout)) = config.timeout() {
        builder = builder.timeout(timeout);
    }
    builder.build(setup.module.parts().to_vec())
}

impl<O: StatefulOptimizer> OneProcessPipeline<O> {
    pub(super) fn build<F>(setup: &EngineSetup<'_>, make: F) -> Result<Self>
    where
        F: FnOnce(Vec<(String, Var)>) -> candle_core::Result<O>,
    {
        Ok(Self {
            pipe: pipeline_over(setup, setup.devices)?,
            trainables: Trainables::over_all(setup.varmap.clone(), make)?,
        })
    }
}

impl<O: StatefulOptimizer + 'static> Engine<O> for OneProcessPipeline<O> {
    fn name(&self) -> &str {
        "pipeline"
    }

    fn forward_backward(
        &mut self,
        x: &Tensor,
        y: &Tensor,
        factor: f64,
        _sync: bool,
        loss_fn: &LossFn,
    ) -> Result<EngineStep> {
        let step =
            self.pipe
                .forward_backward(x, y, LossReduction::Mean, scaled(loss_fn, factor))?;
        from_step(step, factor, true)
    }

    fn forward(&mut self, x: &Tensor) -> Result<Tensor> {
        self.pipe.forward_t(x, false)
    }

    fn trainables(&self) -> &Trainables<O> {
        &self.trainables
    }

    fn trainables_mut(&mut self) -> &mut Trainables<O> {
        &mut self.trainables
    }
}
