//! Training benchmark: one device, DataParallel (three backward paths) and
//! DistributedDataParallel on thread ranks and (built with `--features
//! mpi`, Open MPI installed) on MPI processes, side by side in one run.
//!
//! ```text
//! cargo run --release --example bench -- --out bench-out [--quick] [--steps 20] [--rounds 2]
//!     [--device cpu|cuda] [--torch-csv scripts-output.csv]    (--help for details)
//! ```
//!
//! `--torch-csv` reads the CSV written by `scripts/bench_torch.py --csv` (run
//! just before or after, on the same machine) and adds the ratios to
//! PyTorch.
//!
//! `--device cuda` (a build with `--features cuda`) puts every replica or
//! rank on its own CUDA stream of GPU 0; steps end with a device
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

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Module, Tensor};
use candle_dp::comm::GroupOptions;
use candle_dp::launch::{self, Backend};
use candle_dp::{DataParallel, DdpConfig, DistributedDataParallel, LossReduction};
use candle_nn::{
    conv2d, linear, loss, Conv2d, Conv2dConfig, Linear, Optimizer, VarBuilder, VarMap, SGD,
};
use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};

/// The reference MLP 784-1024-1024-10.
struct Mlp(Linear, Linear, Linear);

/// A small conv net on 1x28x28: conv 16 -> pool -> conv 32 -> pool -> fc 10.
struct Conv(Conv2d, Conv2d, Linear);

enum Net {
    Mlp(Mlp),
    Conv(Conv),
}

impl Net {
    fn new(model: &str, vb: VarBuilder) -> candle_core::Result<Self> {
        Ok(match model {
            "mlp" => Net::Mlp(Mlp(
                linear(784, 1024, vb.pp("l1"))?,
                linear(1024, 1024, vb.pp("l2"))?,
                linear(1024, 10, vb.pp("l3"))?,
            )),
            _ => Net::Conv(Conv(
                conv2d(1, 16, 3, Conv2dConfig::default(), vb.pp("c1"))?,
                conv2d(16, 32, 3, Conv2dConfig::default(), vb.pp("c2"))?,
                linear(32 * 5 * 5, 10, vb.pp("fc"))?,
            )),
        })
    }

    fn input_shape(model: &str, batch: usize) -> Vec<usize> {
        match model {
            "mlp" => vec![batch, 784],
            _ => vec![batch, 1, 28, 28],
        }
    }
}

impl Module for Net {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Net::Mlp(m) => m.2.forward(&m.1.forward(&m.0.forward(x)?.relu()?)?.relu()?),
            Net::Conv(c) => {
                let h = c.0.forward(x)?.relu()?.max_pool2d(2)?;
                let h = c.1.forward(&h)?.relu()?.max_pool2d(2)?;
                c.2.forward(&h.flatten_from(1)?)
            }
        }
    }
}

/// One configuration, as passed to a child process.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Spec {
    /// single | dp-fast | dp-dropin | dp-fromloss | ddp | ddp-mpi
    kind: String,
    model: String,
    /// Global batch (per step, all replicas together).
    batch: usize,
    replicas: usize,
    /// Threads for a single-device run (1 = one core).
    threads: usize,
    warmup: usize,
    steps: usize,
    /// cpu, or cuda: replicas as separate CUDA streams on GPU 0.
    device: String,
}

impl Spec {
    /// The device of replica (or rank) `i`.
    fn device(&self, i: usize) -> candle_core::Result<Device> {
        match (self.device.as_str(), i) {
            ("cuda", 0) if self.kind == "single" => Device::new_cuda(0),
            ("cuda", _) => Device::new_cuda_with_stream(0),
            _ => Ok(Device::Cpu),
        }
    }

    fn sync(&self, devices: &[Device]) -> candle_core::Result<()> {
        devices.iter().try_for_each(|d| d.synchronize())
    }

    fn label(&self) -> String {
        match self.kind.as_str() {
            "single" => format!("single, {} thread(s)", self.threads),
            kind => format!("{kind} x{}", self.replicas),
        }
    }
}

/// What a child reports: per-step wall times and per-phase times (ms).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Measured {
    step_ms: Vec<f64>,
    phases: BTreeMap<String, Vec<f64>>,
    /// DDP: the gradient bytes all-reduced per step.
    grad_bytes: Option<usize>,
    /// DDP: one memcpy of `grad_bytes` (ms, median), for scale.
    memcpy_ms: Option<f64>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return f64::NAN;
    }
    v[v.len() / 2]
}

fn data(spec: &Spec, device: &Device) -> Result<(Tensor, Tensor)> {
    let x = Tensor::randn(
        0f32,
        1.,
        Net::input_shape(&spec.model, spec.batch),
        &Device::Cpu,
    )?;
    let y = Tensor::from_vec(
        (0..spec.batch as u32).map(|i| i % 10).collect(),
        spec.batch,
        &Device::Cpu,
    )?;
    Ok((x.to_device(device)?, y.to_device(device)?))
}

/// Runs one configuration in this process (the child side).
fn run_child(spec: &Spec) -> Result<Measured> {
    let first = spec.device(0)?;
    let (x, y) = data(spec, &first)?;
    let mut m = Measured::default();
    let phase = |m: &mut Measured, name: &str, d: Duration| {
        m.phases.entry(name.into()).or_default().push(ms(d))
    };
    match spec.kind.as_str() {
        "single" => {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(spec.threads)
                .build()?;
            pool.install(|| -> Result<()> {
                let varmap = VarMap::new();
                let net = Net::new(
                    &spec.model,
                    VarBuilder::from_varmap(&varmap, DType::F32, &first),
                )?;
                let mut sgd = SGD::new(varmap.all_vars(), 0.01)?;
                let devices = [first.clone()];
                for step in 0..spec.warmup + spec.steps {
                    let t0 = Instant::now();
                    let loss = loss::cross_entropy(&net.forward(&x)?, &y)?;
                    let t1 = Instant::now();
                    let grads = loss.backward()?;
                    let t2 = Instant::now();
                    sgd.step(&grads)?;
                    spec.sync(&devices)?;
                    if step >= spec.warmup {
                        phase(&mut m, "forward", t1 - t0);
                        phase(&mut m, "backward", t2 - t1);
                        phase(&mut m, "optimizer", t2.elapsed());
                        m.step_ms.push(ms(t0.elapsed()));
                    }
                }
                Ok(())
            })?;
        }
        // The same code on thread ranks and, under mpirun, on processes.
        "ddp" | "ddp-mpi" => {
            let world = spec.replicas;
            let per_rank = spec.batch / world;
            let options = GroupOptions {
                timeout: Some(Duration::from_secs(120)),
                ..Default::default()
            };
            // Thread ranks get their share of the cores from `launch`.
            let mut results = launch::run(world, options, |ctx| -> Result<Measured> {
                {
                    let mut m = Measured::default();
                    let varmap = VarMap::new();
                    let model = spec.model.clone();
                    let device = spec.device(ctx.rank)?;
                    let mut ddp = DistributedDataParallel::new(
                        ctx.process_group(),
                        &varmap,
                        DType::F32,
                        &device,
                        |vb| Net::new(&model, vb),
                        DdpConfig::default(),
                    )?;
                    let mut sgd = SGD::new(varmap.all_vars(), 0.01)?;
                    let grad_bytes: usize = varmap
                        .all_vars()
                        .iter()
                        .map(|v| v.elem_count() * v.dtype().size_in_bytes())
                        .sum();
                    m.grad_bytes = Some(grad_bytes);
                    m.memcpy_ms = Some(memcpy_ms(grad_bytes));
                    let (x, y) = (
                        x.narrow(0, ctx.rank * per_rank, per_rank)?
                            .to_device(&device)?,
                        y.narrow(0, ctx.rank * per_rank, per_rank)?
                            .to_device(&device)?,
                    );
                    let devices = [device.clone()];
                    for step in 0..spec.warmup + spec.steps {
                        let t0 = Instant::now();
                        let loss = loss::cross_entropy(&ddp.forward(&x)?, &y)?;
                        let t1 = Instant::now();
                        let grads = ddp.backward(&loss)?;
                        let t2 = Instant::now();
                        sgd.step(&grads)?;
                        spec.sync(&devices)?;
                        if step >= spec.warmup {
                            let t = ddp.last_timings();
                            m.phases
                                .entry("forward".into())
                                .or_default()
                                .push(ms(t1 - t0));
                            m.phases
                                .entry("backward".into())
                                .or_default()
                                .push(ms(t.backward));
                            m.phases
                                .entry("reduce".into())
                                .or_default()
                                .push(ms(t.all_reduce));
                            m.phases
                                .entry("optimizer".into())
                                .or_default()
                                .push(ms(t2.elapsed()));
                            m.step_ms.push(ms(t0.elapsed()));
                        }
                    }
                    Ok(m)
                }
            })?;
            m = results.swap_remove(0);
        }
        kind => {
            let varmap = VarMap::new();
            let model = spec.model.clone();
            let devices = (0..spec.replicas)
                .map(|i| spec.device(i))
                .collect::<candle_core::Result<Vec<_>>>()?;
            let (x, y) = (x.to_device(&devices[0])?, y.to_device(&devices[0])?);
            let dp = DataParallel::new(&varmap, DType::F32, &devices, move |vb| {
                Net::new(&model, vb)
            })?;
            let mut sgd = SGD::new(varmap.all_vars(), 0.01)?;
            for step in 0..spec.warmup + spec.steps {
                let t0 = Instant::now();
                let grads = match kind {
                    "dp-fast" => {
                        dp.forward_backward(
                            (x.clone(), y.clone()),
                            LossReduction::Mean,
                            |m: &Net, (x, y)| loss::cross_entropy(&m.forward(&x)?, &y),
                        )?
                        .grads
                    }
                    "dp-fromloss" => {
                        let out = dp.forward(&x)?;
                        dp.backward_from_loss(&out, |o| loss::cross_entropy(o, &y))?
                            .grads
                    }
                    "dp-dropin" => {
                        let out = dp.forward(&x)?;
                        let loss = loss::cross_entropy(&out, &y)?;
                        let t = Instant::now();
                        let grads = loss.backward()?;
                        phase(&mut m, "backward-serial", t.elapsed());
                        grads
                    }
                    other => bail!("unknown configuration kind {other}"),
                };
                let t1 = Instant::now();
                sgd.step(&grads)?;
                spec.sync(&devices)?;
                if step >= spec.warmup {
                    let t = dp.last_timings();
                    phase(&mut m, "scatter", t.scatter);
                    phase(&mut m, "replicate", t.replicate);
                    phase(&mut m, "forward", t.forward);
                    phase(&mut m, "backward", t.backward);
                    phase(&mut m, "reduce", t.reduce);
                    phase(&mut m, "gather", t.gather);
                    phase(&mut m, "optimizer", t1.elapsed());
                    m.step_ms.push(ms(t0.elapsed()));
                }
            }
        }
    }
    Ok(m)
}

/// The median time of copying `bytes` bytes once (ms).
fn memcpy_ms(bytes: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let times: Vec<f64> = (0..7)
        .map(|_| {
            let t = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&dst);
            ms(t.elapsed())
        })
        .collect();
    median(&times)
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Runs one configuration in a child process with its thread settings.
fn run_in_child(spec: &Spec) -> Result<Measured> {
    let mut cmd = if spec.kind == "ddp-mpi" {
        let mut mpirun = Command::new("mpirun");
        mpirun
            .args([
                "--allow-run-as-root",
                "--oversubscribe",
                "--bind-to",
                "none",
            ])
            .args(["-np", &spec.replicas.to_string()])
            .arg(std::env::current_exe()?);
        mpirun
    } else {
        Command::new(std::env::current_exe()?)
    };
    cmd.arg("--child").arg(serde_json::to_string(spec)?);
    // One device: gemm splits each matmul into RAYON_NUM_THREADS parts and
    // candle's elementwise pool has CANDLE_NUM_THREADS - 1 threads, so both
    // say how many cores the run gets. DataParallel and DDP on threads size
    // them themselves (src/cpu_threads.rs); MPI processes are told their
    // share here (one core each on this machine's two).
    let threads = match spec.kind.as_str() {
        "single" => Some(spec.threads),
        "ddp-mpi" => Some((cores() / spec.replicas).max(1)),
        _ => None,
    };
    if let Some(threads) = threads {
        cmd.env("RAYON_NUM_THREADS", threads.to_string());
        cmd.env("CANDLE_NUM_THREADS", threads.to_string());
    }
    let out = cmd.output()?;
    if !out.status.success() {
        bail!(
            "{} failed: {}",
            spec.label(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let line = String::from_utf8(out.stdout)?;
    serde_json::from_str(line.lines().last().context("child printed nothing")?)
        .context("child output")
}

struct Row {
    spec: Spec,
    median_ms: f64,
    samples_per_s: f64,
    efficiency: Option<f64>,
    phases: BTreeMap<String, f64>,
    grad_bytes: Option<usize>,
    memcpy_ms: Option<f64>,
}

fn specs(quick: bool, steps: usize, device: &str) -> Vec<Spec> {
    let (models, batches, replicas): (&[&str], &[usize], &[usize]) = if quick {
        (&["mlp"], &[256], &[2])
    } else {
        (&["mlp", "conv"], &[64, 256, 1024], &[1, 2, 4])
    };
    let warmup = if quick { 3 } else { 5 };
    let mut out = Vec::new();
    for &model in models {
        for &batch in batches {
            let spec = |kind: &str, batch: usize, replicas: usize, threads: usize| Spec {
                kind: kind.into(),
                model: model.into(),
                batch,
                replicas,
                threads,
                warmup,
                steps,
                device: device.into(),
            };
            out.push(spec("single", batch, 1, cores()));
            if device == "cpu" {
                out.push(spec("single", batch, 1, 1));
                out.push(spec("single", batch / 2, 1, 1)); // per-replica baseline for 2 replicas
            }
            for &r in replicas {
                for kind in ["dp-fast", "dp-fromloss", "dp-dropin", "ddp", "ddp-mpi"] {
                    if r == 4 && kind != "dp-fast" && kind != "ddp" {
                        continue;
                    }
                    // Processes need the feature, and MPI on this machine.
                    if kind == "ddp-mpi" && (!cfg!(feature = "mpi") || device != "cpu" || r == 1) {
                        continue;
                    }
                    out.push(spec(kind, batch, r, 0));
                }
            }
        }
    }
    out
}

/// Where the replicas or ranks run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum DeviceKind {
    /// CPU replicas (the cores split between them).
    Cpu,
    /// CUDA streams of GPU 0 (a build with `--features cuda`).
    Cuda,
}

impl DeviceKind {
    fn name(self) -> &'static str {
        match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
        }
    }
}

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
    /// Timed steps per configuration and round [default: 20, 10 with --quick].
    #[arg(long)]
    steps: Option<usize>,
    /// Rounds over all configurations [default: 2, 1 with --quick].
    #[arg(long)]
    rounds: Option<usize>,
    /// Where the replicas run.
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    device: DeviceKind,
    /// The CSV of `scripts/bench_torch.py --csv`, for the ratios to PyTorch.
    #[arg(long, value_name = "CSV")]
    torch_csv: Option<PathBuf>,
    /// Internal: run one configuration (JSON) in this process.
    #[arg(long, hide = true, value_name = "SPEC")]
    child: Option<String>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if let Some(child) = &args.child {
        let spec: Spec = serde_json::from_str(child).context("--child needs a spec")?;
        let measured = run_child(&spec)?;
        // Under mpirun every rank gets here; rank 0 reports.
        if Backend::process_rank() == 0 {
            println!("{}", serde_json::to_string(&measured)?);
        }
        return Ok(());
    }
    let quick = args.quick;
    let steps = args.steps.unwrap_or(if quick { 10 } else { 20 });
    let rounds = args.rounds.unwrap_or(if quick { 1 } else { 2 });
    let out_dir = &args.out;
    std::fs::create_dir_all(out_dir)?;
    let specs = specs(quick, steps, args.device.name());
    let bar = ProgressBar::new((specs.len() * rounds) as u64);
    bar.set_style(
        ProgressStyle::with_template("[{bar:30}] {pos}/{len} {msg}")?.progress_chars("=> "),
    );
    let mut measured: Vec<Measured> = vec![Measured::default(); specs.len()];
    for _ in 0..rounds {
        for (spec, m) in specs.iter().zip(measured.iter_mut()) {
            bar.set_message(format!(
                "{} {} batch {}",
                spec.label(),
                spec.model,
                spec.batch
            ));
            let got = run_in_child(spec)?;
            m.step_ms.extend(got.step_ms);
            m.grad_bytes = got.grad_bytes.or(m.grad_bytes);
            if let Some(t) = got.memcpy_ms {
                m.memcpy_ms = Some(m.memcpy_ms.map_or(t, |old| old.min(t)));
            }
            for (k, v) in got.phases {
                m.phases.entry(k).or_default().extend(v);
            }
            bar.inc(1);
        }
    }
    bar.finish_and_clear();

    let rows = summarize(&specs, &measured);
    let torch = args
        .torch_csv
        .as_ref()
        .map(|path| {
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
        })
        .transpose()?;
    let mut table = markdown(&rows);
    table += &targets(&rows, torch.as_deref());
    table += &ddp_comparison(&rows, torch.as_deref());
    println!("{table}");
    std::fs::write(out_dir.join("bench.md"), &table)?;
    std::fs::write(out_dir.join("bench.csv"), csv(&rows))?;
    chart(&rows, &out_dir.join("bench.svg"))?;
    println!(
        "wrote {}: bench.md, bench.csv, bench.svg",
        out_dir.display()
    );
    Ok(())
}

fn summarize(specs: &[Spec], measured: &[Measured]) -> Vec<Row> {
    let throughput = |s: &Spec, m: &Measured| s.batch as f64 / (median(&m.step_ms) / 1e3);
    let baseline = |model: &str, batch: usize, threads: usize| {
        specs
            .iter()
            .zip(measured)
            .find(|(s, _)| {
                s.kind == "single" && s.model == model && s.batch == batch && s.threads == threads
            })
            .map(|(s, m)| throughput(s, m))
    };
    specs
        .iter()
        .zip(measured)
        .map(|(s, m)| {
            let efficiency = (s.kind != "single").then(|| {
                // One replica on 1/R of the cores at the per-replica batch.
                let per_replica = s.batch / s.replicas;
                let base = match s.replicas {
                    _ if s.device != "cpu" => None,
                    1 => baseline(&s.model, s.batch, cores()),
                    r if cores() / r == 1 => baseline(&s.model, per_replica, 1),
                    _ => None,
                };
                base.map(|b| throughput(s, m) / (s.replicas as f64 * b))
            });
            Row {
                spec: s.clone(),
                median_ms: median(&m.step_ms),
                samples_per_s: throughput(s, m),
                efficiency: efficiency.flatten(),
                phases: m
                    .phases
                    .iter()
                    .map(|(k, v)| (k.clone(), median(v)))
                    .collect(),
                grad_bytes: m.grad_bytes,
                memcpy_ms: m.memcpy_ms,
            }
        })
        .collect()
}

/// The issue's target figures for the MLP at global batch 256 on 2 replicas.
fn targets(rows: &[Row], torch: Option<&str>) -> String {
    let find = |kind: &str, replicas: usize, threads: usize| {
        rows.iter().find(|r| {
            r.spec.model == "mlp"
                && r.spec.batch == 256
                && r.spec.kind == kind
                && r.spec.replicas == replicas
                && (kind != "single" || r.spec.threads == threads)
        })
    };
    let (Some(dp), Some(ddp)) = (find("dp-fast", 2, 0), find("ddp", 2, 0)) else {
        return String::new();
    };
    let best_single = rows
        .iter()
        .filter(|r| r.spec.model == "mlp" && r.spec.batch == 256 && r.spec.kind == "single")
        .map(|r| r.samples_per_s)
        .fold(0.0, f64::max);
    let pct = |e: Option<f64>| e.map_or("n/a".to_string(), |e| format!("{:.0}%", 100.0 * e));
    let mut s =
        String::from("\n## Targets (MLP 784-1024-1024-10, global batch 256, 2 replicas)\n\n");
    s += &format!(
        "- scaling efficiency: DataParallel (fast path) {}, DDP {} (target >= 90%)\n",
        pct(dp.efficiency),
        pct(ddp.efficiency)
    );
    s += &format!(
        "- DataParallel / DDP throughput: {:.2} (target >= 0.95)\n",
        dp.samples_per_s / ddp.samples_per_s
    );
    s += &format!(
        "- DataParallel / best single-device configuration: {:.2} (target >= 1.0)\n",
        dp.samples_per_s / best_single
    );
    s += &format!("- engine overhead (all but forward, backward, optimizer): DataParallel {:.1}%, DDP {:.1}% (target <= 5%)\n", overhead_pct(dp), overhead_pct(ddp));
    if let Some(torch) = torch {
        for config in ["torch-ddp-gloo-2x1", "torch-1proc-2thr"] {
            if let Some(rate) = torch_rate(torch, config, 256) {
                s += &format!(
                    "- vs PyTorch {config} ({rate:.0} samples/s): DataParallel {:.2}x, DDP {:.2}x\n",
                    dp.samples_per_s / rate,
                    ddp.samples_per_s / rate
                );
            }
        }
    }
    s
}

/// PyTorch's samples/s for `config` at `batch`, from `bench_torch.py`'s CSV.
fn torch_rate(torch: &str, config: &str, batch: usize) -> Option<f64> {
    torch.lines().find_map(|l| {
        let f: Vec<&str> = l.split(',').collect();
        (f.first() == Some(&config) && f.get(2) == Some(&batch.to_string().as_str()))
            .then(|| f.get(5).and_then(|v| v.parse::<f64>().ok()))
            .flatten()
    })
}

/// DDP on 2 thread ranks against DDP on 2 MPI processes (and PyTorch DDP
/// over gloo, 2 processes x 1 thread, when its CSV is given): throughput,
/// scaling efficiency and the gradient all-reduce per step.
fn ddp_comparison(rows: &[Row], torch: Option<&str>) -> String {
    let ddp: Vec<&Row> = rows
        .iter()
        .filter(|r| r.spec.kind.starts_with("ddp") && r.spec.replicas == 2)
        .collect();
    if !ddp.iter().any(|r| r.spec.kind == "ddp-mpi") {
        return String::new();
    }
    let mut s = String::from(
        "\n## DDP on 2 processes (MPI) and on 2 thread ranks\n\n\
         | config | model | global batch | samples/s | vs PyTorch DDP-gloo 2x1 | scaling eff. | all-reduce ms/step | gradient MB | all-reduce GB/s | memcpy ms |\n\
         |---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in ddp {
        let torch_cell = torch
            .filter(|_| r.spec.model == "mlp")
            .and_then(|t| torch_rate(t, "torch-ddp-gloo-2x1", r.spec.batch))
            .map_or(String::new(), |rate| {
                format!("{:.2}x ({rate:.0})", r.samples_per_s / rate)
            });
        let reduce = r.phases.get("reduce").copied();
        let mb = r.grad_bytes.map(|b| b as f64 / 1e6);
        let gbps = reduce
            .zip(mb)
            .map_or(String::new(), |(ms, mb)| format!("{:.2}", mb / ms));
        s += &format!(
            "| {} | {} | {} | {:.0} | {} | {} | {} | {} | {} | {} |\n",
            r.spec.label(),
            r.spec.model,
            r.spec.batch,
            r.samples_per_s,
            torch_cell,
            r.efficiency
                .map_or(String::new(), |e| format!("{:.0}%", 100.0 * e)),
            reduce.map_or(String::new(), |v| format!("{v:.2}")),
            mb.map_or(String::new(), |v| format!("{v:.2}")),
            gbps,
            r.memcpy_ms.map_or(String::new(), |v| format!("{v:.2}")),
        );
    }
    s += "\nall-reduce GB/s: gradient bytes / all-reduce time (algorithm bandwidth); a ring moves 2(n-1)/n of them per rank.\n";
    s
}

/// Share of the step (percent) not spent in forward, backward (the
/// drop-in path's serial one included) or optimizer compute.
fn overhead_pct(r: &Row) -> f64 {
    let compute: f64 = ["forward", "backward", "optimizer", "backward-serial"]
        .iter()
        .filter_map(|k| r.phases.get(*k))
        .sum();
    100.0 * (r.median_ms - compute).max(0.0) / r.median_ms
}

const PHASES: [&str; 7] = [
    "scatter",
    "replicate",
    "forward",
    "backward",
    "reduce",
    "gather",
    "optimizer",
];

/// The phase times of a row in `PHASES` order (ms, `decimals` places); the
/// drop-in path's backward is the serial one on the caller's thread.
fn phase_cells(r: &Row, decimals: usize) -> Vec<String> {
    PHASES
        .iter()
        .map(|&k| {
            let key = if k == "backward" && r.phases.contains_key("backward-serial") {
                "backward-serial"
            } else {
                k
            };
            r.phases
                .get(key)
                .map_or(String::new(), |v| format!("{v:.decimals$}"))
        })
        .collect()
}

fn markdown(rows: &[Row]) -> String {
    let mut s = format!(
        "| config | model | global batch | replicas | median ms/step | samples/s | scaling eff. | {} | overhead |\n|{}\n",
        PHASES.join(" | "),
        "---|".repeat(8 + PHASES.len())
    );
    for r in rows {
        s += &format!(
            "| {} | {} | {} | {} | {:.2} | {:.0} | {} | {} | {:.1}% |\n",
            r.spec.label(),
            r.spec.model,
            r.spec.batch,
            r.spec.replicas,
            r.median_ms,
            r.samples_per_s,
            r.efficiency
                .map_or(String::new(), |e| format!("{:.0}%", 100.0 * e)),
            phase_cells(r, 2).join(" | "),
            overhead_pct(r)
        );
    }
    s
}

fn csv(rows: &[Row]) -> String {
    let mut s = format!(
        "config,model,global_batch,replicas,median_ms,samples_per_s,scaling_efficiency,{}\n",
        PHASES.join(",")
    );
    for r in rows {
        // The label holds a comma ("single, 2 thread(s)"): quote it.
        s += &format!(
            "\"{}\",{},{},{},{:.3},{:.1},{},{}\n",
            r.spec.label(),
            r.spec.model,
            r.spec.batch,
            r.spec.replicas,
            r.median_ms,
            r.samples_per_s,
            r.efficiency.map_or(String::new(), |e| format!("{e:.3}")),
            phase_cells(r, 3).join(",")
        );
    }
    s
}

/// Samples/s per configuration, one panel row per (model, batch).
fn chart(rows: &[Row], path: &Path) -> Result<()> {
    use plotters::prelude::*;
    let mut groups: Vec<(String, usize)> = Vec::new();
    for r in rows {
        let key = (r.spec.model.clone(), r.spec.batch);
        if !groups.contains(&key) && r.spec.kind != "single" {
            groups.push(key);
        }
    }
    let height = 260 * groups.len() as u32;
    let root = SVGBackend::new(path, (1000, height.max(260))).into_drawing_area();
    root.fill(&WHITE)?;
    for (area, (model, batch)) in root.split_evenly((groups.len(), 1)).iter().zip(&groups) {
        let group: Vec<&Row> = rows
            .iter()
            .filter(|r| &r.spec.model == model && r.spec.batch == *batch)
            .collect();
        let max = group.iter().map(|r| r.samples_per_s).fold(0.0, f64::max) * 1.15;
        let mut chart = ChartBuilder::on(area)
            .caption(
                format!("{model}, global batch {batch}: samples/s"),
                ("sans-serif", 16),
            )
            .margin(8)
            .x_label_area_size(20)
            .y_label_area_size(200)
            .build_cartesian_2d(0.0..max.max(1.0), (0..group.len()).into_segmented())?;
        chart
            .configure_mesh()
            .y_labels(group.len())
            .y_label_formatter(&|v| match v {
                SegmentValue::CenterOf(i) => {
                    group.get(*i).map_or(String::new(), |r| r.spec.label())
                }
                _ => String::new(),
            })
            .draw()?;
        chart.draw_series(group.iter().enumerate().map(|(i, r)| {
            let color = if r.spec.kind == "single" {
                BLUE.mix(0.6)
            } else if r.spec.kind == "ddp" {
                RED.mix(0.6)
            } else {
                GREEN.mix(0.6)
            };
            Rectangle::new(
                [
                    (0.0, SegmentValue::Exact(i)),
                    (r.samples_per_s, SegmentValue::Exact(i + 1)),
                ],
                color.filled(),
            )
        }))?;
    }
    root.present()?;
    Ok(())
}
