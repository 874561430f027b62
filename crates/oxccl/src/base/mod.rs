//! The base layer: errors, environment parameters, data types, reduction operators, the
//! reduction kernels, memory utilities and the doorbell/spin waiting primitives. Imports nothing
//! else of the crate.

pub(crate) mod buffers;
pub(crate) mod cross_memory;
pub(crate) mod debug;
pub(crate) mod dtype;
pub(crate) mod error;
pub(crate) mod file;
pub(crate) mod fork_gate;
pub(crate) mod mem;
pub(crate) mod op;
pub(crate) mod param;
pub mod reduce;
pub mod wait;
