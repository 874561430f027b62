//! Transports: how bytes move between two ranks.
//!
//! Every transport fills the same small interface, [`Link`]: an ordered, reliable,
//! non-blocking byte stream to one peer, in both directions. Algorithms never see a
//! transport; the executor (`exec`) drives links and sleeps on their
//! [`WaitSource`]s when none can progress.
//!
//! - [`shm`]: shared memory between ranks of one host (one single-producer/single-consumer
//!   ring per ordered pair, futex doorbells).
//! - [`tcp`]: TCP sockets between hosts (or everywhere, with `OXCCL_TRANSPORT=tcp`).
//! - [`mem`]: in-process queues, for testing algorithms deterministically in one process.
//!
//! [`counted`] wraps any link to count its bytes and its last progress for the status agent.

use std::fmt;
use std::os::fd::BorrowedFd;

use crate::base::wait::Doorbell;

pub(crate) mod counted;
pub mod mem;
pub mod shm;
pub(crate) mod tcp;

pub(crate) use crate::base::error::describe_io;

/// Which transport a link uses.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum TransportKind {
    /// Shared memory (same host).
    Shm,
    /// TCP sockets.
    Tcp,
    /// In-process memory (tests).
    Mem,
}

impl TransportKind {
    /// Lower-case name, as printed by `oxccl perf` and accepted by `OXCCL_TRANSPORT`.
    pub const fn name(self) -> &'static str {
        match self {
            TransportKind::Shm => "shm",
            TransportKind::Tcp => "tcp",
            TransportKind::Mem => "mem",
        }
    }
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a link failed. The executor turns it into an [`crate::Error`] naming the call.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// The peer closed its end, exited or was killed.
    #[error("peer closed the connection ({0})")]
    Closed(String),
    /// The peer sent something that breaks the protocol.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// An operating-system error.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// The link needs memory that a limit keeps from it (the peer's shared-memory budget):
    /// what, and what to raise.
    #[error("{0}")]
    Resource(String),
    /// The peer's call failed while it lent this rank a message ([`Link::withdraw`]): the
    /// memory it named may hold anything now, so the copy out of it is refused.
    #[error("{0}")]
    Withdrawn(String),
}

impl LinkError {
    /// The error of call `call` (number `seq`) on `rank` when its link to `peer` failed so.
    pub fn into_error(
        self,
        rank: usize,
        peer: usize,
        call: &'static str,
        seq: u64,
    ) -> crate::Error {
        use crate::Error;
        match self {
            LinkError::Protocol(msg) => Error::Protocol {
                rank,
                peer,
                call,
                seq,
                msg,
            },
            LinkError::Closed(reason) => Error::PeerLost {
                rank,
                peer,
                call,
                seq,
                reason,
            },
            LinkError::Resource(msg) => Error::SharedMemory {
                rank,
                msg: format!("{call} (call #{seq}): the link to rank {peer}: {msg}"),
            },
            LinkError::Io(e) => Error::PeerLost {
                rank,
                peer,
                call,
                seq,
                reason: describe_io(&e),
            },
            LinkError::Withdrawn(msg) => Error::Remote {
                rank,
                call,
                seq,
                origin: peer,
                kind: crate::base::error::FailureKind::Other,
                msg,
            },
        }
    }
}

/// What a waiter sleeps on when a link cannot progress.
#[derive(Debug, Clone, Copy)]
pub enum WaitSource<'a> {
    /// Sleep on this doorbell; the peer rings it when it writes or frees ring space.
    Doorbell(&'a Doorbell),
    /// Sleep in `poll(2)` on this descriptor (readable for receives, writable for sends).
    Fd(BorrowedFd<'a>),
}

/// A reliable, ordered, non-blocking byte stream to one peer.
///
/// Both directions are independent: a rank may send and receive on the same link at the same
/// time (the ring algorithms depend on it). Neither call blocks.
pub trait Link: Send {
    /// The transport this link uses.
    fn kind(&self) -> TransportKind;

    /// Copies a prefix of `data` into the link and returns its length; 0 when the link has no
    /// room now (the peer has not consumed earlier bytes). `data` may be empty.
    fn try_send(&mut self, data: &[u8]) -> Result<usize, LinkError>;

    /// Offers the bytes that have arrived, in order, to `consume`, which returns how many of
    /// them it took (a prefix; it may take fewer than offered, e.g. to keep whole elements,
    /// and the rest is offered again next time). The link may call `consume` more than once
    /// (e.g. across the wrap of a ring) and stops once `consume` takes less than offered.
    /// Returns the total taken; 0 when nothing has arrived.
    fn try_recv(&mut self, consume: &mut dyn FnMut(&[u8]) -> usize) -> Result<usize, LinkError>;

    /// Receives arrived bytes straight into a prefix of `dst` and returns how many; 0 when
    /// nothing has arrived. Same stream as [`try_recv`](Self::try_recv) (the two may be
    /// mixed); transports that can avoid a copy through their own buffer override it (TCP
    /// reads from the socket into `dst`).
    fn try_recv_into(&mut self, dst: &mut [u8]) -> Result<usize, LinkError> {
        let mut off = 0;
        self.try_recv(&mut |data| {
            let k = data.len().min(dst.len() - off);
            dst[off..off + k].copy_from_slice(&data[..k]);
            off += k;
            k
        })
    }

    /// Whether a transfer of `len` bytes goes single-copy (`send`: from this rank): the
    /// sender lends its memory ([`try_lend`](Self::try_lend)) and the receiver copies out of
    /// it ([`try_copy_lent`](Self::try_copy_lent)) instead of both copying through the link.
    /// Both ends of a link answer alike for a transfer. The default: never.
    fn single_copy(&self, _send: bool, _len: usize) -> bool {
        false
    }

    /// Lends `src` to the peer (the first call announces it); true once the peer has copied
    /// all of it. `src` must not change until then. Only where [`single_copy`](Self::single_copy).
    fn try_lend(&mut self, _src: &[u8]) -> Result<bool, LinkError> {
        Err(LinkError::Protocol(format!(
            "{} links cannot lend memory",
            self.kind()
        )))
    }

    /// Copies `dst.len()` bytes at `off` of the message of `len` bytes the peer lends; false
    /// while its loan has not arrived. The copy that reaches `len` ends the loan. Only where
    /// [`single_copy`](Self::single_copy).
    fn try_copy_lent(
        &mut self,
        _len: usize,
        _off: usize,
        _dst: &mut [u8],
    ) -> Result<bool, LinkError> {
        Err(LinkError::Protocol(format!(
            "{} links cannot borrow memory",
            self.kind()
        )))
    }

    /// The call failed on this rank: ends a loan still outstanding
    /// ([`try_lend`](Self::try_lend) not yet true), before the caller may reuse the memory.
    /// The peer's copy out of it then fails with [`LinkError::Withdrawn`] instead of reading
    /// whatever the memory holds by then, and the link carries nothing more. The default (a
    /// link that never lends): nothing to do.
    fn withdraw(&mut self) {}

    /// What to sleep on until [`try_send`](Self::try_send) may accept more bytes.
    fn send_wait(&self) -> WaitSource<'_>;

    /// What to sleep on until [`try_recv`](Self::try_recv) may offer bytes.
    fn recv_wait(&self) -> WaitSource<'_>;

    /// Called by the executor every so often while it sleeps on this link, to notice a peer
    /// that died without closing anything (a killed process holding shared memory). The
    /// default checks nothing.
    fn check_alive(&mut self) -> Result<(), LinkError> {
        Ok(())
    }
}

#[cfg(test)]
mod describe_tests {
    use super::*;

    #[test]
    fn raw_os_errors_are_explained() {
        let gone = LinkError::Io(std::io::Error::from_raw_os_error(libc::ESRCH))
            .into_error(0, 2, "all_reduce", 5)
            .to_string();
        assert!(
            gone.contains("lost peer rank 2: its process is gone"),
            "{gone}"
        );
        let again = describe_io(&std::io::Error::from_raw_os_error(libc::EAGAIN));
        assert!(again.starts_with("it sent nothing within"), "{again}");
        let other = describe_io(&std::io::Error::from_raw_os_error(libc::ENOSPC));
        assert!(other.contains("os error"), "{other}");
    }
}
