//! One training loop for every strategy: Lightning Fabric's and Hugging
//! Face Accelerate's front door for candle-dp.
//!
//! A [`Fabric`] is one rank's handle on the run. [`Fabric::launch`] runs a
//! function on every rank (thread ranks in this process, or this process
//! as one rank under `mpirun` / `srun`: the environment decides, so one
//! binary serves both); inside it, [`Fabric::setup`] builds the model and
//! its optimizer for the configured [`Strategy`] and
//! [`Fabric::setup_dataloader`] gives the rank its share of the data. The
//! loop is then the same for every strategy, precision and number of
//! devices: [`FabricModel::backward`], [`FabricModel::step`].
//!
//! ```
//! use std::sync::Arc;
//! use candle_core::{Device, Tensor};
//! use candle_dp::fabric::{DataOptions, Fabric, FabricConfig, ModelRecipe, Strategy};
//! use candle_dp::loader::TensorDataset;
//! use candle_dp::optim::{AdamW, AdamWConfig};
//! use candle_dp::pipeline::unit;
//! use candle_nn::{linear, loss, Activation};
//!
//! // The strategy is one word: "single", "dp", "ddp", "ddp-overlap",
//! // "zero1", "zero2", "fsdp", "hsdp", "pipeline", "pipeline-ddp" or
//! // "pipeline-ranks".
//! let config = FabricConfig::new("fsdp".parse()?, 2);
//! let x = Tensor::randn(0f32, 1., (16, 4), &Device::Cpu)?;
//! let y = Tensor::from_vec((0..16u32).map(|i| i % 2).collect(), 16, &Device::Cpu)?;
//! let data = Arc::new(TensorDataset::new(vec![x, y])?);
//!
//! let losses = Fabric::launch(config, |fabric| {
//!     let module = ModelRecipe::units(vec![
//!         unit(|vb| linear(4, 8, vb.pp("l1"))),
//!         unit(|_| Ok(Activation::Relu)),
//!         unit(|vb| linear(8, 2, vb.pp("l2"))),
//!     ]);
//!     let mut model = fabric.setup(module, |p| AdamW::new_named(p, AdamWConfig::default()))?;
//!     // 8 samples per batch in all, each rank its share.
//!     let mut loader = fabric.setup_dataloader(data.clone(), 8 / fabric.world_size(), DataOptions::default())?;
//!     let mut last = 0.0;
//!     for epoch in 0..2 {
//!         loader.set_epoch(epoch);
//!         for batch in loader.iter()? {
//!             let batch = batch?;
//!             let loss = model.backward(&batch[0], &batch[1], |out, y| loss::cross_entropy(out, y))?;
//!             model.step()?;
//!             last = fabric.all_reduce_mean(&loss)?;
//!         }
//!     }
//!     Ok(last)
//! })?;
//! assert_eq!(losses.len(), 2); // one result per rank, the same on both
//! assert_eq!(losses[0], losses[1]);
//! # Ok::<(), candle_dp::Error>(())
//! ```
//!
//! The manual's page `docs/fabric.md` shows the loop beside Fabric's,
//! Accelerate's and `torchrun`'s, and what differs from them and why.

mod aliases;
mod args;
mod config;
mod data;
mod degrees;
mod memory;
mod mesh_aliases;
mod model;
mod recipe;
mod saving;
mod step_order;
mod strategies;

use std::fmt;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use serde::de::DeserializeOwned;
use serde::Serialize;

pub use args::FabricArgs;
pub use config::{Accelerator, Devices, DpBackward, FabricConfig, Precision, Strategy};
pub use data::{DataOptions, FabricBatches, FabricLoader, Sharding};
pub use degrees::Degrees;
pub use memory::Memory;
pub use mesh_aliases::RANK_MESH;
pub use model::{FabricModel, StepOutcome};
pub use recipe::ModelRecipe;
/// The former name of [`ModelRecipe`].
#[deprecated(
    note = "one name per idea: the recipe is `ModelRecipe`, the set-up model `FabricModel`"
)]
pub type FabricModule = ModelRecipe;
pub use saving::Resumed;
pub use strategies::{
    clip_across, Engine, EngineSetup, EngineStep, FoundState, LossFn, StateStore, Trainables,
    WholeState,
};

use crate::buffers::is_batch_norm_buffer;
use crate::comm::{all_gather_object, DeviceMesh, GroupOptions, ProcessGroup, ReduceOp};
use crate::deterministic::ChunkedStep;
use crate::error::{Error, Result};
use crate::launch::{Backend, Elastic, RankContext};
use crate::loader::Dataset;
use crate::optim::StatefulOptimizer;
use crate::tensor_parallel::TensorParallel;
use crate::units::Units;
use crate::util::lock::lock;
use mesh_aliases::DATA_DIMS;
use step_order::StepOrder;

/// One rank's handle on a run: its place among the ranks, its devices,
/// and the configuration. Made by [`Fabric::launch`] on every rank.
pub struct Fabric {
    config: FabricConfig,
    ctx: RankContext,
    devices: Vec<Device>,
    /// The ranks laid out in every degree ([`RANK_MESH`]).
    mesh: DeviceMesh,
    /// With a `tp` degree above 1: this rank's tensor parallelism, and
    /// the group of the ranks holding the same pieces (the strategy's).
    tensor_parallel: Option<(TensorParallel, Arc<dyn ProcessGroup>)>,
}

impl fmt::Debug for Fabric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fabric")
            .field("strategy", &self.config.effective_strategy())
            .field("rank", &self.ctx.rank)
            .field("world_size", &self.ctx.world_size)
            .field("devices", &self.devices.len())
            .field("precision", &self.config.precision)
            .finish()
    }
}

impl Fabric {
    /// Runs `f` on every rank of `config`'s run and returns the results of
    /// the ranks of this process, in rank order (Fabric's `launch`).
    /// Under an MPI launcher (`mpirun`, `srun`; feature `mpi`) this
    /// process is one rank and the launcher gives the number of ranks;
    /// otherwise the ranks are threads of this process: one per device for
    /// `ddp`, `ddp-overlap`, `zero1`, `zero2`, `fsdp`, `hsdp` and
    /// `pipeline-ranks` (one per stage of each pipeline), one per pipeline
    /// for `pipeline-ddp`, and a single one for `single`, `dp` and
    /// `pipeline`, which spread over their devices inside it.
    ///
    /// # Errors
    ///
    /// [`Error::Strategy`] before anything runs when the strategy cannot
    /// serve the devices, the settings or the precision (naming both);
    /// [`Error::Launch`] when a rank fails (naming it); with
    /// [`FabricConfig::max_restarts`] on thread ranks, [`Error::Elastic`]
    /// once a rank has failed more often than it allows (naming the last
    /// failure).
    pub fn launch<T, F>(config: FabricConfig, f: F) -> Result<Vec<T>>
    where
        T: Send,
        F: Fn(Fabric) -> anyhow::Result<T> + Sync,
    {
        let under_mpi = matches!(Backend::from_env(), Backend::Mpi { .. });
        Self::start(config, f, under_mpi)
    }

    /// [`launch`](Self::launch) on thread ranks of this process, even
    /// under an MPI launcher (as [`launch::spawn`](crate::launch::spawn)
    /// beside [`launch::run`](crate::launch::run)): for a run inside one
    /// process of a job, such as a one-device reference on rank 0.
    ///
    /// # Errors
    ///
    /// As [`launch`](Self::launch).
    pub fn spawn<T, F>(config: FabricConfig, f: F) -> Result<Vec<T>>
    where
        T: Send,
        F: Fn(Fabric) -> anyhow::Result<T> + Sync,
    {
        Self::start(config, f, false)
    }

    fn start<T, F>(config: FabricConfig, f: F, under_mpi: bool) -> Result<Vec<T>>
    where
        T: Send,
        F: Fn(Fabric) -> anyhow::Result<T> + Sync,
    {
        config.check()?;
        let strategy = config.effective_strategy();
        let tp = config.tensor_parallel_size();
        // In one process, or one per tensor-parallel piece of one model.
        if under_mpi && !strategy.is_distributed() && Backend::world_size() != tp {
            return Err(Error::Strategy {
                strategy: strategy.name().into(),
                reason: format!(
                    "it runs in {}, and this is one of {} processes of an MPI job: start {}, \
                     or use ddp, ddp-overlap, zero1, zero2, fsdp, hsdp, pipeline-ddp or \
                     pipeline-ranks",
                    match tp {
                        1 => "one process".to_string(),
                        tp => format!("{tp} processes (one per tensor-parallel piece)"),
                    },
                    Backend::world_size(),
                    match tp {
                        1 => "one process".to_string(),
                        tp => format!("{tp}"),
                    },
                ),
            });
        }
        // The devices are made (and their kernels tried) before any rank
        // starts, so that a device or a precision it cannot serve stops
        // the run on every rank alike.
        let local = if under_mpi { Backend::local_rank() } else { 0 };
        let ranks = if under_mpi { 1 } else { config.ranks() };
        let devices: Vec<Vec<Device>> = (0..ranks)
            .map(|r| rank_devices(&config, local + r))
            .collect::<Result<_>>()?;
        for device in devices.iter().flatten() {
            check_precision(strategy, config.precision, device)?;
        }
        let mut options = GroupOptions::default();
        if let Some(timeout) = config.timeout() {
            options.timeout = timeout;
        }
        let rank = |ctx: RankContext| {
            let mine = match under_mpi {
                true => devices[0].clone(),
                false => devices[ctx.rank].clone(),
            };
            // One mesh of every degree; the strategy's groups and the
            // tensor-parallel ones are its dimensions.
            let mesh = DeviceMesh::new(Arc::clone(&ctx.pg), &config.rank_mesh(ctx.world_size)?)?;
            let tensor_parallel = match tp {
                1 => None,
                _ => Some((
                    TensorParallel::new(Arc::clone(mesh.group("tp")?), config.sequence_parallel),
                    Arc::clone(mesh.sub_mesh(&DATA_DIMS)?.world()),
                )),
            };
            let (world, groups) = (Arc::clone(&ctx.pg), tensor_parallel.clone());
            let result = f(Fabric {
                config: config.clone(),
                ctx,
                devices: mine,
                mesh,
                tensor_parallel,
            });
            // This rank's error fails its groups before their handles go
            // (the world first, so that it is the run's root cause): the
            // others then hear why, not that this rank left.
            if let (Err(e), Some((tp, data))) = (&result, &groups) {
                let reason = format!("{e:#}");
                world.abort(&reason);
                tp.group().abort(&reason);
                data.abort(&reason);
            }
            result
        };
        match (under_mpi, config.max_restarts) {
            (true, _) => crate::launch::run(config.ranks(), options, rank),
            (false, 0) => crate::launch::spawn_with(config.ranks(), options, rank),
            (false, restarts) => {
                return Elastic::new(restarts)
                    .spawn(config.ranks(), options, rank)
                    .map(|run| run.results)
                    .map_err(|e| Error::Elastic(Box::new(e)))
            }
        }
        .map_err(|e| Error::Launch(Box::new(e)))
    }

    /// Which start of the job this is: 0 the first time, `k` after `k`
    /// restarts (thread ranks restarted by
    /// [`FabricConfig::max_restarts`], processes by a supervisor,
    /// [`Elastic::supervise`]). Resume when it is not 0:
    /// `model.resume(fabric.restart() > 0)`.
    pub fn restart(&self) -> usize {
        self.ctx.restart
    }

    /// The configuration of the run.
    pub fn config(&self) -> &FabricConfig {
        &self.config
    }

    /// The strategy in force.
    pub fn strategy(&self) -> Strategy {
        self.config.effective_strategy()
    }

    /// This rank, in `0..world_size` (Fabric's `global_rank`).
    pub fn rank(&self) -> usize {
        self.ctx.rank
    }

    /// The number of ranks (processes, or thread ranks): 1 for `single`,
    /// `dp` and `pipeline`, which spread inside one.
    pub fn world_size(&self) -> usize {
        self.ctx.world_size
    }

    /// Which share of the data this rank trains on, in
    /// `0..data_parallel_size()`: its rank, except with `pipeline-ranks`,
    /// where every rank of one pipeline trains on the same batch (its
    /// replica's number). [`setup_dataloader`](Self::setup_dataloader)
    /// splits by it; a loop that picks its own rows should too (Lightning
    /// gives a model-parallel strategy's sampler the data-parallel rank
    /// likewise).
    pub fn data_parallel_rank(&self) -> usize {
        self.ctx.rank / self.config.ranks_per_data_share()
    }

    /// Into how many shares the data is split: the number of ranks, or of
    /// pipelines with `pipeline-ranks`.
    pub fn data_parallel_size(&self) -> usize {
        self.ctx.world_size / self.config.ranks_per_data_share()
    }

    /// Whether this is rank 0 (Fabric's `is_global_zero`, Accelerate's
    /// `is_main_process`).
    pub fn is_global_zero(&self) -> bool {
        self.ctx.rank == 0
    }

    /// This rank's devices: its replicas (`dp`), its stages (pipelines),
    /// or its one device.
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// Where this rank's batches go (Fabric's `device`): its first device,
    /// which is the master replica's (`dp`) and the first stage's
    /// (pipelines). [`setup_dataloader`](Self::setup_dataloader)'s batches
    /// are moved there; move tensors made by hand with [`to_device`](Self::to_device).
    pub fn device(&self) -> &Device {
        // Every rank has at least one device: `launch` refuses zero.
        &self.devices[0]
    }

    /// `tensor` on this rank's [`device`](Self::device) (Fabric's `to_device`).
    pub fn to_device(&self, tensor: &Tensor) -> Result<Tensor> {
        Ok(tensor.to_device(self.device())?)
    }

    /// The group of the ranks, for the crate's collectives.
    pub fn process_group(&self) -> Arc<dyn ProcessGroup> {
        self.ctx.pg.clone()
    }

    /// Seeds the initial weights and the data order of everything set up
    /// after it, the same on every rank (Fabric's `seed_everything`):
    /// candle's own CPU generator cannot be seeded, so the weights are
    /// drawn from a seeded generator instead ([`crate::seeded_varmap`]).
    pub fn seed_everything(&mut self, seed: u64) {
        self.config.seed = seed;
    }

    /// Prints `message` on rank 0 only (Fabric's `print`).
    pub fn print(&self, message: impl fmt::Display) {
        if self.is_global_zero() {
            println!("{message}");
        }
    }

    /// Waits until every rank has arrived (Fabric's `barrier`,
    /// Accelerate's `wait_for_everyone`).
    pub fn barrier(&self) -> Result<()> {
        Ok(self.ctx.pg.barrier()?)
    }

    /// The element-wise reduction of `tensor` over every rank.
    pub fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
        Ok(self.ctx.pg.all_reduce(tensor, op)?)
    }

    /// The mean of a scalar (a loss) over every rank, as an f32.
    pub fn all_reduce_mean(&self, scalar: &Tensor) -> Result<f32> {
        let x = scalar
            .to_dtype(DType::F32)?
            .reshape(1)?
            .to_device(&Device::Cpu)?;
        let sum = self.ctx.pg.all_reduce(&x, ReduceOp::Sum)?;
        Ok(sum.to_vec1::<f32>()?[0] / self.world_size() as f32)
    }

    /// The mean of a per-row mean (a loss over this rank's `rows` rows)
    /// over every rank's rows: the ranks weighted by their rows, in f64,
    /// as one device computing on the whole global batch reports it.
    pub fn global_mean(&self, value: &Tensor, rows: usize) -> Result<f32> {
        let value = value
            .to_dtype(DType::F64)?
            .to_device(&Device::Cpu)?
            .to_scalar::<f64>()?;
        let rows = rows as f64;
        let mine = Tensor::new(&[value * rows, rows], &Device::Cpu)?;
        let sums = self
            .ctx
            .pg
            .all_reduce(&mine, ReduceOp::Sum)?
            .to_vec1::<f64>()?;
        Ok(match sums.as_slice() {
            &[weighted, total] if total > 0.0 => (weighted / total) as f32,
            _ => f32::NAN,
        })
    }

    /// Every rank's `tensor`, in rank order.
    pub fn all_gather(&self, tensor: &Tensor) -> Result<Vec<Tensor>> {
        Ok(self.ctx.pg.all_gather(tensor)?)
    }

    /// Every rank's `value` (any serde value), in rank order.
    pub fn all_gather_object<T: Serialize + DeserializeOwned>(&self, value: &T) -> Result<Vec<T>> {
        Ok(all_gather_object(self.ctx.pg.as_ref(), value)?)
    }

    /// Rank `root`'s `tensor` on every rank.
    pub fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Tensor> {
        Ok(self.ctx.pg.broadcast(tensor, root)?)
    }

    /// Builds `module` for the strategy on this rank's devices, its initial
    /// weights drawn from the run's seed (the same on every rank and for
    /// every strategy), and the optimizer `make` over the variables the
    /// strategy steps: the whole model, or this rank's pieces (`zero1`,
    /// `zero2`, `fsdp`). Fabric's `setup(model, optimizer)`. Every rank must
    /// call it.
    ///
    /// ```
    /// use candle_dp::fabric::{Fabric, FabricConfig, ModelRecipe, Strategy};
    /// use candle_dp::optim::{Sgd, SgdConfig};
    /// use candle_nn::linear;
    ///
    /// // FSDP works unit by unit: a plain module is refused, naming both.
    /// let err = Fabric::launch(FabricConfig::new(Strategy::Fsdp, 2), |fabric| {
    ///     let module = ModelRecipe::module(|vb| linear(4, 2, vb));
    ///     Ok(fabric.setup(module, |p| Sgd::new_named(p, SgdConfig { lr: 0.1, ..Default::default() }))?.steps())
    /// })
    /// .unwrap_err();
    /// assert!(err.to_string().contains("strategy fsdp"));
    /// assert!(err.to_string().contains("plain module"));
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Strategy`] when the strategy needs units and `module` is
    /// a plain module; the engine's construction errors (ranks whose
    /// models differ, named); `make`'s.
    pub fn setup<O, F>(&self, module: ModelRecipe, make: F) -> Result<FabricModel<O>>
    where
        O: StatefulOptimizer + 'static,
        F: FnOnce(Vec<(String, Var)>) -> candle_core::Result<O>,
    {
        let strategy = self.strategy();
        module.check_serves(strategy, self.config.overlaps())?;
        let varmap = self.initial_varmap(&module)?;
        let setup = self.engine_setup(&varmap, &module);
        let engine = strategies::build(&setup, make)?;
        self.model_around(strategies::with_tensor_parallel(engine, &setup))
    }

    /// [`setup`](Self::setup) with a strategy of the caller's own: `build`
    /// makes its [`Engine`] (the model and the optimizer) from what the
    /// run gives, and the Fabric's loop drives it as any strategy's
    /// (accumulation, loss scaling, clipping, schedules, saving). See
    /// [`Engine`] for an example. Every rank must call it.
    ///
    /// # Errors
    ///
    /// `build`'s; the initial weights cannot be drawn.
    pub fn setup_engine<O, B>(&self, module: ModelRecipe, build: B) -> Result<FabricModel<O>>
    where
        O: StatefulOptimizer + 'static,
        B: FnOnce(EngineSetup<'_>) -> Result<Box<dyn Engine<O>>>,
    {
        let varmap = self.initial_varmap(&module)?;
        let engine = build(self.engine_setup(&varmap, &module))?;
        let setup = self.engine_setup(&varmap, &module);
        self.model_around(strategies::with_tensor_parallel(engine, &setup))
    }

    /// What a strategy is built from on this rank.
    fn engine_setup<'a>(
        &'a self,
        varmap: &'a candle_nn::VarMap,
        module: &'a ModelRecipe,
    ) -> EngineSetup<'a> {
        EngineSetup {
            config: &self.config,
            pg: self.data_group(),
            mesh: &self.mesh,
            devices: &self.devices,
            varmap,
            module,
            tensor_parallel: self.tensor_parallel().cloned(),
        }
    }

    /// The Fabric's model around a strategy's engine.
    fn model_around<O: StatefulOptimizer>(
        &self,
        engine: Box<dyn Engine<O>>,
    ) -> Result<FabricModel<O>> {
        let params = engine.trainables().vars().to_vec();
        if self.config.deterministic.is_some() {
            // Each chunk would update batch statistics in turn: one device
            // and several ranks would end with different ones.
            let data = lock(engine.trainables().varmap().data());
            let mut names: Vec<&String> = data.keys().collect();
            names.sort();
            if let Some(name) = names.into_iter().find(|n| is_batch_norm_buffer(n)) {
                return Err(Error::Config(format!(
                    "deterministic training: the model keeps batch statistics (`{name}`), which \
                     each chunk would update in turn; use a normalisation without running \
                     statistics (LayerNorm, GroupNorm), or train without deterministic"
                )));
            }
        }
        let order = StepOrder::new(self.config.precision.scales_loss(), self.config.init_scale)?;
        Ok(FabricModel {
            strategy: self.strategy(),
            engine,
            order,
            pg: self.ctx.pg.clone(),
            params,
            accumulation_steps: self.config.accumulation_steps,
            gradient_clip: self.config.gradient_clip,
            micro: 0,
            holding_sync: false,
            pending: None,
            grads: None,
            unscaled: false,
            clipped: false,
            steps: 0,
            grad_bytes: 0,
            checkpoint_dir: self.config.checkpoint_dir.clone(),
            keep: self.config.keep,
            seed: self.config.seed,
            precision: self.config.precision,
            deterministic: self
                .config
                .deterministic
                .map(|chunks| ChunkedStep::new(chunks, self.data_group())),
            data_rank: self.data_parallel_rank(),
        })
    }

    /// The ranks the strategy runs over (with tensor parallelism, those
    /// holding the same pieces).
    fn data_group(&self) -> Arc<dyn ProcessGroup> {
        match &self.tensor_parallel {
            Some((_, data)) => Arc::clone(data),
            None => self.ctx.pg.clone(),
        }
    }

    /// The model's initial values, drawn from the run's seed so that every
    /// strategy and every rank starts from the same weights. On several
    /// distinct devices (a pipeline over GPUs) the engine creates them on
    /// each stage's device instead, and DDP copies rank 0's to every rank.
    fn initial_varmap(&self, module: &ModelRecipe) -> Result<candle_nn::VarMap> {
        let first = &self.devices[0];
        if self.devices.iter().any(|d| !d.same_device(first)) {
            return Ok(candle_nn::VarMap::new());
        }
        let whole = module.whole();
        let pieces = match (self.tensor_parallel(), module.tp_plan()) {
            (None, _) => None,
            (Some(tp), Some(plan)) => Some(crate::seeded_init::Pieces {
                plan,
                rank: tp.rank(),
                tp: tp.size(),
            }),
            (Some(tp), None) => {
                return Err(Error::TensorParallel(format!(
                    "the mesh has tp = {}, and the model gives no plan: build its pieces with \
                     Fabric::tensor_parallel and give their placements with \
                     ModelRecipe::with_tp_plan",
                    tp.size()
                )))
            }
        };
        let varmap = crate::seeded_init::seeded_pieces(
            self.config.seed,
            DType::F32,
            first,
            pieces,
            |vb| -> candle_core::Result<Units> { whole(vb) },
        )?;
        if let (Some(_), Some(plan)) = (self.tensor_parallel(), module.tp_plan()) {
            let names: Vec<String> = lock(varmap.data()).keys().cloned().collect();
            plan.check_names(names.iter().map(String::as_str))?;
        }
        Ok(varmap)
    }

    /// The ranks laid out in every degree, 1s included (the dimensions of
    /// [`RANK_MESH`]: `dp_replicate`, `dp_shard`, `pp`, `tp`), over the
    /// job's ranks: the groups every strategy takes are its dimensions.
    /// A loop can reduce over one of them itself, as torchtitan's over
    /// its world mesh.
    pub fn mesh(&self) -> &DeviceMesh {
        &self.mesh
    }

    /// This rank's tensor parallelism, when the mesh has a `tp` degree
    /// above 1: the model's factories build their pieces with it.
    pub fn tensor_parallel(&self) -> Option<&TensorParallel> {
        self.tensor_parallel.as_ref().map(|(tp, _)| tp)
    }

    /// [`setup_dataloader`](Self::setup_dataloader) given the global
    /// batch, the step's (Lightning's and Accelerate's batch size is a
    /// process's): each data share takes `global_batch /
    /// data_parallel_size()` samples (at least 1) with `options`' sharding;
    /// under deterministic training (a [`FabricConfig::deterministic`])
    /// each rank its consecutive part of every global batch
    /// ([`Sharding::split_batches`]), which the chunks need.
    ///
    /// # Errors
    ///
    /// As [`setup_dataloader`](Self::setup_dataloader).
    pub fn setup_global_dataloader(
        &self,
        dataset: Arc<dyn Dataset>,
        global_batch: usize,
        options: DataOptions,
    ) -> Result<FabricLoader> {
        match self.config.deterministic {
            Some(_) => {
                let options = DataOptions {
                    sharding: Sharding::split_batches(),
                    ..options
                };
                self.setup_dataloader(dataset, global_batch, options)
            }
            // Split batches take the global batch and cut it themselves.
            None if matches!(
                options.sharding,
                Sharding::BatchWise {
                    split_batches: true,
                    ..
                }
            ) =>
            {
                self.setup_dataloader(dataset, global_batch, options)
            }
            None => {
                let share = (global_batch / self.data_parallel_size()).max(1);
                self.setup_dataloader(dataset, share, options)
            }
        }
    }

    /// This rank's loader over `dataset`, `batch_size` samples per batch
    /// on each rank (as a PyTorch `DataLoader` in each process), sharded
    /// as `options.sharding` says (Fabric's `setup_dataloaders`,
    /// Accelerate's `prepare`). Shuffling is seeded with the run's seed.
    /// With `single`, `dp` and `pipeline` (one rank) the batch is the whole
    /// step's, which the replicas or the micro-batches split.
    pub fn setup_dataloader(
        &self,
        dataset: Arc<dyn Dataset>,
        batch_size: usize,
        options: DataOptions,
    ) -> Result<FabricLoader> {
        if let Some(chunks) = self.config.deterministic {
            let split = matches!(
                options.sharding,
                Sharding::BatchWise {
                    split_batches: true,
                    ..
                }
            );
            if !split {
                return Err(Error::Config(format!(
                    "deterministic training cuts each global batch into {chunks} chunks of \
                     consecutive rows, each rank taking its consecutive share: give \
                     Sharding::BatchWise {{ split_batches: true, .. }} (the sharding is {:?})",
                    options.sharding
                )));
            }
            if batch_size == 0 || !batch_size.is_multiple_of(chunks) {
                return Err(Error::Config(format!(
                    "deterministic training: the global batch of {batch_size} rows does not cut \
                     into {chunks} chunks; give a batch size {chunks} divides"
                )));
            }
        }
        if let Sharding::BatchWise {
            even_batches: false,
            ..
        } = options.sharding
        {
            if self.data_parallel_size() > 1 && !options.drop_last {
                return Err(Error::Config(format!(
                    "even_batches false gives the {} ranks different numbers of batches, and a \
                     rank with one more would wait in a collective the others never join: keep \
                     even_batches (Accelerate's default) or drop_last",
                    self.data_parallel_size()
                )));
            }
        }
        FabricLoader::for_rank(
            dataset,
            batch_size,
            options,
            self.data_parallel_rank(),
            self.data_parallel_size(),
            self.config.seed,
        )
        .map(|loader| loader.on_device(self.device().clone()))
    }
}

/// Rank `rank`'s devices: its replicas, its stages, or its one device.
fn rank_devices(config: &FabricConfig, rank: usize) -> Result<Vec<Device>> {
    let per_rank = config.devices_per_rank();
    match config.accelerator {
        config::Accelerator::Cpu => Ok(vec![Device::Cpu; per_rank]),
        config::Accelerator::Cuda => {
            let ordinals = config.devices.ordinals();
            // Under mpirun `rank` is the process's local rank: a process
            // beyond the devices listed is refused, not put on a GPU
            // another process drives.
            if (rank + 1) * per_rank > ordinals.len() {
                return Err(Error::Strategy {
                    strategy: config.effective_strategy().name().into(),
                    reason: format!(
                        "the process of local rank {rank} needs {per_rank} device(s) past the \
                         {} listed ({:?}): give each process of this machine its own",
                        ordinals.len(),
                        ordinals
                    ),
                });
            }
            // One device per GPU: two devices of one GPU would be two
            // streams nothing orders (Error::TwoStreamsOfOneGpu), so
            // replicas or stages listed on the same GPU share its device.
            let mut opened: Vec<(usize, Device)> = Vec::new();
            (0..per_rank)
                .map(|k| {
                    let ordinal = ordinals[(rank * per_rank + k) % ordinals.len()];
                    if let Some((_, device)) = opened.iter().find(|(o, _)| *o == ordinal) {
                        return Ok(device.clone());
                    }
                    let device = cuda_device(config, ordinal)?;
                    opened.push((ordinal, device.clone()));
                    Ok(device)
                })
                .collect()
        }
    }
}

/// CUDA device `ordinal`, with one stream that every thread driving it
/// shares (see [`Error::ImplicitCudaStream`]).
fn cuda_device(config: &FabricConfig, ordinal: usize) -> Result<Device> {
    #[cfg(feature = "cuda")]
    {
        let _ = config;
        Device::new_cuda_with_stream(ordinal).map_err(|e| Error::Strategy {
            strategy: config.effective_strategy().name().into(),
            reason: format!("cannot open cuda:{ordinal}: {e}"),
        })
    }
    #[cfg(not(feature = "cuda"))]
    Err(Error::Strategy {
        strategy: config.effective_strategy().name().into(),
        reason: format!(
            "cuda:{ordinal} asked for, but candle-dp was built without its `cuda` feature"
        ),
    })
}

/// A device without the precision's kernels is refused before the run,
/// naming the strategy.
fn check_precision(strategy: Strategy, precision: Precision, device: &Device) -> Result<()> {
    precision
        .check_on(device)
        .map_err(|reason| Error::Strategy {
            strategy: strategy.name().into(),
            reason,
        })
}
