//! The main job: train a digit classifier with DataParallel on CPU replicas,
//! then the same run on one device, and compare.
//!
//! `dp` (default): DataParallel over `--replicas` CPU replicas; `ddp`:
//! DistributedDataParallel over `--replicas` thread ranks, or over the
//! processes of an MPI job when started by `mpirun` (build with `--features
//! mpi`), each rank with a `DistributedSampler` shard and a prefetching
//! `Loader`; `fsdp`: fully sharded (each rank its pieces of every
//! parameter, the layers gathered when used), on thread ranks or under
//! `mpirun`; `single`: plain candle. `dp` and `ddp` are followed by the same
//! run on one device. The initial weights come from `--seed`, so threads and
//! processes train the same model to the same weights.
//!
//! Data: the 8x8 handwritten digits bundled in `data/digits/` (1797
//! samples, 80/20 train / held-out split), or MNIST from a local directory
//! of IDX files with `--mnist DIR` (its own train / test files).
//!
//! Every run reports the loss of its whole batch, as one device computing
//! on that batch does: under DDP, ZeRO and FSDP (threads or MPI) the mean
//! over every rank's rows (`examples/common/global_loss.rs`), not rank 0's
//! own share, so the rows of the final table compare.

#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

// Example code shared with the tests; each user needs only part of it.
#[allow(dead_code)]
#[path = "common/datasets.rs"]
mod datasets;

#[path = "common/checkpoints.rs"]
mod checkpoints;

#[allow(dead_code)]
#[path = "common/flags.rs"]
mod flags;

#[path = "common/global_loss.rs"]
mod global_loss;

#[path = "common/recipe.rs"]
mod recipe;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use std::path::PathBuf;

use anyhow::{bail, Result};
use candle_core::{DType, Device, Module, Tensor};
use candle_dp::checkpoint::{self, Prefix};
use candle_dp::comm::GroupOptions;
use candle_dp::fsdp::{FsdpConfig, FullyShardedDataParallel};
use candle_dp::launch::{self, Backend};
use candle_dp::loader::{Loader, TensorDataset};
use candle_dp::optim::{AdamW, AdamWConfig};
use candle_dp::pipeline::{layer, LayerFactory};
use candle_dp::precision::MixedPrecisionModel;
use candle_dp::sampler::DistributedSampler;
use candle_dp::training_state::{check_ranks_agree, Progress, SamplerState};
use candle_dp::zero::{ZeroOptimizer, ZeroStage};
use candle_dp::{cpu_devices, seeded_varmap, DataParallel, DistributedDataParallel, LossReduction};
use candle_nn::{conv2d, linear, loss, Conv2d, Conv2dConfig, Linear, VarBuilder, VarMap};
use checkpoints::Checkpoints;
use clap::{Parser, ValueEnum};
use datasets::{load_digits, load_mnist, shuffled_indices, LabelledImages};
use global_loss::global_loss;
use indicatif::{ProgressBar, ProgressStyle};
use recipe::{Precision, Recipe, Schedule};

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
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    precision: Precision,
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

impl Args {
    fn replicas(&self) -> usize {
        self.replicas as usize
    }

    fn batch(&self) -> usize {
        self.batch as usize
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

    fn fast_backward(&self) -> bool {
        self.backward == Backward::Fast
    }

    /// The precision, clipping and schedule of a run of `total_steps`.
    fn recipe(&self, total_steps: u64) -> Result<Recipe> {
        let warmup = self.warmup_steps.unwrap_or((total_steps / 20).max(1));
        Recipe::new(
            self.precision,
            self.clip_grad_norm,
            self.lr_schedule,
            self.lr,
            warmup,
            total_steps,
        )
    }
}

/// `net` computing in `args.precision` over `varmap`'s f32 variables.
fn in_precision(
    args: &Args,
    varmap: &VarMap,
    net: impl FnOnce(VarBuilder) -> candle_core::Result<Net>,
) -> Result<MixedPrecisionModel<Net>> {
    Ok(MixedPrecisionModel::new(
        varmap,
        DType::F32,
        &Device::Cpu,
        args.precision.policy(),
        net,
    )?)
}

/// The mean cross-entropy of low-precision logits, computed in f32.
fn loss_of(logits: &Tensor, labels: &Tensor) -> candle_core::Result<Tensor> {
    loss::cross_entropy(&logits.to_dtype(DType::F32)?, labels)
}

/// The variables of `varmap` sorted by name (buffers get no gradient and
/// are skipped by the scaler and the clipping).
fn params_of(varmap: &VarMap) -> Vec<candle_core::Var> {
    let data = varmap.data().lock().expect("lock");
    let mut named: Vec<_> = data.iter().map(|(n, v)| (n.clone(), v.clone())).collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named.into_iter().map(|(_, v)| v).collect()
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

/// The losses of one epoch, and its held-out accuracy, outside the timing.
#[derive(Default)]
struct EpochLog {
    losses: Vec<f32>,
    history: Vec<(f32, f64)>,
    evaluating: std::time::Duration,
}

impl EpochLog {
    fn end_epoch(&mut self, model: &MixedPrecisionModel<Net>, test: &LabelledImages) -> Result<()> {
        let start = Instant::now();
        let mean = self.losses.iter().sum::<f32>() / self.losses.len().max(1) as f32;
        self.losses.clear();
        self.history.push((mean, accuracy(model, test)?));
        self.evaluating += start.elapsed();
        Ok(())
    }
}

/// One training run. `replicas == 0` means plain candle on one device.
fn train(
    args: &Args,
    replicas: usize,
    init: &VarMap,
    train: &LabelledImages,
    test: &LabelledImages,
    checkpoints: Option<&Checkpoints>,
) -> Result<Outcome> {
    let varmap = copy_varmap(init)?;
    let factory = args.net(train);
    let dp = if replicas > 0 {
        Some(
            DataParallel::builder(&varmap, DType::F32, &cpu_devices(replicas))
                .mixed_precision(args.precision.policy())
                .build(factory.clone())?,
        )
    } else {
        None
    };
    let single = in_precision(args, &varmap, factory)?;
    let params = params_of(&varmap);
    let mut opt = adamw(&varmap, args.lr)?;
    let steps_per_epoch = train.len().div_ceil(args.batch());
    let mut recipe = args.recipe((args.epochs * steps_per_epoch) as u64)?;
    let from = match checkpoints {
        Some(c) => c.resume(&varmap, &mut opt, true)?,
        None => None,
    };
    if let Some(state) = &from {
        recipe.resume(state)?;
    }
    let from = from.map(|s| s.progress).unwrap_or_default();

    let bar = progress_bar((args.epochs * steps_per_epoch) as u64)?;
    bar.set_position(from.step);
    bar.set_prefix(if replicas > 0 {
        format!("DP x{replicas}")
    } else {
        "1 device".into()
    });

    let (mut samples, mut last_loss) = (0, f32::NAN);
    let mut log = EpochLog::default();
    let start = Instant::now();
    let mut step = from.step;
    for epoch in from.epoch as usize..args.epochs {
        let order = shuffled_indices(train.len(), args.seed.wrapping_add(1 + epoch as u64));
        // A resumed epoch continues with the batch it had not trained on.
        let skip = if epoch as u64 == from.epoch {
            from.batch as usize
        } else {
            0
        };
        for (index, batch) in order.chunks(args.batch()).enumerate().skip(skip) {
            let b = train.select(batch)?;
            recipe.before_step(&mut opt);
            let (loss, mut grads) = match &dp {
                Some(dp) if args.fast_backward() => {
                    // Each replica: forward, loss on its rows (scaled for
                    // f16), backward; gradients summed.
                    let (factor, dtype) = (recipe.loss_factor(), args.precision.dtype());
                    let step = dp.forward_backward(
                        (b.images, b.labels),
                        LossReduction::Mean,
                        move |m, (x, y)| {
                            let loss = loss_of(&m.forward(&x.to_dtype(dtype)?)?, &y)?;
                            loss.affine(f64::from(factor), 0.0)
                        },
                    )?;
                    let loss = step.loss.affine(1.0 / f64::from(factor), 0.0)?;
                    (loss, step.grads)
                }
                Some(dp) => {
                    let loss = loss_of(&dp.forward(&b.images)?, &b.labels)?;
                    let grads = recipe.scale(&loss)?.backward()?;
                    (loss, grads)
                }
                None => {
                    let loss = loss_of(&single.forward(&b.images)?, &b.labels)?;
                    let grads = recipe.scale(&loss)?.backward()?;
                    (loss, grads)
                }
            };
            recipe.finish(&mut grads, &params, &mut opt)?;
            samples += batch.len();
            last_loss = loss.to_scalar::<f32>()?;
            log.losses.push(last_loss);
            bar.inc(1);
            step += 1;
            if let Some(c) = checkpoints {
                let progress = Progress {
                    epoch: epoch as u64,
                    batch: index as u64 + 1,
                    step,
                };
                let at = recipe.state();
                c.after_step(&varmap, &opt, progress, steps_per_epoch as u64, None, at)?;
            }
        }
        bar.set_message(format!("epoch {} loss {last_loss:.4}", epoch + 1));
        log.end_epoch(&single, test)?;
    }
    let seconds = (start.elapsed() - log.evaluating).as_secs_f64();
    bar.finish();

    Ok(Outcome {
        seconds,
        samples,
        last_loss,
        accuracy: accuracy(&single, test)?,
        history: log.history,
        varmap,
        skipped: recipe.skipped,
    })
}

/// DistributedDataParallel over `args.replicas` thread ranks, or over the
/// processes of an MPI job: each rank reads its `DistributedSampler` shard
/// through a prefetching `Loader`. Only rank 0 shows progress and saves.
/// `None` on the processes other than rank 0's.
fn train_ddp(
    args: &Args,
    init: &VarMap,
    train: &LabelledImages,
    test: &LabelledImages,
    checkpoints: Option<&Checkpoints>,
) -> Result<Option<Outcome>> {
    let dataset = Arc::new(TensorDataset::new(vec![
        train.images.clone(),
        train.labels.clone(),
    ])?);
    let net = args.net(train);
    let mut options = GroupOptions::default();
    if let Some(Timeout(timeout)) = args.timeout {
        options.timeout = timeout;
    }
    let ranks = launch::run(args.replicas(), options, |ctx| {
        let (rank, world) = (ctx.rank, ctx.world_size);
        let per_rank = (args.batch() / world).max(1);
        let varmap = copy_varmap(init)?;
        let mut opt;
        let mut engine = if args.strategy == Strategy::Fsdp {
            let (model, h, w, hidden) = (args.model, train.height, train.width, args.hidden());
            let fsdp = FullyShardedDataParallel::from_units(
                ctx.process_group(),
                &varmap,
                DType::F32,
                &Device::Cpu,
                net_units(model, h, w, hidden),
                FsdpConfig {
                    mixed_precision: Some(args.precision.policy()),
                    ..Default::default()
                },
            )?;
            // Over the VarMap's variables: this rank's pieces now.
            opt = adamw(&varmap, args.lr)?;
            Engine::Fsdp(Box::new(fsdp))
        } else {
            let mut builder = DistributedDataParallel::builder(
                ctx.process_group(),
                &varmap,
                DType::F32,
                &Device::Cpu,
            )
            .mixed_precision(args.precision.policy());
            let zero = args.zero.and_then(ZeroStage::from_number);
            if let Some(stage) = zero {
                builder = builder.zero(stage);
            }
            let ddp = builder.build(net.clone())?;
            opt = adamw(&varmap, args.lr)?;
            // With ZeRO, each rank's AdamW holds the state of its pieces.
            let sharded = match zero {
                Some(_) => Some(Box::new(ZeroOptimizer::new(&ddp, |mine| {
                    AdamW::new_named(
                        mine,
                        AdamWConfig {
                            lr: args.lr,
                            ..Default::default()
                        },
                    )
                })?)),
                None => None,
            };
            Engine::Ddp(Box::new(ddp), sharded)
        };
        let mut sampler = DistributedSampler::new(train.len(), world, rank)?.seed(args.seed);
        // Every rank reads the state itself; all must resume from the same.
        // With ZeRO the state holds the weights, and each rank's shard of the
        // optimizer's state is in a folder of that rank's; with FSDP each
        // rank's folder holds its pieces of the weights too.
        let resumed = match (checkpoints, &mut engine) {
            (Some(c), Engine::Ddp(_, Some(sharded))) => {
                match c.resume_sharded(&varmap, rank == 0)? {
                    Some((state, shards)) => {
                        sharded.load_shards(&shards)?;
                        Some(state)
                    }
                    None => None,
                }
            }
            (Some(c), Engine::Fsdp(fsdp)) => match c.resume_fsdp(rank == 0)? {
                Some((state, saves)) => {
                    let (pieces, states): (Vec<_>, Vec<_>) = saves.into_iter().unzip();
                    fsdp.load_resharded(&pieces, &states, &mut opt)?;
                    Some(state)
                }
                None => None,
            },
            (Some(c), Engine::Ddp(_, None)) => c.resume(&varmap, &mut opt, rank == 0)?,
            (None, _) => None,
        };
        if checkpoints.is_some_and(|c| c.resume) {
            let step = resumed.as_ref().map(|s| s.progress.step);
            check_ranks_agree(ctx.pg.as_ref(), step)?;
        }
        let batches = sampler.len().div_ceil(per_rank) as u64;
        let mut recipe = args.recipe(batches * args.epochs as u64)?;
        let params = params_of(&varmap);
        let from = match &resumed {
            Some(state) => {
                recipe.resume(state)?;
                if let Some(saved) = state.sampler {
                    saved.apply_to(&mut sampler)?;
                }
                state.progress
            }
            None => Default::default(),
        };
        // Timed from here, as the other runs: MPI's start-up is not training.
        let start = Instant::now();
        let bar = if rank == 0 {
            let bar = progress_bar(batches * args.epochs as u64)?;
            bar.set_prefix(match &engine {
                Engine::Fsdp(_) => format!("FSDP x{world}"),
                Engine::Ddp(..) => format!("DDP x{world}"),
            });
            bar.set_position(from.step);
            bar
        } else {
            ProgressBar::hidden()
        };
        let mut step = from.step;
        let (mut samples, mut last_loss) = (0, f32::NAN);
        let mut log = EpochLog::default();
        // Evaluates the model as it is: over the trained variables, or with
        // FSDP over the whole parameters gathered from every rank.
        let evaluated = |engine: &Engine| -> Result<(VarMap, MixedPrecisionModel<Net>)> {
            let whole = match engine {
                Engine::Fsdp(fsdp) => varmap_of(fsdp.full_state()?)?,
                Engine::Ddp(..) => varmap.clone(),
            };
            let model = in_precision(args, &whole, net.clone())?;
            Ok((whole, model))
        };
        for epoch in from.epoch as usize..args.epochs {
            sampler.set_epoch(epoch as u64);
            // A resumed epoch continues with the batch it had not trained on.
            let skip = if epoch as u64 == from.epoch {
                from.batch
            } else {
                0
            };
            let loader = Loader::new(dataset.clone(), per_rank)?
                .indices(sampler.indices())
                .prefetch(2)
                .skip_batches(skip as usize);
            for (index, batch) in (skip..).zip(&loader) {
                let batch = batch?;
                let loss = match &mut engine {
                    Engine::Ddp(ddp, sharded) => {
                        match sharded {
                            Some(sharded) => recipe.before_step(sharded.inner_mut()),
                            None => recipe.before_step(&mut opt),
                        }
                        let loss = loss_of(&ddp.forward(&batch[0])?, &batch[1])?;
                        let mut grads = ddp.backward(&recipe.scale(&loss)?)?;
                        match sharded {
                            Some(sharded) => {
                                recipe.finish_zero(&mut grads, sharded, ctx.pg.as_ref())?
                            }
                            None => recipe.finish(&mut grads, &params, &mut opt)?,
                        };
                        loss
                    }
                    Engine::Fsdp(fsdp) => {
                        recipe.before_step(&mut opt);
                        let factor = f64::from(recipe.loss_factor());
                        let step = fsdp.forward_backward(&batch[0], &batch[1], |out, y| {
                            loss_of(out, y)?.affine(factor, 0.0)
                        })?;
                        let mut grads = step.grads;
                        recipe.finish_fsdp(&mut grads, fsdp, &mut opt)?;
                        step.loss.affine(1.0 / factor, 0.0)?
                    }
                };
                let rows = batch[0].dim(0)?;
                samples += rows;
                // `loss` is this rank's, over its rows: the table, the
                // chart and the bar show the global batch's, as one
                // device's run does (every rank takes part).
                last_loss = global_loss(ctx.pg.as_ref(), &loss, rows)?;
                log.losses.push(last_loss);
                bar.inc(1);
                step += 1;
                if let Some(c) = checkpoints {
                    let progress = Progress {
                        epoch: epoch as u64,
                        batch: index + 1,
                        step,
                    };
                    let position = Some(SamplerState::from(&sampler));
                    match (&engine, c.due(progress, batches)) {
                        // ZeRO: every rank saves its shard; the state that
                        // names the step is written once all shards are.
                        (Engine::Ddp(_, Some(sharded)), Some(due)) => c.save_zero(
                            ctx.pg.as_ref(),
                            &varmap,
                            sharded,
                            due,
                            position,
                            recipe.state(),
                        )?,
                        // FSDP: every rank saves its pieces and its
                        // optimizer's state over them, no gathering.
                        (Engine::Fsdp(fsdp), Some(due)) => c.save_sharded(
                            ctx.pg.as_ref(),
                            &VarMap::new(),
                            &varmap,
                            fsdp.shard_state(&opt)?,
                            due,
                            position,
                            recipe.state(),
                        )?,
                        (Engine::Ddp(_, Some(_)) | Engine::Fsdp(_), None) => {}
                        // One writer: the state is the same on every rank.
                        (Engine::Ddp(_, None), _) if rank == 0 => c.after_step(
                            &varmap,
                            &opt,
                            progress,
                            batches,
                            position,
                            recipe.state(),
                        )?,
                        (Engine::Ddp(_, None), _) => {}
                    }
                }
            }
            bar.set_message(format!("epoch {} loss {last_loss:.4}", epoch + 1));
            // Every rank takes part in FSDP's gathering; rank 0 evaluates.
            let gathering = Instant::now();
            let (_, model) = evaluated(&engine)?;
            log.evaluating += gathering.elapsed();
            if rank == 0 {
                log.end_epoch(&model, test)?;
            }
        }
        let seconds = (start.elapsed() - log.evaluating).as_secs_f64();
        bar.finish();
        let (varmap, model) = evaluated(&engine)?;
        if rank != 0 {
            return Ok(None);
        }
        if let Some(path) = &args.save {
            checkpoint::save(&varmap, path, Prefix::None)?;
        }
        // Every rank trains on as many samples (the sampler pads).
        Ok(Some(Outcome {
            seconds,
            samples: samples * world,
            last_loss,
            accuracy: accuracy(&model, test)?,
            history: log.history,
            varmap,
            skipped: recipe.skipped,
        }))
    })?;
    Ok(ranks.into_iter().flatten().next())
}

/// A rank's engine under `--strategy ddp` (ZeRO's optimizer with it) or
/// `fsdp`.
enum Engine {
    Ddp(
        Box<DistributedDataParallel<Net>>,
        Option<Box<ZeroOptimizer<AdamW>>>,
    ),
    Fsdp(Box<FullyShardedDataParallel>),
}

/// A `VarMap` of `tensors` (FSDP's gathered parameters).
fn varmap_of(tensors: std::collections::HashMap<String, Tensor>) -> Result<VarMap> {
    let varmap = VarMap::new();
    {
        let mut data = varmap.data().lock().map_err(|_| anyhow::anyhow!("lock"))?;
        for (name, tensor) in tensors {
            data.insert(name, candle_core::Var::from_tensor(&tensor)?);
        }
    }
    Ok(varmap)
}

/// candle-dp's AdamW (PyTorch's formulas; its state can be saved).
fn adamw(varmap: &VarMap, lr: f64) -> Result<AdamW> {
    Ok(AdamW::from_varmap(
        varmap,
        AdamWConfig {
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

fn main() -> ExitCode {
    // Errors as whole lines, prefixed with the rank under mpirun.
    candle_dp::launch::report::exit_code(run(Args::parse()))
}

fn run(args: Args) -> Result<()> {
    let mpi = Backend::from_env() != Backend::Threads;
    if mpi && !matches!(args.strategy, Strategy::Ddp | Strategy::Fsdp) {
        bail!("under mpirun, use --strategy ddp or fsdp (dp and single run in one process)");
    }
    if args.zero.is_some() && args.strategy != Strategy::Ddp {
        bail!("--zero shards DistributedDataParallel's optimizer: use it with --strategy ddp");
    }
    if args.precision == Precision::Bf16 && args.model == Model::Conv {
        bail!(
            "--precision bf16 with the conv net: candle 0.11's CPU convolution has no bf16 \
             kernel; use --model mlp, or --precision f16"
        );
    }
    // Under MPI every process runs this; only rank 0 speaks.
    let speaks = Backend::process_rank() == 0;
    let (train_set, test_set, name) = load_data(&args)?;
    if speaks {
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
            Precision::F32 => {}
            Precision::Bf16 => recipe += ", bf16 compute",
            Precision::F16 => recipe += ", f16 compute with loss scaling",
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

    // One initialisation, from the seed, shared by every run (and every
    // process), so they can be compared.
    let init = seeded_varmap(args.seed, DType::F32, &Device::Cpu, args.net(&train_set))?;

    // The states of the run that is saved: the parallel one, or the one
    // device run of `--strategy single`.
    let checkpoints = Checkpoints::new(
        args.checkpoint_dir.as_deref(),
        args.checkpoint_every,
        args.keep as usize,
        args.resume,
    )?;
    let parallel = match args.strategy {
        Strategy::Dp => Some((
            format!("DataParallel, {} CPU replicas", args.replicas),
            train(
                &args,
                args.replicas(),
                &init,
                &train_set,
                &test_set,
                checkpoints.as_ref(),
            )?,
        )),
        Strategy::Ddp | Strategy::Fsdp => {
            let ddp = match (args.strategy, args.zero) {
                (Strategy::Fsdp, _) => "FSDP".to_string(),
                (_, Some(stage)) => format!("DDP with ZeRO stage {stage}"),
                (_, None) => "DDP".to_string(),
            };
            let label = match Backend::from_env() {
                Backend::Threads => format!("{ddp}, {} thread ranks", args.replicas),
                Backend::Mpi { .. } => format!("{ddp}, {} MPI processes", Backend::world_size()),
            };
            match train_ddp(&args, &init, &train_set, &test_set, checkpoints.as_ref())? {
                Some(outcome) => Some((label, outcome)),
                None => return Ok(()), // not rank 0
            }
        }
        Strategy::Single => None,
    };
    let one = match (&parallel, args.no_reference) {
        (Some(_), true) => None,
        (Some(_), false) => Some(train(&args, 0, &init, &train_set, &test_set, None)?),
        (None, _) => Some(train(
            &args,
            0,
            &init,
            &train_set,
            &test_set,
            checkpoints.as_ref(),
        )?),
    };
    // Every run, the saved one first: the parallel run, or the one device.
    let mut runs: Vec<(String, &Outcome)> = Vec::new();
    if let Some((label, outcome)) = &parallel {
        runs.push((label.clone(), outcome));
    }
    if let Some(outcome) = &one {
        runs.push(("one device".to_string(), outcome));
    }
    // DDP's rank 0 saved its own.
    if let (Some(path), false, Some((_, saved))) = (
        &args.save,
        matches!(args.strategy, Strategy::Ddp | Strategy::Fsdp),
        runs.first(),
    ) {
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
