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
//! # Example
//!
//! Two ranks as two threads of one process, joined over a [`UniqueId`] on the loopback
//! interface. Across processes or hosts the id travels as a string (rank 0 makes it and hands
//! it to the others out of band), or a launcher sets the variables that
//! [`Communicator::from_env`] reads.
//!
//! ```
//! use std::net::Ipv4Addr;
//! use std::thread;
//!
//! use oxccl::{Communicator, ReduceOp, UniqueId};
//!
//! # fn main() -> oxccl::Result<()> {
//! let world = 2;
//! // Made in rank 0's process: it listens on 127.0.0.1 for the rendezvous.
//! let id = UniqueId::new_on(Ipv4Addr::LOCALHOST.into())?;
//! let ranks: Vec<_> = (0..world)
//!     .map(|rank| {
//!         let id = id.clone();
//!         thread::spawn(move || -> oxccl::Result<Vec<f32>> {
//!             let comm = Communicator::init(&id, rank, world)?;
//!             let mine = vec![rank as f32 + 1.0; 4];
//!             let mut sum = vec![0.0; 4];
//!             comm.all_reduce(&mine, &mut sum, ReduceOp::Sum)?;
//!             comm.barrier()?;
//!             Ok(sum)
//!         })
//!     })
//!     .collect();
//! for r in ranks {
//!     assert_eq!(r.join().unwrap()?, vec![3.0; 4]);
//! }
//! # Ok(())
//! # }
//! ```
//!
//! # Main types
//!
//! - [`Communicator`]: a rank's handle on its group; blocking collectives, their `_in_place`
//!   forms, asynchronous forms returning a [`Work`] (`all_reduce_async`, ...), point-to-point
//!   ([`P2pOp`] batches), and fault handling (`abort`, `check`, `shrink`, `grow`, `split`).
//! - [`UniqueId`]: where rank 0 hosts the rendezvous and the group's secret.
//! - [`Config`]: the settings, read from `OXCCL_*` variables ([`params`] lists them all) or
//!   built in code for [`Communicator::init_with_config`].
//! - [`Element`] and [`DataType`]: the element types (integers, `f32`, `f64`, [`struct@f16`],
//!   [`struct@bf16`], [`Bool`]); [`ReduceOp`]: sum, product, min, max, average and the bitwise
//!   operators.
//! - [`Error`]: every failure is a value naming the rank, the peer, the call and its sequence
//!   number; [`Error::failure_kind`] sorts them
//!   ([`FailureKind`]).
//! - [`SharedBuffer`] and [`SharedPool`]: memory that the ranks of a host map, for
//!   collectives without copies.
//!
//! The C API (`oxccl.h`, NCCL's names with an `oxccl` prefix) is the `oxccl-capi` crate, the
//! launcher and benchmarks the `oxccl` command (`oxccl-cli`), and the Python package with its
//! PyTorch backend lives in `python/`.
//!
//! The source tree is layered; each folder imports only from the folders above it in this
//! list (bottom layer first):
//!
//! 1. `base`: errors, environment parameters (all of them), data types, reduction operators,
//!    the reduction kernels, memory utilities, the doorbell and spin/sleep waiting primitives.
//! 2. `net`: the authenticated socket layer (handshake, admitting strangers) shared by the
//!    rendezvous and the TCP transport.
//! 3. `bootstrap`: rendezvous (unique id, launcher environment, root join, local groups) and
//!    the topology it yields (who shares a host).
//! 4. `transport`: the `Link` trait and its implementations: in-memory, shared memory, TCP
//!    (with striping).
//! 5. `sched`: each collective algorithm as a schedule of sends, receives and reductions (no
//!    I/O), the rank placement they use, and their simulators (tests only).
//! 6. `plan`: the cost model and the tuner that picks an algorithm.
//! 7. `fault`: health, the control plane (heartbeats, aborts) and call fingerprints.
//! 8. `observe`: flight recorder, timeline, metrics, status agent.
//! 9. `direct`: one-shot and single-copy collectives over mapped shared buffers.
//! 10. `exec`: the executor that runs a schedule over links, and the point-to-point engine.
//! 11. `comm`: the [`Communicator`] (init, collectives, streams, the supervisor: abort, check,
//!     shrink; split, grow) and the collective [`check`]er.
//!
//! The modules are private; this root re-exports the public API, and [`testing`] (hidden)
//! the internals that integration tests, benchmarks and fuzz targets drive directly.
//!
//! The layers, the path of one call and where each concept lives: `docs/architecture.md`.

#![warn(missing_docs)]
#![warn(unreachable_pub)]
#![deny(clippy::undocumented_unsafe_blocks)]

mod base;
mod bootstrap;
mod comm;
mod direct;
mod exec;
mod fault;
mod net;
mod observe;
mod plan;
mod sched;
#[doc(hidden)]
pub mod testing;
mod transport;

pub use base::dtype::{Bool, DataType, Element};
pub use base::error::{blamed_rank, explain_os_error, rank_list, Error, FailureKind, Result};
pub use base::file::read_bounded;
pub use base::mem::check_fits;
pub use base::op::ReduceOp;
pub use base::param::table as params;
pub use base::param::{parse_bytes, Config, TcpConnect, TransportChoice};
pub use base::wait::{spin_until, WAIT_SPIN};
pub use bootstrap::{default_ip, local_host_id, UniqueId};
pub use comm::check;
pub use comm::nonblocking::{RawBufs, Work};
pub use comm::{ByteBufs, Communicator};
pub use direct::shared_buffer::SharedBuffer;
pub use direct::shared_pool::{PoolStats, SharedPool};
pub use exec::p2p::P2pOp;
pub use fault::fingerprint::P2pCall;
pub use half::{bf16, f16};
pub use observe::status;
pub use plan::tuning::{Rates, Tuning};
pub use plan::{calibrate, predict};
pub use sched::{Algo, CollKind};
pub use transport::shm::segment_bytes as shm_segment_bytes;
