//! What the replicas of a [`RankPipeline`]'s stages share on a mesh (pp x
//! dp): each step's gradients, averaged whole as DDP averages them, or,
//! with ZeRO ([`RankPipelineConfig::zero`](super::RankPipelineConfig::zero)),
//! reduce-scattered into one piece per replica, stepped by a
//! [`ZeroOptimizer`] over the pieces (torchtitan's pipeline with FSDP over
//! its replicas holds the same split of gradients and optimizer state
//! during a step).

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

use super::on_ranks::RankPipeline;
use crate::comm::{ProcessGroup, ReduceOp, SubGroup};
use crate::ddp::ZeroStage;
use crate::error::{Error, Result};
use crate::optim::{OptimizerState, StatefulOptimizer};
use crate::sharding::{reduce_scatter_grads, ShardLayout};
use crate::zero::{ZeroOptimizer, ZeroSplit};

impl RankPipeline {
    /// Averages this rank's gradients over its stages' replicas: whole, in
    /// one collective, or at ZeRO stage 2 reduce-scattered, so that each
    /// entry of `grads` holds this rank's piece (a missing gradient counts
    /// as zeros in both). `wholes` are the variables the step's stages
    /// used, in the order of [`variables`](Self::variables): the variables
    /// themselves, or with FSDP the whole values gathered for the step,
    /// whose pieces' gradients are then keyed by the variables (the
    /// pieces).
    pub(super) fn reduce_across_replicas(
        &self,
        replicas: &SubGroup,
        wholes: &[(String, Var)],
        grads: &mut GradStore,
    ) -> Result<()> {
        if self.config.zero == Some(ZeroStage::Two) {
            return self.reduce_scatter_across(wholes, grads);
        }
        let vars: Vec<&Var> = wholes.iter().map(|(_, v)| v).collect();
        let mine = vars
            .iter()
            .map(|v| {
                grads
                    .get(v.as_tensor())
                    .cloned()
                    .map_or_else(|| v.zeros_like(), Ok)
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let averaged = replicas.all_reduce_concat(&mine, ReduceOp::Avg)?;
        let mut offset = 0;
        for var in vars {
            let n = var.elem_count();
            let g = averaged.narrow(0, offset, n)?.reshape(var.dims())?;
            grads.insert(var.as_tensor(), g);
            offset += n;
        }
        Ok(())
    }

    /// ZeRO stage 2: one reduce-scatter per dtype of this rank's
    /// variables, in their order.
    fn reduce_scatter_across(&self, wholes: &[(String, Var)], grads: &mut GradStore) -> Result<()> {
        let dtypes: BTreeSet<&str> = wholes.iter().map(|(_, v)| v.dtype().as_str()).collect();
        // The pieces split over the shard group (every replica, or with
        // hybrid sharding its group), then each averaged across the groups.
        let Some(groups) = &self.pieces else {
            return Err(Error::Zero(
                "a ZeRO pipeline built without its piece groups".into(),
            ));
        };
        let world = groups.shard().world_size();
        for dtype in dtypes {
            let members: Vec<usize> = (0..wholes.len())
                .filter(|&i| wholes[i].1.dtype().as_str() == dtype)
                .collect();
            let dtype = wholes[members[0]].1.dtype();
            // A missing gradient counts as zeros, as the replicas' average
            // and stage 1 take it (the optimizer then decays it alike), and
            // no presence flag is read back from the reduction.
            let whole_grads: Vec<Option<Tensor>> = members
                .iter()
                .map(|&i| grads.remove(wholes[i].1.as_tensor()))
                .collect();
            let present = vec![1.0; members.len()];
            let layouts: Vec<&ShardLayout> =
                members.iter().map(|&i| &self.zero_layouts[i]).collect();
            let pieces = reduce_scatter_grads(
                &whole_grads,
                &layouts,
                dtype,
                &self.device,
                &vec![dtype; members.len()],
                Some(&present),
                world,
                |table, section| Ok(groups.reduce_scatter(table, ReduceOp::Avg, section)?),
            )?;
            for (&i, piece) in members.iter().zip(pieces) {
                if let Some(piece) = piece {
                    grads.insert(self.own[i].1.as_tensor(), piece);
                }
            }
        }
        Ok(())
    }

    /// The ZeRO stage this pipeline was built with (on a mesh), if any.
    pub fn zero_stage(&self) -> Option<ZeroStage> {
        self.config.zero
    }

    /// The optimizer of a pipeline built with
    /// [`zero`](super::RankPipelineConfig::zero): `make` builds it over this
    /// rank's piece of each of its stages' variables (named as the
    /// variable), and [`ZeroOptimizer::step`] takes
    /// [`forward_backward`](Self::forward_backward)'s gradients (whole at
    /// stage 1, this rank's pieces at stage 2), updates the pieces and
    /// all-gathers them across the replicas into the whole variables. Its
    /// [`clip_grad_norm`](ZeroOptimizer::clip_grad_norm) is the whole
    /// model's. Every rank of the mesh calls it.
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use candle_dp::comm::DeviceMesh;
    /// use candle_dp::launch::spawn;
    /// use candle_dp::optim::{AdamW, AdamWConfig};
    /// use candle_dp::pipeline::{unit, RankPipeline, RankPipelineConfig};
    /// use candle_dp::zero::ZeroStage;
    /// use candle_dp::LossReduction;
    /// use candle_nn::{linear, loss, Activation, VarMap};
    ///
    /// // 2 pipelines of 2 stages; each stage's replicas split its state.
    /// spawn(4, |ctx| {
    ///     let mesh = DeviceMesh::new(ctx.process_group(), &[("dp", 2), ("pp", 2)])?;
    ///     let layers = vec![
    ///         unit(|vb| linear(4, 8, vb.pp("a"))),
    ///         unit(|_| Ok(Activation::Relu)),
    ///         unit(|vb| linear(8, 2, vb.pp("b"))),
    ///     ];
    ///     let config = RankPipelineConfig { zero: Some(ZeroStage::Two), ..Default::default() };
    ///     let pipe = RankPipeline::on_mesh(&mesh, ("pp", "dp"), &VarMap::new(), DType::F32,
    ///         &Device::Cpu, layers, config)?;
    ///     let mut opt = pipe.zero_optimizer(|mine| AdamW::new_named(mine, AdamWConfig::default()))?;
    ///     let x = Tensor::ones((4, 4), DType::F32, &Device::Cpu)?;
    ///     let y = Tensor::new(&[0u32, 1, 0, 1], &Device::Cpu)?;
    ///     let stage = mesh.local_rank("pp")?;
    ///     let step = pipe.forward_backward((stage == 0).then_some(&x), (stage == 1).then_some(&y),
    ///         LossReduction::Mean, |out, y| loss::cross_entropy(out, y))?;
    ///     opt.step(&step.grads)?;
    ///     Ok(())
    /// })?;
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Zero`] if the pipeline was built without ZeRO; `make`'s.
    pub fn zero_optimizer<O, F>(&self, make: F) -> Result<ZeroOptimizer<O>>
    where
        O: candle_nn::Optimizer,
        F: FnOnce(Vec<(String, Var)>) -> candle_core::Result<O>,
    {
        if self.is_fsdp() {
            return Err(Error::Zero(
                "an FSDP pipeline's variables are its pieces: step any optimizer over \
                 RankPipeline::variables() instead of a ZeroOptimizer"
                    .into(),
            ));
        }
        let (Some(stage), Some(replicas), Some(world)) =
            (self.config.zero, &self.replicas, &self.world)
        else {
            return Err(Error::Zero(
                "this pipeline shards nothing: build it on a mesh with \
                 RankPipelineConfig { zero: Some(ZeroStage::One), .. } (or Two)"
                    .into(),
            ));
        };
        let counted = self
            .own
            .iter()
            .map(|(name, _)| self.counts_in_norm(name))
            .collect();
        let split = ZeroSplit {
            world: Arc::clone(world),
            pg: Arc::clone(replicas),
            replica_rank: 0,
            stage,
            params: self.own.clone(),
            layouts: self.zero_layouts.clone(),
            // Stage 1: the replicas hold the same whole gradients, the
            // stages different ones; stage 2: every rank its own pieces.
            norm_group: Some(match stage {
                ZeroStage::One => Arc::clone(&self.pg),
                ZeroStage::Two => Arc::clone(world),
            }),
            counted,
        };
        ZeroOptimizer::from_split(split, make)
    }

    /// [`stage_state`](Self::stage_state) of a pipeline built with
    /// [`zero`](super::RankPipelineConfig::zero), on the first replica's
    /// ranks (the ones that write a checkpoint; `None` on the others): the
    /// optimizer state of this rank's whole variables, put together on the
    /// CPU from every replica's pieces, so that the checkpoint is a plain
    /// pipeline's and resumes on any split of stages and replicas, with or
    /// without ZeRO. Every rank of the mesh calls it.
    ///
    /// # Errors
    ///
    /// A collective's; a copy that cannot be made.
    pub fn zero_stage_state<O: StatefulOptimizer>(
        &self,
        zero: &ZeroOptimizer<O>,
    ) -> Result<Option<(HashMap<String, Tensor>, OptimizerState)>> {
        zero.whole_state_on_first()?
            .map(|state| self.stage_state_with(state))
            .transpose()
    }

    /// [`load_stages`](Self::load_stages) into a pipeline built with
    /// [`zero`](super::RankPipelineConfig::zero): `zero` keeps its pieces'
    /// part of the stages' saved state. No collective runs.
    ///
    /// # Errors
    ///
    /// As [`load_stages`](Self::load_stages).
    pub fn load_zero_stages<O: StatefulOptimizer>(
        &self,
        values: &[HashMap<String, Tensor>],
        states: &[OptimizerState],
        zero: &mut ZeroOptimizer<O>,
    ) -> Result<()> {
        self.load_stages_with(values, states, |state| zero.load_whole_state(state))
    }

    /// The group the gradients' norm is summed over: the pipeline's ranks,
    /// or at ZeRO stage 2 (pieces) the whole mesh.
    pub(super) fn norm_group(&self) -> &Arc<dyn ProcessGroup> {
        match (self.config.zero, &self.world) {
            (Some(ZeroStage::Two), Some(world)) => world,
            _ => &self.pg,
        }
    }
}
