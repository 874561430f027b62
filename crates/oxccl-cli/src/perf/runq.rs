//! How long this process's threads have waited for a CPU: the second field of
//! `/proc/self/task/*/schedstat` (nanoseconds runnable but not running), summed over threads.
//!
//! On a shared machine a benchmark's time says little about the library when its ranks
//! spend most of it waiting for a core (other jobs' builds; with `sched_autogroup` the
//! kernel shares the CPUs between sessions, whatever their nice values). `oxccl perf`
//! reports this wait beside the CPU time so that such a run shows as CPU-starved.

/// Seconds this process's threads have spent runnable but waiting for a CPU, so far; `None`
/// where the kernel does not keep scheduler statistics (no `CONFIG_SCHED_INFO`).
pub(crate) fn wait_secs() -> Option<f64> {
    let mut ns: u64 = 0;
    for task in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        // A thread that exits between the listing and the read is simply left out.
        let Ok(s) = std::fs::read_to_string(task.path().join("schedstat")) else {
            continue;
        };
        ns += parse(&s)?;
    }
    Some(ns as f64 * 1e-9)
}

/// The run-queue wait (second field) of one `schedstat` line.
fn parse(line: &str) -> Option<u64> {
    line.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_wait_field() {
        assert_eq!(parse("2318823 51200 17\n"), Some(51200));
        assert_eq!(parse("2318823\n"), None);
        assert_eq!(parse("a b c"), None);
    }

    #[test]
    fn reads_this_process() {
        // Where the kernel keeps the statistics (CONFIG_SCHED_INFO, every distribution
        // kernel), every thread of this process has them and the sum must come out.
        if std::path::Path::new("/proc/self/schedstat").exists() {
            let w = wait_secs().expect("schedstat present but not read");
            assert!(w >= 0.0 && w.is_finite(), "{w}");
        } else {
            assert_eq!(wait_secs(), None);
        }
    }
}
