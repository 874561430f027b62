//! The base layer: errors, environment parameters, data types, reduction operators, the
//! reduction kernels, memory helpers and the doorbell/spin waiting primitives. Imports nothing
//! else of the crate.

pub mod debug;
pub mod dtype;
pub mod error;
pub mod mem;
pub mod op;
pub mod param;
pub mod reduce;
pub mod wait;
