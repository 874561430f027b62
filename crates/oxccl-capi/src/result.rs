//! Error codes (`oxcclResult_t`) and the last error's text, per thread.

use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use oxccl::Error;

/// A C function's result (`oxcclResult_t` in `oxccl.h`).
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum oxcclResult_t {
    /// The call succeeded.
    oxcclSuccess = 0,
    /// A bad argument: a null pointer, an unknown enum value, a wrong length, ...
    oxcclInvalidArgument = 1,
    /// A call or a wait did not finish in time.
    oxcclTimeout = 2,
    /// A peer was lost.
    oxcclPeerLost = 3,
    /// Ranks called different collectives, or with different arguments.
    oxcclMismatch = 4,
    /// The communicator was aborted (or a queued call panicked).
    oxcclAborted = 5,
    /// Another rank failed and said so.
    oxcclRemoteError = 6,
    /// The system failed: sockets, shared memory, rendezvous.
    oxcclSystemError = 7,
    /// A bug in oxccl.
    oxcclInternalError = 8,
    /// Queued work is still running (`oxcclWorkTest` only reports it through `done`).
    oxcclInProgress = 9,
}

use oxcclResult_t::*;

/// A failure on its way to C: the code and the text for `oxcclGetLastError`.
#[derive(Clone, Debug)]
pub struct CError {
    /// The code returned.
    pub code: oxcclResult_t,
    /// The message.
    pub msg: String,
}

impl CError {
    /// A failure of `code` with message `msg`.
    pub fn new(code: oxcclResult_t, msg: impl Into<String>) -> Self {
        CError {
            code,
            msg: msg.into(),
        }
    }

    /// An invalid-argument failure.
    pub fn invalid(msg: impl Into<String>) -> Self {
        Self::new(oxcclInvalidArgument, msg)
    }
}

/// The code of an oxccl error.
pub fn code_of(e: &Error) -> oxcclResult_t {
    match e {
        Error::InvalidArgument { .. } | Error::Env(_) => oxcclInvalidArgument,
        Error::Timeout { .. } => oxcclTimeout,
        Error::PeerLost { .. } | Error::Connect { .. } => oxcclPeerLost,
        Error::Mismatch { .. } => oxcclMismatch,
        Error::Aborted { .. } => oxcclAborted,
        Error::Remote { .. } => oxcclRemoteError,
        _ => oxcclSystemError,
    }
}

impl From<Error> for CError {
    fn from(e: Error) -> Self {
        CError::new(code_of(&e), format!("oxccl: {e}"))
    }
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Sets this thread's last error text.
pub fn set_last_error(msg: &str) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|l| *l.borrow_mut() = c);
}

/// Runs `f` as the body of a C function: its error becomes the code and this thread's last
/// error, a panic `oxcclInternalError`.
pub fn guard(f: impl FnOnce() -> Result<(), CError>) -> oxcclResult_t {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => oxcclSuccess,
        Ok(Err(e)) => {
            set_last_error(&e.msg);
            e.code
        }
        Err(p) => {
            let what = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            set_last_error(&format!("oxccl: internal error (a panic): {what}"));
            oxcclInternalError
        }
    }
}

/// `oxcclGetLastError`: the text of the last failure on this thread (empty if none); valid
/// until the next oxccl call on this thread.
#[no_mangle]
pub extern "C" fn oxcclGetLastError() -> *const c_char {
    LAST_ERROR.with(|l| l.borrow().as_ptr())
}

/// `oxcclGetErrorString`: a static name for a result code.
#[no_mangle]
pub extern "C" fn oxcclGetErrorString(code: oxcclResult_t) -> *const c_char {
    let s: &'static std::ffi::CStr = match code as i32 {
        0 => c"success",
        1 => c"invalid argument",
        2 => c"timeout",
        3 => c"peer lost",
        4 => c"mismatch between ranks",
        5 => c"aborted",
        6 => c"remote error",
        7 => c"system error",
        8 => c"internal error",
        9 => c"in progress",
        _ => c"unknown result code",
    };
    s.as_ptr()
}
