//! Test hooks, not API: failure injection for `oxccl perf --cut-rank` and tests.

use std::io;
use std::os::fd::RawFd;

/// Cuts this process off the network as a silent partition would (no FIN, no RST: packets
/// just stop): every TCP socket the process holds (data links, control, health, bootstrap
/// and listening sockets, of every communicator) gets a classic-BPF socket filter that drops
/// every packet it receives. Nothing else changes: the process keeps running and its threads
/// keep writing.
///
/// The filter drops what arrives, acknowledgements included, so the peers hear nothing
/// new either: what this process sends is never acknowledged, and once its first
/// retransmission timer fires (about 200 ms on a fast link) TCP only retransmits what
/// the peers already have. Sockets opened later are not cut. Returns how many sockets were
/// cut; cannot be undone.
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
        if is_tcp(fd) {
            drop_all(fd)?;
            cut += 1;
        }
    }
    Ok(cut)
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
    let fprog = libc::sock_fprog {
        len: prog.len() as u16,
        filter: prog.as_mut_ptr(),
    };
    // SAFETY: `fprog` points at `prog`, one valid instruction, both alive for the call (the
    // kernel copies the program); the option's length is that of `sock_fprog`.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ATTACH_FILTER,
            (&fprog as *const libc::sock_fprog).cast(),
            std::mem::size_of::<libc::sock_fprog>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream, UdpSocket};
    use std::os::fd::AsRawFd;
    use std::time::Duration;

    /// After the filter, bytes sent to the socket never arrive, and nothing is closed.
    /// (`cut_tcp` itself would cut the sockets of the other tests of this process: the CLI's
    /// `--cut-rank` tests run it.)
    #[test]
    fn a_filtered_socket_hears_nothing_and_is_not_closed() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut b, _) = l.accept().unwrap();
        let u = UdpSocket::bind("127.0.0.1:0").unwrap();
        assert!(super::is_tcp(a.as_raw_fd()) && super::is_tcp(l.as_raw_fd()));
        assert!(!super::is_tcp(u.as_raw_fd()));
        a.write_all(b"before").unwrap();
        let mut got = [0u8; 6];
        b.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"before");
        super::drop_all(b.as_raw_fd()).unwrap();
        a.write_all(b"after").unwrap();
        b.set_read_timeout(Some(Duration::from_millis(500)))
            .unwrap();
        let e = b.read(&mut got).unwrap_err();
        assert!(
            matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
            "{e}"
        );
    }
}
