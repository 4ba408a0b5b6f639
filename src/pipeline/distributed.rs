//! Two-dimensional parallelism: a pipeline inside each
//! [`DistributedDataParallel`] rank.
//!
//! Every rank holds the whole model, split into stages over its own
//! devices; each rank trains on its share of the global batch through its
//! pipeline, and the gradients of the step are averaged across ranks once,
//! after the pipeline's backward, on thread ranks and MPI processes alike.
//! With equal shares and a mean loss the result equals one device training
//! on the global batch.

use crate::ddp::DistributedDataParallel;
use crate::error::Result;
use crate::pipeline::Pipeline;
use crate::step::{LossReduction, Step};
use candle_core::{ModuleT, Tensor};

impl DistributedDataParallel<Pipeline> {
    /// The pipeline's fast path ([`Pipeline::forward_backward`]) on this
    /// rank's batch, then one all-reduce of its gradients, then the
    /// stages' buffers (BatchNorm statistics) committed: if the all-reduce
    /// fails, the buffers are as before the step. The returned
    /// `Step` holds this rank's loss and the gradients averaged over the
    /// ranks (plus what [`no_sync`](Self::no_sync) accumulated; inside
    /// `no_sync`, an empty store), for any candle optimizer. At ZeRO stage
    /// 2 ([`DdpConfig::zero`](crate::DdpConfig::zero)) the store holds only
    /// this rank's own parameters' gradients, as
    /// [`backward`](Self::backward)'s does there: step a
    /// [`ZeroOptimizer`](crate::zero::ZeroOptimizer) with it.
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use candle_dp::launch::spawn;
    /// use candle_dp::pipeline::{unit, Pipeline};
    /// use candle_dp::{cpu_devices, DdpConfig, DistributedDataParallel, LossReduction};
    /// use candle_nn::{linear, loss, Optimizer, VarMap, SGD};
    ///
    /// // 2 ranks, each a pipeline of 2 stages.
    /// spawn(2, |ctx| {
    ///     let varmap = VarMap::new();
    ///     let layers = vec![
    ///         unit(|vb| linear(4, 8, vb.pp("a"))),
    ///         unit(|vb| linear(8, 2, vb.pp("b"))),
    ///     ];
    ///     let pipe = Pipeline::builder(&varmap, DType::F32, &cpu_devices(2)).build(layers)?;
    ///     let mut ddp = DistributedDataParallel::from_module(
    ///         ctx.process_group(),
    ///         &varmap,
    ///         pipe,
    ///         DdpConfig::default(),
    ///     )?;
    ///     let mut sgd = SGD::new(varmap.all_vars(), 0.1)?;
    ///     let x = Tensor::randn(0f32, 1., (6, 4), &Device::Cpu)?;
    ///     let y = Tensor::new(&[0u32, 1, 0, 1, 0, 1], &Device::Cpu)?;
    ///     let step = ddp.forward_backward(&x, &y, LossReduction::Mean, |out, y| {
    ///         loss::cross_entropy(out, y)
    ///     })?;
    ///     sgd.step(&step.grads)?;
    ///     Ok(())
    /// })?;
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn forward_backward<F>(
        &mut self,
        x: &Tensor,
        y: &Tensor,
        reduction: LossReduction,
        loss_fn: F,
    ) -> Result<Step>
    where
        F: Fn(&Tensor, &Tensor) -> candle_core::Result<Tensor> + Send + Sync + 'static,
    {
        self.pre_forward()?;
        let start = std::time::Instant::now();
        let (step, ran) = self
            .module()
            .forward_backward_uncommitted(x, y, reduction, loss_fn)?;
        // `&mut self` keeps every other step out until the commit below.
        let ran = ran.into_exclusive();
        self.record_backward(start.elapsed());
        let grads = self.synchronise(&step.grads)?;
        // The BatchNorm statistics move only once the all-reduce has
        // succeeded too: a failed step changes nothing. (The commit itself
        // only writes values already converted to each buffer's device
        // and dtype.)
        self.module().commit(&ran)?;
        let without_grad = if self.is_syncing() {
            self.vars_without_grad().to_vec()
        } else {
            Vec::new()
        };
        Ok(Step {
            loss: step.loss,
            grads,
            without_grad,
        })
    }
}

/// The drop-in path: [`Pipeline::forward_t`], so that
/// `DistributedDataParallel::forward_t` and `backward` work on a pipeline
/// (the backward walks the whole graph on the calling thread).
impl ModuleT for Pipeline {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        Pipeline::forward_t(self, x, train).map_err(candle_core::Error::wrap)
    }
}
