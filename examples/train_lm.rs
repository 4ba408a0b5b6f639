//! A GPT-style language model trained as people train them: AdamW, a
//! warm-up + cosine schedule, gradient clipping, bf16 or f16, on one device
//! or with any strategy of the crate, on the bytes of a public-domain book
//! (`data/text/`).
//!
//! ```text
//! cargo run --release --example train_lm -- --strategy ddp --replicas 2
//! cargo run --release --example train_lm -- --strategy pipeline --replicas 2 --precision bf16
//! ```
//!
//! Strategies: `single` (one device), `dp` (`DataParallel`, `--replicas` CPU
//! replicas), `ddp` (`--replicas` thread ranks, or the processes of
//! `mpirun`), `zero` (DDP with ZeRO stage 2), `pipeline` (the model's units
//! over `--replicas` CPU stages, `--chunks` micro-batches); with `ddp` and
//! `zero`, `--overlap` gives DDP the model as units and reduces each
//! gradient bucket during the backward. The model and
//! its units: `examples/common/gpt.rs`; the data and its order:
//! `examples/common/text.rs`; the step's recipe: `examples/common/recipe.rs`.
//! `scripts/train_lm_torch.py` trains the same model in PyTorch from
//! `--save-init`'s weights on the same batches.

#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

// Example code shared with the tests; each user needs only part of it.
#[allow(dead_code)]
#[path = "common/checkpoints.rs"]
mod checkpoints;
#[allow(dead_code)]
#[path = "common/flags.rs"]
mod flags;
#[path = "common/global_loss.rs"]
mod global_loss;
#[allow(dead_code)]
#[path = "common/gpt.rs"]
mod gpt;
#[allow(dead_code)]
#[path = "common/recipe.rs"]
mod recipe;
#[allow(dead_code)]
#[path = "common/text.rs"]
mod text;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Module, Tensor};
use candle_dp::checkpoint::{self, Prefix};
use candle_dp::comm::{all_gather_object, GroupOptions};
use candle_dp::fsdp::{FsdpConfig, FullyShardedDataParallel};
use candle_dp::launch::{self, Backend};
use candle_dp::optim::{AdamW, AdamWConfig, StatefulOptimizer};
use candle_dp::pipeline::Pipeline;
use candle_dp::precision::MixedPrecisionModel;
use candle_dp::training_state::{check_ranks_agree, Progress};
use candle_dp::units::Units;
use candle_dp::zero::{ZeroOptimizer, ZeroStage};
use candle_dp::{
    cpu_devices, seeded_varmap, DataParallel, DdpConfig, DistributedDataParallel, LossReduction,
};
use candle_nn::VarMap;
use checkpoints::Checkpoints;
use clap::{Parser, ValueEnum};
use global_loss::global_loss;
use gpt::{lm_loss, units, Gpt, GptConfig};
use recipe::{Precision, Recipe, Schedule};
use text::{load_text, split, windows_at, Windows};

#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
enum Strategy {
    /// One device.
    Single,
    /// DataParallel over `--replicas` CPU replicas.
    Dp,
    /// DistributedDataParallel: thread ranks, or the processes of mpirun.
    Ddp,
    /// DDP with ZeRO stage 2 (optimizer state and gradients sharded).
    Zero,
    /// The model's units as a pipeline over `--replicas` CPU stages.
    Pipeline,
    /// A pipeline of `--stages` CPU stages inside each of `--replicas` DDP
    /// ranks (thread ranks, or the processes of mpirun).
    DdpPipeline,
    /// Fully sharded: each rank holds its pieces of the parameters,
    /// gradients and AdamW state; each unit gathered when used (thread
    /// ranks, or the processes of mpirun).
    Fsdp,
}

/// A rank's model under DDP: whole, its units (`--overlap`), or a
/// pipeline of its units.
enum RankModel {
    Whole(Box<DistributedDataParallel<Gpt>>),
    Units(Box<DistributedDataParallel<Units>>),
    Piped(Box<DistributedDataParallel<Pipeline>>),
}

impl RankModel {
    fn params(&self) -> Vec<candle_core::Var> {
        let params = match self {
            RankModel::Whole(ddp) => ddp.params(),
            RankModel::Units(ddp) => ddp.params(),
            RankModel::Piped(ddp) => ddp.params(),
        };
        params.iter().map(|(_, v)| v.clone()).collect()
    }

    /// This rank's loss (unscaled) and the gradients averaged over the
    /// ranks (scaled by the recipe's loss scale).
    fn step(&mut self, x: &Tensor, y: &Tensor, recipe: &Recipe) -> Result<(Tensor, GradStore)> {
        Ok(match self {
            RankModel::Whole(ddp) => {
                let loss = lm_loss(&ddp.forward(x)?, y)?;
                let grads = ddp.backward(&recipe.scale(&loss)?)?;
                (loss, grads)
            }
            RankModel::Units(ddp) => {
                let factor = f64::from(recipe.loss_factor());
                let step =
                    ddp.forward_backward(x, y, |out, y| lm_loss(out, y)?.affine(factor, 0.0))?;
                (step.loss.affine(1.0 / factor, 0.0)?, step.grads)
            }
            RankModel::Piped(ddp) => {
                let factor = f64::from(recipe.loss_factor());
                let step = ddp.forward_backward(x, y, LossReduction::Mean, move |out, y| {
                    lm_loss(out, y)?.affine(factor, 0.0)
                })?;
                (step.loss.affine(1.0 / factor, 0.0)?, step.grads)
            }
        })
    }
}

/// Train a GPT-style language model on a public-domain book.
#[derive(Parser, Debug, Clone)]
#[command(version)]
struct Args {
    #[arg(long, value_enum, default_value_t = Strategy::Single)]
    strategy: Strategy,
    /// Replicas (dp), ranks (ddp, zero; under mpirun, `-np` decides) or
    /// pipeline stages. At least 1.
    #[arg(long, default_value_t = 2, value_parser = flags::at_least_one::<u64>)]
    replicas: u64,
    /// Pipeline stages in each rank (ddp-pipeline; at least 1).
    #[arg(long, default_value_t = 2, value_parser = flags::at_least_one::<u64>)]
    stages: u64,
    /// Micro-batches per step (pipeline, ddp-pipeline; at least 1).
    #[arg(long, default_value_t = 4, value_parser = flags::at_least_one::<u64>)]
    chunks: u64,
    /// Optimizer steps (at least 1).
    #[arg(long, default_value_t = 250, value_parser = flags::at_least_one::<u64>)]
    steps: u64,
    /// Global batch, in windows of `--context` bytes (at least 1).
    #[arg(long, default_value_t = 8, value_parser = flags::at_least_one::<u64>)]
    batch: u64,
    /// ddp, zero: give DDP the model as units (the embedding, each block,
    /// the head) and all-reduce each gradient bucket while the earlier
    /// units' backward runs.
    #[arg(long)]
    overlap: bool,
    /// Bytes the model sees at once (at least 1).
    #[arg(long, default_value_t = 128, value_parser = flags::at_least_one::<usize>)]
    context: usize,
    /// The model's width (at least 1; a multiple of `--heads`).
    #[arg(long, default_value_t = 128, value_parser = flags::at_least_one::<usize>)]
    width: usize,
    /// Transformer blocks (at least 1).
    #[arg(long, default_value_t = 4, value_parser = flags::at_least_one::<usize>)]
    layers: usize,
    /// Attention heads (at least 1).
    #[arg(long, default_value_t = 4, value_parser = flags::at_least_one::<usize>)]
    heads: usize,
    /// AdamW's peak learning rate (a finite number above 0).
    #[arg(long, default_value_t = 1e-3, value_parser = flags::positive_f64)]
    lr: f64,
    /// AdamW's weight decay (a finite number, 0 or more; 0: none).
    #[arg(long, default_value_t = 0.1, value_parser = flags::non_negative_f64)]
    weight_decay: f64,
    #[arg(long, value_enum, default_value_t = Schedule::WarmupCosine)]
    lr_schedule: Schedule,
    /// Warm-up steps of `--lr-schedule warmup-cosine` (fewer than
    /// `--steps`) [default: 5% of `--steps`, at least 1].
    #[arg(long, value_name = "N")]
    warmup_steps: Option<u64>,
    /// Clips the gradients' total 2-norm to X, a finite number, 0 or more
    /// (0 turns clipping off).
    #[arg(long, value_name = "X", default_value_t = 1.0, value_parser = flags::non_negative_f64)]
    clip_grad_norm: f64,
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    precision: Precision,
    /// Seeds the initial weights and the order of the windows.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Evaluates the held-out loss every N steps (and at the end); N at
    /// least 1.
    #[arg(long, value_name = "N", default_value_t = 50, value_parser = flags::at_least_one::<u64>)]
    eval_every: u64,
    /// Writes the initial weights here (safetensors, GPT-2's names).
    #[arg(long, value_name = "FILE")]
    save_init: Option<PathBuf>,
    /// Writes the trained weights here.
    #[arg(long, value_name = "FILE")]
    save: Option<PathBuf>,
    /// Writes every step's loss here (CSV: step,loss), for comparisons.
    #[arg(long, value_name = "FILE")]
    losses: Option<PathBuf>,
    /// The loss curves (SVG).
    #[arg(long, value_name = "FILE", default_value = "target/train_lm.svg")]
    chart: PathBuf,
    /// Bytes of text to generate at the end (sampled at temperature 0.8;
    /// 0: none).
    #[arg(long, default_value_t = 160)]
    sample: usize,
    /// After a parallel run, trains one device too and compares the curves.
    #[arg(long)]
    compare: bool,
    /// Saves the training state here, to continue with --resume.
    #[arg(long, value_name = "DIR")]
    checkpoint_dir: Option<PathBuf>,
    /// Saves a state every N steps, N at least 1 [default: at the end].
    #[arg(long, value_name = "N", requires = "checkpoint_dir", value_parser = flags::at_least_one::<u64>)]
    checkpoint_every: Option<u64>,
    /// Continues from the newest state in --checkpoint-dir.
    #[arg(long, requires = "checkpoint_dir")]
    resume: bool,
}

impl Args {
    fn config(&self) -> GptConfig {
        GptConfig {
            vocab: 256,
            context: self.context,
            width: self.width,
            layers: self.layers,
            heads: self.heads,
        }
    }

    fn recipe(&self) -> Result<Recipe> {
        let warmup = self.warmup_steps.unwrap_or((self.steps / 20).max(1));
        let clip = (self.clip_grad_norm > 0.0).then_some(self.clip_grad_norm);
        Recipe::new(
            self.precision,
            clip,
            self.lr_schedule,
            self.lr,
            warmup,
            self.steps,
        )
    }

    fn adamw(&self, varmap: &VarMap) -> Result<AdamW> {
        Ok(AdamW::from_varmap(varmap, self.adamw_config())?)
    }

    fn adamw_config(&self) -> AdamWConfig {
        AdamWConfig {
            lr: self.lr,
            weight_decay: self.weight_decay,
            ..Default::default()
        }
    }

    /// Ranks (ddp, zero) or replicas / stages (dp, pipeline) in one process.
    fn replicas(&self) -> usize {
        self.replicas as usize
    }
}

/// What a run reports.
struct Outcome {
    losses: Vec<f32>,
    /// (step, held-out loss).
    held_out: Vec<(u64, f32)>,
    training: Duration,
    tokens: u64,
    varmap: VarMap,
    skipped: u64,
    /// Bytes held after the last step (the most on any rank): the
    /// parameters, the gradients the step used, the optimizer's state.
    param_bytes: usize,
    grad_bytes: usize,
    state_bytes: usize,
}

/// The bytes of `tensors`.
fn bytes_of<'a>(tensors: impl IntoIterator<Item = &'a Tensor>) -> usize {
    tensors
        .into_iter()
        .map(|t| t.elem_count() * t.dtype().size_in_bytes())
        .sum()
}

/// The mean loss over the held-out windows, in the run's precision.
fn held_out_loss(model: &MixedPrecisionModel<Gpt>, held_out: &Windows) -> Result<f32> {
    let all: Vec<usize> = (0..held_out.len()).collect();
    let (mut sum, mut count) = (0f64, 0usize);
    for chunk in all.chunks(32) {
        let (x, y) = held_out.batch(chunk)?;
        let loss = lm_loss(&model.forward(&x)?, &y)?.to_scalar::<f32>()?;
        sum += f64::from(loss) * chunk.len() as f64;
        count += chunk.len();
    }
    Ok((sum / count.max(1) as f64) as f32)
}

/// A continuation of `prompt` by `bytes` bytes, each drawn from the
/// model's distribution at temperature 0.8 (greedy decoding of so small a
/// model repeats one word), with a generator seeded by `seed`.
fn generate(
    model: &MixedPrecisionModel<Gpt>,
    context: usize,
    prompt: &str,
    bytes: usize,
    seed: u64,
) -> Result<String> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut text: Vec<u8> = prompt.bytes().collect();
    for _ in 0..bytes {
        let start = text.len().saturating_sub(context);
        let ids: Vec<u32> = text[start..].iter().map(|&b| u32::from(b)).collect();
        let n = ids.len();
        let logits = model.forward(&Tensor::from_vec(ids, (1, n), &Device::Cpu)?)?;
        let last = logits
            .narrow(1, n - 1, 1)?
            .flatten_all()?
            .to_dtype(DType::F32)?;
        let p = candle_nn::ops::softmax(&(last / 0.8)?, 0)?.to_vec1::<f32>()?;
        let mut draw = rng.random::<f32>();
        let next = p
            .iter()
            .position(|&q| {
                draw -= q;
                draw <= 0.0
            })
            .unwrap_or(p.len() - 1);
        text.push(next as u8);
    }
    Ok(String::from_utf8_lossy(&text).into_owned())
}

/// Everything a run needs that does not change between strategies.
struct Job<'a> {
    args: &'a Args,
    train: &'a Windows,
    held_out: &'a Windows,
    init: &'a VarMap,
    checkpoints: Option<&'a Checkpoints>,
}

impl Job<'_> {
    fn copy_init(&self) -> Result<VarMap> {
        let to = VarMap::new();
        let from = self
            .init
            .data()
            .lock()
            .map_err(|_| anyhow::anyhow!("lock"))?;
        let mut data = to.data().lock().map_err(|_| anyhow::anyhow!("lock"))?;
        for (name, var) in from.iter() {
            data.insert(
                name.clone(),
                candle_core::Var::from_tensor(&var.as_tensor().copy()?)?,
            );
        }
        drop(data);
        Ok(to)
    }

    fn evaluate(
        &self,
        model: &MixedPrecisionModel<Gpt>,
        step: u64,
        log: &mut Vec<(u64, f32)>,
    ) -> Result<()> {
        let loss = held_out_loss(model, self.held_out)?;
        println!(
            "step {step:>5}  held-out loss {loss:.5}  perplexity {:.2}",
            f64::from(loss).exp()
        );
        log.push((step, loss));
        Ok(())
    }
}

/// The model computing in `args.precision` over `varmap`'s f32 variables
/// (evaluation, sampling, one device's training).
fn in_precision(args: &Args, varmap: &VarMap) -> Result<MixedPrecisionModel<Gpt>> {
    let config = args.config();
    Ok(MixedPrecisionModel::new(
        varmap,
        DType::F32,
        &Device::Cpu,
        args.precision.policy(),
        |vb| Gpt::new(config, vb),
    )?)
}

/// One device, DataParallel or the pipeline: one process, the whole batch.
fn train_in_process(job: &Job) -> Result<Outcome> {
    let args = job.args;
    let config = args.config();
    let varmap = job.copy_init()?;
    let eval = in_precision(args, &varmap)?;
    let devices = cpu_devices(args.replicas());
    let dp = match args.strategy {
        Strategy::Dp => Some(
            DataParallel::builder(&varmap, DType::F32, &devices)
                .mixed_precision(args.precision.policy())
                .build(move |vb| Gpt::new(config, vb))?,
        ),
        _ => None,
    };
    let pipe = match args.strategy {
        Strategy::Pipeline => Some(
            Pipeline::builder(&varmap, DType::F32, &devices)
                .chunks(args.chunks as usize)
                .mixed_precision(args.precision.policy())
                .build(units(config))?,
        ),
        _ => None,
    };
    let params = sorted(&varmap);
    let mut opt = args.adamw(&varmap)?;
    let mut recipe = args.recipe()?;
    let from = resume(job, &varmap, Some(&mut opt), &mut recipe)?;
    let mut outcome = Outcome::new(varmap.clone());
    let start = Instant::now();
    let mut evaluating = Duration::ZERO;
    for step in from..args.steps {
        let indices = windows_at(job.train, 1, 0, args.seed, args.batch as usize, step)?;
        let (x, y) = job.train.batch(&indices)?;
        let tokens = x.elem_count() as u64;
        recipe.before_step(&mut opt);
        let factor = recipe.loss_factor();
        let (loss, mut grads) = match (&dp, &pipe) {
            (Some(dp), _) => {
                let step = dp.forward_backward(
                    (x.clone(), y.clone()),
                    LossReduction::Mean,
                    move |m, (x, y)| lm_loss(&m.forward(&x)?, &y)?.affine(f64::from(factor), 0.0),
                )?;
                (step.loss.affine(1.0 / f64::from(factor), 0.0)?, step.grads)
            }
            (_, Some(pipe)) => {
                let step = pipe.forward_backward(&x, &y, LossReduction::Mean, move |out, y| {
                    lm_loss(out, y)?.affine(f64::from(factor), 0.0)
                })?;
                (step.loss.affine(1.0 / f64::from(factor), 0.0)?, step.grads)
            }
            _ => {
                let loss = lm_loss(&eval.forward(&x)?, &y)?;
                let grads = recipe.scale(&loss)?.backward()?;
                (loss, grads)
            }
        };
        recipe.finish(&mut grads, &params, &mut opt)?;
        outcome.grad_bytes = bytes_of(params.iter().filter_map(|p| grads.get(p.as_tensor())));
        outcome.record(loss.to_scalar::<f32>()?, tokens);
        let done = step + 1;
        let paused = Instant::now();
        if done % args.eval_every == 0 || done == args.steps {
            job.evaluate(&eval, done, &mut outcome.held_out)?;
        }
        if let Some(c) = job.checkpoints {
            let progress = Progress {
                epoch: 0,
                batch: done,
                step: done,
            };
            c.after_step(&varmap, &opt, progress, args.steps, None, recipe.state())?;
        }
        evaluating += paused.elapsed();
    }
    outcome.training = start.elapsed() - evaluating;
    outcome.skipped = recipe.skipped;
    outcome.param_bytes = bytes_of(params.iter().map(|p| p.as_tensor()));
    outcome.state_bytes = bytes_of(opt.state()?.tensors.values());
    Ok(outcome)
}

/// DDP (or ZeRO-2) over thread ranks or MPI processes; rank 0's outcome.
fn train_distributed(job: &Job) -> Result<Option<Outcome>> {
    let args = job.args;
    let config = args.config();
    let ranks = launch::run(args.replicas(), GroupOptions::default(), |ctx| {
        let (rank, world) = (ctx.rank, ctx.world_size);
        if !(args.batch as usize).is_multiple_of(world) {
            bail!("--batch {} does not divide among {world} ranks", args.batch);
        }
        let per_rank = args.batch as usize / world;
        let varmap = job.copy_init()?;
        let mut model = if args.strategy == Strategy::DdpPipeline {
            let pipe = Pipeline::builder(&varmap, DType::F32, &cpu_devices(args.stages as usize))
                .chunks(args.chunks as usize)
                .mixed_precision(args.precision.policy())
                .build(units(config))?;
            RankModel::Piped(Box::new(DistributedDataParallel::from_module(
                ctx.process_group(),
                &varmap,
                pipe,
                DdpConfig::default(),
            )?))
        } else {
            let ddp_config = DdpConfig {
                mixed_precision: Some(args.precision.policy()),
                zero: (args.strategy == Strategy::Zero).then_some(ZeroStage::Two),
                ..Default::default()
            };
            let (pg, cpu) = (ctx.process_group(), Device::Cpu);
            match args.overlap {
                true => RankModel::Units(Box::new(DistributedDataParallel::from_units(
                    pg,
                    &varmap,
                    DType::F32,
                    &cpu,
                    units(config),
                    ddp_config,
                )?)),
                false => RankModel::Whole(Box::new(DistributedDataParallel::new(
                    pg,
                    &varmap,
                    DType::F32,
                    &cpu,
                    |vb| Gpt::new(config, vb),
                    ddp_config,
                )?)),
            }
        };
        let eval = in_precision(args, &varmap)?;
        let params = model.params();
        let mut opt = args.adamw(&varmap)?;
        let mut zero = match &model {
            RankModel::Whole(ddp) if args.strategy == Strategy::Zero => {
                Some(ZeroOptimizer::new(ddp, |mine| {
                    AdamW::new_named(mine, args.adamw_config())
                })?)
            }
            RankModel::Units(ddp) if args.strategy == Strategy::Zero => {
                Some(ZeroOptimizer::new(ddp, |mine| {
                    AdamW::new_named(mine, args.adamw_config())
                })?)
            }
            _ => None,
        };
        let mut recipe = args.recipe()?;
        let from = match (&mut zero, job.checkpoints) {
            (Some(zero), Some(c)) => match c.resume_sharded(&varmap, rank == 0)? {
                Some((state, shards)) => {
                    zero.load_shards(&shards)?;
                    recipe.resume(&state)?;
                    state.progress.step
                }
                None => 0,
            },
            _ => resume(
                job,
                &varmap,
                zero.is_none().then_some(&mut opt),
                &mut recipe,
            )?,
        };
        if job.checkpoints.is_some_and(|c| c.resume) {
            check_ranks_agree(ctx.pg.as_ref(), Some(from))?;
        }
        let mut outcome = Outcome::new(varmap.clone());
        let start = Instant::now();
        let mut evaluating = Duration::ZERO;
        for step in from..args.steps {
            let indices = windows_at(job.train, world, rank, args.seed, per_rank, step)?;
            let (x, y) = job.train.batch(&indices)?;
            match &mut zero {
                Some(z) => recipe.before_step(z.inner_mut()),
                None => recipe.before_step(&mut opt),
            }
            let (loss, mut grads) = model.step(&x, &y, &recipe)?;
            match &mut zero {
                Some(z) => recipe.finish_zero(&mut grads, z, ctx.pg.as_ref())?,
                None => recipe.finish(&mut grads, &params, &mut opt)?,
            };
            outcome.grad_bytes = bytes_of(params.iter().filter_map(|p| grads.get(p.as_tensor())));
            outcome.record(
                global_loss(ctx.pg.as_ref(), &loss, x.dim(0)?)?,
                (x.elem_count() * world) as u64,
            );
            let done = step + 1;
            let paused = Instant::now();
            if rank == 0 && (done % args.eval_every == 0 || done == args.steps) {
                job.evaluate(&eval, done, &mut outcome.held_out)?;
            }
            if let Some(c) = job.checkpoints {
                let progress = Progress {
                    epoch: 0,
                    batch: done,
                    step: done,
                };
                match (&zero, c.due(progress, args.steps)) {
                    (Some(z), Some(due)) => {
                        c.save_zero(ctx.pg.as_ref(), &varmap, z, due, None, recipe.state())?
                    }
                    (None, _) if rank == 0 => {
                        c.after_step(&varmap, &opt, progress, args.steps, None, recipe.state())?
                    }
                    _ => {}
                }
            }
            evaluating += paused.elapsed();
        }
        outcome.training = start.elapsed() - evaluating;
        outcome.skipped = recipe.skipped;
        // What the rank holding the most holds, after the last step.
        let state = match &zero {
            Some(z) => z.state_bytes()?,
            None => bytes_of(opt.state()?.tensors.values()),
        };
        let mine = (
            bytes_of(params.iter().map(|p| p.as_tensor())),
            outcome.grad_bytes,
            state,
        );
        let all = all_gather_object(ctx.pg.as_ref(), &mine)?;
        outcome.param_bytes = all.iter().map(|b| b.0).max().unwrap_or(0);
        outcome.grad_bytes = all.iter().map(|b| b.1).max().unwrap_or(0);
        outcome.state_bytes = all.iter().map(|b| b.2).max().unwrap_or(0);
        Ok((rank == 0).then_some(outcome))
    })?;
    Ok(ranks.into_iter().flatten().next())
}

/// FSDP over thread ranks or MPI processes; rank 0's outcome.
fn train_fsdp(job: &Job) -> Result<Option<Outcome>> {
    let args = job.args;
    let config = args.config();
    let ranks = launch::run(args.replicas(), GroupOptions::default(), |ctx| {
        let (rank, world) = (ctx.rank, ctx.world_size);
        if !(args.batch as usize).is_multiple_of(world) {
            bail!("--batch {} does not divide among {world} ranks", args.batch);
        }
        let per_rank = args.batch as usize / world;
        let varmap = job.copy_init()?;
        let mut fsdp = FullyShardedDataParallel::from_units(
            ctx.process_group(),
            &varmap,
            DType::F32,
            &Device::Cpu,
            units(config),
            FsdpConfig {
                mixed_precision: Some(args.precision.policy()),
                ..Default::default()
            },
        )?;
        // Over the VarMap's variables: this rank's pieces now.
        let mut opt = args.adamw(&varmap)?;
        let mut recipe = args.recipe()?;
        let from = match job.checkpoints {
            Some(c) => match c.resume_fsdp(Backend::process_rank() == 0)? {
                Some((state, saves)) => {
                    let (pieces, states): (Vec<_>, Vec<_>) = saves.into_iter().unzip();
                    fsdp.load_resharded(&pieces, &states, &mut opt)?;
                    recipe.resume(&state)?;
                    state.progress.step
                }
                None => 0,
            },
            None => 0,
        };
        if job.checkpoints.is_some_and(|c| c.resume) {
            check_ranks_agree(ctx.pg.as_ref(), Some(from))?;
        }
        let mut outcome = Outcome::new(VarMap::new());
        let start = Instant::now();
        let mut evaluating = Duration::ZERO;
        for step in from..args.steps {
            let indices = windows_at(job.train, world, rank, args.seed, per_rank, step)?;
            let (x, y) = job.train.batch(&indices)?;
            recipe.before_step(&mut opt);
            let factor = f64::from(recipe.loss_factor());
            let s = fsdp.forward_backward(&x, &y, |out, y| lm_loss(out, y)?.affine(factor, 0.0))?;
            let mut grads = s.grads;
            recipe.finish_fsdp(&mut grads, &fsdp, &mut opt)?;
            outcome.grad_bytes = grad_bytes(&grads);
            let loss = s.loss.affine(1.0 / factor, 0.0)?;
            outcome.record(
                global_loss(ctx.pg.as_ref(), &loss, x.dim(0)?)?,
                (x.elem_count() * world) as u64,
            );
            let done = step + 1;
            let paused = Instant::now();
            if done % args.eval_every == 0 || done == args.steps {
                // Every rank takes part in the gathering; rank 0 evaluates.
                let whole = whole_model(args, &fsdp)?;
                if rank == 0 {
                    job.evaluate(&whole.1, done, &mut outcome.held_out)?;
                    outcome.varmap = whole.0;
                }
            }
            if let Some(c) = job.checkpoints {
                let progress = Progress {
                    epoch: 0,
                    batch: done,
                    step: done,
                };
                if let Some(due) = c.due(progress, args.steps) {
                    let shard = fsdp.shard_state(&opt)?;
                    c.save_sharded(
                        ctx.pg.as_ref(),
                        &VarMap::new(),
                        &varmap,
                        shard,
                        due,
                        None,
                        recipe.state(),
                    )?;
                }
            }
            evaluating += paused.elapsed();
        }
        outcome.training = start.elapsed() - evaluating;
        outcome.skipped = recipe.skipped;
        let memory = fsdp.last_memory();
        let mine = (
            memory.shard_bytes,
            outcome.grad_bytes,
            bytes_of(opt.state()?.tensors.values()),
            memory.peak_gathered_bytes,
        );
        let all = all_gather_object(ctx.pg.as_ref(), &mine)?;
        outcome.param_bytes = all.iter().map(|b| b.0).max().unwrap_or(0);
        outcome.grad_bytes = all.iter().map(|b| b.1).max().unwrap_or(0);
        outcome.state_bytes = all.iter().map(|b| b.2).max().unwrap_or(0);
        if rank == 0 {
            println!(
                "FSDP: each rank holds {:.2} MB of parameters; a step gathered at most {:.2} MB \
                 of whole parameters at once (the model: {:.2} MB)",
                memory.shard_bytes as f64 / 1e6,
                all.iter().map(|b| b.3).max().unwrap_or(0) as f64 / 1e6,
                memory.full_bytes as f64 / 1e6
            );
        }
        Ok((rank == 0).then_some(outcome))
    })?;
    Ok(ranks.into_iter().flatten().next())
}

/// The whole model gathered from every rank's pieces (every rank must
/// call it), as a `VarMap` and a model over it.
fn whole_model(
    args: &Args,
    fsdp: &FullyShardedDataParallel,
) -> Result<(VarMap, MixedPrecisionModel<Gpt>)> {
    let varmap = VarMap::new();
    {
        let mut data = varmap.data().lock().map_err(|_| anyhow::anyhow!("lock"))?;
        for (name, tensor) in fsdp.full_state()? {
            data.insert(name, candle_core::Var::from_tensor(&tensor)?);
        }
    }
    let model = in_precision(args, &varmap)?;
    Ok((varmap, model))
}

fn grad_bytes(grads: &GradStore) -> usize {
    grads
        .get_ids()
        .filter_map(|id| grads.get_id(*id))
        .map(|t| t.elem_count() * t.dtype().size_in_bytes())
        .sum()
}

/// Restores the newest state when resuming; the step to continue from.
fn resume<O: candle_dp::optim::StatefulOptimizer>(
    job: &Job,
    varmap: &VarMap,
    opt: Option<&mut O>,
    recipe: &mut Recipe,
) -> Result<u64> {
    let Some(c) = job.checkpoints else {
        return Ok(0);
    };
    // Thread ranks share process rank 0: the first to get here speaks.
    let speaks = Backend::process_rank() == 0;
    match c.resume_with(varmap, opt, speaks)? {
        Some(state) => {
            recipe.resume(&state)?;
            Ok(state.progress.step)
        }
        None => Ok(0),
    }
}

impl Outcome {
    fn new(varmap: VarMap) -> Self {
        Self {
            losses: Vec::new(),
            held_out: Vec::new(),
            training: Duration::ZERO,
            tokens: 0,
            varmap,
            skipped: 0,
            param_bytes: 0,
            grad_bytes: 0,
            state_bytes: 0,
        }
    }

    fn record(&mut self, loss: f32, tokens: u64) {
        self.losses.push(loss);
        self.tokens += tokens;
    }
}

fn sorted(varmap: &VarMap) -> Vec<candle_core::Var> {
    let data = varmap.data().lock().expect("lock");
    let mut named: Vec<_> = data.iter().map(|(n, v)| (n.clone(), v.clone())).collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named.into_iter().map(|(_, v)| v).collect()
}

/// The training loss per step (thin) and the held-out loss per evaluation
/// (thick) of every run, one colour a run.
fn chart(path: &std::path::Path, runs: &[(String, &Outcome)], first: u64) -> Result<()> {
    use plotters::prelude::*;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let root = SVGBackend::new(path, (720, 400)).into_drawing_area();
    root.fill(&WHITE)?;
    let steps = runs.iter().map(|(_, o)| o.losses.len()).max().unwrap_or(0) as u64;
    let last = first + steps;
    let top = runs
        .iter()
        .flat_map(|(_, o)| o.losses.iter().copied())
        .fold(0f32, f32::max)
        .max(1e-3) as f64
        * 1.05;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "loss per step (thin: the step's batch; thick: held out)",
            ("sans-serif", 16),
        )
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(50)
        .build_cartesian_2d(first..last.max(first + 1), 0f64..top)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("cross-entropy (nats per byte)")
        .draw()?;
    for ((label, outcome), color) in runs.iter().zip([BLUE, RED, GREEN].iter().cycle()) {
        let train = outcome
            .losses
            .iter()
            .enumerate()
            .map(|(i, &l)| (first + i as u64 + 1, f64::from(l)));
        chart
            .draw_series(LineSeries::new(train, color.stroke_width(1)))?
            .label(label.as_str())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color));
        let held = outcome.held_out.iter().map(|&(s, l)| (s, f64::from(l)));
        chart.draw_series(LineSeries::new(held, color.stroke_width(3)))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

fn main() -> ExitCode {
    candle_dp::launch::report::exit_code(run(Args::parse()))
}

fn run(args: Args) -> Result<()> {
    // The flags' own ranges (at least 1, finite numbers) were checked as
    // they were parsed (`examples/common/flags.rs`).
    let config = args.config();
    if !config.width.is_multiple_of(config.heads) {
        bail!(
            "--width {} does not divide into {} heads",
            config.width,
            config.heads
        );
    }
    if args.overlap && !matches!(args.strategy, Strategy::Ddp | Strategy::Zero) {
        bail!("--overlap is for --strategy ddp or zero (DDP over the model's units)");
    }
    let mpi = Backend::from_env() != Backend::Threads;
    if mpi
        && !matches!(
            args.strategy,
            Strategy::Ddp | Strategy::Zero | Strategy::DdpPipeline | Strategy::Fsdp
        )
    {
        bail!("under mpirun, use --strategy ddp, zero, ddp-pipeline or fsdp");
    }
    let speaks = Backend::process_rank() == 0;
    let text = load_text()?;
    let (train, held_out) = split(&text, args.context);
    let init = seeded_varmap(args.seed, DType::F32, &Device::Cpu, |vb| {
        Gpt::new(config, vb)
    })?;
    if speaks {
        println!(
            "data: Around the World in Eighty Days, {} bytes: {} training and {} held-out windows of {} bytes",
            text.len(),
            train.len(),
            held_out.len(),
            args.context
        );
        println!(
            "model: GPT, {} layers, width {}, {} heads, context {}: {:.2}M parameters; AdamW lr {} ({:?}), clip {}, {:?}, global batch {} windows, {} steps",
            config.layers,
            config.width,
            config.heads,
            config.context,
            config.parameters() as f64 / 1e6,
            args.lr,
            args.lr_schedule,
            args.clip_grad_norm,
            args.precision,
            args.batch,
            args.steps,
        );
        if let Some(path) = &args.save_init {
            checkpoint::save(&init, path, Prefix::None)?;
            println!("initial weights saved to {}", path.display());
        }
    }
    let checkpoints = Checkpoints::new(
        args.checkpoint_dir.as_deref(),
        args.checkpoint_every,
        3,
        args.resume,
    )?;
    let job = Job {
        args: &args,
        train: &train,
        held_out: &held_out,
        init: &init,
        checkpoints: checkpoints.as_ref(),
    };
    let outcome = match args.strategy {
        Strategy::Ddp | Strategy::Zero | Strategy::DdpPipeline => match train_distributed(&job)? {
            Some(outcome) => outcome,
            None => return Ok(()), // not rank 0
        },
        Strategy::Fsdp => match train_fsdp(&job)? {
            Some(outcome) => outcome,
            None => return Ok(()), // not rank 0
        },
        _ => train_in_process(&job)?,
    };
    let label = match args.strategy {
        Strategy::Single => "one device".to_string(),
        Strategy::Dp => format!("DataParallel x{}", args.replicas),
        Strategy::Ddp | Strategy::Zero => {
            let what = match (args.strategy == Strategy::Zero, args.overlap) {
                (true, false) => "ZeRO-2",
                (true, true) => "ZeRO-2 (overlapped)",
                (false, false) => "DDP",
                (false, true) => "DDP (overlapped)",
            };
            match Backend::from_env() {
                Backend::Threads => format!("{what} x{} (thread ranks)", args.replicas),
                Backend::Mpi { .. } => format!("{what} x{} (MPI processes)", Backend::world_size()),
            }
        }
        Strategy::Fsdp => match Backend::from_env() {
            Backend::Threads => format!("FSDP x{} (thread ranks)", args.replicas),
            Backend::Mpi { .. } => format!("FSDP x{} (MPI processes)", Backend::world_size()),
        },
        Strategy::DdpPipeline => {
            let ranks = match Backend::from_env() {
                Backend::Threads => format!("{} thread ranks", args.replicas),
                Backend::Mpi { .. } => format!("{} MPI processes", Backend::world_size()),
            };
            format!(
                "DDP over {ranks}, each a pipeline of {} stages",
                args.stages
            )
        }
        Strategy::Pipeline => format!(
            "pipeline x{} stages, {} micro-batches",
            args.replicas, args.chunks
        ),
    };
    let reference = match (args.compare, args.strategy) {
        (true, Strategy::Single) | (false, _) => None,
        (true, _) => {
            let single = Args {
                strategy: Strategy::Single,
                checkpoint_dir: None,
                resume: false,
                ..args.clone()
            };
            let job = Job {
                args: &single,
                checkpoints: None,
                ..job
            };
            Some(train_in_process(&job)?)
        }
    };
    let mut runs = vec![(label, &outcome)];
    if let Some(one) = &reference {
        runs.push(("one device".to_string(), one));
    }
    println!();
    println!("| run | training loss (last 10 steps) | held-out loss | perplexity | tokens/s |");
    println!("|---|---|---|---|---|");
    for (label, o) in &runs {
        let tail = &o.losses[o.losses.len().saturating_sub(10)..];
        let recent = tail.iter().sum::<f32>() / tail.len().max(1) as f32;
        let held = o.held_out.last().map_or(f32::NAN, |&(_, l)| l);
        println!(
            "| {label} | {recent:.4} | {held:.4} | {:.2} | {:.0} |",
            f64::from(held).exp(),
            o.tokens as f64 / o.training.as_secs_f64().max(1e-9)
        );
        if o.skipped > 0 {
            println!("{label}: the f16 loss scaler skipped {} steps", o.skipped);
        }
    }
    for (label, o) in &runs {
        println!(
            "{label}: held after a step (the most on a rank): parameters {:.2} MB, gradients {:.2} MB, optimizer state {:.2} MB",
            o.param_bytes as f64 / 1e6,
            o.grad_bytes as f64 / 1e6,
            o.state_bytes as f64 / 1e6
        );
    }
    if let Some(one) = &reference {
        let gap = outcome
            .losses
            .iter()
            .zip(&one.losses)
            .map(|(a, b)| ((a - b) / b).abs())
            .fold(0f32, f32::max);
        println!("largest relative difference of a step's loss from one device's: {gap:.2e}");
    }
    if let Some(path) = &args.losses {
        let first = args.steps - outcome.losses.len() as u64;
        let rows: String = outcome
            .losses
            .iter()
            .enumerate()
            .map(|(i, l)| format!("{},{l}\n", first + i as u64 + 1))
            .collect();
        std::fs::write(path, format!("step,loss\n{rows}"))?;
    }
    if let Some(path) = &args.save {
        checkpoint::save(&outcome.varmap, path, Prefix::None)?;
        println!("weights saved to {}", path.display());
    }
    let first = args.steps - outcome.losses.len() as u64;
    chart(&args.chart, &runs, first)?;
    println!("loss curves: {}", args.chart.display());
    if args.sample > 0 {
        let model = in_precision(&args, &outcome.varmap)?;
        println!(
            "\nsample: {}",
            generate(&model, args.context, "Phileas Fogg", args.sample, args.seed)?
        );
    }
    Ok(())
}
