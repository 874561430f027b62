//! The [`UniqueId`]: the rendezvous address and the communicator's secret.

use std::net::SocketAddr;

/// Made by one rank ([`UniqueId::new`]), handed to every other rank out of band, then passed
/// to [`crate::Communicator::init`]: the address where rank 0 hosts the rendezvous, and a
/// random 128-bit secret every connection must prove it knows.
#[derive(Clone, PartialEq, Eq)]
pub struct UniqueId {
    /// Where rank 0 listens for the rendezvous.
    pub addr: SocketAddr,
    /// The communicator's secret.
    pub secret: [u8; 16],
}

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the secret.
        f.debug_struct("UniqueId")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl UniqueId {
    /// Placeholder until the bootstrap lands.
    pub fn with_addr(addr: SocketAddr, secret: [u8; 16]) -> Self {
        UniqueId { addr, secret }
    }
}
