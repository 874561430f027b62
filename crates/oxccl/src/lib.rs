//! oxccl: collective communication for groups of processes, on one host or many.
//!
//! A group of processes ("ranks") builds a [`Communicator`], then calls collectives on it:
//! [`all_reduce`](Communicator::all_reduce), [`broadcast`](Communicator::broadcast),
//! [`reduce`](Communicator::reduce), [`all_gather`](Communicator::all_gather),
//! [`reduce_scatter`](Communicator::reduce_scatter), [`all_to_all`](Communicator::all_to_all),
//! [`send`](Communicator::send)/[`recv`](Communicator::recv) and
//! [`barrier`](Communicator::barrier). Ranks of one host talk through shared memory, ranks of
//! different hosts through TCP.
//!
//! The tree follows the communicator's life: [`bootstrap`] (rendezvous), [`topo`] (who shares
//! a host), [`transport`] (links to peers), [`tune`] (which algorithm), [`algo`] (each
//! algorithm as a schedule of sends and receives, no I/O), [`exec`] (runs a schedule over
//! links), [`reduce`] (the reduction kernels), [`comm`] (the public API).

#![warn(missing_docs)]

pub mod algo;
pub mod bootstrap;
pub mod check;
pub mod comm;
pub mod control;
pub mod cost;
pub mod debug;
pub mod dtype;
pub mod error;
pub mod exec;
pub mod exec_direct;
pub mod fingerprint;
pub mod flight;
pub mod flight_torch;
#[doc(hidden)]
pub mod fuzzing;
mod grow;
pub mod guard;
pub mod health;
pub mod hugepages;
pub mod mem;
pub mod metrics;
pub mod op;
pub mod p2p;
pub mod param;
pub mod reduce;
pub mod shared_buffer;
mod split;
pub mod status;
pub mod stream;
#[doc(hidden)]
pub mod testing;
pub mod timeline;
pub mod topo;
pub mod transport;
pub mod tune;
pub mod wait;

pub use algo::CollKind;
pub use bootstrap::UniqueId;
pub use comm::{ByteBufs, Communicator};
pub use dtype::{Bool, DataType, Element};
pub use error::{Error, FailureKind, Result};
pub use half::{bf16, f16};
pub use op::ReduceOp;
pub use p2p::P2pOp;
pub use param::Config;
pub use shared_buffer::SharedBuffer;
pub use stream::{RawBufs, Work};
