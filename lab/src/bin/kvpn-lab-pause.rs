//! `kvpn-lab-pause`: the lab's pod sandbox process (the "pause" container every pod
//! has, holding its namespaces). It sleeps until SIGTERM or SIGINT and then exits 0;
//! as PID 1 of the sandbox it also reaps children whose parent died (SIGCHLD).
//! Lab-only: a real cluster brings its own pause image.
//!
//! I/O: none but signals.

use nix::sys::signal::{SigSet, Signal};
use nix::sys::wait::{WaitPidFlag, waitpid};

fn main() {
    let mut set = SigSet::empty();
    for s in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGCHLD] {
        set.add(s);
    }
    // Blocked signals stay pending for sigwait; PID 1 ignores unhandled ones otherwise.
    if let Err(e) = set.thread_block() {
        eprintln!("kvpn-lab-pause: cannot block signals: {e}");
        std::process::exit(1);
    }
    loop {
        match set.wait() {
            Ok(Signal::SIGCHLD) => {
                while let Ok(status) = waitpid(None, Some(WaitPidFlag::WNOHANG)) {
                    if status == nix::sys::wait::WaitStatus::StillAlive {
                        break;
                    }
                }
            }
            Ok(_) => std::process::exit(0),
            Err(e) => {
                eprintln!("kvpn-lab-pause: sigwait failed: {e}");
                std::process::exit(1);
            }
        }
    }
}
