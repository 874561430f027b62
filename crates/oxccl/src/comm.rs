//! The communicator: a group of ranks and the collectives they call together.

use std::sync::{Mutex, MutexGuard};

use tracing::{debug, info};

use crate::algo::{Algo, Coll, CollKind};
use crate::bootstrap::{Bootstrap, LaunchEnv, UniqueId};
use crate::dtype::{DataType, Element};
use crate::error::{Error, Result};
use crate::exec::{self, Buffers, Ctx};
use crate::op::ReduceOp;
use crate::param::Config;
use crate::topo::{self, Topology};
use crate::transport::{shm, tcp, Link, TransportKind};
use crate::tune;

/// A group of ranks that call collectives together.
///
/// Calls are blocking and ordered: every rank must make the same calls, with matching
/// arguments, in the same order (as with NCCL and MPI). A communicator is `Send + Sync`;
/// concurrent calls from several threads are serialized.
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
    forced_algo: Option<Algo>,
    transports: Vec<TransportKind>,
    state: Mutex<State>,
}

struct State {
    links: Vec<Option<Box<dyn Link>>>,
    seq: u64,
    scratch: Vec<u64>,
    broken: Option<String>,
    last_algo: &'static str,
    _boot: Option<Bootstrap>,
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

/// One call's arguments, before buffers.
struct Call {
    kind: CollKind,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
    root: usize,
}

impl Communicator {
    /// Joins the communicator of `id` as `rank` of `world_size` (NCCL's model: one rank makes
    /// the [`UniqueId`] and hands it to the others out of band). Settings come from the
    /// environment ([`Config::from_env`]).
    pub fn init(id: &UniqueId, rank: usize, world_size: usize) -> Result<Self> {
        Self::init_with_config(id, rank, world_size, Config::from_env()?)
    }

    /// Joins a communicator launched by torchrun, `oxccl run`, Slurm, Open MPI or a PMI
    /// launcher, reading rank, size, rendezvous address and secret from their environment
    /// variables (see [`LaunchEnv`]).
    pub fn from_env() -> Result<Self> {
        let env = LaunchEnv::from_env()?;
        let id = UniqueId::with_addr(env.root, env.secret);
        Self::init(&id, env.rank, env.world_size)
    }

    /// As [`init`](Self::init), with explicit settings.
    pub fn init_with_config(id: &UniqueId, rank: usize, world_size: usize, cfg: Config) -> Result<Self> {
        crate::debug::init_from_env();
        if world_size == 0 || rank >= world_size {
            return Err(Error::InvalidArgument {
                rank,
                call: "init",
                seq: 0,
                msg: format!("rank {rank} is not in a world of {world_size} rank(s)"),
            });
        }
        let forced_algo = parse_algo(&cfg)?;
        let mut boot = Bootstrap::init(id, rank, world_size, &cfg)?;
        let peers = boot.peers().to_vec();
        let topo = Topology::new(&peers);
        let (shm_peers, tcp_peers) = topo::plan_links(rank, &peers, &topo, cfg.transport)
            .map_err(|msg| Error::InvalidArgument { rank, call: "init", seq: 0, msg })?;
        info!(rank, world_size, hosts = topo.hosts.len(), shm = shm_peers.len(), tcp = tcp_peers.len(), "init");
        let tag = boot.comm_tag();
        let secret = *boot.secret();
        let shm_links = shm::connect(&mut boot, &shm_peers, tag, &cfg)?;
        let tcp_links = tcp::connect(&mut boot, &tcp_peers, &secret, &cfg)?;
        let mut links: Vec<Option<Box<dyn Link>>> = (0..world_size).map(|_| None).collect();
        for (peer, link) in shm_links.into_iter().chain(tcp_links) {
            links[peer] = Some(link);
        }
        let mut comm = Self::assemble(rank, world_size, links, cfg, forced_algo)?;
        comm.local_rank = topo.local_rank(rank);
        comm.local_size = topo.local_size(rank);
        comm.state.get_mut().unwrap_or_else(|e| e.into_inner())._boot = Some(boot);
        Ok(comm)
    }

    /// Builds a communicator over links made elsewhere, e.g. [`crate::transport::mem::group`]
    /// for ranks that are threads of one process. `links` holds `(peer, link)` for every other
    /// rank.
    pub fn from_links(rank: usize, world_size: usize, links: Vec<(usize, Box<dyn Link>)>, cfg: Config) -> Result<Self> {
        let forced_algo = parse_algo(&cfg)?;
        let mut slots: Vec<Option<Box<dyn Link>>> = (0..world_size).map(|_| None).collect();
        for (peer, link) in links {
            if peer >= world_size || peer == rank {
                return Err(Error::InvalidArgument { rank, call: "init", seq: 0, msg: format!("link to invalid peer {peer}") });
            }
            slots[peer] = Some(link);
        }
        Self::assemble(rank, world_size, slots, cfg, forced_algo)
    }

    fn assemble(
        rank: usize,
        nranks: usize,
        links: Vec<Option<Box<dyn Link>>>,
        cfg: Config,
        forced_algo: Option<Algo>,
    ) -> Result<Self> {
        if let Some(p) = (0..nranks).find(|&p| p != rank && links[p].is_none()) {
            return Err(Error::InvalidArgument { rank, call: "init", seq: 0, msg: format!("no link to rank {p}") });
        }
        let mut transports: Vec<TransportKind> = links.iter().flatten().map(|l| l.kind()).collect();
        transports.sort_by_key(|k| k.name());
        transports.dedup();
        Ok(Communicator {
            rank,
            nranks,
            local_rank: 0,
            local_size: 1,
            cfg,
            forced_algo,
            transports,
            state: Mutex::new(State { links, seq: 0, scratch: Vec::new(), broken: None, last_algo: "", _boot: None }),
        })
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
        self.transports.iter().map(|t| t.name()).collect::<Vec<_>>().join("+")
    }

    /// The algorithm the last call ran (`"ring"`, `"chain"`, ...), empty before any call.
    pub fn last_algo(&self) -> &'static str {
        self.lock().last_algo
    }

    /// Forces an algorithm for every collective it implements (`None`: the tuner decides).
    pub fn set_algo(&mut self, algo: Option<Algo>) {
        self.forced_algo = algo;
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn bad(&self, call: &'static str, seq: u64, msg: String) -> Error {
        Error::InvalidArgument { rank: self.rank, call, seq, msg }
    }

    fn check_root(&self, call: &'static str, seq: u64, root: usize) -> Result<()> {
        if root >= self.nranks {
            return Err(self.bad(call, seq, format!("root {root} is out of range (world size {})", self.nranks)));
        }
        Ok(())
    }

    fn check_peer(&self, call: &'static str, seq: u64, peer: usize) -> Result<()> {
        if peer >= self.nranks {
            return Err(self.bad(call, seq, format!("peer {peer} is out of range (world size {})", self.nranks)));
        }
        if peer == self.rank {
            return Err(self.bad(call, seq, format!("rank {peer} cannot {call} to or from itself")));
        }
        Ok(())
    }

    /// Runs one call: sequence number, validation (by `validate`, which sees the sequence
    /// number), algorithm choice, execution. A fatal error leaves the communicator unusable.
    fn run<'b>(
        &self,
        name: &'static str,
        validate: impl FnOnce(u64) -> Result<Call>,
        mut bufs: Buffers<'b>,
    ) -> Result<()> {
        let mut st = self.lock();
        st.seq += 1;
        let seq = st.seq;
        if let Some(why) = &st.broken {
            return Err(Error::Aborted { rank: self.rank, msg: format!("{name} (call #{seq}) after an earlier failure: {why}") });
        }
        let call = validate(seq)?;
        let algo = tune::choose(call.kind, self.forced_algo);
        let coll = Coll {
            kind: call.kind,
            rank: self.rank,
            nranks: self.nranks,
            count: call.count,
            dtype: call.dtype,
            op: call.op,
            root: call.root,
            chunk_bytes: self.cfg.chunk_bytes,
        };
        let sched = algo.schedule(&coll);
        debug_assert!(sched.validate(self.rank).is_ok(), "{:?}", sched.validate(self.rank));
        debug!(seq, call = name, count = call.count, dtype = %call.dtype, algo = sched.algo, "call");
        st.last_algo = sched.algo;
        let State { links, scratch, .. } = &mut *st;
        let mut ctx = Ctx {
            rank: self.rank,
            links,
            dtype: call.dtype,
            op: call.op,
            nranks: self.nranks,
            spin: self.cfg.spin,
            timeout: self.cfg.timeout,
            call: name,
            seq,
        };
        let res = exec::execute(&mut ctx, &sched, &mut bufs, scratch);
        if let Err(e) = &res {
            if e.is_fatal() {
                st.broken = Some(e.to_string());
            }
        }
        res
    }

    /// Every rank gets the element-wise reduction of every rank's `send` in `recv`
    /// (same length as `send`).
    pub fn all_reduce<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        let (sl, rl) = (send.len(), recv.len());
        let call = "all_reduce";
        self.run(
            call,
            |seq| {
                if sl != rl {
                    return Err(self.bad(call, seq, format!("send has {} elements, recv {}", sl, rl)));
                }
                Ok(Call { kind: CollKind::AllReduce, count: sl, dtype: T::DTYPE, op, root: 0 })
            },
            Buffers::new(bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv)),
        )
    }

    /// [`all_reduce`](Self::all_reduce) in place.
    pub fn all_reduce_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let bl = buf.len();
        let n = std::mem::size_of_val(buf);
        self.run(
            "all_reduce",
            |_| Ok(Call { kind: CollKind::AllReduce, count: bl, dtype: T::DTYPE, op, root: 0 }),
            Buffers::in_place(bytemuck::cast_slice_mut(buf), 0..n, 0..n),
        )
    }

    /// Every rank gets `root`'s `send` in `recv`. `send` is read on the root only (other
    /// ranks may pass an empty slice); on the root it must have `recv`'s length.
    pub fn broadcast<T: Element>(&self, send: &[T], recv: &mut [T], root: usize) -> Result<()> {
        let (sl, rl) = (send.len(), recv.len());
        let call = "broadcast";
        let is_root = root == self.rank;
        self.run(
            call,
            |seq| {
                self.check_root(call, seq, root)?;
                if is_root && sl != rl {
                    return Err(self.bad(call, seq, format!("root's send has {} elements, recv {}", sl, rl)));
                }
                Ok(Call { kind: CollKind::Broadcast, count: rl, dtype: T::DTYPE, op: ReduceOp::Sum, root })
            },
            Buffers::new(if is_root { bytemuck::cast_slice(send) } else { &[] }, bytemuck::cast_slice_mut(recv)),
        )
    }

    /// [`broadcast`](Self::broadcast) in place: `buf` is the source on the root and the
    /// destination elsewhere.
    pub fn broadcast_in_place<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        let bl = buf.len();
        let call = "broadcast";
        let n = std::mem::size_of_val(buf);
        let input = if root == self.rank { 0..n } else { 0..0 };
        self.run(
            call,
            |seq| {
                self.check_root(call, seq, root)?;
                Ok(Call { kind: CollKind::Broadcast, count: bl, dtype: T::DTYPE, op: ReduceOp::Sum, root })
            },
            Buffers::in_place(bytemuck::cast_slice_mut(buf), input, 0..n),
        )
    }

    /// `root` gets the element-wise reduction of every rank's `send` in `recv`. `recv` is
    /// written on the root only (other ranks may pass an empty slice); on the root it must have
    /// `send`'s length.
    pub fn reduce<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        let (sl, rl) = (send.len(), recv.len());
        let call = "reduce";
        let is_root = root == self.rank;
        self.run(
            call,
            |seq| {
                self.check_root(call, seq, root)?;
                if is_root && sl != rl {
                    return Err(self.bad(call, seq, format!("send has {} elements, root's recv {}", sl, rl)));
                }
                Ok(Call { kind: CollKind::Reduce, count: sl, dtype: T::DTYPE, op, root })
            },
            Buffers::new(bytemuck::cast_slice(send), if is_root { bytemuck::cast_slice_mut(recv) } else { &mut [] }),
        )
    }

    /// [`reduce`](Self::reduce) in place: on the root `buf` is replaced by the result; other
    /// ranks' `buf` is only read.
    pub fn reduce_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        let bl = buf.len();
        let call = "reduce";
        let n = std::mem::size_of_val(buf);
        let output = if root == self.rank { 0..n } else { 0..0 };
        self.run(
            call,
            |seq| {
                self.check_root(call, seq, root)?;
                Ok(Call { kind: CollKind::Reduce, count: bl, dtype: T::DTYPE, op, root })
            },
            Buffers::in_place(bytemuck::cast_slice_mut(buf), 0..n, output),
        )
    }

    /// Every rank gets every rank's `send`, concatenated in rank order, in `recv`
    /// (`recv.len() == world_size * send.len()`).
    pub fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let (sl, rl) = (send.len(), recv.len());
        let call = "all_gather";
        self.run(
            call,
            |seq| {
                if Some(rl) != sl.checked_mul(self.nranks) {
                    return Err(self.bad(
                        call,
                        seq,
                        format!("recv has {} elements; expected world size {} x send {}", rl, self.nranks, sl),
                    ));
                }
                Ok(Call { kind: CollKind::AllGather, count: sl, dtype: T::DTYPE, op: ReduceOp::Sum, root: 0 })
            },
            Buffers::new(bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv)),
        )
    }

    /// [`all_gather`](Self::all_gather) in place: this rank's contribution is already in its
    /// block of `buf` (`buf[rank * len / world_size..]`).
    pub fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        let bl = buf.len();
        let call = "all_gather";
        let count = bl / self.nranks;
        let es = std::mem::size_of::<T>();
        let (n, r) = (std::mem::size_of_val(buf), self.rank);
        self.run(
            call,
            |seq| {
                if bl % self.nranks != 0 {
                    return Err(self.bad(call, seq, format!("{} elements do not divide among {} ranks", bl, self.nranks)));
                }
                Ok(Call { kind: CollKind::AllGather, count, dtype: T::DTYPE, op: ReduceOp::Sum, root: 0 })
            },
            Buffers::in_place(bytemuck::cast_slice_mut(buf), r * count * es..(r + 1) * count * es, 0..n),
        )
    }

    /// Rank r gets block r of the element-wise reduction of every rank's `send`
    /// (`send.len() == world_size * recv.len()`).
    pub fn reduce_scatter<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        let (sl, rl) = (send.len(), recv.len());
        let call = "reduce_scatter";
        self.run(
            call,
            |seq| {
                if Some(sl) != rl.checked_mul(self.nranks) {
                    return Err(self.bad(
                        call,
                        seq,
                        format!("send has {} elements; expected world size {} x recv {}", sl, self.nranks, rl),
                    ));
                }
                Ok(Call { kind: CollKind::ReduceScatter, count: rl, dtype: T::DTYPE, op, root: 0 })
            },
            Buffers::new(bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv)),
        )
    }

    /// [`reduce_scatter`](Self::reduce_scatter) in place: the result lands in this rank's
    /// block of `buf` (`buf[rank * len / world_size..][..len / world_size]`); the other blocks
    /// are left as they were.
    pub fn reduce_scatter_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let bl = buf.len();
        let call = "reduce_scatter";
        let count = bl / self.nranks;
        let es = std::mem::size_of::<T>();
        let (n, r) = (std::mem::size_of_val(buf), self.rank);
        self.run(
            call,
            |seq| {
                if bl % self.nranks != 0 {
                    return Err(self.bad(call, seq, format!("{} elements do not divide among {} ranks", bl, self.nranks)));
                }
                Ok(Call { kind: CollKind::ReduceScatter, count, dtype: T::DTYPE, op, root: 0 })
            },
            Buffers::in_place(bytemuck::cast_slice_mut(buf), 0..n, r * count * es..(r + 1) * count * es),
        )
    }

    /// Block p of this rank's `send` goes to rank p, which stores it as block r of its `recv`
    /// (both `world_size` equal blocks, same length).
    pub fn all_to_all<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let (sl, rl) = (send.len(), recv.len());
        let call = "all_to_all";
        self.run(
            call,
            |seq| {
                if sl != rl || sl % self.nranks != 0 {
                    return Err(self.bad(
                        call,
                        seq,
                        format!(
                            "send ({}) and recv ({}) must have one length, divisible by the world size {}",
                            sl,
                            rl,
                            self.nranks
                        ),
                    ));
                }
                Ok(Call { kind: CollKind::AllToAll, count: sl / self.nranks, dtype: T::DTYPE, op: ReduceOp::Sum, root: 0 })
            },
            Buffers::new(bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv)),
        )
    }

    /// [`all_to_all`](Self::all_to_all) in place (through a temporary copy of `buf`).
    pub fn all_to_all_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        let send = buf.to_vec();
        self.all_to_all(&send, buf)
    }

    /// Sends `buf` to `peer`, which must call [`recv`](Self::recv) with the same length.
    pub fn send<T: Element>(&self, buf: &[T], peer: usize) -> Result<()> {
        let bl = buf.len();
        let call = "send";
        self.run(
            call,
            |seq| {
                self.check_peer(call, seq, peer)?;
                Ok(Call { kind: CollKind::Send { peer }, count: bl, dtype: T::DTYPE, op: ReduceOp::Sum, root: 0 })
            },
            Buffers::new(bytemuck::cast_slice(buf), &mut []),
        )
    }

    /// Receives `buf.len()` elements from `peer`'s [`send`](Self::send).
    pub fn recv<T: Element>(&self, buf: &mut [T], peer: usize) -> Result<()> {
        let bl = buf.len();
        let call = "recv";
        self.run(
            call,
            |seq| {
                self.check_peer(call, seq, peer)?;
                Ok(Call { kind: CollKind::Recv { peer }, count: bl, dtype: T::DTYPE, op: ReduceOp::Sum, root: 0 })
            },
            Buffers::new(&[], bytemuck::cast_slice_mut(buf)),
        )
    }

    /// Sends `send` to `to` while receiving `recv` from `from`, as `MPI_Sendrecv` (both of one
    /// length; `to == from == rank` copies locally).
    pub fn sendrecv<T: Element>(&self, send: &[T], to: usize, recv: &mut [T], from: usize) -> Result<()> {
        let (sl, rl) = (send.len(), recv.len());
        let call = "sendrecv";
        let me = self.rank;
        self.run(
            call,
            |seq| {
                if sl != rl {
                    return Err(self.bad(call, seq, format!("send has {} elements, recv {}", sl, rl)));
                }
                if !(to == me && from == me) {
                    self.check_peer(call, seq, to)?;
                    self.check_peer(call, seq, from)?;
                }
                Ok(Call { kind: CollKind::SendRecv { to, from }, count: sl, dtype: T::DTYPE, op: ReduceOp::Sum, root: 0 })
            },
            Buffers::new(bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv)),
        )
    }

    /// Returns once every rank has called it.
    pub fn barrier(&self) -> Result<()> {
        self.run(
            "barrier",
            |_| Ok(Call { kind: CollKind::Barrier, count: 0, dtype: DataType::U8, op: ReduceOp::Sum, root: 0 }),
            Buffers::new(&[], &mut []),
        )
    }
}

fn parse_algo(cfg: &Config) -> Result<Option<Algo>> {
    cfg.algo.as_deref().map(|a| a.parse::<Algo>().map_err(|e| Error::Env(format!("OXCCL_ALGO: {e}")))).transpose()
}
