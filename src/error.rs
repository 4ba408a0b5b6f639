//! The crate's error type.
//!
//! Every variant names what went wrong and where: which replica, which
//! device, which parameter, which dimension. The data-parallel engine never
//! panics on bad input; it returns one of these.

use std::time::Duration;

/// Errors returned by `candle-dp`.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `DataParallel::new` was given an empty device list.
    #[error("no devices given: DataParallel needs at least one device (use candle_dp::cpu_devices(n) for CPU replicas)")]
    NoDevices,

    /// A CUDA device made with `Device::new_cuda`, whose work goes to the
    /// calling thread's default stream: several threads drive each device,
    /// and their streams would run unordered (see the README, GPUs).
    #[error("{role} {index} is on cuda:{ordinal} made with Device::new_cuda, whose work goes to each calling thread's own default stream; several threads drive this device, and their streams are not ordered with each other: create it with Device::new_cuda_with_stream({ordinal}), which gives it one stream")]
    ImplicitCudaStream {
        /// What the device is for: `replica`, `output device` or `stage`.
        role: &'static str,
        /// Its index among the devices given.
        index: usize,
        /// The GPU.
        ordinal: usize,
    },

    /// Two different CUDA devices (streams) on one GPU: candle's kernels
    /// record no CUDA events, so work on two streams of one GPU cannot be
    /// ordered (see the README, GPUs).
    #[error("{first} and {second} are two different devices (streams) on cuda:{ordinal}; candle's kernels record no CUDA events, so work on two streams of one GPU cannot be ordered: give the same Device for both (they share its stream), or one GPU each")]
    TwoStreamsOfOneGpu {
        /// The first of the two, e.g. `replica 0`.
        first: String,
        /// The second, e.g. `replica 1`.
        second: String,
        /// The GPU.
        ordinal: usize,
    },

    /// A master variable does not live on `devices[0]` (PyTorch: "module must
    /// have its parameters and buffers on device X").
    #[error("module must have its parameters and buffers on device {expected} (devices[0]), but `{name}` is on {found}")]
    MasterVarOnWrongDevice {
        /// The variable's name in the `VarMap`.
        name: String,
        /// Where it is.
        found: String,
        /// Where it must be.
        expected: String,
    },

    /// The user's model factory failed while building one replica.
    #[error("building replica {replica} on device {device} failed: {source}")]
    ReplicaBuild {
        /// Replica index (0 is the master's device).
        replica: usize,
        /// Device label, e.g. `cpu` or `cuda:1`.
        device: String,
        /// What the factory returned.
        source: candle_core::Error,
    },

    /// A replica asked for a variable the master model does not have, or
    /// with another shape: the factory is not deterministic.
    #[error("replica {replica} on device {device} asked for `{name}` with shape {shape:?}, which the master model {reason}: the model factory must build the same variables every time")]
    ReplicaVarMismatch {
        /// Replica index.
        replica: usize,
        /// Device label.
        device: String,
        /// Variable name.
        name: String,
        /// Shape the replica asked for.
        shape: Vec<usize>,
        /// What differs.
        reason: String,
    },

    /// The scatter dimension does not exist in one input tensor.
    #[error("scatter dim {dim} is out of range for input tensor #{leaf} of shape {shape:?} (rank {rank})")]
    ScatterDimOutOfRange {
        /// Requested dimension.
        dim: usize,
        /// Index of the tensor among the input's tensor leaves (depth-first order).
        leaf: usize,
        /// That tensor's rank.
        rank: usize,
        /// That tensor's shape.
        shape: Vec<usize>,
    },

    /// Tensors in one input have different sizes along the scatter dim.
    #[error("input tensors disagree on the scatter dim {dim}: tensor #0 has size {expected}, tensor #{leaf} has size {found} (shape {shape:?})")]
    ScatterSizeMismatch {
        /// The scatter dimension.
        dim: usize,
        /// Size of the first tensor leaf along `dim`.
        expected: usize,
        /// Index of the offending leaf (depth-first order).
        leaf: usize,
        /// Its size along `dim`.
        found: usize,
        /// Its shape.
        shape: Vec<usize>,
    },

    /// Explicit chunk sizes that do not fit the batch or the devices.
    #[error("invalid chunk sizes {sizes:?} for {len} rows on {devices} device(s): {reason}")]
    InvalidChunkSizes {
        /// The sizes given.
        sizes: Vec<usize>,
        /// Batch size along the scatter dim.
        len: usize,
        /// Number of devices.
        devices: usize,
        /// What is wrong with them.
        reason: &'static str,
    },

    /// A replica's work returned an error.
    #[error("in replica {replica} on device {device}: {source}")]
    Replica {
        /// Replica index.
        replica: usize,
        /// Device label.
        device: String,
        /// The original error.
        source: candle_core::Error,
    },

    /// A replica's work panicked. The panic was caught; the worker lives on.
    #[error("replica {replica} on device {device} panicked: {message}")]
    ReplicaPanic {
        /// Replica index.
        replica: usize,
        /// Device label.
        device: String,
        /// The panic payload, when it was a string.
        message: String,
    },

    /// A replica did not answer within the configured timeout.
    #[error("replica {replica} on device {device} did not finish within {timeout:?}")]
    ReplicaTimeout {
        /// Replica index.
        replica: usize,
        /// Device label.
        device: String,
        /// The timeout that expired.
        timeout: Duration,
    },

    /// A replica's worker thread is gone (it can only end when the
    /// `DataParallel` is dropped, so this is a bug or an abort).
    #[error("the worker thread of replica {replica} on device {device} is gone")]
    WorkerGone {
        /// Replica index.
        replica: usize,
        /// Device label.
        device: String,
    },

    /// Replica outputs that cannot be gathered.
    #[error("cannot gather the output of replica {replica}: {reason}")]
    Gather {
        /// The replica whose output does not fit replica 0's.
        replica: usize,
        /// What differs.
        reason: String,
    },

    /// `backward` was called with a tensor that is not the latest gathered
    /// output of this `DataParallel`.
    #[error("backward needs the gathered output of this DataParallel's most recent forward; {0}")]
    NoMatchingForward(String),

    /// A checkpoint that cannot be written or read, or does not match the
    /// model; the message starts with the file's path.
    #[error("checkpoint {0}")]
    Checkpoint(String),

    /// A [`Scatter`](crate::Scatter) implementation returned a number of
    /// parts other than the plan's number of replicas.
    #[error("scattering the input gave {found} parts for {expected} replicas: a Scatter implementation must return one part per replica")]
    ScatterParts {
        /// The plan's number of replicas.
        expected: usize,
        /// The number of parts returned.
        found: usize,
    },

    /// A collective between ranks failed (see [`CommError`](crate::comm::CommError)).
    #[error(transparent)]
    Comm(#[from] crate::comm::CommError),

    /// A [`DeviceMesh`](crate::comm::DeviceMesh) that does not fit.
    #[error(transparent)]
    Mesh(#[from] crate::comm::MeshError),

    /// Invalid sampler settings (see [`SamplerError`](crate::sampler::SamplerError)).
    #[error(transparent)]
    Sampler(#[from] crate::sampler::SamplerError),

    /// A loader failure (see [`LoaderError`](crate::loader::LoaderError)).
    #[error(transparent)]
    Loader(#[from] crate::loader::LoaderError),

    /// The ranks of a `DistributedDataParallel` built different models.
    #[error("the model on rank {rank} differs from rank 0's: it {detail}")]
    ModelMismatch {
        /// The first rank whose variables differ.
        rank: usize,
        /// Which variable, and how.
        detail: String,
    },

    /// Inside [`join`](crate::DistributedDataParallel::join), the ranks
    /// still training disagreed on whether this step synchronises: some
    /// called [`no_sync`](crate::DistributedDataParallel::no_sync), some
    /// did not. Every rank of the group returns this error for the step.
    #[error("inside join, rank(s) {not_syncing:?} ran this step inside no_sync while rank(s) {syncing:?} synchronise it: the ranks still training must agree (call no_sync on all of them or none)")]
    JoinSyncMismatch {
        /// The ranks still training that synchronise this step.
        syncing: Vec<usize>,
        /// The ranks still training inside `no_sync`.
        not_syncing: Vec<usize>,
    },

    /// An optimizer state that does not fit the optimizer it is loaded
    /// into (see [`StatefulOptimizer`](crate::optim::StatefulOptimizer)).
    #[error("optimizer state: {0}")]
    OptimizerState(String),

    /// ZeRO was used in a way it does not support (the message says how
    /// to use it instead).
    #[error("ZeRO: {0}")]
    Zero(String),

    /// A learning-rate schedule that cannot be built, stepped further, or
    /// loaded (see [`LrScheduler`](crate::optim::LrScheduler)).
    #[error("learning-rate schedule: {0}")]
    LrSchedule(String),

    /// Gradients that cannot be clipped as asked (see
    /// [`clip_grad_norm`](crate::optim::clip_grad_norm)).
    #[error("gradient clipping: {0}")]
    Clip(String),

    /// A loss scaler misused or given settings it cannot work with (see
    /// [`GradScaler`](crate::optim::GradScaler)).
    #[error("gradient scaler: {0}")]
    GradScaler(String),

    /// A [`DdpConfig::bucket_order`](crate::DdpConfig::bucket_order) that
    /// does not fit the model's parameters.
    #[error("DDP bucket order: {0}")]
    BucketOrder(String),

    /// A model given as [`Units`](crate::units::Units) that cannot be used
    /// as asked (no units; a unit that uses a parameter it did not ask its
    /// `VarBuilder` for).
    #[error("units: {0}")]
    Units(String),

    /// An overlapped gradient reduction failed: the bucket handed over
    /// after the backward of `unit` (or after the whole backward, `None`).
    /// Nothing was updated.
    #[error("on rank {rank}: the reduction of bucket {bucket} (ready after the backward of {}) failed: {source}", match unit { Some(u) => format!("unit {u}"), None => "every unit".to_string() })]
    OverlappedReduction {
        /// The rank reporting it.
        rank: usize,
        /// The bucket, in reduction order.
        bucket: usize,
        /// The unit whose backward made the bucket ready.
        unit: Option<usize>,
        /// What went wrong (often the group's failure, naming the rank
        /// that failed first).
        source: Box<Error>,
    },

    /// Fully sharded data parallelism cannot go on as asked (see
    /// [`fsdp`](crate::fsdp)).
    #[error("FSDP: {0}")]
    Fsdp(String),

    /// A mixed-precision policy that cannot apply (see
    /// [`MixedPrecision`](crate::precision::MixedPrecision)).
    #[error("mixed precision: {0}")]
    MixedPrecision(String),

    /// The ranks found different training states to resume from (see
    /// [`check_ranks_agree`](crate::training_state::check_ranks_agree)).
    #[error("rank {rank} would resume from {}, rank 0 from {}: every rank must resume from the same state (is the checkpoint directory shared by all of them?)", describe_step(*step), describe_step(*rank0_step))]
    ResumeMismatch {
        /// The first rank that differs from rank 0.
        rank: usize,
        /// Its step (`None`: it found no state).
        step: Option<u64>,
        /// Rank 0's step.
        rank0_step: Option<u64>,
    },

    /// An error on one rank, outside any collective.
    #[error("on rank {rank}: {source}")]
    Rank {
        /// The rank.
        rank: usize,
        /// What went wrong.
        source: Box<Error>,
    },

    /// A pipeline balance that does not fit the layers and stages.
    #[error("invalid pipeline balance for {layers} layers on {stages} stage(s): {reason}")]
    InvalidBalance {
        /// Number of layers.
        layers: usize,
        /// Number of stages (devices).
        stages: usize,
        /// What is wrong.
        reason: String,
    },

    /// A pipeline layer's factory failed.
    #[error("building pipeline layer {layer} failed: {source}")]
    LayerBuild {
        /// The layer's index in the model's list.
        layer: usize,
        /// What the factory returned.
        source: candle_core::Error,
    },

    /// A pipeline stage failed: which stage, on which device, in which
    /// micro-batch and phase. The stage named is the one that was
    /// computing, not the ones waiting for it.
    #[error("in pipeline stage {stage} on device {device}, {phase} of micro-batch {micro_batch}: {source}")]
    Stage {
        /// Stage index.
        stage: usize,
        /// Device label.
        device: String,
        /// Micro-batch index.
        micro_batch: usize,
        /// `forward`, `loss` or `backward`.
        phase: &'static str,
        /// The original error (a caught panic's message included), boxed
        /// to keep `Error` small.
        source: Box<candle_core::Error>,
    },

    /// The drop-in training forward of a [`Pipeline`](crate::pipeline::Pipeline)
    /// whose stage works on a copy of a variable that lives on another
    /// device: `loss.backward()` would leave that stage's gradient on the
    /// copy.
    #[error(
        "pipeline stage {stage} works on a copy of `{var}`, which lives on {device}: the drop-in training forward cannot return its gradient; train with `forward_backward`"
    )]
    DropInWithCopiedVar {
        /// Stage index.
        stage: usize,
        /// The variable's name.
        var: String,
        /// Where the variable lives.
        device: String,
    },

    /// A pipeline stage did not finish within the configured timeout.
    #[error("pipeline stage {stage} on device {device} did not finish within {timeout:?}{doing}")]
    StageTimeout {
        /// The stage that was computing when the time ran out.
        stage: usize,
        /// Device label.
        device: String,
        /// What it was doing (e.g. ", in the forward of micro-batch 3").
        doing: String,
        /// The timeout that expired.
        timeout: Duration,
    },

    /// Tensor parallelism that cannot split the model as asked: a size
    /// that does not divide among the ranks, a plan naming a parameter
    /// the model lacks (naming the dimension and the parameter).
    #[error("tensor parallelism: {0}")]
    TensorParallel(String),

    /// A [`FabricConfig`](crate::fabric::FabricConfig) that cannot be read
    /// (an unknown name, a malformed file).
    #[error("configuration: {0}")]
    Config(String),

    /// A strategy that cannot serve the model, the devices or the
    /// settings it was given, found before anything runs.
    #[error("strategy {strategy}: {reason}")]
    Strategy {
        /// The strategy, by name.
        strategy: String,
        /// What it cannot serve.
        reason: String,
    },

    /// A [`FabricModel`](crate::fabric::FabricModel) used out of order (a
    /// step without a backward, a resume that does not fit the run).
    #[error("fabric: {0}")]
    Fabric(String),

    /// The ranks of [`Fabric::launch`](crate::fabric::Fabric::launch)
    /// failed (the launcher's error names the rank).
    #[error(transparent)]
    Launch(#[from] Box<crate::launch::LaunchError>),

    /// The thread ranks of [`Fabric::launch`](crate::fabric::Fabric::launch)
    /// failed more often than
    /// [`FabricConfig::max_restarts`](crate::fabric::FabricConfig::max_restarts)
    /// allows.
    #[error(transparent)]
    Elastic(#[from] Box<crate::launch::ElasticError>),

    /// An error from candle outside any replica (gather, reduce, checkpoint I/O).
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

/// A resume point in an error message.
fn describe_step(step: Option<u64>) -> String {
    match step {
        Some(step) => format!("the state of step {step}"),
        None => "scratch (no state found)".into(),
    }
}
