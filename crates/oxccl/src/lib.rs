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

pub mod base;
pub mod bootstrap;
pub mod comm;
pub mod direct;
pub mod exec;
pub mod fault;
pub mod net;
pub mod observe;
pub mod plan;
pub mod sched;
#[doc(hidden)]
pub mod testing;
pub mod transport;

pub use base::dtype::{Bool, DataType, Element};
pub use base::error::{Error, FailureKind, Result};
pub use base::op::ReduceOp;
pub use base::param::Config;
pub use bootstrap::UniqueId;
pub use comm::stream::{RawBufs, Work};
pub use comm::{ByteBufs, Communicator};
pub use direct::shared_buffer::SharedBuffer;
pub use exec::p2p::P2pOp;
pub use half::{bf16, f16};
pub use sched::CollKind;
