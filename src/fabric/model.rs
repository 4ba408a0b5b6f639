//! [`FabricModel`]: the model and its optimizer as a strategy set them up,
//! with the step every loop writes the same way: `backward`, optionally
//! `clip_gradients`, `step`.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use candle_nn::VarMap;

use super::config::{Precision, Strategy};
use super::memory::Memory;
use super::step_order::StepOrder;
use super::strategies::{Engine, EngineStep, LossFn};
use crate::comm::ProcessGroup;
use crate::deterministic::ChunkedStep;
use crate::error::{Error, Result};
use crate::ops::dropout::{with_sample_keys, SampleKeys};
use crate::optim::{clip_grad_norm, Clipped, LrScheduler, StatefulOptimizer};
use crate::util::vars::with_accumulated;

/// What [`FabricModel::step`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepOutcome {
    /// The optimizer stepped.
    Stepped,
    /// The f16 loss scaler found an inf or NaN: no parameter changed, the
    /// scale was lowered.
    Skipped,
    /// An accumulation step: the gradients were kept for the step that
    /// completes the accumulation (Accelerate's `sync_gradients == False`).
    Accumulating,
}

/// A model and its optimizer, set up by [`Fabric::setup`](super::Fabric::setup)
/// for the configured strategy. Every strategy is trained the same way:
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_dp::fabric::{Fabric, FabricConfig, ModelRecipe, Strategy};
/// use candle_dp::optim::{Sgd, SgdConfig};
/// use candle_nn::{linear, loss};
///
/// let config = FabricConfig::new(Strategy::Ddp, 2);
/// Fabric::launch(config, |fabric| {
///     let module = ModelRecipe::module(|vb| linear(4, 2, vb.pp("fc")));
///     let mut model = fabric.setup(module, |params| Sgd::new_named(params, SgdConfig { lr: 0.1, ..Default::default() }))?;
///     let x = Tensor::ones((3, 4), candle_core::DType::F32, &Device::Cpu)?;
///     let y = Tensor::new(&[0u32, 1, 0], &Device::Cpu)?;
///     let loss = model.backward(&x, &y, |out, y| loss::cross_entropy(out, y))?;
///     model.step()?;
///     fabric.print(format!("loss {}", loss.to_scalar::<f32>()?));
///     Ok(())
/// })?;
/// # Ok::<(), candle_dp::Error>(())
/// ```
pub struct FabricModel<O: StatefulOptimizer> {
    pub(crate) strategy: Strategy,
    /// The strategy's model and optimizer.
    pub(crate) engine: Box<dyn Engine<O>>,
    pub(crate) order: StepOrder,
    pub(crate) pg: Arc<dyn ProcessGroup>,
    /// The variables the gradients are keyed by (masters, pieces): the
    /// engine's, kept here for the scaler and the accumulation.
    pub(crate) params: Vec<Var>,
    pub(crate) accumulation_steps: u64,
    pub(crate) gradient_clip: Option<f64>,
    /// Backward passes since the last optimizer step.
    pub(crate) micro: u64,
    /// Inside [`no_backward_sync`](Self::no_backward_sync).
    pub(crate) holding_sync: bool,
    /// Summed gradients of the accumulation so far, for the engines that
    /// do not keep them themselves.
    pub(crate) pending: Option<GradStore>,
    /// The step's gradients once the accumulation is complete.
    pub(crate) grads: Option<GradStore>,
    pub(crate) unscaled: bool,
    pub(crate) clipped: bool,
    /// Optimizer steps taken or skipped.
    pub(crate) steps: u64,
    /// The bytes of the last step's gradients.
    pub(crate) grad_bytes: usize,
    /// Where [`save`](Self::save) writes, and how many states it keeps.
    pub(crate) checkpoint_dir: Option<std::path::PathBuf>,
    pub(crate) keep: usize,
    /// The run's seed, saved with its states.
    pub(crate) seed: u64,
    /// The run's precision, saved with its states.
    pub(crate) precision: Precision,
    /// Under deterministic training, how a step's chunks are summed.
    pub(crate) deterministic: Option<ChunkedStep>,
    /// Which share of the data this rank trains on (the keys of its
    /// dropout masks).
    pub(crate) data_rank: usize,
}

impl<O: StatefulOptimizer> FabricModel<O> {
    /// Runs the forward and the backward of `loss_fn(output, y)` on this
    /// rank's batch `(x, y)`, the loss scaled for f16 and divided over the
    /// accumulation steps, and returns the loss (this rank's, unscaled).
    /// The output is handed to `loss_fn` in f32 whatever the precision.
    ///
    /// candle computes a backward in one call, with no hooks, so the
    /// strategies that work unit by unit (FSDP's gathering, DDP's overlap,
    /// the pipeline's schedule) need the loss as a function rather than
    /// Fabric's `backward(loss)` of a loss already computed.
    ///
    /// # Errors
    ///
    /// The engine's (a collective's, naming the rank); a second backward
    /// after the accumulation is complete, before [`step`](Self::step).
    pub fn backward<F>(&mut self, x: &Tensor, y: &Tensor, loss_fn: F) -> Result<Tensor>
    where
        F: Fn(&Tensor, &Tensor) -> candle_core::Result<Tensor> + Send + Sync + 'static,
    {
        if self.grads.is_some() {
            return Err(Error::Fabric(format!(
                "backward after the {} batch(es) of a step ({} accumulation step(s)) without \
                 step(): call step() first",
                self.micro, self.accumulation_steps
            )));
        }
        let sync = !self.holding_sync && self.micro + 1 >= self.accumulation_steps;
        let factor = self.order.loss_factor() / self.accumulation_steps as f64;
        let loss_fn: LossFn = Arc::new(loss_fn);
        let ran = match self.deterministic.clone() {
            Some(chunked) => self.chunked_backward(&chunked, x, y, factor, &loss_fn)?,
            None => {
                // Keyed dropout: this share's samples follow the shares
                // before it.
                let keys = self.sample_keys((self.data_rank * x.dim(0)?) as u64);
                let engine = &mut self.engine;
                with_sample_keys(keys, || {
                    engine.forward_backward(x, y, factor, sync, &loss_fn)
                })?
            }
        };
        if self.engine.accumulates_itself() && self.deterministic.is_none() {
            self.grads = ran.grads;
        } else if let Some(grads) = ran.grads {
            // Summed before anything is replaced: a failed sum keeps the
            // batches accumulated so far.
            let summed = match &self.pending {
                Some(before) => add_grads(before, grads, &self.params)?,
                None => grads,
            };
            match sync {
                true => {
                    self.pending = None;
                    self.grads = Some(summed);
                }
                false => self.pending = Some(summed),
            }
        }
        self.micro += 1;
        Ok(ran.loss)
    }

    /// [`backward`](Self::backward) under deterministic training: this
    /// rank's share cut into its chunks, each chunk's gradients computed
    /// alone, and every rank's chunks summed exactly
    /// ([`crate::deterministic`]). The loss is the global batch's.
    fn chunked_backward(
        &mut self,
        chunked: &ChunkedStep,
        x: &Tensor,
        y: &Tensor,
        factor: f64,
        loss_fn: &LossFn,
    ) -> Result<EngineStep> {
        // A rank that fails here says so through the sum's first
        // collective: the others then fail too instead of waiting.
        let ran = self.run_chunks(chunked, x, y, factor, loss_fn);
        let dims = self.engine.local_grad_dims();
        let (grads, losses) = match &ran {
            Ok((grads, losses)) => (grads.as_slice(), losses.as_slice()),
            Err(_) => (&[][..], &[][..]),
        };
        let reduced = chunked.reduce(&self.params, &dims, grads, losses, ran.is_err());
        let (grads, loss) = match ran {
            Err(e) => return Err(e),
            Ok(_) => reduced?,
        };
        Ok(EngineStep {
            loss,
            grads: Some(grads),
        })
    }

    /// This rank's chunks of its share `(x, y)`, each one's forward and
    /// backward alone: their gradients and losses.
    fn run_chunks(
        &mut self,
        chunked: &ChunkedStep,
        x: &Tensor,
        y: &Tensor,
        factor: f64,
        loss_fn: &LossFn,
    ) -> Result<(Vec<GradStore>, Vec<Tensor>)> {
        let (mine, rows) = chunked.cut(x.dim(0)?)?;
        if y.dim(0)? != x.dim(0)? {
            return Err(Error::Fabric(format!(
                "deterministic training cuts the batch by rows: x has {} and y {}",
                x.dim(0)?,
                y.dim(0)?
            )));
        }
        // Each chunk's loss is its rows' mean: the global batch's mean is
        // theirs over the chunks.
        let factor = factor / chunked.chunks() as f64;
        let mut grads = Vec::with_capacity(mine);
        let mut losses = Vec::with_capacity(mine);
        for j in 0..mine {
            let (xj, yj) = (x.narrow(0, j * rows, rows)?, y.narrow(0, j * rows, rows)?);
            // Keyed dropout: the chunk's samples by their place in the
            // global batch, wherever it runs.
            let keys = self.sample_keys(((chunked.first_chunk() + j) * rows) as u64);
            let engine = &mut self.engine;
            let ran = with_sample_keys(keys, || {
                engine.local_forward_backward(&xj, &yj, factor, loss_fn)
            })?;
            if ran.loss.elem_count() != 1 {
                return Err(Error::Fabric(format!(
                    "deterministic training sums the chunks' losses: the loss must be a scalar \
                     (a mean over the rows), got shape {:?}",
                    ran.loss.dims()
                )));
            }
            grads.push(ran.grads.unwrap_or_default());
            losses.push(ran.loss);
        }
        Ok((grads, losses))
    }

    /// The keys of this forward's dropout masks
    /// ([`keyed_dropout`](crate::ops::dropout::keyed_dropout)): the seed,
    /// the step and its micro-batch, the batch's `first` sample.
    fn sample_keys(&self, first: u64) -> SampleKeys {
        // The micro-batch in the low bits: `no_backward_sync` may hold
        // more of them than the accumulation steps.
        SampleKeys {
            seed: self.seed,
            step: (self.steps << 24) + self.micro,
            first,
        }
    }

    /// Whether the next [`backward`](Self::backward) only accumulates
    /// (Accelerate's `not accelerator.sync_gradients`).
    pub fn is_accumulating(&self) -> bool {
        self.holding_sync || self.micro + 1 < self.accumulation_steps
    }

    /// Runs `f` with gradient synchronisation held back (Fabric's
    /// `no_backward_sync`): the backwards inside only accumulate (DDP's and
    /// FSDP's `no_sync`), and the first backward after it completes the
    /// step, whatever `accumulation_steps` says. Divide each loss by the
    /// number of batches yourself, as with Fabric.
    ///
    /// ```
    /// # use candle_core::{DType, Device, Tensor};
    /// # use candle_dp::fabric::{Fabric, FabricConfig, ModelRecipe, StepOutcome, Strategy};
    /// # use candle_dp::optim::{Sgd, SgdConfig};
    /// # use candle_nn::{linear, loss};
    /// Fabric::launch(FabricConfig::new(Strategy::Ddp, 2), |fabric| {
    ///     let module = ModelRecipe::module(|vb| linear(4, 2, vb.pp("fc")));
    ///     let mut model = fabric.setup(module, |p| Sgd::new_named(p, SgdConfig::default()))?;
    ///     let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
    ///     let y = Tensor::new(&[0u32, 1, 0], &Device::Cpu)?;
    ///     let half = |out: &Tensor, y: &Tensor| loss::cross_entropy(out, y)? / 2.0;
    ///     model.no_backward_sync(|model| model.backward(&x, &y, half))?;
    ///     assert_eq!(model.step()?, StepOutcome::Accumulating);
    ///     model.backward(&x, &y, half)?; // synchronises the sum
    ///     assert_eq!(model.step()?, StepOutcome::Stepped);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), candle_dp::Error>(())
    /// ```
    pub fn no_backward_sync<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        let before = std::mem::replace(&mut self.holding_sync, true);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(self)));
        self.holding_sync = before;
        result.unwrap_or_else(|payload| std::panic::resume_unwind(payload))
    }

    /// Unscales (f16) and clips the gradients of the step to a total
    /// 2-norm of `max_norm`, over every rank's pieces where the strategy
    /// shards them (Fabric's `clip_gradients`); `None` on an accumulation
    /// step, whose gradients are not complete yet.
    ///
    /// # Errors
    ///
    /// No [`backward`](Self::backward) since the last step; clipping's.
    pub fn clip_gradients(&mut self, max_norm: f64) -> Result<Option<Clipped>> {
        if self.grads.is_none() && self.micro > 0 {
            return Ok(None);
        }
        self.unscale()?;
        let Some(grads) = self.grads.as_mut() else {
            return Err(Error::Fabric(
                "clip_gradients before backward: there are no gradients to clip".into(),
            ));
        };
        let clipped = match self.deterministic {
            // The gradients are whole and the same on every rank: their
            // norm is one device's, whatever the strategy shards.
            Some(_) => clip_grad_norm(grads, &self.params, max_norm, 2.0, false)?,
            None => self.engine.clip(grads, max_norm)?,
        };
        self.clipped = true;
        Ok(Some(clipped))
    }

    /// Completes the step: unscales (f16), clips to the configured
    /// `gradient_clip` (unless [`clip_gradients`](Self::clip_gradients)
    /// did), steps the optimizer at the schedule's rate (unless the
    /// scaler found an inf or NaN), updates the scale, steps the schedule.
    /// On an accumulation step it does nothing.
    ///
    /// # Errors
    ///
    /// No [`backward`](Self::backward) since the last step; the
    /// optimizer's. A failed step leaves the parameters untouched.
    pub fn step(&mut self) -> Result<StepOutcome> {
        if self.grads.is_none() && self.micro > 0 {
            return Ok(StepOutcome::Accumulating);
        }
        if self.grads.is_none() {
            return Err(Error::Fabric(
                "step before backward: there are no gradients to step with".into(),
            ));
        }
        if let (Some(max_norm), false) = (self.gradient_clip, self.clipped) {
            self.clip_gradients(max_norm)?;
        }
        self.unscale()?;
        let Some(mut grads) = self.grads.take() else {
            return Err(Error::Fabric("the step's gradients are gone".into()));
        };
        self.grad_bytes = self
            .params
            .iter()
            .filter_map(|p| grads.get(p))
            .map(|g| g.elem_count() * g.dtype().size_in_bytes())
            .sum();
        self.order
            .apply_rate(self.engine.trainables_mut().optimizer_mut())?;
        let engine = &mut self.engine;
        let stepped = self
            .order
            .step(&mut grads, &self.params, |g| engine.step(g));
        // Whatever happened, the next step starts afresh (a failed one
        // changed no parameter, and its gradients are spent).
        self.micro = 0;
        self.unscaled = false;
        self.clipped = false;
        let stepped = stepped?;
        self.steps += 1;
        Ok(match stepped {
            true => StepOutcome::Stepped,
            false => StepOutcome::Skipped,
        })
    }

    /// Unscales the step's gradients once (f16; a no-op otherwise).
    fn unscale(&mut self) -> Result<()> {
        if self.unscaled {
            return Ok(());
        }
        if let Some(grads) = self.grads.as_mut() {
            let across = self.engine.shards().then_some(self.pg.as_ref());
            self.order.unscale(grads, &self.params, across)?;
            self.unscaled = true;
        }
        Ok(())
    }

    /// Steps the learning rates with `schedule`, saved with the run. Over
    /// several parameter groups, a schedule of one group (built with group
    /// 0's rate) gives each group the rate of its formula from the group's
    /// own rate now, as PyTorch's schedules over `param_groups` do
    /// ([`LrScheduler::with_group_rates`]); one made with
    /// [`LrScheduler::per_group`] sets each group as it says.
    ///
    /// # Errors
    ///
    /// A schedule made for another number of groups than the optimizer
    /// has; a group's rate the schedule cannot start from.
    pub fn set_schedule(&mut self, schedule: LrScheduler) -> Result<()> {
        let rates = self.engine.trainables().optimizer().group_learning_rates();
        self.order.set_schedule(schedule, &rates)
    }

    /// The optimizer (with ZeRO, this rank's, over its pieces).
    pub fn optimizer(&self) -> &O {
        self.engine.trainables().optimizer()
    }

    /// The optimizer, to change its settings.
    pub fn optimizer_mut(&mut self) -> &mut O {
        self.engine.trainables_mut().optimizer_mut()
    }

    /// The model's output for `x` in evaluation mode, in f32: the whole
    /// model on this rank's batch. Every rank must call it (DDP broadcasts
    /// its buffers, FSDP gathers its units).
    pub fn forward(&mut self, x: &Tensor) -> Result<Tensor> {
        let out = self.engine.forward(x)?;
        Ok(crate::precision::output_for_loss(&out)?)
    }

    /// The whole model's weights by name, on the CPU: FSDP's gathered from
    /// every rank (every rank must call it). Fabric's full state dict.
    pub fn full_state(&self) -> Result<HashMap<String, Tensor>> {
        self.engine
            .full_state()?
            .into_iter()
            .map(|(name, t)| Ok((name, t.to_device(&candle_core::Device::Cpu)?)))
            .collect()
    }

    /// What this rank holds after its last step: its parameters, the
    /// gradients the step used, its optimizer's state; with FSDP, the most
    /// it gathered at once.
    ///
    /// # Errors
    ///
    /// The optimizer's state cannot be copied.
    pub fn memory(&self) -> Result<Memory> {
        Ok(Memory {
            gradients: self.grad_bytes,
            ..self.engine.memory()?
        })
    }

    /// The strategy it was set up for.
    pub fn strategy(&self) -> Strategy {
        self.strategy
    }

    /// Optimizer steps taken (skipped ones included).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Steps the f16 loss scaler skipped.
    pub fn skipped_steps(&self) -> u64 {
        self.order.skipped()
    }

    /// The variables of this rank's model: the masters (`single`, `dp`),
    /// this rank's copy, or FSDP's pieces of them.
    pub fn varmap(&self) -> &VarMap {
        self.engine.trainables().varmap()
    }

    /// The strategy's engine, for what the loop does not cover.
    pub fn engine(&self) -> &dyn Engine<O> {
        self.engine.as_ref()
    }
}

impl<O: StatefulOptimizer> fmt::Debug for FabricModel<O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FabricModel")
            .field("strategy", &self.strategy)
            .field("engine", &self.engine.name())
            .field("rank", &self.pg.rank())
            .field("params", &self.params.len())
            .field("accumulation_steps", &self.accumulation_steps)
            .field("gradient_clip", &self.gradient_clip)
            .field("steps", &self.steps)
            .finish_non_exhaustive()
    }
}

/// `before + grads`, variable by variable (a new store).
fn add_grads(before: &GradStore, grads: GradStore, params: &[Var]) -> Result<GradStore> {
    let mut sum = GradStore::default();
    for var in params {
        let total = with_accumulated(before.get(var), grads.get(var).cloned())?;
        if let Some(total) = total {
            sum.insert(var, total);
        }
    }
    Ok(sum)
}

impl<O: StatefulOptimizer> FabricModel<O> {
    /// Refuses `what` between a step's first backward and its step: the
    /// gradients of its batches live only in memory.
    pub(crate) fn between_steps(&self, what: &str) -> Result<()> {
        if self.micro > 0 || self.grads.is_some() {
            return Err(Error::Fabric(format!(
                "{what} in the middle of a step ({} of its {} batch(es) back-propagated): call \
                 it after step()",
                self.micro, self.accumulation_steps
            )));
        }
        Ok(())
    }
}
