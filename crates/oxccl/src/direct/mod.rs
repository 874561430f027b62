//! The "direct" area: collectives that skip the schedule-over-links path. One-shot slots and
//! single-copy (CMA) collectives over mapped shared buffers, their event records ([`link`],
//! [`shm`]), their executor ([`exec`]) and the shared buffers themselves.

pub mod cma;
pub mod exec;
pub mod hugepages;
pub mod link;
pub mod oneshot;
pub mod shared_buffer;
pub mod shm;
