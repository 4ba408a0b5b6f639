//! Replicas that share one GPU take turns at issuing their work.
//!
//! Replicas on one GPU are one device, so one stream (two streams of a GPU
//! are refused: nothing would order them): the GPU runs their kernels one
//! after another whichever thread issued them, and issuing from several
//! threads at once only makes the threads contend in the driver. Measured
//! on an H100 (`docs/bench/h100/`, 2026-11-25): two replicas of a wide MLP
//! sharing GPU 0 through `forward_backward` took 24.6% longer per step than
//! one GPU when both threads issued at once, 6.3% with turns (the conv net:
//! 12.2% and 0.2%). Holding the GPU's turn for a replica's whole share of a
//! step keeps the GPU as busy (the issue is asynchronous and faster than the
//! kernels) without the contention. CPU replicas never take turns: each
//! computes on its own cores.

use std::sync::{Arc, Mutex};

use candle_core::Device;

/// One lock per GPU shared by several replicas.
pub(super) type Turn = Arc<Mutex<()>>;

/// For each device, the turn it shares with the other replicas on its GPU,
/// or `None` where it has the device to itself or is not a GPU.
pub(super) fn turns(devices: &[Device]) -> Vec<Option<Turn>> {
    let mut turns: Vec<Option<Turn>> = vec![None; devices.len()];
    for i in 0..devices.len() {
        if turns[i].is_some() || !devices[i].is_cuda() {
            continue;
        }
        let sharing: Vec<usize> = (i..devices.len())
            .filter(|&j| devices[j].same_device(&devices[i]))
            .collect();
        if sharing.len() > 1 {
            let turn = Turn::default();
            for j in sharing {
                turns[j] = Some(Arc::clone(&turn));
            }
        }
    }
    turns
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_replicas_never_take_turns() {
        assert!(turns(&[Device::Cpu, Device::Cpu, Device::Cpu])
            .iter()
            .all(Option::is_none));
    }
}
