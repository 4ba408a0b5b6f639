//! FSDP across the replicas of a [`RankPipeline`]'s stages
//! ([`RankPipelineConfig::fsdp`](super::RankPipelineConfig::fsdp)): between
//! steps each rank holds only its piece of each of its stages' variables
//! (ZeRO's per-parameter pieces); a step all-gathers them across the
//! replicas, builds the stages over the whole values, and drops them once
//! its gradients are reduce-scattered back to the pieces. The whole
//! variables live for one step's micro-batches, as torchtitan's FSDP on a
//! pipeline keeps them (it does not reshard between micro-batches).
//!
//! A checkpoint is a plain pipeline's: the first replica saves each stage
//! whole ([`fsdp_stage_state`](RankPipeline::fsdp_stage_state)), and it
//! resumes with or without FSDP or ZeRO, on any split.

use std::collections::{BTreeSet, HashMap};

use candle_core::{DType, Tensor, Var};
use candle_nn::VarMap;

use super::on_ranks::{RankPipeline, Rebuild};
use super::stage::Stage;
use super::stage_build::build_stage;
use super::UnitFactory;
use crate::error::{Error, Result};
use crate::optim::{OptimizerState, ShardOf, StatefulOptimizer};
use crate::sharding::state::{
    mark_shard, named_layouts, piece_state, whole_layouts, whole_state_on_first,
};
use crate::sharding::{gather_whole_vars, ShardLayout};
use crate::util::lock::lock;

/// The settings key of a parameter's rows in a state of pieces.
const ROWS: &str = "pipeline.rows.";

/// A step's stages, built over the whole variables gathered for it.
pub(super) struct GatheredStages {
    /// This rank's stages, in the order of its stage numbers.
    pub(super) stages: Vec<Stage>,
    /// The whole variables, in the order of
    /// [`variables`](RankPipeline::variables)' pieces.
    pub(super) wholes: Vec<(String, Var)>,
}

impl RankPipeline {
    /// Whether this pipeline holds its variables as pieces between steps
    /// ([`RankPipelineConfig::fsdp`](super::RankPipelineConfig::fsdp)).
    pub fn is_fsdp(&self) -> bool {
        self.rebuild.is_some()
    }

    /// Turns a pipeline just built on a mesh (its replicas equal, its
    /// ZeRO layouts made) into FSDP's: each variable of `varmap` this
    /// rank's stages use replaced by this replica's piece of it, and the
    /// stages (which hold the whole ones) dropped until a step needs them.
    pub(super) fn shard_at_rest(
        &mut self,
        varmap: &VarMap,
        dtype: DType,
        layers: &[UnitFactory],
    ) -> Result<()> {
        let rank = self.piece_rank();
        let mut pieces = Vec::with_capacity(self.own.len());
        for ((name, whole), layout) in self.own.iter().zip(&self.zero_layouts) {
            let piece = Var::from_tensor(&layout.shard_of(whole.as_tensor(), rank)?)?;
            pieces.push((name.clone(), piece));
        }
        {
            let mut data = lock(varmap.data());
            for (name, piece) in &pieces {
                data.insert(name.clone(), piece.clone());
            }
        }
        let mut stages = Vec::with_capacity(self.stages_held().len());
        for &k in self.stages_held() {
            let first: usize = self.balance()[..k].iter().sum();
            stages.push((first, layers[first..first + self.balance()[k]].to_vec()));
        }
        self.own = pieces;
        self.held.clear();
        self.rebuild = Some(Rebuild { dtype, stages });
        Ok(())
    }

    /// With FSDP, this step's stages over the whole variables, gathered
    /// across the replicas; `None` for a pipeline that keeps its stages.
    /// Every replica calls it.
    ///
    /// A failure to build them (a factory's error, a variable it did not
    /// ask for before) fails the mesh, so that no other rank waits for
    /// this one's messages until the timeout.
    pub(super) fn gather_stages(&self) -> Result<Option<GatheredStages>> {
        let Some(rebuild) = &self.rebuild else {
            return Ok(None);
        };
        let built = self.build_gathered(rebuild);
        if let Err(e) = &built {
            // Named by its rank in the mesh, which every rank knows it by.
            let rank = self.world.as_ref().map_or(self.pg.rank(), |w| w.rank());
            let reason = format!("rank {rank} could not build its stages: {e}");
            match &self.world {
                Some(world) => world.abort(&reason),
                None => self.pg.abort(&reason),
            }
        }
        built.map(Some)
    }

    /// [`gather_stages`](Self::gather_stages)' work.
    fn build_gathered(&self, rebuild: &Rebuild) -> Result<GatheredStages> {
        let varmap = VarMap::new();
        let wholes = {
            let mut data = lock(varmap.data());
            let mut wholes = Vec::with_capacity(self.own.len());
            for ((name, _), var) in self.own.iter().zip(self.gather_wholes()?) {
                data.insert(name.clone(), var.clone());
                wholes.push((name.clone(), var));
            }
            // The buffers are whole on every replica: the stages mirror
            // them as a kept pipeline's do.
            for (name, var) in &self.buffers {
                data.insert(name.clone(), var.clone());
            }
            wholes
        };
        let stages = rebuild
            .stages
            .iter()
            .map(|(first, layers)| {
                build_stage(
                    &varmap,
                    rebuild.dtype,
                    self.config.mixed_precision.as_ref(),
                    &self.device,
                    *first,
                    layers,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        // A factory that asked for a variable it did not ask for when the
        // pipeline was built would get a fresh one here, silently.
        let known: BTreeSet<&str> = self.own.iter().map(|(n, _)| n.as_str()).collect();
        let asked: BTreeSet<&str> = stages
            .iter()
            .flat_map(|s| s.vars.iter().map(|v| v.name.as_str()))
            .collect();
        if let Some(name) = asked.difference(&known).next() {
            return Err(Error::Candle(candle_core::Error::Msg(format!(
                "a layer asked for `{name}`, which it did not ask for when the pipeline was \
                 built (FSDP builds the stages again each step: a factory must ask for the \
                 same variables every time)"
            ))));
        }
        Ok(GatheredStages { stages, wholes })
    }

    /// The whole values of this rank's variables, in their order: with
    /// FSDP all-gathered from the replicas' pieces (one collective per
    /// dtype) into fresh variables, otherwise the variables themselves.
    pub(super) fn gather_wholes(&self) -> Result<Vec<Var>> {
        self.gather_wholes_to(None)
            .map(|wholes| wholes.unwrap_or_default())
    }

    /// [`gather_wholes`](Self::gather_wholes), onto replica `root` only
    /// (`None` elsewhere) when it is given.
    fn gather_wholes_to(&self, root: Option<usize>) -> Result<Option<Vec<Var>>> {
        let Some(replicas) = self.piece_group().filter(|_| self.is_fsdp()) else {
            return Ok(Some(self.own.iter().map(|(_, v)| v.clone()).collect()));
        };
        let pieces: Vec<&Var> = self.own.iter().map(|(_, v)| v).collect();
        let layouts: Vec<&ShardLayout> = self.zero_layouts.iter().collect();
        gather_whole_vars(replicas.as_ref(), &pieces, &layouts, root)
    }

    /// The bytes of this rank's stages' variables whole: what a step of an
    /// FSDP pipeline gathers (and holds until it returns).
    pub fn stage_bytes(&self) -> usize {
        (0..self.own.len())
            .map(|i| {
                let elems: usize = self.whole_dims(i).iter().product();
                elems * self.own[i].1.dtype().size_in_bytes()
            })
            .sum()
    }

    /// [`stage_state`](Self::stage_state) of an FSDP pipeline, on the
    /// first replica's ranks (`None` on the others): this rank's stages'
    /// variables put together whole, and the optimizer state of the whole
    /// variables put together on the CPU from every replica's pieces
    /// (`opt`: an optimizer over [`variables`](Self::variables), the
    /// pieces). The checkpoint is a plain pipeline's, and resumes on any
    /// split of stages and replicas, with or without FSDP or ZeRO. Every
    /// rank of the mesh calls it.
    ///
    /// # Errors
    ///
    /// [`Error::Zero`] on a pipeline without FSDP; a collective's; a copy
    /// that cannot be made.
    pub fn fsdp_stage_state<O: StatefulOptimizer>(
        &self,
        opt: &O,
    ) -> Result<Option<(HashMap<String, Tensor>, OptimizerState)>> {
        let replicas = self.fsdp_replicas()?;
        // Only the first replica writes: the others send their pieces.
        let wholes = self.gather_wholes_to(Some(0))?;
        let layouts = named_layouts(&self.own, &self.zero_layouts);
        let mut mine = opt.state()?;
        mark_shard(
            &mut mine,
            replicas.rank(),
            replicas.world_size(),
            ROWS,
            &layouts,
        );
        let (Some(state), Some(wholes)) = (
            whole_state_on_first(replicas.as_ref(), &mine, ROWS, &whole_layouts(&layouts))?,
            wholes,
        ) else {
            return Ok(None);
        };
        // With hybrid sharding every shard group holds the same pieces:
        // the first one's put together what the first replica writes.
        if self.replicate_rank() != 0 {
            return Ok(None);
        }
        let mut values: HashMap<String, Tensor> = self
            .own
            .iter()
            .zip(wholes)
            .map(|((name, _), whole)| (name.clone(), whole.into_inner()))
            .collect();
        for (name, var) in &self.buffers {
            values.insert(name.clone(), var.as_tensor().copy()?);
        }
        let mut state = state;
        state.shard = Some(ShardOf {
            rank: self.pg.rank(),
            world_size: self.pg.world_size(),
        });
        Ok(Some((values, state)))
    }

    /// [`load_stages`](Self::load_stages) into an FSDP pipeline: each
    /// variable's saved whole value cut to this replica's piece, and `opt`
    /// (over the pieces) given their part of the saved state. No
    /// collective runs.
    ///
    /// # Errors
    ///
    /// [`Error::Zero`] on a pipeline without FSDP; as
    /// [`load_stages`](Self::load_stages).
    pub fn load_fsdp_stages<O: StatefulOptimizer>(
        &self,
        values: &[HashMap<String, Tensor>],
        states: &[OptimizerState],
        opt: &mut O,
    ) -> Result<()> {
        let replicas = self.fsdp_replicas()?;
        let layouts = named_layouts(&self.own, &self.zero_layouts);
        let fail = |what: String| Error::Checkpoint(format!("a pipeline's checkpoint: {what}"));
        self.load_stages_with(values, states, |whole| {
            let state = piece_state(
                whole,
                ROWS,
                &whole_layouts(&layouts),
                &layouts,
                replicas.rank(),
                &fail,
            )?;
            opt.load_state(&state)
        })
    }

    /// The replicas an FSDP pipeline's pieces split over (its shard group
    /// with hybrid sharding); an error naming what to call otherwise.
    fn fsdp_replicas(&self) -> Result<&crate::comm::SubGroup> {
        match (self.piece_group(), self.is_fsdp()) {
            (Some(replicas), true) => Ok(replicas),
            _ => Err(Error::Zero(
                "this pipeline keeps its variables whole: save it with stage_state (or \
                 zero_stage_state) and load it with load_stages (or load_zero_stages)"
                    .into(),
            )),
        }
    }

    /// The whole shape of variable `i` of [`variables`](Self::variables)
    /// (with FSDP it holds a piece): what a saved value must have.
    pub(super) fn whole_dims(&self, i: usize) -> Vec<usize> {
        match self.is_fsdp() {
            true => self.zero_layouts[i].dims.clone(),
            false => self.own[i].1.dims().to_vec(),
        }
    }

    /// What variable `i` holds of its whole `value`: with FSDP this
    /// replica's piece.
    pub(super) fn held_part(&self, i: usize, value: &Tensor) -> Result<Tensor> {
        match self.is_fsdp() {
            true => Ok(self.zero_layouts[i].shard_of(value, self.piece_rank())?),
            false => Ok(value.clone()),
        }
    }
}
