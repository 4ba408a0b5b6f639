//! Training benchmark: one device, DataParallel (three backward paths) and
//! DistributedDataParallel on thread ranks and (built with `--features
//! mpi`, Open MPI installed) on MPI processes, side by side in one run.
//!
//! ```text
//! cargo run --release --example bench -- --out bench-out [--quick] [--steps 20] [--rounds 2]
//!     [--device cpu|cuda] [--torch-csv scripts-output.csv | --torch-python venv/bin/python]
//!     (--help for details)
//! cargo run --release --example bench -- --pipeline --out bench-out   (model parallelism)
//! cargo run --release --features mpi --example bench -- --all-reduce --out bench-out
//! cargo run --release --features mpi --example bench -- --zero --out bench-out
//! cargo run --release --example bench -- --precision --out bench-out
//! cargo run --release --features mpi --example bench -- --overlap --out bench-out
//! cargo run --release --example bench -- --fabric --out bench-out
//! cargo run --release --features mimalloc --example bench -- --lm --out bench-out \
//!     [--torch-python venv/bin/python]
//! ```
//!
//! `--pipeline` measures the pipeline instead (see `pipeline.rs`) and
//! writes `pipeline.md`; `--all-reduce` measures DDP's gradient
//! all-reduce alone (see `all_reduce.rs`) and writes `all_reduce.md`;
//! `--zero` measures ZeRO against DDP (see `zero.rs`) and writes `zero.md`.
//!
//! `--torch-csv` reads the CSV written by `scripts/bench_torch.py --csv` (run
//! just before or after, on the same machine) and adds the ratios to
//! PyTorch.
//! `--torch-python` instead runs `bench_torch.py` itself, once a round
//! before candle-dp's configurations, and takes its medians over the
//! rounds (written to `torch.csv`).
//!
//! `--device cuda` (a build with `--features cuda`) puts every replica or
//! rank on GPU 0: DataParallel's replicas share its stream (candle-dp
//! refuses two streams of one GPU), DDP's thread ranks have a stream each;
//! steps end with a device
//! synchronisation, phase times are then only indicative (kernels run
//! asynchronously), and scaling efficiency is left out.
//!
//! Every configuration runs in its own child process (this binary again,
//! with `--child`; for `ddp-mpi`, `mpirun -np R` of it), so each gets the
//! thread settings it needs (a single device's threads, an MPI process's
//! share; DataParallel and DDP on threads set up their own), and
//! configurations are interleaved over `--rounds` to spread machine noise.
//! Writes `bench.md` (markdown table), `bench.csv` and `bench.svg` (chart)
//! into `--out`.
//!
//! Scaling efficiency, as defined in the design notes: throughput with R
//! replicas / (R x throughput of one replica on 1/R of the cores at the same
//! per-replica batch). "Engine overhead" is the share of the step not spent
//! in forward, backward or optimizer compute.

#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

// The system allocator, counted for `--precision`'s memory column.
#[cfg(not(feature = "mimalloc"))]
#[global_allocator]
static GLOBAL: alloc_count::Counting = alloc_count::Counting;

mod all_reduce;
// Under mimalloc the counting allocator is not installed (its reads stay
// at zero), so its allocator half goes unused.
#[cfg_attr(feature = "mimalloc", allow(dead_code))]
mod alloc_count;
mod child;
mod fabric;
mod fma_peak;
// The command-line value parsers the examples share.
use candle_dp_examples::flags;
mod inputs;
mod lm;
mod memory_floor;
mod mesh;
mod mfu;
mod net;
mod overlap;
mod pipeline;
mod plan;
mod precision;
mod report;
mod stats;
mod torch_rounds;
mod tp_memory;
mod zero;

use std::path::PathBuf;
use std::process::{Command, ExitCode};

use anyhow::{bail, Context, Result};
use candle_dp::launch::Backend;
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};

use child::{run_child, Measured};
use plan::{cores, specs, DeviceKind, Kind, Spec};
use report::{chart, csv, ddp_comparison, markdown, mfu_section, summarize, targets};

/// Training benchmark of candle-dp: one device, DataParallel, DDP on thread
/// ranks and (feature `mpi`) on MPI processes, side by side in one run.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Only the MLP at global batch 256 on 2 replicas (under a minute).
    #[arg(long)]
    quick: bool,
    /// Where bench.md, bench.csv and bench.svg are written.
    #[arg(long, value_name = "DIR", default_value = "bench-out")]
    out: PathBuf,
    /// Timed steps per configuration and round, at least 1 [default: 20, 10
    /// with --quick].
    #[arg(long, value_parser = flags::at_least_one::<usize>)]
    steps: Option<usize>,
    /// Rounds over all configurations, at least 1 [default: 2, 1 with
    /// --quick].
    #[arg(long, value_parser = flags::at_least_one::<usize>)]
    rounds: Option<usize>,
    /// Where the replicas run.
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    device: DeviceKind,
    /// Also time the MLP through candle-nn's `Linear` and `relu` (model
    /// `mlp-candle-ops`), beside the fused layers, in the same rounds.
    #[arg(long)]
    candle_ops: bool,
    /// The CSV of `scripts/bench_torch.py --csv`, for the ratios to PyTorch.
    #[arg(long, value_name = "CSV")]
    torch_csv: Option<PathBuf>,
    /// Measure model parallelism instead: one device, naive model
    /// parallelism, GPipe and 1F1B at 2-16 micro-batches, and a run under
    /// a per-device memory budget (writes pipeline.md).
    #[arg(long)]
    pipeline: bool,
    /// Measure the all-reduce alone instead: DDP's reduction of the MLP's
    /// gradient on thread ranks, on MPI processes and with Open MPI's own
    /// MPI_Allreduce (writes all_reduce.md).
    #[arg(long)]
    all_reduce: bool,
    /// With --all-reduce: before every call, each rank writes this many MiB
    /// of its own, so the call starts with cold caches, as after a training
    /// step's backward (0: warm, the same tensors call after call).
    #[arg(long, value_name = "MIB", default_value_t = 0)]
    cold_mib: usize,
    /// Runs the MPI processes on simulated machines instead, one process
    /// each (`scripts/netcluster.sh`: network namespaces, TCP only; as
    /// root): the all-reduce and DDP on MPI over a network.
    #[arg(long)]
    simulated_machines: bool,
    /// Internal: run one all-reduce measurement (JSON) in this process.
    #[arg(long, hide = true, value_name = "SPEC")]
    all_reduce_child: Option<String>,
    /// Internal: run one configuration (JSON) in this process.
    #[arg(long, hide = true, value_name = "SPEC")]
    child: Option<String>,
    /// Measure ZeRO instead: DDP against ZeRO stages 1 and 2 (AdamW) on
    /// thread ranks and MPI processes, with the bytes each rank holds, and
    /// a run under a per-rank memory budget (writes zero.md).
    #[arg(long)]
    zero: bool,
    /// Internal: run one ZeRO configuration (JSON) in this process.
    #[arg(long, hide = true, value_name = "SPEC")]
    zero_child: Option<String>,
    /// Measure mixed precision instead: f32, bf16 and f16 (with a
    /// GradScaler) on one device and DDP thread ranks: step time, the
    /// memory a step allocates, the weights against f32's (writes
    /// precision.md).
    #[arg(long)]
    precision: bool,
    /// Internal: run one mixed-precision configuration (JSON) in this process.
    #[arg(long, hide = true, value_name = "SPEC")]
    precision_child: Option<String>,
    /// Measure the reduction overlapped with the backward instead: DDP
    /// against DDP over the model given as units, on thread ranks and MPI
    /// processes, beside one rank's compute (writes overlap.md).
    #[arg(long)]
    overlap: bool,
    /// Internal: run one overlap configuration (JSON) in this process.
    #[arg(long, hide = true, value_name = "SPEC")]
    overlap_child: Option<String>,
    /// Measure the Fabric wrapper instead: the same training through a
    /// `Fabric` and through the engines called directly, side by side
    /// (writes fabric.md).
    #[arg(long)]
    fabric: bool,
    /// Internal: run one Fabric configuration (JSON) in this process.
    #[arg(long, hide = true, value_name = "SPEC")]
    fabric_child: Option<String>,
    /// Measure the language model instead: `train_lm`'s step per strategy
    /// (one device with the fused ops and with candle's, DDP, ZeRO-2 and
    /// FSDP on 2 thread ranks), and with --torch-python the PyTorch twin,
    /// in the same rounds, with the ratios (writes lm.md).
    #[arg(long)]
    lm: bool,
    /// A Python with PyTorch: with --lm, to run `scripts/train_lm_torch.py`
    /// on one process and as DDP over two beside candle-dp; otherwise to
    /// run `scripts/bench_torch.py` once a round, in the same rounds as
    /// candle-dp's configurations (its medians then stand for PyTorch, as
    /// --torch-csv's would).
    #[arg(long, value_name = "PYTHON", conflicts_with = "torch_csv")]
    torch_python: Option<PathBuf>,
    /// Measure the language model on two simulated machines of two ranks
    /// each (`scripts/netcluster.sh`, as root; a build with `--features
    /// mpi`): DDP, FSDP over all four ranks and HSDP (shard groups of a
    /// machine's two), the step time and the bytes each machine's link
    /// carries per step (writes mesh.md).
    #[arg(long)]
    mesh: bool,
    /// Measure what one rank holds at the peak of the language model's
    /// step at tp = 1, 2 and 4, with and without sequence parallelism (a
    /// build without mimalloc: the benchmark's allocator counts; writes
    /// tp_memory.md).
    #[arg(long)]
    tp_memory: bool,
    /// Internal: run one language-model configuration (JSON) in this process.
    #[arg(long, hide = true, value_name = "SPEC")]
    lm_child: Option<String>,
    /// Internal: run one pipeline configuration (JSON) in this process.
    #[arg(long, hide = true, value_name = "SPEC")]
    pipeline_child: Option<String>,
}

fn main() -> ExitCode {
    // Errors as whole lines, prefixed with the rank under mpirun.
    candle_dp::launch::report::exit_code(run(Args::parse()))
}

fn run(args: Args) -> Result<()> {
    if let Some(child) = &args.child {
        let spec: Spec = serde_json::from_str(child).context("--child needs a spec")?;
        let measured = run_child(&spec)?;
        // Under mpirun every rank gets here; rank 0 reports.
        if Backend::process_rank() == 0 {
            println!("{}", serde_json::to_string(&measured)?);
        }
        return Ok(());
    }
    if let Some(child) = &args.fabric_child {
        let spec: fabric::FabricSpec = serde_json::from_str(child).context("a Fabric spec")?;
        println!("{}", serde_json::to_string(&fabric::run_child(&spec)?)?);
        return Ok(());
    }
    if let Some(child) = &args.lm_child {
        let spec: lm::LmSpec = serde_json::from_str(child).context("a language-model spec")?;
        let measured = lm::run_child(&spec)?;
        // Under mpirun every rank gets here; rank 0 reports.
        if Backend::process_rank() == 0 {
            println!("{}", serde_json::to_string(&measured)?);
        }
        return Ok(());
    }
    if let Some(child) = &args.pipeline_child {
        let spec: pipeline::PipeSpec = serde_json::from_str(child).context("a pipeline spec")?;
        println!("{}", serde_json::to_string(&pipeline::run_child(&spec)?)?);
        return Ok(());
    }
    if let Some(child) = &args.precision_child {
        let spec: precision::PrecisionSpec =
            serde_json::from_str(child).context("a precision spec")?;
        println!("{}", serde_json::to_string(&precision::run_child(&spec)?)?);
        return Ok(());
    }
    if let Some(child) = &args.overlap_child {
        let spec: overlap::OverlapSpec = serde_json::from_str(child).context("an overlap spec")?;
        // Under mpirun every rank gets here; rank 0 reports.
        if let Some(measured) = overlap::run_child(&spec)? {
            println!("{}", serde_json::to_string(&measured)?);
        }
        return Ok(());
    }
    if let Some(child) = &args.zero_child {
        let spec: zero::ZeroSpec = serde_json::from_str(child).context("a ZeRO spec")?;
        // Under mpirun every rank gets here; rank 0 reports.
        if let Some(measured) = zero::run_child(&spec)? {
            println!("{}", serde_json::to_string(&measured)?);
        }
        return Ok(());
    }
    if let Some(child) = &args.all_reduce_child {
        let spec = serde_json::from_str(child).context("an all-reduce spec")?;
        if let Some(times) = all_reduce::run_child(spec)? {
            println!("{}", serde_json::to_string(&times)?);
        }
        return Ok(());
    }
    if args.simulated_machines {
        SIMULATED_MACHINES.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    let quick = args.quick;
    let out_dir = &args.out;
    std::fs::create_dir_all(out_dir)?;
    if args.all_reduce {
        let iters = args.steps.unwrap_or(if quick { 10 } else { 40 });
        let rounds = args.rounds.unwrap_or(if quick { 1 } else { 3 });
        let report = all_reduce::run(iters, rounds, args.cold_mib)?;
        println!("{report}");
        std::fs::write(out_dir.join("all_reduce.md"), &report)?;
        println!("wrote {}", out_dir.join("all_reduce.md").display());
        return Ok(());
    }
    if args.zero {
        let steps = args.steps.unwrap_or(if quick { 5 } else { 10 });
        let rounds = args.rounds.unwrap_or(if quick { 1 } else { 2 });
        let report = zero::run(quick, steps, rounds)?;
        println!("{report}");
        std::fs::write(out_dir.join("zero.md"), &report)?;
        println!("wrote {}", out_dir.join("zero.md").display());
        return Ok(());
    }
    if args.fabric {
        let steps = args.steps.unwrap_or(if quick { 5 } else { 20 });
        let rounds = args.rounds.unwrap_or(if quick { 1 } else { 3 });
        let report = fabric::run(quick, steps, rounds)?;
        println!("{report}");
        std::fs::write(out_dir.join("fabric.md"), &report)?;
        println!("wrote {}", out_dir.join("fabric.md").display());
        return Ok(());
    }
    if args.lm {
        let steps = args.steps.unwrap_or(if quick { 3 } else { 10 });
        let rounds = args.rounds.unwrap_or(if quick { 1 } else { 3 });
        let report = lm::run(quick, steps, rounds, args.torch_python.as_deref(), out_dir)?;
        println!("{report}");
        std::fs::write(out_dir.join("lm.md"), &report)?;
        println!("wrote {}", out_dir.join("lm.md").display());
        return Ok(());
    }
    if args.mesh {
        let steps = args.steps.unwrap_or(if quick { 3 } else { 10 });
        let rounds = args.rounds.unwrap_or(if quick { 1 } else { 3 });
        let report = mesh::run(steps, rounds)?;
        println!("{report}");
        std::fs::write(out_dir.join("mesh.md"), &report)?;
        println!("wrote {}", out_dir.join("mesh.md").display());
        return Ok(());
    }
    if args.tp_memory {
        let report = tp_memory::run()?;
        println!("{report}");
        std::fs::write(out_dir.join("tp_memory.md"), &report)?;
        println!("wrote {}", out_dir.join("tp_memory.md").display());
        return Ok(());
    }
    if args.overlap {
        let steps = args.steps.unwrap_or(if quick { 5 } else { 10 });
        let rounds = args.rounds.unwrap_or(if quick { 1 } else { 3 });
        let report = overlap::run(quick, steps, rounds)?;
        println!("{report}");
        std::fs::write(out_dir.join("overlap.md"), &report)?;
        println!("wrote {}", out_dir.join("overlap.md").display());
        return Ok(());
    }
    if args.precision {
        let steps = args.steps.unwrap_or(if quick { 3 } else { 10 });
        let rounds = args.rounds.unwrap_or(if quick { 1 } else { 2 });
        let report = precision::run(quick, steps, rounds, out_dir)?;
        println!("{report}");
        std::fs::write(out_dir.join("precision.md"), &report)?;
        println!("wrote {}", out_dir.join("precision.md").display());
        return Ok(());
    }
    if args.pipeline {
        let steps = args.steps.unwrap_or(if quick { 3 } else { 5 });
        let rounds = args.rounds.unwrap_or(if quick { 1 } else { 2 });
        let report = pipeline::run(quick, steps, rounds)?;
        println!("{report}");
        std::fs::write(out_dir.join("pipeline.md"), &report)?;
        println!("wrote {}", out_dir.join("pipeline.md").display());
        return Ok(());
    }
    let steps = args.steps.unwrap_or(if quick { 10 } else { 20 });
    let rounds = args.rounds.unwrap_or(if quick { 1 } else { 2 });
    let specs = specs(quick, steps, args.device, args.candle_ops);
    let bar = ProgressBar::new((specs.len() * rounds) as u64);
    bar.set_style(
        ProgressStyle::with_template("[{bar:30}] {pos}/{len} {msg}")?.progress_chars("=> "),
    );
    let mut measured: Vec<Measured> = vec![Measured::default(); specs.len()];
    let mut torch_rounds = Vec::new();
    for round in 0..rounds {
        if let Some(python) = &args.torch_python {
            bar.set_message("PyTorch (scripts/bench_torch.py)");
            torch_rounds.push(torch_rounds::run_round(python, quick, out_dir, round)?);
        }
        for (spec, m) in specs.iter().zip(measured.iter_mut()) {
            bar.set_message(format!(
                "{} {} batch {}",
                spec.label(),
                spec.model,
                spec.batch
            ));
            m.merge(run_in_child(spec)?);
            bar.inc(1);
        }
    }
    bar.finish_and_clear();

    let rows = summarize(&specs, &measured);
    let torch = match (&args.torch_csv, torch_rounds.is_empty()) {
        (Some(path), _) => Some(
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?,
        ),
        (None, false) => {
            let csv = torch_rounds::median_csv(&torch_rounds);
            std::fs::write(out_dir.join("torch.csv"), &csv)?;
            Some(csv)
        }
        (None, true) => None,
    };
    let mut table = markdown(&rows);
    table += &targets(&rows, torch.as_deref());
    table += &ddp_comparison(&rows, torch.as_deref());
    table += &mfu_section(&rows, torch.as_deref());
    println!("{table}");
    std::fs::write(out_dir.join("bench.md"), &table)?;
    std::fs::write(out_dir.join("bench.csv"), csv(&rows))?;
    chart(
        &rows,
        torch.as_deref(),
        &format!("candle-dp benchmark: {}, {}", machine(args.device), today()),
        &out_dir.join("bench.svg"),
    )?;
    println!(
        "wrote {}: bench.md, bench.csv, bench.svg",
        out_dir.display()
    );
    Ok(())
}

/// Runs one configuration in a child process with its thread settings.
fn run_in_child(spec: &Spec) -> Result<Measured> {
    let mut cmd = if spec.kind == Kind::DdpMpi {
        mpirun_this(spec.replicas)?
    } else {
        Command::new(std::env::current_exe()?)
    };
    cmd.arg("--child").arg(serde_json::to_string(spec)?);
    // gemm splits each matmul into RAYON_NUM_THREADS parts, and candle's
    // elementwise pool has CANDLE_NUM_THREADS - 1 spinning threads. One
    // device runs as candle-dp runs one rank (src/cpu_threads.rs): its
    // cores for gemm, the pool empty (its spinning worker took 12% of the
    // 2-core MLP step's samples from gemm). DataParallel and DDP on threads
    // size both themselves; MPI processes are told their share here (one
    // core each on this machine's two).
    let threads = match spec.kind {
        Kind::Single => Some((spec.threads, 1)),
        Kind::DdpMpi => Some((
            (cores() / spec.replicas).max(1),
            (cores() / spec.replicas).max(1),
        )),
        _ => None,
    };
    if let Some((rayon, candle)) = threads {
        cmd.env("RAYON_NUM_THREADS", rayon.to_string());
        cmd.env("CANDLE_NUM_THREADS", candle.to_string());
    }
    child_answer(cmd, &spec.label())
}

/// Whether the MPI processes run on simulated machines (`--simulated-machines`).
static SIMULATED_MACHINES: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// `mpirun -np N` of this binary: as root too, more ranks than cores
/// allowed, processes left unbound (they size their own threads). With
/// `--simulated-machines`, N machines of `scripts/netcluster.sh`, one
/// process each, over TCP.
fn mpirun_this(np: usize) -> Result<Command> {
    if SIMULATED_MACHINES.load(std::sync::atomic::Ordering::Relaxed) {
        return on_simulated_machines(np, 1);
    }
    let mut mpirun = Command::new("mpirun");
    mpirun
        .args([
            "--allow-run-as-root",
            "--oversubscribe",
            "--bind-to",
            "none",
        ])
        .args(["-np", &np.to_string()])
        .arg(std::env::current_exe()?);
    Ok(mpirun)
}

/// This binary as `machines x per_machine` MPI processes on the simulated
/// machines of `scripts/netcluster.sh` (as root), one machine's ranks
/// neighbours (`--block`), the thread settings passed on, the processes
/// left unbound.
fn on_simulated_machines(machines: usize, per_machine: usize) -> Result<Command> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/netcluster.sh");
    let mut cluster = Command::new("bash");
    cluster
        .arg(script)
        .args(["run", "--machines", &machines.to_string()])
        .args(["--per-machine", &per_machine.to_string(), "--block"])
        .args(["--export", "RAYON_NUM_THREADS"])
        .args(["--export", "CANDLE_NUM_THREADS"])
        .args(["--mca", "hwloc_base_binding_policy", "none", "--"])
        .arg(std::env::current_exe()?);
    Ok(cluster)
}

/// Runs `cmd` to its end: its output, or an error naming `label` (with
/// its stderr) where it could not start or failed.
fn run_ok(cmd: &mut Command, label: &str) -> Result<std::process::Output> {
    let out = cmd
        .output()
        .with_context(|| format!("{label}: starting {:?}", cmd.get_program()))?;
    if !out.status.success() {
        bail!("{label} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(out)
}

/// Runs a child process and reads the JSON on the last line it printed.
fn child_answer<T: serde::de::DeserializeOwned>(mut cmd: Command, label: &str) -> Result<T> {
    let out = run_ok(&mut cmd, label)?;
    // The answer is the last line that parses: libraries may print too
    // (NCCL its version, with NCCL_DEBUG=VERSION).
    let stdout = String::from_utf8(out.stdout)?;
    stdout
        .lines()
        .rev()
        .find_map(|line| serde_json::from_str(line).ok())
        .with_context(|| format!("{label}: no answer in the child's output:\n{stdout}"))
}

/// The CPU, or the GPU and its host, the benchmark ran on, for the
/// chart's title.
fn machine(device: DeviceKind) -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines().find_map(|l| {
                l.strip_prefix("model name")
                    .map(|v| v.trim_start_matches([' ', '\t', ':']).trim().to_string())
            })
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let host = format!("{cpu}, {} cores", cores());
    match device {
        DeviceKind::Cpu => host,
        DeviceKind::Cuda => format!("{} (GPU 0), host {host}", gpu_name()),
    }
}

#[cfg(feature = "cuda")]
fn gpu_name() -> String {
    candle_core::cuda_backend::cudarc::driver::CudaContext::new(0)
        .and_then(|ctx| ctx.name())
        .unwrap_or_else(|e| format!("unknown GPU ({e:?})"))
}

#[cfg(not(feature = "cuda"))]
fn gpu_name() -> String {
    "no GPU (a build without --features cuda)".into()
}

/// Today's date (UTC), as `date` prints it.
fn today() -> String {
    Command::new("date")
        .args(["-u", "+%Y-%m-%d"])
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map_or_else(|| "date unknown".into(), |d| d.trim().to_string())
}
