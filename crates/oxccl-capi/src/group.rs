//! `oxcclGroupStart` / `oxcclGroupEnd`: the calls between them (on this thread, one
//! communicator) are queued as one job on the communicator's stream and run in order; the end
//! hands back an [`oxcclWork`] to wait on, or waits itself. Groups nest; the outermost end
//! submits.

use std::cell::RefCell;
use std::sync::Arc;

use oxccl::Communicator;

use crate::comm::Call;
use crate::result::{guard, oxcclResult_t, CError};
use crate::work::{oxcclWork, WorkState};

/// This thread's open group.
#[derive(Default)]
struct Group {
    depth: usize,
    comm: Option<Arc<Communicator>>,
    calls: Vec<Call>,
}

thread_local! {
    static GROUP: RefCell<Group> = RefCell::new(Group::default());
}

/// Queues `call` in this thread's open group (`Ok(None)`), or hands it back to run now.
pub(crate) fn record(comm: &Arc<Communicator>, call: Call) -> Result<Option<Call>, CError> {
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            return Ok(Some(call));
        }
        match &g.comm {
            Some(c) if !Arc::ptr_eq(c, comm) => {
                return Err(CError::invalid(
                    "oxccl: every call of a group must be on one communicator",
                ))
            }
            Some(_) => {}
            None => g.comm = Some(Arc::clone(comm)),
        }
        g.calls.push(call);
        Ok(None)
    })
}

/// `oxcclGroupStart`: calls on this thread are queued until the matching `oxcclGroupEnd`.
#[no_mangle]
pub extern "C" fn oxcclGroupStart() -> oxcclResult_t {
    guard(|| {
        GROUP.with(|g| g.borrow_mut().depth += 1);
        Ok(())
    })
}

/// `oxcclGroupEnd`: ends a group; the outermost end queues its calls as one job on the
/// communicator's stream. With `work` non-NULL it returns at once and `*work` is the job's
/// handle (NULL for an empty group), to wait on, test and free; the buffers must stay valid
/// until it completes. With `work` NULL it waits for the job (bounded by each call's timeout)
/// and returns its result.
#[no_mangle]
pub extern "C" fn oxcclGroupEnd(work: *mut *mut oxcclWork) -> oxcclResult_t {
    let mut handle: Option<Box<oxcclWork>> = None;
    let r = guard(|| {
        let (comm, calls) = GROUP.with(|g| {
            let mut g = g.borrow_mut();
            if g.depth == 0 {
                return Err(CError::invalid(
                    "oxccl: oxcclGroupEnd without oxcclGroupStart",
                ));
            }
            g.depth -= 1;
            if g.depth > 0 {
                return Ok((None, Vec::new()));
            }
            Ok((g.comm.take(), std::mem::take(&mut g.calls)))
        })?;
        if let Some(comm) = comm {
            handle = Some(Box::new(WorkState::submit(&comm, calls)));
        }
        Ok(())
    });
    if r != oxcclResult_t::oxcclSuccess {
        return r;
    }
    if work.is_null() {
        return match handle {
            None => r,
            Some(h) => h.wait_raw(-1.0),
        };
    }
    // SAFETY: non-null output pointer (the caller's obligation).
    unsafe { *work = handle.map_or(std::ptr::null_mut(), Box::into_raw) };
    r
}
