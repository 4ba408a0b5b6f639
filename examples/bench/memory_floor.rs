//! What the memory alone allows a reduction: the time for `ranks` threads
//! at once to move the bytes of a thread-rank all-reduce (each reads its
//! chunk of every rank's gradient and writes the chunk's result) with the
//! caches cleared first. In a training step the forward and backward
//! have filled the caches with other data, so DDP's reduce phase is
//! compared with this, as the MFU compares a step's FLOPs with the peak.

use std::hint::black_box;
use std::sync::Barrier;
use std::thread;
use std::time::Instant;

use crate::stats::{median, ms};

/// Memory a thread writes before each timed pass: twice this VM's
/// 32 MiB L3, so that nothing of the previous pass is left in it.
const EVICT_MIB: usize = 64;

/// Timed passes per measurement.
const PASSES: usize = 7;

/// Memory a thread writes before each call to push the data it is about
/// to read out of the caches (nothing when empty).
#[derive(Debug)]
pub struct Evictor {
    junk: Vec<u8>,
    pass: u8,
}

impl Evictor {
    pub fn new(mib: usize) -> Self {
        Self {
            junk: vec![0; mib << 20],
            pass: 0,
        }
    }

    /// Writes one byte of every cache line of the buffer.
    pub fn evict(&mut self) {
        self.pass = self.pass.wrapping_add(1);
        for byte in self.junk.iter_mut().step_by(64) {
            *byte = self.pass;
        }
        black_box(&mut self.junk);
    }
}

/// The median time (ms) of `ranks` threads together summing `bytes` of
/// f32 from each of `ranks` buffers, each thread its `1/ranks` chunk into
/// a result of its own, every pass after clearing the caches; a pass
/// lasts until the last thread is done. `None` for fewer than two ranks
/// (no reduction) or a thread that panicked.
pub fn reduction_ms(bytes: usize, ranks: usize) -> Option<f64> {
    if ranks < 2 {
        return None;
    }
    let len = bytes / std::mem::size_of::<f32>();
    let chunk = len.div_ceil(ranks);
    let inputs: Vec<Vec<f32>> = (0..ranks).map(|r| vec![r as f32 + 1.0; len]).collect();
    let start = Barrier::new(ranks);
    let per_thread: Vec<Vec<(Instant, Instant)>> = thread::scope(|s| {
        let threads: Vec<_> = (0..ranks)
            .map(|rank| {
                let (inputs, start) = (&inputs, &start);
                s.spawn(move || {
                    let range = (rank * chunk).min(len)..((rank + 1) * chunk).min(len);
                    let mut out = vec![0f32; range.len()];
                    let mut evictor = Evictor::new(EVICT_MIB);
                    (0..PASSES)
                        .map(|_| {
                            evictor.evict();
                            black_box(&mut out);
                            start.wait();
                            let begun = Instant::now();
                            sum_chunks(&mut out, inputs, range.clone());
                            black_box(&out);
                            (begun, Instant::now())
                        })
                        .collect()
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().ok())
            .collect::<Vec<_>>()
    })
    .into_iter()
    .collect::<Option<_>>()?;
    let passes: Vec<f64> = (0..PASSES)
        .map(|p| {
            let first = per_thread.iter().map(|t| t[p].0).min();
            let last = per_thread.iter().map(|t| t[p].1).max();
            first
                .zip(last)
                .map_or(f64::NAN, |(first, last)| ms(last - first))
        })
        .collect();
    Some(median(&passes))
}

/// `out = x_0[range] + x_1[range] + …`: the first two in one pass, as
/// the two-rank reduction writes its result, the rest added into it.
fn sum_chunks(out: &mut [f32], inputs: &[Vec<f32>], range: std::ops::Range<usize>) {
    let (first, second) = (&inputs[0][range.clone()], &inputs[1][range.clone()]);
    for ((o, &a), &b) in out.iter_mut().zip(first).zip(second) {
        *o = a + b;
    }
    for x in &inputs[2..] {
        for (o, &v) in out.iter_mut().zip(&x[range.clone()]) {
            *o += v;
        }
    }
}
