//! Asking another process to end (SIGTERM), for the launcher of a rank
//! whose group timed out and for a supervisor's probes and jobs.

/// Sends SIGTERM to `pid`; a pid that does not fit the platform's type, or
/// a process already gone, is left alone.
pub(super) fn terminate(pid: u32) {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return;
    };
    // SAFETY: kill(2) takes two integers and reads or writes no memory of
    // this process.
    unsafe {
        libc::kill(pid, libc::SIGTERM);
    }
}
