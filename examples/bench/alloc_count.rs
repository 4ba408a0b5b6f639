//! Counting the bytes the process has allocated, to measure what one
//! training step allocates at its peak (the mixed-precision rows).
//!
//! A global allocator wrapping the system's: while counting is on, every
//! allocation and release moves a running balance (bytes allocated minus
//! bytes released since counting started) and its peak; off, it costs one
//! relaxed load per call, so the other benchmarks and the timed steps are
//! not slowed.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering::Relaxed};

pub struct Counting;

static ON: AtomicBool = AtomicBool::new(false);
static BALANCE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

fn grew(by: usize) {
    if ON.load(Relaxed) {
        let by = by as isize;
        let now = BALANCE.fetch_add(by, Relaxed) + by;
        PEAK.fetch_max(now, Relaxed);
    }
}

fn shrank(by: usize) {
    if ON.load(Relaxed) {
        BALANCE.fetch_sub(by as isize, Relaxed);
    }
}

// SAFETY: every call is forwarded unchanged to `System`, which upholds
// `GlobalAlloc`'s contract; the counters only observe sizes. A `GlobalAlloc`
// cannot be written without `unsafe`, and no other way measures the bytes
// candle's tensors and temporaries take at the peak of a step.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        shrank(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            shrank(layout.size());
            grew(new_size);
        }
        p
    }
}

/// Starts counting from a balance of 0.
pub fn start() {
    BALANCE.store(0, Relaxed);
    PEAK.store(0, Relaxed);
    ON.store(true, Relaxed);
}

/// Stops counting; the most bytes held above the start at any moment since
/// [`start`].
pub fn stop_peak() -> usize {
    ON.store(false, Relaxed);
    PEAK.load(Relaxed).max(0) as usize
}
