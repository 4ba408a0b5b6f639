//! `pipeline`: a [`Pipeline`] over this process's devices, one stage each,
//! and the pipeline's builder as the other pipeline strategies share it.

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;

use super::{from_step, scaled, Engine, EngineSetup, EngineStep, LossFn};
use crate::error::Result;
use crate::optim::StatefulOptimizer;
use crate::pipeline::Pipeline;
use crate::step::LossReduction;
use crate::vars::sorted_vars;

/// `pipeline`'s engine.
pub(super) struct OneProcessPipeline<O> {
    pipe: Pipeline,
    varmap: VarMap,
    vars: Vec<Var>,
    optimizer: O,
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

/// The sorted variables of `varmap`, and the optimizer `make` over them.
pub(super) fn whole_optimizer<O, F>(varmap: &VarMap, make: F) -> Result<(Vec<Var>, O)>
where
    F: FnOnce(Vec<(String, Var)>) -> candle_core::Result<O>,
{
    let named = sorted_vars(varmap);
    let vars = named.iter().map(|(_, v)| v.clone()).collect();
    Ok((vars, make(named)?))
}

impl<O: StatefulOptimizer> OneProcessPipeline<O> {
    pub(super) fn build<F>(setup: &EngineSetup<'_>, make: F) -> Result<Self>
    where
        F: FnOnce(Vec<(String, Var)>) -> candle_core::Result<O>,
    {
        let pipe = pipeline_over(setup, setup.devices)?;
        let varmap = setup.varmap.clone();
        let (vars, optimizer) = whole_optimizer(&varmap, make)?;
        Ok(Self {
            pipe,
            varmap,
            vars,
            optimizer,
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

    fn varmap(&self) -> &VarMap {
        &self.varmap
    }

    fn grad_vars(&self) -> &[Var] {
        &self.vars
    }

    fn optimizer(&self) -> &O {
        &self.optimizer
    }

    fn optimizer_mut(&mut self) -> &mut O {
        &mut self.optimizer
    }
}
