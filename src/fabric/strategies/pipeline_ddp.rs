//! `pipeline-ddp`: a pipeline on every rank over its devices, the ranks'
//! gradients all-reduced (DDP around it).

use candle_core::{Tensor, Var};

use super::one_process_pipeline::pipeline_over;
use super::{
    bytes_of, from_step, scaled, Engine, EngineSetup, EngineStep, LossFn, Memory, Trainables,
};
use crate::ddp::{DdpConfig, DistributedDataParallel};
use crate::error::Result;
use crate::optim::StatefulOptimizer;
use crate::pipeline::Pipeline;
use crate::step::LossReduction;

/// `pipeline-ddp`'s engine.
pub(super) struct PipelineDdp<O> {
    ddp: Box<DistributedDataParallel<Pipeline>>,
    trainables: Trainables<O>,
}

impl<O: StatefulOptimizer> PipelineDdp<O> {
    pub(super) fn build<F>(setup: &EngineSetup<'_>, make: F) -> Result<Self>
    where
        F: FnOnce(Vec<(String, Var)>) -> candle_core::Result<O>,
    {
        let pipe = pipeline_over(setup, setup.devices)?;
        let ddp = DistributedDataParallel::from_module(
            setup.pg.clone(),
            setup.varmap,
            pipe,
            DdpConfig::default(),
        )?;
        Ok(Self {
            ddp: Box::new(ddp),
            trainables: Trainables::over_all(setup.varmap.clone(), make)?,
        })
    }
}

impl<O: StatefulOptimizer + 'static> Engine<O> for PipelineDdp<O> {
    fn name(&self) -> &str {
        "pipeline-ddp"
    }

    fn forward_backward(
        &mut self,
        x: &Tensor,
        y: &Tensor,
        factor: f64,
        sync: bool,
        loss_fn: &LossFn,
    ) -> Result<EngineStep> {
        let scaled = scaled(loss_fn, factor);
        let run = |ddp: &mut DistributedDataParallel<Pipeline>| {
            ddp.forward_backward(x, y, LossReduction::Mean, scaled)
        };
        let step = match sync {
            true => run(&mut self.ddp),
            false => self.ddp.no_sync(run),
        }?;
        from_step(step, factor, sync)
    }

    fn forward(&mut self, x: &Tensor) -> Result<Tensor> {
        self.ddp.forward_t(x, false)
    }

    fn trainables(&self) -> &Trainables<O> {
        &self.trainables
    }

    fn trainables_mut(&mut self) -> &mut Trainables<O> {
        &mut self.trainables
    }

    fn accumulates_itself(&self) -> bool {
        true
    }

    fn memory(&self) -> Result<Memory> {
        Ok(Memory {
            parameters: bytes_of(self.ddp.params()),
            ..self.trainables.memory()?
        })
    }
}
