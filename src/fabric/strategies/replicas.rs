//! `dp`: a master model and a replica per device in one process
//! ([`DataParallel`]), the loss per replica, or (`dp_backward` gathered)
//! of the gathered output.

use candle_core::{DType, ModuleT, Tensor, Var};

use super::{backward_of, from_step, scaled, Engine, EngineSetup, EngineStep, LossFn, Trainables};
use crate::data_parallel::DataParallel;
use crate::error::Result;
use crate::fabric::config::DpBackward;
use crate::optim::StatefulOptimizer;
use crate::precision::{cast_input, output_for_loss};
use crate::step::LossReduction;
use crate::units::Units;
use crate::util::vars::store_of;

/// `dp`'s engine.
pub(super) struct Replicas<O> {
    dp: DataParallel<Units>,
    gathered: bool,
    trainables: Trainables<O>,
}

impl<O: StatefulOptimizer> Replicas<O> {
    pub(super) fn build<F>(setup: &EngineSetup<'_>, make: F) -> Result<Self>
    where
        F: FnOnce(Vec<(String, Var)>) -> candle_core::Result<O>,
    {
        let config = setup.config;
        let mut builder = DataParallel::builder(setup.varmap, DType::F32, setup.devices);
        if let Some(policy) = config.precision.policy() {
            builder = builder.mixed_precision(policy);
        }
        if let Some(Some(timeout)) = config.timeout() {
            builder = builder.timeout(timeout);
        }
        let dp = builder.build(setup.module.whole())?;
        // The optimizer steps the masters.
        let trainables = Trainables::build(setup.varmap.clone(), dp.vars().to_vec(), make)?;
        Ok(Self {
            dp,
            gathered: config.dp_backward == DpBackward::Gathered,
            trainables,
        })
    }
}

impl<O: StatefulOptimizer + 'static> Engine<O> for Replicas<O> {
    fn name(&self) -> &str {
        "dp"
    }

    fn forward_backward(
        &mut self,
        x: &Tensor,
        y: &Tensor,
        factor: f64,
        _sync: bool,
        loss_fn: &LossFn,
    ) -> Result<EngineStep> {
        if self.gathered {
            return backward_of(&self.dp.forward_t(x, true)?, y, factor, loss_fn);
        }
        let dtype = self.dp.compute_dtype();
        let scaled = scaled(loss_fn, factor);
        let step = self.dp.forward_backward(
            (x.clone(), y.clone()),
            LossReduction::Mean,
            move |m: &Units, (x, y): (Tensor, Tensor)| {
                let x = match dtype {
                    Some(dtype) => cast_input(&x, dtype)?,
                    None => x,
                };
                scaled(&m.forward_t(&x, true)?, &y)
            },
        )?;
        from_step(step, factor, true)
    }

    fn local_forward_backward(
        &mut self,
        x: &Tensor,
        y: &Tensor,
        factor: f64,
        loss_fn: &LossFn,
    ) -> Result<EngineStep> {
        // The chunk whole on the first replica: one device's computation
        // (the chunks run one after another, the other replicas idle).
        let dtype = self.dp.compute_dtype();
        let loss_fn = loss_fn.clone();
        let (loss, grads) = self.dp.forward_backward_whole(
            (x.clone(), y.clone()),
            move |m: &Units, (x, y): (Tensor, Tensor)| {
                let x = match dtype {
                    Some(dtype) => cast_input(&x, dtype)?,
                    None => x,
                };
                let loss = loss_fn(&output_for_loss(&m.forward_t(&x, true)?)?, &y)?;
                Ok((loss.affine(factor, 0.0)?, loss))
            },
        )?;
        Ok(EngineStep {
            loss,
            grads: Some(store_of(self.dp.vars(), grads)),
        })
    }

    fn forward(&mut self, x: &Tensor) -> Result<Tensor> {
        self.dp.forward_t(x, false)
    }

    fn trainables(&self) -> &Trainables<O> {
        &self.trainables
    }

    fn trainables_mut(&mut self) -> &mut Trainables<O> {
        &mut self.trainables
    }
}
