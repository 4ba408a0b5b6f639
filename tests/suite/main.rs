//! The integration tests, one module per subject, in one test binary:
//! each binary links candle, and one binary instead of 21 took about a
//! minute off a clean build of the suite on 2 cores (README, "The two
//! commands"). `cargo test --test suite pipeline::` runs one subject.
//!
//! The MPI tests (`tests/mpi.rs`, `tests/netcluster.rs`) stay binaries of
//! their own: `mpirun` starts them as the processes of a job.

#[path = "../common/mod.rs"]
mod common;
/// The examples' data sets (the digits, MNIST), which two subjects test,
/// and the language model and its data.
use candle_dp_examples::{datasets as example_datasets, gpt as example_gpt, text as example_text};

mod checkpoint;
mod clip;
mod collectives;
mod conformance;
mod custom_engine;
mod datasets;
mod ddp;
mod ddp_reference;
mod degrees;
mod deterministic;
mod dp_reference;
mod elastic;
mod equivalence;
mod errors;
mod example_flags;
mod fabric;
mod fsdp;
mod fused_linear;
mod grad_scaler;
mod hardening;
mod launch;
mod lm;
mod loader;
mod lr_schedule;
mod mesh;
mod nccl;
mod ops;
mod optim;
mod optim_groups;
mod overlap;
mod pipeline;
mod pipeline_fsdp;
mod pipeline_ranks;
mod pipeline_zero;
mod precision;
mod recipe;
mod resume;
mod sampler;
mod scatter_gather;
mod semantics;
mod subgroups;
mod tensor_parallel;
mod training_state;
mod zero;
