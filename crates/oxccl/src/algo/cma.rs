//! Single-copy collectives for large messages between the ranks of one host: every rank
//! publishes the addresses of its buffers and copies what it needs straight out of its peers'
//! memory with `process_vm_readv` (cross-memory attach, as Open MPI's CMA path), instead of
//! streaming everything through shared-memory rings (two copies).
//!
//! - all_reduce: rank `r` reduces block `r` — for each 64 KiB chunk it reads the chunk of every
//!   rank in rank order into a cache-resident buffer and folds it into its output (so all
//!   ranks get identical bits) — then, once every rank has reduced its block, reads the other
//!   blocks from their owners' outputs. Per rank: `(n-1)/n · S` read for the reduction plus
//!   `(n-1)/n · S` for the gather, three events.
//! - reduce_scatter: the first half of all_reduce, two events.
//! - all_gather, all_to_all: each rank reads its peers' inputs into its output, two events.
//! - broadcast: every rank reads the root's input, two events.
//!
//! The last event of each call tells every rank that nobody reads its buffers any more, so it
//! may return.

use crate::algo::{block, Coll, CollKind};
use crate::error::Result;
use crate::exec::Buffers;
use crate::exec_direct::DirectCtx;
use crate::op::ReduceOp;
use crate::reduce;

/// Bytes reduced at a time (the temporary stays in the core's cache).
const CHUNK: usize = 64 << 10;

/// Whether this module implements `kind`.
pub fn supports(kind: CollKind) -> bool {
    matches!(
        kind,
        CollKind::AllReduce
            | CollKind::ReduceScatter
            | CollKind::AllGather
            | CollKind::AllToAll
            | CollKind::Broadcast
    )
}

/// Runs `c` single-copy. `tmp` is reused across calls.
pub fn run(
    cx: &mut DirectCtx<'_>,
    c: &Coll,
    bufs: &mut Buffers<'_>,
    tmp: &mut Vec<u64>,
) -> Result<()> {
    let (n, me, es) = (c.nranks, c.rank, c.dtype.size());
    let (inp, in_len) = bufs.input_raw();
    let (outp, out_len) = bufs.output_raw();
    let e1 = cx.publish(
        &[],
        [inp as u64, outp as u64, in_len as u64, out_len as u64],
    );
    cx.wait_all(e1)?;
    let addrs: Vec<[u64; 6]> = (0..n).map(|p| cx.direct.peer_addrs(p, e1)).collect();
    // SAFETY: the output is valid for out_len bytes for the whole call; this rank writes only
    // the parts that no peer reads in the current phase (see each case), and reads its own
    // input through `read_own` (never through a reference overlapping `out`).
    let out = unsafe { std::slice::from_raw_parts_mut(outp, out_len) };
    let read_own = |off: usize, dst: &mut [u8]| {
        // SAFETY: `off + dst.len() <= in_len` (callers stay within the input) and `dst` is a
        // separate buffer or the very same bytes (copy allows overlap).
        unsafe { std::ptr::copy(inp.add(off), dst.as_mut_ptr(), dst.len()) }
    };
    let read = |cx: &DirectCtx<'_>, p: usize, addr: u64, dst: &mut [u8]| -> Result<()> {
        cx.direct
            .read_peer(p, addr, dst)
            .map_err(|e| cx.read_error(p, e))
    };
    let bytes = c.count * es;
    match c.kind {
        CollKind::AllReduce | CollKind::ReduceScatter => {
            let (start, len, out_off) = if c.kind == CollKind::AllReduce {
                let (s, l) = block(c.count, n, me);
                (s * es, l * es, s * es)
            } else {
                (me * bytes, bytes, 0)
            };
            // In place, this rank's own chunk is overwritten by rank 0's before it is folded
            // in: save it first (rank order must not change, for identical bits everywhere).
            let alias =
                (inp as usize) < outp as usize + out_len && (outp as usize) < inp as usize + in_len;
            let words = (2 * CHUNK).div_ceil(8);
            if tmp.len() < words {
                tmp.resize(words, 0);
            }
            let (tmp, own) =
                bytemuck::cast_slice_mut::<u64, u8>(tmp)[..2 * CHUNK].split_at_mut(CHUNK);
            let chunk = CHUNK / es * es;
            let mut off = 0;
            while off < len {
                let k = chunk.min(len - off);
                let at = start + off;
                let saved = alias && me != 0;
                if saved {
                    read_own(at, &mut own[..k]);
                }
                let dst = &mut out[out_off + off..out_off + off + k];
                #[allow(clippy::needless_range_loop)] // p is a rank, used for more than indexing
                for p in 0..n {
                    let t: &mut [u8] = if p == 0 { &mut *dst } else { &mut tmp[..k] };
                    if p == me && saved {
                        t.copy_from_slice(&own[..k]);
                    } else if p == me {
                        read_own(at, t);
                    } else {
                        read(cx, p, addrs[p][0] + at as u64, t)?;
                    }
                    if p > 0 {
                        reduce::reduce_inplace(c.dtype, c.op, dst, &tmp[..k]);
                    }
                }
                off += k;
            }
            if c.op == ReduceOp::Avg {
                reduce::divide_by(c.dtype, &mut out[out_off..out_off + len], n);
            }
            if c.kind == CollKind::AllReduce {
                let e2 = cx.publish(&[], [0; 4]);
                cx.wait_all(e2)?;
                for p in (0..n).filter(|&p| p != me) {
                    let (s, l) = block(c.count, n, p);
                    read(
                        cx,
                        p,
                        addrs[p][1] + (s * es) as u64,
                        &mut out[s * es..(s + l) * es],
                    )?;
                }
            }
        }
        CollKind::AllGather => {
            for p in 0..n {
                let dst = &mut out[p * bytes..(p + 1) * bytes];
                if p == me {
                    read_own(0, dst);
                } else {
                    read(cx, p, addrs[p][0], dst)?;
                }
            }
        }
        CollKind::AllToAll => {
            for p in 0..n {
                let dst = &mut out[p * bytes..(p + 1) * bytes];
                if p == me {
                    read_own(me * bytes, dst);
                } else {
                    read(cx, p, addrs[p][0] + (me * bytes) as u64, dst)?;
                }
            }
        }
        CollKind::Broadcast => {
            if me == c.root {
                read_own(0, &mut out[..bytes]);
            } else {
                read(cx, c.root, addrs[c.root][0], &mut out[..bytes])?;
            }
        }
        _ => unreachable!("cma::run called for {}", c.kind.name()),
    }
    let done = cx.publish(&[], [0; 4]);
    cx.wait_all(done)
}
