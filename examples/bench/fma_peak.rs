//! The f32 peak as the cores deliver it: independent chains of fused
//! multiply-adds, 8 lanes wide, on every core at once. A VM may report only
//! its nominal clock while the cores boost above it (the Zen 4 VM of
//! 2026-12-02 showed 2.6 GHz and an MLP step at 98% of that peak), so the
//! MFU's formula peak is set beside this measurement.

use std::hint::black_box;
use std::thread;
use std::time::Instant;

use crate::stats::median;

/// Vectors of 8 lanes in flight: enough to cover an FMA's latency (4
/// cycles) on two pipes, few enough to stay in AVX2's 16 registers.
const CHAINS: usize = 12;
const LANES: usize = 8;

/// Rounds per thread and measurement (192 FLOPs each): about 30 ms at
/// 100 GFLOP/s a core.
const ROUNDS: usize = 16_000_000;

/// Measurements; the median is kept.
const TRIES: usize = 5;

/// GFLOP/s of `threads` threads running the FMA chains at once, from
/// the first thread's start to the last one's end (median of a few
/// tries), or `None` where the CPU has no AVX2 with FMA (the loop would
/// measure a library call, not the vector units) or a thread panicked.
pub fn measured_gflops(threads: usize) -> Option<f64> {
    if !has_fma8() || threads == 0 {
        return None;
    }
    let flops = (threads * ROUNDS * CHAINS * LANES * 2) as f64;
    let mut tries = Vec::with_capacity(TRIES);
    for _ in 0..TRIES {
        // No barrier: a thread that never came would hold the others;
        // the threads' start-up, microseconds against the loop's 30 ms,
        // counts in the time instead.
        let spans: Vec<(Instant, Instant)> = thread::scope(|s| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    s.spawn(|| {
                        let begun = Instant::now();
                        black_box(fma_chains(ROUNDS, black_box(0.999_9), black_box(1e-4)));
                        (begun, Instant::now())
                    })
                })
                .collect();
            workers
                .into_iter()
                .map(|w| w.join().ok())
                .collect::<Option<Vec<_>>>()
        })?;
        let first = spans.iter().map(|s| s.0).min()?;
        let last = spans.iter().map(|s| s.1).max()?;
        tries.push(flops / (last - first).as_secs_f64() / 1e9);
    }
    Some(median(&tries))
}

#[cfg(target_arch = "x86_64")]
fn has_fma8() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
}

#[cfg(not(target_arch = "x86_64"))]
fn has_fma8() -> bool {
    false
}

/// `x = x * m + c` on `CHAINS x LANES` independent values, `rounds` times;
/// their sum, so that nothing is left unused. Compiled for AVX2 with FMA,
/// where one statement of the inner loop is one `vfmadd` on a `ymm`
/// register.
#[multiversion::multiversion(targets("x86_64+avx2+fma"))]
fn fma_chains(rounds: usize, m: f32, c: f32) -> f32 {
    let mut acc = [[1.0f32; LANES]; CHAINS];
    for _ in 0..rounds {
        for chain in acc.iter_mut() {
            for x in chain.iter_mut() {
                *x = x.mul_add(m, c);
            }
        }
    }
    acc.iter().flatten().sum()
}
