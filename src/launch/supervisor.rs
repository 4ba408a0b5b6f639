//! [`Elastic::supervise`]: run a job's launcher ([`Mpirun`], [`Srun`]) as a
//! child process and, when the job fails, start it again on the hosts
//! that still answer: torchrun's elastic agent, for processes that MPI or
//! Slurm start.
//!
//! Before every start each host is probed (a one-rank job of the same
//! launcher on that host, bounded by [`Elastic::probe_timeout`]); the job
//! starts on the hosts whose probe ended well, as many ranks as their
//! slots, if that is at least [`Elastic::min_ranks`]. A host lost once is
//! probed again at the next start, so a machine that comes back is used
//! again. The ranks learn which start it is from [`RESTART_VARIABLE`] and
//! resume from their newest state; the job's own group timeout is what
//! ends a start whose machine dropped off the network (see
//! [`run`](super::run)), so give the job one.
//!
//! ```no_run
//! use candle_dp::launch::{Elastic, Host, Mpirun};
//!
//! let hosts = Host::parse_list("node1:4,node2:4")?;
//! let job = Mpirun::new("./train", ["--checkpoint-dir", "/shared/run"]);
//! let run = Elastic::new(3).min_ranks(4).supervise(&hosts, &job)?;
//! println!("finished after {} restart(s)", run.attempts.len() - 1);
//! # Ok::<(), candle_dp::launch::ElasticError>(())
//! ```

use std::ffi::{OsStr, OsString};
use std::fmt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use super::elastic::{Elastic, ElasticError, RESTART_VARIABLE};
use super::report;
use super::signal::{end_with_parent, signal_group};

/// A machine a supervised job may run on, and how many ranks it takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Host {
    /// The name the launcher knows it by (a host name or an address).
    pub name: String,
    /// How many ranks it runs.
    pub slots: usize,
}

impl Host {
    /// Reads `name:slots,name:slots,…` (a name alone has one slot), as
    /// `mpirun --host` takes it.
    ///
    /// ```
    /// use candle_dp::launch::Host;
    ///
    /// let hosts = Host::parse_list("node1:2,node2")?;
    /// assert_eq!(hosts[0], Host { name: "node1".into(), slots: 2 });
    /// assert_eq!(hosts[1].slots, 1);
    /// assert!(Host::parse_list("node1:0").is_err());
    /// # Ok::<(), candle_dp::launch::ElasticError>(())
    /// ```
    ///
    /// # Errors
    ///
    /// An empty list, an empty name, a slot count that is not a number of
    /// at least 1, a name given twice: [`ElasticError::Hosts`] naming the
    /// entry.
    pub fn parse_list(list: &str) -> Result<Vec<Host>, ElasticError> {
        let bad = |why: String| ElasticError::Hosts {
            list: list.to_string(),
            why,
        };
        let mut hosts: Vec<Host> = Vec::new();
        for entry in list.split(',').map(str::trim) {
            let (name, slots) = match entry.rsplit_once(':') {
                Some((name, slots)) => match slots.parse::<usize>() {
                    Ok(n) if n >= 1 => (name, n),
                    _ => {
                        return Err(bad(format!(
                            "{entry:?}: slots must be a number of at least 1"
                        )))
                    }
                },
                None => (entry, 1),
            };
            if name.is_empty() {
                return Err(bad(format!("{entry:?} has no host name")));
            }
            if hosts.iter().any(|h| h.name == name) {
                return Err(bad(format!("{name} is given twice")));
            }
            hosts.push(Host {
                name: name.to_string(),
                slots,
            });
        }
        Ok(hosts)
    }
}

impl Host {
    /// The nodes of the Slurm allocation this process runs in (inside an
    /// `sbatch` script): `SLURM_JOB_NODELIST` expanded by `scontrol show
    /// hostnames`, each node's slots from `SLURM_TASKS_PER_NODE`
    /// (`2(x3),1`).
    ///
    /// # Errors
    ///
    /// Outside an allocation (a variable missing), `scontrol` failing, or
    /// a tasks list that does not cover the nodes: [`ElasticError::Hosts`]
    /// naming what.
    pub fn from_slurm_allocation() -> Result<Vec<Host>, ElasticError> {
        let variable = |name: &str| {
            std::env::var(name).map_err(|_| ElasticError::Hosts {
                list: "slurm".into(),
                why: format!("{name} is not set: not inside a Slurm allocation"),
            })
        };
        let nodes = variable("SLURM_JOB_NODELIST")?;
        let tasks = variable("SLURM_TASKS_PER_NODE")?;
        let bad = |why: String| ElasticError::Hosts {
            list: nodes.clone(),
            why,
        };
        let output = Command::new("scontrol")
            .args(["show", "hostnames", &nodes])
            .output()
            .map_err(|e| bad(format!("cannot run scontrol: {e}")))?;
        if !output.status.success() {
            return Err(bad(format!(
                "scontrol show hostnames failed: {}",
                String::from_utf8_lossy(&output.stderr).trim()
            )));
        }
        String::from_utf8_lossy(&output.stdout)
            .split_whitespace()
            .enumerate()
            .map(|(i, name)| {
                let slots = crate::process_env::slurm_tasks_on_node(&tasks, i)
                    .filter(|&n| n >= 1)
                    .ok_or_else(|| {
                        bad(format!(
                            "SLURM_TASKS_PER_NODE={tasks} gives node {i} ({name}) no tasks"
                        ))
                    })?;
                Ok(Host {
                    name: name.to_string(),
                    slots,
                })
            })
            .collect()
    }
}

impl fmt::Display for Host {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.name, self.slots)
    }
}

/// How a supervised job starts, and how a host is tried.
pub trait JobLauncher: fmt::Debug + Sync {
    /// The command that starts the job on `hosts`, one rank per slot, in
    /// the hosts' order (ranks of one host next to each other).
    fn job(&self, hosts: &[Host]) -> Command;

    /// A command that ends with success, promptly, when `host` can run a
    /// rank of the job now.
    fn probe(&self, host: &Host) -> Command;
}

/// Open MPI's `mpirun` as a [`JobLauncher`]: `mpirun -np N --host
/// h1:s1,h2:s2 --map-by slot -x CANDLE_DP_RESTART OPTIONS PROGRAM ARGS`;
/// a host's probe is `mpirun -np 1 --host h:1 OPTIONS true`, which needs
/// the host's daemon to start and reach this one.
#[derive(Debug, Clone)]
pub struct Mpirun {
    /// The launcher to run [default: `mpirun`].
    pub mpirun: OsString,
    /// Options before the program, for both the job and the probes
    /// (`--allow-run-as-root`, `--mca NAME VALUE`, …).
    pub options: Vec<OsString>,
    /// The program every rank runs.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<OsString>,
}

impl Mpirun {
    /// `program args` under `mpirun`, with no further options.
    pub fn new<I, S>(program: impl Into<PathBuf>, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        Mpirun {
            mpirun: "mpirun".into(),
            options: Vec::new(),
            program: program.into(),
            args: args.into_iter().map(|a| a.as_ref().to_owned()).collect(),
        }
    }

    fn base(&self, ranks: usize, hosts: &str) -> Command {
        let mut command = Command::new(&self.mpirun);
        command
            .arg("-np")
            .arg(ranks.to_string())
            .arg("--host")
            .arg(hosts)
            .args(&self.options);
        command
    }
}

impl JobLauncher for Mpirun {
    fn job(&self, hosts: &[Host]) -> Command {
        let list: Vec<String> = hosts.iter().map(Host::to_string).collect();
        let ranks = hosts.iter().map(|h| h.slots).sum();
        let mut command = self.base(ranks, &list.join(","));
        command
            .args(["--map-by", "slot", "-x", RESTART_VARIABLE])
            .arg(&self.program)
            .args(&self.args);
        command
    }

    fn probe(&self, host: &Host) -> Command {
        let mut command = self.base(1, &format!("{}:1", host.name));
        command.arg("true");
        command
    }
}

/// Slurm's `srun` as a [`JobLauncher`], for a supervisor inside an
/// allocation (an `sbatch` script): `srun --overlap --nodes=K --ntasks=N
/// --nodelist=h1,h2 --distribution=block --kill-on-bad-exit=1 --export=ALL
/// OPTIONS PROGRAM ARGS`, N the hosts' slots summed (Slurm places them as
/// the allocation allows; the whole environment passes, the restart's
/// number included, whatever `SLURM_EXPORT_ENV` says); a host's probe fails at once when `sinfo` says the node is
/// down, drained or not responding, and otherwise runs a one-task step there, `srun --overlap --nodes=1 --ntasks=1
/// --nodelist=h OPTIONS true`. Give `--mpi=pmix` in `options` where
/// Slurm's default plugin is not PMIx.
#[derive(Debug, Clone)]
pub struct Srun {
    /// The launcher to run [default: `srun`].
    pub srun: OsString,
    /// Options before the program, for both the job and the probes.
    pub options: Vec<OsString>,
    /// The program every rank runs.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<OsString>,
}

impl Srun {
    /// `program args` under `srun`, with no further options.
    pub fn new<I, S>(program: impl Into<PathBuf>, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        Srun {
            srun: "srun".into(),
            options: Vec::new(),
            program: program.into(),
            args: args.into_iter().map(|a| a.as_ref().to_owned()).collect(),
        }
    }

    fn base(&self, hosts: &[Host], ranks: usize) -> Command {
        let names: Vec<&str> = hosts.iter().map(|h| h.name.as_str()).collect();
        let mut command = Command::new(&self.srun);
        // Inside an allocation that lost a node (`sbatch --no-kill`), the
        // failed step never completes: its part on the lost node cannot
        // report, so Slurm keeps holding the step's CPUs on the nodes
        // left, and a new step there waits "Requested nodes are busy"
        // (seen with Slurm 22.05 for over 75 s after the node was marked
        // down). `--overlap` lets the probes and the restarted job use
        // them. srun returns once the step's tasks on the nodes that answer
        // are reported ended (`--kill-on-bad-exit`), so the restart does
        // not share a node with the failed ranks; what it does not cover: a
        // GPU or memory the stuck step still holds on a node left, and a
        // Slurm before 20.11, which has no `--overlap`.
        command
            .arg("--overlap")
            .arg(format!("--nodes={}", hosts.len()))
            .arg(format!("--ntasks={ranks}"))
            .arg(format!("--nodelist={}", names.join(",")));
        command
    }
}

impl JobLauncher for Srun {
    fn job(&self, hosts: &[Host]) -> Command {
        let ranks = hosts.iter().map(|h| h.slots).sum();
        let mut command = self.base(hosts, ranks);
        command
            .args([
                "--distribution=block",
                "--kill-on-bad-exit=1",
                "--export=ALL",
            ])
            .args(&self.options)
            .arg(&self.program)
            .args(&self.args);
        command
    }

    fn probe(&self, host: &Host) -> Command {
        // A node Slurm already says is down, drained, failing or not
        // responding (a `*` after its state) fails at once: a step asked
        // of it would wait in the queue until the probe's timeout. Any
        // other node runs a one-task step (with `--overlap`, see `base`: it
        // does not wait for the CPUs of a step that cannot complete).
        let step = self.base(std::slice::from_ref(host), 1);
        let mut command = Command::new("sh");
        command
            .arg("-c")
            .arg(
                "case \"$(sinfo --noheader --nodes=\"$1\" -o %T)\" in \
                 *down*|*drain*|*fail*|*'*'*) exit 1 ;; esac; shift; exec \"$@\"",
            )
            .arg("sh")
            .arg(&host.name)
            .arg(step.get_program())
            .args(step.get_args())
            .args(&self.options)
            .arg("true");
        command
    }
}

/// One start of a supervised job.
#[derive(Debug, Clone)]
pub struct Attempt {
    /// The hosts it ran on.
    pub hosts: Vec<Host>,
    /// The hosts whose probe failed or did not end in time.
    pub lost: Vec<String>,
    /// How long the probes took.
    pub probing: Duration,
    /// How long the job ran.
    pub ran: Duration,
    /// How it ended.
    pub status: ExitStatus,
}

impl Attempt {
    /// Its number of ranks.
    pub fn ranks(&self) -> usize {
        self.hosts.iter().map(|h| h.slots).sum()
    }

    /// How it ended, as an error.
    pub fn failure(&self) -> JobFailed {
        JobFailed {
            ranks: self.ranks(),
            hosts: self
                .hosts
                .iter()
                .map(Host::to_string)
                .collect::<Vec<_>>()
                .join(","),
            status: self.status,
        }
    }
}

/// A supervised job that finished: every start, the last one the one that
/// ended well.
#[derive(Debug, Clone)]
pub struct Supervised {
    /// Every start, in order.
    pub attempts: Vec<Attempt>,
}

/// A start that ended badly (the `last` failure of
/// [`ElasticError::OutOfRestarts`] under a supervisor).
#[derive(Debug, thiserror::Error)]
#[error("the job on {ranks} rank(s) ({hosts}) ended with {status}")]
pub struct JobFailed {
    /// Its ranks.
    pub ranks: usize,
    /// Its hosts, as `--host` lists them.
    pub hosts: String,
    /// How it ended.
    pub status: ExitStatus,
}

/// How long a probe asked to end (SIGTERM) is given before it is killed.
const END_GRACE: Duration = Duration::from_secs(2);

impl Elastic {
    /// Runs the job `launcher` starts on `hosts` and starts it again after
    /// each failure, at most [`max_restarts`](Elastic::max_restarts)
    /// times. Before every start each host is probed (a one-rank job of
    /// the same launcher there, bounded by
    /// [`probe_timeout`](Elastic::probe_timeout)); the job starts on the
    /// hosts whose probe ended well, one rank per slot (with
    /// [`ranks_dividing`](Elastic::ranks_dividing), on the first slots
    /// whose number divides it), if that is at least
    /// [`min_ranks`](Elastic::min_ranks). A host lost once is probed
    /// again at the next start. The ranks learn which start it is from
    /// [`RESTART_VARIABLE`] and should resume from their newest state; the
    /// job's own group timeout is what ends a start whose machine dropped
    /// off the network, so give the job one. The job's output is this
    /// process's; the job gets
    /// SIGTERM if this thread ends before it (a supervisor killed). Each
    /// start is said on standard error (`elastic: start: 4 rank(s) on
    /// node1:2,node2:2 (probed in 0.31 s)`, then `elastic: restart 1 of at
    /// most 3: 2 rank(s) on node1:2 (probed in 0.56 s); lost: node2`).
    ///
    /// # Errors
    ///
    /// [`ElasticError::TooFewRanks`] when the hosts that answer have fewer
    /// slots than `min_ranks`, naming the lost ones and the failure before;
    /// [`ElasticError::OutOfRestarts`] when the last allowed start fails
    /// (its `last` is a [`JobFailed`]); [`ElasticError::Start`] when the
    /// launcher or a probe cannot be run at all.
    pub fn supervise(
        &self,
        hosts: &[Host],
        launcher: &dyn JobLauncher,
    ) -> Result<Supervised, ElasticError> {
        if self.min_ranks == 0 {
            return Err(ElasticError::NoMinimum);
        }
        if hosts.is_empty() {
            return Err(ElasticError::Hosts {
                list: String::new(),
                why: "no host given".into(),
            });
        }
        let mut attempts: Vec<Attempt> = Vec::new();
        for restart in 0..=self.max_restarts {
            let which = match restart {
                0 => "start".to_string(),
                k => format!("restart {k} of at most {}", self.max_restarts),
            };
            let probing = Instant::now();
            let (alive, lost) = self.probe_all(hosts, launcher)?;
            let probing = probing.elapsed();
            let slots: usize = alive.iter().map(|h| h.slots).sum();
            let ranks = self.usable_ranks(slots);
            if ranks < self.min_ranks {
                return Err(ElasticError::TooFewRanks {
                    ranks,
                    slots,
                    dividing: self.ranks_dividing,
                    min_ranks: self.min_ranks,
                    lost,
                    before: attempts.last().map(|a| a.failure().to_string()),
                });
            }
            let alive = first_slots(alive, ranks);
            let list: Vec<String> = alive.iter().map(Host::to_string).collect();
            let lost_text = match lost.is_empty() {
                true => String::new(),
                false => format!("; lost: {}", lost.join(", ")),
            };
            let unused = match (slots - ranks, self.ranks_dividing) {
                (0, _) | (_, None) => String::new(),
                (_, Some(n)) => format!("; {slots} slots answered, {ranks} divide {n}"),
            };
            report::eprint_report(&format!(
                "elastic: {which}: {ranks} rank(s) on {} (probed in {:.2} s){unused}{lost_text}",
                list.join(","),
                probing.as_secs_f64(),
            ));
            let mut job = launcher.job(&alive);
            job.env(RESTART_VARIABLE, restart.to_string());
            end_with_parent(&mut job);
            let started = Instant::now();
            let status = job.status().map_err(|source| ElasticError::Start {
                command: format!("{job:?}"),
                source,
            })?;
            let attempt = Attempt {
                hosts: alive,
                lost,
                probing,
                ran: started.elapsed(),
                status,
            };
            if status.success() {
                attempts.push(attempt);
                return Ok(Supervised { attempts });
            }
            report::eprint_report(&format!(
                "elastic: {} after {:.2} s",
                attempt.failure(),
                attempt.ran.as_secs_f64()
            ));
            attempts.push(attempt);
        }
        let last = attempts.pop().map(|a| a.failure());
        Err(ElasticError::OutOfRestarts {
            max_restarts: self.max_restarts,
            last: match last {
                Some(last) => Box::new(last),
                None => "no start was made".into(),
            },
        })
    }

    /// The hosts whose probe ends well within the probe timeout, and the
    /// names of the others; all probed at once.
    fn probe_all(
        &self,
        hosts: &[Host],
        launcher: &dyn JobLauncher,
    ) -> Result<(Vec<Host>, Vec<String>), ElasticError> {
        let answered: Vec<Result<bool, ElasticError>> = std::thread::scope(|scope| {
            let probes: Vec<_> = hosts
                .iter()
                .map(|host| {
                    scope.spawn(move || {
                        let probe = launcher.probe(host);
                        let command = format!("{probe:?}");
                        answers(probe, Some(self.probe_timeout))
                            .map_err(|source| ElasticError::Start { command, source })
                    })
                })
                .collect();
            probes
                .into_iter()
                .map(|probe| probe.join().unwrap_or(Ok(false)))
                .collect()
        });
        let mut alive = Vec::new();
        let mut lost = Vec::new();
        for (host, answered) in hosts.iter().zip(answered) {
            match answered? {
                true => alive.push(host.clone()),
                false => lost.push(host.name.clone()),
            }
        }
        Ok((alive, lost))
    }
}

/// Whether `probe` ends with success within `timeout` (none: no limit);
/// one that does not end in time is asked to end, then killed, with
/// everything it started (it leads a process group of its own).
fn answers(mut probe: Command, timeout: Option<Duration>) -> std::io::Result<bool> {
    use std::os::unix::process::CommandExt;
    probe
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0);
    let mut child = probe.spawn()?;
    let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
    if let Some(status) = wait_until(&mut child, deadline) {
        return Ok(status.success());
    }
    signal_group(child.id(), false);
    if wait_until(&mut child, Instant::now().checked_add(END_GRACE)).is_none() {
        signal_group(child.id(), true);
        let _ = child.wait();
    }
    Ok(false)
}

/// `child`'s status, once it ends before `deadline` (none: whenever it
/// ends).
fn wait_until(child: &mut Child, deadline: Option<Instant>) -> Option<ExitStatus> {
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if deadline.is_none_or(|d| Instant::now() < d) => {
                std::thread::sleep(Duration::from_millis(20));
            }
            _ => return None,
        }
    }
}

/// The first `ranks` slots of `hosts`, in order: the last hosts' slots
/// left unused (a host left with none dropped).
fn first_slots(hosts: Vec<Host>, ranks: usize) -> Vec<Host> {
    let mut left = ranks;
    hosts
        .into_iter()
        .filter_map(|host| {
            let slots = host.slots.min(left);
            left -= slots;
            (slots > 0).then_some(Host { slots, ..host })
        })
        .collect()
}
