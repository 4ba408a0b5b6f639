//! PyTorch's side of the MLP benchmark (`scripts/bench_torch.py`) run
//! inside the bench's rounds, one run of it a round before candle-dp's
//! configurations, so that both meet the same moments of a noisy
//! machine; its rates are then the medians over the rounds.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result};

use crate::stats::median;

/// One run of `bench_torch.py` (`--quick` with the quick plan): its CSV.
pub fn run_round(python: &Path, quick: bool, out: &Path, round: usize) -> Result<String> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/bench_torch.py");
    let csv = out.join(format!("torch-round-{round}.csv"));
    let mut cmd = Command::new(python);
    cmd.arg(script).arg("--csv").arg(&csv);
    if quick {
        cmd.arg("--quick");
    }
    crate::run_ok(&mut cmd, &format!("bench_torch.py (round {round})"))?;
    std::fs::read_to_string(&csv).with_context(|| format!("reading {}", csv.display()))
}

/// The rounds' CSVs as one, in the first's rows and columns: each row's
/// `median_ms` and `samples_per_s` the medians over the rounds of the
/// rows of its configuration and batch.
pub fn median_csv(rounds: &[String]) -> String {
    let rows = |csv: &str| -> Vec<Vec<String>> {
        csv.lines()
            .skip(1)
            .map(|l| l.split(',').map(str::to_string).collect())
            .collect()
    };
    let Some(first) = rounds.first() else {
        return String::new();
    };
    let mut out = first.lines().next().unwrap_or_default().to_string() + "\n";
    for mut row in rows(first) {
        let key = (row.first().cloned(), row.get(2).cloned());
        let same: Vec<Vec<String>> = rounds
            .iter()
            .flat_map(|csv| rows(csv))
            .filter(|r| (r.first().cloned(), r.get(2).cloned()) == key)
            .collect();
        for column in [4, 5] {
            let values: Vec<f64> = same
                .iter()
                .filter_map(|r| r.get(column)?.parse().ok())
                .collect();
            if let (false, Some(cell)) = (values.is_empty(), row.get_mut(column)) {
                *cell = format!("{:.3}", median(&values));
            }
        }
        out += &(row.join(",") + "\n");
    }
    out
}
