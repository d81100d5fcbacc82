//! Envoy's own CPU time, read from `/proc`, for the overhead benchmark's CPU
//! per request: it tells what the filter costs in CPU apart from what it
//! makes a request wait (buffering a body before it leaves, scheduling).

use anyhow::Context as _;

/// Nanoseconds all threads of process `pid` have run on a CPU, summed from
/// `/proc/<pid>/task/*/schedstat` (its first field). Threads that exit take
/// their time with them; Envoy's workers live as long as Envoy.
pub fn process_cpu_ns(pid: u32) -> anyhow::Result<u64> {
    let tasks = format!("/proc/{pid}/task");
    let mut total = 0u64;
    for entry in std::fs::read_dir(&tasks).with_context(|| format!("reading {tasks}"))? {
        let path = entry?.path().join("schedstat");
        // A thread may exit between listing and reading: it no longer counts.
        let Ok(line) = std::fs::read_to_string(&path) else {
            continue;
        };
        total +=
            on_cpu_ns(&line).with_context(|| format!("unexpected {}: {line:?}", path.display()))?;
    }
    Ok(total)
}

/// The first field of a `schedstat` line: time spent on the CPU, in ns.
fn on_cpu_ns(line: &str) -> Option<u64> {
    line.split_whitespace().next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn schedstat_lines_give_their_first_field() {
        assert_eq!(on_cpu_ns("485178808 479007 25\n"), Some(485_178_808));
        assert_eq!(on_cpu_ns(""), None);
        assert_eq!(on_cpu_ns("x 1 2"), None);
    }

    /// This process's user + system time from `/proc/self/stat`, in the
    /// kernel's USER_HZ ticks (100 a second on Linux): a second source to
    /// check the schedstat sum against.
    fn stat_ticks() -> u64 {
        let stat = std::fs::read_to_string("/proc/self/stat").expect("readable");
        // Fields after the command name (which may hold spaces) start at the state, field 3.
        let after_name = &stat[stat.rfind(')').expect("a command name") + 2..];
        let fields: Vec<&str> = after_name.split_whitespace().collect();
        let utime: u64 = fields[11].parse().expect("utime");
        let stime: u64 = fields[12].parse().expect("stime");
        utime + stime
    }

    #[test]
    fn busy_work_shows_in_the_process_cpu_time() {
        let pid = std::process::id();
        let before = process_cpu_ns(pid).expect("readable");
        let ticks_before = stat_ticks();
        // Spin until the kernel's other account says 8 ticks (80 ms) of CPU
        // went to this process, however busy the machine is.
        let started = Instant::now();
        let mut spin = 0u64;
        while stat_ticks() - ticks_before < 8 {
            for _ in 0..100_000 {
                spin = std::hint::black_box(spin.wrapping_add(1));
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "80 ms of CPU not reached in 30 s"
            );
        }
        let used = process_cpu_ns(pid).expect("readable") - before;
        // Tick accounting can be a tick ahead of the exact schedstat sum.
        assert!(used >= 60_000_000, "{used} ns of CPU for 8 ticks of it");
    }
}
