//! The all-reduce part of the benchmark (`--all-reduce`): the gradient of
//! the benchmark's MLP (784-1024-1024-10, f32, 7.45 MB in 6 tensors)
//! averaged over 2 ranks, the way DDP reduces it, on thread ranks, on MPI
//! processes (candle-dp's `MpiGroup`), and with Open MPI's own
//! `MPI_Allreduce` on the same bytes, beside one memcpy of them.
//!
//! Each measurement runs in a child process (this binary with
//! `--all-reduce-child`, under `mpirun -np 2` for the MPI ones); every
//! call starts after a barrier, so the times are the collective's own and
//! not a late rank's. With `--cold-mib N`, each rank first writes N MiB of
//! its own before every call: in training the gradients come from a
//! backward pass that has filled the caches with other data, while
//! without it the same tensors are reduced call after call from the
//! caches.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::process::Command;
use std::thread;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_dp::comm::{ProcessGroup, ReduceOp, ThreadGroup};
use serde::{Deserialize, Serialize};

use crate::memory_floor::Evictor;
use crate::stats::median;

/// The shapes of the MLP's parameters, as DDP's buckets hold them.
const SHAPES: [&[usize]; 6] = [
    &[1024, 784],
    &[1024],
    &[1024, 1024],
    &[1024],
    &[10, 1024],
    &[10],
];

/// What a child measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Backend {
    /// Two thread ranks of a `ThreadGroup`, and a memcpy for scale.
    Threads,
    /// `MpiGroup` on 2 processes.
    Mpi,
    /// `MPI_Allreduce` (sum) on 2 processes, without candle-dp.
    MpiNative,
}

/// Milliseconds per call, by what was called.
pub type Times = BTreeMap<String, Vec<f64>>;

/// One child's measurement.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct ChildSpec {
    backend: Backend,
    iters: usize,
    cold_mib: usize,
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

/// This rank's gradients: other values on every rank.
fn gradients(rank: usize) -> Result<Vec<Tensor>> {
    SHAPES
        .iter()
        .enumerate()
        .map(|(i, shape)| {
            let n: usize = shape.iter().product();
            let t = Tensor::arange(0u32, n as u32, &Device::Cpu)?
                .to_dtype(DType::F32)?
                .affine(1e-3, (rank * 7 + i) as f64)?
                .sin()?
                .reshape(*shape)?;
            Ok(t)
        })
        .collect()
}

/// Times `iters` calls of DDP's reduction (`all_reduce_concat`, `Avg`),
/// of `all_reduce` on the flat gradient and of `reduce_scatter` of it into
/// one half per rank, on one rank of `pg`.
fn time_group(pg: &dyn ProcessGroup, iters: usize, cold_mib: usize) -> Result<Times> {
    let pieces = gradients(pg.rank())?;
    let flat = Tensor::cat(
        &pieces
            .iter()
            .map(Tensor::flatten_all)
            .collect::<candle_core::Result<Vec<_>>>()?,
        0,
    )?;
    let mut times = Times::new();
    let mut evictor = Evictor::new(cold_mib);
    for _ in 0..iters {
        evictor.evict();
        pg.barrier()?;
        let t = Instant::now();
        let out = pg.all_reduce_concat(&pieces, ReduceOp::Avg)?;
        let concat_ms = ms(t);
        drop(out);
        evictor.evict();
        pg.barrier()?;
        let t = Instant::now();
        let out = pg.all_reduce(&flat, ReduceOp::Sum)?;
        let flat_ms = ms(t);
        drop(out);
        // ZeRO-2's and FSDP's call: each rank gets only its half.
        evictor.evict();
        pg.barrier()?;
        let n = flat.elem_count();
        let counts: Vec<usize> = (0..pg.world_size())
            .map(|r| n / pg.world_size() + usize::from(r < n % pg.world_size()))
            .collect();
        let t = Instant::now();
        let out = pg.reduce_scatter(&flat, ReduceOp::Sum, &counts)?;
        let scatter_ms = ms(t);
        drop(out);
        times.entry("concat".into()).or_default().push(concat_ms);
        times.entry("flat".into()).or_default().push(flat_ms);
        times
            .entry("reduce_scatter".into())
            .or_default()
            .push(scatter_ms);
    }
    Ok(times)
}

/// The child side: measures `backend` and returns rank 0's times (`None`
/// on the other MPI ranks).
pub fn run_child(spec: ChildSpec) -> Result<Option<Times>> {
    let ChildSpec {
        backend,
        iters,
        cold_mib,
    } = spec;
    match backend {
        Backend::Threads => {
            let mut ranks = ThreadGroup::new(2);
            let rank1 = ranks.pop().context("two ranks")?;
            let rank0 = ranks.pop().context("two ranks")?;
            let partner = thread::spawn(move || time_group(&rank1, iters, cold_mib));
            let mut times = time_group(&rank0, iters, cold_mib)?;
            match partner.join() {
                Ok(result) => drop(result?),
                Err(_) => bail!("rank 1 panicked"),
            }
            let src = gradients(0)?
                .iter()
                .map(|t| t.flatten_all()?.to_vec1::<f32>())
                .collect::<candle_core::Result<Vec<_>>>()?
                .concat();
            let mut dst = vec![0f32; src.len()];
            let mut evictor = Evictor::new(cold_mib);
            for _ in 0..iters {
                evictor.evict();
                let t = Instant::now();
                dst.copy_from_slice(std::hint::black_box(&src));
                std::hint::black_box(&mut dst);
                times.entry("memcpy".into()).or_default().push(ms(t));
            }
            Ok(Some(times))
        }
        Backend::Mpi => mpi_child(iters, cold_mib),
        Backend::MpiNative => native_child(iters, cold_mib),
    }
}

#[cfg(feature = "mpi")]
fn mpi_child(iters: usize, cold_mib: usize) -> Result<Option<Times>> {
    let pg = candle_dp::comm::MpiGroup::init(Default::default())?;
    let times = time_group(pg.as_ref(), iters, cold_mib)?;
    Ok((pg.rank() == 0).then_some(times))
}

/// Open MPI's `MPI_Allreduce` on the flat gradient, as a floor to compare
/// with (it sums in its own order; candle-dp's ring keeps the thread
/// group's, bit for bit).
#[cfg(feature = "mpi")]
fn native_child(iters: usize, cold_mib: usize) -> Result<Option<Times>> {
    use mpi::collective::SystemOperation;
    use mpi::traits::*;
    let universe = mpi::initialize().context("MPI did not start")?;
    let world = universe.world();
    let rank = world.rank() as usize;
    let x: Vec<f32> = gradients(rank)?
        .iter()
        .map(|t| t.flatten_all()?.to_vec1::<f32>())
        .collect::<candle_core::Result<Vec<_>>>()?
        .concat();
    let mut y = vec![0f32; x.len()];
    let mut times = Times::new();
    let mut evictor = Evictor::new(cold_mib);
    for _ in 0..iters {
        evictor.evict();
        world.barrier();
        let t = Instant::now();
        world.all_reduce_into(&x[..], &mut y[..], SystemOperation::sum());
        times.entry("flat".into()).or_default().push(ms(t));
    }
    Ok((rank == 0).then_some(times))
}

#[cfg(not(feature = "mpi"))]
fn mpi_child(_: usize, _: usize) -> Result<Option<Times>> {
    bail!("the MPI measurements need a build with --features mpi")
}

#[cfg(not(feature = "mpi"))]
fn native_child(_: usize, _: usize) -> Result<Option<Times>> {
    bail!("the MPI measurements need a build with --features mpi")
}

fn run_in_child(spec: ChildSpec) -> Result<Times> {
    let mut cmd = if spec.backend == Backend::Threads {
        Command::new(std::env::current_exe()?)
    } else {
        crate::mpirun_this(2)?
    };
    cmd.arg("--all-reduce-child")
        .arg(serde_json::to_string(&spec)?);
    crate::child_answer(cmd, &format!("all-reduce {:?}", spec.backend))
}

/// The parent side: every backend over `rounds`, interleaved; returns the
/// markdown report.
pub fn run(iters: usize, rounds: usize, cold_mib: usize) -> Result<String> {
    let backends: &[Backend] = if cfg!(feature = "mpi") {
        &[Backend::Threads, Backend::Mpi, Backend::MpiNative]
    } else {
        &[Backend::Threads]
    };
    let mut all: BTreeMap<(usize, String), Vec<f64>> = BTreeMap::new();
    for round in 0..rounds {
        for (b, &backend) in backends.iter().enumerate() {
            eprintln!("all-reduce round {}/{rounds}: {backend:?}", round + 1);
            let spec = ChildSpec {
                backend,
                iters,
                cold_mib,
            };
            for (what, t) in run_in_child(spec)? {
                all.entry((b, what)).or_default().extend(t);
            }
        }
    }
    let bytes: usize = SHAPES
        .iter()
        .map(|s| s.iter().product::<usize>())
        .sum::<usize>()
        * 4;
    let caches = match cold_mib {
        0 => "warm caches (the same tensors call after call)".to_string(),
        mib => format!("cold caches (each rank writes {mib} MiB of its own before every call)"),
    };
    let mut out = String::new();
    writeln!(
        out,
        "All-reduce of the MLP's gradient ({:.2} MB f32 in {} tensors) over 2 ranks, \
         {iters} calls x {rounds} rounds, each after a barrier, {caches}; median and fastest ms.\n",
        bytes as f64 / 1e6,
        SHAPES.len()
    )?;
    writeln!(
        out,
        "| ranks | call | median ms | fastest ms | GB/s (median) |"
    )?;
    writeln!(out, "|---|---|---:|---:|---:|")?;
    for ((b, what), t) in &all {
        let (ranks, call) = match (backends[*b], what.as_str()) {
            (Backend::Threads, "memcpy") => ("-", "memcpy of the whole gradient"),
            (Backend::Threads, "concat") => ("2 threads", "all_reduce_concat Avg (DDP's call)"),
            (Backend::Threads, "reduce_scatter") => (
                "2 threads",
                "reduce_scatter Sum, a half each (ZeRO-2's, FSDP's)",
            ),
            (Backend::Mpi, "reduce_scatter") => (
                "2 MPI processes",
                "reduce_scatter Sum, a half each (ZeRO-2's, FSDP's)",
            ),
            (Backend::Threads, _) => ("2 threads", "all_reduce Sum, one flat tensor"),
            (Backend::Mpi, "concat") => ("2 MPI processes", "all_reduce_concat Avg (DDP's call)"),
            (Backend::Mpi, _) => ("2 MPI processes", "all_reduce Sum, one flat tensor"),
            (Backend::MpiNative, _) => (
                "2 MPI processes",
                "Open MPI's MPI_Allreduce Sum, flat buffer",
            ),
        };
        let med = median(t);
        let fastest = t.iter().copied().fold(f64::INFINITY, f64::min);
        writeln!(
            out,
            "| {ranks} | {call} | {med:.3} | {fastest:.3} | {:.2} |",
            bytes as f64 / med / 1e6
        )?;
    }
    Ok(out)
}
