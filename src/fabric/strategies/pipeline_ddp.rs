//! `pipeline-ddp`: a pipeline on every rank over its devices, the ranks'
//! gradients all-reduced (DDP around it).

use candle_core::{Tensor, Var};
use candle_nn::VarMap;

use super::one_process_pipeline::{pipeline_over, whole_optimizer};
use super::whole_state::optimizer_bytes;
use super::{bytes_of, from_step, scaled, Engine, EngineSetup, EngineStep, LossFn, Memory};
use crate::ddp::{DdpConfig, DistributedDataParallel};
use crate::error::Result;
use crate::optim::StatefulOptimizer;
use crate::pipeline::Pipeline;
use crate::step::LossReduction;

/// `pipeline-ddp`'s engine.
pub(super) struct PipelineDdp<O> {
    ddp: Box<DistributedDataParallel<Pipeline>>,
    varmap: VarMap,
    vars: Vec<Var>,
    optimizer: O,
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
        let varmap = setup.varmap.clone();
        let (vars, optimizer) = whole_optimizer(&varmap, make)?;
        Ok(Self {
            ddp: Box::new(ddp),
            varmap,
            vars,
            optimizer,
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

    fn accumulates_itself(&self) -> bool {
        true
    }

    fn memory(&self) -> Result<Memory> {
        Ok(Memory {
            parameters: bytes_of(self.ddp.params()),
            optimizer_state: optimizer_bytes(&self.optimizer)?,
            ..Memory::default()
        })
    }
}
