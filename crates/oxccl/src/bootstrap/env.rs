//! Reading a launcher's environment (torchrun, `oxccl run`, Slurm, Open MPI, PMI).

use std::net::SocketAddr;

/// What a launcher told this process.
#[derive(Clone, Debug)]
pub struct LaunchEnv {
    /// This process's rank.
    pub rank: usize,
    /// The number of ranks.
    pub world_size: usize,
    /// Rank among the ranks on this host, if the launcher says.
    pub local_rank: Option<usize>,
    /// Where rank 0 hosts the rendezvous.
    pub root: SocketAddr,
    /// The communicator's secret.
    pub secret: [u8; 16],
    /// Which launcher's variables were used (`"torchrun"`, `"slurm"`, `"openmpi"`, `"pmi"`).
    pub launcher: &'static str,
}

impl LaunchEnv {
    /// Placeholder until the bootstrap lands.
    pub fn from_env() -> crate::Result<LaunchEnv> {
        todo!()
    }
}
