//! The replicas of a [`DataParallel`](super::DataParallel): one per device,
//! each the state of one worker of a [`WorkerPool`], built there from the
//! user's factory and never moved (so the model type need not be `Send`).
//! Here the pool's workers are replicas, and their failures the crate's
//! replica errors.

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};

use super::gpu_turns::{turns, Turn};
use crate::buffers::BufferPredicate;
use crate::error::{Error, Result};
use crate::replicate::{build_replica, CopyOptions, ReplicaVars};
use crate::util::lock::lock;
use crate::worker_pool::{Cancel, Failure, NoAnswer, WorkerFailure, WorkerPool};

/// What a worker owns: the user's model and the tensors that follow the master.
pub(super) struct Replica<M> {
    model: M,
    vars: Arc<ReplicaVars>,
    /// Held for this replica's work where it shares its GPU (see
    /// `gpu_turns`).
    turn: Option<Turn>,
}

/// One replica's share of a forward, and how long its phases took.
pub(super) struct ReplicaRun<R> {
    /// What the replica's work returned.
    pub(super) output: R,
    /// Refreshing the replica from the master.
    pub(super) replicate: Duration,
    /// The work itself (the forward, and whatever the caller added).
    pub(super) work: Duration,
}

/// One replica per device, on its own persistent worker thread.
pub(super) struct Replicas<M> {
    pool: WorkerPool<Replica<M>>,
    vars: Vec<Arc<ReplicaVars>>,
    /// How long a step waits for its replicas (none: no limit).
    timeout: Option<Duration>,
}

impl<M: 'static> Replicas<M> {
    /// Starts one worker per device (`threads` threads each) and builds
    /// replica `i` there from `factory`, tied to the master's variables in
    /// `varmap`, in `dtype` (differing from the master as `options` say).
    /// With a `timeout`, each build must finish within it.
    pub(super) fn start<F>(
        varmap: &VarMap,
        (dtype, options): (DType, CopyOptions),
        devices: &[Device],
        threads: usize,
        timeout: Option<Duration>,
        is_buffer: BufferPredicate,
        factory: Arc<F>,
    ) -> Result<Self>
    where
        F: Fn(VarBuilder) -> candle_core::Result<M> + Send + Sync + 'static,
    {
        let varmap = varmap.clone();
        let turns = turns(devices);
        let (pool, vars) = WorkerPool::start(devices, threads, timeout, move |index, device| {
            let (model, vars) = build_replica(
                index,
                &varmap,
                dtype,
                device,
                is_buffer.clone(),
                options.clone(),
                &*factory,
            )?;
            let vars = Arc::new(vars);
            let replica = Replica {
                model,
                vars: Arc::clone(&vars),
                turn: turns.get(index).cloned().flatten(),
            };
            Ok((replica, vars))
        })
        .map_err(build_error)?;
        Ok(Self {
            pool,
            vars,
            timeout,
        })
    }

    /// Runs `work(replica, inputs[i], cancel)` on replica `i` for every
    /// input, in parallel, within the timeout: the results in replica order,
    /// or the first failure, naming the replica and its device (see
    /// [`WorkerPool::run`]).
    pub(super) fn parallel_apply<I, R, F>(&self, inputs: Vec<I>, work: F) -> Result<Vec<R>>
    where
        I: Send + 'static,
        R: Send + 'static,
        F: Fn(&Replica<M>, I, &Cancel) -> candle_core::Result<R> + Send + Sync + 'static,
    {
        let work = Arc::new(work);
        let jobs: Vec<_> = inputs
            .into_iter()
            .map(|input| {
                let work = Arc::clone(&work);
                move |replica: &mut Replica<M>, cancel: &Cancel| {
                    let turn = replica.turn.clone();
                    let _turn = turn.as_deref().map(lock);
                    work(replica, input, cancel)
                }
            })
            .collect();
        self.pool.run(jobs, self.timeout).map_err(replica_error)
    }

    /// Replicate, then apply: each replica is refreshed from the master's
    /// current values and runs `f` on its model and its input.
    pub(super) fn replicate_apply<I, R, F>(
        &self,
        inputs: Vec<I>,
        f: F,
    ) -> Result<Vec<ReplicaRun<R>>>
    where
        I: Send + 'static,
        R: Send + 'static,
        F: Fn(&M, I, &Cancel) -> candle_core::Result<R> + Send + Sync + 'static,
    {
        self.parallel_apply(inputs, move |replica, input, cancel| {
            let start = Instant::now();
            replica.vars.refresh()?;
            let refreshed = Instant::now();
            let output = f(&replica.model, input, cancel)?;
            Ok(ReplicaRun {
                output,
                replicate: refreshed - start,
                work: refreshed.elapsed(),
            })
        })
    }

    /// Keeps replica 0's buffers (BatchNorm statistics), as PyTorch does:
    /// the last part of a successful step.
    pub(super) fn commit_buffers(&self) -> Result<()> {
        match self.vars.first() {
            Some(vars) => Ok(vars.commit_buffers()?),
            None => Ok(()),
        }
    }
}

/// The error for a replica whose work failed.
fn replica_error(failure: WorkerFailure<candle_core::Error>) -> Error {
    let (replica, device) = (failure.worker, failure.device);
    match failure.failure {
        Failure::Error(source) => Error::Replica {
            replica,
            device,
            source,
        },
        Failure::Panic(message) => Error::ReplicaPanic {
            replica,
            device,
            message,
        },
        Failure::NoAnswer(why) => no_answer_error(replica, device, why),
    }
}

/// The error for a replica that could not be built.
fn build_error(failure: WorkerFailure<Error>) -> Error {
    let (replica, device) = (failure.worker, failure.device);
    match failure.failure {
        Failure::Error(e) => e,
        Failure::Panic(message) => Error::Candle(candle_core::Error::Msg(format!(
            "the model factory panicked: {message}"
        ))),
        Failure::NoAnswer(why) => no_answer_error(replica, device, why),
    }
}

/// The error for a replica whose worker did not answer.
fn no_answer_error(replica: usize, device: String, why: NoAnswer) -> Error {
    match why {
        NoAnswer::Timeout(timeout) => Error::ReplicaTimeout {
            replica,
            device,
            timeout,
        },
        NoAnswer::Gone => Error::WorkerGone { replica, device },
        NoAnswer::NoThreadPool(reason) => Error::Candle(candle_core::Error::Msg(format!(
            "cannot start the thread pool of replica {replica}: {reason}"
        ))),
    }
}
