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
//! Every strategy trains through one loop on a [`Fabric`]
//! (`candle_dp::fabric`): `single` (one device), `dp` (`DataParallel`,
//! `--replicas` CPU replicas), `ddp` (`--replicas` thread ranks, or the
//! processes of `mpirun`), `zero` (DDP with ZeRO stage 2), `pipeline` (the
//! model's units over `--replicas` CPU stages, `--chunks` micro-batches),
//! `ddp-pipeline` (a pipeline of `--stages` inside each rank) and `fsdp`;
//! with `ddp` and `zero`, `--overlap` reduces each gradient bucket during
//! the backward. The model and its units: `examples/common/gpt.rs`; the
//! data and its order: `examples/common/text.rs`.
//! `scripts/train_lm_torch.py` trains the same model in PyTorch from
//! `--save-init`'s weights on the same batches.

#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use candle_dp::checkpoint::{self, Prefix};
use candle_dp::fabric::{self, Degrees, Fabric, FabricConfig, FabricModule};
use candle_dp::launch::Backend;
use candle_dp::optim::{AdamWConfig, LrScheduler};
use candle_dp::precision::{MixedPrecision, MixedPrecisionModel};
use candle_dp::seeded_varmap;
use candle_dp::training_state::Progress;
use candle_dp_examples::elastic::ElasticArgs;
use candle_dp_examples::flags;
use candle_dp_examples::gpt::{adamw_groups, lm_loss, lm_loss_composite, units, Gpt, GptConfig};
use candle_dp_examples::text::{load_text, split, windows_at, Windows};
use candle_nn::VarMap;
use clap::{Parser, ValueEnum};

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
    /// Hybrid sharding: FSDP within groups of `--shard-size` ranks (a
    /// machine's), the groups replicas of each other; only a piece of each
    /// gradient crosses between the groups.
    Hsdp,
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
    /// hsdp and zero: ranks per shard group, each holding one copy of the
    /// pieces; it must divide the ranks [default: hsdp the ranks per
    /// machine under mpirun, every rank on threads; zero every rank].
    #[arg(long, value_parser = flags::at_least_one::<usize>)]
    shard_size: Option<usize>,
    /// The ranks as a mesh of degrees, `dp=2,pp=2` (`dp` is
    /// `dp_replicate`, `shard` `dp_shard`; see `candle_dp::fabric::Degrees`):
    /// with `--strategy pipeline`, `pp` stages on ranks (threads, or
    /// mpirun's processes) replicated `dp` times; with `hsdp` and `zero`,
    /// `dp` replicas of `shard` ranks (zero without `shard`: `dp` ranks);
    /// with `ddp` and `fsdp`, `dp` ranks. Under mpirun the mesh must hold
    /// every process. Replaces `--replicas` (and `--shard-size`).
    #[arg(long, conflicts_with_all = ["replicas", "shard_size"])]
    mesh: Option<Degrees>,
    /// With `--strategy pipeline` on ranks: ZeRO across each stage's
    /// replicas, 1 (optimizer state), 2 (and gradients) or 3 (and the
    /// variables between steps: FSDP), each replica holding its piece of
    /// the stage.
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=3))]
    pipeline_zero: Option<u8>,
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
    /// Where to train: cpu, or cuda (a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    accelerator: fabric::Accelerator,
    /// With cuda: the GPU of each rank, replica or stage, in order (`0`:
    /// GPU 0; `0,1`; `0,0` puts two on one GPU) [default: 0, 1, ... one
    /// each].
    #[arg(long, value_parser = flags::gpu_ordinals)]
    gpus: Option<fabric::Devices>,
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
    /// AdamW's weight decay (a finite number, 0 or more; 0: none), on the
    /// weight matrices only (embeddings and linear weights; not biases or
    /// LayerNorm weights), as GPT-2 is trained: two parameter groups.
    #[arg(long, default_value_t = 0.1, value_parser = flags::non_negative_f64)]
    weight_decay: f64,
    /// Decay every parameter, biases and LayerNorm weights too (one
    /// parameter group: this example's behaviour before groups).
    #[arg(long)]
    decay_all: bool,
    /// candle's composite ops instead of the crate's fused ones
    /// (`candle_dp::ops`: linear layers, LayerNorm, the causal softmax,
    /// GELU, the cross-entropy), for comparison.
    #[arg(long)]
    no_fused_ops: bool,
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
    /// The dtype of the forward and backward, the Fabric's precision:
    /// f32, bf16 (bf16 compute, f32 reduction) or f16 (and dynamic loss
    /// scaling); also 32-true, bf16-mixed, 16-mixed. The master weights
    /// and the optimizer state stay in f32.
    #[arg(long, default_value = "f32")]
    precision: fabric::Precision,
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
    /// Seconds a rank waits in a collective for the others before the job
    /// fails (a finite number above 0) [default: 1800, or
    /// CANDLE_DP_TIMEOUT]. A job that should outlive a lost machine needs
    /// a short one: the timeout is how its ranks learn of the loss.
    #[arg(long, value_name = "SECONDS", value_parser = flags::positive_f64)]
    timeout: Option<f64>,
    #[command(flatten)]
    elastic: ElasticArgs,
}

impl Args {
    fn config(&self) -> GptConfig {
        GptConfig {
            vocab: 256,
            context: self.context,
            width: self.width,
            layers: self.layers,
            heads: self.heads,
            fused_ops: !self.no_fused_ops,
        }
    }

    /// The training loss: fused unless `--no-fused-ops`.
    fn loss(&self) -> fn(&Tensor, &Tensor) -> candle_core::Result<Tensor> {
        match self.no_fused_ops {
            true => lm_loss_composite,
            false => lm_loss,
        }
    }

    fn adamw_config(&self) -> AdamWConfig {
        AdamWConfig {
            lr: self.lr,
            weight_decay: self.weight_decay,
            ..Default::default()
        }
    }

    /// The Fabric's configuration of `strategy`: the one flag that picks
    /// the strategy, with the settings every run shares.
    fn fabric(&self, strategy: Strategy) -> FabricConfig {
        let mesh = self.mesh.filter(|_| strategy != Strategy::Single);
        // Under mpirun the launcher's processes are the ranks.
        let replicas = match (mesh, Backend::from_env()) {
            (Some(m), _) => m.world_size(),
            (None, Backend::Threads) => self.replicas as usize,
            (None, Backend::Mpi { .. }) => Backend::world_size(),
        };
        let (fabric_strategy, devices) = match strategy {
            Strategy::Single => (fabric::Strategy::Single, 1),
            Strategy::Dp => (fabric::Strategy::Dp, replicas),
            Strategy::Ddp => (fabric::Strategy::Ddp, replicas),
            Strategy::Zero => (fabric::Strategy::Zero2, replicas),
            Strategy::Pipeline if self.stages_on_ranks() => {
                (fabric::Strategy::PipelineRanks, replicas)
            }
            Strategy::Pipeline => (fabric::Strategy::Pipeline, replicas),
            Strategy::DdpPipeline => (
                fabric::Strategy::PipelineDdp,
                replicas * self.stages as usize,
            ),
            Strategy::Fsdp => (fabric::Strategy::Fsdp, replicas),
            Strategy::Hsdp => (fabric::Strategy::Hsdp, replicas),
        };
        // A pipeline on ranks: `pp` ranks per pipeline (under mpirun
        // without a mesh, every process a stage).
        let stages = match (fabric_strategy, mesh) {
            (fabric::Strategy::PipelineRanks, Some(m)) => m.pp,
            (fabric::Strategy::PipelineRanks, None) => Backend::world_size(),
            _ => self.stages as usize,
        };
        FabricConfig {
            stages,
            chunks: Some(self.chunks as usize),
            precision: self.precision,
            overlap: self.overlap && matches!(strategy, Strategy::Ddp | Strategy::Zero),
            // Shard groups: HSDP's, and ZeRO's on a mesh.
            shard_size: match strategy {
                Strategy::Hsdp => mesh.map_or(self.shard_size, |m| Some(m.dp_shard)),
                Strategy::Zero => {
                    mesh.map_or(self.shard_size, |m| (m.dp_shard > 1).then_some(m.dp_shard))
                }
                _ => None,
            },
            zero: self
                .pipeline_zero
                .filter(|_| fabric_strategy == fabric::Strategy::PipelineRanks),
            gradient_clip: (self.clip_grad_norm > 0.0).then_some(self.clip_grad_norm),
            checkpoint_dir: self.checkpoint_dir.clone(),
            timeout_secs: self.timeout,
            seed: self.seed,
            accelerator: self.accelerator,
            // The first GPUs listed, as many as the strategy takes (one
            // for the one-device run beside a parallel one).
            devices: match (&self.gpus, self.accelerator) {
                (Some(gpus), fabric::Accelerator::Cuda) => {
                    fabric::Devices::Ids(gpus.ordinals().into_iter().take(devices).collect())
                }
                _ => fabric::Devices::Count(devices),
            },
            ..FabricConfig::new(fabric_strategy, devices)
        }
    }

    /// Whether `--strategy pipeline` puts its stages on ranks (a mesh, or
    /// the processes of mpirun) rather than on CPU devices of one process.
    fn stages_on_ranks(&self) -> bool {
        self.mesh.is_some() || Backend::from_env() != Backend::Threads
    }

    /// The mixed-precision policy of the evaluation model.
    fn policy(&self) -> MixedPrecision {
        (self.precision.policy()).unwrap_or_else(|| MixedPrecision::new(DType::F32))
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
    /// Bytes held after the last step (the most on any rank).
    memory: fabric::Memory,
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
    /// Whether this run saves and resumes its states.
    saves: bool,
}

impl Job<'_> {
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
/// (evaluation, sampling).
fn in_precision(args: &Args, varmap: &VarMap) -> Result<MixedPrecisionModel<Gpt>> {
    let config = args.config();
    Ok(MixedPrecisionModel::new(
        varmap,
        DType::F32,
        &Device::Cpu,
        args.policy(),
        |vb| Gpt::new(config, vb),
    )?)
}

/// One run of `strategy`: the same loop for every strategy; rank 0's
/// outcome. `in_process`: thread ranks even under mpirun (the one-device
/// comparison).
fn train_run(job: &Job, strategy: Strategy, in_process: bool) -> Result<Option<Outcome>> {
    let args = job.args;
    let mut config = args.fabric(strategy);
    config.max_restarts = args.elastic.max_restarts;
    if !job.saves {
        config.checkpoint_dir = None;
        config.max_restarts = 0;
    }
    let rank_loop =
        |fabric: Fabric| -> Result<Option<Outcome>> {
            // The data's shares: one per rank, or per pipeline of ranks.
            let rank = fabric.rank();
            let (share, shares) = (fabric.data_parallel_rank(), fabric.data_parallel_size());
            if !(args.batch as usize).is_multiple_of(shares) {
                bail!(
                    "--batch {} does not divide among {shares} replicas",
                    args.batch
                );
            }
            let per_rank = args.batch as usize / shares;
            let module = FabricModule::units(units(args.config()));
            let mut model = fabric.setup(module, |p| {
                adamw_groups(p, args.adamw_config(), args.decay_all)
            })?;
            if args.lr_schedule == Schedule::WarmupCosine {
                let warmup = args.warmup_steps.unwrap_or((args.steps / 20).max(1));
                model.set_schedule(LrScheduler::warmup_cosine(args.lr, warmup, args.steps)?)?;
            }
            // A restarted job (elastic) resumes whatever --resume says.
            let from = model
                .resume(job.saves && (args.resume || fabric.restart() > 0))?
                .step;
            let mut outcome = Outcome::new();
            let start = Instant::now();
            let mut evaluating = Duration::ZERO;
            for step in from..args.steps {
                let indices = windows_at(job.train, shares, share, args.seed, per_rank, step)?;
                let (x, y) = job.train.batch(&indices)?;
                let (x, y) = (fabric.to_device(&x)?, fabric.to_device(&y)?);
                let loss = model.backward(&x, &y, args.loss())?;
                model.step()?;
                outcome.record(
                    fabric.global_mean(&loss, x.dim(0)?)?,
                    (x.elem_count() * shares) as u64,
                );
                let done = step + 1;
                let paused = Instant::now();
                if done % args.eval_every == 0 || done == args.steps {
                    // Every rank takes part in FSDP's gathering; rank 0 evaluates.
                    let whole = model.full_varmap()?;
                    if rank == 0 {
                        job.evaluate(&in_precision(args, &whole)?, done, &mut outcome.held_out)?;
                        outcome.varmap = whole;
                    }
                }
                let progress = Progress {
                    epoch: 0,
                    batch: done,
                    step: done,
                };
                if let Some(progress) = progress.due(args.steps, args.checkpoint_every) {
                    if job.saves {
                        model.save(progress)?;
                    }
                }
                evaluating += paused.elapsed();
            }
            outcome.training = start.elapsed() - evaluating;
            outcome.skipped = model.skipped_steps();
            if from == args.steps {
                outcome.varmap = model.full_varmap()?;
            }
            // What the rank holding the most holds, after the last step.
            let all = fabric.all_gather_object(&model.memory()?)?;
            let most = |f: fn(&fabric::Memory) -> usize| all.iter().map(f).max().unwrap_or(0);
            outcome.memory = fabric::Memory {
                parameters: most(|m| m.parameters),
                gradients: most(|m| m.gradients),
                optimizer_state: most(|m| m.optimizer_state),
                peak_gathered: all.iter().filter_map(|m| m.peak_gathered).max(),
                whole_model: all[0].whole_model,
            };
            if let (0, Some(peak)) = (rank, outcome.memory.peak_gathered) {
                println!(
                "FSDP: each rank holds {:.2} MB of parameters; a step gathered at most {:.2} MB \
                 of whole parameters at once{}",
                outcome.memory.parameters as f64 / 1e6,
                peak as f64 / 1e6,
                outcome
                    .memory
                    .whole_model
                    .map_or_else(String::new, |w| format!(" (the model: {:.2} MB)", w as f64 / 1e6))
            );
            }
            Ok((rank == 0).then_some(outcome))
        };
    let ranks = match in_process {
        true => Fabric::spawn(config, rank_loop)?,
        false => Fabric::launch(config, rank_loop)?,
    };
    Ok(ranks.into_iter().flatten().next())
}

impl Outcome {
    fn new() -> Self {
        Self {
            losses: Vec::new(),
            held_out: Vec::new(),
            training: Duration::ZERO,
            tokens: 0,
            varmap: VarMap::new(),
            skipped: 0,
            memory: fabric::Memory::default(),
        }
    }

    fn record(&mut self, loss: f32, tokens: u64) {
        self.losses.push(loss);
        self.tokens += tokens;
    }
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

/// How the run of `--strategy` is named in the results.
fn label(args: &Args) -> String {
    let config = args.fabric(args.strategy);
    let ranks = config.devices.len();
    let on = match Backend::from_env() {
        Backend::Threads => "thread ranks",
        Backend::Mpi { .. } => "MPI processes",
    };
    match args.strategy {
        Strategy::Single => "one device".to_string(),
        Strategy::Dp => format!("DataParallel x{ranks}"),
        Strategy::Ddp | Strategy::Zero => {
            let what = match (args.strategy == Strategy::Zero, args.overlap) {
                (true, false) => "ZeRO-2",
                (true, true) => "ZeRO-2 (overlapped)",
                (false, false) => "DDP",
                (false, true) => "DDP (overlapped)",
            };
            match config.shard_size {
                Some(shard) => format!("{what} x{ranks} ({on}, shard groups of {shard})"),
                None => format!("{what} x{ranks} ({on})"),
            }
        }
        Strategy::Fsdp => format!("FSDP x{ranks} ({on})"),
        Strategy::Hsdp => {
            let shard = config.shard_size.unwrap_or(match Backend::from_env() {
                Backend::Threads => ranks,
                Backend::Mpi { .. } => Backend::local_processes(),
            });
            format!("HSDP x{ranks} ({on}, shard groups of {shard})")
        }
        Strategy::DdpPipeline => format!(
            "DDP over {} {on}, each a pipeline of {} stages",
            config.ranks(),
            args.stages
        ),
        Strategy::Pipeline if args.stages_on_ranks() => format!(
            "{} pipeline(s) of {} stages on {on}, {} micro-batches{}",
            ranks / config.stages.max(1),
            config.stages,
            args.chunks,
            match config.zero {
                Some(3) => ", FSDP across the pipelines".to_string(),
                Some(stage) => format!(", ZeRO-{stage} across the pipelines"),
                None => String::new(),
            }
        ),
        Strategy::Pipeline => format!("pipeline x{ranks} stages, {} micro-batches", args.chunks),
    }
}

/// Whether `--mesh` fits `--strategy` (and, under mpirun, the processes).
fn check_mesh(args: &Args, mesh: Degrees) -> Result<()> {
    mesh.check()?;
    let fits = match args.strategy {
        Strategy::Pipeline => mesh.dp_shard == 1,
        Strategy::Hsdp | Strategy::Zero => mesh.pp == 1,
        Strategy::Ddp | Strategy::Fsdp => mesh.pp == 1 && mesh.dp_shard == 1,
        Strategy::Single | Strategy::Dp | Strategy::DdpPipeline => false,
    };
    if !fits {
        bail!(
            "--mesh {mesh} does not fit --strategy {:?}: pipeline takes dp and pp, hsdp and zero \
             dp and shard, ddp and fsdp dp only",
            args.strategy
        );
    }
    if Backend::from_env() != Backend::Threads && mesh.world_size() != Backend::world_size() {
        bail!(
            "--mesh {mesh} lays out {} ranks, but mpirun started {} processes",
            mesh.world_size(),
            Backend::world_size()
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    candle_dp::launch::report::exit_code(run(Args::parse()))
}

fn run(args: Args) -> Result<()> {
    // The flags' own ranges (at least 1, finite numbers) were checked as
    // they were parsed (`candle_dp_examples::flags`); what a supervisor
    // could not mend by restarting is refused before it starts anything.
    let config = args.config();
    if !config.width.is_multiple_of(config.heads) {
        bail!(
            "--width {} does not divide into {} heads",
            config.width,
            config.heads
        );
    }
    if args.elastic.max_restarts > 0 && args.checkpoint_dir.is_none() {
        bail!("--max-restarts needs --checkpoint-dir: each start resumes from its newest state");
    }
    if args.elastic.hosts.is_some() && !cfg!(feature = "mpi") {
        bail!("--hosts starts this program under mpirun or srun: build it with --features mpi");
    }
    // Each rank takes an equal share of the batch: a restart on fewer
    // slots starts on the most ranks that share it. Shard groups (hsdp,
    // zero with --shard-size), a mesh and a pipeline on ranks fix numbers
    // of their own, which the batch alone does not keep.
    let own_numbers = args.mesh.is_some()
        || args.shard_size.is_some()
        || matches!(args.strategy, Strategy::Pipeline | Strategy::Hsdp);
    let dividing = (!own_numbers).then_some(args.batch as usize);
    if let Some(supervised) = args.elastic.supervise(dividing) {
        return supervised;
    }
    if args.overlap && !matches!(args.strategy, Strategy::Ddp | Strategy::Zero) {
        bail!("--overlap is for --strategy ddp or zero (DDP over the model's units)");
    }
    let mpi = Backend::from_env() != Backend::Threads;
    if mpi
        && !matches!(
            args.strategy,
            Strategy::Ddp
                | Strategy::Zero
                | Strategy::DdpPipeline
                | Strategy::Fsdp
                | Strategy::Hsdp
                | Strategy::Pipeline
        )
    {
        bail!("under mpirun, use --strategy ddp, zero, ddp-pipeline, fsdp, hsdp or pipeline");
    }
    if let Some(mesh) = args.mesh {
        check_mesh(&args, mesh)?;
    }
    if args.pipeline_zero.is_some()
        && (args.strategy != Strategy::Pipeline || !args.stages_on_ranks())
    {
        bail!(
            "--pipeline-zero splits a pipeline's stages across its replicas: use it with \
             --strategy pipeline on ranks (--mesh dp=D,pp=P, or under mpirun)"
        );
    }
    if args.shard_size.is_some() && !matches!(args.strategy, Strategy::Hsdp | Strategy::Zero) {
        bail!("--shard-size splits the ranks into shard groups for --strategy hsdp and zero only");
    }
    let speaks = Backend::process_rank() == 0;
    let text = load_text()?;
    let (train, held_out) = split(&text, args.context);
    if speaks {
        println!(
            "data: Around the World in Eighty Days, {} bytes: {} training and {} held-out windows of {} bytes",
            text.len(),
            train.len(),
            held_out.len(),
            args.context
        );
        println!(
            "model: GPT, {} layers, width {}, {} heads, context {}: {:.2}M parameters; AdamW lr {} ({:?}), decay {} on {}, clip {}, {:?}, global batch {} windows, {} steps",
            config.layers,
            config.width,
            config.heads,
            config.context,
            config.parameters() as f64 / 1e6,
            args.lr,
            args.lr_schedule,
            args.weight_decay,
            if args.decay_all { "all" } else { "matrices" },
            args.clip_grad_norm,
            args.precision,
            args.batch,
            args.steps,
        );
        if let Some(path) = &args.save_init {
            // The Fabric draws the same values from the seed.
            let init = seeded_varmap(args.seed, DType::F32, &Device::Cpu, |vb| {
                Gpt::new(config, vb)
            })?;
            checkpoint::save(&init, path, Prefix::None)?;
            println!("initial weights saved to {}", path.display());
        }
    }
    let job = Job {
        args: &args,
        train: &train,
        held_out: &held_out,
        saves: args.checkpoint_dir.is_some(),
    };
    let Some(outcome) = train_run(&job, args.strategy, false)? else {
        return Ok(()); // not rank 0
    };
    let label = label(&args);
    let reference = match (args.compare, args.strategy) {
        (true, Strategy::Single) | (false, _) => None,
        (true, _) => {
            let job = Job {
                saves: false,
                ..job
            };
            train_run(&job, Strategy::Single, true)?
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
            o.memory.parameters as f64 / 1e6,
            o.memory.gradients as f64 / 1e6,
            o.memory.optimizer_state as f64 / 1e6
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
