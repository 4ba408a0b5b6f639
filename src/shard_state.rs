//! Optimizer state saved in pieces (FSDP's and ZeRO's sharded
//! checkpoints): each rank saves the state of its pieces, marked with its
//! rank, the world size and each parameter's rows; a run of any world size
//! puts every state tensor shaped like a piece back whole and takes its
//! own piece of its own split (resharding).

use candle_core::Tensor;

use crate::error::{Error, Result};
use crate::optim::{OptimizerState, ShardOf};
use crate::shard_layout::ShardLayout;

/// Each parameter's name beside its split (`params` and `layouts` in one
/// order): what the functions below take.
pub(crate) fn named_layouts(
    params: &[(String, candle_core::Var)],
    layouts: &[ShardLayout],
) -> Vec<(String, ShardLayout)> {
    params
        .iter()
        .zip(layouts)
        .map(|((name, _), layout)| (name.clone(), layout.clone()))
        .collect()
}

/// Marks `state` as rank `rank`'s of `world`, recording each parameter's
/// rows among its settings under `prefix` (so that a load can tell a model
/// of another shape whose pieces happen to have the same size).
pub(crate) fn mark_shard(
    state: &mut OptimizerState,
    rank: usize,
    world: usize,
    prefix: &str,
    params: &[(String, ShardLayout)],
) {
    state.shard = Some(ShardOf {
        rank,
        world_size: world,
    });
    for (name, layout) in params {
        state
            .settings
            .insert(format!("{prefix}{name}"), layout.rows() as f64);
    }
}

/// The state for rank `rank` of this run (`params`: each parameter's name
/// and this run's layout) from `states`, every old rank's state in rank
/// order (checked: each marks its place and they are of one run and step).
/// Each tensor shaped like an old piece is unsharded and re-split; the rest
/// (settings, step counts) is rank 0's, which every rank shares. `fail`
/// words the errors.
pub(crate) fn reshard_states(
    states: &[OptimizerState],
    prefix: &str,
    params: &[(String, ShardLayout)],
    rank: usize,
    fail: &dyn Fn(String) -> Error,
) -> Result<OptimizerState> {
    let old_world = states.len();
    let Some(first) = states.first() else {
        return Err(fail(
            "no saved states: every rank's save of one run is needed".into(),
        ));
    };
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
        if state.kind != first.kind || state.steps != first.steps {
            return Err(fail(format!(
                "rank {r}'s state is {} at step {}, rank 0's {} at step {}: saves of \
                 different runs or steps",
                state.kind, state.steps, first.kind, first.steps
            )));
        }
    }
    check_rows(first, prefix, params, fail)?;
    let mut state = first.clone();
    state.shard = None;
    state.settings.retain(|key, _| !key.starts_with(prefix));
    for (key, saved) in &first.tensors {
        let Some(p) = param_of(params, key) else {
            return Err(fail(format!(
                "optimizer tensor `{key}` names no parameter of this model: the state must name \
                 its entries after the parameters (the crate's optimizers' `new_named`)"
            )));
        };
        let layout = &params[p].1;
        let old = ShardLayout::new(&layout.dims, old_world);
        if saved.dims() == old.shard_dims().as_slice() {
            let whole = unshard_saved(&old, key, |r| states[r].tensors.get(key), fail)?;
            state
                .tensors
                .insert(key.clone(), layout.shard_of(&whole, rank)?);
        }
    }
    Ok(state)
}

/// Checks that `state` records the rows of every parameter of `params`
/// as this model has them.
pub(crate) fn check_rows(
    state: &OptimizerState,
    prefix: &str,
    params: &[(String, ShardLayout)],
    fail: &dyn Fn(String) -> Error,
) -> Result<()> {
    for (name, layout) in params {
        let rows = layout.rows();
        let saved = state.settings.get(&format!("{prefix}{name}")).copied();
        if saved != Some(rows as f64) {
            return Err(fail(format!(
                "`{name}` has {rows} rows in this model, {} in the save",
                saved.map_or("none recorded".to_string(), |r| r.to_string())
            )));
        }
    }
    Ok(())
}

/// The parameter an optimizer tensor `<parameter>.<slot>` belongs to (the
/// longest name that fits: names hold dots too).
pub(crate) fn param_of(params: &[(String, ShardLayout)], key: &str) -> Option<usize> {
    params
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

/// The whole tensor `name` from every old rank's piece (`piece_of(r)`),
/// each of the old layout's piece shape.
pub(crate) fn unshard_saved<'a>(
    old: &ShardLayout,
    name: &str,
    piece_of: impl Fn(usize) -> Option<&'a Tensor>,
    fail: &dyn Fn(String) -> Error,
) -> Result<Tensor> {
    let world = old.world();
    let mut flat = Vec::with_capacity(world);
    for r in 0..world {
        let piece = piece_of(r).ok_or_else(|| fail(format!("rank {r}'s save lacks `{name}`")))?;
        if piece.dims() != old.shard_dims().as_slice() {
            return Err(fail(format!(
                "rank {r}'s `{name}` has shape {:?}, a piece of {:?} on {world} ranks has {:?}",
                piece.dims(),
                old.dims,
                old.shard_dims()
            )));
        }
        flat.push(piece.flatten_all()?);
    }
    Ok(old.unshard(&flat)?)
}
