//! Communicators and collectives on raw pointers.
//!
//! Counts are in elements of the call's data type, as in NCCL. A call is in place when the
//! pointers say so, as in NCCL: `sendbuff == recvbuff` (all-reduce, broadcast, reduce,
//! all-to-all), `sendbuff == recvbuff + rank * sendcount` (all-gather), `recvbuff ==
//! sendbuff + rank * recvcount` (reduce-scatter). Between `oxcclGroupStart` and
//! `oxcclGroupEnd` a call is queued instead of run (see [`crate::group`]).

use std::ffi::{c_char, c_int, CStr};
use std::str::FromStr;
use std::sync::Arc;

use oxccl::{CollKind, Communicator, DataType, RawBufs, ReduceOp, UniqueId};

use crate::group;
use crate::result::{guard, oxcclResult_t, CError};
use crate::types::{dtype, op, oxcclDataType_t, oxcclRedOp_t};

/// A communicator handle (`oxcclComm_t` points to one). Several handles may share one
/// communicator (the Python module hands out handles to its own communicators); the
/// communicator goes away with its last handle or Python object.
pub struct oxcclComm {
    pub(crate) comm: Arc<Communicator>,
}

/// A new C handle of `comm`, for `oxcclCommDestroy` to free.
pub fn comm_into_handle(comm: Arc<Communicator>) -> *mut oxcclComm {
    Box::into_raw(Box::new(oxcclComm { comm }))
}

/// Size of `oxcclUniqueId` (a NUL-terminated string).
pub const UNIQUE_ID_BYTES: usize = 128;

/// `oxcclUniqueId`: the rendezvous id, as its string form.
#[repr(C)]
pub struct oxcclUniqueId {
    /// The id's string form, NUL-terminated.
    pub internal: [c_char; UNIQUE_ID_BYTES],
}

pub(crate) fn handle<'a>(comm: *const oxcclComm) -> Result<&'a oxcclComm, CError> {
    // SAFETY: a non-null handle comes from comm_into_handle and is alive until
    // oxcclCommDestroy (the caller's obligation, as with any C handle).
    unsafe { comm.as_ref() }.ok_or_else(|| CError::invalid("oxccl: the communicator is NULL"))
}

fn out<'a, T>(p: *mut T, what: &str) -> Result<&'a mut T, CError> {
    // SAFETY: a non-null output pointer points to writable memory (the caller's obligation).
    unsafe { p.as_mut() }.ok_or_else(|| CError::invalid(format!("oxccl: {what} is NULL")))
}

/// `oxcclGetUniqueId`: a fresh id; this process must then be rank 0 of the communicator.
#[no_mangle]
pub extern "C" fn oxcclGetUniqueId(id: *mut oxcclUniqueId) -> oxcclResult_t {
    guard(|| {
        let id = out(id, "the id")?;
        let s = UniqueId::new()?.to_string();
        if s.len() >= UNIQUE_ID_BYTES {
            return Err(CError::invalid(format!(
                "oxccl: unique id '{s}' is too long"
            )));
        }
        id.internal = [0; UNIQUE_ID_BYTES];
        for (d, b) in id.internal.iter_mut().zip(s.bytes()) {
            *d = b as c_char;
        }
        Ok(())
    })
}

fn boxed(
    comm: *mut *mut oxcclComm,
    make: impl FnOnce() -> oxccl::Result<Communicator>,
) -> oxcclResult_t {
    guard(|| {
        let slot = out(comm, "the communicator pointer")?;
        *slot = comm_into_handle(Arc::new(make()?));
        Ok(())
    })
}

/// `oxcclCommInitRank`: joins the communicator of `id` as `rank` of `nranks` (settings from
/// the environment, as `oxccl::Communicator::init`).
#[no_mangle]
pub extern "C" fn oxcclCommInitRank(
    comm: *mut *mut oxcclComm,
    nranks: c_int,
    id: *const oxcclUniqueId,
    rank: c_int,
) -> oxcclResult_t {
    let parsed = (|| {
        // SAFETY: a non-null id points to an oxcclUniqueId (the caller's obligation).
        let id = unsafe { id.as_ref() }.ok_or_else(|| CError::invalid("oxccl: the id is NULL"))?;
        if !id.internal.contains(&0) {
            return Err(CError::invalid("oxccl: the id is not NUL-terminated"));
        }
        // SAFETY: NUL-terminated within the array (checked above).
        let s = unsafe { CStr::from_ptr(id.internal.as_ptr()) };
        let s = s
            .to_str()
            .map_err(|_| CError::invalid("oxccl: the id is not UTF-8"))?;
        let rank = usize::try_from(rank)
            .map_err(|_| CError::invalid(format!("oxccl: rank {rank} is negative")))?;
        let n = usize::try_from(nranks)
            .map_err(|_| CError::invalid(format!("oxccl: nranks {nranks} is negative")))?;
        Ok((UniqueId::from_str(s)?, rank, n))
    })();
    match parsed {
        Ok((id, rank, n)) => boxed(comm, || Communicator::init(&id, rank, n)),
        Err(e) => guard(|| Err(e)),
    }
}

/// `oxcclCommInitFromEnv`: joins the communicator a launcher (torchrun, `oxccl run`, Slurm,
/// Open MPI, PMI) describes in the environment.
#[no_mangle]
pub extern "C" fn oxcclCommInitFromEnv(comm: *mut *mut oxcclComm) -> oxcclResult_t {
    boxed(comm, Communicator::from_env)
}

/// `oxcclCommDestroy`: frees the handle (the communicator goes away with its last handle;
/// queued calls still finish). NULL is a no-op.
#[no_mangle]
pub extern "C" fn oxcclCommDestroy(comm: *mut oxcclComm) -> oxcclResult_t {
    guard(|| {
        if !comm.is_null() {
            // SAFETY: from comm_into_handle, destroyed once (the caller's obligation).
            drop(unsafe { Box::from_raw(comm) });
        }
        Ok(())
    })
}

/// `oxcclCommCount`: the number of ranks.
#[no_mangle]
pub extern "C" fn oxcclCommCount(comm: *const oxcclComm, count: *mut c_int) -> oxcclResult_t {
    guard(|| {
        *out(count, "count")? = handle(comm)?.comm.world_size() as c_int;
        Ok(())
    })
}

/// `oxcclCommUserRank`: this process's rank.
#[no_mangle]
pub extern "C" fn oxcclCommUserRank(comm: *const oxcclComm, rank: *mut c_int) -> oxcclResult_t {
    guard(|| {
        *out(rank, "rank")? = handle(comm)?.comm.rank() as c_int;
        Ok(())
    })
}

/// `oxcclCommTimeout`: the communicator's timeout (each call's bound), in seconds.
#[no_mangle]
pub extern "C" fn oxcclCommTimeout(comm: *const oxcclComm, seconds: *mut f64) -> oxcclResult_t {
    guard(|| {
        *out(seconds, "seconds")? = handle(comm)?.comm.timeout().as_secs_f64();
        Ok(())
    })
}

/// `oxcclCommSetTimeout`: sets the communicator's timeout (each later call's bound), in
/// seconds, instead of `OXCCL_TIMEOUT`; it holds for every handle of the communicator.
#[no_mangle]
pub extern "C" fn oxcclCommSetTimeout(comm: *const oxcclComm, seconds: f64) -> oxcclResult_t {
    guard(|| {
        let c = &handle(comm)?.comm;
        // The bounds OXCCL_TIMEOUT is held to.
        let (min, max) = (oxccl::params::MIN_SECS, oxccl::params::MAX_SECS);
        if !(min..=max).contains(&seconds) {
            return Err(CError::invalid(format!(
                "rank {}: oxcclCommSetTimeout: the timeout {seconds} s is not a number of \
                 seconds from {min} to {max}",
                c.rank()
            )));
        }
        c.set_timeout(std::time::Duration::from_secs_f64(seconds));
        Ok(())
    })
}

/// One call of a group, ready to run now or later: a collective, or a point-to-point group.
pub(crate) enum Call {
    /// A collective on raw buffers.
    Coll(Coll),
    /// Sends and receives ([`crate::p2p`]).
    P2p(crate::p2p::P2p),
}

impl Call {
    /// Runs the call.
    ///
    /// # Safety
    ///
    /// Its buffers must be valid for the call (see [`RawBufs::as_byte_bufs`] and
    /// [`crate::p2p::P2p::run`]).
    pub(crate) unsafe fn run(self, comm: &Communicator) -> oxccl::Result<()> {
        match self {
            // SAFETY: forwarded from the caller.
            Call::Coll(c) => unsafe { c.run(comm) },
            // SAFETY: forwarded from the caller.
            Call::P2p(p) => unsafe { p.run(comm) },
        }
    }
}

/// One collective on raw buffers.
pub(crate) struct Coll {
    pub(crate) kind: CollKind,
    pub(crate) dtype: DataType,
    pub(crate) op: ReduceOp,
    pub(crate) root: usize,
    pub(crate) bufs: RawBufs,
}

impl Coll {
    /// Runs the call.
    ///
    /// # Safety
    ///
    /// The buffers must be valid for the call (see [`RawBufs::as_byte_bufs`]).
    pub(crate) unsafe fn run(self, comm: &Communicator) -> oxccl::Result<()> {
        // SAFETY: forwarded from the caller.
        let bufs = unsafe { self.bufs.as_byte_bufs() };
        comm.call_bytes(self.kind, self.dtype, self.op, self.root, bufs)
    }
}

/// The byte length of `count` elements of `dt`.
fn bytes(count: usize, dt: DataType) -> Result<usize, CError> {
    count
        .checked_mul(dt.size())
        .ok_or_else(|| CError::invalid(format!("oxccl: {count} elements of {dt} overflow")))
}

/// Runs `kind` now, or queues it in this thread's open group. `in_place`: one buffer at
/// `inplace_base` of `recv_len` bytes (the larger side).
#[allow(clippy::too_many_arguments)]
fn collective(
    comm: *const oxcclComm,
    kind: CollKind,
    dt: oxcclDataType_t,
    rop: oxcclRedOp_t,
    root: c_int,
    send: (*const u8, usize),
    recv: (*mut u8, usize),
    in_place: Option<(*mut u8, usize)>,
) -> oxcclResult_t {
    guard(|| {
        let h = handle(comm)?;
        let root = usize::try_from(root)
            .map_err(|_| CError::invalid(format!("oxccl: root {root} is negative")))?;
        check_buffers(kind, h.comm.rank() == root, send, recv, in_place)?;
        let bufs = match in_place {
            Some((buf, len)) => RawBufs::InPlace { buf, len },
            None => RawBufs::Separate {
                send: send.0,
                send_len: send.1,
                recv: recv.0,
                recv_len: recv.1,
            },
        };
        let call = Call::Coll(Coll {
            kind,
            dtype: dtype(dt)?,
            op: op(rop)?,
            root,
            bufs,
        });
        match group::record(&h.comm, call)? {
            None => Ok(()),
            // SAFETY: a blocking call: the C caller's buffers are valid for its duration.
            Some(call) => unsafe { call.run(&h.comm) }.map_err(CError::from),
        }
    })
}

/// A NULL buffer with a length, or a length no buffer can have (over `isize::MAX` bytes): an
/// error before any data moves. (`RawBufs::as_byte_bufs` reads a NULL buffer as empty, so
/// such a call would run on nothing and report success.) As in NCCL, a broadcast's send
/// buffer and a reduce's receive buffer may be NULL on ranks other than the root.
fn check_buffers(
    kind: CollKind,
    is_root: bool,
    send: (*const u8, usize),
    recv: (*mut u8, usize),
    in_place: Option<(*mut u8, usize)>,
) -> Result<(), CError> {
    let name = kind.name();
    let check = |what: &str, null: bool, len: usize, read: bool| {
        if len > isize::MAX as usize {
            return Err(CError::invalid(format!(
                "oxccl: {name}: the {what} buffer of {len} bytes is larger than any buffer can be"
            )));
        }
        if read && null && len > 0 {
            return Err(CError::invalid(format!(
                "oxccl: {name}: the {what} buffer is NULL but the call has {len} bytes for it"
            )));
        }
        Ok(())
    };
    match in_place {
        Some((buf, len)) => check("in-place", buf.is_null(), len, true),
        None => {
            let send_read = kind != CollKind::Broadcast || is_root;
            let recv_written = kind != CollKind::Reduce || is_root;
            check("send", send.0.is_null(), send.1, send_read)?;
            check("receive", recv.0.is_null(), recv.1, recv_written)
        }
    }
}

/// A reduction op for calls without one (their op is ignored).
const SUM: oxcclRedOp_t = 0;

/// `oxcclAllReduce`: every rank gets the reduction of every rank's `count` elements.
#[no_mangle]
pub extern "C" fn oxcclAllReduce(
    sendbuff: *const u8,
    recvbuff: *mut u8,
    count: usize,
    datatype: oxcclDataType_t,
    op: oxcclRedOp_t,
    comm: *const oxcclComm,
) -> oxcclResult_t {
    same_size(
        CollKind::AllReduce,
        sendbuff,
        recvbuff,
        count,
        datatype,
        op,
        0,
        comm,
    )
}

/// `oxcclBroadcast`: every rank gets the root's `count` elements (`sendbuff` is read on the
/// root only).
#[no_mangle]
pub extern "C" fn oxcclBroadcast(
    sendbuff: *const u8,
    recvbuff: *mut u8,
    count: usize,
    datatype: oxcclDataType_t,
    root: c_int,
    comm: *const oxcclComm,
) -> oxcclResult_t {
    same_size(
        CollKind::Broadcast,
        sendbuff,
        recvbuff,
        count,
        datatype,
        SUM,
        root,
        comm,
    )
}

/// `oxcclReduce`: the root gets the reduction of every rank's `count` elements.
#[no_mangle]
pub extern "C" fn oxcclReduce(
    sendbuff: *const u8,
    recvbuff: *mut u8,
    count: usize,
    datatype: oxcclDataType_t,
    op: oxcclRedOp_t,
    root: c_int,
    comm: *const oxcclComm,
) -> oxcclResult_t {
    same_size(
        CollKind::Reduce,
        sendbuff,
        recvbuff,
        count,
        datatype,
        op,
        root,
        comm,
    )
}

/// `oxcclAllToAll`: block p (of `count` elements) of this rank's input goes to rank p, which
/// stores it as block r of its output.
#[no_mangle]
pub extern "C" fn oxcclAllToAll(
    sendbuff: *const u8,
    recvbuff: *mut u8,
    count: usize,
    datatype: oxcclDataType_t,
    comm: *const oxcclComm,
) -> oxcclResult_t {
    let total = match handle(comm) {
        Ok(h) => count.saturating_mul(h.comm.world_size()),
        Err(e) => return guard(|| Err(e)),
    };
    same_size(
        CollKind::AllToAll,
        sendbuff,
        recvbuff,
        total,
        datatype,
        SUM,
        0,
        comm,
    )
}

/// Calls whose input and output have one length.
#[allow(clippy::too_many_arguments)]
fn same_size(
    kind: CollKind,
    sendbuff: *const u8,
    recvbuff: *mut u8,
    count: usize,
    dt: oxcclDataType_t,
    rop: oxcclRedOp_t,
    root: c_int,
    comm: *const oxcclComm,
) -> oxcclResult_t {
    let len = match dtype(dt).and_then(|d| bytes(count, d)) {
        Ok(l) => l,
        Err(e) => return guard(|| Err(e)),
    };
    let in_place = std::ptr::eq(sendbuff, recvbuff).then_some((recvbuff, len));
    collective(
        comm,
        kind,
        dt,
        rop,
        root,
        (sendbuff, len),
        (recvbuff, len),
        in_place,
    )
}

/// `oxcclAllGather`: every rank gets every rank's `sendcount` elements, in rank order.
#[no_mangle]
pub extern "C" fn oxcclAllGather(
    sendbuff: *const u8,
    recvbuff: *mut u8,
    sendcount: usize,
    datatype: oxcclDataType_t,
    comm: *const oxcclComm,
) -> oxcclResult_t {
    blocked(
        CollKind::AllGather,
        sendbuff,
        recvbuff,
        sendcount,
        datatype,
        SUM,
        comm,
    )
}

/// `oxcclReduceScatter`: rank r gets block r (of `recvcount` elements) of the reduction of
/// every rank's input.
#[no_mangle]
pub extern "C" fn oxcclReduceScatter(
    sendbuff: *const u8,
    recvbuff: *mut u8,
    recvcount: usize,
    datatype: oxcclDataType_t,
    op: oxcclRedOp_t,
    comm: *const oxcclComm,
) -> oxcclResult_t {
    blocked(
        CollKind::ReduceScatter,
        sendbuff,
        recvbuff,
        recvcount,
        datatype,
        op,
        comm,
    )
}

/// All-gather and reduce-scatter: one side is `world_size` blocks of `count` elements.
fn blocked(
    kind: CollKind,
    sendbuff: *const u8,
    recvbuff: *mut u8,
    count: usize,
    dt: oxcclDataType_t,
    rop: oxcclRedOp_t,
    comm: *const oxcclComm,
) -> oxcclResult_t {
    let sizes = handle(comm).and_then(|h| {
        let block = bytes(count, dtype(dt)?)?;
        let whole = block
            .checked_mul(h.comm.world_size())
            .ok_or_else(|| CError::invalid("oxccl: buffer size overflows"))?;
        Ok((block, whole, h.comm.rank()))
    });
    let (block, whole, rank) = match sizes {
        Ok(s) => s,
        Err(e) => return guard(|| Err(e)),
    };
    let mine = block * rank;
    let (send_len, recv_len, in_place) = if kind == CollKind::AllGather {
        let ip = (sendbuff as usize == (recvbuff as usize).wrapping_add(mine))
            .then_some((recvbuff, whole));
        (block, whole, ip)
    } else {
        let ip = (recvbuff as usize == (sendbuff as usize).wrapping_add(mine))
            .then_some((sendbuff as *mut u8, whole));
        (whole, block, ip)
    };
    collective(
        comm,
        kind,
        dt,
        rop,
        0,
        (sendbuff, send_len),
        (recvbuff, recv_len),
        in_place,
    )
}

/// `oxcclBarrier`: returns once every rank has called it.
#[no_mangle]
pub extern "C" fn oxcclBarrier(comm: *const oxcclComm) -> oxcclResult_t {
    let null = std::ptr::null_mut();
    collective(
        comm,
        CollKind::Barrier,
        1,
        SUM,
        0,
        (null, 0),
        (null, 0),
        None,
    )
}
