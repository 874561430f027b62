//! The "direct" area: collectives on one host that skip the schedule-over-links path. Every
//! rank publishes events in a small area its peers map ([`link`]: the interface, [`shm`]: over
//! shared memory), through which run one-shot collectives (data in the slots, [`oneshot`]) and
//! single-copy ones (straight between ranks' buffers, [`cma`]: `process_vm_readv`/`writev`, or
//! loads and stores into peers' mapped [`shared_buffer`]s, which [`shared_pool`] caches for
//! allocations without a communicator); [`exec`] publishes and waits; [`agree`] is the
//! agreement on shared buffers a call's plan may depend on.

pub(crate) mod agree;
pub(crate) mod cma;
pub(crate) mod exec;
pub(crate) mod hugepages;
pub mod link;
pub(crate) mod oneshot;
pub mod shared_buffer;
pub(crate) mod shared_pool;
pub(crate) mod shm;
