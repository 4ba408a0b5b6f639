//! Sharded checkpoints of FSDP: each rank saves its own pieces and its
//! optimizer's state over them, with no gathering; a run of any world size
//! loads every rank's save and takes its own pieces (resharding), and
//! [`full_state`](FullyShardedDataParallel::full_state) gives the whole
//! parameters for an unsharded export.

use std::collections::HashMap;

use candle_core::Tensor;

use super::layout::ShardLayout;
use super::FullyShardedDataParallel;
use crate::error::{Error, Result};
use crate::optim::{OptimizerState, ShardOf, StatefulOptimizer};

impl FullyShardedDataParallel {
    /// This rank's pieces, by parameter name (copies): with
    /// [`shard_state`](Self::shard_state), what this rank saves.
    pub fn pieces(&self) -> Result<HashMap<String, Tensor>> {
        self.shards
            .iter()
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
        state.shard = Some(ShardOf {
            rank: self.pg.rank(),
            world_size: self.pg.world_size(),
        });
        for ((name, _), layout) in self.shards.iter().zip(&self.layouts) {
            state
                .settings
                .insert(format!("{ROWS}{name}"), layout.rows() as f64);
        }
        Ok(state)
    }

    /// Restores a sharded checkpoint saved by every rank of a run of any
    /// world size: `pieces[r]` and `states[r]` are what old rank `r` saved
    /// ([`pieces`](Self::pieces), [`shard_state`](Self::shard_state)).
    /// Each parameter, and each optimizer tensor shaped like its piece
    /// (Adam's moments), is put back whole and this rank takes its own
    /// piece of this run's split; the rest of the optimizer's state (its
    /// settings, step count, per-parameter steps) is rank 0's, which every
    /// rank shares. Every rank calls it with the same saves; no
    /// collective runs.
    ///
    /// # Errors
    ///
    /// [`Error::Fsdp`] naming what does not fit (a missing or repeated
    /// rank, a parameter missing or of another shape, a state of another
    /// optimizer or step), and then nothing has changed; the optimizer's
    /// own refusal ([`Error::OptimizerState`]) likewise.
    pub fn load_resharded<O: StatefulOptimizer>(
        &mut self,
        pieces: &[HashMap<String, Tensor>],
        states: &[OptimizerState],
        opt: &mut O,
    ) -> Result<()> {
        let old_world = states.len();
        let fail = |what: String| Error::Fsdp(format!("a sharded checkpoint: {what}"));
        if old_world == 0 || pieces.len() != old_world {
            return Err(fail(format!(
                "{} ranks' pieces and {old_world} optimizer states: every rank's save of one run \
                 is needed",
                pieces.len()
            )));
        }
        for (r, state) in states.iter().enumerate() {
            match state.shard {
                Some(ShardOf { rank, world_size }) if rank == r && world_size == old_world => {}
                other => {
                    return Err(fail(format!(
                        "the state in place {r} of {old_world} was saved as {other:?}: give every \
                         rank's state, in rank order"
                    )))
                }
            }
            if state.kind != states[0].kind || state.steps != states[0].steps {
                return Err(fail(format!(
                    "rank {r}'s state is {} at step {}, rank 0's {} at step {}: saves of \
                     different runs or steps",
                    state.kind, state.steps, states[0].kind, states[0].steps
                )));
            }
        }
        let rank = self.pg.rank();
        let mut mine = Vec::with_capacity(self.shards.len());
        for (p, (name, var)) in self.shards.iter().enumerate() {
            let rows = self.layouts[p].rows();
            let saved = states[0].settings.get(&format!("{ROWS}{name}")).copied();
            if saved != Some(rows as f64) {
                return Err(fail(format!(
                    "`{name}` has {rows} rows in this model, {} in the save",
                    saved.map_or("none recorded".to_string(), |r| r.to_string())
                )));
            }
            let old = ShardLayout::new(&self.layouts[p].dims, old_world);
            let whole = unshard_saved(&old, name, |r| pieces[r].get(name))?;
            // In the piece's dtype and on its device, a copy of its own:
            // after the optimizer's load nothing below can fail.
            let piece = self.layouts[p]
                .shard_of(&whole.to_dtype(var.dtype())?, rank)?
                .to_device(var.device())?
                .copy()?;
            mine.push(piece);
        }
        let mut state = states[0].clone();
        state.shard = None;
        state.settings.retain(|key, _| !key.starts_with(ROWS));
        for key in states[0].tensors.keys() {
            let Some(p) = self.param_of(key) else {
                return Err(fail(format!("optimizer tensor `{key}` names no parameter")));
            };
            let old = ShardLayout::new(&self.layouts[p].dims, old_world);
            if states[0].tensors[key].dims() == old.shard_dims().as_slice() {
                let whole = unshard_saved(&old, key, |r| states[r].tensors.get(key))?;
                state
                    .tensors
                    .insert(key.clone(), self.layouts[p].shard_of(&whole, rank)?);
            }
        }
        opt.load_state(&state)?;
        for ((_, var), piece) in self.shards.iter().zip(mine) {
            var.set(&piece)?;
        }
        Ok(())
    }

    /// The parameter an optimizer tensor `<parameter>.<slot>` belongs to
    /// (the longest name that fits: names hold dots too).
    fn param_of(&self, key: &str) -> Option<usize> {
        self.shards
            .iter()
            .enumerate()
            .filter(|(_, (name, _))| {
                key.len() > name.len()
                    && key.starts_with(name.as_str())
                    && key[name.len()..].starts_with('.')
            })
            .max_by_key(|(_, (name, _))| name.len())
            .map(|(p, _)| p)
    }
}

/// The settings' prefix under which a shard state records each parameter's
/// rows.
const ROWS: &str = "fsdp.rows.";

/// The whole tensor `name` from every old rank's piece (`piece_of(r)`),
/// each of the old layout's piece shape.
fn unshard_saved<'a>(
    old: &ShardLayout,
    name: &str,
    piece_of: impl Fn(usize) -> Option<&'a Tensor>,
) -> Result<Tensor> {
    let world = old.world();
    let mut flat = Vec::with_capacity(world);
    for r in 0..world {
        let piece = piece_of(r).ok_or_else(|| {
            Error::Fsdp(format!(
                "a sharded checkpoint: rank {r}'s save lacks `{name}`"
            ))
        })?;
        if piece.dims() != old.shard_dims().as_slice() {
            return Err(Error::Fsdp(format!(
                "a sharded checkpoint: rank {r}'s `{name}` has shape {:?}, a piece of {:?} on {world} \
                 ranks has {:?}",
                piece.dims(),
                old.dims,
                old.shard_dims()
            )));
        }
        flat.push(piece.flatten_all()?);
    }
    Ok(old.unshard(&flat)?)
}
