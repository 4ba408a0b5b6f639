//! [`ZeroOptimizer`]: any optimizer, run by each rank on its pieces of
//! every parameter, the updated pieces then shared with every rank.

use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};

use super::ZeroStage;
use crate::comm::{all_gather_object, ProcessGroup};
use crate::ddp::DistributedDataParallel;
use crate::error::{Error, Result};
use crate::optim::clip::{groups, AlsoAcross, AlsoCounted};
use crate::optim::{OptimizerState, ShardOf, StatefulOptimizer};
use crate::sharding::state::{
    mark_shard, named_layouts, reshard_states, whole_layouts, whole_state_on_first,
};
use crate::sharding::{all_gather_pieces, ShardLayout};

/// An optimizer sharded across the ranks of a
/// [`DistributedDataParallel`] built with [`zero`](crate::DdpBuilder::zero)
/// (ZeRO stage 1 or 2; DeepSpeed's stages 1-2, with FSDP2's split): each
/// parameter is split along dim 0 into one piece per rank (`torch.chunk`'s
/// sizes, padded to equal shape), each rank builds its optimizer over its
/// pieces, so it holds a `1/world` share of the optimizer state even of a
/// model with one huge parameter, and [`step`](Self::step) updates them,
/// then all-gathers every rank's pieces into every rank's whole
/// parameters.
///
/// **Exact.** With an optimizer that updates each element from its own
/// gradient and state (SGD, Adam, AdamW: candle's and the crate's), the
/// weights are bitwise those of DDP with the same optimizer over all
/// parameters wherever the gradients are DDP's bytes: always at stage 1;
/// at stage 2 where the reduce-scatter adds in DDP's order (up to two
/// ranks, or buckets below the group's ring threshold; see the ZeRO
/// page). An optimizer that couples elements (a global gradient norm,
/// LAMB's trust ratio) would see only this rank's pieces: use
/// [`clip_grad_norm`](Self::clip_grad_norm) for the norm.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_dp::launch::spawn;
/// use candle_dp::optim::{AdamW, AdamWConfig};
/// use candle_dp::zero::{ZeroOptimizer, ZeroStage};
/// use candle_dp::DistributedDataParallel;
/// use candle_nn::{linear, Module, VarMap};
///
/// spawn(2, |ctx| {
///     let varmap = VarMap::new();
///     let mut ddp = DistributedDataParallel::builder(ctx.process_group(), &varmap, DType::F32, &Device::Cpu)
///         .zero(ZeroStage::Two)
///         .build(|vb| linear(4, 2, vb))?;
///     // Each rank's AdamW holds the state of its pieces only.
///     let mut opt = ZeroOptimizer::new(&ddp, |mine| AdamW::new_named(mine, AdamWConfig::default()))?;
///     let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
///     let loss = ddp.forward(&x)?.sum_all()?;
///     let grads = ddp.backward(&loss)?; // stage 2: this rank's pieces of the gradients
///     opt.step(&grads)?;
///     Ok(())
/// })?;
/// # Ok::<(), anyhow::Error>(())
/// ```
pub struct ZeroOptimizer<O> {
    inner: O,
    /// Every rank of the DDP: where the ranks agree on a step's outcome.
    world: Arc<dyn ProcessGroup>,
    /// The ranks the pieces split over (the DDP's group, or on a mesh
    /// this rank's shard group): which piece this rank holds, and whose
    /// pieces it gathers.
    pg: Arc<dyn ProcessGroup>,
    /// On a mesh, which replica of the pieces this rank holds (0 without).
    replica_rank: usize,
    stage: ZeroStage,
    /// The model's whole parameters, in DDP's order.
    params: Vec<(String, Var)>,
    /// This rank's piece of each (what `inner` steps), named as the
    /// parameter.
    pieces: Vec<(String, Var)>,
    layouts: Vec<ShardLayout>,
    groups: Vec<GatherGroup>,
    /// Where the gradients' norm is summed: `None`, each rank holds whole
    /// gradients that are every rank's (DDP's stage 1); else the ranks
    /// whose gradients together are the model's.
    norm_group: Option<Arc<dyn ProcessGroup>>,
    /// The parameters this rank leaves out of the norm (a weight tied
    /// across a pipeline's ranks counts on one of them).
    uncounted: std::collections::HashSet<candle_core::TensorId>,
}

/// What a [`ZeroOptimizer`] splits, over which ranks: a ZeRO DDP's
/// parameters, or a pipeline's stages across their replicas.
pub(crate) struct ZeroSplit {
    /// Every rank: where the ranks agree on a step's outcome.
    pub(crate) world: Arc<dyn ProcessGroup>,
    /// The ranks the pieces split over.
    pub(crate) pg: Arc<dyn ProcessGroup>,
    /// Which replica of the pieces this rank holds (0 without).
    pub(crate) replica_rank: usize,
    pub(crate) stage: ZeroStage,
    pub(crate) params: Vec<(String, Var)>,
    pub(crate) layouts: Vec<ShardLayout>,
    /// See [`ZeroOptimizer`]'s field.
    pub(crate) norm_group: Option<Arc<dyn ProcessGroup>>,
    /// See [`ZeroOptimizer`]'s field.
    pub(crate) counted: Vec<bool>,
}

/// Parameters of one dtype and device, whose pieces are all-gathered as
/// one flat buffer (of the same length on every rank).
struct GatherGroup {
    /// Indices into the parameters, in their order.
    members: Vec<usize>,
    /// Elements of this rank's pieces of the members.
    elems: usize,
}

/// The settings' prefix under which a shard state records each
/// parameter's rows.
const ROWS: &str = "zero.rows.";

impl<O: candle_nn::Optimizer> ZeroOptimizer<O> {
    /// Builds this rank's optimizer with `make`, given this rank's piece
    /// of every parameter (named as the parameter, in the model's order:
    /// pass them to the crate's optimizers' `new_named`, or their `Var`s
    /// to any candle optimizer). Every rank must call it.
    ///
    /// # Errors
    ///
    /// [`Error::Zero`] if `ddp` was not built with
    /// [`zero`](crate::DdpBuilder::zero); `make`'s error.
    pub fn new<M, F>(ddp: &DistributedDataParallel<M>, make: F) -> Result<Self>
    where
        F: FnOnce(Vec<(String, Var)>) -> candle_core::Result<O>,
    {
        let Some(stage) = ddp.zero_stage() else {
            return Err(Error::Zero(
                "this DistributedDataParallel shards nothing: build it with \
                 DistributedDataParallel::builder(..).zero(ZeroStage::One) (or Two)"
                    .into(),
            ));
        };
        let world = Arc::clone(ddp.process_group());
        let (pg, replica_rank) = match ddp.zero_groups() {
            Some(groups) => (Arc::clone(groups.shard()), groups.replica_rank()),
            None => (Arc::clone(&world), 0),
        };
        let params = ddp.params().to_vec();
        let split = ZeroSplit {
            norm_group: (stage == ZeroStage::Two).then(|| Arc::clone(&pg)),
            counted: vec![true; params.len()],
            world,
            pg,
            replica_rank,
            stage,
            layouts: ddp.zero_layouts().to_vec(),
            params,
        };
        Self::from_split(split, make)
    }

    /// The optimizer of `split`, built with `make` over this rank's
    /// pieces.
    pub(crate) fn from_split<F>(split: ZeroSplit, make: F) -> Result<Self>
    where
        F: FnOnce(Vec<(String, Var)>) -> candle_core::Result<O>,
    {
        let ZeroSplit {
            world,
            pg,
            replica_rank,
            stage,
            params,
            layouts,
            norm_group,
            counted,
        } = split;
        let rank = pg.rank();
        let pieces = params
            .iter()
            .zip(&layouts)
            .map(|((name, var), layout)| {
                let piece = layout.shard_of(var.as_tensor(), rank)?;
                Ok((name.clone(), Var::from_tensor(&piece)?))
            })
            .collect::<Result<Vec<_>>>()?;
        let inner = make(pieces.clone())?;
        let groups = gather_groups(&params, &layouts);
        let uncounted = params
            .iter()
            .zip(&counted)
            .filter(|(_, counted)| !**counted)
            .map(|((_, var), _)| var.as_tensor().id())
            .collect();
        Ok(Self {
            inner,
            world,
            pg,
            replica_rank,
            stage,
            params,
            pieces,
            layouts,
            groups,
            norm_group,
            uncounted,
        })
    }

    /// Updates this rank's pieces from `grads` (DDP's averaged gradients:
    /// whole at stage 1, this rank's pieces at stage 2), then gives every
    /// rank every other rank's updated pieces, written into the whole
    /// parameters. Every rank must call it.
    ///
    /// The pieces are taken from the whole parameters first, so weights
    /// loaded into the model between steps are what the step updates.
    ///
    /// # Errors
    ///
    /// If any rank's update fails (its optimizer, or gradients that are
    /// not this DDP's), every rank returns [`Error::Zero`] naming it, with
    /// every parameter as before the step (the ranks agree on the
    /// updates' outcome before they exchange anything). If the exchange
    /// fails, no parameter has been written. The optimizer's own state is
    /// not rolled back: the ranks whose update succeeded have moved theirs
    /// on (their step counts now differ from the failed rank's, and their
    /// shard states no longer form a set), so resume every rank from a
    /// checkpoint, as after any failed collective.
    pub fn step(&mut self, grads: &GradStore) -> Result<()> {
        let updated = self
            .piece_grads(grads)
            .and_then(|pieces| Ok(self.inner.step(&pieces)?))
            .map_err(|e| e.to_string());
        // A rank whose update failed must not leave the others waiting in
        // the exchange: all learn every rank's outcome first.
        let outcomes = all_gather_object(self.world.as_ref(), &updated.err())?;
        if let Some((culprit, why)) = outcomes
            .iter()
            .enumerate()
            .find_map(|(r, failed)| failed.as_ref().map(|why| (r, why)))
        {
            return Err(Error::Zero(format!(
                "the optimizer step of rank {culprit} failed: {why}; every rank's parameters \
                 are as before the step"
            )));
        }
        self.share_updates()
    }

    /// The pieces refreshed from the whole parameters, and their gradients
    /// from DDP's `grads`.
    fn piece_grads(&self, grads: &GradStore) -> Result<GradStore> {
        let rank = self.pg.rank();
        let mut store = GradStore::default();
        for (((name, var), (_, piece)), layout) in
            self.params.iter().zip(&self.pieces).zip(&self.layouts)
        {
            piece.set(&layout.shard_of(var.as_tensor(), rank)?)?;
            let Some(grad) = grads.get(var.as_tensor()) else {
                continue;
            };
            let grad = match self.stage {
                ZeroStage::One if grad.dims() == var.dims() => layout.shard_of(grad, rank)?,
                ZeroStage::Two if grad.dims() == layout.shard_dims().as_slice() => grad.clone(),
                // Whole gradients at stage 2 (deterministic training sums
                // them whole on every rank): this rank's piece of each.
                ZeroStage::Two if grad.dims() == var.dims() => layout.shard_of(grad, rank)?,
                stage => {
                    let want = match stage {
                        ZeroStage::One => format!("the parameter's {:?}", var.dims()),
                        ZeroStage::Two => format!("this rank's piece's {:?}", layout.shard_dims()),
                    };
                    return Err(Error::Zero(format!(
                        "the gradient of `{name}` has shape {:?}, not {want}: pass the \
                         gradients of the backward this optimizer was built for (its \
                         DistributedDataParallel's or RankPipeline's)",
                        grad.dims()
                    )));
                }
            };
            store.insert(piece.as_tensor(), grad);
        }
        Ok(store)
    }

    /// Every rank sends its pieces, group by group, as one flat buffer,
    /// and takes the others' from theirs: every group is exchanged (and,
    /// on a GPU group, completed) before any parameter is written; then
    /// each rank's real rows are written into the whole parameters in
    /// place.
    fn share_updates(&self) -> Result<()> {
        let mut writes: Vec<(usize, usize, Tensor)> = Vec::new();
        // A group whose parameters have no elements (a dtype held only by
        // an empty parameter) has nothing to share, and no piece to cat.
        for group in self.groups.iter().filter(|g| g.elems > 0) {
            let mine: Vec<Tensor> = group
                .members
                .iter()
                .map(|&i| self.pieces[i].1.as_tensor().clone())
                .collect();
            let layouts: Vec<&ShardLayout> =
                group.members.iter().map(|&i| &self.layouts[i]).collect();
            let gathered = all_gather_pieces(self.pg.as_ref(), &mine, &layouts)?;
            for (&i, pieces) in group.members.iter().zip(gathered) {
                writes.extend(
                    pieces
                        .into_iter()
                        .enumerate()
                        .map(|(rank, piece)| (i, rank, piece)),
                );
            }
        }
        self.pg.wait_for_device()?;
        for (i, rank, piece) in writes {
            self.layouts[i].write_rows(&self.params[i].1, &piece, rank)?;
        }
        Ok(())
    }

    /// PyTorch's `clip_grad_norm_` over every rank's gradients, for DDP's
    /// `grads` at either stage: every rank clips by the factor of the
    /// total norm. At stage 1 each rank holds the whole averaged gradients
    /// and computes it alone (DDP's bytes); at stage 2 each rank's norm of
    /// its pieces is combined with one all-reduce of one number within the
    /// shard group (on a mesh the replicas hold the same pieces; the total
    /// agrees with [`clip_grad_norm`](crate::optim::clip_grad_norm) of the
    /// whole gradients to rounding). Over a pipeline's stages
    /// ([`RankPipeline::zero_optimizer`](crate::pipeline::RankPipeline::zero_optimizer))
    /// the norm is summed over every stage's rank (at stage 2 over the
    /// whole mesh), a weight tied across stages counted once, as
    /// [`RankPipeline::clip_grad_norm`](crate::pipeline::RankPipeline::clip_grad_norm)
    /// does. Every rank must call it, before [`step`](Self::step).
    ///
    /// # Errors
    ///
    /// As [`clip_grad_norm`](crate::optim::clip_grad_norm), on every rank
    /// alike; a collective's error.
    pub fn clip_grad_norm(
        &self,
        grads: &mut GradStore,
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
        grads: &mut GradStore,
        max_norm: f64,
        norm_type: f64,
        error_if_nonfinite: bool,
        also: Option<AlsoAcross<'_>>,
    ) -> Result<crate::optim::Clipped> {
        let vars = self.grad_vars();
        if self.norm_group.is_none() && also.is_none() {
            return crate::optim::clip_grad_norm(
                grads,
                &vars,
                max_norm,
                norm_type,
                error_if_nonfinite,
            );
        }
        let also_counts = AlsoCounted::of(also, &self.params);
        let counted = |var: &Var| {
            let id = var.as_tensor().id();
            !self.uncounted.contains(&id) && also_counts.counts(var)
        };
        crate::optim::clip::clip_grad_norm_across_counting(
            &groups(self.norm_group.as_deref(), also),
            grads,
            &vars,
            &counted,
            max_norm,
            norm_type,
            error_if_nonfinite,
        )
    }

    /// The variables DDP's gradients are keyed by (the whole parameters;
    /// at stage 2 each entry holds this rank's piece): what
    /// [`GradScaler::unscale_across`](crate::optim::GradScaler::unscale_across)
    /// takes on every rank, so that an inf in any rank's gradients skips
    /// every rank's step.
    pub fn grad_vars(&self) -> Vec<Var> {
        self.params.iter().map(|(_, v)| v.clone()).collect()
    }

    /// This rank's pieces, named as their parameters: the variables its
    /// optimizer steps.
    pub fn shard_vars(&self) -> &[(String, Var)] {
        &self.pieces
    }

    /// The optimizer over this rank's pieces.
    pub fn inner(&self) -> &O {
        &self.inner
    }

    /// The optimizer over this rank's pieces, to change its settings (a
    /// learning-rate schedule).
    pub fn inner_mut(&mut self) -> &mut O {
        &mut self.inner
    }

    /// The ZeRO stage (the DDP's or the pipeline's).
    pub fn stage(&self) -> ZeroStage {
        self.stage
    }

    /// Which piece of each parameter this rank holds: its rank among the
    /// ranks the pieces split over (on a mesh, its shard group).
    pub fn shard_rank(&self) -> usize {
        self.pg.rank()
    }

    /// On a mesh ([`DdpBuilder::zero_on_mesh`](crate::DdpBuilder::zero_on_mesh)),
    /// which replica of the pieces this rank holds; 0 otherwise (and on a
    /// pipeline, whose replicas split the pieces: each is held once). A
    /// save needs one replica's shard states.
    pub fn replica_rank(&self) -> usize {
        self.replica_rank
    }

    /// Each parameter's name and split.
    fn named_layouts(&self) -> Vec<(String, ShardLayout)> {
        named_layouts(&self.params, &self.layouts)
    }
}

impl<O: StatefulOptimizer> ZeroOptimizer<O> {
    /// This rank's shard of the optimizer state: the state of its pieces,
    /// which rank of how many saved it ([`OptimizerState::shard`]), and
    /// each parameter's rows (`zero.rows.<name>` among its settings). Save
    /// one per rank (on a mesh, one per rank of one replica: the others
    /// hold the same); [`load_shards`](Self::load_shards) takes them back.
    /// Over a pipeline's stages the shards of different stages share
    /// their numbers: save those with
    /// [`RankPipeline::zero_stage_state`](crate::pipeline::RankPipeline::zero_stage_state).
    pub fn shard_state(&self) -> Result<OptimizerState> {
        let mut state = self.inner.state()?;
        let (rank, world) = (self.pg.rank(), self.pg.world_size());
        mark_shard(&mut state, rank, world, ROWS, &self.named_layouts());
        Ok(state)
    }

    /// Loads the state saved as shards by every rank of a run (all of
    /// them, in any order), on any number of ranks: each state tensor
    /// shaped like a piece (Adam's moments) is put back whole and this
    /// rank keeps its own piece of this run's split, so a run resumed on
    /// another world size re-shards the state. Every rank calls it with
    /// the same shards; no collective runs.
    ///
    /// # Errors
    ///
    /// [`Error::OptimizerState`] when the set is not one run's complete
    /// set (a rank's shard missing or given twice, shards of different
    /// world sizes, optimizers, steps or settings, one that records no
    /// rank, one that lacks an entry another has, such as a parameter's
    /// moments), when a parameter's rows differ from the save's or an
    /// entry names no parameter, or (from the optimizer) when an entry
    /// does not fit; nothing is loaded then. The error names the rank and
    /// the entry.
    pub fn load_shards(&mut self, shards: &[OptimizerState]) -> Result<()> {
        if shards.is_empty() {
            return Err(Error::OptimizerState("no shards to load".into()));
        }
        check_complete_set(shards)?;
        // The rest of the rule (one kind, step, settings and entries on
        // every rank) is FSDP's too: `reshard_states` checks it.
        let mut in_order: Vec<&OptimizerState> = shards.iter().collect();
        in_order.sort_by_key(|s| s.shard.map_or(0, |s| s.rank));
        let in_order: Vec<OptimizerState> = in_order.into_iter().cloned().collect();
        let fail = |what: String| Error::OptimizerState(format!("ZeRO shards: {what}"));
        let state = reshard_states(
            &in_order,
            ROWS,
            &self.named_layouts(),
            self.pg.rank(),
            &fail,
        )?;
        self.inner.load_state(&state)
    }

    /// The optimizer state of the whole parameters, put together on the
    /// CPU of the first rank of those they split over (on a pipeline, the
    /// stage's first replica) from every rank's pieces, gathered there one
    /// state tensor at a time: what an optimizer over the whole parameters
    /// would hold. `None` on the other ranks. Every rank of that group
    /// calls it.
    ///
    /// # Errors
    ///
    /// A collective's; the pieces' states not fitting together.
    pub(crate) fn whole_state_on_first(&self) -> Result<Option<OptimizerState>> {
        let whole = whole_layouts(&self.named_layouts());
        whole_state_on_first(self.pg.as_ref(), &self.shard_state()?, ROWS, &whole)
    }

    /// Loads a state of the whole parameters ([`whole_state_on_first`](Self::whole_state_on_first)'s,
    /// or a plain optimizer's over them): this rank keeps its pieces' part.
    /// No collective runs.
    ///
    /// # Errors
    ///
    /// As [`load_shards`](Self::load_shards).
    pub(crate) fn load_whole_state(&mut self, whole: &OptimizerState) -> Result<()> {
        let mut state = whole.clone();
        mark_shard(
            &mut state,
            0,
            1,
            ROWS,
            &whole_layouts(&self.named_layouts()),
        );
        self.load_shards(&[state])
    }

    /// Bytes of optimizer state this rank holds.
    pub fn state_bytes(&self) -> Result<usize> {
        Ok(self
            .inner
            .state()?
            .tensors
            .values()
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum())
    }
}

impl<O> fmt::Debug for ZeroOptimizer<O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZeroOptimizer")
            .field("stage", &self.stage)
            .field("rank", &self.world.rank())
            .field("world_size", &self.world.world_size())
            .field("shard_rank", &self.pg.rank())
            .field("shard_size", &self.pg.world_size())
            .field("replica_rank", &self.replica_rank)
            .field("parameters", &self.params.len())
            .finish_non_exhaustive()
    }
}

/// Checks that `shards` are every rank's shard of one run, each once:
/// what each records ([`OptimizerState::shard`]) must name the same world
/// size and, together, each of its ranks.
fn check_complete_set(shards: &[OptimizerState]) -> Result<()> {
    let refuse = |why: String| Err(Error::OptimizerState(why));
    let mut world = None;
    let mut ranks = BTreeSet::new();
    for (k, shard) in shards.iter().enumerate() {
        let Some(ShardOf { rank, world_size }) = shard.shard else {
            return refuse(format!(
                "shard {k} does not record which rank saved it: only states from \
                 ZeroOptimizer::shard_state can be checked for a complete set"
            ));
        };
        match world {
            None => world = Some(world_size),
            Some(w) if w != world_size => {
                return refuse(format!(
                    "shard {k} was saved by rank {rank} of {world_size}, shard 0 by a run of {w} \
                     ranks: the shards are not of one run"
                ))
            }
            Some(_) => {}
        }
        if rank >= world_size {
            return refuse(format!(
                "shard {k} says it is rank {rank} of {world_size}: there is no such rank"
            ));
        }
        if !ranks.insert(rank) {
            return refuse(format!(
                "two shards were saved by rank {rank}: the shards are not of one run"
            ));
        }
    }
    let world = world.unwrap_or(0);
    if ranks.len() == world {
        return Ok(());
    }
    // At most `shards.len()` ranks are present, so this ends after a few
    // steps whatever world size a shard claims.
    let missing: Vec<usize> = (0..world).filter(|r| !ranks.contains(r)).take(8).collect();
    let more = if world - ranks.len() > missing.len() {
        format!(" (and {} more)", world - ranks.len() - missing.len())
    } else {
        String::new()
    };
    refuse(format!(
        "the shards of rank(s) {missing:?}{more} of the {world} that saved the state are \
         missing: their parameters would restart from no state"
    ))
}

/// The parameters by dtype and device, in order of first appearance (the
/// same on every rank), with the elements of each rank's pieces.
fn gather_groups(params: &[(String, Var)], layouts: &[ShardLayout]) -> Vec<GatherGroup> {
    let mut keys: Vec<(DType, Device)> = Vec::new();
    let mut groups: Vec<GatherGroup> = Vec::new();
    for (i, (_, var)) in params.iter().enumerate() {
        let found = keys
            .iter()
            .position(|(dtype, device)| *dtype == var.dtype() && device.same_device(var.device()));
        let g = match found {
            Some(g) => g,
            None => {
                keys.push((var.dtype(), var.device().clone()));
                groups.push(GatherGroup {
                    members: Vec::new(),
                    elems: 0,
                });
                groups.len() - 1
            }
        };
        groups[g].members.push(i);
        groups[g].elems += layouts[i].shard_elems();
    }
    groups
}

/// Bytes of the gradients `grads` holds: after a ZeRO stage 2 backward,
/// this rank's pieces only.
pub fn grad_bytes(grads: &GradStore) -> usize {
    grads
        .get_ids()
        .filter_map(|id| grads.get_id(*id))
        .map(|t| t.elem_count() * t.dtype().size_in_bytes())
        .sum()
}
