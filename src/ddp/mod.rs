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

mod buckets;
mod builder;
mod config;
mod join;
mod overlap;
mod timeline;

pub use buckets::CommHook;
pub use builder::DdpBuilder;
pub use config::{DdpConfig, DdpTimings, JoinDivisor, ZeroStage};
pub use timeline::{Activity, Span};

use crate::comm::{ProcessGroup, ShardGroups};
use crate::error::{Error, Result};
use crate::no_grad::NoGradCheck;
use crate::precision::{build_in_precision, cast_input};
use crate::replicate::ReplicaVars;
use crate::same_model::{broadcast_vars, verify_same_vars};
use crate::sharding::ShardLayout;
use crate::util::vars::{grads_of, sorted_vars, with_accumulated};
use buckets::{bucket_order, make_buckets, verify_same_order, Bucket, BucketReducer};
use join::highest;

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
    /// With ZeRO, the ranks the pieces split over (and their replicas).
    zero_groups: Option<ShardGroups>,
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
    /// use candle_dp::pipeline::{unit, Pipeline};
    /// use candle_dp::{cpu_devices, DdpConfig, DistributedDataParallel};
    /// use candle_nn::{linear, VarMap};
    ///
    /// spawn(2, |ctx| {
    ///     let varmap = VarMap::new();
    ///     let layers = vec![
    ///         unit(|vb| linear(4, 8, vb.pp("a"))),
    ///         unit(|vb| linear(8, 2, vb.pp("b"))),
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
        let zero_groups = zero_groups_of(&pg, &config)?;
        // The ranks agree on the parameters' shapes (checked above), so
        // on their pieces.
        let zero_layouts = match &zero_groups {
            Some(groups) => params
                .iter()
                .map(|(_, var)| ShardLayout::new(var.dims(), groups.shard().world_size()))
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
            zero_groups,
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

    /// With ZeRO, the ranks the pieces split over and, on a mesh, the
    /// replicas holding the same pieces.
    pub fn zero_groups(&self) -> Option<&ShardGroups> {
        self.zero_groups.as_ref()
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
                .map(|(a, g)| Ok(with_accumulated(a.as_ref(), g)?))
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
            zero_groups: self.zero_groups.as_ref(),
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

/// ZeRO's groups: the configured mesh's (checked to be `pg`'s ranks), or
/// `pg` itself; none without ZeRO.
fn zero_groups_of(pg: &Arc<dyn ProcessGroup>, config: &DdpConfig) -> Result<Option<ShardGroups>> {
    let refuse = |why: String| Error::Rank {
        rank: pg.rank(),
        source: Box::new(Error::Zero(why)),
    };
    match (config.zero, &config.zero_groups) {
        (None, None) => Ok(None),
        (None, Some(_)) => Err(refuse(
            "zero_groups without a ZeRO stage: set zero as well (DdpBuilder::zero_on_mesh sets \
             both)"
                .into(),
        )),
        (Some(_), None) => Ok(Some(ShardGroups::flat(Arc::clone(pg)))),
        (Some(_), Some(groups)) => {
            let world = groups.world();
            if (world.rank(), world.world_size()) != (pg.rank(), pg.world_size()) {
                return Err(refuse(format!(
                    "ZeRO's mesh is not this DDP's group: the mesh's rank {} of {}, the group's \
                     rank {} of {} (build DDP over mesh.world())",
                    world.rank(),
                    world.world_size(),
                    pg.rank(),
                    pg.world_size()
                )));
            }
            Ok(Some(groups.clone()))
        }
    }
}
