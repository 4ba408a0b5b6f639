//! A report as whole lines, each prefixed with the process's rank under an
//! MPI launcher and written in one call, so that the reports of several
//! processes sharing one output stream never interleave mid-line (see
//! [`launch::report`](crate::launch::report), which names these
//! functions). Here, below the collectives, so that a group can report too
//! (a bad `CANDLE_DP_TIMEOUT`).

use std::io::{self, Write};

use crate::process_env::Backend;

/// What starts each line this process reports: `"[rank N] "` when an MPI
/// launcher started it, nothing otherwise (one process: its errors name
/// the rank themselves).
pub fn line_prefix() -> String {
    match Backend::from_env() {
        Backend::Threads => String::new(),
        Backend::Mpi { .. } => format!("[rank {}] ", Backend::process_rank()),
    }
}

/// `text` with `prefix` before each of its lines and a newline after the
/// last: the bytes of one report.
pub fn prefixed_lines(prefix: &str, text: &str) -> String {
    let mut out = String::with_capacity(text.len() + prefix.len() + 1);
    for line in text.lines() {
        out.push_str(prefix);
        out.push_str(line);
        out.push('\n');
    }
    if out.is_empty() {
        out.push_str(prefix.trim_end());
        out.push('\n');
    }
    out
}

/// Writes `text` to `out` as whole lines, each starting with `prefix`, in
/// one `write_all` (one `write` system call for an unbuffered stream such
/// as standard error, unless the kernel takes only part of it).
///
/// # Errors
///
/// The stream's own error.
pub fn write_report(out: &mut impl Write, prefix: &str, text: &str) -> io::Result<()> {
    out.write_all(prefixed_lines(prefix, text).as_bytes())?;
    out.flush()
}

/// Prints `text` to standard error as one report with this process's
/// [`line_prefix`]. A failure to write is ignored: there is nowhere left
/// to report it.
pub fn eprint_report(text: &str) {
    let _ = write_report(&mut io::stderr().lock(), &line_prefix(), text);
}
