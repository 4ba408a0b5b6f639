//! Sharded checkpoints of FSDP: each rank saves its own pieces and its
//! optimizer's state over them, with no gathering; a run of any world size
//! loads every rank's save and takes its own pieces (resharding), and
//! [`full_state`](FullyShardedDataParallel::full_state) gives the whole
//! parameters for an unsharded export.

use std::collections::HashMap;

use candle_core::Tensor;

use super::FullyShardedDataParallel;
use crate::error::{Error, Result};
use crate::optim::{OptimizerState, StatefulOptimizer};
use crate::sharding::state::{
    mark_shard, named_layouts, piece_state, reshard_states, unshard_saved, whole_layouts,
    whole_state_on_first,
};
use crate::sharding::ShardLayout;

impl FullyShardedDataParallel {
    /// This rank's pieces, by parameter name, and the buffers, whole
    /// (copies): with [`shard_state`](Self::shard_state), what this rank
    /// saves.
    pub fn pieces(&self) -> Result<HashMap<String, Tensor>> {
        self.shards
            .iter()
            .chain(&self.buffers)
            .map(|(name, var)| Ok((name.clone(), var.as_tensor().copy()?)))
            .collect()
    }

    /// `opt`'s state (an optimizer over this rank's pieces) marked with
    /// this rank and the world size, so that a later run can tell a
    /// complete set of saves and reshard them.
    /// The state also records each parameter's rows (`fsdp.rows.<name>`
    /// among its settings), so that a load can tell a model of another
    /// shape whose pieces happen to have the same size.
    pub fn shard_state<O: StatefulOptimizer>(&self, opt: &O) -> Result<OptimizerState> {
        let mut state = opt.state()?;
        let (rank, world) = (self.pg.rank(), self.pg.world_size());
        mark_shard(&mut state, rank, world, ROWS, &self.named_layouts());
        Ok(state)
    }

    /// Each parameter's name and split.
    fn named_layouts(&self) -> Vec<(String, ShardLayout)> {
        named_layouts(&self.shards, &self.layouts)
    }

    /// Restores a sharded checkpoint saved by every rank of a run of any
    /// world size: `pieces[r]` and `states[r]` are what old rank `r` saved
    /// ([`pieces`](Self::pieces), [`shard_state`](Self::shard_state)).
    /// Each parameter, and each optimizer tensor shaped like its piece
    /// (Adam's moments), is put back whole and this rank takes its own
    /// piece of this run's split; the rest of the optimizer's state (its
    /// settings, step count, per-parameter steps) and the buffers are rank
    /// 0's, which every rank shares. Every rank calls it with the same
    /// saves; no collective runs.
    ///
    /// # Errors
    ///
    /// [`Error::Fsdp`] naming what does not fit (a missing or repeated
    /// rank, a parameter missing or of another shape, a rank's state of
    /// another optimizer, step or settings, or lacking an entry another
    /// rank's has, such as a parameter's moments: the rule ZeRO's
    /// [`load_shards`](crate::zero::ZeroOptimizer::load_shards) follows
    /// too), and then nothing has changed; the optimizer's own refusal
    /// ([`Error::OptimizerState`]) likewise.
    pub fn load_resharded<O: StatefulOptimizer>(
        &mut self,
        pieces: &[HashMap<String, Tensor>],
        states: &[OptimizerState],
        opt: &mut O,
    ) -> Result<()> {
        let fail = |what: String| Error::Fsdp(format!("a sharded checkpoint: {what}"));
        let old_world = states.len();
        if old_world == 0 || pieces.len() != old_world {
            return Err(fail(format!(
                "{} ranks' pieces and {old_world} optimizer states: every rank's save of one run \
                 is needed",
                pieces.len()
            )));
        }
        let rank = self.pg.rank();
        let named = self.named_layouts();
        let state = reshard_states(states, ROWS, &named, rank, &fail)?;
        let mut mine = Vec::with_capacity(self.shards.len());
        for ((name, var), layout) in self.shards.iter().zip(&self.layouts) {
            let old = ShardLayout::new(&layout.dims, old_world);
            let whole = unshard_saved(&old, name, |r| pieces[r].get(name), &fail)?;
            // In the piece's dtype and on its device, a copy of its own:
            // after the optimizer's load nothing below can fail.
            let piece = layout
                .shard_of(&whole.to_dtype(var.dtype())?, rank)?
                .to_device(var.device())?
                .copy()?;
            mine.push(piece);
        }
        // The buffers, whole in every save: rank 0's, whose every forward
        // broadcasts them.
        let mut buffers = Vec::with_capacity(self.buffers.len());
        for (name, var) in &self.buffers {
            let saved = pieces[0]
                .get(name)
                .ok_or_else(|| fail(format!("rank 0's save lacks the buffer `{name}`")))?;
            if saved.dims() != var.dims() {
                return Err(fail(format!(
                    "the buffer `{name}` has shape {:?} in the save, {:?} in this model",
                    saved.dims(),
                    var.dims()
                )));
            }
            buffers.push(
                saved
                    .to_dtype(var.dtype())?
                    .to_device(var.device())?
                    .copy()?,
            );
        }
        opt.load_state(&state)?;
        for ((_, var), piece) in self.shards.iter().zip(mine) {
            var.set(&piece)?;
        }
        for ((_, var), value) in self.buffers.iter().zip(buffers) {
            var.set(&value)?;
        }
        Ok(())
    }

    /// The whole model (every rank) and the optimizer state of the whole
    /// parameters, put together on the shard group's first rank (`None`
    /// elsewhere): what one device would hold. Every rank calls it.
    ///
    /// # Errors
    ///
    /// A collective's; the optimizer's state.
    pub(crate) fn whole_state<O: StatefulOptimizer>(
        &self,
        opt: &O,
    ) -> Result<(HashMap<String, Tensor>, Option<OptimizerState>)> {
        let values = self.full_state()?;
        let whole = whole_layouts(&self.named_layouts());
        let state = whole_state_on_first(self.pg.as_ref(), &self.shard_state(opt)?, ROWS, &whole)?;
        Ok((values, state))
    }

    /// Puts a whole state back (`values`: every parameter and buffer
    /// whole; `state`: the optimizer's state of the whole parameters), this
    /// rank taking its pieces. No collective runs. All or nothing.
    ///
    /// # Errors
    ///
    /// [`Error::Fsdp`] naming a value missing or of another shape, or a
    /// state that does not fit; the optimizer's refusal.
    pub(crate) fn load_whole<O: StatefulOptimizer>(
        &mut self,
        values: &HashMap<String, Tensor>,
        state: &OptimizerState,
        opt: &mut O,
    ) -> Result<()> {
        let fail = |what: String| Error::Fsdp(format!("a whole state: {what}"));
        let (rank, named) = (self.pg.rank(), self.named_layouts());
        let state = piece_state(state, ROWS, &whole_layouts(&named), &named, rank, &fail)?;
        let value = |name: &str, dims: &[usize]| -> Result<&Tensor> {
            let value = values
                .get(name)
                .ok_or_else(|| fail(format!("it lacks `{name}`")))?;
            if value.dims() != dims {
                return Err(fail(format!(
                    "`{name}` has shape {:?} in it, {dims:?} in this model",
                    value.dims()
                )));
            }
            Ok(value)
        };
        let mut pieces = Vec::with_capacity(self.shards.len());
        for ((name, var), layout) in self.shards.iter().zip(&self.layouts) {
            let whole = value(name, &layout.dims)?.to_dtype(var.dtype())?;
            pieces.push(
                layout
                    .shard_of(&whole, rank)?
                    .to_device(var.device())?
                    .copy()?,
            );
        }
        let mut buffers = Vec::with_capacity(self.buffers.len());
        for (name, var) in &self.buffers {
            let whole = value(name, var.dims())?;
            buffers.push(
                whole
                    .to_dtype(var.dtype())?
                    .to_device(var.device())?
                    .copy()?,
            );
        }
        opt.load_state(&state)?;
        for ((_, var), piece) in self.shards.iter().zip(pieces) {
            var.set(&piece)?;
        }
        for ((_, var), value) in self.buffers.iter().zip(buffers) {
            var.set(&value)?;
        }
        Ok(())
    }
}

/// The settings' prefix under which a shard state records each parameter's
/// rows.
const ROWS: &str = "fsdp.rows.";
