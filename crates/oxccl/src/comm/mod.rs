//! The communicator: a group of ranks and the collectives they call together.
//!
//! `impl Communicator` is spread over this folder by concern:
//!
//! - this file: the [`Communicator`] struct, its per-call state and its plain accessors;
//! - [`init`]: joining a group (rendezvous, links, direct area) or building one over links;
//! - [`settings`]: the settings every rank must share, agreed at init;
//! - [`collectives`]: the blocking calls, their argument checks and the path of one call
//!   (`run`: sequence number, algorithm choice, execution);
//! - [`nonblocking`]: the per-communicator queue, `*_async` calls and [`Work`](nonblocking::Work);
//! - [`fault`]: the [`Supervisor`](fault::Supervisor) (health, watchdog, recorder, timeout)
//!   and the calls built on it: abort, check, set_timeout, shrink;
//! - [`split`] and [`grow`]: new communicators from this one;
//! - [`check`]: the collective checker (every collective against a plain reference);
//! - [`exit`]: the goodbye of a communicator still alive when its process exits.

pub mod check;
mod collectives;
mod exit;
pub(crate) mod fault;
mod grow;
mod init;
pub(crate) mod nonblocking;
mod settings;
mod split;

pub use collectives::ByteBufs;

use std::mem::ManuallyDrop;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::base::error::{Error, Result};
use crate::base::param::Config;
use crate::base::wait::Spin;
use crate::bootstrap::topo::Topology;
use crate::bootstrap::Bootstrap;
use crate::comm::fault::Supervisor;
use crate::direct::link::Direct;
use crate::direct::shared_buffer::SharedBuffer;
use crate::fault::fingerprint::Sequencer;
use crate::sched::Algo;
use crate::transport::{Link, TransportKind};

/// A group of ranks that call collectives together.
///
/// Calls are blocking and ordered: every rank must make the same calls, with matching
/// arguments, in the same order (as with NCCL and MPI). A communicator is `Send + Sync`;
/// concurrent calls from several threads are serialized.
///
/// A communicator belongs to the process that made it: in a child forked from that process
/// every call on it (collectives, point-to-point, split, grow, shrink, queued calls, `check`)
/// fails with [`Error::InvalidArgument`](crate::Error::InvalidArgument) before anything
/// moves, `close` and `abort` do nothing, and dropping it there leaks its links and shared
/// memory instead of closing them for the parent's peers. A child makes its own.
///
/// ```no_run
/// use oxccl::{Communicator, ReduceOp};
/// # fn main() -> oxccl::Result<()> {
/// // Under torchrun, srun, mpirun or `oxccl run`:
/// let comm = Communicator::from_env()?;
/// let mut grads = vec![comm.rank() as f32; 1024];
/// comm.all_reduce_in_place(&mut grads, ReduceOp::Avg)?;
/// # Ok(()) }
/// ```
pub struct Communicator {
    rank: usize,
    nranks: usize,
    local_rank: usize,
    local_size: usize,
    cfg: Config,
    /// The cost model for `cfg` (its rates and network), made once: each call's choice
    /// reads it.
    model: crate::plan::cost::CostModel,
    /// How waiting calls spin: `cfg`'s settings, for this host's rank count.
    spin: Spin,
    forced_algo: Option<Algo>,
    transports: Vec<TransportKind>,
    /// Failure handling: the [`Supervisor`] (dropped before the links: it says goodbye first).
    /// `guard`, `state` and `stream` are dropped by hand (see `Drop`): a forked child that
    /// inherited the communicator leaks them instead.
    guard: ManuallyDrop<Supervisor>,
    /// Host of each rank (`None` for communicators built from links).
    topo: Option<Arc<Topology>>,
    /// Shared only with the exit hook ([`exit`], weakly): held through every call.
    state: ManuallyDrop<Arc<Mutex<State>>>,
    /// Queued non-blocking calls ([`crate::comm::nonblocking`]).
    pub(crate) stream: ManuallyDrop<crate::comm::nonblocking::Stream>,
    /// The process that made it: its id, and how many forks made it from the first process
    /// with fork handlers ([`fork_generation`](crate::direct::shared_buffer::fork_generation),
    /// one atomic load a call where `getpid` is a system call).
    owner: Owner,
}

/// The process a communicator belongs to (see `Communicator::own_process`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Owner {
    pid: u32,
    generation: u64,
}

impl Owner {
    /// This process (installing the fork handlers that count its forks, once).
    pub(crate) fn this_process() -> Owner {
        crate::direct::shared_buffer::install_fork_handlers();
        Owner {
            pid: std::process::id(),
            generation: crate::direct::shared_buffer::fork_generation(),
        }
    }

    /// Whether this is the process that `self` names (not a child forked from it).
    #[inline]
    pub(crate) fn is_this_process(&self) -> bool {
        crate::direct::shared_buffer::fork_generation() == self.generation
    }
}

struct State {
    links: Vec<Option<Box<dyn Link>>>,
    seq: u64,
    scratch: Vec<u64>,
    /// The direct area when every rank shares this host (one-shot and single-copy algorithms).
    direct: Option<Box<dyn Direct>>,
    broken: Option<String>,
    /// [`Communicator::close`] ran: links, direct area and watchdog are gone.
    closed: bool,
    last_algo: &'static str,
    seqr: Sequencer,
    /// Point-to-point messages that arrived before a receive asked for them.
    stash: crate::exec::p2p::Stash,
    /// The TCP links not made yet (`OXCCL_TCP_CONNECT=lazy`); `None` once all are.
    lazy: Option<crate::transport::tcp::lazy::LazyTcp>,
    _boot: Option<Bootstrap>,
}

impl State {
    /// Frees what a closed communicator no longer needs: its links (a TCP link reads what
    /// its peer sent first, so that it closes with a FIN), its direct area, the rest.
    fn release(&mut self) {
        for l in self.links.iter_mut() {
            *l = None;
        }
        self.direct = None;
        self.lazy = None;
        self.scratch = Vec::new();
        self._boot = None;
    }
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank)
            .field("world_size", &self.nranks)
            .field("transports", &self.transport_summary())
            .finish_non_exhaustive()
    }
}

impl Communicator {
    /// A zeroed buffer of `bytes` bytes in shared memory (like `ncclMemAlloc`): collectives
    /// on it (or on any part of it) move bytes to and from the other ranks of this host with
    /// plain loads and stores instead of kernel copies. See [`crate::direct::shared_buffer`].
    pub fn alloc_shared(&self, bytes: usize) -> Result<SharedBuffer> {
        SharedBuffer::new(bytes, self.rank)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.nranks
    }

    /// This rank's index among the ranks of its host.
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// How many ranks share this rank's host.
    pub fn local_size(&self) -> usize {
        self.local_size
    }

    /// The settings in force.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The transports this rank's links use, e.g. `"shm"`, `"shm+tcp"`, or `"none"` alone.
    pub fn transport_summary(&self) -> String {
        if self.transports.is_empty() {
            return "none".into();
        }
        self.transports
            .iter()
            .map(|t| t.name())
            .collect::<Vec<_>>()
            .join("+")
    }

    /// The algorithm the last call ran (`"ring"`, `"chain"`, ...), empty before any call.
    pub fn last_algo(&self) -> &'static str {
        self.lock().last_algo
    }

    /// Forces an algorithm for every collective it implements (`None`: the tuner decides).
    pub fn set_algo(&mut self, algo: Option<Algo>) {
        self.forced_algo = algo;
    }

    /// Failure handling ([`crate::comm::fault`]).
    pub(crate) fn supervisor(&self) -> &Supervisor {
        &self.guard
    }

    /// The hosts of the ranks, as the communicator saw them at init (`None` when built from
    /// links).
    pub fn topology(&self) -> Option<&Topology> {
        self.topo.as_deref()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Refuses `call` in a process other than the one that made this communicator (a child
    /// forked from it): its links, shared-memory rings, direct area and control connections
    /// are the parent's, so any traffic from the child would reach the peers as the parent's
    /// (a peer pairs it with its own call and returns wrong data). Checked before anything
    /// else (the queue, the state's lock: a thread of the parent may have held it at the
    /// fork, and no thread of the parent runs in the child).
    #[inline]
    pub(crate) fn own_process(&self, call: &'static str) -> Result<()> {
        if self.owner.is_this_process() {
            return Ok(());
        }
        Err(Error::InvalidArgument {
            rank: self.rank,
            call,
            seq: 0,
            msg: format!(
                "this communicator belongs to process {}; process {} is a child forked from \
                 it, and a forked child must create its own communicator (its calls would \
                 reach the peers as the parent's)",
                self.owner.pid,
                std::process::id()
            ),
        })
    }
}

impl Drop for Communicator {
    /// Drops the supervisor first (it says goodbye), then the state (links, direct area),
    /// then the stream. In a forked child that inherited the communicator they are leaked
    /// instead: dropping them would say the parent's goodbye, close the parent's
    /// shared-memory rings and direct area for every peer, and join threads that exist only
    /// in the parent.
    fn drop(&mut self) {
        if !self.owner.is_this_process() {
            return;
        }
        // SAFETY: each field is dropped once, here, and not used after (this is `drop`).
        unsafe {
            ManuallyDrop::drop(&mut self.guard);
            ManuallyDrop::drop(&mut self.state);
            ManuallyDrop::drop(&mut self.stream);
        }
    }
}
