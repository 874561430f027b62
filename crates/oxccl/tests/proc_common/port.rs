//! Rendezvous ports for tests that start ranks (shared by every test crate that does).

/// A TCP port on 127.0.0.1 for a rendezvous address: free now, never handed out twice by
/// this process, and drawn at random below the kernel's ephemeral range. A port from
/// `bind(127.0.0.1:0)` lies in that range, where the kernel hands ports to every outgoing
/// connection too, so another job's connection can take it before rank 0 binds it (seen
/// under load: the rendezvous's `EADDRINUSE`); below the range only an explicit bind can.
pub fn free_port() -> u16 {
    use std::collections::HashSet;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Mutex;
    static DRAWS: AtomicU64 = AtomicU64::new(0);
    static GIVEN: Mutex<Option<HashSet<u16>>> = Mutex::new(None);
    let ephemeral_low: u32 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768);
    let (lo, hi) = (10_000u32, ephemeral_low.min(65_536));
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    let given = given.get_or_insert_with(HashSet::new);
    if hi > lo + 1_000 {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        for _ in 0..1_000 {
            // splitmix64 of (pid, time, draw): different in every process and call
            let mut z = (u64::from(std::process::id()) << 32 ^ nanos).wrapping_add(
                DRAWS
                    .fetch_add(1, Ordering::Relaxed)
                    .wrapping_mul(0x9e37_79b9_7f4a_7c15),
            );
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            let port = (lo + (z % u64::from(hi - lo)) as u32) as u16;
            if !given.contains(&port) && std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                given.insert(port);
                return port;
            }
        }
    }
    // No room below the ephemeral range on this machine: the kernel's choice.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    given.insert(port);
    port
}
