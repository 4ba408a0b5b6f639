//! Datasets and collation: samples as lists of tensors, stacked into batches.

use candle_core::{Device, Tensor};

use super::LoaderError;

/// One sample: one tensor per field, e.g. `vec![x, y]`.
pub type Sample = Vec<Tensor>;

/// One collated batch: one tensor per field, each with the batch as dim 0.
pub type Batch = Vec<Tensor>;
/// A map-style dataset: `len()` samples, fetched by index.
///
/// Implement [`get`](Self::get); override [`get_batch`](Self::get_batch)
/// when a whole batch can be loaded faster than sample by sample (as
/// [`TensorDataset`] does).
///
/// ```
/// use candle_core::{Device, Result, Tensor};
/// use candle_dp::loader::{Dataset, Sample};
///
/// /// Sample i is (x = [i, i], y = i % 2).
/// struct Parity;
/// impl Dataset for Parity {
///     fn len(&self) -> usize { 6 }
///     fn get(&self, i: usize) -> Result<Sample> {
///         let x = Tensor::new(&[i as f32, i as f32], &Device::Cpu)?;
///         let y = Tensor::new(i as u32 % 2, &Device::Cpu)?;
///         Ok(vec![x, y])
///     }
/// }
///
/// # fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
/// let batch = Parity.get_batch(&[1, 4])?;
/// assert_eq!(batch[0].dims(), &[2, 2]);
/// assert_eq!(batch[1].to_vec1::<u32>()?, vec![1, 0]);
/// # Ok(())
/// # }
/// ```
pub trait Dataset: Send + Sync {
    /// Number of samples.
    fn len(&self) -> usize;

    /// Whether the dataset has no sample.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sample `index` (`index < len()`), one tensor per field.
    fn get(&self, index: usize) -> candle_core::Result<Sample>;

    /// The samples at `indices`, collated: by default every sample is
    /// fetched with [`get`](Self::get) and the fields are stacked with
    /// [`collate`].
    fn get_batch(&self, indices: &[usize]) -> Result<Batch, LoaderError> {
        let samples = indices
            .iter()
            .map(|&index| {
                self.get(index)
                    .map_err(|source| LoaderError::Sample { index, source })
            })
            .collect::<Result<Vec<_>, _>>()?;
        collate(&samples)
    }
}

/// Stacks the samples field by field along a new dim 0 (`Tensor::stack`).
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_dp::loader::collate;
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let s = |v: f32| -> candle_core::Result<Vec<Tensor>> {
///     Ok(vec![Tensor::new(&[v, v], &Device::Cpu)?, Tensor::new(v as u32, &Device::Cpu)?])
/// };
/// let batch = collate(&[s(1.)?, s(2.)?, s(3.)?])?;
/// assert_eq!(batch[0].dims(), &[3, 2]);
/// assert_eq!(batch[1].to_vec1::<u32>()?, vec![1, 2, 3]);
/// # Ok(())
/// # }
/// ```
pub fn collate(samples: &[Sample]) -> Result<Batch, LoaderError> {
    let first = samples.first().ok_or(LoaderError::EmptyBatch)?;
    let expected = first.len();
    if let Some((position, sample)) = samples
        .iter()
        .enumerate()
        .find(|(_, sample)| sample.len() != expected)
    {
        return Err(LoaderError::FieldCount {
            position,
            expected,
            found: sample.len(),
        });
    }
    (0..expected)
        .map(|field| {
            let column: Vec<&Tensor> = samples.iter().map(|sample| &sample[field]).collect();
            Tensor::stack(&column, 0).map_err(|source| LoaderError::Collate { field, source })
        })
        .collect()
}

/// A dataset over tensors that share dim 0: sample `i` is row `i` of every
/// tensor (PyTorch's `TensorDataset`).
///
/// Batches are gathered with one `index_select` per field instead of
/// stacking rows one by one.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_dp::loader::{Dataset, TensorDataset};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let x = Tensor::zeros((5, 3), candle_core::DType::F32, &Device::Cpu)?;
/// let y = Tensor::zeros(4, candle_core::DType::U32, &Device::Cpu)?;
/// let err = TensorDataset::new(vec![x, y]).unwrap_err();
/// assert!(err.to_string().contains("field 1 has 4"));
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct TensorDataset {
    tensors: Vec<Tensor>,
    len: usize,
}

impl TensorDataset {
    /// A dataset over `tensors` (one per field). Fails if the list is empty,
    /// a tensor is a scalar, or the tensors' dim 0 sizes differ.
    pub fn new(tensors: Vec<Tensor>) -> Result<Self, LoaderError> {
        if tensors.is_empty() {
            return Err(LoaderError::NoFields);
        }
        let mut sizes = Vec::with_capacity(tensors.len());
        for (field, tensor) in tensors.iter().enumerate() {
            match tensor.dims().first() {
                Some(&size) => sizes.push(size),
                None => return Err(LoaderError::ScalarField { field }),
            }
        }
        let expected = sizes[0];
        if let Some((field, &found)) = sizes.iter().enumerate().find(|(_, &s)| s != expected) {
            return Err(LoaderError::FieldSizeMismatch {
                field,
                expected,
                found,
            });
        }
        Ok(Self {
            tensors,
            len: expected,
        })
    }

    /// The tensors, one per field.
    pub fn tensors(&self) -> &[Tensor] {
        &self.tensors
    }
}

impl Dataset for TensorDataset {
    fn len(&self) -> usize {
        self.len
    }

    fn get(&self, index: usize) -> candle_core::Result<Sample> {
        if index >= self.len {
            return Err(candle_core::Error::Msg(format!(
                "index {index} is out of range for a TensorDataset of length {}",
                self.len
            )));
        }
        self.tensors.iter().map(|t| t.get(index)).collect()
    }

    fn get_batch(&self, indices: &[usize]) -> Result<Batch, LoaderError> {
        if indices.is_empty() {
            return Err(LoaderError::EmptyBatch);
        }
        if let Some(&index) = indices.iter().find(|&&i| i >= self.len) {
            return Err(LoaderError::IndexOutOfRange {
                index,
                len: self.len,
            });
        }
        self.tensors
            .iter()
            .enumerate()
            .map(|(field, tensor)| {
                index_tensor(indices, tensor.device())
                    .and_then(|ids| tensor.index_select(&ids, 0))
                    .map_err(|source| LoaderError::Collate { field, source })
            })
            .collect()
    }
}

/// The indices as a 1-D tensor for `index_select`: `u32` when they fit,
/// `i64` otherwise.
fn index_tensor(indices: &[usize], device: &Device) -> candle_core::Result<Tensor> {
    let ids: Option<Vec<u32>> = indices.iter().map(|&i| u32::try_from(i).ok()).collect();
    match ids {
        Some(ids) => Tensor::new(ids.as_slice(), device),
        None => {
            let ids: Vec<i64> = indices.iter().map(|&i| i as i64).collect();
            Tensor::new(ids.as_slice(), device)
        }
    }
}
