//! Memory requests checked against what the host has, so that an absurd size (a mistyped
//! `-b 64G`, a huge ring) is a clear error, never an abort of the process or a host driven
//! into swap.

/// The memory the kernel says can be had without swapping (`MemAvailable` of
/// `/proc/meminfo`), in bytes; `None` where unknown.
pub(crate) fn available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Fails with a message naming `what` when `bytes` exceeds the memory available on this host
/// (nothing is checked where that is unknown).
pub fn check_fits(bytes: u64, what: &str) -> Result<(), String> {
    match available() {
        Some(avail) if bytes > avail => Err(format!(
            "{what}: {} requested, but this host has only {} available (MemAvailable of /proc/meminfo)",
            human(bytes),
            human(avail)
        )),
        _ => Ok(()),
    }
}

/// A zeroed vector of `len` elements: checked with [`check_fits`] and allocated with
/// `try_reserve_exact`, so that a failure is an error, never an abort.
pub(crate) fn try_zeroed<T: Copy + Default>(len: usize, what: &str) -> Result<Vec<T>, String> {
    let bytes = (len as u64).saturating_mul(std::mem::size_of::<T>() as u64);
    check_fits(bytes, what)?;
    let mut v = Vec::new();
    v.try_reserve_exact(len)
        .map_err(|e| format!("{what}: cannot allocate {}: {e}", human(bytes)))?;
    v.resize(len, T::default());
    Ok(v)
}

/// `bytes` for people: "64.0 GiB", "512 B".
pub(crate) fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absurd_requests_are_errors() {
        let avail = available().expect("/proc/meminfo has MemAvailable");
        let e = check_fits(avail + 1, "the test buffer").unwrap_err();
        assert!(e.contains("the test buffer: "), "{e}");
        check_fits(1 << 20, "a small buffer").unwrap();
        let e = try_zeroed::<u64>(usize::MAX / 8, "a huge vector").unwrap_err();
        assert!(e.contains("a huge vector"), "{e}");
        assert_eq!(try_zeroed::<u64>(3, "x").unwrap(), vec![0; 3]);
        assert_eq!(human(64 << 30), "64.0 GiB");
        assert_eq!(human(12), "12 B");
    }
}
