//! Internals that the integration tests, the benchmarks and the fuzz targets reach for; not a
//! stable API (hidden from the docs).

mod cut;
pub mod fuzzing;

pub use cut::cut_tcp;

pub use crate::base::{reduce, wait};
pub use crate::direct::{link, shared_buffer};
pub use crate::fault::{control, fingerprint, health};
pub use crate::net::auth;
pub use crate::observe::{flight, metrics};

/// The rendezvous internals the tests drive directly.
pub mod bootstrap {
    pub use crate::bootstrap::{local, Exchange};
}

/// The transport internals the tests drive directly: links and their errors.
pub mod transport {
    pub use crate::transport::counted::{counted, LinkStats};
    pub use crate::transport::{mem, shm, Link, LinkError, TransportKind, WaitSource};
}
