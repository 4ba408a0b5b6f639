//! The states of the strategies: an engine that keeps the whole model on
//! every rank (rank 0 writes it, every rank loads it), and finding the
//! newest state of FSDP's layout (each rank its pieces and their state).

use candle_nn::VarMap;

use super::{FoundState, Shards, StateStore};
use crate::error::{Error, Result};
use crate::optim::StatefulOptimizer;
use crate::saving::training_state::TrainingState;

/// Rank 0 writes `varmap` and the optimizer's state with `state`; no rank
/// goes on before it is written.
pub(super) fn save_whole<O: StatefulOptimizer>(
    store: &StateStore<'_>,
    varmap: &VarMap,
    optimizer: &O,
    mut state: TrainingState,
) -> Result<()> {
    if store.pg.rank() == 0 {
        state.optimizer = Some(optimizer.state()?);
        store.checkpoints.save(varmap, &state)?;
    }
    Ok(store.pg.barrier()?)
}

/// The newest complete state.
pub(super) fn find_whole(store: &StateStore<'_>) -> Result<Option<FoundState>> {
    Ok(store.checkpoints.latest()?.map(|saved| FoundState {
        saved,
        shards: Shards::None,
    }))
}

/// Puts a whole state back into `varmap` and `optimizer`.
pub(super) fn load_whole<O: StatefulOptimizer>(
    found: FoundState,
    varmap: &VarMap,
    optimizer: &mut O,
) -> Result<()> {
    match found.shards {
        Shards::None => found.saved.restore(varmap, Some(optimizer)),
        _ => Err(not_this_layout()),
    }
}

/// The newest complete state of FSDP's layout: each rank's pieces of the
/// model and their optimizer state.
pub(super) fn find_fsdp_layout(store: &StateStore<'_>) -> Result<Option<FoundState>> {
    Ok(store
        .checkpoints
        .latest_fsdp()?
        .map(|(saved, saves)| FoundState {
            saved,
            shards: Shards::Fsdp(saves),
        }))
}

/// The bytes of an optimizer's state.
pub(super) fn optimizer_bytes<O: StatefulOptimizer>(optimizer: &O) -> Result<usize> {
    Ok(optimizer
        .state()?
        .tensors
        .values()
        .map(|t| t.elem_count() * t.dtype().size_in_bytes())
        .sum())
}

/// A state of another layout than the engine's.
pub(super) fn not_this_layout() -> Error {
    Error::Fabric("the state found does not fit this strategy's layout".into())
}
