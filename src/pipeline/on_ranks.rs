//! A pipeline whose stages live on the ranks of a group (processes,
//! machines): [`RankPipeline`], PyTorch's `torch.distributed.pipelining`
//! (`PipelineStage` and a schedule) on candle-dp's groups.
//!
//! Each rank builds and runs only its own stages, with the in-process
//! pipeline's stage work (the same schedules, activation checkpointing,
//! deferred BatchNorm), talking to the neighbouring ranks' stages with
//! `send` and `recv` instead of channels ([`link`](super::link)). For the
//! same split and schedule, the losses and gradients are the in-process
//! pipeline's, bit for bit.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;
use crossbeam::channel;

use super::balance::layers_per_stage;
use super::device_work::{stages_of, DeviceWork};
use super::link::{Flow, Inbox, Outbox, RankPort, Route};
use super::stage::{Doing, Links, LossFn, Stage, StageOutput, StageWork, TrainLoss};
use super::stage_build::build_stage;
use super::stage_var::StageVar;
use super::tied::tie_across_ranks;
use super::{Balance, Checkpoint, PipelineTimings, Schedule, UnitFactory};
use crate::comm::{all_gather_object, DeviceMesh, ProcessGroup, ReduceOp, ShardGroups, SubGroup};
use crate::ddp::ZeroStage;
use crate::error::{Error, Result};
use crate::precision::MixedPrecision;
use crate::sharding::ShardLayout;
use crate::step::LossReduction;
use crate::worker_pool::Cancel;

/// How a [`RankPipeline`] splits and runs the model. Every rank passes the
/// same.
#[derive(Debug, Clone)]
pub struct RankPipelineConfig {
    /// How many layers each stage gets (default [`Balance::Uniform`]).
    pub balance: Balance,
    /// Micro-batches per step (default: one per stage).
    pub chunks: Option<usize>,
    /// The schedule (default 1F1B); interleaved puts several stages on
    /// each rank, stage `k` on rank `k % ranks`.
    pub schedule: Schedule,
    /// Which micro-batches each stage recomputes before their backward.
    pub checkpoint: Checkpoint,
    /// The stages compute on low-precision copies of the variables (bf16
    /// or f16), their gradients kept in the variables' dtype, as the
    /// in-process pipeline's [`mixed_precision`](super::PipelineBuilder::mixed_precision);
    /// `None`: on the variables themselves.
    pub mixed_precision: Option<MixedPrecision>,
    /// On a mesh ([`RankPipeline::on_mesh`]), ZeRO across each stage's
    /// replicas: every variable split into one piece per replica, the
    /// optimizer state of this rank's pieces only (stage 1), and the
    /// gradients reduce-scattered to them instead of averaged whole (stage
    /// 2). Step with [`RankPipeline::zero_optimizer`]. `None` (default):
    /// the replicas average whole gradients, as DDP.
    pub zero: Option<ZeroStage>,
    /// On a mesh, FSDP across each stage's replicas (ZeRO stage 3): on top
    /// of ZeRO stage 2 (implied; stage 1 is refused), the variables
    /// themselves are held as pieces between steps: the `VarMap` and
    /// [`RankPipeline::variables`] hold this rank's piece of each, and
    /// each step all-gathers them, builds the stages over the whole
    /// values for its micro-batches, and drops them after its backward
    /// (torchtitan's FSDP on a pipeline, which does not reshard between
    /// micro-batches). Step any optimizer over the pieces. Default
    /// `false`.
    pub fsdp: bool,
    /// With [`fsdp`](Self::fsdp), hybrid sharding (HSDP) across each
    /// stage's replicas: the pieces split within groups of this many
    /// consecutive replicas (a mesh's `dp_shard`) and held alike by the
    /// groups (its `dp_replicate`): a gradient is reduce-scattered within
    /// the group, then each piece averaged across the groups. It must
    /// divide the replicas. `None` (default): every replica its own piece.
    pub shard_size: Option<usize>,
}

impl Default for RankPipelineConfig {
    fn default() -> Self {
        RankPipelineConfig {
            balance: Balance::Uniform,
            chunks: None,
            schedule: Schedule::OneFOneB,
            checkpoint: Checkpoint::Never,
            mixed_precision: None,
            zero: None,
            fsdp: false,
            shard_size: None,
        }
    }
}

/// What one rank's part of a step gives: the loss on the rank of the last
/// stage (its micro-batches' weighted losses summed), and the gradients of
/// this rank's stages' variables, for any candle optimizer over them.
#[derive(Debug)]
pub struct RankStep {
    /// The step's loss, on the rank that holds the last stage; `None`
    /// elsewhere.
    pub loss: Option<Tensor>,
    /// This rank's variables' gradients, accumulated over the
    /// micro-batches.
    pub grads: GradStore,
}

/// One rank's part of a pipeline whose stages are spread over the ranks
/// of `pg`: with `R` ranks and `v` stages per rank (interleaved), stage `k`
/// of `R·v` lives on rank `k % R`. The rank of stage 0 feeds the input,
/// the rank of the last stage the targets and computes the loss;
/// activations go forward and gradients backward between neighbouring
/// ranks, point to point.
///
/// Each rank builds only its own stages' layers (the whole model never
/// exists on one rank) in `varmap`: its optimizer steps those. The layers
/// are built on this thread and stay on it (they need not be `Send`).
///
/// A failure on any rank (a layer's error, a lost rank, the group's
/// timeout) fails the group, and every rank's step returns an error naming
/// the stage.
///
/// ```
/// use candle_core::{DType, Device, Tensor, Var};
/// use candle_dp::launch::spawn;
/// use candle_dp::pipeline::{unit, RankPipeline, RankPipelineConfig};
/// use candle_dp::LossReduction;
/// use candle_nn::{linear, loss, Activation, Optimizer, VarMap, SGD};
///
/// spawn(2, |ctx| {
///     let layers = vec![
///         unit(|vb| linear(4, 8, vb.pp("a"))),
///         unit(|_| Ok(Activation::Relu)),
///         unit(|vb| linear(8, 2, vb.pp("b"))),
///     ];
///     let varmap = VarMap::new();
///     let pipe = RankPipeline::new(ctx.process_group(), &varmap, DType::F32, &Device::Cpu,
///         layers, RankPipelineConfig { chunks: Some(3), ..Default::default() })?;
///     let mut sgd = SGD::new(varmap.all_vars(), 0.1)?;
///     let x = Tensor::randn(0f32, 1., (6, 4), &Device::Cpu)?;
///     let y = Tensor::new(&[0u32, 1, 0, 1, 0, 1], &Device::Cpu)?;
///     // Rank 0 holds the first stage (the input), rank 1 the last (the targets).
///     let (input, targets) = ((ctx.rank == 0).then_some(&x), (ctx.rank == 1).then_some(&y));
///     let step = pipe.forward_backward(input, targets, LossReduction::Mean,
///         |out, y| loss::cross_entropy(out, y))?;
///     assert_eq!(step.loss.is_some(), ctx.rank == 1);
///     sgd.step(&step.grads)?;
///     Ok(())
/// })?;
/// # Ok::<(), anyhow::Error>(())
/// ```
pub struct RankPipeline {
    pub(super) pg: Arc<dyn ProcessGroup>,
    port: Arc<RankPort>,
    pub(super) device: Device,
    /// This rank's stages, in the order of `indices`.
    pub(super) held: Vec<Stage>,
    /// Their numbers in the pipeline.
    indices: Vec<usize>,
    /// The `VarMap`'s variables these stages use, each once, by name.
    pub(super) own: Vec<(String, Var)>,
    /// The `VarMap`'s buffers (BatchNorm statistics) these stages update,
    /// each once, by name.
    pub(super) buffers: Vec<(String, Var)>,
    /// Layers per stage.
    balance: Vec<usize>,
    pub(super) config: RankPipelineConfig,
    /// The variables this rank shares with stages on other ranks (tied
    /// weights), by name, sorted, each with the group of the ranks that
    /// use it.
    pub(super) tied: Vec<(String, SubGroup)>,
    /// On a mesh: the replicas of this rank's stages (the same stages on
    /// other pipelines), across which the gradients are averaged.
    pub(super) replicas: Option<SubGroup>,
    /// With ZeRO or FSDP: the replicas this rank's pieces split over, and
    /// with hybrid sharding ([`RankPipelineConfig::shard_size`]) those
    /// holding the same pieces.
    pub(super) pieces: Option<ShardGroups>,
    /// On a mesh: every rank of it.
    pub(super) world: Option<Arc<dyn ProcessGroup>>,
    /// With FSDP: how this rank's stages are built again each step over
    /// the gathered variables (`held` is empty between steps).
    pub(super) rebuild: Option<Rebuild>,
    /// With ZeRO: each of [`own`](Self::own)'s split across the replicas
    /// of its piece group ([`pieces`](Self::pieces)' shard group).
    pub(super) zero_layouts: Vec<ShardLayout>,
    /// This rank's part of the latest successful step's timings.
    pub(super) timings: Mutex<PipelineTimings>,
}

impl std::fmt::Debug for RankPipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankPipeline")
            .field("rank", &self.pg.rank())
            .field("stages", &self.indices)
            .field("balance", &self.balance)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// With FSDP, what builds this rank's stages again each step.
pub(super) struct Rebuild {
    /// The dtype of the variables.
    pub(super) dtype: DType,
    /// Each stage's first layer and its layers, in the order of
    /// `indices`.
    pub(super) stages: Vec<(usize, Vec<UnitFactory>)>,
}

/// The ZeRO stage FSDP builds on: 2, the gradients reduce-scattered to the
/// pieces the variables are held in (stage 1 would keep whole gradients).
fn fsdp_zero_stage(zero: Option<ZeroStage>) -> Result<ZeroStage> {
    match zero {
        None | Some(ZeroStage::Two) => Ok(ZeroStage::Two),
        Some(ZeroStage::One) => Err(Error::Zero(
            "FSDP holds the variables as pieces and their gradients with them (ZeRO stage 2): \
             it cannot take zero: Some(ZeroStage::One); leave zero at None or Two"
                .into(),
        )),
    }
}

/// What every rank's pipeline must agree on.
#[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
struct Plan {
    layers: usize,
    balance: Vec<usize>,
    chunks: Option<usize>,
    schedule: String,
    checkpoint: String,
    precision: String,
    zero: String,
    fsdp: bool,
}

impl RankPipeline {
    /// Builds this rank's stages of `layers` on `device` (variables created
    /// in `varmap` where missing). Every rank of `pg` calls it with the
    /// same layers and configuration.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidBalance`] for a split that does not fit (fewer
    /// layers than stages, a wrong explicit balance);
    /// [`Error::ModelMismatch`] naming the first rank whose layers, split,
    /// schedule, micro-batches or checkpointing differ from rank 0's; a
    /// layer's factory failing.
    pub fn new(
        pg: Arc<dyn ProcessGroup>,
        varmap: &VarMap,
        dtype: DType,
        device: &Device,
        layers: Vec<UnitFactory>,
        config: RankPipelineConfig,
    ) -> Result<Self> {
        if config.zero.is_some() || config.fsdp {
            return Err(Error::Zero(
                "ZeRO and FSDP split each stage across its replicas: build the pipeline on a \
                 mesh (RankPipeline::on_mesh)"
                    .into(),
            ));
        }
        Self::build(pg, varmap, dtype, device, layers, config)
    }

    /// [`new`](Self::new), and the stages of a pipeline on a mesh.
    fn build(
        pg: Arc<dyn ProcessGroup>,
        varmap: &VarMap,
        dtype: DType,
        device: &Device,
        layers: Vec<UnitFactory>,
        config: RankPipelineConfig,
    ) -> Result<Self> {
        let ranks = pg.world_size();
        let stages = ranks * config.schedule.stages_per_device().max(1);
        let balance = layers_per_stage(&config.balance, &layers, stages, dtype, device);
        let plan = Plan {
            layers: layers.len(),
            balance: balance.as_ref().map_or_else(|_| Vec::new(), Clone::clone),
            chunks: config.chunks,
            schedule: format!("{:?}", config.schedule),
            checkpoint: format!("{:?}", config.checkpoint),
            precision: format!("{:?}", config.mixed_precision),
            zero: format!("{:?}", config.zero),
            fsdp: config.fsdp,
        };
        let plans = all_gather_object(pg.as_ref(), &plan)?;
        if let Some(rank) = plans.iter().position(|p| p != &plans[0]) {
            return Err(Error::ModelMismatch {
                rank,
                detail: format!(
                    "asks for another pipeline: {:?}, where rank 0 asks for {:?}",
                    plans[rank], plans[0]
                ),
            });
        }
        let balance = balance?;
        if config.chunks == Some(0) {
            return Err(Error::Candle(candle_core::Error::Msg(
                "a pipeline step needs at least one micro-batch".into(),
            )));
        }
        let rank = pg.rank();
        let indices: Vec<usize> = stages_of(rank, ranks, stages).collect();
        let mut held = Vec::with_capacity(indices.len());
        for &k in &indices {
            let first: usize = balance[..k].iter().sum();
            let factories = &layers[first..first + balance[k]];
            held.push(build_stage(
                varmap,
                dtype,
                config.mixed_precision.as_ref(),
                device,
                first,
                factories,
            )?);
        }
        let own = named_once(held.iter().flat_map(|s| &s.vars));
        let buffers = named_once(held.iter().flat_map(|s| &s.buffers));
        let tied = tie_across_ranks(pg.as_ref(), &own)?;
        Ok(RankPipeline {
            port: Arc::new(RankPort::new(Arc::clone(&pg))),
            pg,
            device: device.clone(),
            held,
            indices,
            own,
            buffers,
            balance,
            config,
            tied,
            replicas: None,
            pieces: None,
            world: None,
            rebuild: None,
            zero_layouts: Vec::new(),
            timings: Mutex::new(PipelineTimings::default()),
        })
    }

    /// A pipeline on a two-dimensional mesh (pp x dp, each pipeline
    /// replicated by data parallelism): `dims` = `(pp, dp)`, the stages
    /// along dimension `pp`, replicated along `dp`. Each pipeline trains on its share of the
    /// global batch; after each step's backward every stage's gradients
    /// are averaged across its replicas (and the last stages' losses), so
    /// the weights are those of one pipeline on the whole batch (with a
    /// mean loss and equal shares). The replicas start from the values of
    /// the first pipeline (`dp` coordinate 0), and each step from its
    /// buffers (BatchNorm statistics: DDP's `broadcast_buffers`), which
    /// every replica then updates with its own rows. With
    /// [`zero`](RankPipelineConfig::zero), the replicas split each stage's
    /// optimizer state (and at stage 2 its gradients) instead; with
    /// [`fsdp`](RankPipelineConfig::fsdp) its variables too, between steps.
    /// Every rank of the mesh calls it, with the same configuration.
    ///
    /// # Errors
    ///
    /// As [`new`](Self::new); a dimension the mesh does not have.
    pub fn on_mesh(
        mesh: &DeviceMesh,
        dims: (&str, &str),
        varmap: &VarMap,
        dtype: DType,
        device: &Device,
        layers: Vec<UnitFactory>,
        mut config: RankPipelineConfig,
    ) -> Result<Self> {
        let (pp, dp) = dims;
        let stages = Arc::clone(mesh.group(pp)?);
        let replicas = Arc::clone(mesh.group(dp)?);
        if config.fsdp {
            config.zero = Some(fsdp_zero_stage(config.zero)?);
        }
        // The replicas must split alike, or their collectives would not
        // pair up (the stage ranks compare the rest of the plan).
        let split = (format!("{:?}", config.zero), config.fsdp, config.shard_size);
        let splits = all_gather_object(mesh.world().as_ref(), &split)?;
        if let Some(rank) = splits.iter().position(|s| s != &splits[0]) {
            return Err(Error::ModelMismatch {
                rank,
                detail: format!(
                    "splits its stages across the replicas as (zero, fsdp, shard_size) = {:?}, \
                     where rank 0 asks for {:?}",
                    splits[rank], splits[0]
                ),
            });
        }
        let factories = config.fsdp.then(|| layers.clone());
        let pieces = Self::piece_groups(mesh.world(), &replicas, &config)?;
        let mut pipe = Self::build(stages, varmap, dtype, device, layers, config)?;
        for (_, var) in pipe.own.iter().chain(&pipe.buffers) {
            var.set(&replicas.broadcast(var.as_tensor(), 0)?)?;
        }
        if pipe.config.zero.is_some() {
            // One piece per rank of the group the pieces split over.
            let n = pieces.as_ref().map_or(1, |g| g.shard().world_size());
            pipe.zero_layouts = pipe
                .own
                .iter()
                .map(|(_, var)| ShardLayout::new(var.dims(), n))
                .collect();
        }
        pipe.replicas = Some(replicas);
        pipe.pieces = pieces;
        pipe.world = Some(Arc::clone(mesh.world()));
        if let Some(factories) = factories {
            pipe.shard_at_rest(varmap, dtype, &factories)?;
        }
        Ok(pipe)
    }

    /// The pipeline's stages in all.
    pub(super) fn stages(&self) -> usize {
        self.balance.len()
    }

    /// The rank that holds stage `k`.
    pub(super) fn owner(&self, k: usize) -> usize {
        k % self.pg.world_size().max(1)
    }

    /// The numbers of this rank's stages.
    pub fn stages_held(&self) -> &[usize] {
        &self.indices
    }

    /// Layers per stage.
    pub fn balance(&self) -> &[usize] {
        &self.balance
    }

    /// The names of the variables this rank's stages use (what its
    /// optimizer steps and its checkpoint holds), sorted. With
    /// [`fsdp`](RankPipelineConfig::fsdp) the variables are this rank's
    /// pieces of them.
    pub fn variable_names(&self) -> Vec<String> {
        self.own.iter().map(|(name, _)| name.clone()).collect()
    }

    /// The variables this rank's stages use, by name, sorted: what its
    /// optimizer steps (the gradients of [`RankStep`] are keyed by them).
    /// With [`fsdp`](RankPipelineConfig::fsdp), this rank's pieces of them
    /// (the `VarMap` holds the same pieces under the same names; any
    /// variable of other stages the caller's `VarMap` held stays as it
    /// was).
    pub fn variables(&self) -> &[(String, Var)] {
        &self.own
    }

    /// The buffers (BatchNorm statistics) this rank's stages update, by
    /// name, sorted.
    pub fn buffers(&self) -> &[(String, Var)] {
        &self.buffers
    }

    /// The group of this pipeline's ranks (on a mesh, the `pp` group).
    pub fn group(&self) -> &Arc<dyn ProcessGroup> {
        &self.pg
    }

    /// On a mesh, which replica of the pipeline this rank's is (its `dp`
    /// coordinate); 0 otherwise.
    pub fn replica_rank(&self) -> usize {
        self.replicas.as_ref().map_or(0, |r| r.rank())
    }

    /// The model's output for `x` (given on the rank of the first stage),
    /// the micro-batches run forward through the stages (in evaluation
    /// mode unless `train`): on the rank of the last stage, `None`
    /// elsewhere ([`from_last_stage`](Self::from_last_stage) gives it to
    /// every rank), detached from the stages. The buffers (BatchNorm
    /// statistics) change only in `train` mode. Every rank of the pipeline
    /// calls it; with [`fsdp`](RankPipelineConfig::fsdp), which gathers the
    /// variables first, every rank of the mesh.
    ///
    /// # Errors
    ///
    /// On every rank alike: no input on the first stage's rank; then a
    /// stage's failure on any rank (with FSDP, its stages failing to
    /// build), after which the group is failed.
    pub fn forward_t(&self, x: Option<&Tensor>, train: bool) -> Result<Option<Tensor>> {
        let sizes = self.micro_batch_sizes(x, None)?;
        let inputs = self.first_stage_inputs(x, &sizes)?;
        let gathered = self.gather_stages()?;
        let held = gathered.as_ref().map_or(&self.held, |g| &g.stages);
        let outputs = self.run(held, inputs, &mut None, sizes.len(), false, train)?;
        self.every_rank_ran()?;
        let mut last = None;
        let mut buffers = Vec::new();
        for (&k, out) in self.indices.iter().zip(outputs) {
            buffers.extend(out.buffers);
            if k + 1 == self.stages() {
                // Detached: the graph would hold the stages' variables (with
                // FSDP the step's whole ones) as long as the output lives.
                last = Some(match out.outputs.as_slice() {
                    [only] => only.detach(),
                    all => Tensor::cat(all, 0)?.detach(),
                });
            }
        }
        for (var, value) in buffers {
            var.set(&value)?;
        }
        Ok(last)
    }

    /// One training step: `x` on the rank of the first stage, `y` on the
    /// rank of the last (the others pass `None`; what they pass is not
    /// used). The batch is split into `torch.chunk` micro-batches; with
    /// [`LossReduction::Mean`] each micro-batch's loss is weighted by its
    /// share of the rows, so the gradients are the whole batch's.
    ///
    /// # Errors
    ///
    /// On every rank alike: no input on the first stage's rank, no targets
    /// on the last one's, or targets of another length than the input;
    /// then, a stage's failure on any rank ([`Error::Stage`] naming the
    /// stage, the micro-batch and the phase), after which the group is
    /// failed. The buffers (BatchNorm statistics) change only when the
    /// step succeeds.
    pub fn forward_backward<F>(
        &self,
        x: Option<&Tensor>,
        y: Option<&Tensor>,
        reduction: LossReduction,
        loss_fn: F,
    ) -> Result<RankStep>
    where
        F: Fn(&Tensor, &Tensor) -> candle_core::Result<Tensor> + Send + Sync + 'static,
    {
        let last_rank = self.owner(self.stages() - 1);
        let sizes = self.micro_batch_sizes(x, Some(y))?;
        // On a mesh each step starts from the first replica's statistics,
        // as DDP's forward starts from rank 0's buffers.
        if let Some(replicas) = &self.replicas {
            for (_, var) in &self.buffers {
                var.set(&replicas.broadcast(var.as_tensor(), 0)?)?;
            }
        }
        let rows: usize = sizes.iter().sum();
        let inputs = self.first_stage_inputs(x, &sizes)?;
        let mut loss = match y.filter(|_| self.pg.rank() == last_rank) {
            Some(y) => Some(TrainLoss {
                loss_fn: Arc::new(loss_fn) as Arc<LossFn>,
                targets: Self::split_rows(y, &sizes)?,
                shares: sizes
                    .iter()
                    .map(|&n| match reduction {
                        LossReduction::Mean => n as f64 / rows as f64,
                        LossReduction::Sum => 1.0,
                    })
                    .collect(),
            }),
            None => None,
        };
        // With FSDP, the stages are built over the whole variables,
        // gathered for this step and dropped at its end.
        let gathered = self.gather_stages()?;
        let (held, wholes) = match &gathered {
            Some(g) => (&g.stages, &g.wholes),
            None => (&self.held, &self.own),
        };
        let outputs = self.run(held, inputs, &mut loss, sizes.len(), true, true)?;
        self.every_rank_ran()?;
        let mut grads = GradStore::default();
        let mut buffers = Vec::new();
        let mut losses = Vec::new();
        for (stage, out) in held.iter().zip(outputs) {
            for (var, grad) in stage.vars.iter().zip(out.grads) {
                let Some(grad) = grad else { continue };
                // A variable of two of this rank's stages gets the sum.
                let sum = match grads.get(var.master.as_tensor()) {
                    Some(earlier) => (earlier + grad)?,
                    None => grad,
                };
                grads.insert(var.master.as_tensor(), sum);
            }
            buffers.extend(out.buffers);
            losses.extend(out.losses);
        }
        // A weight tied across ranks gets the sum of every rank's gradient
        // (in rank order, the stages' order for two ranks), as a weight
        // shared by stages in one process does.
        for (name, group) in &self.tied {
            let Some((_, var)) = wholes.iter().find(|(n, _)| n == name) else {
                continue;
            };
            let mine = match grads.get(var.as_tensor()) {
                Some(g) => g.clone(),
                None => var.zeros_like()?,
            };
            let sum = group.all_reduce(&mine, ReduceOp::Sum)?;
            grads.insert(var.as_tensor(), sum);
        }
        // On a mesh: every gradient averaged over the stage's replicas (or
        // reduce-scattered to this rank's pieces), and the last stages'
        // losses.
        if let Some(replicas) = &self.replicas {
            self.reduce_across_replicas(replicas, wholes, &mut grads)?;
        }
        let loss = match losses.split_first() {
            Some((first, rest)) => Some(rest.iter().try_fold(first.clone(), |sum, l| sum + l)?),
            None => None,
        };
        let loss = match (&self.replicas, loss) {
            (Some(replicas), Some(loss)) => Some(replicas.all_reduce(&loss, ReduceOp::Avg)?),
            (_, loss) => loss,
        };
        // The step succeeded on this rank: its statistics are committed.
        for (var, value) in buffers {
            var.set(&value)?;
        }
        Ok(RankStep { loss, grads })
    }

    /// Returns once every rank of the pipeline has run its part of the
    /// step, or the group's failure. A rank's own tasks can all be done
    /// while another's are still running (the last stage's, once it has
    /// sent its last gradient): without this, it would return `Ok` from a
    /// step that failed on another rank, and its caller would step alone.
    /// A failing rank fails the group before it returns, so the wait here
    /// ends with that failure on every other rank.
    fn every_rank_ran(&self) -> Result<()> {
        Ok(self.pg.barrier()?)
    }

    /// Runs this rank's tasks of a step on this thread (`training`: the
    /// forwards and backwards of a training step; otherwise the forwards
    /// only, the layers told `train`); a failure fails the group (so that
    /// the other ranks' waits end) and is returned named.
    fn run(
        &self,
        held: &[Stage],
        inputs: Vec<Tensor>,
        loss: &mut Option<TrainLoss>,
        chunks: usize,
        training: bool,
        train: bool,
    ) -> Result<Vec<StageOutput>> {
        let ranks = self.pg.world_size();
        let last = self.stages() - 1;
        let board = Arc::new(
            (0..self.stages())
                .map(|_| Mutex::new(Doing::NotStarted))
                .collect(),
        );
        // Neighbouring stages on this very rank (one rank, interleaved)
        // talk over channels: the boundary after stage `k`.
        let mut local: HashMap<usize, Boundary> = HashMap::new();
        for &k in self.indices.iter().filter(|&&k| k < last) {
            if self.owner(k + 1) == self.pg.rank() {
                local.insert(k, Boundary::new());
            }
        }
        let route = |peer: usize, flow: Flow, from_stage: usize| Route {
            port: Arc::clone(&self.port),
            peer,
            flow,
            from_stage,
        };
        let mut inputs = Some(inputs);
        let mut works = Vec::with_capacity(self.indices.len());
        for &k in &self.indices {
            let mut links = Links::default();
            if k > 0 {
                let prev = self.owner(k - 1);
                match local.get_mut(&(k - 1)) {
                    Some(boundary) => {
                        links.from_prev = boundary.activations.1.take();
                        links.grad_to_prev = boundary.gradients.0.take();
                    }
                    None => {
                        links.from_prev = Some(Inbox::Rank(route(prev, Flow::Activation, k - 1)));
                        links.grad_to_prev = Some(Outbox::Rank(route(prev, Flow::Gradient, k)));
                    }
                }
            }
            if k < last {
                let next = self.owner(k + 1);
                match local.get_mut(&k) {
                    Some(boundary) => {
                        links.to_next = boundary.activations.0.take();
                        links.grad_from_next = boundary.gradients.1.take();
                    }
                    None => {
                        links.to_next = Some(Outbox::Rank(route(next, Flow::Activation, k)));
                        links.grad_from_next =
                            Some(Inbox::Rank(route(next, Flow::Gradient, k + 1)));
                    }
                }
            }
            works.push(StageWork {
                index: k,
                chunks,
                device: self.device.clone(),
                inputs: if k == 0 {
                    inputs.take().unwrap_or_default()
                } else {
                    Vec::new()
                },
                links,
                board: Arc::clone(&board),
                training,
                loss: if k == last { loss.take() } else { None },
                train,
                checkpoint: self.config.checkpoint,
                computing_since: Cell::new(None),
                busy: Cell::new(Duration::ZERO),
                checking: Cell::new(Duration::ZERO),
            });
        }
        let work = DeviceWork {
            stages: works,
            tasks: match training {
                true => self.config.schedule.tasks(self.pg.rank(), ranks, chunks),
                false => self
                    .config
                    .schedule
                    .forward_tasks(self.pg.rank(), ranks, chunks),
            },
        };
        let started = std::time::Instant::now();
        match work.run(held, &Cancel::default()) {
            Ok(out) => {
                *crate::util::lock::lock(&self.timings) = PipelineTimings {
                    step: started.elapsed(),
                    busy: vec![out.busy],
                    checking: vec![out.checking],
                    peak_saved_bytes: vec![out.peak_saved_bytes],
                };
                Ok(out.stages)
            }
            Err(failed) => {
                let f = failed.failure;
                let error = Error::Stage {
                    stage: failed.stage,
                    device: format!("rank {}", self.pg.rank()),
                    micro_batch: f.micro_batch,
                    phase: f.phase.name(),
                    source: Box::new(f.source),
                };
                // The neighbours' waits end with the group's failure.
                self.pg.abort(&error.to_string());
                Err(error)
            }
        }
    }
}

/// The `VarMap`'s variables of `vars`, each once, by name.
fn named_once<'a>(vars: impl Iterator<Item = &'a StageVar>) -> Vec<(String, Var)> {
    let mut vars: Vec<(String, Var)> = vars.map(|v| (v.name.clone(), v.master.clone())).collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    vars.dedup_by(|a, b| a.0 == b.0);
    vars
}

/// The two channels between neighbouring stages of one rank, each end
/// taken once by its stage.
struct Boundary {
    activations: (Option<Outbox>, Option<Inbox>),
    gradients: (Option<Outbox>, Option<Inbox>),
}

impl Boundary {
    fn new() -> Self {
        let pair = || {
            let (tx, rx) = channel::unbounded();
            (Some(Outbox::Channel(tx)), Some(Inbox::Channel(rx)))
        };
        Boundary {
            activations: pair(),
            gradients: pair(),
        }
    }
}
