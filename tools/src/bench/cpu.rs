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

    #[test]
    fn busy_work_shows_in_the_process_cpu_time() {
        let pid = std::process::id();
        let before = process_cpu_ns(pid).expect("readable");
        let started = Instant::now();
        let mut spin = 0u64;
        while started.elapsed() < Duration::from_millis(60) {
            spin = std::hint::black_box(spin.wrapping_add(1));
        }
        let used = process_cpu_ns(pid).expect("readable") - before;
        // 60 ms of wall time spinning: at least 30 ms on a CPU even on a busy machine.
        assert!(used >= 30_000_000, "{used} ns of CPU for 60 ms of spinning");
    }
}
