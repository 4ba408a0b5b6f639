//! What the examples print and draw around their one loop: a run's name,
//! its progress bar, the schedule flag, the weights' distance between two
//! runs, and the loss charts (SVG).

use std::path::Path;

use candle_core::Tensor;
use candle_dp::fabric::FabricConfig;
use candle_dp::launch::Backend;
use candle_dp::optim::LrScheduler;
use candle_nn::VarMap;
use indicatif::{ProgressBar, ProgressStyle};
use plotters::prelude::*;

/// The learning rate over the run (`--lr-schedule`).
#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
pub enum Schedule {
    /// The `--lr` throughout.
    Constant,
    /// A linear warm-up from 1% of `--lr` over `--warmup-steps`, then a
    /// cosine decay to 0 at the last step (PyTorch's SequentialLR of
    /// LinearLR and CosineAnnealingLR).
    WarmupCosine,
}

impl Schedule {
    /// The schedule of a run of `total` steps at peak rate `lr`, `None`
    /// for a constant rate; the warm-up 5% of the run (at least 1 step)
    /// unless given.
    pub fn over(
        self,
        lr: f64,
        warmup: Option<u64>,
        total: u64,
    ) -> anyhow::Result<Option<LrScheduler>> {
        match self {
            Schedule::Constant => Ok(None),
            Schedule::WarmupCosine => {
                let warmup = warmup.unwrap_or((total / 20).max(1));
                Ok(Some(LrScheduler::warmup_cosine(lr, warmup, total)?))
            }
        }
    }
}

/// How a run of `config` is named in a table: `DDP, 2 thread ranks`,
/// `DataParallel, 2 CPU replicas`, `FSDP, 4 MPI processes`, `one device`.
pub fn label(config: &FabricConfig) -> String {
    let strategy = config.effective_strategy();
    let n = config.devices.len();
    if strategy.name() == "single" {
        return "one device".into();
    }
    let on = match (strategy.is_distributed(), Backend::from_env()) {
        (false, _) => "CPU replicas".to_string(),
        (true, Backend::Threads) => "thread ranks".to_string(),
        (true, Backend::Mpi { .. }) => {
            return format!(
                "{}, {} MPI processes",
                strategy.title(),
                Backend::world_size()
            )
        }
    };
    format!("{}, {n} {on}", strategy.title())
}

/// A bar of `steps` steps on rank 0, hidden on the others.
pub fn progress_bar(steps: u64, prefix: String, rank: usize) -> anyhow::Result<ProgressBar> {
    if rank != 0 {
        return Ok(ProgressBar::hidden());
    }
    let bar = ProgressBar::new(steps);
    bar.set_style(
        ProgressStyle::with_template("{prefix:>12} [{bar:30}] {pos}/{len} steps  {msg}")?
            .progress_chars("=> "),
    );
    bar.set_prefix(prefix);
    Ok(bar)
}

/// The largest difference between two runs' weights of the same names.
pub fn max_weight_difference(a: &VarMap, b: &VarMap) -> anyhow::Result<f32> {
    let sorted = |v: &VarMap| -> anyhow::Result<Vec<(String, Tensor)>> {
        let data = v
            .data()
            .lock()
            .map_err(|_| anyhow::anyhow!("a poisoned VarMap"))?;
        let mut named: Vec<_> = data
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
            .collect();
        named.sort_by(|x, y| x.0.cmp(&y.0));
        Ok(named)
    };
    let mut most = 0f32;
    for ((_, x), (_, y)) in sorted(a)?.iter().zip(&sorted(b)?) {
        most = most.max((x - y)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?);
    }
    Ok(most)
}

/// One line of a chart: a run's name and its points.
pub type Curve = (String, Vec<(f64, f64)>);

/// A chart panel of `curves` titled `title`, wider lines first (runs that
/// agree, as they should, stay visible); `thick` curves are drawn at 3.
fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    (x_desc, y_desc): (&str, &str),
    curves: &[Curve],
    thick: &[Curve],
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let all = curves.iter().chain(thick).flat_map(|(_, p)| p.iter());
    let (x0, x1, top) = all.fold((f64::MAX, f64::MIN, 1e-3f64), |(a, b, t), &(x, y)| {
        (a.min(x), b.max(x), t.max(y))
    });
    let (x0, x1) = if x0 > x1 {
        (0.0, 1.0)
    } else {
        (x0, x1.max(x0 + 1.0))
    };
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 16))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(50)
        .build_cartesian_2d(x0..x1, 0f64..top * 1.05)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .draw()?;
    let colors = [RED, BLUE, GREEN];
    let widths = |i: usize| 6u32.saturating_sub(3 * i as u32).max(2);
    for (i, ((name, points), color)) in curves.iter().zip(colors.iter().cycle()).enumerate() {
        let style = color.stroke_width(if thick.is_empty() { widths(i) } else { 1 });
        chart
            .draw_series(LineSeries::new(points.iter().copied(), style))?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], style));
    }
    for ((_, points), color) in thick.iter().zip(colors.iter().cycle()) {
        chart.draw_series(LineSeries::new(
            points.iter().copied(),
            color.stroke_width(3),
        ))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

/// A chart's panel: its title, its axes' names, its thin curves and its
/// thick ones.
pub type Panel<'a> = (&'a str, (&'a str, &'a str), Vec<Curve>, Vec<Curve>);

/// An SVG at `path` of `panels` side by side.
pub fn chart(path: &Path, panels: &[Panel<'_>]) -> anyhow::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let width = 450 * panels.len().max(1) as u32;
    let root = SVGBackend::new(path, (width.max(720), 380)).into_drawing_area();
    root.fill(&WHITE)?;
    let areas = root.split_evenly((1, panels.len().max(1)));
    for ((title, axes, thin, thick), area) in panels.iter().zip(&areas) {
        panel(area, title, *axes, thin, thick)?;
    }
    root.present()?;
    Ok(())
}
