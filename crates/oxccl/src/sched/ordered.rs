//! Rank-ordered reductions, for bitwise reproducibility (`OXCCL_DETERMINISTIC=1`): all_reduce,
//! reduce_scatter and reduce whose floating-point results are the same bits on every rank,
//! from run to run, and equal to those of the other rank-ordered algorithms (one-shot,
//! single-copy), whatever the number of ranks per host.
//!
//! The buffer is split into `n` blocks (`n` × `count` for reduce_scatter). Rank `r` owns block
//! `r`: it copies its own contribution aside, then in steps `s = 1 .. n-1` sends its block
//! `r+s` to rank `r+s` while receiving rank `r-s`'s block `r` into scratch slot `r-s`. Then it
//! folds the `n` contributions in rank order, `((x0 ⊕ x1) ⊕ x2) ...`, into its result. So far
//! `(n-1)/n · S` sent (as a ring reduce-scatter), with `n · S/n` scratch. Then:
//! - all_reduce: the ring all-gather of the blocks (`(n-1)/n · S` more);
//! - reduce: every rank sends its block to the root (`S/n` each);
//! - reduce_scatter: nothing more.

use super::{
    block, sub_mod, Buf, BufRange, Coll, CollKind, Combine, Local, ReduceOp, Schedule, Xfer,
};

/// The rank-ordered schedule for `c` (all_reduce, reduce_scatter or reduce).
pub(crate) fn schedule(c: &Coll) -> Schedule {
    let (n, r, es) = (c.nranks, c.rank, c.dtype.size());
    // Input block i: (byte offset, byte length).
    let blk = |i: usize| -> (usize, usize) {
        if c.kind == CollKind::ReduceScatter {
            (i * c.count * es, c.count * es)
        } else {
            let (s, l) = block(c.count, n, i);
            (s * es, l * es)
        }
    };
    let input = |i: usize| BufRange::new(Buf::Input, blk(i).0, blk(i).1);
    let slot_len = blk(0).1; // block 0 is the largest
    let slot = |p: usize, len: usize| BufRange::new(Buf::Scratch, p * slot_len, len);
    let my_len = blk(r).1;
    // Where this rank's fully reduced block goes.
    let result = match c.kind {
        CollKind::AllReduce => BufRange::new(Buf::Output, blk(r).0, my_len),
        CollKind::ReduceScatter => BufRange::new(Buf::Output, 0, my_len),
        _ if r == c.root => BufRange::new(Buf::Output, blk(r).0, my_len),
        _ => slot(n, my_len),
    };
    let mut s = Schedule::new("ordered");
    s.scratch_bytes = (n + 1) * slot_len;
    // Own contribution aside first: the result may alias the input (in place).
    s.push_local(Local::Copy {
        src: input(r),
        dst: slot(r, my_len),
    });
    for step in 1..n {
        let to = (r + step) % n;
        let from = sub_mod(r, step, n);
        s.push_xfers([
            Xfer::Send {
                peer: to,
                src: input(to),
            },
            Xfer::Recv {
                peer: from,
                dst: slot(from, my_len),
                combine: Combine::Store,
            },
        ]);
    }
    s.push_local(Local::Copy {
        src: slot(0, my_len),
        dst: result,
    });
    for p in 1..n {
        s.push_local(Local::Reduce {
            dst: result,
            src: slot(p, my_len),
        });
    }
    if c.op == ReduceOp::Avg {
        s.push_local(Local::DivideByRanks(result));
    }
    let out = |i: usize| BufRange::new(Buf::Output, blk(i).0, blk(i).1);
    match c.kind {
        CollKind::AllReduce => {
            let (left, right) = ((r + n - 1) % n, (r + 1) % n);
            for step in 0..n.saturating_sub(1) {
                s.push_xfers([
                    Xfer::Send {
                        peer: right,
                        src: out(sub_mod(r, step, n)),
                    },
                    Xfer::Recv {
                        peer: left,
                        dst: out(sub_mod(r, step + 1, n)),
                        combine: Combine::Store,
                    },
                ]);
            }
        }
        CollKind::Reduce if r == c.root => {
            s.push_xfers((0..n).filter(|&p| p != r).map(|p| Xfer::Recv {
                peer: p,
                dst: out(p),
                combine: Combine::Store,
            }));
        }
        CollKind::Reduce => s.push_xfers([Xfer::Send {
            peer: c.root,
            src: result,
        }]),
        _ => {}
    }
    s
}
