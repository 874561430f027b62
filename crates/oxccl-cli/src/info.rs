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
            let per_peer = cfg.shm_ring_bytes as u64;
            println!(
                "/dev/shm     {} MiB free of {} MiB: room for {} shared-memory rings of {} KiB (one per ordered pair of local ranks)",
                free >> 20,
                total >> 20,
                free / per_peer.max(1),
                per_peer >> 10,
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
