//! Joining a group: [`Communicator::init`] and its launcher and explicit-settings forms
//! (rendezvous, settings agreement, links, the direct area), and [`Communicator::from_links`]
//! for links made elsewhere.

use std::mem::ManuallyDrop;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tracing::{debug, info};

use crate::base::error::{Error, Result};
use crate::base::param::{Config, TransportChoice};
use crate::base::wait::Spin;
use crate::bootstrap::carry::{Carrier, Rider};
use crate::bootstrap::topo::{self, Topology};
use crate::bootstrap::{Bootstrap, LaunchEnv, UniqueId};
use crate::comm::fault::{Supervisor, SupervisorPrep};
use crate::comm::settings::{agree_on_settings, encode_settings};
use crate::comm::{Communicator, State};
use crate::direct::link::Direct;
use crate::fault::fingerprint::Sequencer;
use crate::sched::Algo;
use crate::transport::counted::{counted, LinkStats};
use crate::transport::tcp::lazy::LazyTcp;
use crate::transport::{shm, tcp, Link, TransportKind};

impl Communicator {
    /// Joins the communicator of `id` as `rank` of `world_size` (NCCL's model: one rank makes
    /// the [`UniqueId`] and hands it to the others out of band). Settings come from the
    /// environment ([`Config::from_env`]).
    ///
    /// Every rank calls it with the same `id` and `world_size`; it returns once all of them
    /// have joined and the links are up, or fails naming the ranks that did not join within
    /// the timeout (`OXCCL_TIMEOUT`). Rank 0 must run in the process that made `id` with
    /// [`UniqueId::new`] (it holds the listener), or `id` must come from
    /// [`UniqueId::with_addr`].
    ///
    /// # Example
    ///
    /// Two ranks as threads; the id goes to the other rank as a string, as it would to another
    /// process or host:
    ///
    /// ```
    /// use std::net::Ipv4Addr;
    ///
    /// use oxccl::{Communicator, UniqueId};
    ///
    /// # fn main() -> oxccl::Result<()> {
    /// // Rank 0 makes the id (here listening on 127.0.0.1; `UniqueId::new` picks the
    /// // interface that routes outward) and hands its string form to the others.
    /// let id = UniqueId::new_on(Ipv4Addr::LOCALHOST.into())?;
    /// let text = id.to_string();
    /// let other = std::thread::spawn(move || -> oxccl::Result<usize> {
    ///     let id: UniqueId = text.parse()?;
    ///     let comm = Communicator::init(&id, 1, 2)?;
    ///     Ok(comm.rank())
    /// });
    /// let comm = Communicator::init(&id, 0, 2)?;
    /// assert_eq!((comm.rank(), comm.world_size()), (0, 2));
    /// assert_eq!(other.join().unwrap()?, 1);
    /// # Ok(())
    /// # }
    /// ```
    pub fn init(id: &UniqueId, rank: usize, world_size: usize) -> Result<Self> {
        Self::init_with_config(id, rank, world_size, Config::from_env()?)
    }

    /// Joins a communicator launched by torchrun, `oxccl run`, Slurm, Open MPI or a PMI
    /// launcher, reading rank, size, rendezvous address and secret from their environment
    /// variables (listed in `bootstrap/env.rs`).
    ///
    /// # Example
    ///
    /// A launcher sets these variables for each rank; here the program sets them itself for a
    /// group of one rank:
    ///
    /// ```
    /// use std::net::TcpListener;
    ///
    /// use oxccl::Communicator;
    ///
    /// # fn main() -> oxccl::Result<()> {
    /// // A free port on the loopback interface for rank 0's rendezvous.
    /// let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    /// std::env::set_var("RANK", "0");
    /// std::env::set_var("WORLD_SIZE", "1");
    /// std::env::set_var("OXCCL_ROOT", format!("127.0.0.1:{port}"));
    /// // 32 hex digits shared by every rank (`oxccl run` draws random ones).
    /// std::env::set_var("OXCCL_SECRET", "00112233445566778899aabbccddeeff");
    /// let comm = Communicator::from_env()?;
    /// assert_eq!((comm.rank(), comm.world_size()), (0, 1));
    /// # Ok(())
    /// # }
    /// ```
    pub fn from_env() -> Result<Self> {
        let env = LaunchEnv::from_env()?;
        let id = UniqueId::with_addr(env.root, env.secret);
        Self::init(&id, env.rank, env.world_size)
    }

    /// As [`init`](Self::init), with explicit settings.
    pub fn init_with_config(
        id: &UniqueId,
        rank: usize,
        world_size: usize,
        cfg: Config,
    ) -> Result<Self> {
        crate::base::debug::init_from_env();
        if world_size == 0 || rank >= world_size {
            return Err(Error::InvalidArgument {
                rank,
                call: "init",
                seq: 0,
                msg: format!("rank {rank} is not in a world of {world_size} rank(s)"),
            });
        }
        // When each phase ended, for the `init phases` debug line (start-up cost, docs/scale.md).
        let t0 = Instant::now();
        // Rank 0's settings ride with the peer table: every rank takes them.
        let mut boot = Bootstrap::init_saying(id, rank, world_size, &cfg, &encode_settings(&cfg))?;
        // A rank that fails after its last exchange tells its peers why: some may have
        // finished init already, and would otherwise only see it leave.
        let mut last_exchange = None;
        match Self::init_on(&mut boot, t0, rank, world_size, cfg, &mut last_exchange) {
            Ok(comm) => {
                comm.lock()._boot = Some(boot);
                crate::comm::exit::register(&comm);
                Ok(comm)
            }
            Err(e) => {
                if last_exchange.is_some_and(|n| boot.exchanges_finished() >= n) {
                    tell_peers_init_failed(&mut boot, rank, &e);
                }
                Err(e)
            }
        }
    }

    /// Init after the rendezvous: the settings, the links, the supervisor. `last_exchange`:
    /// set to the number of finished exchanges that makes this rank's last one finished, once
    /// it is known.
    fn init_on(
        boot: &mut Bootstrap,
        t0: Instant,
        rank: usize,
        world_size: usize,
        cfg: Config,
        last_exchange: &mut Option<u64>,
    ) -> Result<Self> {
        let t_rendezvous = t0.elapsed();
        let cfg = agree_on_settings(boot, cfg)?;
        let t_settings = t0.elapsed();
        let forced_algo = parse_algo(&cfg)?;
        let peers = boot.peers().to_vec();
        let topo = Topology::new(&peers);
        let (shm_peers, tcp_peers) =
            topo::plan_links(rank, &peers, &topo, cfg.transport).map_err(|msg| {
                Error::InvalidArgument {
                    rank,
                    call: "init",
                    seq: 0,
                    msg,
                }
            })?;
        info!(
            rank,
            world_size,
            hosts = topo.hosts.len(),
            shm = shm_peers.len(),
            tcp = tcp_peers.len(),
            "init"
        );
        let tag = boot.comm_tag();
        let secret = *boot.secret();
        // The supervisor's ports and the direct area (every rank on this host, talking
        // through shared memory: the one-shot and single-copy algorithms; all ranks decide
        // alike, same topology) ride in the shared-memory transport's two exchanges.
        let (direct, direct_msg) = if world_size > 1 && tcp_peers.is_empty() {
            let pids: Vec<u32> = peers.iter().map(|p| p.pid).collect();
            let (setup, msg) = crate::direct::shm::Setup::start(rank, &pids, tag, cfg.cma);
            (Some(setup), msg)
        } else {
            (None, Vec::new())
        };
        let mut rider = InitRider {
            supervisor: Some(Supervisor::prepare(boot, &cfg)),
            ports: None,
            direct,
            direct_msg,
            done: None,
        };
        let shm_links = {
            let mut carrier = Carrier::new(boot, &mut rider);
            let links = shm::connect(&mut carrier, &shm_peers, tag, &cfg)?;
            carrier.finish()?;
            links
        };
        let t_shm = t0.elapsed();
        // Every rank decides alike whether any rank has a TCP peer (the peer table, the
        // topology and the transport are the same everywhere): when none has, skip the
        // transport's exchange of listen addresses (a round trip through rank 0).
        let tcp_anywhere =
            world_size > 1 && (cfg.transport == TransportChoice::Tcp || topo.hosts.len() > 1);
        // Init's last exchange: the TCP port exchange where any rank has a TCP peer, else the
        // shared-memory transport's (finished by now).
        *last_exchange = Some(boot.exchanges_finished() + u64::from(tcp_anywhere));
        let (tcp_links, lazy) = if tcp_anywhere {
            match tcp::setup(boot, &tcp_peers, &secret, &cfg)? {
                tcp::Setup::Now(links) => (links, None),
                tcp::Setup::Later(lazy) => (Vec::new(), Some(lazy)),
            }
        } else {
            (Vec::new(), None)
        };
        let t_tcp = t0.elapsed();
        let direct = rider
            .done
            .take()
            .flatten()
            .map(|d| Box::new(d) as Box<dyn Direct>);
        let t_direct = t0.elapsed();
        let mut links: Vec<Option<Box<dyn Link>>> = (0..world_size).map(|_| None).collect();
        // Every link counts its bytes and progress for the status agent.
        let mut stats: Vec<Option<Arc<LinkStats>>> = (0..world_size).map(|_| None).collect();
        for (peer, link) in shm_links.into_iter().chain(tcp_links) {
            let (link, s) = counted(link);
            links[peer] = Some(link);
            stats[peer] = Some(s);
        }
        // Links made on first use count into counters the status agent holds from now on.
        for (peer, s) in lazy.iter().flat_map(|l| l.stats()) {
            stats[*peer] = Some(s.clone());
        }
        let mut comm = Self::assemble(rank, world_size, links, lazy, cfg, forced_algo)?;
        comm.local_rank = topo.local_rank(rank);
        comm.local_size = topo.local_size(rank);
        comm.spin = Spin::from_config(&comm.cfg, comm.local_size);
        let (prep, ports) = (rider.supervisor.take(), rider.ports.take());
        let (Some(prep), Some(ports)) = (prep, ports) else {
            return Err(Error::Protocol {
                rank,
                peer: 0,
                call: "init",
                seq: 0,
                msg: "the supervisor's ports were not exchanged".into(),
            });
        };
        *comm.guard = prep.finish(boot, &comm.cfg, &stats, ports)?;
        let us = |d: std::time::Duration| d.as_micros() as u64;
        debug!(
            rank,
            rendezvous_us = us(t_rendezvous),
            settings_us = us(t_settings),
            shm_us = us(t_shm),
            tcp_us = us(t_tcp),
            direct_us = us(t_direct),
            supervisor_us = us(t0.elapsed()),
            "init phases (time from the start of init to the end of each)"
        );
        debug!(
            rank,
            local_ranks = comm.local_size,
            spin = comm.spin.budget,
            direct_spin = comm.spin.direct_budget,
            yield_every = comm.spin.yield_every,
            "wait policy"
        );
        comm.topo = Some(Arc::new(topo));
        comm.lock().direct = direct;
        Ok(comm)
    }

    /// Builds a communicator over links made elsewhere, e.g. [`crate::transport::mem::group`]
    /// for ranks that are threads of one process. `links` holds `(peer, link)` for every other
    /// rank.
    pub fn from_links(
        rank: usize,
        world_size: usize,
        links: Vec<(usize, Box<dyn Link>)>,
        cfg: Config,
    ) -> Result<Self> {
        let forced_algo = parse_algo(&cfg)?;
        let mut slots: Vec<Option<Box<dyn Link>>> = (0..world_size).map(|_| None).collect();
        for (peer, link) in links {
            if peer >= world_size || peer == rank {
                return Err(Error::InvalidArgument {
                    rank,
                    call: "init",
                    seq: 0,
                    msg: format!("link to invalid peer {peer}"),
                });
            }
            slots[peer] = Some(link);
        }
        Self::assemble(rank, world_size, slots, None, cfg, forced_algo)
    }

    fn assemble(
        rank: usize,
        nranks: usize,
        links: Vec<Option<Box<dyn Link>>>,
        lazy: Option<LazyTcp>,
        cfg: Config,
        forced_algo: Option<Algo>,
    ) -> Result<Self> {
        let later = |p: usize| lazy.as_ref().is_some_and(|l| l.covers(p));
        if let Some(p) = (0..nranks).find(|&p| p != rank && links[p].is_none() && !later(p)) {
            return Err(Error::InvalidArgument {
                rank,
                call: "init",
                seq: 0,
                msg: format!("no link to rank {p}"),
            });
        }
        let mut transports: Vec<TransportKind> = links.iter().flatten().map(|l| l.kind()).collect();
        if lazy.is_some() {
            transports.push(TransportKind::Tcp);
        }
        transports.sort_by_key(|k| k.name());
        transports.dedup();
        Ok(Communicator {
            rank,
            nranks,
            local_rank: 0,
            local_size: 1,
            guard: ManuallyDrop::new(Supervisor::local(rank, nranks, &cfg)),
            spin: Spin::from_config(&cfg, 1),
            model: crate::plan::cost::CostModel::for_config(&cfg),
            cfg,
            forced_algo,
            transports,
            topo: None,
            state: ManuallyDrop::new(Arc::new(Mutex::new(State {
                links,
                seq: 0,
                scratch: Vec::new(),
                direct: None,
                broken: None,
                closed: false,
                last_algo: "",
                seqr: Sequencer::new(nranks),
                stash: Default::default(),
                lazy,
                _boot: None,
            }))),
            stream: Default::default(),
            owner: crate::comm::Owner::this_process(),
        })
    }

    /// Gives a communicator built by [`from_links`](Self::from_links) a direct area (e.g.
    /// [`crate::direct::link::mem_group`] for threads), enabling the one-shot and
    /// single-copy algorithms. Every rank must do the same.
    pub fn with_direct(self, direct: Box<dyn Direct>) -> Self {
        self.lock().direct = Some(direct);
        self
    }
}

/// What rides in the shared-memory transport's two exchanges at init ([`Carrier`]): round 0
/// carries the supervisor's ports and the direct area's first message, round 1 the direct
/// area's verdict. Each round's message: the ports' length (`u16`), the ports, the direct
/// area's message.
struct InitRider {
    supervisor: Option<SupervisorPrep>,
    /// Every rank's ports, once round 0 arrived.
    ports: Option<Vec<Vec<u8>>>,
    /// The direct area being set up (none when it is not planned).
    direct: Option<crate::direct::shm::Setup>,
    /// The direct area's message for the next round.
    direct_msg: Vec<u8>,
    /// The direct area, once round 1 arrived (`Some(None)`: some rank could not set it up).
    done: Option<Option<crate::direct::shm::ShmDirect>>,
}

impl Rider for InitRider {
    fn message(&mut self, round: usize) -> Vec<u8> {
        let ports = match (round, &self.supervisor) {
            (0, Some(s)) => s.message(),
            _ => Vec::new(),
        };
        let direct = match (round, &self.direct) {
            (0 | 1, Some(_)) => std::mem::take(&mut self.direct_msg),
            _ => Vec::new(),
        };
        let mut msg = (ports.len() as u16).to_le_bytes().to_vec();
        msg.extend_from_slice(&ports);
        msg.extend_from_slice(&direct);
        msg
    }

    fn arrived(&mut self, round: usize, all: Vec<Vec<u8>>) {
        let (ports, direct): (Vec<Vec<u8>>, Vec<Vec<u8>>) = all
            .into_iter()
            .map(|mut m| {
                let len = m
                    .get(..2)
                    .map_or(0, |b| u16::from_le_bytes([b[0], b[1]]) as usize);
                let len = len.min(m.len().saturating_sub(2));
                let direct = m.split_off((2 + len).min(m.len()));
                m.drain(..2.min(m.len()));
                (m, direct)
            })
            .unzip();
        match round {
            0 => {
                self.ports = Some(ports);
                if let Some(d) = &mut self.direct {
                    self.direct_msg = d.opened(&direct);
                }
            }
            1 => {
                if let Some(d) = self.direct.take() {
                    self.done = Some(d.finish(&direct));
                }
            }
            _ => {}
        }
    }

    fn wants_more(&self, round: usize) -> bool {
        round < 2
    }
}

fn parse_algo(cfg: &Config) -> Result<Option<Algo>> {
    cfg.algo
        .as_deref()
        .map(|a| {
            a.parse::<Algo>()
                .map_err(|e| Error::Env(format!("OXCCL_ALGO: {e}")))
        })
        .transpose()
}

/// Tells the peers this rank is still connected to (over the connections their watchdogs
/// read: [`Bootstrap::take_connections`]) that its init failed with `e`, as a failed call's
/// report does: a peer that finished init then blames the rank `e` names, not this rank for
/// leaving. Called only after this rank's last exchange (nothing else is read on those
/// connections then). Best effort, without blocking: what was unread is drained first so
/// that the close sends the report and an orderly end, not a reset.
fn tell_peers_init_failed(boot: &mut Bootstrap, rank: usize, e: &Error) {
    use rustix::net::{RecvFlags, SendFlags, Shutdown};
    let Some(f) = crate::fault::watchdog::report_frame(rank, e) else {
        return;
    };
    let bytes = f.encode();
    let (conns, _) = boot.take_connections();
    let mut sink = [0u8; 4096];
    for (_, s, _) in &conns {
        let _ = rustix::net::send(s, &bytes, SendFlags::DONTWAIT | SendFlags::NOSIGNAL);
        for _ in 0..64 {
            if !matches!(rustix::net::recv(s, &mut sink, RecvFlags::DONTWAIT), Ok((n, _)) if n > 0)
            {
                break;
            }
        }
        let _ = rustix::net::shutdown(s, Shutdown::Write);
    }
}
