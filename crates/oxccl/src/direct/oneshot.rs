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
//! all_gather), a rank whose input and output both lie in shared buffers (`Communicator::alloc_shared`, torch's shared-memory
//! allocator) publishes where they lie instead of copying its input into its slot (the first
//! event's record then holds its buffers; a rank that copied leaves the record empty), and
//! every rank reads from the first event who did what, so all decide alike:
//! - every rank shared: the call goes on as single-copy ([`cma`](crate::direct::cma)), each
//!   rank folding its block straight from the peers' mapped buffers into theirs: no copy into
//!   a slot, whose lines the peer still holds from its last read (2-4x faster at 8-32 KB);
//! - none: the slots hold every input, as above;
//! - some: every rank publishes its input in a second event and folds from those slots.

use crate::base::buffers::Buffers;
use crate::base::error::Result;
use crate::base::op::ReduceOp;
use crate::base::reduce;
use crate::direct::cma;
use crate::direct::exec::DirectCtx;
use crate::direct::link::EventRecord;
use crate::sched::{Algo, Coll, CollKind};

/// Runs `c` one-shot (or, where every rank's buffers are shared, single-copy: see the
/// module), and says which ran ([`Algo::OneShot`] or [`Algo::Cma`], alike on every rank).
/// `tmp` is single-copy's scratch, reused across calls.
pub(crate) fn run(
    cx: &mut DirectCtx<'_>,
    c: &Coll,
    bufs: &mut Buffers<'_>,
    tmp: &mut Vec<u64>,
) -> Result<Algo> {
    let (n, me) = (c.nranks, c.rank);
    let (inp, in_len) = bufs.input_raw();
    let (outp, out_len) = bufs.output_raw();
    // SAFETY: the buffers are valid for their lengths for the whole call (Buffers' contract);
    // the input is only read here, before anything is written to the output.
    let input = unsafe { std::slice::from_raw_parts(inp, in_len) };
    // Every rank decides this alike: the kind, the input's length and whether ranks can
    // reach each other's memory are the same on all.
    let may_map = n > 1
        && in_len >= cx.mapped_min
        && matches!(
            c.kind,
            CollKind::AllReduce | CollKind::ReduceScatter | CollKind::AllGather
        )
        && cx.direct.can_read_peers();
    if !may_map {
        // A broadcast needs only the root's data: the others publish none (no copy).
        let publish = match c.kind {
            CollKind::Broadcast if me != c.root => &input[..0],
            _ => input,
        };
        let e = cx.begin(publish, EventRecord::default())?;
        fold(cx, c, bufs, e)?;
        return Ok(Algo::OneShot);
    }
    let (regions, [in_shared, out_shared]) = cma::regions(bufs);
    let shared = in_shared && out_shared;
    let e = if shared {
        cx.begin(
            bytemuck::bytes_of(&regions),
            EventRecord::buffers(inp, in_len, outp, out_len),
        )?
    } else {
        cx.begin(input, EventRecord::default())?
    };
    let sharing = (0..n)
        .filter(|&p| {
            if p == me {
                shared
            } else {
                cx.direct.peer_record(p, e).input_len != 0
            }
        })
        .count();
    if sharing == n {
        cma::run_from(cx, c, bufs, tmp, e, regions)?;
        return Ok(Algo::Cma);
    }
    if sharing == 0 {
        fold(cx, c, bufs, e)?;
        return Ok(Algo::OneShot);
    }
    // Some ranks published their buffers, some their data: every rank publishes its data.
    let e2 = cx.publish(input, &EventRecord::default());
    cx.wait_all(e2)?;
    fold(cx, c, bufs, e2)?;
    Ok(Algo::OneShot)
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
