//! Single-copy collectives for large messages between the ranks of one host: every rank
//! publishes the addresses of its buffers and moves what it needs straight between its own
//! memory and its peers' with `process_vm_readv` / `process_vm_writev` (cross-memory attach, as
//! Open MPI's CMA path), instead of streaming everything through shared-memory rings (two
//! copies).
//!
//! - all_reduce: rank `r` owns block `r`. For each chunk of it, it reads the chunk of every
//!   rank's input (in rank order, so that every element is combined the same way whoever owns
//!   it: identical bits on every rank) into cache-resident buffers, folds them, and writes the
//!   result straight into every rank's output. One pass over memory: per rank `S` read and `S`
//!   written whatever the rank count (a reduce-scatter followed by an all-gather reads and
//!   writes the owned blocks twice). Two events.
//! - reduce_scatter: the same with the result written to the owner's output only.
//! - reduce: the same with the result written to the root's output only, so every rank
//!   reduces `1/n` of the data in parallel.
//! - all_gather, all_to_all: each rank reads its peers' inputs into its output, two events.
//! - broadcast: every rank reads the root's input while the root writes part of each peer's
//!   output itself: block `p` into peer `p` when it is in place (it has nothing of its own to
//!   copy), the last `1/(2n)` when it also copies its input to its output. Two events.
//!
//! Only the owner of a block touches that block of any buffer in a call, so a rank's in-place
//! buffer is read before it is overwritten, by the same rank. The last event of each call tells
//! every rank that nobody reads or writes its buffers any more, so it may return.

use crate::algo::{block, Coll, CollKind};
use crate::error::Result;
use crate::exec::Buffers;
use crate::exec_direct::DirectCtx;
use crate::op::ReduceOp;
use crate::reduce;

/// Bytes reduced at a time (the temporary stays in the core's cache).
const CHUNK: usize = 256 << 10;

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
    // The first event carries the call's header: every rank checks that its peers called the
    // same collective on the same count before touching their memory.
    let e1 = cx.begin(
        &[],
        [inp as u64, outp as u64, in_len as u64, out_len as u64],
    )?;
    let addrs: Vec<[u64; 6]> = (0..n).map(|p| cx.direct.peer_addrs(p, e1)).collect();
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
    let write = |cx: &DirectCtx<'_>, p: usize, addr: u64, src: &[u8]| -> Result<()> {
        cx.direct
            .write_peer(p, addr, src)
            .map_err(|e| cx.write_error(p, e))
    };
    // The whole output, for the cases where no peer writes into it (the reductions build no
    // such reference: there peers write parts of a rank's output).
    let whole_out = || {
        // SAFETY: the output is valid for out_len bytes for the whole call; in these cases no
        // peer touches it, and this rank reads its own input through `read_own` (never through
        // a reference overlapping `out`).
        unsafe { std::slice::from_raw_parts_mut(outp, out_len) }
    };
    let bytes = c.count * es;
    match c.kind {
        CollKind::AllReduce | CollKind::ReduceScatter | CollKind::Reduce => {
            // This rank's block: where it starts in the inputs, its length, and where its
            // result goes: (rank, address) pairs, this rank's own output included.
            let (start, len, dests): (usize, usize, Vec<(usize, u64)>) = match c.kind {
                CollKind::ReduceScatter => (me * bytes, bytes, vec![(me, outp as u64)]),
                _ => {
                    let (s, l) = block(c.count, n, me);
                    let (s, l) = (s * es, l * es);
                    let dests = if c.kind == CollKind::AllReduce {
                        (0..n).map(|p| (p, addrs[p][1] + s as u64)).collect()
                    } else {
                        vec![(c.root, addrs[c.root][1] + s as u64)]
                    };
                    (s, l, dests)
                }
            };
            let words = (3 * CHUNK).div_ceil(8);
            if tmp.len() < words {
                tmp.resize(words, 0);
            }
            let (acc, rest) =
                bytemuck::cast_slice_mut::<u64, u8>(tmp)[..3 * CHUNK].split_at_mut(CHUNK);
            let (ta, tb) = rest.split_at_mut(CHUNK);
            let chunk = CHUNK / es * es;
            let mut off = 0;
            while off < len {
                let k = chunk.min(len - off);
                let at = start + off;
                // SAFETY: `at + k <= in_len`; the input stays valid and, in this phase, only
                // this rank writes this block of it (after the last use of `own`).
                let own = unsafe { std::slice::from_raw_parts(inp.add(at), k) };
                let acc = &mut acc[..k];
                // Rank order: acc = ((x0 ⊕ x1) ⊕ x2) ...
                if n == 1 {
                    acc.copy_from_slice(own);
                } else {
                    let x0: &[u8] = if me == 0 {
                        own
                    } else {
                        read(cx, 0, addrs[0][0] + at as u64, &mut ta[..k])?;
                        &ta[..k]
                    };
                    #[allow(clippy::needless_range_loop)]
                    // p is a rank, used for more than indexing
                    for p in 1..n {
                        let xp: &[u8] = if p == me {
                            own
                        } else {
                            read(cx, p, addrs[p][0] + at as u64, &mut tb[..k])?;
                            &tb[..k]
                        };
                        if p == 1 {
                            reduce::reduce_into(c.dtype, c.op, acc, x0, xp);
                        } else {
                            reduce::reduce_inplace(c.dtype, c.op, acc, xp);
                        }
                    }
                }
                if c.op == ReduceOp::Avg {
                    reduce::divide_by(c.dtype, acc, n);
                }
                for &(p, addr) in &dests {
                    let to = addr + off as u64;
                    if p == me {
                        // SAFETY: `to` is this rank's output at an offset of at most
                        // `out_len - k` (its block, or all of it for reduce_scatter); `acc` is
                        // a separate buffer, and `own` is not used past this point.
                        unsafe {
                            std::ptr::copy_nonoverlapping(acc.as_ptr(), to as usize as *mut u8, k)
                        };
                    } else {
                        write(cx, p, to, acc)?;
                    }
                }
                off += k;
            }
        }
        CollKind::AllGather => {
            let out = whole_out();
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
            let out = whole_out();
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
            // The root shares the copying: it writes part of each peer's output itself while
            // the peers read the rest (every rank learns from the root's addresses whether it
            // is in place, so they agree on the parts). In place, the root has nothing of its
            // own to copy and writes block p into each peer p. Out of place it must also copy
            // its input to its output, at memcpy speed, about twice the kernel's
            // cross-process copy here: it writes the last 1/(2n) of every peer's output.
            let root = c.root;
            let in_place = addrs[root][0] == addrs[root][1];
            let root_part = |p: usize| {
                let (s, l) = if in_place {
                    block(c.count, n, p)
                } else {
                    let k = c.count / (2 * n);
                    (c.count - k, k)
                };
                (s * es, l * es)
            };
            if me == root {
                for p in (0..n).filter(|&p| p != root) {
                    let (s, l) = root_part(p);
                    // SAFETY: `s + l <= bytes`, within the root's input, which nobody writes in
                    // this call.
                    let src = unsafe { std::slice::from_raw_parts(inp.add(s), l) };
                    write(cx, p, addrs[p][1] + s as u64, src)?;
                }
                if !in_place {
                    read_own(0, &mut whole_out()[..bytes]);
                }
            } else {
                let (s, l) = root_part(me);
                for (from, to) in [(0, s), (s + l, bytes)] {
                    if to > from {
                        // SAFETY: within the output (`to <= bytes <= out_len`); while the root
                        // writes `s..s + l` of it, this rank touches only the other bytes,
                        // through separate slices built here.
                        let dst =
                            unsafe { std::slice::from_raw_parts_mut(outp.add(from), to - from) };
                        read(cx, root, addrs[root][0] + from as u64, dst)?;
                    }
                }
            }
        }
        _ => unreachable!("cma::run called for {}", c.kind.name()),
    }
    let done = cx.publish(&[], [0; 4]);
    cx.wait_all(done)
}
