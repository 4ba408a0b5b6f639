//! The strategies behind the Fabric's one loop, one file each behind one
//! trait, [`Engine`]: how a strategy builds the model and its optimizer,
//! runs a step's forward and backward, steps, clips, counts its memory,
//! and saves and loads its shards. [`FabricModel`](super::FabricModel)
//! keeps what is the same for all of them (accumulation, the loss scale,
//! the schedule, the order of a step), so a new strategy is a new file
//! here and a line in [`build`]; a user's own is an [`Engine`] given to
//! [`Fabric::setup_engine`](super::Fabric::setup_engine).

mod ddp;
mod fsdp;
mod one_process_pipeline;
mod pipeline_ddp;
mod pipeline_ranks;
mod replicas;
mod single;
mod states;
mod tensor_parallel;
mod trainables;

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use candle_nn::VarMap;

use super::config::{FabricConfig, Strategy};
use super::memory::Memory;
use super::recipe::ModelRecipe;
use crate::comm::{DeviceMesh, ProcessGroup};
use crate::error::{Error, Result};
use crate::optim::clip::AlsoAcross;
use crate::optim::{clip_grad_norm, Clipped, OptimizerState, StatefulOptimizer};
use crate::saving::sharded::{Checkpoints, FsdpSave};
use crate::saving::training_state::{SavedState, TrainingState};
use crate::step::Step;
use crate::tensor_parallel::TensorParallel;
use crate::util::vars::sorted_vars;

pub use trainables::Trainables;

/// A whole state: the model's values by name, and the optimizer's state
/// of the whole parameters ([`Engine::whole_state`]).
pub type WholeState = (HashMap<String, Tensor>, OptimizerState);

/// A loss from the model's output (in f32) and the targets.
pub type LossFn = Arc<dyn Fn(&Tensor, &Tensor) -> candle_core::Result<Tensor> + Send + Sync>;

/// What one forward and backward gave: this rank's loss (unscaled), and
/// the gradients when the step synchronised (`None` while an engine that
/// accumulates itself only accumulated, inside `no_sync`).
#[derive(Debug)]
pub struct EngineStep {
    /// This rank's loss, unscaled.
    pub loss: Tensor,
    /// The step's gradients, keyed by [`Trainables::vars`].
    pub grads: Option<GradStore>,
}

/// One rank's strategy: the model as the strategy holds it, and what it
/// trains ([`Trainables`]: the variables and the optimizer over them). The
/// Fabric's loop calls it in the order `forward_backward` (once per
/// accumulated batch), `clip`, `step`; `save`, `find_state` and
/// `load_state` between steps.
///
/// The methods with a default serve an engine that keeps the whole model
/// on every rank (as DDP does): its variables' bytes, the optimizer's
/// step, a plain clip over its gradients, and a state that rank 0 writes
/// whole.
///
/// ```
/// use candle_core::{DType, Device, ModuleT, Tensor};
/// use candle_dp::fabric::{Engine, EngineSetup, EngineStep, Fabric, FabricConfig, ModelRecipe, LossFn, Strategy, Trainables};
/// use candle_dp::optim::{Sgd, SgdConfig};
/// use candle_dp::units::Units;
/// use candle_nn::{linear, loss, VarBuilder};
///
/// /// One device, the plain candle step: a user's own strategy.
/// struct Plain { model: Units, trainables: Trainables<Sgd> }
///
/// impl Engine<Sgd> for Plain {
///     fn name(&self) -> &str { "plain" }
///     fn forward_backward(&mut self, x: &Tensor, y: &Tensor, factor: f64, _sync: bool, loss_fn: &LossFn)
///         -> candle_dp::Result<EngineStep> {
///         let loss = loss_fn(&self.model.forward_t(x, true)?, y)?;
///         let grads = loss.affine(factor, 0.0)?.backward()?;
///         Ok(EngineStep { loss: loss.detach(), grads: Some(grads) })
///     }
///     fn forward(&mut self, x: &Tensor) -> candle_dp::Result<Tensor> { Ok(self.model.forward_t(x, false)?) }
///     fn trainables(&self) -> &Trainables<Sgd> { &self.trainables }
///     fn trainables_mut(&mut self) -> &mut Trainables<Sgd> { &mut self.trainables }
/// }
///
/// Fabric::launch(FabricConfig::new(Strategy::Single, 1), |fabric| {
///     let module = ModelRecipe::module(|vb| linear(4, 2, vb.pp("fc")));
///     let mut model = fabric.setup_engine(module, |setup: EngineSetup<'_>| {
///         let varmap = setup.varmap().clone();
///         let model = setup.module().build(VarBuilder::from_varmap(&varmap, DType::F32, setup.device()))?;
///         let sgd = SgdConfig { lr: 0.1, ..Default::default() };
///         let trainables = Trainables::over_all(varmap, |named| Sgd::new_named(named, sgd))?;
///         Ok(Box::new(Plain { model, trainables }) as Box<dyn Engine<Sgd>>)
///     })?;
///     let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
///     let y = Tensor::new(&[0u32, 1, 0], &Device::Cpu)?;
///     model.backward(&x, &y, |out, y| loss::cross_entropy(out, y))?;
///     model.step()?;
///     assert_eq!(model.steps(), 1);
///     Ok(())
/// })?;
/// # Ok::<(), candle_dp::Error>(())
/// ```
pub trait Engine<O: StatefulOptimizer> {
    /// The strategy's name, for messages.
    fn name(&self) -> &str;

    /// One forward and backward of `loss_fn(output, y)` times `factor`
    /// (the loss scale over the accumulation steps). `sync` false: an
    /// engine that holds its reduction back (`no_sync`) keeps this batch's
    /// gradients itself, returns none, and says so with
    /// [`accumulates_itself`](Self::accumulates_itself); any other returns
    /// them, and the Fabric sums the batches'.
    ///
    /// # Errors
    ///
    /// The model's, the loss's, a collective's. An engine should leave the
    /// model's parameters and buffers as they were when it fails (the
    /// crate's put back what a failed step changed, as `single` its
    /// BatchNorm statistics).
    fn forward_backward(
        &mut self,
        x: &Tensor,
        y: &Tensor,
        factor: f64,
        sync: bool,
        loss_fn: &LossFn,
    ) -> Result<EngineStep>;

    /// One chunk's forward and backward, as
    /// [`forward_backward`](Self::forward_backward), with its gradients
    /// returned as this rank computed them, reduced with no other rank's:
    /// deterministic training ([`crate::deterministic`]) sums the chunks
    /// itself. The default refuses, naming the strategy (one that reduces
    /// inside its step).
    ///
    /// # Errors
    ///
    /// [`Error::Strategy`] by default; the model's, the loss's.
    fn local_forward_backward(
        &mut self,
        x: &Tensor,
        y: &Tensor,
        factor: f64,
        loss_fn: &LossFn,
    ) -> Result<EngineStep> {
        let _ = (x, y, factor, loss_fn);
        Err(Error::Strategy {
            strategy: self.name().into(),
            reason: "it reduces the gradients inside its step, so deterministic training cannot \
                     take one chunk's from it"
                .into(),
        })
    }

    /// The shape of each of [`trainables`](Self::trainables)' variables'
    /// gradients as [`local_forward_backward`](Self::local_forward_backward)
    /// hands them (a sharding engine's whole, its variables pieces), the
    /// same on every rank.
    fn local_grad_dims(&self) -> Vec<Vec<usize>> {
        self.trainables()
            .vars()
            .iter()
            .map(|v| v.dims().to_vec())
            .collect()
    }

    /// The model's output for `x` in evaluation mode (every rank calls it).
    ///
    /// # Errors
    ///
    /// The model's, a collective's.
    fn forward(&mut self, x: &Tensor) -> Result<Tensor>;

    /// What it trains: its model's variables and the optimizer over those
    /// it steps.
    fn trainables(&self) -> &Trainables<O>;

    /// What it trains, to step and to set the optimizer's rates.
    fn trainables_mut(&mut self) -> &mut Trainables<O>;

    /// Whether the engine keeps the gradients of `no_sync` steps itself
    /// (the Fabric sums the others' across the accumulation).
    fn accumulates_itself(&self) -> bool {
        false
    }

    /// Whether a rank holds only pieces of the gradients or the state, so
    /// that an inf found on one rank must be told to the others.
    fn shards(&self) -> bool {
        false
    }

    /// How its states lie, when not as its strategy's name says (a
    /// strategy beside tensor parallelism saves them whole): `None` for
    /// the strategy's own.
    fn state_layout(&self) -> Option<&'static str> {
        None
    }

    /// Whether each rank holds its model and its optimizer's state whole
    /// (its [`Trainables`] are the whole model's), so that a state saved
    /// whole loads into it as it is: an engine that neither shards nor
    /// splits the model among ranks.
    fn holds_whole(&self) -> bool {
        !self.shards()
    }

    /// Steps the optimizer with the step's gradients.
    ///
    /// # Errors
    ///
    /// The optimizer's.
    fn step(&mut self, grads: &GradStore) -> Result<()> {
        self.trainables_mut().step(grads)
    }

    /// Clips the gradients to a total 2-norm of `max_norm` (over every
    /// rank's pieces where the strategy shards them).
    ///
    /// # Errors
    ///
    /// The norm's, a collective's.
    fn clip(&self, grads: &mut GradStore, max_norm: f64) -> Result<Clipped> {
        clip_grad_norm(grads, self.trainables().vars(), max_norm, 2.0, false)
    }

    /// [`clip`](Self::clip) with the total norm taken over the
    /// tensor-parallel ranks `tp` as well, each parameter's gradient
    /// counted where `counted(name)` says (so that one every rank holds
    /// whole counts once). The default refuses: an engine whose own
    /// clip is local (its gradients whole on each rank) gives it with
    /// [`clip_across`](crate::fabric::clip_across).
    ///
    /// # Errors
    ///
    /// [`Error::TensorParallel`](crate::Error::TensorParallel) where the strategy cannot; the norm's,
    /// a collective's.
    fn clip_tensor_parallel(
        &self,
        grads: &mut GradStore,
        max_norm: f64,
        tp: &dyn ProcessGroup,
        counted: &dyn Fn(&str) -> bool,
    ) -> Result<Clipped> {
        let _ = (grads, max_norm, tp, counted);
        Err(no_clip_across(self.name()))
    }

    /// The whole model's variables by name (a sharding engine gathers
    /// them: every rank calls it).
    ///
    /// # Errors
    ///
    /// A collective's.
    fn full_state(&self) -> Result<HashMap<String, Tensor>> {
        Ok(sorted_vars(self.trainables().varmap())
            .into_iter()
            .map(|(name, var)| (name, var.as_tensor().clone()))
            .collect())
    }

    /// What this rank holds: its parameters, its optimizer's state, and
    /// for FSDP what it gathers (`gradients` is filled in by the Fabric).
    ///
    /// # Errors
    ///
    /// The optimizer's state cannot be copied.
    fn memory(&self) -> Result<Memory> {
        self.trainables().memory()
    }

    /// The whole model's values and the optimizer's state of the whole
    /// parameters, as one device would hold them, on the ranks that put
    /// them together (`None` on the others); every rank calls it. An
    /// engine that holds its model whole gives its own on every rank;
    /// FSDP puts its pieces together on its shard group's first rank.
    /// What a tensor-parallel run saves (its pieces joined once more).
    ///
    /// # Errors
    ///
    /// [`Error::TensorParallel`](crate::Error::TensorParallel) for an
    /// engine that cannot; a collective's; the optimizer's state.
    fn whole_state(&self) -> Result<Option<WholeState>> {
        if !self.holds_whole() {
            return Err(crate::error::Error::TensorParallel(format!(
                "strategy {} cannot put its whole state together",
                self.name()
            )));
        }
        let trainables = self.trainables();
        Ok(Some((
            values_of(trainables)?,
            trainables.optimizer().state()?,
        )))
    }

    /// Puts a whole state back (as [`whole_state`](Self::whole_state)
    /// gives it): each rank takes its part. All or nothing: when a value
    /// does not fit, nothing has changed.
    ///
    /// # Errors
    ///
    /// A value missing or of another shape (naming it); the optimizer's
    /// refusal; [`Error::TensorParallel`](crate::Error::TensorParallel)
    /// for an engine that cannot.
    fn load_whole_state(
        &mut self,
        values: &HashMap<String, Tensor>,
        optimizer: &OptimizerState,
    ) -> Result<()> {
        if !self.holds_whole() {
            return Err(crate::error::Error::TensorParallel(format!(
                "strategy {} cannot load a whole state",
                self.name()
            )));
        }
        let trainables = self.trainables_mut();
        let fitted = fitting(trainables, values)?;
        trainables.optimizer_mut().load_state(optimizer)?;
        set_all(&fitted)
    }

    /// Saves `state` with this rank's part of the model and optimizer
    /// (every rank calls it).
    ///
    /// # Errors
    ///
    /// The write's, naming the file.
    fn save(&self, store: &StateStore<'_>, state: TrainingState) -> Result<()> {
        let trainables = self.trainables();
        states::save_whole(store, trainables.varmap(), trainables.optimizer(), state)
    }

    /// The newest complete state of this strategy's layout, `None` when
    /// there is none.
    ///
    /// # Errors
    ///
    /// A state that cannot be read.
    fn find_state(&self, store: &StateStore<'_>) -> Result<Option<FoundState>> {
        states::find_whole(store)
    }

    /// Puts `found` back into the model and the optimizer, all or nothing.
    ///
    /// # Errors
    ///
    /// A state that does not fit, naming what.
    fn load_state(&mut self, found: FoundState) -> Result<()> {
        let trainables = self.trainables_mut();
        let varmap = trainables.varmap().clone();
        states::load_whole(found, &varmap, trainables.optimizer_mut())
    }
}

/// Where a strategy saves and finds its states: the run's folder and its
/// ranks.
pub struct StateStore<'a> {
    pub(crate) checkpoints: &'a Checkpoints,
    pub(crate) pg: &'a dyn ProcessGroup,
}

impl fmt::Debug for StateStore<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StateStore")
            .field("path", &self.checkpoints.path())
            .field("rank", &self.pg.rank())
            .finish()
    }
}

/// A state found by [`Engine::find_state`]: its step and its shards, as
/// the strategy that saved them laid them out.
pub struct FoundState {
    pub(crate) saved: SavedState,
    pub(crate) shards: Shards,
}

impl FoundState {
    /// The state, without the model's variables.
    pub fn state(&self) -> &TrainingState {
        &self.saved.state
    }

    /// Its folder.
    pub fn path(&self) -> &std::path::Path {
        &self.saved.path
    }
}

impl fmt::Debug for FoundState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FoundState")
            .field("path", &self.saved.path)
            .field("step", &self.saved.state.progress.step)
            .finish_non_exhaustive()
    }
}

/// Every rank's shards of a state, as its strategy saved them.
pub(crate) enum Shards {
    None,
    Zero(Vec<OptimizerState>),
    Fsdp(Vec<FsdpSave>),
}

/// What a strategy is built from on one rank: the configuration, the
/// ranks, this rank's devices, the model's seeded initial variables and
/// its recipe.
pub struct EngineSetup<'a> {
    pub(crate) config: &'a FabricConfig,
    pub(crate) pg: Arc<dyn ProcessGroup>,
    pub(crate) mesh: &'a DeviceMesh,
    pub(crate) devices: &'a [Device],
    pub(crate) varmap: &'a VarMap,
    pub(crate) module: &'a ModelRecipe,
    pub(crate) tensor_parallel: Option<TensorParallel>,
}

impl EngineSetup<'_> {
    /// The run's configuration.
    pub fn config(&self) -> &FabricConfig {
        self.config
    }

    /// The ranks' tensor parallelism, when the mesh has a `tp` degree
    /// above 1 ([`process_group`](Self::process_group) is then the group
    /// of the ranks at this rank's place in its tensor-parallel group).
    pub fn tensor_parallel(&self) -> Option<&TensorParallel> {
        self.tensor_parallel.as_ref()
    }

    /// The group of the ranks the strategy runs over (with tensor
    /// parallelism, those holding the same pieces).
    pub fn process_group(&self) -> Arc<dyn ProcessGroup> {
        self.pg.clone()
    }

    /// The ranks laid out in every degree ([`Fabric::mesh`](super::Fabric::mesh)):
    /// a strategy takes its groups from its dimensions.
    pub fn mesh(&self) -> &DeviceMesh {
        self.mesh
    }

    /// This rank's devices.
    pub fn devices(&self) -> &[Device] {
        self.devices
    }

    /// This rank's first device.
    pub fn device(&self) -> &Device {
        // `Fabric::launch` gives every rank at least one device.
        &self.devices[0]
    }

    /// The model's initial variables, the same on every rank.
    pub fn varmap(&self) -> &VarMap {
        self.varmap
    }

    /// The initial variables by name, sorted.
    pub fn named_vars(&self) -> Vec<(String, Var)> {
        sorted_vars(self.varmap)
    }

    /// The model's recipe.
    pub fn module(&self) -> &ModelRecipe {
        self.module
    }
}

impl fmt::Debug for EngineSetup<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EngineSetup")
            .field("strategy", &self.config.effective_strategy())
            .field("rank", &self.pg.rank())
            .field("devices", &self.devices.len())
            .finish_non_exhaustive()
    }
}

/// Builds the engine of `setup`'s strategy, with the optimizer `make`
/// over the variables it steps: the one place the strategy's name picks
/// its file.
pub(crate) fn build<O, F>(setup: &EngineSetup<'_>, make: F) -> Result<Box<dyn Engine<O>>>
where
    O: StatefulOptimizer + 'static,
    F: FnOnce(Vec<(String, Var)>) -> candle_core::Result<O>,
{
    let strategy = setup.config.effective_strategy();
    Ok(match strategy {
        Strategy::Single => Box::new(single::Single::build(setup, make)?),
        Strategy::Dp => Box::new(replicas::Replicas::build(setup, make)?),
        Strategy::Ddp | Strategy::DdpOverlap | Strategy::Zero1 | Strategy::Zero2 => {
            Box::new(ddp::Ddp::build(setup, strategy, make)?)
        }
        Strategy::Fsdp | Strategy::Hsdp => Box::new(fsdp::Fsdp::build(setup, strategy, make)?),
        Strategy::Pipeline => Box::new(one_process_pipeline::OneProcessPipeline::build(
            setup, make,
        )?),
        Strategy::PipelineDdp => Box::new(pipeline_ddp::PipelineDdp::build(setup, make)?),
        Strategy::PipelineRanks => Box::new(pipeline_ranks::PipelineRanks::build(setup, make)?),
    })
}

/// `engine` as the run needs it: with tensor parallelism, inside the
/// engine that takes the norm over the tensor-parallel ranks and joins
/// their pieces.
pub(crate) fn with_tensor_parallel<O: StatefulOptimizer + 'static>(
    engine: Box<dyn Engine<O>>,
    setup: &EngineSetup<'_>,
) -> Box<dyn Engine<O>> {
    match (&setup.tensor_parallel, setup.module.tp_plan()) {
        (Some(tp), Some(plan)) => Box::new(tensor_parallel::TensorParallelEngine::around(
            engine,
            tp.clone(),
            plan.clone(),
        )),
        _ => engine,
    }
}

/// Copies of the values of `trainables`' variables, by name.
pub(crate) fn values_of<O: StatefulOptimizer>(
    trainables: &Trainables<O>,
) -> Result<HashMap<String, Tensor>> {
    sorted_vars(trainables.varmap())
        .into_iter()
        .map(|(name, var)| Ok((name, var.as_tensor().copy()?)))
        .collect()
}

/// `trainables`' variables beside their values in `values` (in their
/// dtypes, on their devices): an error naming a value missing or of
/// another shape, before anything changes.
pub(crate) fn fitting<O: StatefulOptimizer>(
    trainables: &Trainables<O>,
    values: &HashMap<String, Tensor>,
) -> Result<Vec<(Var, Tensor)>> {
    let mut fitted = Vec::new();
    for (name, var) in sorted_vars(trainables.varmap()) {
        let value = values
            .get(&name)
            .ok_or_else(|| crate::error::Error::Checkpoint(format!("the state lacks `{name}`")))?;
        if value.dims() != var.dims() {
            return Err(crate::error::Error::Checkpoint(format!(
                "`{name}` has shape {:?} in the state, {:?} in this model",
                value.dims(),
                var.dims()
            )));
        }
        let value = value.to_dtype(var.dtype())?.to_device(var.device())?;
        fitted.push((var, value));
    }
    Ok(fitted)
}

/// Sets each variable to its value ([`fitting`]'s: they fit).
pub(crate) fn set_all(fitted: &[(Var, Tensor)]) -> Result<()> {
    for (var, value) in fitted {
        var.set(value)?;
    }
    Ok(())
}

/// The error of a strategy that cannot clip across tensor-parallel ranks.
fn no_clip_across(strategy: &str) -> crate::error::Error {
    crate::error::Error::TensorParallel(format!(
        "strategy {strategy} does not clip gradients across tensor-parallel ranks: turn \
         clipping off, or give it Engine::clip_tensor_parallel"
    ))
}

/// Clips the gradients of `trainables` (whole on this rank) to a total
/// norm of `max_norm` taken over the ranks of `pg` as well, each counted
/// where `counted(name)` says: [`Engine::clip_tensor_parallel`] for an
/// engine whose gradients are whole on each rank.
///
/// # Errors
///
/// The norm's, a collective's.
pub fn clip_across<O: StatefulOptimizer>(
    trainables: &Trainables<O>,
    grads: &mut GradStore,
    max_norm: f64,
    pg: &dyn ProcessGroup,
    counted: &dyn Fn(&str) -> bool,
) -> Result<Clipped> {
    let ids = AlsoAcross { group: pg, counted }.counted_ids(&sorted_vars(trainables.varmap()));
    let counts = |var: &Var| ids.contains(&var.as_tensor().id());
    crate::optim::clip::clip_grad_norm_across_counting(
        &[pg],
        grads,
        trainables.vars(),
        &counts,
        max_norm,
        2.0,
        false,
    )
}

/// The bytes of `vars`.
pub(crate) fn bytes_of(vars: &[(String, Var)]) -> usize {
    vars.iter()
        .map(|(_, v)| v.elem_count() * v.dtype().size_in_bytes())
        .sum()
}

/// What an engine's [`Step`] of a loss scaled by `factor` gave: the loss
/// unscaled, and the gradients unless it ran inside no_sync.
fn from_step(step: Step, factor: f64, sync: bool) -> Result<EngineStep> {
    Ok(EngineStep {
        loss: step.loss.affine(1.0 / factor, 0.0)?,
        grads: Some(step.grads).filter(|_| sync),
    })
}

/// `loss_fn` on the output in f32, times `factor`: the loss the engines
/// that take a loss function back-propagate.
fn scaled(
    loss_fn: &LossFn,
    factor: f64,
) -> impl Fn(&Tensor, &Tensor) -> candle_core::Result<Tensor> + Clone + Send + Sync + 'static {
    let loss_fn = loss_fn.clone();
    move |out: &Tensor, y: &Tensor| {
        loss_fn(&crate::precision::output_for_loss(out)?, y)?.affine(factor, 0.0)
    }
}

/// The loss of `output` (in f32) and its gradients, scaled by `factor`.
fn backward_of(output: &Tensor, y: &Tensor, factor: f64, loss_fn: &LossFn) -> Result<EngineStep> {
    let loss = loss_fn(&crate::precision::output_for_loss(output)?, y)?;
    let grads = loss.affine(factor, 0.0)?.backward()?;
    Ok(EngineStep {
        loss: loss.detach(),
        grads: Some(grads),
    })
}

/// A `VarMap` holding `tensors`.
pub(crate) fn varmap_of(tensors: HashMap<String, Tensor>) -> Result<VarMap> {
    let varmap = VarMap::new();
    {
        let mut data = crate::util::lock::lock(varmap.data());
        for (name, tensor) in tensors {
            data.insert(name, Var::from_tensor(&tensor)?);
        }
    }
    Ok(varmap)
}
