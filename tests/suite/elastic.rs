//! Elastic restarts: thread ranks that fail start again from the newest
//! state and finish to the bytes of a run that never failed; a supervisor
//! of processes starts a failed job again on the hosts that answer, says
//! which start it is, and ends with an error naming why when it cannot
//! go on.

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use candle_dp::fabric::{Fabric, FabricConfig, Strategy};
use candle_dp::launch::{Elastic, ElasticError, Host, JobFailed, JobLauncher, LaunchError};

use crate::common::fabric_loop::{dataset, devices_for_two, train_resumable, AfterStep, Trained};
use crate::common::{diff_report, identical};

/// A fresh directory of its own for each call.
fn tempdir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("candle-dp-elastic-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `strategy` on two ranks (one where it spreads in one process), every
/// collective bounded.
fn config(strategy: Strategy, dir: PathBuf, max_restarts: usize) -> FabricConfig {
    let devices = devices_for_two(strategy);
    FabricConfig {
        chunks: Some(2),
        checkpoint_dir: Some(dir),
        max_restarts,
        timeout_secs: Some(120.0),
        ..FabricConfig::new(strategy, devices)
    }
}

/// Rank 0's outcome, and how many times the job started.
type Outcome = (candle_dp::Result<Trained>, usize);

/// The shared loop, saving every second step; the last rank fails right
/// after step `fail_after` in each of the first `failing_starts` starts.
/// Returns rank 0's outcome and the starts each rank saw.
fn train(config: &FabricConfig, fail_after: u64, failing_starts: usize) -> Outcome {
    let data = dataset();
    let starts = AtomicUsize::new(0);
    let outcome = Fabric::launch(config.clone(), |fabric| {
        if fabric.rank() == 0 {
            starts.fetch_add(1, Ordering::SeqCst);
        }
        train_resumable(fabric, data.clone(), |fabric, step| {
            let last = fabric.rank() + 1 == fabric.world_size();
            if last && step == fail_after && fabric.restart() < failing_starts {
                anyhow::bail!("lost its device after step {step}");
            }
            Ok(match step % 2 {
                0 => AfterStep::Save,
                _ => AfterStep::Go,
            })
        })
    });
    (outcome.map(|mut r| r.swap_remove(0)), starts.into_inner())
}

#[test]
fn thread_ranks_that_fail_restart_from_the_newest_state_to_the_bytes_of_a_run_that_did_not() {
    for strategy in Strategy::ALL {
        let straight = train(&config(strategy, tempdir("straight"), 0), 0, 0);
        let straight: Trained = straight.0.unwrap();
        // Fails after step 3 (its newest state is step 2's) twice: two
        // restarts, each repeating step 3.
        let (restarted, starts) = train(&config(strategy, tempdir("restarted"), 2), 3, 2);
        let restarted = restarted.unwrap_or_else(|e| panic!("{strategy}: {e}"));
        assert_eq!(starts, 3, "{strategy}: starts");
        assert!(
            identical(&restarted.0, &straight.0),
            "{strategy}: weights after two restarts differ\n{}",
            diff_report(&restarted.0, &straight.0)
        );
        // The last start's losses are those of steps 3.. of the run that
        // did not fail.
        assert_eq!(restarted.1, straight.1[2..], "{strategy}: losses");
    }
}

#[test]
fn thread_ranks_out_of_restarts_end_with_the_last_failure_naming_the_rank() {
    let (outcome, starts) = train(&config(Strategy::Ddp, tempdir("out"), 1), 1, 5);
    assert_eq!(starts, 2);
    let error = outcome.unwrap_err();
    let candle_dp::Error::Elastic(elastic) = &error else {
        panic!("not an elastic error: {error}");
    };
    let ElasticError::OutOfRestarts { max_restarts, last } = elastic.as_ref() else {
        panic!("not out of restarts: {elastic}");
    };
    assert_eq!(*max_restarts, 1);
    assert!(
        matches!(
            last.downcast_ref::<LaunchError>(),
            Some(LaunchError::Failed { rank: 1, .. })
        ),
        "{last}"
    );
    let said = error.to_string();
    assert!(
        said.contains("failed 2 time(s)")
            && said.contains("rank 1 failed: lost its device after step 1"),
        "{said}"
    );
}

#[test]
fn restarts_without_a_checkpoint_dir_are_refused_before_anything_runs() {
    let config = FabricConfig {
        max_restarts: 2,
        ..FabricConfig::new(Strategy::Ddp, 2)
    };
    let ran = AtomicUsize::new(0);
    let error = Fabric::launch(config, |_| {
        ran.fetch_add(1, Ordering::SeqCst);
        Ok(())
    })
    .unwrap_err();
    assert!(error.to_string().contains("max_restarts 2"), "{error}");
    assert!(error.to_string().contains("checkpoint_dir"), "{error}");
    assert_eq!(ran.into_inner(), 0);
}

/// A launcher of shell commands: the job runs `job` (a shell script that
/// sees `$CANDLE_DP_RESTART` and `$HOSTS`), a host answers its probe
/// when its name does not start with `down` (a `down` host's probe
/// sleeps past any timeout).
#[derive(Debug)]
struct Shell {
    job: String,
}

impl JobLauncher for Shell {
    fn job(&self, hosts: &[Host]) -> Command {
        let list: Vec<String> = hosts.iter().map(Host::to_string).collect();
        let mut command = Command::new("sh");
        command
            .arg("-c")
            .arg(&self.job)
            .env("HOSTS", list.join(","));
        command
    }

    fn probe(&self, host: &Host) -> Command {
        let mut command = Command::new("sh");
        command.arg("-c").arg(match host.name.starts_with("down") {
            true => "sleep 30",
            false => "true",
        });
        command
    }
}

fn elastic(max_restarts: usize, min_ranks: usize) -> Elastic {
    Elastic {
        probe_timeout: Duration::from_millis(500),
        ..Elastic::new(max_restarts).min_ranks(min_ranks)
    }
}

#[test]
fn a_supervised_job_starts_again_on_the_hosts_that_answer_telling_the_ranks_which_start() {
    let dir = tempdir("supervised");
    let log = dir.join("starts");
    // Fails on its first two starts; each start writes its number and hosts.
    let job = Shell {
        job: format!(
            "echo \"$CANDLE_DP_RESTART $HOSTS\" >> {log}; [ \"$CANDLE_DP_RESTART\" -ge 2 ]",
            log = log.display()
        ),
    };
    let hosts = Host::parse_list("a:2,down1:2,b:1").unwrap();
    let run = elastic(3, 3).supervise(&hosts, &job).unwrap();
    assert_eq!(
        std::fs::read_to_string(&log).unwrap(),
        "0 a:2,b:1\n1 a:2,b:1\n2 a:2,b:1\n"
    );
    assert_eq!(run.attempts.len(), 3);
    for attempt in &run.attempts {
        assert_eq!(attempt.lost, ["down1"]);
        assert_eq!(attempt.ranks(), 3);
        // The lost host's probe (a 30 s sleep) was ended at its 0.5 s
        // timeout, not waited for: a hang guard with a wide margin, not a
        // speed claim.
        assert!(attempt.probing < Duration::from_secs(20), "{attempt:?}");
    }
    assert!(run.attempts[2].status.success());
}

#[test]
fn a_supervised_job_below_its_minimum_or_out_of_restarts_ends_naming_why() {
    let never = Shell {
        job: "exit 3".into(),
    };
    let hosts = Host::parse_list("a:2,down1:2").unwrap();
    // Two ranks answer; four are needed.
    let error = elastic(3, 4).supervise(&hosts, &never).unwrap_err();
    assert!(
        matches!(&error, ElasticError::TooFewRanks { ranks: 2, min_ranks: 4, lost, .. } if lost == &["down1"]),
        "{error}"
    );
    assert_eq!(
        error.to_string(),
        "2 rank(s) can start, fewer than the minimum of 4 (lost: down1)"
    );
    // Enough ranks, but the job fails every time.
    let error = elastic(1, 2).supervise(&hosts, &never).unwrap_err();
    let ElasticError::OutOfRestarts { max_restarts, last } = &error else {
        panic!("{error}");
    };
    assert_eq!(*max_restarts, 1);
    let last = last.downcast_ref::<JobFailed>().expect("a JobFailed");
    assert_eq!((last.ranks, last.hosts.as_str()), (2, "a:2"));
    assert_eq!(last.status.code(), Some(3));
    assert!(
        error.to_string().starts_with("the job failed 2 time(s)"),
        "{error}"
    );
}

/// With `ranks_dividing` (the global batch), a start takes the most
/// slots that divide it, the last hosts' slots left unused; below the
/// minimum it ends naming the slots and the number.
#[test]
fn a_supervised_start_takes_the_most_slots_that_divide_the_batch() {
    let dir = tempdir("dividing");
    let log = dir.join("starts");
    // Fails on its first start; each start writes its hosts.
    let job = Shell {
        job: format!(
            "echo \"$HOSTS\" >> {log}; [ \"$CANDLE_DP_RESTART\" -ge 1 ]",
            log = log.display()
        ),
    };
    // 2 + 2 + 1 slots answer: 4 divide the batch of 8, 5 do not.
    let hosts = Host::parse_list("a:2,down1:3,b:2,c:1").unwrap();
    let run = elastic(1, 1)
        .ranks_dividing(8)
        .supervise(&hosts, &job)
        .unwrap();
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "a:2,b:2\na:2,b:2\n");
    assert_eq!(run.attempts[1].ranks(), 4);
    // 3 slots answer for a batch of 9: all three; for 8, two.
    let three = Host::parse_list("a:2,c:1").unwrap();
    let both = Shell { job: "true".into() };
    let run = elastic(0, 1)
        .ranks_dividing(9)
        .supervise(&three, &both)
        .unwrap();
    assert_eq!(run.attempts[0].ranks(), 3);
    let run = elastic(0, 1)
        .ranks_dividing(8)
        .supervise(&three, &both)
        .unwrap();
    assert_eq!(run.attempts[0].ranks(), 2);
    let error = elastic(0, 3)
        .ranks_dividing(8)
        .supervise(&three, &both)
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "2 rank(s) can start (of 3 slots, the most that divide 8), fewer than the minimum of 3"
    );
}

#[test]
fn a_host_lost_after_a_failed_start_names_that_failure_and_a_probe_that_cannot_run_is_no_lost_host()
{
    let dir = tempdir("before");
    // Host `once` answers its first probe only.
    let job = Shell {
        job: "exit 3".into(),
    };
    let launcher = OnceHost {
        shell: job,
        marker: dir.join("probed"),
    };
    let hosts = Host::parse_list("a:2,once:2").unwrap();
    let error = elastic(3, 4).supervise(&hosts, &launcher).unwrap_err();
    assert_eq!(
        error.to_string(),
        "2 rank(s) can start, fewer than the minimum of 4 (lost: once); before: the job on 4 \
         rank(s) (a:2,once:2) ended with exit status: 3"
    );
    // A probe whose program does not exist is the launcher's fault, not
    // the host's.
    let error = elastic(3, 1).supervise(&hosts, &NoSuchProbe).unwrap_err();
    assert!(
        matches!(&error, ElasticError::Start { command, .. } if command.contains("no-such-launcher")),
        "{error}"
    );
}

/// [`Shell`], whose host `once` answers only its first probe.
#[derive(Debug)]
struct OnceHost {
    shell: Shell,
    marker: PathBuf,
}

impl JobLauncher for OnceHost {
    fn job(&self, hosts: &[Host]) -> Command {
        self.shell.job(hosts)
    }

    fn probe(&self, host: &Host) -> Command {
        if host.name != "once" {
            return self.shell.probe(host);
        }
        let mut command = Command::new("sh");
        command
            .arg("-c")
            .arg("[ ! -e \"$1\" ] && touch \"$1\"")
            .arg("sh")
            .arg(&self.marker);
        command
    }
}

/// A launcher whose probes cannot be started.
#[derive(Debug)]
struct NoSuchProbe;

impl JobLauncher for NoSuchProbe {
    fn job(&self, _: &[Host]) -> Command {
        Command::new("true")
    }

    fn probe(&self, _: &Host) -> Command {
        Command::new("no-such-launcher")
    }
}

#[test]
fn host_lists_that_cannot_be_read_are_refused_naming_the_entry() {
    for (list, says) in [
        ("", "has no host name"),
        ("a:2,,b", "has no host name"),
        ("a:x", "\"a:x\": slots must be a number of at least 1"),
        ("a:0", "slots must be a number of at least 1"),
        ("a,b:2,a:3", "a is given twice"),
    ] {
        let error = Host::parse_list(list).unwrap_err();
        assert!(error.to_string().contains(says), "{list:?}: {error}");
    }
    let hosts = Host::parse_list(" 10.0.0.1:4 , node2 ").unwrap();
    assert_eq!(
        hosts,
        [
            Host {
                name: "10.0.0.1".into(),
                slots: 4
            },
            Host {
                name: "node2".into(),
                slots: 1
            }
        ]
    );
}
