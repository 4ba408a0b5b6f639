//! The training state on disk, in one folder: a model's weights as
//! safetensors ([`checkpoint`]), the whole training state and the folder
//! of states a run keeps ([`training_state`]: the newest complete one
//! found after a kill), and the shards each rank of a sharding strategy
//! writes beside it (`sharded.rs`). What a strategy puts in its shards
//! (ZeRO's pieces of the optimizer state, FSDP's of the weights, a
//! pipeline's stages) is the strategy's: `zero/`, `fsdp/checkpoint.rs`,
//! `pipeline/rank_state.rs`.

pub mod checkpoint;
pub(crate) mod sharded;
pub mod training_state;
