//! `DistributedDataParallel`: one persistent model per rank, gradients
//! averaged across ranks so every rank applies the identical update.
//!
//! Mirrors `torch.nn.parallel.DistributedDataParallel` over any
//! [`ProcessGroup`] (today the in-process [`ThreadGroup`](crate::comm::ThreadGroup),
//! one rank per thread):
//!
//! - at construction every rank's variable names and shapes are compared
//!   (an error names the rank and the variable that differ), then all values
//!   are broadcast from rank 0;
//! - each synchronised backward packs the gradients into buckets (cap
//!   configurable, default 25 MiB, first bucket 1 MiB), in a fixed order
//!   identical on every rank, and all-reduces them through a [`CommHook`]
//!   (plain average, or fp16 / bf16 compression);
//! - [`no_sync`](DistributedDataParallel::no_sync) accumulates gradients
//!   locally (decided at each step's forward, as in PyTorch); the next
//!   synchronised backward reduces the accumulated sum;
//! - buffers (BatchNorm statistics) are broadcast from rank 0 before every
//!   forward unless [`DdpConfig::broadcast_buffers`] is off (inside
//!   [`join`](DistributedDataParallel::join), from the highest rank still
//!   training);
//! - variables that got no gradient on some rank this step are reduced as
//!   zeros there (no hang, no corrupted average); variables that got no
//!   gradient on any rank get none, so optimizers skip them, as in PyTorch;
//! - [`join`](DistributedDataParallel::join) handles uneven inputs: a rank
//!   out of data keeps answering the others' collectives with zeros.
//!
//! Unlike PyTorch, the reduction does not overlap the backward pass: candle
//! computes all gradients in one call, with no per-gradient hook.
//!
//! With a *summed* (not averaged) loss, DDP gradients are `world_size` times
//! smaller than single-device training on the combined batch, exactly as in
//! PyTorch; use a mean loss (or scale) for equivalence.

use std::panic::{self, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Module, ModuleT, Optimizer, VarBuilder, VarMap};
use serde::{Deserialize, Serialize};

pub use crate::buckets::CommHook;
use crate::buckets::{make_buckets, Bucket, BucketReducer};
use crate::buffers::{is_batch_norm_buffer, BufferPredicate};
use crate::comm::{all_gather_object, ProcessGroup, ReduceOp};
use crate::ddp_timeline::{hidden_fraction, Span};
use crate::error::{Error, Result};
use crate::no_grad::NoGradCheck;
use crate::precision::{build_in_precision, cast_input, MixedPrecision};
use crate::replicate::ReplicaVars;
use crate::shard_layout::ShardLayout;
use crate::vars::{grads_of, sorted_vars};
use crate::zero::ZeroStage;

/// What to divide the gradient sum by while some ranks have joined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum JoinDivisor {
    /// The world size at construction: joined ranks count as zero
    /// gradients (PyTorch's `divide_by_initial_world_size=True`).
    #[default]
    InitialWorldSize,
    /// The number of ranks still training this step.
    ActiveRanks,
}

/// Settings of a [`DistributedDataParallel`].
#[derive(Clone)]
pub struct DdpConfig {
    /// Largest bucket, in bytes (default 25 MiB).
    pub bucket_cap_bytes: usize,
    /// Largest first bucket, in bytes (default 1 MiB), so the first
    /// reduction can start early once reduction overlaps backward.
    pub first_bucket_cap_bytes: usize,
    /// Broadcast buffers from rank 0 at construction and before every
    /// forward (default on; inside [`join`](DistributedDataParallel::join)
    /// from the highest rank still training). Off, buffers stay rank-local
    /// throughout, as with PyTorch's `broadcast_buffers=False`.
    pub broadcast_buffers: bool,
    /// How buckets are reduced (default [`CommHook::Average`]).
    pub comm_hook: CommHook,
    /// Divisor while ranks have joined (default the initial world size).
    pub join_divisor: JoinDivisor,
    /// Which variables are buffers (default BatchNorm statistics).
    pub is_buffer: BufferPredicate,
    /// Shard the optimizer state (and gradients) across ranks (default
    /// none): see [`crate::zero`].
    pub zero: Option<ZeroStage>,
    /// Compute in a low dtype over the master variables, and reduce the
    /// buckets in the policy's reduce dtype (default none): see
    /// [`crate::precision`]. Applies to models built by
    /// [`DistributedDataParallel::new`], not to
    /// [`from_module`](DistributedDataParallel::from_module).
    pub mixed_precision: Option<MixedPrecision>,
    /// The order in which parameters fill the buckets, by name (default
    /// none: sorted by name, or, for a model given as [`Units`](crate::units::Units), the
    /// reverse of the units' order, so that the buckets fill in the order
    /// the backward finishes their gradients, as PyTorch's reverse
    /// registration order does). Parameters not named follow, sorted.
    /// Naming a variable that is not a parameter is an error at
    /// construction.
    pub bucket_order: Option<Vec<String>>,
}

impl Default for DdpConfig {
    fn default() -> Self {
        Self {
            bucket_cap_bytes: 25 * 1024 * 1024,
            first_bucket_cap_bytes: 1024 * 1024,
            broadcast_buffers: true,
            comm_hook: CommHook::Average,
            join_divisor: JoinDivisor::InitialWorldSize,
            is_buffer: Arc::new(is_batch_norm_buffer),
            zero: None,
            mixed_precision: None,
            bucket_order: None,
        }
    }
}

impl std::fmt::Debug for DdpConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DdpConfig")
            .field("bucket_cap_bytes", &self.bucket_cap_bytes)
            .field("first_bucket_cap_bytes", &self.first_bucket_cap_bytes)
            .field("broadcast_buffers", &self.broadcast_buffers)
            .field("comm_hook", &self.comm_hook)
            .field("join_divisor", &self.join_divisor)
            .field("zero", &self.zero)
            .field("mixed_precision", &self.mixed_precision)
            .field("bucket_order", &self.bucket_order)
            .finish_non_exhaustive()
    }
}

/// Where the time of the latest synchronised backward went.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DdpTimings {
    /// The local backward pass. Around a
    /// [`Pipeline`](crate::pipeline::Pipeline), whose forwards and
    /// backwards interleave, the whole of its
    /// [`forward_backward`](crate::DistributedDataParallel::forward_backward).
    pub backward: Duration,
    /// Packing, all-reducing and unpacking the gradient buckets. With a
    /// model given as [`Units`](crate::units::Units), the time the communication thread spent
    /// on them, most of it while the backward still ran.
    pub all_reduce: Duration,
    /// With a model given as [`Units`](crate::units::Units)
    /// (`forward_backward`):
    /// the step's forward, each unit's backward, each bucket's reduction
    /// and the wait for the last ones, in order of their start; empty
    /// otherwise.
    pub timeline: Vec<Span>,
}

impl DdpTimings {
    /// The share of the reduction time hidden behind the backward (see
    /// [`timeline`](Self::timeline)): 1 when the backward never waited
    /// for a reduction. Without a timeline (a plain module, which reduces
    /// after its backward), 0.
    pub fn hidden_fraction(&self) -> f64 {
        if self.timeline.is_empty() {
            return 0.0;
        }
        hidden_fraction(&self.timeline)
    }
}

/// A variable as the construction-time check compares it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct VarSignature {
    name: String,
    shape: Vec<usize>,
    dtype: String,
    /// Which of the rank's devices holds it, by first appearance: buckets
    /// and broadcasts are made per device, so every rank must place the
    /// variables alike.
    device: usize,
}

/// Data parallelism across the ranks of a [`ProcessGroup`]: each rank holds
/// its own model and optimizer, and gradients are averaged across ranks.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_nn::{linear, loss, Module, Optimizer, VarMap, SGD};
/// use candle_dp::{launch::spawn, DdpConfig, DistributedDataParallel};
///
/// let weights = spawn(2, |ctx| {
///     let varmap = VarMap::new();
///     let mut ddp = DistributedDataParallel::new(ctx.process_group(), &varmap, DType::F32, &Device::Cpu,
///         |vb| linear(4, 2, vb), DdpConfig::default())?;
///     let mut sgd = SGD::new(varmap.all_vars(), 0.1)?;
///     // each rank its own shard of the data
///     let x = Tensor::full(ctx.rank as f32, (3, 4), &Device::Cpu)?;
///     let y = Tensor::new(&[0u32, 1, 0], &Device::Cpu)?;
///     let loss = loss::cross_entropy(&ddp.forward(&x)?, &y)?;
///     let grads = ddp.backward(&loss)?; // averaged across ranks
///     sgd.step(&grads)?;
///     let weight = varmap.data().lock().unwrap()["weight"].to_vec2::<f32>()?;
///     Ok(weight)
/// })?;
/// assert_eq!(weights[0], weights[1]); // every rank applied the same update
/// # Ok::<(), anyhow::Error>(())
/// ```
pub struct DistributedDataParallel<M> {
    module: M,
    pg: Arc<dyn ProcessGroup>,
    config: DdpConfig,
    params: Vec<(String, Var)>,
    buffers: Vec<(String, Var)>,
    buckets: Vec<Bucket>,
    /// Gradients accumulated under `no_sync`, one slot per parameter.
    accumulated: Option<Vec<Option<Tensor>>>,
    syncing: bool,
    /// Inside `join`: every forward first counts the ranks still training.
    joining: bool,
    /// Whether the step whose forward ran last synchronises, decided at
    /// that forward as PyTorch's reducer is prepared there: `no_sync` as it
    /// was then (inside `join`, what every rank agreed, which the joined
    /// ranks act on). `None` before the first forward.
    step_syncs: Option<bool>,
    /// Ranks that took part in the current step (set by a joining forward).
    active_ranks: usize,
    timings: DdpTimings,
    no_grad: NoGradCheck,
    /// Parameters without a gradient in the latest synchronised backward.
    without_grad: Vec<String>,
    /// With ZeRO: each parameter's split into pieces (empty without).
    zero_layouts: Vec<ShardLayout>,
    /// With mixed precision: the module's low-precision copies of the
    /// variables, refreshed before every forward.
    copies: Option<ReplicaVars>,
    /// A model given as units: buckets are reduced as the backward goes.
    overlaps: bool,
}

impl<M> DistributedDataParallel<M> {
    /// Builds this rank's model from `factory` on `device` (variables in
    /// `varmap`), checks that every rank built the same variables, and
    /// copies rank 0's values to every rank. Every rank must call it.
    /// [`builder`](Self::builder) gives the settings one at a time instead
    /// of as a [`DdpConfig`].
    pub fn new<F>(
        pg: Arc<dyn ProcessGroup>,
        varmap: &VarMap,
        dtype: DType,
        device: &Device,
        factory: F,
        config: DdpConfig,
    ) -> Result<Self>
    where
        F: FnOnce(VarBuilder) -> candle_core::Result<M>,
    {
        Self::build_with_order(pg, varmap, dtype, device, factory, config, |_| None)
    }

    /// [`new`](Self::new), where `order_of` gives the built model's own
    /// bucket order (a model given as [`Units`](crate::units::Units)) when the configuration
    /// names none.
    pub(crate) fn build_with_order<F>(
        pg: Arc<dyn ProcessGroup>,
        varmap: &VarMap,
        dtype: DType,
        device: &Device,
        factory: F,
        config: DdpConfig,
        order_of: impl FnOnce(&M) -> Option<Vec<String>>,
    ) -> Result<Self>
    where
        F: FnOnce(VarBuilder) -> candle_core::Result<M>,
    {
        let rank = pg.rank();
        let in_rank = |e: Error| Error::Rank {
            rank,
            source: Box::new(e),
        };
        let Some(policy) = config.mixed_precision.clone() else {
            let module = factory(VarBuilder::from_varmap(varmap, dtype, device))
                .map_err(|e| in_rank(Error::Candle(e)))?;
            let order = order_of(&module);
            return Self::wrap(pg, varmap, module, config, order);
        };
        let (module, copies) = build_in_precision(
            rank,
            varmap,
            dtype,
            device,
            &policy,
            config.is_buffer.clone(),
            factory,
        )
        .map_err(in_rank)?;
        let order = order_of(&module);
        let mut ddp = Self::wrap(pg, varmap, module, config, order)?;
        ddp.copies = Some(copies);
        Ok(ddp)
    }

    /// Wraps a `module` already built from `varmap` (its variables may lie
    /// on several devices, as a [`Pipeline`](crate::pipeline::Pipeline)'s
    /// do): checks that every rank has the same variables and copies rank
    /// 0's values to every rank. Every rank must call it.
    ///
    /// ```
    /// use candle_core::{DType, Device};
    /// use candle_dp::launch::spawn;
    /// use candle_dp::pipeline::{layer, Pipeline};
    /// use candle_dp::{cpu_devices, DdpConfig, DistributedDataParallel};
    /// use candle_nn::{linear, VarMap};
    ///
    /// spawn(2, |ctx| {
    ///     let varmap = VarMap::new();
    ///     let layers = vec![
    ///         layer(|vb| linear(4, 8, vb.pp("a"))),
    ///         layer(|vb| linear(8, 2, vb.pp("b"))),
    ///     ];
    ///     let pipe = Pipeline::builder(&varmap, DType::F32, &cpu_devices(2)).build(layers)?;
    ///     let ddp = DistributedDataParallel::from_module(
    ///         ctx.process_group(),
    ///         &varmap,
    ///         pipe,
    ///         DdpConfig::default(),
    ///     )?;
    ///     Ok(ddp.params().len())
    /// })?;
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::MixedPrecision`] with [`DdpConfig::mixed_precision`] set: the
    /// module was built without the policy (use [`new`](Self::new)).
    pub fn from_module(
        pg: Arc<dyn ProcessGroup>,
        varmap: &VarMap,
        module: M,
        config: DdpConfig,
    ) -> Result<Self> {
        if config.mixed_precision.is_some() {
            return Err(Error::MixedPrecision(
                "from_module wraps a module already built, in its own dtype: build it with \
                 DistributedDataParallel::new (or the builder) to apply the policy"
                    .into(),
            ));
        }
        Self::wrap(pg, varmap, module, config, None)
    }

    /// What `new` and `from_module` share: the checks, the buckets (filled
    /// in the configuration's order, else `model_order`, else by name) and
    /// the first broadcasts.
    fn wrap(
        pg: Arc<dyn ProcessGroup>,
        varmap: &VarMap,
        module: M,
        config: DdpConfig,
        model_order: Option<Vec<String>>,
    ) -> Result<Self> {
        let vars = sorted_vars(varmap);
        verify_same_vars(pg.as_ref(), &vars)?;
        let (buffers, params): (Vec<_>, Vec<_>) = vars
            .into_iter()
            .partition(|(name, _)| (config.is_buffer)(name));
        // The ranks agree on the parameters' shapes (checked above), so
        // on their pieces.
        let zero_layouts = match config.zero {
            Some(_) => params
                .iter()
                .map(|(_, var)| ShardLayout::new(var.dims(), pg.world_size()))
                .collect(),
            None => Vec::new(),
        };
        let order = match (&config.bucket_order, model_order) {
            (Some(names), _) => bucket_order(&params, names, true),
            (None, Some(names)) => bucket_order(&params, &names, false),
            (None, None) => bucket_order(&params, &[], true),
        }
        .map_err(|e| Error::Rank {
            rank: pg.rank(),
            source: Box::new(e),
        })?;
        verify_same_order(pg.as_ref(), &order)?;
        let ddp = Self {
            buckets: make_buckets(
                &params,
                &order,
                config.first_bucket_cap_bytes,
                config.bucket_cap_bytes,
                |name, var| match &config.mixed_precision {
                    Some(policy) => policy.reduce_dtype_of(name, var.dtype()),
                    None => var.dtype(),
                },
            ),
            module,
            active_ranks: pg.world_size(),
            pg,
            config,
            params,
            buffers,
            accumulated: None,
            syncing: true,
            joining: false,
            step_syncs: None,
            no_grad: NoGradCheck::default(),
            without_grad: Vec::new(),
            timings: DdpTimings::default(),
            zero_layouts,
            copies: None,
            overlaps: false,
        };
        ddp.broadcast_vars(&ddp.params, 0)?;
        // PyTorch leaves buffers rank-local at construction too when they
        // are not broadcast.
        if ddp.config.broadcast_buffers {
            ddp.broadcast_vars(&ddp.buffers, 0)?;
        }
        Ok(ddp)
    }

    /// This rank's model.
    pub fn module(&self) -> &M {
        &self.module
    }

    /// The buffers (the master variables, with mixed precision), by name,
    /// sorted.
    pub(crate) fn buffers(&self) -> &[(String, Var)] {
        &self.buffers
    }

    /// The ZeRO stage this DDP was built with, if any.
    pub fn zero_stage(&self) -> Option<ZeroStage> {
        self.config.zero
    }

    /// With ZeRO, each parameter's split into pieces, in the order of
    /// [`params`](Self::params) (empty without ZeRO).
    pub(crate) fn zero_layouts(&self) -> &[ShardLayout] {
        &self.zero_layouts
    }

    /// Whether the next backward synchronises, as decided at the latest
    /// forward (see [`no_sync`](Self::no_sync)); before any forward,
    /// whether `no_sync` is on now.
    pub(crate) fn is_syncing(&self) -> bool {
        self.step_syncs.unwrap_or(self.syncing)
    }

    /// The parameters of each gradient bucket, by name, in the order the
    /// buckets are reduced (see [`DdpConfig::bucket_order`]).
    pub fn buckets(&self) -> Vec<Vec<&str>> {
        self.buckets
            .iter()
            .map(|b| {
                b.params
                    .iter()
                    .map(|&i| self.params[i].0.as_str())
                    .collect()
            })
            .collect()
    }

    /// The buckets, in reduction order.
    pub(crate) fn bucket_list(&self) -> &[Bucket] {
        &self.buckets
    }

    /// What `no_sync` accumulated, one slot per parameter.
    pub(crate) fn accumulated(&self) -> Option<&[Option<Tensor>]> {
        self.accumulated.as_deref()
    }

    /// Marks a model given as units: its buckets are reduced as the
    /// backward goes.
    pub(crate) fn set_overlaps(&mut self) {
        self.overlaps = true;
    }

    /// Records a step whose reductions overlapped its backward.
    pub(crate) fn record_overlapped(
        &mut self,
        backward: Duration,
        all_reduce: Duration,
        timeline: Vec<Span>,
    ) {
        self.timings = DdpTimings {
            backward,
            all_reduce,
            timeline,
        };
    }

    /// This rank's process group.
    pub fn process_group(&self) -> &Arc<dyn ProcessGroup> {
        &self.pg
    }

    /// The parameters (variables that get gradients), sorted by name.
    pub fn params(&self) -> &[(String, Var)] {
        &self.params
    }

    /// Runs the model on this rank's batch (after the per-step collectives:
    /// the join count and the buffer broadcast).
    pub fn forward(&mut self, x: &Tensor) -> Result<Tensor>
    where
        M: Module,
    {
        self.pre_forward()?;
        let out = self.module.forward(&self.input(x)?)?;
        self.commit_buffers()?;
        Ok(out)
    }

    /// [`forward`](Self::forward) for a [`ModuleT`] (train / eval flag).
    pub fn forward_t(&mut self, x: &Tensor, train: bool) -> Result<Tensor>
    where
        M: ModuleT,
    {
        self.pre_forward()?;
        let out = self.module.forward_t(&self.input(x)?, train)?;
        if train {
            self.commit_buffers()?;
        }
        Ok(out)
    }

    /// With mixed precision, a floating-point input in the compute dtype.
    pub(crate) fn input(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match &self.config.mixed_precision {
            Some(policy) => cast_input(x, policy.param_dtype)?,
            None => x.clone(),
        })
    }

    /// With mixed precision, the buffers the forward updated in its copies
    /// go back to the master variables (which the next forward's broadcast
    /// reads).
    pub(crate) fn commit_buffers(&self) -> Result<()> {
        if let Some(copies) = &self.copies {
            copies.commit_buffers()?;
        }
        Ok(())
    }

    pub(crate) fn pre_forward(&mut self) -> Result<()> {
        // Outside a join rank 0's buffers are the authority. Inside, rank 0
        // may have joined with stale statistics: PyTorch takes the highest
        // rank still training (`_find_common_rank(rank, True)`).
        let buffer_root = if self.joining {
            let flags = self.step_flags(true, self.syncing)?;
            self.active_ranks = flags.active_ranks();
            self.step_syncs = Some(flags.agreed_sync()?);
            highest(&flags.active).unwrap_or(0)
        } else {
            self.step_syncs = Some(self.syncing);
            0
        };
        self.sync_buffers(buffer_root)?;
        // The masters may have changed since the last forward (a step, a
        // load, a join's final broadcast): the copies follow them.
        if let Some(copies) = &self.copies {
            copies.refresh()?;
        }
        Ok(())
    }

    /// Broadcasts the buffers from `root` when the configuration asks for it.
    fn sync_buffers(&self, root: usize) -> Result<()> {
        if self.config.broadcast_buffers && !self.buffers.is_empty() {
            self.broadcast_vars(&self.buffers, root)?;
        }
        Ok(())
    }

    /// Back-propagates `loss` on this rank and returns the gradients
    /// averaged over all ranks (plus anything accumulated under
    /// [`no_sync`](Self::no_sync)), keyed by this rank's variables, for any
    /// candle `Optimizer::step`. Inside `no_sync` it only accumulates and
    /// returns an empty store.
    pub fn backward(&mut self, loss: &Tensor) -> Result<GradStore> {
        let start = Instant::now();
        let grads = loss.backward()?;
        self.timings.backward = start.elapsed();
        self.synchronise(&grads)
    }

    /// Records the time of this rank's local backward (for a pipeline,
    /// its fused forward and backward) in [`last_timings`](Self::last_timings).
    pub(crate) fn record_backward(&mut self, time: std::time::Duration) {
        self.timings.backward = time;
        self.timings.timeline.clear();
    }

    /// What [`backward`](Self::backward) does once this rank's gradients
    /// are known: adds what `no_sync` accumulated, then averages across
    /// ranks (or, inside `no_sync`, only accumulates).
    pub(crate) fn synchronise(&mut self, grads: &GradStore) -> Result<GradStore> {
        self.timings.timeline.clear();
        let local = grads_of(grads, &self.params);
        // What `no_sync` accumulated stays until the all-reduce succeeds:
        // a failed step loses none of it.
        let local = match &self.accumulated {
            None => local,
            Some(acc) => acc
                .iter()
                .zip(local)
                .map(|(a, g)| with_accumulated(a.as_ref(), g))
                .collect::<Result<_>>()?,
        };
        if !self.is_syncing() {
            self.accumulated = Some(local);
            return Ok(GradStore::default());
        }
        let reduce_start = Instant::now();
        // A failed step must leave the parameters untouched: with a device
        // group, the gradients reach the optimizer only once its
        // collectives completed (a no-op for the host groups).
        let reduced = self
            .all_reduce_grads(local)
            .and_then(|reduced| self.comm(self.pg.wait_for_device()).map(|()| reduced));
        let store = reduced?;
        self.timings.all_reduce = reduce_start.elapsed();
        Ok(self.synchronised(store))
    }

    /// After a successful reduction: what `no_sync` accumulated is spent,
    /// and the parameters without a gradient are noted.
    pub(crate) fn synchronised(&mut self, store: GradStore) -> GradStore {
        self.accumulated = None;
        self.without_grad = self
            .no_grad
            .check("DistributedDataParallel", &self.params, &store);
        store
    }

    /// The parameters that received a gradient on no rank in the latest
    /// synchronised backward, sorted: they are not trained (PyTorch's DDP
    /// names such parameters too). A common cause in candle is a layer
    /// whose kernel has no backward, such as candle-nn 0.11's fused
    /// `LayerNorm` (use `candle_nn::ops::layer_norm_slow` in training). The
    /// first backward with any also logs a `tracing` warning.
    pub fn vars_without_grad(&self) -> &[String] {
        &self.without_grad
    }

    /// Where the time of the latest backward went.
    pub fn last_timings(&self) -> DdpTimings {
        self.timings.clone()
    }

    /// [`backward`](Self::backward) then `optimizer.step` (skipped inside
    /// `no_sync`).
    ///
    /// # Errors
    ///
    /// [`Error::Zero`] at ZeRO stage 2, before anything runs: each rank
    /// keeps only its own parameters' gradients, so an optimizer over all
    /// of them would update a part and let the ranks drift apart; use
    /// [`ZeroOptimizer::step`](crate::zero::ZeroOptimizer::step).
    pub fn backward_step<O: Optimizer>(&mut self, loss: &Tensor, optimizer: &mut O) -> Result<()> {
        if self.config.zero == Some(ZeroStage::Two) {
            return Err(Error::Zero(
                "backward_step with an optimizer over every parameter at stage 2, where a rank \
                 keeps only its own parameters' gradients: step a ZeroOptimizer with \
                 ddp.backward(&loss)'s gradients instead"
                    .into(),
            ));
        }
        let syncing = self.is_syncing();
        let grads = self.backward(loss)?;
        if syncing {
            optimizer.step(&grads)?;
        }
        Ok(())
    }

    /// Runs `f` with gradient synchronisation off (PyTorch's `no_sync`):
    /// steps whose forward runs inside accumulate their gradients locally;
    /// the first synchronised backward after it reduces the accumulated
    /// sum. For gradient accumulation over k micro-batches, divide each
    /// loss by k.
    ///
    /// **The forward decides**, as in PyTorch (its reducer is prepared at
    /// forward), inside [`join`](Self::join) or not: a backward
    /// synchronises when its step's forward ran outside `no_sync`, wherever
    /// the backward itself is called. A forward inside `no_sync` whose
    /// backward runs after it only accumulates. Every forward decides for
    /// the next backward, an evaluation forward between a step's forward
    /// and its backward included (candle has no switch that turns
    /// gradients off, which is what spares such a forward in PyTorch).
    pub fn no_sync<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        let before = std::mem::replace(&mut self.syncing, false);
        // Restored on unwind too: a caught panic must not leave every later
        // backward silently unsynchronised.
        let result = panic::catch_unwind(AssertUnwindSafe(|| f(self)));
        self.syncing = before;
        result.unwrap_or_else(|payload| panic::resume_unwind(payload))
    }

    /// Runs a training loop that may run out of data before the other
    /// ranks' (PyTorch's `Join`): every rank must call `join`; inside, each
    /// step is one forward and one backward, synchronised or, with gradient
    /// accumulation, inside [`no_sync`](Self::no_sync) on every rank still
    /// training (whether a step synchronises is agreed at its forward: the
    /// ranks that joined answer its all-reduce or skip it; ranks that
    /// disagree get [`Error::JoinSyncMismatch`]). When this rank's
    /// `f` returns, it keeps answering the others' collectives with zero
    /// gradients (divided per [`DdpConfig::join_divisor`]) until every rank
    /// is done. Then, as in PyTorch, every rank takes the parameters (and,
    /// with [`DdpConfig::broadcast_buffers`], the buffers) of the last rank
    /// to finish, the largest such rank on a tie: the others stopped
    /// applying updates when they ran out of data. Optimizer states are not
    /// synchronised. While any rank trains, buffers are broadcast from the
    /// highest rank still training, not from rank 0. If `f` fails, its
    /// error is returned at once.
    pub fn join<R>(&mut self, f: impl FnOnce(&mut Self) -> Result<R>) -> Result<R> {
        if self.config.zero.is_some() {
            return Err(Error::Zero(
                "join is not supported: a rank that ran out of data would not take part in the \
                 ZeroOptimizer's all-gather of the parameters; give every rank the same number \
                 of batches (DistributedSampler with drop_last)"
                    .into(),
            ));
        }
        self.joining = true;
        // A panic in `f` ends the join as an error does (state restored),
        // then goes on unwinding.
        let result = match panic::catch_unwind(AssertUnwindSafe(|| f(self))) {
            Ok(result) => result,
            Err(payload) => {
                self.joining = false;
                self.step_syncs = None;
                self.active_ranks = self.pg.world_size();
                panic::resume_unwind(payload)
            }
        };
        let shadowed = match &result {
            Ok(_) => self
                .shadow_until_all_joined()
                .and_then(|last_joiner| self.sync_from_last_joiner(last_joiner)),
            Err(_) => Ok(()),
        };
        self.joining = false;
        self.step_syncs = None;
        self.active_ranks = self.pg.world_size();
        let value = result?;
        shadowed?;
        Ok(value)
    }

    /// Which ranks answer `true`: one all-reduce of a one-hot vector (this
    /// rank's slot holds `mine`), so the count and the highest such rank
    /// come from the same collective.
    fn active_flags(&self, mine: bool) -> Result<Vec<bool>> {
        self.rank_flags(&[mine]).map(|mut sets| sets.remove(0))
    }

    /// The per-step exchange inside a join (PyTorch's join hook exchanges
    /// the same): which ranks still train, and which of them synchronise
    /// this step's gradients. Joined ranks answer `(false, false)`.
    fn step_flags(&self, active: bool, syncing: bool) -> Result<StepFlags> {
        let mut sets = self.rank_flags(&[active, active && syncing])?;
        let syncing = sets.pop().unwrap_or_default();
        let active = sets.pop().unwrap_or_default();
        Ok(StepFlags { active, syncing })
    }

    /// One all-reduce of one one-hot vector per entry of `mine` (this
    /// rank's slot of vector `k` holds `mine[k]`): for each, which ranks
    /// answered `true`.
    fn rank_flags(&self, mine: &[bool]) -> Result<Vec<Vec<bool>>> {
        let world = self.pg.world_size();
        let mut slots = vec![0f32; world * mine.len()];
        for (k, &flag) in mine.iter().enumerate() {
            if let Some(slot) = slots.get_mut(k * world + self.pg.rank()) {
                *slot = if flag { 1.0 } else { 0.0 };
            }
        }
        let flags = Tensor::from_vec(slots, world * mine.len(), &Device::Cpu)?;
        let total = self.comm(self.pg.all_reduce(&flags, ReduceOp::Sum))?;
        let total = total.to_vec1::<f32>()?;
        // A `ProcessGroup` implementation may be the user's: check its answer.
        if total.len() != world * mine.len() {
            return Err(Error::Candle(candle_core::Error::Msg(format!(
                "all_reduce of the {} join flags returned {} values",
                world * mine.len(),
                total.len()
            ))));
        }
        Ok(total
            .chunks(world.max(1))
            .map(|set| set.iter().map(|&f| f > 0.5).collect())
            .collect())
    }

    /// Every rank takes the model of the last rank to join (the largest
    /// one on a tie, PyTorch's `_sync_final_model`).
    fn sync_from_last_joiner(&self, last_joiner: bool) -> Result<()> {
        let root = highest(&self.active_flags(last_joiner)?).unwrap_or(0);
        self.broadcast_vars(&self.params, root)?;
        self.sync_buffers(root)
    }

    /// Answers the collectives of the ranks still training until none is.
    /// Returns whether this rank was among the last to join (no rank was
    /// still training when it finished).
    fn shadow_until_all_joined(&mut self) -> Result<bool> {
        let mut last_joiner = true;
        loop {
            let flags = self.step_flags(false, false)?;
            self.active_ranks = flags.active_ranks();
            let Some(buffer_root) = highest(&flags.active) else {
                return Ok(last_joiner);
            };
            last_joiner = false;
            let synchronised = flags.agreed_sync()?;
            self.sync_buffers(buffer_root)?;
            // A step inside no_sync has no all-reduce to answer.
            if synchronised {
                let zeros = self.params.iter().map(|_| None).collect();
                self.all_reduce_grads(zeros)?;
            }
        }
    }

    /// Averages `local` (one optional gradient per parameter) across ranks,
    /// bucket by bucket (see [`BucketReducer::reduce`]); where the group
    /// reduces on the GPUs ([`ProcessGroup::reduces_on_device`]), the
    /// presence flags of all parameters are summed once on the host first.
    ///
    /// Returns the averaged gradients this rank keeps (at ZeRO stage 2,
    /// its pieces of them).
    fn all_reduce_grads(&self, local: Vec<Option<Tensor>>) -> Result<GradStore> {
        let reducer = self.reducer();
        let presence = match self.presence_once() && !local.is_empty() {
            true => Some(reducer.presence_on_host(&local)?),
            false => None,
        };
        let mut store = GradStore::default();
        for bucket in &self.buckets {
            let grads: Vec<Option<Tensor>> =
                bucket.params.iter().map(|&i| local[i].clone()).collect();
            let presence = match &presence {
                Some(all) => Some(bucket.params.iter().map(|&i| all[i]).collect()),
                None if self.pg.reduces_on_device() => Some(reducer.presence_on_host(&grads)?),
                None => None,
            };
            let reduced = reducer.reduce(bucket, &grads, presence.as_deref())?;
            for (i, grad) in reduced.grads {
                store.insert(self.params[i].1.as_tensor(), grad);
            }
        }
        Ok(store)
    }

    /// Whether the presence flags of every parameter are summed once, before
    /// the buckets: on a group that reduces on the GPUs, unless the
    /// buckets are reduced as the backward goes (a model given as units),
    /// when each bucket's flags are summed on the host just before it, on
    /// every rank alike (a joined rank answers them so too).
    fn presence_once(&self) -> bool {
        self.pg.reduces_on_device() && !self.overlaps
    }

    /// What a bucket's reduction reads of this DDP, for the current step.
    pub(crate) fn reducer(&self) -> BucketReducer<'_> {
        let divisor = match self.config.join_divisor {
            JoinDivisor::InitialWorldSize => self.pg.world_size(),
            JoinDivisor::ActiveRanks => self.active_ranks.max(1),
        } as f64;
        BucketReducer {
            pg: self.pg.as_ref(),
            comm_hook: self.config.comm_hook,
            zero: self.config.zero,
            params: &self.params,
            layouts: &self.zero_layouts,
            divisor,
        }
    }

    /// Copies `root`'s values of `vars` into this rank's.
    fn broadcast_vars(&self, vars: &[(String, Var)], root: usize) -> Result<()> {
        broadcast_vars(self.pg.as_ref(), vars, root)
    }

    fn comm<T>(&self, r: std::result::Result<T, crate::comm::CommError>) -> Result<T> {
        r.map_err(Error::from)
    }
}

/// Copies `root`'s values of `vars` into this rank's, one collective per
/// dtype and device.
pub(crate) fn broadcast_vars(
    pg: &dyn ProcessGroup,
    vars: &[(String, Var)],
    root: usize,
) -> Result<()> {
    // In order of first appearance: the same on every rank.
    let mut groups: Vec<(DType, &Device)> = Vec::new();
    for (_, v) in vars {
        if !groups
            .iter()
            .any(|(d, dev)| *d == v.dtype() && dev.same_device(v.device()))
        {
            groups.push((v.dtype(), v.device()));
        }
    }
    for (dtype, device) in groups {
        let group: Vec<&Var> = vars
            .iter()
            .map(|(_, v)| v)
            .filter(|v| v.dtype() == dtype && v.device().same_device(device))
            .collect();
        let flats = group
            .iter()
            .map(|v| v.as_tensor().flatten_all())
            .collect::<candle_core::Result<Vec<_>>>()?;
        let flat = Tensor::cat(&flats, 0)?;
        let value = pg.broadcast(&flat, root)?;
        let mut offset = 0;
        for var in group {
            let n = var.elem_count();
            var.set(&value.narrow(0, offset, n)?.reshape(var.shape())?)?;
            offset += n;
        }
    }
    Ok(())
}

/// A parameter's gradient of this backward plus what `no_sync`
/// accumulated for it (in that order of the sum, on every path).
pub(crate) fn with_accumulated(
    acc: Option<&Tensor>,
    grad: Option<Tensor>,
) -> Result<Option<Tensor>> {
    Ok(match (acc, grad) {
        (Some(a), Some(g)) => Some((a + g)?),
        (a, g) => a.cloned().or(g),
    })
}

/// The order in which `params` fill the buckets, as indices: the names of
/// `order` first, then the others by name. Where `strict` (an order the
/// user gave), a name that is not a parameter is an error; a name given
/// twice always is.
fn bucket_order(params: &[(String, Var)], order: &[String], strict: bool) -> Result<Vec<usize>> {
    let mut taken = vec![false; params.len()];
    let mut indices = Vec::with_capacity(params.len());
    for name in order {
        let Ok(i) = params.binary_search_by(|(n, _)| n.as_str().cmp(name)) else {
            if !strict {
                continue;
            }
            return Err(Error::BucketOrder(format!(
                "`{name}` is not a parameter of the model (buffers are not bucketed)"
            )));
        };
        if std::mem::replace(&mut taken[i], true) {
            return Err(Error::BucketOrder(format!("`{name}` is named twice")));
        }
        indices.push(i);
    }
    indices.extend((0..params.len()).filter(|&i| !taken[i]));
    Ok(indices)
}

/// Checks that every rank fills its buckets in the same order as rank 0:
/// buckets that differ would reduce one rank's gradient with another's.
fn verify_same_order(pg: &dyn ProcessGroup, order: &[usize]) -> Result<()> {
    let all = all_gather_object(pg, &order.to_vec())?;
    match all.iter().position(|theirs| theirs != &all[0]) {
        None => Ok(()),
        Some(rank) => Err(Error::ModelMismatch {
            rank,
            detail: "fills its gradient buckets in another order than rank 0 (a model given \
                     as units on one rank and whole on another, or another \
                     DdpConfig::bucket_order)"
                .into(),
        }),
    }
}

/// Checks that every rank has the same variables (names, shapes, dtypes)
/// as rank 0; the error names the first rank and variable that differ. All
/// ranks see all signatures, so all return the same verdict.
/// The highest rank whose flag is set.
fn highest(flags: &[bool]) -> Option<usize> {
    flags.iter().rposition(|&f| f)
}

/// What every rank said at the start of a step inside a join.
#[derive(Debug)]
struct StepFlags {
    /// Per rank: still training.
    active: Vec<bool>,
    /// Per rank: still training, and synchronising this step.
    syncing: Vec<bool>,
}

impl StepFlags {
    fn active_ranks(&self) -> usize {
        self.active.iter().filter(|&&a| a).count()
    }

    /// Whether the step synchronises; an error when the ranks still
    /// training disagree (every rank sees the same flags, so every rank
    /// fails the step alike, and none waits for a collective that another
    /// skips).
    fn agreed_sync(&self) -> Result<bool> {
        let ranks = |want: bool| -> Vec<usize> {
            (0..self.active.len())
                .filter(|&r| self.active[r] && self.syncing[r] == want)
                .collect()
        };
        let (syncing, not_syncing) = (ranks(true), ranks(false));
        if !syncing.is_empty() && !not_syncing.is_empty() {
            return Err(Error::JoinSyncMismatch {
                syncing,
                not_syncing,
            });
        }
        Ok(!syncing.is_empty())
    }
}

pub(crate) fn verify_same_vars(pg: &dyn ProcessGroup, vars: &[(String, Var)]) -> Result<()> {
    let mut devices: Vec<&Device> = Vec::new();
    let mine: Vec<VarSignature> = vars
        .iter()
        .map(|(name, v)| {
            let device = match devices.iter().position(|d| d.same_device(v.device())) {
                Some(i) => i,
                None => {
                    devices.push(v.device());
                    devices.len() - 1
                }
            };
            VarSignature {
                name: name.clone(),
                shape: v.dims().to_vec(),
                dtype: v.dtype().as_str().to_string(),
                device,
            }
        })
        .collect();
    let all = all_gather_object(pg, &mine)?;
    let Some(reference) = all.first() else {
        return Err(Error::Comm(crate::comm::CommError::Protocol {
            rank: pg.rank(),
            op: "all_gather_object",
            peer: 0,
            detail: "the process group returned no rank's variable list".into(),
        }));
    };
    for (rank, theirs) in all.iter().enumerate().skip(1) {
        for (a, b) in reference.iter().zip(theirs) {
            if a != b {
                return Err(Error::ModelMismatch {
                    rank,
                    detail: if a.name != b.name {
                        format!("has variable `{}` where rank 0 has `{}`", b.name, a.name)
                    } else if a.device != b.device {
                        format!(
                            "has `{}` on its device {} (counting devices as its variables first use them) where rank 0 has it on its device {}: every rank must place the variables on its devices alike",
                            b.name, b.device, a.device
                        )
                    } else {
                        format!(
                            "has `{}` with shape {:?} ({}) where rank 0 has {:?} ({})",
                            b.name, b.shape, b.dtype, a.shape, a.dtype
                        )
                    },
                });
            }
        }
        if theirs.len() != reference.len() {
            let extra = if theirs.len() > reference.len() {
                format!("has `{}`, which rank 0 lacks", theirs[reference.len()].name)
            } else {
                format!("lacks `{}`, which rank 0 has", reference[theirs.len()].name)
            };
            return Err(Error::ModelMismatch {
                rank,
                detail: extra,
            });
        }
    }
    Ok(())
}

// The module and the process group stay out: `M` need not be `Debug`, and
// the rank and world size say which group this is.
impl<M> std::fmt::Debug for DistributedDataParallel<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DistributedDataParallel")
            .field("rank", &self.pg.rank())
            .field("world_size", &self.pg.world_size())
            .field("params", &self.params.len())
            .field("buffers", &self.buffers.len())
            .field("buckets", &self.buckets.len())
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}
