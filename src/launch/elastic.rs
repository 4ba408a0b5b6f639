//! Elastic restarts: a job whose rank fails starts again, from its newest
//! complete training state, at most `max_restarts` times (torchrun's
//! `--max-restarts`).
//!
//! Two places restart a job:
//! - [`Elastic::spawn`] restarts thread ranks in this process (a rank's
//!   error or panic fails the group; every rank starts again);
//! - [`Elastic::supervise`] runs a launcher (`mpirun`,
//!   `srun`) as child processes and, when the job fails, starts it again
//!   on the hosts that still answer, within `min_ranks..=` their slots
//!   (torchrun's `--nnodes MIN:MAX`).
//!
//! Either way each rank learns which start it is in
//! [`RankContext::restart`] (under a supervisor, from the variable
//! [`RESTART_VARIABLE`], torchrun's `TORCHELASTIC_RESTART_COUNT`), and a
//! training loop resumes when it is not 0: with the
//! [`Fabric`](crate::Fabric), `model.resume(fabric.restart() > 0)`. What
//! the loop keeps across a restart is what its training state holds (the
//! weights, the optimizer, the schedule, the loss scale, the step); what a
//! rank did since the newest state is done again.

use std::time::Duration;

use super::report;
use super::threads::spawn_attempt;
use super::{LaunchError, RankContext};
use crate::comm::GroupOptions;

pub use crate::process_env::RESTART_VARIABLE;

/// How a job restarts: at most `max_restarts` times, never on fewer than
/// `min_ranks` ranks. [`Elastic::spawn`] restarts thread ranks in this
/// process; [`Elastic::supervise`] restarts the processes of a launcher
/// (`mpirun`, `srun`) on the hosts that still answer. Each rank learns
/// which start it is from [`RankContext::restart`] and resumes from its
/// newest state when it is not 0.
///
/// ```
/// use std::sync::atomic::{AtomicBool, Ordering};
/// use candle_dp::launch::Elastic;
///
/// // Rank 1 fails once; the job starts again and finishes.
/// let failed = AtomicBool::new(false);
/// let run = Elastic::new(2).spawn(2, Default::default(), |ctx| {
///     if ctx.rank == 1 && !failed.swap(true, Ordering::SeqCst) {
///         anyhow::bail!("lost its device");
///     }
///     Ok(ctx.restart)
/// })?;
/// assert_eq!(run.results, vec![1, 1]);
/// assert_eq!(run.failures.len(), 1);
/// # Ok::<(), candle_dp::launch::ElasticError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Elastic {
    /// How many times a failed job starts again (0: it does not).
    pub max_restarts: usize,
    /// The fewest ranks a supervised job may start on (the hosts that
    /// answer must have this many slots between them); at least 1.
    pub min_ranks: usize,
    /// How long a supervisor waits for a host's probe before counting the
    /// host lost.
    pub probe_timeout: Duration,
    /// A supervised start's number of ranks must divide this (the global
    /// batch, so that each rank gets an equal share): the job starts on
    /// the most slots that do, the last hosts' slots left unused (default
    /// none: every slot that answers).
    pub ranks_dividing: Option<usize>,
}

impl Default for Elastic {
    fn default() -> Self {
        Elastic {
            max_restarts: 0,
            min_ranks: 1,
            probe_timeout: Duration::from_secs(10),
            ranks_dividing: None,
        }
    }
}

/// A job that finished, perhaps after restarts.
#[derive(Debug)]
pub struct Restarted<T> {
    /// What the job's last start returned.
    pub results: T,
    /// Why each earlier start failed, in order (empty: no restart).
    pub failures: Vec<LaunchError>,
}

/// Why an elastic job did not finish.
#[derive(Debug, thiserror::Error)]
pub enum ElasticError {
    /// The job failed once more than `max_restarts` allows.
    #[error("the job failed {} time(s) and may restart at most {max_restarts} time(s); the last failure: {}", .max_restarts + 1, report::one_line(.last.as_ref()))]
    OutOfRestarts {
        /// The setting.
        max_restarts: usize,
        /// The last start's failure: a [`LaunchError`] for thread ranks,
        /// a [`JobFailed`](super::JobFailed) under a supervisor.
        last: Box<dyn std::error::Error + Send + Sync>,
    },

    /// A failure that a restart cannot mend (an empty world, a thread
    /// that could not start, a program built without what its launcher
    /// needs).
    #[error(transparent)]
    Launch(Box<LaunchError>),

    /// `min_ranks` was 0.
    #[error("min_ranks must be at least 1, got 0")]
    NoMinimum,

    /// Fewer ranks can start than `min_ranks`.
    #[error("{ranks} rank(s) can start{}, fewer than the minimum of {min_ranks}{}{}", of_slots(*.ranks, *.slots, *.dividing), lost_hosts(.lost), before_text(.before))]
    TooFewRanks {
        /// The ranks that could start.
        ranks: usize,
        /// The slots that answered (more than `ranks` where not all of
        /// them divide `dividing`).
        slots: usize,
        /// [`Elastic::ranks_dividing`].
        dividing: Option<usize>,
        /// The setting.
        min_ranks: usize,
        /// The hosts that did not answer their probe.
        lost: Vec<String>,
        /// How the start before ended, when there was one.
        before: Option<String>,
    },

    /// A supervisor's host list that cannot be read.
    #[error("the host list {list:?}: {why}")]
    Hosts {
        /// The list.
        list: String,
        /// What is wrong with it.
        why: String,
    },

    /// A supervisor could not run the job's launcher.
    #[error("could not start {command}: {source}")]
    Start {
        /// The command.
        command: String,
        /// The operating system's error.
        source: std::io::Error,
    },
}

/// `; before: …` when a start came before.
fn before_text(before: &Option<String>) -> String {
    before
        .as_ref()
        .map_or_else(String::new, |b| format!("; before: {b}"))
}

/// ` (of 3 slots, the most that divide 8)` when not every slot can start.
fn of_slots(ranks: usize, slots: usize, dividing: Option<usize>) -> String {
    match dividing {
        Some(n) if ranks < slots => format!(" (of {slots} slots, the most that divide {n})"),
        _ => String::new(),
    }
}

/// ` (lost: a, b)` when hosts were lost.
fn lost_hosts(lost: &[String]) -> String {
    match lost.is_empty() {
        true => String::new(),
        false => format!(" (lost: {})", lost.join(", ")),
    }
}

impl Elastic {
    /// At most `max_restarts` restarts, on at least one rank.
    pub fn new(max_restarts: usize) -> Self {
        Elastic {
            max_restarts,
            ..Elastic::default()
        }
    }

    /// This setting with `min_ranks`.
    pub fn min_ranks(self, min_ranks: usize) -> Self {
        Elastic { min_ranks, ..self }
    }

    /// This setting with [`ranks_dividing`](Self::ranks_dividing) `n`.
    pub fn ranks_dividing(self, n: usize) -> Self {
        Elastic {
            ranks_dividing: Some(n),
            ..self
        }
    }

    /// How many of `slots` a start uses: all, or the most that divide
    /// [`ranks_dividing`](Self::ranks_dividing) (0 is divided by all).
    pub(crate) fn usable_ranks(&self, slots: usize) -> usize {
        match self.ranks_dividing {
            Some(n) if n > 0 => (1..=slots).rev().find(|r| n % r == 0).unwrap_or(0),
            _ => slots,
        }
    }

    /// [`spawn_with`](super::spawn_with), started again after a failure:
    /// every rank of the failed start has ended (the group fails them
    /// all) before the next start builds a new group of `world_size`
    /// thread ranks. Each restart is said on standard error with the
    /// failure that caused it.
    ///
    /// # Errors
    ///
    /// [`ElasticError::OutOfRestarts`] with the last failure;
    /// [`ElasticError::TooFewRanks`] for fewer ranks than `min_ranks` (an
    /// empty world included); [`ElasticError::Launch`] for a failure a
    /// restart cannot mend (a thread that could not start).
    pub fn spawn<T, F>(
        &self,
        world_size: usize,
        options: GroupOptions,
        f: F,
    ) -> Result<Restarted<Vec<T>>, ElasticError>
    where
        T: Send,
        F: Fn(RankContext) -> anyhow::Result<T> + Sync,
    {
        if self.min_ranks == 0 {
            return Err(ElasticError::NoMinimum);
        }
        if world_size < self.min_ranks {
            return Err(ElasticError::TooFewRanks {
                ranks: world_size,
                slots: world_size,
                dividing: None,
                min_ranks: self.min_ranks,
                lost: Vec::new(),
                before: None,
            });
        }
        let mut failures = Vec::new();
        let mut restart = 0;
        loop {
            let error = match spawn_attempt(world_size, options.clone(), restart, &f) {
                Ok(results) => return Ok(Restarted { results, failures }),
                Err(error) => error,
            };
            if !restartable(&error) {
                return Err(ElasticError::Launch(Box::new(error)));
            }
            if restart == self.max_restarts {
                return Err(ElasticError::OutOfRestarts {
                    max_restarts: self.max_restarts,
                    last: Box::new(error),
                });
            }
            restart += 1;
            report::eprint_report(&format!(
                "elastic: restart {restart} of at most {} on {world_size} thread rank(s), after: {}",
                self.max_restarts,
                report::one_line(&error)
            ));
            failures.push(error);
        }
    }
}

/// Whether starting again may mend `error`: a rank's failure may (a lost
/// device, a peer gone, a timeout), a launch that cannot begin may not.
fn restartable(error: &LaunchError) -> bool {
    !matches!(
        error,
        LaunchError::EmptyWorld | LaunchError::MpiNotEnabled { .. } | LaunchError::Spawn { .. }
    )
}
