//! `oxccl info`: what this host offers oxccl.

use oxccl::Config;

/// Prints version, host identity, cores, /dev/shm space, interfaces and usable transports.
pub fn main() -> i32 {
    let cfg = match Config::from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("oxccl info: {e}");
            return 2;
        }
    };
    println!("oxccl        {}", env!("CARGO_PKG_VERSION"));
    println!("host id      {}", oxccl::local_host_id(&cfg));
    let host = rustix::system::uname();
    println!("host name    {}", host.nodename().to_string_lossy());
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    println!("cores        {cores} usable");
    let shm_ok = match rustix::fs::statvfs("/dev/shm") {
        Ok(s) => {
            let free = s.f_bavail * s.f_frsize;
            let total = s.f_blocks * s.f_frsize;
            // Each rank reserves one segment: a ring per local peer, the rings shrunk to fit
            // OXCCL_SHM_BUDGET_BYTES. How many local ranks fit in what is free?
            let job = |n: u64| {
                oxccl::shm_segment_bytes(
                    n.saturating_sub(1) as usize,
                    cfg.shm_ring_bytes,
                    cfg.shm_budget_bytes as u64,
                )
                .map_or(u64::MAX, |b| b.saturating_mul(n))
            };
            let fit = (2..=4096u64)
                .take_while(|&n| job(n) <= free)
                .last()
                .unwrap_or(1);
            let per_peer = job(2) / 2;
            println!(
                "/dev/shm     {} MiB free of {} MiB: room for the shared-memory segments of {}{} local ranks \
                 (per rank: {} KiB with 1 peer, {} KiB with 31; OXCCL_SHM_RING_BYTES, OXCCL_SHM_BUDGET_BYTES)",
                free >> 20,
                total >> 20,
                if fit == 4096 { "4096 or more" } else { "" },
                if fit == 4096 { String::new() } else { fit.to_string() },
                per_peer >> 10,
                (job(32) / 32) >> 10,
            );
            free >= per_peer
        }
        Err(e) => {
            println!("/dev/shm     unavailable ({e})");
            false
        }
    };
    println!("interfaces");
    match if_addrs::get_if_addrs() {
        Ok(ifs) => {
            for i in ifs {
                println!(
                    "  {:<12} {}{}",
                    i.name,
                    i.ip(),
                    if i.is_loopback() { " (loopback)" } else { "" }
                );
            }
        }
        Err(e) => println!("  cannot list: {e}"),
    }
    println!(
        "default ip   {} (the address peers reach this host at, unless OXCCL_SOCKET_IFNAME says)",
        oxccl::default_ip()
    );
    let mut transports = vec!["tcp"];
    if shm_ok {
        transports.insert(0, "shm");
    }
    println!(
        "transports   {} (OXCCL_TRANSPORT={})",
        transports.join(", "),
        format!("{:?}", cfg.transport).to_lowercase()
    );
    0
}
