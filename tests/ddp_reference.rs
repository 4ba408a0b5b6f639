//! Reproduces real PyTorch DDP runs over gloo with DistributedSampler
//! (tests/data/ddp_reference.safetensors, see tests/data/FIXTURES.md) with
//! this crate's DDP, sampler and loader on thread ranks.

mod common;

use std::time::Duration;

use candle_dp::comm::GroupOptions;
use candle_dp::launch::spawn_with;
use common::*;

fn run(name: &str, world: usize, samples: usize, seed: u64, batch: usize) {
    let file = load_fixture("ddp_reference.safetensors");
    let expected = fixture_tensors(&file, &format!("final_{name}."));
    let options = GroupOptions {
        timeout: Some(Duration::from_secs(30)),
        ..Default::default()
    };
    let ranks = spawn_with(world, options, |ctx| {
        ddp_reference_run(&ctx, samples, seed, batch)
    })
    .unwrap();
    for (rank, got) in ranks.iter().enumerate() {
        let diff = max_rel_diff(got, &expected);
        assert!(
            diff < 1e-5,
            "run {name}, rank {rank}: {diff}\n{}",
            diff_report(got, &expected)
        );
    }
}

#[test]
fn pytorch_ddp_run_a_world_2_seed_3_batch_6_is_reproduced() {
    run("A", 2, 96, 3, 6);
}

#[test]
fn pytorch_ddp_run_b_world_4_padded_90_to_92_seed_1_batch_5_is_reproduced() {
    run("B", 4, 90, 1, 5);
}
