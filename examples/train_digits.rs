//! The main job: train a digit classifier with DataParallel on CPU replicas,
//! then the same run on one device, and compare.
//!
//! Every strategy trains through one loop on a [`Fabric`]
//! (`candle_dp::fabric`): `--strategy` picks it, nothing else changes.
//! `dp` (default): DataParallel over `--replicas` CPU replicas; `ddp`:
//! DistributedDataParallel over `--replicas` thread ranks, or over the
//! processes of an MPI job when started by `mpirun` (build with `--features
//! mpi`), each rank with a `DistributedSampler` shard; `--zero 1|2` with it
//! shards the optimizer state (and the gradients); `fsdp`: fully sharded
//! (each rank its pieces of every parameter, the layers gathered when
//! used), on thread ranks or under `mpirun`; `single`: one device. `dp` and
//! `ddp` are followed by the same run on one device. The initial weights
//! come from `--seed`, so threads and processes train the same model to the
//! same weights.
//!
//! Data: the 8x8 handwritten digits bundled in `data/digits/` (1797
//! samples, 80/20 train / held-out split), or MNIST from a local directory
//! of IDX files with `--mnist DIR` (its own train / test files). `dp` and
//! `single` shuffle the global batches with the example's own order (one
//! loader over the whole batch); the ranks of `ddp` and `fsdp` take theirs
//! from a `DistributedSampler`.
//!
//! Every run reports the loss of its whole batch, as one device computing
//! on that batch does: under DDP, ZeRO and FSDP (threads or MPI) the mean
//! over every rank's rows (`Fabric::global_mean`), not rank 0's own share,
//! so the rows of the final table compare.

#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::{DType, Device, Module, Tensor};
use candle_dp::checkpoint::{self, Prefix};
use candle_dp::fabric::{self, DataOptions, DpBackward, Fabric, FabricConfig, FabricModule};
use candle_dp::launch::Backend;
use candle_dp::loader::TensorDataset;
use candle_dp::optim::{AdamW, AdamWConfig, LrScheduler};
use candle_dp::pipeline::{layer, LayerFactory};
use candle_dp::precision::{MixedPrecision, MixedPrecisionModel};
use candle_dp::training_state::Progress;
use candle_dp_examples::datasets::{load_digits, load_mnist, shuffled_indices, LabelledImages};
use candle_dp_examples::flags;
use candle_nn::{conv2d, linear, loss, Conv2d, Conv2dConfig, Linear, VarBuilder, VarMap};
use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};

/// The user's model: plain candle code, unaware of data parallelism.
enum Net {
    Mlp { l1: Linear, l2: Linear },
    Conv(ConvNet),
}

/// conv(1 -> c, 3x3) -> relu -> conv(c -> 2c, 3x3) -> relu -> maxpool 2 ->
/// linear(2c * (h/2) * (w/2) -> 10), on images given as flattened rows.
struct ConvNet {
    conv1: Conv2d,
    conv2: Conv2d,
    fc: Linear,
    height: usize,
    width: usize,
}

impl Net {
    fn new(
        vb: VarBuilder,
        model: Model,
        height: usize,
        width: usize,
        hidden: usize,
    ) -> candle_core::Result<Self> {
        Ok(match model {
            Model::Mlp => Net::Mlp {
                l1: linear(height * width, hidden, vb.pp("l1"))?,
                l2: linear(hidden, 10, vb.pp("l2"))?,
            },
            Model::Conv => {
                let c = hidden;
                let same = Conv2dConfig {
                    padding: 1,
                    ..Default::default()
                };
                Net::Conv(ConvNet {
                    conv1: conv2d(1, c, 3, same, vb.pp("conv1"))?,
                    conv2: conv2d(c, 2 * c, 3, same, vb.pp("conv2"))?,
                    fc: linear(2 * c * (height / 2) * (width / 2), 10, vb.pp("fc"))?,
                    height,
                    width,
                })
            }
        })
    }
}

impl Module for Net {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Net::Mlp { l1, l2 } => l2.forward(&l1.forward(x)?.relu()?),
            Net::Conv(net) => {
                let x = x.reshape((x.dim(0)?, 1, net.height, net.width))?;
                let h = net.conv1.forward(&x)?.relu()?;
                let h = net.conv2.forward(&h)?.relu()?.max_pool2d(2)?;
                net.fc.forward(&h.flatten_from(1)?)
            }
        }
    }
}

/// The model as units, for FSDP: each layer with what follows it up to
/// the next layer (the same variables, the same forward as [`Net`]).
fn net_units(model: Model, height: usize, width: usize, hidden: usize) -> Vec<LayerFactory> {
    match model {
        Model::Mlp => vec![
            layer(move |vb| Ok(Dense(linear(height * width, hidden, vb.pp("l1"))?, true))),
            layer(move |vb| Ok(Dense(linear(hidden, 10, vb.pp("l2"))?, false))),
        ],
        Model::Conv => {
            let c = hidden;
            let same = Conv2dConfig {
                padding: 1,
                ..Default::default()
            };
            vec![
                layer(move |vb| {
                    let conv = conv2d(1, c, 3, same, vb.pp("conv1"))?;
                    Ok(ConvUnit(conv, Some((height, width)), false))
                }),
                layer(move |vb| {
                    Ok(ConvUnit(
                        conv2d(c, 2 * c, 3, same, vb.pp("conv2"))?,
                        None,
                        true,
                    ))
                }),
                layer(move |vb| {
                    let fc = linear(2 * c * (height / 2) * (width / 2), 10, vb.pp("fc"))?;
                    Ok(Dense(fc, false))
                }),
            ]
        }
    }
}

/// A linear layer on flattened rows, then ReLU when `.1`.
struct Dense(Linear, bool);

impl Module for Dense {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.0.forward(&x.flatten_from(1)?)?;
        if self.1 {
            h.relu()
        } else {
            Ok(h)
        }
    }
}

/// A convolution then ReLU: first reshaping rows to images (`.1`), then
/// pooling (`.2`).
struct ConvUnit(Conv2d, Option<(usize, usize)>, bool);

impl Module for ConvUnit {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let x = match self.1 {
            Some((h, w)) => x.reshape((x.dim(0)?, 1, h, w))?,
            None => x.clone(),
        };
        let h = self.0.forward(&x)?.relu()?;
        if self.2 {
            h.max_pool2d(2)
        } else {
            Ok(h)
        }
    }
}

/// Which model the job trains.
#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
enum Model {
    /// Two convolutions and a linear layer (`--hidden` channels first).
    Conv,
    /// One hidden layer of `--hidden` units.
    Mlp,
}

/// How the training is parallelised.
#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
enum Strategy {
    /// DataParallel: one process, a replica per CPU device.
    Dp,
    /// DistributedDataParallel: thread ranks, or MPI processes under mpirun.
    Ddp,
    /// Fully sharded data parallelism (each rank its pieces of the
    /// parameters, gradients and AdamW state; each layer gathered when
    /// used): thread ranks, or MPI processes under mpirun.
    Fsdp,
    /// Plain candle on one device only.
    Single,
}

/// How DataParallel computes gradients.
#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
enum Backward {
    /// Loss and backward on every replica, in parallel.
    Fast,
    /// Loss on the gathered output, one backward through it.
    Dropin,
}

/// Train a digit classifier with data parallelism and compare it with the
/// same run on one device.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// dp: DataParallel; ddp: DistributedDataParallel (thread ranks, or the
    /// processes of `mpirun`); single: one device only.
    #[arg(long, value_enum, default_value_t = Strategy::Dp)]
    strategy: Strategy,
    /// Replicas (dp) or thread ranks (ddp); under mpirun, `-np` decides.
    /// At least 1.
    #[arg(long, default_value_t = 2, value_parser = flags::at_least_one::<u64>)]
    replicas: u64,
    /// Passes over the training set (at least 1).
    #[arg(long, default_value_t = 20, value_parser = flags::at_least_one::<usize>)]
    epochs: usize,
    /// Global batch size (split across replicas or ranks; at least 1).
    #[arg(long, default_value_t = 64, value_parser = flags::at_least_one::<u64>)]
    batch: u64,
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
    /// DataParallel's backward path.
    #[arg(long, value_enum, default_value_t = Backward::Fast)]
    backward: Backward,
    /// A directory of MNIST IDX files instead of the bundled digits.
    #[arg(long, value_name = "DIR")]
    mnist: Option<String>,
    /// Seeds the initial weights, the data split and the shuffling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Writes the trained weights (safetensors) here; under DDP, rank 0 writes.
    #[arg(long, value_name = "FILE")]
    save: Option<PathBuf>,
    /// Writes the loss and held-out accuracy per epoch of every run here (SVG).
    #[arg(long, value_name = "FILE", default_value = "target/train_digits.svg")]
    chart: PathBuf,
    /// Saves the whole training state (weights, optimizer, progress) of the
    /// run into this directory, to continue with `--resume` after a crash.
    #[arg(long, value_name = "DIR")]
    checkpoint_dir: Option<PathBuf>,
    /// Saves a state every N optimizer steps, N at least 1 [default: at the
    /// end of every epoch].
    #[arg(long, value_name = "N", requires = "checkpoint_dir", value_parser = flags::at_least_one::<u64>)]
    checkpoint_every: Option<u64>,
    /// How many of the newest states to keep (at least 1).
    #[arg(long, value_name = "K", default_value_t = 3, requires = "checkpoint_dir", value_parser = flags::at_least_one::<u64>)]
    keep: u64,
    /// ZeRO with --strategy ddp: shard the optimizer state (1) or the
    /// optimizer state and the gradients (2) across the ranks; the weights
    /// are those of plain DDP, bit for bit.
    #[arg(long, value_name = "STAGE", value_parser = clap::value_parser!(u8).range(1..=2))]
    zero: Option<u8>,
    /// Continues from the newest complete state in `--checkpoint-dir`
    /// (from scratch, saying so, when there is none).
    #[arg(long, requires = "checkpoint_dir")]
    resume: bool,
    /// Skips the one-device comparison run (dp and ddp).
    #[arg(long)]
    no_reference: bool,
    /// How long a DDP rank waits in a collective for the others before the
    /// job fails: seconds, or `none` [default: 1800, or CANDLE_DP_TIMEOUT].
    #[arg(long, value_name = "SECONDS", value_parser = timeout_arg)]
    timeout: Option<Timeout>,
    /// The dtype of the forward and backward; the weights, the gradients
    /// the optimizer sees and its state stay in f32 (f16 adds dynamic loss
    /// scaling).
    /// f32, bf16 or f16 (also the Fabric's 32-true, bf16-mixed, 16-mixed).
    #[arg(long, default_value = "f32")]
    precision: fabric::Precision,
    /// Clips the total 2-norm of the gradients to X (a finite number above
    /// 0) before each step [default: no clipping].
    #[arg(long, value_name = "X", value_parser = flags::positive_f64)]
    clip_grad_norm: Option<f64>,
    /// The learning rate over the run.
    #[arg(long, value_enum, default_value_t = Schedule::Constant)]
    lr_schedule: Schedule,
    /// Warm-up steps of `--lr-schedule warmup-cosine` (fewer than the
    /// run's steps) [default: 5% of the run's steps, at least 1].
    #[arg(long, value_name = "N")]
    warmup_steps: Option<u64>,
}

/// A `--timeout`: `None` is no limit.
#[derive(Clone, Copy, Debug)]
struct Timeout(Option<std::time::Duration>);

fn timeout_arg(value: &str) -> std::result::Result<Timeout, String> {
    candle_dp::comm::parse_timeout(Some(value))
        .map(Timeout)
        .map_err(|e| e.replace("CANDLE_DP_TIMEOUT=", "--timeout "))
}

/// The learning rate over the run.
#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
enum Schedule {
    /// The `--lr` throughout.
    Constant,
    /// A linear warm-up from 1% of `--lr` over `--warmup-steps`, then a
    /// cosine decay to 0 at the last step (PyTorch's SequentialLR of
    /// LinearLR and CosineAnnealingLR).
    WarmupCosine,
}

impl Args {
    fn replicas(&self) -> usize {
        self.replicas as usize
    }

    fn hidden(&self) -> usize {
        self.hidden.unwrap_or(match self.model {
            Model::Conv => 8,
            Model::Mlp => 256,
        })
    }

    /// Builds this run's model for `data`'s image size.
    fn net(
        &self,
        data: &LabelledImages,
    ) -> impl Fn(VarBuilder) -> candle_core::Result<Net> + Send + Sync + Clone + 'static {
        let (model, height, width, hidden) = (self.model, data.height, data.width, self.hidden());
        move |vb| Net::new(vb, model, height, width, hidden)
    }

    /// The Fabric's configuration of `strategy` on `devices` (the one
    /// flag that picks the strategy, with the settings every run shares).
    fn fabric(&self, strategy: fabric::Strategy, devices: usize) -> FabricConfig {
        FabricConfig {
            // ZeRO is a setting of DDP: the one-device reference has none.
            zero: self.zero.filter(|_| strategy == fabric::Strategy::Ddp),
            precision: self.precision,
            gradient_clip: self.clip_grad_norm,
            dp_backward: match self.backward {
                Backward::Fast => DpBackward::Parallel,
                Backward::Dropin => DpBackward::Gathered,
            },
            timeout_secs: self
                .timeout
                .map(|Timeout(t)| t.map_or(f64::INFINITY, |d| d.as_secs_f64())),
            checkpoint_dir: self.checkpoint_dir.clone(),
            keep: self.keep as usize,
            seed: self.seed,
            ..FabricConfig::new(strategy, devices)
        }
    }
}

/// The mean cross-entropy (the logits come in f32 whatever the precision).
fn loss_of(logits: &Tensor, labels: &Tensor) -> candle_core::Result<Tensor> {
    loss::cross_entropy(logits, labels)
}

struct Outcome {
    /// Training time, evaluations excluded.
    seconds: f64,
    samples: usize,
    /// The last step's loss over its whole (global) batch: under DDP and
    /// FSDP the mean over every rank's rows, not rank 0's own.
    last_loss: f32,
    accuracy: f64,
    /// Per epoch: the mean training loss (of the global batches) and the
    /// held-out accuracy.
    history: Vec<(f32, f64)>,
    /// The trained weights.
    varmap: VarMap,
    /// Steps the f16 loss scaler skipped.
    skipped: u64,
}

/// What one run needs besides its strategy.
struct Job<'a> {
    args: &'a Args,
    train: &'a LabelledImages,
    test: &'a LabelledImages,
    /// Whether this run saves and resumes its states (`--checkpoint-dir`).
    saves: bool,
}

/// One run of `strategy` on `devices`: the same loop for every strategy.
/// `in_process`: thread ranks even under `mpirun` (the one-device
/// reference on rank 0). `None` on the ranks other than 0.
fn train(
    job: &Job,
    strategy: fabric::Strategy,
    devices: usize,
    in_process: bool,
) -> Result<Option<Outcome>> {
    let Job {
        args, train, test, ..
    } = *job;
    let mut config = args.fabric(strategy, devices);
    if !job.saves {
        config.checkpoint_dir = None;
    }
    let dataset = Arc::new(TensorDataset::new(vec![
        train.images.clone(),
        train.labels.clone(),
    ])?);
    let (height, width, hidden) = (train.height, train.width, args.hidden());
    let rank_loop = |fabric: Fabric| -> Result<Option<Outcome>> {
        let (rank, world) = (fabric.rank(), fabric.world_size());
        let units = FabricModule::units(net_units(args.model, height, width, hidden));
        let lr = args.lr;
        let mut model = fabric.setup(units, |params| {
            AdamW::new_named(
                params,
                AdamWConfig {
                    lr,
                    ..Default::default()
                },
            )
        })?;
        // One process over the whole global batch shuffles with the
        // example's own order; ranks take theirs from a DistributedSampler.
        let per_rank = (args.batch as usize / world).max(1);
        let mut loader = fabric.setup_dataloader(
            dataset.clone(),
            per_rank,
            DataOptions {
                shuffle: true,
                prefetch: 2,
                ..DataOptions::default()
            },
        )?;
        if !strategy.is_distributed() {
            let (n, seed) = (train.len(), args.seed);
            loader =
                loader.with_order(move |epoch| shuffled_indices(n, seed.wrapping_add(1 + epoch)));
        }
        let batches = loader.len()? as u64;
        let total = batches * args.epochs as u64;
        if args.lr_schedule == Schedule::WarmupCosine {
            let warmup = args.warmup_steps.unwrap_or((total / 20).max(1));
            model.set_schedule(LrScheduler::warmup_cosine(args.lr, warmup, total)?)?;
        }
        let from = model.resume(job.saves && args.resume)?;
        let bar = if rank == 0 {
            let bar = progress_bar(total)?;
            bar.set_prefix(match strategy {
                fabric::Strategy::Single => "1 device".to_string(),
                fabric::Strategy::Dp => format!("DP x{devices}"),
                fabric::Strategy::Fsdp => format!("FSDP x{world}"),
                _ => format!("DDP x{world}"),
            });
            bar.set_position(from.step);
            bar
        } else {
            ProgressBar::hidden()
        };
        // Timed from here: MPI's start-up is not training.
        let start = Instant::now();
        let (mut samples, mut last_loss, mut step) = (0, f32::NAN, from.step);
        let (mut losses, mut history, mut evaluating) =
            (Vec::new(), Vec::new(), Default::default());
        for epoch in from.epoch..args.epochs as u64 {
            loader.set_epoch(epoch);
            // A resumed epoch continues with the batch it had not trained on.
            let skip = if epoch == from.epoch { from.batch } else { 0 };
            loader.skip_batches(skip as usize);
            for (index, batch) in (skip..).zip(loader.iter()?) {
                let batch = batch?;
                let loss = model.backward(&batch[0], &batch[1], loss_of)?;
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
                if let Some(progress) = progress.due(batches, args.checkpoint_every) {
                    if job.saves {
                        model.save(progress)?;
                    }
                }
            }
            bar.set_message(format!("epoch {} loss {last_loss:.4}", epoch + 1));
            // Every rank takes part in FSDP's gathering; rank 0 evaluates.
            let evaluation = Instant::now();
            let weights = model.full_varmap()?;
            if rank == 0 {
                let mean = losses.iter().sum::<f32>() / losses.len().max(1) as f32;
                losses.clear();
                history.push((mean, accuracy(&in_precision(args, &weights, train)?, test)?));
            }
            evaluating += evaluation.elapsed();
        }
        let seconds = (start.elapsed() - evaluating).as_secs_f64();
        bar.finish();
        let varmap = model.full_varmap()?;
        if rank != 0 {
            return Ok(None);
        }
        let accuracy = accuracy(&in_precision(args, &varmap, train)?, test)?;
        Ok(Some(Outcome {
            seconds,
            // Every rank trains on as many samples (the sampler pads).
            samples: samples * world,
            last_loss,
            accuracy,
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

/// The classifier in the run's precision over `varmap`'s f32 weights.
fn in_precision(
    args: &Args,
    varmap: &VarMap,
    data: &LabelledImages,
) -> Result<MixedPrecisionModel<Net>> {
    let policy = (args.precision.policy()).unwrap_or_else(|| MixedPrecision::new(DType::F32));
    Ok(MixedPrecisionModel::new(
        varmap,
        DType::F32,
        &Device::Cpu,
        policy,
        args.net(data),
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

fn accuracy(model: &MixedPrecisionModel<Net>, test: &LabelledImages) -> Result<f64> {
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

fn main() -> ExitCode {
    // Errors as whole lines, prefixed with the rank under mpirun.
    candle_dp::launch::report::exit_code(run(Args::parse()))
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

fn run(args: Args) -> Result<()> {
    let mpi = Backend::from_env() != Backend::Threads;
    if mpi && !matches!(args.strategy, Strategy::Ddp | Strategy::Fsdp) {
        bail!("under mpirun, use --strategy ddp or fsdp (dp and single run in one process)");
    }
    if args.zero.is_some() && args.strategy != Strategy::Ddp {
        bail!("--zero shards DistributedDataParallel's optimizer: use it with --strategy ddp");
    }
    if args.precision == fabric::Precision::Bf16Mixed && args.model == Model::Conv {
        bail!(
            "--precision bf16 with the conv net: candle 0.11's CPU convolution has no bf16 \
             kernel; use --model mlp, or --precision f16"
        );
    }
    // Under MPI every process runs this; only rank 0 speaks.
    let speaks = Backend::process_rank() == 0;
    let (train_set, test_set, name) = load_data(&args)?;
    if speaks {
        describe(&args, &train_set, &test_set, &name);
    }
    let job = Job {
        args: &args,
        train: &train_set,
        test: &test_set,
        saves: args.checkpoint_dir.is_some(),
    };
    // The saved run: the parallel one, or the one device of `single`.
    let parallel = match args.strategy {
        Strategy::Dp => Some((
            format!("DataParallel, {} CPU replicas", args.replicas),
            train(&job, fabric::Strategy::Dp, args.replicas(), false)?,
        )),
        Strategy::Ddp | Strategy::Fsdp => {
            let (strategy, ddp) = match (args.strategy, args.zero) {
                (Strategy::Fsdp, _) => (fabric::Strategy::Fsdp, "FSDP".to_string()),
                (_, Some(stage)) => (
                    fabric::Strategy::Ddp,
                    format!("DDP with ZeRO stage {stage}"),
                ),
                (_, None) => (fabric::Strategy::Ddp, "DDP".to_string()),
            };
            let label = match Backend::from_env() {
                Backend::Threads => format!("{ddp}, {} thread ranks", args.replicas),
                Backend::Mpi { .. } => format!("{ddp}, {} MPI processes", Backend::world_size()),
            };
            match train(&job, strategy, args.replicas(), false)? {
                Some(outcome) => Some((label, Some(outcome))),
                None => return Ok(()), // not rank 0
            }
        }
        Strategy::Single => None,
    };
    let parallel = parallel.map(|(label, outcome)| (label, outcome.expect("rank 0's outcome")));
    let reference = Job {
        saves: false,
        ..job
    };
    let one = match (&parallel, args.no_reference) {
        (Some(_), true) => None,
        (Some(_), false) => train(&reference, fabric::Strategy::Single, 1, true)?,
        (None, _) => train(&job, fabric::Strategy::Single, 1, true)?,
    };
    // Every run, the saved one first: the parallel run, or the one device.
    let mut runs: Vec<(String, &Outcome)> = Vec::new();
    if let Some((label, outcome)) = &parallel {
        runs.push((label.clone(), outcome));
    }
    if let Some(outcome) = &one {
        runs.push(("one device".to_string(), outcome));
    }
    if let (Some(path), Some((_, saved))) = (&args.save, runs.first()) {
        checkpoint::save(&saved.varmap, path, Prefix::None)?;
    }

    println!();
    println!("| run | final loss | held-out accuracy | train time (s) | samples/s |");
    println!("|---|---|---|---|---|");
    for (label, o) in &runs {
        println!(
            "| {label} | {:.4} | {:.2}% | {:.2} | {:.0} |",
            o.last_loss,
            100.0 * o.accuracy,
            o.seconds,
            o.samples as f64 / o.seconds
        );
    }
    if let (Some((_, p)), Some(one)) = (&parallel, &one) {
        println!();
        println!("speed-up over one device: {:.2}x", one.seconds / p.seconds);
        let max_diff = sorted_weights(&p.varmap)
            .iter()
            .zip(&sorted_weights(&one.varmap))
            .map(|(a, b)| Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?))
            .collect::<Result<Vec<f32>>>()?
            .into_iter()
            .fold(0f32, f32::max);
        let note = if args.strategy == Strategy::Dp {
            "same init, same batches"
        } else {
            "same init; DDP's sampler orders the data its own way"
        };
        println!("largest weight difference from the one-device run: {max_diff:.3e} ({note})");
    }
    for (label, o) in &runs {
        if o.skipped > 0 {
            println!(
                "{label}: the f16 loss scaler skipped {} steps (gradients past f16's range)",
                o.skipped
            );
        }
    }
    if let Some(path) = &args.save {
        println!("weights saved to {}", path.display());
    }
    let curves: Vec<(String, &[(f32, f64)])> = runs
        .iter()
        .map(|(label, o)| (label.clone(), o.history.as_slice()))
        .collect();
    chart(&args.chart, &curves)?;
    println!("loss and accuracy per epoch: {}", args.chart.display());
    Ok(())
}

/// What is trained, on what, said once.
fn describe(args: &Args, train_set: &LabelledImages, test_set: &LabelledImages, name: &str) {
    println!(
        "data: {name}: {} training and {} held-out samples of {}x{} pixels",
        train_set.len(),
        test_set.len(),
        train_set.height,
        train_set.width
    );
    let model = match args.model {
        Model::Mlp => format!(
            "MLP {}-{}-10",
            train_set.height * train_set.width,
            args.hidden()
        ),
        Model::Conv => {
            let c = args.hidden();
            format!(
                "conv net (conv 3x3 1-{c}, conv 3x3 {c}-{}, maxpool 2, linear to 10)",
                2 * c
            )
        }
    };
    let mut recipe = String::new();
    if args.lr_schedule == Schedule::WarmupCosine {
        recipe += " with warm-up and cosine decay";
    }
    if let Some(x) = args.clip_grad_norm {
        recipe += &format!(", gradients clipped to norm {x}");
    }
    match args.precision {
        fabric::Precision::F32 => {}
        fabric::Precision::Bf16Mixed => recipe += ", bf16 compute",
        fabric::Precision::F16Mixed => recipe += ", f16 compute with loss scaling",
    }
    println!(
        "model: {model}, AdamW lr {}{recipe}, global batch {}, {} epochs, {} backward, seed {}",
        args.lr,
        args.batch,
        args.epochs,
        match args.backward {
            Backward::Fast => "parallel (per-replica loss)",
            Backward::Dropin => "drop-in (loss on gathered output)",
        },
        args.seed
    );
}

/// Two panels, training loss and held-out accuracy per epoch, one line per run.
fn chart(path: &std::path::Path, runs: &[(String, &[(f32, f64)])]) -> Result<()> {
    use plotters::prelude::*;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let root = SVGBackend::new(path, (900, 360)).into_drawing_area();
    root.fill(&WHITE)?;
    let (left, right) = root.split_horizontally(450);
    let epochs = runs.iter().map(|(_, h)| h.len()).max().unwrap_or(1).max(1);
    let colors = [RED, BLUE, GREEN];
    // Which number of an epoch's (loss, accuracy) a panel plots.
    type Metric = fn(&(f32, f64)) -> f64;
    let panels: [(&str, DrawingArea<_, _>, Metric); 2] = [
        ("training loss (epoch mean)", left, |e| f64::from(e.0)),
        ("held-out accuracy", right, |e| e.1),
    ];
    for (title, area, value) in panels {
        let values = runs.iter().flat_map(|(_, h)| h.iter().map(value));
        let top = values.fold(0f64, f64::max).max(1e-3) * 1.05;
        let mut chart = ChartBuilder::on(&area)
            .caption(title, ("sans-serif", 16))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(50)
            .build_cartesian_2d(1..epochs, 0f64..top)?;
        chart.configure_mesh().x_desc("epoch").draw()?;
        // Wider lines first: runs that agree (they should) stay visible.
        for (i, ((label, history), color)) in runs.iter().zip(colors.iter().cycle()).enumerate() {
            let style = color.stroke_width(6u32.saturating_sub(3 * i as u32).max(2));
            let points = history.iter().enumerate().map(|(i, e)| (i + 1, value(e)));
            chart
                .draw_series(LineSeries::new(points, style))?
                .label(label.as_str())
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], style));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(())
}
