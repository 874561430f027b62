//! The authenticated socket layer shared by the rendezvous (`bootstrap`) and the TCP
//! transport: the handshake ([`auth`]), the listener that admits strangers ([`accept`]) and the
//! dial that connects, authenticates and retries ([`dial`]).

pub(crate) mod accept;
pub mod auth;
pub(crate) mod dial;

use std::os::fd::AsFd;

use rustix::event::{PollFd, PollFlags, Timespec};

/// Which of `conns` (tagged by rank) have something to read or have closed, without
/// waiting: one `poll` with a zero timeout. A failed `poll` counts as nothing ready (the
/// callers look again later).
pub(crate) fn readable_now<'a, S: AsFd>(conns: &[(usize, &'a S)]) -> Vec<(usize, &'a S)> {
    if conns.is_empty() {
        return Vec::new();
    }
    let mut fds: Vec<PollFd> = conns
        .iter()
        .map(|(_, c)| PollFd::from_borrowed_fd(c.as_fd(), PollFlags::IN))
        .collect();
    let zero = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    if !matches!(rustix::event::poll(&mut fds, Some(&zero)), Ok(k) if k > 0) {
        return Vec::new();
    }
    conns
        .iter()
        .zip(&fds)
        .filter(|(_, f)| !f.revents().is_empty())
        .map(|(c, _)| *c)
        .collect()
}
