//! Sharding, written once for ZeRO and FSDP: how a parameter splits into
//! one piece per rank ([`layout`]: FSDP2's `torch.chunk` pieces along dim
//! 0, padded to one shape), the two collectives of sharded training over
//! those pieces ([`collectives`]: whole gradients reduce-scattered to each
//! rank's pieces, pieces all-gathered back), and the optimizer state saved
//! in pieces and resharded onto any world size ([`state`]).
//!
//! The byte layout here is what lets ZeRO and FSDP train to DDP's very
//! weights: a reduce-scattered piece is bitwise the same slice of the
//! all-reduce DDP runs (see [`ProcessGroup::reduce_scatter`](crate::comm::ProcessGroup::reduce_scatter)).
//! The group's own reduce-scatter and all-gather live with the groups
//! (`comm`); this module decides what goes into them and what comes out.

pub(crate) mod collectives;
pub(crate) mod layout;
pub(crate) mod state;

pub(crate) use collectives::{all_gather_pieces, gather_whole_vars, reduce_scatter_grads};
pub(crate) use layout::ShardLayout;
