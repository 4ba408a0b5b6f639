//! Model parallelism: a digit classifier split into stages over 2 CPU
//! "devices", pipelined over micro-batches, then the same training on one
//! device, and the largest weight difference between the two.
//!
//! ```text
//! cargo run --release --example pipeline -- [--stages 2] [--chunks 4]
//!     [--schedule 1f1b|gpipe|interleaved [--stages-per-device 2]]
//!     [--checkpoint never|except-last|always]
//!     [--epochs 5] [--batch 64] [--seed 1] [--save FILE]
//!     [--checkpoint-dir DIR [--checkpoint-every N] [--resume]] [--no-reference]
//! ```
//!
//! The model is a list of layer factories; each stage builds only its own
//! layers, on its own device (on CPU every stage is `Device::Cpu`, with its
//! own share of the cores). The training loop is the plain candle loop with
//! one call changed: `pipe.forward_backward(..)` instead of
//! `model.forward(..)` and `loss.backward()`.

#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_dp::checkpoint::{self, Prefix};
use candle_dp::fabric::Resumed;
use candle_dp::optim::{AdamW, AdamWConfig, StatefulOptimizer};
use candle_dp::pipeline::{unit, Checkpoint, Pipeline, Schedule, UnitFactory};
use candle_dp::training_state::{Progress, StateDir, TrainingState};
use candle_dp::{cpu_devices, seeded_varmap, LossReduction};
use candle_dp_examples::datasets::{load_digits, shuffled_indices, LabelledImages};
use candle_dp_examples::flags;
use candle_nn::{linear, loss, Activation, Optimizer, VarBuilder, VarMap};
use clap::{Parser, ValueEnum};
use std::path::PathBuf;
use std::process::ExitCode;

/// Which micro-batches a stage recomputes before their backward.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum Recompute {
    /// Keep every micro-batch's activations.
    Never,
    /// Recompute all but the last micro-batch (torchgpipe's default).
    ExceptLast,
    /// Recompute every micro-batch: the least memory.
    Always,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Sched {
    Gpipe,
    #[value(name = "1f1b")]
    OneFOneB,
    /// Interleaved 1F1B: each device holds `--stages-per-device` stages.
    Interleaved,
}

/// Trains an MLP on the bundled 8x8 digits with a pipeline, then on one
/// device, and compares.
#[derive(Parser, Debug)]
struct Args {
    /// Pipeline devices (CPU "devices"): one stage each, or
    /// `--stages-per-device` with `--schedule interleaved`. At least 1.
    #[arg(long, default_value_t = 2, value_parser = flags::at_least_one::<usize>)]
    stages: usize,
    /// Micro-batches per batch (at least 1).
    #[arg(long, default_value_t = 4, value_parser = flags::at_least_one::<usize>)]
    chunks: usize,
    #[arg(long, value_enum, default_value_t = Sched::OneFOneB)]
    schedule: Sched,
    /// Stages per device of the interleaved schedule (Megatron's v; at
    /// least 1).
    #[arg(long, default_value_t = 2, value_parser = flags::at_least_one::<u16>)]
    stages_per_device: u16,
    /// Activation checkpointing: recompute each stage's forward before its
    /// backward instead of keeping its activations.
    #[arg(long, value_enum, default_value_t = Recompute::Never)]
    checkpoint: Recompute,
    /// Passes over the training set (at least 1).
    #[arg(long, default_value_t = 5, value_parser = flags::at_least_one::<usize>)]
    epochs: usize,
    /// Rows per batch (at least 1).
    #[arg(long, default_value_t = 64, value_parser = flags::at_least_one::<usize>)]
    batch: usize,
    /// Initial weights and data order.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Writes the pipeline's trained weights (safetensors) here.
    #[arg(long, value_name = "FILE")]
    save: Option<PathBuf>,
    /// Saves the whole training state of the pipeline run into this
    /// directory, to continue with `--resume` after a crash.
    #[arg(long, value_name = "DIR")]
    checkpoint_dir: Option<PathBuf>,
    /// Saves a state every N steps, N at least 1 [default: at the end of
    /// every epoch].
    #[arg(long, value_name = "N", requires = "checkpoint_dir", value_parser = flags::at_least_one::<u64>)]
    checkpoint_every: Option<u64>,
    /// Continues from the newest complete state in `--checkpoint-dir`.
    #[arg(long, requires = "checkpoint_dir")]
    resume: bool,
    /// Skips the one-device comparison run.
    #[arg(long)]
    no_reference: bool,
}

/// The model as a list of layers: 64 -> 128 -> 128 -> 64 -> 10.
fn layers() -> Vec<UnitFactory> {
    vec![
        unit(|vb| linear(64, 128, vb.pp("l1"))),
        unit(|_| Ok(Activation::Relu)),
        unit(|vb| linear(128, 128, vb.pp("l2"))),
        unit(|_| Ok(Activation::Relu)),
        unit(|vb| linear(128, 64, vb.pp("l3"))),
        unit(|_| Ok(Activation::Relu)),
        unit(|vb| linear(64, 10, vb.pp("l4"))),
    ]
}

fn adamw(varmap: &VarMap) -> Result<AdamW> {
    Ok(AdamW::from_varmap(
        varmap,
        AdamWConfig {
            lr: 3e-3,
            ..Default::default()
        },
    )?)
}

fn accuracy(logits: &Tensor, labels: &Tensor) -> Result<f64> {
    let hits = logits
        .argmax(1)?
        .eq(labels)?
        .to_dtype(DType::F32)?
        .sum_all()?;
    Ok(hits.to_scalar::<f32>()? as f64 / labels.dim(0)? as f64)
}

fn batches(
    train: &LabelledImages,
    batch: usize,
    epoch: usize,
    seed: u64,
) -> Result<Vec<(Tensor, Tensor)>> {
    let order = shuffled_indices(train.len(), seed.wrapping_add(epoch as u64));
    order
        .chunks(batch)
        .map(|rows| {
            let part = train.select(rows)?;
            Ok((part.images.flatten_from(1)?, part.labels))
        })
        .collect()
}

fn main() -> ExitCode {
    // Errors as whole lines, prefixed with the rank under mpirun.
    candle_dp::launch::report::exit_code(run(Args::parse()))
}

fn run(args: Args) -> Result<()> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/data/digits/digits.csv.gz");
    let all = load_digits(path)?;
    let order = shuffled_indices(all.len(), args.seed);
    let cut = all.len() * 4 / 5;
    let (train, test) = (all.select(&order[..cut])?, all.select(&order[cut..])?);
    let list = layers();
    let init = || {
        seeded_varmap(args.seed, DType::F32, &Device::Cpu, |vb| {
            list.iter().try_for_each(|f| f(vb.clone()).map(|_| ()))
        })
    };

    // The pipeline.
    let varmap = init()?;
    let schedule = match args.schedule {
        Sched::Gpipe => Schedule::GPipe,
        Sched::OneFOneB => Schedule::OneFOneB,
        Sched::Interleaved => Schedule::Interleaved1F1B {
            stages_per_device: args.stages_per_device.into(),
        },
    };
    let checkpoint = match args.checkpoint {
        Recompute::Never => Checkpoint::Never,
        Recompute::ExceptLast => Checkpoint::ExceptLast,
        Recompute::Always => Checkpoint::Always,
    };
    let pipe = Pipeline::builder(&varmap, DType::F32, &cpu_devices(args.stages))
        .chunks(args.chunks)
        .schedule(schedule)
        .checkpoint(checkpoint)
        .build(layers())?;
    println!(
        "pipeline: {} devices (layers per stage {:?}), {} micro-batches, {:?}, checkpoint {checkpoint:?}",
        args.stages,
        pipe.balance(),
        pipe.chunks(),
        pipe.schedule()
    );
    let mut opt = adamw(&varmap)?;
    // The run's states (the newest 3 kept). The stages' variables are the
    // VarMap's: a restored state is theirs.
    let states = match &args.checkpoint_dir {
        Some(dir) => Some(StateDir::new(dir)?.keep(3)),
        None => None,
    };
    let from = match (&states, args.resume) {
        (Some(states), true) => match states.latest()? {
            Some(saved) => {
                saved.restore(&varmap, Some(&mut opt))?;
                let resumed = Resumed {
                    progress: saved.state.progress,
                    path: saved.path,
                };
                eprintln!("{resumed}");
                resumed.progress
            }
            None => {
                eprintln!(
                    "no complete training state in {}: starting from scratch",
                    states.path().display()
                );
                Progress::default()
            }
        },
        _ => Progress::default(),
    };
    let test_x = test.images.flatten_from(1)?;
    let mut bubble = Vec::new();
    // Per device, the most activation bytes held for the backward in any step.
    let mut peak_saved = vec![0usize; args.stages];
    let start = std::time::Instant::now();
    let mut step_count = from.step;
    for epoch in from.epoch as usize..args.epochs {
        let mut losses = Vec::new();
        let all = batches(&train, args.batch, epoch, args.seed)?;
        let per_epoch = all.len() as u64;
        // A resumed epoch continues with the batch it had not trained on.
        let skip = if epoch as u64 == from.epoch {
            from.batch as usize
        } else {
            0
        };
        for (index, (x, y)) in all.into_iter().enumerate().skip(skip) {
            let step = pipe.forward_backward(&x, &y, LossReduction::Mean, loss::cross_entropy)?;
            opt.step(&step.grads)?;
            losses.push(step.loss.to_scalar::<f32>()?);
            let timings = pipe.last_timings();
            bubble.push(timings.bubble());
            for (peak, step) in peak_saved.iter_mut().zip(&timings.peak_saved_bytes) {
                *peak = (*peak).max(*step);
            }
            step_count += 1;
            if let Some(states) = &states {
                let progress = Progress {
                    epoch: epoch as u64,
                    batch: index as u64 + 1,
                    step: step_count,
                };
                if let Some(progress) = progress.due(per_epoch, args.checkpoint_every) {
                    let state = TrainingState {
                        progress,
                        optimizer: Some(opt.state()?),
                        ..Default::default()
                    };
                    states.save(&varmap, &state)?;
                }
            }
        }
        let acc = accuracy(&pipe.forward_t(&test_x, false)?, &test.labels)?;
        let mean = losses.iter().sum::<f32>() / losses.len().max(1) as f32;
        println!(
            "epoch {epoch}: loss {mean:.4}, held-out accuracy {:.2}%",
            acc * 100.0
        );
    }
    let pipe_seconds = start.elapsed().as_secs_f64();
    bubble.sort_by(f64::total_cmp);
    let median_bubble = bubble.get(bubble.len() / 2).copied().unwrap_or(0.0);
    let peak_kib: Vec<String> = peak_saved
        .iter()
        .map(|b| format!("{:.1}", *b as f64 / 1024.0))
        .collect();
    println!(
        "peak activation KiB held for the backward, per device: [{}]",
        peak_kib.join(", ")
    );
    if let Some(path) = &args.save {
        checkpoint::save(&varmap, path, Prefix::None)?;
        println!("weights saved to {}", path.display());
    }
    if args.no_reference {
        return Ok(());
    }

    // The same training on one device: plain candle.
    let reference = init()?;
    let vb = VarBuilder::from_varmap(&reference, DType::F32, &Device::Cpu);
    let model = layers()
        .iter()
        .map(|f| f(vb.clone()))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let forward = |x: &Tensor, train: bool| {
        model
            .iter()
            .try_fold(x.clone(), |h, l| l.forward_t(&h, train))
    };
    let mut opt = adamw(&reference)?;
    for epoch in 0..args.epochs {
        for (x, y) in batches(&train, args.batch, epoch, args.seed)? {
            opt.backward_step(&loss::cross_entropy(&forward(&x, true)?, &y)?)?;
        }
    }
    let one_acc = accuracy(&forward(&test_x, false)?, &test.labels)?;

    let mut diff = 0f32;
    let pipeline_vars = varmap
        .data()
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?;
    let reference_vars = reference
        .data()
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?;
    for (name, var) in pipeline_vars.iter() {
        let d = (var.as_tensor() - reference_vars[name].as_tensor())?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        diff = diff.max(d);
    }
    println!(
        "one device: held-out accuracy {:.2}%\n\
         pipeline training took {pipe_seconds:.2} s; median measured bubble {median_bubble:.2} \
         (ideal (S-1)/(v*m+S-1) = {:.2})\n\
         largest weight difference, pipeline vs one device: {diff:.2e}",
        one_acc * 100.0,
        (args.stages - 1) as f64
            / (schedule.stages_per_device() * pipe.chunks() + args.stages - 1) as f64,
    );
    Ok(())
}
