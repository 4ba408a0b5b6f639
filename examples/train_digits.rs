//! The main job: train a digit classifier with DataParallel on CPU replicas,
//! then the same run on one device, and compare.
//!
//! ```text
//! cargo run --example train_digits -- [--strategy dp|ddp|single] [--replicas 2]
//!     [--epochs 20] [--batch 64] [--lr 0.002] [--hidden 256]
//!     [--backward fast|dropin] [--mnist DIR] [--seed 0]
//! ```
//!
//! `dp` (default): DataParallel over `--replicas` CPU replicas; `ddp`:
//! DistributedDataParallel over `--replicas` thread ranks, each with a
//! `DistributedSampler` shard and a prefetching `Loader`; `single`: plain
//! candle. `dp` and `ddp` are followed by the same run on one device.
//!
//! Data: the 8x8 handwritten digits bundled in `data/digits/` (1797
//! samples, 80/20 train / held-out split), or MNIST from a local directory
//! of IDX files with `--mnist DIR` (its own train / test files).

#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Module, Tensor};
use candle_dp::datasets::{load_digits, load_mnist, shuffled_indices, LabelledImages};
use candle_dp::launch::spawn;
use candle_dp::loader::{Loader, TensorDataset};
use candle_dp::sampler::DistributedSampler;
use candle_dp::{cpu_devices, DataParallel, DdpConfig, DistributedDataParallel, LossReduction};
use candle_nn::{linear, loss, AdamW, Linear, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use indicatif::{ProgressBar, ProgressStyle};

/// The user's model: plain candle code, unaware of data parallelism.
struct Mlp {
    l1: Linear,
    l2: Linear,
}

impl Mlp {
    fn new(vb: VarBuilder, inputs: usize, hidden: usize) -> candle_core::Result<Self> {
        Ok(Self {
            l1: linear(inputs, hidden, vb.pp("l1"))?,
            l2: linear(hidden, 10, vb.pp("l2"))?,
        })
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.l2.forward(&self.l1.forward(x)?.relu()?)
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Strategy {
    Dp,
    Ddp,
    Single,
}

struct Args {
    strategy: Strategy,
    replicas: usize,
    epochs: usize,
    batch: usize,
    lr: f64,
    hidden: usize,
    fast_backward: bool,
    mnist: Option<String>,
    seed: u64,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        strategy: Strategy::Dp,
        replicas: 2,
        epochs: 20,
        batch: 64,
        lr: 0.002,
        hidden: 256,
        fast_backward: true,
        mnist: None,
        seed: 0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--replicas" => args.replicas = value()?.parse()?,
            "--epochs" => args.epochs = value()?.parse()?,
            "--batch" => args.batch = value()?.parse()?,
            "--lr" => args.lr = value()?.parse()?,
            "--hidden" => args.hidden = value()?.parse()?,
            "--seed" => args.seed = value()?.parse()?,
            "--mnist" => args.mnist = Some(value()?),
            "--strategy" => {
                args.strategy = match value()?.as_str() {
                    "dp" => Strategy::Dp,
                    "ddp" => Strategy::Ddp,
                    "single" => Strategy::Single,
                    other => bail!("--strategy takes dp, ddp or single, not {other}"),
                }
            }
            "--backward" => {
                args.fast_backward = match value()?.as_str() {
                    "fast" => true,
                    "dropin" => false,
                    other => bail!("--backward takes fast or dropin, not {other}"),
                }
            }
            "-h" | "--help" => {
                println!(
                    "{}",
                    include_str!("train_digits.rs")
                        .lines()
                        .skip(3)
                        .take(4)
                        .collect::<Vec<_>>()
                        .join("\n")
                );
                std::process::exit(0);
            }
            other => bail!("unknown flag {other} (try --help)"),
        }
    }
    if args.replicas == 0 || args.batch == 0 {
        bail!("--replicas and --batch must be at least 1");
    }
    Ok(args)
}

/// Train and held-out sets.
fn load_data(args: &Args) -> Result<(LabelledImages, LabelledImages, String)> {
    if let Some(dir) = &args.mnist {
        return Ok((
            load_mnist(dir, true)?,
            load_mnist(dir, false)?,
            format!("MNIST from {dir}"),
        ));
    }
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/data/digits/digits.csv.gz");
    let all = load_digits(path)?;
    let order = shuffled_indices(all.len(), args.seed);
    let cut = all.len() * 4 / 5;
    Ok((
        all.select(&order[..cut])?,
        all.select(&order[cut..])?,
        "8x8 digits (scikit-learn)".into(),
    ))
}

struct Outcome {
    seconds: f64,
    samples: usize,
    last_loss: f32,
    accuracy: f64,
    weights: Vec<Tensor>,
}

/// One training run. `replicas == 0` means plain candle on one device.
fn train(
    args: &Args,
    replicas: usize,
    init: &VarMap,
    train: &LabelledImages,
    test: &LabelledImages,
) -> Result<Outcome> {
    let varmap = copy_varmap(init)?;
    let (inputs, hidden) = (train.height * train.width, args.hidden);
    let factory = move |vb: VarBuilder| Mlp::new(vb, inputs, hidden);
    let dp = if replicas > 0 {
        Some(DataParallel::new(
            &varmap,
            DType::F32,
            &cpu_devices(replicas),
            factory,
        )?)
    } else {
        None
    };
    let single = factory(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?;
    let mut opt = adamw(&varmap, args.lr)?;

    let steps_per_epoch = train.len().div_ceil(args.batch);
    let bar = progress_bar((args.epochs * steps_per_epoch) as u64)?;
    bar.set_prefix(if replicas > 0 {
        format!("DP x{replicas}")
    } else {
        "1 device".into()
    });

    let (mut samples, mut last_loss) = (0, f32::NAN);
    let start = Instant::now();
    for epoch in 0..args.epochs {
        let order = shuffled_indices(train.len(), args.seed + 1 + epoch as u64);
        for batch in order.chunks(args.batch) {
            let b = train.select(batch)?;
            let loss = match &dp {
                Some(dp) if args.fast_backward => {
                    // Each replica: forward, loss on its rows, backward; gradients summed.
                    let step = dp.forward_backward(
                        (b.images, b.labels),
                        LossReduction::Mean,
                        |m, (x, y)| loss::cross_entropy(&m.forward(&x)?, &y),
                    )?;
                    opt.step(&step.grads)?;
                    step.loss
                }
                Some(dp) => {
                    let loss = loss::cross_entropy(&dp.forward(&b.images)?, &b.labels)?;
                    opt.backward_step(&loss)?;
                    loss
                }
                None => {
                    let loss = loss::cross_entropy(&single.forward(&b.images)?, &b.labels)?;
                    opt.backward_step(&loss)?;
                    loss
                }
            };
            samples += batch.len();
            last_loss = loss.to_scalar::<f32>()?;
            bar.inc(1);
        }
        bar.set_message(format!("epoch {} loss {last_loss:.4}", epoch + 1));
    }
    let seconds = start.elapsed().as_secs_f64();
    bar.finish();

    Ok(Outcome {
        seconds,
        samples,
        last_loss,
        accuracy: accuracy(&single, test)?,
        weights: sorted_weights(&varmap),
    })
}

/// DistributedDataParallel over `args.replicas` thread ranks: each rank
/// reads its `DistributedSampler` shard through a prefetching `Loader`.
fn train_ddp(
    args: &Args,
    init: &VarMap,
    train: &LabelledImages,
    test: &LabelledImages,
) -> Result<Outcome> {
    let world = args.replicas;
    let per_rank = (args.batch / world).max(1);
    let dataset = Arc::new(TensorDataset::new(vec![
        train.images.clone(),
        train.labels.clone(),
    ])?);
    let (inputs, hidden) = (train.height * train.width, args.hidden);
    let steps_per_epoch = DistributedSampler::new(train.len(), world, 0)?
        .len()
        .div_ceil(per_rank);
    let bar = progress_bar((args.epochs * steps_per_epoch) as u64)?;
    bar.set_prefix(format!("DDP x{world}"));
    let start = Instant::now();
    let mut results = spawn(world, |ctx| {
        let varmap = copy_varmap(init)?;
        let mut ddp = DistributedDataParallel::new(
            ctx.process_group(),
            &varmap,
            DType::F32,
            &Device::Cpu,
            |vb| Mlp::new(vb, inputs, hidden),
            DdpConfig::default(),
        )?;
        let mut opt = adamw(&varmap, args.lr)?;
        let mut sampler = DistributedSampler::new(train.len(), world, ctx.rank)?.seed(args.seed);
        let (mut samples, mut last_loss) = (0, f32::NAN);
        for epoch in 0..args.epochs {
            sampler.set_epoch(epoch as u64);
            let loader = Loader::new(dataset.clone(), per_rank)?
                .indices(sampler.indices())
                .prefetch(2);
            for batch in &loader {
                let batch = batch?;
                let loss = loss::cross_entropy(&ddp.forward(&batch[0])?, &batch[1])?;
                ddp.backward_step(&loss, &mut opt)?;
                samples += batch[0].dim(0)?;
                last_loss = loss.to_scalar::<f32>()?;
                if ctx.rank == 0 {
                    bar.inc(1);
                }
            }
            if ctx.rank == 0 {
                bar.set_message(format!("epoch {} loss {last_loss:.4}", epoch + 1));
            }
        }
        let model = Mlp::new(
            VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
            inputs,
            hidden,
        )?;
        Ok((
            samples,
            last_loss,
            accuracy(&model, test)?,
            sorted_weights(&varmap),
        ))
    })?;
    let seconds = start.elapsed().as_secs_f64();
    bar.finish();
    let samples: usize = results.iter().map(|r| r.0).sum();
    let (_, last_loss, accuracy, weights) = results.swap_remove(0);
    Ok(Outcome {
        seconds,
        samples,
        last_loss,
        accuracy,
        weights,
    })
}

fn adamw(varmap: &VarMap, lr: f64) -> Result<AdamW> {
    Ok(AdamW::new(
        varmap.all_vars(),
        ParamsAdamW {
            lr,
            ..Default::default()
        },
    )?)
}

fn progress_bar(steps: u64) -> Result<ProgressBar> {
    let bar = ProgressBar::new(steps);
    bar.set_style(
        ProgressStyle::with_template("{prefix:>12} [{bar:30}] {pos}/{len} steps  {msg}")?
            .progress_chars("=> "),
    );
    Ok(bar)
}

fn accuracy(model: &Mlp, test: &LabelledImages) -> Result<f64> {
    let predictions = model.forward(&test.images)?.argmax(1)?;
    let correct = predictions
        .eq(&test.labels)?
        .to_dtype(DType::F32)?
        .sum_all()?
        .to_scalar::<f32>()?;
    Ok(correct as f64 / test.len() as f64)
}

fn sorted_weights(varmap: &VarMap) -> Vec<Tensor> {
    let data = varmap.data().lock().expect("lock");
    let mut named: Vec<_> = data
        .iter()
        .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named.into_iter().map(|(_, t)| t).collect()
}

fn copy_varmap(from: &VarMap) -> Result<VarMap> {
    let to = VarMap::new();
    {
        let src = from.data().lock().expect("lock");
        let mut dst = to.data().lock().expect("lock");
        for (name, var) in src.iter() {
            dst.insert(
                name.clone(),
                candle_core::Var::from_tensor(&var.as_tensor().copy()?)?,
            );
        }
    }
    Ok(to)
}

fn main() -> Result<()> {
    let args = parse_args()?;
    let (train_set, test_set, name) = load_data(&args)?;
    println!(
        "data: {name}: {} training and {} held-out samples of {}x{} pixels",
        train_set.len(),
        test_set.len(),
        train_set.height,
        train_set.width
    );
    println!(
        "model: MLP {}-{}-10, AdamW lr {}, global batch {}, {} epochs, {} backward",
        train_set.height * train_set.width,
        args.hidden,
        args.lr,
        args.batch,
        args.epochs,
        if args.fast_backward {
            "parallel (per-replica loss)"
        } else {
            "drop-in (loss on gathered output)"
        }
    );

    // One initialisation shared by both runs, so they can be compared.
    let init = VarMap::new();
    Mlp::new(
        VarBuilder::from_varmap(&init, DType::F32, &Device::Cpu),
        train_set.height * train_set.width,
        args.hidden,
    )?;

    let one = train(&args, 0, &init, &train_set, &test_set)?;
    let parallel = match args.strategy {
        Strategy::Dp => Some((
            format!("DataParallel, {} CPU replicas", args.replicas),
            train(&args, args.replicas, &init, &train_set, &test_set)?,
        )),
        Strategy::Ddp => Some((
            format!("DDP, {} thread ranks", args.replicas),
            train_ddp(&args, &init, &train_set, &test_set)?,
        )),
        Strategy::Single => None,
    };

    println!();
    println!("| run | final loss | held-out accuracy | train time (s) | samples/s |");
    println!("|---|---|---|---|---|");
    let mut runs = vec![("one device".to_string(), &one)];
    if let Some((label, outcome)) = &parallel {
        runs.insert(0, (label.clone(), outcome));
    }
    for (label, o) in runs {
        println!(
            "| {label} | {:.4} | {:.2}% | {:.2} | {:.0} |",
            o.last_loss,
            100.0 * o.accuracy,
            o.seconds,
            o.samples as f64 / o.seconds
        );
    }
    if let Some((_, p)) = &parallel {
        println!();
        println!("speed-up over one device: {:.2}x", one.seconds / p.seconds);
        if args.strategy == Strategy::Dp {
            let max_diff = p
                .weights
                .iter()
                .zip(&one.weights)
                .map(|(a, b)| Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?))
                .collect::<Result<Vec<f32>>>()?
                .into_iter()
                .fold(0f32, f32::max);
            println!("largest weight difference from the one-device run: {max_diff:.3e} (same init, same batches)");
        }
    }
    Ok(())
}
