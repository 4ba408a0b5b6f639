//! Sharing the CPU between the workers of one process (DataParallel
//! replicas, thread ranks, or one of them alone), which candle's CPU
//! kernels do not do by themselves.
//!
//! candle runs a CPU matmul on the current rayon pool, split into
//! `RAYON_NUM_THREADS` parts, and large elementwise ops on one
//! process-wide "barrier pool" of `CANDLE_NUM_THREADS - 1` spinning threads
//! that serves one caller at a time (the two variables are read apart). With several workers calling it at once, that pool serialises them
//! and its spinning threads take cores from them: on 2 cores, 2 replicas of
//! the benchmark's MLP took 43.5 ms per step with candle's defaults against
//! 19.8 ms with the pool empty (README, Performance).
//!
//! So each worker gets its own rayon pool of `cores / workers` threads, and
//! before any worker starts, [`share_cpu_between`] tells gemm to split each
//! matmul into that many parts and empties the barrier pool (elementwise ops
//! then run on the calling worker's thread), unless the user set
//! `RAYON_NUM_THREADS` or `CANDLE_NUM_THREADS` themselves. The cost: candle
//! code run outside the workers later in the same process (a single-device
//! run, the optimizer on DataParallel's master) gets the same settings. Processes started together on one
//! machine by `mpirun` divide its cores the same way
//! (`share_cpu_with_local_processes`, feature `mpi`).

use std::sync::Once;

/// The variable candle sizes its elementwise pool from (read once, when
/// the pool starts).
const CANDLE_NUM_THREADS: &str = "CANDLE_NUM_THREADS";

/// How many parts candle's matmul (gemm) splits its work into.
const RAYON_NUM_THREADS: &str = "RAYON_NUM_THREADS";

/// Sets `variable` to `value` unless the user set it; whether it did.
fn set_if_unset(variable: &str, value: &str) -> bool {
    if std::env::var_os(variable).is_some() {
        return false;
    }
    // A process-wide setting, changed only when the user left it unset and
    // asked for several workers, before they start. std's environment lock
    // guards it against Rust readers (candle reads it with `std::env::var`);
    // C code reading the environment on another thread at this moment
    // (`getenv`) is not guarded, which is why `set_var` is `unsafe` from
    // edition 2024. Users who start such threads first set both variables
    // themselves, and nothing is written here.
    std::env::set_var(variable, value);
    true
}

/// The cores this process may use.
pub(crate) fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Threads for each of `workers` workers sharing the cores: at least 1.
pub(crate) fn threads_per_worker(workers: usize) -> usize {
    (cores() / workers.max(1)).max(1)
}

/// Prepares candle for `workers` CPU workers running at once in this
/// process. Call it before the workers start.
///
/// Sets `RAYON_NUM_THREADS` to each worker's share of the cores (several
/// workers) and `CANDLE_NUM_THREADS=1` (any number, one included), each
/// only when the user has not set it. If candle's elementwise pool had
/// already started with threads for several workers (it starts at the
/// first large elementwise op, and cannot be resized), logs a warning once
/// that says how to avoid it.
///
/// One worker too: candle's elementwise pool spins a thread per further
/// core between ops, on the cores where the worker's rayon pool runs
/// candle's matmul and `candle_dp::ops`' kernels. With the pool empty the
/// language model's step on one device was faster in all five rounds
/// (ratios 1.02 to 1.52, median 1.13; 2-core AMD EPYC), and the MLP and
/// conv net's within noise (docs/notes/findings.md).
pub(crate) fn share_cpu_between(workers: usize) {
    if workers == 0 {
        return;
    }
    if workers == 1 {
        set_if_unset(CANDLE_NUM_THREADS, "1");
        return;
    }
    // gemm splits each matmul into RAYON_NUM_THREADS parts whatever pool it
    // runs in; more parts than the worker's pool has threads cost the conv
    // net 40% (25.5 against 17.8 ms per step, 2 replicas).
    set_if_unset(RAYON_NUM_THREADS, &threads_per_worker(workers).to_string());
    if !set_if_unset(CANDLE_NUM_THREADS, "1") {
        return;
    }
    let started_with = candle_core::utils::barrier_pool().n_workers();
    if started_with > 0 {
        static WARNED: Once = Once::new();
        WARNED.call_once(|| {
            tracing::warn!(
                "candle's elementwise thread pool started with {started_with} thread(s) before \
                 candle-dp could size it for {workers} workers; they will take turns on it \
                 (about 2x slower on CPU). Set CANDLE_NUM_THREADS=1 before the first candle op, \
                 or build the DataParallel (or start the ranks) first."
            );
        });
    }
}

/// Prepares candle for this process being one of `local` processes on its
/// machine (ranks started by `mpirun`): unless the user set them, sets
/// `RAYON_NUM_THREADS` and `CANDLE_NUM_THREADS` to this process's share of
/// the cores it may use, as `torchrun` sets `OMP_NUM_THREADS` for PyTorch.
/// Call it before the first candle op and before rayon's global pool
/// starts. When the launcher bound the process to some cores, the share is
/// of those (at least 1).
#[cfg(feature = "mpi")]
pub(crate) fn share_cpu_with_local_processes(local: usize) {
    if local <= 1 {
        return;
    }
    let threads = threads_per_worker(local).to_string();
    for variable in [RAYON_NUM_THREADS, CANDLE_NUM_THREADS] {
        set_if_unset(variable, &threads);
    }
}

/// A rayon pool of `threads` threads named `name-<i>`, for one worker's
/// parallel kernels.
pub(crate) fn worker_pool(
    name: String,
    threads: usize,
) -> Result<rayon::ThreadPool, rayon::ThreadPoolBuildError> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .thread_name(move |i| format!("{name}-{i}"))
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_worker_gets_at_least_one_thread() {
        assert_eq!(threads_per_worker(0), cores());
        assert_eq!(threads_per_worker(1), cores());
        assert_eq!(threads_per_worker(cores() * 4), 1);
    }
}
