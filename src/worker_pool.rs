//! A pool of persistent worker threads, one per device, each owning a state
//! built on it and running jobs on that state in parallel.
//!
//! [`DataParallel`](crate::DataParallel) keeps one replica per worker and
//! runs every step's replica work here: `torch/nn/parallel/parallel_apply.py`,
//! with two differences: the threads live as long as the pool (no thread is
//! created per step), and the first failure is returned at once instead of
//! after joining every thread.
//!
//! A worker's state is built on the worker and never leaves it, so it need
//! not be `Send`. Each worker runs inside its own rayon pool: candle's CPU
//! kernels (gemm and friends) parallelise over the current rayon pool, so
//! giving each worker a pool of `cores / workers` threads partitions the
//! machine instead of oversubscribing it.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::Device;
use crossbeam::channel::{self, Receiver, RecvTimeoutError, Sender};

use crate::util::device_label::device_label;
use crate::util::panic_message::panic_message;

/// Why a worker produced no value.
#[derive(Debug)]
pub(crate) enum Failure<E> {
    /// The job (or the state's initialisation) returned this error.
    Error(E),
    /// The job (or the initialisation) panicked; the worker lives on.
    Panic(String),
    /// The worker did not answer.
    NoAnswer(NoAnswer),
}

/// Why a worker did not answer.
#[derive(Debug)]
pub(crate) enum NoAnswer {
    /// Not within the deadline (the configured timeout).
    Timeout(Duration),
    /// Its thread is gone.
    Gone,
    /// Its thread pool could not be started.
    NoThreadPool(String),
}

impl<E> From<NoAnswer> for Failure<E> {
    fn from(why: NoAnswer) -> Self {
        Failure::NoAnswer(why)
    }
}

/// The first failure of a [`WorkerPool::start`] or [`WorkerPool::run`]: which
/// worker, on which device, and why.
#[derive(Debug)]
pub(crate) struct WorkerFailure<E> {
    /// The worker's index (its device's position).
    pub(crate) worker: usize,
    /// Its device's label.
    pub(crate) device: String,
    pub(crate) failure: Failure<E>,
}

/// Shared flag telling the jobs of one run that it was abandoned.
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

type Job<S> = Box<dyn FnOnce(&mut S) + Send>;

/// One device's worker thread.
struct Worker<S> {
    jobs: Option<Sender<Job<S>>>,
    device: Device,
    // Kept so the pool lives as long as the worker loop that runs on it.
    _pool: rayon::ThreadPool,
}

impl<S: 'static> Worker<S> {
    /// Starts worker `index` for `device` with a pool of `threads` threads
    /// and builds its state there with `init`, which also returns a value
    /// for the caller. With a `timeout`, `init` must finish within it.
    fn start<T, E>(
        index: usize,
        device: &Device,
        threads: usize,
        timeout: Option<Duration>,
        init: impl FnOnce() -> Result<(S, T), E> + Send + 'static,
    ) -> Result<(Self, T), WorkerFailure<E>>
    where
        T: Send + 'static,
        E: Send + 'static,
    {
        let failure = |failure: Failure<E>| WorkerFailure {
            worker: index,
            device: device_label(device),
            failure,
        };
        let label = device_label(device);
        let pool = crate::cpu_threads::worker_pool(format!("candle-dp-{index}-{label}"), threads)
            .map_err(|e| failure(NoAnswer::NoThreadPool(e.to_string()).into()))?;
        let (jobs, queue) = channel::unbounded::<Job<S>>();
        let (built_tx, built_rx) = channel::bounded::<Result<T, Failure<E>>>(1);
        // The worker loop occupies one pool thread for the worker's whole
        // life; the pool's other threads (and this one, while it waits in a
        // join) run the parallel kernels of the worker's jobs.
        pool.spawn(move || {
            let state = match catch_unwind(AssertUnwindSafe(init)) {
                Ok(Ok((state, for_caller))) => {
                    let _ = built_tx.send(Ok(for_caller));
                    state
                }
                Ok(Err(e)) => {
                    let _ = built_tx.send(Err(Failure::Error(e)));
                    return;
                }
                Err(panic) => {
                    let _ = built_tx.send(Err(Failure::Panic(panic_message(&*panic))));
                    return;
                }
            };
            run_jobs(state, queue);
        });
        let worker = Self {
            jobs: Some(jobs),
            device: device.clone(),
            _pool: pool,
        };
        // An init that never returns is bounded by the timeout (its thread
        // is left behind, as a stuck job's is).
        let built = match timeout {
            Some(timeout) => built_rx.recv_timeout(timeout),
            None => built_rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
        };
        match built {
            Ok(Ok(for_caller)) => Ok((worker, for_caller)),
            Ok(Err(e)) => Err(failure(e)),
            Err(RecvTimeoutError::Timeout) => Err(failure(
                NoAnswer::Timeout(timeout.unwrap_or_default()).into(),
            )),
            Err(RecvTimeoutError::Disconnected) => Err(failure(NoAnswer::Gone.into())),
        }
    }
}

fn run_jobs<S>(mut state: S, queue: Receiver<Job<S>>) {
    // Ends when the pool drops its sender.
    while let Ok(job) = queue.recv() {
        // Jobs catch their own panics (see `WorkerPool::run`); this is a
        // second line of defence so the worker survives whatever a job does.
        let _ = catch_unwind(AssertUnwindSafe(|| job(&mut state)));
    }
}

impl<S> Drop for Worker<S> {
    fn drop(&mut self) {
        // Closing the queue ends the worker loop; the pool then shuts down.
        self.jobs.take();
    }
}

enum Outcome<R, E> {
    Done(Result<R, E>),
    Panicked(String),
    Skipped,
}

/// One persistent worker thread per device, each owning a state `S`.
pub(crate) struct WorkerPool<S> {
    workers: Vec<Worker<S>>,
}

impl<S> std::fmt::Debug for WorkerPool<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let devices: Vec<String> = self
            .workers
            .iter()
            .map(|w| device_label(&w.device))
            .collect();
        f.debug_struct("WorkerPool")
            .field("devices", &devices)
            .finish()
    }
}

impl<S: 'static> WorkerPool<S> {
    /// Starts one worker per device, in order, each with a rayon pool of
    /// `threads` threads, and builds worker `i`'s state on its own thread
    /// with `init(i, device)`, which also returns a value for the caller.
    /// With a `timeout`, each `init` must finish within it. Returns the pool
    /// and the callers' values, or the first worker that failed to start.
    pub(crate) fn start<T, E, F>(
        devices: &[Device],
        threads: usize,
        timeout: Option<Duration>,
        init: F,
    ) -> Result<(Self, Vec<T>), WorkerFailure<E>>
    where
        T: Send + 'static,
        E: Send + 'static,
        F: Fn(usize, &Device) -> Result<(S, T), E> + Send + Sync + 'static,
    {
        let init = Arc::new(init);
        let mut workers = Vec::with_capacity(devices.len());
        let mut for_caller = Vec::with_capacity(devices.len());
        for (index, device) in devices.iter().enumerate() {
            let (init, dev) = (Arc::clone(&init), device.clone());
            let (worker, value) =
                Worker::start(index, device, threads, timeout, move || init(index, &dev))?;
            workers.push(worker);
            for_caller.push(value);
        }
        Ok((Self { workers }, for_caller))
    }

    /// Runs `jobs[i]` on worker `i`'s state, all in parallel, and returns
    /// their results in order, or the first failure (naming the worker and
    /// its device) as soon as it happens, or when `timeout` has passed
    /// without every answer. After a failure the other jobs are told to stop
    /// at their next check of the [`Cancel`] they are given (a job that has
    /// not started yet does not start).
    pub(crate) fn run<R, E, J>(
        &self,
        jobs: Vec<J>,
        timeout: Option<Duration>,
    ) -> Result<Vec<R>, WorkerFailure<E>>
    where
        R: Send + 'static,
        E: Send + 'static,
        J: FnOnce(&mut S, &Cancel) -> Result<R, E> + Send + 'static,
    {
        let count = jobs.len();
        let cancel = Cancel::default();
        let label = |i: usize| {
            self.workers
                .get(i)
                .map_or_else(|| "(no worker)".into(), |w| device_label(&w.device))
        };
        let failed = |worker: usize, failure: Failure<E>| {
            cancel.cancel();
            WorkerFailure {
                worker,
                device: label(worker),
                failure,
            }
        };
        let (results_tx, results) = channel::unbounded::<(usize, Outcome<R, E>)>();
        for (index, job) in jobs.into_iter().enumerate() {
            let (job_cancel, results_tx) = (cancel.clone(), results_tx.clone());
            let job: Job<S> = Box::new(move |state| {
                let outcome = if job_cancel.is_cancelled() {
                    Outcome::Skipped
                } else {
                    match catch_unwind(AssertUnwindSafe(|| job(state, &job_cancel))) {
                        Ok(result) => Outcome::Done(result),
                        Err(panic) => Outcome::Panicked(panic_message(&*panic)),
                    }
                };
                // The caller may have returned already (another job failed).
                let _ = results_tx.send((index, outcome));
            });
            let sent = self.workers.get(index).and_then(|w| w.jobs.as_ref());
            if !matches!(sent.map(|jobs| jobs.send(job)), Some(Ok(()))) {
                return Err(failed(index, NoAnswer::Gone.into()));
            }
        }
        drop(results_tx);

        // A timeout too large for `Instant` (`Duration::MAX`) is no limit.
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        let mut done: Vec<Option<R>> = (0..count).map(|_| None).collect();
        for _ in 0..count {
            let received = match deadline {
                Some(deadline) => results.recv_deadline(deadline),
                None => results.recv().map_err(|_| RecvTimeoutError::Disconnected),
            };
            let missing = || done.iter().position(Option::is_none).unwrap_or(0);
            let (index, outcome) = match received {
                Ok(message) => message,
                Err(RecvTimeoutError::Timeout) => {
                    let timeout = timeout.unwrap_or_default();
                    return Err(failed(missing(), NoAnswer::Timeout(timeout).into()));
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(failed(missing(), NoAnswer::Gone.into()));
                }
            };
            match outcome {
                Outcome::Done(Ok(value)) => done[index] = Some(value),
                Outcome::Done(Err(e)) => return Err(failed(index, Failure::Error(e))),
                Outcome::Panicked(message) => return Err(failed(index, Failure::Panic(message))),
                // Only possible after a cancel, which returns above first.
                Outcome::Skipped => {}
            }
        }
        // Every job answered `Done` above (a skipped one implies a cancel,
        // which returned); a gap would be a worker that sent nothing.
        done.into_iter()
            .enumerate()
            .map(|(index, value)| value.ok_or_else(|| failed(index, NoAnswer::Gone.into())))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` CPU workers whose state starts at their index.
    fn pool(n: usize) -> WorkerPool<usize> {
        let devices = vec![Device::Cpu; n];
        let (pool, ids) = WorkerPool::start(&devices, 1, None, |i, _| Ok::<_, ()>((i, i))).unwrap();
        assert_eq!(ids, (0..n).collect::<Vec<_>>());
        pool
    }

    #[test]
    fn jobs_run_on_their_workers_state_and_come_back_in_order() {
        let pool = pool(3);
        for round in 1..=2 {
            let jobs: Vec<_> = (0..3)
                .map(|_| {
                    |state: &mut usize, _: &Cancel| {
                        *state += 10;
                        Ok::<_, ()>(*state)
                    }
                })
                .collect();
            let expected: Vec<usize> = (0..3).map(|i| i + 10 * round).collect();
            assert_eq!(pool.run(jobs, None).unwrap(), expected);
        }
    }

    #[test]
    fn a_panicking_job_names_its_worker_and_the_worker_lives_on() {
        let pool = pool(2);
        let job = |panics: bool| {
            move |state: &mut usize, _: &Cancel| {
                assert!(!panics, "job on {state} panics");
                Ok::<_, ()>(*state)
            }
        };
        let failure = pool.run(vec![job(false), job(true)], None).unwrap_err();
        assert_eq!((failure.worker, failure.device.as_str()), (1, "cpu"));
        assert!(
            matches!(&failure.failure, Failure::Panic(m) if m.contains("job on 1 panics")),
            "{failure:?}"
        );
        assert_eq!(
            pool.run(vec![job(false), job(false)], None).unwrap(),
            [0, 1]
        );
    }

    #[test]
    fn a_job_past_the_deadline_is_a_timeout_and_the_others_are_cancelled() {
        let pool = pool(2);
        let saw_cancel = Arc::new(AtomicBool::new(false));
        let job = |waits: bool, saw_cancel: Arc<AtomicBool>| {
            move |_: &mut usize, cancel: &Cancel| {
                while waits && !cancel.is_cancelled() {
                    std::thread::sleep(Duration::from_millis(5));
                }
                saw_cancel.store(waits, Ordering::Relaxed);
                Ok::<_, ()>(())
            }
        };
        let jobs = vec![
            job(true, saw_cancel.clone()),
            job(false, saw_cancel.clone()),
        ];
        let failure = pool.run(jobs, Some(Duration::from_millis(50))).unwrap_err();
        assert_eq!(failure.worker, 0);
        assert!(
            matches!(failure.failure, Failure::NoAnswer(NoAnswer::Timeout(t)) if t == Duration::from_millis(50)),
            "{failure:?}"
        );
        let deadline = Instant::now() + Duration::from_secs(5);
        while !saw_cancel.load(Ordering::Relaxed) {
            assert!(
                Instant::now() < deadline,
                "the waiting job was not cancelled"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn an_init_that_fails_or_panics_is_a_start_failure_naming_the_worker() {
        let devices = vec![Device::Cpu; 3];
        let failure = WorkerPool::<()>::start(&devices, 1, None, |i, _| match i {
            1 => Err("no model"),
            _ => Ok(((), ())),
        })
        .unwrap_err();
        assert!(
            matches!(failure.failure, Failure::Error("no model")) && failure.worker == 1,
            "{failure:?}"
        );
        let failure = WorkerPool::<()>::start(&devices, 1, None, |i, _| {
            assert!(i != 2, "init {i} panics");
            Ok::<_, ()>(((), ()))
        })
        .unwrap_err();
        assert!(
            matches!(&failure.failure, Failure::Panic(m) if m.contains("init 2 panics")),
            "{failure:?}"
        );
    }
}
