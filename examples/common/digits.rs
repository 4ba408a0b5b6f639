//! The digit classifier of `train_digits`, written once as units (each
//! layer with what follows it up to the next), which every strategy
//! builds: a small conv net or an MLP, on images given as flattened rows.

use std::path::Path;

use candle_core::{DType, Device, Module, Tensor};
use candle_dp::fabric::Precision;
use candle_dp::pipeline::{unit, UnitFactory};
use candle_dp::precision::{MixedPrecision, MixedPrecisionModel};
use candle_dp::units::Units;
use candle_nn::{conv2d, linear, Conv2d, Conv2dConfig, Linear, VarMap};

use crate::datasets::{load_digits, load_mnist, shuffled_indices, LabelledImages};
use crate::report::{self, Curve};

/// Which model the job trains.
#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
pub enum Model {
    /// Two convolutions and a linear layer (`--hidden` channels first).
    Conv,
    /// One hidden layer of `--hidden` units.
    Mlp,
}

impl Model {
    /// Its width when none is given: 8 channels, 256 hidden units.
    pub fn default_hidden(self) -> usize {
        match self {
            Model::Conv => 8,
            Model::Mlp => 256,
        }
    }

    /// The model as units for `height` x `width` images: conv(1 -> c, 3x3)
    /// -> relu -> conv(c -> 2c, 3x3) -> relu -> maxpool 2 -> linear to 10,
    /// or linear -> relu -> linear to 10.
    pub fn units(self, height: usize, width: usize, hidden: usize) -> Vec<UnitFactory> {
        let c = hidden;
        let same = Conv2dConfig {
            padding: 1,
            ..Default::default()
        };
        match self {
            Model::Mlp => vec![
                unit(move |vb| Ok(Dense(linear(height * width, hidden, vb.pp("l1"))?, true))),
                unit(move |vb| Ok(Dense(linear(hidden, 10, vb.pp("l2"))?, false))),
            ],
            Model::Conv => vec![
                unit(move |vb| {
                    let conv = conv2d(1, c, 3, same, vb.pp("conv1"))?;
                    Ok(ConvUnit(conv, Some((height, width)), false))
                }),
                unit(move |vb| {
                    Ok(ConvUnit(
                        conv2d(c, 2 * c, 3, same, vb.pp("conv2"))?,
                        None,
                        true,
                    ))
                }),
                unit(move |vb| {
                    let fc = linear(2 * c * (height / 2) * (width / 2), 10, vb.pp("fc"))?;
                    Ok(Dense(fc, false))
                }),
            ],
        }
    }

    /// The model in words, for `pixels`-pixel images.
    pub fn describe(self, pixels: usize, hidden: usize) -> String {
        match self {
            Model::Mlp => format!("MLP {pixels}-{hidden}-10"),
            Model::Conv => format!(
                "conv net (conv 3x3 1-{hidden}, conv 3x3 {hidden}-{}, maxpool 2, linear to 10)",
                2 * hidden
            ),
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

/// The share of `test` that `units` over `varmap`'s f32 weights, computing
/// in `precision`, classifies right.
pub fn accuracy(
    units: &[UnitFactory],
    varmap: &VarMap,
    precision: Precision,
    test: &LabelledImages,
) -> anyhow::Result<f64> {
    let policy = precision
        .policy()
        .unwrap_or_else(|| MixedPrecision::new(DType::F32));
    let parts = units.to_vec();
    let model = MixedPrecisionModel::new(varmap, DType::F32, &Device::Cpu, policy, move |vb| {
        Units::build(vb, &parts).map_err(candle_core::Error::wrap)
    })?;
    let predictions = model.forward_t(&test.images, false)?.argmax(1)?;
    let correct = predictions
        .eq(&test.labels)?
        .to_dtype(DType::F32)?
        .sum_all()?
        .to_scalar::<f32>()?;
    Ok(f64::from(correct) / test.len() as f64)
}

/// `name: N training and M held-out samples of HxW pixels`.
pub fn describe(name: &str, train: &LabelledImages, test: &LabelledImages) -> String {
    let (n, m, h, w) = (train.len(), test.len(), train.height, train.width);
    format!("{name}: {n} training and {m} held-out samples of {h}x{w} pixels")
}

/// What a run of `train_digits` reports (rank 0's).
pub struct Outcome {
    /// Training time, evaluations excluded.
    pub seconds: f64,
    /// Samples trained on, every rank's.
    pub samples: usize,
    /// The last step's loss over its global batch.
    pub last_loss: f32,
    /// The held-out accuracy at the end.
    pub accuracy: f64,
    /// Per epoch: the mean loss of the global batches, the held-out accuracy.
    pub history: Vec<(f32, f64)>,
    /// The trained weights.
    pub varmap: VarMap,
    /// Steps the f16 loss scaler skipped.
    pub skipped: u64,
}

/// The train and held-out sets, and their name: MNIST's IDX files in
/// `mnist`, or the bundled 8x8 digits split 80/20 in `seed`'s order.
pub fn load(
    mnist: Option<&str>,
    seed: u64,
) -> anyhow::Result<(LabelledImages, LabelledImages, String)> {
    if let Some(dir) = mnist {
        let name = format!("MNIST from {dir}");
        return Ok((load_mnist(dir, true)?, load_mnist(dir, false)?, name));
    }
    let all = load_digits(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../data/digits/digits.csv.gz"
    ))?;
    let order = shuffled_indices(all.len(), seed);
    let cut = all.len() * 4 / 5;
    let name = "8x8 digits (scikit-learn)".to_string();
    Ok((all.select(&order[..cut])?, all.select(&order[cut..])?, name))
}

/// The runs' table, how the parallel run (first) compares with one
/// device's (`same_batches`: both trained on the same batches), and the
/// chart of their epochs at `chart`.
pub fn compare(
    runs: &[(String, Outcome)],
    same_batches: bool,
    saved: Option<&Path>,
    chart: &Path,
) -> anyhow::Result<()> {
    println!("\n| run | final loss | held-out accuracy | train time (s) | samples/s |");
    println!("|---|---|---|---|---|");
    for (label, o) in runs {
        let rate = o.samples as f64 / o.seconds;
        let accuracy = 100.0 * o.accuracy;
        println!(
            "| {label} | {:.4} | {accuracy:.2}% | {:.2} | {rate:.0} |",
            o.last_loss, o.seconds
        );
    }
    if let [(_, p), (_, one)] = runs {
        println!(
            "\nspeed-up over one device: {:.2}x",
            one.seconds / p.seconds
        );
        let diff = report::max_weight_difference(&p.varmap, &one.varmap)?;
        let note = match same_batches {
            true => "same init, same batches",
            false => "same init; DDP's sampler orders the data its own way",
        };
        println!("largest weight difference from the one-device run: {diff:.3e} ({note})");
    }
    for (label, o) in runs.iter().filter(|(_, o)| o.skipped > 0) {
        let skipped = o.skipped;
        println!(
            "{label}: the f16 loss scaler skipped {skipped} steps (gradients past f16's range)"
        );
    }
    if let Some(path) = saved {
        println!("weights saved to {}", path.display());
    }
    let curve = |f: fn(&(f32, f64)) -> f64| -> Vec<Curve> {
        let points = |o: &Outcome| {
            let epochs = o.history.iter().enumerate();
            epochs.map(|(i, e)| ((i + 1) as f64, f(e))).collect()
        };
        runs.iter()
            .map(|(label, o)| (label.clone(), points(o)))
            .collect()
    };
    let loss = curve(|e| f64::from(e.0));
    let accuracy = curve(|e| e.1);
    report::chart(
        chart,
        &[
            ("training loss (epoch mean)", ("epoch", ""), loss, vec![]),
            ("held-out accuracy", ("epoch", ""), accuracy, vec![]),
        ],
    )?;
    println!("loss and accuracy per epoch: {}", chart.display());
    Ok(())
}
