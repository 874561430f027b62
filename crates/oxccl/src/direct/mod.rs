//! The "direct" area: collectives that skip the schedule-over-links path. One-shot slots and
//! single-copy (CMA) collectives over mapped shared buffers, their event records ([`link`],
//! [`shm`]), their executor ([`exec`]) and the shared buffers themselves.

pub(crate) mod cma;
pub(crate) mod exec;
pub(crate) mod hugepages;
pub mod link;
pub(crate) mod oneshot;
pub mod shared_buffer;
pub(crate) mod shm;
