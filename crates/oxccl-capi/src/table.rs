//! Every C function in one table (`oxcclApi_t` in `oxccl.h`). The Python module exports
//! [`API`] as the capsule `oxccl._oxccl._C_API`, so that C++ code loaded into the same
//! process (the torch backend) calls the library instance Python uses, on communicators
//! Python created, without linking a second copy.

use std::ffi::{c_char, c_int, c_void};

use crate::comm::*;
use crate::group::*;
use crate::mem::*;
use crate::p2p::*;
use crate::result::*;
use crate::types::{oxcclDataType_t, oxcclRedOp_t};
use crate::work::*;

/// The table's layout version (`OXCCL_API_VERSION` in `oxccl.h`); raised whenever an entry is
/// added, removed or changed.
pub const API_VERSION: u32 = 4;

type Coll = extern "C" fn(
    *const u8,
    *mut u8,
    usize,
    oxcclDataType_t,
    oxcclRedOp_t,
    *const oxcclComm,
) -> oxcclResult_t;
type Rooted = extern "C" fn(
    *const u8,
    *mut u8,
    usize,
    oxcclDataType_t,
    c_int,
    *const oxcclComm,
) -> oxcclResult_t;
type RootedOp = extern "C" fn(
    *const u8,
    *mut u8,
    usize,
    oxcclDataType_t,
    oxcclRedOp_t,
    c_int,
    *const oxcclComm,
) -> oxcclResult_t;
type Move =
    extern "C" fn(*const u8, *mut u8, usize, oxcclDataType_t, *const oxcclComm) -> oxcclResult_t;

/// The function table; field order is the ABI (see `oxcclApi_t` in `oxccl.h`).
#[repr(C)]
pub struct oxcclApi {
    /// [`API_VERSION`].
    pub version: u32,
    /// `size_of::<oxcclApi>()`.
    pub size: u32,
    /// [`oxcclGetLastError`].
    pub get_last_error: extern "C" fn() -> *const c_char,
    /// [`oxcclGetErrorString`].
    pub get_error_string: extern "C" fn(oxcclResult_t) -> *const c_char,
    /// [`oxcclCommDestroy`].
    pub comm_destroy: extern "C" fn(*mut oxcclComm) -> oxcclResult_t,
    /// [`oxcclCommCount`].
    pub comm_count: extern "C" fn(*const oxcclComm, *mut c_int) -> oxcclResult_t,
    /// [`oxcclCommUserRank`].
    pub comm_user_rank: extern "C" fn(*const oxcclComm, *mut c_int) -> oxcclResult_t,
    /// [`oxcclCommTimeout`].
    pub comm_timeout: extern "C" fn(*const oxcclComm, *mut f64) -> oxcclResult_t,
    /// [`oxcclAllReduce`].
    pub all_reduce: Coll,
    /// [`oxcclBroadcast`].
    pub broadcast: Rooted,
    /// [`oxcclReduce`].
    pub reduce: RootedOp,
    /// [`oxcclAllGather`].
    pub all_gather: Move,
    /// [`oxcclReduceScatter`].
    pub reduce_scatter: Coll,
    /// [`oxcclAllToAll`].
    pub all_to_all: Move,
    /// [`oxcclBarrier`].
    pub barrier: extern "C" fn(*const oxcclComm) -> oxcclResult_t,
    /// [`oxcclGroupStart`].
    pub group_start: extern "C" fn() -> oxcclResult_t,
    /// [`oxcclGroupEnd`].
    pub group_end: extern "C" fn(*mut *mut oxcclWork) -> oxcclResult_t,
    /// [`oxcclWorkWait`].
    pub work_wait: extern "C" fn(*const oxcclWork, f64) -> oxcclResult_t,
    /// [`oxcclWorkTest`].
    pub work_test: extern "C" fn(*const oxcclWork, *mut i32) -> oxcclResult_t,
    /// [`oxcclWorkOnComplete`].
    pub work_on_complete:
        extern "C" fn(*const oxcclWork, oxcclWorkCallback, *mut c_void) -> oxcclResult_t,
    /// [`oxcclWorkFree`].
    pub work_free: extern "C" fn(*mut oxcclWork) -> oxcclResult_t,
    /// [`oxcclMemAlloc`] (since version 2).
    pub mem_alloc: extern "C" fn(*mut *mut c_void, usize) -> oxcclResult_t,
    /// [`oxcclMemFree`] (since version 2).
    pub mem_free: extern "C" fn(*mut c_void) -> oxcclResult_t,
    /// [`oxcclCommSetTimeout`] (since version 3).
    pub comm_set_timeout: extern "C" fn(*const oxcclComm, f64) -> oxcclResult_t,
    /// [`oxcclP2p`] (since version 4).
    pub p2p:
        extern "C" fn(*mut oxcclP2pOp, usize, oxcclP2pCall_t, *const oxcclComm) -> oxcclResult_t,
}

/// The table of this library instance.
pub static API: oxcclApi = oxcclApi {
    version: API_VERSION,
    size: std::mem::size_of::<oxcclApi>() as u32,
    get_last_error: oxcclGetLastError,
    get_error_string: oxcclGetErrorString,
    comm_destroy: oxcclCommDestroy,
    comm_count: oxcclCommCount,
    comm_user_rank: oxcclCommUserRank,
    comm_timeout: oxcclCommTimeout,
    all_reduce: oxcclAllReduce,
    broadcast: oxcclBroadcast,
    reduce: oxcclReduce,
    all_gather: oxcclAllGather,
    reduce_scatter: oxcclReduceScatter,
    all_to_all: oxcclAllToAll,
    barrier: oxcclBarrier,
    group_start: oxcclGroupStart,
    group_end: oxcclGroupEnd,
    work_wait: oxcclWorkWait,
    work_test: oxcclWorkTest,
    work_on_complete: oxcclWorkOnComplete,
    work_free: oxcclWorkFree,
    mem_alloc: oxcclMemAlloc,
    mem_free: oxcclMemFree,
    comm_set_timeout: oxcclCommSetTimeout,
    p2p: oxcclP2p,
};

/// `oxcclGetApi`: this library's function table.
#[no_mangle]
pub extern "C" fn oxcclGetApi() -> *const oxcclApi {
    &API
}
