//! Optimizer state saved in pieces (FSDP's and ZeRO's sharded
//! checkpoints): each rank saves the state of its pieces, marked with its
//! rank, the world size and each parameter's rows; a run of any world size
//! puts every state tensor shaped like a piece back whole and takes its
//! own piece of its own split (resharding).

use candle_core::{Device, Tensor};

use super::layout::ShardLayout;
use crate::comm::ProcessGroup;
use crate::error::{Error, Result};
use crate::optim::{OptimizerState, ShardOf};

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
/// order, checked by [`check_one_run`]. Each tensor shaped like an old
/// piece is unsharded and re-split; the rest (settings, step counts) is
/// rank 0's, which every rank shares. `fail` words the errors.
pub(crate) fn reshard_states(
    states: &[OptimizerState],
    prefix: &str,
    params: &[(String, ShardLayout)],
    rank: usize,
    fail: &dyn Fn(String) -> Error,
) -> Result<OptimizerState> {
    let old_world = states.len();
    check_one_run(states, prefix, params, fail)?;
    let Some(first) = states.first() else {
        return Err(fail(
            "no saved states: every rank's save of one run is needed".into(),
        ));
    };
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

/// The rule for a set of sharded states (FSDP's and ZeRO's alike): every
/// old rank's state, in rank order, each marking its place; each records
/// this model's rows; and every rank's state has rank 0's kind, step,
/// settings and entries, with the entries that are not pieces (step
/// counts) equal to rank 0's. Otherwise the error names the rank and the
/// entry: a rank whose state lacks a parameter's moments would otherwise
/// restart that parameter from no state on every rank, and states of two
/// runs would be spliced.
fn check_one_run(
    states: &[OptimizerState],
    prefix: &str,
    params: &[(String, ShardLayout)],
    fail: &dyn Fn(String) -> Error,
) -> Result<()> {
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
        check_rows(state, prefix, params, &|what| {
            fail(format!("rank {r}'s state: {what}"))
        })?;
    }
    for (r, state) in states.iter().enumerate().skip(1) {
        let of_another_run = |what: String| {
            fail(format!(
                "{what}: the states are not of one run and step (saves of different runs or \
                 steps), and nothing was loaded"
            ))
        };
        if state.kind != first.kind || state.steps != first.steps {
            return Err(of_another_run(format!(
                "rank {r}'s state is {} at step {}, rank 0's {} at step {}",
                state.kind, state.steps, first.kind, first.steps
            )));
        }
        let settings = first.settings.keys().chain(state.settings.keys());
        for key in settings {
            let (theirs, ours) = (state.settings.get(key), first.settings.get(key));
            // Bit patterns: a NaN setting equals itself here.
            if theirs.map(|v| v.to_bits()) != ours.map(|v| v.to_bits()) {
                return Err(of_another_run(format!(
                    "rank {r}'s setting `{key}` is {}, rank 0's {}",
                    words(theirs),
                    words(ours)
                )));
            }
        }
        for key in first.tensors.keys().chain(state.tensors.keys()) {
            match (state.tensors.get(key), first.tensors.get(key)) {
                (Some(theirs), Some(ours)) => {
                    if theirs.dims() != ours.dims() {
                        return Err(fail(format!(
                            "rank {r}'s `{key}` has shape {:?}, rank 0's {:?}",
                            theirs.dims(),
                            ours.dims()
                        )));
                    }
                    let is_piece = param_of(params, key).is_some_and(|p| {
                        let old = ShardLayout::new(&params[p].1.dims, old_world);
                        ours.dims() == old.shard_dims().as_slice()
                    });
                    if !is_piece && !same_values(theirs, ours)? {
                        return Err(of_another_run(format!(
                            "rank {r}'s `{key}` holds other values than rank 0's (an entry every \
                             rank shares)"
                        )));
                    }
                }
                (None, Some(_)) => {
                    return Err(fail(format!(
                        "rank {r}'s state lacks `{key}`, which rank 0's has: every rank's state \
                         must hold the same entries, and nothing was loaded"
                    )))
                }
                (Some(_), None) => {
                    return Err(fail(format!(
                        "rank 0's state lacks `{key}`, which rank {r}'s has: every rank's state \
                         must hold the same entries, and nothing was loaded"
                    )))
                }
                (None, None) => {}
            }
        }
    }
    Ok(())
}

fn words(value: Option<&f64>) -> String {
    value.map_or("missing".to_string(), |v| v.to_string())
}

/// Whether two tensors of one shape hold the same values (compared as
/// f64, bit for bit; a NaN equals a NaN).
fn same_values(a: &Tensor, b: &Tensor) -> Result<bool> {
    let flat = |t: &Tensor| -> candle_core::Result<Vec<u64>> {
        Ok(t.flatten_all()?
            .to_dtype(candle_core::DType::F64)?
            .to_vec1::<f64>()?
            .into_iter()
            .map(f64::to_bits)
            .collect())
    };
    Ok(a.dtype() == b.dtype() && flat(a)? == flat(b)?)
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

/// The optimizer state of the whole parameters, put together on the CPU
/// of `pg`'s first rank from every rank's `mine` (the state of its pieces,
/// marked by [`mark_shard`] with `prefix`), gathered there one state
/// tensor at a time: what an optimizer over the whole parameters
/// (`whole`: each parameter's name beside a split into one piece) would
/// hold. `None` on the other ranks. Every rank of `pg` calls it.
pub(crate) fn whole_state_on_first(
    pg: &dyn ProcessGroup,
    mine: &OptimizerState,
    prefix: &str,
    whole: &[(String, ShardLayout)],
) -> Result<Option<OptimizerState>> {
    let world = pg.world_size();
    let mut states = vec![mine.clone(); world];
    for (key, tensor) in &mine.tensors {
        // Every rank takes part; only the first gets the pieces.
        let Some(all) = pg.gather(tensor, 0)? else {
            continue;
        };
        for (state, theirs) in states.iter_mut().zip(all) {
            state
                .tensors
                .insert(key.clone(), theirs.to_device(&Device::Cpu)?);
        }
    }
    if pg.rank() != 0 {
        return Ok(None);
    }
    for (rank, state) in states.iter_mut().enumerate() {
        state.shard = Some(ShardOf {
            rank,
            world_size: world,
        });
    }
    let fail = |what: String| Error::OptimizerState(format!("the pieces' states: {what}"));
    reshard_states(&states, prefix, whole, 0, &fail).map(Some)
}

/// Rank `rank`'s part of `whole_state`, a state of the whole parameters
/// (`whole`: each beside a split into one piece), for this run's split
/// `params`: what an optimizer over that rank's pieces holds.
pub(crate) fn piece_state(
    whole_state: &OptimizerState,
    prefix: &str,
    whole: &[(String, ShardLayout)],
    params: &[(String, ShardLayout)],
    rank: usize,
    fail: &dyn Fn(String) -> Error,
) -> Result<OptimizerState> {
    let mut state = whole_state.clone();
    mark_shard(&mut state, 0, 1, prefix, whole);
    reshard_states(&[state], prefix, params, rank, fail)
}

/// Each of `params` beside a split into one piece: the whole parameters,
/// as [`whole_state_on_first`] and [`piece_state`] take them.
pub(crate) fn whole_layouts(params: &[(String, ShardLayout)]) -> Vec<(String, ShardLayout)> {
    params
        .iter()
        .map(|(name, layout)| (name.clone(), ShardLayout::new(&layout.dims, 1)))
        .collect()
}
