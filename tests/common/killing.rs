//! Killing a training job at chosen moments and resuming it: the harness
//! of the resume tests (`tests/suite/resume.rs`, and under `mpirun` in
//! `tests/mpi.rs`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The longest any one run of a job may take.
pub const RUN_DEADLINE: Duration = Duration::from_secs(300);

/// An example program beside this test binary
/// (`target/<profile>/deps/<test>-…` → `target/<profile>/examples/<name>`).
pub fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let path = exe
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .join("examples")
        .join(name);
    assert!(
        path.exists(),
        "{} is missing: `cargo test` builds the examples (under MPI: `cargo build --features mpi --example {name}` first, as .ci/run does)",
        path.display()
    );
    path
}

/// When to kill a run.
#[derive(Debug, Clone, Copy)]
pub enum KillAt {
    /// This long after it started.
    After(Duration),
    /// This long after it started, and not before it has saved a training
    /// state of its own (so that the next run resumes past where this one
    /// began, however long a process takes to start).
    AfterItsFirstSave(Duration),
    /// As soon as a save of a training state is under way in the
    /// checkpoint directory (its temporary folder exists) while a complete
    /// state is already there (so that the next run resumes from it).
    DuringSave,
}

/// What one killed attempt did.
#[derive(Debug, Default, Clone)]
pub struct Killed {
    /// The run was still going when the kill came (else it had finished).
    pub interrupted: bool,
    /// A new temporary folder of a save was left behind: the kill landed
    /// inside a save.
    pub inside_a_save: bool,
    /// The line in which the run said where it resumed from, if it did.
    pub resumed: Option<String>,
}

/// Starts `command`, kills `victim(child)` (the process itself, or one of
/// its own children) with SIGKILL at `at`, and waits for `command` to end.
pub fn run_and_kill(
    mut command: Command,
    at: KillAt,
    checkpoints: &Path,
    victim: impl Fn(&Child) -> Option<u32>,
) -> Killed {
    let before = saves_under_way(checkpoints);
    let states_before = states(checkpoints);
    let mut child = command
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the job starts");
    // Read on a thread, so that a chatty job never blocks on its pipe.
    let stderr = child.stderr.take().map(|mut pipe| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = std::io::Read::read_to_string(&mut pipe, &mut text);
            text
        })
    });
    let start = Instant::now();
    let mut killed = Killed::default();
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        assert!(
            start.elapsed() < RUN_DEADLINE,
            "a run went on past {RUN_DEADLINE:?}"
        );
        let due = match at {
            KillAt::After(delay) => start.elapsed() >= delay,
            KillAt::AfterItsFirstSave(delay) => {
                start.elapsed() >= delay && states(checkpoints) != states_before
            }
            KillAt::DuringSave => {
                has_a_state(checkpoints) && !saves_under_way(checkpoints).is_subset(&before)
            }
        };
        if due {
            if let Some(pid) = victim(&child) {
                let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
                killed.interrupted = true;
                break;
            }
        }
        match at {
            // A save can take well under a millisecond: look without pause.
            KillAt::DuringSave => std::thread::yield_now(),
            KillAt::After(_) | KillAt::AfterItsFirstSave(_) => {
                std::thread::sleep(Duration::from_micros(200))
            }
        }
    }
    // A killed rank makes mpirun end the others. Open MPI 4.1's mpirun can
    // hang in its own shutdown once every process is gone (see
    // tests/mpi.rs): ended after 10 s without a live child.
    let mut childless_since: Option<Instant> = None;
    while child.try_wait().unwrap().is_none() {
        if ranks_of(child.id()).is_empty() {
            let since = *childless_since.get_or_insert_with(Instant::now);
            if since.elapsed() > Duration::from_secs(10) {
                let _ = child.kill();
            }
        } else {
            childless_since = None;
        }
        if start.elapsed() > RUN_DEADLINE {
            let _ = child.kill();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    killed.inside_a_save = killed.interrupted && !saves_under_way(checkpoints).is_subset(&before);
    let text = stderr.and_then(|t| t.join().ok()).unwrap_or_default();
    killed.resumed = text
        .lines()
        .find(|l| l.contains("resuming from"))
        .map(str::to_string);
    killed
}

/// Runs `command` to the end; panics with its output if it fails.
pub fn run_to_end(mut command: Command, what: &str) {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the job starts");
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > RUN_DEADLINE {
            let _ = child.kill();
            panic!("{what} ran past {RUN_DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let output = child.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "{what} failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Whether `dir` holds a state folder (`state-…`).
fn has_a_state(dir: &Path) -> bool {
    !states(dir).is_empty()
}

/// The state folders (`state-…`) in `dir`.
fn states(dir: &Path) -> std::collections::BTreeSet<std::ffi::OsString> {
    named_from(dir, "state-")
}

/// The names in `dir` that start with `prefix`.
fn named_from(dir: &Path, prefix: &str) -> std::collections::BTreeSet<std::ffi::OsString> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.file_name())
                .filter(|n| n.to_str().is_some_and(|n| n.starts_with(prefix)))
                .collect()
        })
        .unwrap_or_default()
}

/// The temporary folders of saves in `dir` (a save under way, or one a
/// kill interrupted).
fn saves_under_way(dir: &Path) -> std::collections::BTreeSet<std::ffi::OsString> {
    named_from(dir, ".tmp-state-")
}

/// The children of `parent` that have not exited, with their environment
/// variable `OMPI_COMM_WORLD_RANK` (from `/proc`).
pub fn ranks_of(parent: u32) -> Vec<(u32, Option<usize>)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            let rest = stat.rsplit_once(')')?.1;
            let mut fields = rest.split_whitespace();
            let state = fields.next()?;
            let ppid: u32 = fields.next()?.parse().ok()?;
            if ppid != parent || state == "Z" || state == "X" {
                return None;
            }
            let environ = std::fs::read(entry.path().join("environ")).unwrap_or_default();
            let rank = environ
                .split(|&b| b == 0)
                .filter_map(|v| std::str::from_utf8(v).ok())
                .find_map(|v| v.strip_prefix("OMPI_COMM_WORLD_RANK="))
                .and_then(|r| r.parse().ok());
            Some((pid, rank))
        })
        .collect()
}

/// Deterministic pseudo-random fractions in [0.1, 0.9) (a small LCG, so
/// that the kill points of a failing run can be replayed).
pub fn fractions(seed: u64, n: usize) -> Vec<f64> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            0.1 + 0.8 * ((state >> 11) as f64 / (1u64 << 53) as f64)
        })
        .collect()
}

/// Runs `command` to the end and returns its output; a run past `limit`
/// is killed and fails the test (the pipes are read on threads, so a
/// chatty command never blocks on them).
pub fn bounded_output(mut command: Command, limit: Duration) -> std::process::Output {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the command starts");
    let read = |pipe: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut bytes);
            }
            bytes
        })
    };
    let stdout = read(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn std::io::Read + Send>),
    );
    let stderr = read(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn std::io::Read + Send>),
    );
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{command:?} ran past {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    std::process::Output {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    }
}
