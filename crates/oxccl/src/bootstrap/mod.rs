//! Bootstrap: how the ranks of a communicator find each other.
//!
//! Rank 0 hosts the rendezvous at the address in the [`UniqueId`] (or `MASTER_ADDR:MASTER_PORT`
//! / `OXCCL_ROOT` under a launcher). Every rank connects to it, proves that it knows the
//! secret, and sends its [`PeerInfo`]; rank 0 answers with everyone's. The connections stay
//! open for the life of the communicator and carry small out-of-band exchanges
//! ([`Bootstrap::allgather`], [`Bootstrap::barrier`]) that transports use to set up their links.

pub mod auth;
pub mod env;
pub mod local;
mod unique_id;

use std::net::IpAddr;

pub use env::LaunchEnv;
pub use unique_id::UniqueId;

use crate::error::Result;
use crate::param::Config;

/// What each rank tells the others at rendezvous.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerInfo {
    /// The rank.
    pub rank: usize,
    /// Host identity: ranks with equal host ids share memory (see [`crate::topo`]).
    pub host_id: String,
    /// Host name, for messages.
    pub hostname: String,
    /// Process id, for messages and liveness checks of shared-memory peers.
    pub pid: u32,
    /// The address this rank's data connections listen on (the interface that routes to the
    /// rendezvous, or `OXCCL_SOCKET_IFNAME`'s).
    pub ip: IpAddr,
}

/// Out-of-band exchange between the ranks of a communicator: what transports use to set up
/// their links. [`Bootstrap`] implements it over TCP; [`local::LocalExchange`] over threads,
/// for tests.
pub trait Exchange: Send {
    /// This rank.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn world_size(&self) -> usize;
    /// Every rank contributes `mine`; every rank gets all contributions, indexed by rank.
    /// Collective: every rank must call it, in the same order as the others.
    fn allgather(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>>;
    /// Returns once every rank has called it.
    fn barrier(&mut self) -> Result<()> {
        self.allgather(&[]).map(|_| ())
    }
}

/// A rank's connection to the rendezvous, kept open for out-of-band exchanges.
pub struct Bootstrap {
    _private: (),
}

impl Bootstrap {
    /// Joins the rendezvous of `id` as `rank` of `world_size`; blocks until every rank has
    /// joined or `cfg.timeout` passes.
    pub fn init(
        _id: &UniqueId,
        _rank: usize,
        _world_size: usize,
        _cfg: &Config,
    ) -> Result<Bootstrap> {
        todo!("bootstrap")
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        todo!()
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        todo!()
    }

    /// Every rank's [`PeerInfo`], indexed by rank.
    pub fn peers(&self) -> &[PeerInfo] {
        todo!()
    }

    /// A per-communicator tag derived from the secret (names shared-memory segments).
    pub fn comm_tag(&self) -> u64 {
        todo!()
    }

    /// The communicator's secret (from the [`UniqueId`]).
    pub fn secret(&self) -> &[u8; 16] {
        todo!()
    }

    /// Every rank contributes `mine`; every rank gets all contributions, indexed by rank.
    /// Collective: every rank must call it.
    pub fn allgather(&mut self, _mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        todo!()
    }

    /// Returns once every rank has called it.
    pub fn barrier(&mut self) -> Result<()> {
        self.allgather(&[]).map(|_| ())
    }
}

impl Exchange for Bootstrap {
    fn rank(&self) -> usize {
        todo!()
    }
    fn world_size(&self) -> usize {
        todo!()
    }
    fn allgather(&mut self, _mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        todo!()
    }
}
