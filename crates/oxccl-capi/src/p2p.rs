//! `oxcclP2p`: a group of sends and receives that progress together (tags, receives from any
//! rank), or a collective made of them (a gather, a scatter, an all-to-all with blocks of
//! different sizes): [`oxccl::Communicator::group_p2p_as`]. Between `oxcclGroupStart` and
//! `oxcclGroupEnd` it is queued as the collectives are, in order with them.

use std::ffi::{c_int, c_void};

use oxccl::{Communicator, DataType, P2pCall, P2pOp};

use crate::comm::{handle, oxcclComm, Call};
use crate::group;
use crate::result::{guard, oxcclResult_t, CError};
use crate::types::{dtype, oxcclDataType_t};

/// `oxcclP2pCall_t`: what a point-to-point group is. `oxcclP2pUser` (0): the program's own
/// messages, matched by source and tag; `oxcclP2pGather` (1), `oxcclP2pScatter` (2),
/// `oxcclP2pAllToAllv` (3): a collective of that name made of messages (tag 0, named peers
/// only), numbered as the communicator's collectives, so that its errors name it and no
/// other call's receive takes its messages.
pub type oxcclP2pCall_t = i32;

/// One operation of a point-to-point group (`oxcclP2pOp_t` in `oxccl.h`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct oxcclP2pOp {
    /// 1: send `count` elements of `buff` to `peer`; 0: receive them from `peer`.
    pub send: c_int,
    /// The other rank; -1 on a receive: from any rank (`oxcclP2pUser` only).
    pub peer: c_int,
    /// The message's tag (0 in the collectives).
    pub tag: u32,
    /// Element type.
    pub datatype: oxcclDataType_t,
    /// The buffer (may be NULL when `count` is 0).
    pub buff: *mut c_void,
    /// Elements.
    pub count: usize,
    /// Set on a receive once the group has completed: the rank the message came from
    /// (-1 on sends and until then).
    pub source: c_int,
}

/// A checked point-to-point group, its buffers as plain addresses.
pub(crate) struct P2p {
    call: P2pCall,
    /// (send, peer, tag, dtype, address, bytes)
    ops: Vec<(bool, Option<usize>, u32, DataType, usize, usize)>,
    /// Where the receives' sources go (the caller's array, valid until the call completes).
    out: *mut oxcclP2pOp,
}

impl P2p {
    /// Runs the group and writes each operation's `source`.
    ///
    /// # Safety
    ///
    /// Every buffer must be valid (receives: writable, not aliased) for the call, and `out`
    /// must point to the caller's array of `ops.len()` operations until it returns.
    pub(crate) unsafe fn run(self, comm: &Communicator) -> oxccl::Result<()> {
        let mut ops: Vec<P2pOp<'_>> = self
            .ops
            .iter()
            .map(|&(send, peer, tag, dtype, addr, len)| {
                if send {
                    P2pOp::Send {
                        peer: peer.unwrap_or(usize::MAX),
                        tag,
                        dtype,
                        buf: if len == 0 {
                            &[]
                        } else {
                            // SAFETY: the caller's buffer of `len` bytes, valid for the call.
                            unsafe { std::slice::from_raw_parts(addr as *const u8, len) }
                        },
                    }
                } else {
                    P2pOp::Recv {
                        peer,
                        tag,
                        dtype,
                        buf: if len == 0 {
                            &mut []
                        } else {
                            // SAFETY: the caller's writable, unaliased buffer of `len` bytes.
                            unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) }
                        },
                        from: None,
                    }
                }
            })
            .collect();
        let r = comm.group_p2p_as(self.call, &mut ops);
        if r.is_ok() {
            for (i, op) in ops.iter().enumerate() {
                if let P2pOp::Recv { from, .. } = op {
                    // SAFETY: `out` is the caller's array of ops.len() operations, valid until
                    // the call completes (oxcclP2p's contract).
                    unsafe { (*self.out.add(i)).source = from.map_or(-1, |p| p as c_int) };
                }
            }
        }
        r
    }
}

/// The library's call of a C value.
fn p2p_call(v: oxcclP2pCall_t) -> Result<P2pCall, CError> {
    u32::try_from(v)
        .ok()
        .and_then(P2pCall::from_code)
        .ok_or_else(|| CError::invalid(format!("oxccl: unknown point-to-point call {v}")))
}

/// `oxcclP2p`: runs the `nops` sends and receives of `ops` as one group (`call`: the program's
/// own messages, or the collective they make). Outside a group it blocks until they are done
/// and fills each receive's `source`; inside one it is queued, and `ops` and the buffers must
/// stay valid until the group's work completes (the sources are written then). Every
/// operation is checked before any data moves (`oxcclInvalidArgument`): its kind, a peer in
/// the communicator (-1 only on a user receive), the type, a non-NULL buffer for a nonzero
/// count, tag 0 in a collective.
#[no_mangle]
pub extern "C" fn oxcclP2p(
    ops: *mut oxcclP2pOp,
    nops: usize,
    call: oxcclP2pCall_t,
    comm: *const oxcclComm,
) -> oxcclResult_t {
    guard(|| {
        let h = handle(comm)?;
        let call = p2p_call(call)?;
        let name = call.name();
        let (n, me) = (h.comm.world_size(), h.comm.rank());
        if ops.is_null() && nops > 0 {
            return Err(CError::invalid(format!(
                "oxccl: rank {me}: {name}: ops is NULL but nops is {nops}"
            )));
        }
        let list: &[oxcclP2pOp] = if nops == 0 {
            &[]
        } else {
            // SAFETY: a non-null array of nops operations (the caller's obligation).
            unsafe { std::slice::from_raw_parts(ops, nops) }
        };
        let mut v = Vec::with_capacity(nops);
        for (i, op) in list.iter().enumerate() {
            let bad = |m: String| {
                CError::invalid(format!("oxccl: rank {me}: {name}: operation {i}: {m}"))
            };
            let send = match op.send {
                0 => false,
                1 => true,
                k => {
                    return Err(bad(format!(
                        "send is {k}, expected 1 (send) or 0 (receive)"
                    )))
                }
            };
            let peer = match op.peer {
                -1 if !send && !call.is_collective() => None,
                p if p >= 0 && (p as usize) < n => Some(p as usize),
                p => {
                    return Err(bad(format!(
                        "peer {p} is not a rank of this communicator of {n} (ranks 0 .. {}{})",
                        n - 1,
                        if send || call.is_collective() {
                            ""
                        } else {
                            ", or -1 for any"
                        }
                    )))
                }
            };
            if call.is_collective() && op.tag != 0 {
                return Err(bad(format!(
                    "tag {} in a collective (its messages have tag 0)",
                    op.tag
                )));
            }
            let dt = dtype(op.datatype)?;
            let len = op
                .count
                .checked_mul(dt.size())
                .filter(|&l| l <= isize::MAX as usize)
                .ok_or_else(|| {
                    bad(format!(
                        "{} elements of {dt} are more than any buffer holds",
                        op.count
                    ))
                })?;
            if op.buff.is_null() && len > 0 {
                return Err(bad(format!(
                    "the buffer is NULL but the count is {}",
                    op.count
                )));
            }
            v.push((send, peer, op.tag, dt, op.buff as usize, len));
        }
        for i in 0..nops {
            // SAFETY: i < nops in the caller's writable array (`list` is no longer used):
            // the sources are unset until the group completes.
            unsafe { (*ops.add(i)).source = -1 };
        }
        let p2p = P2p {
            call,
            ops: v,
            out: ops,
        };
        match group::record(&h.comm, Call::P2p(p2p))? {
            None => Ok(()),
            // SAFETY: a blocking call: the buffers and the array are valid for its duration.
            Some(c) => unsafe { c.run(&h.comm) }.map_err(CError::from),
        }
    })
}
