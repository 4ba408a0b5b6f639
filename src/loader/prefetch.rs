//! Background prefetch: one thread loads a pass's batches ahead of the
//! caller, through a bounded channel.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam::channel::{self, Receiver, RecvTimeoutError, Sender};

use super::plan::Plan;
use super::{Batch, LoaderError};
use crate::util::panic_message::panic_message;

/// How long dropping a prefetching iterator waits for its background thread
/// to finish the batch it is loading before leaving it to exit on its own.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// The background thread of a prefetching pass and the caller's end of its
/// channel.
pub(super) struct Prefetcher {
    /// Batches in order; `None` once shut down.
    batches: Option<Receiver<Result<Batch, LoaderError>>>,
    /// Disconnects (never receives) when the thread has exited.
    exited: Receiver<()>,
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
    pub(super) remaining: usize,
}

impl Prefetcher {
    pub(super) fn spawn(plan: Plan, depth: usize) -> Result<Self, LoaderError> {
        // A channel deeper than the pass is never used, and a huge depth
        // (`prefetch(usize::MAX)`) could not be allocated.
        let depth = depth.min(plan.num_batches - plan.first).max(1);
        let (batch_tx, batch_rx) = channel::bounded(depth);
        let (exited_tx, exited_rx) = channel::bounded::<()>(0);
        let stop = Arc::new(AtomicBool::new(false));
        let remaining = plan.num_batches - plan.first;
        let thread_stop = Arc::clone(&stop);
        let handle = std::thread::Builder::new()
            .name("candle-dp-prefetch".into())
            .spawn(move || prefetch_worker(plan, batch_tx, thread_stop, exited_tx))
            .map_err(LoaderError::Spawn)?;
        Ok(Self {
            batches: Some(batch_rx),
            exited: exited_rx,
            stop,
            handle: Some(handle),
            remaining,
        })
    }

    pub(super) fn next(&mut self) -> Option<Result<Batch, LoaderError>> {
        if self.remaining == 0 {
            return None;
        }
        let batches = self.batches.as_ref()?;
        // The thread sends every batch it was asked for or exits (which
        // disconnects the channel), so this does not wait forever.
        match batches.recv() {
            Ok(item) => {
                self.remaining -= 1;
                Some(item)
            }
            Err(_) => {
                self.remaining = 0;
                let message = match self.handle.take().map(JoinHandle::join) {
                    Some(Err(payload)) => panic_message(payload.as_ref()),
                    _ => "the thread exited before sending every batch".to_string(),
                };
                Some(Err(LoaderError::WorkerPanicked { message }))
            }
        }
    }
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Closing the channel makes a pending or future send fail.
        self.batches = None;
        if let Some(handle) = self.handle.take() {
            // Give the thread a bounded time to finish the batch it is
            // loading; if the dataset is slower than that, leave it: it
            // exits as soon as that batch is loaded.
            if let Err(RecvTimeoutError::Disconnected) = self.exited.recv_timeout(SHUTDOWN_GRACE) {
                let _ = handle.join();
            }
        }
    }
}

/// Loads the plan's batches in order into `batches`; returns at the end,
/// after sending an error, when asked to stop or when the receiver is gone.
/// `_exited` is dropped when the thread exits, panicking or not.
fn prefetch_worker(
    plan: Plan,
    batches: Sender<Result<Batch, LoaderError>>,
    stop: Arc<AtomicBool>,
    _exited: Sender<()>,
) {
    for batch in plan.first..plan.num_batches {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let item = plan.load(batch);
        let failed = item.is_err();
        if batches.send(item).is_err() || failed {
            return;
        }
    }
}
