//! Failure reports that stay readable when several processes share one
//! output stream.
//!
//! Under `mpirun` every process's standard error ends up in one stream,
//! and the launcher forwards whatever each process wrote as it arrives.
//! Rust's standard error is unbuffered, so a message printed with
//! `eprintln!` (or by `main` returning `Err`) leaves the process as several
//! writes, and the writes of two processes interleave mid-line ("Error:
//! rank 1 panicked: Error: rank 2 stopped because …"). Every report here is
//! built whole first and written with one call, each of its lines starting
//! with the process's rank (`[rank 1] …`, as `mpirun --tag-output` would
//! tag it). A pipe takes a single write of up to `PIPE_BUF` bytes (4 KiB on
//! Linux) in one piece, so a report of that size never interleaves.
//!
//! [`run`](super::run) prints the failure of its rank this way under MPI
//! itself (a rank's own failure before the others learn of it, since
//! `mpirun` may end this process as soon as another one exits). A program's
//! `main` reports what it returns with [`exit_code`], which does not print a
//! failure that `run` has already printed:
//!
//! ```no_run
//! use std::process::ExitCode;
//!
//! fn train() -> anyhow::Result<()> {
//!     anyhow::bail!("out of data")
//! }
//!
//! fn main() -> ExitCode {
//!     // Prints "[rank 1] out of data" on rank 1 of an MPI job, and
//!     // "out of data" outside one.
//!     candle_dp::launch::report::exit_code(train())
//! }
//! ```

#[cfg(feature = "mpi")]
use std::io;
#[cfg(feature = "mpi")]
use std::panic::{self, PanicHookInfo};
use std::process::ExitCode;
use std::sync::Mutex;

/// The reports [`run`](super::run) has printed, so that [`exit_code`] and
/// [`eprint_error`] do not print the same failure twice.
static PRINTED_BY_RUN: Mutex<Vec<String>> = Mutex::new(Vec::new());

pub use crate::report_lines::{eprint_report, line_prefix, prefixed_lines, write_report};

/// `error` and its causes on one line (`outer: cause: …`), leaving out a
/// cause whose text the line already holds (errors such as
/// [`LaunchError::Failed`](super::LaunchError::Failed) show their source
/// in their own message).
pub fn one_line(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(next) = cause {
        let said = next.to_string();
        if !text.contains(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        cause = next.source();
    }
    text
}

/// Prints `error` as a report on one line ([`one_line`]), unless
/// [`run`](super::run) has already printed this very failure.
pub fn eprint_error(error: &anyhow::Error) {
    let text = one_line(error.as_ref());
    let printed = PRINTED_BY_RUN
        .lock()
        .map(|printed| printed.contains(&text))
        .unwrap_or(false);
    if !printed {
        eprint_report(&text);
    }
}

/// The exit code of a `main` that ran `result`: success, or failure after
/// printing the error with [`eprint_error`]. Use it in place of `main`
/// returning `Result`, whose `Error: …` is printed in several writes.
pub fn exit_code<E: Into<anyhow::Error>>(result: Result<(), E>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprint_error(&error.into());
            ExitCode::FAILURE
        }
    }
}

#[cfg(feature = "mpi")]
/// Prints a failure of [`run`](super::run) as a report and remembers it.
pub(super) fn eprint_from_run(text: &str) {
    eprint_report(text);
    if let Ok(mut printed) = PRINTED_BY_RUN.lock() {
        printed.push(text.to_string());
    }
}

/// A panic hook, as `std::panic::take_hook` returns it.
#[cfg(feature = "mpi")]
type PanicHook = Box<dyn Fn(&PanicHookInfo<'_>) + Sync + Send + 'static>;

#[cfg(feature = "mpi")]
/// The panic hook in force while [`run`](super::run) runs a rank under
/// MPI; the one before it comes back when dropped.
pub(super) struct RankPanicHook {
    previous: Option<PanicHook>,
}

#[cfg(feature = "mpi")]
impl RankPanicHook {
    /// Replaces the panic hook with one that prints each panic (thread,
    /// place, message, and the backtrace when `RUST_BACKTRACE` asks for
    /// one) as one report, its lines prefixed with `rank`. It does not
    /// call the hook it replaces, which would print the panic again, in
    /// pieces; that hook is back once `run` returns.
    pub(super) fn install(rank: usize) -> Self {
        let previous = panic::take_hook();
        let prefix = format!("[rank {rank}] ");
        panic::set_hook(Box::new(move |info| {
            let _ = write_report(&mut io::stderr().lock(), &prefix, &panic_text(info));
        }));
        Self {
            previous: Some(previous),
        }
    }
}

#[cfg(feature = "mpi")]
impl Drop for RankPanicHook {
    fn drop(&mut self) {
        // set_hook panics on a panicking thread; the rank's hook then
        // stays, which prints as well as the one it replaced.
        if std::thread::panicking() {
            return;
        }
        if let Some(previous) = self.previous.take() {
            panic::set_hook(previous);
        }
    }
}

#[cfg(feature = "mpi")]
impl std::fmt::Debug for RankPanicHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankPanicHook").finish_non_exhaustive()
    }
}

#[cfg(feature = "mpi")]
/// What the standard panic hook prints, as one text.
fn panic_text(info: &PanicHookInfo<'_>) -> String {
    let thread = std::thread::current();
    let name = thread.name().unwrap_or("<unnamed>");
    let message = crate::util::panic_message::panic_message(info.payload());
    let mut text = match info.location() {
        Some(place) => format!("thread '{name}' panicked at {place}:\n{message}"),
        None => format!("thread '{name}' panicked:\n{message}"),
    };
    let backtrace = std::backtrace::Backtrace::capture();
    if backtrace.status() == std::backtrace::BacktraceStatus::Captured {
        text.push_str(&format!("\nstack backtrace:\n{backtrace}"));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{self, Write};
    #[cfg(feature = "mpi")]
    use std::panic;

    /// A stream that records each call it gets.
    #[derive(Default)]
    struct Calls(Vec<Vec<u8>>);

    impl Write for Calls {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.push(buf.to_vec());
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_report_of_several_lines_is_one_write_of_prefixed_whole_lines() {
        let mut out = Calls::default();
        write_report(&mut out, "[rank 2] ", "rank 2 failed: x\n\nCaused by:\n  y").unwrap();
        assert_eq!(out.0.len(), 1, "{:?}", out.0);
        assert_eq!(
            String::from_utf8(out.0.remove(0)).unwrap(),
            "[rank 2] rank 2 failed: x\n[rank 2] \n[rank 2] Caused by:\n[rank 2]   y\n"
        );
    }

    #[test]
    fn a_cause_already_in_the_message_is_not_repeated() {
        let error = anyhow::Error::new(super::super::LaunchError::Failed {
            rank: 1,
            source: anyhow::anyhow!("disk full").context("saving"),
        });
        assert_eq!(one_line(error.as_ref()), "rank 1 failed: saving: disk full");
        let error = anyhow::anyhow!("disk full").context("saving");
        assert_eq!(one_line(error.as_ref()), "saving: disk full");
    }

    #[test]
    fn an_empty_report_is_still_one_prefixed_line() {
        assert_eq!(prefixed_lines("[rank 0] ", ""), "[rank 0]\n");
        assert_eq!(prefixed_lines("", "a\n"), "a\n");
    }

    #[cfg(feature = "mpi")]
    #[test]
    fn a_panic_reads_as_the_standard_hook_would_print_it() {
        // Other tests of this binary may panic meanwhile: their panics go
        // to the hook that was there.
        const NAME: &str = "report-test-worker";
        let text = std::sync::Arc::new(Mutex::new(String::new()));
        let seen = std::sync::Arc::clone(&text);
        let previous = std::sync::Arc::new(panic::take_hook());
        let others = std::sync::Arc::clone(&previous);
        panic::set_hook(Box::new(move |info| {
            if std::thread::current().name() == Some(NAME) {
                *seen.lock().unwrap() = panic_text(info);
            } else {
                others(info);
            }
        }));
        let caught = std::thread::Builder::new()
            .name(NAME.into())
            .spawn(|| panic!("lost at {}", 3))
            .unwrap()
            .join();
        drop(panic::take_hook()); // ours, with its handle on `previous`
        if let Ok(previous) = std::sync::Arc::try_unwrap(previous) {
            panic::set_hook(previous);
        }
        assert!(caught.is_err());
        let text = text.lock().unwrap().clone();
        assert!(
            text.starts_with("thread 'report-test-worker' panicked at src/launch/report.rs:"),
            "{text}"
        );
        assert!(text.contains(":\nlost at 3"), "{text}");
    }
}
