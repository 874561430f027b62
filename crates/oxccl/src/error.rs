//! The one error type of oxccl.
//!
//! Every error that happens inside a collective names the rank that saw it, the call
//! (`"all_reduce"`, ...) and the call's sequence number on this communicator, and, where a
//! peer is involved, that peer. Nothing in the public API panics on bad input: it returns one
//! of these.

use std::time::Duration;

/// Result alias used throughout oxccl.
pub type Result<T, E = Error> = std::result::Result<T, E>;

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
    #[error("rank {rank}: {call} (call #{seq}) timed out after {elapsed:?}, still waiting on rank(s) {waiting_on:?}")]
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
    /// An operating-system error outside of a peer link.
    #[error("rank {rank}: {context}: {source}")]
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

impl Error {
    /// True when the error means the communicator can no longer be used (a peer was lost, a
    /// timeout, a protocol error), as opposed to a rejected argument.
    pub fn is_fatal(&self) -> bool {
        !matches!(self, Error::InvalidArgument { .. } | Error::Env(_))
    }
}
