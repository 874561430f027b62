//! `oxcclMemAlloc` / `oxcclMemFree`, as NCCL's `ncclMemAlloc` / `ncclMemFree`: memory in
//! shared memory (a block of the process's [`oxccl::SharedPool`]) that collectives reach with
//! loads and stores on every rank of the host, from any communicator. A freed block is cached
//! and handed out again, keeping the mappings peers made of it.

use std::ffi::c_void;

use oxccl::SharedPool;

use crate::result::{guard, oxcclResult_t, CError};

/// `oxcclMemAlloc`: `*ptr` = a page-aligned block of at least `size` bytes in shared memory
/// (contents undefined), to be freed with [`oxcclMemFree`].
#[no_mangle]
pub extern "C" fn oxcclMemAlloc(ptr: *mut *mut c_void, size: usize) -> oxcclResult_t {
    guard(|| {
        // SAFETY: a non-null output pointer points to writable memory (the caller's obligation).
        let slot = unsafe { ptr.as_mut() }
            .ok_or_else(|| CError::invalid("oxccl: oxcclMemAlloc: ptr is NULL"))?;
        *slot = SharedPool::global().alloc(size)?.as_ptr().cast();
        Ok(())
    })
}

/// `oxcclMemFree`: returns a block of [`oxcclMemAlloc`]; `NULL` is a no-op. Any other pointer
/// (one freed already, or not from `oxcclMemAlloc`) is `oxcclInvalidArgument`, and nothing is
/// freed.
#[no_mangle]
pub extern "C" fn oxcclMemFree(ptr: *mut c_void) -> oxcclResult_t {
    guard(|| {
        if ptr.is_null() {
            return Ok(());
        }
        SharedPool::global()
            .free(ptr.cast_const().cast())
            .map_err(|e| CError::invalid(format!("oxccl: {e}")))
    })
}
