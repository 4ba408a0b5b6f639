//! A GPT-style language model trained as people train them: AdamW, a
//! warm-up + cosine schedule, gradient clipping, bf16 or f16, through one
//! loop on a [`Fabric`] with any strategy of the crate, on the bytes of a
//! public-domain book (`data/text/`).
//!
//! ```text
//! cargo run --release --example train_lm -- --strategy ddp --replicas 2
//! cargo run --release --example train_lm -- --mesh dp_shard=2,pp=2 --precision bf16
//! ```
//!
//! The Fabric's flags (`FabricArgs`) pick the strategy, by name
//! (`--strategy single|dp|ddp|zero|fsdp|hsdp|pipeline|ddp-pipeline`,
//! `--replicas` of them) or as degrees (`--mesh dp=2,pp=2`). The model:
//! `examples/common/gpt.rs`; its data: `text.rs`; the report: `lm.rs`.
//! `scripts/train_lm_torch.py` trains the same model in PyTorch from
//! `--save-init`'s weights on the same batches.

#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use candle_dp::fabric::{Devices, Fabric, FabricArgs, FabricConfig};
use candle_dp::launch::Backend;
use candle_dp::training_state::Progress;
use candle_dp_examples::elastic::ElasticArgs;
use candle_dp_examples::flags;
use candle_dp_examples::gpt::{loss_on, model_recipe};
use candle_dp_examples::lm::{self, in_precision, GptArgs, OptimArgs, Outcome};
use candle_dp_examples::text::{load_text, share_at, split, Windows};
use clap::Parser;

/// Train a GPT-style language model on a public-domain book.
#[derive(Parser, Debug, Clone)]
#[command(version)]
struct Args {
    #[command(flatten)]
    fabric: FabricArgs,
    /// With cuda: the GPU of each rank, replica or stage, in order (`0`,
    /// `0,1`; `0,0` puts two on one GPU) [default: 0, 1, ... one each].
    #[arg(long, value_parser = flags::gpu_ordinals)]
    gpus: Option<Devices>,
    /// Optimizer steps (at least 1).
    #[arg(long, default_value_t = 250, value_parser = flags::at_least_one::<u64>)]
    steps: u64,
    /// Global batch, in windows of `--context` bytes (at least 1).
    #[arg(long, default_value_t = 8, value_parser = flags::at_least_one::<usize>)]
    batch: usize,
    #[command(flatten)]
    model: GptArgs,
    #[command(flatten)]
    optim: OptimArgs,
    /// Evaluates the held-out loss every N steps (and at the end).
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
    /// Bytes of text to generate at the end (temperature 0.8; 0: none).
    #[arg(long, default_value_t = 160)]
    sample: usize,
    /// After a parallel run, trains one device too and compares the curves.
    #[arg(long)]
    compare: bool,
    /// Saves a state every N steps, N at least 1 [default: at the end].
    #[arg(long, value_name = "N", requires = "checkpoint_dir", value_parser = flags::at_least_one::<u64>)]
    checkpoint_every: Option<u64>,
    /// Continues from the newest state in --checkpoint-dir.
    #[arg(long, requires = "checkpoint_dir")]
    resume: bool,
    #[command(flatten)]
    elastic: ElasticArgs,
}

/// One run of `config`: the same loop for every strategy; rank 0's
/// outcome. `in_process`: thread ranks even under mpirun (the reference).
fn train_run(
    args: &Args,
    config: FabricConfig,
    data: (&Windows, &Windows),
    in_process: bool,
) -> Result<Option<Outcome>> {
    let (train, held_out) = data;
    let saves = config.checkpoint_dir.is_some();
    let precision = config.precision;
    let loss_fn = args.model.loss();
    let rank_loop = |fabric: Fabric| -> Result<Option<Outcome>> {
        // The data's shares: one per rank, or per pipeline of ranks.
        let rank = fabric.rank();
        let (share, shares) = (fabric.data_parallel_rank(), fabric.data_parallel_size());
        if !args.batch.is_multiple_of(shares) {
            bail!(
                "--batch {} does not divide among {shares} replicas",
                args.batch
            );
        }
        // With a tp degree, each rank builds its pieces of the model.
        let module = model_recipe(args.model.config(), fabric.tensor_parallel());
        let mut model = fabric.setup(module, |p| args.optim.adamw(p))?;
        if let Some(schedule) = args.optim.schedule(args.steps)? {
            model.set_schedule(schedule)?;
        }
        // A restarted job (elastic) resumes whatever --resume says.
        let from = model
            .resume(saves && (args.resume || fabric.restart() > 0))?
            .step;
        let (mut outcome, start, mut evaluating) =
            (Outcome::default(), Instant::now(), Duration::ZERO);
        for step in from..args.steps {
            let consecutive = fabric.config().deterministic.is_some();
            let (seed, shared) = (fabric.config().seed, (shares, share));
            let indices = share_at(train, shared, seed, args.batch, step, consecutive)?;
            let (x, y) = train.batch(&indices)?;
            let (x, y) = (fabric.to_device(&x)?, fabric.to_device(&y)?);
            let loss = model.backward(&x, &y, loss_on(fabric.tensor_parallel(), loss_fn))?;
            model.step()?;
            outcome.losses.push(fabric.global_mean(&loss, x.dim(0)?)?);
            outcome.tokens += (x.elem_count() * shares) as u64;
            let (done, paused) = (step + 1, Instant::now());
            if done % args.eval_every == 0 || done == args.steps {
                // Every rank takes part in FSDP's gathering; rank 0 evaluates.
                let whole = model.full_varmap()?;
                if rank == 0 {
                    let model = in_precision(args.model.config(), precision, &whole)?;
                    outcome
                        .held_out
                        .push((done, lm::evaluate(&model, held_out, done)?));
                    outcome.varmap = whole;
                }
            }
            let progress = Progress {
                epoch: 0,
                batch: done,
                step: done,
            };
            match progress.due(args.steps, args.checkpoint_every) {
                Some(progress) if saves => model.save(progress)?,
                _ => {}
            }
            evaluating += paused.elapsed();
        }
        outcome.training = start.elapsed() - evaluating;
        outcome.skipped = model.skipped_steps();
        if from == args.steps {
            outcome.varmap = model.full_varmap()?;
        }
        outcome.memory = lm::most(&fabric.all_gather_object(&model.memory()?)?);
        if rank == 0 {
            lm::say_what_fsdp_gathered(&outcome.memory);
        }
        Ok((rank == 0).then_some(outcome))
    };
    let ranks = match in_process {
        true => Fabric::spawn(config, rank_loop)?,
        false => Fabric::launch(config, rank_loop)?,
    };
    Ok(ranks.into_iter().flatten().next())
}

fn main() -> ExitCode {
    candle_dp::launch::report::exit_code(run(Args::parse()))
}

fn run(args: Args) -> Result<()> {
    // The flags' own ranges were checked as they were parsed; what a
    // supervisor could not mend by restarting is refused before it starts.
    let gpt = args.model.config();
    if !gpt.width.is_multiple_of(gpt.heads) {
        bail!(
            "--width {} does not divide into {} heads",
            gpt.width,
            gpt.heads
        );
    }
    let config = lm::fabric_config(&args.fabric, args.gpus.as_ref())?;
    if args.elastic.hosts.is_some() && !cfg!(feature = "mpi") {
        bail!("--hosts starts this program under mpirun or srun: build it with --features mpi");
    }
    let dividing = lm::ranks_dividing(&config, args.fabric.mesh.is_some(), args.batch);
    if let Some(supervised) = args.elastic.supervise(config.max_restarts, dividing) {
        return supervised;
    }
    let text = load_text()?;
    let (train, held_out) = split(&text, gpt.context);
    if Backend::process_rank() == 0 {
        let (windows, context) = ((train.len(), held_out.len()), gpt.context);
        println!("data: Around the World in Eighty Days, {} bytes: {} training and {} held-out windows of {context} bytes", text.len(), windows.0, windows.1);
        let (model, optim, clip) = (
            lm::describe(&gpt),
            args.optim.describe(),
            config.gradient_clip,
        );
        println!(
            "model: {model}; {optim}, clip {clip:?}, {}, global batch {} windows, {} steps",
            config.precision, args.batch, args.steps
        );
        if let Some(path) = &args.save_init {
            lm::save_init(gpt, config.seed, path)?;
        }
    }
    let label = lm::label(&config);
    let (one, data) = (config.on_one_device(), (&train, &held_out));
    let Some(outcome) = train_run(&args, config, data, false)? else {
        return Ok(()); // not rank 0
    };
    let reference = FabricConfig {
        checkpoint_dir: None,
        max_restarts: 0,
        ..one.clone()
    };
    let reference = match args.compare && label != "one device" {
        true => train_run(&args, reference, data, true)?,
        false => None,
    };
    let mut runs = vec![(label, &outcome)];
    runs.extend(reference.iter().map(|one| ("one device".to_string(), one)));
    lm::compare(
        &runs,
        args.steps,
        args.losses.as_deref(),
        args.save.as_deref(),
        &args.chart,
    )?;
    if args.sample > 0 {
        let model = in_precision(gpt, one.precision, &outcome.varmap)?;
        let sample = lm::generate(&model, gpt.context, "Phileas Fogg", args.sample, one.seed)?;
        println!("\nsample: {sample}");
    }
    Ok(())
}
