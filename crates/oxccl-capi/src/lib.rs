//! A C ABI over oxccl, NCCL-like: `include/oxccl.h` declares it.
//!
//! - [`result`]: error codes and the per-thread last-error text;
//! - [`types`]: the data type and reduction enums;
//! - [`comm`]: communicators and blocking collectives on raw pointers;
//! - [`group`]: `oxcclGroupStart`/`oxcclGroupEnd`, which queue calls as one nonblocking
//!   [`work::oxcclWork`];
//! - [`work`]: waiting on, testing, and completion callbacks of queued work;
//! - [`p2p`]: `oxcclP2p`, sends and receives (tags, any source) and the collectives made of
//!   them, as one group;
//! - [`mem`]: `oxcclMemAlloc`/`oxcclMemFree`, memory in shared memory for collectives;
//! - [`table`]: every function in one table ([`API`]), which the Python module exports as a
//!   capsule so that C++ code in the same process (the torch backend) calls the same library
//!   instance.
//!
//! No panic crosses the ABI: every function runs under `catch_unwind` and reports a panic as
//! `oxcclInternalError`.

#![allow(non_camel_case_types)]
// The `extern "C"` functions take raw pointers from C, whose contracts (valid handles, output
// pointers, buffers of the stated length) are C's, documented in include/oxccl.h; each
// dereference says so in its SAFETY comment. They are entry points for C, not Rust API.
#![allow(clippy::not_unsafe_ptr_arg_deref)]
#![warn(missing_docs)]

pub mod comm;
pub mod group;
pub mod mem;
pub mod p2p;
pub mod result;
pub mod table;
pub mod types;
pub mod work;

pub use comm::{comm_into_handle, oxcclComm};
pub use result::oxcclResult_t;
pub use table::{oxcclApi, API};
pub use work::oxcclWork;
