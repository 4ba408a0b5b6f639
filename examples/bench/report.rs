//! The report of a run: one row per configuration (median step, samples/s,
//! scaling efficiency, phases), as a markdown table, CSV and SVG chart, the
//! issue's targets and the DDP comparison.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Result;

use crate::child::Measured;
use crate::mfu::{net_flops_per_sample, Peak};
use crate::plan::{cores, DeviceKind, Kind, Model, Spec};
use crate::stats::median;

/// One configuration's medians over all its rounds.
pub struct Row {
    pub spec: Spec,
    pub median_ms: f64,
    pub samples_per_s: f64,
    pub efficiency: Option<f64>,
    pub phases: BTreeMap<String, f64>,
    pub grad_bytes: Option<usize>,
    pub memcpy_ms: Option<f64>,
    /// The reduction's bytes with cold caches (ms, median over the passes
    /// of every round), [`Measured::cold_reduction_ms`].
    pub cold_reduction_ms: Option<f64>,
    /// The engine's overhead, [`overhead_per_step`].
    pub overhead_pct: f64,
}

pub fn summarize(specs: &[Spec], measured: &[Measured]) -> Vec<Row> {
    let throughput = |s: &Spec, m: &Measured| s.batch as f64 / (median(&m.step_ms) / 1e3);
    let baseline = |model: Model, batch: usize, threads: usize| {
        specs
            .iter()
            .zip(measured)
            .find(|(s, _)| {
                s.kind == Kind::Single
                    && s.model == model
                    && s.batch == batch
                    && s.threads == threads
            })
            .map(|(s, m)| throughput(s, m))
    };
    specs
        .iter()
        .zip(measured)
        .map(|(s, m)| {
            let efficiency = (s.kind != Kind::Single).then(|| {
                // One replica on 1/R of the cores at the per-replica batch.
                let per_replica = s.batch / s.replicas;
                let base = match s.replicas {
                    _ if s.device != DeviceKind::Cpu => None,
                    1 => baseline(s.model, s.batch, cores()),
                    r if cores() / r == 1 => baseline(s.model, per_replica, 1),
                    _ => None,
                };
                base.map(|b| throughput(s, m) / (s.replicas as f64 * b))
            });
            let mut row = Row {
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
                cold_reduction_ms: (!m.cold_reduction_ms.is_empty())
                    .then(|| median(&m.cold_reduction_ms)),
                overhead_pct: 0.0,
            };
            row.overhead_pct = overhead_per_step(m).unwrap_or_else(|| overhead_of_medians(&row));
            row
        })
        .collect()
}

/// The row of `kind` on `replicas` replicas at `model` and global `batch`.
fn find(rows: &[Row], model: Model, batch: usize, kind: Kind, replicas: usize) -> Option<&Row> {
    rows.iter().find(|r| {
        r.spec.model == model
            && r.spec.batch == batch
            && r.spec.kind == kind
            && r.spec.replicas == replicas
    })
}

/// The best single-device throughput at `model` and global `batch`, any
/// thread count (0 when none was measured).
fn best_single(rows: &[Row], model: Model, batch: usize) -> f64 {
    rows.iter()
        .filter(|r| r.spec.model == model && r.spec.batch == batch && r.spec.kind == Kind::Single)
        .map(|r| r.samples_per_s)
        .fold(0.0, f64::max)
}

/// PyTorch's two reference configurations in `bench_torch.py`'s CSV.
const TORCH_DDP: &str = "torch-ddp-gloo-2x1";
const TORCH_1PROC: &str = "torch-1proc-2thr";

/// The target figures: for the MLP at global batch 256 on 2
/// replicas as bullets, then a table for every model and batch measured.
pub fn targets(rows: &[Row], torch: Option<&str>) -> String {
    mlp_256_targets(rows, torch) + &targets_table(rows, torch)
}

fn mlp_256_targets(rows: &[Row], torch: Option<&str>) -> String {
    let find = |kind| find(rows, Model::Mlp, 256, kind, 2);
    let (Some(dp), Some(ddp)) = (find(Kind::DpFast), find(Kind::Ddp)) else {
        return String::new();
    };
    let best_single = best_single(rows, Model::Mlp, 256);
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
    s += &format!(
        "- engine overhead (all but forward, backward, optimizer; median over the steps): \
         DataParallel {:.1}%, DDP {:.1}% (target <= 5%); the median step less the phases' \
         medians: {:.1}%, {:.1}%\n",
        overhead_pct(dp),
        overhead_pct(ddp),
        overhead_of_medians(dp),
        overhead_of_medians(ddp)
    );
    if let (Some(cold), Some(reduce)) = (ddp.cold_reduction_ms, ddp.phases.get("reduce")) {
        if cold > 0.0 {
            s += &format!(
                "- DDP's reduce phase (the wait for the other rank included) against the time \
                 its bytes take with cold caches, 2 threads at once: {reduce:.2} ms against \
                 {cold:.2} ms ({:.2}x); that time is {:.1}% of the DDP step\n",
                reduce / cold,
                100.0 * cold / ddp.median_ms
            );
        }
    }
    if let Some(torch) = torch {
        for config in [TORCH_DDP, TORCH_1PROC] {
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

/// The targets at every (model, global batch) with DataParallel (fast path)
/// or DDP on thread ranks measured on 2 replicas; a cell is empty where its
/// configuration (or PyTorch's, MLP only) is missing.
fn targets_table(rows: &[Row], torch: Option<&str>) -> String {
    let mut groups: Vec<(Model, usize)> = Vec::new();
    for r in rows {
        let key = (r.spec.model, r.spec.batch);
        let measured = matches!(r.spec.kind, Kind::DpFast | Kind::Ddp) && r.spec.replicas == 2;
        if measured && !groups.contains(&key) {
            groups.push(key);
        }
    }
    if groups.is_empty() {
        return String::new();
    }
    let mut s = String::from(
        "\n## Targets at every model and global batch (2 replicas)\n\n\
         DP: DataParallel (fast path); DDP: on thread ranks; single: the best \
         single-device configuration at that batch (target >= 1.0); overhead: all but forward, \
         backward, optimizer (target <= 5%)",
    );
    let torch_columns = if torch.is_some() {
        s +=
            "; PyTorch: DDP over gloo (2 processes x 1 thread) and 1 process (2 threads), MLP only";
        " DP / PyTorch DDP-gloo | DDP / PyTorch DDP-gloo | DP / PyTorch 1-process | DDP / PyTorch 1-process |"
    } else {
        ""
    };
    let columns = 6 + if torch.is_some() { 4 } else { 0 };
    s += &format!(
        ".\n\n| model | global batch | DP / single | DDP / single | DP overhead | DDP overhead |{torch_columns}\n|{}\n",
        "---|".repeat(columns)
    );
    let ratio = |a: Option<f64>, b: Option<f64>| {
        a.zip(b.filter(|b| *b > 0.0))
            .map_or(String::new(), |(a, b)| format!("{:.2}", a / b))
    };
    for (model, batch) in groups {
        let dp = find(rows, model, batch, Kind::DpFast, 2);
        let ddp = find(rows, model, batch, Kind::Ddp, 2);
        let (dp_rate, ddp_rate) = (dp.map(|r| r.samples_per_s), ddp.map(|r| r.samples_per_s));
        let single = Some(best_single(rows, model, batch));
        let overhead =
            |r: Option<&Row>| r.map_or(String::new(), |r| format!("{:.1}%", overhead_pct(r)));
        s += &format!(
            "| {model} | {batch} | {} | {} | {} | {} |",
            ratio(dp_rate, single),
            ratio(ddp_rate, single),
            overhead(dp),
            overhead(ddp),
        );
        if let Some(torch) = torch {
            let rate = |config| {
                (model == Model::Mlp)
                    .then(|| torch_rate(torch, config, batch))
                    .flatten()
            };
            let (gloo, one_proc) = (rate(TORCH_DDP), rate(TORCH_1PROC));
            s += &format!(
                " {} | {} | {} | {} |",
                ratio(dp_rate, gloo),
                ratio(ddp_rate, gloo),
                ratio(dp_rate, one_proc),
                ratio(ddp_rate, one_proc),
            );
        }
        s += "\n";
    }
    s
}

/// Every row's (and PyTorch's MLP rows') GFLOP/s and its share of this
/// CPU's f32 peak ([`crate::mfu`]); the conv net's are not counted.
pub fn mfu_section(rows: &[Row], torch: Option<&str>) -> String {
    let peak = Peak::of_this_cpu();
    let mut s = String::from(
        "\n## How far from the CPU's peak\n\n\
         | config | model | global batch | samples/s | GFLOP/s | MFU |\n|---|---|---|---|---|---|\n",
    );
    let mut line = |label: &str, model: Model, batch: &str, rate: f64| {
        let (gflops, mfu) = peak.cells(net_flops_per_sample(model).map(|f| f * rate));
        s += &format!("| {label} | {model} | {batch} | {rate:.0} | {gflops} | {mfu} |\n");
    };
    for r in rows {
        line(
            &r.spec.label(),
            r.spec.model,
            &r.spec.batch.to_string(),
            r.samples_per_s,
        );
    }
    // PyTorch's rows: the MLP (`bench_torch.py` trains only it).
    for l in torch.into_iter().flat_map(str::lines).skip(1) {
        let f: Vec<&str> = l.split(',').collect();
        if let (Some(config), Some(batch), Some(rate)) = (
            f.first(),
            f.get(2),
            f.get(5).and_then(|v| v.parse::<f64>().ok()),
        ) {
            line(&format!("PyTorch {config}"), Model::Mlp, batch, rate);
        }
    }
    s + "\n" + &peak.describe() + ".\n"
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
pub fn ddp_comparison(rows: &[Row], torch: Option<&str>) -> String {
    let ddp: Vec<&Row> = rows
        .iter()
        .filter(|r| r.spec.kind.is_ddp() && r.spec.replicas == 2)
        .collect();
    if !ddp.iter().any(|r| r.spec.kind == Kind::DdpMpi) {
        return String::new();
    }
    let mut s = String::from(
        "\n## DDP on 2 processes (MPI) and on 2 thread ranks\n\n\
         | config | model | global batch | samples/s | vs PyTorch DDP-gloo 2x1 | scaling eff. | all-reduce ms/step | gradient MB | all-reduce GB/s | memcpy ms |\n\
         |---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in ddp {
        let torch_cell = torch
            .filter(|_| r.spec.model == Model::Mlp)
            .and_then(|t| torch_rate(t, TORCH_DDP, r.spec.batch))
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

/// The phases that are compute: forward, backward (the drop-in path's
/// serial one included) and the optimizer.
const COMPUTE: [&str; 4] = ["forward", "backward", "optimizer", "backward-serial"];

/// The engine's overhead of a row (percent).
fn overhead_pct(r: &Row) -> f64 {
    r.overhead_pct
}

/// The share (percent) of each step not spent in compute, median over the
/// steps: each step's compute against that step's own time. `None` where
/// the phases were not timed at every step.
///
/// The median step less the phases' medians ([`overhead_of_medians`])
/// mixes steps: a DDP run whose steps fell into two groups gave 12.7%
/// where each step's share had a median of 3.4%.
fn overhead_per_step(m: &Measured) -> Option<f64> {
    let steps = m.step_ms.len();
    let phases: Vec<&Vec<f64>> = COMPUTE.iter().filter_map(|k| m.phases.get(*k)).collect();
    if steps == 0 || phases.is_empty() || phases.iter().any(|p| p.len() != steps) {
        return None;
    }
    let shares: Vec<f64> = (0..steps)
        .map(|i| {
            let compute: f64 = phases.iter().map(|p| p[i]).sum();
            100.0 * (m.step_ms[i] - compute).max(0.0) / m.step_ms[i]
        })
        .collect();
    Some(median(&shares))
}

/// The median step less the medians of its compute phases, as a share
/// of the median step (percent).
fn overhead_of_medians(r: &Row) -> f64 {
    let compute: f64 = COMPUTE.iter().filter_map(|k| r.phases.get(*k)).sum();
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

/// The table formats a row is written in.
#[derive(Clone, Copy)]
enum Format {
    Markdown,
    Csv,
}

/// One row's cells up to the phases, in the columns both formats share;
/// only the precision, the efficiency's unit and the label's quoting differ.
fn row_cells(r: &Row, format: Format) -> Vec<String> {
    let (ms, rate, phase_decimals) = match format {
        Format::Markdown => (2, 0, 2),
        Format::Csv => (3, 1, 3),
    };
    let (label, efficiency) = match format {
        Format::Markdown => (
            r.spec.label(),
            r.efficiency.map(|e| format!("{:.0}%", 100.0 * e)),
        ),
        // The label holds a comma ("single, 2 thread(s)"): quote it.
        Format::Csv => (
            format!("\"{}\"", r.spec.label()),
            r.efficiency.map(|e| format!("{e:.3}")),
        ),
    };
    let mut cells = vec![
        label,
        r.spec.model.to_string(),
        r.spec.batch.to_string(),
        r.spec.replicas.to_string(),
        format!("{:.ms$}", r.median_ms),
        format!("{:.rate$}", r.samples_per_s),
        efficiency.unwrap_or_default(),
    ];
    cells.extend(phase_cells(r, phase_decimals));
    cells
}

pub fn markdown(rows: &[Row]) -> String {
    let mut s = format!(
        "| config | model | global batch | replicas | median ms/step | samples/s | scaling eff. | {} | overhead |\n|{}\n",
        PHASES.join(" | "),
        "---|".repeat(8 + PHASES.len())
    );
    for r in rows {
        let cells = row_cells(r, Format::Markdown).join(" | ");
        s += &format!("| {cells} | {:.1}% |\n", overhead_pct(r));
    }
    s
}

pub fn csv(rows: &[Row]) -> String {
    let mut s = format!(
        "config,model,global_batch,replicas,median_ms,samples_per_s,scaling_efficiency,{}\n",
        PHASES.join(",")
    );
    for r in rows {
        s += &(row_cells(r, Format::Csv).join(",") + "\n");
    }
    s
}

/// A bar's family: its colour and its legend entry.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Family {
    OneDevice,
    DataParallel,
    DdpThreads,
    DdpMpi,
    PyTorch,
}

impl Family {
    const ALL: [Family; 5] = [
        Family::OneDevice,
        Family::DataParallel,
        Family::DdpThreads,
        Family::DdpMpi,
        Family::PyTorch,
    ];

    fn of(kind: Kind) -> Family {
        match kind {
            Kind::Single => Family::OneDevice,
            Kind::DpFast | Kind::DpFromloss | Kind::DpDropin => Family::DataParallel,
            Kind::Ddp | Kind::DdpNccl => Family::DdpThreads,
            Kind::DdpMpi => Family::DdpMpi,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Family::OneDevice => "one device",
            Family::DataParallel => "DataParallel",
            Family::DdpThreads => "DDP, thread ranks",
            Family::DdpMpi => "DDP, MPI processes",
            Family::PyTorch => "PyTorch",
        }
    }

    fn color(self) -> plotters::style::RGBColor {
        use plotters::style::RGBColor;
        match self {
            Family::OneDevice => RGBColor(110, 110, 110),
            Family::DataParallel => RGBColor(46, 125, 50),
            Family::DdpThreads => RGBColor(21, 101, 192),
            Family::DdpMpi => RGBColor(106, 27, 154),
            Family::PyTorch => RGBColor(230, 81, 0),
        }
    }
}

/// One bar of the chart.
struct Bar {
    label: String,
    samples_per_s: f64,
    family: Family,
}

/// PyTorch's runs of `bench_torch.py`'s CSV for `model` at `batch`.
fn torch_bars(torch: &str, model: Model, batch: usize) -> Vec<Bar> {
    let name = match model {
        Model::Mlp | Model::MlpCandleOps => "MLP 784-1024-1024-10",
        Model::MlpWide => "MLP 784-4096-4096-10",
        Model::Conv => "conv",
    };
    torch
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            let same = f.get(1) == Some(&name) && f.get(2) == Some(&batch.to_string().as_str());
            same.then(|| {
                Some(Bar {
                    label: (*f.first()?).to_string(),
                    samples_per_s: f.get(5)?.parse().ok()?,
                    family: Family::PyTorch,
                })
            })
            .flatten()
        })
        .collect()
}

/// Samples/s of every configuration, one panel per model and global batch,
/// one colour per family (PyTorch's runs from `torch` included), each bar
/// with its value; `title` names the machine and the date.
pub fn chart(rows: &[Row], torch: Option<&str>, title: &str, path: &Path) -> Result<()> {
    use plotters::prelude::*;
    let mut groups: Vec<(Model, usize)> = Vec::new();
    for r in rows {
        let key = (r.spec.model, r.spec.batch);
        if !groups.contains(&key) && r.spec.kind != Kind::Single {
            groups.push(key);
        }
    }
    let panels: Vec<(String, Vec<Bar>)> = groups
        .iter()
        .map(|&(model, batch)| {
            let mut bars: Vec<Bar> = rows
                .iter()
                .filter(|r| r.spec.model == model && r.spec.batch == batch)
                .map(|r| Bar {
                    label: r.spec.label(),
                    samples_per_s: r.samples_per_s,
                    family: Family::of(r.spec.kind),
                })
                .collect();
            bars.extend(
                torch
                    .map(|t| torch_bars(t, model, batch))
                    .unwrap_or_default(),
            );
            (format!("{model}, global batch {batch}: samples/s"), bars)
        })
        .collect();
    let heights: Vec<u32> = panels
        .iter()
        .map(|(_, b)| 60 + 22 * b.len() as u32)
        .collect();
    let total = 70 + heights.iter().sum::<u32>();
    let root = SVGBackend::new(path, (1000, total)).into_drawing_area();
    root.fill(&WHITE)?;
    let (header, mut rest) = root.split_vertically(70);
    header.draw(&Text::new(title, (10, 8), ("sans-serif", 18).into_font()))?;
    // The legend: one swatch per family.
    for (i, family) in Family::ALL.iter().enumerate() {
        let x = 10 + 190 * i as i32;
        header.draw(&Rectangle::new(
            [(x, 40), (x + 14, 54)],
            family.color().filled(),
        ))?;
        header.draw(&Text::new(
            family.name(),
            (x + 20, 40),
            ("sans-serif", 14).into_font(),
        ))?;
    }
    for ((caption, bars), height) in panels.iter().zip(&heights) {
        let (area, below) = rest.split_vertically(*height);
        rest = below;
        let max = bars.iter().map(|b| b.samples_per_s).fold(0.0, f64::max) * 1.18;
        let mut chart = ChartBuilder::on(&area)
            .caption(caption, ("sans-serif", 16))
            .margin(8)
            .x_label_area_size(20)
            .y_label_area_size(220)
            .build_cartesian_2d(0.0..max.max(1.0), (0..bars.len()).into_segmented())?;
        chart
            .configure_mesh()
            .y_labels(bars.len())
            .y_label_formatter(&|v| match v {
                SegmentValue::CenterOf(i) => {
                    bars.get(*i).map_or(String::new(), |b| b.label.clone())
                }
                _ => String::new(),
            })
            .draw()?;
        chart.draw_series(bars.iter().enumerate().map(|(i, b)| {
            Rectangle::new(
                [
                    (0.0, SegmentValue::Exact(i)),
                    (b.samples_per_s, SegmentValue::Exact(i + 1)),
                ],
                b.family.color().mix(0.85).filled(),
            )
        }))?;
        chart.draw_series(bars.iter().enumerate().map(|(i, b)| {
            Text::new(
                format!("{:.0}", b.samples_per_s),
                (b.samples_per_s + max * 0.01, SegmentValue::CenterOf(i)),
                ("sans-serif", 13).into_font(),
            )
        }))?;
    }
    root.present()?;
    Ok(())
}
