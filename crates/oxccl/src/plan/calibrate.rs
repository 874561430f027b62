//! Calibration of the multi-host cost model (`plan/cost.rs`) on this host, for `oxccl tune`:
//! how fast one core reduces and copies float32 buffers, the per-message cost and the
//! throughput of the TCP stack over loopback, and the shared-memory link's latency and
//! bandwidth from the ring all_reduce times `oxccl tune` measures. The results are the tune
//! file's [`Rates`], read back by every communicator and by `oxccl sim`.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::base::dtype::DataType;
use crate::base::op::ReduceOp;
use crate::base::reduce::reduce_inplace;
use crate::plan::tuning::Rates;

/// Bytes of each buffer in the cache-resident measurements (two such buffers fit in the L2
/// of current cores; the model's cache-resident limit is 1 MiB).
const CACHED_BYTES: usize = 256 << 10;
/// Bytes of each buffer in the memory measurements (well past the last-level cache).
const MEMORY_BYTES: usize = 64 << 20;
/// Each rate is the best of this many timed passes (the machine may be shared).
const PASSES: usize = 5;
/// No measurement waits longer than this for a socket.
const SOCKET_TIMEOUT: Duration = Duration::from_secs(10);

/// Best GB/s of `f` over [`PASSES`] passes, each of `reps` calls on `bytes` bytes.
fn best_gbps(bytes: usize, reps: usize, mut f: impl FnMut()) -> f64 {
    f(); // first touch, page faults
    let mut best = f64::INFINITY;
    for _ in 0..PASSES {
        let t = Instant::now();
        for _ in 0..reps {
            f();
        }
        best = best.min(t.elapsed().as_secs_f64() / reps as f64);
    }
    bytes as f64 / best.max(1e-12) / 1e9
}

/// `(reduce GB/s, reduce in cache, copy GB/s, copy in cache)` of one core: float32 sum
/// `dst += src` (the library's own kernel) and `dst.copy_from_slice(src)`, counted in bytes
/// of `dst` per second.
pub fn memory_gbps() -> (f64, f64, f64, f64) {
    let mut out = [0.0; 4];
    for (i, (bytes, reps)) in [(MEMORY_BYTES, 2), (CACHED_BYTES, 200)]
        .into_iter()
        .enumerate()
    {
        // Float32 buffers (aligned as the kernel needs), reduced as bytes; sums of ones
        // stay finite well past any repetition count here.
        let src = vec![1f32; bytes / 4];
        let mut dst = vec![0f32; bytes / 4];
        out[i] = best_gbps(bytes, reps, || {
            reduce_inplace(
                DataType::F32,
                ReduceOp::Sum,
                bytemuck::cast_slice_mut(&mut dst),
                bytemuck::cast_slice(&src),
            )
        });
        out[2 + i] = best_gbps(bytes, reps, || {
            dst.copy_from_slice(&src);
            std::hint::black_box(&mut dst);
        });
    }
    let [r, rc, c, cc] = out;
    (r, rc, c, cc)
}

/// Errors of the loopback measurements, naming the step.
type Result<T> = std::io::Result<T>;

fn io_err(what: &str, e: std::io::Error) -> std::io::Error {
    std::io::Error::new(e.kind(), format!("calibrating the TCP stack: {what}: {e}"))
}

/// A connected pair of loopback TCP sockets with `TCP_NODELAY`, as the TCP transport sets.
fn loopback_pair() -> Result<(TcpStream, TcpStream)> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(|e| io_err("bind", e))?;
    let addr = l.local_addr().map_err(|e| io_err("local_addr", e))?;
    let a = TcpStream::connect_timeout(&addr, SOCKET_TIMEOUT).map_err(|e| io_err("connect", e))?;
    let (b, _) = l.accept().map_err(|e| io_err("accept", e))?;
    for s in [&a, &b] {
        s.set_nodelay(true).map_err(|e| io_err("nodelay", e))?;
        s.set_read_timeout(Some(SOCKET_TIMEOUT))
            .map_err(|e| io_err("timeout", e))?;
        s.set_write_timeout(Some(SOCKET_TIMEOUT))
            .map_err(|e| io_err("timeout", e))?;
    }
    Ok((a, b))
}

/// One-way microseconds of an 8-byte message over loopback TCP: the median round trip of
/// `rounds` ping-pongs between two threads, halved.
pub fn tcp_latency_us(rounds: usize) -> Result<f64> {
    let (mut a, mut b) = loopback_pair()?;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let mut m = [0u8; 8];
        for _ in 0..rounds {
            b.read_exact(&mut m)?;
            b.write_all(&m)?;
        }
        Ok(())
    });
    let mut rtts = Vec::with_capacity(rounds);
    let mut m = [7u8; 8];
    let mut failed = None;
    for _ in 0..rounds {
        let t = Instant::now();
        if let Err(e) = a.write_all(&m).and_then(|()| a.read_exact(&mut m)) {
            failed = Some(e);
            break;
        }
        rtts.push(t.elapsed().as_secs_f64());
    }
    drop(a); // ends the echo thread's read at once if we stopped early
    let echoed = echo.join().map_err(|_| {
        std::io::Error::other("calibrating the TCP stack: the echo thread panicked")
    })?;
    if let Some(e) = failed {
        return Err(io_err("ping-pong", e));
    }
    echoed.map_err(|e| io_err("echo", e))?;
    rtts.sort_by(f64::total_cmp);
    let median = rtts.get(rtts.len() / 2).copied().unwrap_or(f64::NAN);
    Ok(median / 2.0 * 1e6)
}

/// GB/s one core moves through the TCP stack, sending and receiving: one thread writes
/// bytes into one end of a loopback connection and reads them from the other
/// (non-blocking, 256 KiB at a time), as a rank in a ring step sends one block and
/// receives another; the best of `PASSES` passes of `total / PASSES` bytes (a pass that
/// lost its core to another process measures the machine's load, not the stack).
pub fn tcp_gbps(total: usize) -> Result<f64> {
    let (mut a, mut b) = loopback_pair()?;
    let mut best: f64 = 0.0;
    for _ in 0..PASSES {
        best = best.max(tcp_pass(&mut a, &mut b, (total / PASSES).max(1))?);
    }
    Ok(best)
}

/// One pass of [`tcp_gbps`]: `total` bytes from `a` to `b` in one thread.
fn tcp_pass(a: &mut TcpStream, b: &mut TcpStream, total: usize) -> Result<f64> {
    for s in [&a, &b] {
        s.set_nonblocking(true)
            .map_err(|e| io_err("nonblocking", e))?;
    }
    let chunk = vec![0x5au8; 256 << 10];
    let mut sink = vec![0u8; 256 << 10];
    let (mut sent, mut got) = (0usize, 0usize);
    let start = Instant::now();
    while got < total {
        if start.elapsed() > SOCKET_TIMEOUT {
            return Err(std::io::Error::new(
                ErrorKind::TimedOut,
                format!(
                    "calibrating the TCP stack: {got} of {total} bytes through loopback in {} s",
                    SOCKET_TIMEOUT.as_secs()
                ),
            ));
        }
        let mut progressed = false;
        if sent < total {
            let n = chunk.len().min(total - sent);
            match a.write(&chunk[..n]) {
                Ok(k) => {
                    sent += k;
                    progressed |= k > 0;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => return Err(io_err("write", e)),
            }
        }
        match b.read(&mut sink) {
            Ok(0) => return Err(io_err("read", ErrorKind::UnexpectedEof.into())),
            Ok(k) => {
                got += k;
                progressed = true;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) => return Err(io_err("read", e)),
        }
        if !progressed {
            std::thread::yield_now();
        }
    }
    Ok(total as f64 / start.elapsed().as_secs_f64().max(1e-12) / 1e9)
}

/// `(latency µs, GB/s)` of the shared-memory link from `oxccl tune`'s ring all_reduce on
/// `ranks` ranks of this host: `small_us` at 8 bytes is `2(n-1)` steps of latency; `big_us`
/// at `big_bytes` is `2(n-1)` steps of `α + S/n / β` plus the reduction of `(n-1)/n · S`
/// at `reduce_gbps`, solved for `β`. `None` when the times cannot be such a ring (fewer
/// than 2 ranks, or the large call no slower than its latency and reduction).
pub fn shm_link(
    ranks: usize,
    small_us: f64,
    big_bytes: usize,
    big_us: f64,
    reduce_gbps: f64,
) -> Option<(f64, f64)> {
    if ranks < 2 || !(small_us > 0.0 && big_us > 0.0 && reduce_gbps > 0.0) {
        return None;
    }
    let (n, s) = (ranks as f64, big_bytes as f64);
    let steps = 2.0 * (n - 1.0);
    let alpha = small_us / steps;
    let moving = big_us - steps * alpha - (n - 1.0) / n * s / (reduce_gbps * 1e3);
    (moving > 0.0).then(|| (alpha, steps * s / n / moving / 1e3))
}

/// Every rate of [`Rates`]: the memory rates as [`memory_gbps`] measured them, the
/// shared-memory link as given (from [`shm_link`]), the TCP stack measured here.
pub fn measure(memory: (f64, f64, f64, f64), shm_lat_us: f64, shm_gbps: f64) -> Result<Rates> {
    let (reduce_gbps, reduce_cached_gbps, copy_gbps, copy_cached_gbps) = memory;
    Ok(Rates {
        shm_lat_us,
        shm_gbps,
        reduce_gbps,
        reduce_cached_gbps,
        copy_gbps,
        copy_cached_gbps,
        tcp_lat_us: tcp_latency_us(2000)?,
        tcp_gbps: tcp_gbps(256 << 20)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shm_link_inverts_the_ring_formula() {
        // 4 ranks, α = 2 µs, β = 3 GB/s, reduction at 2 GB/s: the ring's times at 8 B and
        // 4 MiB by the model's formula give back α and β.
        let (n, a, b, mu) = (4.0, 2.0, 3.0, 2.0);
        let s = (4 << 20) as f64;
        let small = 2.0 * (n - 1.0) * a;
        let big = 2.0 * (n - 1.0) * (a + s / n / (b * 1e3)) + (n - 1.0) / n * s / (mu * 1e3);
        let (got_a, got_b) = shm_link(4, small, 4 << 20, big, mu).unwrap();
        assert!(
            (got_a - a).abs() < 1e-9 && (got_b - b).abs() < 1e-9,
            "{got_a} {got_b}"
        );
        assert_eq!(shm_link(1, small, 4 << 20, big, mu), None);
        assert_eq!(
            shm_link(4, small, 4 << 20, small, mu),
            None,
            "no time left to move"
        );
        assert_eq!(shm_link(4, 0.0, 4 << 20, big, mu), None);
    }

    #[test]
    fn loopback_rates_are_plausible() {
        let lat = tcp_latency_us(50).unwrap();
        assert!(lat > 0.0 && lat < 100_000.0, "{lat}");
        let g = tcp_gbps(4 << 20).unwrap();
        assert!(g > 0.0 && g.is_finite(), "{g}");
    }
}
