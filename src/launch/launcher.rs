//! Ending a launcher that cannot end itself.
//!
//! When a machine drops off the network, Open MPI 4.1's `mpirun` and the
//! daemons (`orted`) of the machines it can no longer reach never finish:
//! their messages to each other sit unacknowledged, and no MPI call
//! returns an error (measured in `shared/NETWORK_FAULTS.md`: mpirun alive
//! 30-60 s after every rank had exited, an orted alive after its rank).
//! Only a rank's own timeout notices. So a rank whose group timed out ends
//! its parent process, as the measurements found works: an `orted` on one
//! SIGTERM (it kills its ranks and exits), `mpirun` on two SIGTERMs 0.3 s
//! apart (the first orders the daemons to halt and kills its local ranks,
//! the second makes it exit without waiting for daemons it cannot reach).
//! Any other parent (a shell, Slurm's `srun`) is left alone.

use std::time::Duration;

use super::signal::terminate;

/// How long the rank's report is given to reach the launcher's output
/// before the launcher is ended (it forwards output as it arrives).
const REPORT_GRACE: Duration = Duration::from_millis(500);

/// This process's launcher: its parent, when that is Open MPI's `mpirun`
/// or `orted` (from `/proc/<ppid>/comm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Launcher {
    pid: u32,
    /// `orted`, or `mpirun` (under any of its names).
    daemon: bool,
}

impl Launcher {
    /// The parent process, if it is an Open MPI launcher.
    pub(super) fn parent() -> Option<Launcher> {
        let pid = std::os::unix::process::parent_id();
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
        match comm.trim() {
            "orted" => Some(Launcher { pid, daemon: true }),
            "mpirun" | "orterun" | "mpiexec" => Some(Launcher { pid, daemon: false }),
            _ => None,
        }
    }

    /// `orted` or `mpirun`.
    pub(super) fn name(&self) -> &'static str {
        if self.daemon {
            "orted"
        } else {
            "mpirun"
        }
    }

    /// Ends it (see the [module docs](self)), after giving this rank's
    /// report time to reach its output. `mpirun` kills this process too.
    pub(super) fn end(&self) {
        std::thread::sleep(REPORT_GRACE);
        terminate(self.pid);
        if !self.daemon {
            std::thread::sleep(Duration::from_millis(300));
            terminate(self.pid);
        }
    }
}
