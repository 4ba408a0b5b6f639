//! The examples' elastic flags (`--max-restarts`, `--min-ranks`,
//! `--hosts`), flattened into their parsers, and the supervisor they start.

use std::time::Duration;

use anyhow::{Context, Result};
use candle_dp::launch::{Backend, Elastic, Host, Mpirun, Srun, RESTART_VARIABLE};

/// Restarts after a failure: of the thread ranks in this process, or, with
/// `--hosts`, of an `mpirun` job this process supervises. How many: the
/// Fabric's `--max-restarts` (`FabricArgs`), given to each method.
#[derive(Debug, Clone, clap::Args)]
pub struct ElasticArgs {
    /// With --hosts: the fewest ranks a start may have.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = crate::flags::at_least_one::<usize>)]
    pub min_ranks: usize,
    /// Supervises the job: runs this program under --launcher on these
    /// hosts (`name:slots,…`, one rank per slot; `slurm`: the nodes and
    /// tasks of this Slurm allocation) and, when it fails, starts it again
    /// on the hosts that still answer (at most --max-restarts times).
    #[arg(long, value_name = "LIST")]
    pub hosts: Option<String>,
    /// With --hosts: what starts the ranks.
    #[arg(long, value_enum, default_value_t = Launcher::Mpirun)]
    pub launcher: Launcher,
    /// With --hosts: seconds a host's probe (a one-rank job there) may
    /// take before the host counts as lost.
    #[arg(long, value_name = "SECONDS", default_value_t = 10.0, value_parser = crate::flags::positive_f64)]
    pub probe_timeout: f64,
    /// With --hosts: an option for the launcher, for the job and the
    /// probes (repeat it: `--launcher-option=--allow-run-as-root`).
    #[arg(long, value_name = "OPTION", allow_hyphen_values = true)]
    pub launcher_option: Vec<String>,
}

/// What a supervisor starts the ranks with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Launcher {
    /// Open MPI's `mpirun --host`.
    Mpirun,
    /// Slurm's `srun --nodelist`, inside an allocation.
    Srun,
}

impl ElasticArgs {
    /// The library's setting; a start's ranks must divide
    /// `ranks_dividing` (the global batch) where given.
    pub fn elastic(&self, max_restarts: usize, ranks_dividing: Option<usize>) -> Elastic {
        Elastic {
            max_restarts,
            min_ranks: self.min_ranks,
            // A timeout past what a Duration holds is no limit.
            probe_timeout: Duration::try_from_secs_f64(self.probe_timeout).unwrap_or(Duration::MAX),
            ranks_dividing,
        }
    }

    /// With `--hosts` outside an MPI job: supervises this very program,
    /// with the same arguments, under mpirun on the hosts, until it
    /// finishes or cannot go on (`Some` with how that went); `None` where
    /// this process should train (no `--hosts`, or a rank of the job).
    /// Each start's ranks divide `ranks_dividing` where given (the global
    /// batch: a restart on fewer slots then starts on the most that share
    /// it evenly, rather than failing again).
    ///
    /// `Some` with an error where the flags cannot do what they say: a
    /// process that a supervisor started (its restart variable set) but
    /// not as a rank of an MPI job (an `srun` without its MPI plugin would
    /// make every task a supervisor), or `--hosts` / `--max-restarts`
    /// under a launcher that no supervisor started (nothing would restart).
    pub fn supervise(
        &self,
        max_restarts: usize,
        ranks_dividing: Option<usize>,
    ) -> Option<Result<()>> {
        let supervised = std::env::var_os(RESTART_VARIABLE).is_some();
        match (Backend::from_env(), &self.hosts, supervised) {
            (Backend::Threads, Some(_), true) => Some(Err(anyhow::anyhow!(
                "started by an elastic supervisor ({RESTART_VARIABLE} is set) but not as a rank \
                 of an MPI job: give the launcher its MPI plugin (srun: \
                 --launcher-option=--mpi=pmix)"
            ))),
            (Backend::Threads, Some(hosts), false) => {
                Some(self.run_supervisor(hosts, self.elastic(max_restarts, ranks_dividing)))
            }
            (Backend::Mpi { variable }, _, false) if self.hosts.is_some() || max_restarts > 0 => {
                Some(Err(anyhow::anyhow!(
                    "--hosts and --max-restarts restart nothing under a launcher ({variable} is \
                     set): the supervisor starts mpirun or srun itself; run this program \
                     without one, with --hosts"
                )))
            }
            _ => None,
        }
    }

    fn run_supervisor(&self, hosts: &str, elastic: Elastic) -> Result<()> {
        let hosts = match hosts {
            "slurm" => Host::from_slurm_allocation()?,
            list => Host::parse_list(list)?,
        };
        let program = std::env::current_exe().context("cannot find this program's path")?;
        let options = self.launcher_option.iter().map(Into::into).collect();
        let args = std::env::args_os().skip(1);
        let run = match self.launcher {
            Launcher::Mpirun => elastic.supervise(
                &hosts,
                &Mpirun {
                    options,
                    ..Mpirun::new(program, args)
                },
            ),
            Launcher::Srun => elastic.supervise(
                &hosts,
                &Srun {
                    options,
                    ..Srun::new(program, args)
                },
            ),
        }?;
        println!("\n| start | hosts | ranks | lost | probing, s | ran, s | ended |");
        println!("|---|---|---|---|---|---|---|");
        for (i, a) in run.attempts.iter().enumerate() {
            let hosts: Vec<String> = a.hosts.iter().map(Host::to_string).collect();
            println!(
                "| {i} | {} | {} | {} | {:.2} | {:.2} | {} |",
                hosts.join(","),
                a.ranks(),
                if a.lost.is_empty() {
                    "-".to_string()
                } else {
                    a.lost.join(",")
                },
                a.probing.as_secs_f64(),
                a.ran.as_secs_f64(),
                a.status
            );
        }
        Ok(())
    }
}
