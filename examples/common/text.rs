//! The language model's data: the bytes of a public-domain book
//! (`data/text/`, its README says where from and how it is cut), as fixed
//! windows visited in PyTorch's `DistributedSampler` order.

use std::io::Read;

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use candle_dp::sampler::DistributedSampler;

/// The bundled text, as bytes.
pub fn load_text() -> Result<Vec<u8>> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../data/text/eighty-days.txt.gz"
    );
    let raw = std::fs::read(path).with_context(|| format!("reading {path}"))?;
    let mut text = Vec::new();
    flate2::read::GzDecoder::new(&raw[..])
        .read_to_end(&mut text)
        .with_context(|| format!("decompressing {path}"))?;
    Ok(text)
}

/// One part of the text cut into windows of `context + 1` bytes, one
/// every `context` bytes.
#[derive(Debug, Clone)]
pub struct Windows {
    bytes: Vec<u8>,
    context: usize,
}

impl Windows {
    pub fn new(bytes: &[u8], context: usize) -> Self {
        Self {
            bytes: bytes.to_vec(),
            context,
        }
    }

    /// How many whole windows there are.
    pub fn len(&self) -> usize {
        self.bytes.len().saturating_sub(1) / self.context
    }

    /// Whether there is no whole window.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Inputs and targets (u32, rows x context) of windows `indices`.
    pub fn batch(&self, indices: &[usize]) -> Result<(Tensor, Tensor)> {
        let t = self.context;
        let mut x = Vec::with_capacity(indices.len() * t);
        let mut y = Vec::with_capacity(indices.len() * t);
        for &i in indices {
            let window = &self.bytes[i * t..=(i + 1) * t];
            x.extend(window[..t].iter().map(|&b| u32::from(b)));
            y.extend(window[1..].iter().map(|&b| u32::from(b)));
        }
        let rows = indices.len();
        Ok((
            Tensor::from_vec(x, (rows, t), &Device::Cpu)?,
            Tensor::from_vec(y, (rows, t), &Device::Cpu)?,
        ))
    }
}

/// The training and held-out windows: the first 90% of the text and the
/// rest.
pub fn split(text: &[u8], context: usize) -> (Windows, Windows) {
    let cut = text.len() * 9 / 10;
    (
        Windows::new(&text[..cut], context),
        Windows::new(&text[cut..], context),
    )
}

/// The windows rank `rank` of `world` trains on at `step` (global,
/// from 0) with `per_rank` windows a step: PyTorch's `DistributedSampler`
/// (shuffled with `seed`, `set_epoch(epoch)` each pass), passes repeating
/// as long as the run lasts.
///
/// A pass is as many whole global batches (`per_rank * world` windows) as
/// the windows fill; the remainder is dropped. So the global batch of a
/// step is the same windows for every number of ranks, at every step:
/// every rank size shuffles the same `randperm`, the ranks' shares of a
/// step are its positions `step * global ..` dealt out, and the padding
/// `DistributedSampler` adds for the ranks lies past the last whole global
/// batch, never used (it would make two ranks repeat a window, and run a
/// step behind one device from the second pass on).
pub fn windows_at(
    train: &Windows,
    world: usize,
    rank: usize,
    seed: u64,
    per_rank: usize,
    step: u64,
) -> Result<Vec<usize>> {
    let mut sampler = DistributedSampler::new(train.len(), world, rank)?.seed(seed);
    let global = per_rank * world;
    if global == 0 || train.len() < global {
        anyhow::bail!(
            "a global batch of {global} windows ({per_rank} per rank x {world}) is more than the \
             {} windows of a pass",
            train.len()
        );
    }
    let per_epoch = (train.len() / global) as u64;
    sampler.set_epoch(step / per_epoch);
    let at = (step % per_epoch) as usize * per_rank;
    Ok(sampler.indices()[at..at + per_rank].to_vec())
}

/// [`windows_at`] of a global batch of `global` windows cut `shares`
/// ways: dealt out as `DistributedSampler` deals them, or, `consecutive`
/// (deterministic training, whose chunks are consecutive rows), share
/// `share`'s consecutive part of the step's global batch.
pub fn share_at(
    train: &Windows,
    (shares, share): (usize, usize),
    seed: u64,
    global: usize,
    step: u64,
    consecutive: bool,
) -> Result<Vec<usize>> {
    let per = global / shares.max(1);
    if !consecutive {
        return windows_at(train, shares, share, seed, per, step);
    }
    let all = windows_at(train, 1, 0, seed, per * shares, step)?;
    Ok(all[share * per..(share + 1) * per].to_vec())
}
