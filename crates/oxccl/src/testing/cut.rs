//! Failure injection for `oxccl perf --cut-rank` and tests: cutting this process off the network.

use std::io;
use std::os::fd::RawFd;

/// Cuts this process off the network as a silent partition would (no FIN, no RST: packets
/// just stop), without privileges: every TCP socket the process holds (data links, control,
/// health, bootstrap and listening sockets, of every communicator) drops every packet it
/// receives (a classic-BPF socket filter, `ret #0`) and sends at most one more (its pacing
/// rate capped at 1 byte/s, so the next packet would leave seconds to hours later, and its
/// acknowledgements never come; what is already in flight may still arrive, as on a real
/// wire). Nothing else changes: the process keeps running and its threads keep writing into
/// their sockets.
///
/// Sockets opened later are not cut. Returns how many sockets were cut; cannot be undone.
#[doc(hidden)]
pub fn cut_tcp() -> io::Result<usize> {
    let mut cut = 0;
    for entry in std::fs::read_dir("/proc/self/fd")? {
        let Some(fd) = entry?
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<RawFd>().ok())
        else {
            continue;
        };
        if !is_tcp(fd) {
            continue;
        }
        match silence(fd) {
            Ok(()) => cut += 1,
            // Closed (or reused for something else) since it was listed.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EBADF | libc::ENOTSOCK)) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(cut)
}

/// Drops what TCP socket `fd` receives and stops what it sends, after at most one packet
/// (TCP paces a connection once it has sent 10 segments; a fresh one may send a few more,
/// until its first retransmission timeout, about 200 ms).
fn silence(fd: RawFd) -> io::Result<()> {
    drop_all(fd)?;
    set_opt::<libc::c_int>(fd, libc::SO_MAX_PACING_RATE, &1)
}

/// One `int` socket option of `fd`, or `None` (not a socket, or closed meanwhile).
fn int_opt(fd: RawFd, name: libc::c_int) -> Option<libc::c_int> {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `v` and `len` are valid for writes of the sizes given; on a descriptor that is
    // not a socket (or no longer open) the call fails and writes nothing.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            name,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    (r == 0).then_some(v)
}

/// Sets socket option `name` of `fd` (level `SOL_SOCKET`) to `v`, of the type the option
/// expects.
fn set_opt<T>(fd: RawFd, name: libc::c_int, v: &T) -> io::Result<()> {
    // SAFETY: `v` is valid for reads of the size given, for the call (the kernel copies it).
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            name,
            (v as *const T).cast(),
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn is_tcp(fd: RawFd) -> bool {
    matches!(
        int_opt(fd, libc::SO_DOMAIN),
        Some(libc::AF_INET | libc::AF_INET6)
    ) && int_opt(fd, libc::SO_PROTOCOL) == Some(libc::IPPROTO_TCP)
}

/// Attaches the one-instruction filter `ret #0` (keep 0 bytes: drop) to socket `fd`.
fn drop_all(fd: RawFd) -> io::Result<()> {
    let mut prog = [libc::sock_filter {
        code: (libc::BPF_RET | libc::BPF_K) as u16,
        jt: 0,
        jf: 0,
        k: 0,
    }];
    // `prog` outlives the call; the kernel copies the program.
    let fprog = libc::sock_fprog {
        len: prog.len() as u16,
        filter: prog.as_mut_ptr(),
    };
    set_opt(fd, libc::SO_ATTACH_FILTER, &fprog)
}

#[cfg(test)]
mod tests {
    use std::io::{ErrorKind, Read, Write};
    use std::net::{TcpListener, TcpStream, UdpSocket};
    use std::os::fd::AsRawFd;
    use std::time::Duration;

    /// Whatever `s` receives within `wait` of the last bytes.
    fn drain(s: &mut TcpStream, wait: Duration) -> Vec<u8> {
        s.set_read_timeout(Some(wait)).unwrap();
        let mut got = Vec::new();
        let mut b = [0u8; 64];
        loop {
            match s.read(&mut b) {
                Ok(0) => panic!("the connection was closed"),
                Ok(n) => got.extend_from_slice(&b[..n]),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return got
                }
                Err(e) => panic!("{e}"),
            }
        }
    }

    /// A silenced socket hears nothing and, after one more packet, says nothing; nothing is
    /// closed. (`cut_tcp` itself would cut the sockets of the other tests of this process:
    /// the CLI's `--cut-rank` tests run it.)
    #[test]
    fn a_silenced_socket_hears_nothing_says_at_most_one_packet_and_stays_open() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut b, _) = l.accept().unwrap();
        let u = UdpSocket::bind("127.0.0.1:0").unwrap();
        assert!(super::is_tcp(a.as_raw_fd()) && super::is_tcp(l.as_raw_fd()));
        assert!(!super::is_tcp(u.as_raw_fd()));
        a.set_nodelay(true).unwrap();
        // TCP paces a connection only once it sent 10 segments: send 12, one at a time.
        for i in 0..12u8 {
            a.write_all(&[i]).unwrap();
            let mut got = [0u8; 1];
            b.read_exact(&mut got).unwrap();
            assert_eq!(got[0], i);
            b.write_all(&[i]).unwrap();
            a.read_exact(&mut got).unwrap();
        }
        super::silence(a.as_raw_fd()).unwrap();
        b.write_all(b"to a").unwrap();
        assert_eq!(drain(&mut a, Duration::from_millis(500)), b"");
        // Ten 8-byte messages, one every 50 ms, as a heartbeat would: the first leaves.
        for i in 0..10u8 {
            a.write_all(&[b'0' + i; 8]).unwrap();
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(drain(&mut b, Duration::from_millis(500)), [b'0'; 8]);
    }
}
