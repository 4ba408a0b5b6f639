//! Fully sharded data parallelism (FSDP; ZeRO stage 3): every parameter
//! split along dim 0 into one piece per rank (`torch.chunk` sizes, padded
//! to equal pieces, as FSDP2's `fully_shard` does), each rank keeping only
//! its pieces of the parameters, their gradients and the optimizer state.
//!
//! The model is given as units ([`Units`]: one
//! factory each, a transformer block per unit). A step walks them:
//! - **forward**: before a unit's forward its parameters are all-gathered
//!   and the unit is built over them; after it, with
//!   [`FsdpConfig::reshard_after_forward`] (FSDP2's default), the gathered
//!   parameters' storage is freed in place while the unit's graph (its
//!   activations) stays, as FSDP2 frees its parameters' storage (except
//!   for the last unit and, with prefetch, the one before: their
//!   backwards come first); with [`FsdpConfig::recompute_activations`]
//!   (and off the CPU or under a mixed-precision policy) the activations
//!   go too, keeping only the unit's input; without resharding they all
//!   stay until the backward (ZeRO-2's memory);
//! - **backward**, last unit first: a resharded unit is gathered again,
//!   into its freed storage, or, recomputed, its forward run again from
//!   its saved input and checked against the first forward (a unit that
//!   gives another output, such as Dropout, fails the step, named);
//!   after the unit's backward the
//!   gradients that are final (a weight tied across units: after its
//!   earliest unit) are reduce-scattered, so each rank receives the
//!   average of its own pieces.
//!
//! The pieces are the variables: after [`from_units`](FullyShardedDataParallel::from_units)
//! the `VarMap` holds each rank's piece under the parameter's name (the
//! whole parameters are released), so an optimizer built over
//! `varmap.all_vars()` or [`shards`](FullyShardedDataParallel::shards), any
//! candle `Optimizer` or the crate's stateful ones, updates the pieces.
//! [`full_state`](FullyShardedDataParallel::full_state) gathers the whole
//! parameters, for evaluation and a `safetensors` export.
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use candle_dp::fsdp::{FsdpConfig, FullyShardedDataParallel};
//! use candle_dp::launch::spawn;
//! use candle_dp::pipeline::unit;
//! use candle_nn::{linear, loss, Activation, Optimizer, VarMap, SGD};
//!
//! spawn(2, |ctx| {
//!     let varmap = VarMap::new();
//!     let units = vec![
//!         unit(|vb| linear(4, 8, vb.pp("a"))),
//!         unit(|_| Ok(Activation::Relu)),
//!         unit(|vb| linear(8, 2, vb.pp("b"))),
//!     ];
//!     let mut fsdp = FullyShardedDataParallel::from_units(
//!         ctx.process_group(), &varmap, DType::F32, &Device::Cpu, units, FsdpConfig::default())?;
//!     // Each rank holds half of `a.weight`'s 8 rows.
//!     assert_eq!(varmap.data().lock().unwrap()["a.weight"].dims(), [4, 4]);
//!     let mut sgd = SGD::new(varmap.all_vars(), 0.1)?;
//!     let x = Tensor::randn(0f32, 1., (6, 4), &Device::Cpu)?;
//!     let y = Tensor::new(&[0u32, 1, 0, 1, 0, 1], &Device::Cpu)?;
//!     let step = fsdp.forward_backward(&x, &y, |out, y| loss::cross_entropy(out, y))?;
//!     sgd.step(&step.grads)?;
//!     let whole = fsdp.full_state()?; // every rank: the whole parameters
//!     assert_eq!(whole["a.weight"].dims(), [8, 4]);
//!     Ok(())
//! })?;
//! # Ok::<(), anyhow::Error>(())
//! ```

mod agreement;
mod checkpoint;
mod gathered;
mod release;
mod step;

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};

use crate::buffers::{is_batch_norm_buffer, BufferPredicate};
use crate::comm::{DeviceMesh, ProcessGroup, ShardGroups};
use crate::error::{Error, Result};
use crate::precision::MixedPrecision;
use crate::same_model::{broadcast_vars, verify_same_vars};
use crate::sharding::{all_gather_pieces, ShardLayout};
use crate::units::{UnitFactory, Units};
use crate::util::lock::lock;
use crate::util::vars::sorted_vars;
use agreement::{verify_same_plan, Plan};

pub use step::FsdpMemory;

/// This rank's plan of the walk, which every rank's must equal.
fn plan_of(
    built: &Units,
    buffers: &[(String, Var)],
    params: &[(String, Var)],
    config: &FsdpConfig,
) -> Plan {
    Plan {
        units: (0..built.len())
            .map(|k| built.vars_of(k).to_vec())
            .collect(),
        buffers: buffers.iter().map(|(name, _)| name.clone()).collect(),
        reshard_after_forward: config.reshard_after_forward,
        prefetch: config.prefetch,
        broadcast_buffers: config.broadcast_buffers,
        precision: config.mixed_precision.as_ref().map(|policy| {
            let dtype = |d: DType| d.as_str().to_string();
            let reduce = policy.reduce_dtype.unwrap_or(policy.param_dtype);
            let kept = params
                .iter()
                .filter(|(name, _)| policy.keeps(name))
                .map(|(name, _)| name.clone())
                .collect();
            (dtype(policy.param_dtype), dtype(reduce), kept)
        }),
    }
}

/// Settings of a [`FullyShardedDataParallel`].
#[derive(Clone)]
pub struct FsdpConfig {
    /// Free a unit's gathered parameters after its forward and gather
    /// them again for its backward (default `true`, FSDP2's default),
    /// except the last unit and, with `prefetch`, the one before, whose
    /// backwards come first (their parameters would be gathered again at
    /// once); `false` keeps every unit's until the backward: no second
    /// gather, a whole model's parameters held at the peak.
    pub reshard_after_forward: bool,
    /// With `reshard_after_forward`: drop a resharded unit's activations
    /// too and recompute its forward for its backward (activation
    /// checkpointing per unit: the least memory, a forward more). Default
    /// `false`: the activations are kept and only the parameters' storage
    /// is freed and refilled, as FSDP2 does (on the CPU without a
    /// mixed-precision policy; elsewhere the unit is recomputed, as with
    /// `true`).
    pub recompute_activations: bool,
    /// Gather the next unit's parameters on another thread while the
    /// current unit computes, in the forward and in the backward (default
    /// `true`, as FSDP2 does): at most two units' whole parameters at
    /// once.
    pub prefetch: bool,
    /// Which variables are buffers (default BatchNorm statistics): kept
    /// whole on every rank, never sharded nor reduced; a unit's forward
    /// updates them in place (once per step: a recomputation for the
    /// backward works on copies).
    pub is_buffer: BufferPredicate,
    /// Copy rank 0's buffers to every rank before each forward (default
    /// `true`, DDP's `broadcast_buffers`), so that all ranks normalise
    /// with the same statistics and save the same ones.
    pub broadcast_buffers: bool,
    /// Compute in a low dtype and reduce-scatter in the policy's reduce
    /// dtype (default none), as FSDP2's `MixedPrecisionPolicy`: the
    /// pieces and the optimizer stay in the parameters' dtype; each unit is
    /// gathered whole and cast to `param_dtype` (the variables the policy
    /// keeps stay in theirs), and its gradients come back to the pieces in
    /// the parameters' dtype. See [`crate::precision`].
    pub mixed_precision: Option<MixedPrecision>,
}

impl Default for FsdpConfig {
    fn default() -> Self {
        Self {
            reshard_after_forward: true,
            recompute_activations: false,
            prefetch: true,
            is_buffer: Arc::new(is_batch_norm_buffer),
            broadcast_buffers: true,
            mixed_precision: None,
        }
    }
}

impl std::fmt::Debug for FsdpConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FsdpConfig")
            .field("reshard_after_forward", &self.reshard_after_forward)
            .field("recompute_activations", &self.recompute_activations)
            .field("prefetch", &self.prefetch)
            .field("broadcast_buffers", &self.broadcast_buffers)
            .field("mixed_precision", &self.mixed_precision)
            .finish_non_exhaustive()
    }
}

/// Fully sharded data parallelism over a model given as units. See the
/// [module docs](self).
pub struct FullyShardedDataParallel {
    /// The ranks the parameters are sharded over (`groups.shard()`).
    pg: Arc<dyn ProcessGroup>,
    /// The shard group, the replicas under HSDP, and every rank of the
    /// job (over which the model is checked and broadcast).
    groups: ShardGroups,
    factories: Vec<UnitFactory>,
    /// Per unit, the parameters it uses (indices into `shards`).
    unit_params: Vec<Vec<usize>>,
    /// Per parameter, the earliest unit that uses it (`None`: no unit).
    first_use: Vec<Option<usize>>,
    /// This rank's piece of each parameter, by name, sorted.
    shards: Vec<(String, Var)>,
    /// The buffers, whole, by name, sorted (the `VarMap`'s own variables).
    buffers: Vec<(String, Var)>,
    /// Per unit, the buffers it uses (indices into `buffers`).
    unit_buffers: Vec<Vec<usize>>,
    layouts: Vec<ShardLayout>,
    dtype: DType,
    device: Device,
    config: FsdpConfig,
    memory: FsdpMemory,
    /// Off inside [`no_sync`](Self::no_sync).
    syncing: bool,
    /// What `no_sync` steps accumulated: whole gradients, one slot per
    /// parameter.
    accumulated: Option<Vec<Option<Tensor>>>,
}

impl FullyShardedDataParallel {
    /// Builds the model from `units` on `device` (variables created in
    /// `varmap` where missing), checks that every rank built the same
    /// parameters, copies rank 0's values to every rank, then keeps only
    /// this rank's piece of each: the `VarMap`'s entries are replaced by
    /// the pieces. Every rank must call it, with the same units.
    ///
    /// # Errors
    ///
    /// [`Error::Fsdp`] for no units, parameters of several dtypes, or
    /// buffers with mixed precision; a unit's factory failing;
    /// [`Error::ModelMismatch`] naming the first rank whose parameters
    /// differ from rank 0's, whose units differ (their number, or the
    /// variables a unit uses: the same variables split into units another
    /// way), or whose buffers, `reshard_after_forward`, `prefetch` (it
    /// orders a step's collectives), `broadcast_buffers` or
    /// mixed-precision policy differ.
    pub fn from_units(
        pg: Arc<dyn ProcessGroup>,
        varmap: &VarMap,
        dtype: DType,
        device: &Device,
        units: Vec<UnitFactory>,
        config: FsdpConfig,
    ) -> Result<Self> {
        let groups = ShardGroups::flat(pg);
        Self::with_groups(groups, varmap, dtype, device, units, config)
    }

    /// [`from_units`](Self::from_units) on a mesh, as FSDP2's
    /// `fully_shard(module, mesh=...)`: a mesh of one dimension shards over
    /// its group; a mesh of two, `(replicate, shard)` in that order, is
    /// **hybrid sharding** (HSDP): the parameters, gradients and optimizer
    /// state are split among the ranks of the `shard` dimension (keep it
    /// inside a machine) and replicated along `replicate` (across
    /// machines). A step gathers within the shard group only, and each
    /// gradient is reduce-scattered within it and the piece then averaged
    /// across the replicas: only a piece of the gradients crosses between
    /// the machines. The model is checked and copied from the mesh's rank
    /// 0 over the whole mesh. The weights are FSDP's (and DDP's) up to
    /// floating-point rounding: the sums run in another order.
    ///
    /// A checkpoint of an HSDP run is any one replica's pieces
    /// ([`pieces`](Self::pieces) and [`shard_state`](Self::shard_state),
    /// numbered in the shard group): every replica holds the same.
    ///
    /// ```
    /// use candle_core::{DType, Device};
    /// use candle_dp::comm::DeviceMesh;
    /// use candle_dp::fsdp::{FsdpConfig, FullyShardedDataParallel};
    /// use candle_dp::launch::spawn;
    /// use candle_dp::pipeline::unit;
    /// use candle_nn::{linear, VarMap};
    ///
    /// spawn(4, |ctx| {
    ///     let mesh = DeviceMesh::new(ctx.process_group(), &[("replicate", 2), ("shard", 2)])?;
    ///     let varmap = VarMap::new();
    ///     let units = vec![unit(|vb| linear(4, 8, vb.pp("a")))];
    ///     let _hsdp = FullyShardedDataParallel::from_units_on_mesh(
    ///         &mesh, &varmap, DType::F32, &Device::Cpu, units, FsdpConfig::default())?;
    ///     // Two ranks share `a.weight`'s 8 rows: 4 each, on both replicas.
    ///     assert_eq!(varmap.data().lock().unwrap()["a.weight"].dims(), [4, 4]);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// As [`from_units`](Self::from_units); [`Error::Mesh`] for a mesh of
    /// more than two dimensions.
    pub fn from_units_on_mesh(
        mesh: &DeviceMesh,
        varmap: &VarMap,
        dtype: DType,
        device: &Device,
        units: Vec<UnitFactory>,
        config: FsdpConfig,
    ) -> Result<Self> {
        let groups = ShardGroups::from_mesh(mesh)?;
        Self::with_groups(groups, varmap, dtype, device, units, config)
    }

    fn with_groups(
        groups: ShardGroups,
        varmap: &VarMap,
        dtype: DType,
        device: &Device,
        units: Vec<UnitFactory>,
        config: FsdpConfig,
    ) -> Result<Self> {
        let pg = Arc::clone(groups.shard());
        let whole = Arc::clone(groups.world());
        let rank = pg.rank();
        let in_rank = |e: Error| Error::Rank {
            rank,
            source: Box::new(e),
        };
        if units.is_empty() {
            return Err(in_rank(Error::Fsdp(
                "a model given as units needs at least one unit".into(),
            )));
        }
        if let Some(policy) = &config.mixed_precision {
            policy.check().map_err(in_rank)?;
        }
        let built = Units::build(VarBuilder::from_varmap(varmap, dtype, device), &units)
            .map_err(in_rank)?;
        let vars = sorted_vars(varmap);
        // Every rank checks the same things after the ranks agree on the
        // variables, so that all refuse alike instead of some waiting.
        verify_same_vars(whole.as_ref(), &vars)?;
        let (buffers, params): (Vec<_>, Vec<_>) = vars
            .iter()
            .cloned()
            .partition(|(name, _)| (config.is_buffer)(name));
        verify_same_plan(whole.as_ref(), &plan_of(&built, &buffers, &params, &config))?;
        if let (Some((name, _)), Some(_)) = (buffers.first(), &config.mixed_precision) {
            return Err(in_rank(Error::Fsdp(format!(
                "`{name}` is a buffer: FSDP's mixed precision does not handle buffers \
                 (BatchNorm statistics) yet; train this model in one dtype, or with \
                 DistributedDataParallel's mixed precision"
            ))));
        }
        if let Some((name, var)) = params.iter().find(|(_, v)| v.dtype() != dtype) {
            return Err(in_rank(Error::Fsdp(format!(
                "`{name}` is {:?} where the model is {dtype:?}: FSDP shards parameters of one dtype",
                var.dtype()
            ))));
        }
        let used: std::collections::HashSet<&String> =
            (0..built.len()).flat_map(|k| built.vars_of(k)).collect();
        if let Some((name, _)) = vars.iter().find(|(name, _)| !used.contains(name)) {
            return Err(in_rank(Error::Fsdp(format!(
                "`{name}` is in the VarMap but no unit asks for it: FSDP would replace it by a \
                 piece and never train it; give FSDP a VarMap of this model alone"
            ))));
        }
        broadcast_vars(whole.as_ref(), &vars, 0)?;
        let index_of = |list: &[(String, Var)]| -> HashMap<String, usize> {
            list.iter()
                .enumerate()
                .map(|(i, (n, _))| (n.clone(), i))
                .collect()
        };
        let (param_index, buffer_index) = (index_of(&params), index_of(&buffers));
        let used_by = |index: &HashMap<String, usize>| -> Vec<Vec<usize>> {
            (0..built.len())
                .map(|k| {
                    built
                        .vars_of(k)
                        .iter()
                        .filter_map(|n| index.get(n).copied())
                        .collect()
                })
                .collect()
        };
        let (unit_params, unit_buffers) = (used_by(&param_index), used_by(&buffer_index));
        let mut first_use = vec![None; params.len()];
        for (k, params) in unit_params.iter().enumerate() {
            for &p in params {
                first_use[p].get_or_insert(k);
            }
        }
        drop(built);
        let world = pg.world_size();
        let mut shards = Vec::with_capacity(params.len());
        let mut layouts = Vec::with_capacity(params.len());
        {
            let mut data = lock(varmap.data());
            for (name, full) in params {
                let layout = ShardLayout::new(full.dims(), world);
                let piece = layout.shard_of(full.as_tensor(), rank)?;
                let shard = Var::from_tensor(&piece)?;
                // The whole parameter goes: the map holds the piece now.
                data.insert(name.clone(), shard.clone());
                shards.push((name, shard));
                layouts.push(layout);
            }
        }
        Ok(FullyShardedDataParallel {
            pg,
            groups,
            factories: units,
            unit_params,
            first_use,
            shards,
            buffers,
            unit_buffers,
            layouts,
            dtype,
            device: device.clone(),
            config,
            memory: FsdpMemory::default(),
            syncing: true,
            accumulated: None,
        })
    }

    /// This rank's piece of each parameter, by name, sorted: what an
    /// optimizer steps.
    pub fn shards(&self) -> &[(String, Var)] {
        &self.shards
    }

    /// The pieces as variables, for the checks that take a list:
    /// [`GradScaler::unscale_across`](crate::optim::GradScaler::unscale_across)
    /// on every rank skips every rank's step alike.
    pub fn shard_vars(&self) -> Vec<Var> {
        self.shards.iter().map(|(_, v)| v.clone()).collect()
    }

    /// PyTorch's `clip_grad_norm_` over the whole model's gradients, of
    /// which this rank holds its pieces (`grads`, a step's): the total norm
    /// comes from every rank's pieces through one all-reduce (the padding
    /// adds nothing), and every rank scales its pieces by the same factor.
    /// Every rank must call it.
    ///
    /// # Errors
    ///
    /// As [`clip_grad_norm`](crate::optim::clip_grad_norm), on every rank
    /// alike; a collective's error.
    pub fn clip_grad_norm(
        &self,
        grads: &mut candle_core::backprop::GradStore,
        max_norm: f64,
        norm_type: f64,
        error_if_nonfinite: bool,
    ) -> Result<crate::optim::Clipped> {
        self.clip_grad_norm_also(grads, max_norm, norm_type, error_if_nonfinite, None)
    }

    /// [`clip_grad_norm`](Self::clip_grad_norm) whose total spans `also`'s
    /// ranks too (tensor parallelism).
    pub(crate) fn clip_grad_norm_also(
        &self,
        grads: &mut candle_core::backprop::GradStore,
        max_norm: f64,
        norm_type: f64,
        error_if_nonfinite: bool,
        also: Option<crate::optim::clip::AlsoAcross<'_>>,
    ) -> Result<crate::optim::Clipped> {
        let counts = crate::optim::clip::AlsoCounted::of(also, &self.shards);
        let counted = |var: &Var| counts.counts(var);
        crate::optim::clip::clip_grad_norm_across_counting(
            &crate::optim::clip::groups(Some(self.pg.as_ref()), also),
            grads,
            &self.shard_vars(),
            &counted,
            max_norm,
            norm_type,
            error_if_nonfinite,
        )
    }

    /// Runs `f` with gradient synchronisation off (FSDP2's
    /// `set_requires_gradient_sync(False)`, DDP's `no_sync`): the steps
    /// inside skip the reduce-scatter and accumulate this rank's **whole**
    /// gradients (a full model's gradients held, as FSDP2 does), returning
    /// an empty store; the first step after adds what they accumulated and
    /// reduce-scatters the sum. For accumulation over k micro-batches,
    /// divide each loss by k.
    pub fn no_sync<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
        let before = std::mem::replace(&mut self.syncing, false);
        // Restored on unwind too.
        let result = catch_unwind(AssertUnwindSafe(|| f(self)));
        self.syncing = before;
        result.unwrap_or_else(|payload| resume_unwind(payload))
    }

    /// What [`no_sync`](Self::no_sync) steps accumulated, taken: this
    /// rank's whole gradient of each parameter (in the order of
    /// [`shards`](Self::shards)), `None` where it got none; empty when
    /// nothing was accumulated. Deterministic training takes each chunk's
    /// so.
    pub(crate) fn take_accumulated(&mut self) -> Vec<Option<Tensor>> {
        self.accumulated.take().unwrap_or_default()
    }

    /// The whole shape of each parameter, in the order of
    /// [`shards`](Self::shards).
    pub(crate) fn whole_dims(&self) -> Vec<Vec<usize>> {
        self.layouts.iter().map(|l| l.dims.clone()).collect()
    }

    /// `grads` keyed by the pieces ([`shards`](Self::shards)), each this
    /// rank's piece of a whole gradient where it is whole (deterministic
    /// training hands them whole), as it is where it is a piece.
    pub(crate) fn pieces_of_whole(&self, grads: &GradStore) -> Result<GradStore> {
        let rank = self.shard_rank();
        let mut store = GradStore::default();
        for ((_, piece), layout) in self.shards.iter().zip(&self.layouts) {
            if let Some(grad) = grads.get(piece) {
                let grad =
                    match grad.dims() == layout.dims.as_slice() && grad.dims() != piece.dims() {
                        true => layout.shard_of(grad, rank)?,
                        false => grad.clone(),
                    };
                store.insert(piece.as_tensor(), grad);
            }
        }
        Ok(store)
    }

    /// The group the parameters are sharded over (under HSDP, this
    /// rank's shard group).
    pub fn process_group(&self) -> &Arc<dyn ProcessGroup> {
        &self.pg
    }

    /// Under HSDP, which replica this rank's shard group is (its rank in
    /// the replicate group); 0 otherwise.
    pub fn replica_rank(&self) -> usize {
        self.groups.replica_rank()
    }

    /// This rank's number among the ranks its parameters are sharded over
    /// (under HSDP, its rank in its shard group): which piece it holds.
    pub fn shard_rank(&self) -> usize {
        self.pg.rank()
    }

    /// The number of units.
    pub fn units(&self) -> usize {
        self.factories.len()
    }

    /// The settings.
    pub fn config(&self) -> &FsdpConfig {
        &self.config
    }

    /// What the latest step held (see [`FsdpMemory`]).
    pub fn last_memory(&self) -> FsdpMemory {
        self.memory
    }

    /// Every parameter whole, and this rank's buffers, by name, on every
    /// rank (an all-gather of the parameters): for evaluation or a
    /// `safetensors` export (`candle_core::safetensors::save`; take rank
    /// 0's, whose buffers the next forward broadcasts). Every rank must
    /// call it.
    pub fn full_state(&self) -> Result<HashMap<String, Tensor>> {
        let all: Vec<usize> = (0..self.shards.len()).collect();
        let gathered = self.gather(&all)?;
        let mut state: HashMap<String, Tensor> = all
            .into_iter()
            .zip(gathered)
            .map(|(p, t)| (self.shards[p].0.clone(), t))
            .collect();
        for (name, var) in &self.buffers {
            state.insert(name.clone(), var.as_tensor().copy()?);
        }
        Ok(state)
    }

    /// The buffers, whole, as this rank holds them, by name, sorted: each
    /// training forward starts from rank 0's (broadcast) and updates them
    /// with this rank's batch, so ranks differ after it; rank 0's are the
    /// ones the next forward, and a sharded checkpoint's load, use.
    pub fn buffers(&self) -> &[(String, Var)] {
        &self.buffers
    }

    /// Copies rank 0's buffers to every rank, where the settings ask for
    /// it: before each forward. Every rank calls it.
    pub(crate) fn sync_buffers(&self) -> Result<()> {
        if self.config.broadcast_buffers && !self.buffers.is_empty() {
            broadcast_vars(self.groups.world().as_ref(), &self.buffers, 0)?;
        }
        Ok(())
    }

    /// The dtype parameter `p` computes in (the policy's, unless it keeps
    /// the parameter in its own).
    pub(crate) fn compute_dtype(&self, p: usize) -> DType {
        match &self.config.mixed_precision {
            Some(policy) if !policy.keeps(&self.shards[p].0) => policy.param_dtype,
            _ => self.dtype,
        }
    }

    /// The dtype parameter `p`'s gradients are reduce-scattered in.
    pub(crate) fn reduce_dtype(&self, p: usize) -> DType {
        match &self.config.mixed_precision {
            Some(policy) => policy.reduce_dtype_of(&self.shards[p].0, self.dtype),
            None => self.dtype,
        }
    }

    /// The whole parameters `params` (indices), all-gathered in one
    /// collective: each rank contributes its pieces, in order.
    fn gather(&self, params: &[usize]) -> Result<Vec<Tensor>> {
        let mine: Vec<Tensor> = params
            .iter()
            .map(|&p| self.shards[p].1.as_detached_tensor())
            .collect();
        let layouts: Vec<&ShardLayout> = params.iter().map(|&p| &self.layouts[p]).collect();
        let gathered = all_gather_pieces(self.pg.as_ref(), &mine, &layouts)?;
        layouts
            .iter()
            .zip(gathered)
            .map(|(layout, pieces)| Ok(layout.unshard(&pieces)?))
            .collect()
    }
}

impl std::fmt::Debug for FullyShardedDataParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FullyShardedDataParallel")
            .field("rank", &self.pg.rank())
            .field("world_size", &self.pg.world_size())
            .field("replicas", &self.groups.replicate().map(|g| g.world_size()))
            .field("units", &self.factories.len())
            .field("params", &self.shards.len())
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}
