//! The examples refuse a numeric flag that makes no sense as the flags are
//! parsed, naming the flag and what is wrong: `train_lm --clip-grad-norm
//! nan` used to train without clipping and `--checkpoint-every 0` to save
//! nothing, both exiting 0. The shared parsers
//! (`candle_dp_examples::flags`) are tested here directly too.

use crate::common;

use std::process::{Command, Output};
use std::time::Duration;

use common::killing::{bounded_output, example};

use candle_dp_examples::flags;

/// Runs the example `name` with `args` (clap's messages without colours).
fn run(name: &str, args: &[&str]) -> Output {
    let mut command = Command::new(example(name));
    command
        .args(args)
        .env("NO_COLOR", "1")
        .env_remove("CLICOLOR_FORCE");
    bounded_output(command, Duration::from_secs(120))
}

/// The standard error of the example `name` run with `args`, after
/// checking that clap refused them: exit status 2 (clap's for a usage
/// error) and nothing on standard output (nothing ran).
fn refused(name: &str, args: &[&str]) -> String {
    let output = run(name, args);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(
        output.status.code(),
        Some(2),
        "{name} {args:?} was not refused as its flags were parsed:\n{stdout}\n{stderr}"
    );
    assert!(
        stdout.is_empty(),
        "{name} {args:?} started before refusing:\n{stdout}"
    );
    stderr
}

/// Asserts that `stderr` names `flag` and says `why`.
fn names(stderr: &str, flag: &str, why: &str) {
    assert!(stderr.contains(flag), "{flag} not named:\n{stderr}");
    assert!(stderr.contains(why), "{why:?} not said:\n{stderr}");
}

/// A directory of this test that does not exist.
fn unmade_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "candle_dp_example_flags_{name}_{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn train_lm_refuses_a_clip_norm_that_is_not_a_number_naming_the_flag() {
    let stderr = refused("train_lm", &["--clip-grad-norm", "nan"]);
    names(
        &stderr,
        "--clip-grad-norm",
        "must be a finite number, got NaN",
    );
}

#[test]
fn train_lm_refuses_checkpoint_every_zero_and_saves_nothing() {
    let dir = unmade_dir("lm_every_0");
    let dir_arg = dir.to_str().expect("a UTF-8 temporary directory");
    let stderr = refused(
        "train_lm",
        &["--checkpoint-dir", dir_arg, "--checkpoint-every", "0"],
    );
    names(&stderr, "--checkpoint-every", "must be at least 1, got 0");
    assert!(!dir.exists(), "{} was made", dir.display());
}

#[test]
fn train_lm_refuses_a_negative_weight_decay_and_an_infinite_learning_rate() {
    let stderr = refused("train_lm", &["--weight-decay=-0.1"]);
    names(&stderr, "--weight-decay", "must be 0 or more, got -0.1");
    let stderr = refused("train_lm", &["--lr", "inf"]);
    names(&stderr, "--lr", "must be a finite number, got inf");
}

#[test]
fn train_lm_refuses_zero_steps_and_zero_heads() {
    let stderr = refused("train_lm", &["--steps", "0"]);
    names(&stderr, "--steps", "must be at least 1, got 0");
    let stderr = refused("train_lm", &["--heads", "0"]);
    names(&stderr, "--heads", "must be at least 1, got 0");
}

/// Every default passes its parser: the run gets past the parsing to its
/// own first check (a width that does not divide into the heads).
#[test]
fn train_lm_accepts_its_default_values() {
    let output = run("train_lm", &["--width", "5", "--heads", "2"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("does not divide into 2 heads"), "{stderr}");
}

#[test]
fn train_digits_refuses_a_clip_norm_that_is_not_a_number_naming_the_flag() {
    let stderr = refused("train_digits", &["--clip-grad-norm", "NaN"]);
    names(
        &stderr,
        "--clip-grad-norm",
        "must be a finite number, got NaN",
    );
}

#[test]
fn train_digits_refuses_a_learning_rate_of_zero_and_zero_epochs() {
    let stderr = refused("train_digits", &["--lr", "0"]);
    names(&stderr, "--lr", "must be greater than 0, got 0");
    let stderr = refused("train_digits", &["--epochs", "0"]);
    names(&stderr, "--epochs", "must be at least 1, got 0");
}

#[test]
fn train_digits_refuses_checkpoint_every_zero_and_saves_nothing() {
    let dir = unmade_dir("digits_every_0");
    let dir_arg = dir.to_str().expect("a UTF-8 temporary directory");
    let stderr = refused(
        "train_digits",
        &["--checkpoint-dir", dir_arg, "--checkpoint-every", "0"],
    );
    names(&stderr, "--checkpoint-every", "must be at least 1, got 0");
    assert!(!dir.exists(), "{} was made", dir.display());
}

/// Every default passes its parser: the run gets past the parsing to its
/// own first check (ZeRO asked of a strategy without it).
#[test]
fn train_digits_accepts_its_default_values() {
    let output = run("train_digits", &["--strategy", "single", "--zero", "1"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("--zero shards"), "{stderr}");
}

#[test]
fn pipeline_refuses_zero_chunks_and_a_batch_of_zero_rows() {
    let stderr = refused("pipeline", &["--chunks", "0"]);
    names(&stderr, "--chunks", "must be at least 1, got 0");
    let stderr = refused("pipeline", &["--batch", "0"]);
    names(&stderr, "--batch", "must be at least 1, got 0");
}

#[test]
fn pipeline_refuses_zero_stages_and_a_count_that_is_not_a_whole_number() {
    let stderr = refused("pipeline", &["--stages", "0"]);
    names(&stderr, "--stages", "must be at least 1, got 0");
    let stderr = refused("pipeline", &["--epochs", "2.5"]);
    names(
        &stderr,
        "--epochs",
        "must be a whole number of 1 or more, got '2.5'",
    );
}

#[test]
fn the_shared_parsers_refuse_nan_infinities_and_values_out_of_range_saying_why() {
    type Parser = fn(&str) -> Result<f64, String>;
    let parsers: [Parser; 4] = [
        flags::finite_f64,
        flags::positive_f64,
        flags::non_negative_f64,
        flags::fraction,
    ];
    for nan in ["nan", "NaN", "-nan"] {
        for parse in parsers {
            assert_eq!(parse(nan), Err("must be a finite number, got NaN".into()));
        }
    }
    assert_eq!(
        flags::finite_f64("inf"),
        Err("must be a finite number, got inf".into())
    );
    assert_eq!(
        flags::non_negative_f64("-infinity"),
        Err("must be a finite number, got -inf".into())
    );
    assert_eq!(
        flags::finite_f64("1e400"),
        Err("must be a finite number, got inf".into())
    );
    assert_eq!(
        flags::finite_f64("one"),
        Err("must be a number, got 'one'".into())
    );
    assert_eq!(
        flags::positive_f64("0"),
        Err("must be greater than 0, got 0".into())
    );
    assert_eq!(
        flags::positive_f64("-2"),
        Err("must be greater than 0, got -2".into())
    );
    assert_eq!(
        flags::non_negative_f64("-0.5"),
        Err("must be 0 or more, got -0.5".into())
    );
    assert_eq!(
        flags::fraction("1.5"),
        Err("must be between 0 and 1, got 1.5".into())
    );
    assert_eq!(
        flags::at_least_one::<u64>("0"),
        Err("must be at least 1, got 0".into())
    );
    assert_eq!(
        flags::at_least_one::<usize>("-1"),
        Err("must be a whole number of 1 or more, got '-1'".into())
    );
    assert_eq!(
        flags::at_least_one::<u16>("65536"),
        Err("must be a smaller number, got 65536".into())
    );
}

#[test]
fn the_shared_parsers_keep_valid_values_as_they_are() {
    assert_eq!(flags::finite_f64("-3.25"), Ok(-3.25));
    assert_eq!(flags::positive_f64("0.002"), Ok(0.002));
    assert_eq!(flags::positive_f64("1e-3"), Ok(1e-3));
    // 0 is valid where it means "none": no weight decay, no clipping.
    assert_eq!(flags::non_negative_f64("0"), Ok(0.0));
    assert_eq!(flags::non_negative_f64("0.1"), Ok(0.1));
    assert_eq!(flags::fraction("0"), Ok(0.0));
    assert_eq!(flags::fraction("1"), Ok(1.0));
    assert_eq!(flags::at_least_one::<usize>("20"), Ok(20));
    assert_eq!(flags::at_least_one::<u64>("1"), Ok(1));
    assert_eq!(flags::at_least_one::<u16>("65535"), Ok(u16::MAX));
}

/// `--gpus` lists GPUs: a lone number is one GPU (not a count, as in
/// `--devices`), and anything but ordinals is refused saying so.
#[test]
fn gpu_lists_read_a_lone_number_as_one_gpu() {
    use candle_dp::fabric::Devices;
    assert_eq!(flags::gpu_ordinals("0"), Ok(Devices::Ids(vec![0])));
    assert_eq!(flags::gpu_ordinals("[1]"), Ok(Devices::Ids(vec![1])));
    assert_eq!(flags::gpu_ordinals("0, 0"), Ok(Devices::Ids(vec![0, 0])));
    assert_eq!(
        flags::gpu_ordinals("two"),
        Err("must be GPU ordinals like 0 or 0,1, got 'two'".into())
    );
    let stderr = refused("train_lm", &["--gpus", "0,x"]);
    names(
        &stderr,
        "--gpus",
        "must be GPU ordinals like 0 or 0,1, got '0,x'",
    );
}
