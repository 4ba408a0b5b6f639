//! What the memory allows a reduction: the time for `ranks` threads at
//! once to move the bytes of a thread-rank all-reduce (each reads its
//! chunk of every rank's gradient and writes the chunk's result, block by
//! block as the ring does) when none of those bytes is in a cache. DDP's
//! reduce phase is set beside it: near it, the reduction runs at the
//! memory's speed; below it, some of the gradients were still cached from
//! the backward that wrote them.

use std::hint::black_box;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use crate::stats::ms;

/// Memory a thread reads before each timed pass: twice the 32 MiB L3 of
/// the Zen 4 VM this was written on, so that none of the pass's data is
/// left in a cache.
const EVICT_MIB: usize = 64;

/// Timed passes per measurement.
const PASSES: usize = 7;

/// Elements reduced at a time, as the thread group's ring does
/// (`src/comm/ring.rs`), so that with more than two ranks the partial
/// result stays in cache between inputs.
const BLOCK: usize = 4096;

/// How long a thread waits for the others at the start of a pass before
/// the measurement is given up.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// Memory a thread writes before each call to push the data it is about
/// to read out of the caches (nothing when empty).
#[derive(Debug)]
pub struct Evictor {
    junk: Vec<u8>,
    pass: u8,
}

impl Evictor {
    pub fn new(mib: usize) -> Self {
        // Written, so that each page is memory of its own (untouched
        // zeroed memory would all read as the kernel's one zero page).
        Self {
            junk: vec![1; mib << 20],
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

    /// Reads one byte of every cache line of the buffer: the caches left
    /// full of lines that need no writing back when the next data comes.
    pub fn evict_clean(&self) {
        let sum = self
            .junk
            .iter()
            .step_by(64)
            .fold(0u8, |acc, &b| acc.wrapping_add(black_box(b)));
        black_box(sum);
    }
}

/// The time (ms) of each of a few passes in which `ranks` threads at
/// once sum `bytes` of f32 from each of `ranks` buffers, each thread its
/// chunk (split as the ring splits) into a result of its own, after every
/// thread read [`EVICT_MIB`] MiB of other memory; a pass lasts from the
/// first thread's start to the last one's end. The result is written where
/// the previous pass wrote it (the reduction writes a fresh allocation).
/// `None` for fewer than two ranks (no reduction), or when the threads did
/// not all start a pass within [`START_TIMEOUT`].
pub fn reduction_passes_ms(bytes: usize, ranks: usize) -> Option<Vec<f64>> {
    if ranks < 2 {
        return None;
    }
    let len = bytes / std::mem::size_of::<f32>();
    let inputs: Vec<Vec<f32>> = (0..ranks).map(|r| vec![r as f32 + 1.0; len]).collect();
    let arrived: Vec<AtomicUsize> = (0..PASSES).map(|_| AtomicUsize::new(0)).collect();
    let per_thread: Vec<Option<Vec<(Instant, Instant)>>> = thread::scope(|s| {
        let threads: Vec<_> = (0..ranks)
            .map(|rank| {
                let (inputs, arrived) = (&inputs, &arrived);
                s.spawn(move || {
                    let range = chunk(len, ranks, rank);
                    let mut out = vec![0f32; range.len()];
                    let evictor = Evictor::new(EVICT_MIB);
                    arrived
                        .iter()
                        .map(|count| {
                            evictor.evict_clean();
                            black_box(&mut out);
                            all_arrived(count, ranks)?;
                            let begun = Instant::now();
                            sum_chunks(&mut out, inputs, range.clone());
                            black_box(&out);
                            Some((begun, Instant::now()))
                        })
                        .collect()
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().ok().flatten())
            .collect()
    });
    let per_thread: Vec<Vec<(Instant, Instant)>> = per_thread.into_iter().collect::<Option<_>>()?;
    (0..PASSES)
        .map(|p| {
            let first = per_thread.iter().map(|t| t[p].0).min()?;
            let last = per_thread.iter().map(|t| t[p].1).max()?;
            Some(ms(last - first))
        })
        .collect()
}

/// Counts this thread in at `count`, then spins until all `ranks` are
/// (a spinning wait: a sleeping one would add its wake-up to the pass);
/// `None` if they are not within [`START_TIMEOUT`].
fn all_arrived(count: &AtomicUsize, ranks: usize) -> Option<()> {
    count.fetch_add(1, Ordering::AcqRel);
    let deadline = Instant::now() + START_TIMEOUT;
    while count.load(Ordering::Acquire) < ranks {
        if Instant::now() > deadline {
            return None;
        }
        std::hint::spin_loop();
    }
    Some(())
}

/// Chunk `c` of `len` elements over `ranks`: the first `len % ranks`
/// chunks one element longer, as the ring splits its buffer.
fn chunk(len: usize, ranks: usize, c: usize) -> Range<usize> {
    let (base, extra) = (len / ranks, len % ranks);
    let start = c * base + c.min(extra);
    start..start + base + usize::from(c < extra)
}

/// `out = x_0[range] + x_1[range] + …`, block by block: each block of the
/// first two written in one pass, as the two-rank reduction writes its
/// result, the others added into it while it is in cache.
fn sum_chunks(out: &mut [f32], inputs: &[Vec<f32>], range: Range<usize>) {
    for (b, out) in out.chunks_mut(BLOCK).enumerate() {
        let at = range.start + b * BLOCK..range.start + b * BLOCK + out.len();
        let (first, second) = (&inputs[0][at.clone()], &inputs[1][at.clone()]);
        for ((o, &a), &b) in out.iter_mut().zip(first).zip(second) {
            *o = a + b;
        }
        for x in &inputs[2..] {
            for (o, &v) in out.iter_mut().zip(&x[at.clone()]) {
                *o += v;
            }
        }
    }
}
