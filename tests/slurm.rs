//! Under Slurm (`scripts/slurm.sh`: a one-node cluster of munge,
//! slurmctld and slurmd on this machine): `srun` starts the ranks, Open
//! MPI joins them through PMIx, and the main job trains to the bytes of as
//! many thread ranks, on a flat group and on a mesh; `scancel` ends every
//! rank of a running job and leaves no process behind; a job whose rank is
//! killed finishes to the bytes of an uninterrupted run, requeued by its
//! batch script or restarted in its allocation by a supervisor of `srun`
//! steps.
//!
//! Needs root, Slurm and munge (`.ci/run` installs them when missing), Open
//! MPI and the `mpi` feature; where Slurm cannot run, each test prints why
//! and passes without running.
#![cfg(feature = "mpi")]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::killing::{bounded_output, example};

/// One cluster at a time: its daemons listen on fixed ports.
static CLUSTER: Mutex<()> = Mutex::new(());

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/slurm.sh")
}

/// A one-node Slurm cluster, up while this lives (one at a time: the
/// next test's waits until this one is down).
struct Cluster {
    dir: PathBuf,
    conf: PathBuf,
    _one: std::sync::MutexGuard<'static, ()>,
}

impl Cluster {
    /// The cluster for test `name`, or `None` after printing why there
    /// can be none here.
    fn for_test(name: &str) -> Option<Cluster> {
        Cluster::up(name)
            .inspect_err(|why| println!("skipped: {why}"))
            .ok()
    }

    /// The cluster, or why there can be none here.
    fn up(name: &str) -> Result<Cluster, String> {
        let one = CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
        let mut check = Command::new("bash");
        check.arg(script()).arg("check");
        let checked = bounded_output(check, Duration::from_secs(30));
        if !checked.status.success() {
            return Err(text(&checked).trim().to_string());
        }
        let dir =
            std::env::temp_dir().join(format!("candle_dp_slurm_{}_{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut up = Command::new("bash");
        up.arg(script()).arg("up").arg(&dir);
        let started = bounded_output(up, Duration::from_secs(90));
        let cluster = Cluster {
            conf: dir.join("slurm.conf"),
            dir,
            _one: one,
        };
        assert!(started.status.success(), "slurm.sh up: {}", text(&started));
        Ok(cluster)
    }

    /// A Slurm command against this cluster.
    fn command(&self, program: &str) -> Command {
        let mut command = Command::new(program);
        command.env("SLURM_CONF", &self.conf);
        command
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let mut down = Command::new("bash");
        down.arg(script()).arg("down").arg(&self.dir);
        bounded_output(down, Duration::from_secs(60));
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// `train_lm`'s flags for a run of `steps` steps of a small model that
/// saves its weights and losses under `dir` as `name` (its chart there
/// too: a name no other process's command line holds).
fn lm_args(dir: &Path, name: &str, run: &[&str], steps: u32) -> Vec<std::ffi::OsString> {
    let mut args: Vec<std::ffi::OsString> = run.iter().map(Into::into).collect();
    let steps = steps.to_string();
    let small = ["--width", "32", "--context", "32", "--sample", "0"];
    for flag in ["--steps", &steps, "--eval-every", &steps]
        .into_iter()
        .chain(small)
    {
        args.push(flag.into());
    }
    let file = |ext: &str| dir.join(format!("{name}.{ext}")).into_os_string();
    args.extend(["--chart".into(), file("svg")]);
    args.extend(["--losses".into(), file("csv")]);
    args
}

/// [`lm_args`] that also save the weights as `name.safetensors`.
fn lm_args_saving(dir: &Path, name: &str, run: &[&str], steps: u32) -> Vec<std::ffi::OsString> {
    let mut args = lm_args(dir, name, run, steps);
    let file = dir.join(format!("{name}.safetensors"));
    args.extend(["--save".into(), file.into_os_string()]);
    args
}

#[test]
fn srun_trains_ddp_fsdp_hsdp_and_a_mesh_of_pipelines_to_the_bytes_of_thread_ranks() {
    let Some(cluster) = Cluster::for_test("bytes") else {
        return;
    };
    let exe = example("train_lm");
    let dir = cluster.dir.join("runs");
    std::fs::create_dir_all(&dir).unwrap();
    // (the strategy's flags on thread ranks, under srun, and the ranks)
    let runs: [(&[&str], &[&str], usize); 4] = [
        (
            &["--strategy", "ddp", "--replicas", "2"],
            &["--strategy", "ddp"],
            2,
        ),
        (
            &["--strategy", "fsdp", "--replicas", "2"],
            &["--strategy", "fsdp"],
            2,
        ),
        // srun's tasks per node give HSDP its shard groups (4 here, one node).
        (
            &["--strategy", "hsdp", "--replicas", "4"],
            &["--strategy", "hsdp"],
            4,
        ),
        (
            &["--strategy", "pipeline", "--mesh", "dp=2,pp=2"],
            &["--strategy", "pipeline", "--mesh", "dp=2,pp=2"],
            4,
        ),
    ];
    for (threads_run, srun_run, ranks) in runs {
        let label = srun_run.join(" ");
        let mut threads = Command::new(&exe);
        threads.args(lm_args_saving(&dir, "threads", threads_run, 3));
        let threads = bounded_output(threads, Duration::from_secs(240));
        assert!(threads.status.success(), "{label}: {}", text(&threads));
        let mut srun = cluster.command("srun");
        srun.args([
            "--mpi=pmix",
            "--kill-on-bad-exit=1",
            "-n",
            &ranks.to_string(),
        ])
        .arg(&exe)
        .args(lm_args_saving(&dir, "srun", srun_run, 3));
        let start = Instant::now();
        let srun = bounded_output(srun, Duration::from_secs(240));
        assert!(srun.status.success(), "{label}: {}", text(&srun));
        assert!(
            text(&srun).contains("MPI processes"),
            "{label}: not run as MPI processes\n{}",
            text(&srun)
        );
        for file in ["safetensors", "csv"] {
            let read = |name: &str| std::fs::read(dir.join(format!("{name}.{file}"))).unwrap();
            assert!(
                read("threads") == read("srun"),
                "{label}: the {file} under srun -n {ranks} differs from {ranks} thread ranks'"
            );
        }
        println!(
            "srun -n {ranks} {label}: the bytes of thread ranks ({:?})",
            start.elapsed()
        );
    }
}

/// The processes whose command line matches `marker` (a regular
/// expression, as `pgrep -f` reads it).
fn processes_with(marker: &str) -> Vec<String> {
    let output = Command::new("pgrep")
        .args(["-f", "-a", marker])
        .output()
        .unwrap();
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter(|line| !line.contains("pgrep"))
        .map(str::to_string)
        .collect()
}

#[test]
fn scancel_ends_every_rank_of_a_running_job_and_leaves_no_process() {
    let Some(cluster) = Cluster::for_test("scancel") else {
        return;
    };
    let exe = example("train_lm");
    // A job that would run for hours; its chart's name marks its processes.
    let marker = format!("candle_dp_scancel_{}", std::process::id());
    let chart = cluster.dir.join(format!("{marker}.svg"));
    let mut sbatch = cluster.command("sbatch");
    sbatch
        .args(["--parsable", "-n", "2", "--output"])
        .arg(cluster.dir.join("job.out"))
        .arg("--wrap")
        .arg(format!(
            "srun --mpi=pmix -n 2 {} --strategy ddp --steps 1000000 --eval-every 1000000 \
             --width 32 --context 32 --sample 0 --chart {}",
            exe.display(),
            chart.display()
        ));
    let submitted = bounded_output(sbatch, Duration::from_secs(30));
    assert!(submitted.status.success(), "sbatch: {}", text(&submitted));
    let job = String::from_utf8_lossy(&submitted.stdout)
        .trim()
        .to_string();
    // Both ranks running.
    let deadline = Instant::now() + Duration::from_secs(60);
    while processes_with(&marker).len() < 2 {
        assert!(
            Instant::now() < deadline,
            "job {job}: its two ranks did not start within 60 s"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let mut scancel = cluster.command("scancel");
    scancel.arg(&job);
    let cancelled = bounded_output(scancel, Duration::from_secs(30));
    assert!(cancelled.status.success(), "scancel: {}", text(&cancelled));
    let start = Instant::now();
    let deadline = start + Duration::from_secs(30);
    loop {
        let left = processes_with(&marker);
        if left.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "30 s after scancel these processes of job {job} remain:\n{}",
            left.join("\n")
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    println!("scancel: every rank gone after {:?}", start.elapsed());
}

/// A state folder (`state-…`) in `dir`.
fn has_a_state(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|entries| {
        entries
            .flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with("state-"))
    })
}

/// What [`lm_job`] trains, on two ranks, [`JOB_STEPS`] steps: DDP (under
/// srun the launcher decides the ranks, `--replicas` is for the thread-rank
/// run), or a pipeline of two stages, one per rank. A rank is killed once
/// the first state is saved (step 20), so the run goes on for 60 more
/// steps: seconds, where the killer polls every 0.1 s.
const JOB_RUNS: [[&str; 4]; 2] = [
    ["--strategy", "ddp", "--replicas", "2"],
    ["--strategy", "pipeline", "--mesh", "pp=2"],
];
const JOB_STEPS: u32 = 80;

/// What the jobs of `run` are compared with: the same training on two
/// thread ranks, uninterrupted, saved as `threads.safetensors`.
fn uninterrupted_on_threads(cluster: &Cluster, run: &[&str]) {
    let mut threads = Command::new(example("train_lm"));
    threads.args(lm_args_saving(&cluster.dir, "threads", run, JOB_STEPS));
    let threads = bounded_output(threads, Duration::from_secs(240));
    assert!(
        threads.status.success(),
        "{}: {}",
        run.join(" "),
        text(&threads)
    );
}

/// `scripts/train_lm.sbatch` as a job of two tasks training `train_lm`
/// (`run`), a state every 20 steps, at most `step_restarts` restarts of
/// its step in the allocation, then at most `max_restarts` requeues; its
/// id.
fn lm_job(cluster: &Cluster, run: &[&str], max_restarts: u32, step_restarts: u32) -> String {
    let mut sbatch = cluster.command("sbatch");
    sbatch
        .current_dir(&cluster.dir)
        .env("TRAIN_LM", example("train_lm"))
        .env("CHECKPOINT_DIR", cluster.dir.join("states"))
        .env("CHECKPOINT_EVERY", "20")
        .env("MAX_RESTARTS", max_restarts.to_string())
        .env("STEP_RESTARTS", step_restarts.to_string())
        .env("FINAL", cluster.dir.join("job.safetensors"))
        .args(["--parsable", "-n", "2", "--output"])
        .arg(cluster.dir.join("job.out"))
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/train_lm.sbatch"))
        .args(lm_args(&cluster.dir, "job", run, JOB_STEPS));
    let submitted = bounded_output(sbatch, Duration::from_secs(30));
    assert!(submitted.status.success(), "sbatch: {}", text(&submitted));
    String::from_utf8_lossy(&submitted.stdout)
        .trim()
        .to_string()
}

/// Once the job has saved a state, kills one of its ranks (SIGKILL).
fn kill_a_rank_after_a_state(cluster: &Cluster, job: &str) {
    let marker = cluster.dir.join("job.svg").display().to_string();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let ranks: Vec<String> = processes_with(&marker)
            .into_iter()
            // The ranks (PMIx's rank in their environment): not srun, the
            // batch script, or train_lm supervising its steps, whose
            // command lines hold the marker too.
            .filter(|line| is_pmix_rank(line))
            .collect();
        if ranks.len() == 2 && has_a_state(&cluster.dir.join("states")) {
            let pid = ranks[1].split_whitespace().next().unwrap();
            let killed = Command::new("kill").args(["-9", pid]).status().unwrap();
            assert!(killed.success(), "kill -9 {pid}");
            return;
        }
        assert!(
            Instant::now() < deadline,
            "job {job}: no state with two ranks running within 120 s\n{}",
            std::fs::read_to_string(cluster.dir.join("job.out")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits (at most `limit`) until the job has left the queue; a requeued
/// job is made eligible at once (Slurm holds one for two minutes).
fn wait_for_the_end(cluster: &Cluster, job: &str, limit: Duration) -> String {
    let deadline = Instant::now() + limit;
    loop {
        let mut squeue = cluster.command("squeue");
        squeue.args(["-h", "-j", job, "-o", "%T %r"]);
        let state = text(&bounded_output(squeue, Duration::from_secs(30)));
        if state.trim().is_empty() || state.contains("Invalid job id") {
            break;
        }
        // Once the killed run's step has been cleaned up (a new step
        // launched before fails to start).
        let old_step = format!("slurmstepd: \\[{job}\\.");
        if state.contains("BeginTime") && processes_with(&old_step).is_empty() {
            let mut update = cluster.command("scontrol");
            update.args(["update", &format!("JobId={job}"), "StartTime=now"]);
            bounded_output(update, Duration::from_secs(30));
        }
        assert!(
            Instant::now() < deadline,
            "job {job} still queued after {limit:?}: {state}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    std::fs::read_to_string(cluster.dir.join("job.out")).unwrap_or_default()
}

#[test]
fn a_job_whose_rank_is_killed_requeues_itself_and_resumes_to_the_bytes_of_an_uninterrupted_run() {
    for (k, run) in JOB_RUNS.iter().enumerate() {
        let Some(cluster) = Cluster::for_test(&format!("requeue-{k}")) else {
            return;
        };
        let label = run.join(" ");
        uninterrupted_on_threads(&cluster, run);
        let job = lm_job(&cluster, run, 2, 0);
        let start = Instant::now();
        kill_a_rank_after_a_state(&cluster, &job);
        let killed = start.elapsed();
        let out = wait_for_the_end(&cluster, &job, Duration::from_secs(240));
        for expected in [
            "requeueing",
            "restarts so far: 1 of at most 2",
            "resuming from",
            "train_lm.sbatch: finished; the weights are in",
        ] {
            assert!(out.contains(expected), "{label}: no `{expected}`\n{out}");
        }
        let read = |name: &str| std::fs::read(cluster.dir.join(format!("{name}.safetensors")));
        assert!(
            read("job").unwrap() == read("threads").unwrap(),
            "{label}: the requeued job's weights differ from an uninterrupted run's"
        );
        println!(
            "{label}: killed after {killed:?}, finished to the same bytes after {:?}",
            start.elapsed()
        );
    }
}

#[test]
fn a_job_out_of_restarts_ends_failed_saying_why() {
    let Some(cluster) = Cluster::for_test("no-restarts") else {
        return;
    };
    let job = lm_job(&cluster, &JOB_RUNS[0], 0, 0);
    kill_a_rank_after_a_state(&cluster, &job);
    let out = wait_for_the_end(&cluster, &job, Duration::from_secs(120));
    assert!(
        out.contains("after 0 restarts, the most MAX_RESTARTS allows: giving up"),
        "{out}"
    );
    assert!(!out.contains("train_lm.sbatch: finished"), "{out}");
    assert!(!cluster.dir.join("job.safetensors").exists(), "{out}");
}

/// Whether the process of `line` (`pgrep -a`: pid first) is a rank that
/// PMIx started (its environment has `PMIX_RANK`).
fn is_pmix_rank(line: &str) -> bool {
    let Some(pid) = line.split_whitespace().next() else {
        return false;
    };
    std::fs::read(format!("/proc/{pid}/environ"))
        .is_ok_and(|env| env.split(|&b| b == 0).any(|v| v.starts_with(b"PMIX_RANK=")))
}

/// The pid of the rank `rank` (its `SLURM_PROCID`) among the processes
/// whose command line holds `marker`.
fn slurm_rank_with(marker: &str, rank: usize) -> Option<String> {
    let wanted = format!("SLURM_PROCID={rank}");
    processes_with(marker).into_iter().find_map(|line| {
        let pid = line.split_whitespace().next()?.to_string();
        let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
        environ
            .split(|&b| b == 0)
            .any(|v| v == wanted.as_bytes())
            .then_some(pid)
    })
}

/// The elastic supervisor with `srun` as its launcher (`train_lm --hosts
/// NODE:2 --launcher srun`), as inside an allocation: a rank killed after
/// the first state ends the step, the supervisor starts a new one on the
/// node, which answers its probe, and the job resumes to the bytes of an
/// uninterrupted run, without a requeue.
#[test]
fn a_supervisor_of_srun_restarts_a_step_whose_rank_is_killed_to_the_bytes_of_an_uninterrupted_run()
{
    let Some(cluster) = Cluster::for_test("elastic") else {
        return;
    };
    let run = &JOB_RUNS[0];
    uninterrupted_on_threads(&cluster, run);
    let mut sinfo = cluster.command("sinfo");
    sinfo.args(["-h", "-o", "%N"]);
    let node = text(&bounded_output(sinfo, Duration::from_secs(30)))
        .trim()
        .to_string();
    let states = cluster.dir.join("states");
    let mut supervisor = cluster.command(&example("train_lm").display().to_string());
    supervisor
        .args(lm_args_saving(&cluster.dir, "elastic", run, JOB_STEPS))
        .args(["--hosts", &format!("{node}:2"), "--launcher", "srun"])
        .args(["--launcher-option=--mpi=pmix", "--max-restarts", "2"])
        .args([
            "--timeout",
            "60",
            "--checkpoint-every",
            "20",
            "--checkpoint-dir",
        ])
        .arg(&states);
    let marker = cluster.dir.join("elastic.svg").display().to_string();
    let killer = std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(120);
        while Instant::now() < deadline {
            if let (true, Some(pid)) = (has_a_state(&states), slurm_rank_with(&marker, 1)) {
                return Command::new("kill")
                    .args(["-9", &pid])
                    .status()
                    .is_ok_and(|s| s.success());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    });
    let output = bounded_output(supervisor, Duration::from_secs(300));
    let said = text(&output);
    assert!(
        killer.join().unwrap(),
        "no rank 1 with a state to kill:\n{said}"
    );
    assert!(output.status.success(), "{said}");
    for expected in [
        format!("elastic: restart 1 of at most 2: 2 rank(s) on {node}:2"),
        "resuming from".to_string(),
    ] {
        assert!(said.contains(&expected), "no `{expected}`:\n{said}");
    }
    let read = |name: &str| std::fs::read(cluster.dir.join(format!("{name}.safetensors")));
    assert!(
        read("elastic").unwrap() == read("threads").unwrap(),
        "the restarted job's weights differ from an uninterrupted run's"
    );
}

/// `STEP_RESTARTS=2`: the batch script supervises its srun steps
/// (`train_lm --hosts slurm --launcher srun`); a killed rank's step starts
/// again inside the allocation, without a requeue, and the job finishes to
/// the bytes of an uninterrupted run.
#[test]
fn a_batch_job_with_step_restarts_restarts_its_step_without_a_requeue_to_the_bytes_of_an_uninterrupted_run(
) {
    let Some(cluster) = Cluster::for_test("step-restarts") else {
        return;
    };
    let run = &JOB_RUNS[0];
    uninterrupted_on_threads(&cluster, run);
    let job = lm_job(&cluster, run, 2, 2);
    kill_a_rank_after_a_state(&cluster, &job);
    let out = wait_for_the_end(&cluster, &job, Duration::from_secs(240));
    for expected in [
        "elastic: restart 1 of at most 2: 2 rank(s)",
        "resuming from",
        "train_lm.sbatch: finished; the weights are in",
    ] {
        assert!(out.contains(expected), "no `{expected}`\n{out}");
    }
    assert!(!out.contains("requeueing"), "{out}");
    let read = |name: &str| std::fs::read(cluster.dir.join(format!("{name}.safetensors")));
    assert!(
        read("job").unwrap() == read("threads").unwrap(),
        "the restarted job's weights differ from an uninterrupted run's"
    );
}
