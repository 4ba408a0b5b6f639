//! Several machines, simulated (`scripts/netcluster.sh`): ranks in
//! separate network namespaces, over TCP only. The main job trains to the
//! same bytes as on thread ranks; a machine cut off mid-training ends every
//! rank, the cut-off one included, within the group's timeout, naming the
//! rank that did not arrive, and leaves no process behind.
//!
//! Needs root (network namespaces), Open MPI and the `mpi` feature; where
//! namespaces cannot be made, each test prints why and passes without
//! running (as CI does not promise them).
#![cfg(feature = "mpi")]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::killing::{bounded_output, example};

/// An empty folder of this test process's for `name`.
fn fresh_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("{name}_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/netcluster.sh")
}

/// `None` when a cluster can be made here, else why not.
fn unavailable() -> Option<String> {
    let mut check = Command::new("bash");
    check.arg(script()).arg("check");
    let output = bounded_output(check, Duration::from_secs(60));
    match output.status.success() {
        true => None,
        false => Some(String::from_utf8_lossy(&output.stdout).trim().to_string()),
    }
}

/// Runs the script (bounded by `limit`), returning its output and how
/// long it took.
fn cluster(args: &[&str], program: &[&std::ffi::OsStr], limit: Duration) -> (Output, Duration) {
    let start = Instant::now();
    let mut child = Command::new("bash")
        .arg(script())
        .arg("run")
        .args(args)
        .arg("--")
        .args(program)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            // SIGTERM: the script tears the cluster down.
            let _ = Command::new("kill").arg(child.id().to_string()).status();
            let output = child.wait_with_output().unwrap();
            panic!(
                "the cluster ran past {limit:?}:\n{}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    (child.wait_with_output().unwrap(), start.elapsed())
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// The main job's weights on 2 "machines" x 1 and x 2 processes equal
/// those of as many thread ranks, byte for byte.
#[test]
fn train_digits_on_two_simulated_machines_saves_the_same_weights_as_thread_ranks() {
    if let Some(why) = unavailable() {
        println!("skipped: {why}");
        return;
    }
    let exe = example("train_digits");
    let dir = fresh_dir("candle_dp_netcluster");
    for per_machine in [1, 2] {
        let ranks = 2 * per_machine;
        let save = |name: &str| dir.join(format!("{name}-{ranks}.safetensors"));
        let args = |file: &Path| {
            let mut args: Vec<std::ffi::OsString> = [
                "--strategy",
                "ddp",
                "--epochs",
                "2",
                "--seed",
                "5",
                "--no-reference",
            ]
            .iter()
            .map(Into::into)
            .collect();
            args.extend(["--replicas".into(), ranks.to_string().into()]);
            args.extend(["--chart".into(), dir.join("chart.svg").into_os_string()]);
            args.extend(["--save".into(), file.as_os_str().to_owned()]);
            args
        };
        let mut threads = Command::new(&exe);
        threads.args(args(&save("threads")));
        let threads = bounded_output(threads, Duration::from_secs(240));
        assert!(threads.status.success(), "{}", text(&threads));
        let mut program = vec![exe.as_os_str()];
        let cluster_args = args(&save("cluster"));
        program.extend(cluster_args.iter().map(|a| a.as_os_str()));
        let per = per_machine.to_string();
        let (output, took) = cluster(
            &["--machines", "2", "--per-machine", &per],
            &program,
            Duration::from_secs(240),
        );
        assert!(output.status.success(), "{}", text(&output));
        assert!(
            !text(&output).contains("still running at teardown"),
            "{}",
            text(&output)
        );
        let (a, b) = (
            std::fs::read(save("threads")).unwrap(),
            std::fs::read(save("cluster")).unwrap(),
        );
        assert!(
            a == b,
            "2 machines x {per_machine}: other weights than {ranks} thread ranks"
        );
        println!("2 machines x {per_machine}: same bytes as {ranks} thread ranks ({took:?})");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Machine 2's link goes down in the middle of training: every rank ends
/// within the timeout (5 s here) with an error naming the rank that did
/// not arrive, mpirun exits with a failure, and no process is left on
/// either machine.
#[test]
fn a_machine_cut_off_mid_training_ends_every_rank_within_the_timeout_naming_it() {
    if let Some(why) = unavailable() {
        println!("skipped: {why}");
        return;
    }
    let exe = example("train_digits");
    let dir = fresh_dir("candle_dp_partition");
    let chart = dir.join("chart.svg");
    let program = [
        exe.as_os_str(),
        "--strategy".as_ref(),
        "ddp".as_ref(),
        "--epochs".as_ref(),
        "200".as_ref(),
        "--timeout".as_ref(),
        "5".as_ref(),
        "--no-reference".as_ref(),
        "--chart".as_ref(),
        chart.as_os_str(),
    ];
    // The second time the machine comes back, after the timeout fired:
    // too late to change what was decided.
    for restore in [None, Some("9.5")] {
        let mut args = vec![
            "--machines",
            "2",
            "--cut",
            "2",
            "--cut-after",
            "4",
            "--wait-empty",
            "20",
        ];
        args.extend(
            restore
                .map(|r| ["--restore-after", r])
                .into_iter()
                .flatten(),
        );
        let (output, took) = cluster(&args, &program, Duration::from_secs(120));
        let said = text(&output);
        assert!(!output.status.success(), "the job ended well:\n{said}");
        assert!(said.contains("machine 2 cut off"), "{said}");
        assert!(
            said.contains("[rank 0]") && said.contains("rank(s) [1] did not arrive"),
            "rank 0 does not name rank 1:\n{said}"
        );
        assert!(
            !said.contains("still running at teardown"),
            "a process outlived the job:\n{said}"
        );
        println!(
            "partition (back at {restore:?}): the job ended {took:?} after its start (cut at +4 s):\n{said}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The language model's four stages, one per process, over two machines
/// (two stages each, `--block`: stages 1 and 2 meet across the link)
/// train to the bytes of four stage thread ranks, the loss curve too.
#[test]
fn the_language_models_stages_on_two_simulated_machines_save_the_bytes_of_stage_thread_ranks() {
    if let Some(why) = unavailable() {
        println!("skipped: {why}");
        return;
    }
    let exe = example("train_lm");
    let dir = fresh_dir("candle_dp_netcluster_lm");
    let args = |name: &str| -> Vec<std::ffi::OsString> {
        let mut args: Vec<std::ffi::OsString> = [
            "--strategy",
            "pipeline",
            "--mesh",
            "pp=4",
            "--steps",
            "4",
            "--eval-every",
            "4",
            "--width",
            "32",
            "--context",
            "32",
            "--sample",
            "0",
        ]
        .iter()
        .map(Into::into)
        .collect();
        args.extend(["--chart".into(), dir.join("chart.svg").into_os_string()]);
        args.extend([
            "--save".into(),
            dir.join(format!("{name}.safetensors")).into(),
        ]);
        args.extend(["--losses".into(), dir.join(format!("{name}.csv")).into()]);
        args
    };
    let mut threads = Command::new(&exe);
    threads.args(args("threads"));
    let threads = bounded_output(threads, Duration::from_secs(240));
    assert!(threads.status.success(), "{}", text(&threads));
    let cluster_args = args("cluster");
    let mut program = vec![exe.as_os_str()];
    program.extend(cluster_args.iter().map(|a| a.as_os_str()));
    let (output, took) = cluster(
        &["--machines", "2", "--per-machine", "2", "--block"],
        &program,
        Duration::from_secs(240),
    );
    assert!(output.status.success(), "{}", text(&output));
    assert!(
        text(&output).contains("1 pipeline(s) of 4 stages on MPI processes"),
        "{}",
        text(&output)
    );
    for file in ["safetensors", "csv"] {
        let read = |name: &str| std::fs::read(dir.join(format!("{name}.{file}"))).unwrap();
        assert!(
            read("threads") == read("cluster"),
            "the {file} of 4 stages on two machines differs from 4 stage thread ranks'"
        );
    }
    println!("4 stages on two machines: the bytes of thread ranks ({took:?})");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The language model's flags for these runs: `strategy`, a constant
/// learning rate (so that a run of fewer steps follows the same curve), a
/// 5 s group timeout (how the ranks learn of the loss).
fn lm_args(dir: &Path, name: &str, steps: u64, strategy: &str) -> Vec<std::ffi::OsString> {
    let mut args = lm_flags(steps, strategy);
    args.extend(["--chart".into(), dir.join("chart.svg").into_os_string()]);
    args.extend([
        "--save".into(),
        dir.join(format!("{name}.safetensors")).into(),
    ]);
    args
}

/// The language model's flags of these tests, without the files.
fn lm_flags(steps: u64, strategy: &str) -> Vec<std::ffi::OsString> {
    let steps = steps.to_string();
    let mut args: Vec<std::ffi::OsString> = ["--steps", &steps, "--strategy", strategy]
        .map(Into::into)
        .to_vec();
    args.extend(
        [
            "--lr-schedule",
            "constant",
            "--eval-every",
            "300",
            "--width",
            "32",
            "--context",
            "32",
            "--sample",
            "0",
            "--timeout",
            "5",
        ]
        .map(Into::into),
    );
    args
}

/// The step of the last "resuming from DIR/state-…: epoch E, batch B,
/// step S" line of a run's output.
fn last_resume_step(said: &str) -> Option<u64> {
    said.lines().rev().find_map(|l| {
        l.split_once("resuming from ")?
            .1
            .rsplit_once(", step ")?
            .1
            .trim()
            .parse()
            .ok()
    })
}

/// The language model under FSDP on thread ranks (`extra`: `--replicas`
/// and the like), its states in `states`, its weights saved as
/// `dir/name.safetensors`.
fn fsdp_on_threads(dir: &Path, states: &Path, name: &str, steps: u64, extra: &[&str]) {
    lm_on_threads(dir, states, name, steps, "fsdp", extra)
}

/// [`fsdp_on_threads`] with `strategy`.
fn lm_on_threads(
    dir: &Path,
    states: &Path,
    name: &str,
    steps: u64,
    strategy: &str,
    extra: &[&str],
) {
    let mut command = Command::new(example("train_lm"));
    command
        .args(lm_args(dir, name, steps, strategy))
        .args(extra)
        .arg("--checkpoint-dir")
        .arg(states);
    let output = bounded_output(command, Duration::from_secs(240));
    assert!(output.status.success(), "{}", text(&output));
}

/// How the supervisor starts the ranks in an elastic test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Via {
    /// `mpirun --host 10.213.7.N:1`.
    Mpirun,
    /// `srun --nodelist nodeN` on a Slurm cluster of the machines.
    Srun,
}

impl Via {
    /// What the supervisor calls the machines.
    fn host(self, machine: usize) -> String {
        match self {
            Via::Mpirun => format!("10.213.7.{machine}"),
            Via::Srun => format!("node{machine}"),
        }
    }
}

/// How many steps the runs that lose a machine train, a state every
/// [`STATE_EVERY`] of them; the machine is cut off once the state of step
/// [`CUT_AT`] is saved. The cut is tied to a step, not to a time, so that
/// it falls mid-run on a fast machine and on a slow one alike, and the run
/// need not be long enough to outlast a cut at a fixed time.
const ELASTIC_STEPS: u64 = 60;
const STATE_EVERY: &str = "10";
const CUT_AT: u64 = 20;

/// The cluster's flags that cut machine 2 off once the state of step
/// [`CUT_AT`] is in `states`.
fn cut_machine_2_at_a_state(states: &Path) -> Vec<String> {
    let saved = states.join(format!("state-{CUT_AT:012}-*"));
    ["--cut", "2", "--cut-when"]
        .map(String::from)
        .into_iter()
        .chain([saved.display().to_string()])
        .collect()
}

/// The supervisor on machine 1 of two (one rank each), machine 2 cut off
/// once the state of step [`CUT_AT`] is saved; `extra`: more flags for
/// train_lm.
fn supervised_lm_losing_machine_2(dir: &Path, via: Via, extra: &[&str]) -> (Output, Duration) {
    supervised_lm_of(dir, via, "fsdp", extra)
}

/// [`supervised_lm_losing_machine_2`] with `strategy`.
fn supervised_lm_of(dir: &Path, via: Via, strategy: &str, extra: &[&str]) -> (Output, Duration) {
    let exe = example("train_lm");
    let mut args = lm_args(dir, "elastic", ELASTIC_STEPS, strategy);
    let hosts = format!("{}:1,{}:1", via.host(1), via.host(2));
    args.extend(["--hosts", &hosts, "--checkpoint-every", STATE_EVERY].map(Into::into));
    // Slurm frees the lost node's job only once it marks the node down
    // (SlurmdTimeout, 10 s here): the probe of the machine left waits.
    args.extend(match via {
        Via::Mpirun => ["--probe-timeout", "5"].map(Into::into).to_vec(),
        Via::Srun => [
            "--launcher",
            "srun",
            "--launcher-option=--mpi=pmix",
            "--probe-timeout",
            "40",
        ]
        .map(Into::into)
        .to_vec(),
    });
    args.extend(extra.iter().map(Into::into));
    args.extend([
        "--checkpoint-dir".into(),
        dir.join("states").into_os_string(),
    ]);
    let mut program = vec![exe.as_os_str()];
    program.extend(args.iter().map(|a| a.as_os_str()));
    let cut = cut_machine_2_at_a_state(&dir.join("states"));
    let mut cluster_args = vec!["--machines", "2", "--supervise", "--wait-empty", "10"];
    cluster_args.extend(cut.iter().map(String::as_str));
    if via == Via::Srun {
        cluster_args.push("--slurm");
    }
    cluster(&cluster_args, &program, Duration::from_secs(300))
}

/// One Slurm cluster of simulated machines at a time: two at once on two
/// cores starve each other's daemons.
static SLURM: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Whether Slurm can run here (`scripts/slurm.sh check`), else why not.
fn slurm_unavailable() -> Option<String> {
    let mut check = Command::new("bash");
    check
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/slurm.sh"))
        .arg("check");
    let output = bounded_output(check, Duration::from_secs(30));
    match output.status.success() {
        true => None,
        false => Some(String::from_utf8_lossy(&output.stdout).trim().to_string()),
    }
}

/// torchrun's elastic restart, on the simulated cluster: a machine lost
/// mid-run ends the job (the group timeout); the supervisor finds the
/// machine gone and starts the job again on the one left, which resumes
/// FSDP's state of two ranks on one rank. Its final weights are the bytes
/// of two thread ranks trained to that state and one thread rank resumed
/// from it, and within rounding of an uninterrupted run.
#[test]
fn a_job_that_loses_a_machine_restarts_on_the_other_and_finishes_as_an_uninterrupted_run() {
    if let Some(why) = unavailable() {
        println!("skipped: {why}");
        return;
    }
    elastic_run_losing_machine_2(Via::Mpirun);
}

/// Deterministic training (issue 74): DDP on the two machines loses
/// machine 2, resumes on machine 1 alone, and ends at the very bits of the
/// run that lost nothing, on 2 thread ranks and on one.
#[test]
fn a_deterministic_job_that_loses_a_machine_ends_at_the_uninterrupted_runs_bits() {
    if let Some(why) = unavailable() {
        println!("skipped: {why}");
        return;
    }
    let dir = fresh_dir("candle_dp_elastic_deterministic");
    let chunks = ["--deterministic", "2"];
    let extra = [&["--max-restarts", "3"][..], &chunks].concat();
    let (output, took) = supervised_lm_of(&dir, Via::Mpirun, "ddp", &extra);
    let said = text(&output);
    assert!(output.status.success(), "{said}");
    let resumed_at = last_resume_step(&said).unwrap_or_else(|| panic!("no resume in:\n{said}"));
    let finished = format!(
        "| {}:1 | 1 | {} |",
        Via::Mpirun.host(1),
        Via::Mpirun.host(2)
    );
    assert!(
        said.lines()
            .any(|l| l.contains(&finished) && l.ends_with("| exit status: 0 |")),
        "the job did not finish on machine 1 alone:\n{said}"
    );
    let states = dir.join("threads");
    for (name, replicas) in [("straight", "2"), ("one", "1")] {
        let _ = std::fs::remove_dir_all(&states);
        let flags = [&["--replicas", replicas][..], &chunks].concat();
        lm_on_threads(&dir, &states, name, ELASTIC_STEPS, "ddp", &flags);
    }
    let load = |name: &str| {
        let path = dir.join(format!("{name}.safetensors"));
        candle_core::safetensors::load(path, &candle_core::Device::Cpu).unwrap()
    };
    for reference in ["straight", "one"] {
        assert!(
            common::identical(&load("elastic"), &load(reference)),
            "the elastic run differs from the uninterrupted run ({reference})"
        );
    }
    println!(
        "deterministic: lost machine 2 of 2, resumed at step {resumed_at} on machine 1, finished \
         in {took:?}, at the bits of the uninterrupted runs on 2 thread ranks and on 1"
    );
}

/// The same under Slurm: a Slurm cluster of the two machines, the
/// supervisor starting `srun` steps; the lost node's probe fails once
/// Slurm marks it down.
#[test]
fn a_job_of_srun_steps_that_loses_a_node_restarts_on_the_other_and_finishes_as_an_uninterrupted_run(
) {
    if let Some(why) = unavailable().or_else(slurm_unavailable) {
        println!("skipped: {why}");
        return;
    }
    let _one = SLURM.lock().unwrap_or_else(|e| e.into_inner());
    elastic_run_losing_machine_2(Via::Srun);
}

/// The lost-machine run through `via`, checked against thread ranks.
fn elastic_run_losing_machine_2(via: Via) {
    let dir = fresh_dir(&format!("candle_dp_elastic_{via:?}"));
    // Three restarts: a start may also fail for a reason of its own (on a
    // fresh machine, once, a rank crashed at its start under srun; the
    // supervisor started it again), and the loss must still be mended.
    let (output, took) = supervised_lm_losing_machine_2(&dir, via, &["--max-restarts", "3"]);
    let said = text(&output);
    assert!(output.status.success(), "{said}");
    let (one, two) = (via.host(1), via.host(2));
    assert!(
        said.contains("machine 2 cut off") && said.contains("timed out"),
        "{said}"
    );
    let restarted_on_one = said.lines().any(|l| {
        l.starts_with("elastic: restart ")
            && l.contains(&format!(": 1 rank(s) on {one}:1 "))
            && l.ends_with(&format!("lost: {two}"))
    });
    assert!(
        restarted_on_one,
        "no restart on {one} alone, {two} lost:\n{said}"
    );
    // The start that finished: on machine 1 alone, machine 2 lost.
    let finished = format!("| {one}:1 | 1 | {two} |");
    assert!(
        said.lines()
            .any(|l| l.contains(&finished) && l.ends_with("| exit status: 0 |")),
        "the job did not finish on {one} alone:\n{said}"
    );
    // Under Slurm the cut-off node's slurmstepd waits for a controller it
    // cannot reach (a real lost machine's would be gone with it); nothing
    // may be left on the machine that went on.
    assert!(
        !said.contains("machine 1: pid")
            && (via == Via::Srun || !said.contains("still running at teardown")),
        "a process outlived the job:\n{said}"
    );
    // "resuming from DIR/state-…: epoch E, batch B, step S": the last
    // resume, the one on one rank (a restart on two ranks before it keeps
    // the bytes of two ranks).
    let resumed_at: u64 =
        last_resume_step(&said).unwrap_or_else(|| panic!("no resume in:\n{said}"));
    assert!(
        (CUT_AT..ELASTIC_STEPS).contains(&resumed_at),
        "resumed at {resumed_at}"
    );
    // The same path on thread ranks: 2 ranks to the state, 1 from it.
    let states = dir.join("threads");
    let lm =
        |name: &str, steps: u64, extra: &[&str]| fsdp_on_threads(&dir, &states, name, steps, extra);
    lm("first", resumed_at, &["--replicas", "2"]);
    lm("threads", ELASTIC_STEPS, &["--replicas", "1", "--resume"]);
    let load = |name: &str| {
        let path = dir.join(format!("{name}.safetensors"));
        candle_core::safetensors::load(path, &candle_core::Device::Cpu).unwrap()
    };
    assert!(
        common::identical(&load("elastic"), &load("threads")),
        "the elastic run differs from thread ranks that took its path"
    );
    // Against the run that lost nothing, and what two ranks against one
    // differ by anyway.
    let _ = std::fs::remove_dir_all(&states);
    lm("straight", ELASTIC_STEPS, &["--replicas", "2"]);
    let _ = std::fs::remove_dir_all(&states);
    lm("one", ELASTIC_STEPS, &["--replicas", "1"]);
    let elastic = common::relative_l2(&load("elastic"), &load("straight"));
    let floor = common::relative_l2(&load("one"), &load("straight"));
    assert!(elastic <= 1e-4, "{elastic:.2e} from the uninterrupted run");
    println!(
        "{via:?}: lost machine 2 of 2 after the state of step {CUT_AT}, resumed at step {resumed_at} \
         on machine 1; finished in \
         {took:?}; the weights are the bytes of thread ranks on the same path, {elastic:.2e} \
         (relative L2) from the uninterrupted run on 2 ranks, where one rank's run is {floor:.2e} \
         from it:\n{said}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The same loss with `--min-ranks 2`: one rank is left, fewer than the
/// minimum, and the supervisor ends saying so, naming the lost machine.
#[test]
fn a_job_left_with_fewer_ranks_than_its_minimum_ends_naming_the_lost_machine() {
    if let Some(why) = unavailable() {
        println!("skipped: {why}");
        return;
    }
    let dir = fresh_dir("candle_dp_elastic_min");
    let (output, _) = supervised_lm_losing_machine_2(
        &dir,
        Via::Mpirun,
        &["--max-restarts", "2", "--min-ranks", "2"],
    );
    let said = text(&output);
    assert!(!output.status.success(), "{said}");
    assert!(
        said.contains("1 rank(s) can start, fewer than the minimum of 2 (lost: 10.213.7.2)"),
        "{said}"
    );
    assert!(!said.contains("elastic: restart 1"), "{said}");
    assert!(
        !said.contains("still running at teardown"),
        "a process outlived the job:\n{said}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The processes netcluster's teardown found still running (its lines
/// after "still running at teardown"), but Slurm's step daemons
/// (`slurmstepd`), which are Slurm's, not the job's.
fn leftovers_but_slurmstepd(said: &str) -> Vec<&str> {
    said.lines()
        .skip_while(|l| !l.contains("still running at teardown"))
        .skip(1)
        .take_while(|l| l.trim_start().starts_with("machine "))
        .filter(|l| !l.contains("slurmstepd"))
        .collect()
}

/// Slurm on several nodes: a Slurm cluster of two simulated machines
/// (`--slurm`), `srun --nodes=2 --mpi=pmix train_lm` (one task a node,
/// over TCP between them) saves the bytes of two thread ranks, under DDP
/// and FSDP.
#[test]
fn srun_on_two_simulated_nodes_trains_to_the_bytes_of_thread_ranks() {
    if let Some(why) = unavailable().or_else(slurm_unavailable) {
        println!("skipped: {why}");
        return;
    }
    let _one = SLURM.lock().unwrap_or_else(|e| e.into_inner());
    let exe = example("train_lm");
    let dir = fresh_dir("candle_dp_slurm_nodes");
    for strategy in ["ddp", "fsdp"] {
        let args = |name: &str| lm_args(&dir, name, 20, strategy);
        let mut threads = Command::new(&exe);
        threads.args(args("threads")).args(["--replicas", "2"]);
        let threads = bounded_output(threads, Duration::from_secs(240));
        assert!(threads.status.success(), "{}", text(&threads));
        let srun_args = args("srun");
        let mut program: Vec<&std::ffi::OsStr> = ["srun", "--nodes=2", "--ntasks=2", "--mpi=pmix"]
            .map(|a| a.as_ref())
            .to_vec();
        program.push(exe.as_os_str());
        program.extend(srun_args.iter().map(|a| a.as_os_str()));
        let run = || {
            cluster(
                // A step's slurmstepd can take past the default 10 s to end
                // on a loaded 2-core machine (it did once in CI, after a
                // run that had finished and saved the right bytes).
                &[
                    "--machines",
                    "2",
                    "--supervise",
                    "--slurm",
                    "--wait-empty",
                    "30",
                ],
                &program,
                Duration::from_secs(240),
            )
        };
        let (mut output, mut took) = run();
        // A rank's MPI thread has crashed at its start here (a call through
        // a null pointer, twice in about 30 runs; docs/notes/findings.md):
        // that is not what this test is about, so such a start is tried
        // once more, and said.
        if !output.status.success() && text(&output).contains("Segmentation fault") {
            println!(
                "{strategy}: a rank crashed at its start (the known crash); once more:\n{}",
                text(&output)
            );
            (output, took) = run();
        }
        let said = text(&output);
        assert!(output.status.success(), "{strategy}: {said}");
        assert!(said.contains("x2 (MPI processes)"), "{strategy}: {said}");
        // Slurm's own step daemon may outlive the wait on a loaded 2-core
        // machine (past 30 s once, in a run that had saved the right
        // bytes); nothing of the job may.
        let left = leftovers_but_slurmstepd(&said);
        assert!(
            left.is_empty(),
            "{strategy}: a process outlived the job: {left:?}\n{said}"
        );
        let read = |name: &str| std::fs::read(dir.join(format!("{name}.safetensors"))).unwrap();
        assert!(
            read("srun") == read("threads"),
            "{strategy}: srun on two nodes saved other weights than two thread ranks"
        );
        println!("{strategy}: srun on two simulated nodes, the bytes of thread ranks ({took:?})");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `sbatch --no-kill` over both simulated nodes, `scripts/train_lm.sbatch`
/// restarting its step within the allocation (`STEP_RESTARTS`, no
/// requeue): node 2 is cut off once the state of step [`CUT_AT`] is
/// saved; the supervisor finds it lost and
/// starts the step again on node 1 in the same allocation, which finishes.
/// Its weights are the bytes of thread ranks that took the same path (2
/// ranks to the state it resumed, 1 from there).
#[test]
fn a_no_kill_batch_job_that_loses_a_node_finishes_on_the_other_within_its_allocation() {
    if let Some(why) = unavailable().or_else(slurm_unavailable) {
        println!("skipped: {why}");
        return;
    }
    let _one = SLURM.lock().unwrap_or_else(|e| e.into_inner());
    let dir = fresh_dir("candle_dp_no_kill");
    let exe = example("train_lm");
    let (states, out) = (dir.join("states"), dir.join("job.out"));
    let sbatch = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/train_lm.sbatch");
    let mut program: Vec<std::ffi::OsString> = vec![
        "env".into(),
        format!("TRAIN_LM={}", exe.display()).into(),
        format!("CHECKPOINT_DIR={}", states.display()).into(),
        "STEP_RESTARTS=3".into(),
        "MAX_RESTARTS=0".into(),
        format!("CHECKPOINT_EVERY={STATE_EVERY}").into(),
        "sbatch".into(),
        "--wait".into(),
        "--no-kill".into(),
        "--nodes=2".into(),
        "--ntasks-per-node=1".into(),
        "--output".into(),
        out.clone().into_os_string(),
        sbatch.into_os_string(),
    ];
    program.extend(lm_flags(ELASTIC_STEPS, "fsdp"));
    // Slurm marks the lost node down after SlurmdTimeout (10 s here).
    program.extend(["--probe-timeout", "40"].map(Into::into));
    let program: Vec<&std::ffi::OsStr> = program.iter().map(|a| a.as_os_str()).collect();
    let cut = cut_machine_2_at_a_state(&states);
    let mut cluster_args = vec![
        "--machines",
        "2",
        "--supervise",
        "--slurm",
        "--wait-empty",
        "10",
    ];
    cluster_args.extend(cut.iter().map(String::as_str));
    let (output, took) = cluster(&cluster_args, &program, Duration::from_secs(300));
    let job = std::fs::read_to_string(&out).unwrap_or_default();
    let said = format!("{}\n{job}", text(&output));
    assert!(output.status.success(), "{said}");
    assert!(said.contains("machine 2 cut off"), "{said}");
    assert!(
        job.lines().any(|l| l.starts_with("elastic: restart ")
            && l.contains(": 1 rank(s) on node1:1 ")
            && l.ends_with("lost: node2")),
        "no restart on node1 alone within the allocation:\n{said}"
    );
    assert!(
        job.contains("train_lm.sbatch: finished") && !job.contains("requeueing"),
        "{said}"
    );
    let resumed_at: u64 = last_resume_step(&job).unwrap_or_else(|| panic!("no resume in:\n{said}"));
    // The same path on thread ranks.
    let threads = dir.join("threads");
    let lm = |name: &str, steps: u64, extra: &[&str]| {
        fsdp_on_threads(&dir, &threads, name, steps, extra)
    };
    lm("first", resumed_at, &["--replicas", "2"]);
    lm("path", ELASTIC_STEPS, &["--replicas", "1", "--resume"]);
    let load =
        |path: PathBuf| candle_core::safetensors::load(path, &candle_core::Device::Cpu).unwrap();
    assert!(
        common::identical(
            &load(states.join("final.safetensors")),
            &load(dir.join("path.safetensors"))
        ),
        "the batch job's weights differ from thread ranks that took its path"
    );
    println!(
        "sbatch --no-kill: node 2 lost after the state of step {CUT_AT}, the step restarted on node 1 \
         at step {resumed_at} \
         within the allocation; finished in {took:?}, the bytes of thread ranks on the same path"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
