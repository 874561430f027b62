//! The one error type of oxccl.
//!
//! Every error that happens inside a collective names the rank that saw it, the call
//! (`"all_reduce"`, ...) and the call's sequence number on this communicator, and, where a
//! peer is involved, that peer. Nothing in the public API panics on bad input: it returns one
//! of these.

use std::time::Duration;

/// Result alias used throughout oxccl.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The most ranks an error line names; the rest are counted ([`rank_list`]).
pub(crate) const MAX_LISTED_RANKS: usize = 8;

/// `ranks` for an error line: at most `MAX_LISTED_RANKS` (8) of them, then how many more
/// (`[0, 1, 2, 3, 4, 5, 6, 7] and 65527 more`), so that a line stays short whatever the
/// world size.
pub fn rank_list(ranks: &[usize]) -> String {
    let shown = &ranks[..ranks.len().min(MAX_LISTED_RANKS)];
    match ranks.len() - shown.len() {
        0 => format!("{shown:?}"),
        more => format!("{shown:?} and {more} more"),
    }
}

/// The rank an error line blames, as an operator (or `oxccl run`) reads it: the innermost
/// of "lost peer rank K", "still waiting on rank(s) [K" (the first listed), "cannot connect
/// to rank K", "protocol error from rank K" and "rank K failed", i.e. the one that appears
/// last in the line (a rank that relays another's failure wraps that rank's own error).
/// `None` when the line names no rank at fault.
pub fn blamed_rank(line: &str) -> Option<usize> {
    const PATTERNS: [&str; 5] = [
        "lost peer rank ",
        "still waiting on rank(s) [",
        "cannot connect to rank ",
        "protocol error from rank ",
        "failed: ",
    ];
    let mut best: Option<(usize, usize)> = None;
    for pat in PATTERNS {
        let mut from = 0;
        while let Some(i) = line[from..].find(pat) {
            let at = from + i;
            from = at + pat.len();
            let rank = if pat == "failed: " {
                // "rank K failed: ...": the number before.
                let head = line[..at].trim_end();
                let digits = head.len() - head.trim_end_matches(|c: char| c.is_ascii_digit()).len();
                let num = &head[head.len() - digits..];
                let before = head[..head.len() - digits].trim_end();
                if digits == 0 || !before.ends_with("rank") {
                    continue;
                }
                num.parse().ok()
            } else {
                let tail = &line[from..];
                let end = tail
                    .find(|c: char| !c.is_ascii_digit())
                    .unwrap_or(tail.len());
                tail[..end].parse().ok()
            };
            if let Some(r) = rank {
                if best.is_none_or(|(pos, _)| at >= pos) {
                    best = Some((at, r));
                }
            }
        }
    }
    best.map(|(_, r)| r)
}

/// Everything that can go wrong in oxccl.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A caller passed something that cannot work: a wrong length, a root out of range,
    /// sending to oneself, ...
    #[error("rank {rank}: invalid argument to {call} (call #{seq}): {msg}")]
    InvalidArgument {
        /// The rank that saw the error.
        rank: usize,
        /// The call, e.g. `"all_reduce"`.
        call: &'static str,
        /// Sequence number of the call on this communicator.
        seq: u64,
        /// What is wrong.
        msg: String,
    },
    /// A peer went away (process exited or was killed, connection reset, link cut).
    #[error("rank {rank}: {call} (call #{seq}): lost peer rank {peer}: {reason}")]
    PeerLost {
        /// The rank that saw the error.
        rank: usize,
        /// The peer that was lost.
        peer: usize,
        /// The call in progress (or `"init"`).
        call: &'static str,
        /// Sequence number of the call.
        seq: u64,
        /// How the loss was seen.
        reason: String,
    },
    /// A call did not complete within the communicator's timeout.
    #[error("rank {rank}: {call} (call #{seq}) timed out after {elapsed:?}, still waiting on rank(s) {} when the call's timeout expired", rank_list(.waiting_on))]
    Timeout {
        /// The rank that saw the error.
        rank: usize,
        /// The call that timed out.
        call: &'static str,
        /// Sequence number of the call.
        seq: u64,
        /// Ranks whose data had not (fully) arrived or been taken.
        waiting_on: Vec<usize>,
        /// How long the call waited.
        elapsed: Duration,
    },
    /// A peer sent bytes that do not follow the protocol.
    #[error("rank {rank}: protocol error from rank {peer} in {call} (call #{seq}): {msg}")]
    Protocol {
        /// The rank that saw the error.
        rank: usize,
        /// The peer that sent the bad data.
        peer: usize,
        /// The call in progress.
        call: &'static str,
        /// Sequence number of the call.
        seq: u64,
        /// What was wrong.
        msg: String,
    },
    /// Launcher environment variables are missing, malformed or contradict each other.
    #[error("environment: {0}")]
    Env(String),
    /// The rendezvous (bootstrap) failed.
    #[error("rank {rank}: rendezvous at {addr}: {msg}")]
    Rendezvous {
        /// The rank that saw the error.
        rank: usize,
        /// The rendezvous address.
        addr: String,
        /// What went wrong.
        msg: String,
    },
    /// A connection to a peer could not be made before the timeout.
    #[error("rank {rank}: cannot connect to rank {peer} at {addr} within {timeout:?}: {reason}")]
    Connect {
        /// The rank that saw the error.
        rank: usize,
        /// The unreachable rank.
        peer: usize,
        /// The address that was tried.
        addr: String,
        /// The timeout that expired.
        timeout: Duration,
        /// The last error seen.
        reason: String,
    },
    /// A connection failed authentication (wrong or missing secret, foreign communicator).
    #[error("rank {rank}: authentication with {addr} failed: {msg}")]
    Auth {
        /// The rank that saw the error.
        rank: usize,
        /// The remote address.
        addr: String,
        /// What failed.
        msg: String,
    },
    /// Shared memory could not be set up (too little space in /dev/shm, mmap failed, ...).
    #[error("rank {rank}: shared memory: {msg}")]
    SharedMemory {
        /// The rank that saw the error.
        rank: usize,
        /// What went wrong and what to do about it.
        msg: String,
    },
    /// The process's pool of shared buffers (`SharedPool`, `oxcclMemAlloc`) could not
    /// allocate, or was handed a pointer it does not own.
    #[error("shared-memory pool: {msg}")]
    SharedPool {
        /// What went wrong.
        msg: String,
    },
    /// Ranks called different collectives, or the same one with different arguments.
    #[error(
        "rank {rank}: call #{seq} mismatch: this rank called {mine}, rank {peer} called {theirs}"
    )]
    Mismatch {
        /// The rank that saw the error.
        rank: usize,
        /// The rank that disagrees.
        peer: usize,
        /// Sequence number of the call.
        seq: u64,
        /// This rank's call.
        mine: String,
        /// The peer's call.
        theirs: String,
    },
    /// The communicator was aborted, or failed earlier and can no longer be used.
    #[error("rank {rank}: communicator is unusable: {msg}")]
    Aborted {
        /// The rank that saw the error.
        rank: usize,
        /// Why.
        msg: String,
    },
    /// Another rank failed (a mismatch it found, a timeout, an abort, a protocol error) and
    /// told every rank, so that none waits for ever; `msg` is that rank's own error, which
    /// names the ranks and calls involved.
    #[error("rank {rank}: {call} (call #{seq}): rank {origin} failed: {msg}")]
    Remote {
        /// The rank that reports the error.
        rank: usize,
        /// The call in progress here (or the next call after the news arrived).
        call: &'static str,
        /// Sequence number of that call.
        seq: u64,
        /// The rank that failed first.
        origin: usize,
        /// What kind of failure it was.
        kind: FailureKind,
        /// The failing rank's error.
        msg: String,
    },
    /// An operating-system error outside of a peer link (its message adds what the errno
    /// most likely means and what to do, [`explain_os_error`]).
    #[error("rank {rank}: {context}: {}", with_explanation(.source))]
    Io {
        /// The rank that saw the error.
        rank: usize,
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

/// The kind of a failure that one rank reports to the others ([`Error::Remote`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FailureKind {
    /// Ranks called different collectives or the same one with different arguments.
    Mismatch,
    /// A peer was lost.
    PeerLost,
    /// A call timed out.
    Timeout,
    /// A rank called [`abort`](crate::Communicator::abort) or dropped a failed communicator.
    Aborted,
    /// A peer broke the protocol.
    Protocol,
    /// Anything else.
    Other,
}

impl FailureKind {
    /// A one-byte code for the wire.
    pub fn code(self) -> u8 {
        match self {
            FailureKind::Mismatch => 1,
            FailureKind::PeerLost => 2,
            FailureKind::Timeout => 3,
            FailureKind::Aborted => 4,
            FailureKind::Protocol => 5,
            FailureKind::Other => 6,
        }
    }

    /// The kind of a [`code`](Self::code) (unknown codes are `Other`).
    pub fn from_code(c: u8) -> Self {
        match c {
            1 => FailureKind::Mismatch,
            2 => FailureKind::PeerLost,
            3 => FailureKind::Timeout,
            4 => FailureKind::Aborted,
            5 => FailureKind::Protocol,
            _ => FailureKind::Other,
        }
    }
}

impl Error {
    /// What kind of failure this is, as told to the other ranks.
    pub fn failure_kind(&self) -> FailureKind {
        match self {
            Error::Mismatch { .. } => FailureKind::Mismatch,
            Error::PeerLost { .. } => FailureKind::PeerLost,
            Error::Timeout { .. } => FailureKind::Timeout,
            Error::Aborted { .. } => FailureKind::Aborted,
            Error::Protocol { .. } => FailureKind::Protocol,
            Error::Remote { kind, .. } => *kind,
            _ => FailureKind::Other,
        }
    }

    /// True for a mismatch, seen here ([`Error::Mismatch`]) or by another rank
    /// ([`Error::Remote`] of kind [`FailureKind::Mismatch`]).
    pub fn is_mismatch(&self) -> bool {
        self.failure_kind() == FailureKind::Mismatch
    }

    /// The lost rank, for [`Error::PeerLost`].
    pub fn lost_peer(&self) -> Option<usize> {
        match self {
            Error::PeerLost { peer, .. } => Some(*peer),
            _ => None,
        }
    }

    /// True when the error means the communicator can no longer be used (a peer was lost, a
    /// timeout, a protocol error), as opposed to a rejected argument.
    pub fn is_fatal(&self) -> bool {
        !matches!(self, Error::InvalidArgument { .. } | Error::Env(_))
    }
}

/// What a raw OS error that reaches users most likely means and what to do about it, by
/// errno, in one place (used by [`Error::Io`], the peer-link errors and the shared-memory
/// errors); `None` for errors whose text says enough.
pub fn explain_os_error(errno: i32) -> Option<&'static str> {
    Some(match errno {
        libc::EAGAIN => "the resource was busy or a non-blocking call would have waited (os error 11, EAGAIN): a socket timeout expired or the system is short of a resource (threads, locked memory); retry, raise OXCCL_TIMEOUT, or check `ulimit -u` / `ulimit -l`",
        libc::EEXIST => "the name is already taken (os error 17, EEXIST): a file or object of that name was left by an earlier job or is used by another one; remove stale /dev/shm/oxccl-* files of dead jobs, or give this job another OXCCL_SECRET",
        libc::EADDRINUSE => "the address is already in use (os error 98, EADDRINUSE): another process (an earlier job still running, or another program) listens on that port; pick another MASTER_PORT or stop the other process (`ss -ltnp` shows it)",
        libc::ECONNRESET => "the connection was reset by the other side (os error 104, ECONNRESET): its process died or closed the connection with data unread (it failed); look at that rank's own error",
        libc::ESRCH => "no such process (os error 3, ESRCH): the peer's process is gone (it died or exited), or it is in another pid namespace (containers) where its pid means nothing here",
        libc::ECONNREFUSED => "connection refused (os error 111, ECONNREFUSED): nothing listens at that address; the rank there is not running yet, has died, or the address/port is wrong",
        libc::ENOSPC => "no space left (os error 28, ENOSPC): the file system (for shared memory, /dev/shm) is full; enlarge it or free space",
        libc::EMFILE | libc::ENFILE => "too many open files (EMFILE/ENFILE): raise `ulimit -n`",
        _ => return None,
    })
}

/// `e` followed by its explanation, if [`explain_os_error`] has one.
pub(crate) fn with_explanation(e: &std::io::Error) -> String {
    match e.raw_os_error().and_then(explain_os_error) {
        Some(why) => format!("{e}; {why}"),
        None => e.to_string(),
    }
}

/// What an OS error on a peer's process or connection means, with the raw error after it:
/// "its process is gone (No such process (os error 3))".
pub(crate) fn describe_io(e: &std::io::Error) -> String {
    let meaning = match e.raw_os_error() {
        Some(libc::ESRCH) => Some("its process is gone"),
        Some(libc::EFAULT) => Some("its buffer is no longer mapped (it died or freed it)"),
        Some(libc::EPERM) | Some(libc::EACCES) => {
            Some("the kernel refuses access to its memory (ptrace rules)")
        }
        _ => match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                Some("it sent nothing within the socket's timeout")
            }
            std::io::ErrorKind::ConnectionReset => {
                Some("the connection was reset (its process died or its host went away)")
            }
            std::io::ErrorKind::BrokenPipe => Some("it closed the connection"),
            std::io::ErrorKind::UnexpectedEof => Some("it closed the connection mid-message"),
            _ => None,
        },
    };
    match meaning {
        Some(m) => format!("{m} ({e})"),
        None => with_explanation(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_os_errors_are_explained() {
        for (errno, want) in [
            (libc::EAGAIN, "OXCCL_TIMEOUT"),
            (libc::EEXIST, "/dev/shm/oxccl-"),
            (libc::EADDRINUSE, "MASTER_PORT"),
            (libc::ECONNRESET, "died"),
            (libc::ESRCH, "pid namespace"),
        ] {
            let e = Error::Io {
                rank: 3,
                context: "binding the rendezvous address 127.0.0.1:29500".into(),
                source: std::io::Error::from_raw_os_error(errno),
            };
            let m = e.to_string();
            assert!(
                m.starts_with("rank 3: binding the rendezvous address 127.0.0.1:29500: ")
                    && m.contains(&format!("(os error {errno})"))
                    && m.contains(want),
                "{m}"
            );
        }
        // Errors whose text says enough are left as they are.
        let e = std::io::Error::from_raw_os_error(libc::EINVAL);
        assert_eq!(with_explanation(&e), e.to_string());
        assert!(
            describe_io(&std::io::Error::from_raw_os_error(libc::EADDRINUSE)).contains("ss -ltnp")
        );
    }

    #[test]
    fn the_blamed_rank_is_the_innermost_one_named() {
        for (line, want) in [
            ("rank 1: bootstrap_allgather (call #2): lost peer rank 3: bootstrap connection closed", Some(3)),
            ("rank 2: all_reduce (call #4): rank 1 failed: rank 1: all_reduce (call #4): lost peer rank 3: x", Some(3)),
            ("rank 0: init (call #0) timed out after 3s, still waiting on rank(s) [2, 3]", Some(2)),
            ("rank 1: rendezvous at 127.0.0.1:5: rank 0 failed the rendezvous: rank 0: init (call #0) timed out after 3s, still waiting on rank(s) [3]", Some(3)),
            ("rank 3: cannot connect to rank 0 at 127.0.0.1:9 within 1s: refused", Some(0)),
            ("rank 1: barrier (call #1): rank 2 failed: rank 2: communicator is unusable: aborted", Some(2)),
            ("rank 1: shared memory: no room", None),
            ("CHILD_ERR environment: RANK is missing", None),
        ] {
            assert_eq!(blamed_rank(line), want, "{line}");
        }
    }

    #[test]
    fn rank_lists_are_bounded() {
        assert_eq!(rank_list(&[]), "[]");
        assert_eq!(rank_list(&[1, 2]), "[1, 2]");
        let all: Vec<usize> = (1..65536).collect();
        assert_eq!(rank_list(&all), "[1, 2, 3, 4, 5, 6, 7, 8] and 65527 more");
        let e = Error::Timeout {
            rank: 0,
            call: "init",
            seq: 0,
            waiting_on: all,
            elapsed: Duration::from_secs(1),
        };
        let m = e.to_string();
        assert!(
            m.len() < 250 && m.contains("[1, 2, 3, 4, 5, 6, 7, 8] and 65527 more"),
            "{m}"
        );
    }
}
