//! A batching data loader with optional background prefetch.
//!
//! A [`Dataset`] hands out samples, one tensor per field (e.g. `(x, y)`);
//! a [`Loader`] walks a list of indices (all of them by default, or one
//! rank's share from a [`DistributedSampler`](crate::sampler::DistributedSampler)),
//! cuts it into batches and collates each batch by stacking every field along
//! a new dim 0. With [`Loader::prefetch`] one background thread loads the next
//! batches while the caller trains on the current one.
//!
//! For distributed evaluation, [`Loader::num_batches`] makes every rank
//! produce the same number of batches (Accelerate's `even_batches`), and
//! [`drop_padding`] removes the samples the sampler and the loader repeated so
//! that a metric counts every sample exactly once (Accelerate's
//! `gather_for_metrics`).
//!
//! ```
//! use std::sync::Arc;
//! use candle_core::{Device, Tensor};
//! use candle_dp::loader::{Loader, TensorDataset};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let x = Tensor::arange(0f32, 30., &Device::Cpu)?.reshape((10, 3))?;
//! let y = Tensor::arange(0u32, 10, &Device::Cpu)?;
//! let dataset = Arc::new(TensorDataset::new(vec![x, y])?);
//!
//! let loader = Loader::new(dataset, 4)?.prefetch(2);
//! let sizes: Vec<usize> = loader
//!     .iter()
//!     .map(|batch| batch.map(|b| b[0].dim(0).unwrap()))
//!     .collect::<Result<_, _>>()?;
//! assert_eq!(sizes, vec![4, 4, 2]); // the last batch is short
//! # Ok(())
//! # }
//! ```

mod batching;
mod dataset;
mod error;
mod plan;
mod prefetch;

pub use batching::{batches_per_rank, drop_padding, Loader, LoaderIter};
pub use dataset::{collate, Batch, Dataset, Sample, TensorDataset};
pub use error::LoaderError;
