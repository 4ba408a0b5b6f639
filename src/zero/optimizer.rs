//! [`ZeroOptimizer`]: any optimizer, run by each rank on the parameters it
//! owns, the updated parameters then shared with every rank.

use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};

use super::{Partition, ZeroStage};
use crate::comm::{all_gather_object, ProcessGroup};
use crate::ddp::DistributedDataParallel;
use crate::error::{Error, Result};
use crate::optim::{OptimizerState, ShardOf, StatefulOptimizer};

/// An optimizer sharded across the ranks of a
/// [`DistributedDataParallel`] built with [`zero`](crate::DdpBuilder::zero)
/// (ZeRO stage 1 or 2; PyTorch's `ZeroRedundancyOptimizer`, DeepSpeed's
/// stages 1-2): each rank builds its optimizer over the parameters it owns
/// ([`Partition`]), so it holds their optimizer state only, and
/// [`step`](Self::step) updates them, then all-gathers every rank's updated
/// parameters into every rank's model.
///
/// **Exact.** With an optimizer that updates each parameter from its own
/// gradient and state (SGD, Adam, AdamW: candle's and the crate's), the
/// weights are bitwise those of DDP with the same optimizer over all
/// parameters: the gradients are DDP's, each update is the one DDP's
/// optimizer would make, and the all-gather copies. An optimizer that
/// couples parameters (a global gradient norm, LAMB's trust ratio across
/// layers) would see only this rank's.
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
///     // Each rank's AdamW holds the state of the parameters it owns only.
///     let mut opt = ZeroOptimizer::new(&ddp, |mine| AdamW::new_named(mine, AdamWConfig::default()))?;
///     let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
///     let loss = ddp.forward(&x)?.sum_all()?;
///     let grads = ddp.backward(&loss)?; // stage 2: this rank's parameters' gradients only
///     opt.step(&grads)?;
///     Ok(())
/// })?;
/// # Ok::<(), anyhow::Error>(())
/// ```
pub struct ZeroOptimizer<O> {
    inner: O,
    pg: Arc<dyn ProcessGroup>,
    stage: ZeroStage,
    params: Vec<(String, Var)>,
    partition: Arc<Partition>,
    groups: Vec<GatherGroup>,
}

/// Parameters of one dtype and device, all-gathered as one flat buffer.
struct GatherGroup {
    dtype: DType,
    device: Device,
    /// Indices into the parameters, in their order.
    members: Vec<usize>,
    /// Elements each rank sends: the most any rank owns in this group (the
    /// others pad with zeros).
    padded: usize,
}

impl<O: candle_nn::Optimizer> ZeroOptimizer<O> {
    /// Builds this rank's optimizer with `make`, given the parameters this
    /// rank owns (named, in the model's order: pass them to the crate's
    /// optimizers' `new_named`, or their `Var`s to any candle optimizer).
    /// Every rank must call it.
    ///
    /// # Errors
    ///
    /// [`Error::Zero`] if `ddp` was not built with
    /// [`zero`](crate::DdpBuilder::zero); `make`'s error.
    pub fn new<M, F>(ddp: &DistributedDataParallel<M>, make: F) -> Result<Self>
    where
        F: FnOnce(Vec<(String, Var)>) -> candle_core::Result<O>,
    {
        let (stage, partition) = match (ddp.zero_stage(), ddp.zero_partition()) {
            (Some(stage), Some(partition)) => (stage, Arc::clone(partition)),
            _ => {
                return Err(Error::Zero(
                    "this DistributedDataParallel shards nothing: build it with \
                     DistributedDataParallel::builder(..).zero(ZeroStage::One) (or Two)"
                        .into(),
                ))
            }
        };
        let pg = Arc::clone(ddp.process_group());
        let params = ddp.params().to_vec();
        let rank = pg.rank();
        let owned: Vec<(String, Var)> = params
            .iter()
            .enumerate()
            .filter(|&(i, _)| partition.owns(rank, i))
            .map(|(_, p)| p.clone())
            .collect();
        let inner = make(owned)?;
        let groups = gather_groups(&params, &partition);
        Ok(Self {
            inner,
            pg,
            stage,
            params,
            partition,
            groups,
        })
    }

    /// Updates this rank's parameters from `grads` (DDP's averaged
    /// gradients: at stage 2 only this rank's parameters have one), then
    /// gives every rank every other rank's updated parameters. Every rank
    /// must call it.
    ///
    /// # Errors
    ///
    /// If any rank's update fails, every rank returns [`Error::Zero`]
    /// naming it, with every parameter as before the step (the ranks agree
    /// on the updates' outcome before they exchange anything). If the
    /// exchange fails, this rank's parameters are put back and no other
    /// rank's value has been written. The optimizer's own state is not
    /// rolled back: resume from a checkpoint, as after any failed
    /// collective.
    pub fn step(&mut self, grads: &GradStore) -> Result<()> {
        let rank = self.pg.rank();
        let mine: Vec<usize> = self.owned_indices(rank).collect();
        let before = mine
            .iter()
            .map(|&i| self.params[i].1.as_tensor().copy())
            .collect::<candle_core::Result<Vec<_>>>();
        let updated = match &before {
            Ok(_) => self.inner.step(grads).map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        // A rank whose update failed must not leave the others waiting in
        // the exchange: all learn every rank's outcome first.
        let outcomes = all_gather_object(self.pg.as_ref(), &updated.err());
        let result = match outcomes {
            Err(e) => Err(Error::from(e)),
            Ok(outcomes) => match outcomes
                .iter()
                .enumerate()
                .find_map(|(r, failed)| failed.as_ref().map(|why| (r, why)))
            {
                Some((culprit, why)) => Err(Error::Zero(format!(
                    "the optimizer step of rank {culprit} failed: {why}; every rank's parameters \
                     are as before the step"
                ))),
                None => self.share_updates(),
            },
        };
        if result.is_err() {
            if let Ok(before) = &before {
                for (&i, old) in mine.iter().zip(before) {
                    // Best effort: the error being returned says what failed.
                    let _ = self.params[i].1.set(old);
                }
            }
        }
        result
    }

    /// Every rank sends the parameters it owns, group by group, as one
    /// flat buffer (padded to the largest rank's share), and takes the
    /// others' from theirs: every group is exchanged (and, on a GPU group,
    /// completed) before any parameter is written.
    fn share_updates(&self) -> Result<()> {
        let rank = self.pg.rank();
        let owners = self.partition.owners();
        let mut writes: Vec<(usize, Tensor)> = Vec::new();
        // A group whose parameters have no elements (a dtype held only by
        // an empty parameter) has nothing to share, and no piece to cat.
        for group in self.groups.iter().filter(|g| g.padded > 0) {
            let mut pieces = Vec::new();
            let mut sent = 0;
            for &i in group.members.iter().filter(|&&i| owners[i] == rank) {
                let var = &self.params[i].1;
                pieces.push(var.as_tensor().flatten_all()?);
                sent += var.elem_count();
            }
            if sent < group.padded {
                pieces.push(Tensor::zeros(
                    group.padded - sent,
                    group.dtype,
                    &group.device,
                )?);
            }
            let flat = Tensor::cat(&pieces, 0)?;
            // Each rank's piece as it came (all_gather_into would copy them
            // all into one buffer first).
            let all = self.pg.all_gather(&flat)?;
            for (owner, piece) in all.iter().enumerate() {
                let mut offset = 0;
                for &i in group.members.iter().filter(|&&i| owners[i] == owner) {
                    let var = &self.params[i].1;
                    let n = var.elem_count();
                    if owner != rank {
                        writes.push((i, piece.narrow(0, offset, n)?.reshape(var.shape())?));
                    }
                    offset += n;
                }
            }
        }
        self.pg.wait_for_device()?;
        for (i, value) in writes {
            self.params[i].1.set(&value)?;
        }
        Ok(())
    }

    fn owned_indices(&self, rank: usize) -> impl Iterator<Item = usize> + '_ {
        (0..self.params.len()).filter(move |&i| self.partition.owns(rank, i))
    }

    /// PyTorch's `clip_grad_norm_` over every rank's gradients, for DDP's
    /// `grads` at either stage: each rank clips the gradients of the
    /// parameters it owns (the only ones its optimizer steps) by the
    /// factor of the total norm of all of them, which one all-reduce of
    /// one number gives every rank. Every rank must call it, before
    /// [`step`](Self::step). The total agrees with
    /// [`clip_grad_norm`](crate::optim::clip_grad_norm) of the whole
    /// gradients to rounding.
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
        let mine: Vec<Var> = self
            .owned_indices(self.pg.rank())
            .map(|i| self.params[i].1.clone())
            .collect();
        crate::optim::clip::clip_grad_norm_across(
            self.pg.as_ref(),
            grads,
            &mine,
            max_norm,
            norm_type,
            error_if_nonfinite,
        )
    }

    /// The parameters this rank owns (the ones its optimizer steps, whose
    /// gradients it keeps at stage 2): what
    /// [`GradScaler::unscale_across`](crate::optim::GradScaler::unscale_across)
    /// takes on every rank, so that an inf in any rank's gradients skips
    /// every rank's step.
    pub fn owned_params(&self) -> Vec<Var> {
        self.owned_indices(self.pg.rank())
            .map(|i| self.params[i].1.clone())
            .collect()
    }

    /// The optimizer over this rank's parameters.
    pub fn inner(&self) -> &O {
        &self.inner
    }

    /// The optimizer over this rank's parameters, to change its settings
    /// (a learning-rate schedule).
    pub fn inner_mut(&mut self) -> &mut O {
        &mut self.inner
    }

    /// The stage the DDP was built with.
    pub fn stage(&self) -> ZeroStage {
        self.stage
    }

    /// Which rank owns which parameter.
    pub fn partition(&self) -> &Partition {
        &self.partition
    }

    /// The names of the parameters this rank owns.
    pub fn owned_names(&self) -> Vec<&str> {
        self.owned_indices(self.pg.rank())
            .map(|i| self.params[i].0.as_str())
            .collect()
    }
}

impl<O: StatefulOptimizer> ZeroOptimizer<O> {
    /// This rank's shard of the optimizer state: the entries of the
    /// parameters it owns, and which rank of how many saved it
    /// ([`OptimizerState::shard`]). Save one per rank;
    /// [`load_shards`](Self::load_shards) takes them back.
    pub fn shard_state(&self) -> Result<OptimizerState> {
        let mut state = self.inner.state()?;
        state.shard = Some(ShardOf {
            rank: self.pg.rank(),
            world_size: self.pg.world_size(),
        });
        Ok(state)
    }

    /// Loads the state saved as shards by every rank of a run (all of
    /// them, in any order), on any number of ranks: this rank keeps the
    /// entries of the parameters it owns now, so a run resumed on another
    /// world size re-partitions the state.
    ///
    /// # Errors
    ///
    /// [`Error::OptimizerState`] when the set is not one run's complete
    /// set (a rank's shard missing or given twice, shards of different
    /// world sizes, optimizers, steps or settings, one that records no
    /// rank), when two shards hold one parameter, or (from the optimizer)
    /// when an entry does not fit; nothing is loaded then.
    pub fn load_shards(&mut self, shards: &[OptimizerState]) -> Result<()> {
        let Some(first) = shards.first() else {
            return Err(Error::OptimizerState("no shards to load".into()));
        };
        check_complete_set(shards)?;
        let mut merged = OptimizerState {
            kind: first.kind.clone(),
            steps: first.steps,
            settings: first.settings.clone(),
            tensors: Default::default(),
            shard: None,
        };
        let owned: BTreeSet<&str> = self.owned_names().into_iter().collect();
        let all: BTreeSet<&str> = self.params.iter().map(|(n, _)| n.as_str()).collect();
        let mut seen = BTreeSet::new();
        for (k, shard) in shards.iter().enumerate() {
            if shard.kind != first.kind
                || shard.steps != first.steps
                || shard.settings != first.settings
            {
                return Err(Error::OptimizerState(format!(
                    "shard {k} is of {} after {} steps with settings {:?}, shard 0 of {} after {} steps with {:?}: the shards are not of one run",
                    shard.kind, shard.steps, shard.settings, first.kind, first.steps, first.settings
                )));
            }
            for (key, tensor) in &shard.tensors {
                if !seen.insert(key.clone()) {
                    return Err(Error::OptimizerState(format!(
                        "`{key}` is in two shards: the shards are not of one run"
                    )));
                }
                let param = key.rsplit_once('.').map_or(key.as_str(), |(p, _)| p);
                if !all.contains(param) {
                    return Err(Error::OptimizerState(format!(
                        "`{key}` names no parameter of this model: the shards must come from \
                         optimizers that name their state after the parameters (the crate's \
                         `new_named`), not by position, to be re-partitioned"
                    )));
                }
                if owned.contains(param) {
                    merged.tensors.insert(key.clone(), tensor.clone());
                }
            }
        }
        self.inner.load_state(&merged)
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
            .field("rank", &self.pg.rank())
            .field("partition", &self.partition)
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
/// same on every rank), with each group's padded share.
fn gather_groups(params: &[(String, Var)], partition: &Partition) -> Vec<GatherGroup> {
    let mut groups: Vec<GatherGroup> = Vec::new();
    for (i, (_, var)) in params.iter().enumerate() {
        let found = groups
            .iter_mut()
            .find(|g| g.dtype == var.dtype() && g.device.same_device(var.device()));
        match found {
            Some(group) => group.members.push(i),
            None => groups.push(GatherGroup {
                dtype: var.dtype(),
                device: var.device().clone(),
                members: vec![i],
                padded: 0,
            }),
        }
    }
    let owners = partition.owners();
    for group in &mut groups {
        group.padded = (0..partition.world_size())
            .map(|r| {
                group
                    .members
                    .iter()
                    .filter(|&&i| owners[i] == r)
                    .map(|&i| params[i].1.elem_count())
                    .sum::<usize>()
            })
            .max()
            .unwrap_or(0);
    }
    groups
}

/// Bytes of the gradients `grads` holds: after a ZeRO stage 2 step, this
/// rank's parameters' only.
pub fn grad_bytes(grads: &GradStore) -> usize {
    grads
        .get_ids()
        .filter_map(|id| grads.get_id(*id))
        .map(|t| t.elem_count() * t.dtype().size_in_bytes())
        .sum()
}
