//! Child processes that cannot outlive the process that started them.
//!
//! Used for Envoy, vllm-sim and the engine benchmark's servers. Drop kills
//! them on every normal path, but a test binary killed by a timeout
//! or an abort runs no destructors. Linux's parent-death signal covers that. It
//! fires when the *thread* that forked exits, not the process, so children are
//! forked from one long-lived thread: test threads and tokio's blocking pool
//! come and go, and a child forked from them would die with them.

use std::io;
use std::os::unix::process::CommandExt as _;
use std::process::{Child, Command};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};

type SpawnRequest = (Command, mpsc::Sender<io::Result<Child>>);

/// Spawns `command` so that it receives SIGKILL when this process ends.
pub fn spawn_tied_to_process(mut command: Command) -> io::Result<Child> {
    // SAFETY: the closure only calls async-signal-safe functions (prctl, getppid).
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(io::Error::last_os_error());
            }
            // The parent may have died before prctl took effect.
            if libc::getppid() == 1 {
                return Err(io::Error::other("parent exited during spawn"));
            }
            Ok(())
        });
    }
    let (reply, response) = mpsc::channel();
    spawner()
        .lock()
        .map_err(|_| io::Error::other("spawner lock poisoned"))?
        .send((command, reply))
        .map_err(|_| io::Error::other("spawner thread is gone"))?;
    response
        .recv()
        .map_err(|_| io::Error::other("spawner thread is gone"))?
}

/// Asks a child to stop (SIGTERM), so it can clean up.
pub fn terminate(child: &Child) {
    if let Ok(pid) = libc::pid_t::try_from(child.id()) {
        // SAFETY: plain syscall on a pid we own and have not reaped yet.
        unsafe {
            libc::kill(pid, libc::SIGTERM);
        }
    }
}

fn spawner() -> &'static Mutex<mpsc::Sender<SpawnRequest>> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (requests, incoming) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("child-spawner".into())
            .spawn(move || {
                for (mut command, reply) in incoming {
                    let _ = reply.send(command.spawn());
                }
            })
            .expect("cannot start the child-spawner thread");
        Mutex::new(requests)
    })
}
