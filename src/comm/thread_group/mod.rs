//! [`ThreadGroup`]: a process group whose ranks are threads of one process,
//! talking through crossbeam channels.
//!
//! [`group`] holds the group's state (its ranks' handles and the failure
//! they share), [`call`] one collective in progress on one rank (the header
//! exchange, messages, errors), [`collectives`] the [`ProcessGroup`]
//! implementation on top of both, and [`subgroups`] the sub-groups and the
//! point-to-point messages.
//!
//! [`ProcessGroup`]: super::ProcessGroup

mod call;
mod collectives;
mod group;
mod subgroups;

pub use group::{GroupOptions, ThreadGroup, ThreadRank, DEFAULT_RING_THRESHOLD_BYTES};
