//! Persistent per-device workers that run replica work in parallel.
//!
//! Mirrors `torch/nn/parallel/parallel_apply.py`, with two differences:
//! the threads live as long as the [`DataParallel`](crate::DataParallel)
//! (no thread is created per step), and the first failure is returned at
//! once instead of after joining every thread.
//!
//! Each worker owns its replica (so the model type need not be `Send`: it is
//! built on the worker and never leaves it) and runs inside its own rayon
//! pool. candle's CPU kernels (gemm and friends) parallelise over the current
//! rayon pool, so giving each replica a pool of `cores / replicas` threads
//! partitions the machine instead of oversubscribing it.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::Device;
use crossbeam::channel::{self, Receiver, RecvTimeoutError, Sender};

use crate::device_label::device_label;
use crate::error::{Error, Result};
use crate::panic_message::panic_message;
use crate::replicate::ReplicaVars;

/// What a worker owns: the user's model and the tensors that follow the master.
pub(crate) struct Replica<M> {
    pub(crate) model: M,
    pub(crate) vars: Arc<ReplicaVars>,
}

type Job<M> = Box<dyn FnOnce(&mut Replica<M>) + Send>;

/// One device's worker thread.
pub(crate) struct Worker<M> {
    jobs: Option<Sender<Job<M>>>,
    device: Device,
    // Kept so the pool lives as long as the worker loop that runs on it.
    _pool: rayon::ThreadPool,
}

impl<M> Worker<M> {
    /// Starts a worker for `device` with a pool of `threads` threads and
    /// builds its replica there with `build`.
    pub(crate) fn start(
        index: usize,
        device: &Device,
        threads: usize,
        timeout: Option<Duration>,
        build: impl FnOnce() -> Result<Replica<M>> + Send + 'static,
    ) -> Result<(Self, Arc<ReplicaVars>)>
    where
        M: 'static,
    {
        let label = device_label(device);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .thread_name(move |i| format!("candle-dp-{index}-{label}-{i}"))
            .build()
            .map_err(|e| {
                Error::Candle(candle_core::Error::Msg(format!(
                    "cannot start the thread pool of replica {index}: {e}"
                )))
            })?;
        let (jobs, queue) = channel::unbounded::<Job<M>>();
        let (built_tx, built_rx) = channel::bounded::<Result<Arc<ReplicaVars>>>(1);
        // The worker loop occupies one pool thread for the worker's whole
        // life; the pool's other threads (and this one, while it waits in a
        // join) run the parallel kernels of the replica's jobs.
        pool.spawn(move || {
            let replica = match catch_unwind(AssertUnwindSafe(build)) {
                Ok(Ok(replica)) => {
                    let _ = built_tx.send(Ok(replica.vars.clone()));
                    replica
                }
                Ok(Err(e)) => {
                    let _ = built_tx.send(Err(e));
                    return;
                }
                Err(panic) => {
                    let _ = built_tx.send(Err(Error::Candle(candle_core::Error::Msg(format!(
                        "the model factory panicked: {}",
                        panic_message(&*panic)
                    )))));
                    return;
                }
            };
            run_jobs(replica, queue);
        });
        let worker = Self {
            jobs: Some(jobs),
            device: device.clone(),
            _pool: pool,
        };
        // A factory that never returns is bounded by the step timeout (its
        // thread is left behind, as a stuck replica's is).
        let built = match timeout {
            Some(timeout) => built_rx.recv_timeout(timeout),
            None => built_rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
        };
        match built {
            Ok(Ok(vars)) => Ok((worker, vars)),
            Ok(Err(e)) => Err(e),
            Err(RecvTimeoutError::Timeout) => Err(Error::ReplicaTimeout {
                replica: index,
                device: device_label(device),
                timeout: timeout.unwrap_or_default(),
            }),
            Err(RecvTimeoutError::Disconnected) => Err(Error::WorkerGone {
                replica: index,
                device: device_label(device),
            }),
        }
    }

    pub(crate) fn device(&self) -> &Device {
        &self.device
    }
}

fn run_jobs<M>(mut replica: Replica<M>, queue: Receiver<Job<M>>) {
    // Ends when the `DataParallel` drops its sender.
    while let Ok(job) = queue.recv() {
        // Jobs catch their own panics (see `Workers::run`); this is a second
        // line of defence so the worker survives whatever a job does.
        let _ = catch_unwind(AssertUnwindSafe(|| job(&mut replica)));
    }
}

impl<M> Drop for Worker<M> {
    fn drop(&mut self) {
        // Closing the queue ends the worker loop; the pool then shuts down.
        self.jobs.take();
    }
}

/// Shared flag telling the replicas of one step that it was abandoned.
#[derive(Clone, Default)]
pub(crate) struct Cancel(Arc<AtomicBool>);

impl Cancel {
    pub(crate) fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed)
    }
}

enum Outcome<R> {
    Done(candle_core::Result<R>),
    Panicked(String),
    Skipped,
}

/// Runs `work(replica, input, cancel)` on the first `inputs.len()` workers
/// in parallel and returns their results in replica order, or the first
/// failure (naming the replica and its device) as soon as it happens; the
/// other replicas are told to stop at their next check of `cancel`.
pub(crate) fn parallel_apply<M, I, R, F>(
    workers: &[Worker<M>],
    inputs: Vec<I>,
    timeout: Option<Duration>,
    work: F,
) -> Result<Vec<R>>
where
    M: 'static,
    I: Send + 'static,
    R: Send + 'static,
    F: Fn(&mut Replica<M>, I, &Cancel) -> candle_core::Result<R> + Send + Sync + 'static,
{
    let count = inputs.len();
    let work = Arc::new(work);
    let cancel = Cancel::default();
    let (results_tx, results) = channel::unbounded::<(usize, Outcome<R>)>();
    for (index, (worker, input)) in workers.iter().zip(inputs).enumerate() {
        let (work, job_cancel, results_tx) = (work.clone(), cancel.clone(), results_tx.clone());
        let job: Job<M> = Box::new(move |replica| {
            let outcome = if job_cancel.is_cancelled() {
                Outcome::Skipped
            } else {
                match catch_unwind(AssertUnwindSafe(|| work(replica, input, &job_cancel))) {
                    Ok(result) => Outcome::Done(result),
                    Err(panic) => Outcome::Panicked(panic_message(&*panic)),
                }
            };
            // The caller may have returned already (another replica failed).
            let _ = results_tx.send((index, outcome));
        });
        let sent = worker.jobs.as_ref().map(|jobs| jobs.send(job));
        if !matches!(sent, Some(Ok(()))) {
            cancel.cancel();
            return Err(Error::WorkerGone {
                replica: index,
                device: device_label(worker.device()),
            });
        }
    }
    drop(results_tx);

    let deadline = timeout.map(|t| Instant::now() + t);
    let mut done: Vec<Option<R>> = (0..count).map(|_| None).collect();
    let label = |i: usize| device_label(workers[i].device());
    for _ in 0..count {
        let received = match deadline {
            Some(deadline) => results.recv_deadline(deadline),
            None => results.recv().map_err(|_| RecvTimeoutError::Disconnected),
        };
        let missing = || done.iter().position(Option::is_none).unwrap_or(0);
        let (replica, outcome) = match received {
            Ok(message) => message,
            Err(RecvTimeoutError::Timeout) => {
                cancel.cancel();
                let replica = missing();
                return Err(Error::ReplicaTimeout {
                    replica,
                    device: label(replica),
                    timeout: timeout.unwrap_or_default(),
                });
            }
            Err(RecvTimeoutError::Disconnected) => {
                cancel.cancel();
                let replica = missing();
                return Err(Error::WorkerGone {
                    replica,
                    device: label(replica),
                });
            }
        };
        match outcome {
            Outcome::Done(Ok(value)) => done[replica] = Some(value),
            Outcome::Done(Err(source)) => {
                cancel.cancel();
                return Err(Error::Replica {
                    replica,
                    device: label(replica),
                    source,
                });
            }
            Outcome::Panicked(message) => {
                cancel.cancel();
                return Err(Error::ReplicaPanic {
                    replica,
                    device: label(replica),
                    message,
                });
            }
            // Only possible after a cancel, which returns above first.
            Outcome::Skipped => {}
        }
    }
    // Every replica answered `Done` above (a skipped one implies a cancel,
    // which returned); a gap would be a worker that sent nothing.
    done.into_iter()
        .enumerate()
        .map(|(replica, value)| {
            value.ok_or_else(|| Error::WorkerGone {
                replica,
                device: label(replica),
            })
        })
        .collect()
}
