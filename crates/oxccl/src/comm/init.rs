//! Joining a group: [`Communicator::init`] and its launcher and explicit-settings forms
//! (rendezvous, settings agreement, links, the direct area), and [`Communicator::from_links`]
//! for links made elsewhere.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use tracing::{debug, info};

use crate::base::error::{Error, Result};
use crate::base::param::{Config, TransportChoice};
use crate::base::wait::Spin;
use crate::bootstrap::topo::{self, Topology};
use crate::bootstrap::{Bootstrap, LaunchEnv, UniqueId};
use crate::comm::fault::Supervisor;
use crate::comm::settings::agree_on_settings;
use crate::comm::{Communicator, State};
use crate::direct::link::Direct;
use crate::fault::fingerprint::Sequencer;
use crate::sched::Algo;
use crate::transport::counted::{counted, LinkStats};
use crate::transport::{shm, tcp, Link, TransportKind};

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
        let mut boot = Bootstrap::init(id, rank, world_size, &cfg)?;
        let t_rendezvous = t0.elapsed();
        let cfg = agree_on_settings(&mut boot, cfg)?;
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
        let shm_links = shm::connect(&mut boot, &shm_peers, tag, &cfg)?;
        let t_shm = t0.elapsed();
        // Every rank decides alike whether any rank has a TCP peer (the peer table, the
        // topology and the transport are the same everywhere): when none has, skip the
        // transport's exchange of listen addresses (a round trip through rank 0).
        let tcp_anywhere =
            world_size > 1 && (cfg.transport == TransportChoice::Tcp || topo.hosts.len() > 1);
        let tcp_links = if tcp_anywhere {
            tcp::connect(&mut boot, &tcp_peers, &secret, &cfg)?
        } else {
            Vec::new()
        };
        let t_tcp = t0.elapsed();
        // Every rank on this host, talking through shared memory: set up the direct area for
        // the one-shot and single-copy algorithms (all ranks decide alike: same topology).
        let direct = if world_size > 1 && tcp_peers.is_empty() {
            let pids: Vec<u32> = peers.iter().map(|p| p.pid).collect();
            crate::direct::shm::connect(&mut boot, &pids, tag, cfg.cma)?
                .map(|d| Box::new(d) as Box<dyn Direct>)
        } else {
            None
        };
        let t_direct = t0.elapsed();
        let mut links: Vec<Option<Box<dyn Link>>> = (0..world_size).map(|_| None).collect();
        // Every link counts its bytes and progress for the status agent.
        let mut stats: Vec<Option<Arc<LinkStats>>> = (0..world_size).map(|_| None).collect();
        for (peer, link) in shm_links.into_iter().chain(tcp_links) {
            let (link, s) = counted(link);
            links[peer] = Some(link);
            stats[peer] = Some(s);
        }
        let mut comm = Self::assemble(rank, world_size, links, cfg, forced_algo)?;
        comm.local_rank = topo.local_rank(rank);
        comm.local_size = topo.local_size(rank);
        comm.spin = Spin::from_config(&comm.cfg, comm.local_size);
        comm.guard = Supervisor::with_bootstrap(&mut boot, &comm.cfg, &stats)?;
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
        comm.topo = Some(Arc::new(topo));
        comm.state
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            ._boot = Some(boot);
        comm.state
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .direct = direct;
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
            return Err(Error::InvalidArgument {
                rank,
                call: "init",
                seq: 0,
                msg: format!("no link to rank {p}"),
            });
        }
        let mut transports: Vec<TransportKind> = links.iter().flatten().map(|l| l.kind()).collect();
        transports.sort_by_key(|k| k.name());
        transports.dedup();
        Ok(Communicator {
            rank,
            nranks,
            local_rank: 0,
            local_size: 1,
            guard: Supervisor::local(rank, nranks, &cfg),
            spin: Spin::from_config(&cfg, 1),
            cfg,
            forced_algo,
            transports,
            topo: None,
            state: Mutex::new(State {
                links,
                seq: 0,
                scratch: Vec::new(),
                direct: None,
                broken: None,
                last_algo: "",
                seqr: Sequencer::new(nranks),
                stash: Default::default(),
                _boot: None,
            }),
            stream: Default::default(),
        })
    }

    /// Gives a communicator built by [`from_links`](Self::from_links) a direct area (e.g.
    /// [`crate::direct::link::mem_group`] for threads), enabling the one-shot and
    /// single-copy algorithms. Every rank must do the same.
    pub fn with_direct(mut self, direct: Box<dyn Direct>) -> Self {
        self.state
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .direct = Some(direct);
        self
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
