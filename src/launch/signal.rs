//! Signals to other processes: the launcher of a rank whose group timed
//! out, a supervisor's probes (a process group each), and the job a
//! supervisor started, which must not outlive it.

use std::process::Command;

/// Sends SIGTERM to `pid`; a pid that does not fit the platform's type, or
/// a process already gone, is left alone.
#[cfg(feature = "mpi")]
pub(super) fn terminate(pid: u32) {
    send(pid, false, libc::SIGTERM);
}

/// Sends `signal` (SIGTERM or SIGKILL) to the process group `pgid` (a
/// probe started as the leader of its own group, with everything it
/// started: `sh` and its `sinfo`, `mpirun` and its launch agents).
pub(super) fn signal_group(pgid: u32, kill: bool) {
    send(pgid, true, if kill { libc::SIGKILL } else { libc::SIGTERM });
}

fn send(id: u32, group: bool, signal: libc::c_int) {
    let Ok(id) = libc::pid_t::try_from(id) else {
        return;
    };
    if id <= 0 {
        return;
    }
    let target = if group { -id } else { id };
    // SAFETY: kill(2) takes two integers and reads or writes no memory of
    // this process; `target` is a positive pid or a negated positive pgid,
    // never 0 or -1 (which would signal this group or every process).
    unsafe {
        libc::kill(target, signal);
    }
}

/// Makes the child that `command` starts receive SIGTERM when the thread
/// that starts it ends (Linux's parent-death signal): a supervisor killed
/// outright does not leave its `mpirun` or `srun`, and their ranks,
/// running unattended. Measured (`train_lm --hosts localhost:2`, the
/// supervisor killed with SIGKILL): 4 s later its `mpirun` and both ranks
/// still ran without this; with it, none did.
pub(super) fn end_with_parent(command: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the child between fork and exec, where
    // only async-signal-safe calls are allowed: prctl(2) is a plain
    // system call on integers, it allocates nothing and takes no lock.
    unsafe {
        command.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
}
