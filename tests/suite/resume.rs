//! A killed job resumes to the same bytes. The main job (`train_digits`,
//! DataParallel and DDP on thread ranks) and the pipeline example are
//! killed with SIGKILL at pseudo-random moments and while a save is under
//! way, restarted with `--resume` each time, and finally run to the end:
//! their saved weights equal an uninterrupted run's byte for byte. (Under
//! `mpirun`: `tests/mpi.rs`.)

use crate::common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::killing::{bounded_output, example, fractions, run_and_kill, run_to_end, KillAt};

/// Kills `job` at each of `kills` (restarting it with `--resume` each
/// time), then lets it finish; returns the bytes it saved, after checking
/// them against an uninterrupted run's. `job(dir, save)` is the command
/// with its checkpoint directory and weights file.
fn resumes_to_the_same_bytes(name: &str, job: impl Fn(&Path, &Path) -> Command, kills: usize) {
    let root = std::env::temp_dir().join(format!("candle_dp_resume_{name}_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    let (straight, resumed) = (
        root.join("straight.safetensors"),
        root.join("resumed.safetensors"),
    );
    let start = Instant::now();
    run_to_end(job(&root.join("straight-states"), &straight), name);
    let whole = start.elapsed();

    // Kill points: pseudo-random moments within the first 1/(kills + 1) of
    // a whole run's time (so that every restart still has work left), and
    // (every third) the first save under way.
    let states = root.join("states");
    let mut report = Vec::new();
    let window = whole.div_f64((kills + 1) as f64);
    for (i, fraction) in fractions(name.len() as u64, kills).into_iter().enumerate() {
        let at = if i % 3 == 2 {
            KillAt::DuringSave
        } else {
            KillAt::After(window.mul_f64(fraction))
        };
        let killed = run_and_kill(job(&states, &resumed), at, &states, |child| {
            Some(child.id())
        });
        report.push(format!("{at:?}: {killed:?}"));
    }
    run_to_end(job(&states, &resumed), name);
    let (want, got) = (
        std::fs::read(&straight).unwrap(),
        std::fs::read(&resumed).unwrap(),
    );
    assert!(
        got == want,
        "{name}: the resumed run saved other weights than the uninterrupted one; kills: {report:#?}"
    );
    println!("{name}: same bytes after {kills} kills: {report:#?}");
    assert!(
        report.iter().any(|r| r.contains("resumed: Some(")),
        "{name}: no run resumed from a saved state: {report:#?}"
    );
    let _ = std::fs::remove_dir_all(&root);
}

/// `train_digits` with checkpoints every 2 steps, resuming.
fn train_digits(strategy: &'static str) -> impl Fn(&Path, &Path) -> Command {
    move |states, save| {
        let mut command = Command::new(example("train_digits"));
        command
            .args([
                "--strategy",
                strategy,
                "--epochs",
                "3",
                "--seed",
                "3",
                "--no-reference",
            ])
            .args(["--checkpoint-every", "2", "--resume"])
            .arg("--checkpoint-dir")
            .arg(states)
            .arg("--save")
            .arg(save)
            .arg("--chart")
            .arg(states.with_extension("svg"));
        command
    }
}

#[test]
fn data_parallel_killed_five_times_resumes_to_the_same_bytes() {
    resumes_to_the_same_bytes("dp", train_digits("dp"), 5);
}

#[test]
fn ddp_on_thread_ranks_killed_five_times_resumes_to_the_same_bytes() {
    resumes_to_the_same_bytes("ddp", train_digits("ddp"), 5);
}

#[test]
fn a_pipeline_killed_five_times_resumes_to_the_same_bytes() {
    resumes_to_the_same_bytes(
        "pipeline",
        |states, save| {
            let mut command = Command::new(example("pipeline"));
            command
                .args([
                    "--epochs",
                    "3",
                    "--no-reference",
                    "--checkpoint-every",
                    "2",
                    "--resume",
                ])
                .arg("--checkpoint-dir")
                .arg(states)
                .arg("--save")
                .arg(save);
            command
        },
        5,
    );
}

/// `--resume` on an empty directory says so and trains from scratch.
#[test]
fn resume_without_a_state_says_so_and_starts_from_scratch() {
    let root = std::env::temp_dir().join(format!("candle_dp_resume_empty_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let command = train_digits("single")(&root.join("states"), &root.join("w.safetensors"));
    let output = bounded_output(command, Duration::from_secs(300));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(stderr.contains("no complete training state in"), "{stderr}");
    assert!(stderr.contains("starting from scratch"), "{stderr}");
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn ddp_with_zero_stage_2_killed_five_times_resumes_to_the_same_bytes() {
    // Each rank saves its shard of AdamW's state; the state naming the
    // step is written once all are.
    let job = train_digits("ddp");
    resumes_to_the_same_bytes(
        "zero",
        move |states, save| {
            let mut command = job(states, save);
            command.args(["--zero", "2", "--replicas", "3"]);
            command
        },
        5,
    );
}

/// With f16 (its loss scale), clipping and a warm-up + cosine schedule,
/// under ZeRO-2 on 2 thread ranks: the scale, its growth tracker and the
/// schedule's position are in the saved state and come back exactly.
#[test]
fn f16_zero_training_with_clipping_and_a_schedule_killed_resumes_to_the_same_bytes() {
    let job = train_digits("ddp");
    resumes_to_the_same_bytes(
        "f16",
        move |states, save| {
            let mut command = job(states, save);
            command.args(["--zero", "2", "--model", "mlp", "--precision", "f16"]);
            command.args(["--clip-grad-norm", "0.5", "--lr-schedule", "warmup-cosine"]);
            command
        },
        3,
    );
}

/// The main job under FSDP on 2 thread ranks, with clipping and a
/// schedule, killed three times: each rank's pieces and AdamW state, saved
/// without gathering, come back to the uninterrupted run's bytes.
#[test]
fn fsdp_training_with_clipping_and_a_schedule_killed_resumes_to_the_same_bytes() {
    let job = train_digits("fsdp");
    resumes_to_the_same_bytes(
        "fsdp",
        move |states, save| {
            let mut command = job(states, save);
            command.args(["--clip-grad-norm", "0.5", "--lr-schedule", "warmup-cosine"]);
            command
        },
        3,
    );
}

/// The same with bf16 on DataParallel.
#[test]
fn bf16_data_parallel_with_a_schedule_killed_resumes_to_the_same_bytes() {
    let job = train_digits("dp");
    resumes_to_the_same_bytes(
        "bf16",
        move |states, save| {
            let mut command = job(states, save);
            command.args(["--model", "mlp", "--precision", "bf16"]);
            command.args(["--clip-grad-norm", "1", "--lr-schedule", "warmup-cosine"]);
            command
        },
        3,
    );
}

/// The language model (`train_lm`, a small configuration) at ZeRO stage 2
/// in bf16 with clipping and warm-up + cosine, killed three times: its
/// shards, schedule and weights come back to the uninterrupted run's bytes.
#[test]
fn the_language_model_killed_three_times_resumes_to_the_same_bytes() {
    resumes_to_the_same_bytes(
        "lm",
        |states, save| {
            let mut command = Command::new(example("train_lm"));
            command
                .args(["--strategy", "zero", "--layers", "1", "--width", "16"])
                .args(["--heads", "2", "--context", "16", "--batch", "4"])
                .args(["--steps", "40", "--eval-every", "20", "--sample", "0"])
                .args(["--precision", "bf16", "--checkpoint-every", "2", "--resume"])
                .arg("--checkpoint-dir")
                .arg(states)
                .arg("--save")
                .arg(save)
                .arg("--chart")
                .arg(states.with_extension("svg"));
            command
        },
        3,
    );
}

/// The language model under FSDP (2 thread ranks, each saving its own
/// pieces and AdamW state, no gathering), with clipping and warm-up +
/// cosine, killed three times: it comes back to the uninterrupted run's
/// bytes.
#[test]
fn the_language_model_under_fsdp_killed_three_times_resumes_to_the_same_bytes() {
    resumes_to_the_same_bytes(
        "lm-fsdp",
        |states, save| {
            let mut command = Command::new(example("train_lm"));
            command
                .args(["--strategy", "fsdp", "--layers", "2", "--width", "16"])
                .args(["--heads", "2", "--context", "16", "--batch", "4"])
                .args(["--steps", "40", "--eval-every", "20", "--sample", "0"])
                .args(["--checkpoint-every", "2", "--resume"])
                .arg("--checkpoint-dir")
                .arg(states)
                .arg("--save")
                .arg(save)
                .arg("--chart")
                .arg(states.with_extension("svg"));
            command
        },
        3,
    );
}
