//! The main job: train a digit classifier through one loop on a [`Fabric`]
//! with any strategy of the crate, then the same run on one device, and
//! compare them.
//!
//! The Fabric's flags (`FabricArgs`) pick the strategy: `--strategy dp`
//! (here the default, over `--replicas` CPU replicas), `ddp` (thread ranks,
//! or `mpirun`'s processes), `--zero 1|2`, `fsdp`, `hsdp`, `single`, or
//! `--mesh dp_replicate=2,dp_shard=2`. The weights start from `--seed`, so
//! threads and processes train to the same weights. Data: the bundled 8x8
//! digits (80/20 split), or MNIST's IDX files with `--mnist DIR`.

#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use candle_dp::checkpoint::{self, Prefix};
use candle_dp::fabric::{
    DataOptions, Devices, Fabric, FabricArgs, FabricConfig, ModelRecipe, Precision,
};
use candle_dp::launch::Backend;
use candle_dp::loader::TensorDataset;
use candle_dp::optim::{AdamW, AdamWConfig};
use candle_dp::training_state::Progress;
use candle_dp_examples::datasets::{shuffled_indices, LabelledImages};
use candle_dp_examples::digits::{self, accuracy, Model, Outcome};
use candle_dp_examples::flags;
use candle_dp_examples::report::{self, Schedule};
use candle_nn::loss;
use clap::Parser;

/// Train a digit classifier with data parallelism and compare it with the
/// same run on one device.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    #[command(flatten)]
    fabric: FabricArgs,
    /// Passes over the training set (at least 1).
    #[arg(long, default_value_t = 20, value_parser = flags::at_least_one::<usize>)]
    epochs: usize,
    /// Global batch size (split across replicas or ranks; at least 1).
    #[arg(long, default_value_t = 64, value_parser = flags::at_least_one::<usize>)]
    batch: usize,
    /// AdamW learning rate (a finite number above 0).
    #[arg(long, default_value_t = 0.002, value_parser = flags::positive_f64)]
    lr: f64,
    /// The model: a small conv net, or an MLP.
    #[arg(long, value_enum, default_value_t = Model::Conv)]
    model: Model,
    /// Channels of the conv net's first convolution, or the MLP's hidden
    /// units, at least 1 [default: 8 for conv, 256 for mlp].
    #[arg(long, value_parser = flags::at_least_one::<usize>)]
    hidden: Option<usize>,
    /// A directory of MNIST IDX files instead of the bundled digits.
    #[arg(long, value_name = "DIR")]
    mnist: Option<String>,
    /// Writes the trained weights (safetensors) here; rank 0 writes.
    #[arg(long, value_name = "FILE")]
    save: Option<PathBuf>,
    /// Writes the loss and held-out accuracy per epoch of every run here (SVG).
    #[arg(long, value_name = "FILE", default_value = "target/train_digits.svg")]
    chart: PathBuf,
    /// Saves a state every N optimizer steps, N at least 1 [default: at the
    /// end of every epoch].
    #[arg(long, value_name = "N", requires = "checkpoint_dir", value_parser = flags::at_least_one::<u64>)]
    checkpoint_every: Option<u64>,
    /// Continues from the newest complete state in `--checkpoint-dir`.
    #[arg(long, requires = "checkpoint_dir")]
    resume: bool,
    /// Skips the one-device comparison run.
    #[arg(long)]
    no_reference: bool,
    /// The learning rate over the run.
    #[arg(long, value_enum, default_value_t = Schedule::Constant)]
    lr_schedule: Schedule,
    /// Warm-up steps of `--lr-schedule warmup-cosine` [default: 5% of the
    /// run's steps, at least 1].
    #[arg(long, value_name = "N")]
    warmup_steps: Option<u64>,
}

/// One run of `config`: the same loop for every strategy. `in_process`:
/// thread ranks even under `mpirun` (the one-device reference on rank 0).
fn train(
    args: &Args,
    config: FabricConfig,
    data: (&LabelledImages, &LabelledImages),
    in_process: bool,
) -> Result<Option<Outcome>> {
    let (train, test) = data;
    let dataset = Arc::new(TensorDataset::new(vec![
        train.images.clone(),
        train.labels.clone(),
    ])?);
    let hidden = args.hidden.unwrap_or(args.model.default_hidden());
    let units = args.model.units(train.height, train.width, hidden);
    let distributed = config.effective_strategy().is_distributed();
    let precision = config.precision;
    let saves = config.checkpoint_dir.is_some();
    let rank_loop = |fabric: Fabric| -> Result<Option<Outcome>> {
        let (rank, world) = (fabric.rank(), fabric.world_size());
        let adamw = AdamWConfig {
            lr: args.lr,
            ..Default::default()
        };
        let module = ModelRecipe::units(units.clone());
        let mut model = fabric.setup(module, |params| AdamW::new_named(params, adamw))?;
        let options = DataOptions {
            shuffle: true,
            prefetch: 2,
            ..DataOptions::default()
        };
        let mut loader = fabric.setup_global_dataloader(dataset.clone(), args.batch, options)?;
        if !distributed && fabric.config().deterministic.is_none() {
            // One process over the whole batch shuffles with the example's
            // own order; ranks take theirs from a DistributedSampler.
            let (n, seed) = (train.len(), fabric.config().seed);
            loader =
                loader.with_order(move |epoch| shuffled_indices(n, seed.wrapping_add(1 + epoch)));
        }
        let batches = loader.len()? as u64;
        let total = batches * args.epochs as u64;
        if let Some(schedule) = args.lr_schedule.over(args.lr, args.warmup_steps, total)? {
            model.set_schedule(schedule)?;
        }
        let from = model.resume(saves && args.resume)?;
        let prefix = format!("{} x{world}", fabric.strategy());
        let bar = report::progress_bar(total, prefix, rank)?;
        bar.set_position(from.step);
        let start = Instant::now(); // MPI's start-up is not training
        let (mut samples, mut last_loss, mut step) = (0, f32::NAN, from.step);
        let (mut losses, mut history, mut evaluating) = (Vec::new(), Vec::new(), Duration::ZERO);
        for epoch in from.epoch..args.epochs as u64 {
            loader.set_epoch(epoch);
            // A resumed epoch continues with the batch it had not trained on.
            let skip = if epoch == from.epoch { from.batch } else { 0 };
            loader.skip_batches(skip as usize);
            for (index, batch) in (skip..).zip(loader.iter()?) {
                let batch = batch?;
                let loss = model.backward(&batch[0], &batch[1], loss::cross_entropy)?;
                model.step()?;
                let rows = batch[0].dim(0)?;
                samples += rows;
                last_loss = fabric.global_mean(&loss, rows)?;
                losses.push(last_loss);
                bar.inc(1);
                step += 1;
                let progress = Progress {
                    epoch,
                    batch: index + 1,
                    step,
                };
                match progress.due(batches, args.checkpoint_every) {
                    Some(progress) if saves => model.save(progress)?,
                    _ => {}
                }
            }
            bar.set_message(format!("epoch {} loss {last_loss:.4}", epoch + 1));
            // Every rank takes part in FSDP's gathering; rank 0 evaluates.
            let evaluation = Instant::now();
            let weights = model.full_varmap()?;
            if rank == 0 {
                let mean = losses.iter().sum::<f32>() / losses.len().max(1) as f32;
                losses.clear();
                history.push((mean, accuracy(&units, &weights, precision, test)?));
            }
            evaluating += evaluation.elapsed();
        }
        let seconds = (start.elapsed() - evaluating).as_secs_f64();
        bar.finish();
        let varmap = model.full_varmap()?;
        if rank != 0 {
            return Ok(None);
        }
        Ok(Some(Outcome {
            seconds,
            samples: samples * world, // every rank as many (the sampler pads)
            last_loss,
            accuracy: accuracy(&units, &varmap, precision, test)?,
            history,
            varmap,
            skipped: model.skipped_steps(),
        }))
    };
    let ranks = match in_process {
        true => Fabric::spawn(config, rank_loop)?,
        false => Fabric::launch(config, rank_loop)?,
    };
    Ok(ranks.into_iter().flatten().next())
}

fn main() -> ExitCode {
    // Errors as whole lines, prefixed with the rank under mpirun.
    candle_dp::launch::report::exit_code(run(Args::parse()))
}

fn run(mut args: Args) -> Result<()> {
    // This example's defaults: DataParallel, two replicas or ranks.
    if args.fabric.config.is_none() && args.fabric.mesh.is_none() {
        let strategy = *args.fabric.strategy.get_or_insert("dp".parse()?);
        if strategy.name() != "single" {
            args.fabric.devices.get_or_insert(Devices::Count(2));
        }
    }
    let mut config = args.fabric.config()?;
    if config.precision == Precision::Bf16Mixed && args.model == Model::Conv {
        bail!("--precision bf16 with the conv net: candle 0.11's CPU convolution has no bf16 kernel; use --model mlp, or --precision f16");
    }
    let (train_set, test_set, name) = digits::load(args.mnist.as_deref(), config.seed)?;
    if Backend::process_rank() == 0 {
        let hidden = args.hidden.unwrap_or(args.model.default_hidden());
        println!("data: {}", digits::describe(&name, &train_set, &test_set));
        println!("model: {}, AdamW lr {} ({:?}), clip {:?}, {}, global batch {}, {} epochs, {:?} backward, seed {}", args.model.describe(train_set.height * train_set.width, hidden), args.lr, args.lr_schedule, config.gradient_clip, config.precision, args.batch, args.epochs, config.dp_backward, config.seed);
    }
    let data = (&train_set, &test_set);
    let distributed = config.effective_strategy().is_distributed();
    let one = config.on_one_device();
    let parallel = config.effective_strategy().name() != "single";
    // The saved run: the parallel one, or the one device.
    let mut runs: Vec<(String, Outcome)> = Vec::new();
    if parallel {
        let label = report::label(&config);
        match train(&args, config.clone(), data, false)? {
            Some(outcome) => runs.push((label, outcome)),
            None => return Ok(()), // not rank 0
        }
    }
    if !parallel || !args.no_reference {
        config = FabricConfig {
            checkpoint_dir: config.checkpoint_dir.filter(|_| !parallel),
            ..one
        };
        let outcome =
            train(&args, config, data, true)?.ok_or_else(|| anyhow::anyhow!("no outcome"))?;
        runs.push(("one device".into(), outcome));
    }
    if let (Some(path), Some((_, saved))) = (&args.save, runs.first()) {
        checkpoint::save(&saved.varmap, path, Prefix::None)?;
    }
    digits::compare(&runs, !distributed, args.save.as_deref(), &args.chart)
}
