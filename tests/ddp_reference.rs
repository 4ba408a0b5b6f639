//! Reproduces real PyTorch DDP runs over gloo with DistributedSampler
//! (tests/data/ddp_reference.safetensors, see tests/data/FIXTURES.md) with
//! this crate's DDP, sampler and loader on thread ranks.

mod common;

use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device};
use candle_dp::comm::GroupOptions;
use candle_dp::launch::spawn_with;
use candle_dp::loader::{Loader, TensorDataset};
use candle_dp::sampler::DistributedSampler;
use candle_dp::{DdpConfig, DistributedDataParallel};
use candle_nn::{loss, Optimizer, SGD};
use common::*;

fn run(name: &str, world: usize, samples: usize, seed: u64, batch: usize) {
    let file = load_fixture("ddp_reference.safetensors");
    let init = fixture_tensors(&file, "init.");
    let expected = fixture_tensors(&file, &format!("final_{name}."));
    let x = file["x"].narrow(0, 0, samples).unwrap();
    let y = file["y"].narrow(0, 0, samples).unwrap();
    let dataset = Arc::new(TensorDataset::new(vec![x, y]).unwrap());
    let options = GroupOptions {
        timeout: Some(Duration::from_secs(30)),
        ..Default::default()
    };
    let ranks = spawn_with(world, options, |ctx| {
        let varmap = varmap_from(&init);
        let mut ddp = DistributedDataParallel::new(
            ctx.process_group(),
            &varmap,
            DType::F32,
            &Device::Cpu,
            |vb| Mlp::new(vb, (20, 32, 10)),
            DdpConfig::default(),
        )?;
        let mut sgd = SGD::new(varmap.all_vars(), 0.1)?;
        let mut sampler = DistributedSampler::new(samples, world, ctx.rank)?
            .shuffle(true)
            .seed(seed);
        for epoch in 0..2 {
            sampler.set_epoch(epoch);
            let loader = Loader::new(dataset.clone(), batch)?
                .indices(sampler.indices())
                .prefetch(2);
            for b in &loader {
                let b = b?;
                let loss = loss::cross_entropy(&ddp.forward(&b[0])?, &b[1])?;
                ddp.backward_step(&loss, &mut sgd)?;
            }
        }
        Ok(snapshot(&varmap))
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
