//! The seed's demonstration: which rank gets which batch. Four ways to
//! train on two devices (PyTorch's `mp.spawn` and `torchrun`, each with a
//! `DistributedSampler`, Lightning Fabric's `setup_dataloaders` and
//! Accelerate's `prepare`) load the numbers 0 to 19, batch 10, and print
//! each rank's batches; this example does the same four with candle-dp and
//! prints the same lines (pinned against the real tools' output by
//! `scripts/gen_fabric_reference.py` and the tests).
//!
//! ```text
//! cargo run --example which_batch -- --script spawn|torchrun|fabric|accelerate
//! mpirun -np 2 target/debug/examples/which_batch --script torchrun   (feature mpi)
//! ```
//!
//! The first three deal the numbers one by one (rank 0 gets 0, 2, 4, ...);
//! Accelerate deals whole batches (rank 0 gets 0..9, rank 1 gets 10..19).

use std::sync::Arc;

use anyhow::Result;
use candle_core::{Device, Tensor};
use candle_dp::comm::GroupOptions;
use candle_dp::fabric::{DataOptions, Fabric, FabricConfig, Sharding, Strategy};
use candle_dp::launch::{self, RankContext};
use candle_dp::loader::{Dataset, Loader, TensorDataset};
use candle_dp::sampler::DistributedSampler;
use clap::{Parser, ValueEnum};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Script {
    /// `mp.spawn`: thread ranks of this process (`launch::spawn`), a
    /// `DistributedSampler` each.
    Spawn,
    /// `torchrun`: the launcher decides (`launch::run`: thread ranks, or
    /// the processes of `mpirun`), a `DistributedSampler` each.
    Torchrun,
    /// Fabric's `setup_dataloaders`: `Fabric::setup_dataloader`.
    Fabric,
    /// Accelerate's `prepare`: `Fabric::setup_dataloader` with
    /// `Sharding::accelerate()`.
    Accelerate,
}

#[derive(Parser, Debug)]
#[command(about = "Which rank gets which batch: mp.spawn, torchrun, Fabric and Accelerate")]
struct Args {
    /// Which of the four scripts.
    #[arg(long, value_enum, default_value = "fabric")]
    script: Script,
    /// The dataset: the numbers 0..N.
    #[arg(long, default_value_t = 20)]
    numbers: u32,
    /// Samples per batch on each rank.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    batch: u64,
    /// Ranks (devices); under mpirun the launcher decides.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..))]
    devices: u64,
}

fn main() -> std::process::ExitCode {
    candle_dp::launch::report::exit_code(run(Args::parse()))
}

fn run(args: Args) -> Result<()> {
    let numbers = Tensor::arange(0u32, args.numbers, &Device::Cpu)?;
    let data = Arc::new(TensorDataset::new(vec![numbers])?);
    let batch = args.batch as usize;
    let devices = args.devices as usize;
    // PyTorch's two launchers with a DistributedSampler under the loader.
    let with_sampler = |ctx: RankContext| -> Result<()> {
        let sampler = DistributedSampler::new(data.len(), ctx.world_size, ctx.rank)?.shuffle(false);
        let loader = Loader::new(data.clone(), batch)?.indices(sampler.indices());
        show(ctx.rank, loader.iter().map(|b| Ok(b?)))
    };
    match args.script {
        Script::Spawn => {
            launch::spawn(devices, with_sampler)?;
        }
        Script::Torchrun => {
            launch::run(devices, GroupOptions::default(), with_sampler)?;
        }
        Script::Fabric | Script::Accelerate => {
            let sharding = match args.script {
                Script::Accelerate => Sharding::accelerate(),
                _ => Sharding::Distributed,
            };
            Fabric::launch(FabricConfig::new(Strategy::Ddp, devices), |fabric| {
                let options = DataOptions {
                    sharding,
                    ..DataOptions::default()
                };
                let loader = fabric.setup_dataloader(data.clone(), batch, options)?;
                show(fabric.rank(), loader.iter()?.map(|b| Ok(b?)))
            })?;
        }
    }
    Ok(())
}

/// Prints each batch as the Python scripts do: `rank R batch I: [..]`.
fn show(rank: usize, batches: impl Iterator<Item = Result<Vec<Tensor>>>) -> Result<()> {
    for (i, batch) in batches.enumerate() {
        let numbers = batch?[0].to_vec1::<u32>()?;
        println!("rank {rank} batch {i}: {numbers:?}");
    }
    Ok(())
}
