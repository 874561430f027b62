//! One-shot collectives for small messages between the ranks of one host.
//!
//! Every rank publishes its whole input in its shared slot (one event), waits until every
//! rank has published, then computes its output straight from the slots: a reduction reads
//! the slots in rank order (`((x0 ⊕ x1) ⊕ x2) ...`), so every rank gets identical bits, and
//! the same bits run after run. One synchronization instead of the ring's `2(n-1)` steps:
//! latency is one cache-line transfer plus the reads, and no system call is made unless a rank
//! has to sleep. Limited to inputs that fit a slot
//! ([`Direct::slot_bytes`](crate::direct::link::Direct::slot_bytes)).
//!
//! From `OXCCL_ONESHOT_MAPPED_MIN` bytes on (8 KiB by default; all_reduce, reduce_scatter,
//! all_gather), the call's first event is the agreement on shared buffers
//! ([`agree`](crate::direct::agree)): a rank whose input and output both lie in shared buffers
//! publishes where they lie, any other its input. The plan then says
//! ([`Slots`]): where every rank shared, the call runs single-copy instead (not here); where
//! none did, the slots hold every input and the fold reads them from that event; where some
//! did, every rank publishes its input in a second event and folds from those slots.

use crate::base::buffers::Buffers;
use crate::base::error::Result;
use crate::base::op::ReduceOp;
use crate::base::reduce;
use crate::direct::exec::DirectCtx;
use crate::direct::link::EventRecord;
use crate::plan::call_plan::Slots;
use crate::sched::{Coll, CollKind};

/// Runs `c` one-shot, its inputs brought into the slots as `slots` says: `agreed` is the
/// agreement's event for [`Slots::Agreed`] and [`Slots::Again`].
pub(crate) fn run(
    cx: &mut DirectCtx<'_>,
    c: &Coll,
    bufs: &mut Buffers<'_>,
    slots: Slots,
    agreed: Option<u64>,
) -> Result<()> {
    debug_assert!(slots == Slots::Publish || agreed.is_some(), "{slots:?}");
    let (inp, in_len) = bufs.input_raw();
    // SAFETY: the buffers are valid for their lengths for the whole call (Buffers' contract);
    // the input is only read here, before anything is written to the output.
    let input = unsafe { std::slice::from_raw_parts(inp, in_len) };
    let e = match (slots, agreed) {
        (Slots::Agreed, Some(e)) => e,
        (Slots::Again, Some(_)) => {
            // Some ranks published their buffers, some their data: every rank publishes its
            // data.
            let e2 = cx.publish(input, &EventRecord::default());
            cx.wait_all(e2)?;
            e2
        }
        _ => {
            // A broadcast needs only the root's data: the others publish none (no copy).
            let publish = match c.kind {
                CollKind::Broadcast if c.rank != c.root => &input[..0],
                _ => input,
            };
            cx.begin(publish, EventRecord::default())?
        }
    };
    fold(cx, c, bufs, e)
}

/// Bytes of own data an in-place fold copies aside (on the stack) to read them from there
/// rather than from its own record (see [`Own`]).
const ASIDE: usize = 512;

/// Where a fold reads this rank's own published bytes from. Not from its own record or slot
/// where it can help it: those lines were written by this very call and may still wait in
/// the store buffer for the peer to give them up (it read them two calls ago), and a load
/// spanning several pending stores waits until they are written, about one cross-core
/// transfer (0.03 µs near, 0.1 far: most of what 40-160 bytes cost over 8, measured in
/// docs/decisions.md, "A `Release` publish").
enum Own<'a> {
    /// The caller's input, which does not overlap the output (it holds what was published).
    Input(&'a [u8]),
    /// Already where the output wants it (in place).
    InOutput,
    /// Only the record or slot has it.
    Slot,
}

/// Where this rank's published bytes `off..off + len` are, for a fold that writes them to
/// `at`, given its input `(inp, in_len)` and its whole output `(outp, out_len)`.
fn own_at<'a>(
    (inp, in_len): (*const u8, usize),
    (outp, out_len): (*const u8, usize),
    at: *const u8,
    off: usize,
    len: usize,
) -> Own<'a> {
    let (i, o) = (inp as usize, outp as usize);
    if i + off == at as usize {
        Own::InOutput
    } else if i + in_len <= o || o + out_len <= i {
        // SAFETY: the input is valid for `in_len >= off + len` bytes for the whole call
        // (Buffers' contract) and is not written during it: it does not overlap the output,
        // the only memory a fold writes.
        Own::Input(unsafe { std::slice::from_raw_parts(inp.add(off), len) })
    } else {
        Own::Slot
    }
}

/// Computes this rank's output of `c` from the data every rank published with event `e`,
/// reading this rank's own part from its input where possible ([`Own`]).
fn fold(cx: &mut DirectCtx<'_>, c: &Coll, bufs: &mut Buffers<'_>, e: u64) -> Result<()> {
    let (n, me, es) = (c.nranks, c.rank, c.dtype.size());
    let (outp, out_len) = bufs.output_raw();
    let (inp, in_len) = bufs.input_raw();
    // From here the input is no longer needed (it is in this rank's own slot), so writing the
    // output is fine even when it aliases the input.
    // SAFETY: valid for out_len bytes; no other reference to the output is live.
    let out = unsafe { std::slice::from_raw_parts_mut(outp, out_len) };
    let d = &*cx.direct;
    let slot = |p: usize, len: usize| d.peer_slot(p, e, len);
    let own = |off: usize, len: usize, at: *const u8| {
        own_at((inp, in_len), (outp, out_len), at, off, len)
    };
    let reduce_all = |out: &mut [u8], off: usize| {
        let len = out.len();
        let from = |p: usize| &slot(p, off + len)[off..];
        let mut aside = [0u64; ASIDE / 8];
        let mine: Option<&[u8]> = match own(off, len, out.as_ptr()) {
            Own::Input(b) => Some(b),
            // Already in the output, which is where a fold in rank order starts from.
            Own::InOutput if me == 0 => None,
            Own::InOutput if len <= ASIDE => {
                let a = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut aside)[..len];
                a.copy_from_slice(out);
                Some(&*a)
            }
            Own::InOutput | Own::Slot => Some(from(me)),
        };
        let data = |p: usize| {
            if p == me {
                mine.unwrap_or(&[])
            } else {
                from(p)
            }
        };
        if n == 1 {
            if let Some(m) = mine {
                out.copy_from_slice(m);
            }
        } else {
            if me == 0 && mine.is_none() {
                reduce::reduce_inplace(c.dtype, c.op, out, data(1));
            } else {
                reduce::reduce_into(c.dtype, c.op, out, data(0), data(1));
            }
            for p in 2..n {
                reduce::reduce_inplace(c.dtype, c.op, out, data(p));
            }
        }
        if c.op == ReduceOp::Avg {
            reduce::divide_by(c.dtype, out, n);
        }
    };
    let bytes = c.count * es;
    // A block of rank p's published bytes `off..off + bytes` into `dst`.
    let block = |dst: &mut [u8], p: usize, off: usize| {
        if p == me {
            match own(off, bytes, dst.as_ptr()) {
                Own::Input(b) => dst.copy_from_slice(b),
                Own::InOutput => {}
                Own::Slot => dst.copy_from_slice(&slot(p, off + bytes)[off..]),
            }
        } else {
            dst.copy_from_slice(&slot(p, off + bytes)[off..]);
        }
    };
    match c.kind {
        CollKind::AllReduce => reduce_all(out, 0),
        CollKind::Reduce if me == c.root => reduce_all(out, 0),
        CollKind::ReduceScatter => reduce_all(out, me * bytes),
        CollKind::Broadcast => block(out, c.root, 0),
        CollKind::AllGather => {
            for p in 0..n {
                block(&mut out[p * bytes..(p + 1) * bytes], p, 0);
            }
        }
        CollKind::AllToAll => {
            for p in 0..n {
                block(&mut out[p * bytes..(p + 1) * bytes], p, me * bytes);
            }
        }
        _ => {}
    }
    Ok(())
}
