//! What can go wrong building datasets and loaders and loading batches.

/// Errors from building datasets and loaders and from loading batches.
#[derive(Debug, thiserror::Error)]
pub enum LoaderError {
    /// `batch_size` was 0.
    #[error("batch_size must be at least 1, got 0")]
    ZeroBatchSize,

    /// A [`TensorDataset`](super::TensorDataset) was given no tensor.
    #[error("TensorDataset needs at least one tensor (field)")]
    NoFields,

    /// A [`TensorDataset`](super::TensorDataset) field has no dim 0 to index.
    #[error("TensorDataset field {field} is a scalar (rank 0): every field needs the samples along dim 0")]
    ScalarField {
        /// Position of the field in the tensor list.
        field: usize,
    },

    /// [`TensorDataset`](super::TensorDataset) fields disagree on the number of samples.
    #[error("TensorDataset fields disagree on dim 0: field 0 has {expected} samples, field {field} has {found}")]
    FieldSizeMismatch {
        /// The offending field.
        field: usize,
        /// Dim 0 of field 0.
        expected: usize,
        /// Dim 0 of the offending field.
        found: usize,
    },

    /// An index is not below the dataset's length.
    #[error("index {index} is out of range for a dataset of length {len}")]
    IndexOutOfRange {
        /// The index asked for.
        index: usize,
        /// The dataset's length.
        len: usize,
    },

    /// [`Dataset::get`](super::Dataset::get) failed.
    #[error("loading sample {index} failed: {source}")]
    Sample {
        /// The dataset index of the sample.
        index: usize,
        /// What the dataset returned.
        source: candle_core::Error,
    },

    /// Samples of one batch have different numbers of fields.
    #[error("sample at position {position} of the batch has {found} fields, the first one has {expected}")]
    FieldCount {
        /// Position of the offending sample in the batch.
        position: usize,
        /// Number of fields of the first sample.
        expected: usize,
        /// Number of fields of the offending sample.
        found: usize,
    },

    /// Stacking (or gathering) one field of a batch failed, e.g. because the
    /// samples' shapes, dtypes or devices differ.
    #[error("collating field {field} of the batch failed: {source}")]
    Collate {
        /// The field.
        field: usize,
        /// The candle error.
        source: candle_core::Error,
    },

    /// [`collate`](super::collate) was given no sample.
    #[error("cannot collate an empty batch")]
    EmptyBatch,

    /// A full batch of `batch_size` cycled indices (with
    /// [`Loader::even_batches`](super::Loader::even_batches) or
    /// [`Loader::num_batches`](super::Loader::num_batches)) cannot be held
    /// in memory.
    #[error("cannot build a full batch of {batch_size} indices (even_batches / num_batches): too large to allocate")]
    BatchTooLarge {
        /// The batch size.
        batch_size: usize,
    },

    /// [`Loader::num_batches`](super::Loader::num_batches) or
    /// [`Loader::even_batches`](super::Loader::even_batches) asked for batches
    /// but there is no index to cycle through.
    #[error("{num_batches} batches were asked for but the index list is empty: nothing to cycle through")]
    NothingToCycle {
        /// The number of batches asked for.
        num_batches: usize,
    },

    /// The background prefetch thread could not be started.
    #[error("failed to spawn the prefetch thread: {0}")]
    Spawn(#[source] std::io::Error),

    /// The background prefetch thread panicked (inside the dataset).
    #[error("the prefetch thread panicked: {message}")]
    WorkerPanicked {
        /// The panic message, when it was a string.
        message: String,
    },
}
