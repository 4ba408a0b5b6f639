//! Reproduces real PyTorch DDP runs over gloo with DistributedSampler
//! (tests/data/ddp_reference.safetensors) and with `Join` on uneven inputs
//! and BatchNorm (tests/data/join_reference.safetensors), see
//! tests/data/FIXTURES.md, with this crate's DDP, sampler and loader on
//! thread ranks.

// The closure given to `join` returns `candle_dp::Result` as the API requires.
#![allow(clippy::result_large_err)]

use crate::common;

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

/// One rank of a PyTorch DDP `join` run of `tests/data/join_reference.safetensors`
/// (BnNet, world 3, rank r trains `batches[r]` batches of 4 rows, SGD 0.05,
/// see `scripts/gen_join_reference.py`): this rank's final variables.
fn join_rank(
    ctx: &candle_dp::launch::RankContext,
    batches: &[usize],
    broadcast_buffers: bool,
) -> anyhow::Result<std::collections::HashMap<String, candle_core::Tensor>> {
    use candle_nn::Optimizer;

    let file = load_fixture("join_reference.safetensors");
    let varmap = varmap_from(&fixture_tensors(&file, "init."));
    let mut ddp = candle_dp::DistributedDataParallel::builder(
        ctx.process_group(),
        &varmap,
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )
    .broadcast_buffers(broadcast_buffers)
    .build(BnNet::new)?;
    let mut sgd = candle_nn::SGD::new(varmap.all_vars(), 0.05)?;
    let first_row = 4 * batches[..ctx.rank].iter().sum::<usize>();
    ddp.join(|ddp| {
        for b in 0..batches[ctx.rank] {
            let x = file["x"].narrow(0, first_row + 4 * b, 4)?;
            let y = file["y"].narrow(0, first_row + 4 * b, 4)?;
            let logits = ddp.forward_t(&x, true)?;
            let loss = candle_nn::loss::cross_entropy(&logits, &y)?;
            ddp.backward_step(&loss, &mut sgd)?;
        }
        Ok(())
    })?;
    Ok(snapshot(&varmap))
}

fn run_join(name: &str, batches: [usize; 3], broadcast_buffers: bool) {
    let file = load_fixture("join_reference.safetensors");
    let options = GroupOptions {
        timeout: Some(Duration::from_secs(30)),
        ..Default::default()
    };
    let ranks = spawn_with(3, options, move |ctx| {
        join_rank(&ctx, &batches, broadcast_buffers)
    })
    .unwrap();
    for (rank, got) in ranks.iter().enumerate() {
        let expected = fixture_tensors(&file, &format!("final_{name}.r{rank}."));
        let diff = max_rel_diff(got, &expected);
        assert!(
            diff < 1e-5,
            "join run {name}, rank {rank}: {diff}\n{}",
            diff_report(got, &expected)
        );
    }
}

#[test]
fn pytorch_join_buffers_come_from_the_highest_active_rank_and_the_last_joiner() {
    run_join("J1", [2, 4, 3], true);
}

#[test]
fn pytorch_join_final_sync_breaks_a_tie_of_last_joiners_toward_the_larger_rank() {
    run_join("J2", [3, 1, 3], true);
}

#[test]
fn pytorch_join_without_broadcast_buffers_syncs_parameters_only() {
    run_join("J3", [2, 4, 3], false);
}
